"""Benchmark of ``fp4compile::gemm`` (NVFP4 x NVFP4 -> bf16) against cuBLAS BF16 (``torch.mm``), same run.

Usage (on the H200)::

    python bench/gemm.py                 # the table of docs/BENCHMARKS.md (## GEMM)
    python bench/gemm.py --explore       # correctness checks + tile/dequant-path sweep (development)
    python bench/gemm.py --quick         # fewer shapes
    python bench/gemm.py --lower         # candidate sm_90 lowerings per shape vs cuBLAS BF16 (lowering_table)
    python bench/gemm.py --tma-configs   # every TMA GEMM tile vs the autotuner's pick and cuBLAS (124M fprop/dgrad)

Per shape: TFLOP/s (2*M*N*K / time) of the "half" kernel (autotuned; its time includes the bf16
pre-dequantization of the operand with fewer rows), of the "full" kernel (both operands dequantized in
registers, autotuned), of the "dequantize both to bf16 with one Triton pass each, then cuBLAS (fp32 out), then
scale" baseline, of ``torch.ops.fp4compile.gemm`` as registered (default impl "auto": one of the three, by
``choose_impl``), and of cuBLAS BF16 ``torch.mm`` on bf16 operands of the same shape; op / cuBLAS and
best-of-three / cuBLAS. Times: ``triton.testing.do_bench``
(median, L2 flushed between calls), short rep times.

Shapes: M,N,K in {4096, 8192}; the linear-layer GEMMs of one training step at 16x1024 tokens of GPT-124M
(d=768, MLP 4d) and a ~1B GPT (d=2048, MLP 4d, 16 layers): per layer qkv, attn-out, fc1, fc2, each as fprop
(M=tokens, N=out, K=in), dgrad (M=tokens, N=in, K=out) and wgrad (M=out, N=in, K=tokens); duplicates
removed. The LM head (vocab 50304) is excluded (the presets keep it in BF16); memory-bound shapes M <= 256.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from fp4compile.formats import nvfp4  # noqa: E402
from fp4compile.kernels import gemm as G  # noqa: E402
from fp4compile.ops import _gemm_reference  # noqa: E402
from bench.timing import host_us  # noqa: E402

TOKENS = 16 * 1024
VARIANT_SHAPES = [("square", 8192, 8192, 8192), ("124M fc1.fprop", TOKENS, 3072, 768),
                  ("1B fc1.dgrad", TOKENS, 2048, 8192)]


def linear_shapes(d, tokens=TOKENS):
    """(name, M, N, K) for fprop/dgrad/wgrad of qkv, attn-out, fc1, fc2 of a GPT block of width d."""
    out = []
    for layer, (fin, fout) in {"qkv": (d, 3 * d), "proj": (d, d), "fc1": (d, 4 * d), "fc2": (4 * d, d)}.items():
        out.append((f"{layer}.fprop", tokens, fout, fin))
        out.append((f"{layer}.dgrad", tokens, fin, fout))
        out.append((f"{layer}.wgrad", fout, fin, tokens))
    seen, uniq = set(), []
    for name, m, n, k in out:
        if (m, n, k) not in seen:
            seen.add((m, n, k))
            uniq.append((name, m, n, k))
    return uniq


def all_shapes(quick=False):
    shapes = []
    sq = [(4096, 4096, 4096), (8192, 8192, 8192)] if quick else \
        [(m, n, k) for m in (4096, 8192) for n in (4096, 8192) for k in (4096, 8192)]
    shapes += [("square", *s) for s in sq]
    for tag, d in (("124M", 768), ("1B", 2048)):
        sh = linear_shapes(d)
        if quick:
            sh = sh[:3]
        shapes += [(f"{tag} {name}", m, n, k) for name, m, n, k in sh]
    mem = [(16, 4096, 4096), (64, 8192, 8192), (256, 8192, 8192)] if quick else \
        [(m, nk, nk) for m in (16, 64, 256) for nk in (4096, 8192)]
    shapes += [("M<=256", *s) for s in mem]
    return shapes


def make_operands(M, N, K, device="cuda", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(M, K, device=device, generator=g)
    b = torch.randn(N, K, device=device, generator=g)
    qa = nvfp4.quantize(a, check=False)
    qb = nvfp4.quantize(b, check=False)
    return (qa.codes, qa.scales.view(torch.uint8), qa.global_scale,
            qb.codes, qb.scales.view(torch.uint8), qb.global_scale)


def tflops(M, N, K, ms):
    return 2.0 * M * N * K / (ms * 1e-3) / 1e12


CUDAGRAPH = False   # --cudagraph: GPU time only (do_bench_cudagraph), no Python launch overhead


def bench_ms(fn, rep, cudagraph=None):
    """Median ms of ``fn``: CUDA-graph replays (GPU time) when ``cudagraph`` (default: ``--cudagraph``), else
    ``do_bench`` (L2 flushed before every call, launch included)."""
    if cudagraph is None:
        cudagraph = CUDAGRAPH
    if cudagraph:
        from triton.testing import do_bench_cudagraph
        return do_bench_cudagraph(fn, rep=rep, return_mode="median")
    return do_bench(fn, warmup=max(5, rep // 5), rep=rep, return_mode="median")


def safe_tflops(M, N, K, fn, rep):
    """TFLOP/s of fn, or NaN (with the error printed) if it fails: one bad variant must not lose the table."""
    try:
        return tflops(M, N, K, bench_ms(fn, rep))
    except Exception as e:  # noqa: BLE001
        print(f"  ERROR {M}x{N}x{K}: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return float("nan")


def reference64(args):
    one = torch.ones((), device=args[0].device)
    a = nvfp4.dequantize_codes(args[0], args[1].view(torch.float8_e4m3fn), one).double()
    b = nvfp4.dequantize_codes(args[3], args[4].view(torch.float8_e4m3fn), one).double()
    return (a @ b.t()) * (args[2].double() * args[5].double())


def rel_err(x, ref):
    return ((x.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


# ---------------------------------------------------------------------------------------------- checks
def check_decode(dequant):
    """Every code byte x every E4M3 scale byte (NaN excluded): the kernel's decode equals the reference."""
    codes = torch.arange(256, dtype=torch.uint8, device="cuda").repeat(127, 1)[:, :256]  # [127, 256] -> K=512
    scales = torch.arange(127, dtype=torch.uint8, device="cuda")[:, None].expand(127, 32).contiguous()
    got = G.dequantize_bf16(codes, scales, dequant=dequant).float()
    one = torch.ones((), device="cuda")
    ref = nvfp4.dequantize_codes(codes, scales.view(torch.float8_e4m3fn), one)
    return int((got != ref).sum().item())


