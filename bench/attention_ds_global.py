"""What the power-of-two dS tile global costs in accuracy (CPU, float64; issue 4, session 21's change).

    python bench/attention_ds_global.py [--seeds 4]

The backward kernels scale each 64x64 tile of dS with s_enc = 2688/amax floored to a power of two
(``attention_ref.tile_scales``), so that the decode scale folds exactly into the BF16 operand. This script
isolates what that floor does to the quantization error: the float64 reference backward with only dS in NVFP4
(roles DSK | DSQ), once with the floored global and once with the exact quotient 2688/amax, each against the
exact float64 gradients (all roles BF16, no quantization). Prints each case's relative Frobenius errors of dQ and
dK (also with q scaled by 4: peaked softmax rows, a heavier-tailed dS) and their means; a ratio near 1 means the
floor costs nothing measurable.
"""
from __future__ import annotations

import argparse
import math
import statistics

import torch

from fp4compile.kernels import attention_ref as R

floored_tile_scales = R.tile_scales


def exact_tile_scales(x: torch.Tensor, tile: int = R.DS_TILE):
    """``attention_ref.tile_scales`` without the power-of-two floor (s_enc = 2688 / tile amax)."""
    return floored_tile_scales(x, tile, pow2=False)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def grads(q, k, v, do, causal, mask):
    sc = 1 / math.sqrt(q.shape[-1])
    views = R.quantize_qkv(q, k, v, mask)
    o, lse = R.attention_fwd_ref(q, k, v, views, None, causal, sc, mask, out_dtype=torch.float64)
    return R.attention_bwd_ref(do, q, k, v, views, o, lse, None, causal, sc, mask, out_dtype=torch.float64)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=4)
    args = ap.parse_args(argv)
    errs = {"floor": ([], []), "exact": ([], [])}
    print("| seed | T | d | causal | q scale | dQ floor | dQ exact | dK floor | dK exact |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for seed in range(args.seeds):
        for T, D, causal, qs in ((256, 64, True, 1), (320, 128, True, 1), (256, 64, False, 1), (256, 64, True, 4)):
            g = torch.Generator().manual_seed(seed)
            q, k, v, do = (torch.randn(1, 2, T, D, generator=g).bfloat16() for _ in range(4))
            q = q * qs  # qs = 4: peaked softmax rows, a heavier-tailed dS
            g0 = grads(q, k, v, do, causal, 0)
            row = {}
            for name, fn in (("floor", floored_tile_scales), ("exact", exact_tile_scales)):
                R.tile_scales = fn
                try:
                    gq = grads(q, k, v, do, causal, R.DSK | R.DSQ)
                finally:
                    R.tile_scales = floored_tile_scales
                row[name] = (rel(gq[0], g0[0]), rel(gq[1], g0[1]))
                errs[name][0].append(row[name][0])
                errs[name][1].append(row[name][1])
            print(f"| {seed} | {T} | {D} | {causal} | {qs} | {row['floor'][0]:.5f} | {row['exact'][0]:.5f} | "
                  f"{row['floor'][1]:.5f} | {row['exact'][1]:.5f} |")
    for i, n in ((0, "dQ"), (1, "dK")):
        f, e = statistics.mean(errs["floor"][i]), statistics.mean(errs["exact"][i])
        print(f"{n}: mean rel err, floored global {f:.5f}, exact global {e:.5f}, ratio {f / e:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
