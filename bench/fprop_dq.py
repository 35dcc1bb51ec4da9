"""The forward NVFP4 GEMM from ``quantize_dq`` operands against quantize + gemm (issue 3, session 32).

A forward linear quantizes X (RTN 4/6, 1x16 blocks) and W (RTN 4/6, 16x16 blocks), then ``fp4compile::gemm``,
whose CUDA implementation at the GPT-124M step's fprop shapes dequantizes both copies to exact bf16 (one
``_dequant2_kernel`` launch reading the codes back) before the TMA bf16 GEMM. ``fp4compile::quantize_dq`` stores
the same bf16 q * S from the quantize kernel, which holds every code and scale already, and
``fp4compile::gemm_dequantized`` runs the same bf16 GEMM on it: no dequantize pass.

Per shape: ``old`` = quantize(X) + quantize(W) + gemm; ``new`` = quantize_dq(X) + quantize_dq(W) +
gemm_dequantized; and cuBLAS BF16 ``X @ W^T`` as the baseline the target is stated against. Each is one CUDA graph
(``triton.testing.do_bench_cudagraph``, median), so launch cost does not count. The outputs are checked equal.

    python bench/fprop_dq.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from triton.testing import do_bench_cudagraph  # noqa: E402

import fp4compile.ops  # noqa: E402,F401  (defines the ops; registers the CUDA kernels)

#: (name, tokens M, out features N, in features K) of the GPT-124M step's forward linears (B=16, T=1024)
SHAPES = [("c_attn", 16384, 2304, 768), ("attn.c_proj", 16384, 768, 768), ("c_fc", 16384, 3072, 768),
          ("mlp.c_proj", 16384, 768, 3072)]


def ms(fn) -> float:
    return do_bench_cudagraph(fn, rep=50, return_mode="median")


def main() -> int:
    ops = torch.ops.fp4compile
    print(torch.__version__, torch.cuda.get_device_name())
    print("| linear | M x N x K | old ms (quantize x2 + gemm) | new ms (quantize_dq x2 + gemm_dequantized) | new / old "
          "| cuBLAS bf16 ms | old / bf16 | new / bf16 | same output |")
    print("|---|---|---|---|---|---|---|---|---|")
    tot = [0.0, 0.0, 0.0]
    for name, M, N, K in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(M + N + K)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02

        def old():
            qx = ops.quantize(x, "rtn", True, False, 0, None, None, False)
            qw = ops.quantize(w, "rtn", True, True, 0, None, None, False)
            return ops.gemm(*qx, *qw, torch.bfloat16)

        def new():
            qx = ops.quantize_dq(x, "rtn", True, False, 0, None, None, False)
            qw = ops.quantize_dq(w, "rtn", True, True, 0, None, None, False)
            return ops.gemm_dequantized(qx[3], qx[2], qw[3], qw[2], torch.bfloat16)

        same = torch.equal(old(), new())
        t = (ms(old), ms(new), ms(lambda: torch.mm(x, w.t())))
        tot = [a + b for a, b in zip(tot, t)]
        print(f"| {name} | {M}x{N}x{K} | {t[0]:.4f} | {t[1]:.4f} | {t[1] / t[0]:.3f} | {t[2]:.4f} | "
              f"{t[2] / t[0]:.3f} | {t[2] / t[1]:.3f} | {same} |", flush=True)
    print(f"| sum | | {tot[0]:.4f} | {tot[1]:.4f} | {tot[1] / tot[0]:.3f} | {tot[2]:.4f} | {tot[2] / tot[0]:.3f} | "
          f"{tot[2] / tot[1]:.3f} | |")
    print("(old / bf16, new / bf16: cuBLAS BF16 time over ours, i.e. our speed as a fraction of BF16's)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
