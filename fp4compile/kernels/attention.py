"""Q-Attn Triton kernels: flash-style (tiled, online softmax, O(T) memory) mixed-precision attention.

The numerics (which operand is quantized how, which copy is reused, the scale levels) are documented in
``attention_ref.py``, whose torch code is the reference these kernels must match. In short:

* ``quantize_2d`` (Triton ``_quant2d_kernel``): Q, K, V (and dO) -> NVFP4 with 16x16 tiles and a per-tensor
  global computed on the device (no host sync). One copy serves both contraction axes, so the forward's copy
  is the one saved for, and reused by, the backward.
* ``attention_fwd``: one program per (128-query block, batch x head); K/V tiles are loaded as BF16 or as FP4
  codes + E4M3 scales and dequantized in registers (code x scale is exact in BF16), S = Q·Kᵀ runs on BF16
  tensor cores with FP32 accumulation, the FP32 global scales multiply the accumulator. P is quantized on the
  fly (1x16 along keys) when attn.pv is NVFP4.
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
    def _load_tile(ptr, codes_ptr, scales_ptr, offs_t, mask_t, stride_t, D: tl.constexpr, FP4: tl.constexpr):
        """[BT, D] bf16 operand tile: the BF16 tensor, or the FP4 copy dequantized (code x E4M3, no global).

        ``ptr`` points at the (batch, head) slice of the BF16 tensor (row stride ``stride_t``); ``codes_ptr`` /
        ``scales_ptr`` at the slice of its contiguous FP4 copy ([T, D/2] bytes, [T, D/16] scale bytes)."""
        if FP4:
            ob = tl.arange(0, D // 2)
            byte = tl.load(codes_ptr + offs_t[:, None] * (D // 2) + ob[None, :], mask=mask_t[:, None], other=0)
            byte = byte.to(tl.int32)
            code = tl.reshape(tl.join(byte & 15, byte >> 4), [offs_t.shape[0], D])
            os_ = tl.arange(0, D // 16)
            sb = tl.load(scales_ptr + offs_t[:, None] * (D // 16) + os_[None, :], mask=mask_t[:, None], other=0)
            sf = sb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            val = tl.reshape(_e2m1_value(code), [offs_t.shape[0], D // 16, 16]) * sf[:, :, None]
            return _to_bf16(tl.reshape(val, [offs_t.shape[0], D]))
        else:
            od = tl.arange(0, D)
            x = tl.load(ptr + offs_t[:, None] * stride_t + od[None, :], mask=mask_t[:, None], other=0.0)
            return _to_bf16(x)

    # -----------------------------------------------------------------------------------------------------
    @triton.jit
    def _quant2d_kernel(x_ptr, codes_ptr, scales_ptr, senc_ptr, gdec_ptr, T, H, sxb, sxh, sxt,
                        BT: tl.constexpr, D: tl.constexpr):
        """NVFP4 RTN, 16x16 tiles over (T, D), of one [BT, D] slab of x[b, h]; == attention_ref.quantize_2d."""
        pid_t = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        offs_t = pid_t * BT + tl.arange(0, BT)
        mt = offs_t < T
        od = tl.arange(0, D)
        x = tl.load(x_ptr + b * sxb + h * sxh + offs_t[:, None] * sxt + od[None, :], mask=mt[:, None],
                    other=0.0).to(tl.float32)
        x4 = tl.reshape(x, [BT // 16, 16, D // 16, 16])
        amax = tl.max(tl.max(tl.abs(x4), axis=3), axis=1)  # [BT/16, D/16]
        s_enc = tl.load(senc_ptr)
        g_dec = tl.load(gdec_ptr)
        sf8 = _to_e4m3(tl.minimum(tl.math.div_rn(amax, 6.0) * s_enc, 448.0))
        sf = sf8.to(tl.float32)
        enc = tl.where(sf == 0.0, 0.0, tl.math.div_rn(tl.full(sf.shape, 1.0, tl.float32), sf * g_dec))
        enc4 = tl.broadcast_to(tl.reshape(enc, [BT // 16, 1, D // 16, 1]), [BT // 16, 16, D // 16, 16])
        a = x * tl.reshape(enc4, [BT, D])
        mag = _e2m1_mag_code(tl.abs(a))
        code = tl.where(a < 0, mag | 8, mag)
        lo, hi = tl.split(tl.reshape(code, [BT, D // 2, 2]))
        packed = (lo | (hi << 4)).to(tl.uint8)
        base = (b * H + h) * T
        ob = tl.arange(0, D // 2)
        tl.store(codes_ptr + (base + offs_t[:, None]) * (D // 2) + ob[None, :], packed, mask=mt[:, None])
        sbytes = sf8.to(tl.uint8, bitcast=True)
        srows = tl.reshape(tl.broadcast_to(tl.reshape(sbytes, [BT // 16, 1, D // 16]), [BT // 16, 16, D // 16]),
                           [BT, D // 16])
        os_ = tl.arange(0, D // 16)
        tl.store(scales_ptr + (base + offs_t[:, None]) * (D // 16) + os_[None, :], srows, mask=mt[:, None])

    # -----------------------------------------------------------------------------------------------------
    @triton.jit
    def _attn_fwd_kernel(Q, K, V, Qc, Qs, Kc, Ks, Vc, Vs, G, Bias, O, LSE,
                         sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot,
                         sbb, sbh, sbm, sbn, sm_scale, H, GROUPS, Tq, Tk,
                         QK_FP4: tl.constexpr, PV_FP4: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        hk = h // GROUPS
        Hkv = H // GROUPS
        offs_m = pid_m * BM + tl.arange(0, BM)
        mm = offs_m < Tq
        q = _load_tile(Q + b * sqb + h * sqh, Qc + (pid_bh * Tq) * (D // 2), Qs + (pid_bh * Tq) * (D // 16),
                       offs_m, mm, sqt, D, QK_FP4)
        kvh = b * Hkv + hk
        k_ptr = K + b * skb + hk * skh
        v_ptr = V + b * svb + hk * svh
        kc_ptr = Kc + (kvh * Tk) * (D // 2)
        ks_ptr = Ks + (kvh * Tk) * (D // 16)
        vc_ptr = Vc + (kvh * Tk) * (D // 2)
        vs_ptr = Vs + (kvh * Tk) * (D // 16)
        qk_scale = sm_scale * 1.4426950408889634
        if QK_FP4:
            qk_scale = qk_scale * tl.load(G) * tl.load(G + 1)
        pv_scale = 1.0
        if PV_FP4:
            pv_scale = tl.load(G + 2) * P_GLOBAL_C
        m_i = tl.full([BM], float("-inf"), tl.float32)
        l_i = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        hi = Tk
        if CAUSAL:
            hi = tl.minimum((pid_m + 1) * BM, Tk)
        for start_n in range(0, hi, BN):
            offs_n = start_n + tl.arange(0, BN)
            mn = offs_n < Tk
            k = _load_tile(k_ptr, kc_ptr, ks_ptr, offs_n, mn, skt, D, QK_FP4)
            s = _mma(q, tl.trans(k)) * qk_scale
            if HAS_BIAS:
                bias = tl.load(Bias + b * sbb + h * sbh + offs_m[:, None] * sbm + offs_n[None, :] * sbn,
                               mask=mm[:, None] & mn[None, :], other=0.0)
                s = s + bias * 1.4426950408889634
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
            v = _load_tile(v_ptr, vc_ptr, vs_ptr, offs_n, mn, svt, D, PV_FP4)
            if PV_FP4:
                pq = _fq_rows(p, G_NUM_C, P_GLOBAL_C, BM, BN)
                acc += _mma(_to_bf16(pq), v) * pv_scale
            else:
                acc += _mma(_to_bf16(p), v)
            m_i = m_new
        empty = l_i == 0.0
        o = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse = tl.where(empty, float("inf"), m_i / 1.4426950408889634 + tl.log(tl.where(empty, 1.0, l_i)))
        od = tl.arange(0, D)
        tl.store(O + b * sob + h * soh + offs_m[:, None] * sot + od[None, :], _cast_like(o, O),
                 mask=mm[:, None])
        tl.store(LSE + pid_bh * Tq + offs_m, lse, mask=mm)

    # -----------------------------------------------------------------------------------------------------
    @triton.jit
    def _attn_bwd_dkdv_kernel(Q, K, V, DO, Qc, Qs, Kc, Ks, Vc, Vs, DOc, DOs, G, Bias, LSE, DELTA, DK, DV,
                              sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdb, sdh, sdt,
                              sbb, sbh, sbm, sbn, sm_scale, H, GROUPS, Tq, Tk,
                              QK_FP4: tl.constexpr, DOV_FP4: tl.constexpr, PDO_FP4: tl.constexpr,
                              DSQ_FP4: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                              BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_bhk = tl.program_id(1)
        Hkv = H // GROUPS
        b = pid_bhk // Hkv
        hk = pid_bhk % Hkv
        offs_n = pid_n * BN + tl.arange(0, BN)
        mn = offs_n < Tk
        kc_ptr = Kc + (pid_bhk * Tk) * (D // 2)
        ks_ptr = Ks + (pid_bhk * Tk) * (D // 16)
        k = _load_tile(K + b * skb + hk * skh, kc_ptr, ks_ptr, offs_n, mn, skt, D, QK_FP4)
        v = _load_tile(V + b * svb + hk * svh, Vc + (pid_bhk * Tk) * (D // 2), Vs + (pid_bhk * Tk) * (D // 16),
                       offs_n, mn, svt, D, DOV_FP4)
        qk_scale = sm_scale * 1.4426950408889634
        if QK_FP4:
            qk_scale = qk_scale * tl.load(G) * tl.load(G + 1)
        dp_scale = 1.0
        if DOV_FP4:
            dp_scale = tl.load(G + 2) * tl.load(G + 3)
        dv_scale = 1.0
        if PDO_FP4:
            dv_scale = tl.load(G + 3) * P_GLOBAL_C
        gq = tl.load(G)
        dk = tl.zeros([BN, D], tl.float32)
        dv = tl.zeros([BN, D], tl.float32)
        lo = 0
        if CAUSAL:
            lo = ((pid_n * BN) // BM) * BM
        for g in range(0, GROUPS):
            h = hk * GROUPS + g
            bh = b * H + h
            q_ptr = Q + b * sqb + h * sqh
            qc_ptr = Qc + (bh * Tq) * (D // 2)
            qs_ptr = Qs + (bh * Tq) * (D // 16)
            do_ptr = DO + b * sdb + h * sdh
            doc_ptr = DOc + (bh * Tq) * (D // 2)
            dos_ptr = DOs + (bh * Tq) * (D // 16)
            for start_m in range(lo, Tq, BM):
                offs_m = start_m + tl.arange(0, BM)
                mm = offs_m < Tq
                q = _load_tile(q_ptr, qc_ptr, qs_ptr, offs_m, mm, sqt, D, QK_FP4)
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
                do_pdo = _load_tile(do_ptr, doc_ptr, dos_ptr, offs_m, mm, sdt, D, PDO_FP4)
                if PDO_FP4:
                    pq = _fq_rows(pT, G_NUM_C, P_GLOBAL_C, BN, BM)
                    dv += _mma(_to_bf16(pq), do_pdo) * dv_scale
                else:
                    dv += _mma(_to_bf16(pT), do_pdo)
                if DOV_FP4 == PDO_FP4:
                    do_dov = do_pdo
                else:
                    do_dov = _load_tile(do_ptr, doc_ptr, dos_ptr, offs_m, mm, sdt, D, DOV_FP4)
                dpT = _mma(v, tl.trans(do_dov)) * dp_scale
                delta = tl.load(DELTA + bh * Tq + offs_m, mask=mm, other=0.0)
                dsT = pT * (dpT - delta[None, :])
                if DSQ_FP4:
                    if QK_FP4:
                        q_dsq = q
                    else:
                        q_dsq = _load_tile(q_ptr, qc_ptr, qs_ptr, offs_m, mm, sqt, D, True)
                    s_enc, g_dec = _tile_scales(dsT)
                    dsq = _fq_rows(dsT, s_enc, g_dec, BN, BM)
                    dk += _mma(_to_bf16(dsq), q_dsq) * (g_dec * gq)
                else:
                    if QK_FP4:
                        q_dsq = _load_tile(q_ptr, qc_ptr, qs_ptr, offs_m, mm, sqt, D, False)
                    else:
                        q_dsq = q
                    dk += _mma(_to_bf16(dsT), q_dsq)
        od = tl.arange(0, D)
        out_off = (pid_bhk * Tk + offs_n[:, None]) * D + od[None, :]
        tl.store(DK + out_off, _cast_like((dk * sm_scale), DK), mask=mn[:, None])
        tl.store(DV + out_off, _cast_like(dv, DV), mask=mn[:, None])

    @triton.jit
    def _attn_bwd_dq_kernel(Q, K, V, DO, Qc, Qs, Kc, Ks, Vc, Vs, DOc, DOs, G, Bias, LSE, DELTA, DQ,
                            sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sdb, sdh, sdt,
                            sbb, sbh, sbm, sbn, sm_scale, H, GROUPS, Tq, Tk,
                            QK_FP4: tl.constexpr, DOV_FP4: tl.constexpr, DSK_FP4: tl.constexpr,
                            CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                            BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        hk = h // GROUPS
        kvh = b * (H // GROUPS) + hk
        offs_m = pid_m * BM + tl.arange(0, BM)
        mm = offs_m < Tq
        q = _load_tile(Q + b * sqb + h * sqh, Qc + (pid_bh * Tq) * (D // 2), Qs + (pid_bh * Tq) * (D // 16),
                       offs_m, mm, sqt, D, QK_FP4)
        do = _load_tile(DO + b * sdb + h * sdh, DOc + (pid_bh * Tq) * (D // 2), DOs + (pid_bh * Tq) * (D // 16),
                        offs_m, mm, sdt, D, DOV_FP4)
        lse = tl.load(LSE + pid_bh * Tq + offs_m, mask=mm, other=float("inf")) * 1.4426950408889634
        delta = tl.load(DELTA + pid_bh * Tq + offs_m, mask=mm, other=0.0)
        k_ptr = K + b * skb + hk * skh
        v_ptr = V + b * svb + hk * svh
        kc_ptr = Kc + (kvh * Tk) * (D // 2)
        ks_ptr = Ks + (kvh * Tk) * (D // 16)
        vc_ptr = Vc + (kvh * Tk) * (D // 2)
        vs_ptr = Vs + (kvh * Tk) * (D // 16)
        qk_scale = sm_scale * 1.4426950408889634
        if QK_FP4:
            qk_scale = qk_scale * tl.load(G) * tl.load(G + 1)
        dp_scale = 1.0
        if DOV_FP4:
            dp_scale = tl.load(G + 2) * tl.load(G + 3)
        gk = tl.load(G + 1)
        dq = tl.zeros([BM, D], tl.float32)
        hi = Tk
        if CAUSAL:
            hi = tl.minimum((pid_m + 1) * BM, Tk)
        for start_n in range(0, hi, BN):
            offs_n = start_n + tl.arange(0, BN)
            mn = offs_n < Tk
            k = _load_tile(k_ptr, kc_ptr, ks_ptr, offs_n, mn, skt, D, QK_FP4)
            s = _mma(q, tl.trans(k)) * qk_scale
            if HAS_BIAS:
                bias = tl.load(Bias + b * sbb + h * sbh + offs_m[:, None] * sbm + offs_n[None, :] * sbn,
                               mask=mm[:, None] & mn[None, :], other=0.0)
                s = s + bias * 1.4426950408889634
            valid = mm[:, None] & mn[None, :]
            if CAUSAL:
                valid = valid & (offs_n[None, :] <= offs_m[:, None])
            p = tl.where(valid, tl.math.exp2(s - lse[:, None]), 0.0)
            v = _load_tile(v_ptr, vc_ptr, vs_ptr, offs_n, mn, svt, D, DOV_FP4)
            dp = _mma(do, tl.trans(v)) * dp_scale
            ds = p * (dp - delta[:, None])
            if DSK_FP4:
                if QK_FP4:
                    k_dsk = k
                else:
                    k_dsk = _load_tile(k_ptr, kc_ptr, ks_ptr, offs_n, mn, skt, D, True)
                s_enc, g_dec = _tile_scales(ds)
                dsq = _fq_rows(ds, s_enc, g_dec, BM, BN)
                dq += _mma(_to_bf16(dsq), k_dsk) * (g_dec * gk)
            else:
                if QK_FP4:
                    k_dsk = _load_tile(k_ptr, kc_ptr, ks_ptr, offs_n, mn, skt, D, False)
                else:
                    k_dsk = k
                dq += _mma(_to_bf16(ds), k_dsk)
        od = tl.arange(0, D)
        tl.store(DQ + (pid_bh * Tq + offs_m[:, None]) * D + od[None, :], _cast_like((dq * sm_scale), DQ),
                 mask=mm[:, None])


# ---------------------------------------------------------------------------------------------------------
# launchers
def _require_triton():
    if triton is None:
        raise RuntimeError("fp4compile attention kernels need Triton")


def _lastdim_contig(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def global_scales(x: Tensor) -> tuple[Tensor, Tensor]:
    """(s_enc, g_dec) fp32 device scalars from x's amax, computed exactly as the reference does (no sync)."""
    amax = x.abs().amax().to(torch.float32)
    zero = amax == 0
    s_enc = torch.where(zero, torch.ones_like(amax), torch.full_like(amax, G_NUM) / amax)  # not G_NUM/amax: rtruediv is reciprocal*G
    return s_enc, torch.where(zero, torch.zeros_like(amax), 1.0 / s_enc)


