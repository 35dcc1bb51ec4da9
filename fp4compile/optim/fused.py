"""Fused multi-tensor Triton kernels for the (Q-)AdamW step: one launch per parameter group and kind.

``_qadamw_kernel`` does the whole Q-AdamW update of :func:`fp4compile.optim.qadamw.q_adamw_step` in one
pass over memory: decode m (NVFP4 -> inverse RHT) and sqrt(v) (NVFP4 -> inverse RHT -> + BF16 tile mean ->
resolution floor), the AdamW update, re-encode m (RHT -> NVFP4 with stochastic rounding and 4/6 scaling)
and sqrt(v) (tile mean -> RHT -> NVFP4), and write the parameter (FP32, or BF16 with stochastic rounding /
Kahan compensation). ``_adamw_kernel`` is the FP32-state AdamW of ``qadamw.adamw_step`` for the small and
1-D tensors. Per step and parameter group there are at most two kernel launches (plus a handful of tiny
torch ops for the step counters), however many tensors the group has:

* every program handles one run of ``SCALE_CHUNK`` (1024) elements of one tensor. The runs of all tensors
  of a launch are listed in a chunk table ``(tensor, run)`` and each tensor's addresses in a pointer table
  (int64 ``data_ptr``s cast to pointers in the kernel), both built once and cached on the device; only the
  parameter/gradient addresses are re-read each step and re-uploaded when they change;
* the states' second-level NVFP4 scale is per 1024-element run (``qadamw.SCALE_CHUNK``), so a program needs
  no tensor-wide amax and no second pass; everything else (block scales, 4/6 choice, tile means, Hadamard
  mixes, the decode floor) lives inside a run;
* ``lr`` is a device tensor and the step counters stay on the device: no host synchronization.

Layout (kernel 2, the default; ``KERNEL``): a program of 2 warps holds its run's 64 16-element blocks one per
thread, each as four 16-byte "quarters" ([64, 4] tensors, ``_q_*`` helpers), so the block max, the E4M3
scales, the 4/6 search, the error trees and the 16-point Hadamard never leave the thread's registers and no
per-block work is replicated. E2M1 codes come from FP adds/mins (``_e2m1_mag_magic``), the 4/6 search works on
magnitudes and RTN reuses the winning candidate's codes, codes are unpacked from and packed into int32 words
(8 codes each) in registers, the Hadamard signs read as float tables (:func:`_sign_table`). Static sm_90 SASS of
the default configuration: 3864 instructions per thread of 16 elements (241.5 per element; 128 registers, no
spills; ~280 when this paragraph was first written; 253.5 before session 46's sign tables, whose kernel took 1.06×
the time of this one on the H200) vs 6400 per thread of 8 (~800) for the first
version (``_qadamw_kernel_v1``, [N] / [N/16, 16] tiles spread over 4 warps with shuffles and shared-memory
exchanges, kept for comparison; ``bench/qadamw_sass.py`` counts them on a machine without a GPU). Parameters and
gradients must be 16-byte aligned (else the torch step runs). H200, 124M set: 1.48 ms per step vs 6.17 ms for
the first version and 1.06 ms for ``torch.optim.AdamW(fused=True)`` (docs/BENCHMARKS.md).

Bit-exactness: the kernels reproduce the torch reference steps bit for bit (same operations in the same
order: ``div_rn``/``sqrt_rn``, no FMA contraction (``enable_fp_fusion=False``), the same butterfly Hadamard,
pairwise tree sums and counter-based hash for the random bits); per-tensor scalars (bias corrections,
decay, step size) are computed by the same torch function (``qadamw.adam_coefficients``) for both.
``tests/test_optim_fused.py`` checks this under ``TRITON_INTERPRET=1``; the GPU test checks it on CUDA.
The E2M1/E4M3 rounding and the butterfly come from ``kernels/quantize.py`` (shared with the quantize kernels).
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from ..kernels.launch import stable_cache_keys
from ..kernels.quantize import SR_RP as _SR_RP
from ..kernels.quantize import (AMAX_FLUSH, _MAGIC_PACK, _e2m1_mag_magic, _e2m1_rne, _e2m1_sr_mag_magic, _e2m1_value,
                                _e4m3_code, _e4m3_value, _fwht, _launch_opts, _mag_value_magic)
from . import qadamw as _qa
from .codec import SQRT_V_MAX

CH = _qa.SCALE_CHUNK
#: which Q-AdamW kernel runs: 2 = :func:`_qadamw_kernel` (block per thread, default), 1 = :func:`_qadamw_kernel_v1`
#: (the first version: [N] / [N/16, 16] tiles spread over threads; kept for comparison, same results bit for bit)
KERNEL = int(os.environ.get("FP4COMPILE_QADAMW_KERNEL", "2"))
#: Triton warps per program (1024 elements each) of the Q-AdamW kernel; 0 = the kernel's default: 2 for kernel 2
#: (64 threads, one 16-block each; 1.48 ms on the 124M set on the H200 vs 1.62 ms with 1 warp, two blocks per
#: thread; ``bench/qadamw_variants.py``), 4 for kernel 1 (fastest of 1, 2, 4, 8 for it: 22.7, 11.1, 7.1-7.8, 9.0 ms)
NUM_WARPS = int(os.environ.get("FP4COMPILE_QADAMW_WARPS", "0"))
#: kernel 2: Triton's register cap per thread (``maxnreg``; 0 = the compiler's choice: 128 registers, 8 programs of
#: 2 warps per SM). Static sm_90 (session 30): 96 -> +96 instructions per thread and 23 spilled words, 10 programs;
#: 80 -> +144, 41 words, 12 programs; 64 -> +216, 75 words, 16 programs. H200, 124M set, alternating twice: 0 1.304,
#: 1.326 ms; 96 1.369, 1.376; 80 1.360, 1.358; 64 1.541, 1.555 (more resident warps do not pay for the spills)
MAXNREG = int(os.environ.get("FP4COMPILE_QADAMW_MAXNREG", "0"))
#: kernel 2, SR: the E2M1 codes by directed-rounding PTX (True; :data:`fp4compile.kernels.quantize.SR_RP`) or by the
#: comparison form (False, the default); the same codes. Static sm_90: 246 vs 254 instructions per element (234 vs
#: 241.5 since session 46's sign tables), but 165 registers instead of 128 (6 programs per SM instead of 8). H200,
#: 124M set (session 43): 1.36 / 1.42 ms per step with it against 1.32 / 1.32 without, 1.31 with it under a
#: 128-register cap (spills). ``FP4COMPILE_QADAMW_SR_RP=1`` turns it on (never under ``TRITON_INTERPRET=1``).
SR_RP = _SR_RP and os.environ.get("FP4COMPILE_QADAMW_SR_RP", "0") == "1"
#: kernel 2, RTN + 4/6: reuse the winning candidate's codes from the 4/6 search (1) or re-round (0)
REUSE = int(os.environ.get("FP4COMPILE_QADAMW_REUSE", "1"))
#: kernel 2, timing ablations only (bit mask; results are NOT the reference's): 1 approximate sqrt/divisions in the
#: update, 2 no SR hash (constant uniform). 0 (default) is the exact kernel.
PROF = int(os.environ.get("FP4COMPILE_QADAMW_PROF", "0"))
#: butterfly implementation of ``kernels.quantize._fwht`` (0: permute/split/join, 1: flip; 1 measured faster on the
#: H200: 7.06 vs 7.93 ms on the 124M set)
RHT_IMPL = int(os.environ.get("FP4COMPILE_QADAMW_RHT_IMPL", "1"))
_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_FTYPES = tl.constexpr((tl.float32, tl.bfloat16, tl.float16))  # Triton element type of each _KIND
_SQRT_V_MAX = tl.constexpr(SQRT_V_MAX)  # sqrt(v) saturates here, as in the reference (codec.saturate_sqrt_v)
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# pointer-table columns
_Q_COLS = ("numel", "m_codes", "m_scales", "m_gbits", "v_codes", "v_scales", "v_gbits", "v_mean", "m_signs",
           "v_signs", "seed", "comp")
_F_COLS = ("numel", "exp_avg", "exp_avg_sq", "seed", "comp")


# ---------------------------------------------------------------------------------------------- helpers
@triton.jit
def _fptr(addr, KIND: tl.constexpr):
    if KIND == 0:
        r = addr.to(tl.pointer_type(tl.float32))
    elif KIND == 1:
        r = addr.to(tl.pointer_type(tl.bfloat16))
    else:
        r = addr.to(tl.pointer_type(tl.float16))
    return r


@triton.jit
def _bf16_rne(x):
    """FP32 -> BF16, round to nearest even, on the bit pattern (what ``.to(torch.bfloat16)`` does; written out
    because the Triton interpreter's cast truncates)."""
    b = x.to(tl.int32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    return b.to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def _hash(idx, seed):
    """``codec.hash_bits`` for int64 element indices and a uint32 seed: uint32 words."""
    x = (idx & 0xFFFFFFFF).to(tl.uint32) * 0x2545F491 + seed * 0x61C88647 + 0x1B873593
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x2C1B3C6D
    x = x ^ (x >> 16)
    x = x * 0x297A2D39
    return x ^ (x >> 15)


@triton.jit
def _step_seed(base, step_f, STREAM: tl.constexpr):
    """``codec.step_seed``: (base + step * 0x9E3779B1 + stream * 0x165667B1) mod 2^32."""
    s = (base + step_f.to(tl.int64) * 0x9E3779B1 + STREAM * 0x165667B1) & 0xFFFFFFFF
    return s.to(tl.uint32)


@triton.jit
def _tree_rows(t, R: tl.constexpr, N: tl.constexpr):
    """[R, N] -> [R]: sum of each row as a pairwise tree of adjacent pairs (``formats.nvfp4.tree_sum``)."""
    if N >= 1024:
        a, b = tl.split(tl.reshape(t, (R, 512, 2)))
        t = a + b
    if N >= 512:
        a, b = tl.split(tl.reshape(t, (R, 256, 2)))
        t = a + b
    if N >= 256:
        a, b = tl.split(tl.reshape(t, (R, 128, 2)))
        t = a + b
    if N >= 128:
        a, b = tl.split(tl.reshape(t, (R, 64, 2)))
        t = a + b
    if N >= 64:
        a, b = tl.split(tl.reshape(t, (R, 32, 2)))
        t = a + b
    if N >= 32:
        a, b = tl.split(tl.reshape(t, (R, 16, 2)))
        t = a + b
    if N >= 16:
        a, b = tl.split(tl.reshape(t, (R, 8, 2)))
        t = a + b
    if N >= 8:
        a, b = tl.split(tl.reshape(t, (R, 4, 2)))
        t = a + b
    if N >= 4:
        a, b = tl.split(tl.reshape(t, (R, 2, 2)))
        t = a + b
    a, b = tl.split(tl.reshape(t, (R, 1, 2)))
    return tl.reshape(a + b, (R,))


@triton.jit
def _rht(x, s_ptr, N: tl.constexpr, D: tl.constexpr, NORM: tl.constexpr, IMPL: tl.constexpr):
    """``codec.rht``: (x * s) H_D / sqrt(D) along runs of D of a flat [N] vector (s: the sign table's first row)."""
    s = tl.load(s_ptr + tl.arange(0, D))
    xs = tl.reshape(x, (N // D, D)) * s[None, :]
    y = _fwht(xs, N // D, D, IMPL) * NORM
    return tl.reshape(y, (N,))


@triton.jit
def _irht(y, s_ptr, N: tl.constexpr, D: tl.constexpr, NORM: tl.constexpr, IMPL: tl.constexpr):
    """``codec.inverse_rht``: (y H_D / sqrt(D)) * s."""
    s = tl.load(s_ptr + tl.arange(0, D))
    z = _fwht(tl.reshape(y, (N // D, D)), N // D, D, IMPL) * NORM
    return tl.reshape(z * s[None, :], (N,))


@triton.jit
def _unpack(ptr, base, n, N: tl.constexpr):
    """N E2M1 codes (int32) of elements [base, base + N) from two-per-byte storage (element 2i low nibble)."""
    o = base // 2 + tl.arange(0, N // 2)
    b = tl.load(ptr + o, mask=o < n // 2, other=0).to(tl.int32)
    return tl.reshape(tl.join(b & 15, b >> 4), (N,))


@triton.jit
def _decode(codes_ptr, scales_ptr, g, base, n, N: tl.constexpr):
    """``codec.decode`` of one run: (values [N], block scale * global [N // 16])."""
    q = _e2m1_value(_unpack(codes_ptr, base, n, N))
    ob = base // 16 + tl.arange(0, N // 16)
    sf = _e4m3_value(tl.load(scales_ptr + ob, mask=ob < n // 16, other=0).to(tl.int32))
    s = sf * g
    return tl.reshape(tl.reshape(q, (N // 16, 16)) * s[:, None], (N,)), s


@triton.jit
def _run_global(amax, FOS: tl.constexpr):
    """The run's second-level scale from its amax: (all-zero flag, s_enc = G / amax, decode scale 1 / s_enc),
    G = 6 * 448 (6 * 256 with 4/6); an amax below AMAX_FLUSH encodes the run as zeros."""
    zero = amax < AMAX_FLUSH
    if FOS:
        numer = 1536.0
    else:
        numer = 2688.0
    one = tl.full([], 1.0, tl.float32)
    s_enc = tl.where(zero, one, tl.math.div_rn(tl.full([], numer, tl.float32), tl.where(zero, one, amax)))
    gs = tl.where(zero, 0.0, tl.math.div_rn(one, s_enc))
    return zero, s_enc, gs


@triton.jit
def _scale_for(ab, M: tl.constexpr, s_enc, gs):
    v = tl.minimum(tl.math.div_rn(ab, tl.full(ab.shape, M, tl.float32)) * s_enc, 448.0)
    code = _e4m3_code(v)
    sf = _e4m3_value(code)
    enc = tl.where(sf == 0, 0.0, tl.math.div_rn(tl.full(sf.shape, 1.0, tl.float32), sf * gs))
    return code, sf, enc


@triton.jit
def _sse(xb, sf, enc, gs, NB: tl.constexpr, SSE64: tl.constexpr):
    """Per-block sum of squared errors of one 4/6 candidate (FP64 or FP32, adjacent-pair tree)."""
    q = _e2m1_value(_e2m1_rne(xb * enc[:, None])) * (sf * gs)[:, None]
    if SSE64:
        d = xb.to(tl.float64) - q.to(tl.float64)
    else:
        d = xb - q
    return _tree_rows(d * d, NB, 16)


@triton.jit
def _sr_codes(v, u):
    """``codec.e2m1_sr_codes``: unbiased stochastic rounding onto the E2M1 grid -> codes."""
    a = tl.minimum(tl.abs(v), 6.0)
    step = tl.where(a < 2.0, 0.5, tl.where(a < 4.0, 1.0, 2.0))
    inv = tl.where(a < 2.0, 2.0, tl.where(a < 4.0, 1.0, 0.5))  # x / 2^k == x * 2^-k exactly: no division
    lo = tl.floor(a * inv) * step
    q = tl.minimum(tl.where(u < (a - lo) * inv, lo + step, lo), 6.0)
    sign = (v.to(tl.uint32, bitcast=True) >> 31).to(tl.int32)
    # the sign goes in as a bit: Triton's ``-q`` is ``0 - q``, which turns -0 into +0 (torch keeps -0 -> code 8)
    return _e2m1_rne(q) | (sign << 3)


@triton.jit
def _encode_store(y, u, codes_ptr, scales_ptr, gbits_ptr, c, base, n, N: tl.constexpr,
                  FOS: tl.constexpr, SR: tl.constexpr, SSE64: tl.constexpr):
    """``codec.encode`` of one run (its own second-level scale) -> stores codes, scale bytes, global. ``u``: the
    run's SR uniforms [N] (read only when SR)."""
    NB: tl.constexpr = N // 16
    xb = tl.reshape(y, (NB, 16))
    ab = tl.max(tl.abs(xb), axis=1)
    amax = tl.max(ab, axis=0)  # the run's amax from the block amaxes (max is exact: same value)
    zero, s_enc, gs = _run_global(amax, FOS)
    code, sf, enc = _scale_for(ab, 6.0, s_enc, gs)
    if FOS:
        code4, sf4, enc4 = _scale_for(ab, 4.0, s_enc, gs)
        pick4 = _sse(xb, sf4, enc4, gs, NB, SSE64) < _sse(xb, sf, enc, gs, NB, SSE64)
        code = tl.where(pick4, code4, code)
        enc = tl.where(pick4, enc4, enc)
    scaled = xb * enc[:, None]
    if SR:
        q = _sr_codes(scaled, tl.reshape(u, (NB, 16)))
    else:
        q = _e2m1_rne(scaled)
    q = tl.where(zero, 0, q)
    lo, hi = tl.split(tl.reshape(q, (N // 2, 2)))
    o2 = base // 2 + tl.arange(0, N // 2)
    tl.store(codes_ptr + o2, (lo | (hi << 4)).to(tl.uint8), mask=o2 < n // 2)
    ob = base // 16 + tl.arange(0, NB)
    tl.store(scales_ptr + ob, code.to(tl.uint8), mask=ob < n // 16)
    tl.store(gbits_ptr + c, gs)


@triton.jit
def _write_param(p_ptr, comp_addr, p32, offs, mask, base_seed, step_f, MASTER: tl.constexpr):
    """``qadamw._write_param``: 0 plain cast, 1 BF16 stochastic rounding, 2 BF16 + Kahan compensation."""
    if MASTER == 1:
        r = (_hash(offs, _step_seed(base_seed, step_f, 2)) & 0xFFFF).to(tl.int32)
        bits = (p32.to(tl.int32, bitcast=True) + r) & -65536
        tl.store(p_ptr + offs, bits.to(tl.float32, bitcast=True).to(tl.bfloat16), mask=mask)
    elif MASTER == 2:
        comp_ptr = comp_addr.to(tl.pointer_type(tl.bfloat16))
        s = p32 + tl.load(comp_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        new = _bf16_rne(s)
        tl.store(comp_ptr + offs, _bf16_rne(s - new.to(tl.float32)), mask=mask)
        tl.store(p_ptr + offs, new, mask=mask)
    elif p_ptr.dtype.element_ty == tl.bfloat16:
        tl.store(p_ptr + offs, _bf16_rne(p32), mask=mask)
    else:
        tl.store(p_ptr + offs, p32.to(p_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------- kernels
@triton.jit
def _run_start(qtab, coef, coef_stride, chunks, N: tl.constexpr, NQ: tl.constexpr):
    """This program's run from the chunk table -> (tensor t, run c, its pointer-table row, numel n, first
    element base, the tensor's coefficients decay / step size / sqrt(bias correction 2) / step, base seed)."""
    pid = tl.program_id(0)
    t = tl.load(chunks + 2 * pid)
    c = tl.load(chunks + 2 * pid + 1).to(tl.int64)
    row = qtab + t * NQ
    n = tl.load(row + 0)
    decay = tl.load(coef + t)
    step_size = tl.load(coef + coef_stride + t)
    bc2s = tl.load(coef + 2 * coef_stride + t)
    step_f = tl.load(coef + 3 * coef_stride + t)
    base_seed = tl.load(tl.load(row + 10).to(tl.pointer_type(tl.int64)))
    return t, c, row, n, c * N, decay, step_size, bc2s, step_f, base_seed


@triton.jit
def _state_ptrs(row, CODE_T: tl.constexpr):
    """The NVFP4 state addresses of a pointer-table row (columns of ``_Q_COLS``), codes read as ``CODE_T``."""
    return (tl.load(row + 1).to(tl.pointer_type(CODE_T)), tl.load(row + 2).to(tl.pointer_type(tl.uint8)),
            tl.load(row + 3).to(tl.pointer_type(tl.float32)), tl.load(row + 4).to(tl.pointer_type(CODE_T)),
            tl.load(row + 5).to(tl.pointer_type(tl.uint8)), tl.load(row + 6).to(tl.pointer_type(tl.float32)),
            tl.load(row + 7).to(tl.pointer_type(tl.bfloat16)),
            tl.multiple_of(tl.load(row + 8).to(tl.pointer_type(tl.float32)), 16),
            tl.multiple_of(tl.load(row + 9).to(tl.pointer_type(tl.float32)), 16))


@triton.jit
def _qadamw_kernel_v1(qtab, ptab, coef, coef_stride, chunks, b1c, sb2, sb2c, eps,
                   N: tl.constexpr, NQ: tl.constexpr, TILE: tl.constexpr, MH: tl.constexpr, VH: tl.constexpr,
                   MNORM: tl.constexpr, VNORM: tl.constexpr, M_SR: tl.constexpr, M_FOS: tl.constexpr,
                   V_SR: tl.constexpr, V_FOS: tl.constexpr, P_KIND: tl.constexpr, G_KIND: tl.constexpr,
                   MASTER: tl.constexpr, MAXIMIZE: tl.constexpr, IMPL: tl.constexpr, SSE64: tl.constexpr):
    t, c, row, n, base, decay, step_size, bc2s, step_f, base_seed = _run_start(qtab, coef, coef_stride, chunks,
                                                                                N, NQ)
    offs = base + tl.arange(0, N)
    mask = offs < n
    m_codes, m_scales, m_gbits, v_codes, v_scales, v_gbits, v_mean, m_signs, v_signs = _state_ptrs(row, tl.uint8)
    p_ptr = _fptr(tl.load(ptab + 2 * t), P_KIND)
    g_ptr = _fptr(tl.load(ptab + 2 * t + 1), G_KIND)

    # ---- decode m and sqrt(v)
    m, _s = _decode(m_codes, m_scales, tl.load(m_gbits + c), base, n, N)
    if MH > 0:
        m = _irht(m, m_signs, N, MH, MNORM, IMPL)
    y, vs = _decode(v_codes, v_scales, tl.load(v_gbits + c), base, n, N)
    if VH > 0:
        y = _irht(y, v_signs, N, VH, VNORM, IMPL)
    ot = base // TILE + tl.arange(0, N // TILE)
    mu = tl.load(v_mean + ot, mask=ot < n // TILE, other=0.0).to(tl.float32)
    r = tl.reshape(tl.reshape(y, (N // TILE, TILE)) + mu[:, None], (N,))
    lo = vs * 0.25
    if VH > 16:  # the floor is the max over the blocks of one Hadamard group
        lg = tl.max(tl.reshape(lo, (N // VH, VH // 16)), axis=1)
        lo = tl.reshape(tl.broadcast_to(lg[:, None], (N // VH, VH // 16)), (N // 16,))
    r = tl.maximum(r, tl.reshape(tl.broadcast_to(lo[:, None], (N // 16, 16)), (N,)))

    # ---- the AdamW update (the same arithmetic as the default kernel's, :func:`_q_update`)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m, r, p32 = _q_update(m, r, g, p, b1c, sb2, sb2c, bc2s, eps, decay, step_size, MAXIMIZE, 0)

    # ---- re-encode m and sqrt(v); write the parameter
    m = tl.where(mask, m, 0.0)
    r = tl.where(mask, r, 0.0)
    if MH > 0:
        m = _rht(m, m_signs, N, MH, MNORM, IMPL)
    # one hash per element for both moments' SR (``codec.shared_sr_uniforms``: m the high 16 bits, v the low)
    if M_SR or V_SR:
        h = _hash(offs, _step_seed(base_seed, step_f, 0))
        um = _hi16(h)
        uv = _lo16(h)
    else:
        um = 0.0
        uv = 0.0
    _encode_store(m, um, m_codes, m_scales, m_gbits, c, base, n, N, M_FOS, M_SR, SSE64)
    mu = _bf16_rne(_tree_rows(tl.reshape(r, (N // TILE, TILE)), N // TILE, TILE) * (1.0 / TILE))
    tl.store(v_mean + ot, mu, mask=ot < n // TILE)
    res = tl.reshape(tl.reshape(r, (N // TILE, TILE)) - mu.to(tl.float32)[:, None], (N,))
    res = tl.where(mask, res, 0.0)
    if VH > 0:
        res = _rht(res, v_signs, N, VH, VNORM, IMPL)
    _encode_store(res, uv, v_codes, v_scales, v_gbits, c, base, n, N, V_FOS, V_SR, SSE64)
    _write_param(p_ptr, tl.load(row + 11), p32, offs, mask, base_seed, step_f, MASTER)


# ---------------------------------------------------------------------------------------------- block-per-thread
# The default Q-AdamW kernel holds every 16-element block of its run in ONE thread, as four "quarters"
# [NB, 4] (elements 4k..4k+3 of each block, k = 0..3; each a 16-byte load of FP32): the block max, the E4M3
# scale math, the 4/6 choice, the error sums and the 16-point Hadamard are register-only (no shuffles, no
# per-block work replicated over threads). Only what spans several blocks goes across threads: the run's amax,
# tile means over tile > 16 elements, Hadamard sizes > 16 and the decode floor over their groups.
@triton.jit
def _q_h1(x, NB: tl.constexpr):
    """Butterfly stage h = 1 inside a quarter: (x0, x1), (x2, x3) -> (a + b, a - b)."""
    a, b = tl.split(tl.reshape(x, (NB, 2, 2)))
    return tl.reshape(tl.join(a + b, a - b), (NB, 4))


@triton.jit
def _q_h1_signed(x, s, NB: tl.constexpr):
    """Signs ``s`` ([1, 4] or [NB, 4], +-1) times :func:`_q_h1`: (a sa + b sb, a sa - b sb) as p = a sa, fma(b, sb, p),
    fma(b, -sb, p). The products by +-1 are exact, so each output is the single rounding of the reference's
    (x * s)[j] +- (x * s)[j + 1], signed zeros included (3 operations per pair instead of 4)."""
    a, b = tl.split(tl.reshape(x, (NB, 2, 2)))
    sa, sb = tl.split(tl.reshape(tl.broadcast_to(s, (NB, 4)), (NB, 2, 2)))
    p = a * sa
    # sb * -1 (not -sb, Triton's 0 - sb): ptxas folds it into the FMA's operand negation
    return tl.reshape(tl.join(tl.fma(b, sb, p), tl.fma(b, sb * -1.0, p)), (NB, 4))


@triton.jit
def _q_h2(x, NB: tl.constexpr):
    """Butterfly stage h = 2 inside a quarter: (x0, x2), (x1, x3)."""
    a, b = tl.split(tl.permute(tl.reshape(x, (NB, 2, 2)), (0, 2, 1)))
    return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (NB, 4))


@triton.jit
def _q_hblk(x, NB: tl.constexpr, H: tl.constexpr):
    """Butterfly stage h = 16 H across blocks: block b pairs with block b ^ H (partner via ``tl.flip``)."""
    v = tl.reshape(x, (NB // (2 * H), 2, H, 4))
    p = tl.flip(v, 1)
    sgn = tl.where(tl.arange(0, 2) == 0, 1.0, -1.0)
    return tl.reshape(tl.fma(v, sgn[None, :, None, None], p), (NB, 4))  # exact +-v + p: one rounding


@triton.jit
def _q_fwht(x0, x1, x2, x3, NB: tl.constexpr, D: tl.constexpr, H1: tl.constexpr = True):
    """Unnormalized Walsh-Hadamard butterflies over runs of D (>= 16) elements held as quarters: stages
    h = 1, 2 inside each quarter, h = 4, 8 between quarters, h >= 16 across blocks (the reference's order).
    ``H1=False``: the caller has done stage h = 1 (:func:`_q_h1_signed`)."""
    if H1:
        x0, x1, x2, x3 = _q_h1(x0, NB), _q_h1(x1, NB), _q_h1(x2, NB), _q_h1(x3, NB)
    x0, x1, x2, x3 = _q_h2(x0, NB), _q_h2(x1, NB), _q_h2(x2, NB), _q_h2(x3, NB)
    x0, x1 = x0 + x1, x0 - x1
    x2, x3 = x2 + x3, x2 - x3
    x0, x2 = x0 + x2, x0 - x2
    x1, x3 = x1 + x3, x1 - x3
    if D >= 32:
        x0, x1, x2, x3 = _q_hblk(x0, NB, 1), _q_hblk(x1, NB, 1), _q_hblk(x2, NB, 1), _q_hblk(x3, NB, 1)
    if D >= 64:
        x0, x1, x2, x3 = _q_hblk(x0, NB, 2), _q_hblk(x1, NB, 2), _q_hblk(x2, NB, 2), _q_hblk(x3, NB, 2)
    if D >= 128:
        x0, x1, x2, x3 = _q_hblk(x0, NB, 4), _q_hblk(x1, NB, 4), _q_hblk(x2, NB, 4), _q_hblk(x3, NB, 4)
    return x0, x1, x2, x3


@triton.jit
def _q_signs(s_ptr, k: tl.constexpr, NB: tl.constexpr, D: tl.constexpr):
    """Quarter k's entries of one row of a sign table (:func:`_sign_table`): [1, 4] (D = 16) or [NB, 4] (block b
    uses entries (b mod D/16) * 16 + ...). 16-byte vector loads, no conversion."""
    j = 4 * k + tl.arange(0, 4)
    if D == 16:
        s = tl.load(s_ptr + j)[None, :]
    else:
        s = tl.load(s_ptr + tl.multiple_of((tl.arange(0, NB) % (D // 16)) * 16, 16)[:, None] + j[None, :])
    return s


@triton.jit
def _q_rht(x0, x1, x2, x3, s_ptr, NB: tl.constexpr, D: tl.constexpr, NORM: tl.constexpr):
    """``codec.rht``: (x * s) H_D * (1 / sqrt(D)), s from the sign table's first row."""
    x0, x1, x2, x3 = _q_fwht(_q_h1_signed(x0, _q_signs(s_ptr, 0, NB, D), NB),
                             _q_h1_signed(x1, _q_signs(s_ptr, 1, NB, D), NB),
                             _q_h1_signed(x2, _q_signs(s_ptr, 2, NB, D), NB),
                             _q_h1_signed(x3, _q_signs(s_ptr, 3, NB, D), NB), NB, D, False)
    return x0 * NORM, x1 * NORM, x2 * NORM, x3 * NORM


@triton.jit
def _q_irht(x0, x1, x2, x3, s_ptr, NB: tl.constexpr, D: tl.constexpr):
    """``codec.inverse_rht``: (y H_D * (1 / sqrt(D))) * s, as one product y H_D * (s / sqrt(D)) by the sign table's
    second row (s = +-1: the same bits, signed zeros included)."""
    x0, x1, x2, x3 = _q_fwht(x0, x1, x2, x3, NB, D)
    sn = s_ptr + D
    return (x0 * _q_signs(sn, 0, NB, D), x1 * _q_signs(sn, 1, NB, D), x2 * _q_signs(sn, 2, NB, D),
            x3 * _q_signs(sn, 3, NB, D))


@triton.jit
def _q_tree(t, NB: tl.constexpr):
    """[NB, 4] -> [NB]: ((t0 + t1) + (t2 + t3)), the adjacent-pair tree of one quarter."""
    a, b = tl.split(tl.reshape(t, (NB, 2, 2)))
    a, b = tl.split(a + b)
    return a + b


@triton.jit
def _q_decode_quarter(w, SH: tl.constexpr, s):
    """4 E2M1 codes (nibbles SH/4 .. SH/4 + 3 of the int32 words ``w`` [NB]) -> value * s (``codec.decode``), by
    the kernels' bit-placement decoder :func:`_e2m1_value` (code 8 decodes to -0, as the reference)."""
    sh = SH + 4 * tl.arange(0, 4)
    return _e2m1_value(w[:, None] >> sh[None, :]) * s[:, None]


@triton.jit
def _q_decode(codes_ptr, scales_ptr, g, base, bmask, NB: tl.constexpr):
    """``codec.decode`` of one run as quarters, plus the per-block decode scale (E4M3 scale * global).
    ``codes_ptr``: the packed codes as int32 words (8 codes each, element 8i + j in bits 4j..4j+3)."""
    blk = tl.arange(0, NB)
    wi = base // 8 + 2 * blk
    w0 = tl.load(codes_ptr + wi, mask=bmask, other=0)
    w1 = tl.load(codes_ptr + wi + 1, mask=bmask, other=0)
    sf = _e4m3_value(tl.load(scales_ptr + base // 16 + blk, mask=bmask, other=0).to(tl.int32))
    s = sf * g
    return (_q_decode_quarter(w0, 0, s), _q_decode_quarter(w0, 16, s), _q_decode_quarter(w1, 0, s),
            _q_decode_quarter(w1, 16, s), s)


@triton.jit
def _q_sse(a, enc6, enc4, qs6, qs4, NB: tl.constexpr, SSE64: tl.constexpr):
    """One quarter's share of both 4/6 candidates' squared errors (``codec.encode``'s ``sse``) from |x|:
    x - q = sign(x) (|x| - |q|) exactly (q carries x's sign), so the sums are those of the signed values.
    Returns (tree sums 6, 4; the candidates' MAGIC + code floats, for reuse by RTN)."""
    m6 = _e2m1_mag_magic(a * enc6[:, None])
    m4 = _e2m1_mag_magic(a * enc4[:, None])
    q6 = _mag_value_magic(m6) * qs6[:, None]
    q4 = _mag_value_magic(m4) * qs4[:, None]
    if SSE64:
        d6 = a.to(tl.float64) - q6.to(tl.float64)
        d4 = a.to(tl.float64) - q4.to(tl.float64)
    else:
        d6 = a - q6
        d4 = a - q4
    return _q_tree(d6 * d6, NB), _q_tree(d4 * d4, NB), m6, m4


@triton.jit
def _q_pack(m, x, SH: tl.constexpr):
    """4 codes (MAGIC + magnitude floats ``m``, signs from ``x``) shifted to nibbles SH/4.. of a word, plus
    MAGIC's bits shifted alike (the caller subtracts ``_MAGIC_PACK`` once per word; see ``_pack_magic``)."""
    sh = (SH + 4 * tl.arange(0, 4)).to(tl.uint32)[None, :]
    mb = m.to(tl.uint32, bitcast=True)
    sgn = (x.to(tl.uint32, bitcast=True) >> (28 - sh)) & (8 << sh)
    return tl.sum((mb << sh) | sgn, axis=1)


@triton.jit
def _q_hash(idx0, K: tl.constexpr, seed):
    """``codec.hash_bits`` of quarter K (uint32 element indices idx0 + 4K + j, mod 2^32): uint32 [NB, 4]."""
    i = idx0[:, None] + (4 * K + tl.arange(0, 4)).to(tl.uint32)[None, :]
    return _hash(i, seed)


@triton.jit
def _q_hashes(idx0, seed):
    """:func:`_q_hash` of the four quarters."""
    return _q_hash(idx0, 0, seed), _q_hash(idx0, 1, seed), _q_hash(idx0, 2, seed), _q_hash(idx0, 3, seed)


@triton.jit
def _hi16(h):
    """``codec.shared_sr_uniforms``' first stream: the high 16 bits of a hash word as a uniform in [0, 1)."""
    return (h >> 16).to(tl.float32) * 1.52587890625e-05


@triton.jit
def _lo16(h):
    """``codec.shared_sr_uniforms``' second stream: the low 16 bits as a uniform in [0, 1)."""
    return (h & 0xFFFF).to(tl.float32) * 1.52587890625e-05


@triton.jit
def _q_encode_store(x0, x1, x2, x3, u0, u1, u2, u3, codes_ptr, scales_ptr, gbits_ptr, c, base, bmask,
                    NB: tl.constexpr, FOS: tl.constexpr, SR: tl.constexpr, SSE64: tl.constexpr,
                    REUSE: tl.constexpr, MAGIC_PACK: tl.constexpr, PROF: tl.constexpr, SR_RP: tl.constexpr):
    """``codec.encode`` of one run held as quarters (its own second-level scale) -> stores the packed codes
    (two int32 words per block), the scale bytes and the global decode scale. ``u0..u3``: the quarters' SR
    uniforms (read only when SR); ``SR_RP``: :data:`SR_RP`."""
    a0 = tl.abs(x0)
    a1 = tl.abs(x1)
    a2 = tl.abs(x2)
    a3 = tl.abs(x3)
    ab = tl.maximum(tl.maximum(tl.max(a0, axis=1), tl.max(a1, axis=1)),
                    tl.maximum(tl.max(a2, axis=1), tl.max(a3, axis=1)))
    amax = tl.max(ab, axis=0)
    zero, s_enc, gs = _run_global(amax, FOS)
    code, sf, enc = _scale_for(ab, 6.0, s_enc, gs)
    if FOS:
        # ab / 4 == ab * 0.25 bit for bit (both round the same real number), no division needed
        v4 = tl.minimum((ab * 0.25) * s_enc, 448.0)
        code4 = _e4m3_code(v4)
        sf4 = _e4m3_value(code4)
        enc4 = tl.where(sf4 == 0, 0.0, tl.math.div_rn(tl.full(sf4.shape, 1.0, tl.float32), sf4 * gs))
        qs6 = sf * gs
        qs4 = sf4 * gs
        e6a, e4a, m6a, m4a = _q_sse(a0, enc, enc4, qs6, qs4, NB, SSE64)
        e6b, e4b, m6b, m4b = _q_sse(a1, enc, enc4, qs6, qs4, NB, SSE64)
        e6c, e4c, m6c, m4c = _q_sse(a2, enc, enc4, qs6, qs4, NB, SSE64)
        e6d, e4d, m6d, m4d = _q_sse(a3, enc, enc4, qs6, qs4, NB, SSE64)
        pick4 = ((e4a + e4b) + (e4c + e4d)) < ((e6a + e6b) + (e6c + e6d))
        code = tl.where(pick4, code4, code)
        enc = tl.where(pick4, enc4, enc)
    e2 = enc[:, None]
    if SR and (PROF & 2):  # timing only: no hash (a constant uniform)
        m0 = _e2m1_sr_mag_magic(a0 * e2, 0.5, SR_RP)
        m1 = _e2m1_sr_mag_magic(a1 * e2, 0.5, SR_RP)
        m2 = _e2m1_sr_mag_magic(a2 * e2, 0.5, SR_RP)
        m3 = _e2m1_sr_mag_magic(a3 * e2, 0.5, SR_RP)
    elif SR:
        m0 = _e2m1_sr_mag_magic(a0 * e2, u0, SR_RP)
        m1 = _e2m1_sr_mag_magic(a1 * e2, u1, SR_RP)
        m2 = _e2m1_sr_mag_magic(a2 * e2, u2, SR_RP)
        m3 = _e2m1_sr_mag_magic(a3 * e2, u3, SR_RP)
    elif FOS and REUSE:
        p4 = pick4[:, None]
        m0 = tl.where(p4, m4a, m6a)
        m1 = tl.where(p4, m4b, m6b)
        m2 = tl.where(p4, m4c, m6c)
        m3 = tl.where(p4, m4d, m6d)
    else:
        m0 = _e2m1_mag_magic(a0 * e2)
        m1 = _e2m1_mag_magic(a1 * e2)
        m2 = _e2m1_mag_magic(a2 * e2)
        m3 = _e2m1_mag_magic(a3 * e2)
    w0 = ((_q_pack(m0, x0, 0) + _q_pack(m1, x1, 16)) - MAGIC_PACK).to(tl.int32, bitcast=True)
    w1 = ((_q_pack(m2, x2, 0) + _q_pack(m3, x3, 16)) - MAGIC_PACK).to(tl.int32, bitcast=True)
    w0 = tl.where(zero, 0, w0)
    w1 = tl.where(zero, 0, w1)
    blk = tl.arange(0, NB)
    wi = base // 8 + 2 * blk
    tl.store(codes_ptr + wi, w0, mask=bmask)
    tl.store(codes_ptr + wi + 1, w1, mask=bmask)
    tl.store(scales_ptr + base // 16 + blk, code.to(tl.uint8), mask=bmask)
    tl.store(gbits_ptr + c, gs)


@triton.jit
def _q_update(m, r, g, p, b1c, sb2, sb2c, bc2s, eps, decay, step_size, MAXIMIZE: tl.constexpr,
              PROF: tl.constexpr):
    """The AdamW arithmetic of ``qadamw.q_adamw_step`` on one quarter -> (m, sqrt(v), p32)."""
    if MAXIMIZE:
        g = g * -1.0  # not -g (0 - g): keeps torch's -0
    m = m + (g - m) * b1c
    a = r * sb2
    b = tl.abs(g) * sb2c
    mx = tl.maximum(a, b)
    big = mx > 1.152921504606847e18
    small = mx < 8.673617379884035e-19
    s = tl.where(big, 5.421010862427522e-20, tl.where(small, 1.8446744073709552e19, 1.0))
    si = tl.where(big, 1.8446744073709552e19, tl.where(small, 5.421010862427522e-20, 1.0))
    a = a * s
    b = b * s
    if PROF & 1:  # timing only: approximate sqrt / divisions (not the reference's numerics)
        r = tl.sqrt(a * a + b * b) * si
    else:
        r = tl.sqrt_rn(a * a + b * b) * si
    r = tl.where(r > _SQRT_V_MAX, _SQRT_V_MAX, r)  # codec.saturate_sqrt_v
    # (step_size bc2s) * m / (r + eps bc2s): the reference's one division per element (torch's form has two)
    denom = r + eps * bc2s
    if PROF & 1:
        p32 = p * decay - (step_size * bc2s) * (m / denom)
    else:
        p32 = p * decay - (step_size * bc2s) * tl.math.div_rn(m, denom)
    return m, r, p32


@triton.jit
def _q_quarter(m, r, p_ptr, g_ptr, comp_addr, o, bm, b1c, sb2, sb2c, bc2s, eps, decay, step_size, base_seed,
               step_f, MAXIMIZE: tl.constexpr, MASTER: tl.constexpr, PROF: tl.constexpr):
    """Load g and p of one quarter, update, write the parameter; -> (m, sqrt(v)).

    Outside the tensor (whole blocks, whole tiles and whole Hadamard groups: n is a multiple of the tile, the tile a
    multiple of the Hadamard size) both come out as zeros without a select: the masked loads give zero codes, scale
    codes, tile means, g and p, so m decodes to +-0, sqrt(v) and its floor to 0, and the update keeps them zero (+0
    or -0: their codes are never stored and zeros do not change the run's amax or the tile sums of the blocks
    inside)."""
    g = tl.load(g_ptr + o, mask=bm, other=0.0).to(tl.float32)
    p = tl.load(p_ptr + o, mask=bm, other=0.0).to(tl.float32)
    m, r, p32 = _q_update(m, r, g, p, b1c, sb2, sb2c, bc2s, eps, decay, step_size, MAXIMIZE, PROF)
    _write_param(p_ptr, comp_addr, p32, o, bm, base_seed, step_f, MASTER)
    return m, r


@triton.jit
def _qadamw_kernel(qtab, ptab, coef, coef_stride, chunks, b1c, sb2, sb2c, eps,
                   N: tl.constexpr, NQ: tl.constexpr, TILE: tl.constexpr, MH: tl.constexpr, VH: tl.constexpr,
                   MNORM: tl.constexpr, VNORM: tl.constexpr, M_SR: tl.constexpr, M_FOS: tl.constexpr,
                   V_SR: tl.constexpr, V_FOS: tl.constexpr, P_KIND: tl.constexpr, G_KIND: tl.constexpr,
                   MASTER: tl.constexpr, MAXIMIZE: tl.constexpr, SSE64: tl.constexpr, REUSE: tl.constexpr,
                   MAGIC_PACK: tl.constexpr, PROF: tl.constexpr = 0, SR_RP: tl.constexpr = False):
    """One run of N elements of one tensor: decode m and sqrt(v), AdamW, re-encode, write p (block per thread;
    same arithmetic, bit for bit, as :func:`_qadamw_kernel_v1` and the torch reference)."""
    NB: tl.constexpr = N // 16
    t, c, row, n, base, decay, step_size, bc2s, step_f, base_seed = _run_start(qtab, coef, coef_stride, chunks,
                                                                                N, NQ)
    blk = tl.arange(0, NB)
    boff = base + blk * 16
    bmask = boff < n  # n is a multiple of the tile (>= 16): whole blocks are in or out
    bm = tl.broadcast_to(bmask[:, None], (NB, 4))
    o0 = boff[:, None] + tl.arange(0, 4)[None, :]
    # 8 codes per int32 word
    m_codes, m_scales, m_gbits, v_codes, v_scales, v_gbits, v_mean, m_signs, v_signs = _state_ptrs(row, tl.int32)
    comp_addr = tl.load(row + 11)
    # parameter and gradient are 16-byte aligned (``_eligible`` / ``FusedPlan.still_valid``): vector loads
    p_ptr = tl.multiple_of(tl.load(ptab + 2 * t).to(tl.pointer_type(_FTYPES[P_KIND])), 16)
    g_ptr = tl.multiple_of(tl.load(ptab + 2 * t + 1).to(tl.pointer_type(_FTYPES[G_KIND])), 16)

    # ---- decode m and sqrt(v)
    m0, m1, m2, m3, _s = _q_decode(m_codes, m_scales, tl.load(m_gbits + c), base, bmask, NB)
    if MH > 0:
        m0, m1, m2, m3 = _q_irht(m0, m1, m2, m3, m_signs, NB, MH)
    y0, y1, y2, y3, vs = _q_decode(v_codes, v_scales, tl.load(v_gbits + c), base, bmask, NB)
    if VH > 0:
        y0, y1, y2, y3 = _q_irht(y0, y1, y2, y3, v_signs, NB, VH)
    mu = tl.load(v_mean + boff // TILE, mask=bmask, other=0.0).to(tl.float32)[:, None]
    lo = vs * 0.25
    if VH > 16:  # the floor is the max over the blocks of one Hadamard group
        lg = tl.max(tl.reshape(lo, (NB // (VH // 16), VH // 16)), axis=1)
        lo = tl.reshape(tl.broadcast_to(lg[:, None], (NB // (VH // 16), VH // 16)), (NB,))
    lo = lo[:, None]

    # ---- the AdamW update, one quarter at a time (the parameter is written right away)
    m0, r0 = _q_quarter(m0, tl.maximum(y0 + mu, lo), p_ptr, g_ptr, comp_addr, o0, bm, b1c, sb2, sb2c, bc2s,
                        eps, decay, step_size, base_seed, step_f, MAXIMIZE, MASTER, PROF)
    m1, r1 = _q_quarter(m1, tl.maximum(y1 + mu, lo), p_ptr, g_ptr, comp_addr, o0 + 4, bm, b1c, sb2, sb2c, bc2s,
                        eps, decay, step_size, base_seed, step_f, MAXIMIZE, MASTER, PROF)
    m2, r2 = _q_quarter(m2, tl.maximum(y2 + mu, lo), p_ptr, g_ptr, comp_addr, o0 + 8, bm, b1c, sb2, sb2c, bc2s,
                        eps, decay, step_size, base_seed, step_f, MAXIMIZE, MASTER, PROF)
    m3, r3 = _q_quarter(m3, tl.maximum(y3 + mu, lo), p_ptr, g_ptr, comp_addr, o0 + 12, bm, b1c, sb2, sb2c,
                        bc2s, eps, decay, step_size, base_seed, step_f, MAXIMIZE, MASTER, PROF)

    # ---- re-encode m
    idx0 = (base & 0xFFFFFFFF).to(tl.uint32) + (blk * 16).to(tl.uint32)  # hash index mod 2^32
    if MH > 0:
        m0, m1, m2, m3 = _q_rht(m0, m1, m2, m3, m_signs, NB, MH, MNORM)
    # one hash per element for both moments' SR (``codec.shared_sr_uniforms``: m the high 16 bits, v the low),
    # drawn where it is first needed (drawn here for a v-only SR, it would hold 40 more registers through m's encode)
    sd = _step_seed(base_seed, step_f, 0)
    if M_SR and not (PROF & 2):
        h0, h1, h2, h3 = _q_hashes(idx0, sd)
    else:  # no uniforms read (dead code after compilation)
        h0 = tl.zeros((NB, 4), dtype=tl.uint32)
        h1 = h0
        h2 = h0
        h3 = h0
    _q_encode_store(m0, m1, m2, m3, _hi16(h0), _hi16(h1), _hi16(h2), _hi16(h3), m_codes, m_scales,
                    m_gbits, c, base, bmask, NB, M_FOS, M_SR, SSE64, REUSE, MAGIC_PACK, PROF, SR_RP)

    # ---- re-encode sqrt(v): tile means (adjacent-pair tree: blocks, then blocks of a tile), RHT, NVFP4
    sb = (_q_tree(r0, NB) + _q_tree(r1, NB)) + (_q_tree(r2, NB) + _q_tree(r3, NB))
    KT: tl.constexpr = TILE // 16
    if KT > 1:
        ts = _tree_rows(tl.reshape(sb, (NB // KT, KT)), NB // KT, KT)
    else:
        ts = sb
    mu_t = _bf16_rne(ts * (1.0 / TILE))
    ot = base // TILE + tl.arange(0, NB // KT)
    tl.store(v_mean + ot, mu_t, mask=ot < n // TILE)
    mub = mu_t.to(tl.float32)
    if KT > 1:
        mub = tl.reshape(tl.broadcast_to(mub[:, None], (NB // KT, KT)), (NB,))
    mub = mub[:, None]
    r0 = r0 - mub  # zero outside the tensor (see _q_quarter)
    r1 = r1 - mub
    r2 = r2 - mub
    r3 = r3 - mub
    if VH > 0:
        r0, r1, r2, r3 = _q_rht(r0, r1, r2, r3, v_signs, NB, VH, VNORM)
    if V_SR and not M_SR and not (PROF & 2):
        h0, h1, h2, h3 = _q_hashes(idx0, sd)
    _q_encode_store(r0, r1, r2, r3, _lo16(h0), _lo16(h1), _lo16(h2), _lo16(h3), v_codes, v_scales,
                    v_gbits, c, base, bmask, NB, V_FOS, V_SR, SSE64, REUSE, MAGIC_PACK, PROF, SR_RP)


@triton.jit
def _adamw_kernel(ftab, ptab, coef, coef_stride, chunks, b1c, b2, b2c, eps,
                  N: tl.constexpr, NF: tl.constexpr, P_KIND: tl.constexpr, G_KIND: tl.constexpr,
                  MASTER: tl.constexpr, MAXIMIZE: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(chunks + 2 * pid)
    c = tl.load(chunks + 2 * pid + 1).to(tl.int64)
    row = ftab + t * NF
    n = tl.load(row + 0)
    offs = c * N + tl.arange(0, N)
    mask = offs < n
    decay = tl.load(coef + t)
    step_size = tl.load(coef + coef_stride + t)
    bc2s = tl.load(coef + 2 * coef_stride + t)
    step_f = tl.load(coef + 3 * coef_stride + t)
    m_ptr = tl.load(row + 1).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    base_seed = tl.load(tl.load(row + 3).to(tl.pointer_type(tl.int64)))
    p_ptr = _fptr(tl.load(ptab + 2 * t), P_KIND)
    g_ptr = _fptr(tl.load(ptab + 2 * t + 1), G_KIND)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if MAXIMIZE:
        g = g * -1.0  # not -g (0 - g): keeps torch's -0
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    m = m + (g - m) * b1c
    v = v * b2 + (g * g) * b2c
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    denom = tl.math.div_rn(tl.sqrt_rn(v), tl.broadcast_to(bc2s, v.shape)) + eps
    p32 = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32) * decay
    p32 = p32 - step_size * tl.math.div_rn(m, denom)
    _write_param(p_ptr, tl.load(row + 4), p32, offs, mask, base_seed, step_f, MASTER)


# ---------------------------------------------------------------------------------------------- host side
def available(device: torch.device) -> bool:
    """The fused kernels can run on ``device`` (CUDA, or CPU under ``TRITON_INTERPRET=1``)."""
    return device.type == "cuda" or (_INTERPRET and device.type == "cpu")


def _master_code(p: torch.Tensor, state: dict, master: str) -> int:
    if p.dtype == torch.bfloat16 and master == "sr":
        return 1
    if p.dtype == torch.bfloat16 and master == "kahan" and "comp" in state:
        return 2
    return 0


def _eligible(p: torch.Tensor, st: dict, group: dict) -> bool:
    """The fused kernels handle ``p`` (else the per-parameter torch step does)."""
    g = p.grad
    if p.dtype not in _KIND or g.dtype not in _KIND or g.is_sparse or not available(p.device):
        return False
    if not (p.is_contiguous() and g.is_contiguous() and g.device == p.device and g.shape == p.shape):
        return False
    if p.data_ptr() % 16 or g.data_ptr() % 16:  # the kernels load 16-byte vectors
        return False
    if st["step"].device != p.device or st["seed"].device != p.device:
        return False
    if "comp" in st and not (st["comp"].dtype == torch.bfloat16 and st["comp"].is_contiguous()
                             and st["comp"].data_ptr() % 16 == 0):
        return False
    if "m_codes" in st:
        tile = group["tile"]
        if CH % tile or tile & (tile - 1) or group["v_state"] != "floored":
            return False  # (v_state "signed" has no kernel: the per-parameter torch step runs it)
        return all(st[k].is_contiguous() and st[k].device == p.device for k in _Q_COLS[1:]
                   if k in st) and st["m_gbits"].numel() == _qa.n_chunks(p.numel())
    return all(st[k].dtype == torch.float32 and st[k].is_contiguous() and st[k].device == p.device
               for k in ("exp_avg", "exp_avg_sq"))


def _sign_table(signs: torch.Tensor) -> torch.Tensor:
    """A state's RHT signs (int8 [D], +-1) as the kernels read them: float32 [2, D], row 0 the signs (the forward
    transform's x * s), row 1 the signs times 1 / sqrt(D) rounded to FP32 (the inverse's (y H_D) * (s / sqrt(D)),
    one product with the bits of ``codec.inverse_rht``'s two). Loaded as 16-byte vectors, no int8 -> float
    conversion in the kernel (static sm_90 SASS of the default kernel 2: 244.5 instructions per element instead of
    253.5 by this alone, ``bench/qadamw_sass.py``)."""
    s = signs.to(torch.float32)
    norm = torch.tensor(1.0 / math.sqrt(s.numel()), dtype=torch.float32, device=s.device)
    return torch.stack((s, s * norm)).contiguous()


class _Bucket:
    """Parameters of one group that share a kernel specialization: their tables, cached on the device."""

    def __init__(self, kind, key, params, states, device):
        self.kind, self.key, self.params = kind, key, params
        cols = _Q_COLS if kind == "q" else _F_COLS
        # the kernels read the Hadamard signs as float tables (:func:`_sign_table`), built here from the int8 states
        states = [{**st, **{k: _sign_table(st[k]) for k in ("m_signs", "v_signs") if k in st}} for st in states]
        dummy = 0
        rows = [[p.numel() if k == "numel" else (st[k].data_ptr() if k in st else dummy) for k in cols]
                for p, st in zip(params, states)]
        self.table = torch.tensor(rows, dtype=torch.int64).to(device)
        # the table holds raw addresses: keep the tensors alive while it exists (state entries replaced other than
        # through load_state_dict are not seen by the plan; they are never freed under it either)
        self._keep = [st[k] for st in states for k in cols if k in st]
        # chunk table: (tensor index, run index within the tensor) of every program
        nch = torch.tensor([-(-p.numel() // CH) for p in params], dtype=torch.int64)
        self.nprog = int(nch.sum())
        tid = torch.repeat_interleave(torch.arange(len(params)), nch)
        cid = torch.arange(self.nprog) - torch.repeat_interleave(torch.cumsum(nch, 0) - nch, nch)
        self.chunks = torch.stack((tid, cid), 1).to(torch.int32).reshape(-1).to(device)
        self.steps = [st["step"] for st in states]
        self._ptrs = None
        self.ptab = None

    def pointers(self, device):
        ptrs = [x for p in self.params for x in (p.data_ptr(), p.grad.data_ptr())]
        if ptrs != self._ptrs:
            t = torch.tensor(ptrs, dtype=torch.int64)
            self.ptab = t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t
            self._ptrs = ptrs
        return self.ptab


class FusedPlan:
    """All buckets of one parameter group (rebuilt when its parameters or states change)."""

    def __init__(self, opt, group, params):
        by_key = {}
        self.rest = []
        for p in params:
            st = opt.state[p]
            if not _eligible(p, st, group):
                self.rest.append(p)
                continue
            kind = "q" if "m_codes" in st else "f"
            key = (kind, _KIND[p.dtype], _KIND[p.grad.dtype], _master_code(p, st, group["bf16_master"]))
            by_key.setdefault(key, []).append(p)
        self.buckets = []
        for key, ps in by_key.items():
            self.buckets.append(_Bucket(key[0], key, ps, [opt.state[p] for p in ps], ps[0].device))
        self.steps = [s for b in self.buckets for s in b.steps]
        self.grad_dtypes = [(p, p.grad.dtype) for b in self.buckets for p in b.params]

    def still_valid(self) -> bool:
        """Cheap per-step check: every gradient still has the dtype/layout the plan was built for and every
        parameter and gradient is 16-byte aligned (a view into a shared buffer may not be)."""
        for p, dt in self.grad_dtypes:
            g = p.grad
            if g.dtype != dt or not g.is_contiguous() or g.data_ptr() % 16 or p.data_ptr() % 16:
                return False
        return True


def run_group(opt, gi: int, group: dict, params: list, lr: torch.Tensor, plans: dict, version: int):
    """Apply one (Q-)AdamW step to ``params`` (all with grads and initialized states) of ``group`` with the
    fused kernels. Returns the parameters it could not handle (the caller runs the torch step on them)."""
    key = (gi, version, tuple(id(p) for p in params))
    plan = plans.get(gi)
    if plan is None or plan[0] != key or not plan[1].still_valid():
        plans[gi] = plan = (key, FusedPlan(opt, group, params))
    plan = plan[1]
    if not plan.buckets:
        return plan.rest
    beta1, beta2 = group["betas"]
    beta1, beta2 = float(beta1), float(beta2)
    torch._foreach_add_(plan.steps, 1.0)
    steps = torch.stack(plan.steps)
    decay, step_size, bc2s = _qa.adam_coefficients(steps, lr, beta1, beta2, float(group["weight_decay"]))
    coef = torch.stack((decay.expand_as(steps), step_size, bc2s, steps))
    ttot = steps.numel()
    t0 = 0
    eps = float(group["eps"])
    maximize = bool(group["maximize"])
    for b in plan.buckets:
        dev = b.params[0].device
        ptab = b.pointers(dev)
        _, pk, gk, master = b.key
        cslice = coef.reshape(-1)[t0:]
        if b.kind == "q":
            mh, vh = group["m_hadamard"] or 0, group["v_hadamard"] or 0
            args = (b.table, ptab, cslice, ttot, b.chunks, 1 - beta1, math.sqrt(beta2), math.sqrt(1 - beta2), eps)
            kw = dict(N=CH, NQ=len(_Q_COLS), TILE=group["tile"], MH=mh, VH=vh,
                      MNORM=1.0 / math.sqrt(mh) if mh else 1.0, VNORM=1.0 / math.sqrt(vh) if vh else 1.0,
                      M_SR=group["m_rounding"] == "sr", M_FOS=bool(group["m_four_over_six"]),
                      V_SR=group["v_rounding"] == "sr", V_FOS=bool(group["v_four_over_six"]),
                      P_KIND=pk, G_KIND=gk, MASTER=master, MAXIMIZE=maximize, SSE64=_qa.SSE64_4OVER6)
            if KERNEL == 1:
                _qadamw_kernel_v1[(b.nprog,)](*args, **kw, IMPL=RHT_IMPL, num_warps=NUM_WARPS or 4,
                                              **_launch_opts(dev))
            else:
                _qadamw_kernel[(b.nprog,)](*args, **kw, REUSE=bool(REUSE), MAGIC_PACK=_MAGIC_PACK, PROF=PROF,
                                           SR_RP=SR_RP, num_warps=NUM_WARPS or 2, **_launch_opts(dev, MAXNREG))
        else:
            _adamw_kernel[(b.nprog,)](
                b.table, ptab, cslice, ttot, b.chunks, 1 - beta1, beta2, 1 - beta2, eps,
                N=CH, NF=len(_F_COLS), P_KIND=pk, G_KIND=gk, MASTER=master, MAXIMIZE=maximize,
                num_warps=4, **_launch_opts(dev))
        t0 += len(b.params)
    return plan.rest


stable_cache_keys(globals())  # Triton cache keys independent of launch order (kernels/launch.py)
