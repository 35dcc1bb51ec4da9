"""Q-Root NVFP4 Newton–Schulz: batched stack path vs the per-matrix loop vs BF16 NS (issue 5).

    python bench/ns_batched.py --set 124M          # H200: error study + per-shape timing on GPT-124M shapes
    python bench/ns_batched.py --tiny              # CPU smoke run (seconds)

Sections (each guarded; rows printed as they finish, JSON with --out):
1. ``check``: on the bench's stacks, the batched product (dequantize_blocks + one FP32 bmm) vs one
   ``fp4compile::gemm`` per matrix on the same per-stack-quantized operands (max |diff| relative to max |ref|,
   FP32 outputs), and the full 5-step NS of both.
2. ``error``: relative Frobenius error of the NS output vs an FP64 NS with the same coefficients, per matrix,
   for BF16 NS, NVFP4 with per-matrix global scales (the old loop, ``_ns_nvfp4_one``) and NVFP4 with
   per-stack global scales (the batched path). Inputs: momentum-like matrices (``study.momentum_like``) of
   a different scale and column profile per layer, clipped at their p99 as ``QRoot.orthogonalize`` does.
3. ``time``: CUDA-event median ms of ``newton_schulz`` per stacked shape (BF16, NVFP4 batched, NVFP4 loop),
   plus the batched path replayed from a CUDA graph (the device-time floor without host launch overhead).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from fp4compile.optim.root import (_bgemm_nvfp4, _loop_gemm_nvfp4, _ns_nvfp4_one, _ns_nvfp4_stack,  # noqa: E402
                                   _q_stack, abs_quantile, newton_schulz, ns_coefficients)
from fp4compile.optim import root as _root  # noqa: E402
from fp4compile.optim.study import momentum_like  # noqa: E402
from fp4compile.policy import NVFP4  # noqa: E402

SETS = {"124M": dict(d=768, layers=12), "1B": dict(d=2048, layers=18), "tiny": dict(d=64, layers=3)}


def hidden_shapes(d):
    return [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)]


def make_stack(shape, layers, device, seed=0):
    """Clipped momentum-like stack [layers, m, n] (per-layer scale 10^U(-2, 1) and column-profile decay)."""
    gen = torch.Generator().manual_seed(seed)
    mats = []
    for i in range(layers):
        decay = float(torch.rand((), generator=gen)) * 2
        scale = 10.0 ** float(torch.empty(()).uniform_(-2, 1, generator=gen))
        mats.append(momentum_like(*shape, seed=seed * 1000 + i, decay=decay) * scale)
    G = torch.stack(mats).to(device)
    eps = abs_quantile(G.reshape(layers, -1), 0.99) + 1e-9
    return torch.maximum(torch.minimum(G, eps.view(-1, 1, 1)), -eps.view(-1, 1, 1))


def prep(G):
    """newton_schulz's preprocessing: BF16, short side first, Frobenius-normalized."""
    X = G.to(torch.bfloat16)
    if X.shape[-2] > X.shape[-1]:
        X = X.mT
    return (X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)).contiguous()


def ns_f64(X, coeffs):
    X = X.double()
    for a, b, c in coeffs:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X


def loop_ns(X, coeffs, spec):
    return torch.stack([_ns_nvfp4_one(X[i], coeffs, spec, None, None) for i in range(X.shape[0])])


def median_ms(fn, iters, device):
    fn()
    if device.type != "cuda":
        ts = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e3)
        return statistics.median(ts)
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts)


def section_check(stacks, spec, rows):
    for shape, G in stacks.items():
        X = prep(G)
        coeffs = ns_coefficients(shape, 5, "root")
        qx = _q_stack(X, spec, None)
        qt = _q_stack(X.mT.contiguous(), spec, None)
        d = []
        for qa, qb in ((qx, qx), (qt, qt)):
            a, b = _bgemm_nvfp4(qa, qb, torch.float32), _loop_gemm_nvfp4(qa, qb, torch.float32)
            d.append(float((a - b).abs().max() / b.abs().max()))
        o1 = _ns_nvfp4_stack(X, coeffs, spec, None, None)
        o2 = _ns_nvfp4_stack(X, coeffs, spec, None, None, product=_loop_gemm_nvfp4)
        rows.append(dict(section="check", shape=str(shape), prod_xxt_maxdiff_rel=d[0], prod_xtx_maxdiff_rel=d[1],
                         ns_bitexact=bool(torch.equal(o1, o2)),
                         ns_reldiff=float((o1.float() - o2.float()).norm() / o2.float().norm())))


