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
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fp4compile.optim.study import NS_VARIANTS, ns_error_table  # noqa: E402
from fp4compile.policy import NVFP4  # noqa: E402

#: the shapes of docs/OPTIM.md's first table, then the 30M preset's four block shapes as QRoot sees them
DEFAULT_SHAPES = "64x256,128x128,128x512,256x256,256x1024,1920x640,640x640,3584x640,640x1792"


def _mean(values):
    finite = [v for v in values if math.isfinite(v)]
    return statistics.fmean(finite) if len(finite) == len(values) else math.inf


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma-separated MxN (default: %(default)s)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--four-over-six", action="store_true", help="NVFP4 operands with 4/6 (default: RTN 1x16)")
    args = ap.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    spec = NVFP4("rtn", four_over_six=args.four_over_six)
    t0 = time.time()
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
