"""Rounding schemes of the NVFP4 reference: RTN (+4/6), SR (+4/6), MS-EDEN. FP32 math, any device.

Every scheme is the two-level scaling of ``nvfp4.py`` with its own constants; all arithmetic is FP32 in the
order written here (statistics that are *sums* use FP32 and the fixed pairwise order of
:func:`~fp4compile.formats.nvfp4.tree_sum`), and all randomness comes from the counter-based hash of
:mod:`fp4compile.formats.random`, so the Triton kernels reproduce every byte.

Notation: ``amax`` = max|x| over the tensor (after the rotation, if any), ``amax_b`` = max|x| over a block
(1x16, or the 16x16 tile), ``G`` = the global numerator, ``M`` = the value the block max is mapped to.

    s_enc    = G / amax           global = 1 / s_enc       (amax = 0: s_enc = 1, global = 0)
    S_b      = e4m3_rne(min(amax_b / M * s_enc, 448))
    enc_b    = 1 / (S_b * global)                          (S_b = 0: enc_b = 0, the block encodes as zeros)
    v        = x * enc_b

``rtn``      G = 6*448 (4/6: 6*256), M = 6 (4/6 candidate: 4); codes = e2m1_rne_sat(v).
             4/6 picks per block the candidate with the lower sum of (x*s_enc - q*S_b)^2 (FP32, fixed tree:
             the squared error in units of the global decode scale; the 4-candidate only if strictly lower).
``sr``       G = 6*448*16/17 (4/6: 6*256*16/17), M = 6*16/17 (4/6 candidate: 4*16/17).
             The 16/17 headroom: RNE of the scale can shrink it by up to 16/17, so |v| <= 6 always and SR never
             saturates (notes §8). The global numerator carries the same factor so the top block's scale
             lands on 448 instead of 476 and is not clamped (a clamped scale would let |v| exceed 6 again).
             codes = SR(v): between grid neighbours lo <= |v| <= hi, round up iff u < (|v| - lo)/(hi - lo),
             u = uniform(seed, flat element index). E[decode] = x exactly (up to the 2^-24 grid of u).
             4/6 picks per block the candidate with the lower *expected* SR error sum (|v|-lo)(hi-|v|)*S_b^2
             (FP32, fixed tree; in units of global^2, the factor both candidates share), a deterministic
             function of x, so the choice does not bias the result.
``ms_eden``  Quartet II's MS-EDEN in its CUDA form, "post hoc range alignment" (notes §10): the block scales are
             computed first, from each block alone, and the FP32 global scale is fixed afterwards from their max.
             That needs no global amax before the blocks, so a kernel reads x once (pass 1 over x, pass 2 over
             the per-block scales only). val_max = 6/((17/16)*0.93) (FP32), INV_VAL_MAX = fp32(1/val_max),
             per 1x16 block (16x16 tile for 2D blocks; tile statistics are the fixed-tree sums of its rows'):
               z      = fwht(x * signs)  (the *unnormalized* butterfly; z = x without ``hadamard``)
               a_z    = max|z| over the block;  a_y = a_z * fp32(1/sqrt(d))  (= the block max of the normalized
                        rotation rht(x): rounding is monotone; a_y = a_z without ``hadamard``)
               live   = a_y >= AMAX_FLUSH  (else the block encodes as zeros: codes 0, S' = 0)
               enc    = val_max / a_z    (live: a_z >= a_y >= 2^-100, so enc is finite and normal)
               a      = |z| * enc        (<= val_max * (1 + 2^-22) < 7: the E2M1 map never needs saturation)
               q      = e2m1_rne(a), sign bit of z   (the code of the block max is 6)
               c      = sum(a^2) / sum(a * |q|)      (FP32 sums, fixed tree; the denominator >= 36 when live)
               S'     = c * (a_y * INV_VAL_MAX)      (the EDEN-corrected scale in units of the normalized
                        rotation: the 1/sqrt(d) is folded into this per-block product, not into every element)
             then over the tensor:
               M      = max S'; global = M * 2^-8 (exact; 0 if M = 0); r = S' / global (<= 256, = 256 at the max)
               stored = r stochastically rounded to one of its neighbouring E4M3 codes lo <= r <= hi:
                        hi iff u < (r - lo)/(hi - lo), u = uniform(seed, flat block index) (2D tiles: the index of
                        the tile's top-row block), so E[stored * global] = S' (r is an E4M3 value: stored = r).
             Decode q * stored * global = q * S' in expectation over the scale draw; over the random rotation the
             EDEN factor c makes the estimator unbiased (pass ``hadamard`` with fresh signs). The E4M3 scale may
             land in the subnormal range (r < 2^-6) or round to 0: SR between 0 and 2^-9 is still unbiased, so
             unlike RTN/SR there is no relative floor, only the absolute block floor AMAX_FLUSH. A tensor whose
             (rotated) amax is below AMAX_FLUSH has no live block and encodes as all zeros (global 0). Nothing
             divides by a subnormal: a_z >= 2^-100, the denominator of c >= 36, global >= 2^-112 when M > 0.
             Inputs whose unnormalized rotation overflows FP32 (|x| > ~FLT_MAX/d) are out of range (as in rht).
             A NaN or Inf element makes its block's S' NaN, and with it M and the global: every decoded value is
             NaN (see "Non-finite inputs" below).
             4/6 is not defined for MS-EDEN (raises).

Non-finite inputs (the ops and kernels; ``nvfp4.quantize`` itself refuses them): a tensor with a NaN or an Inf
quantizes to a copy whose global decode scale is non-finite (RTN / SR: NaN for a NaN, Inf for an Inf, from the
amax; MS-EDEN: NaN), so that every value it decodes to, and every GEMM output through it, is NaN or Inf, as a
diverging BF16 run would show it, never finite values or zeros. Its codes and E4M3 scales are unspecified.
Q-Attn's in-register dS (and P) quantizations keep a NaN element NaN (their tile scales may drop it), so its
gradients have NaN where the all-BF16 kernels have it.

Known limits: RTN/SR blocks whose scale underflows E4M3 (amax_b < ~2^-10 * amax / 448 of the global range) encode
as zeros, so SR is unbiased only above that floor (MS-EDEN: see above).
"""
from __future__ import annotations

