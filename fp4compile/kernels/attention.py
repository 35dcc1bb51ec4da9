"""Q-Attn Triton kernels: flash-style (tiled, online softmax, O(T) memory) mixed-precision attention.

The numerics (which operand is quantized how, which copy is reused, the scale levels) are documented in
``attention_ref.py``, whose torch code is the reference these kernels must match. In short:

* ``quantize_2d`` (Triton ``_quant2d_kernel``): Q, K, V (and dO) -> NVFP4 with 16x16 tiles and a per-tensor
  global computed on the device (no host sync). One copy serves both contraction axes, so the forward's copy
  is the one saved for, and reused by, the backward. The same pass also writes code x E4M3 scale as BF16 (exact:
  2 + 4 significant bits), a transient operand buffer for the MMA kernels; the backward rebuilds it from the
  saved codes with ``_dequant2d_kernel``. (H200 has no FP4 tensor cores: the products are BF16 MMAs on exactly
  the NVFP4 values, with the FP32 global scales applied to the FP32 accumulators -- what Blackwell computes.
  Dequantizing each K/V tile inside the attention loop instead was measured 1.8-2.8x slower: every query
  block would redo it.)
* ``attention_fwd``: one program per (128-query block, batch x head), S = Q·Kᵀ on BF16 tensor cores with FP32
  accumulation, online softmax in base 2. P is quantized on the fly, in registers (1x16 along keys), when
  attn.pv is NVFP4.
* ``attention_bwd``: FlashAttention-2 structure: D = rowsum(dO∘O); a dK/dV kernel (one program per 64-key
  block and KV head, looping over the GQA group's query heads and query blocks) and a dQ kernel (one program
  per 64-query block). dS is quantized on the fly with 1x16 blocks along each product's contraction axis and a
  per-64x64-tile global (the register tile: ``DS_TILE``).

Causal masking is top-left aligned (key j visible to query i iff j <= i), like ``F.scaled_dot_product_attention``.
Masks are additive FP32 biases (booleans become 0 / -inf), read per tile with broadcast strides. Any sequence
length: loads and stores are masked, padded rows/keys contribute exact zeros (also to every amax).
"""
from __future__ import annotations

import math
import os
from typing import Optional

import torch

from .attention_ref import DOV, DS_TILE, PV_TILE, DSK, DSQ, G_NUM, P_GLOBAL, PDO, PV, QK, QuantizedQKV, needs_fp4

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU wheel without Triton: only the torch reference is available
    triton = None

Tensor = torch.Tensor
LOG2E = 1.4426950408889634
SUPPORTED_HEAD_DIMS = (64, 128)

