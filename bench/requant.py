"""The backward's requantization of a forward FP4 copy along its other dim (issue 3, session 27).

Quartet II requantizes W (for dgrad) and X (for wgrad) from their forward FP4 copies, along the copy's other
dim, with MS-EDEN + RHT-128. Two ways to run ``quantize(dequantize(copy)^T)``:

* ``old``: ``dequantize`` to [R, C] bf16, then ``quantize(..., transpose=True)``, which makes a transposing copy
  [C, R] (``_transpose_kernel``) before its row-wise passes (the backend's graph until session 27);
* ``new``: ``dequantize(..., transpose=True)`` stores [C, R] directly, then the row-wise ``quantize``.

Both give the same bytes (checked here on every shape); this times each pair (CUDA graph of the pair, so launch
cost does not count; ``triton.testing.do_bench_cudagraph``, median) at the GPT-124M step's operand shapes (16,384
tokens, d = 768), and the transposed dequantization alone for a few tiles (``CONFIG["dt_*"]``) against the
row-major one and a bf16 copy of the same bytes.

    python bench/requant.py [--sweep]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from triton.testing import do_bench_cudagraph  # noqa: E402

from fp4compile.kernels import quantize as Q  # noqa: E402

#: (name, rows, cols) of the forward copies the 124M backward requantizes: X of c_attn/c_proj/c_fc (K = 768),
#: X of the MLP's c_proj (K = 3072), and the four weights
SHAPES = [("X d=768", 16384, 768), ("X d=3072", 16384, 3072), ("W c_attn", 2304, 768), ("W c_fc", 3072, 768),
          ("W mlp.c_proj", 768, 3072), ("W attn.c_proj", 768, 768)]
TILES = [(16, 128, 4), (32, 128, 4), (64, 128, 4), (64, 128, 8), (128, 128, 8), (128, 64, 4), (64, 64, 4)]


def ms(fn) -> float:
    return do_bench_cudagraph(fn, rep=40, return_mode="median")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also time the transposed dequantization per tile")
    args = ap.parse_args()
    print(torch.__version__, torch.cuda.get_device_name(), "CONFIG dt:", Q.CONFIG["dt_rows"], Q.CONFIG["dt_cols"],
          Q.CONFIG["dt_warps"])
    sg = Q.prepare_signs(None, 128, torch.device("cuda"))
    seed = torch.tensor(7, device="cuda")
    print("| copy | shape | old ms (deq + transposing quantize) | new ms (transposed deq + quantize) | new / old "
          "| same bytes |")
    print("|---|---|---|---|---|---|")
    tot_old = tot_new = 0.0
    for name, R, C in SHAPES:
        x = torch.randn(R, C, device="cuda", dtype=torch.bfloat16)
        c, s, g = Q.quantize(x, "rtn", four_over_six=True)

        def old():
            return Q.quantize(Q.dequantize(c, s, g), "ms_eden", hadamard=128, signs=sg, seed=seed, transpose=True)

        def new():
            return Q.quantize(Q.dequantize(c, s, g, transpose=True), "ms_eden", hadamard=128, signs=sg, seed=seed)

        same = all(torch.equal(a, b) for a, b in zip(old(), new()))
        t_old, t_new = ms(old), ms(new)
        tot_old, tot_new = tot_old + t_old, tot_new + t_new
        print(f"| {name} | {R}x{C} | {t_old:.4f} | {t_new:.4f} | {t_new / t_old:.3f} | {same} |", flush=True)
    print(f"| sum | | {tot_old:.4f} | {tot_new:.4f} | {tot_new / tot_old:.3f} | |")
    if args.sweep:
        print("\n| shape | tile (rows, cols, warps) | transposed deq ms | row-major deq ms | bf16 copy ms "
              "| copy / transposed |")
        print("|---|---|---|---|---|---|")
        for name, R, C in SHAPES[:2]:
            x = torch.randn(R, C, device="cuda", dtype=torch.bfloat16)
            c, s, g = Q.quantize(x)
            y = torch.empty_like(x)
            t_row = ms(lambda: Q.dequantize(c, s, g))
            t_copy = ms(lambda: y.copy_(x))
            ref = Q.dequantize(c, s, g).t()
            for br, bc, w in TILES:
                cfg = dict(Q.CONFIG, dt_rows=br, dt_cols=bc, dt_warps=w)
                ok = torch.equal(Q.dequantize(c, s, g, config=cfg, transpose=True), ref)
                t = ms(lambda: Q.dequantize(c, s, g, config=cfg, transpose=True))
                print(f"| {R}x{C} | {br}, {bc}, {w} | {t:.4f}{'' if ok else ' MISMATCH'} | {t_row:.4f} | "
                      f"{t_copy:.4f} | {t_copy / t:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
