"""NVFP4 quantize kernels on the GPU: bit-exactness against the torch reference, then throughput.

    python bench/quantize.py --check --bench [--sweep] [--out DIR]

--check   every kernel configuration (rounding x 4/6 x 1D/2D x RHT x transpose, and dequantize) on large
          random bf16 inputs, compared byte for byte with the CPU torch reference (same seed, same signs).
--bench   bf16 -> NVFP4 throughput at 4096x4096 and 16384x8192 as a fraction of the device-to-device copy
          bandwidth measured in the same run. Kernel times come from CUDA-graph replay
          (``triton.testing.do_bench_cudagraph``: no Python launch overhead). Bytes counted two ways:
            logical = read x once (2 B/elem) + write codes (0.5 B/elem) + scales (1/16 B/elem);
            actual  = logical + the second read of x by the amax pass (the global scale needs max|x| first).
          The copy reference moves 2x the bytes of x (read + write). Also the naive torch-eager reference
          (``fp4compile.formats.nvfp4.quantize`` on the GPU) for contrast.
--sweep   try a few tile configurations of the quantize kernel and use the fastest.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fp4compile import ops  # noqa: E402,F401  (registers the ops and their CUDA kernels)
from fp4compile.formats import nvfp4  # noqa: E402
from fp4compile.kernels import quantize as K  # noqa: E402


def log(*a):
    print(*a, flush=True)


def make_input(shape, kind, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if kind == "heavy":
        x = x * torch.exp(1.5 * torch.randn(shape, generator=g))
    return x.to(torch.bfloat16)


QUICK_CASES = [("rtn", False, False, 0, False), ("rtn", True, True, 0, False), ("rtn", False, False, 16, False),
               ("rtn", False, False, 128, True), ("sr", False, False, 0, False), ("sr", True, True, 16, False),
               ("ms_eden", False, False, 128, False), ("ms_eden", False, True, 128, True)]


def check(out_rows, quick=False, impls=(None,)):
    """Bit-exact comparison of the CUDA kernels with the CPU reference; returns the number of mismatches.

    quick: a subset covering every code path (both butterfly implementations when ``impls`` lists them)."""
    bad = 0
    signs = (torch.randint(0, 2, (128,), generator=torch.Generator().manual_seed(1)) * 2 - 1).float()
    seed = torch.tensor(0x1234_5678_9ABC, dtype=torch.int64)
    shapes = [((1024, 2048), "gauss"), ((512, 4096), "heavy")]
    cases = []
    for r, f, b2, h in itertools.product(["rtn", "sr", "ms_eden"], [False, True], [False, True], [0, 16, 128]):
        if r == "ms_eden" and f:
            continue
        cases.append((r, f, b2, h, False))
    for r, b2, h in itertools.product(["rtn", "sr", "ms_eden"], [False, True], [0, 128]):
        cases.append((r, False, b2, h, True))
    if quick:
        cases = QUICK_CASES
        shapes = shapes[:1]
    t0 = time.time()
    for (shape, kind), (r, f, b2, h, tr), impl in itertools.product(shapes, cases, impls):
        if (shape, kind) != shapes[0] and (tr or h == 16):
            continue
        if impl == 1 and not h:
            continue
        x = make_input(shape, kind)
        sg = signs[:h] if h else None
        got = K.quantize(x.cuda(), r, f, b2, h, None if sg is None else sg.cuda(), seed.cuda(), tr,
                         config=None if impl is None else {"rht_impl": impl})
        ref = ops._quantize_reference(x, r, f, b2, h, sg, seed, tr)
        eq = [torch.equal(a.cpu(), b) for a, b in zip(got, ref)]
        nmis = [int((a.cpu() != b).sum()) for a, b in zip(got, ref)]
        ok = all(eq)
        bad += not ok
        out_rows.append({"op": "quantize", "shape": list(shape), "data": kind, "rounding": r, "four_over_six": f,
                         "block2d": b2, "hadamard": h, "transpose": tr, "rht_impl": impl, "bit_exact": ok,
                         "mismatches": nmis})
        if not ok:
            log(f"MISMATCH quantize {shape} {kind} {r} 4/6={f} 2d={b2} had={h} T={tr} impl={impl}: {nmis}")
    for h, dt, impl in itertools.product([0, 16, 128], [torch.bfloat16, torch.float32], impls):
        if (quick and dt == torch.float32 and h != 16) or (impl == 1 and not h):
            continue
        x = make_input((1024, 2048), "heavy")
        sg = signs[:h] if h else None
        c, s, g = ops._quantize_reference(x, "rtn", False, False, h, sg, None, False)
        got = K.dequantize(c.cuda(), s.cuda(), g.cuda(), h, None if sg is None else sg.cuda(), dt,
                           config=None if impl is None else {"rht_impl": impl})
        ref = torch.ops.fp4compile.dequantize(c, s, g, h, sg, dt)
        ok = torch.equal(got.cpu(), ref)
        bad += not ok
        out_rows.append({"op": "dequantize", "hadamard": h, "dtype": str(dt), "rht_impl": impl, "bit_exact": ok})
        if not ok:
            log(f"MISMATCH dequantize had={h} {dt}")
    log(f"check: {len(out_rows)} configurations, {bad} mismatching, {time.time() - t0:.1f}s")
    return bad


def bench_ms(fn):
    import triton.testing

    with torch.cuda.stream(torch.cuda.Stream()):
        return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")


BENCH_CASES = [
    ("RTN", dict(rounding="rtn")),
    ("RTN 4/6", dict(rounding="rtn", four_over_six=True)),
    ("RTN + RHT16", dict(rounding="rtn", hadamard=16)),
    ("SR", dict(rounding="sr")),
    ("MS-EDEN + RHT128", dict(rounding="ms_eden", hadamard=128)),
    ("RTN 2D 16x16 (weights)", dict(rounding="rtn", block2d=True)),
    ("MS-EDEN + RHT128, transposed", dict(rounding="ms_eden", hadamard=128, transpose=True)),
]


def run_case(x, case, config=None):
    kw = dict(case)
    h = kw.get("hadamard", 0)
    signs = torch.ones(h, device="cuda") if h else None
    seed = torch.tensor(7, dtype=torch.int64, device="cuda")
    return lambda: K.quantize(x, kw.get("rounding", "rtn"), kw.get("four_over_six", False),
                              kw.get("block2d", False), h, signs, seed, kw.get("transpose", False), config=config)


def sweep(x):
    best = {}
    grids = {
        "rtn": (dict(rounding="rtn"), [dict(q_rows=r, q_cols=c, q_warps=w) for r, c, w in
                                       [(16, 256, 4), (32, 256, 8), (16, 512, 8), (8, 512, 4)]]),
        "had128": (dict(rounding="ms_eden", hadamard=128),
                   [dict(q_rows=r, q_cols=c, q_warps=w, rht_impl=i, a_rows=ar) for r, c, w, i, ar in
                    [(16, 128, 4, 0, 32), (16, 128, 4, 1, 32), (16, 256, 4, 1, 32), (8, 128, 4, 1, 16),
                     (16, 256, 8, 1, 16)]]),
        "transposed": (dict(rounding="ms_eden", hadamard=128, transpose=True),
                       [dict(t_impl=t, q_rows=r, a_rows=r) for t, r in [(0, 16), (1, 16), (1, 64)]]),
    }
    for name, (case, grid) in grids.items():
        res = []
        for cfg in grid:
            try:
                ms = bench_ms(run_case(x, case, cfg))
                ms_a = bench_ms(lambda: K.amax(x, case.get("hadamard", 0),
                                               torch.ones(case.get("hadamard", 1), device="cuda")
                                               if case.get("hadamard") else None, case.get("transpose", False),
                                               config=cfg))
            except Exception as e:  # noqa: BLE001 (a config that does not compile is just skipped)
                log(f"sweep {name} {cfg}: failed {type(e).__name__}: {str(e)[:300]}")
                continue
            res.append((ms, cfg))
            log(f"sweep {name} {cfg}: total {ms * 1e3:.1f} us (amax pass {ms_a * 1e3:.1f} us)")
        best[name] = min(res, key=lambda t: t[0])[1] if res else None
    return best


def bench(rows, config_rtn=None, config_had=None, config_t=None):
    n = 16384 * 8192
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src))
    copy_bw = 2 * n * 2 / copy_ms / 1e6  # GB/s
    log(f"copy bandwidth: {copy_bw:.0f} GB/s ({n * 2 / 2**20:.0f} MiB buffer)")
    for shape in [(4096, 4096), (16384, 8192)]:
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        ne = x.numel()
        logical = ne * 2 + ne // 2 + ne // 16
        actual = logical + ne * 2
        for name, case in BENCH_CASES:
            cfg = config_had if case.get("hadamard") else config_rtn
            if case.get("transpose") and config_t is not None:
                cfg = config_t
            ms = bench_ms(run_case(x, case, cfg))
            row = {"shape": list(shape), "case": name, "us": ms * 1e3,
                   "frac_copy_logical": logical / ms / 1e6 / copy_bw,
                   "frac_copy_actual": actual / ms / 1e6 / copy_bw, "copy_GBps": copy_bw}
            rows.append(row)
            log(f"{shape} {name:32s} {ms * 1e3:8.1f} us  logical {row['frac_copy_logical']:.2f}  "
                f"actual {row['frac_copy_actual']:.2f} of copy BW")
        import triton.testing
        for name, case in [("torch-eager reference RTN", dict(rounding="rtn")),
                           ("torch-eager reference MS-EDEN+RHT128", dict(rounding="ms_eden", hadamard=128))]:
            kw = dict(case)
            h = kw.get("hadamard")
            signs = torch.ones(h, device="cuda") if h else None
            seed = torch.tensor(7, dtype=torch.int64, device="cuda")
            fn = lambda: nvfp4.quantize(x, rounding=kw["rounding"], hadamard=h, signs=signs, seed=seed,  # noqa
                                        check=False)
            ms = triton.testing.do_bench(fn, rep=50, return_mode="median")
            rows.append({"shape": list(shape), "case": name, "us": ms * 1e3,
                         "frac_copy_logical": logical / ms / 1e6 / copy_bw})
            log(f"{shape} {name:32s} {ms * 1e3:8.1f} us  logical {logical / ms / 1e6 / copy_bw:.3f} of copy BW")
    return copy_bw


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--quick", action="store_true", help="check a subset of configurations (both RHT impls)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA device"
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "command": " ".join(sys.argv)}
    import triton
    result["triton"] = triton.__version__
    bad = 0
    if args.bench:
        cfg_rtn = cfg_had = cfg_t = None
        if args.sweep:
            x = torch.randn(16384, 8192, device="cuda", dtype=torch.bfloat16)
            best = sweep(x)
            cfg_rtn, cfg_had, cfg_t = best["rtn"], best["had128"], best["transposed"]
            result["sweep_best"] = best
            log(f"best configs: {best}")
            with open(os.path.join(args.out, "quantize_bench.json"), "w") as f:
                json.dump(result, f, indent=1)
        result["bench"] = []
        bench(result["bench"], cfg_rtn, cfg_had, cfg_t)
        log("\n| shape | case | us | fraction of copy BW (logical bytes) | (actual bytes incl. amax pass) |")
        log("|---|---|---|---|---|")
        for r in result["bench"]:
            act = f"{r['frac_copy_actual']:.2f}" if "frac_copy_actual" in r else "-"
            log(f"| {r['shape'][0]}x{r['shape'][1]} | {r['case']} | {r['us']:.1f} | {r['frac_copy_logical']:.3f} | {act} |")
    if args.check:
        result["check"] = []
        bad = check(result["check"], quick=args.quick, impls=(0, 1) if args.quick else (None,))
    with open(os.path.join(args.out, "quantize_bench.json"), "w") as f:
        json.dump(result, f, indent=1)
    if bad:
        log(f"FAILED: {bad} configurations not bit-exact")
        sys.exit(1)


if __name__ == "__main__":
    main()
