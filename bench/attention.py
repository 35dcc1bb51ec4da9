"""Q-Attn on the GPU: correctness against the float64 reference, then time vs torch SDPA (cuDNN/flash, BF16).

    python bench/attention.py [--phase checks|sweep|table|profile|all] [--json FILE] [--quick]
    python bench/attention.py --compile-worker I/N     # fill Triton's disk cache with the sweep's kernels

Phases: ``checks`` (correctness, below), ``sweep`` (kernel-level times of the tile configurations in SWEEP at
T = 1024, 2048 and 4096; each config's output is compared with the default config's; the fastest valid config per
(head dim, kernel) becomes the configuration of the ``table`` phase in the same process, and is printed), and
``table`` (the issue's grid, op level); ``profile`` (not in ``all``): device time per kernel of one
forward+backward at T = 4096 for SDPA and both splits (torch.profiler). ``--compile-worker`` processes started in parallel compile the sweep's
kernels on tiny inputs of the same Triton specialization, so the timing process loads them from the cache.

Correctness (FlashAttention's rule, relative Frobenius errors): err(Triton) <= 2·err(torch FP32 + BF16-rounding
implementation of the same mixed-precision math) + 1e-3, against float64 with the same NVFP4 operands; the
all-BF16 roles against torch SDPA in the same form; opcheck of the CUDA op.

Benchmark: B·H = 64 (B=4, H=16), T in {1024, 2048, 4096}, d in {64, 128}, causal, bf16. Forward and
forward+backward through autograd, for torch SDPA (whatever backend torch picks), qattn with the paper's split
(QKᵀ, dS·K, dSᵀ·Q NVFP4; includes quantizing Q/K), and qattn with all six roles BF16 (the same Triton kernels
without FP4: separates the kernels' quality from the cost of FP4). FLOPs: causal forward 2·B·H·T²·d (half of
4·B·H·T²·d), backward 2.5× forward; TFLOP/s are against the 790 TFLOP/s BF16 matmul rate measured on this GPU.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fp4compile.ops  # noqa: E402,F401
from fp4compile.kernels import attention as A  # noqa: E402
from fp4compile.kernels import attention_ref as R  # noqa: E402
from fp4compile.passes.attention import qattn_sdpa  # noqa: E402
from bench.timing import host_us, kernel_table  # noqa: E402

CEILING = 790.0
#: forward + backward FLOPs over forward FLOPs (the backward counts as 2.5 forwards)
FB_FACTOR = 3.5
LOG = []


def causal_fwd_flops(bh: int, T: int, d: int) -> float:
    """FLOPs of a causal attention forward as the tables count them: half of 4·BH·T²·d."""
    return 2.0 * bh * T * T * d


def say(*a):
    line = " ".join(str(x) for x in a)
    print(line, flush=True)
    LOG.append(line)


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def check(mask, causal, B, H, Hkv, T, D, mk=None):
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, H, T, D, device=dev, generator=g).bfloat16()
    k = torch.randn(B, Hkv, T, D, device=dev, generator=g).bfloat16()
    v = torch.randn(B, Hkv, T, D, device=dev, generator=g).bfloat16()
    do = torch.randn(B, H, T, D, device=dev, generator=g).bfloat16()
    am = None
    if mk:
        keep = torch.rand(B, 1, T, T, device=dev, generator=g) > 0.3
        keep[..., 0] = True
        am = keep if mk == "bool" else torch.where(keep, torch.randn(keep.shape, device=dev, generator=g),
                                                   torch.full(keep.shape, -1e4, device=dev))
    sc = 1 / math.sqrt(D)
    views = R.quantize_qkv(q, k, v, mask, quantize=A.quantize_2d)
    ref_views = R.quantize_qkv(q, k, v, mask)
    same = all(torch.equal(a, b) for a, b in zip(views, ref_views))
    o, lse = A.attention_fwd(q, k, v, views, am, causal, sc, mask)
    o64, l64 = R.attention_fwd_ref(q, k, v, views, am, causal, sc, mask, out_dtype=torch.float64)
    opt, lpt = R.attention_fwd_ref(q, k, v, views, am, causal, sc, mask, dtype=torch.float32, emulate_bf16=True)
    gr = A.attention_bwd(do, q, k, v, views, o, lse, am, causal, sc, mask)
    g64 = R.attention_bwd_ref(do, q, k, v, views, o64, l64, am, causal, sc, mask, out_dtype=torch.float64)
    gpt = R.attention_bwd_ref(do, q, k, v, views, opt, lpt, am, causal, sc, mask, dtype=torch.float32,
                              emulate_bf16=True)
    ok = same and (lse.double() - l64).abs().max().item() < 1e-4
    parts = []
    for name, a, b, c in [("O", o, opt, o64)] + list(zip(("dQ", "dK", "dV"), gr, gpt, g64)):
        ek, ep = rel(a, c), rel(b, c)
        ok &= ek <= 2 * ep + 1e-3
        parts.append(f"{name} {ek:.4f}/{ep:.4f}")
    say(f"check roles={mask:06b} causal={causal} B{B} H{H}/{Hkv} T{T} d{D} mask={mk}: quant2d==ref {same}; "
        f"kernel/pt rel err: {', '.join(parts)} -> {'PASS' if ok else 'FAIL'}")
    if mask == 0 and mk is None:  # all-BF16 roles vs torch SDPA
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = qattn_sdpa(*leaves, is_causal=causal, enable_gqa=H != Hkv, fp4_roles=0)
        gq = torch.autograd.grad(out, leaves, do)
        sd = [t.clone().requires_grad_() for t in (q, k, v)]
        so = F.scaled_dot_product_attention(*sd, is_causal=causal, enable_gqa=H != Hkv)
        gs = torch.autograd.grad(so, sd, do)
        s64 = [t.double().requires_grad_() for t in (q, k, v)]
        o_64 = R.sdpa_math_ref(*s64, is_causal=causal)
        g_64 = torch.autograd.grad(o_64, s64, do.double())
        errs = [(rel(out, o_64), rel(so, o_64))] + [(rel(a, c), rel(b, c)) for a, b, c in zip(gq, gs, g_64)]
        ok2 = all(a <= 2 * b + 1e-3 for a, b in errs)
        say("check bf16 roles vs SDPA (qattn/sdpa rel err vs fp64): "
            + ", ".join(f"{n} {a:.4f}/{b:.4f}" for n, (a, b) in zip(("O", "dQ", "dK", "dV"), errs))
            + f" -> {'PASS' if ok2 else 'FAIL'}")
        ok &= ok2
    return ok


DEV = "cuda"
TINY: dict = {}  # --dry: small shapes


def bench_one(fn, warmup=3, rep=20):
    if DEV == "cpu":  # --dry: exercise the code paths only
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def _cfg(bm, bn, w, st, maxnreg=0):
    return dict(BM=bm, BN=bn, num_warps=w, num_stages=st, **({"maxnreg": maxnreg} if maxnreg else {}))


#: the sweep: forward configs per head dim (bf16 roles; the QK-in-NVFP4 forward is the same kernel plus two
#: scalar loads), backward (dkdv, dq) pairs per (head dim, dS in NVFP4); the first entry is the current default
SWEEP = {
    ("fwd", 64): [_cfg(128, 64, 8, 3), _cfg(128, 64, 8, 4), _cfg(64, 64, 4, 3), _cfg(64, 64, 4, 4),
                  _cfg(128, 64, 4, 4), _cfg(128, 32, 4, 3)],
    ("fwd", 128): [_cfg(128, 64, 8, 3), _cfg(128, 64, 8, 4), _cfg(64, 64, 4, 3), _cfg(64, 64, 4, 4),
                   _cfg(128, 64, 4, 3), _cfg(128, 32, 4, 3)],
    ("bwd", 64, False): [(_cfg(64, 64, 4, 2), _cfg(64, 64, 4, 2)), (_cfg(32, 128, 4, 3), _cfg(128, 32, 4, 3)),
                         (_cfg(64, 128, 8, 2), _cfg(128, 64, 8, 2)), (_cfg(64, 64, 4, 3), _cfg(64, 64, 4, 3)),
                         (_cfg(64, 128, 4, 2), _cfg(128, 64, 4, 2))],
    ("bwd", 128, False): [(_cfg(64, 64, 4, 2), _cfg(64, 64, 4, 2)), (_cfg(64, 64, 8, 2), _cfg(64, 64, 8, 2)),
                          (_cfg(64, 64, 4, 3), _cfg(64, 64, 4, 3)), (_cfg(64, 128, 8, 2), _cfg(128, 64, 8, 2)),
                          (_cfg(32, 128, 4, 2), _cfg(128, 32, 4, 2))],
    # dS in NVFP4: the contraction side is DS_TILE (64); the other side holds one or two 64x64 scale tiles
    # (the default: both at 2 stages, dK/dV capped at 168 registers, 3 programs per SM instead of 2; dQ at 128, 4 per SM
    # instead of 3; see attention.py)
    ("bwd", 64, True): [(_cfg(64, 64, 4, 2, 168), _cfg(64, 64, 4, 2, 128)),
                        (_cfg(64, 64, 4, 3, 168), _cfg(64, 64, 4, 2, 128)), (_cfg(64, 64, 4, 3), _cfg(64, 64, 4, 3)),
                        (_cfg(64, 64, 4, 2), _cfg(64, 64, 4, 2)),
                        (_cfg(64, 64, 4, 4), _cfg(64, 64, 4, 4)), (_cfg(64, 128, 4, 2), _cfg(128, 64, 4, 2)),
                        (_cfg(64, 128, 4, 3), _cfg(128, 64, 4, 3))],
    ("bwd", 128, True): [(_cfg(64, 64, 4, 2), _cfg(64, 64, 4, 2)), (_cfg(64, 64, 4, 3), _cfg(64, 64, 4, 3)),
                         (_cfg(64, 128, 4, 2), _cfg(128, 64, 4, 2)), (_cfg(64, 128, 8, 2), _cfg(128, 64, 8, 2))],
}


def _jobs():
    """(kind, D, mask, fwd config, bwd config) of every kernel the sweep and the table launch."""
    jobs = []
    for (kind, D, *rest), cfgs in SWEEP.items():
        for c in cfgs:
            if kind == "fwd":
                jobs += [("fwd", D, 0, c, None), ("fwd", D, R.PAPER_ROLES, c, None)]
            else:
                jobs.append(("bwd", D, R.PAPER_ROLES if rest[0] else 0, None, {"dkdv": c[0], "dq": c[1]}))
    ops = [("op", D, m, None, None) for D in (64, 128) for m in (0, R.PAPER_ROLES)]
    return ops if os.environ.get("ATTN_JOBS") == "op" else ops + jobs  # ATTN_JOBS=op: the defaults only


def _inputs(B, H, T, D, mask, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    q, k, v, do = (torch.randn(B, H, T, D, device=DEV, generator=g).bfloat16() for _ in range(4))
    views = R.quantize_qkv(q, k, v, mask, quantize=A.quantize_2d)
    return q, k, v, do, views


def compile_worker(spec):
    """Run every job i with i % N == I once on B=1, H=16, T=256 (same specialization as the timed shapes)."""
    I, N = (int(x) for x in spec.split("/"))
    t0 = time.time()
    for j, (kind, D, mask, fc, bc) in enumerate(_jobs()):
        if j % N != I:
            continue
        try:
            q, k, v, do, views = _inputs(1, 16, 256, D, mask) if DEV == "cuda" else _inputs(1, 2, 64, D, mask)
            if kind == "op":  # the op path's own launches (fused quantize, backward prep), default configs
                leaves = [t.requires_grad_() for t in (q, k, v)]
                torch.autograd.grad(qattn_sdpa(*leaves, is_causal=True, fp4_roles=mask), leaves, do)
                continue
            o, lse = A.attention_fwd(q, k, v, views, None, True, D ** -0.5, mask, config=fc)
            if kind == "bwd":
                A.attention_bwd(do, q, k, v, views, o, lse, None, True, D ** -0.5, mask, config=bc)
        except Exception as e:
            print(f"worker {I}: job {kind} D{D} mask{mask} {fc or bc} failed: {type(e).__name__}: {e}", flush=True)
    if DEV == "cuda":
        torch.cuda.synchronize()
    print(f"worker {I}/{N} done in {time.time() - t0:.0f} s", flush=True)


def sweep(results, Ts=(1024, 2048, 4096), budget_s=80.0, B=4, H=16):
    """Kernel-level times of SWEEP; sets A.FWD_CONFIGS / A.BWD_CONFIGS to the fastest valid entries."""
    t0 = time.time()
    if DEV == "cpu":
        Ts = (128,)
    out = results.setdefault("sweep", [])
    tot = {}
    for (kind, D, *rest), cfgs in SWEEP.items():
        mask = R.PAPER_ROLES if rest and rest[0] else 0
        for T in Ts:
            if time.time() - t0 > budget_s:
                say(f"sweep: time budget reached, skipping {kind} D{D} T{T}")
                continue
            q, k, v, do, views = _inputs(B, H, T, D, mask)
            sc = D ** -0.5
            ref = None
            for ci, c in enumerate(cfgs):
                try:
                    if kind == "fwd":
                        fn = lambda: A.attention_fwd(q, k, v, views, None, True, sc, mask, config=c)  # noqa: E731
                        res = fn()[0]
                    else:
                        o, lse = A.attention_fwd(q, k, v, views, None, True, sc, mask)
                        bc = {"dkdv": c[0], "dq": c[1]}
                        fn = lambda: A.attention_bwd(do, q, k, v, views, o, lse, None, True, sc, mask,  # noqa: E731
                                                     config=bc)
                        res = torch.cat([t.flatten() for t in fn()])
                    if ref is None:
                        ref = res
                    err = rel(res, ref)
                    ms = bench_one(fn, rep=40)
                    ok = err < 2e-2
                    key = (kind, D, mask, ci)
                    if ok:
                        tot[key] = tot.get(key, 0.0) + ms
                    else:
                        tot[key] = float("inf")
                    fl = 2.0 * B * H * T * T * D * (1.0 if kind == "fwd" else 2.5)
                    say(f"sweep {kind} D{D} roles={mask:06b} T{T} cfg{ci} {c}: {ms:.3f} ms "
                        f"({fl / ms / 1e9:.0f} TFLOP/s), rel diff vs cfg0 {err:.1e}{'' if ok else ' INVALID'}")
                    out.append(dict(kind=kind, D=D, roles=mask, T=T, cfg=ci, config=c, ms=ms, rel_vs_cfg0=err))
                except Exception as e:
                    tot[(kind, D, mask, ci)] = float("inf")
                    say(f"sweep {kind} D{D} T{T} cfg{ci} {c} failed: {type(e).__name__}: {str(e)[:300]}")
            del q, k, v, do, views
    best = {}
    for (kind, D, mask, ci), t in tot.items():
        if t < float("inf") and ((kind, D, mask) not in best or t < best[(kind, D, mask)][1]):
            best[(kind, D, mask)] = (ci, t)
    for (kind, D, mask), (ci, t) in sorted(best.items()):
        c = SWEEP[(kind, D) if kind == "fwd" else (kind, D, bool(mask))][ci]
        say(f"sweep choice {kind} D{D} roles={mask:06b}: cfg{ci} {c} (sum over T {t:.3f} ms)")
        if kind == "fwd":
            A.FWD_CONFIGS[D] = dict(c)
        else:
            A.BWD_CONFIGS[(D, bool(mask))] = {"dkdv": dict(c[0]), "dq": dict(c[1])}
    results["chosen"] = {"fwd": {str(k): v for k, v in A.FWD_CONFIGS.items()},
                         "bwd": {str(k): v for k, v in A.BWD_CONFIGS.items()}}
    say(f"sweep done in {time.time() - t0:.0f} s")


def host_overhead(results):
    """CPU time per call (no sync: launches queue up, so this is the host cost) and kernels per call."""
    B, H, T, D = 4, 16, 1024, 64
    q, k, v, do = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    impls = {"sdpa": lambda *a: F.scaled_dot_product_attention(*a, is_causal=True),
             "qattn paper": lambda *a: qattn_sdpa(*a, is_causal=True, fp4_roles=R.PAPER_ROLES),
             "qattn bf16": lambda *a: qattn_sdpa(*a, is_causal=True, fp4_roles=0)}
    out = results.setdefault("host", {})
    fns = {}
    for name, f in impls.items():
        def fwd(f=f):
            with torch.no_grad():
                f(q, k, v)

        def fb(f=f):
            o = f(*leaves)
            torch.autograd.grad(o, leaves, do)
        fns[name] = (("fwd", fwd), ("fwd+bwd", fb))
    for name, pair in fns.items():  # host time first, for every impl (the profiler below comes last)
        row = out.setdefault(name, {})
        for lab, fn in pair:
            row[lab + " host us"] = host_us(fn, 30)
    for name, pair in fns.items():
        row = out[name]
        for lab, fn in pair:
            try:
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    fn()
                    torch.cuda.synchronize()
                row[lab + " kernels"] = sum(1 for e in prof.events() if e.device_type.name == "CUDA")
            except Exception as e:
                row[lab + " kernels"] = f"n/a ({type(e).__name__})"
        say(f"host T{T} d{D} {name}: " + ", ".join(f"{a} {b:.0f}" if isinstance(b, float) else f"{a} {b}"
                                                   for a, b in row.items()))


def host_breakdown(results, T=1024, D=64):
    """Host (CPU) microseconds per call of each piece of the op path (no sync; launches queue up)."""
    B, H = 4, 16
    sc = D ** -0.5
    q, k, v, do = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    P = R.PAPER_ROLES
    (qc, qs, qg, qd), (kc, ks, kg, kd) = A.quantize_many([q, k], [True, True])
    e = torch.empty(0, dtype=torch.uint8, device="cuda")
    views = R.QuantizedQKV(qc, qs, qg, kc, ks, kg, e, e, torch.zeros((), device="cuda"))
    o, lse = A.attention_fwd(q, k, v, views, None, True, sc, P, dequantized={"q": qd, "k": kd})
    views0 = R.quantize_qkv(q, k, v, 0)
    pieces = {
        "torch.empty": lambda: torch.empty((B, H, T, D), dtype=torch.bfloat16, device="cuda"),
        "quantize_many(q, k)": lambda: A.quantize_many([q, k], [True, True]),
        "attention_fwd paper (kernel only)": lambda: A.attention_fwd(q, k, v, views, None, True, sc, P,
                                                                     dequantized={"q": qd, "k": kd}),
        "attention_fwd bf16": lambda: A.attention_fwd(q, k, v, views0, None, True, sc, 0),
        "op qattn paper": lambda: torch.ops.fp4compile.qattn(q, k, v, None, True, sc, P),
        "op qattn bf16": lambda: torch.ops.fp4compile.qattn(q, k, v, None, True, sc, 0),
        "qattn_sdpa paper (eager path)": lambda: qattn_sdpa(q, k, v, is_causal=True, fp4_roles=P),
        "qattn_sdpa bf16 (eager path)": lambda: qattn_sdpa(q, k, v, is_causal=True, fp4_roles=0),
        "bwd prep (delta + deq q, k)": lambda: A._bwd_prep(do, o, [(qc, qs), (kc, ks)]),
        "attention_bwd paper": lambda: A.attention_bwd(do, None, None, v, views, o, lse, None, True, sc, P),
        "attention_bwd bf16": lambda: A.attention_bwd(do, q, k, v, views0, o, lse, None, True, sc, 0),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    }
    out = results.setdefault("host_breakdown", {})
    with torch.no_grad():
        for name, fn in pieces.items():
            try:
                us = out[name] = host_us(fn, 40)
                say(f"host us/call T{T} d{D}: {name}: {us:.1f}")
            except Exception as ex:
                say(f"host {name} failed: {type(ex).__name__}: {str(ex)[:200]}")


def kernel_profile(results, T=4096, B=4, H=16, steps=5):
    """Device time per kernel of one forward+backward (torch.profiler, ``steps`` calls after a warm-up) for SDPA
    and the two Q-Attn splits at T, d = 64 and 128: where the paper split's time goes, kernel by kernel."""
    from torch.profiler import ProfilerActivity, profile

    out = results.setdefault("kernel_profile", {})
    for D in (64, 128):
        q, k, v, do = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        impls = {
            "sdpa": lambda *a: F.scaled_dot_product_attention(*a, is_causal=True),
            "qattn paper": lambda *a: qattn_sdpa(*a, is_causal=True, fp4_roles=R.PAPER_ROLES),
            "qattn bf16": lambda *a: qattn_sdpa(*a, is_causal=True, fp4_roles=0),
        }
        for name, f in impls.items():
            def fb():
                return torch.autograd.grad(f(*leaves), leaves, do)
            fb()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(steps):
                    fb()
                torch.cuda.synchronize()
            table = kernel_table(prof, steps, top=8)
            out[f"{name} T{T} d{D}"] = table
            say(f"kernels, {name}, fwd+bwd, T{T} d{D}:\n" + table)
        del q, k, v, do, leaves


