"""NVFP4: E2M1 elements, E4M3 block scales (1x16 or 16x16), an FP32 per-tensor decode scale.

This is the *reference* implementation: pure torch, any device, written for clarity and for exact
agreement with the Triton kernels in ``fp4compile/kernels/quantize.py`` (they must match it bit for bit).

Semantics (all arithmetic in FP32, in exactly this order; NVIDIA's two-level scaling):

    amax        = max |x|
    s_enc       = G / amax                      G = 6*448 = 2688 (RTN), 6*256 (4/6), see ``_global_numerator``
    global      = 1 / s_enc                     the decode scale stored in ``NVFP4Tensor.global_scale``
    stored_b    = e4m3_rne(min(amax_b / 6 * s_enc, 448))
    codes       = e2m1_rne_sat(x * (1 / (stored_b * global)))

A block whose stored scale is 0 encodes as zeros; an all-zero tensor gives zero codes, zero scales and a
zero global scale and dequantizes to zeros. So does a tensor whose amax is below ``AMAX_FLUSH`` = 2^-100
(about 7.9e-31): for such an amax ``s_enc = G / amax`` approaches or overflows FP32's range (inf for
amax < G / FLT_MAX), and its decode scale and the block scales would be subnormal, so the whole tensor is
flushed to zero instead (every implementation -- this reference, the Triton kernels, the optimizer codec and
Q-Attn's tile scales -- uses the same test ``amax < AMAX_FLUSH``).

Packing: element 2i in the low nibble, 2i+1 in the high nibble (bit-compatible with
``torch.float4_e2m1fn_x2``). Sign is bit 3 of a nibble.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import torch

from ..devcache import cached

# ----------------------------------------------------------------------------------------------
# constants
E2M1_MAX = 6.0
E4M3_MAX = 448.0
#: amax below this (2^-100, exact in FP32) encodes as an all-zero tensor: see the module docstring
AMAX_FLUSH = 2.0 ** -100
#: the E2M1 magnitudes by 3-bit code
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
ROUNDINGS = ("rtn", "sr", "ms_eden")
HADAMARD_SIZES = (16, 32, 64, 128)

Block = Union[int, Sequence[int]]


# ----------------------------------------------------------------------------------------------
# element and scale casts
def e2m1_rne_codes(v: torch.Tensor) -> torch.Tensor:
    """FP32 -> 4-bit E2M1 codes (uint8 in [0, 15]), round-to-nearest-even, saturating at +-6.

    Ties: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4 (to the even mantissa).
    """
    a = v.abs()
    mag = ((a > 0.25).to(torch.uint8) + (a >= 0.75).to(torch.uint8) + (a > 1.25).to(torch.uint8)
           + (a >= 1.75).to(torch.uint8) + (a > 2.5).to(torch.uint8) + (a >= 3.5).to(torch.uint8)
           + (a > 5.0).to(torch.uint8))
    return mag | (torch.signbit(v).to(torch.uint8) << 3)


_E2M1_LUT_CACHE: dict = {}
_E2M1_SIGNED = tuple(E2M1_VALUES) + tuple(-v for v in E2M1_VALUES)   # code -> value, sign bit 3


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8 in [0, 15]) -> FP32 values."""
    lut = cached(_E2M1_LUT_CACHE, codes.device, codes.device,       # outside CUDA-graph pools (devcache)
                 lambda: torch.tensor(_E2M1_SIGNED, dtype=torch.float32, device=codes.device))
    return lut[codes.long()]


def e4m3_rne(v: torch.Tensor) -> torch.Tensor:
    """FP32 (>= 0, already clamped to <= 448) -> float8_e4m3fn, round-to-nearest-even."""
    return v.to(torch.float8_e4m3fn)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] uint8 codes -> [..., K/2] bytes, element 2i in the low nibble."""
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] uint8 codes."""
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


