"""NVFP4 GEMMs from ``quantize_dq`` operands against quantize + gemm (issue 3, session 32).

Every GEMM of the GPT-124M step dequantizes both NVFP4 operands to exact bf16 before a bf16 GEMM (the TMA GEMM or
cuBLAS split-K): in ``fp4compile::gemm`` one ``_dequant2_kernel`` launch reads both copies' codes back.
``fp4compile::quantize_dq`` makes the same bf16 q * S in the quantize launches themselves -- RTN / SR's quantize
kernel stores the values it holds, MS-EDEN's pass 2 dequantizes each tile whose scales it makes -- and
``fp4compile::gemm_dequantized`` runs the same bf16 GEMM on it.

Per GEMM: ``old`` = quantize(A) + quantize(B) + gemm; ``new`` = quantize_dq(A) + quantize_dq(B) +
gemm_dequantized; and cuBLAS BF16 ``A @ B^T`` as the baseline the targets are stated against. Forward: RTN 4/6 (W
in 16x16 blocks); dgrad and wgrad: MS-EDEN + RHT-128 of row-major operands of the backward's shapes (dY [tokens, N]
and W^T [K, N] for dgrad; dY^T [N, tokens] and X^T [K, tokens] for wgrad). Each is one CUDA graph
(``triton.testing.do_bench_cudagraph``, median), so launch cost does not count. The outputs are checked equal.

    python bench/dq_operands.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from triton.testing import do_bench_cudagraph  # noqa: E402

import fp4compile.ops  # noqa: E402,F401  (defines the ops; registers the CUDA kernels)

T = 16384
#: (name, in features K, out features N) of the GPT-124M step's linears (B=16, T=1024)
LINEARS = [("c_attn", 768, 2304), ("attn.c_proj", 768, 768), ("c_fc", 768, 3072), ("mlp.c_proj", 3072, 768)]


def ms(fn) -> float:
    return do_bench_cudagraph(fn, rep=50, return_mode="median")


def gemms():
    """(label, A [M, Kc], B [N, Kc], quantize arguments of A, of B) of every GEMM of one layer."""
    for name, k, n in LINEARS:
        yield f"{name} fprop", (T, k), (n, k), ("rtn", True, False), ("rtn", True, True)
        yield f"{name} dgrad", (T, n), (k, n), ("ms_eden", False, False), ("ms_eden", False, False)
        yield f"{name} wgrad", (n, T), (k, T), ("ms_eden", False, False), ("ms_eden", False, False)


def main() -> int:
    ops = torch.ops.fp4compile
    print(torch.__version__, torch.cuda.get_device_name())
    print("| GEMM | M x N x K | old ms (quantize x2 + gemm) | new ms (quantize_dq x2 + gemm_dequantized) | new / old "
          "| cuBLAS bf16 ms | old / bf16 | new / bf16 | same output |")
    print("|---|---|---|---|---|---|---|---|---|")
    tot = {}
    signs = torch.randint(0, 2, (128,), device="cuda").float() * 2 - 1
    seed = torch.tensor(5, device="cuda")
    for label, sa, sb, qa, qb in gemms():
        g = torch.Generator(device="cuda").manual_seed(sa[0] + sb[0] + sa[1])
        a = torch.randn(*sa, device="cuda", dtype=torch.bfloat16, generator=g)
        b = torch.randn(*sb, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02

        def q(op, x, spec):
            rounding, f46, b2 = spec
            had = 128 if rounding == "ms_eden" else 0
            return op(x, rounding, f46, b2, had, signs if had else None, seed if had else None, False)

        def old():
            return ops.gemm(*q(ops.quantize, a, qa), *q(ops.quantize, b, qb), torch.bfloat16)

        def new():
            ca, cb = q(ops.quantize_dq, a, qa), q(ops.quantize_dq, b, qb)
            return ops.gemm_dequantized(ca[3], ca[2], cb[3], cb[2], torch.bfloat16)

        same = torch.equal(old(), new())
        t = (ms(old), ms(new), ms(lambda: torch.mm(a, b.t())))
        role = label.split()[-1]
        tot[role] = [x + y for x, y in zip(tot.get(role, (0.0, 0.0, 0.0)), t)]
        print(f"| {label} | {sa[0]}x{sb[0]}x{sa[1]} | {t[0]:.4f} | {t[1]:.4f} | {t[1] / t[0]:.3f} | {t[2]:.4f} | "
              f"{t[2] / t[0]:.3f} | {t[2] / t[1]:.3f} | {same} |", flush=True)
    tot["all"] = [sum(v[i] for v in tot.values()) for i in range(3)]
    for role, t in tot.items():
        print(f"| sum {role} | | {t[0]:.4f} | {t[1]:.4f} | {t[1] / t[0]:.3f} | {t[2]:.4f} | {t[2] / t[0]:.3f} | "
              f"{t[2] / t[1]:.3f} | |")
    print("(old / bf16, new / bf16: cuBLAS BF16 time over ours, i.e. our speed as a fraction of BF16's)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