def quantize_2d(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Triton twin of ``attention_ref.quantize_2d`` for ``[B, H, T, D]`` (D in 16..256, a power of two)."""
    _require_triton()
    x = _lastdim_contig(x)
    B, H, T, D = x.shape
    s_enc, g_dec = global_scales(x)
    codes = torch.empty((B, H, T, D // 2), dtype=torch.uint8, device=x.device)
    scales = torch.empty((B, H, T, D // 16), dtype=torch.uint8, device=x.device)
    BT = 64
    grid = (triton.cdiv(T, BT), B * H)
    _quant2d_kernel[grid](x, codes, scales, s_enc, g_dec, T, H, x.stride(0), x.stride(1), x.stride(2),
                          BT=BT, D=D, num_warps=4)
    return codes, scales, g_dec


def _bias_args(attn_mask: Optional[Tensor], B, H, Tq, Tk, device):
    if attn_mask is None:
        return torch.empty(1, device=device, dtype=torch.float32), (0, 0, 0, 0), False
    if attn_mask.dtype == torch.bool:
        bias = torch.zeros(attn_mask.shape, dtype=torch.float32, device=device).masked_fill(~attn_mask, -math.inf)
    else:
        bias = attn_mask.to(torch.float32)
    bias = bias.expand(B, H, Tq, Tk)
    return bias, tuple(bias.stride()), True


def _dummy(device):
    return torch.empty(1, dtype=torch.uint8, device=device)


def _fwd_config(D: int):
    # Hopper: 128-query tiles, 8 warps. BN is PV_TILE (64): part of the attn.pv numerics, not a tuning knob.
    return dict(BM=128, BN=PV_TILE, num_warps=8, num_stages=3 if D == 64 else 2)


def attention_fwd(q: Tensor, k: Tensor, v: Tensor, views: QuantizedQKV, attn_mask: Optional[Tensor],
                  is_causal: bool, scale: float, mask: int, *, config: Optional[dict] = None):
    """Triton forward: (O [B, H, Tq, D] in q's dtype, LSE fp32 [B, H, Tq])."""
    _require_triton()
    q, k, v = (_lastdim_contig(t) for t in (q, k, v))
    B, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((B, H, Tq), dtype=torch.float32, device=q.device)
    dev = q.device
    G = torch.stack([views.q_global, views.k_global, views.v_global]).to(torch.float32)
    bias, sb, has_bias = _bias_args(attn_mask, B, H, Tq, Tk, dev)
    cfg = dict(_fwd_config(D), **(config or {}))
    BM, BN = cfg.pop("BM"), cfg.pop("BN")
    d = _dummy(dev)
    qc, qs = (views.q_codes, views.q_scales) if mask & QK else (d, d)
    kc, ks = (views.k_codes, views.k_scales) if mask & QK else (d, d)
    vc, vs = (views.v_codes, views.v_scales) if mask & PV else (d, d)
    grid = (triton.cdiv(Tq, BM), B * H)
    _attn_fwd_kernel[grid](q, k, v, qc, qs, kc, ks, vc, vs, G, bias, o, lse,
                           q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                           v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
                           *sb, float(scale), H, H // Hkv, Tq, Tk,
                           QK_FP4=bool(mask & QK), PV_FP4=bool(mask & PV), CAUSAL=bool(is_causal),
                           HAS_BIAS=has_bias, BM=BM, BN=BN, D=D, **cfg)
    return o, lse


def attention_bwd(grad_out: Tensor, q: Optional[Tensor], k: Optional[Tensor], v: Optional[Tensor],
                  views: QuantizedQKV, out: Tensor, lse: Tensor, attn_mask: Optional[Tensor], is_causal: bool,
                  scale: float, mask: int, *, config: Optional[dict] = None):
    """Triton backward: (dQ, dK, dV). q/k/v may be None where only their FP4 copy was saved."""
    _require_triton()
    do = _lastdim_contig(grad_out)
    B, H, Tq, D = do.shape
    dev = do.device
    kv_ref = k if k is not None else (views.k_codes if views.k_codes.dim() == 4 else views.v_codes)
    Hkv, Tk = kv_ref.shape[1], kv_ref.shape[2]
    if v is None and views.v_codes.dim() != 4:
        raise RuntimeError("qattn backward: neither V nor its FP4 copy was saved")
    delta = (do.float() * out.float()).sum(-1)
    d = _dummy(dev)
    dummy_bf = torch.empty(1, dtype=do.dtype, device=dev)
    q_ = _lastdim_contig(q) if q is not None else dummy_bf
    k_ = _lastdim_contig(k) if k is not None else dummy_bf
    v_ = _lastdim_contig(v) if v is not None else dummy_bf
    if mask & (DOV | PDO):
        doc, dos, dog = quantize_2d(do)
    else:
        doc, dos, dog = d, d, torch.zeros((), dtype=torch.float32, device=dev)
    G = torch.stack([views.q_global, views.k_global, views.v_global, dog]).to(torch.float32)
    fq, fk, fv = needs_fp4(mask)
    qc, qs = (views.q_codes, views.q_scales) if fq else (d, d)
    kc, ks = (views.k_codes, views.k_scales) if fk else (d, d)
    vc, vs = (views.v_codes, views.v_scales) if mask & DOV else (d, d)
    bias, sb, has_bias = _bias_args(attn_mask, B, H, Tq, Tk, dev)
    dtype = do.dtype
    dq = torch.empty((B, H, Tq, D), dtype=dtype, device=dev)
    dk = torch.empty((B, Hkv, Tk, D), dtype=dtype, device=dev)
    dv = torch.empty((B, Hkv, Tk, D), dtype=dtype, device=dev)
    cfg = dict(num_warps=4 if D == 64 else 8, num_stages=2)
    cfg.update(config or {})
    BM = BN = DS_TILE  # fixed: the dS per-tile global scale is defined on this tile (numerics, not tuning)

    def strides(t):
        return (t.stride(0), t.stride(1), t.stride(2)) if t.dim() == 4 else (0, 0, 0)

    common = (*strides(q_), *strides(k_), *strides(v_), *strides(do), *sb, float(scale), H, H // Hkv, Tq, Tk)
    flags = dict(QK_FP4=bool(mask & QK), DOV_FP4=bool(mask & DOV), CAUSAL=bool(is_causal), HAS_BIAS=has_bias,
                 BM=BM, BN=BN, D=D)
    _attn_bwd_dkdv_kernel[(triton.cdiv(Tk, BN), B * Hkv)](
        q_, k_, v_, do, qc, qs, kc, ks, vc, vs, doc, dos, G, bias, lse, delta, dk, dv, *common,
        PDO_FP4=bool(mask & PDO), DSQ_FP4=bool(mask & DSQ), **flags, **cfg)
    _attn_bwd_dq_kernel[(triton.cdiv(Tq, BM), B * H)](
        q_, k_, v_, do, qc, qs, kc, ks, vc, vs, doc, dos, G, bias, lse, delta, dq, *common,
        DSK_FP4=bool(mask & DSK), **flags, **cfg)
    return dq, dk, dv