# ----------------------------------------------------------------------------------------------
# the tensor
@dataclasses.dataclass
class NVFP4Tensor:
    """A quantized tensor. Plain container, not a tensor subclass.

    Attributes:
        codes: uint8 ``[..., K/2]``, two E2M1 codes per byte (element 2i low nibble).
        scales: ``torch.float8_e4m3fn`` ``[..., K/16]``; for 2D (16x16) blocks each tile's scale is
            replicated over the tile's 16 rows so every consumer sees the 1x16 layout.
        global_scale: FP32 0-dim tensor, the per-tensor decode scale (0 for an all-zero tensor).
        shape: the logical (unquantized) shape.
        block: 16 or (16, 16).
        rounding: "rtn", "sr" or "ms_eden".
        hadamard: None or the RHT size d; then ``signs`` holds the random +-1 vector (length d) and the
            codes are of ``chunkwise((x * signs) @ H_d / sqrt(d))`` along the last dimension.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor
    shape: torch.Size
    block: Block = 16
    rounding: str = "rtn"
    four_over_six: bool = False
    hadamard: Optional[int] = None
    signs: Optional[torch.Tensor] = None

    def dequantize(self, dtype: torch.dtype = torch.bfloat16, *, rotated: bool = False) -> torch.Tensor:
        """Decode to ``dtype``. Undoes the Hadamard rotation unless ``rotated=True``."""
        from .hadamard import inverse_rht

        vals = dequantize_codes(self.codes, self.scales, self.global_scale)
        if self.hadamard is not None and not rotated:
            vals = inverse_rht(vals, self.signs)
        return vals.to(dtype)

    @property
    def nbytes(self) -> int:
        """Storage size in bytes: packed codes + E4M3 scales (one byte each) + 4 for the FP32 global scale
        (``signs`` not counted)."""
        return self.codes.numel() + self.scales.numel() + 4


def dequantize_codes(codes: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """FP32 values ``q * S_b * global`` from packed codes and 1x16 scales (rotated basis if RHT was used)."""
    q = e2m1_decode(unpack_nibbles(codes))
    s = scales.to(torch.float32) * global_scale.to(torch.float32)
    q = q.unflatten(-1, (q.shape[-1] // 16, 16))
    return (q * s.unsqueeze(-1)).flatten(-2)


# ----------------------------------------------------------------------------------------------
# input validation (eager API only; kernels have an unchecked fast path)
def _normalize_block(block: Block):
    if isinstance(block, int):
        if block != 16:
            raise ValueError(f"block must be 16 or (16, 16), got {block!r}")
        return 16
    b = tuple(block)
    if b == (16,):
        return 16
    if b != (16, 16):
        raise ValueError(f"block must be 16 or (16, 16), got {block!r}")
    return (16, 16)


def check_input(x: torch.Tensor, block=16, hadamard: Optional[int] = None, check_finite: bool = True):
    """Raise a clear error for inputs NVFP4 cannot encode."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point or x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"NVFP4 quantize needs a float32/float16/bfloat16 tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("NVFP4 quantize needs at least one dimension")
    if x.shape[-1] % 16 != 0:
        raise ValueError(f"last dimension must be a multiple of 16 for NVFP4 blocks, got shape {tuple(x.shape)}")
    if block == (16, 16) and (x.dim() < 2 or x.shape[-2] % 16 != 0):
        raise ValueError(f"2D 16x16 blocks need the last two dimensions to be multiples of 16, got {tuple(x.shape)}")
    if hadamard is not None:
        if hadamard not in HADAMARD_SIZES:
            raise ValueError(f"hadamard must be one of {HADAMARD_SIZES} or None, got {hadamard!r}")
        if x.shape[-1] % hadamard != 0:
            raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the Hadamard size {hadamard}")
    if check_finite and x.numel() and not bool(torch.isfinite(x).all()):
        raise ValueError("input contains NaN or Inf; NVFP4 cannot encode them")


# ----------------------------------------------------------------------------------------------
# RTN core (the other schemes live beside it; see quantize())
def _global_numerator(rounding: str, four_over_six: bool) -> float:
    if four_over_six:
        return 6.0 * 256.0
    return 6.0 * E4M3_MAX