def section_error(stacks, spec, rows):
    for shape, G in stacks.items():
        X = prep(G)
        coeffs = ns_coefficients(shape, 5, "root")
        ref = ns_f64(X, coeffs)
        outs = {"bf16": newton_schulz(X, coeffs), "nvfp4_matrix_global": loop_ns(X, coeffs, spec),
                "nvfp4_stack_global": _ns_nvfp4_stack(X, coeffs, spec, None, None)}
        row = dict(section="error vs fp64 NS", shape=str(shape), S=X.shape[0],
                   amax_spread=float(X.abs().amax(dim=(-2, -1)).max() / X.abs().amax(dim=(-2, -1)).min()))
        for k, o in outs.items():
            e = ((o.double() - ref).norm(dim=(-2, -1)) / ref.norm(dim=(-2, -1))).cpu()
            row[f"{k}_mean"], row[f"{k}_max"] = float(e.mean()), float(e.max())
        rows.append(row)


def section_time(stacks, spec, rows, device, iters, loop_iters):
    tot = {"bf16": 0.0, "batched": 0.0, "loop": 0.0, "graph": 0.0}
    for shape, G in stacks.items():
        coeffs = ns_coefficients(shape, 5, "root")
        r = dict(section="NS time ms", shape=str(tuple(G.shape)))
        r["bf16"] = median_ms(lambda: newton_schulz(G, coeffs), iters, device)
        r["batched"] = median_ms(lambda: newton_schulz(G, coeffs, spec=spec), iters, device)
        if loop_iters:
            X = prep(G)
            r["loop"] = median_ms(lambda: loop_ns(X, coeffs, spec), loop_iters, device)
        if device.type == "cuda":
            try:
                static = G.clone()
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    for _ in range(2):
                        newton_schulz(static, coeffs, spec=spec)
                torch.cuda.current_stream().wait_stream(s)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = newton_schulz(static, coeffs, spec=spec)
                ref = newton_schulz(static, coeffs, spec=spec)
                graph.replay()
                torch.cuda.synchronize()
                r["graph_equal"] = bool(torch.equal(out, ref))
                r["graph"] = median_ms(graph.replay, iters, device)
            except Exception as e:  # report, keep going
                r["graph_error"] = f"{type(e).__name__}: {e}"[:200]
        for k in tot:
            if k in r:
                tot[k] += r[k]
        r["batched_vs_bf16"] = r["bf16"] / r["batched"]
        rows.append(r)
    rows.append(dict(section="NS time ms (sum of shapes)", **{k: v for k, v in tot.items() if v},
                     batched_vs_bf16=tot["bf16"] / tot["batched"],
                     **({"batched_vs_loop": tot["loop"] / tot["batched"]} if tot["loop"] else {}),
                     bmm_out_dtype_f32=device.type == "cuda"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", default="124M", choices=sorted(SETS))
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run (the 'tiny' set on CPU)")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: check,error,time,loop")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    cfg = SETS["tiny" if args.tiny else args.set]
    skip = set(filter(None, args.skip.split(",")))
    spec = NVFP4()
    stacks = {s: make_stack(s, cfg["layers"], device, seed=j) for j, s in enumerate(hidden_shapes(cfg["d"]))}
    rows = []
    jobs = [("check", lambda: section_check(stacks, spec, rows)),
            ("error", lambda: section_error(stacks, spec, rows)),
            ("time", lambda: section_time(stacks, spec, rows, device, args.iters if not args.tiny else 2,
                                          0 if "loop" in skip else (3 if not args.tiny else 1)))]
    for name, job in jobs:
        if name in skip:
            continue
        t, n0 = time.perf_counter(), len(rows)
        try:
            job()
        except Exception as e:
            traceback.print_exc()
            rows.append(dict(section=name, error=f"{type(e).__name__}: {e}"))
        for r in rows[n0:]:
            print("[row] " + " | ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                        for k, v in r.items()), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
        print(f"[bench/ns_batched] {name}: {time.perf_counter() - t:.1f}s", flush=True)


if __name__ == "__main__":
    main()
