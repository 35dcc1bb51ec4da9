"""Issue 5's Newton–Schulz numerics: each NS variant's error against the float64 polar factor, per matrix shape
(CPU, a few minutes).

    python bench/ns_error.py                        # the reference shapes and the 30M block shapes, 3 seeds
    python bench/ns_error.py --shapes 128x512,256x256 --seeds 1 --four-over-six

The issue asks for the orthogonalization error of NVFP4 NS against a float64 SVD-based polar factor, plain NVFP4
NS against shape-aware coefficients + clipping (the paper: ~10 % -> ~3 %), per shape. Inputs are
``fp4compile.optim.study.momentum_like`` matrices (Gaussian times a column profile plus outliers); the "+ clip"
variants get them clipped at ROOT's 0.99 quantile and are measured against the clipped matrix's polar factor,
which is what ROOT orthogonalizes. Variants: ``fp4compile.optim.study.NS_VARIANTS``. For each variant and shape
the script prints, averaged over the seeds (``fp4compile.optim.study.ns_error_parts``):

- ``polar``: ||O - P||_F / ||P||_F, the issue's measure;
- ``dir``: ||polar(O) - P||_F / ||P||_F, the error in O's singular vectors, which later NS steps cannot undo;
- ``sig``: max |sigma_i(O) - 1|, how far O is from orthogonal (small directions of G that did not converge).

A run whose error exceeds 10 (or is not finite) prints ``diverged`` with its polar error.

``--per-step`` prints instead where the direction error arises: for 7 Polar Express steps with the shift and the
guard (the best row above), per shape and step, how far that one NVFP4 step turned the iterate's singular vectors
(``fp4compile.optim.study.ns_step_increments``), with B of B·X in 1x16 and in 16x16 blocks, and with each of the
step's four quantized operands left exact in turn (which quantization turns them).

    python bench/ns_error.py --per-step --shapes 128x512,640x1792,1920x640

``--real`` measures QRoot's default NVFP4 NS and its ``ns_sym_b`` / ``ns_shared_x`` options (ROOT's coefficients,
5 steps, clip + guard + shift) on real momentum-like matrices instead: a tiny GPT's AdamW ``exp_avg`` of its block
weights after 400 steps on the shared corpus (``fp4compile.optim.study.tiny_gpt_momenta``), per weight kind, mean
over its layers and the seeds.

    python bench/ns_error.py --real --seeds 3
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fp4compile.optim.study import NS_VARIANTS, ns_error_table, momentum_like, ns_step_increments  # noqa: E402
from fp4compile.policy import NVFP4  # noqa: E402

#: the shapes of docs/OPTIM.md's first table, then the 30M preset's four block shapes as QRoot sees them
DEFAULT_SHAPES = "64x256,128x128,128x512,256x256,256x1024,1920x640,640x640,3584x640,640x1792"


def _mean(values):
    finite = [v for v in values if math.isfinite(v)]
    return statistics.fmean(finite) if len(finite) == len(values) else math.inf


def per_step(shapes, seeds, spec):
    """The ``--per-step`` table: per shape, each step's direction increment (mean over seeds) and the direction
    error after the last step, for B of B·X in 1x16 and in 16x16 blocks, and with one operand at a time left
    unquantized (``ns_step_increments``' ``exact``); then the iterate's singular-value range entering each step."""
    arms = {"all NVFP4": {}, "B in 16x16 blocks": dict(sym_b=True)}
    for name, label in (("xt", "Xᵀ of B·X"), ("b", "B of B·X"), ("x", "X of X Xᵀ"), ("e", "E of E²")):
        arms[f"{label} exact"] = dict(exact=(name,))
    print(f"Direction turned by each NVFP4 NS step (7 Polar Express steps, clip 0.99, guard 1.0, shift; {spec}), "
          f"mean of {seeds} seed(s); last column: the direction error after the last step")
    steps = 7
    print("| shape | operands | " + " | ".join(f"step {k}" for k in range(steps)) + " | total |")
    print("|" + "---|" * (steps + 3))
    for shape in shapes:
        runs = {name: [ns_step_increments(momentum_like(*shape, seed), steps, spec=spec, **kw)
                       for seed in range(seeds)] for name, kw in arms.items()}
        for name, rs in runs.items():
            cells = [statistics.fmean(r[k]["increment"] for r in rs) for k in range(steps)]
            total = statistics.fmean(r[-1]["cumulative"] for r in rs)
            print(f"| {shape[0]}x{shape[1]} | {name} | " + " | ".join(f"{v:.4f}" for v in cells) + f" | {total:.4f} |")
        rs = runs["all NVFP4"]
        lo = [statistics.fmean(r[k]["sigma_min"] for r in rs) for k in range(steps)]
        hi = [statistics.fmean(r[k]["sigma_max"] for r in rs) for k in range(steps)]
        print(f"| {shape[0]}x{shape[1]} | sigma in | " + " | ".join(f"{a:.2g}-{b:.2f}" for a, b in zip(lo, hi))
              + " | |", flush=True)


#: ``--real``'s arms: QRoot's default NVFP4 NS with its options (newton_schulz keywords), then the BF16 NS
REAL_ARMS = (("QRoot default", dict(spec=NVFP4(), shift=True)),
             ("+ ns_sym_b", dict(spec=NVFP4(), shift=True, sym_b=True)),
             ("+ ns_shared_x", dict(spec=NVFP4(), shift=True, shared_x=True)),
             ("+ ns_sym_b + ns_shared_x", dict(spec=NVFP4(), shift=True, sym_b=True, shared_x=True)),
             ("BF16 NS", {}))


def real(seeds):
    """The ``--real`` table: per block weight kind of the tiny GPT and arm, polar (dir, sig) against the polar factor
    of the clipped momentum, mean over the layers and ``seeds``."""
    from fp4compile.optim.root import clip_by_quantile, newton_schulz, ns_coefficients
    from fp4compile.optim.study import ns_error_parts, tiny_gpt_momenta

    acc, shapes = {}, {}
    for seed in range(seeds):
        for name, M in tiny_gpt_momenta(seed=seed).items():
            kind = name.split(".", 2)[-1]
            G = clip_by_quantile(M, 0.99)
            shapes[kind] = tuple(G.shape)
            coeffs = ns_coefficients(tuple(G.shape), 5, "root")
            for arm, kw in REAL_ARMS:
                parts = ns_error_parts(G, newton_schulz(G, coeffs, **kw).float())
                acc.setdefault((kind, arm), []).append(parts)
    kinds = sorted(shapes)
    print(f"NS error vs the float64 polar factor on a tiny GPT's momenta (d=128, 2 layers, 400 AdamW steps, clipped "
          f"at 0.99), mean over layers and {seeds} seed(s); each cell: polar (dir, sig)")
    print("| arm | " + " | ".join(f"{k} {shapes[k][0]}x{shapes[k][1]}" for k in kinds) + " |")
    print("|" + "---|" * (len(kinds) + 1))
    for arm, _ in REAL_ARMS:
        cells = []
        for k in kinds:
            p, d, s = (_mean([q[key] for q in acc[(k, arm)]]) for key in ("polar", "direction", "sigma"))
            cells.append(f"{p:.3f} ({d:.3f}, {s:.2f})")
        print(f"| {arm} | " + " | ".join(cells) + " |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated MxN (default: %(default)s)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--four-over-six", action="store_true", help="NVFP4 operands with 4/6 (default: RTN 1x16)")
    ap.add_argument("--per-step", action="store_true",
                    help="per NS step, how far it turned the singular vectors (instead of the variants' table)")
    ap.add_argument("--real", action="store_true",
                    help="QRoot's NVFP4 NS and its options on a tiny GPT's real momenta (instead of the variants' table)")
    args = ap.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    spec = NVFP4("rtn", four_over_six=args.four_over_six)
    t0 = time.time()
    if args.real:
        real(args.seeds)
        print(f"({time.time() - t0:.0f} s)")
        return
    if args.per_step:
        per_step(shapes, args.seeds, spec)
        print(f"({time.time() - t0:.0f} s)")
        return
    acc = {}
    for seed in range(args.seeds):
        for shape, name, parts in ns_error_table(shapes, seed=seed, spec=spec):
            for key, v in parts.items():
                acc.setdefault((name, shape, key), []).append(v)
    print(f"NS error vs the float64 polar factor, NVFP4 operands {spec}, mean of {args.seeds} seed(s); "
          "each cell: polar (dir, sig)")
    width = max(len(v[0]) for v in NS_VARIANTS)
    print("| variant".ljust(width + 2) + " | " + " | ".join(f"{m}x{n}" for m, n in shapes) + " |")
    print("|" + "---|" * (len(shapes) + 1))
    for name, *_ in NS_VARIANTS:
        cells = []
        for shape in shapes:
            p, d, s = (_mean(acc[(name, shape, k)]) for k in ("polar", "direction", "sigma"))
            if not math.isfinite(p) or p > 10:
                cells.append(f"diverged ({p:.1e})")
            else:
                cells.append(f"{p:.3f} ({d:.3f}, {s:.2f})")
        print(f"| {name.ljust(width)} | " + " | ".join(cells) + " |")
    print(f"({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
