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
``ms_eden``  Quartet II's MS-EDEN (notes §10), per 1x16 block (16x16 tile for 2D blocks):
             val_max = 6/((17/16)*0.93), G = 256*val_max, M = val_max; RTN elements q = e2m1_rne_sat(v);
             EDEN correction c = sum(v^2) / sum(v*q)  (FP32 sums, fixed tree; c = 1 if the denominator is 0);
             S' = min(S_b * c, 448) (FP32) stochastically rounded to one of its neighbouring E4M3 codes
             (u = uniform(seed, flat block index); for 2D tiles the index of the tile's top-row block), so
             E[S_stored] = S'. Unbiased over the random rotation (pass ``hadamard``); the caller's ``hadamard``
             argument applies the RHT (signs first). 4/6 is not defined for MS-EDEN (raises).

Known limits: blocks whose scale underflows E4M3 (amax_b < ~2^-10 * amax / 448 of the global range) encode
as zeros in every scheme, so SR/MS-EDEN are unbiased only above that floor.
"""
from __future__ import annotations

from typing import Optional

import torch

from .hadamard import random_signs, rht
from .nvfp4 import (AMAX_FLUSH, E4M3_MAX, NVFP4Tensor, _block_amax, _tile_sum, e2m1_decode, e2m1_rne_codes, e4m3_rne,
                    pack_nibbles, quantize_rtn_, tree_sum)
from .random import draw_seed, uniform

SR_HEADROOM = 16.0 / 17.0
EDEN_VAL_MAX = 6.0 / ((17.0 / 16.0) * 0.93)
EDEN_SCALE_CEIL = 256.0


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


def _quantize_eden(x2: torch.Tensor, block2d: bool, seed: torch.Tensor):
    R, K = x2.shape
    nb = K // 16
    amax = x2.abs().amax().to(torch.float32)
    s_enc, gscale = _global(amax, global_numerator("ms_eden", False))
    amax_b = _block_amax(x2, block2d)
    xb = x2.unflatten(-1, (nb, 16))
    stored, enc = _scale_and_enc(amax_b, EDEN_VAL_MAX, s_enc, gscale)
    v = xb * enc.unsqueeze(-1)
    q = e2m1_rne_codes(v)
    num = tree_sum(v * v)  # FP32, fixed order: |v| <= ~6.4, so no range issue
    den = tree_sum(v * e2m1_decode(q))
    if block2d:
        num, den = _tile_sum(num), _tile_sum(den)
    c = torch.where(den == 0, torch.ones_like(num), num / torch.where(den == 0, torch.ones_like(den), den))
    s_corr = torch.clamp(stored.to(torch.float32) * c, max=E4M3_MAX)
    lo, hi = e4m3_neighbours(s_corr)
    p = torch.where(hi > lo, (s_corr - lo) / torch.where(hi > lo, hi - lo, torch.ones_like(hi)), torch.zeros_like(lo))
    rows = torch.arange(R, device=x2.device, dtype=torch.int64)
    if block2d:
        rows = rows - rows % 16
    bidx = rows[:, None] * nb + torch.arange(nb, device=x2.device, dtype=torch.int64)[None, :]
    u = uniform(seed, bidx)
    final = torch.where(u < p, hi, lo).to(torch.float8_e4m3fn)
    q = torch.where(amax < AMAX_FLUSH, torch.zeros_like(q), q)
    return pack_nibbles(q.flatten(-2)), final, gscale


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
    if hadamard is not None:
        if signs is None:
            signs = random_signs(hadamard, generator, device=x.device)
        elif signs.numel() != hadamard:
            raise ValueError(f"signs has {signs.numel()} entries, expected {hadamard}")
        signs = signs.to(device=x.device, dtype=torch.float32)
        x32 = rht(x32, signs)
    block2d = block == (16, 16)
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
                codes, scales, g = _quantize_eden(x2, block2d, seed)
            else:
                raise ValueError(f"unknown rounding {rounding!r}")
            codes = codes.reshape(*shape[:-1], K // 2)
            scales = scales.reshape(*shape[:-1], K // 16)
    return NVFP4Tensor(codes=codes, scales=scales, global_scale=g, shape=shape, block=block,
                       rounding=rounding, four_over_six=four_over_six, hadamard=hadamard,
                       signs=signs if hadamard is not None else None)
