"""A gradient's two MS-EDEN copies (issue 3, session 28): ``quantize_both`` against two ``quantize`` calls.

Quartet II quantizes dY twice in the backward, both times with MS-EDEN + RHT-128: along N (row-wise, for dgrad)
and along the tokens (transposed, for wgrad). ``quantize(x, transpose=True)`` makes a transposing copy of x
(``_transpose_kernel``, 2 bytes read and 2 written per element) before its row-wise passes; ``quantize_both``
has the row-wise pass 1 store that transpose instead (same bytes, checked here). Times both ways (CUDA graph,
``triton.testing.do_bench_cudagraph``, median) at the GPT-124M step's dY shapes (16,384 tokens), with a bf16
copy of the same tensor as the bandwidth yardstick.

    python bench/quantize_both.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from triton.testing import do_bench_cudagraph  # noqa: E402

from fp4compile.kernels import quantize as Q  # noqa: E402

#: (name, tokens, features) of the 124M step's output gradients: attn.c_attn (3·768), attn/mlp.c_proj (768),
#: mlp.c_fc (3072)
SHAPES = [("dY c_attn", 16384, 2304), ("dY c_proj", 16384, 768), ("dY c_fc", 16384, 3072)]


def ms(fn) -> float:
    return do_bench_cudagraph(fn, rep=40, return_mode="median")


def main() -> int:
    print(torch.__version__, torch.cuda.get_device_name())
    dev = torch.device("cuda")
    sg, sg_t = Q.prepare_signs(None, 128, dev), Q.prepare_signs(None, 128, dev)
    seed, seed_t = torch.tensor(7, device=dev), torch.tensor(8, device=dev)
    print("| gradient | shape | two quantize ms | quantize_both ms | both / two | bf16 copy ms | same bytes |")
    print("|---|---|---|---|---|---|---|")
    tot = [0.0, 0.0]
    for name, R, C in SHAPES:
        x = torch.randn(R, C, device=dev, dtype=torch.bfloat16)
        y = torch.empty_like(x)

        def two():
            return (Q.quantize(x, "ms_eden", hadamard=128, signs=sg, seed=seed)
                    + Q.quantize(x, "ms_eden", hadamard=128, signs=sg_t, seed=seed_t, transpose=True))

        def both():
            return Q.quantize_both(x, 128, sg, seed, 128, sg_t, seed_t)

        same = all(torch.equal(a, b) for a, b in zip(two(), both()))
        t = [ms(two), ms(both)]
        tot = [a + b for a, b in zip(tot, t)]
        t_copy = ms(lambda: y.copy_(x))
        print(f"| {name} | {R}x{C} | {t[0]:.4f} | {t[1]:.4f} | {t[1] / t[0]:.3f} | {t_copy:.4f} | {same} |",
              flush=True)
    print(f"| sum | | {tot[0]:.4f} | {tot[1]:.4f} | {tot[1] / tot[0]:.3f} | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