from typing import Optional

import torch

from .hadamard import fwht, random_signs, rht
from .nvfp4 import (AMAX_FLUSH, E4M3_MAX, NVFP4Tensor, _block_amax, _tile_sum, e2m1_decode, e2m1_rne_codes, e4m3_rne,
                    pack_nibbles, quantize_rtn_, tree_sum)
from .random import draw_seed, uniform

SR_HEADROOM = 16.0 / 17.0
EDEN_VAL_MAX = 6.0 / ((17.0 / 16.0) * 0.93)
EDEN_SCALE_CEIL = 256.0
#: fp32(1 / val_max), the per-block factor of MS-EDEN's scale (a Python float holding the FP32 value)
EDEN_INV_VAL_MAX = float(torch.tensor(1.0 / EDEN_VAL_MAX, dtype=torch.float32))


def global_numerator(rounding: str, four_over_six: bool) -> float:
    """G of s_enc = G / amax for each scheme (a Python float; the kernels use the same value as FP32)."""
    if rounding == "rtn":
        return 6.0 * (256.0 if four_over_six else E4M3_MAX)
    if rounding == "sr":
        return 6.0 * (256.0 if four_over_six else E4M3_MAX) * SR_HEADROOM
    if rounding == "ms_eden":
        return EDEN_SCALE_CEIL * EDEN_VAL_MAX
    raise ValueError(f"unknown rounding {rounding!r}")


def block_max_targets(rounding: str):
    """(M for the 6-candidate, M for the 4-candidate) of each scheme."""
    if rounding == "rtn":
        return 6.0, 4.0
    if rounding == "sr":
        return 6.0 * SR_HEADROOM, 4.0 * SR_HEADROOM
    return EDEN_VAL_MAX, None


def _f32(v: float, device) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32, device=device)


def _global(amax: torch.Tensor, numerator: float):
    zero = amax < AMAX_FLUSH
    s_enc = torch.where(zero, torch.ones_like(amax), _f32(numerator, amax.device) / amax)
    gscale = torch.where(zero, torch.zeros_like(amax), 1.0 / s_enc)
    return s_enc, gscale


def _scale_and_enc(amax_b, max_code: float, s_enc, gscale):
    stored = e4m3_rne(torch.clamp(amax_b / _f32(max_code, amax_b.device) * s_enc, max=E4M3_MAX))
    sf = stored.to(torch.float32)
    enc = 1.0 / (sf * gscale)
    enc = torch.where(sf == 0, torch.zeros_like(enc), enc)
    return stored, enc


# ---------------------------------------------------------------------------------------------- SR
_LO = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _sr_floor(v: torch.Tensor):
    """(|v| clamped to 6, lower grid code c in 0..7, its value lo, the step to the next code)."""
    a = torch.clamp(v.abs(), max=6.0)
    c = ((a >= 0.5).to(torch.uint8) + (a >= 1.0).to(torch.uint8) + (a >= 1.5).to(torch.uint8)
         + (a >= 2.0).to(torch.uint8) + (a >= 3.0).to(torch.uint8) + (a >= 4.0).to(torch.uint8)
         + (a >= 6.0).to(torch.uint8))
    lo = torch.tensor(_LO, dtype=torch.float32, device=v.device)[c.long()]
    step = torch.where(c < 4, 0.5, torch.where(c < 6, 1.0, 2.0)).to(torch.float32)
    return a, c, lo, step


