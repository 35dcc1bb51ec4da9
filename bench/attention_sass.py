"""Static sm_90 SASS of the Q-Attn backward kernels, on a machine without a GPU (a CPU-side proxy for their cost).

Compiles the dK/dV and dQ kernels as a training step launches them (bf16 gradients, no GQA, T a multiple of 16)
with the default backward tiles (BM = BN = 64, 4 warps, the stages and register caps of ``attention.BWD_CONFIGS``),
causal, no bias, for head dims 64 and 128, with every role in BF16 and with the paper's split (QKᵀ, dS·K, dSᵀ·Q in
NVFP4), plus the backward's preparatory launch (also as QK_1X16 launches it: "prep_1x16", with the re-quantization
of the saved 1x16 copies in tiles), and prints per kernel the SASS instruction count (each loop body
is counted once per copy: masked and unmasked), registers per thread and the local-memory loads/stores of register
spills (LDL/STL). Issue 4's backward question: what the FP4 dS costs over the BF16 kernels, instruction by
instruction (session 21 used it to choose the power-of-two dS global).

    python bench/attention_sass.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fp4compile.kernels import attention as A  # noqa: E402
from fp4compile.kernels.offline import compile_offline, sass_stats  # noqa: E402

# the gradients are stored in the inputs' dtype (bf16 in training), not FP32
_BF16_PTRS = ("Q", "Q2", "K", "K2", "V", "DO", "DO2", "O", "Y0", "Y1", "Z0", "Z1", "DQ", "DK", "DV")
_FP32_PTRS = ("Gq", "Gk", "Gv", "Gdo", "Bias", "LSE", "DELTA")
_U8_PTRS = ("C0", "S0", "C1", "S1")


def _signature(fn, constexprs: dict) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            continue
        if name in _BF16_PTRS:
            sig[name] = "*bf16"
        elif name in _FP32_PTRS:
            sig[name] = "*fp32"
        elif name in _U8_PTRS:
            sig[name] = "*u8"
        else:
            sig[name] = "fp32" if name == "sm_scale" else "i32"
    return sig


def compile_kernel(kernel: str, D: int, fp4: bool, upto: str = "cubin", metadata=None):
    """PTX (text) or cubin (bytes) of one backward kernel ("dkdv", "dq", "prep", or with "_1x16" as QK_1X16 launches
    it: the dS products on their own re-quantized operand, the prep launch re-quantizing) for sm_90;
    ``metadata``: a dict that receives the compiler's (``"shared"``: bytes of shared memory per program)."""
    own = kernel.endswith("_1x16")   # QK_1X16: the dS products read their own (re-quantized) operand
    kernel = kernel.removesuffix("_1x16") if kernel != "prep_1x16" else kernel
    cfg = A.BWD_CONFIGS[(D, fp4)]["dq" if kernel == "dq" else "dkdv"]
    stages, cap = cfg["num_stages"], {"maxnreg": cfg["maxnreg"]} if "maxnreg" in cfg else {}
    # GROUPS = 1 (no GQA): a launch specializes an int argument equal to 1 into a constant
    if kernel == "dq":
        fn = A._attn_bwd_dq_kernel
        const = dict(QK_FP4=fp4, DOV_FP4=False, DSK_FP4=fp4, CAUSAL=True, HAS_BIAS=False, MASK_M=False,
                     BM=64, BN=64, D=D, GROUPS=1, DS_OWN=own)
    elif kernel == "dkdv":
        fn = A._attn_bwd_dkdv_kernel
        const = dict(QK_FP4=fp4, DOV_FP4=False, PDO_FP4=False, DSQ_FP4=fp4, CAUSAL=True, HAS_BIAS=False,
                     MASK_M=False, MASK_N=False, BM=64, BN=64, D=D, GROUPS=1, DS_OWN=own)
    else:
        const = dict(BT=64, D=D, DEQUANT_ASM=True, RQ0=kernel == "prep_1x16", RQ1=kernel == "prep_1x16",
                     SUB=A._requant_rows(D))
        fn, stages, cap = A._bwd_prep_kernel, 1, {}
    sig = _signature(fn, const)
    # pointers 16-byte aligned, row strides and sequence lengths multiples of 16 (what a launch on [B, H, T, D]
    # tensors with T a multiple of 16 gets)
    div = [n for n, t in sig.items()
           if t.startswith("*") or (t == "i32" and (n[-1] in "bht" or n in ("T", "Tq", "Tk")))]
    return compile_offline(fn, sig, const, 4, upto=upto, divisible_by_16=div, num_stages=stages,
                           metadata=metadata, **cap)


def kernel_stats(kernel: str, D: int, fp4: bool) -> dict:
    """SASS instructions, registers, LDL and STL of one backward kernel (see :func:`compile_kernel`)."""
    n, ops, regs, _ = sass_stats(compile_kernel(kernel, D, fp4))
    return dict(instructions=n, registers=regs, ldl=ops.get("LDL", 0), stl=ops.get("STL", 0))


def main() -> int:
    print("| kernel | d | roles | SASS instructions | registers | LDL / STL (spills) |\n|---|---|---|---|---|---|")
    for D in (64, 128):
        for kernel in ("dkdv", "dkdv_1x16", "dq", "dq_1x16", "prep", "prep_1x16"):
            for fp4 in ((False, True) if kernel in ("dkdv", "dq") else (True,)):
                s = kernel_stats(kernel, D, fp4)
                roles = ("paper split" if fp4 else "all BF16") + (", Q/K 1x16" if kernel.endswith("_1x16") else "")
                print(f"| {kernel} | {D} | {roles} | {s['instructions']} | {s['registers']} | "
                      f"{s['ldl']} / {s['stl']} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