if triton is not None:
    #: The interpreter (TRITON_INTERPRET=1, CPU tests) multiplies bf16 operands as raw integers in tl.dot; there
    #: the (exact-in-bf16) operands are widened to fp32 first. On the GPU the dots are BF16 MMAs.
    _DOT_F32 = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")

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

    # -----------------------------------------------------------------------------------------------------
    # NVFP4 helpers (registers)
    @triton.jit
    def _e2m1_mag_code(a):
        """|x|*enc -> 3-bit E2M1 magnitude code, round-to-nearest-even, saturating (== e2m1_rne_codes)."""
        return ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
                + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
                + (a > 5.0).to(tl.int32))

    @triton.jit
    def _e2m1_value(code):
        """4-bit code (int32) -> its E2M1 value (fp32)."""
        mag = code & 7
        normal = (((mag >> 1) + 126) << 23) | ((mag & 1) << 22)
        val = tl.where(mag >= 2, normal.to(tl.float32, bitcast=True), mag.to(tl.float32) * 0.5)
        return tl.where(code >= 8, -val, val)

    @triton.jit
    def _fq_rows(x, s_enc, g_dec, R: tl.constexpr, C: tl.constexpr):
        """Fake-quantize fp32 [R, C] with 1x16 blocks along C; returns code*E4M3-scale (exact in bf16), i.e.
        the NVFP4 value without the global decode scale ``g_dec`` (the caller applies it to the product)."""
        xb = tl.reshape(x, [R, C // 16, 16])
        amax = tl.max(tl.abs(xb), axis=2)
        sf = _to_e4m3(tl.minimum(tl.math.div_rn(amax, 6.0) * s_enc, 448.0)).to(tl.float32)
        enc = tl.where(sf == 0.0, 0.0, tl.math.div_rn(tl.full(sf.shape, 1.0, tl.float32), sf * g_dec))
        a = xb * enc[:, :, None]
        mag = _e2m1_mag_code(tl.abs(a))
        code = tl.where(a < 0, mag | 8, mag)
        return tl.reshape(_e2m1_value(code) * sf[:, :, None], [R, C])

    @triton.jit
    def _tile_scales(x):
        """Per-tile two-level scale of an fp32 tile: (s_enc, g_dec) from its amax (0 -> (1, 0))."""
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        s_enc = tl.where(amax == 0.0, 1.0, tl.math.div_rn(G_NUM_C, amax))
        g_dec = tl.where(amax == 0.0, 0.0, tl.math.div_rn(1.0, s_enc))
        return s_enc, g_dec

    G_NUM_C = tl.constexpr(G_NUM)
    P_GLOBAL_C = tl.constexpr(P_GLOBAL)

    @triton.jit
    def _ld(ptr, offs_t, mask_t, stride_t, D: tl.constexpr):
        """[BT, D] bf16 operand tile of the (batch, head) slice at ``ptr`` (row stride ``stride_t``)."""
        od = tl.arange(0, D)
        x = tl.load(ptr + offs_t[:, None] * stride_t + od[None, :], mask=mask_t[:, None], other=0.0)
        return _to_bf16(x)

    # -----------------------------------------------------------------------------------------------------
    @triton.jit
    def _quant2d_kernel(x_ptr, codes_ptr, scales_ptr, deq_ptr, amax_ptr, gdec_ptr, T, H, sxb, sxh, sxt,
                        BT: tl.constexpr, D: tl.constexpr, WRITE_DEQ: tl.constexpr):
        """NVFP4 RTN, 16x16 tiles over (T, D), of one [BT, D] slab of x[b, h]; == attention_ref.quantize_2d.
        With WRITE_DEQ also stores code x E4M3 scale (exact in bf16; the global is applied by the consumer)."""
        pid_t = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        amax_t = tl.load(amax_ptr)
        s_enc = tl.where(amax_t == 0.0, 1.0, tl.math.div_rn(G_NUM_C + 0.0 * amax_t, amax_t))
        g_dec = tl.where(amax_t == 0.0, 0.0, tl.math.div_rn(1.0 + 0.0 * s_enc, s_enc))
        if (pid_t == 0) & (pid_bh == 0):
            tl.store(gdec_ptr, g_dec)
        offs_t = pid_t * BT + tl.arange(0, BT)
        mt = offs_t < T
        od = tl.arange(0, D)
        x = tl.load(x_ptr + b * sxb + h * sxh + offs_t[:, None] * sxt + od[None, :], mask=mt[:, None],
                    other=0.0).to(tl.float32)
        x4 = tl.reshape(x, [BT // 16, 16, D // 16, 16])
        amax = tl.max(tl.max(tl.abs(x4), axis=3), axis=1)  # [BT/16, D/16]
        sf8 = _to_e4m3(tl.minimum(tl.math.div_rn(amax, 6.0) * s_enc, 448.0))
        sf = sf8.to(tl.float32)
        enc = tl.where(sf == 0.0, 0.0, tl.math.div_rn(tl.full(sf.shape, 1.0, tl.float32), sf * g_dec))
        enc4 = tl.broadcast_to(tl.reshape(enc, [BT // 16, 1, D // 16, 1]), [BT // 16, 16, D // 16, 16])
        a = x * tl.reshape(enc4, [BT, D])
        mag = _e2m1_mag_code(tl.abs(a))
        code = tl.where(a < 0, mag | 8, mag)
        base = (b * H + h) * T
        if WRITE_DEQ:
            sf4 = tl.broadcast_to(tl.reshape(sf, [BT // 16, 1, D // 16, 1]), [BT // 16, 16, D // 16, 16])
            val = _e2m1_value(code) * tl.reshape(sf4, [BT, D])
            tl.store(deq_ptr + (base + offs_t[:, None]) * D + od[None, :], _to_bf16(val), mask=mt[:, None])
        lo, hi = tl.split(tl.reshape(code, [BT, D // 2, 2]))
        packed = (lo | (hi << 4)).to(tl.uint8)
        ob = tl.arange(0, D // 2)
        tl.store(codes_ptr + (base + offs_t[:, None]) * (D // 2) + ob[None, :], packed, mask=mt[:, None])
        sbytes = sf8.to(tl.uint8, bitcast=True)
        srows = tl.reshape(tl.broadcast_to(tl.reshape(sbytes, [BT // 16, 1, D // 16]), [BT // 16, 16, D // 16]),
                           [BT, D // 16])
        os_ = tl.arange(0, D // 16)
        tl.store(scales_ptr + (base + offs_t[:, None]) * (D // 16) + os_[None, :], srows, mask=mt[:, None])

    @triton.jit
    def _dequant2d_kernel(codes_ptr, scales_ptr, out_ptr, R, BT: tl.constexpr, D: tl.constexpr):
        """code x E4M3 scale (bf16, global excluded) of a contiguous [R, D] NVFP4 copy; purely elementwise."""
        rows = tl.program_id(0) * BT + tl.arange(0, BT)
        m = rows < R
        od = tl.arange(0, D)
        byte = tl.load(codes_ptr + rows[:, None] * (D // 2) + od[None, :] // 2, mask=m[:, None], other=0)
        code = (byte.to(tl.int32) >> ((od[None, :] % 2) * 4)) & 15
        sb = tl.load(scales_ptr + rows[:, None] * (D // 16) + od[None, :] // 16, mask=m[:, None], other=0)
        sf = sb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        tl.store(out_ptr + rows[:, None] * D + od[None, :], _to_bf16(_e2m1_value(code) * sf), mask=m[:, None])

    # -----------------------------------------------------------------------------------------------------
    @triton.jit
    def _fwd_inner(acc, m_i, l_i, q, k_ptr, v_ptr, Bias, b, h, offs_m, mm, lo, hi, skt, svt, sbb, sbh, sbm, sbn,
                   qk_scale, pv_scale, Tk, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                   PV_FP4: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr):
        """Online-softmax over key tiles [lo, hi); MASKED: apply the key-range and causal masks."""
        for start_n in range(lo, hi, BN):
            offs_n = start_n + tl.arange(0, BN)
            mn = offs_n < Tk
            k = _ld(k_ptr, offs_n, mn, skt, D)
            s = _mma(q, tl.trans(k)) * qk_scale
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
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            v = _ld(v_ptr, offs_n, mn, svt, D)
            if PV_FP4:
                pq = _fq_rows(p, G_NUM_C, P_GLOBAL_C, BM, BN)
                acc += _mma(_to_bf16(pq), v) * pv_scale
            else:
                acc += _mma(_to_bf16(p), v)
            m_i = m_new
        return acc, m_i, l_i

    @triton.jit
    def _attn_fwd_kernel(Q, K, V, Gq, Gk, Gv, Bias, O, LSE,
                         sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot,
                         sbb, sbh, sbm, sbn, sm_scale, H, GROUPS, Tq, Tk,
                         QK_FP4: tl.constexpr, PV_FP4: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr):
        """Q/K (and V) are BF16, or the dequantized code x scale of their NVFP4 copies when the role is NVFP4;
        the FP4 global scales multiply the FP32 scores / accumulator. Key tiles fully inside the visible range
        run without masks; the causal diagonal band and the ragged tail run masked."""
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        hk = h // GROUPS
        offs_m = pid_m * BM + tl.arange(0, BM)
        mm = offs_m < Tq
        q = _ld(Q + b * sqb + h * sqh, offs_m, mm, sqt, D)
        k_ptr = K + b * skb + hk * skh
        v_ptr = V + b * svb + hk * svh
        qk_scale = sm_scale * 1.4426950408889634
        if QK_FP4:
            qk_scale = qk_scale * tl.load(Gq) * tl.load(Gk)
        pv_scale = 1.0
        if PV_FP4:
            pv_scale = tl.load(Gv) * P_GLOBAL_C
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
                                   sbb, sbh, sbm, sbn, qk_scale, pv_scale, Tk, False, CAUSAL, HAS_BIAS, PV_FP4,
                                   BM, BN, D)
        acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_ptr, v_ptr, Bias, b, h, offs_m, mm, full, hi, skt, svt,
                                   sbb, sbh, sbm, sbn, qk_scale, pv_scale, Tk, True, CAUSAL, HAS_BIAS, PV_FP4,
                                   BM, BN, D)
        empty = l_i == 0.0
        o = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse = tl.where(empty, float("inf"), m_i / 1.4426950408889634 + tl.log(tl.where(empty, 1.0, l_i)))
        od = tl.arange(0, D)
        tl.store(O + b * sob + h * soh + offs_m[:, None] * sot + od[None, :], _cast_like(o, O), mask=mm[:, None])
        tl.store(LSE + pid_bh * Tq + offs_m, lse, mask=mm)

    # -----------------------------------------------------------------------------------------------------
    @triton.jit
    def _attn_bwd_dkdv_kernel(Q, Q2, K, V, DO, DO2, Gq, Gk, Gv, Gdo, Bias, LSE, DELTA, DK, DV,
                              sqb, sqh, sqt, sq2b, sq2h, sq2t, skb, skh, skt, svb, svh, svt,
                              sdb, sdh, sdt, sd2b, sd2h, sd2t, sbb, sbh, sbm, sbn, sm_scale, H, GROUPS, Tq, Tk,
                              QK_FP4: tl.constexpr, DOV_FP4: tl.constexpr, PDO_FP4: tl.constexpr,
                              DSQ_FP4: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                              BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr):
        """dK, dV for one 64-key block of one KV head. Q: the attn.qk operand, Q2: the attn.dsq operand (read
        only when the two precisions differ); DO: the attn.pdo operand, DO2: the attn.dov operand (idem)."""
        pid_n = tl.program_id(0)
        pid_bhk = tl.program_id(1)
        Hkv = H // GROUPS
        b = pid_bhk // Hkv
        hk = pid_bhk % Hkv
        offs_n = pid_n * BN + tl.arange(0, BN)
        mn = offs_n < Tk
        k = _ld(K + b * skb + hk * skh, offs_n, mn, skt, D)
        v = _ld(V + b * svb + hk * svh, offs_n, mn, svt, D)
        qk_scale = sm_scale * 1.4426950408889634
        if QK_FP4:
            qk_scale = qk_scale * tl.load(Gq) * tl.load(Gk)
        dp_scale = 1.0
        if DOV_FP4:
            dp_scale = tl.load(Gv) * tl.load(Gdo)
        dv_scale = 1.0
        if PDO_FP4:
            dv_scale = tl.load(Gdo) * P_GLOBAL_C
        gq = 1.0
        if DSQ_FP4:
            gq = tl.load(Gq)
        dk = tl.zeros([BN, D], tl.float32)
        dv = tl.zeros([BN, D], tl.float32)
        lo = 0
        if CAUSAL:
            lo = ((pid_n * BN) // BM) * BM
        for g in range(0, GROUPS):
            h = hk * GROUPS + g
            bh = b * H + h
            q_ptr = Q + b * sqb + h * sqh
            q2_ptr = Q2 + b * sq2b + h * sq2h
            do_ptr = DO + b * sdb + h * sdh
            do2_ptr = DO2 + b * sd2b + h * sd2h
            for start_m in range(lo, Tq, BM):
                offs_m = start_m + tl.arange(0, BM)
                mm = offs_m < Tq
                q = _ld(q_ptr, offs_m, mm, sqt, D)
                sT = _mma(k, tl.trans(q)) * qk_scale  # [BN, BM]
                if HAS_BIAS:
                    bias = tl.load(Bias + b * sbb + h * sbh + offs_m[None, :] * sbm + offs_n[:, None] * sbn,
                                   mask=mm[None, :] & mn[:, None], other=0.0)
                    sT = sT + bias * 1.4426950408889634
                lse = tl.load(LSE + bh * Tq + offs_m, mask=mm, other=float("inf")) * 1.4426950408889634
                valid = mn[:, None] & mm[None, :]
                if CAUSAL:
                    valid = valid & (offs_n[:, None] <= offs_m[None, :])
                pT = tl.where(valid, tl.math.exp2(sT - lse[None, :]), 0.0)
                do = _ld(do_ptr, offs_m, mm, sdt, D)
                if PDO_FP4:
                    pq = _fq_rows(pT, G_NUM_C, P_GLOBAL_C, BN, BM)
                    dv += _mma(_to_bf16(pq), do) * dv_scale
                else:
                    dv += _mma(_to_bf16(pT), do)
                if DOV_FP4 == PDO_FP4:
                    do2 = do
                else:
                    do2 = _ld(do2_ptr, offs_m, mm, sd2t, D)
                dpT = _mma(v, tl.trans(do2)) * dp_scale
                delta = tl.load(DELTA + bh * Tq + offs_m, mask=mm, other=0.0)
                dsT = pT * (dpT - delta[None, :])
                if DSQ_FP4 == QK_FP4:
                    q2 = q
                else:
                    q2 = _ld(q2_ptr, offs_m, mm, sq2t, D)
                if DSQ_FP4:
                    s_enc, g_dec = _tile_scales(dsT)
                    dsq = _fq_rows(dsT, s_enc, g_dec, BN, BM)
                    dk += _mma(_to_bf16(dsq), q2) * (g_dec * gq)
                else:
                    dk += _mma(_to_bf16(dsT), q2)
        od = tl.arange(0, D)
        out_off = (pid_bhk * Tk + offs_n[:, None]) * D + od[None, :]
        tl.store(DK + out_off, _cast_like(dk * sm_scale, DK), mask=mn[:, None])
        tl.store(DV + out_off, _cast_like(dv, DV), mask=mn[:, None])

    @triton.jit
    def _dq_inner(dq, q, do, lse, delta, k_ptr, k2_ptr, v_ptr, Bias, b, h, offs_m, mm, lo, hi, skt, sk2t, svt,
                  sbb, sbh, sbm, sbn, qk_scale, dp_scale, gk, Tk, MASKED: tl.constexpr, QK_FP4: tl.constexpr,
                  DSK_FP4: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr):
        """Accumulate dQ of one query block over key tiles [lo, hi). Unmasked tiles must be complete key
        tiles strictly below the causal diagonal (query rows past Tq have LSE = +inf: P = dS = 0)."""
        for start_n in range(lo, hi, BN):
            offs_n = start_n + tl.arange(0, BN)
            mn = offs_n < Tk
            k = _ld(k_ptr, offs_n, mn, skt, D)
            s = _mma(q, tl.trans(k)) * qk_scale
            if HAS_BIAS:
                bias = tl.load(Bias + b * sbb + h * sbh + offs_m[:, None] * sbm + offs_n[None, :] * sbn,
                               mask=mm[:, None] & mn[None, :], other=0.0)
                s = s + bias * 1.4426950408889634
            p = tl.math.exp2(s - lse[:, None])
            if MASKED:
                valid = mm[:, None] & mn[None, :]
                if CAUSAL:
                    valid = valid & (offs_n[None, :] <= offs_m[:, None])
                p = tl.where(valid, p, 0.0)
            v = _ld(v_ptr, offs_n, mn, svt, D)
            dp = _mma(do, tl.trans(v)) * dp_scale
            ds = p * (dp - delta[:, None])
            if DSK_FP4 == QK_FP4:
                k2 = k
            else:
                k2 = _ld(k2_ptr, offs_n, mn, sk2t, D)
            if DSK_FP4:
                s_enc, g_dec = _tile_scales(ds)
                dsq = _fq_rows(ds, s_enc, g_dec, BM, BN)
                dq += _mma(_to_bf16(dsq), k2) * (g_dec * gk)
            else:
                dq += _mma(_to_bf16(ds), k2)
        return dq

    @triton.jit
    def _attn_bwd_dq_kernel(Q, K, K2, V, DO, Gq, Gk, Gv, Gdo, Bias, LSE, DELTA, DQ,
                            sqb, sqh, sqt, skb, skh, skt, sk2b, sk2h, sk2t, svb, svh, svt, sdb, sdh, sdt,
                            sbb, sbh, sbm, sbn, sm_scale, H, GROUPS, Tq, Tk,
                            QK_FP4: tl.constexpr, DOV_FP4: tl.constexpr, DSK_FP4: tl.constexpr,
                            CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                            BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr):
        """dQ for one 64-query block. K: the attn.qk operand, K2: the attn.dsk operand (read only when the two
        precisions differ); DO: the attn.dov operand."""
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        hk = h // GROUPS
        offs_m = pid_m * BM + tl.arange(0, BM)
        mm = offs_m < Tq
        q = _ld(Q + b * sqb + h * sqh, offs_m, mm, sqt, D)
        do = _ld(DO + b * sdb + h * sdh, offs_m, mm, sdt, D)
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
        gk = 1.0
        if DSK_FP4:
            gk = tl.load(Gk)
        dq = tl.zeros([BM, D], tl.float32)
        if CAUSAL:
            hi = tl.minimum((pid_m + 1) * BM, Tk)
            full = (tl.minimum(pid_m * BM, Tk) // BN) * BN
        else:
            hi = Tk
            full = (Tk // BN) * BN
        dq = _dq_inner(dq, q, do, lse, delta, k_ptr, k2_ptr, v_ptr, Bias, b, h, offs_m, mm, 0, full, skt, sk2t,
                       svt, sbb, sbh, sbm, sbn, qk_scale, dp_scale, gk, Tk, False, QK_FP4, DSK_FP4, CAUSAL,
                       HAS_BIAS, BM, BN, D)
        dq = _dq_inner(dq, q, do, lse, delta, k_ptr, k2_ptr, v_ptr, Bias, b, h, offs_m, mm, full, hi, skt, sk2t,
                       svt, sbb, sbh, sbm, sbn, qk_scale, dp_scale, gk, Tk, True, QK_FP4, DSK_FP4, CAUSAL,
                       HAS_BIAS, BM, BN, D)
        od = tl.arange(0, D)
        tl.store(DQ + (pid_bh * Tq + offs_m[:, None]) * D + od[None, :], _cast_like(dq * sm_scale, DQ),
                 mask=mm[:, None])


# ---------------------------------------------------------------------------------------------------------
# launchers
def _require_triton():
    if triton is None:
        raise RuntimeError("fp4compile attention kernels need Triton")


def _lastdim_contig(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def quantize_2d(x: Tensor, *, dequantized: bool = False):
    """Triton twin of ``attention_ref.quantize_2d`` for ``[B, H, T, D]`` (D a power of two, 16..256).

    Returns (codes, scales, global); with ``dequantized=True`` also the bf16 tensor of code x E4M3 scale (the
    NVFP4 values without the global scale; exact in bf16) that the attention kernels consume. The per-tensor
    amax stays on the device (no host sync); the kernel derives the global scales from it exactly as the
    reference does."""
    _require_triton()
    x = _lastdim_contig(x)
    B, H, T, D = x.shape
    amax = torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32)
    g_dec = torch.empty((), dtype=torch.float32, device=x.device)
    codes = torch.empty((B, H, T, D // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((B, H, T, D // 16), dtype=torch.uint8, device=x.device)
    deq = torch.empty((B, H, T, D), dtype=torch.bfloat16, device=x.device) if dequantized else codes
    BT = 32
    _quant2d_kernel[(triton.cdiv(T, BT), B * H)](x, codes, scales, deq, amax, g_dec, T, H, x.stride(0), x.stride(1),
                                                 x.stride(2), BT=BT, D=D, WRITE_DEQ=dequantized, num_warps=4)
    return (codes, scales, g_dec, deq) if dequantized else (codes, scales, g_dec)


def dequantize_2d(codes: Tensor, scales: Tensor) -> Tensor:
    """bf16 code x E4M3 scale of a contiguous NVFP4 copy [..., D/2] (global excluded)."""
    _require_triton()
    D = codes.shape[-1] * 2
    out = torch.empty((*codes.shape[:-1], D), dtype=torch.bfloat16, device=codes.device)
    R_ = codes.numel() // (D // 2)
    BT = 64
    _dequant2d_kernel[(triton.cdiv(R_, BT),)](codes, scales, out, R_, BT=BT, D=D, num_warps=4)
    return out


def _bias_args(attn_mask: Optional[Tensor], B, H, Tq, Tk, device):
    if attn_mask is None:
        return _dummy(device, torch.float32), (0, 0, 0, 0), False
    if attn_mask.dtype == torch.bool:
        bias = torch.zeros(attn_mask.shape, dtype=torch.float32, device=device).masked_fill(~attn_mask, -math.inf)
    else:
        bias = attn_mask.to(torch.float32)
    bias = bias.expand(B, H, Tq, Tk)
    return bias, tuple(bias.stride()), True


_DUMMIES: dict = {}


def _dummy(device, dtype=torch.bfloat16):
    key = (device, dtype)
    t = _DUMMIES.get(key)
    if t is None:
        t = _DUMMIES[key] = torch.zeros(1, dtype=dtype, device=device)
    return t


def _st(t: Tensor):
    return (t.stride(0), t.stride(1), t.stride(2)) if t.dim() == 4 else (0, 0, 0)


def _fwd_config(D: int, pv_fp4: bool):
    # Hopper: 128-query tiles, 8 warps. With attn.pv in NVFP4 the key tile is PV_TILE (64): it is part of the
    # numerics (P̃ is quantized relative to the running max of each tile), not a tuning knob.
    return dict(BM=128, BN=PV_TILE if pv_fp4 or D == 128 else 128, num_warps=8, num_stages=3 if D == 64 else 2)


def attention_fwd(q: Tensor, k: Tensor, v: Tensor, views: QuantizedQKV, attn_mask: Optional[Tensor],
                  is_causal: bool, scale: float, mask: int, *, dequantized: Optional[dict] = None,
                  config: Optional[dict] = None):
    """Triton forward: (O [B, H, Tq, D] in q's dtype, LSE fp32 [B, H, Tq]).

    ``dequantized`` may hold the bf16 code x scale tensors ("q", "k", "v") made by ``quantize_2d(...,
    dequantized=True)``; missing ones are dequantized from ``views`` here."""
    _require_triton()
    q, k, v = (_lastdim_contig(t) for t in (q, k, v))
    B, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    dq_ = dict(dequantized or {})

    def operand(name, x, fp4):
        if not fp4:
            return x
        if name not in dq_:
            c, s = getattr(views, f"{name}_codes"), getattr(views, f"{name}_scales")
            dq_[name] = dequantize_2d(c, s)
        return dq_[name]

    qa, ka = operand("q", q, mask & QK), operand("k", k, mask & QK)
    va = operand("v", v, mask & PV)
    o = torch.empty((B, H, Tq, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, Tq), dtype=torch.float32, device=q.device)
    bias, sb, has_bias = _bias_args(attn_mask, B, H, Tq, Tk, q.device)
    cfg = dict(_fwd_config(D, bool(mask & PV)), **(config or {}))
    BM, BN = cfg.pop("BM"), cfg.pop("BN")
    grid = (triton.cdiv(Tq, BM), B * H)
    _attn_fwd_kernel[grid](qa, ka, va, views.q_global, views.k_global, views.v_global, bias, o, lse,
                           *_st(qa), *_st(ka), *_st(va), *_st(o), *sb, float(scale), H, H // Hkv, Tq, Tk,
                           QK_FP4=bool(mask & QK), PV_FP4=bool(mask & PV), CAUSAL=bool(is_causal),
                           HAS_BIAS=has_bias, BM=BM, BN=BN, D=D, **cfg)
    return o, lse


def attention_bwd(grad_out: Tensor, q: Optional[Tensor], k: Optional[Tensor], v: Optional[Tensor],
                  views: QuantizedQKV, out: Tensor, lse: Tensor, attn_mask: Optional[Tensor], is_causal: bool,
                  scale: float, mask: int, *, config: Optional[dict] = None):
    """Triton backward: (dQ, dK, dV). q/k/v may be None where only their FP4 copy was saved; the FP4 copies
    are dequantized once (bf16 code x scale, a transient buffer) and read by both kernels."""
    _require_triton()
    do = _lastdim_contig(grad_out)
    B, H, Tq, D = do.shape
    dev = do.device
    kv_ref = k if k is not None else (views.k_codes if views.k_codes.dim() == 4 else views.v_codes)
    Hkv, Tk = kv_ref.shape[1], kv_ref.shape[2]
    fq, fk, _ = needs_fp4(mask)
    qh = dequantize_2d(views.q_codes, views.q_scales) if fq else None
    kh = dequantize_2d(views.k_codes, views.k_scales) if fk else None
    q_qk, q_ds = (qh if mask & QK else q), (qh if mask & DSQ else q)
    k_qk, k_ds = (kh if mask & QK else k), (kh if mask & DSK else k)
    v_dov = dequantize_2d(views.v_codes, views.v_scales) if mask & DOV else v
    if q_qk is None or k_qk is None or v_dov is None or q_ds is None or k_ds is None:
        raise RuntimeError("qattn backward: an operand was not saved (precision mask mismatch)")
    q_qk, q_ds, k_qk, k_ds, v_dov = (_lastdim_contig(t) for t in (q_qk, q_ds, k_qk, k_ds, v_dov))
    if mask & (DOV | PDO):
        _, _, g_do, doh = quantize_2d(do, dequantized=True)
    else:
        g_do, doh = torch.zeros((), dtype=torch.float32, device=dev), None
    do_pdo = doh if mask & PDO else do
    do_dov = doh if mask & DOV else do
    delta = (do.float() * out.float()).sum(-1)
    bias, sb, has_bias = _bias_args(attn_mask, B, H, Tq, Tk, dev)
    dtype = do.dtype
    dq = torch.empty((B, H, Tq, D), dtype=dtype, device=dev)
    dk = torch.empty((B, Hkv, Tk, D), dtype=dtype, device=dev)
    dv = torch.empty((B, Hkv, Tk, D), dtype=dtype, device=dev)
    cfg = dict(num_warps=4 if D == 64 else 8, num_stages=2)
    cfg.update(config or {})
    BM = BN = DS_TILE  # fixed: the dS per-tile global scale is defined on this tile (numerics, not tuning)
    G = (views.q_global, views.k_global, views.v_global, g_do)
    flags = dict(QK_FP4=bool(mask & QK), DOV_FP4=bool(mask & DOV), CAUSAL=bool(is_causal), HAS_BIAS=has_bias,
                 BM=BM, BN=BN, D=D)
    tail = (*sb, float(scale), H, H // Hkv, Tq, Tk)
    _attn_bwd_dkdv_kernel[(triton.cdiv(Tk, BN), B * Hkv)](
        q_qk, q_ds, k_qk, v_dov, do_pdo, do_dov, *G, bias, lse, delta, dk, dv,
        *_st(q_qk), *_st(q_ds), *_st(k_qk), *_st(v_dov), *_st(do_pdo), *_st(do_dov), *tail,
        PDO_FP4=bool(mask & PDO), DSQ_FP4=bool(mask & DSQ), **flags, **cfg)
    _attn_bwd_dq_kernel[(triton.cdiv(Tq, BM), B * H)](
        q_qk, k_qk, k_ds, v_dov, do_dov, *G, bias, lse, delta, dq,
        *_st(q_qk), *_st(k_qk), *_st(k_ds), *_st(v_dov), *_st(do_dov), *tail,
        DSK_FP4=bool(mask & DSK), **flags, **cfg)
    return dq, dk, dv