def _block_amax(x: torch.Tensor, block2d: bool) -> torch.Tensor:
    """|x| max per 1x16 block ``[..., K/16]`` (for 2D: per 16x16 tile, replicated over its rows)."""
    a = x.abs().unflatten(-1, (x.shape[-1] // 16, 16)).amax(-1)
    if block2d:
        t = a.unflatten(-2, (a.shape[-2] // 16, 16)).amax(-2, keepdim=True)
        a = t.expand(*t.shape[:-2], 16, t.shape[-1]).flatten(-3, -2)
    return a


def quantize_rtn_(x32: torch.Tensor, block2d: bool, four_over_six: bool):
    """RTN (optionally 4/6) on an FP32 tensor; returns (codes uint8 [...,K/2], scales fp8 [...,K/16], global)."""
    amax = x32.abs().amax() if x32.numel() else torch.zeros((), device=x32.device)
    amax = amax.to(torch.float32)
    zero = amax < AMAX_FLUSH
    s_enc = torch.where(zero, torch.ones_like(amax),
                        torch.tensor(_global_numerator("rtn", four_over_six), device=x32.device) / amax)
    gscale = torch.where(zero, torch.zeros_like(amax), 1.0 / s_enc)
    amax_b = _block_amax(x32, block2d)
    xb = x32.unflatten(-1, (x32.shape[-1] // 16, 16))

    def encode(max_code: float):
        stored = e4m3_rne(torch.clamp(amax_b / max_code * s_enc, max=E4M3_MAX))
        sf = stored.to(torch.float32)
        enc = 1.0 / (sf * gscale)
        enc = torch.where(sf == 0, torch.zeros_like(enc), enc)
        q = e2m1_rne_codes(xb * enc.unsqueeze(-1))
        return stored, q

    stored, q = encode(6.0)
    if four_over_six:
        stored4, q4 = encode(4.0)
        xs = xb * s_enc
        err6 = _block_sse(xs, q, stored)
        err4 = _block_sse(xs, q4, stored4)
        if block2d:
            err6 = _tile_sum(err6)
            err4 = _tile_sum(err4)
        pick4 = err4 < err6
        stored = torch.where(pick4, stored4.to(torch.float32), stored.to(torch.float32)).to(torch.float8_e4m3fn)
        q = torch.where(pick4.unsqueeze(-1), q4, q)
    q = torch.where(zero, torch.zeros_like(q), q)
    return pack_nibbles(q.flatten(-2)), stored, gscale


def tree_sum(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum over ``dim`` (a power-of-two size) as a pairwise tree of *adjacent* pairs: ((t0+t1)+(t2+t3))+...

    A fixed summation order, so the Triton kernels reproduce the result bit for bit.
    """
    dim = dim % t.dim()
    while t.shape[dim] > 1:
        v = t.unflatten(dim, (t.shape[dim] // 2, 2))
        t = v.select(dim + 1, 0) + v.select(dim + 1, 1)
    return t.squeeze(dim)


def _block_sse(xs, q, stored):
    """Per-block sum of squared errors, FP32, in units of the global decode scale, summed in a fixed pairwise
    order (:func:`tree_sum`): ``d = x * s_enc - q * S_b`` (``xs`` = x * s_enc, shared by both candidates).

    The unit keeps every term in FP32 range for any amax (|x * s_enc| <= G, S_b <= 448, |q| <= 6); comparing
    two candidates' errors in that common unit is the same comparison as in x's own unit up to FP32 rounding.
    """
    d = xs - e2m1_decode(q) * stored.to(torch.float32).unsqueeze(-1)
    return tree_sum(d * d)


def _tile_sum(err):
    """Sum a per-1x16-block statistic over each 16x16 tile (fixed order) and replicate it over the tile's rows."""
    t = tree_sum(err.unflatten(-2, (err.shape[-2] // 16, 16)), dim=-2).unsqueeze(-2)
    return t.expand(*t.shape[:-2], 16, t.shape[-1]).flatten(-3, -2)


# ----------------------------------------------------------------------------------------------
# public API
def quantize(x: torch.Tensor, *, rounding: str = "rtn", block: Block = 16, four_over_six: bool = False,
             hadamard: Optional[int] = None, generator: Optional[torch.Generator] = None,
             signs: Optional[torch.Tensor] = None, check: bool = True,
             seed: Optional[torch.Tensor] = None) -> NVFP4Tensor:
    """Quantize ``x`` to NVFP4 along its last dimension.

    Args:
        x: float32/float16/bfloat16 tensor, last dim a multiple of 16 (and of ``hadamard``).
        rounding: "rtn" (round-to-nearest-even), "sr" (unbiased stochastic rounding of the elements with the
            16/17 headroom factor, also in the global scale) or "ms_eden" (Quartet II's MS-EDEN: RTN elements, EDEN-corrected,
            stochastically rounded scales).
        block: 16 (1x16 blocks along the last dim) or (16, 16) (2D tiles over the last two dims).
        four_over_six: per block, also try mapping the block max to 4 and keep the lower-MSE choice.
        hadamard: None or 16/32/64/128: random Hadamard transform along the last dim before quantizing.
        generator: source of the random signs and stochastic-rounding bits.
        signs: explicit +-1 sign vector of length ``hadamard`` (overrides drawing one from ``generator``);
            two operands of one GEMM must share it.
        check: validate dtype/shape/finiteness (raises ValueError/TypeError).
        seed: explicit int64 0-dim seed of the stochastic rounding (default: drawn from ``generator``); the
            same seed gives the same bytes here and in the CUDA kernels (see ``formats/random.py``).

    The exact arithmetic of every scheme is documented in ``fp4compile/formats/schemes.py``.
    """
    from .schemes import quantize_fp32

    block_n = _normalize_block(block)
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    if check:
        check_input(x, block_n, hadamard)
    return quantize_fp32(x, rounding=rounding, block=block_n, four_over_six=four_over_six,
                         hadamard=hadamard, generator=generator, signs=signs, seed=seed)


def dequantize(t: NVFP4Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Functional alias of ``NVFP4Tensor.dequantize``."""
    return t.dequantize(dtype)
