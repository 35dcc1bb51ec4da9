"""Dequantization of packed NVFP4 tiles to exact BF16 ``q * S`` inside Triton kernels (global scale excluded).

Shared by the GEMM kernels (:mod:`fp4compile.kernels.gemm`: operand tiles inside the GEMMs and the stand-alone
"dequantize, then a BF16 GEMM" passes) and by the attention backward's preparatory launch
(:mod:`fp4compile.kernels.attention`: the saved NVFP4 copies of Q and K). The value ``code x E4M3 scale`` has at
most 6 significant bits, so it is exact in BF16 and every path below gives the same bits.

Two paths, chosen by the ``DEQUANT_ASM`` constexpr:

* ``False`` (portable; runs under ``TRITON_INTERPRET=1``): integer ops build FP32 bit patterns, one FP32
  multiply by the scale, one convert to BF16.
* ``True`` (inline PTX, sm_90): 4 packed bytes (8 codes) at a time: one ``prmt``, shifts/masks that build
  ``bf16x2`` bit patterns for two codes at once, and one ``mul.rn.bf16x2`` by the scale per two codes.

Public name: :data:`DEFAULT_DEQUANT`; the rest are private jitted helpers. The references are
:func:`fp4compile.formats.nvfp4.dequantize_codes` and the GEMM tests.
"""
from __future__ import annotations

import os

from .launch import stable_cache_keys

#: dequantization path of the CUDA kernels ("asm" or "fp32"): the GEMM op and the attention backward's prep launch
#: (``fp4compile.kernels.gemm.DEFAULT_DEQUANT`` is this value); the env var overrides it for experiments
DEFAULT_DEQUANT = os.environ.get("FP4COMPILE_GEMM_DEQUANT", "asm")

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU wheel without Triton
    triton = None
    tl = None

# One invocation handles 4 code bytes ($4) = 8 codes, with the bf16 scales of those 4 bytes ($5 = bytes 0,1;
# $6 = bytes 2,3). Outputs: $0 = low nibbles of bytes 0,1; $1 = low nibbles of bytes 2,3; $2, $3 the high
# nibbles. After prmt, t = [b0, b2, b1, b3]: 16-bit lane 0 holds b0 (low byte) and b2, lane 1 holds b1 and b3,
# so one shift/mask sequence decodes the same nibble of two bytes into a bf16x2 word
# (magnitude bits -> bits 6..8, sign -> bit 15 of each lane).
_DEQUANT_ASM = """
{
.reg .b32 t, u, v, w;
prmt.b32 t, $4, $4, 0x3120;
shl.b32 u, t, 6;
and.b32 u, u, 0x01C001C0;
shl.b32 v, t, 12;
and.b32 v, v, 0x80008000;
or.b32 w, u, v;
mul.rn.bf16x2 $0, w, $5;
shr.b32 u, t, 2;
and.b32 u, u, 0x01C001C0;
shl.b32 v, t, 4;
and.b32 v, v, 0x80008000;
or.b32 w, u, v;
mul.rn.bf16x2 $1, w, $6;
shl.b32 u, t, 2;
and.b32 u, u, 0x01C001C0;
shl.b32 v, t, 8;
and.b32 v, v, 0x80008000;
or.b32 w, u, v;
mul.rn.bf16x2 $2, w, $5;
shr.b32 u, t, 6;
and.b32 u, u, 0x01C001C0;
and.b32 v, t, 0x80008000;
or.b32 w, u, v;
mul.rn.bf16x2 $3, w, $6;
}
"""


if triton is not None:
    # read at compile time by the jitted helper
    _DEQUANT_ASM_CONST = tl.constexpr(_DEQUANT_ASM)

    @triton.jit
    def _dequant_tile(codes, scales, BR: tl.constexpr, BK: tl.constexpr, DEQUANT_ASM: tl.constexpr):
        """codes u8 [BR, BK/2], scales u8 (E4M3 bytes) [BR, BK/16] -> bf16 [BR, BK] equal to q*S*2^-8."""
        s = scales.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 332306998946228968225951765070086144.0
        if DEQUANT_ASM:
            sb = s.to(tl.bfloat16)
            sb = tl.reshape(tl.broadcast_to(sb[:, :, None], (BR, BK // 16, 8)), (BR, BK // 2))
            lo, hi = tl.inline_asm_elementwise(
                _DEQUANT_ASM_CONST, "=r,=r,=r,=r,r,r,r", [codes, sb],
                dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
            return tl.reshape(tl.join(lo, hi), (BR, BK))
        else:
            c = codes.to(tl.uint32)
            lo = ((c & 0x8) << 28) | ((c & 0x7) << 22)
            hi = ((c & 0x80) << 24) | ((c & 0x70) << 18)
            q = tl.reshape(tl.join(lo, hi), (BR, BK)).to(tl.float32, bitcast=True)
            sf = tl.reshape(tl.broadcast_to(s[:, :, None], (BR, BK // 16, 16)), (BR, BK))
            return (q * sf).to(tl.bfloat16)

    @triton.jit
    def _dequant_rows(c_ptr, s_ptr, o_ptr, R, KH, pid_r, pid_k, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                      DEQUANT_ASM: tl.constexpr, stride_c=None, stride_s=None, stride_o=None):
        """Rows [pid_r*BLOCK_R, +BLOCK_R) x columns [pid_k*BLOCK_K, +BLOCK_K) of an NVFP4 matrix (codes [R, KH]
        bytes, E4M3 scale bytes [R, KH/8]) to exact bf16 ``q * S`` in ``o_ptr`` [R, 2*KH]; code bytes and scale
        rows are loaded whole (vector loads), ragged rows and columns masked. Row strides default to the
        contiguous ones (KH, KH/8, 2*KH)."""
        sc = KH if stride_c is None else stride_c
        ss = KH // 8 if stride_s is None else stride_s
        so = 2 * KH if stride_o is None else stride_o
        rr = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        kb = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        ks = pid_k * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)
        ko = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        rmask = rr[:, None] < R
        codes = tl.load(c_ptr + rr.to(tl.int64)[:, None] * sc + kb[None, :], mask=rmask & (kb[None, :] < KH),
                        other=0)
        scales = tl.load(s_ptr + rr.to(tl.int64)[:, None] * ss + ks[None, :],
                         mask=rmask & (ks[None, :] < KH // 8), other=0)
        v = _dequant_tile(codes, scales, BLOCK_R, BLOCK_K, DEQUANT_ASM).to(tl.float32) * 256.0
        tl.store(o_ptr + rr.to(tl.int64)[:, None] * so + ko[None, :], v.to(tl.bfloat16),
                 mask=rmask & (ko[None, :] < 2 * KH))


stable_cache_keys(globals())  # Triton cache keys independent of launch order (kernels/launch.py)
