"""Triton NVFP4 quantize / dequantize kernels, beside the torch reference they match bit for bit.

Reference: ``fp4compile/formats/schemes.py`` (and ``nvfp4.py``, ``hadamard.py``, ``random.py``). Every
floating-point step of the reference is reproduced here in the same order and precision:

* divisions use ``tl.math.div_rn`` (correctly rounded, like torch's FP32 ``/``);
* kernels are launched with ``enable_fp_fusion=False`` so no multiply-add is contracted into an FMA;
* sums (4/6 errors, EDEN statistics) are FP32 in the same fixed pairwise tree (:func:`_tree_last`);
* the RHT is the same butterfly (signs first, stages h = 1, 2, 4, ..., then x fp32(1/sqrt(d)), then + 0.0;
  MS-EDEN stops after the butterfly and folds 1/sqrt(d) into its per-block scales);
* E4M3 rounding is done on the FP32 bit pattern (RNE, identical to ``.to(torch.float8_e4m3fn)`` on [0, 448]);
* random bits come from the same counter-based hash of (seed, flat index).

Two launches per quantize, no host synchronization. RTN / SR: ``_amax_kernel`` reduces max|x| (of the rotated
tensor when an RHT is fused) into a device scalar with ``atomic_max``; ``_quantize_kernel`` reads it, derives
the global scale, and writes codes, scale bytes and (program 0) the global decode scale. MS-EDEN ("post hoc
range alignment", Quartet II's CUDA form): ``_eden_pass1_kernel`` reads x once and writes the codes, the
EDEN-corrected FP32 block scales into a [R, K/16] scratch and their max (``atomic_max``);
``_eden_pass2_kernel`` reads only the scratch (1/16 of the elements, 4 B each) and writes the E4M3 scales and
the global decode scale.
``transpose=True`` quantizes ``x.T``: by default (``CONFIG["t_impl"] = 2``) through one transposing copy of x
and the row-wise kernels; ``t_impl`` 0/1 read the column-wise tiles in-kernel through swapped strides
(strided, or coalesced + ``tl.trans``), no copy, but slower layouts (see :data:`CONFIG`).

Per tile the quantize kernel holds each 16-block in one thread (two 16-byte half loads, :func:`_load_halves`),
maps values to E2M1 codes with FP32 adds/mins (:func:`_e2m1_mag_magic`) and packs 8 codes per 32-bit store.
``amax=`` (optional, RTN/SR) skips the amax pass: a single pass with a given global amax (delayed scaling).
``CONFIG["pdl"] = 1`` (the default; sm_90+ only): the quantize kernel of RTN/SR is launched with programmatic
dependent launch behind the amax kernel. The amax kernel lets it launch at once (``gdc_launch_dependents``); the
quantize kernel loads its tile of x and takes its block maxima, then waits for the amax kernel's completion and
memory flush (``gdc_wait``) before it reads the amax. Its loads so overlap the amax pass's tail. Only the launch
right after this module's own amax kernel uses it: that kernel writes nothing the quantize kernel reads before
the wait (a given ``amax=`` or the transposing copy's amax keep the ordinary launch).

The kernels do *not* check for NaN/Inf (the fast unchecked path; the eager ``formats.nvfp4.quantize`` checks).
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from ..formats.nvfp4 import AMAX_FLUSH as _AMAX_FLUSH_PY
from ..formats.random import draw_seed
from ..formats.schemes import EDEN_INV_VAL_MAX, EDEN_VAL_MAX, block_max_targets, global_numerator
from .dequant import DEFAULT_DEQUANT, _dequant_tile  # noqa: F401  (a jitted helper pass 2's dq variant calls)
from .launch import cdiv, launch, placeholder, stable_cache_keys

#: amax below this encodes as an all-zero tensor (``formats.nvfp4.AMAX_FLUSH``; a constexpr for the kernels)
AMAX_FLUSH = tl.constexpr(_AMAX_FLUSH_PY)

_ROUNDING_ID = {"rtn": 0, "sr": 1, "ms_eden": 2}


# ---------------------------------------------------------------------------------------------- helpers
@triton.jit
def _max_nan(a, b):
    """max that keeps a NaN (PTX ``max.NaN.f32``; ``tl.max`` alone drops one on the GPU): a tensor's amax must see
    its NaN elements, so that the copy's global scale is NaN (formats/schemes.py, "Non-finite inputs")."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _min_nan(a, b):
    """min that keeps a NaN (PTX ``min.NaN.f32``), :func:`_max_nan`'s partner (Q-Attn's E2M1 clamp)."""
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


#: TRITON_INTERPRET=1 (the CPU tests): the interpreter calls a ``tl.reduce`` combine function in Python per element
#: (minutes for the test suite's amax tiles), so there :func:`_amax_all` takes ``tl.max`` (np.nanmax: it drops a
#: NaN, as the GPU's ``max.f32`` does) and a NaN flag; the sm_90 PTX tests check the GPU form's ``max.NaN.f32``
_INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def _amax_all(a):
    """The NaN-propagating max of every element of a 1D, 2D or 3D ``a`` (a 0-dim tensor), one axis at a time (a
    reshape to 1D first costs the 2D tiles a layout conversion and registers). A NaN result is positive, as the float
    ``atomic_max`` that takes it needs (it treats a value with the sign bit set as negative): ``max.NaN.f32`` returns
    the canonical NaN 0x7FFFFFFF, the interpreter branch a positive one; so MS-EDEN's S' (>= 0 or NaN) needs no
    ``tl.abs`` before it (which cost pass 1 0.25 instructions per element)."""
    if _INTERPRET:
        m = a
        n = (a != a).to(tl.int32)
        if len(a.shape) == 3:
            m = tl.max(m, axis=2)
            n = tl.max(n, axis=2)
        if len(a.shape) >= 2:
            m = tl.max(m, axis=1)
            n = tl.max(n, axis=1)
        return tl.where(tl.max(n, axis=0) > 0, float("nan"), tl.max(m, axis=0))
    else:
        if len(a.shape) == 3:
            a = tl.reduce(a, 2, _max_nan)
        if len(a.shape) == 2:
            a = tl.reduce(a, 1, _max_nan)
        return tl.reduce(a, 0, _max_nan)


@triton.jit
def _lowbias32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


@triton.jit
def _seed_keys(seed_ptr):
    s = tl.load(seed_ptr)
    lo = (s & 0xFFFFFFFF).to(tl.uint32)
    hi = ((s >> 32) & 0xFFFFFFFF).to(tl.uint32)
    k0 = _lowbias32(lo ^ 0x9E3779B9)
    k1 = _lowbias32(hi ^ k0)
    return k0, k1


@triton.jit
def _uniform(k0, k1, idx):
    """float32 uniforms in [0, 1) for int64 flat indices (taken mod 2^32); same as formats.random.uniform."""
    i = (idx & 0xFFFFFFFF).to(tl.uint32)
    h = _lowbias32(_lowbias32(i ^ k0) ^ k1)
    return (h >> 8).to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def _uniform32(k0, k1, i):
    """:func:`_uniform` for uint32 indices (the flat index mod 2^32, computed with uint32 wrap-around)."""
    h = _lowbias32(_lowbias32(i ^ k0) ^ k1)
    return (h >> 8).to(tl.float32) * 5.9604644775390625e-08


@triton.jit
def _e4m3_code(v):
    """FP32 v in [0, 448] -> E4M3 code (int32 0..126), round to nearest even."""
    bits = v.to(tl.uint32, bitcast=True)
    r = bits + 0x7FFFF + ((bits >> 20) & 1)
    code_n = ((r >> 23).to(tl.int32) - 120) * 8 + ((r >> 20) & 7).to(tl.int32)
    t = v * 512.0
    code_s = ((t + 8388608.0) - 8388608.0).to(tl.int32)
    return tl.where(v < 0.015625, code_s, code_n)


@triton.jit
def _e4m3_value(code):
    """E4M3 code (int32 0..126) -> FP32 value."""
    e = code >> 3
    m = code & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.uint32).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125
    return tl.where(e == 0, sub, normal)


@triton.jit
def _e2m1_rne(v):
    """FP32 -> E2M1 code (int32, sign in bit 3), RNE, saturating at +-6.

    Bit form of the reference's comparison chain (checked equal on 11.5M FP32 values incl. every tie):
    |v| >= 1: round the FP32 mantissa to 1 bit (RNE) and read exponent:mantissa; |v| < 1: rne(2|v|) via the
    2^23 magic-number add (exact: 2|v| is exact, the add rounds to nearest even).
    """
    a = tl.abs(v)
    bits = a.to(tl.uint32, bitcast=True)
    r = bits + 0x1FFFFF + ((bits >> 22) & 1)
    normal = tl.minimum((r >> 22).to(tl.int32) - 252, 7)
    t = a * 2.0 + 12582912.0
    sub = t.to(tl.int32, bitcast=True) - 0x4B400000
    mag = tl.where(a < 1.0, sub, normal)
    sign = (v.to(tl.uint32, bitcast=True) >> 31).to(tl.int32)
    return mag | (sign << 3)


#: 1.5 * 2^23: adding it to a float in [0, 2^22] rounds to an integer (RNE) and leaves that integer in the low
#: mantissa bits; the packed-word constant below is sum_i (bits(MAGIC) << 4i) mod 2^32 (see _pack_magic).
_MAGIC = 12582912.0
_MAGIC_BITS = 0x4B400000
_MAGIC_PACK = sum((_MAGIC_BITS << (4 * i)) for i in range(8)) & 0xFFFFFFFF


@triton.jit
def _e2m1_mag_magic(a):
    """|v| (FP32, >= 0) -> MAGIC + E2M1 magnitude code (0..7) as an FP32 in [2^23, 2^24), RNE + saturation.

    The code is a concave piecewise-linear function of the value: 2|v| on [0, 2], |v| + 2 on [2, 4], |v|/2 + 4
    above, saturating at 7. Rounding commutes with adding integers and with the min of monotone pieces, so
    code = min(rne(2a), rne(a) + 2, rne(a/2) + 4, 7); each rne is one FP32 add of MAGIC (the products by 2 and
    0.5 are exact, so an FMA and a multiply-then-add give the same bits). Equal to the reference's comparison
    chain on every FP32 value of sampled binades incl. every tie (tests/test_quantize_kernels.py::
    test_interpreter_e2m1_and_amax, with x's sign bit added; tests/test_attention.py against the threshold form).
    FP-pipe work only (3 adds/FMAs + 3 min), vs ~10 integer ops for the bit form :func:`_e2m1_rne`.
    """
    t1 = tl.fma(a, 2.0, 12582912.0)
    t2 = a + 12582914.0
    t3 = tl.fma(a, 0.5, 12582916.0)
    return tl.minimum(tl.minimum(t1, t2), tl.minimum(t3, 12582919.0))


@triton.jit
def _e2m1_mag_code(a):
    """|v| (FP32, >= 0) -> E2M1 magnitude code 0..7 (int32): :func:`_e2m1_mag_magic` less MAGIC's bits."""
    return _e2m1_mag_magic(a).to(tl.int32, bitcast=True) - 0x4B400000  # _MAGIC_BITS


@triton.jit
def _pack_magic(m, v, MAGIC_PACK: tl.constexpr):
    """[A, B, 8] magnitude codes ``m`` = MAGIC + code (:func:`_e2m1_mag_magic` of |v|) and the [A, B, 8] values
    ``v`` whose signs they take -> [A, B] packed words, without materializing each code: the words of MAGIC + code
    are shifted into place and summed (uint32 wrap-around), then sum_i MAGIC << 4i is subtracted once; the sign
    bits are masked in from each value's bit 31."""
    sh = (tl.arange(0, 8) * 4).to(tl.uint32)[None, None, :]
    mb = m.to(tl.uint32, bitcast=True)
    sgn = (v.to(tl.uint32, bitcast=True) >> (28 - sh)) & (8 << sh)
    w = tl.sum((mb << sh) | sgn, axis=2)
    return (w - MAGIC_PACK).to(tl.int32, bitcast=True)


@triton.jit
def _mag_value_magic(m):
    """E2M1 magnitude value from ``m`` = MAGIC + code (:func:`_e2m1_mag_magic`), exactly: MAGIC = 1.5 * 2^23 =
    0x4B400000 has no set bit below bit 22, so shifting m's bits left by 22 drops MAGIC's bits and leaves the code c
    (0..7) at float bits 24..22, the value times 2^-126 (the bit placement of :func:`_e2m1_value`; 0.5 becomes the
    subnormal 2^-127, kept: no kernel flushes subnormals), times 2^126. One shift and one multiply. Valid for
    m = MAGIC + c with c in 0..7, which every producer returns (:func:`_e2m1_mag_magic` clamps at 7,
    :func:`_e2m1_mag_magic_le7` is only given a < 7); a NaN m gives a NaN value (the former AND with 7 gave 6, but a
    NaN m only comes from a NaN magnitude, whose products are NaN either way)."""
    return (m.to(tl.uint32, bitcast=True) << 22).to(tl.float32, bitcast=True) * 8.507059173023462e37


@triton.jit
def _signed_value(mag, v):
    """``mag`` (FP32, >= 0) with the sign bit of ``v``: the value of a code packed by :func:`_pack_magic` from
    ``v``'s sign (a zero magnitude keeps it: -0, as the code 8 decodes)."""
    bits = mag.to(tl.uint32, bitcast=True) | (v.to(tl.uint32, bitcast=True) & 0x80000000)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_mag_magic_le7(a):
    """:func:`_e2m1_mag_magic` for 0 <= a < 7, where rne(a/2) + 4 <= 7 already, so the clamp at code 7 is dropped
    (MS-EDEN's scaled magnitudes are <= val_max * (1 + 2^-22) < 6.08)."""
    t1 = tl.fma(a, 2.0, 12582912.0)
    t2 = a + 12582914.0
    t3 = tl.fma(a, 0.5, 12582916.0)
    return tl.minimum(tl.minimum(t1, t2), t3)