def sr_codes(v: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Unbiased stochastic rounding of FP32 ``v`` (|v| <= 6) to E2M1 codes with uniforms ``u`` in [0, 1)."""
    a, c, lo, step = _sr_floor(v)
    p = (a - lo) / step                       # exact: a - lo is exact (Sterbenz) and step a power of two
    mag = c + (u < p).to(torch.uint8)
    return mag | (torch.signbit(v).to(torch.uint8) << 3)


def _sr_expected_sse(v: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """Expected SR squared error per block in units of global^2: sum (|v|-lo)(hi-|v|) * S_b^2, FP32, fixed
    order (the common factor global^2 of both 4/6 candidates is left out: no FP32 overflow/underflow)."""
    a, _, lo, step = _sr_floor(v)
    var = (a - lo) * (lo + step - a)
    return tree_sum(var) * (sf * sf)


def _quantize_sr(x2: torch.Tensor, block2d: bool, four_over_six: bool, seed: torch.Tensor):
    R, K = x2.shape
    amax = x2.abs().amax().to(torch.float32)
    s_enc, gscale = _global(amax, global_numerator("sr", four_over_six))
    amax_b = _block_amax(x2, block2d)
    xb = x2.unflatten(-1, (K // 16, 16))
    m6, m4 = block_max_targets("sr")
    stored, enc = _scale_and_enc(amax_b, m6, s_enc, gscale)
    if four_over_six:
        stored4, enc4 = _scale_and_enc(amax_b, m4, s_enc, gscale)
        e6 = _sr_expected_sse(xb * enc.unsqueeze(-1), stored.to(torch.float32))
        e4 = _sr_expected_sse(xb * enc4.unsqueeze(-1), stored4.to(torch.float32))
        if block2d:
            e6, e4 = _tile_sum(e6), _tile_sum(e4)
        pick4 = e4 < e6
        stored = torch.where(pick4, stored4.to(torch.float32), stored.to(torch.float32)).to(torch.float8_e4m3fn)
        enc = torch.where(pick4, enc4, enc)
    idx = torch.arange(R * K, device=x2.device, dtype=torch.int64).view(R, K // 16, 16)
    u = uniform(seed, idx)
    q = sr_codes(xb * enc.unsqueeze(-1), u)
    q = torch.where(amax < AMAX_FLUSH, torch.zeros_like(q), q)
    return pack_nibbles(q.flatten(-2)), stored, gscale


# ---------------------------------------------------------------------------------------------- MS-EDEN
def e4m3_neighbours(s: torch.Tensor):
    """For FP32 ``s`` in [0, 448]: the E4M3 values (lo, hi) with lo <= s <= hi adjacent (hi = lo if s is one)."""
    r = e4m3_rne(s)
    rf = r.to(torch.float32)
    codes = r.view(torch.uint8)
    below = rf > s
    lo_code = torch.where(below, codes - 1, codes)
    lo = lo_code.view(torch.float8_e4m3fn).to(torch.float32)
    exact = lo == s
    hi = torch.where(exact, lo, (lo_code + 1).view(torch.float8_e4m3fn).to(torch.float32))
    return lo, hi


def eden_block_scales(x2: torch.Tensor, block2d: bool, signs: Optional[torch.Tensor]):
    """Pass 1 of MS-EDEN (module docstring): per block the RTN codes against the block's own scale and the
    EDEN-corrected FP32 scale S' (in units of the normalized rotation). Returns (codes uint8 [R, K/16, 16]
    with the sign in bit 3, S' FP32 [R, K/16]; for 2D tiles S' is replicated over the tile's 16 rows)."""
    R, K = x2.shape
    nb = K // 16
    dev = x2.device
    if signs is not None:
        d = signs.numel()
        z = fwht(x2.unflatten(-1, (K // d, d)) * signs.to(dev, torch.float32)).flatten(-2)
        a_z = _block_amax(z, block2d)
        a_y = a_z * _f32(1.0 / d ** 0.5, dev)
    else:
        z = x2
        a_z = a_y = _block_amax(z, block2d)
    live = a_y >= AMAX_FLUSH
    enc = torch.where(live, _f32(EDEN_VAL_MAX, dev) / torch.where(live, a_z, torch.ones_like(a_z)),
                      torch.zeros_like(a_z))
    zb = z.unflatten(-1, (nb, 16))
    a = zb.abs() * enc.unsqueeze(-1)
    q = e2m1_rne_codes(a)                           # a >= 0: magnitude codes
    num = tree_sum(a * a)
    den = tree_sum(a * e2m1_decode(q))
    if block2d:
        num, den = _tile_sum(num), _tile_sum(den)
    c = torch.where(live, num / torch.where(live, den, torch.ones_like(den)), torch.zeros_like(num))
    s_corr = c * (a_y * _f32(EDEN_INV_VAL_MAX, dev))
    q = torch.where(live.unsqueeze(-1), q | (torch.signbit(zb).to(torch.uint8) << 3), torch.zeros_like(q))
    return q, s_corr


def eden_align_scales(s_corr: torch.Tensor, block2d: bool, seed: torch.Tensor):
    """Pass 2 of MS-EDEN: the global decode scale max(S') / 256 and the E4M3 scales, S' / global stochastically
    rounded between E4M3 neighbours (module docstring). Returns (scales float8_e4m3fn [R, K/16], global FP32)."""
    R, nb = s_corr.shape
    dev = s_corr.device
    # a non-finite input leaves a NaN S' (a NaN block's 0 * NaN, an Inf element's 0 * Inf), so M and the global are
    # NaN and the copy decodes to NaN (never to the other blocks' finite values, or to zeros)
    m = s_corr.max()
    live = m > 0
    gscale = torch.where(m == 0, torch.zeros_like(m), m * _f32(2.0 ** -8, dev))
    r = s_corr / torch.where(live, gscale, torch.ones_like(gscale))   # all S' are 0 when M is 0
    lo, hi = e4m3_neighbours(r)
    p = torch.where(hi > lo, (r - lo) / torch.where(hi > lo, hi - lo, torch.ones_like(hi)), torch.zeros_like(lo))
    rows = torch.arange(R, device=dev, dtype=torch.int64)
    if block2d:
        rows = rows - rows % 16
    bidx = rows[:, None] * nb + torch.arange(nb, device=dev, dtype=torch.int64)[None, :]
    u = uniform(seed, bidx)
    return torch.where(u < p, hi, lo).to(torch.float8_e4m3fn), gscale


def _quantize_eden(x2: torch.Tensor, block2d: bool, seed: torch.Tensor, signs: Optional[torch.Tensor]):
    q, s_corr = eden_block_scales(x2, block2d, signs)
    scales, gscale = eden_align_scales(s_corr, block2d, seed)
    return pack_nibbles(q.flatten(-2)), scales, gscale


# ---------------------------------------------------------------------------------------------- entry
def quantize_fp32(x: torch.Tensor, *, rounding: str, block, four_over_six: bool, hadamard: Optional[int],
                  generator: Optional[torch.Generator], signs: Optional[torch.Tensor],
                  seed: Optional[torch.Tensor] = None) -> NVFP4Tensor:
    """The reference encoder behind :func:`fp4compile.formats.nvfp4.quantize` and the ops' CPU path.

    Random draws from ``generator`` in this order: the RHT signs (if ``hadamard`` and no ``signs``), then the
    int64 seed of the stochastic rounding (if ``rounding`` != "rtn" and no ``seed``).
    """
    shape = x.shape
    x32 = x.to(torch.float32)
    block2d = block == (16, 16)
    if hadamard is not None:
        if signs is None:
            signs = random_signs(hadamard, generator, device=x.device)
        elif signs.numel() != hadamard:
            raise ValueError(f"signs has {signs.numel()} entries, expected {hadamard}")
        signs = signs.to(device=x.device, dtype=torch.float32)
        if rounding != "ms_eden" or x32.numel() == 0:  # MS-EDEN rotates inside (unnormalized, see above)
            x32 = rht(x32, signs)
    if rounding == "rtn":
        codes, scales, g = quantize_rtn_(x32, block2d, four_over_six)
    else:
        if rounding == "ms_eden" and four_over_six:
            raise ValueError("four_over_six is not defined for rounding='ms_eden' (its scale is already "
                             "EDEN-corrected and stochastically rounded); use rtn or sr")
        if seed is None:
            seed = draw_seed(generator, device=x.device)
        seed = seed.to(x.device)
        K = shape[-1]
        x2 = x32.reshape(-1, K)
        if x2.numel() == 0:
            codes, scales, g = quantize_rtn_(x32, block2d, False)
        else:
            if rounding == "sr":
                codes, scales, g = _quantize_sr(x2, block2d, four_over_six, seed)
            elif rounding == "ms_eden":
                codes, scales, g = _quantize_eden(x2, block2d, seed, signs if hadamard is not None else None)
            else:
                raise ValueError(f"unknown rounding {rounding!r}")
            codes = codes.reshape(*shape[:-1], K // 2)
            scales = scales.reshape(*shape[:-1], K // 16)
    return NVFP4Tensor(codes=codes, scales=scales, global_scale=g, shape=shape, block=block,
                       rounding=rounding, four_over_six=four_over_six, hadamard=hadamard,
                       signs=signs if hadamard is not None else None)