def explore(out_dir):
    log = open(os.path.join(out_dir, "explore.log"), "w") if out_dir else None

    def p(*a):
        s = " ".join(str(x) for x in a)
        print(s, flush=True)
        if log:
            log.write(s + "\n")
            log.flush()

    t0 = time.time()
    p("device:", torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    for dq in ("asm", "fp32"):
        try:
            p(f"decode mismatches ({dq}):", check_decode(dq))
        except Exception as e:  # noqa: BLE001
            p(f"decode FAILED ({dq}): {type(e).__name__}: {str(e)[:400]}")
    cfg_small = G._cfg(128, 128, 64, 8, 3)
    for dq in ("asm", "fp32"):
        for (M, N, K) in [(1000, 520, 784), (129, 257, 48), (64, 64, 16), (300, 200, 4096)]:
            args = make_operands(M, N, K)
            ref = reference64(args)
            try:
                o32 = G.nvfp4_gemm(*args, out_dtype=torch.float32, config=cfg_small, dequant=dq, impl="full")
                o16 = G.nvfp4_gemm(*args, out_dtype=torch.bfloat16, config=cfg_small, dequant=dq, impl="full")
                p(f"{dq} {M}x{N}x{K}: fp32 rel {rel_err(o32, ref):.2e}  bf16 rel {rel_err(o16, ref):.2e}")
            except Exception as e:  # noqa: BLE001
                p(f"{dq} {M}x{N}x{K}: FAILED {type(e).__name__}: {str(e)[:400]}")
    # SASS: is wgmma (HGMMA) emitted?
    args = make_operands(512, 512, 512)
    for dq in ("asm", "fp32"):
        try:
            out = torch.empty(512, 512, device="cuda", dtype=torch.bfloat16)
            k = G._nvfp4_gemm_kernel[(16,)](*args, out, 512, 512, 512, 256, 32, 256, 32, 512,
                                            BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, EVEN_K=True,
                                            DEQUANT_ASM=dq == "asm", OUT_FP32=False, num_warps=8, num_stages=3)
            sass = k.asm.get("sass", "")
            ttgir = k.asm.get("ttgir", "")
            p(f"{dq}: HGMMA in SASS: {sass.count('HGMMA')}, wgmma in ttgir: {ttgir.count('warp_group_dot')}, "
              f"local_alloc: {ttgir.count('local_alloc')}, regs {k.n_regs}, spills {k.n_spills}, "
              f"smem {k.metadata.shared}")
            if out_dir:
                with open(os.path.join(out_dir, f"kernel_{dq}.ttgir"), "w") as f:
                    f.write(ttgir)
                with open(os.path.join(out_dir, f"kernel_{dq}.sass"), "w") as f:
                    f.write(sass)
        except Exception as e:  # noqa: BLE001
            p(f"{dq}: SASS check FAILED {type(e).__name__}: {str(e)[:300]}")
    p(f"[{time.time() - t0:.0f}s] sweep")
    configs = [G._cfg(128, 128, 64, 8, 3), G._cfg(128, 128, 128, 8, 3), G._cfg(128, 256, 64, 8, 3),
               G._cfg(128, 256, 128, 8, 3), G._cfg(64, 256, 128, 4, 4), G._cfg(128, 128, 64, 4, 4),
               G._cfg(256, 128, 64, 8, 3)]
    for (M, N, K) in [(8192, 8192, 8192), (16384, 3072, 768), (16384, 2048, 8192)]:
        args = make_operands(M, N, K)
        a16 = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b16 = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        cub = bench_ms(lambda: torch.mm(a16, b16.t()), 50)
        try:
            base = tflops(M, N, K, bench_ms(lambda: G.gemm_dequant_cublas(*args), 50))
        except Exception as e:  # noqa: BLE001
            p(f"baseline FAILED {type(e).__name__}: {str(e)[:300]}")
            base = float("nan")
        p(f"{M}x{N}x{K}: cuBLAS {tflops(M, N, K, cub):.0f} TF/s; dequant+cuBLAS {base:.0f}")
        for dq in ("asm", "fp32"):
            for c in configs:
                if dq == "fp32" and c not in configs[:3]:
                    continue
                try:
                    ms = bench_ms(lambda: G.nvfp4_gemm(*args, config=c, dequant=dq, impl="full"), 40)
                    p(f"   {dq} {c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} w{c['num_warps']} s{c['num_stages']}: "
                      f"{tflops(M, N, K, ms):.0f} TF/s ({tflops(M, N, K, ms) / tflops(M, N, K, cub):.2f}x)")
                except Exception as e:  # noqa: BLE001
                    p(f"   {dq} {c}: FAILED {type(e).__name__}: {str(e)[:200]}")
        p(f"[{time.time() - t0:.0f}s]")
    # autotuned path of the registered op
    args = make_operands(4096, 4096, 4096)
    o = G.nvfp4_gemm(*args, impl="full")
    p("op (autotuned) rel err bf16:", f"{rel_err(o, reference64(args)):.2e}",
      "best:", getattr(G._get_tuned_kernel("full"), "best_config", None), f"[{time.time() - t0:.0f}s]")


# ---------------------------------------------------------------------------------------------- table
def _cfg_str(kern):
    c = getattr(kern, "best_config", None)
    if c is None:
        return "-"
    k = c.kwargs
    pf = " pf" if k.get("PREFETCH_S") else ""
    return f"{k['BLOCK_M']}x{k['BLOCK_N']}x{k['BLOCK_K']} w{c.num_warps} s{c.num_stages}{pf}"


def table(quick, out_dir, rep, budget_s):
    """One row per shape: the op (default impl, autotuned), the "full" kernel (autotuned), the
    dequantize+cuBLAS baseline and cuBLAS BF16, all measured in this process."""
    dev = torch.cuda.get_device_name()
    head = (f"device: {dev}; torch {torch.__version__}; triton {triton.__version__}; op impl: {G.DEFAULT_IMPL}; "
            f"dequant path: {G.DEFAULT_DEQUANT}; do_bench rep={rep} ms (median)")
    print(head, flush=True)
    hdr = ("| shape | M | N | K | half TF/s | full TF/s | dq+cuBLAS TF/s | op (auto) TF/s | cuBLAS bf16 TF/s "
           "| op/cuBLAS | best/cuBLAS | auto picks | half tile |")
    lines = [head, "", hdr, "|" + "|".join("---" for _ in range(13)) + "|"]
    outf = open(os.path.join(out_dir, "gemm_table.md"), "w") if out_dir else None
    if outf:
        outf.write("\n".join(lines) + "\n")
        outf.flush()
    t0 = time.time()
    for name, M, N, K in all_shapes(quick):
        if time.time() - t0 > budget_s:
            print(f"(time budget of {budget_s}s reached: remaining shapes not measured)", flush=True)
            lines.append(f"| (budget reached before {name} {M}x{N}x{K}) |")
            break
        args = make_operands(M, N, K)
        a16 = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b16 = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        half = safe_tflops(M, N, K, lambda: G.nvfp4_gemm(*args, impl="half"), rep)
        cfg = _cfg_str(G._get_tuned_kernel("half"))
        full = safe_tflops(M, N, K, lambda: G.nvfp4_gemm(*args, impl="full"), rep)
        base = safe_tflops(M, N, K, lambda: G.gemm_dequant_cublas(*args), rep)
        ours = safe_tflops(M, N, K, lambda: torch.ops.fp4compile.gemm(*args), rep)
        cub = safe_tflops(M, N, K, lambda: torch.mm(a16, b16.t()), rep)
        best = max((v for v in (half, full, base) if v == v), default=float("nan"))
        pick = G.choose_impl(M, N, K) if G.DEFAULT_IMPL == "auto" else G.DEFAULT_IMPL
        line = (f"| {name} | {M} | {N} | {K} | {half:.0f} | {full:.0f} | {base:.0f} | {ours:.0f} | {cub:.0f} "
                f"| {ours / cub:.2f} | {best / cub:.2f} | {pick} | {cfg} |")
        lines.append(line)
        if outf:
            outf.write(line + "\n")
            outf.flush()
        print(line, f"[{time.time() - t0:.0f}s]", flush=True)
        del args, a16, b16
    # the register-operand variant, on a few shapes, while time remains
    var = ["", "| variant half_rega (NVFP4 operand = wgmma register operand) | M | N | K | TF/s | cuBLAS TF/s "
           "| ratio |",
           "|---|---|---|---|---|---|---|"]
    for name, M, N, K in VARIANT_SHAPES:
        if time.time() - t0 > budget_s:
            break
        args = make_operands(M, N, K)
        a16 = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b16 = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        v = safe_tflops(M, N, K, lambda: G.nvfp4_gemm(*args, impl="half_rega"), rep)
        cub = safe_tflops(M, N, K, lambda: torch.mm(a16, b16.t()), rep)
        var.append(f"| {name} | {M} | {N} | {K} | {v:.0f} | {cub:.0f} | {v / cub:.2f} |")
        print(var[-1], flush=True)
    if len(var) > 3:
        lines += var
        if outf:
            outf.write("\n".join(var) + "\n")
            outf.flush()
    print("\n" + "\n".join(lines), flush=True)


# ---------------------------------------------------------------------------------------------- lowering
def lowering_shapes():
    """124M and 1B linear shapes, then the 4096^3 / 8192^3 squares."""
    out = []
    for tag, d in (("124M", 768), ("1B", 2048)):
        out += [(f"{tag} {name}", m, n, k) for name, m, n, k in linear_shapes(d)]
    out += [("square", 4096, 4096, 4096), ("square", 8192, 8192, 8192)]
    return out


def lowering_table(out_dir, rep, budget_s, device="cuda", only=()):
    """Per shape, the candidate sm_90 lowerings of one NVFP4 linear GEMM against cuBLAS BF16 (same run).

    Columns (microseconds, median of do_bench; ratio = cuBLAS BF16 time / time):
      cuBLAS      torch.mm on bf16 operands, bf16 out (the BF16 training step's GEMM)
      cuBLAS f32  torch.mm(out_dtype=float32) on bf16 operands (the GEMM of the "dequantize + cuBLAS" lowering)
      dq x2       the two exact bf16 dequantization passes (dequantize_bf16 of A and of B)
      dq+cuBLAS   dequant_cublas: dq x2 + cuBLAS f32 + scale + cast as separate launches (standalone worst
                  case of lowering (a): in a graph, the scale/cast fuse into the consumer, leaving
                  dq x2 + cuBLAS f32 + the consumer reading 4 instead of 2 bytes per output element)
      (a) est     dq x2 + cuBLAS f32 + (4-2) bytes/element extra read at the measured copy bandwidth
      tma         the persistent TMA bf16 GEMM with the scaled epilogue, on pre-dequantized operands (autotuned)
      tma flat/ws 128x256x64 w8 s3 with the persistent loop flattened / flattened + warp-specialized
                  (124M and square shapes only)
      dq_triton   dq x2 + tma (the op, impl="dq_triton")
      dq_splitk   dq x2 + split-K TMA GEMM (impl="dq_splitk", automatic split count)
      full        both operands dequantized in registers (impl="full")
      op          torch.ops.fp4compile.gemm as registered (impl="auto": choose_impl's pick)
    """
    dev = torch.cuda.get_device_name()
    head = (f"device: {dev}; torch {torch.__version__}; triton {triton.__version__}; op impl: {G.DEFAULT_IMPL}; "
            f"{'do_bench_cudagraph (GPU time only)' if CUDAGRAPH else 'do_bench (incl. launch overhead)'} "
            f"rep={rep} ms (median), times in us, ratio = cuBLAS BF16 time / time")
    print(head, flush=True)
    # copy bandwidth (for the fused-epilogue estimate of lowering (a))
    x = torch.empty(1 << (28 if device == "cuda" else 20), dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    ms = bench_ms(lambda: y.copy_(x), rep)
    bw = 2 * x.numel() / (ms * 1e-3)
    print(f"device-to-device copy: {bw / 1e12:.2f} TB/s (read+write bytes / time)", flush=True)
    del x, y
    cols = ["cuBLAS", "cuBLAS f32", "dq x2", "dq+cuBLAS", "(a) est", "tma", "tma flat", "tma ws", "dq_triton",
            "dq_splitk", "full", "op"]
    hdr = "| shape | M | N | K | " + " | ".join(cols) + " | op/cuBLAS | best lowering | best/cuBLAS | auto picks | split |"
    lines = [head, f"copy bandwidth {bw / 1e12:.2f} TB/s", "", hdr, "|" + "---|" * (len(cols) + 9)]
    outf = open(os.path.join(out_dir, "lowering_table.md"), "a") if out_dir else None
    if outf:
        outf.write("\n".join(lines) + "\n")
        outf.flush()
    t0 = time.time()
    results = []
    for name, M, N, K in lowering_shapes():
        if only and not name.startswith(only):
            continue
        if time.time() - t0 > budget_s:
            print(f"(time budget of {budget_s}s reached: remaining shapes not measured)", flush=True)
            lines.append(f"| (budget reached before {name} {M}x{N}x{K}) |")
            break
        args = make_operands(M, N, K, device=device)
        a16 = G.dequantize_bf16(args[0], args[1])
        b16 = G.dequantize_bf16(args[3], args[4])
        ref = reference64(args) if M * N * K <= 2 ** 36 else None

        def us(fn):
            try:
                return 1e3 * bench_ms(fn, rep)
            except Exception as e:  # noqa: BLE001
                print(f"  ERROR {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                return float("nan")

        t = {}
        t["cuBLAS"] = us(lambda: torch.mm(a16, b16.t()))
        t["cuBLAS f32"] = us(lambda: torch.mm(a16, b16.t(), out_dtype=torch.float32))
        t["dq x2"] = us(lambda: (G.dequantize_bf16(args[0], args[1]), G.dequantize_bf16(args[3], args[4])))
        t["dq+cuBLAS"] = us(lambda: G.gemm_dequant_cublas(*args))
        t["(a) est"] = t["dq x2"] + t["cuBLAS f32"] + 1e6 * (2 * M * N) / bw
        t["tma"] = us(lambda: G.bf16_gemm_scaled(a16, b16, args[2], args[5]))
        if name.startswith("124M") or name.startswith("square"):   # experimental persistent-loop variants
            vc = G._cfg(128, 256, 64, 8, 3, EPI_SUBTILE=True)
            t["tma flat"] = us(lambda: G.bf16_gemm_scaled(a16, b16, args[2], args[5], config=vc, flatten=True))
            t["tma ws"] = us(lambda: G.bf16_gemm_scaled(a16, b16, args[2], args[5], config=vc, flatten=True,
                                                        warp_specialize=True))
        else:
            t["tma flat"] = t["tma ws"] = float("nan")
        t["dq_triton"] = us(lambda: G.nvfp4_gemm(*args, impl="dq_triton"))
        t["dq_splitk"] = us(lambda: G.nvfp4_gemm(*args, impl="dq_splitk"))
        t["full"] = us(lambda: G.nvfp4_gemm(*args, impl="full"))
        t["op"] = us(lambda: torch.ops.fp4compile.gemm(*args))
        if ref is not None:  # the measured candidates are exact up to FP32 accumulation order
            for impl in ("dq_triton", "dq_splitk"):
                o = G.nvfp4_gemm(*args, impl=impl, out_dtype=torch.float32)
                e = rel_err(o, ref)
                if not e < 1e-5:
                    print(f"  WRONG {name} {impl}: fp32 rel err {e:.2e}", flush=True)
        cand = {k: t[k] for k in ("dq+cuBLAS", "(a) est", "dq_triton", "dq_splitk", "full")}
        best = min(cand, key=lambda k: cand[k] if cand[k] == cand[k] else float("inf"))
        pick = G.choose_impl(M, N, K)
        line = (f"| {name} | {M} | {N} | {K} | " + " | ".join(f"{t[c]:.0f}" for c in cols)
                + f" | {t['cuBLAS'] / t['op']:.2f} | {best} | {t['cuBLAS'] / cand[best]:.2f} | {pick} "
                f"| {G.splitk_factor(M, N, K)} |")
        lines.append(line)
        results.append(dict(name=name, M=M, N=N, K=K, us=t, pick=pick, best=best))
        if outf:
            outf.write(line + "\n")
            outf.flush()
        print(line, f"[{time.time() - t0:.0f}s]", flush=True)
        del args, a16, b16
    tuned = getattr(G._tuned.get("tma"), "cache", {})
    print("tma autotuned configs:", {k[:3]: str(v) for k, v in tuned.items()}, flush=True)
    # per training step (one layer's 12 GEMMs x n_layer): sum of times per column, 124M and 1B
    for tag, nl in (("124M", 12), ("1B", 16)):
        d = 768 if tag == "124M" else 2048
        full = [(m, n, k) for name, m, n, k in _all_linear(d)]
        by = {(r["M"], r["N"], r["K"]): r for r in results}
        if not all(s in by for s in full):
            continue
        tot = {c: nl * sum(by[s]["us"][c] for s in full) / 1e3 for c in cols if "tma " not in c}
        cand = ("dq+cuBLAS", "(a) est", "dq_triton", "dq_splitk", "full")
        best = nl * sum(min((v for k, v in by[s]["us"].items() if k in cand and v == v), default=float("nan"))
                        for s in full) / 1e3
        msg = (f"{tag} step, {nl} layers x 12 linear GEMMs, ms: " + ", ".join(f"{c} {v:.2f}" for c, v in tot.items())
               + f", best-per-shape {best:.2f}; op/cuBLAS {tot['cuBLAS'] / tot['op']:.3f}")
        print(msg, flush=True)
        lines.append(msg)
    if outf:
        outf.write("\n".join(lines[-2:]) + "\n")
    return results


def host_overhead(n=200):
    """Host (CPU) microseconds per call of each implementation: ``n`` calls queued without synchronizing
    (the GPU queue does not fill at this count), i.e. what the Python/launch side costs per GEMM; plus the
    GPU time of one call for reference."""
    print("host us/call (n=%d, queued, no sync) | GPU us/call (CUDA graph)" % n, flush=True)
    for name, M, N, K in [("124M qkv.fprop", TOKENS, 2304, 768), ("124M fc1.wgrad", 3072, 768, TOKENS),
                          ("1B fc1.fprop", TOKENS, 8192, 2048)]:
        args = make_operands(M, N, K)
        a16, b16 = G.dequantize_pair_bf16(args[0], args[1], args[3], args[4])
        fns = {"cuBLAS": lambda: torch.mm(a16, b16.t())}
        for impl in ("full", "dequant_cublas", "dq_triton", "dq_splitk"):
            fns[impl] = (lambda i: lambda: G.nvfp4_gemm(*args, impl=i))(impl)
        row = []
        for k, fn in fns.items():
            try:
                host = host_us(fn, n, warmup=3)
                from triton.testing import do_bench_cudagraph
                gpu = 1e3 * do_bench_cudagraph(fn, rep=10, return_mode="median")
                row.append(f"{k} {host:.0f} | {gpu:.0f}")
            except Exception as e:  # noqa: BLE001
                row.append(f"{k} ERROR {type(e).__name__}: {str(e)[:120]}")
        print(f"{name} {M}x{N}x{K}: " + "; ".join(row), flush=True)

def _all_linear(d, tokens=TOKENS):
    """All 12 (not deduplicated) linear GEMMs of one block."""
    out = []
    for layer, (fin, fout) in {"qkv": (d, 3 * d), "proj": (d, d), "fc1": (d, 4 * d), "fc2": (4 * d, d)}.items():
        out += [(f"{layer}.fprop", tokens, fout, fin), (f"{layer}.dgrad", tokens, fin, fout),
                (f"{layer}.wgrad", fout, fin, tokens)]
    return out


def tile_name(c: dict, flatten: bool = False) -> str:
    """A TMA GEMM tile as ``BMxBNxBK wW sS`` (+ `` sub`` with the split epilogue, `` flat`` flattened)."""
    return (f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} w{c.get('num_warps', 4)} s{c.get('num_stages', 3)}"
            + (" sub" if c.get("EPI_SUBTILE") else "") + (" flat" if flatten or c.get("FLATTEN") else ""))


def tma_candidates() -> list:
    """(name, config) of every :data:`TMA_CONFIGS` tile as listed and with its persistent loop flattened (once per
    tile: the listed flattened entry is its plain twin flattened)."""
    out, seen = [], set()
    for c in G.TMA_CONFIGS:
        for flat in (bool(c.get("FLATTEN")), True):
            cfg = dict(c, FLATTEN=flat)
            name = tile_name(cfg)
            if name not in seen:
                seen.add(name)
                out.append((name, cfg))
    return out


def _us_graph(fn, rep):
    """µs of ``fn`` as GPU time of CUDA-graph replays."""
    return 1e3 * bench_ms(fn, rep, cudagraph=True)


def _us_flushed(fn, rep):
    """µs of ``fn`` about as the TMA GEMM's autotuner times it (``do_bench``: L2 flushed before every call)."""
    return 1e3 * bench_ms(fn, max(20, rep), cudagraph=False)


def tma_configs_table(rep, only=(), device="cuda"):
    """Whether the TMA GEMM's autotuner picks its fastest tile (issue 3). On the 124M step's fprop and dgrad shapes
    (the ones ``auto`` runs as ``dq_triton``): every tile of :func:`tma_candidates` timed explicitly, the tile the
    autotuner picks in this process (its in-memory and disk choices dropped first: it tunes anew, warmup 5, rep 20),
    the choice the disk cache held before (``AUTOTUNE_CACHE``: e.g. a training run's, made by its precompile workers
    while others compiled; "-" if none), and cuBLAS BF16, in µs (:func:`_us_graph`: GPU time; the pick and the
    fastest tile also as the autotuner times them, L2 flushed before each call, :func:`_us_flushed`). Session 56
    saw the 16384x3072x768 GEMM (fc1.fprop and fc2.dgrad) at 141.8 µs in a 4-warp tile against cuBLAS's 116.6 on an
    H100. Returns the rows as dicts."""
    one = torch.ones((), device=device)
    cands = tma_candidates()
    gpu = torch.cuda.get_device_name() if device == "cuda" else device
    print(f"device: {gpu}; torch {torch.__version__}; triton {triton.__version__}; "
          f"do_bench_cudagraph rep={rep} ms (median), µs")
    print("| shape | M | N | K | cuBLAS | autotuned pick | pick µs | fastest tile | fastest µs | pick / fastest "
          "| fastest / cuBLAS | pick, fastest µs with L2 flushed | stored pick | stored µs | "
          + " | ".join(n for n, _ in cands) + " |")
    print("|" + "---|" * (14 + len(cands)))
    rows = []
    for name, M, N, K in linear_shapes(768):
        if name.endswith("wgrad") or (only and not f"124M {name}".startswith(only)):
            continue
        g = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(M, K, device=device, generator=g).to(torch.bfloat16)
        b = torch.randn(N, K, device=device, generator=g).to(torch.bfloat16)
        def gemm(cfg=None):
            return G.bf16_gemm_scaled(a, b, one, one, config=cfg)

        cub = _us_graph(lambda: torch.mm(a, b.t()), rep)
        times = {}
        for n, cfg in cands:
            try:
                times[n] = _us_graph(lambda: gemm(cfg), rep)
            except Exception as e:  # noqa: BLE001  (a tile that does not fit: one bad entry must not lose the table)
                print(f"  {name} {n}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                times[n] = float("nan")
        key = (M, N, K, torch.bfloat16, a.device.index, False, False)
        stored = G._load_tuned(key)
        stored_us = _us_graph(lambda: gemm(stored), rep) if stored else float("nan")
        cache = G.AUTOTUNE_CACHE
        G.AUTOTUNE_CACHE, _ = False, G._tuned.pop("tma", None)
        G._TMA_BEST.pop(key, None)
        try:
            gemm()
        finally:
            G.AUTOTUNE_CACHE = cache
        pick = G._TMA_BEST[key]
        pick_us = _us_graph(lambda: gemm(pick), rep)
        best = min((n for n in times if times[n] == times[n]), key=times.get)
        best_cfg = dict(cands)[best]
        flushed = (_us_flushed(lambda: gemm(pick), rep), _us_flushed(lambda: gemm(best_cfg), rep))
        rows.append(dict(shape=name, M=M, N=N, K=K, cublas=cub, pick=tile_name(pick), pick_us=pick_us, fastest=best,
                         fastest_us=times[best], flushed=flushed, times=times,
                         stored=tile_name(stored) if stored else None, stored_us=stored_us))
        print(f"| 124M {name} | {M} | {N} | {K} | {cub:.1f} | {tile_name(pick)} | {pick_us:.1f} | {best} | "
              f"{times[best]:.1f} | {pick_us / times[best]:.3f} | {times[best] / cub:.3f} | "
              f"{flushed[0]:.1f}, {flushed[1]:.1f} | {tile_name(stored) if stored else '-'} | {stored_us:.1f} | "
              + " | ".join(f"{times[n]:.1f}" for n, _ in cands) + " |",
              flush=True)
        del a, b
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--explore", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--lower", action="store_true", help="the lowering table (candidate lowerings vs cuBLAS)")
    ap.add_argument("--host", action="store_true", help="host (launch) overhead per call of each impl")
    ap.add_argument("--tma-configs", action="store_true",
                    help="every TMA GEMM tile against the autotuner's pick and cuBLAS on the 124M fprop/dgrad shapes")
    ap.add_argument("--cudagraph", action="store_true",
                    help="time CUDA-graph replays (GPU time only, no Python launch overhead)")
    ap.add_argument("--only", default="", help="--lower: only shapes whose name starts with one of these "
                                               "comma-separated prefixes (e.g. 124M,square)")
    ap.add_argument("--rep", type=int, default=25, help="do_bench rep time in ms")
    ap.add_argument("--budget", type=float, default=1e9, help="stop starting new shapes after this many s")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gemm.py needs a CUDA device")
    if a.host:
        host_overhead()
    elif a.tma_configs:
        tma_configs_table(a.rep, only=tuple(p for p in a.only.split(",") if p))
    elif a.explore:
        explore(a.out)
    elif a.lower:
        global CUDAGRAPH
        CUDAGRAPH = a.cudagraph
        lowering_table(a.out, a.rep, a.budget, only=tuple(p for p in a.only.split(",") if p))
    else:
        table(a.quick, a.out, a.rep, a.budget)


if __name__ == "__main__":
    main()