#: How :func:`_e2m1_sr_mag_magic` rounds in compiled kernels (its ``RP``): by directed-rounding PTX (``fma.rp`` /
#: ``add.rp``, True, the default) or by the comparison form (False; ``FP4COMPILE_SR_RP=0`` at import). The
#: interpreter (``TRITON_INTERPRET=1``, the CPU tests) runs no inline PTX: always the comparison form there. Both give
#: the reference's codes bit for bit (``tests/test_quantize_kernels.py`` checks the PTX form's arithmetic exactly).
SR_RP = os.environ.get("TRITON_INTERPRET", "0") != "1" and os.environ.get("FP4COMPILE_SR_RP", "1") != "0"


@triton.jit
def _fma_rp(a, b, c):
    """a * b + c rounded once toward +inf (PTX ``fma.rp.f32``: subnormals kept, no flush to zero)."""
    return tl.inline_asm_elementwise("fma.rp.f32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.float32,
                                     is_pure=True, pack=1)


@triton.jit
def _add_rp(a, b):
    """a + b rounded toward +inf (PTX ``add.rp.f32``: subnormals kept)."""
    return tl.inline_asm_elementwise("add.rp.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def _e2m1_sr_mag_magic(a, u, RP: tl.constexpr):
    """Stochastic rounding of |v| = ``a`` (FP32, >= 0) onto the E2M1 magnitudes -> MAGIC + code (as
    :func:`_e2m1_mag_magic`): the code of the grid point lo below min(a, 6), plus 1 iff u < (min(a, 6) - lo) / step,
    the reference's rule (``schemes.sr_codes``, ``codec.e2m1_sr_codes``); u in [0, 1) the uniform.

    ``RP`` (:data:`SR_RP`; compiled kernels only): E2M1's code is the concave piecewise-linear min(2a, a + 2, a / 2 + 4,
    7), and "lo's code + [u < frac]" is ceil(code(a) - u); ceil is monotone, so it commutes with the min, and
    ceil(k a - u) = ceil(RU(k a - u)) (RU rounds toward +inf, and the integer ceil(k a - u) is a float that RU cannot
    pass), and RU(y + MAGIC + c) = MAGIC + c + ceil(y) where floats have unit spacing. So each piece is one ``fma.rp``
    (or ``add.rp``) and one ``add.rp`` of a MAGIC constant: 6 adds and 3 mins. Otherwise the comparison form (~13
    operations): the step by two compares, s = a / step exact, floor(s) + the segment's code offset, + [u < s - fl]."""
    if RP:
        nu = u * -1.0                                        # exact; folds into the uniform's scale constant
        t1 = _add_rp(_fma_rp(a, 2.0, nu), 12582912.0)
        t2 = _add_rp(_add_rp(a, nu), 12582914.0)
        t3 = _add_rp(_fma_rp(a, 0.5, nu), 12582916.0)
        return tl.minimum(tl.minimum(t1, t2), tl.minimum(t3, 12582919.0))
    else:
        t = tl.minimum(a, 6.0)
        lt2 = t < 2.0
        lt4 = t < 4.0
        s = t * tl.where(lt2, 2.0, tl.where(lt4, 1.0, 0.5))  # t / step, exact (a power-of-two step)
        fl = tl.floor(s)
        off = tl.where(lt2, 12582912.0, tl.where(lt4, 12582914.0, 12582916.0))
        return (fl + off) + tl.where(u < s - fl, 1.0, 0.0)  # s - fl = (t - lo) / step exactly (Sterbenz)


@triton.jit
def _e2m1_value(code):
    """E2M1 code (0..15, sign in bit 3) -> FP32 value, exactly, by bit placement: the magnitude bits ``e1 e0 m`` at
    float bits 24..22 and the sign at bit 31 make the float ``q * 2^-126`` for every code (0.5 becomes the subnormal
    2^-127), and the multiply by 2^126 is exact (IEEE subnormals: no kernel of the project flushes them; the
    dequantize kernel's PTX is checked). A few integer ops and one multiply, no selects. The one E2M1 decoder of
    the kernels (quantize, dequantize, the optimizer codec, the attention quantizer)."""
    c = code.to(tl.int32)
    bits = ((c & 7) << 22) | ((c & 8) << 28)
    return bits.to(tl.float32, bitcast=True) * 8.507059173023462e37


@triton.jit
def _sr_floor(v):
    a = tl.minimum(tl.abs(v), 6.0)
    c = ((a >= 0.5).to(tl.int32) + (a >= 1.0).to(tl.int32) + (a >= 1.5).to(tl.int32)
         + (a >= 2.0).to(tl.int32) + (a >= 3.0).to(tl.int32) + (a >= 4.0).to(tl.int32)
         + (a >= 6.0).to(tl.int32))
    lo = _e2m1_value(c)
    step = tl.where(c < 4, 0.5, tl.where(c < 6, 1.0, 2.0))
    return a, c, lo, step


@triton.jit
def _tree_last(t, A: tl.constexpr, B: tl.constexpr, N: tl.constexpr):
    """Sum a [A, B, N] tensor over its last axis as a pairwise tree of adjacent pairs -> [A, B]."""
    if N >= 16:
        t0, t1 = tl.split(tl.reshape(t, (A, B, N // 2, 2)))
        t = t0 + t1
    if N >= 8:
        t0, t1 = tl.split(tl.reshape(t, (A, B, 4, 2)))
        t = t0 + t1
    if N >= 4:
        t0, t1 = tl.split(tl.reshape(t, (A, B, 2, 2)))
        t = t0 + t1
    t0, t1 = tl.split(tl.reshape(t, (A, B, 1, 2)))
    return tl.reshape(t0 + t1, (A, B))


@triton.jit
def _tile_rows(t, BR: tl.constexpr, NB: tl.constexpr):
    """[BR, NB] per-block statistic -> summed over each 16-row group (fixed tree), replicated: [BR, NB]."""
    u = tl.permute(tl.reshape(t, (BR // 16, 16, NB)), (0, 2, 1))
    s = _tree_last(u, BR // 16, NB, 16)
    return tl.reshape(tl.broadcast_to(tl.reshape(s, (BR // 16, 1, NB)), (BR // 16, 16, NB)), (BR, NB))


@triton.jit
def _tile_max(t, BR: tl.constexpr, NB: tl.constexpr):
    s = tl.max(tl.reshape(t, (BR // 16, 16, NB)), axis=1)
    return tl.reshape(tl.broadcast_to(tl.reshape(s, (BR // 16, 1, NB)), (BR // 16, 16, NB)), (BR, NB))


@triton.jit
def _fwht_stage(y, N: tl.constexpr, D: tl.constexpr, H: tl.constexpr, IMPL: tl.constexpr):
    """One butterfly stage: (a, b) = (y[j], y[j + H]) -> (a + b, a - b) for j with bit H clear.

    IMPL 0: permute + split/join. IMPL 1: the partner via ``tl.flip`` on the size-2 axis (an exact xor
    exchange of bit patterns) and ``v * (+-1) + partner``; both are exactly the reference's FP32 ops.
    """
    if IMPL == 0:
        v = tl.permute(tl.reshape(y, (N, D // (2 * H), 2, H)), (0, 1, 3, 2))
        a, b = tl.split(v)
        w = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
    else:
        v = tl.reshape(y, (N, D // (2 * H), 2, H))
        p = tl.flip(v, 2)
        sgn = tl.where(tl.arange(0, 2) == 0, 1.0, -1.0)
        w = v * sgn[None, None, :, None] + p
    return tl.reshape(w, (N, D))


@triton.jit
def _fwht(y, N: tl.constexpr, D: tl.constexpr, IMPL: tl.constexpr):
    """Unnormalized butterfly Walsh-Hadamard transform of the rows of a [N, D] tile (formats.hadamard.fwht)."""
    y = _fwht_stage(y, N, D, 1, IMPL)
    y = _fwht_stage(y, N, D, 2, IMPL)
    y = _fwht_stage(y, N, D, 4, IMPL)
    y = _fwht_stage(y, N, D, 8, IMPL)
    if D >= 32:
        y = _fwht_stage(y, N, D, 16, IMPL)
    if D >= 64:
        y = _fwht_stage(y, N, D, 32, IMPL)
    if D >= 128:
        y = _fwht_stage(y, N, D, 64, IMPL)
    return y


@triton.jit
def _rht(x, signs_ptr, BR: tl.constexpr, BC: tl.constexpr, HAD: tl.constexpr, NORM: tl.constexpr,
         IMPL: tl.constexpr):
    s = tl.load(signs_ptr + tl.arange(0, HAD))
    xs = tl.reshape(x, (BR, BC // HAD, HAD)) * s[None, None, :]
    y = _fwht(tl.reshape(xs, (BR * (BC // HAD), HAD)), BR * (BC // HAD), HAD, IMPL)
    y = y * NORM + 0.0
    return tl.reshape(y, (BR, BC))


@triton.jit
def _load_tile(x_ptr, srow, scol, R, K, pid_r, pid_c, BR: tl.constexpr, BC: tl.constexpr, TLOAD: tl.constexpr):
    """The [BR, BC] tile of the logical matrix (x, or x.T through swapped strides) as FP32.

    TLOAD=1 (for transpose=True): load the tile in x's own orientation, [BC, BR] with x's contiguous dim last,
    and transpose it in registers; the values are the same as TLOAD=0's strided load, only the access
    pattern differs. Not yet measured on a GPU (off by default: ``CONFIG["t_impl"] = 0``).
    """
    rows = pid_r * BR + tl.arange(0, BR)
    cols = pid_c * BC + tl.arange(0, BC)
    if TLOAD:
        tmask = (cols < K)[:, None] & (rows < R)[None, :]
        tptrs = x_ptr + cols.to(tl.int64)[:, None] * scol + rows.to(tl.int64)[None, :] * srow
        x = tl.trans(tl.load(tptrs, mask=tmask, other=0.0))
    else:
        mask = (rows < R)[:, None] & (cols < K)[None, :]
        ptrs = x_ptr + rows.to(tl.int64)[:, None] * srow + cols.to(tl.int64)[None, :] * scol
        x = tl.load(ptrs, mask=mask, other=0.0)
    return x.to(tl.float32), rows, cols


@triton.jit
def _scale_enc(ab, M: tl.constexpr, s_enc, gs):
    v = tl.minimum(tl.math.div_rn(ab, M) * s_enc, 448.0)
    code = _e4m3_code(v)
    sf = _e4m3_value(code)
    enc = tl.where(sf == 0, 0.0, tl.math.div_rn(1.0, sf * gs))
    return code, sf, enc


# ---------------------------------------------------------------------------------------------- kernels
@triton.jit
def _amax_kernel(x_ptr, srow, scol, R, K, signs_ptr, amax_ptr,
                 HAD: tl.constexpr, NORM: tl.constexpr, RHT_IMPL: tl.constexpr, TLOAD: tl.constexpr,
                 BR: tl.constexpr, BC: tl.constexpr, HALVES: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # the PDL-launched quantize kernel may start now; it waits for this grid's completion to read amax
        tl.extra.cuda.gdc_launch_dependents()
    if HALVES:  # the quantize kernel's block-per-thread load and RHT (_load_halves)
        lo, hi, rows = _load_halves(x_ptr, srow, scol, R, K, tl.program_id(0), tl.program_id(1), signs_ptr, HAD,
                                    NORM, RHT_IMPL, TLOAD, BR, BC, True)
        tl.atomic_max(amax_ptr, _max_nan(_amax_all(tl.abs(lo)), _amax_all(tl.abs(hi))))
    else:
        x, rows, cols = _load_tile(x_ptr, srow, scol, R, K, tl.program_id(0), tl.program_id(1), BR, BC, TLOAD)
        if HAD > 0:
            x = _rht(x, signs_ptr, BR, BC, HAD, NORM, RHT_IMPL)
        tl.atomic_max(amax_ptr, _amax_all(tl.abs(x)))


@triton.jit
def _quantize_kernel_v0(x_ptr, srow, scol, R, K, amax_ptr, seed_ptr, signs_ptr,
                     codes_ptr, scales_ptr, gscale_ptr,
                     G: tl.constexpr, M6: tl.constexpr, M4: tl.constexpr,
                     ROUNDING: tl.constexpr, FOUR_SIX: tl.constexpr, BLOCK2D: tl.constexpr,
                     HAD: tl.constexpr, NORM: tl.constexpr, RHT_IMPL: tl.constexpr, TLOAD: tl.constexpr,
                     BR: tl.constexpr, BC: tl.constexpr):
    NB: tl.constexpr = BC // 16
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    x, rows, cols = _load_tile(x_ptr, srow, scol, R, K, pid_r, pid_c, BR, BC, TLOAD)
    if HAD > 0:
        x = _rht(x, signs_ptr, BR, BC, HAD, NORM, RHT_IMPL)

    amax = tl.load(amax_ptr)
    zero = amax < AMAX_FLUSH
    s_enc = tl.where(zero, 1.0, tl.math.div_rn(G, amax))
    gs = tl.where(zero, 0.0, tl.math.div_rn(1.0, s_enc))

    xb = tl.reshape(x, (BR, NB, 16))
    ab = tl.max(tl.abs(xb), axis=2)
    if BLOCK2D:
        ab = _tile_max(ab, BR, NB)
    code, sf, enc = _scale_enc(ab, M6, s_enc, gs)

    if ROUNDING == 0:
        q = _e2m1_rne(xb * enc[:, :, None])
        if FOUR_SIX:
            code4, sf4, enc4 = _scale_enc(ab, M4, s_enc, gs)
            q4 = _e2m1_rne(xb * enc4[:, :, None])
            xs = xb * s_enc
            d6 = xs - _e2m1_value(q) * sf[:, :, None]
            d4 = xs - _e2m1_value(q4) * sf4[:, :, None]
            e6 = _tree_last(d6 * d6, BR, NB, 16)
            e4 = _tree_last(d4 * d4, BR, NB, 16)
            if BLOCK2D:
                e6 = _tile_rows(e6, BR, NB)
                e4 = _tile_rows(e4, BR, NB)
            pick4 = e4 < e6
            code = tl.where(pick4, code4, code)
            q = tl.where(pick4[:, :, None], q4, q)
    elif ROUNDING == 1:
        if FOUR_SIX:
            code4, sf4, enc4 = _scale_enc(ab, M4, s_enc, gs)
            a6, c6, lo6, st6 = _sr_floor(xb * enc[:, :, None])
            a4, c4, lo4, st4 = _sr_floor(xb * enc4[:, :, None])
            e6 = _tree_last((a6 - lo6) * (lo6 + st6 - a6), BR, NB, 16) * (sf * sf)
            e4 = _tree_last((a4 - lo4) * (lo4 + st4 - a4), BR, NB, 16) * (sf4 * sf4)
            if BLOCK2D:
                e6 = _tile_rows(e6, BR, NB)
                e4 = _tile_rows(e4, BR, NB)
            pick4 = e4 < e6
            code = tl.where(pick4, code4, code)
            enc = tl.where(pick4, enc4, enc)
        k0, k1 = _seed_keys(seed_ptr)
        idx = rows.to(tl.int64)[:, None] * K + cols.to(tl.int64)[None, :]
        u = tl.reshape(_uniform(k0, k1, idx), (BR, NB, 16))
        v = xb * enc[:, :, None]
        a, c, lo, step = _sr_floor(v)
        p = tl.math.div_rn(a - lo, step)
        mag = c + (u < p).to(tl.int32)
        q = mag | ((v.to(tl.uint32, bitcast=True) >> 31).to(tl.int32) << 3)

    q = tl.where(zero, 0, q)
    q2 = tl.reshape(q, (BR, BC // 2, 2))
    qlo, qhi = tl.split(q2)
    packed = (qlo | (qhi << 4)).to(tl.uint8)
    cols2 = pid_c * (BC // 2) + tl.arange(0, BC // 2)
    rmask = (rows < R)[:, None]
    tl.store(codes_ptr + rows.to(tl.int64)[:, None] * (K // 2) + cols2[None, :], packed,
             mask=rmask & (cols2 < K // 2)[None, :])
    colsb = pid_c * NB + tl.arange(0, NB)
    tl.store(scales_ptr + rows.to(tl.int64)[:, None] * (K // 16) + colsb[None, :], code.to(tl.uint8),
             mask=rmask & (colsb < K // 16)[None, :])
    if (pid_r == 0) & (pid_c == 0):
        tl.store(gscale_ptr, gs)


@triton.jit
def _stage8(y, A: tl.constexpr, B: tl.constexpr, H: tl.constexpr):
    """Butterfly stage h = H (1, 2, 4) inside [A, B, 8] halves (the 8 are one thread's registers)."""
    v = tl.permute(tl.reshape(y, (A, B, 8 // (2 * H), 2, H)), (0, 1, 2, 4, 3))
    a, b = tl.split(v)
    return tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 2, 4, 3)), (A, B, 8))


@triton.jit
def _stage_blocks(y, A: tl.constexpr, NB: tl.constexpr, H: tl.constexpr, IMPL: tl.constexpr):
    """Butterfly stage h = 16 H across blocks: block b pairs with block b ^ H (same element of the half)."""
    if IMPL == 0:
        v = tl.permute(tl.reshape(y, (A, NB // (2 * H), 2, H, 8)), (0, 1, 3, 4, 2))
        a, b = tl.split(v)
        w = tl.permute(tl.join(a + b, a - b), (0, 1, 4, 2, 3))
    else:
        v = tl.reshape(y, (A, NB // (2 * H), 2, H, 8))
        p = tl.flip(v, 2)
        sgn = tl.where(tl.arange(0, 2) == 0, 1.0, -1.0)
        w = tl.fma(v, sgn[None, None, :, None, None], p)  # exact product by +-1: = a + b / a - b, one rounding
    return tl.reshape(w, (A, NB, 8))


@triton.jit
def _stage1_signed(y, sg, A: tl.constexpr, B: tl.constexpr):
    """Signs times the butterfly stage h = 1 inside [A, B, 8] halves, with the signs ``sg`` [B, 8] (+-1):
    (a, b) -> (a*sa + b*sb, a*sa - b*sb) as p = a*sa, fma(b, sb, p), fma(b, -sb, p). The products by +-1 are
    exact, so each output is the reference's single rounding of (x * s)[j] +- (x * s)[j + 1], signed zeros
    included (1 multiply + 2 FMAs per pair instead of 2 multiplies + 2 adds)."""
    a, b = tl.split(tl.reshape(y, (A, B, 4, 2)))
    sa, sb = tl.split(tl.reshape(sg, (B, 4, 2)))
    p = a * sa[None, :, :]
    return tl.reshape(tl.join(tl.fma(b, sb[None, :, :], p), tl.fma(b, -sb[None, :, :], p)), (A, B, 8))


@triton.jit
def _rht_halves(lo, hi, signs_ptr, BR: tl.constexpr, NB: tl.constexpr, HAD: tl.constexpr, NORM: tl.constexpr,
                IMPL: tl.constexpr, NORMALIZE: tl.constexpr):
    """formats.hadamard.rht on 16-blocks held as halves: signs, stages h = 1, 2, 4 inside each half, h = 8
    between the halves (both in registers), h = 16, 32, 64 across blocks (lanes), x fp32(1/sqrt(d)), + 0.0.
    Every output is the reference's FP32 op on the same operands, in the same stage order. ``NORMALIZE=False``
    stops after the butterfly: formats.hadamard.fwht(x * signs) (MS-EDEN folds 1/sqrt(d) into its scales)."""
    HB: tl.constexpr = HAD // 16
    sidx = ((tl.arange(0, NB) % HB) * 16)[:, None] + tl.arange(0, 8)[None, :]
    lo = _stage1_signed(lo, tl.load(signs_ptr + sidx), BR, NB)
    hi = _stage1_signed(hi, tl.load(signs_ptr + sidx + 8), BR, NB)
    lo = _stage8(_stage8(lo, BR, NB, 2), BR, NB, 4)
    hi = _stage8(_stage8(hi, BR, NB, 2), BR, NB, 4)
    lo, hi = lo + hi, lo - hi
    if HB >= 2:
        lo = _stage_blocks(lo, BR, NB, 1, IMPL)
        hi = _stage_blocks(hi, BR, NB, 1, IMPL)
    if HB >= 4:
        lo = _stage_blocks(lo, BR, NB, 2, IMPL)
        hi = _stage_blocks(hi, BR, NB, 2, IMPL)
    if HB >= 8:
        lo = _stage_blocks(lo, BR, NB, 4, IMPL)
        hi = _stage_blocks(hi, BR, NB, 4, IMPL)
    if NORMALIZE:
        # fma(y, NORM, +0.0) rounds y * NORM once and turns -0 into +0: the reference's (y * NORM) + 0.0
        lo = tl.fma(lo, NORM, 0.0)
        hi = tl.fma(hi, NORM, 0.0)
    return lo, hi


@triton.jit
def _load_halves(x_ptr, srow, scol, R, K, pid_r, pid_c, signs_ptr, HAD: tl.constexpr, NORM: tl.constexpr,
                 RHT_IMPL: tl.constexpr, TLOAD: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                 NORMALIZE: tl.constexpr):
    """The [BR, BC] tile as two FP32 halves [BR, BC/16, 8]: elements 0..7 and 8..15 of every 16-block.

    Without RHT or transposition the halves are two loads of 16 contiguous bytes (bf16) per block, so one
    thread holds a whole block: the block max and the per-block scale math need no shuffles and are not
    replicated across threads (a single [BR, BC] load gives each thread 8 elements, i.e. half a block).
    The transposed path (TLOAD or strided) loads the [BR, BC] tile as before and splits it in registers.
    Under RHT the rotation is applied to the halves (:func:`_rht_halves`; unnormalized if not ``NORMALIZE``).
    """
    NB: tl.constexpr = BC // 16
    rows = pid_r * BR + tl.arange(0, BR)
    if TLOAD == 0:
        # flat (row, block) index first, so consecutive threads take consecutive blocks of a row (coalesced)
        f = tl.arange(0, BR * NB)
        r = pid_r * BR + f // NB
        c0 = (pid_c * NB + f % NB)[:, None] * 16 + tl.arange(0, 8)[None, :]
        ptr = x_ptr + r.to(tl.int64)[:, None] * srow + c0 * scol
        mask = (r < R)[:, None] & (c0 < K)
        lo = tl.reshape(tl.load(ptr, mask=mask, other=0.0).to(tl.float32), (BR, NB, 8))
        hi = tl.reshape(tl.load(ptr + 8 * scol, mask=mask, other=0.0).to(tl.float32), (BR, NB, 8))
    else:
        x, rows, cols = _load_tile(x_ptr, srow, scol, R, K, pid_r, pid_c, BR, BC, TLOAD)
        lo, hi = tl.split(tl.permute(tl.reshape(x, (BR, NB, 2, 8)), (0, 1, 3, 2)))
    if HAD > 0:
        lo, hi = _rht_halves(lo, hi, signs_ptr, BR, NB, HAD, NORM, RHT_IMPL, NORMALIZE)
    return lo, hi, rows


@triton.jit
def _tree2(lo, hi, BR: tl.constexpr, NB: tl.constexpr):
    """The fixed pairwise tree sum over a 16-block held as two [BR, NB, 8] halves (= _tree_last over 16)."""
    return _tree_last(lo, BR, NB, 8) + _tree_last(hi, BR, NB, 8)


@triton.jit
def _sse46(axs, m, m4, sf, sf4, BR: tl.constexpr, NB: tl.constexpr):
    """Per-block squared errors of the 6- and 4-candidates for one half (FP32, fixed tree, in units of the
    global decode scale; formats.nvfp4._block_sse), from magnitudes: ``axs`` = |x| * s_enc and the candidates'
    MAGIC + code floats ``m``, ``m4`` (:func:`_e2m1_mag_magic`). A code has x's sign, so x * s_enc - value * S is
    the magnitudes' difference with that sign, exactly: the same squares as the signed form."""
    d6 = axs - _mag_value_magic(m) * sf[:, :, None]
    d4 = axs - _mag_value_magic(m4) * sf4[:, :, None]
    return _tree_last(d6 * d6, BR, NB, 8), _tree_last(d4 * d4, BR, NB, 8)


@triton.jit
def _sr_var(v, BR: tl.constexpr, NB: tl.constexpr):
    """Tree sum over a half of the SR variance terms (|v| - lo)(hi - |v|), FP32."""
    a, c, lo, st = _sr_floor(v)
    return _tree_last((a - lo) * (lo + st - a), BR, NB, 8)


@triton.jit
def _store_dq(dq_ptr, dlo, dhi, zero, rows, pid_c, R, K, NB: tl.constexpr):
    """Store a tile's bf16 q * S (its [BR, NB, 8] halves; all zeros where the tensor flushed to zero) into ``dq``
    [R, K]: 16 contiguous bytes per half-block."""
    dcol = (pid_c * NB + tl.arange(0, NB))[None, :, None] * 16 + tl.arange(0, 8)[None, None, :]
    dptr = dq_ptr + rows.to(tl.int64)[:, None, None] * K + dcol
    dmask = (rows < R)[:, None, None] & (dcol < K)
    tl.store(dptr, tl.where(zero, 0.0, dlo).to(tl.bfloat16), mask=dmask)
    tl.store(dptr + 8, tl.where(zero, 0.0, dhi).to(tl.bfloat16), mask=dmask)


@triton.jit
def _quantize_kernel(x_ptr, srow, scol, R, K, amax_ptr, seed_ptr, signs_ptr,
                     codes_ptr, scales_ptr, gscale_ptr, dq_ptr,
                     G: tl.constexpr, M6: tl.constexpr, M4: tl.constexpr,
                     ROUNDING: tl.constexpr, FOUR_SIX: tl.constexpr, BLOCK2D: tl.constexpr,
                     HAD: tl.constexpr, NORM: tl.constexpr, RHT_IMPL: tl.constexpr, TLOAD: tl.constexpr,
                     BR: tl.constexpr, BC: tl.constexpr, MAGIC_PACK: tl.constexpr, PDL: tl.constexpr = False,
                     DQ: tl.constexpr = False, SR_RP: tl.constexpr = False):
    """One [BR, BC] tile -> packed codes (int32 words, 8 codes each) and scale bytes; see the module docstring.

    Same arithmetic as :func:`_quantize_kernel_v0` (the first version, kept for comparison), reorganized so a
    thread owns whole 16-blocks (:func:`_load_halves`), codes come from the FP-pipe :func:`_e2m1_mag_magic`,
    8 codes are packed into one 32-bit word in registers, and the SR / EDEN hash indices are 32-bit.

    ``DQ``: also store each element's exact bf16 ``q * S`` (its E2M1 value times its block's E4M3 scale, no global
    scale; the bytes of :func:`fp4compile.kernels.gemm.dequantize_bf16` of the codes and scales written here) into
    ``dq`` [R, K], 16 contiguous bytes per half-block, so a GEMM's operand needs no dequantize pass of its own.
    """
    NB: tl.constexpr = BC // 16
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    lo, hi, rows = _load_halves(x_ptr, srow, scol, R, K, pid_r, pid_c, signs_ptr, HAD, NORM, RHT_IMPL, TLOAD,
                                BR, BC, True)
    ab = tl.maximum(tl.max(tl.abs(lo), axis=2), tl.max(tl.abs(hi), axis=2))
    if BLOCK2D:
        ab = _tile_max(ab, BR, NB)
    if PDL:  # x and the block maxima are ours already; the amax is the amax kernel's (module docstring)
        tl.extra.cuda.gdc_wait()
    amax = tl.load(amax_ptr)
    zero = amax < AMAX_FLUSH
    s_enc = tl.where(zero, 1.0, tl.math.div_rn(G, amax))
    gs = tl.where(zero, 0.0, tl.math.div_rn(1.0, s_enc))

    code, sf, enc = _scale_enc(ab, M6, s_enc, gs)
    e3 = enc[:, :, None]

    if ROUNDING == 0:
        if FOUR_SIX:
            # both candidates on magnitudes (the code's sign is x's, and the errors' squares do not depend on it),
            # kept as MAGIC + code floats until the chosen one is packed with x's sign bits
            code4, sf4, enc4 = _scale_enc(ab, M4, s_enc, gs)
            e4_3 = enc4[:, :, None]
            alo = tl.abs(lo)
            ahi = tl.abs(hi)
            mlo = _e2m1_mag_magic(alo * e3)
            mhi = _e2m1_mag_magic(ahi * e3)
            m4lo = _e2m1_mag_magic(alo * e4_3)
            m4hi = _e2m1_mag_magic(ahi * e4_3)
            e6a, e4a = _sse46(alo * s_enc, mlo, m4lo, sf, sf4, BR, NB)
            e6b, e4b = _sse46(ahi * s_enc, mhi, m4hi, sf, sf4, BR, NB)
            e6 = e6a + e6b
            e4 = e4a + e4b
            if BLOCK2D:
                e6 = _tile_rows(e6, BR, NB)
                e4 = _tile_rows(e4, BR, NB)
            pick4 = e4 < e6
            code = tl.where(pick4, code4, code)
            mlo = tl.where(pick4[:, :, None], m4lo, mlo)
            mhi = tl.where(pick4[:, :, None], m4hi, mhi)
            wlo = _pack_magic(mlo, lo, MAGIC_PACK)
            whi = _pack_magic(mhi, hi, MAGIC_PACK)
            if DQ:  # (stored after the codes: stored here the kernel spills 30 words at its 128-register cap)
                sfc = tl.where(pick4, sf4, sf)[:, :, None]
                dlo = _signed_value(_mag_value_magic(mlo) * sfc, lo)
                dhi = _signed_value(_mag_value_magic(mhi) * sfc, hi)
        else:
            vlo = lo * e3
            vhi = hi * e3
            mlo = _e2m1_mag_magic(tl.abs(vlo))
            mhi = _e2m1_mag_magic(tl.abs(vhi))
            wlo = _pack_magic(mlo, vlo, MAGIC_PACK)
            whi = _pack_magic(mhi, vhi, MAGIC_PACK)
            if DQ:  # (stored at once: kept until after the codes, the values take 167 registers, not 128)
                _store_dq(dq_ptr, _signed_value(_mag_value_magic(mlo) * sf[:, :, None], vlo),
                          _signed_value(_mag_value_magic(mhi) * sf[:, :, None], vhi), zero, rows, pid_c, R, K, NB)
    elif ROUNDING == 1:
        if FOUR_SIX:
            code4, sf4, enc4 = _scale_enc(ab, M4, s_enc, gs)
            e4_3 = enc4[:, :, None]
            e6 = (_sr_var(lo * e3, BR, NB) + _sr_var(hi * e3, BR, NB)) * (sf * sf)
            e4 = (_sr_var(lo * e4_3, BR, NB) + _sr_var(hi * e4_3, BR, NB)) * (sf4 * sf4)
            if BLOCK2D:
                e6 = _tile_rows(e6, BR, NB)
                e4 = _tile_rows(e4, BR, NB)
            pick4 = e4 < e6
            code = tl.where(pick4, code4, code)
            e3 = tl.where(pick4, enc4, enc)[:, :, None]
            sf = tl.where(pick4, sf4, sf)
        k0, k1 = _seed_keys(seed_ptr)
        # the hash takes the flat index mod 2^32: uint32 wrap-around arithmetic gives exactly that
        c0 = ((pid_c * NB + tl.arange(0, NB))[None, :, None] * 16 + tl.arange(0, 8)[None, None, :]).to(tl.uint32)
        i0 = rows.to(tl.uint32)[:, None, None] * K.to(tl.uint32) + c0
        vlo = lo * e3
        vhi = hi * e3
        mlo = _e2m1_sr_mag_magic(tl.abs(vlo), _uniform32(k0, k1, i0), SR_RP)
        mhi = _e2m1_sr_mag_magic(tl.abs(vhi), _uniform32(k0, k1, i0 + 8), SR_RP)
        wlo = _pack_magic(mlo, vlo, MAGIC_PACK)
        whi = _pack_magic(mhi, vhi, MAGIC_PACK)
        if DQ:
            _store_dq(dq_ptr, _signed_value(_mag_value_magic(mlo) * sf[:, :, None], vlo),
                      _signed_value(_mag_value_magic(mhi) * sf[:, :, None], vhi), zero, rows, pid_c, R, K, NB)

    w = tl.reshape(tl.join(wlo, whi), (BR, 2 * NB))  # words 2b, 2b + 1 of block b
    w = tl.where(zero, 0, w)
    rmask = (rows < R)[:, None]
    blk = pid_c * NB + tl.arange(0, NB)
    wcol = pid_c * (2 * NB) + tl.arange(0, 2 * NB)
    tl.store(codes_ptr + rows.to(tl.int64)[:, None] * (K // 8) + wcol[None, :], w,
             mask=rmask & (wcol < K // 8)[None, :])
    tl.store(scales_ptr + rows.to(tl.int64)[:, None] * (K // 16) + blk[None, :], code.to(tl.uint8),
             mask=rmask & (blk < K // 16)[None, :])
    if (pid_r == 0) & (pid_c == 0):
        tl.store(gscale_ptr, gs)
    if DQ and ROUNDING == 0 and FOUR_SIX:
        _store_dq(dq_ptr, dlo, dhi, zero, rows, pid_c, R, K, NB)


@triton.jit
def _eden_pass1_kernel(x_ptr, srow, scol, R, K, signs_ptr, codes_ptr, scratch_ptr, smax_ptr, xt_ptr,
                       VAL_MAX: tl.constexpr, INV_VAL_MAX: tl.constexpr, BLOCK2D: tl.constexpr,
                       HAD: tl.constexpr, NORM: tl.constexpr, RHT_IMPL: tl.constexpr, TLOAD: tl.constexpr,
                       BR: tl.constexpr, BC: tl.constexpr, MAGIC_PACK: tl.constexpr, TSTORE: tl.constexpr = False):
    """MS-EDEN pass 1 (``formats.schemes.eden_block_scales``) on one [BR, BC] tile: reads x once, writes the
    packed codes, the EDEN-corrected FP32 block scales S' into ``scratch`` [R, K/16], and max S' into
    ``smax`` (``atomic_max``). No global scale is needed: each block is scaled by its own max. ``TSTORE``: also
    store the tile (before any rotation) transposed into ``xt`` [K, R] (contiguous, x's dtype), the source of a
    second, transposed quantization of x (:func:`quantize_both`), instead of a separate transposing copy.

    Per element: the unnormalized butterfly (1/sqrt(d) is folded into the per-block S'), |z| * enc, the E2M1
    code as MAGIC + code (:func:`_e2m1_mag_magic_le7`), the two EDEN sums, the packing. Per block: two correctly
    rounded divisions (enc = val_max / a_z and c = num / den)."""
    NB: tl.constexpr = BC // 16
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    lo, hi, rows = _load_halves(x_ptr, srow, scol, R, K, pid_r, pid_c, signs_ptr, 0, NORM, RHT_IMPL, TLOAD,
                                BR, BC, False)
    if TSTORE:
        x = tl.reshape(tl.permute(tl.join(lo, hi), (0, 1, 3, 2)), (BR, BC))  # the halves back in column order
        cols = pid_c * BC + tl.arange(0, BC)
        tl.store(xt_ptr + cols.to(tl.int64)[None, :] * R + rows[:, None], x.to(xt_ptr.dtype.element_ty),
                 mask=(rows < R)[:, None] & (cols < K)[None, :])
    if HAD > 0:
        lo, hi = _rht_halves(lo, hi, signs_ptr, BR, NB, HAD, NORM, RHT_IMPL, False)
    a_z = tl.maximum(tl.max(tl.abs(lo), axis=2), tl.max(tl.abs(hi), axis=2))
    if BLOCK2D:
        a_z = _tile_max(a_z, BR, NB)
    if HAD > 0:
        a_y = a_z * NORM
    else:
        a_y = a_z
    live = a_y >= AMAX_FLUSH
    enc = tl.where(live, tl.math.div_rn(VAL_MAX, tl.where(live, a_z, 1.0)), 0.0)
    e3 = enc[:, :, None]
    alo = tl.abs(lo) * e3
    ahi = tl.abs(hi) * e3
    mlo = _e2m1_mag_magic_le7(alo)
    mhi = _e2m1_mag_magic_le7(ahi)
    num = _tree2(alo * alo, ahi * ahi, BR, NB)
    den = _tree2(alo * _mag_value_magic(mlo), ahi * _mag_value_magic(mhi), BR, NB)
    if BLOCK2D:
        num = _tile_rows(num, BR, NB)
        den = _tile_rows(den, BR, NB)
    c = tl.where(live, tl.math.div_rn(num, tl.where(live, den, 1.0)), 0.0)
    s_corr = c * (a_y * INV_VAL_MAX)
    wlo = tl.where(live, _pack_magic(mlo, lo, MAGIC_PACK), 0)  # sign bits from z
    whi = tl.where(live, _pack_magic(mhi, hi, MAGIC_PACK), 0)
    w = tl.reshape(tl.join(wlo, whi), (BR, 2 * NB))  # words 2b, 2b + 1 of block b
    rmask = (rows < R)[:, None]
    blk = pid_c * NB + tl.arange(0, NB)
    wcol = pid_c * (2 * NB) + tl.arange(0, 2 * NB)
    tl.store(codes_ptr + rows.to(tl.int64)[:, None] * (K // 8) + wcol[None, :], w,
             mask=rmask & (wcol < K // 8)[None, :])
    tl.store(scratch_ptr + rows.to(tl.int64)[:, None] * (K // 16) + blk[None, :], s_corr,
             mask=rmask & (blk < K // 16)[None, :])
    # rows past R hold zeros (masked loads), so their S' is 0 and cannot raise the max
    tl.atomic_max(smax_ptr, _amax_all(s_corr))


@triton.jit
def _run_half(x_ptr, base, j: tl.constexpr, mask, sg, A: tl.constexpr, B: tl.constexpr):
    """Half-block ``j`` (elements 8j..8j+7) of every run (a 128-chunk or half of one) of the pass-1 kernels that give
    a thread a run, [A * B, 8] FP32 (16 contiguous bytes per thread), with the signs ``sg`` [B, 8] and the butterfly
    stages h = 1, 2, 4 applied in registers (:func:`_stage1_signed`, :func:`_stage8`, as :func:`_rht_halves`): the
    runs as [A, B] = [runs, 1] when every run has the same signs, [1, runs] when each has its own row of ``sg``."""
    y = tl.load(x_ptr + base[:, None] + (j * 8 + tl.arange(0, 8))[None, :], mask=mask, other=0.0).to(tl.float32)
    y = _stage1_signed(tl.reshape(y, (A, B, 8)), sg, A, B)
    return tl.reshape(_stage8(_stage8(y, A, B, 2), A, B, 4), (A * B, 8))


@triton.jit
def _c_half(x_ptr, base, j: tl.constexpr, mask, signs_ptr, C: tl.constexpr):
    """:func:`_run_half` of every 128-chunk (the same signs for all: those of elements 8j..8j+7)."""
    return _run_half(x_ptr, base, j, mask, tl.reshape(tl.load(signs_ptr + j * 8 + tl.arange(0, 8)), (1, 8)), C, 1)


@triton.jit
def _bf(a, b):
    return a + b, a - b


@triton.jit
def _c_block(lo, hi, VAL_MAX: tl.constexpr, INV_VAL_MAX: tl.constexpr, NORM: tl.constexpr, C: tl.constexpr,
             MAGIC_PACK: tl.constexpr):
    """The per-block MS-EDEN pass-1 math of :func:`_eden_pass1_kernel` for one 16-block held as two [C, 8]
    halves: (low word, high word, S') per chunk."""
    a_z = tl.maximum(tl.max(tl.abs(lo), axis=1), tl.max(tl.abs(hi), axis=1))
    a_y = a_z * NORM
    live = a_y >= AMAX_FLUSH
    enc = tl.where(live, tl.math.div_rn(VAL_MAX, tl.where(live, a_z, 1.0)), 0.0)
    alo = tl.reshape(tl.abs(lo) * enc[:, None], (C, 1, 8))
    ahi = tl.reshape(tl.abs(hi) * enc[:, None], (C, 1, 8))
    mlo = _e2m1_mag_magic_le7(alo)
    mhi = _e2m1_mag_magic_le7(ahi)
    num = tl.reshape(_tree2(alo * alo, ahi * ahi, C, 1), (C,))
    den = tl.reshape(_tree2(alo * _mag_value_magic(mlo), ahi * _mag_value_magic(mhi), C, 1), (C,))
    c = tl.where(live, tl.math.div_rn(num, tl.where(live, den, 1.0)), 0.0)
    wlo = tl.reshape(_pack_magic(mlo, tl.reshape(lo, (C, 1, 8)), MAGIC_PACK), (C,))
    whi = tl.reshape(_pack_magic(mhi, tl.reshape(hi, (C, 1, 8)), MAGIC_PACK), (C,))
    return tl.where(live, wlo, 0), tl.where(live, whi, 0), c * (a_y * INV_VAL_MAX)


@triton.jit
def _join8(v0, v1, v2, v3, v4, v5, v6, v7, C: tl.constexpr):
    """Eight [C] tensors -> [C, 8] (column k = vk), by joins (in registers) and one permute."""
    t = tl.join(tl.join(tl.join(v0, v1), tl.join(v2, v3)), tl.join(tl.join(v4, v5), tl.join(v6, v7)))
    return tl.reshape(tl.permute(t, (0, 3, 2, 1)), (C, 8))


@triton.jit
def _store_runs(codes_ptr, scratch_ptr, smax_ptr, rows, col0, K, mask, w, sc, NW: tl.constexpr):
    """The pass-1 outputs of the kernels that give a thread a run (a 128-chunk or part of one, starting at column
    ``col0`` of row ``rows``): its ``NW`` packed code words [C, NW] (8 codes each), its NW / 2 scales S' [C, NW / 2]
    into ``scratch``, and max S' into ``smax`` (``atomic_max``)."""
    tl.store(codes_ptr + (rows.to(tl.int64) * (K // 8) + col0 // 8)[:, None] + tl.arange(0, NW)[None, :], w,
             mask=mask)
    tl.store(scratch_ptr + (rows.to(tl.int64) * (K // 16) + col0 // 16)[:, None] + tl.arange(0, NW // 2)[None, :],
             sc, mask=mask)
    tl.atomic_max(smax_ptr, _amax_all(sc))


@triton.jit
def _chunk_tile(srow, R, K, BR: tl.constexpr, BC: tl.constexpr, W: tl.constexpr):
    """The [BR, BC] tile of program (0, 1) as BR * BC / W runs of W contiguous elements, one per thread: (run index
    f, row, first column, x's offset, the [runs, 1] mask of runs inside x)."""
    f = tl.arange(0, BR * (BC // W))
    rows = tl.program_id(0) * BR + f // (BC // W)
    col0 = tl.program_id(1) * BC + (f % (BC // W)) * W
    base = rows.to(tl.int64) * srow + col0
    return f, rows, col0, base, ((rows < R) & (col0 < K))[:, None]


@triton.jit
def _eden_pass1_chunk_kernel(x_ptr, srow, R, K, signs_ptr, codes_ptr, scratch_ptr, smax_ptr,
                             VAL_MAX: tl.constexpr, INV_VAL_MAX: tl.constexpr, NORM: tl.constexpr,
                             BR: tl.constexpr, BC: tl.constexpr, MAGIC_PACK: tl.constexpr):
    """:func:`_eden_pass1_kernel` for RHT-128 on contiguous rows (``CONFIG["e_impl"] = 1``), 1x16 blocks: one
    thread per 128-element chunk held as 16 separate [C, 8] half-blocks, so the butterfly stages across halves
    and blocks (h = 8 ... 64) are plain register ops between tensors, no warp shuffles (a shuffle issues at a
    quarter of the FP32 rate). Same arithmetic in the same order as the reference, same bytes."""
    C: tl.constexpr = BR * (BC // 128)
    f, rows, col0, base, mask = _chunk_tile(srow, R, K, BR, BC, 128)
    h0 = _c_half(x_ptr, base, 0, mask, signs_ptr, C)
    h1 = _c_half(x_ptr, base, 1, mask, signs_ptr, C)
    h2 = _c_half(x_ptr, base, 2, mask, signs_ptr, C)
    h3 = _c_half(x_ptr, base, 3, mask, signs_ptr, C)
    h4 = _c_half(x_ptr, base, 4, mask, signs_ptr, C)
    h5 = _c_half(x_ptr, base, 5, mask, signs_ptr, C)
    h6 = _c_half(x_ptr, base, 6, mask, signs_ptr, C)
    h7 = _c_half(x_ptr, base, 7, mask, signs_ptr, C)
    h8 = _c_half(x_ptr, base, 8, mask, signs_ptr, C)
    h9 = _c_half(x_ptr, base, 9, mask, signs_ptr, C)
    h10 = _c_half(x_ptr, base, 10, mask, signs_ptr, C)
    h11 = _c_half(x_ptr, base, 11, mask, signs_ptr, C)
    h12 = _c_half(x_ptr, base, 12, mask, signs_ptr, C)
    h13 = _c_half(x_ptr, base, 13, mask, signs_ptr, C)
    h14 = _c_half(x_ptr, base, 14, mask, signs_ptr, C)
    h15 = _c_half(x_ptr, base, 15, mask, signs_ptr, C)
    # butterfly stage h = 8: half j with half j ^ 1
    h0, h1 = _bf(h0, h1)
    h2, h3 = _bf(h2, h3)
    h4, h5 = _bf(h4, h5)
    h6, h7 = _bf(h6, h7)
    h8, h9 = _bf(h8, h9)
    h10, h11 = _bf(h10, h11)
    h12, h13 = _bf(h12, h13)
    h14, h15 = _bf(h14, h15)
    # butterfly stage h = 16: half j with half j ^ 2
    h0, h2 = _bf(h0, h2)
    h1, h3 = _bf(h1, h3)
    h4, h6 = _bf(h4, h6)
    h5, h7 = _bf(h5, h7)
    h8, h10 = _bf(h8, h10)
    h9, h11 = _bf(h9, h11)
    h12, h14 = _bf(h12, h14)
    h13, h15 = _bf(h13, h15)
    # butterfly stage h = 32: half j with half j ^ 4
    h0, h4 = _bf(h0, h4)
    h1, h5 = _bf(h1, h5)
    h2, h6 = _bf(h2, h6)
    h3, h7 = _bf(h3, h7)
    h8, h12 = _bf(h8, h12)
    h9, h13 = _bf(h9, h13)
    h10, h14 = _bf(h10, h14)
    h11, h15 = _bf(h11, h15)
    # butterfly stage h = 64: half j with half j ^ 8
    h0, h8 = _bf(h0, h8)
    h1, h9 = _bf(h1, h9)
    h2, h10 = _bf(h2, h10)
    h3, h11 = _bf(h3, h11)
    h4, h12 = _bf(h4, h12)
    h5, h13 = _bf(h5, h13)
    h6, h14 = _bf(h6, h14)
    h7, h15 = _bf(h7, h15)
    w0, w1, s0 = _c_block(h0, h1, VAL_MAX, INV_VAL_MAX, NORM, C, MAGIC_PACK)
    w2, w3, s1 = _c_block(h2, h3, VAL_MAX, INV_VAL_MAX, NORM, C, MAGIC_PACK)
    w4, w5, s2 = _c_block(h4, h5, VAL_MAX, INV_VAL_MAX, NORM, C, MAGIC_PACK)
    w6, w7, s3 = _c_block(h6, h7, VAL_MAX, INV_VAL_MAX, NORM, C, MAGIC_PACK)
    w8, w9, s4 = _c_block(h8, h9, VAL_MAX, INV_VAL_MAX, NORM, C, MAGIC_PACK)
    w10, w11, s5 = _c_block(h10, h11, VAL_MAX, INV_VAL_MAX, NORM, C, MAGIC_PACK)
    w12, w13, s6 = _c_block(h12, h13, VAL_MAX, INV_VAL_MAX, NORM, C, MAGIC_PACK)
    w14, w15, s7 = _c_block(h14, h15, VAL_MAX, INV_VAL_MAX, NORM, C, MAGIC_PACK)
    w = tl.join(_join8(w0, w1, w2, w3, w4, w5, w6, w7, C), _join8(w8, w9, w10, w11, w12, w13, w14, w15, C))
    w = tl.reshape(tl.permute(w, (0, 2, 1)), (C, 16))  # word 2b + half of block b
    sc = _join8(s0, s1, s2, s3, s4, s5, s6, s7, C)
    _store_runs(codes_ptr, scratch_ptr, smax_ptr, rows, col0, K, mask, w, sc, 16)


@triton.jit
def _h_half(x_ptr, base, j: tl.constexpr, mask, sgn_off, signs_ptr, C: tl.constexpr):
    """:func:`_run_half` of every run of a 128-chunk (a half or a quarter of it), whose signs start at ``sgn_off`` [C]
    (the run's offset in its chunk)."""
    sg = tl.load(signs_ptr + sgn_off[:, None] + (j * 8 + tl.arange(0, 8))[None, :])
    return _run_half(x_ptr, base, j, mask, sg, 1, C)


@triton.jit
def _h_pair(h, C: tl.constexpr, H: tl.constexpr = 1):
    """Butterfly stage between the runs of a 128-chunk held by threads f and f ^ H (each run a [C, 8] half-block per
    thread): h = 64 between half-chunks (H = 1), h = 32 and 64 between quarter-chunks (H = 1, 2). The cross-block
    stage of :func:`_stage_blocks` (the partner's values by ``tl.flip``, a lane exchange) over the runs seen as
    blocks."""
    return tl.reshape(_stage_blocks(tl.reshape(h, (1, C, 8)), 1, C, H, 1), (C, 8))


@triton.jit
def _eden_pass1_half_kernel(x_ptr, srow, R, K, signs_ptr, codes_ptr, scratch_ptr, smax_ptr,
                            VAL_MAX: tl.constexpr, INV_VAL_MAX: tl.constexpr, NORM: tl.constexpr,
                            BR: tl.constexpr, BC: tl.constexpr, MAGIC_PACK: tl.constexpr):
    """:func:`_eden_pass1_kernel` for RHT-128 on contiguous rows (``CONFIG["e_impl"] = 2``), 1x16 blocks: one thread
    per 64-element half of a 128-chunk, held as 8 separate [C, 8] half-blocks. The butterfly stages h = 1 ... 32 are
    register ops inside the thread; only h = 64 pairs two threads (one exchange per element, against three shuffle
    stages when a thread holds one 16-block), with half the registers of a whole chunk per thread (``e_impl`` 1).
    Same arithmetic in the same order as the reference, same bytes."""
    tl.static_assert(BC % 128 == 0, "BC must hold whole 128-chunks (the partner of a half is its neighbour)")
    C: tl.constexpr = BR * (BC // 64)
    f, rows, col0, base, mask = _chunk_tile(srow, R, K, BR, BC, 64)
    so = (f % 2) * 64
    h0 = _h_half(x_ptr, base, 0, mask, so, signs_ptr, C)
    h1 = _h_half(x_ptr, base, 1, mask, so, signs_ptr, C)
    h2 = _h_half(x_ptr, base, 2, mask, so, signs_ptr, C)
    h3 = _h_half(x_ptr, base, 3, mask, so, signs_ptr, C)
    h4 = _h_half(x_ptr, base, 4, mask, so, signs_ptr, C)
    h5 = _h_half(x_ptr, base, 5, mask, so, signs_ptr, C)
    h6 = _h_half(x_ptr, base, 6, mask, so, signs_ptr, C)
    h7 = _h_half(x_ptr, base, 7, mask, so, signs_ptr, C)
    # stages h = 8, 16, 32: half j with half j ^ 1, j ^ 2, j ^ 4 (in the thread)
    h0, h1 = _bf(h0, h1)
    h2, h3 = _bf(h2, h3)
    h4, h5 = _bf(h4, h5)
    h6, h7 = _bf(h6, h7)
    h0, h2 = _bf(h0, h2)
    h1, h3 = _bf(h1, h3)
    h4, h6 = _bf(h4, h6)
    h5, h7 = _bf(h5, h7)
    h0, h4 = _bf(h0, h4)
    h1, h5 = _bf(h1, h5)
    h2, h6 = _bf(h2, h6)
    h3, h7 = _bf(h3, h7)
    # stage h = 64: the same half-block of the chunk's other half-chunk (the partner thread)
    h0 = _h_pair(h0, C)
    h1 = _h_pair(h1, C)
    h2 = _h_pair(h2, C)
    h3 = _h_pair(h3, C)
    h4 = _h_pair(h4, C)
    h5 = _h_pair(h5, C)
    h6 = _h_pair(h6, C)
    h7 = _h_pair(h7, C)
    w0, w1, s0 = _c_block(h0, h1, VAL_MAX, INV_VAL_MAX, NORM, C, MAGIC_PACK)
    w2, w3, s1 = _c_block(h2, h3, VAL_MAX, INV_VAL_MAX, NORM, C, MAGIC_PACK)
    w4, w5, s2 = _c_block(h4, h5, VAL_MAX, INV_VAL_MAX, NORM, C, MAGIC_PACK)
    w6, w7, s3 = _c_block(h6, h7, VAL_MAX, INV_VAL_MAX, NORM, C, MAGIC_PACK)
    w = _join8(w0, w1, w2, w3, w4, w5, w6, w7, C)    # word 2b + half of block b
    sc = tl.reshape(tl.permute(tl.join(tl.join(s0, s1), tl.join(s2, s3)), (0, 2, 1)), (C, 4))
    _store_runs(codes_ptr, scratch_ptr, smax_ptr, rows, col0, K, mask, w, sc, 8)


@triton.jit
def _eden_pass1_quarter_kernel(x_ptr, srow, R, K, signs_ptr, codes_ptr, scratch_ptr, smax_ptr,
                               VAL_MAX: tl.constexpr, INV_VAL_MAX: tl.constexpr, NORM: tl.constexpr,
                               BR: tl.constexpr, BC: tl.constexpr, MAGIC_PACK: tl.constexpr):
    """:func:`_eden_pass1_kernel` for RHT-128 on contiguous rows (``CONFIG["e_impl"] = 3``), 1x16 blocks: one thread
    per 32-element quarter of a 128-chunk (two 16-blocks), held as 4 separate [C, 8] half-blocks. The butterfly
    stages h = 1 ... 16 are register ops inside the thread; h = 32 and h = 64 pair threads (two exchanges per element,
    against three shuffle stages when a thread holds one 16-block, and one with half a chunk per thread at twice the
    registers). Same arithmetic in the same order as the reference, same bytes."""
    tl.static_assert(BC % 128 == 0, "BC must hold whole 128-chunks (the partners of a quarter are its neighbours)")
    C: tl.constexpr = BR * (BC // 32)
    f, rows, col0, base, mask = _chunk_tile(srow, R, K, BR, BC, 32)
    so = (f % 4) * 32
    h0, h1 = _h_half(x_ptr, base, 0, mask, so, signs_ptr, C), _h_half(x_ptr, base, 1, mask, so, signs_ptr, C)
    h2, h3 = _h_half(x_ptr, base, 2, mask, so, signs_ptr, C), _h_half(x_ptr, base, 3, mask, so, signs_ptr, C)
    # stages h = 8, 16: half j with half j ^ 1, j ^ 2 (in the thread)
    h0, h1 = _bf(h0, h1)
    h2, h3 = _bf(h2, h3)
    h0, h2 = _bf(h0, h2)
    h1, h3 = _bf(h1, h3)
    # stages h = 32, 64: the same half-block of quarter-chunk f ^ 1, then f ^ 2 (partner threads)
    h0, h1, h2, h3 = _h_pair(h0, C, 1), _h_pair(h1, C, 1), _h_pair(h2, C, 1), _h_pair(h3, C, 1)
    h0, h1, h2, h3 = _h_pair(h0, C, 2), _h_pair(h1, C, 2), _h_pair(h2, C, 2), _h_pair(h3, C, 2)
    w0, w1, s0 = _c_block(h0, h1, VAL_MAX, INV_VAL_MAX, NORM, C, MAGIC_PACK)
    w2, w3, s1 = _c_block(h2, h3, VAL_MAX, INV_VAL_MAX, NORM, C, MAGIC_PACK)
    w = tl.reshape(tl.permute(tl.join(tl.join(w0, w1), tl.join(w2, w3)), (0, 2, 1)), (C, 4))  # word 2b + half
    sc = tl.reshape(tl.join(s0, s1), (C, 2))
    _store_runs(codes_ptr, scratch_ptr, smax_ptr, rows, col0, K, mask, w, sc, 4)


@triton.jit
def _eden_pass2_kernel(scratch_ptr, smax_ptr, seed_ptr, scales_ptr, gscale_ptr, N, NBK,
                       BLOCK2D: tl.constexpr, BLOCK: tl.constexpr, WIDE: tl.constexpr = False):
    """MS-EDEN pass 2 (``formats.schemes.eden_align_scales``) on BLOCK consecutive entries of the [R, K/16] scales,
    seen flat (N = R * K/16 entries; every lane has an entry whatever K/16 is, the row width of the 124M step's
    scales being 48 to 192): global = max S' / 256, r = S' / global, stochastically rounded to an E4M3 neighbour.
    The lower neighbour is r truncated to E4M3 (its bit pattern: exponent and top 3 mantissa bits; r * 512 below
    2^-6), the step hi - lo a power of two, so p = (r - lo) * (1 / step) is the reference's exact (r - lo) / (hi -
    lo). The uniform is keyed by the entry's flat index (2D blocks: that of the first row of its 16-row tile).
    ``WIDE``: 64-bit indices (N >= 2^31)."""
    if WIDE:
        f = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    else:
        f = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = f < N
    idx = f
    if BLOCK2D:
        idx = f - ((f // NBK) % 16) * NBK
    code, gs = _eden_align(tl.load(scratch_ptr + f, mask=mask, other=0.0), smax_ptr, seed_ptr, idx)
    tl.store(scales_ptr + f, code.to(tl.uint8), mask=mask)
    if tl.program_id(0) == 0:
        tl.store(gscale_ptr, gs)


@triton.jit
def _eden_align(s, smax_ptr, seed_ptr, idx):
    """MS-EDEN pass 2's per-entry math (:func:`_eden_pass2_kernel`): S' entries ``s`` -> (E4M3 scale codes, the
    global decode scale), the uniforms keyed by the flat block indices ``idx`` (taken mod 2^32)."""
    m = tl.load(smax_ptr)
    live = m > 0
    gs = tl.where(m == 0.0, 0.0, m * 0.00390625)   # NaN m (a non-finite input): a NaN global
    r = tl.math.div_rn(s, tl.where(live, gs, 1.0))
    # lower E4M3 neighbour (r truncated), its code and 1 / (hi - lo), from r's bit pattern: r >= 2^-6 keeps the
    # exponent and 3 mantissa bits (step 2^(e - 3), its reciprocal's bits 0x7F000000 - step's bits); below, the
    # subnormal grid of 2^-9 (r * 512 is exact). Both branches are exact.
    bits = r.to(tl.int32, bitcast=True)
    normal = r >= 0.015625
    code = tl.where(normal, (bits >> 20) - 960, (r * 512.0).to(tl.int32))
    lo = tl.where(normal, (bits & -1048576).to(tl.float32, bitcast=True), code.to(tl.float32) * 0.001953125)
    inv_step = tl.where(normal, (0x7F000000 - ((bits & 0x7F800000) - 0x1800000)).to(tl.float32, bitcast=True), 512.0)
    p = (r - lo) * inv_step
    k0, k1 = _seed_keys(seed_ptr)
    u = _uniform32(k0, k1, idx.to(tl.uint32))
    return tl.where(u < p, code + 1, code), gs


@triton.jit
def _eden_pass2_dq_kernel(scratch_ptr, smax_ptr, seed_ptr, scales_ptr, gscale_ptr, codes_ptr, dq_ptr, R, NBK,
                          BLOCK2D: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, DEQUANT_ASM: tl.constexpr):
    """:func:`_eden_pass2_kernel` on a [BR, BC] tile of the [R, K] copy (its [BR, BC/16] scale entries), which then
    also dequantizes the tile's codes with the scales it made into ``dq`` [R, K], exact bf16 q * S
    (``quantize_dq``): the bytes of :func:`fp4compile.kernels.gemm.dequantize_bf16` of the final copy, with no
    pass of its own (the dequantize kernel's work, without its launch and without reading the scales back)."""
    NB: tl.constexpr = BC // 16
    rr = tl.program_id(0) * BR + tl.arange(0, BR)
    kb = tl.program_id(1) * NB + tl.arange(0, NB)
    rmask = (rr < R)[:, None]
    smask = rmask & (kb < NBK)[None, :]
    f = rr.to(tl.int64)[:, None] * NBK + kb[None, :]
    idx = f
    if BLOCK2D:
        idx = (rr - rr % 16).to(tl.int64)[:, None] * NBK + kb[None, :]
    code, gs = _eden_align(tl.load(scratch_ptr + f, mask=smask, other=0.0), smax_ptr, seed_ptr, idx)
    code = code.to(tl.uint8)
    tl.store(scales_ptr + f, code, mask=smask)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(gscale_ptr, gs)
    kh = tl.program_id(1) * (BC // 2) + tl.arange(0, BC // 2)
    codes = tl.load(codes_ptr + rr.to(tl.int64)[:, None] * (NBK * 8) + kh[None, :],
                    mask=rmask & (kh < NBK * 8)[None, :], other=0)
    v = _dequant_tile(codes, code, BR, BC, DEQUANT_ASM).to(tl.float32) * 256.0
    ko = tl.program_id(1) * BC + tl.arange(0, BC)
    tl.store(dq_ptr + rr.to(tl.int64)[:, None] * (NBK * 16) + ko[None, :], v.to(tl.bfloat16),
             mask=rmask & (ko < NBK * 16)[None, :])


@triton.jit
def _dequantize_kernel(codes_ptr, scales_ptr, gscale_ptr, signs_ptr, out_ptr, R, K,
                       HAD: tl.constexpr, NORM: tl.constexpr, RHT_IMPL: tl.constexpr, OUT_BF16: tl.constexpr,
                       BR: tl.constexpr, BC: tl.constexpr, TRANS: tl.constexpr = False,
                       RNE_BITS: tl.constexpr = True):
    """One [BR, BC] tile of the [R, K] dequantization ``q * S * global`` (inverse RHT along K when HAD), stored
    into ``out`` [R, K], or with TRANS into ``out`` [K, R] at the transposed position (one pass instead of a
    dequantization and a transposing copy)."""
    NB: tl.constexpr = BC // 16
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BR + tl.arange(0, BR)
    rmask = (rows < R)[:, None]
    cols2 = pid_c * (BC // 2) + tl.arange(0, BC // 2)
    packed = tl.load(codes_ptr + rows.to(tl.int64)[:, None] * (K // 2) + cols2[None, :],
                     mask=rmask & (cols2 < K // 2)[None, :], other=0).to(tl.int32)
    q = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BR, NB, 16))
    colsb = pid_c * NB + tl.arange(0, NB)
    sc = tl.load(scales_ptr + rows.to(tl.int64)[:, None] * (K // 16) + colsb[None, :],
                 mask=rmask & (colsb < K // 16)[None, :], other=0).to(tl.int32)
    s = _e4m3_value(sc) * tl.load(gscale_ptr)
    vals = tl.reshape(_e2m1_value(q) * s[:, :, None], (BR, BC))
    if HAD > 0:
        sg = tl.load(signs_ptr + tl.arange(0, HAD))
        y = _fwht(tl.reshape(vals, (BR * (BC // HAD), HAD)), BR * (BC // HAD), HAD, RHT_IMPL)
        y = tl.reshape(y * NORM, (BR, BC // HAD, HAD)) * sg[None, None, :]
        vals = tl.reshape(y, (BR, BC))
    if OUT_BF16 and RNE_BITS:  # explicit RNE to bf16 (the interpreter's cast truncates; the GPU's is RNE)
        b = vals.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        vals = b.to(tl.float32, bitcast=True)
    cols = pid_c * BC + tl.arange(0, BC)
    if TRANS:
        off = cols.to(tl.int64)[None, :] * R + rows[:, None]
    else:
        off = rows.to(tl.int64)[:, None] * K + cols[None, :]
    tl.store(out_ptr + off, vals.to(out_ptr.dtype.element_ty), mask=rmask & (cols < K)[None, :])


@triton.jit
def _transpose_kernel(x_ptr, xt_ptr, M, N, sxm, sxn, amax_ptr, AMAX: tl.constexpr, BM: tl.constexpr,
                      BN: tl.constexpr):
    """xt[n, m] = x[m, n] for one [BM, BN] tile (xt contiguous [N, M]); with AMAX also max|x| into amax_ptr
    (max|x.T| = max|x|, so the transposed quantize needs no separate amax pass without RHT)."""
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (m < M)[:, None] & (n < N)[None, :]
    t = tl.load(x_ptr + m.to(tl.int64)[:, None] * sxm + n.to(tl.int64)[None, :] * sxn, mask=mask, other=0.0)
    if AMAX:
        tl.atomic_max(amax_ptr, _amax_all(tl.abs(t.to(tl.float32))))
    tl.store(xt_ptr + n.to(tl.int64)[None, :] * M + m.to(tl.int64)[:, None], t, mask=mask)


# ---------------------------------------------------------------------------------------------- launchers
#: Tile sizes and kernel variants, from the H200 sweeps in bench/quantize.py (docs/BENCHMARKS.md, 16384x8192).
#: Quantize tiles: ``q_*`` plain RTN, 1D or 2D (16x512, 4 warps: 171 us total vs 176 us for 16x256), ``s_*`` SR
#: and 4/6 (16x256: SR 461 us vs 550 us with 16x512), ``r_*`` with RHT (16x256, 4 warps), ``t_*`` the
#: in-kernel transposed paths. Amax pass: ``a_*`` without RHT (128x256, 8 warps: 65 us vs 73 us for 32x256),
#: ``ah_*`` with RHT (32x256, 4 warps: 103 us vs 121 us for 64x256). ``rht_impl`` 1: the butterfly exchanges
#: partners with ``tl.flip`` (MS-EDEN+RHT128 346 us vs 774 us for 0, permute/split). ``q_impl``: 1 = the
#: block-per-thread quantize kernel (:func:`_quantize_kernel`; RTN 175 us vs 227 us), 0 = the first version
#: (:func:`_quantize_kernel_v0`). ``a_impl``: 1 = under RHT the amax pass loads and rotates blocks as halves like
#: the quantize kernel (103 vs 115 us); 2 = halves also without RHT; 0 = never. ``t_impl`` (transpose=True):
#: 2 = one Triton transposing copy (tiles ``p_*``, 128x128, 8 warps; fused with the amax pass without RHT), then
#: the row-wise kernels (MS-EDEN+RHT128 477 us, RTN 231 us); 0 = strided loads through the swapped strides (717
#: and 344 us; the first kernel: 5884 us); 1 = load the tile in x's own orientation and ``tl.trans`` it (2894 us).
#: MS-EDEN (post hoc range alignment, :func:`_quantize_eden`): ``e_*`` pass 1 over x (16x256, 4 warps, the tile
#: of the former RHT quantize kernel; ``t_*`` for the in-kernel transposed paths), ``f_*`` pass 2 over the
#: [R, K/16] FP32 block scales, flat (``f_block`` entries per program, 16 per thread; until session 28 16x128
#: tiles, which left 62 % of the lanes idle at K/16 = 48: static sm_90 62 instructions per entry against 83-167 at
#: the 124M step's K/16 of 48-192). ``e_impl`` 1: for RHT-128 on contiguous rows with 1x16 blocks, pass 1 gives each
#: thread a whole 128-chunk (:func:`_eden_pass1_chunk_kernel`, tiles ``c_*``: rows x columns, c_rows * c_cols / 128
#: chunks per program, ideally 32 * c_warps); 0: a 16-block per thread (the RHT's cross-block stages shuffle
#: between lanes). Measured on the H200 (16384x8192, pass 1 alone): e_impl 0 216.5 us, e_impl 1 285.2 us, although
#: e_impl 1 issues fewer instructions (SASS for sm_90: 35 per element and no SHFL vs 48 incl. 3.3 SHFL): it needs
#: 254 registers per thread (8 warps per SM) against 96. ``e_impl`` 2 (session 45): half a 128-chunk
#: per thread (:func:`_eden_pass1_half_kernel`, tiles ``h_*``, cap ``h_maxnreg``, 0 = none): the butterfly's stages
#: up to h = 32 in registers, h = 64 one exchange with the partner thread; static sm_90 35.0 instructions and 1.1
#: SHFL per element at 185 registers uncapped, 37.8 with spills at 128; H200 (session 46): 318-321 us at 16384x8192
#: against e_impl 0's 214 (its registers cost more than the shuffles it saves). ``e_impl`` 3 (session 46): a
#: quarter of a 128-chunk per thread (:func:`_eden_pass1_quarter_kernel`, tiles ``u_*``, cap ``u_maxnreg``): stages up
#: to h = 16 in registers, h = 32 and 64 exchanged with partner threads. Static sm_90 at the default tile (16x512, 4
#: warps: two quarter-chunks per thread): 35.8 instructions and 2.1 SHFL per element at the 128-register cap (2
#: spill accesses per thread; 35.6 at 158 registers uncapped, 37.5 with 108 spill accesses at 96); one quarter-chunk
#: per thread (8x512): 40.0 and 2.2 at 80 registers, no spill. e_impl 0: 40.8 and 3.3 at 96. H200 (session 46,
#: ``bench/quantize.py --sweep --sweeps had128u``): 207.6 us at 16384x8192, 0.466 of copy bandwidth, against e_impl
#: 0's 214.3 (0.452; the best of 9 tiles/caps; uncapped 257, one per thread 227), but 33.5 against 32.5 us at 4096x4096
#: and no change in the 124M step (49.29 against 49.23 ms), so e_impl stays 0.
#: ``g_*``: pass 2's tile when it also dequantizes the copy (``quantize(..., dq=True)``, :func:`_eden_pass2_dq_kernel`;
#: rows x columns of the copy, the dequantize kernel's ``_dequant2_kernel`` tile, whose work it takes over).
#: ``q_impl`` and the ``a_*``/``ah_*`` amax tiles do not apply to MS-EDEN. ``pdl`` 1: RTN/SR's quantize kernel
#: (``q_impl`` 1) is launched with programmatic dependent launch behind its amax kernel on sm_90+ (module
#: docstring), the default: bit-exact with two ordinary launches (eagerly and in CUDA graphs) and, on the H200,
#: RTN 4096x4096 at 0.864-0.875 of copy bandwidth against 0.840 without (16384x8192: 0.895 both; session 12,
#: docs/BENCHMARKS.md); 0: two ordinary launches. ``d_*``: the dequantize kernel's tile; ``dt_*``: its tile when it
#: stores the transpose (``dequantize(..., transpose=True)``, the backward's requantization source). 64x64, 4 warps
#: (``bench/requant.py --sweep``, 16384x3072, session 27): 59.4 us, the best of seven tiles, with the earlier
#: select-chain decode; 38.6 us with the bit-placed one, within 2.5 % of the best tile (32x128, 37.7 us).
#: ``e_maxnreg`` / ``s_maxnreg``: a register cap (Triton's ``maxnreg`` launch option; 0 = the compiler's choice) for
#: MS-EDEN's pass 1 (the ``e_*`` and ``t_*`` tiles) / the SR and 4/6 quantize kernel (``s_*``). Pass 1 RHT-128
#: takes 108 registers uncapped (4 programs of 4 warps per SM); at 96, the default, it compiles to the same
#: instructions with no spill (5 per SM; every pass-1 variant, tests/test_quantize_kernels.py). H200, session 30:
#: MS-EDEN + RHT-128 at 16384x8192 230.9 -> 214.4 us (80: 211.9, spilling), the 124M full-stack step's quantize
#: kernels 12.98 -> 12.25 ms and the step 50.9, 50.9 -> 50.4, 49.8 ms (alternating). ``s_maxnreg`` 128, the
#: default: RTN 4/6 on magnitudes (:func:`_sse46`) takes 168 registers uncapped (3 programs per SM) and at 128 the
#: same instructions with no spill (4 per SM; 49.0 static SASS instructions per element against the signed form's
#: 58.0). H200, session 31, 16384x8192 with its amax pass: 324.0 us (signed form) -> 299.5 uncapped -> 287.4-288.4
#: at 128 (96: 301, spilling). SR (4/6 or not) takes 128 uncapped, so the cap leaves it as it was.
CONFIG = {"q_rows": 16, "q_cols": 512, "q_warps": 4, "s_rows": 16, "s_cols": 256, "s_warps": 4,
          "r_rows": 16, "r_cols": 256, "r_warps": 4, "t_rows": 16, "t_cols": 256, "t_warps": 4,
          "a_rows": 128, "a_cols": 256, "a_warps": 8, "ah_rows": 32, "ah_cols": 256, "ah_warps": 4,
          "d_rows": 16, "d_cols": 128, "d_warps": 4, "dt_rows": 64, "dt_cols": 64, "dt_warps": 4,
          "p_rows": 128, "p_cols": 128, "p_warps": 8,
          "e_rows": 16, "e_cols": 256, "e_warps": 4, "f_block": 2048, "f_warps": 4,
          "g_rows": 64, "g_cols": 128, "g_warps": 4,
          "e_impl": 0, "c_rows": 32, "c_cols": 512, "c_warps": 4, "h_rows": 16, "h_cols": 512, "h_warps": 4,
          "h_maxnreg": 0, "u_rows": 16, "u_cols": 512, "u_warps": 4, "u_maxnreg": 128,
          "rht_impl": 1, "t_impl": 2, "q_impl": 1, "a_impl": 1, "pdl": 1, "e_maxnreg": 96, "s_maxnreg": 128}


#: MS-EDEN pass 1 for RHT-128 on contiguous rows by ``e_impl``: (kernel, its tile keys' prefix; ``<prefix>_maxnreg``,
#: where present, its register cap)
_CHUNK_KERNELS = {1: (_eden_pass1_chunk_kernel, "c"), 2: (_eden_pass1_half_kernel, "h"),
                  3: (_eden_pass1_quarter_kernel, "u")}


def _config(device, config: Optional[dict]) -> dict:
    if config is None and device.type != "cpu":
        return CONFIG  # read-only use by the launchers: no per-call copy
    cfg = dict(CONFIG)
    if device.type == "cpu":
        # TRITON_INTERPRET=1: the interpreter runs tl.reduce combine functions (used by tl.flip) in Python,
        # ~10x slower; the permute/split butterfly gives the same bits (both are checked on the H200).
        cfg["rht_impl"] = 0
    cfg.update(config or {})
    return cfg


def _norm(hadamard: int) -> float:
    return 1.0 / hadamard ** 0.5 if hadamard else 1.0


@functools.lru_cache(maxsize=None)
def _pdl_device(index: int) -> bool:
    """Whether CUDA device ``index`` supports programmatic dependent launch (sm_90+)."""
    return torch.cuda.get_device_capability(index)[0] >= 9


def _use_pdl(cfg: dict, device) -> bool:
    return bool(cfg["pdl"]) and cfg["q_impl"] == 1 and device.type == "cuda" and _pdl_device(
        device.index if device.index is not None else torch.cuda.current_device())


def _launch_opts(device, maxnreg: int = 0):
    if device.type == "cpu":  # TRITON_INTERPRET=1: the interpreter ignores launch options
        return {}
    return {"enable_fp_fusion": False, **({"maxnreg": int(maxnreg)} if maxnreg else {})}


def prepare_signs(signs: Optional[torch.Tensor], hadamard: int, device) -> torch.Tensor:
    """The +-1 sign vector as a contiguous FP32 device tensor (random if ``signs`` is None; a cached
    placeholder when ``hadamard`` is 0)."""
    if not hadamard:
        return placeholder(device, torch.float32)
    if signs is None:
        from ..formats.hadamard import random_signs
        return random_signs(hadamard, device=device).contiguous()
    if signs.numel() != hadamard:
        raise ValueError(f"signs has {signs.numel()} entries, expected hadamard={hadamard}")
    return signs.to(device=device, dtype=torch.float32).reshape(-1).contiguous()


def _amax(x, R, K, srow, scol, hadamard, sg, cfg, tload=False, dependents=False):
    """max|x| (rotated under RHT) into a fresh FP32 device scalar; ``dependents``: the next launch is the
    PDL-launched quantize kernel, which this grid lets start at once (``CONFIG["pdl"]``)."""
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    if not hadamard and srow == 1 and scol != 1:
        # max|x.T| = max|x|: reduce x in its own (contiguous) orientation
        R, K, srow, scol, tload = K, R, scol, srow, False
    pre = "ah" if hadamard else "a"
    br, bc = cfg[pre + "_rows"], max(cfg[pre + "_cols"], hadamard or 16)
    launch(_amax_kernel, (cdiv(R, br), cdiv(K, bc)),
        x, srow, scol, R, K, sg, amax, HAD=hadamard, NORM=_norm(hadamard), RHT_IMPL=cfg["rht_impl"],
        TLOAD=tload, BR=br, BC=bc, HALVES=bool(cfg["a_impl"] == 2 or (hadamard and cfg["a_impl"])),
        num_warps=cfg[pre + "_warps"],
        PDL=dependents, **_launch_opts(x.device))
    return amax


def _transpose(x, cfg, want_amax: bool):
    """(x.T contiguous, max|x| as an FP32 device scalar or None) from one Triton pass over x."""
    M, N = x.shape
    xt = torch.empty((N, M), dtype=x.dtype, device=x.device)
    # the amax slot is zero-filled only when reduced into (a fill is one more launch); otherwise a placeholder
    am = torch.zeros((), dtype=torch.float32, device=x.device) if want_amax else placeholder(x.device, torch.float32)
    launch(_transpose_kernel, (cdiv(M, cfg["p_rows"]), cdiv(N, cfg["p_cols"])),
        x, xt, M, N, x.stride(0), x.stride(1), am, AMAX=bool(want_amax), BM=cfg["p_rows"], BN=cfg["p_cols"],
        num_warps=cfg["p_warps"])
    return xt, (am if want_amax else None)


def amax(x: torch.Tensor, hadamard: int = 0, signs: Optional[torch.Tensor] = None, transpose: bool = False,
         config: Optional[dict] = None) -> torch.Tensor:
    """max|x| (of the RHT-rotated tensor when ``hadamard``) as an FP32 device scalar: the first of the two
    passes of :func:`quantize`, exposed for timing and for delayed-amax schemes."""
    cfg = _config(x.device, config)
    if transpose and hadamard and cfg["t_impl"] == 2:
        x, transpose = _transpose(x, cfg, False)[0], False
    R, K = (x.shape[1], x.shape[0]) if transpose else (x.shape[0], x.shape[1])
    srow, scol = (x.stride(1), x.stride(0)) if transpose else (x.stride(0), x.stride(1))
    return _amax(x, R, K, srow, scol, hadamard, prepare_signs(signs, hadamard, x.device), cfg,
                 bool(transpose and cfg["t_impl"]))


def _check_input(x: torch.Tensor, what: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"{what} takes a 2D tensor, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{what} takes float32/float16/bfloat16, got {x.dtype}")


def _check_quantized(n: int, hadamard: int, what: str = "the quantized dimension") -> None:
    """A quantized dimension of ``n`` elements: whole 16-blocks, and whole RHT groups under ``hadamard``."""
    if n % 16:
        raise ValueError(f"{what} must be a multiple of 16, got {n}")
    if hadamard and (hadamard not in (16, 32, 64, 128) or n % hadamard):
        raise ValueError(f"hadamard={hadamard} must be 16/32/64/128 and divide {what} ({n})")


def _empty_copy(R: int, K: int, dev):
    """Uninitialized outputs of an [R, K] quantization: codes [R, K/2], scale bytes [R, K/16], global scale."""
    return (torch.empty((R, K // 2), dtype=torch.uint8, device=dev),
            torch.empty((R, K // 16), dtype=torch.uint8, device=dev), torch.empty((), dtype=torch.float32, device=dev))


def quantize(x: torch.Tensor, rounding: str = "rtn", four_over_six: bool = False, block2d: bool = False,
             hadamard: int = 0, signs: Optional[torch.Tensor] = None, seed: Optional[torch.Tensor] = None,
             transpose: bool = False, config: Optional[dict] = None, amax: Optional[torch.Tensor] = None,
             dq: bool = False):
    """Launch the NVFP4 quantize kernels on a 2D tensor (CUDA, or CPU under ``TRITON_INTERPRET=1``).

    Same contract as ``torch.ops.fp4compile.quantize``: returns (codes uint8 [R, C/2], scale bytes uint8
    [R, C/16], global decode scale fp32 0-dim) of ``x`` (or of ``x.T`` when ``transpose``). Unchecked for
    NaN/Inf. ``config`` overrides the tile sizes of :data:`CONFIG`.

    ``dq`` (``torch.ops.fp4compile.quantize_dq``): a fourth output, the copy's exact bf16 ``q * S`` [R, C] (the
    bytes of :func:`fp4compile.kernels.gemm.dequantize_bf16` of the codes and scales), a GEMM operand. RTN / SR
    (``q_impl`` 1) store it from the quantize kernel itself, which holds every code and scale already (2 bytes per
    element more written, no dequantize pass reading the codes back); MS-EDEN, whose scales are final only after
    pass 2, from pass 2 (:func:`_eden_pass2_dq_kernel`: the dequantize kernel's work in the launch that makes the
    scales).

    ``amax`` (RTN / SR only): optional FP32 0-dim device tensor used as the global amax instead of measuring
    max|x| (of the rotated tensor under RHT): one pass over x instead of two, e.g. for delayed scaling (the
    previous step's amax, as in Transformer Engine's FP8 recipe). The result equals the two-pass one only when
    ``amax`` is the true max; a smaller value saturates the top block scales at 448 (RTN codes saturate at 6;
    SR's no-saturation guarantee is lost). Not used by the op / the backend (their default measures amax).
    MS-EDEN reads x once anyway (its global scale is aligned after the block scales) and rejects ``amax``.
    """
    cfg = _config(x.device, config)
    _check_input(x, "quantize kernel")
    if rounding not in _ROUNDING_ID:
        raise ValueError(f"rounding must be one of {tuple(_ROUNDING_ID)}, got {rounding!r}")
    if rounding == "ms_eden" and four_over_six:
        raise ValueError("four_over_six is not defined for rounding='ms_eden'")
    if rounding == "ms_eden" and amax is not None:
        raise ValueError("rounding='ms_eden' takes no amax: its block scales come first and the global scale is "
                         "aligned to their max afterwards (formats.schemes)")
    R, K = (x.shape[1], x.shape[0]) if transpose else (x.shape[0], x.shape[1])
    _check_quantized(K, hadamard)
    if block2d and R % 16:
        raise ValueError(f"2D 16x16 blocks need both dimensions to be multiples of 16, got {R}x{K}")
    if transpose and cfg["t_impl"] == 2 and x.numel():  # one transposing copy, then the row-wise kernels
        x, a = _transpose(x, cfg, amax is None and not hadamard and rounding != "ms_eden")
        transpose = False
        amax = a if a is not None else amax
    srow, scol = (x.stride(1), x.stride(0)) if transpose else (x.stride(0), x.stride(1))
    dev = x.device
    sg = prepare_signs(signs, hadamard, dev)
    if rounding != "rtn":
        seed = draw_seed(device=dev) if seed is None else seed.to(device=dev, dtype=torch.int64)
    else:
        seed = placeholder(dev, torch.int64)
    codes, scales, gscale = _empty_copy(R, K, dev)
    out = torch.empty((R, K), dtype=torch.bfloat16, device=dev) if dq else None
    result = (codes, scales, gscale, out) if dq else (codes, scales, gscale)
    if R == 0 or K == 0:
        gscale.zero_()
        return result
    tload = bool(transpose and cfg["t_impl"])
    if rounding == "ms_eden":
        _quantize_eden(x, R, K, srow, scol, block2d, hadamard, sg, seed, tload, transpose, cfg, codes, scales,
                       gscale, dq=out)
        return result
    pdl = False
    if amax is None:
        pdl = _use_pdl(cfg, dev)  # only behind our own amax kernel (module docstring)
        amax = _amax(x, R, K, srow, scol, hadamard, sg, cfg, tload, dependents=pdl)
    else:
        if amax.numel() != 1:
            raise ValueError(f"amax must be a scalar tensor, got shape {tuple(amax.shape)}")
        amax = amax.to(device=dev, dtype=torch.float32).reshape(())
    norm = _norm(hadamard)
    m6, m4 = block_max_targets(rounding)
    pre = "t" if transpose else "r" if hadamard else "q" if rounding == "rtn" and not four_over_six else "s"
    opts = _launch_opts(dev, cfg["s_maxnreg"] if pre == "s" else 0)
    br, bc, warps = cfg[pre + "_rows"], max(cfg[pre + "_cols"], hadamard or 16), cfg[pre + "_warps"]
    if block2d:
        br = max(16, br // 16 * 16)
    args = dict(G=global_numerator(rounding, four_over_six), M6=m6, M4=m4 if m4 is not None else 4.0,
                ROUNDING=_ROUNDING_ID[rounding], FOUR_SIX=bool(four_over_six), BLOCK2D=bool(block2d),
                HAD=hadamard, NORM=norm, RHT_IMPL=cfg["rht_impl"], TLOAD=tload, BR=br, BC=bc, num_warps=warps,
                **opts)
    grid = (cdiv(R, br), cdiv(K, bc))
    if cfg["q_impl"] == 0:  # (the first kernel version has no dq store: a dequantize pass after it)
        _quantize_kernel_v0[grid](x, srow, scol, R, K, amax, seed, sg, codes, scales, gscale, **args)
        if dq:
            from .gemm import dequantize_bf16  # (at call time: ops.py's registration imports this module first)
            result = (codes, scales, gscale, dequantize_bf16(codes, scales))
        return result
    launch(_quantize_kernel, grid, x, srow, scol, R, K, amax, seed, sg, codes.view(torch.int32), scales,
           gscale, out if dq else placeholder(dev, torch.bfloat16), MAGIC_PACK=_MAGIC_PACK, PDL=pdl, DQ=dq,
           SR_RP=SR_RP and rounding == "sr", **args, **({"launch_pdl": True} if pdl else {}))
    return result


def quantize_both(x: torch.Tensor, hadamard: int = 0, signs: Optional[torch.Tensor] = None,
                  seed: Optional[torch.Tensor] = None, hadamard_t: int = 0, signs_t: Optional[torch.Tensor] = None,
                  seed_t: Optional[torch.Tensor] = None, config: Optional[dict] = None, dq: bool = False):
    """MS-EDEN quantizations of x [R, C] in both layouts: ``quantize(x, "ms_eden", hadamard=hadamard, signs=signs,
    seed=seed)`` and ``quantize(x, "ms_eden", hadamard=hadamard_t, signs=signs_t, seed=seed_t, transpose=True)``
    (the same bytes, ``torch.ops.fp4compile.quantize_both``), where the row-wise pass 1 also writes the [C, R]
    transpose that the second quantization reads (the transposing copy of ``quantize(..., transpose=True)`` is not
    a pass of its own). Returns the six tensors (codes, scales, global) row-wise then transposed; with ``dq``
    (``quantize_both_dq``) eight: each copy's (codes, scales, global, bf16 q * S), as ``quantize(..., dq=True)``."""
    cfg = _config(x.device, config)
    _check_input(x, "quantize_both")
    R, K = x.shape
    _check_quantized(K, hadamard, "the columns (the row-wise copy's quantized dimension)")
    _check_quantized(R, hadamard_t, "the rows (the transposed copy's quantized dimension)")
    dev = x.device
    sg = prepare_signs(signs, hadamard, dev)
    seed = draw_seed(device=dev) if seed is None else seed.to(device=dev, dtype=torch.int64)
    codes, scales, gscale = _empty_copy(R, K, dev)
    out = (torch.empty((R, K), dtype=torch.bfloat16, device=dev),) if dq else ()
    xt = torch.empty((K, R), dtype=x.dtype, device=dev)
    if x.numel() == 0:
        gscale.zero_()
    else:
        _quantize_eden(x, R, K, x.stride(0), x.stride(1), False, hadamard, sg, seed, False, False, cfg, codes,
                       scales, gscale, xt=xt, dq=out[0] if dq else None)
    return (codes, scales, gscale) + out + quantize(xt, "ms_eden", hadamard=hadamard_t, signs=signs_t,
                                                    seed=seed_t, config=config, dq=dq)


def _quantize_eden(x, R, K, srow, scol, block2d, hadamard, sg, seed, tload, transpose, cfg, codes, scales,
                   gscale, xt=None, dq=None):
    """MS-EDEN: pass 1 over x (codes + FP32 block scales S' in a [R, K/16] scratch + max S'), pass 2 over the
    scratch only (E4M3 scales + global decode scale); see ``formats.schemes`` for the arithmetic. ``xt``: a
    contiguous [K, R] tensor that pass 1 also fills with x transposed (the block-per-thread pass 1 then). ``dq``:
    a [R, K] bf16 tensor that pass 2 fills with the copy's q * S (:func:`_eden_pass2_dq_kernel`, tiles ``g_*``)."""
    dev = x.device
    scratch = torch.empty((R, K // 16), dtype=torch.float32, device=dev)
    smax = torch.zeros((), dtype=torch.float32, device=dev)
    pre = "t" if transpose else "e"
    br, bc, warps = cfg[pre + "_rows"], max(cfg[pre + "_cols"], hadamard or 16), cfg[pre + "_warps"]
    if block2d:
        br = max(16, br // 16 * 16)
    opts = _launch_opts(dev)
    chunked = cfg["e_impl"] in _CHUNK_KERNELS and hadamard == 128 and not block2d and not transpose
    if chunked and scol == 1 and xt is None:
        kernel, pre = _CHUNK_KERNELS[cfg["e_impl"]]
        br, bc = cfg[pre + "_rows"], cfg[pre + "_cols"]
        launch(kernel, (cdiv(R, br), cdiv(K, bc)),
            x, srow, R, K, sg, codes.view(torch.int32), scratch, smax, VAL_MAX=EDEN_VAL_MAX,
            INV_VAL_MAX=EDEN_INV_VAL_MAX, NORM=_norm(hadamard), BR=br, BC=bc, MAGIC_PACK=_MAGIC_PACK,
            num_warps=cfg[pre + "_warps"], **_launch_opts(dev, cfg.get(pre + "_maxnreg", 0)))
    else:
        launch(_eden_pass1_kernel, (cdiv(R, br), cdiv(K, bc)),
            x, srow, scol, R, K, sg, codes.view(torch.int32), scratch, smax,
            xt if xt is not None else placeholder(dev, x.dtype), VAL_MAX=EDEN_VAL_MAX,
            INV_VAL_MAX=EDEN_INV_VAL_MAX, BLOCK2D=bool(block2d), HAD=hadamard, NORM=_norm(hadamard),
            RHT_IMPL=cfg["rht_impl"], TLOAD=tload, BR=br, BC=bc, MAGIC_PACK=_MAGIC_PACK, TSTORE=xt is not None,
            num_warps=warps, **_launch_opts(dev, cfg["e_maxnreg"]))
    nbk = K // 16
    if dq is not None:
        br, bc = cfg["g_rows"], cfg["g_cols"]
        launch(_eden_pass2_dq_kernel, (cdiv(R, br), cdiv(K, bc)),
            scratch, smax, seed, scales, gscale, codes, dq, R, nbk, BLOCK2D=bool(block2d), BR=br, BC=bc,
            DEQUANT_ASM=dev.type == "cuda" and DEFAULT_DEQUANT == "asm", num_warps=cfg["g_warps"], **opts)
        return
    launch(_eden_pass2_kernel, (cdiv(R * nbk, cfg["f_block"]),),
        scratch, smax, seed, scales, gscale, R * nbk, nbk, BLOCK2D=bool(block2d), BLOCK=cfg["f_block"],
        WIDE=R * nbk + cfg["f_block"] >= 2 ** 31, num_warps=cfg["f_warps"], **opts)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor, hadamard: int = 0,
               signs: Optional[torch.Tensor] = None, dtype: torch.dtype = torch.bfloat16,
               config: Optional[dict] = None, transpose: bool = False) -> torch.Tensor:
    """Launch the NVFP4 dequantize kernel: [R, C/2] codes + [R, C/16] scale bytes -> [R, C] in ``dtype``, or
    with ``transpose`` the same values as a contiguous [C, R] tensor (tiles ``dt_*`` of :data:`CONFIG`)."""
    cfg = _config(codes.device, config)
    R, K = codes.shape[0], codes.shape[1] * 2
    if hadamard and signs is None:
        raise ValueError("dequantize with hadamard needs the signs used to quantize")
    if codes.dim() != 2 or tuple(scales.shape) != (R, K // 16):
        raise ValueError(f"dequantize expects codes [R, C/2] and scales [R, C/16], got {tuple(codes.shape)} "
                         f"and {tuple(scales.shape)}")
    dev = codes.device
    sg = prepare_signs(signs, hadamard, dev)
    out = torch.empty((K, R) if transpose else (R, K), dtype=dtype, device=dev)
    if out.numel() == 0:
        return out
    pre = "dt" if transpose else "d"
    br, bc = cfg[pre + "_rows"], max(cfg[pre + "_cols"], hadamard or 16)
    launch(_dequantize_kernel, (cdiv(R, br), cdiv(K, bc)),
        codes.contiguous(), scales.contiguous(), global_scale.to(torch.float32), sg, out, R, K,
        HAD=hadamard, NORM=_norm(hadamard), RHT_IMPL=cfg["rht_impl"], OUT_BF16=dtype == torch.bfloat16,
        BR=br, BC=bc, TRANS=bool(transpose), RNE_BITS=dev.type == "cpu", num_warps=cfg[pre + "_warps"],
        **_launch_opts(dev))
    return out


# ---------------------------------------------------------------------------------------------- registration
def _check_amax(amax, rounding, hadamard):
    from ..ops import check_amax  # (imported here: ops imports the kernels at load, and attention imports us)

    check_amax(amax, rounding, hadamard)


def _quantize_cuda(x, rounding="rtn", four_over_six=False, block2d=False, hadamard=0, signs=None, seed=None,
                   transpose=False, amax=None):
    _check_amax(amax, rounding, hadamard)
    return quantize(x, rounding, four_over_six, block2d, hadamard, signs, seed, transpose, amax=amax)


def _quantize_dq_cuda(x, rounding="rtn", four_over_six=False, block2d=False, hadamard=0, signs=None, seed=None,
                      transpose=False, amax=None):
    _check_amax(amax, rounding, hadamard)
    return quantize(x, rounding, four_over_six, block2d, hadamard, signs, seed, transpose, amax=amax, dq=True)


def _dequantize_cuda(codes, scales, global_scale, hadamard=0, signs=None, dtype=torch.bfloat16, transpose=False):
    return dequantize(codes, scales, global_scale, hadamard, signs, dtype, transpose=transpose)


def _quantize_both_cuda(x, hadamard=0, signs=None, seed=None, hadamard_t=0, signs_t=None, seed_t=None):
    return quantize_both(x, hadamard, signs, seed, hadamard_t, signs_t, seed_t)


def _quantize_both_dq_cuda(x, hadamard=0, signs=None, seed=None, hadamard_t=0, signs_t=None, seed_t=None):
    return quantize_both(x, hadamard, signs, seed, hadamard_t, signs_t, seed_t, dq=True)


def _register():
    from .. import ops  # noqa: F401  (defines the ops; idempotent)

    ops.register_cuda("quantize", _quantize_cuda)
    ops.register_cuda("quantize_dq", _quantize_dq_cuda)
    ops.register_cuda("dequantize", _dequantize_cuda)
    ops.register_cuda("quantize_both", _quantize_both_cuda)
    ops.register_cuda("quantize_both_dq", _quantize_both_dq_cuda)


_register()


stable_cache_keys(globals())  # Triton cache keys independent of launch order (kernels/launch.py)
