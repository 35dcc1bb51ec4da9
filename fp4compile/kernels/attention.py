"""Q-Attn Triton kernels: flash-style (tiled, online softmax, O(T) memory) mixed-precision attention.

The numerics (which operand is quantized how, which copy is reused, the scale levels) are documented in
``attention_ref.py``, whose torch code is the reference these kernels must match. In short:

* ``quantize_many`` (``_amax_kernel`` then ``_quant2d_kernel``: two launches for up to three tensors): Q, K, V
  (and dO) -> NVFP4 with 16x16 tiles and a per-tensor global computed on the device from deterministic partial
  maxima (no host sync, no atomics). One copy serves both contraction axes, so the forward's copy is the one
  saved for, and reused by, the backward. The same pass also writes code x E4M3 scale as BF16 (exact: 2 + 4
  significant bits), a transient operand buffer for the MMA kernels; the backward rebuilds it from the saved
  codes in its one preparatory launch (``_bwd_prep_kernel``, which also computes D = rowsum(dO∘O)). (H200 has
  no FP4 tensor cores: the products are BF16 MMAs on exactly the NVFP4 values, with the FP32 global scales
  applied to the FP32 accumulators -- what Blackwell computes. Dequantizing each K/V tile inside the attention
  loop instead was measured 1.8-2.8x slower: every query block would redo it.)
* ``attention_fwd``: one program per (batch x head, BM-query block), longest causal blocks first; S = Q·Kᵀ on
  BF16 tensor cores with FP32 accumulation, online softmax in base 2 with the scale folded into one FMA;
  interior key tiles unpredicated, the diagonal band and ragged tail masked. P is quantized on the fly, in
  registers (1x16 along keys), when attn.pv is NVFP4.
* ``attention_bwd``: FlashAttention-2 structure: a dK/dV kernel (one program per BN-key block and KV head,
  looping over the GQA group's query heads and query blocks) and a dQ kernel (one program per BM-query block).
  dS is quantized on the fly with 1x16 blocks along each product's contraction axis and a per-64x64-tile global
  (``DS_TILE``; a 128-row register tile holds two scale tiles, one global per 64-row band). The tile's global is
  a power of two (``attention_ref.tile_scales``), so code x E4M3 scale x global is still exact in BF16 and dS·K,
  dSᵀ·Q accumulate into the MMA accumulator in place (session 21: 1-7 % off the paper split's forward+backward).

Tile configurations: ``FWD_CONFIGS`` / ``BWD_CONFIGS``, chosen from the H200 sweep in ``bench/attention.py``
(docs/BENCHMARKS.md, "Attention").

Causal masking is top-left aligned (key j visible to query i iff j <= i), like ``F.scaled_dot_product_attention``.
Masks are additive FP32 biases (booleans become 0 / -inf), read per tile with broadcast strides. Any sequence
length: ragged tiles are masked, padded rows/keys contribute exact zeros (also to every amax).
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch

from ..formats import nvfp4 as _nvfp4
from . import dequant as _dequant
from .dequant import _dequant_rows, _dequant_tile
from .launch import cdiv, placeholder, stable_cache_keys
from .attention_ref import (DOV, DS_TILE, PV_TILE, DSK, DSQ, G_NUM, P_GLOBAL, PDO, PV, QK, QuantizedQKV, bthd_empty,
                            needs_fp4, qk_tiles)

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU wheel without Triton: only the torch reference is available
    triton = None

Tensor = torch.Tensor
LOG2E = 1.4426950408889634
SUPPORTED_HEAD_DIMS = (64, 128)
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

if triton is not None:
    # the kernels' one E2M1 encoder (magnitude code by FP-pipe rounding) and decoder, used by _quant2d_kernel
    from .quantize import _amax_all, _e2m1_mag_code, _e2m1_value, _max_nan, _min_nan  # noqa: F401

    #: The interpreter (TRITON_INTERPRET=1, CPU tests) multiplies bf16 operands as raw integers in tl.dot; there
    #: the (exact-in-bf16) operands are widened to fp32 first. On the GPU the dots are BF16 MMAs.
    _DOT_F32 = tl.constexpr(_INTERPRET)

    @triton.jit
    def _rne_bf16(x):
        """fp32 -> the nearest-even bf16 value, still in fp32 (the interpreter's own cast truncates)."""
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _to_bf16(x):
        if _DOT_F32:
            return _rne_bf16(x.to(tl.float32)).to(tl.bfloat16)
        else:
            return x.to(tl.bfloat16)

    @triton.jit
    def _cast_like(x, ptr):
        """Cast for a store into ``ptr`` (round-to-nearest-even to bf16, also under the interpreter)."""
        if _DOT_F32:
            if ptr.dtype.element_ty == tl.bfloat16:
                return _rne_bf16(x).to(tl.bfloat16)
            else:
                return x.to(ptr.dtype.element_ty)
        else:
            return x.to(ptr.dtype.element_ty)

    @triton.jit
    def _to_e4m3(x):
        """fp32 in [0, 448] -> float8_e4m3fn, round-to-nearest-even. On the GPU this is the hardware cvt; the
        interpreter's cast mis-rounds when the mantissa carries into the exponent, so there it is built from
        bit arithmetic (normals: 3 mantissa bits; subnormals: multiples of 2^-9)."""
        if _DOT_F32:
            bits = x.to(tl.uint32, bitcast=True)
            nrm = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
            sub = ((x * 512.0 + 8388608.0) - 8388608.0) * 0.001953125
            return tl.where(x < 0.015625, sub, nrm).to(tl.float8e4nv)
        else:
            return x.to(tl.float8e4nv)

    @triton.jit
    def _mma(a, b):
        if _DOT_F32:
            return tl.dot(a.to(tl.float32), b.to(tl.float32))
        else:
            return tl.dot(a, b)

    @triton.jit
    def _signed_hadamard(D: tl.constexpr, BLOCK: tl.constexpr, LOGB: tl.constexpr, TRANS: tl.constexpr):
        """The +-1 [D, D] ``attention_ref.signed_hadamard(D, block=BLOCK, normalize=False)`` (its transpose with
        TRANS) in FP32 registers, from the same integer formula: the sign of row i is bit 13 of i * 0x39B1, entry
        (i, j) of a diagonal block the parity of (i & j)."""
        i = tl.arange(0, D)[:, None]
        j = tl.arange(0, D)[None, :]
        if TRANS:
            neg = ((j * 0x39B1) >> 13) & 1             # S^T[i, j] = S[j, i]: the sign of row j
        else:
            neg = ((i * 0x39B1) >> 13) & 1
        a = (i % BLOCK) & (j % BLOCK)
        for sh in tl.static_range(LOGB):
            neg = neg ^ ((a >> sh) & 1)
        return tl.where((i // BLOCK) == (j // BLOCK), 1.0 - 2.0 * neg.to(tl.float32), 0.0)

    @triton.jit
    def _qk_transform_rows(x, x_ptr, m_ptr, bh, rows_ok, s, SMOOTH: tl.constexpr, ROT: tl.constexpr,
                           D: tl.constexpr):
        """Rows ``x`` [R, D] of Q or K as loaded (x_ptr's dtype) after the Q, K transform, as
        ``fp4compile::smooth_rotate`` makes them (``kernels/rotate.py``): minus the FP32 mean m_ptr[bh, :] and one
        rounding (SMOOTH), times ``s`` (the signed Hadamard of ROT channels in x's dtype, :func:`_signed_hadamard`,
        built once per program by the caller) on tensor cores and one rounding (ROT > 0). Rows past T (``rows_ok``
        False) come back 0, as the unfused copy's padding."""
        if SMOOTH:
            mean = tl.load(m_ptr + bh * D + tl.arange(0, D))
            x = _cast_like(x.to(tl.float32) - mean[None, :], x_ptr)
        if ROT > 0:
            x = _cast_like(_mma(x, s), x_ptr)
        return tl.where(rows_ok[:, None], x, 0.0).to(x_ptr.dtype.element_ty)

    # -----------------------------------------------------------------------------------------------------
    # NVFP4 helpers (registers)
    @triton.jit
    def _e2m1_round(x):
        """Signed fp32 (x*enc) -> its E2M1 value with the sign, round-to-nearest-even, saturating at +-6, for every
        x (a zero may come back as +0 where the sign would give -0; the interpreter test checks it against the
        threshold form). The E2M1 grid's step is 2^(e-1) for |x| in [2^e, 2^(e+1)), e >= 0, and 1/2 below 1, so
        adding and subtracting M = +-1.5 * 2^(max(e, 0) + 22) -- whose fp32 ulp is exactly that step -- rounds x
        to the grid with fp32's own round-to-nearest-even (ties land on the even code: 0.25 -> 0, 2.5 -> 2,
        5 -> 4). M is made from x's exponent bits; 7 instructions, no selects. A NaN stays NaN (the clamp is
        ``_min_nan`` / ``_max_nan``, one instruction each as ``min`` / ``max`` are; those drop a NaN on the GPU and
        would saturate it to +-6), so a NaN in dS or P reaches the products it feeds (formats/schemes.py,
        "Non-finite inputs")."""
        c = _min_nan(_max_nan(x, -6.0), 6.0)
        bits = c.to(tl.uint32, bitcast=True)
        e = tl.maximum(bits & 0x7F800000, 0x3F800000)
        m = ((e + 0x0B400000) | (bits & 0x80000000)).to(tl.float32, bitcast=True)
        return (c + m) - m

    @triton.jit
    def _div6_rn(x):
        """RN(x / 6) for fp32 x >= 0, as ``tl.math.div_rn(x, 6.0)`` gives it (inf -> inf), in three instructions on
        the GPU: q = RN(x * RN(1/6)) is within one ulp of x / 6, the remainder x - 6q is exact in one FMA, and
        one more FMA corrects q to the correctly rounded quotient (Markstein's theorem; every fp32 significand
        is checked in tests/test_attention.py). The interpreter's fma rounds twice: there it is div_rn."""
        if _DOT_F32:
            return tl.math.div_rn(x, 6.0)
        else:
            q = x * INV6_C
            r = tl.fma(-q, 6.0, x)
            return tl.where(x == float("inf"), x, tl.fma(r, INV6_C, q))

    @triton.jit
    def _rcp_e4m3_rn(sf):
        """RN(1 / sf) for a positive E4M3 value sf (0 -> inf): the hardware's approximate reciprocal (within one
        ulp) corrected by one Newton step in two FMAs, which is the correctly rounded reciprocal for the 3-bit
        significands of E4M3 values (every candidate within one ulp is checked in tests/test_attention.py).
        The interpreter has no PTX: there it is div_rn."""
        if _DOT_F32:
            return tl.math.div_rn(tl.full(sf.shape, 1.0, tl.float32), sf)
        else:
            y = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [sf], dtype=tl.float32,
                                          is_pure=True, pack=1)
            return tl.fma(tl.fma(-sf, y, 1.0), y, y)

    @triton.jit
    def _fq_blocks(xb, amax, s_enc, g_dec, R: tl.constexpr, C: tl.constexpr, FOLD: tl.constexpr):
        """:func:`_fq_rows` from the [R, C/16, 16] view ``xb`` and its block maxima ``amax`` = max |xb| over
        the last axis (computed once by the caller when it also needs them for the tile's global). With FOLD
        the global ``g_dec`` = 1 / ``s_enc`` is a power of two, so RN(1 / (sf * g_dec)) = RN(1 / sf) * s_enc."""
        sf = _to_e4m3(tl.minimum(_div6_rn(amax) * s_enc, 448.0)).to(tl.float32)
        sfg = sf * g_dec
        if FOLD:
            enc = tl.where(sf == 0.0, 0.0, _rcp_e4m3_rn(sf) * s_enc)
        else:
            enc = tl.where(sf == 0.0, 0.0, tl.math.div_rn(tl.full(sf.shape, 1.0, tl.float32), sfg))
        val = _e2m1_round(xb * enc[:, :, None])
        if FOLD:
            return tl.reshape(val * sfg[:, :, None], [R, C])
        else:
            return tl.reshape(val * sf[:, :, None], [R, C])

    @triton.jit
    def _fq_rows(x, s_enc, g_dec, R: tl.constexpr, C: tl.constexpr, FOLD: tl.constexpr = False):
        """Fake-quantize fp32 [R, C] with 1x16 blocks along C; returns code*E4M3-scale (exact in bf16), i.e.
        the NVFP4 value without the global decode scale ``g_dec`` (the caller applies it to the product), or,
        with ``FOLD``, code*E4M3-scale*``g_dec`` (still exact in bf16 when ``g_dec`` is a power of two, as dS's
        per-tile globals are: the product then accumulates straight into the MMA accumulator).
        ``s_enc`` / ``g_dec``: scalars, or [R, 1] (one two-level scale per row band)."""
        xb = tl.reshape(x, [R, C // 16, 16])
        return _fq_blocks(xb, tl.max(tl.abs(xb), axis=2), s_enc, g_dec, R, C, FOLD)

    @triton.jit
    def _pow2_floor(x):
        """Positive normal fp32 -> the largest power of two <= x (the exponent bits alone)."""
        return (x.to(tl.uint32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)

    @triton.jit
    def _band_scales(bmax, R: tl.constexpr, C: tl.constexpr):
        """Two-level scales of an fp32 [R, C] tile of dS (C == DS_TILE, R a multiple of it) from its 1x16 block
        maxima ``bmax`` [R, C/16], one per DS_TILE x DS_TILE band of rows: (s_enc, g_dec), each [R, 1] (scalars
        when R == DS_TILE), from the band's amax (0 -> (1, 0)). s_enc = 2688/amax floored to a power of two
        (``attention_ref.tile_scales``), so g_dec = 1/s_enc is exact and folds into the BF16 operand."""
        if R == DS_TILE_C:  # one tile: scalar scales
            amax = tl.max(tl.max(bmax, axis=1), axis=0)
            s_enc = tl.where(amax < AMAX_FLUSH, 1.0, _pow2_floor(tl.math.div_rn(G_NUM_C, amax)))
            g_dec = tl.where(amax < AMAX_FLUSH, 0.0, tl.math.div_rn(1.0, s_enc))
        else:
            rmax = tl.max(bmax, axis=1)  # [R]
            band = tl.max(tl.reshape(rmax, [R // DS_TILE_C, DS_TILE_C]), axis=1)  # [R / DS_TILE]
            amax = tl.reshape(tl.broadcast_to(band[:, None], [R // DS_TILE_C, DS_TILE_C]), [R, 1])
            s_enc = tl.where(amax < AMAX_FLUSH, 1.0,
                             _pow2_floor(tl.math.div_rn(tl.full(amax.shape, G_NUM_C, tl.float32), amax)))
            g_dec = tl.where(amax < AMAX_FLUSH, 0.0, tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), s_enc))
        return s_enc, g_dec

    DS_TILE_C = tl.constexpr(DS_TILE)
    INV6_C = tl.constexpr(float.fromhex("0x1.555556p-3"))  # RN(1/6) in fp32
    G_NUM_C = tl.constexpr(G_NUM)
    AMAX_FLUSH = tl.constexpr(_nvfp4.AMAX_FLUSH)
    P_GLOBAL_C = tl.constexpr(P_GLOBAL)

    @triton.jit
    def _ld(ptr, offs_t, mask_t, stride_t, D: tl.constexpr, CHECK: tl.constexpr = True):
        """[BT, D] bf16 operand tile of the (batch, head) slice at ``ptr`` (row stride ``stride_t``). CHECK=False:
        every row is known to be in range (no predicate on the load)."""
        od = tl.arange(0, D)
        p = ptr + offs_t[:, None] * stride_t + od[None, :]
        if CHECK:
            x = tl.load(p, mask=mask_t[:, None], other=0.0)
        else:
            x = tl.load(p)
        return _to_bf16(x)

    @triton.jit
    def _mma_acc(a, b, acc):
        """acc + a @ b with the accumulator inside the MMA (wgmma's accumulator operand on the GPU)."""
        if _DOT_F32:
            return acc + tl.dot(a.to(tl.float32), b.to(tl.float32))
        else:
            return tl.dot(a, b, acc)

    # -----------------------------------------------------------------------------------------------------
    # quantization of Q/K/V/dO: one amax launch and one quantize launch for up to three tensors
    @triton.jit
    def _amax_body(x_ptr, part_ptr, pid, NP, T, H, NBH, sxb, sxh, sxt, m_ptr, BT: tl.constexpr, D: tl.constexpr,
                   SMOOTH: tl.constexpr = False, ROT: tl.constexpr = 0, LOGR: tl.constexpr = 0):
        """Partial amax of the [BT, D] tiles pid, pid + NP, ... of x (tiles ordered (batch*head, time)); of x after
        the Q, K transform where SMOOTH / ROT say so (:func:`_qk_transform_rows`)."""
        nT = tl.cdiv(T, BT)
        od = tl.arange(0, D)
        acc = tl.zeros([BT, D], tl.float32)
        if SMOOTH or ROT > 0:   # the transform's +-1 operand, once per program (only where it is used)
            s = _signed_hadamard(D, ROT if ROT > 0 else D, LOGR, False).to(x_ptr.dtype.element_ty)
        for i in range(pid, nT * NBH, NP):
            bh = i // nT
            offs_t = (i % nT) * BT + tl.arange(0, BT)
            x = tl.load(x_ptr + (bh // H) * sxb + (bh % H) * sxh + offs_t[:, None] * sxt + od[None, :],
                        mask=offs_t[:, None] < T, other=0.0)
            if SMOOTH or ROT > 0:
                x = _qk_transform_rows(x, x_ptr, m_ptr, bh, offs_t < T, s, SMOOTH, ROT, D)
            acc = _max_nan(acc, tl.abs(x.to(tl.float32)))   # a NaN element makes the global NaN
        tl.store(part_ptr + pid, _amax_all(acc))

    @triton.jit
    def _amax_kernel(X0, X1, X2, PART, NP, T0, T1, T2, H0, H1, H2, N0, N1, N2,
                     s0b, s0h, s0t, s1b, s1h, s1t, s2b, s2h, s2t, M0, M1, BT: tl.constexpr, D: tl.constexpr,
                     SM0: tl.constexpr = False, RO0: tl.constexpr = 0, SM1: tl.constexpr = False,
                     RO1: tl.constexpr = 0, LOGR: tl.constexpr = 0):
        """PART[t, p] = amax of tensor t's tiles p, p + NP, ... (deterministic: no atomics, no memset). Tensors 0 and
        1 (Q and K) may be transformed first (SMi: centred by the means Mi; ROi: rotated; see ``quantize_many``)."""
        pid = tl.program_id(0)
        t = tl.program_id(1)
        if t == 0:
            _amax_body(X0, PART, pid, NP, T0, H0, N0, s0b, s0h, s0t, M0, BT, D, SM0, RO0, LOGR)
        elif t == 1:
            _amax_body(X1, PART + NP, pid, NP, T1, H1, N1, s1b, s1h, s1t, M1, BT, D, SM1, RO1, LOGR)
        else:
            _amax_body(X2, PART + 2 * NP, pid, NP, T2, H2, N2, s2b, s2h, s2t, M0, BT, D)

    @triton.jit
    def _per_element(blk, BT: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr):
        """A per-block value (``_quant_body``'s [BT, D/16] with ROWS, else [BT/16, D/16]) on each element [BT, D]."""
        if ROWS:
            return tl.reshape(tl.broadcast_to(blk[:, :, None], [BT, D // 16, 16]), [BT, D])
        else:
            return tl.reshape(tl.broadcast_to(tl.reshape(blk, [BT // 16, 1, D // 16, 1]), [BT // 16, 16, D // 16, 16]),
                              [BT, D])

    @triton.jit
    def _round_blocks(x, s_enc, g_dec, BT: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr):
        """NVFP4 RTN of a [BT, D] fp32 slab in 16x16 tiles (with ROWS: 1x16 blocks along D) under the tensor's
        encode / decode globals: (signed E2M1 codes [BT, D], E4M3 scales and their fp32 values, [BT/16, D/16] or
        with ROWS [BT, D/16])."""
        if ROWS:  # one scale per row and 16 channels: [BT, D/16]
            amax = tl.max(tl.abs(tl.reshape(x, [BT, D // 16, 16])), axis=2)
        else:  # one scale per 16x16 tile: [BT/16, D/16]
            amax = tl.max(tl.max(tl.abs(tl.reshape(x, [BT // 16, 16, D // 16, 16])), axis=3), axis=1)
        sf8 = _to_e4m3(tl.minimum(tl.math.div_rn(amax, 6.0) * s_enc, 448.0))
        sf = sf8.to(tl.float32)
        enc = tl.where(sf == 0.0, 0.0, tl.math.div_rn(tl.full(sf.shape, 1.0, tl.float32), sf * g_dec))
        a = x * _per_element(enc, BT, D, ROWS)
        mag = _e2m1_mag_code(tl.abs(a))
        return tl.where(a < 0, mag | 8, mag), sf8, sf

    @triton.jit
    def _quant_body(x_ptr, codes_ptr, scales_ptr, deq_ptr, gdec_ptr, part_ptr, NP, pid_t, pid_bh, T, H, NBH,
                    sxb, sxh, sxt, m_ptr, BT: tl.constexpr, D: tl.constexpr, NP2: tl.constexpr,
                    WRITE_DEQ: tl.constexpr, ROWS: tl.constexpr = False, SMOOTH: tl.constexpr = False,
                    ROT: tl.constexpr = 0, LOGR: tl.constexpr = 0):
        """NVFP4 RTN, 16x16 tiles over (T, D) (with ROWS: 1x16 blocks along D), of one [BT, D] slab of x[b, h]
        (after the Q, K transform where SMOOTH / ROT say so: :func:`_qk_transform_rows`);
        == attention_ref.quantize_2d(x, tiles=not ROWS). The per-tensor amax is the max of the NP partials. With
        WRITE_DEQ also stores code x E4M3 scale (exact in bf16; the global is applied by the consumer)."""
        if (pid_t * BT < T) & (pid_bh < NBH):
            ip = tl.arange(0, NP2)
            amax_t = _amax_all(tl.load(part_ptr + ip, mask=ip < NP, other=0.0))
            s_enc = tl.where(amax_t < AMAX_FLUSH, 1.0, tl.math.div_rn(G_NUM_C + 0.0 * amax_t, amax_t))
            g_dec = tl.where(amax_t < AMAX_FLUSH, 0.0, tl.math.div_rn(1.0 + 0.0 * s_enc, s_enc))
            if (pid_t == 0) & (pid_bh == 0):
                tl.store(gdec_ptr, g_dec)
            b = pid_bh // H
            h = pid_bh % H
            offs_t = pid_t * BT + tl.arange(0, BT)
            mt = offs_t < T
            od = tl.arange(0, D)
            x = tl.load(x_ptr + b * sxb + h * sxh + offs_t[:, None] * sxt + od[None, :], mask=mt[:, None],
                        other=0.0)
            if SMOOTH or ROT > 0:
                s = _signed_hadamard(D, ROT if ROT > 0 else D, LOGR, False).to(x_ptr.dtype.element_ty)
                x = _qk_transform_rows(x, x_ptr, m_ptr, pid_bh, mt, s, SMOOTH, ROT, D)
            code, sf8, sf = _round_blocks(x.to(tl.float32), s_enc, g_dec, BT, D, ROWS)
            base = pid_bh * T
            if WRITE_DEQ:
                val = _e2m1_value(code) * _per_element(sf, BT, D, ROWS)
                tl.store(deq_ptr + (base + offs_t[:, None]) * D + od[None, :], _to_bf16(val), mask=mt[:, None])
            lo, hi = tl.split(tl.reshape(code, [BT, D // 2, 2]))
            packed = (lo | (hi << 4)).to(tl.uint8)
            ob = tl.arange(0, D // 2)
            tl.store(codes_ptr + (base + offs_t[:, None]) * (D // 2) + ob[None, :], packed, mask=mt[:, None])
            sbytes = sf8.to(tl.uint8, bitcast=True)
            if ROWS:
                srows = sbytes
            else:
                srows = tl.reshape(tl.broadcast_to(tl.reshape(sbytes, [BT // 16, 1, D // 16]),
                                                   [BT // 16, 16, D // 16]), [BT, D // 16])
            os_ = tl.arange(0, D // 16)
            tl.store(scales_ptr + (base + offs_t[:, None]) * (D // 16) + os_[None, :], srows, mask=mt[:, None])

    @triton.jit
    def _quant2d_kernel(X0, C0, S0, Y0, G0, X1, C1, S1, Y1, G1, X2, C2, S2, Y2, G2, PART, NP,
                        T0, T1, T2, H0, H1, H2, N0, N1, N2, s0b, s0h, s0t, s1b, s1h, s1t, s2b, s2h, s2t, M0, M1,
                        BT: tl.constexpr, D: tl.constexpr, NP2: tl.constexpr,
                        WD0: tl.constexpr, WD1: tl.constexpr, WD2: tl.constexpr,
                        RW0: tl.constexpr = False, RW1: tl.constexpr = False, RW2: tl.constexpr = False,
                        SM0: tl.constexpr = False, RO0: tl.constexpr = 0, SM1: tl.constexpr = False,
                        RO1: tl.constexpr = 0, LOGR: tl.constexpr = 0):
        """Grid (time blocks, batch*head, tensor): quantizes up to three tensors in one launch (RWi: tensor i in
        1x16 blocks along D instead of 16x16 tiles; SMi, ROi: tensors 0 and 1 transformed first, as in
        :func:`_amax_kernel`)."""
        pid_t = tl.program_id(0)
        pid_bh = tl.program_id(1)
        t = tl.program_id(2)
        if t == 0:
            _quant_body(X0, C0, S0, Y0, G0, PART, NP, pid_t, pid_bh, T0, H0, N0, s0b, s0h, s0t, M0, BT, D, NP2, WD0,
                        RW0, SM0, RO0, LOGR)
        elif t == 1:
            _quant_body(X1, C1, S1, Y1, G1, PART + NP, NP, pid_t, pid_bh, T1, H1, N1, s1b, s1h, s1t, M1, BT, D, NP2,
                        WD1, RW1, SM1, RO1, LOGR)
        else:
            _quant_body(X2, C2, S2, Y2, G2, PART + 2 * NP, NP, pid_t, pid_bh, T2, H2, N2, s2b, s2h, s2t, M0, BT, D,
                        NP2, WD2, RW2)

    @triton.jit
    def _requant_body(c_ptr, s_ptr, y_ptr, z_ptr, pid, T, NBH, BT: tl.constexpr, D: tl.constexpr,
                      DEQUANT_ASM: tl.constexpr, SUB: tl.constexpr):
        """Rows [t0, t0 + BT) (SUB at a time) of head pid // cdiv(T, BT) of a saved contiguous 1x16 copy (codes
        [NBH*T, D/2], scales [NBH*T, D/16]), read once: its bf16 code x scale (global excluded) into y [NBH*T, D],
        as ``_dequant_rows`` stores it, and its values quantized again in 16x16 tiles, bf16 code x scale into z
        [NBH*T, D], == attention_ref.requantize_tiles without the global. The values' amax is G_NUM by construction,
        so both globals of the second rounding are 1 (the copy's global applies)."""
        nT = tl.cdiv(T, BT)
        if pid < nT * NBH:
            for i in tl.static_range(BT // SUB):  # SUB rows (a multiple of 16) at a time: fewer live registers
                offs_t = (pid % nT) * BT + i * SUB + tl.arange(0, SUB)
                mt = offs_t[:, None] < T
                rows = ((pid // nT) * T + offs_t).to(tl.int64)[:, None]
                codes = tl.load(c_ptr + rows * (D // 2) + tl.arange(0, D // 2)[None, :], mask=mt, other=0)
                # a row's D/16 scale bytes as D/64 32-bit words (not one byte per thread), split little-endian
                words = tl.load(s_ptr.to(tl.pointer_type(tl.uint32)) + rows * (D // 64)
                                + tl.arange(0, D // 64)[None, :], mask=mt, other=0)
                sh = (tl.arange(0, 4) * 8).to(tl.uint32)
                scales = tl.reshape((words[:, :, None] >> sh[None, None, :]) & 0xFF, [SUB, D // 16]).to(tl.uint8)
                x = _dequant_tile(codes, scales, SUB, D, DEQUANT_ASM).to(tl.float32) * 256.0  # exact; padding 0
                od = tl.arange(0, D)[None, :]
                tl.store(y_ptr + rows * D + od, x.to(tl.bfloat16), mask=mt)
                code, _, sf = _round_blocks(x, 1.0, 1.0, SUB, D, False)
                val = _e2m1_value(code) * _per_element(sf, SUB, D, False)
                tl.store(z_ptr + rows * D + od, _to_bf16(val), mask=mt)

    @triton.jit
    def _bwd_prep_kernel(DO, O, DELTA, C0, S0, Y0, R0, C1, S1, Y1, R1, Z0, RT0, RN0, Z1, RT1, RN1, T, H, NBH,
                         sdb, sdh, sdt, sob, soh, sot, BT: tl.constexpr, D: tl.constexpr, DEQUANT_ASM: tl.constexpr,
                         RQ0: tl.constexpr = False, RQ1: tl.constexpr = False, SUB: tl.constexpr = 16):
        """The backward's one preparatory launch. Task 0 (program_id(1)): delta = rowsum(dO * O) in fp32 for a
        [BT] row block; tasks 1, 2: code x scale (bf16, global excluded) of rows [pid*BT, pid*BT + BT) of a
        saved contiguous [R, D] NVFP4 copy (Q and/or K), by the GEMM's dequantization
        (:func:`fp4compile.kernels.dequant._dequant_rows`: whole code bytes and scale rows as vector loads;
        ``DEQUANT_ASM`` its inline-PTX unpacking, CUDA only). With RQi, task 1 + i instead reads copy i per head
        (``_requant_body``; [RNi heads, RTi rows]) and stores, from that one read, both its code x scale into Yi
        and its values re-quantized in 16x16 tiles into Zi: the operands of the dS products under QK_1X16."""
        pid = tl.program_id(0)
        task = tl.program_id(1)
        if task == 0:
            nT = tl.cdiv(T, BT)
            if pid < nT * NBH:
                bh = pid // nT
                b = bh // H
                h = bh % H
                offs_t = (pid % nT) * BT + tl.arange(0, BT)
                mt = offs_t < T
                od = tl.arange(0, D)
                do = tl.load(DO + b * sdb + h * sdh + offs_t[:, None] * sdt + od[None, :], mask=mt[:, None],
                             other=0.0).to(tl.float32)
                o = tl.load(O + b * sob + h * soh + offs_t[:, None] * sot + od[None, :], mask=mt[:, None],
                            other=0.0).to(tl.float32)
                tl.store(DELTA + bh * T + offs_t, tl.sum(do * o, axis=1), mask=mt)
        elif task == 1:
            if RQ0:
                _requant_body(C0, S0, Y0, Z0, pid, RT0, RN0, BT, D, DEQUANT_ASM, SUB)
            elif pid * BT < R0:
                _dequant_rows(C0, S0, Y0, R0, D // 2, pid, 0, BT, D, DEQUANT_ASM)
        else:
            if RQ1:
                _requant_body(C1, S1, Y1, Z1, pid, RT1, RN1, BT, D, DEQUANT_ASM, SUB)
            elif pid * BT < R1:
                _dequant_rows(C1, S1, Y1, R1, D // 2, pid, 0, BT, D, DEQUANT_ASM)

    @triton.jit
    def _fwd_inner(acc, m_i, l_i, q, k_ptr, v_ptr, Bias, b, h, offs_m, mm, lo, hi, skt, svt, sbb, sbh, sbm, sbn,
                   qk_scale, Tk, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                   PV_FP4: tl.constexpr, FOLD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr):
        """Online softmax over key tiles [lo, hi). MASKED: apply the key-range and causal masks; otherwise every
        tile is complete and fully visible (unpredicated loads; with FOLD the softmax scale is folded into the
        max and into one FMA before exp2)."""
        for start_n in range(lo, hi, BN):
            offs_n = start_n + tl.arange(0, BN)
            mn = offs_n < Tk
            k = _ld(k_ptr, offs_n, mn, skt, D, MASKED)
            s = _mma(q, tl.trans(k))
            if (HAS_BIAS or MASKED) or (not FOLD):  # Triton rejects chained boolean operators
                s = s * qk_scale
                if HAS_BIAS:
                    bias = tl.load(Bias + b * sbb + h * sbh + offs_m[:, None] * sbm + offs_n[None, :] * sbn,
                                   mask=mm[:, None] & mn[None, :], other=0.0)
                    s = s + bias * 1.4426950408889634
                if MASKED:
                    valid = mn[None, :]
                    if CAUSAL:
                        valid = valid & (offs_n[None, :] <= offs_m[:, None])
                    s = tl.where(valid, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.math.exp2(s - m_safe[:, None])
            else:
                m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.math.exp2(s * qk_scale - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            v = _ld(v_ptr, offs_n, mn, svt, D, MASKED)
            if PV_FP4:
                acc = _mma_acc(_to_bf16(_fq_rows(p, G_NUM_C, P_GLOBAL_C, BM, BN)), v, acc)
            else:
                acc = _mma_acc(_to_bf16(p), v, acc)
            m_i = m_new
        return acc, m_i, l_i

    @triton.jit(do_not_specialize=["ZERO_G"])
    def _attn_fwd_kernel(Q, K, V, Gq, Gk, Gv, Bias, O, LSE,
                         sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot,
                         sbb, sbh, sbm, sbn, sm_scale, H, GROUPS, Tq, Tk,
                         QK_FP4: tl.constexpr, PV_FP4: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                         FOLD: tl.constexpr, MASK_M: tl.constexpr, ZERO_G, BM: tl.constexpr,
                         BN: tl.constexpr, D: tl.constexpr):
        """Q/K (and V) are BF16, or the dequantized code x scale of their NVFP4 copies when the role is NVFP4;
        the FP4 global scales multiply the FP32 scores / the final accumulator. Grid (batch*head, query
        blocks); causal: the longest query blocks are scheduled first. Key tiles fully inside the visible
        range run without masks; the causal diagonal band and the ragged tail run masked. ZERO_G (runtime,
        bits 0..2): the op's global-scale outputs of Q/K/V that were not quantized, set to 0 here (no fill
        launches)."""
        pid_bh = tl.program_id(0)
        pid_m = tl.program_id(1)
        if (ZERO_G != 0) & (pid_bh == 0) & (pid_m == 0):
            if (ZERO_G & 1) != 0:
                tl.store(Gq, 0.0)
            if (ZERO_G & 2) != 0:
                tl.store(Gk, 0.0)
            if (ZERO_G & 4) != 0:
                tl.store(Gv, 0.0)
        if CAUSAL:
            pid_m = tl.num_programs(1) - 1 - pid_m
        b = pid_bh // H
        h = pid_bh % H
        hk = h // GROUPS
        offs_m = pid_m * BM + tl.arange(0, BM)
        mm = offs_m < Tq
        q = _ld(Q + b * sqb + h * sqh, offs_m, mm, sqt, D, MASK_M)
        k_ptr = K + b * skb + hk * skh
        v_ptr = V + b * svb + hk * svh
        qk_scale = sm_scale * 1.4426950408889634
        if QK_FP4:
            qk_scale = qk_scale * tl.load(Gq) * tl.load(Gk)
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        if CAUSAL:
            hi = tl.minimum((pid_m + 1) * BM, Tk)
            full = (tl.minimum(pid_m * BM, Tk) // BN) * BN
        else:
            hi = Tk
            full = (Tk // BN) * BN
        acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_ptr, v_ptr, Bias, b, h, offs_m, mm, 0, full, skt, svt,
                                   sbb, sbh, sbm, sbn, qk_scale, Tk, False, CAUSAL, HAS_BIAS, PV_FP4, FOLD,
                                   BM, BN, D)
        acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_ptr, v_ptr, Bias, b, h, offs_m, mm, full, hi, skt, svt,
                                   sbb, sbh, sbm, sbn, qk_scale, Tk, True, CAUSAL, HAS_BIAS, PV_FP4, FOLD,
                                   BM, BN, D)
        if PV_FP4:
            acc = acc * (tl.load(Gv) * P_GLOBAL_C)
        empty = l_i == 0.0
        o = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse = tl.where(empty, float("inf"), m_i / 1.4426950408889634 + tl.log(tl.where(empty, 1.0, l_i)))
        od = tl.arange(0, D)
        o_ptrs = O + b * sob + h * soh + offs_m[:, None] * sot + od[None, :]
        if MASK_M:
            tl.store(o_ptrs, _cast_like(o, O), mask=mm[:, None])
            tl.store(LSE + pid_bh * Tq + offs_m, lse, mask=mm)
        else:
            tl.store(o_ptrs, _cast_like(o, O))
            tl.store(LSE + pid_bh * Tq + offs_m, lse)

    # -----------------------------------------------------------------------------------------------------
    @triton.jit
    def _ds_dot(ds, other, acc, FP4: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
        """``acc + dS · other`` for a dS tile [R, C]: in NVFP4 (rows quantized along C, one two-level scale per
        DS_TILE-row band; the power-of-two decode scale is folded into the exact BF16 operand, so the product
        accumulates in place) or in BF16."""
        if FP4:
            xb = tl.reshape(ds, [R, C // 16, 16])
            bmax = tl.max(tl.abs(xb), axis=2)  # once: the blocks' scales and the tile's global
            s_enc, g_dec = _band_scales(bmax, R, C)
            acc = _mma_acc(_to_bf16(_fq_blocks(xb, bmax, s_enc, g_dec, R, C, True)), other, acc)
        else:
            acc = _mma_acc(_to_bf16(ds), other, acc)
        return acc

    @triton.jit
    def _dkdv_inner(dk, dv, k, v, q_ptr, q2_ptr, do_ptr, do2_ptr, Bias, LSE, DELTA, b, h, bh, offs_n, mn, lo, hi,
                    sqt, sq2t, sdt, sd2t, sbb, sbh, sbm, sbn, qk_scale, dp_scale, Tq,
                    MASKED: tl.constexpr, MASK_N: tl.constexpr, DOV_FP4: tl.constexpr, PDO_FP4: tl.constexpr,
                    DSQ_FP4: tl.constexpr, QK_FP4: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, DS_OWN: tl.constexpr = False):
        """Accumulate dK, dV of one key block over query blocks [lo, hi). Unmasked blocks are complete and
        fully visible; with MASK_N the key rows past Tk are zeroed (they must not enter a dS tile's amax)."""
        for start_m in range(lo, hi, BM):
            offs_m = start_m + tl.arange(0, BM)
            mm = offs_m < Tq
            q = _ld(q_ptr, offs_m, mm, sqt, D, MASKED)
            sT = _mma(k, tl.trans(q))  # [BN, BM]
            if MASKED:
                lse = tl.load(LSE + bh * Tq + offs_m, mask=mm, other=float("inf")) * 1.4426950408889634
            else:
                lse = tl.load(LSE + bh * Tq + offs_m) * 1.4426950408889634
            if HAS_BIAS:
                bias = tl.load(Bias + b * sbb + h * sbh + offs_m[None, :] * sbm + offs_n[:, None] * sbn,
                               mask=mm[None, :] & mn[:, None], other=0.0)
                pT = tl.math.exp2(sT * qk_scale + bias * 1.4426950408889634 - lse[None, :])
            else:
                pT = tl.math.exp2(sT * qk_scale - lse[None, :])
            if MASKED:
                valid = mn[:, None] & mm[None, :]
                if CAUSAL:
                    valid = valid & (offs_n[:, None] <= offs_m[None, :])
                pT = tl.where(valid, pT, 0.0)
            elif MASK_N:
                pT = tl.where(mn[:, None], pT, 0.0)
            do = _ld(do_ptr, offs_m, mm, sdt, D, MASKED)
            if PDO_FP4:
                dv = _mma_acc(_to_bf16(_fq_rows(pT, G_NUM_C, P_GLOBAL_C, BN, BM)), do, dv)
            else:
                dv = _mma_acc(_to_bf16(pT), do, dv)
            if DOV_FP4 == PDO_FP4:
                do2 = do
            else:
                do2 = _ld(do2_ptr, offs_m, mm, sd2t, D, MASKED)
            dpT = _mma(v, tl.trans(do2))
            if DOV_FP4:
                dpT = dpT * dp_scale
            if MASKED:
                delta = tl.load(DELTA + bh * Tq + offs_m, mask=mm, other=0.0)
            else:
                delta = tl.load(DELTA + bh * Tq + offs_m)
            dsT = pT * (dpT - delta[None, :])
            if (DSQ_FP4 == QK_FP4) and (not DS_OWN):
                q2 = q
            else:
                q2 = _ld(q2_ptr, offs_m, mm, sq2t, D, MASKED)
            dk = _ds_dot(dsT, q2, dk, DSQ_FP4, BN, BM)  # rows: keys; one scale per 64-key band
        return dk, dv

    @triton.jit
    def _attn_bwd_dkdv_kernel(Q, Q2, K, V, DO, DO2, Gq, Gk, Gv, Gdo, Bias, LSE, DELTA, DK, DV,
                              sqb, sqh, sqt, sq2b, sq2h, sq2t, skb, skh, skt, svb, svh, svt,
                              sdb, sdh, sdt, sd2b, sd2h, sd2t, sob, soh, sot, sbb, sbh, sbm, sbn, sm_scale, H,
                              GROUPS, Tq, Tk,
                              QK_FP4: tl.constexpr, DOV_FP4: tl.constexpr, PDO_FP4: tl.constexpr,
                              DSQ_FP4: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                              MASK_M: tl.constexpr, MASK_N: tl.constexpr,
                              BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, DS_OWN: tl.constexpr = False):
        """dK, dV for one BN-key block of one KV head (grid: (batch*KV heads, key blocks); causal: the first key
        blocks, which see the most queries, are scheduled first), looping over the GQA group's query heads and
        over BM-query blocks: the causal diagonal band masked, the blocks fully below it unmasked, the ragged
        query tail masked. Q: the attn.qk operand, Q2: the attn.dsq operand (read only when the two precisions
        differ); DO: the attn.pdo operand, DO2: the attn.dov operand (idem). DK and DV share the strides
        (sob, soh, sot)."""
        pid_bhk = tl.program_id(0)
        pid_n = tl.program_id(1)
        Hkv = H // GROUPS
        b = pid_bhk // Hkv
        hk = pid_bhk % Hkv
        offs_n = pid_n * BN + tl.arange(0, BN)
        mn = offs_n < Tk
        k = _ld(K + b * skb + hk * skh, offs_n, mn, skt, D, MASK_N)
        v = _ld(V + b * svb + hk * svh, offs_n, mn, svt, D, MASK_N)
        qk_scale = sm_scale * 1.4426950408889634
        if QK_FP4:
            qk_scale = qk_scale * tl.load(Gq) * tl.load(Gk)
        dp_scale = 1.0
        if DOV_FP4:
            dp_scale = tl.load(Gv) * tl.load(Gdo)
        dk = tl.zeros([BN, D], tl.float32)
        dv = tl.zeros([BN, D], tl.float32)
        lo = 0
        mu = 0
        if CAUSAL:
            lo = ((pid_n * BN) // BM) * BM
            mu = tl.cdiv(pid_n * BN + BN - 1, BM) * BM  # first query block that sees every key of this block
        q_full = (Tq // BM) * BM
        mid = tl.minimum(tl.maximum(mu, lo), q_full)
        tail = tl.maximum(tl.maximum(mid, q_full), lo)
        for g in range(0, GROUPS):
            h = hk * GROUPS + g
            bh = b * H + h
            q_ptr = Q + b * sqb + h * sqh
            q2_ptr = Q2 + b * sq2b + h * sq2h
            do_ptr = DO + b * sdb + h * sdh
            do2_ptr = DO2 + b * sd2b + h * sd2h
            dk, dv = _dkdv_inner(dk, dv, k, v, q_ptr, q2_ptr, do_ptr, do2_ptr, Bias, LSE, DELTA, b, h, bh, offs_n,
                                 mn, lo, mid, sqt, sq2t, sdt, sd2t, sbb, sbh, sbm, sbn, qk_scale, dp_scale, Tq,
                                 True, MASK_N, DOV_FP4, PDO_FP4, DSQ_FP4, QK_FP4, CAUSAL, HAS_BIAS, BM, BN, D, DS_OWN)
            dk, dv = _dkdv_inner(dk, dv, k, v, q_ptr, q2_ptr, do_ptr, do2_ptr, Bias, LSE, DELTA, b, h, bh, offs_n,
                                 mn, mid, q_full, sqt, sq2t, sdt, sd2t, sbb, sbh, sbm, sbn, qk_scale, dp_scale, Tq,
                                 False, MASK_N, DOV_FP4, PDO_FP4, DSQ_FP4, QK_FP4, CAUSAL, HAS_BIAS, BM, BN, D, DS_OWN)
            if MASK_M:
                dk, dv = _dkdv_inner(dk, dv, k, v, q_ptr, q2_ptr, do_ptr, do2_ptr, Bias, LSE, DELTA, b, h, bh,
                                     offs_n, mn, tail, Tq, sqt, sq2t, sdt, sd2t, sbb, sbh, sbm, sbn, qk_scale,
                                     dp_scale, Tq, True, MASK_N, DOV_FP4, PDO_FP4, DSQ_FP4, QK_FP4, CAUSAL,
                                     HAS_BIAS, BM, BN, D, DS_OWN)
        dk_scale = sm_scale
        if DSQ_FP4:
            dk_scale = dk_scale * tl.load(Gq)
        if PDO_FP4:
            dv = dv * (tl.load(Gdo) * P_GLOBAL_C)
        od = tl.arange(0, D)
        out_off = b * sob + hk * soh + offs_n[:, None] * sot + od[None, :]
        if MASK_N:
            tl.store(DK + out_off, _cast_like(dk * dk_scale, DK), mask=mn[:, None])
            tl.store(DV + out_off, _cast_like(dv, DV), mask=mn[:, None])
        else:
            tl.store(DK + out_off, _cast_like(dk * dk_scale, DK))
            tl.store(DV + out_off, _cast_like(dv, DV))

    @triton.jit
    def _dq_inner(dq, q, do, lse, delta, k_ptr, k2_ptr, v_ptr, Bias, b, h, offs_m, mm, lo, hi, skt, sk2t, svt,
                  sbb, sbh, sbm, sbn, qk_scale, dp_scale, Tk, MASKED: tl.constexpr, QK_FP4: tl.constexpr,
                  DOV_FP4: tl.constexpr, DSK_FP4: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, DS_OWN: tl.constexpr = False):
        """Accumulate dQ of one query block over key tiles [lo, hi). Unmasked tiles must be complete key
        tiles strictly below the causal diagonal (query rows past Tq have LSE = +inf: P = dS = 0)."""
        for start_n in range(lo, hi, BN):
            offs_n = start_n + tl.arange(0, BN)
            mn = offs_n < Tk
            k = _ld(k_ptr, offs_n, mn, skt, D, MASKED)
            s = _mma(q, tl.trans(k))
            if HAS_BIAS:
                bias = tl.load(Bias + b * sbb + h * sbh + offs_m[:, None] * sbm + offs_n[None, :] * sbn,
                               mask=mm[:, None] & mn[None, :], other=0.0)
                p = tl.math.exp2(s * qk_scale + bias * 1.4426950408889634 - lse[:, None])
            else:
                p = tl.math.exp2(s * qk_scale - lse[:, None])
            if MASKED:
                valid = mm[:, None] & mn[None, :]
                if CAUSAL:
                    valid = valid & (offs_n[None, :] <= offs_m[:, None])
                p = tl.where(valid, p, 0.0)
            v = _ld(v_ptr, offs_n, mn, svt, D, MASKED)
            dp = _mma(do, tl.trans(v))
            if DOV_FP4:
                dp = dp * dp_scale
            ds = p * (dp - delta[:, None])
            if (DSK_FP4 == QK_FP4) and (not DS_OWN):
                k2 = k
            else:
                k2 = _ld(k2_ptr, offs_n, mn, sk2t, D, MASKED)
            dq = _ds_dot(ds, k2, dq, DSK_FP4, BM, BN)  # rows: queries; one scale per 64-query band
        return dq

    @triton.jit
    def _attn_bwd_dq_kernel(Q, K, K2, V, DO, Gq, Gk, Gv, Gdo, Bias, LSE, DELTA, DQ,
                            sqb, sqh, sqt, skb, skh, skt, sk2b, sk2h, sk2t, svb, svh, svt, sdb, sdh, sdt,
                            sob, soh, sot, sbb, sbh, sbm, sbn, sm_scale, H, GROUPS, Tq, Tk,
                            QK_FP4: tl.constexpr, DOV_FP4: tl.constexpr, DSK_FP4: tl.constexpr,
                            CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, MASK_M: tl.constexpr,
                            BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, DS_OWN: tl.constexpr = False):
        """dQ for one BM-query block (grid: (batch*heads, query blocks), longest first when causal). K: the
        attn.qk operand, K2: the attn.dsk operand (read only when the two precisions differ); DO: the attn.dov
        operand."""
        pid_bh = tl.program_id(0)
        pid_m = tl.program_id(1)
        if CAUSAL:
            pid_m = tl.num_programs(1) - 1 - pid_m
        b = pid_bh // H
        h = pid_bh % H
        hk = h // GROUPS
        offs_m = pid_m * BM + tl.arange(0, BM)
        mm = offs_m < Tq
        q = _ld(Q + b * sqb + h * sqh, offs_m, mm, sqt, D, MASK_M)
        do = _ld(DO + b * sdb + h * sdh, offs_m, mm, sdt, D, MASK_M)
        lse = tl.load(LSE + pid_bh * Tq + offs_m, mask=mm, other=float("inf")) * 1.4426950408889634
        delta = tl.load(DELTA + pid_bh * Tq + offs_m, mask=mm, other=0.0)
        k_ptr = K + b * skb + hk * skh
        k2_ptr = K2 + b * sk2b + hk * sk2h
        v_ptr = V + b * svb + hk * svh
        qk_scale = sm_scale * 1.4426950408889634
        if QK_FP4:
            qk_scale = qk_scale * tl.load(Gq) * tl.load(Gk)
        dp_scale = 1.0
        if DOV_FP4:
            dp_scale = tl.load(Gv) * tl.load(Gdo)
        dq = tl.zeros([BM, D], tl.float32)
        if CAUSAL:
            hi = tl.minimum((pid_m + 1) * BM, Tk)
            full = (tl.minimum(pid_m * BM, Tk) // BN) * BN
        else:
            hi = Tk
            full = (Tk // BN) * BN
        dq = _dq_inner(dq, q, do, lse, delta, k_ptr, k2_ptr, v_ptr, Bias, b, h, offs_m, mm, 0, full, skt, sk2t,
                       svt, sbb, sbh, sbm, sbn, qk_scale, dp_scale, Tk, False, QK_FP4, DOV_FP4, DSK_FP4, CAUSAL,
                       HAS_BIAS, BM, BN, D, DS_OWN)
        dq = _dq_inner(dq, q, do, lse, delta, k_ptr, k2_ptr, v_ptr, Bias, b, h, offs_m, mm, full, hi, skt, sk2t,
                       svt, sbb, sbh, sbm, sbn, qk_scale, dp_scale, Tk, True, QK_FP4, DOV_FP4, DSK_FP4, CAUSAL,
                       HAS_BIAS, BM, BN, D, DS_OWN)
        dq_scale = sm_scale
        if DSK_FP4:
            dq_scale = dq_scale * tl.load(Gk)
        od = tl.arange(0, D)
        dq_ptrs = DQ + b * sob + h * soh + offs_m[:, None] * sot + od[None, :]
        if MASK_M:
            tl.store(dq_ptrs, _cast_like(dq * dq_scale, DQ), mask=mm[:, None])
        else:
            tl.store(dq_ptrs, _cast_like(dq * dq_scale, DQ))


# ---------------------------------------------------------------------------------------------------------
# launchers
def _require_triton():
    if triton is None:
        raise RuntimeError("fp4compile attention kernels need Triton")


def _lastdim_contig(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


#: programs of the amax pass per tensor (each reduces every NP-th tile; the quantize pass reads the NP partials)
_AMAX_PROGRAMS = 256


#: head dims whose Q, K transform ``quantize_many`` can apply in its launches (``folds_transform``)
FOLD_HEAD_DIMS = (64, 128)


def folds_transform(x: Tensor, block: int) -> bool:
    """Whether ``quantize_many`` applies the Q, K transform (rotation in diagonal blocks of ``block`` channels) to
    ``x`` itself: CUDA (or any device under ``TRITON_INTERPRET=1``), BF16 / FP16, a head dim of
    :data:`FOLD_HEAD_DIMS`. Otherwise the caller transforms first."""
    return (triton is not None and (x.is_cuda or _INTERPRET) and x.dtype in (torch.bfloat16, torch.float16)
            and x.shape[-1] in FOLD_HEAD_DIMS and block <= x.shape[-1])


def quantize_many(xs, dequantized, tiles=None, transforms=None) -> list:
    """Quantize up to three ``[B, H, T, D]`` tensors (same D, a power of two 16..256) with 16x16 tiles (or, where
    ``tiles[i]`` is False, 1x16 blocks along D), in two launches in all: one partial-amax pass and one quantize
    pass (the per-tensor global scales stay on the device). Returns, per tensor, (codes, scales, global) and,
    where ``dequantized[i]``, also the bf16 code x E4M3 scale tensor (exact; the global excluded) that the
    attention kernels consume. Bit-identical to ``attention_ref.quantize_2d(x, tiles[i])``.

    ``transforms[i]`` = (smooth, block) for the first two tensors (Q and K): both launches quantize
    ``fp4compile::smooth_rotate(x, smooth, block, False)``'s values instead, computed in registers from x (its mean
    over T by one ``torch.mean``, as the op's default), so the transformed tensor is never stored; the product's
    FP32 sums may round one BF16 step apart from the op's (another tile shape), as between the op's GPU and CPU
    implementations. Needs :func:`folds_transform`."""
    _require_triton()
    n = len(xs)
    tiles = [True] * n if tiles is None else list(tiles)
    transforms = [(False, 0)] * n if transforms is None else [(bool(a), int(b)) for a, b in transforms]
    if not 1 <= n <= 3 or len(dequantized) != n or len(tiles) != n or len(transforms) != n:
        raise ValueError(f"quantize_many takes 1 to 3 tensors and as many dequantized (and tiles, transforms) flags, "
                         f"got {n}")
    if n > 2 and any(transforms[2]):
        raise ValueError("quantize_many: only the first two tensors (Q, K) can be transformed")
    xs = [_lastdim_contig(x) for x in xs]
    D = xs[0].shape[-1]
    if any(x.dim() != 4 or x.shape[-1] != D for x in xs):
        raise ValueError("quantize_many: tensors must be [B, H, T, D] with one head dim")
    for x, (smooth, block) in zip(xs, transforms):
        if (smooth or block) and not folds_transform(x, block):
            raise ValueError(f"quantize_many: cannot fold the Q, K transform for a {x.dtype} {x.device.type} tensor "
                             f"of head dim {D} (block {block}); transform it first")
        if block and (block & (block - 1) or D % block):
            raise ValueError(f"quantize_many: the rotation block must be a power of two dividing {D}, got {block}")
    blocks = {b for _, b in transforms if b}
    if len(blocks) > 1:
        raise ValueError(f"quantize_many: one rotation block for Q and K, got {sorted(blocks)}")
    rot = blocks.pop() if blocks else 0
    dev = xs[0].device
    fp32_ph = placeholder(dev, torch.float32)
    tq, tk = (transforms + [(False, 0)])[:2]          # Q's and K's slots (a lone tensor: K's unused)
    means = [torch.mean(x, dim=-2, dtype=torch.float32).contiguous() if sm else fp32_ph
             for x, (sm, _) in zip(xs, (tq, tk))]
    means += [fp32_ph] * (2 - len(means))
    tf = dict(SM0=tq[0], RO0=tq[1], SM1=tk[0], RO1=tk[1], LOGR=max(rot.bit_length() - 1, 0))
    BT_A = 64 if D <= 64 and not rot else 32   # rotated: the quantize launch's tile shape, so the same products
    NP = _AMAX_PROGRAMS
    part = torch.empty((n, NP), dtype=torch.float32, device=dev)
    outs, slots = [], []
    for x, wd in zip(xs, dequantized):
        B, H, T, _ = x.shape
        codes = torch.empty((B, H, T, D // 2), dtype=torch.uint8, device=dev)
        scales = torch.empty((B, H, T, D // 16), dtype=torch.uint8, device=dev)
        g = torch.empty((), dtype=torch.float32, device=dev)
        deq = torch.empty((B, H, T, D), dtype=torch.bfloat16, device=dev) if wd else None
        outs.append((codes, scales, g, deq) if wd else (codes, scales, g))
        slots.append((x, codes, scales, deq if wd else codes, g, T, H, B * H, x.stride(0), x.stride(1),
                      x.stride(2), bool(wd)))
    while len(slots) < 3:  # unused slots: never reached (the grid's last dim is n)
        slots.append(slots[0])
    X = [s[0] for s in slots]
    T_, H_, N_ = [s[5] for s in slots], [s[6] for s in slots], [s[7] for s in slots]
    strides = [v for s in slots for v in s[8:11]]
    _amax_kernel[(NP, n)](*X, part, NP, *T_, *H_, *N_, *strides, *means, BT=BT_A, D=D, **tf, num_warps=4)
    BT = 32
    tens = [t for s in slots for t in s[:5]]
    _quant2d_kernel[(cdiv(max(T_[:n]), BT), max(N_[:n]), n)](
        *tens, part, NP, *T_, *H_, *N_, *strides, *means, BT=BT, D=D, NP2=triton.next_power_of_2(NP),
        WD0=slots[0][11], WD1=slots[1][11], WD2=slots[2][11], RW0=not tiles[0], RW1=n > 1 and not tiles[1],
        RW2=n > 2 and not tiles[2], **tf, num_warps=4)
    return outs


def quantize_2d(x: Tensor, tiles: bool = True, *, dequantized: bool = False):
    """Triton twin of ``attention_ref.quantize_2d`` for ``[B, H, T, D]`` (D a power of two, 16..256; ``tiles=False``:
    1x16 blocks along D).

    Returns (codes, scales, global); with ``dequantized=True`` also the bf16 tensor of code x E4M3 scale (the
    NVFP4 values without the global scale; exact in bf16) that the attention kernels consume. The per-tensor
    amax stays on the device (no host sync). ``quantize_many`` does several tensors in the same two launches."""
    return quantize_many([x], [dequantized], [tiles])[0]


def dequantize_many(pairs) -> list:
    """bf16 code x E4M3 scale (global excluded) of one or two contiguous NVFP4 copies (codes [..., D/2],
    scales [..., D/16]), in one launch."""
    return _bwd_prep(None, None, pairs)[1]


def _requant_rows(D: int) -> int:
    """Rows per step of the prep launch's re-quantization (``_requant_body``'s SUB): 2048 elements, 16 per thread,
    so that it needs few more registers than the plain dequantization beside it (sm_90 static counts of the launch
    at D = 64 / 128: 56 / 79 registers, the launch without re-quantization 44 / 79, the whole 64-row block at once
    80 / 155)."""
    return 2048 // D


def _bwd_prep(do: Optional[Tensor], out: Optional[Tensor], pairs, requant=()):
    """One launch: delta = rowsum(dO * O) (fp32 [B, H, T], when ``do`` is given), the code x scale tensors of up to
    two contiguous NVFP4 copies ``pairs`` = [(codes [B, H, T, D/2], scales), ...], and, where ``requant[i]``, pair
    i's values re-quantized in 16x16 tiles (``_requant_body``: the dS products' operands under QK_1X16). Returns
    (delta, [code x scale per pair], [re-quantized or None per pair])."""
    _require_triton()
    if len(pairs) > 2 or len(requant) > len(pairs):
        raise ValueError("_bwd_prep dequantizes at most two copies (one requant flag each)")
    rq = [bool(r) for r in requant] + [False] * (2 - len(requant))   # per slot, unused ones False
    ref = do if do is not None else pairs[0][0]
    dev = ref.device
    D = do.shape[-1] if do is not None else pairs[0][0].shape[-1] * 2
    BT = 64
    deqs, reqs, slots, rslots = [], [], [], []
    dummy, c0 = placeholder(dev, torch.bfloat16), placeholder(dev, torch.uint8)
    for (c, s), rq_i in zip(pairs, rq):
        y = torch.empty((*c.shape[:-1], D), dtype=torch.bfloat16, device=dev)
        deqs.append(y)
        slots.append((c, s, y, c.numel() // (D // 2)))
        if rq_i and (c.dim() != 4 or not c.is_contiguous() or not s.is_contiguous() or s.data_ptr() % 4):
            raise ValueError("_bwd_prep: a re-quantized copy must be a contiguous [B, H, T, D/2] (scales contiguous, "
                             "4-byte aligned)")
        z = torch.empty_like(y) if rq_i else None
        reqs.append(z)
        rslots.append((z, c.shape[2], c.shape[0] * c.shape[1]) if rq_i else (dummy, 0, 0))
    while len(slots) < 2:  # unused slot (R = 0): never read, but typed like a real one (the kernel bitcasts)
        slots.append((c0, c0, dummy, 0))
        rslots.append((dummy, 0, 0))
    if do is not None:
        B, H, T, _ = do.shape
        delta = torch.empty((B, H, T), dtype=torch.float32, device=dev)
        dargs = (do, out, delta)
        st = (do.stride(0), do.stride(1), do.stride(2), out.stride(0), out.stride(1), out.stride(2))
        n0 = cdiv(T, BT) * B * H
    else:
        delta, B, H, T, n0 = None, 1, 1, 0, 0
        dargs, st = (dummy, dummy, dummy), (0,) * 6
    nx = max([n0] + [cdiv(sl[3], BT) for sl in slots] + [cdiv(t, BT) * n for _, t, n in rslots])
    asm = dev.type == "cuda" and _dequant.DEFAULT_DEQUANT == "asm"
    _bwd_prep_kernel[(nx, 3)](*dargs, *slots[0], *slots[1], *rslots[0], *rslots[1], T, H, B * H, *st, BT=BT, D=D,
                              DEQUANT_ASM=asm, RQ0=rq[0], RQ1=rq[1], SUB=_requant_rows(D), num_warps=4)
    return delta, deqs, reqs


def dequantize_2d(codes: Tensor, scales: Tensor) -> Tensor:
    """bf16 code x E4M3 scale of a contiguous NVFP4 copy [..., D/2] (global excluded)."""
    return dequantize_many([(codes, scales)])[0]


def _bias_args(attn_mask: Optional[Tensor], B, H, Tq, Tk, device):
    if attn_mask is None:
        return placeholder(device, torch.float32), (0, 0, 0, 0), False
    if attn_mask.dtype == torch.bool:
        bias = torch.zeros(attn_mask.shape, dtype=torch.float32, device=device).masked_fill(~attn_mask, -math.inf)
    else:
        bias = attn_mask.to(torch.float32)
    bias = bias.expand(B, H, Tq, Tk)
    return bias, tuple(bias.stride()), True


def _st(t: Tensor):
    return (t.stride(0), t.stride(1), t.stride(2)) if t.dim() == 4 else (0, 0, 0)


#: Forward tile configuration per head dim, {D: dict(BM, BN, num_warps, num_stages)}; chosen from the sweep in
#: ``bench/attention.py`` (docs/BENCHMARKS.md). With attn.pv in NVFP4 the key tile is PV_TILE whatever this says.
FWD_CONFIGS = {64: dict(BM=128, BN=64, num_warps=8, num_stages=3),
               128: dict(BM=128, BN=64, num_warps=8, num_stages=3)}
#: Backward configurations, {(D, fp4_ds): {"dkdv": dict(BM, BN, ...), "dq": dict(BM, BN, ...)}}. fp4_ds (attn.dsk
#: or attn.dsq in NVFP4) pins the contraction side of each kernel's dS tile to DS_TILE (dkdv: BM, dq: BN) and the
#: other side to a multiple of it: the per-tile global scale of dS is defined on DS_TILE x DS_TILE tiles.
#: ``maxnreg`` (Triton's register cap per thread, a launch option; absent = the compiler's choice): the dK/dV kernel
#: of the paper split at D = 64 is capped at 168 = the most that lets 3 programs of 4 warps share an SM's 64K
#: registers (its 67.5 KB of shared memory allow 3 too). Uncapped it takes 184 registers, 2 programs per SM. H200,
#: bench/attention_kernels_at.py, [16, 12, 1024, 64] causal (session 30): 308.9 -> 250.2 us, same bytes of dQ, dK,
#: dV (160: 252.4-253.1 us, no spill; 168 spills 4 words). Not at D = 128 (255 registers uncapped, 152 spilled
#: words at 168, unmeasured). Its dQ kernel runs 2 stages at 128 registers (49 KB of shared memory: 4 programs per
#: SM instead of 3; 5 spilled words): 204.4, 204.3 -> 201.8, 202.0 us alternating, same bytes (128 registers at 3
#: stages, still 3 per SM by shared memory: 202.5 -> 217.9 us). Since dS's per-block divisions are short sequences
#: (session 31) the dK/dV kernel runs 2 stages too, still at 168 (50 KB of shared memory, 3 programs per SM, 3024
#: static instructions against 3520 at 3 stages, 4 spilled words): 232.8, 230.0 -> 210.8, 215.2 us alternating, same
#: bytes (2 stages at 128: 216.6, 216.9, 4 per SM, 18 spilled words; at 144: 261; session 30, before the short
#: divisions, 2 stages were no better: 258.9 at 128, 252.7 at 168).
def _bwd_pair(w: int, st: int = 2, bm1: int = 64, bn1: int = 64, bm2: int = 64, bn2: int = 64,
              dkdv_maxnreg: int = 0, dq_stages: int = 0, dq_maxnreg: int = 0) -> dict:
    def cap(n):
        return {"maxnreg": n} if n else {}
    return {"dkdv": dict(BM=bm1, BN=bn1, num_warps=w, num_stages=st, **cap(dkdv_maxnreg)),
            "dq": dict(BM=bm2, BN=bn2, num_warps=w, num_stages=dq_stages or st, **cap(dq_maxnreg))}


BWD_CONFIGS = {(64, False): _bwd_pair(4), (128, False): _bwd_pair(4),
               (64, True): _bwd_pair(4, 2, dkdv_maxnreg=168, dq_maxnreg=128),
               (128, True): _bwd_pair(4)}


def _fwd_config(D: int, pv_fp4: bool, config: Optional[dict] = None) -> dict:
    cfg = dict(FWD_CONFIGS.get(D, dict(BM=64, BN=64, num_warps=4, num_stages=2)))
    cfg.update(config or {})
    if pv_fp4:  # P̃ is quantized per key tile relative to the running max: the tile width is numerics
        cfg["BN"] = PV_TILE
    return cfg


def _bwd_config(D: int, fp4_ds: bool, config: Optional[dict] = None) -> dict:
    base = BWD_CONFIGS.get((D, fp4_ds), _bwd_pair(4))
    cfg = {k: dict(v, **((config or {}).get(k) or {})) for k, v in base.items()}
    if fp4_ds:  # the contraction tile is DS_TILE (dS's per-tile global); the other side may hold several tiles
        cfg["dkdv"]["BM"] = DS_TILE
        cfg["dq"]["BN"] = DS_TILE
        for kern, side in (("dkdv", "BN"), ("dq", "BM")):
            if cfg[kern][side] % DS_TILE:
                cfg[kern][side] = DS_TILE
    return cfg


def attention_fwd(q: Tensor, k: Tensor, v: Tensor, views: QuantizedQKV, attn_mask: Optional[Tensor],
                  is_causal: bool, scale: float, mask: int, *, dequantized: Optional[dict] = None,
                  config: Optional[dict] = None, zero_globals: int = 0):
    """Triton forward: (O [B, H, Tq, D] in q's dtype, LSE fp32 [B, H, Tq]). One launch.

    ``dequantized`` may hold the bf16 code x scale tensors ("q", "k", "v") made by ``quantize_many(...)``;
    missing ones are dequantized from ``views`` here. ``config`` overrides ``FWD_CONFIGS`` (BM, BN, num_warps,
    num_stages). ``zero_globals`` (bits 0, 1, 2 = Q, K, V): global-scale tensors of ``views`` that hold no copy
    (never read here) and that the kernel sets to 0 (the op's documented value)."""
    _require_triton()
    q, k, v = (_lastdim_contig(t) for t in (q, k, v))
    B, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    dq_ = dict(dequantized or {})
    missing = [n for n, r in (("q", QK), ("k", QK), ("v", PV)) if mask & r and n not in dq_]
    if missing:
        got = dequantize_many([(getattr(views, f"{n}_codes"), getattr(views, f"{n}_scales")) for n in missing[:2]])
        if len(missing) == 3:
            got += dequantize_many([(views.v_codes, views.v_scales)])
        dq_.update(zip(missing, got))
    qa = dq_["q"] if mask & QK else q
    ka = dq_["k"] if mask & QK else k
    va = dq_["v"] if mask & PV else v
    o = bthd_empty(B, H, Tq, D, q.dtype, q.device)
    lse = torch.empty((B, H, Tq), dtype=torch.float32, device=q.device)
    bias, sb, has_bias = _bias_args(attn_mask, B, H, Tq, Tk, q.device)
    cfg = _fwd_config(D, bool(mask & PV), config)
    BM, BN = cfg.pop("BM"), cfg.pop("BN")
    grid = (B * H, cdiv(Tq, BM))
    _attn_fwd_kernel[grid](qa, ka, va, views.q_global, views.k_global, views.v_global, bias, o, lse,
                           *_st(qa), *_st(ka), *_st(va), *_st(o), *sb, float(scale), H, H // Hkv, Tq, Tk,
                           QK_FP4=bool(mask & QK), PV_FP4=bool(mask & PV), CAUSAL=bool(is_causal),
                           HAS_BIAS=has_bias, FOLD=scale >= 0, MASK_M=Tq % BM != 0, ZERO_G=int(zero_globals),
                           BM=BM, BN=BN, D=D, **cfg)
    return o, lse


def attention_bwd(grad_out: Tensor, q: Optional[Tensor], k: Optional[Tensor], v: Optional[Tensor],
                  views: QuantizedQKV, out: Tensor, lse: Tensor, attn_mask: Optional[Tensor], is_causal: bool,
                  scale: float, mask: int, *, config: Optional[dict] = None):
    """Triton backward: (dQ, dK, dV). q/k/v may be None where only their FP4 copy was saved; the FP4 copies
    of Q/K are dequantized once (bf16 code x scale, transient buffers) in the same launch that computes
    delta = rowsum(dO * O), and read by both kernels. Three launches in all (four, plus two, with dO in
    NVFP4). ``config`` = {"dkdv": {...}, "dq": {...}} overrides ``BWD_CONFIGS``."""
    _require_triton()
    do = _lastdim_contig(grad_out)
    B, H, Tq, D = do.shape
    dev = do.device
    kv_ref = k if k is not None else (views.k_codes if views.k_codes.dim() == 4 else views.v_codes)
    Hkv, Tk = kv_ref.shape[1], kv_ref.shape[2]
    fq, fk, _ = needs_fp4(mask)
    pairs = [(views.q_codes, views.q_scales)] if fq else []
    pairs += [(views.k_codes, views.k_scales)] if fk else []
    # QK_1X16: the dS products take the 1x16 copies re-quantized in tiles (attention_ref.requantize_tiles), made in
    # the same launch from the same read of the codes and scales as their code x scale
    rq = not qk_tiles(mask)
    requant = ([rq and bool(mask & DSQ)] if fq else []) + ([rq and bool(mask & DSK)] if fk else [])
    ds_own = any(requant)
    # dO may be [B, T, H, D]-strided (the output's layout): read in place
    delta, deqs, reqs = _bwd_prep(do, out, pairs, requant)
    qh, q_rq = (deqs.pop(0), reqs.pop(0)) if fq else (None, None)
    kh, k_rq = (deqs.pop(0), reqs.pop(0)) if fk else (None, None)
    q_qk, q_ds = (qh if mask & QK else q), (q_rq if q_rq is not None else qh if mask & DSQ else q)
    k_qk, k_ds = (kh if mask & QK else k), (k_rq if k_rq is not None else kh if mask & DSK else k)
    v_dov = dequantize_2d(views.v_codes, views.v_scales) if mask & DOV else v
    if q_qk is None or k_qk is None or v_dov is None or q_ds is None or k_ds is None:
        raise RuntimeError("qattn backward: an operand was not saved (precision mask mismatch)")
    q_qk, q_ds, k_qk, k_ds, v_dov = (_lastdim_contig(t) for t in (q_qk, q_ds, k_qk, k_ds, v_dov))
    if mask & (DOV | PDO):
        _, _, g_do, doh = quantize_2d(do, dequantized=True)
    else:
        g_do, doh = views.q_global, None  # unread (no dO role in NVFP4)
    do_pdo = doh if mask & PDO else do
    do_dov = doh if mask & DOV else do
    bias, sb, has_bias = _bias_args(attn_mask, B, H, Tq, Tk, dev)
    dtype = do.dtype
    dq = bthd_empty(B, H, Tq, D, dtype, dev)
    dk = bthd_empty(B, Hkv, Tk, D, dtype, dev)
    dv = bthd_empty(B, Hkv, Tk, D, dtype, dev)
    cfg = _bwd_config(D, bool(mask & (DSK | DSQ)), config)
    c1, c2 = dict(cfg["dkdv"]), dict(cfg["dq"])
    BM1, BN1, BM2, BN2 = c1.pop("BM"), c1.pop("BN"), c2.pop("BM"), c2.pop("BN")
    G = (views.q_global, views.k_global, views.v_global, g_do)
    flags = dict(QK_FP4=bool(mask & QK), DOV_FP4=bool(mask & DOV), CAUSAL=bool(is_causal), HAS_BIAS=has_bias, D=D,
                 DS_OWN=ds_own)
    tail = (*sb, float(scale), H, H // Hkv, Tq, Tk)
    _attn_bwd_dkdv_kernel[(B * Hkv, cdiv(Tk, BN1))](
        q_qk, q_ds, k_qk, v_dov, do_pdo, do_dov, *G, bias, lse, delta, dk, dv,
        *_st(q_qk), *_st(q_ds), *_st(k_qk), *_st(v_dov), *_st(do_pdo), *_st(do_dov), *_st(dk), *tail,
        PDO_FP4=bool(mask & PDO), DSQ_FP4=bool(mask & DSQ), MASK_M=Tq % BM1 != 0, MASK_N=Tk % BN1 != 0,
        BM=BM1, BN=BN1, **flags, **c1)
    _attn_bwd_dq_kernel[(B * H, cdiv(Tq, BM2))](
        q_qk, k_qk, k_ds, v_dov, do_dov, *G, bias, lse, delta, dq,
        *_st(q_qk), *_st(k_qk), *_st(k_ds), *_st(v_dov), *_st(do_dov), *_st(dq), *tail,
        DSK_FP4=bool(mask & DSK), MASK_M=Tq % BM2 != 0, BM=BM2, BN=BN2, **flags, **c2)
    return dq, dk, dv


stable_cache_keys(globals())  # Triton cache keys independent of launch order (kernels/launch.py)
