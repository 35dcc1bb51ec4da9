"""NVFP4 quantize kernels on the GPU: bit-exactness against the torch reference, then throughput.

    python bench/quantize.py --check --bench [--sweep] [--out DIR]

--check   every kernel configuration (rounding x 4/6 x 1D/2D x RHT x transpose, and dequantize) on large
          random bf16 inputs, compared byte for byte with the CPU torch reference (same seed, same signs).
--bench   bf16 -> NVFP4 throughput at 4096x4096 and 16384x8192 as a fraction of the device-to-device copy
          bandwidth measured in the same run. Kernel times come from CUDA-graph replay
          (``triton.testing.do_bench_cudagraph``: no Python launch overhead). Bytes counted two ways:
            logical = read x once (2 B/elem) + write codes (0.5 B/elem) + scales (1/16 B/elem);
            actual  = logical + what the implementation moves on top: RTN/SR the second read of x by the amax
                      pass (the global scale needs max|x| first); MS-EDEN the FP32 block-scale scratch written
                      by pass 1 and read back by pass 2 (4 + 4 B per 16 elements); transposed (t_impl 2) the
                      transposing copy (read x + write x.T; it also carries the amax of RTN/SR without RHT).
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
from fp4compile.kernels.launch import placeholder  # noqa: E402


#: device and sizes (a CPU dry run under TRITON_INTERPRET=1 overrides them: tests/test_quantize_kernels.py)
DEV = "cuda"
BENCH_SHAPES = [(4096, 4096), (16384, 8192)]
SWEEP_SHAPE = (16384, 8192)
CHECK_SHAPE = (512, 1024)


def log(*a):
    print(*a, flush=True)


def make_input(shape, kind, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if kind == "heavy":
        x = x * torch.exp(1.5 * torch.randn(shape, generator=g))
    return x.to(torch.bfloat16)


QUICK_CASES = [("rtn", False, False, 0, False), ("rtn", True, False, 0, False), ("rtn", True, True, 0, False),
               ("rtn", False, True, 0, False), ("rtn", False, False, 16, False), ("rtn", False, False, 128, True),
               ("rtn", False, False, 0, True), ("sr", False, False, 0, False), ("sr", True, True, 16, False),
               ("sr", False, False, 0, True), ("ms_eden", False, False, 128, False),
               ("ms_eden", False, True, 128, True), ("ms_eden", False, False, 128, True),
               ("ms_eden", False, False, 0, False), ("ms_eden", False, True, 16, False)]
#: configs checked beside the default on the quick list (each only where it changes the code path)
QUICK_CONFIGS = [None, {"t_impl": 0}, {"t_impl": 1}, {"q_cols": 256, "s_cols": 512}]


def check(out_rows, quick=False, configs=(None,)):
    """Bit-exact comparison of the CUDA kernels with the CPU reference; returns the number of mismatches.

    quick: a subset covering every code path, at 512x1024, under each config of ``configs`` (a config that
    cannot change a case's code path is skipped for it)."""
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
        shapes = [(CHECK_SHAPE, "heavy")]
    t0 = time.time()
    for (shape, kind), (r, f, b2, h, tr), cfg in itertools.product(shapes, cases, configs):
        if (shape, kind) != shapes[0] and (tr or h == 16):
            continue
        if cfg and (("t_impl" in cfg and not tr) or ("rht_impl" in cfg and not h)
                    or ("q_cols" in cfg and (h or tr))):
            continue
        x = make_input(shape, kind)
        sg = signs[:h] if h else None
        try:
            got = K.quantize(x.to(DEV), r, f, b2, h, None if sg is None else sg.to(DEV), seed.to(DEV), tr,
                             config=cfg)
        except Exception as e:  # noqa: BLE001 (reported as a failure; the other cases still run)
            bad += 1
            log(f"ERROR quantize {r} 4/6={f} 2d={b2} had={h} T={tr} config={cfg}: {type(e).__name__}: {str(e)[:500]}")
            out_rows.append({"op": "quantize", "rounding": r, "four_over_six": f, "block2d": b2, "hadamard": h,
                             "transpose": tr, "config": cfg, "bit_exact": False, "error": str(e)[:500]})
            continue
        ref = ops._quantize_reference(x, r, f, b2, h, sg, seed, tr)
        nmis = [int((a.cpu() != b).sum()) for a, b in zip(got, ref)]
        ok = all(torch.equal(a.cpu(), b) for a, b in zip(got, ref))
        bad += not ok
        out_rows.append({"op": "quantize", "shape": list(shape), "data": kind, "rounding": r, "four_over_six": f,
                         "block2d": b2, "hadamard": h, "transpose": tr, "config": cfg, "bit_exact": ok,
                         "mismatches": nmis})
        if not ok:
            log(f"MISMATCH quantize {shape} {kind} {r} 4/6={f} 2d={b2} had={h} T={tr} config={cfg}: {nmis}")
    for r, h in [("rtn", 0), ("sr", 128)]:  # the single-pass mode with the true amax = the default
        x = make_input(CHECK_SHAPE, "heavy").to(DEV)
        sg = signs[:h].to(DEV) if h else None
        got = K.quantize(x, r, hadamard=h, signs=sg, seed=seed.to(DEV), amax=K.amax(x, h, sg))
        ref = K.quantize(x, r, hadamard=h, signs=sg, seed=seed.to(DEV))
        ok = all(torch.equal(a, b) for a, b in zip(got, ref))
        bad += not ok
        out_rows.append({"op": "quantize given amax", "rounding": r, "hadamard": h, "bit_exact": ok})
        if not ok:
            log(f"MISMATCH quantize with given amax {r} had={h}")
    for h, dt in itertools.product([0, 16, 128], [torch.bfloat16, torch.float32]):
        if quick and dt == torch.float32 and h != 16:
            continue
        x = make_input(CHECK_SHAPE, "heavy")
        sg = signs[:h] if h else None
        c, s, g = ops._quantize_reference(x, "rtn", False, False, h, sg, None, False)
        got = K.dequantize(c.to(DEV), s.to(DEV), g.to(DEV), h, None if sg is None else sg.to(DEV), dt)
        ref = torch.ops.fp4compile.dequantize(c, s, g, h, sg, dt)
        ok = torch.equal(got.cpu(), ref)
        bad += not ok
        out_rows.append({"op": "dequantize", "hadamard": h, "dtype": str(dt), "bit_exact": ok})
        if not ok:
            log(f"MISMATCH dequantize had={h} {dt}")
    log(f"check: {len(out_rows)} configurations, {bad} mismatching, {time.time() - t0:.1f}s")
    return bad


def bench_ms(fn, rep=50):
    import triton.testing

    with torch.cuda.stream(torch.cuda.Stream()):
        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


BENCH_CASES = [
    ("RTN", dict(rounding="rtn")),
    ("RTN 4/6", dict(rounding="rtn", four_over_six=True)),
    ("RTN + RHT16", dict(rounding="rtn", hadamard=16)),
    ("SR", dict(rounding="sr")),
    ("SR 4/6", dict(rounding="sr", four_over_six=True)),
    ("RTN + RHT128", dict(rounding="rtn", hadamard=128)),
    ("MS-EDEN (no RHT)", dict(rounding="ms_eden")),
    ("MS-EDEN + RHT128", dict(rounding="ms_eden", hadamard=128)),
    ("MS-EDEN + RHT128, e_impl 1 (chunk/thread)", dict(rounding="ms_eden", hadamard=128, config={"e_impl": 1})),
    ("MS-EDEN + RHT128, e_impl 2 (half chunk/thread)", dict(rounding="ms_eden", hadamard=128, config={"e_impl": 2})),
    ("MS-EDEN + RHT128, e_impl 2, 128 registers", dict(rounding="ms_eden", hadamard=128,
                                                        config={"e_impl": 2, "h_maxnreg": 128})),
    ("MS-EDEN + RHT128, e_impl 3 (quarter chunk/thread)", dict(rounding="ms_eden", hadamard=128,
                                                               config={"e_impl": 3})),
    ("MS-EDEN + RHT128, e_impl 3, one quarter/thread", dict(rounding="ms_eden", hadamard=128,
                                                            config={"e_impl": 3, "u_rows": 8, "u_maxnreg": 0})),
    ("RTN 2D 16x16 (weights)", dict(rounding="rtn", block2d=True)),
    ("RTN, transposed", dict(rounding="rtn", transpose=True)),
    ("MS-EDEN + RHT128, transposed", dict(rounding="ms_eden", hadamard=128, transpose=True)),
    # single pass with a given global amax (delayed scaling): not the default op's number, a separate row
    ("RTN, given amax (1 pass)", dict(rounding="rtn", given_amax=True)),
    # two ordinary launches instead of the default PDL-launched quantize kernel (CONFIG["pdl"]; kernels/quantize.py)
    ("RTN, no PDL", dict(rounding="rtn", config={"pdl": 0})),
    ("RTN + RHT128, given amax (1 pass)", dict(rounding="rtn", hadamard=128, given_amax=True)),
]
#: the rows of ``--reduced`` (the MS-EDEN one-pass question: its rows and the RTN baselines)
REDUCED = ("RTN", "RTN + RHT128", "RTN + RHT128, given amax (1 pass)", "MS-EDEN (no RHT)", "MS-EDEN + RHT128",
           "MS-EDEN + RHT128, e_impl 1 (chunk/thread)", "MS-EDEN + RHT128, e_impl 2 (half chunk/thread)",
           "MS-EDEN + RHT128, e_impl 2, 128 registers", "MS-EDEN + RHT128, e_impl 3 (quarter chunk/thread)",
           "MS-EDEN + RHT128, e_impl 3, one quarter/thread", "RTN, transposed", "MS-EDEN + RHT128, transposed")


def run_case(x, case, config=None, kernels=K):
    """A no-argument callable running ``case``'s quantize of ``x`` with ``kernels`` (this revision's
    ``fp4compile.kernels.quantize``, or another's: ``bench/quantize_ab.py``); random RHT signs from torch's RNG."""
    kw = dict(case)
    h = kw.get("hadamard", 0)
    signs = (torch.randint(0, 2, (h,), device=DEV) * 2 - 1).float() if h else None
    seed = torch.tensor(7, dtype=torch.int64, device=DEV)
    tr = kw.get("transpose", False)
    amax = kernels.amax(x, h, signs, tr, config=config) if kw.get("given_amax") else None
    return lambda: kernels.quantize(x, kw.get("rounding", "rtn"), kw.get("four_over_six", False),
                                    kw.get("block2d", False), h, signs, seed, tr, config=config, amax=amax)


def case_bytes(ne, case):
    """(logical, actual) bytes of one quantize (module docstring)."""
    logical = ne * 2 + ne // 2 + ne // 16
    extra = 0
    tr = case.get("transpose", False) and K.CONFIG["t_impl"] == 2
    if tr:
        extra += 4 * ne                      # transposing copy: read x, write x.T
    if case.get("rounding") == "ms_eden":
        extra += ne // 2                     # FP32 S' scratch: 4 B written + 4 B read per 16 elements
    elif not case.get("given_amax") and not (tr and not case.get("hadamard")):
        extra += 2 * ne                      # the amax pass reads x again
    return logical, logical + extra


SWEEPS = {  # name: (case, candidate configs), most important first; the first candidate is the default CONFIG
    "rtn": (dict(rounding="rtn"), [{}] + [dict(q_rows=r, q_cols=c, q_warps=w) for r, c, w in
                                          [(16, 256, 4), (32, 256, 4), (8, 1024, 4), (8, 512, 4), (16, 512, 8),
                                           (32, 512, 8), (16, 1024, 8)]]
            + [dict(a_rows=r, a_cols=c, a_warps=w, a_impl=i) for r, c, w, i in
               [(64, 256, 8, 1), (256, 256, 8, 1), (128, 512, 8, 1), (128, 256, 16, 1), (64, 512, 8, 2),
                (128, 512, 16, 2)]]),
    "had128": (dict(rounding="ms_eden", hadamard=128),
               [{}] + [dict(e_impl=1, c_rows=r, c_cols=c, c_warps=w) for r, c, w in
                       [(32, 512, 4), (16, 512, 2), (8, 512, 1), (32, 256, 2), (64, 512, 8)]]
               + [dict(f_block=b, f_warps=w) for b, w in [(1024, 4), (4096, 4), (4096, 8)]]),
    "had128h": (dict(rounding="ms_eden", hadamard=128),  # pass 1 with half a 128-chunk per thread (e_impl 2)
                [{}] + [dict(e_impl=2, h_rows=r, h_cols=c, h_warps=w, h_maxnreg=m) for r, c, w, m in
                        [(16, 512, 4, 0), (16, 512, 4, 128), (16, 512, 4, 112), (8, 512, 2, 128), (16, 256, 2, 128),
                         (32, 512, 8, 128), (32, 256, 4, 128)]]),
    "had128u": (dict(rounding="ms_eden", hadamard=128),  # pass 1 with a quarter of a 128-chunk per thread (e_impl 3)
                [{}] + [dict(e_impl=3, u_rows=r, u_cols=c, u_warps=w, u_maxnreg=m) for r, c, w, m in
                        [(16, 512, 4, 128), (16, 512, 4, 0), (8, 512, 4, 0), (8, 256, 2, 0), (16, 256, 2, 0),
                         (16, 512, 4, 112), (32, 512, 8, 128), (16, 1024, 8, 0)]]),
    "had128e": (dict(rounding="ms_eden", hadamard=128),  # the block-per-thread pass 1 (e_impl 0) and pass 2 tiles
                # (CONFIG caps pass 1 at 96 registers since session 30: the tiles below run capped; 0 = uncapped)
                [{}, dict(e_maxnreg=0), dict(e_maxnreg=88), dict(e_maxnreg=80)]
                + [dict(e_rows=r, e_cols=c, e_warps=w) for r, c, w in [(8, 256, 2), (32, 256, 8), (16, 128, 2),
                                                                       (16, 512, 8)]]
                + [dict(e_rows=16, e_cols=128, e_warps=2, e_maxnreg=80)]
                + [dict(f_block=b, f_warps=w) for b, w in [(1024, 4), (4096, 8)]]),
    "transposed": (dict(rounding="ms_eden", hadamard=128, transpose=True),
                   [{}, dict(t_impl=0, t_rows=16, t_cols=128)]
                   + [dict(p_rows=r, p_cols=c, p_warps=w) for r, c, w in [(128, 128, 8), (64, 256, 8), (64, 128, 4)]]),
    "rtn_transposed": (dict(rounding="rtn", transpose=True),
                       [{}, dict(t_impl=0)] + [dict(p_rows=r, p_cols=c, p_warps=w) for r, c, w in
                                               [(128, 128, 8), (64, 256, 8), (64, 128, 4)]]),
    "sr": (dict(rounding="sr"), [{}, dict(s_maxnreg=96), dict(q_impl=0), dict(s_rows=8, s_cols=256),
                                 dict(s_rows=32, s_cols=128)]),
    "rtn46": (dict(rounding="rtn", four_over_six=True), [{}, dict(s_maxnreg=0), dict(s_maxnreg=128),
                                                         dict(s_maxnreg=96), dict(q_impl=0),
                                                         dict(s_rows=8, s_cols=256), dict(s_rows=16, s_cols=128)]),
    "rtn_had16": (dict(rounding="rtn", hadamard=16), [{}, dict(q_impl=0, a_impl=0)]),
    # programmatic dependent launch of the quantize kernel behind the amax kernel (CONFIG["pdl"], default 1);
    # PDL and two ordinary launches alternate so the drift within the run shows
    "pdl": (dict(rounding="rtn"), [dict(pdl=0), dict(pdl=1), dict(pdl=0, q_rows=8, q_cols=512, q_warps=4),
                                   dict(pdl=1, q_rows=8, q_cols=512, q_warps=4), dict(pdl=0), dict(pdl=1)]),
    "pdl_sr": (dict(rounding="sr"), [dict(pdl=0), dict(pdl=1)]),
    "pdl_rtn46": (dict(rounding="rtn", four_over_six=True), [dict(pdl=0), dict(pdl=1)]),
    "pdl_had16": (dict(rounding="rtn", hadamard=16), [dict(pdl=0), dict(pdl=1)]),
}


def sweep(x, copy_bw, rows, only=None, save=lambda: None):
    """Time every candidate config on ``x`` (total time, amax pass separately); returns the fastest per sweep."""
    best = {}
    ne = x.numel()
    for name, (case, grid) in SWEEPS.items():
        if only and name not in only:
            continue
        res = []
        for cfg in grid:
            try:
                ms = bench_ms(run_case(x, case, cfg), rep=25)
                h = case.get("hadamard", 0)
                sg = torch.ones(h, device=DEV) if h else None
                ms_a = 0.0 if case.get("rounding") == "ms_eden" else bench_ms(  # MS-EDEN has no amax pass
                    lambda: K.amax(x, h, sg, case.get("transpose", False), config=cfg), rep=15)
            except Exception as e:  # noqa: BLE001 (a config that does not compile is just skipped)
                log(f"sweep {name} {cfg}: failed {type(e).__name__}: {str(e)[:300]}")
                continue
            logical, actual = case_bytes(ne, case)
            res.append((ms, cfg))
            rows.append({"sweep": name, "config": cfg, "us": ms * 1e3, "amax_us": ms_a * 1e3,
                         "frac_copy_actual": actual / ms / 1e6 / copy_bw,
                         "quantize_pass_frac": (ne * 2 + ne // 2 + ne // 16) / max(ms - ms_a, 1e-9) / 1e6 / copy_bw})
            log(f"sweep {name:14s} {str(cfg):70s} total {ms * 1e3:7.1f} us (amax pass {ms_a * 1e3:6.1f} us)  "
                f"actual {rows[-1]['frac_copy_actual']:.3f} of copy BW, quantize pass alone "
                f"{rows[-1]['quantize_pass_frac']:.3f}")
        best[name] = min(res, key=lambda t: t[0])[1] if res else None
        save()
    return best


def copy_bandwidth():
    n = SWEEP_SHAPE[0] * SWEEP_SHAPE[1]
    src = torch.randn(n, device=DEV, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src))
    copy_bw = 2 * n * 2 / copy_ms / 1e6  # GB/s
    log(f"copy bandwidth: {copy_bw:.0f} GB/s ({n * 2 / 2**20:.0f} MiB buffer)")
    return copy_bw


def eden_passes(rows, x, copy_bw, hadamard=128):
    """Pass 1 (x -> codes + FP32 scratch + max) and pass 2 (scratch -> E4M3 scales) of MS-EDEN timed apart."""
    import triton

    R, Kd = x.shape
    cfg = K._config(x.device, None)
    sg = (torch.randint(0, 2, (hadamard,), device=DEV) * 2 - 1).float() if hadamard else placeholder(DEV, torch.float32)
    seed = torch.tensor(7, dtype=torch.int64, device=DEV)
    codes = torch.empty((R, Kd // 2), dtype=torch.uint8, device=DEV)
    scales = torch.empty((R, Kd // 16), dtype=torch.uint8, device=DEV)
    g = torch.empty((), dtype=torch.float32, device=DEV)
    scratch = torch.empty((R, Kd // 16), dtype=torch.float32, device=DEV)
    smax = torch.zeros((), dtype=torch.float32, device=DEV)
    br, bc = cfg["e_rows"], max(cfg["e_cols"], hadamard or 16)
    p1 = lambda: K._eden_pass1_kernel[(triton.cdiv(R, br), triton.cdiv(Kd, bc))](  # noqa: E731
        x, x.stride(0), x.stride(1), R, Kd, sg, codes.view(torch.int32), scratch, smax, placeholder(DEV, x.dtype),
        VAL_MAX=K.EDEN_VAL_MAX, INV_VAL_MAX=K.EDEN_INV_VAL_MAX, BLOCK2D=False, HAD=hadamard, NORM=K._norm(hadamard),
        RHT_IMPL=cfg["rht_impl"], TLOAD=False, BR=br, BC=bc, MAGIC_PACK=K._MAGIC_PACK, num_warps=cfg["e_warps"],
        **K._launch_opts(x.device))
    nbk = Kd // 16
    p2 = lambda: K._eden_pass2_kernel[(triton.cdiv(R * nbk, cfg["f_block"]),)](  # noqa: E731
        scratch, smax, seed, scales, g, R * nbk, nbk, BLOCK2D=False, BLOCK=cfg["f_block"],
        num_warps=cfg["f_warps"], **K._launch_opts(x.device))
    cb, cc = cfg["c_rows"], cfg["c_cols"]
    p1c = lambda: K._eden_pass1_chunk_kernel[(triton.cdiv(R, cb), triton.cdiv(Kd, cc))](  # noqa: E731
        x, x.stride(0), R, Kd, sg, codes.view(torch.int32), scratch, smax, VAL_MAX=K.EDEN_VAL_MAX,
        INV_VAL_MAX=K.EDEN_INV_VAL_MAX, NORM=K._norm(hadamard), BR=cb, BC=cc, MAGIC_PACK=K._MAGIC_PACK,
        num_warps=cfg["c_warps"], **K._launch_opts(x.device))
    hb, hc = cfg["h_rows"], cfg["h_cols"]
    p1h = lambda cap: (lambda: K._eden_pass1_half_kernel[(triton.cdiv(R, hb), triton.cdiv(Kd, hc))](  # noqa: E731
        x, x.stride(0), R, Kd, sg, codes.view(torch.int32), scratch, smax, VAL_MAX=K.EDEN_VAL_MAX,
        INV_VAL_MAX=K.EDEN_INV_VAL_MAX, NORM=K._norm(hadamard), BR=hb, BC=hc, MAGIC_PACK=K._MAGIC_PACK,
        num_warps=cfg["h_warps"], **K._launch_opts(x.device, cap)))
    ub, uc = cfg["u_rows"], cfg["u_cols"]
    p1u = lambda cap: (lambda: K._eden_pass1_quarter_kernel[(triton.cdiv(R, ub), triton.cdiv(Kd, uc))](  # noqa: E731
        x, x.stride(0), R, Kd, sg, codes.view(torch.int32), scratch, smax, VAL_MAX=K.EDEN_VAL_MAX,
        INV_VAL_MAX=K.EDEN_INV_VAL_MAX, NORM=K._norm(hadamard), BR=ub, BC=uc, MAGIC_PACK=K._MAGIC_PACK,
        num_warps=cfg["u_warps"], **K._launch_opts(x.device, cap)))
    ne = x.numel()
    for name, fn, nbytes in [(f"MS-EDEN+RHT{hadamard} pass 1 only (e_impl 0)", p1, ne * 2 + ne // 2 + ne // 4),
                             (f"MS-EDEN+RHT{hadamard} pass 1 only (e_impl 1)", p1c, ne * 2 + ne // 2 + ne // 4),
                             (f"MS-EDEN+RHT{hadamard} pass 1 only (e_impl 2)", p1h(0), ne * 2 + ne // 2 + ne // 4),
                             (f"MS-EDEN+RHT{hadamard} pass 1 only (e_impl 2, 128 regs)", p1h(128),
                              ne * 2 + ne // 2 + ne // 4),
                             (f"MS-EDEN+RHT{hadamard} pass 1 only (e_impl 3, {cfg['u_maxnreg']} regs)",
                              p1u(cfg["u_maxnreg"]), ne * 2 + ne // 2 + ne // 4),
                             (f"MS-EDEN+RHT{hadamard} pass 1 only (e_impl 3, uncapped)", p1u(0),
                              ne * 2 + ne // 2 + ne // 4),
                             (f"MS-EDEN+RHT{hadamard} pass 2 only", p2, ne // 4 + ne // 16)]:
        ms = bench_ms(fn)
        rows.append({"shape": list(x.shape), "case": name, "us": ms * 1e3,
                     "frac_copy_logical": nbytes / ms / 1e6 / copy_bw})
        log(f"{tuple(x.shape)} {name:40s} {ms * 1e3:8.1f} us  its own bytes {rows[-1]['frac_copy_logical']:.2f} "
            f"of copy BW")


def bench(rows, copy_bw, eager=True, only=None):
    for shape in BENCH_SHAPES:
        x = torch.randn(shape, device=DEV, dtype=torch.bfloat16)
        ne = x.numel()
        for name, case in BENCH_CASES:
            if only and name not in only:
                continue
            try:
                ms = bench_ms(run_case(x, case, case.get("config")))
            except Exception as e:  # noqa: BLE001 (a failing case is logged; the table goes on)
                log(f"{shape} {name}: failed {type(e).__name__}: {str(e)[:300]}")
                continue
            logical, actual = case_bytes(ne, case)
            row = {"shape": list(shape), "case": name, "us": ms * 1e3,
                   "frac_copy_logical": logical / ms / 1e6 / copy_bw,
                   "frac_copy_actual": actual / ms / 1e6 / copy_bw, "copy_GBps": copy_bw}
            rows.append(row)
            log(f"{shape} {name:40s} {ms * 1e3:8.1f} us  logical {row['frac_copy_logical']:.3f}  "
                f"actual {row['frac_copy_actual']:.3f} of copy BW")
        try:
            eden_passes(rows, x, copy_bw)
        except Exception as e:  # noqa: BLE001
            log(f"{shape} MS-EDEN pass breakdown: failed {type(e).__name__}: {str(e)[:300]}")
        if not eager:
            continue
        import triton.testing
        logical = ne * 2 + ne // 2 + ne // 16
        for name, case in [("torch-eager reference RTN", dict(rounding="rtn")),
                           ("torch-eager reference MS-EDEN+RHT128", dict(rounding="ms_eden", hadamard=128))]:
            kw = dict(case)
            h = kw.get("hadamard")
            signs = torch.ones(h, device=DEV) if h else None
            seed = torch.tensor(7, dtype=torch.int64, device=DEV)
            fn = lambda: nvfp4.quantize(x, rounding=kw["rounding"], hadamard=h, signs=signs, seed=seed,  # noqa
                                        check=False)
            ms = triton.testing.do_bench(fn, rep=50, return_mode="median")
            rows.append({"shape": list(shape), "case": name, "us": ms * 1e3,
                         "frac_copy_logical": logical / ms / 1e6 / copy_bw})
            log(f"{shape} {name:40s} {ms * 1e3:8.1f} us  logical {logical / ms / 1e6 / copy_bw:.3f} of copy BW")


def table(rows):
    log("\n| shape | case | us | fraction of copy BW (logical bytes) "
        "| (actual bytes: + amax pass, scratch, transposing copy) |")
    log("|---|---|---|---|---|")
    for r in rows:
        act = f"{r['frac_copy_actual']:.3f}" if "frac_copy_actual" in r else "-"
        log(f"| {r['shape'][0]}x{r['shape'][1]} | {r['case']} | {r['us']:.1f} | {r['frac_copy_logical']:.3f} | {act} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweeps", default="", help="comma-separated subset of the sweeps (default: all)")
    ap.add_argument("--sweep-shape", default="x".join(map(str, SWEEP_SHAPE)), help="RxC of the sweeps' input")
    ap.add_argument("--no-eager", action="store_true", help="skip the torch-eager reference rows")
    ap.add_argument("--reduced", action="store_true", help="bench only the REDUCED rows (MS-EDEN and RTN)")
    ap.add_argument("--quick", action="store_true", help="check a subset of cases, under each QUICK_CONFIGS entry")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    assert DEV != "cuda" or torch.cuda.is_available(), "needs a CUDA device"
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name() if DEV == "cuda" else DEV, "torch": torch.__version__,
              "command": " ".join(sys.argv), "config": dict(K.CONFIG)}
    import triton
    result["triton"] = triton.__version__
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "quantize_bench.json")

    def save():
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    bad = 0
    if args.check:  # first: a timeout later still leaves the correctness result
        result["check"] = []
        bad = check(result["check"], quick=args.quick, configs=QUICK_CONFIGS if args.quick else (None,))
        save()
    if args.bench or args.sweep:
        copy_bw = copy_bandwidth()
        result["copy_GBps"] = copy_bw
    if args.bench:
        result["bench"] = []
        if args.reduced:  # the large shape first: a timeout still leaves the number that matters
            global BENCH_SHAPES
            BENCH_SHAPES = sorted(BENCH_SHAPES, key=lambda sh: -sh[0] * sh[1])
        bench(result["bench"], copy_bw, eager=not args.no_eager, only=REDUCED if args.reduced else None)
        save()
        table(result["bench"])
    if args.sweep:
        result["sweep"] = []
        x = torch.randn(tuple(int(v) for v in args.sweep_shape.split("x")), device=DEV, dtype=torch.bfloat16)
        result["sweep_shape"] = args.sweep_shape
        best = result["sweep_best"] = {}
        best.update(sweep(x, copy_bw, result["sweep"], only=[w for w in args.sweeps.split(",") if w], save=save))
        log(f"best configs: {best}")
        save()
    save()
    if bad:
        log(f"FAILED: {bad} configurations not bit-exact")
        sys.exit(1)


if __name__ == "__main__":
    main()
