"""Counter-based random bits shared bit-for-bit by the torch reference and the Triton kernels.

Stochastic rounding (SR of elements, SR of MS-EDEN scales) needs random numbers that the CPU reference and
the GPU kernel can reproduce *exactly*, so that both encoders produce the same bytes for the same seed. A
counter-based hash does this without any RNG state: the random word for element (or block) ``index`` is a
pure function of ``(seed, index)``.

    k0        = lowbias32(seed_lo ^ 0x9E3779B9)
    k1        = lowbias32(seed_hi ^ k0)
    bits(i)   = lowbias32(lowbias32((i mod 2^32) ^ k0) ^ k1)            (uint32)
    uniform(i)= (bits(i) >> 8) * 2^-24                                    (float32 in [0, 1), exact)

``lowbias32`` is Chris Wellons' 32-bit integer finalizer (x ^= x>>16; x *= 0x7feb352d; x ^= x>>15;
x *= 0x846ca68b; x ^= x>>16), a bijection on uint32 with good avalanche. ``seed`` is an int64; its two
32-bit halves key the stream. Indices are taken modulo 2^32 (streams repeat only for tensors of more than
4 Gi elements or blocks).

For a fixed seed, ``bits`` is a bijection of the index (mod 2^32): each 32-bit word occurs exactly once. The
index that gets the word 0 (u = 0, so an SR draw always rounds up there) is ``seed_hi`` itself, because
``lowbias32(i ^ k0) == k1`` exactly when ``i == seed_hi``. With the random 64-bit seeds the ops draw
(``draw_seed``), that index is uniform and the marginal law of every u is unchanged; a fixed seed with
``seed_hi = 0`` (small test seeds) pins it at element 0, which statistical tests must not rely on.

torch has no uint32 arithmetic, so the torch version works on int64 tensors holding values in [0, 2^32)
and splits every multiply into 16-bit halves so no intermediate exceeds 2^49 (no int64 overflow).
The Triton version (``fp4compile/kernels/quantize.py::_uniform``) uses native uint32 wrap-around.
"""
from __future__ import annotations

from typing import Optional

import torch

MASK32 = 0xFFFFFFFF
M1 = 0x7FEB352D
M2 = 0x846CA68B
GOLDEN = 0x9E3779B9


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2^32 for int64 ``a`` in [0, 2^32) and a constant ``c`` < 2^32, without overflow."""
    c_lo, c_hi = c & 0xFFFF, c >> 16
    return (a * c_lo + (((a & 0xFFFF) * c_hi) << 16)) & MASK32


def lowbias32(x: torch.Tensor) -> torch.Tensor:
    """Wellons' lowbias32 finalizer on int64 tensors holding uint32 values."""
    x = x ^ (x >> 16)
    x = _mul32(x, M1)
    x = x ^ (x >> 15)
    x = _mul32(x, M2)
    return x ^ (x >> 16)


def seed_keys(seed: torch.Tensor):
    """(k0, k1) int64 0-dim tensors keying the stream of an int64 ``seed``."""
    s = seed.to(torch.int64)
    lo = s & MASK32
    hi = (s >> 32) & MASK32
    k0 = lowbias32(lo ^ GOLDEN)
    k1 = lowbias32(hi ^ k0)
    return k0, k1


def random_bits(seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """uint32 random words (as int64 in [0, 2^32)) for each entry of the integer tensor ``index``."""
    k0, k1 = seed_keys(seed.to(index.device))
    i = index.to(torch.int64) & MASK32
    return lowbias32(lowbias32(i ^ k0) ^ k1)


def uniform(seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in [0, 1) on the 2^-24 grid, one per entry of ``index``."""
    return (random_bits(seed, index) >> 8).to(torch.float32) * (2.0 ** -24)


def draw_seed(generator: Optional[torch.Generator] = None, device=None, shape=()) -> torch.Tensor:
    """A fresh int64 seed tensor drawn from ``generator`` (or torch's default generator on ``device``): 0-dim, or
    ``shape`` independent seeds in one launch (``passes/seeds.py``'s pool).

    The seed stays on the generator's device: drawing it costs no host synchronization.
    """
    dev = generator.device if generator is not None else (torch.device(device) if device is not None else None)
    return torch.randint(-(2 ** 62), 2 ** 62, tuple(shape), generator=generator, device=dev, dtype=torch.int64)