def _graphed(fn):
    """fn captured in a CUDA graph (host overhead removed); None if capture fails."""
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return g.replay
    except Exception as e:
        say(f"graph capture failed: {type(e).__name__}: {str(e)[:200]}")
        return None


def bench(results, quick=False, graphed=False, B=4, H=16):
    """The issue's grid, op level (qattn_sdpa through the custom op and its autograd); ``graphed``: each call
    captured in a CUDA graph and replayed (device time without the host's launch overhead), vs SDPA likewise."""
    rows = results.setdefault("table_graphed" if graphed else "table", [])
    Ts = (1024, 2048) if quick else (1024, 2048, 4096)
    if DEV == "cpu":
        Ts = (64,)
    for D in (64, 128):
        for T in Ts:
            q, k, v, do = (torch.randn(B, H, T, D, device=DEV, dtype=torch.bfloat16) for _ in range(4))
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            fl_f = causal_fwd_flops(B * H, T, D)
            fl_fb = fl_f * FB_FACTOR
            res = {}
            impls = {
                "sdpa": lambda *a: F.scaled_dot_product_attention(*a, is_causal=True),
                "qattn paper": lambda *a: qattn_sdpa(*a, is_causal=True, fp4_roles=R.PAPER_ROLES),
                "qattn bf16": lambda *a: qattn_sdpa(*a, is_causal=True, fp4_roles=0),
            }
            for name, f in impls.items():
                try:
                    def fw():
                        with torch.no_grad():
                            return f(q, k, v)

                    def fb():
                        out = f(*leaves)
                        return torch.autograd.grad(out, leaves, do)
                    if graphed:  # second pass: host overhead removed (captured once, replayed)
                        gf, gfb = _graphed(fw), _graphed(fb)
                        if gf is None or gfb is None:
                            continue
                        fw, fb, name = gf, gfb, name + " (CUDA graph)"
                    tf, tfb = bench_one(fw), bench_one(fb)
                    res[name] = (tf, tfb)
                except Exception as e:  # report and continue
                    say(f"bench {name} T{T} d{D} failed: {type(e).__name__}: {str(e)[:300]}")
            for name, (tf, tfb) in res.items():
                base = "sdpa (CUDA graph)" if name.endswith("(CUDA graph)") else "sdpa"
                sf = res.get(base, (float("nan"),) * 2)
                rows.append(dict(impl=name, T=T, D=D, fwd_ms=tf, fwd_tflops=fl_f / tf / 1e9, fwd_vs_sdpa=sf[0] / tf,
                                 fb_ms=tfb, fb_tflops=fl_fb / tfb / 1e9, fb_vs_sdpa=sf[1] / tfb))
                r = rows[-1]
                say(f"| {name} | {T} | {D} | {tf:.3f} | {r['fwd_tflops']:.0f} ({100 * r['fwd_tflops'] / CEILING:.0f}%)"
                    f" | {r['fwd_vs_sdpa']:.2f}x | {tfb:.3f} | {r['fb_tflops']:.0f} "
                    f"({100 * r['fb_tflops'] / CEILING:.0f}%) | {r['fb_vs_sdpa']:.2f}x |")
            del q, k, v, do, leaves


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--phase", default="all", choices=["checks", "sweep", "table", "profile", "all"])
    ap.add_argument("--json", default=None, help="write the measurements here")
    ap.add_argument("--quick", action="store_true", help="table at T in {1024, 2048} only")
    ap.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph timings")
    ap.add_argument("--compile-worker", default=None, metavar="I/N")
    ap.add_argument("--sweep-budget", type=float, default=80.0)
    ap.add_argument("--all-checks", action="store_true", help="also the additive-mask dO-in-NVFP4 case")
    ap.add_argument("--dry", action="store_true", help="CPU + TRITON_INTERPRET=1, tiny shapes: code paths only")
    args = ap.parse_args()
    import signal

    signal.signal(signal.SIGTERM, lambda *a: sys.exit(124))  # `timeout`: still write the JSON (finally below)
    global DEV
    if args.dry:
        DEV = "cpu"
        TINY.update(B=1, H=2)
        import triton.runtime.interpreter as interp
        orig = interp._patch_lang_tensor

        def patched(tensor, scope):  # Triton 3.6's interpreter calls int() on 1-element arrays; numpy >= 2.4 refuses
            orig(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
        interp._patch_lang_tensor = patched
    if args.compile_worker:
        compile_worker(args.compile_worker)
        return
    dev_name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (dry run)"
    say(torch.__version__, dev_name, "triton", __import__("triton").__version__)
    t0 = time.time()
    results = {"device": dev_name, "torch": torch.__version__}
    try:
        if args.phase in ("checks", "all"):
            ok = True
            for cfg in [(R.PAPER_ROLES, True, 2, 4, 2, 300, 64, None), (63, False, 1, 2, 2, 200, 128, "bool"),
                        (0, True, 2, 4, 2, 257, 128, None), (R.PAPER_ROLES, True, 1, 2, 2, 1024, 128, None)] + (
                        [(R.PDO | R.DOV | R.QK, False, 1, 2, 1, 130, 64, "add")] if args.all_checks else []):
                try:
                    ok &= check(*cfg)
                except Exception:
                    ok = False
                    say("check", cfg, "raised:", traceback.format_exc()[-1500:])
            try:
                q, k, v = (torch.randn(1, 2, 80, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                           for _ in range(3))
                torch.library.opcheck(torch.ops.fp4compile.qattn.default, (q, k, v, None, True, 0.125, R.PAPER_ROLES))
                say("opcheck qattn cuda: PASS")
            except Exception:
                ok = False
                say("opcheck qattn cuda: FAIL", traceback.format_exc()[-1500:])
            results["checks_pass"] = bool(ok)
            say(f"checks {'ALL PASS' if ok else 'SOME FAILED'} ({time.time() - t0:.0f} s)")
        if args.phase in ("sweep", "all"):
            sweep(results, budget_s=args.sweep_budget, **TINY)
            if DEV == "cuda":
                host_breakdown(results)
        if args.phase == "table" and DEV == "cuda":
            host_breakdown(results)
        if args.phase in ("table", "sweep", "all"):
            say(f"| impl | T | d | fwd ms | fwd TFLOP/s (% of {CEILING:.0f}) | fwd vs SDPA | fwd+bwd ms | "
                "fwd+bwd TFLOP/s (%) | fwd+bwd vs SDPA |")
            say("|---|---|---|---|---|---|---|---|---|")
            bench(results, args.quick, **TINY)
            if not args.no_graphs and DEV == "cuda":
                say("CUDA-graph replays (device time, no host overhead):")
                bench(results, args.quick, graphed=True)
            if DEV == "cuda":  # last: the profiler (kernel counts) may leave CUPTI hooks that slow later launches
                host_overhead(results)
        if args.phase == "profile" and DEV == "cuda":
            kernel_profile(results)
    finally:
        say(f"total {time.time() - t0:.0f} s")
        if args.json:
            import json
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
