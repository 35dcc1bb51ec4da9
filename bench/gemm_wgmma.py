"""The Gluon NVFP4 GEMM (``impl="wgmma"``, fp4compile/kernels/gemm_wgmma.py) on the H200: checks, then GPU time
against cuBLAS BF16 and the current default lowering, all measured in the same process.

Checks (each must pass before any time is printed for the kernel):
  * exact decode: A = every code byte (256) x every finite E4M3 scale byte (127 rows), B = the identity in NVFP4
    (code 1.0, scale 1.0); the FP32 output must equal the reference dequantization bit for bit (this also proves
    that both operands see the same K permutation);
  * against a float64 reference (``bench.gemm.reference64``): FP32 output relative error < 1e-5 on every
    benchmarked shape (when it fits in memory) and on tail shapes (rows not a multiple of the tile, a single K-tile),
    for every config of ``WGMMA_CONFIGS``.

Timing: ``triton.testing.do_bench_cudagraph`` (GPU time, no launch cost), median, microseconds; ratio = cuBLAS
BF16 time / time. Columns: ``cuBLAS`` (torch.mm on the exact bf16 operands), ``dq_triton`` (dequantize both
operands, then the TMA GEMM), ``wgmma <cfg>`` per config, ``auto`` (the op as registered: since session 73 it runs
the mixed GEMM on the shapes ``kernels.gemm.mixed_wins`` names), and for the mixed configs ``kernel only <cfg>``
(without B's preparation), ``prepare_b`` (the fused pass) and ``prepare_b gather`` (dequantize, then a gather; the
benchmark also checks that both give the same bits). Sums per training step (12 layers x 12 linear GEMMs for
GPT-124M, 16 x 12 for ~1B).

    python bench/gemm_wgmma.py [--rep 20] [--only 124M,1B,square] [--kinds sp,ws,rs,mixed,diag,diag_rs,diag_mixed]
        [--match REGEX] [--json out.json] [--no-proxy-fence]

``--no-proxy-fence`` is a diagnostic: it turns off Triton's proxy-fence insertion pass for every kernel this process
compiles (into a fresh cache directory), which removes the ``fence.proxy.async`` Triton puts between a slot's
shared-memory reads and its next TMA write (CUTLASS's sm90 mixed-input mainloop has none there). The checks still run;
the times say what the fence costs, not a supported configuration.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import gemm as BG  # noqa: E402
from fp4compile.formats import nvfp4  # noqa: E402
from fp4compile.kernels import gemm as G  # noqa: E402
from fp4compile.kernels import gemm_wgmma as W  # noqa: E402


def _kind(c):
    """A config's family: ``sp`` (software-pipelined), ``ws`` (warp-specialized), ``rs`` (A in registers), ``mixed``
    (A in registers, B bf16 by TMA: timed with its B preparation, and without as ``kernel only``)."""
    return "ws" if c.get("WS") else "rs" if c.get("RS") else "mixed" if c.get("MIXED") else "sp"


def _cfg_name(c):
    return (f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']}w{c['num_warps']}"
            + (f" ws{c['DECODE_WARPS']}x2" if c.get("WS") else "") + (" rs" if c.get("RS") else "")
            + (" mixed" if c.get("MIXED") else "") + (" halves" if c.get("HALVES") else "")
            + (f" split b{c['B_STAGES']}" if c.get("SPLIT") else "") + (" atma" if c.get("A_TMA") else "")
            + (" nofence" if c.get("NO_PROXY_FENCE") else "")
            + (f" r{c['maxnreg']}" if c.get("maxnreg") else "")
            + ({0: "", 1: " NOLOAD NODEC", 2: " DEC OFFPATH", 3: " LOADS ONLY"} if c.get("MIXED") else
               {0: "", 1: " NODEQ", 2: " NOMMA", 3: " NOFENCE", 4: " NOB", 5: " NODEC"})[c.get("DIAG", 0)])


#: checked and timed
CHECKED = W.WGMMA_CONFIGS + W.WS_CONFIGS + W.RS_CONFIGS + W.MIXED_CONFIGS
#: timing-only diagnostics (results not valid): the default config without the decode ALU work (NODEQ: the code
#: words are stored as they are) and without the MMA (NOMMA)
DIAG = [dict(W.WGMMA_CONFIGS[0], DIAG=1), dict(W.WGMMA_CONFIGS[0], DIAG=2)]
#: the same for the first register-A config: no MMA (2), no generic -> async proxy fence (3), no B decode/store (4),
#: no decode at all (5: the wgmmas, the code staging and the synchronization only)
DIAG_RS = [dict(W.RS_CONFIGS[0], DIAG=d) for d in (2, 3, 4, 5)]
#: the mixed kernel's HALVES loop (the one-partition 128 x 256 tile and the SPLIT tile with A's global loads) timed as
#: "kernel only" without A's decode feeding the wgmmas: 1 with neither the decode nor A's code loads (the wgmmas, the B
#: ring and the synchronization only; the compiler drops the unused loads), 2 with both (the decode off the wgmmas'
#: path), 3 with the loads only
_HALVES_256 = next(c for c in W.MIXED_CONFIGS if c.get("HALVES") and not c.get("SPLIT") and c["BLOCK_M"] == 128
                   and c["BLOCK_N"] == 256)
DIAG_MIXED = [dict(c, DIAG=d) for c in (_HALVES_256, W.MIXED_SPLIT_LDG) for d in (1, 2, 3)]


def check_decode_exact(cfg) -> int:
    """Mismatches of the exhaustive decode check (see module docstring)."""
    dev = "cuda"
    K = 512
    a_codes = torch.arange(256, dtype=torch.uint8, device=dev).repeat(127, 1)           # [127, 256] -> K = 512
    a_scales = torch.arange(127, dtype=torch.uint8, device=dev)[:, None].expand(127, K // 16).contiguous()
    # B = identity: row n has code 1.0 (0x2) at element n, 0 elsewhere; scale 1.0 (E4M3 0x38)
    b = torch.zeros(K, K, dtype=torch.uint8, device=dev)
    idx = torch.arange(K, device=dev)
    b[idx, idx] = 2
    b_codes = (b[:, 0::2] | (b[:, 1::2] << 4)).contiguous()
    b_scales = torch.full((K, K // 16), 0x38, dtype=torch.uint8, device=dev)
    one = torch.ones((), device=dev)
    got = W.nvfp4_gemm_wgmma(a_codes, a_scales, one, b_codes, b_scales, one, torch.float32, config=cfg)
    ref = nvfp4.dequantize_codes(a_codes, a_scales.view(torch.float8_e4m3fn), one)
    return int((got != ref).sum().item())


def check_shape(M, N, K, cfg, seed=1) -> float:
    args = BG.make_operands(M, N, K, seed=seed)
    out = W.nvfp4_gemm_wgmma(*args, torch.float32, config=cfg)
    return BG.rel_err(out, BG.reference64(args))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rep", type=int, default=20)
    ap.add_argument("--only", default="124M,1B,square")
    ap.add_argument("--json", default=None)
    ap.add_argument("--kinds", default="sp,ws,rs,mixed,diag",
                    help="config families to check and time: sp, ws, rs, mixed (see _kind); diag, diag_rs, "
                         "diag_mixed: the diagnostics")
    ap.add_argument("--match", default=None,
                    help="keep only the configs whose name (as printed) matches this regular expression")
    ap.add_argument("--no-proxy-fence", action="store_true",
                    help="diagnostic: compile every kernel without Triton's proxy-fence insertion pass")
    args = ap.parse_args(argv)
    if not args.no_proxy_fence:
        return _run(args)
    # every kernel of this process compiled without the pass, into a fresh cache (its keys do not see the pass)
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-nofence-")
    print("diagnostic: Triton's proxy-fence insertion pass is off", flush=True)
    with W._without_proxy_fences():
        return _run(args)


def _run(args):
    kinds = set(args.kinds.split(","))
    checked = [c for c in CHECKED if _kind(c) in kinds and (args.match is None or re.search(args.match, _cfg_name(c)))]
    diag = (DIAG if "diag" in kinds else []) + (DIAG_RS if "diag_rs" in kinds else [])
    BG.CUDAGRAPH = True
    dev = torch.cuda.get_device_name()
    print(f"device: {dev}; torch {torch.__version__}; triton {BG.triton.__version__}; "
          f"do_bench_cudagraph rep={args.rep} ms, median, us; ratio = cuBLAS BF16 / time", flush=True)
    ok = True
    for cfg in checked:
        bad = check_decode_exact(cfg)
        print(f"decode check {_cfg_name(cfg)}: {bad} mismatches", flush=True)
        ok &= bad == 0
        for M, N, K in [(300, 200, 832), (1000, 1000, 64), (129, 257, 4096), (16384, 768, 768)]:
            e = check_shape(M, N, K, cfg)
            print(f"  {M}x{N}x{K} fp32 rel err {e:.2e}", flush=True)
            ok &= e < 1e-5
    print("checks:", "PASS" if ok else "FAIL", flush=True)

    shapes = []
    only = tuple(args.only.split(","))
    for tag, d in (("124M", 768), ("1B", 2048)):
        if tag in only:
            shapes += [(f"{tag} {n}", m, nn, k) for n, m, nn, k in BG.linear_shapes(d)]
    if "square" in only:
        shapes += [("square", 4096, 4096, 4096), ("square", 8192, 8192, 8192)]
    mixed = [c for c in checked if c.get("MIXED")] + (DIAG_MIXED if "diag_mixed" in kinds else [])
    cols = (["cuBLAS", "dq_triton"] + [f"wgmma {_cfg_name(c)}" for c in checked] + ["auto"]
            + [f"diag {_cfg_name(c)}" for c in diag] + [f"kernel only {_cfg_name(c)}" for c in mixed]
            + (["prepare_b", "prepare_b gather"] if mixed else []))
    assert len(set(cols)) == len(cols), cols
    print("| shape | M | N | K | " + " | ".join(cols) + " | best wgmma / cuBLAS | dq_triton / cuBLAS |", flush=True)
    print("|" + "---|" * (len(cols) + 6), flush=True)
    rows = []
    t0 = time.time()
    for name, M, N, K in shapes:
        ops = BG.make_operands(M, N, K)
        a16 = G.dequantize_bf16(ops[0], ops[1])
        b16 = G.dequantize_bf16(ops[3], ops[4])
        ref = BG.reference64(ops) if M * N * K <= 2 ** 36 else None

        def us(fn):
            try:
                return 1e3 * BG.bench_ms(fn, args.rep)
            except Exception as e:  # noqa: BLE001
                print(f"  ERROR {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                return float("nan")

        t = {"cuBLAS": us(lambda: torch.mm(a16, b16.t())),
             "dq_triton": us(lambda: G.nvfp4_gemm(*ops, impl="dq_triton"))}
        for c in checked:
            key = f"wgmma {_cfg_name(c)}"
            if ref is not None:
                e = BG.rel_err(W.nvfp4_gemm_wgmma(*ops, torch.float32, config=c), ref)
                if not e < 1e-5:
                    print(f"  WRONG {name} {key}: fp32 rel err {e:.2e}", flush=True)
                    ok = False
            t[key] = us(lambda c=c: W.nvfp4_gemm_wgmma(*ops, config=c))
        t["auto"] = us(lambda: torch.ops.fp4compile.gemm(*ops))
        for c in diag:
            t[f"diag {_cfg_name(c)}"] = us(lambda c=c: W.nvfp4_gemm_wgmma(*ops, config=c))
        if mixed:   # the mixed GEMM without its B preparation (a weight's would be made once per step), and that alone;
            # with the diag_mixed configs (results not checked)
            b16p = W.prepare_b(ops[3], ops[4])
            if not torch.equal(b16p, W.prepare_b(ops[3], ops[4], fused=False)):
                print(f"  WRONG {name}: prepare_b's fused pass differs from dequantize + gather", flush=True)
                ok = False
            for c in mixed:
                t[f"kernel only {_cfg_name(c)}"] = us(
                    lambda c=c: W.nvfp4_gemm_mixed(ops[0], ops[1], ops[2], b16p, ops[5], config=c))
            t["prepare_b"] = us(lambda: W.prepare_b(ops[3], ops[4]))
            t["prepare_b gather"] = us(lambda: W.prepare_b(ops[3], ops[4], fused=False))
        best = min(t[k] for k in t if k.startswith("wgmma"))
        line = (f"| {name} | {M} | {N} | {K} | " + " | ".join(f"{t[c]:.0f}" for c in cols)
                + f" | {t['cuBLAS'] / best:.2f} | {t['cuBLAS'] / t['dq_triton']:.2f} |")
        print(line, f"[{time.time() - t0:.0f}s]", flush=True)
        rows.append(dict(name=name, M=M, N=N, K=K, us=t))
        del ops, a16, b16
    by = {(r["M"], r["N"], r["K"]): r for r in rows}
    for tag, d, nl in (("124M", 768, 12), ("1B", 2048, 16)):
        full = [(m, n, k) for _, m, n, k in BG._all_linear(d)]
        if not all(s in by for s in full):
            continue
        tot = {c: nl * sum(by[s]["us"][c] for s in full) / 1e3 for c in cols}
        bestw = nl * sum(min(v for k, v in by[s]["us"].items() if k.startswith("wgmma")) for s in full) / 1e3
        print(f"{tag} step ({nl} layers x 12 linear GEMMs), ms: " + ", ".join(f"{c} {v:.2f}" for c, v in tot.items())
              + f", best wgmma per shape {bestw:.2f}; ratios to cuBLAS: "
              f"dq_triton {tot['cuBLAS'] / tot['dq_triton']:.3f}, best wgmma {tot['cuBLAS'] / bestw:.3f}, auto {tot['cuBLAS'] / tot['auto']:.3f}", flush=True)
    print("checks (incl. benchmarked shapes):", "PASS" if ok else "FAIL", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=dev, rows=rows, ok=ok), f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
