"""NVFP4 codecs for optimizer states: the first moment (RHT + SR + 4/6) and the second moment
(sqrt -> tile mean -> RHT -> NVFP4). Pure torch, any device, written so Inductor fuses it into a few
kernels: no host syncs, no data-dependent Python control flow, no matmuls (the Hadamard is a butterfly).

The element/scale semantics are exactly those of :mod:`fp4compile.formats.nvfp4` (two-level scaling,
global numerator 6*448, or 6*256 with 4/6; E4M3 block scales; E2M1 codes packed two per byte, element 2i in
the low nibble). ``tests/test_optim_codec.py`` checks the RTN path bit for bit against
``fp4compile.formats.nvfp4.quantize``. Stochastic rounding uses a *counter-based* hash (index, seed) -> uniform
so that the same bits are reproducible on any device, inside a compiled graph, and across a checkpoint
resume (no generator state to save).

Storage layout of one quantized state of ``n`` elements (``n % tile == 0``), all tensors integer-typed so
``torch.optim.Optimizer.load_state_dict`` (which casts floating state to the parameter dtype) cannot
touch them:

    codes   uint8 [n/2]      two E2M1 codes per byte
    scales  uint8 [n/16]     raw E4M3 bytes
    gbits   int32 [] or [ceil(n/chunk)]   the FP32 second-level decode scale(s), bit-cast: per tensor, or per
                             run of ``chunk`` elements (what the optimizer stores: no tensor-wide
                             reduction, so one fused kernel encodes each run on its own)
    mean    int16 [n/tile]   (second moment only) BF16 tile means of sqrt(v), bit-cast
"""
from __future__ import annotations

import math

import torch

from ..formats.nvfp4 import AMAX_FLUSH as _AMAX_FLUSH, E4M3_MAX, e2m1_rne_codes, e4m3_rne, pack_nibbles, tree_sum, unpack_nibbles

M32 = 0xFFFFFFFF


# ----------------------------------------------------------------------------------------------
# Hadamard (butterfly, fusable) and counter-based random numbers
def fwht(x: torch.Tensor, d: int) -> torch.Tensor:
    """Normalized Sylvester Hadamard H_d/sqrt(d), chunkwise along the last dim, as log2(d) butterflies.

    Same transform as ``x @ hadamard_matrix(d)`` (up to FP32 summation order) but pointwise ops only, so
    Inductor fuses it into the surrounding kernel instead of calling a GEMM.
    """
    shape = x.shape
    y = x.reshape(-1, d)
    h = 1
    while h < d:
        y = y.reshape(-1, d // (2 * h), 2, h)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return y.reshape(shape) * (1.0 / math.sqrt(d))


def rht(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """(x * s) H_d / sqrt(d) chunkwise along the last dim (``signs`` has length d, +-1)."""
    d = signs.numel()
    xs = x.reshape(-1, d) * signs.to(torch.float32)
    return fwht(xs, d).reshape(x.shape)


def inverse_rht(y: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`rht`: (y H_d / sqrt(d)) * s chunkwise along the last dim (H_d / sqrt(d) is its own
    inverse)."""
    d = signs.numel()
    return (fwht(y.reshape(-1, d), d) * signs.to(torch.float32)).reshape(y.shape)


def hash_bits(n: int, seed: torch.Tensor, device) -> torch.Tensor:
    """n 32-bit hashes (int64 in [0, 2**32)) of (index, seed). ``seed``: int64 0-dim tensor.

    All multipliers are < 2**31 so int64 products never overflow; everything is masked to 32 bits.
    """
    x = torch.arange(n, device=device, dtype=torch.int64)
    x = (x * 0x2545F491 + seed * 0x61C88647 + 0x1B873593) & M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & M32
    x = x ^ (x >> 16)
    x = (x * 0x297A2D39) & M32
    return x ^ (x >> 15)


def uniform_hash(n: int, seed: torch.Tensor, device) -> torch.Tensor:
    """n uniforms in [0, 1) (24-bit resolution) from :func:`hash_bits`."""
    return (hash_bits(n, seed, device) >> 8).to(torch.float32) * (1.0 / 16777216.0)


def shared_sr_uniforms(n: int, seed: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two streams of n uniforms in [0, 1) from ONE :func:`hash_bits` word per element: the high 16 bits for the
    first stream, the low 16 bits for the second (16-bit resolution each, k / 2^16).

    Q-AdamW's step draws both moments' SR bits this way (m: high half, v: low half), so its fused kernel
    hashes each element once instead of once per moment (the two hashes were ~11 % of the kernel's sm_90
    instructions, ``bench/qadamw_sass.py``). The halves of a well-mixed 32-bit word are independent for this
    purpose (``tests/test_optim_codec.py`` checks their correlation and uniformity). With 16 bits, SR rounds up
    with probability ceil(f * 2^16) / 2^16 for a fractional position f: a bias below 2^-16 of a grid step.
    """
    h = hash_bits(n, seed, device)
    return (h >> 16).to(torch.float32) * (1.0 / 65536.0), (h & 0xFFFF).to(torch.float32) * (1.0 / 65536.0)


def bf16_stochastic_round(x: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """FP32 -> BF16 with unbiased stochastic rounding: add 16 random bits below the BF16 mantissa, truncate.

    Works on the bit pattern (sign-magnitude), so negative values round their magnitude the same way.
    """
    flat = x.reshape(-1).to(torch.float32).contiguous()
    r = (hash_bits(flat.numel(), seed, flat.device) & 0xFFFF).to(torch.int32)
    bits = (flat.view(torch.int32) + r) & -65536
    return bits.view(torch.float32).to(torch.bfloat16).reshape(x.shape)


def step_seed(base: torch.Tensor, step: torch.Tensor, stream: int) -> torch.Tensor:
    """A per-(tensor, step, stream) seed, computed on device (no host sync)."""
    return (base + step.to(torch.int64) * 0x9E3779B1 + stream * 0x165667B1) & M32


# ----------------------------------------------------------------------------------------------
# E2M1 element rounding and decoding
def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes -> FP32 by arithmetic (no lookup table, fusable)."""
    c = codes.to(torch.int32)
    mag = c & 7
    e = (mag >> 1).to(torch.float32)
    mant = (mag & 1).to(torch.float32)
    val = torch.where(mag < 2, 0.5 * mant, (1.0 + 0.5 * mant) * torch.exp2(e - 1.0))
    return torch.where((c & 8) != 0, -val, val)


def e2m1_sr_codes(v: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Unbiased stochastic rounding of FP32 v (|v| <= 6 after scaling) onto the E2M1 grid -> codes.

    Between the two neighbouring grid points lo <= |v| < lo + step, round up with probability
    (|v| - lo) / step (so E[q] = v). |v| > 6 (only possible through E4M3 scale rounding) saturates to 6.
    """
    a = v.abs().clamp(max=6.0)
    step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    lo = torch.floor(a / step) * step
    q = torch.where(u < (a - lo) / step, lo + step, lo).clamp(max=6.0)
    return e2m1_rne_codes(torch.where(torch.signbit(v), -q, q))  # grid values encode exactly


# ----------------------------------------------------------------------------------------------
# block encode/decode (1x16 blocks along a flat vector)
def chunk_amax(x: torch.Tensor, chunk: int | None) -> torch.Tensor:
    """max|x| over the whole flat ``x`` (``chunk=None``: a 0-dim tensor) or over each run of ``chunk``
    consecutive elements (the last run may be shorter): ``[ceil(n / chunk)]``."""
    a = x.abs()
    if chunk is None:
        return a.amax()
    n = a.numel()
    pad = (-n) % chunk
    if pad:
        a = torch.cat((a, a.new_zeros(pad)))
    return a.reshape(-1, chunk).amax(-1)


def per_block(gscale: torch.Tensor, n: int, chunk: int | None) -> torch.Tensor:
    """The global scale of each 16-element block of an ``n``-element vector: ``gscale`` is 0-dim (per
    tensor; ``chunk`` ignored) or one per run of ``chunk`` elements -> ``[n/16]``."""
    if gscale.dim() == 0:
        return gscale.expand(n // 16)
    if chunk is None or gscale.numel() != -(-n // chunk):
        raise ValueError(f"{gscale.numel()} global scales do not fit {n} elements in chunks of {chunk}")
    return gscale.repeat_interleave(chunk // 16)[: n // 16]


def encode(x: torch.Tensor, *, rounding: str, four_over_six: bool, u: torch.Tensor | None = None,
           chunk: int | None = None, sse64: bool = True):
    """Flat FP32 x [n] (n % 16 == 0) -> (codes u8 [n/2], scales u8 [n/16], global fp32).

    ``chunk=None``: one per-tensor global scale (0-dim) and RTN is bit-identical to
    ``formats.nvfp4.quantize_rtn_`` on the same input, except in 4/6 ties: a block whose two candidates are
    exactly as good (e.g. both decode to the same values) may store the other candidate's scale and codes,
    because the two compute the errors with different roundings (here x - code·(S·g); there x·s_enc - code·S;
    the fused kernel computes them as here, and rounding code·S first would cost it a multiply per element).
    ``chunk=c`` (a multiple of 16): the second scaling
    level is per run of ``c`` consecutive elements instead of per tensor (``global`` is ``[ceil(n/c)]``):
    the same two-level arithmetic, applied to each run as if it were a tensor of its own, so a fused kernel
    can encode each run without a tensor-wide reduction. With ``rounding="sr"`` the block scales (and the
    4/6 choice, made by RTN error) are the same and the elements are rounded stochastically with ``u`` [n].
    ``sse64``: the 4/6 choice compares per-block squared-error sums in FP64 or, with False, in FP32 (the same
    adjacent-pair tree as the format reference's ``tree_sum``; differs from FP64 only in near-ties).
    """
    x = x.to(torch.float32)
    n = x.numel()
    if chunk is not None and chunk % 16:
        raise ValueError(f"chunk must be a multiple of 16, got {chunk}")
    amax = chunk_amax(x, chunk)
    zero = amax < _AMAX_FLUSH
    numer = 6.0 * 256.0 if four_over_six else 6.0 * E4M3_MAX
    # tensor / tensor (``float / tensor`` is reciprocal-then-multiply in torch and would differ by an ulp)
    s_enc = torch.where(zero, torch.ones_like(amax),
                        torch.full_like(amax, numer) / torch.where(zero, torch.ones_like(amax), amax))
    gscale_c = torch.where(zero, torch.zeros_like(amax), 1.0 / s_enc)
    # per 16-element block from here on
    s_enc, gscale, zero = (per_block(t, n, chunk) for t in (s_enc, gscale_c, zero))
    xb = x.reshape(-1, 16)
    amax_b = xb.abs().amax(-1)

    def scale_for(max_code: float):
        stored = e4m3_rne(torch.clamp(amax_b / max_code * s_enc, max=E4M3_MAX))
        sf = stored.to(torch.float32)
        enc = torch.where(sf == 0, torch.zeros_like(sf), 1.0 / (sf * gscale))
        return stored, sf, enc

    stored, sf, enc = scale_for(6.0)
    if four_over_six:
        stored4, sf4, enc4 = scale_for(4.0)

        def sse(sf_, enc_):
            q = e2m1_decode(e2m1_rne_codes(xb * enc_.unsqueeze(-1))) * (sf_ * gscale).unsqueeze(-1)
            d = xb.double() - q.double() if sse64 else xb - q
            return tree_sum(d * d)  # the format reference's fixed pairwise order

        pick4 = sse(sf4, enc4) < sse(sf, enc)
        stored = torch.where(pick4, sf4, sf).to(torch.float8_e4m3fn)
        enc = torch.where(pick4, enc4, enc)
    scaled = xb * enc.unsqueeze(-1)
    if rounding == "rtn":
        q = e2m1_rne_codes(scaled)
    elif rounding == "sr":
        if u is None:
            raise ValueError("stochastic rounding needs uniforms u")
        q = e2m1_sr_codes(scaled, u.reshape(-1, 16))
    else:
        raise ValueError(f"optimizer-state rounding must be 'rtn' or 'sr', got {rounding!r}")
    q = torch.where(zero.unsqueeze(-1), torch.zeros_like(q), q)
    return pack_nibbles(q.reshape(-1)), stored.view(torch.uint8), gscale_c


def decode(codes: torch.Tensor, scales_u8: torch.Tensor, gscale: torch.Tensor, chunk: int | None = None
           ) -> torch.Tensor:
    """(codes, raw E4M3 scale bytes, global) -> flat FP32. ``gscale``: 0-dim (per tensor), or one per run of
    ``chunk`` elements as :func:`encode` wrote it."""
    q = e2m1_decode(unpack_nibbles(codes)).reshape(-1, 16)
    s = scales_u8.view(torch.float8_e4m3fn).to(torch.float32) * per_block(gscale, q.numel(), chunk)
    return (q * s.unsqueeze(-1)).reshape(-1)


def f32_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """int32 bit patterns -> the FP32 values they encode (a bit-cast view; inverse of :func:`bits_from_f32`)."""
    return bits.view(torch.float32)


def bits_from_f32(x: torch.Tensor) -> torch.Tensor:
    """FP32 global scale(s) -> their int32 bit patterns (0-dim stays 0-dim)."""
    x = x.to(torch.float32)
    return x.reshape(()).view(torch.int32) if x.numel() == 1 and x.dim() == 0 else x.view(torch.int32)


def tile_mean(r: torch.Tensor, tile: int) -> torch.Tensor:
    """Mean of each run of ``tile`` (a power of two) elements, summed as a fixed pairwise tree of adjacent
    pairs (``formats.nvfp4.tree_sum``) then divided by ``tile`` (exact): a device-independent order the
    Triton kernel reproduces bit for bit (``torch.mean``'s order differs between CPU and CUDA)."""
    if tile & (tile - 1):
        return r.reshape(-1, tile).mean(-1)
    return tree_sum(r.reshape(-1, tile)) / tile


#: the largest sqrt(v) a quantized second moment holds (2^100; v itself would overflow FP32 once sqrt(v) > ~1.8e19). The
#: v update saturates here so that every later step of the encode (tile sums of 32 elements, the Hadamard
#: butterflies, the BF16 tile mean) stays finite: a state the optimizer writes always decodes and always loads.
SQRT_V_MAX = 2.0 ** 100


def saturate_sqrt_v(r: torch.Tensor) -> torch.Tensor:
    """min(r, :data:`SQRT_V_MAX`), written as a select so that NaN stays NaN (as in the fused kernel)."""
    return torch.where(r > SQRT_V_MAX, SQRT_V_MAX, r)


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded FP32 square root on every device. CUDA's ``sqrt`` is IEEE; some CPU builds of torch
    vectorize FP32 ``sqrt`` with an approximation that is off by an ulp for ~1 in 7 inputs, so on CPU it is
    taken in FP64 and rounded once (exact: a double-rounded square root is correctly rounded)."""
    if x.device.type == "cuda":
        return x.sqrt()
    return x.double().sqrt().to(x.dtype)


def scaled_hypot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sqrt(a^2 + b^2) for a, b >= 0 without overflow or underflow: both are scaled by the same power of
    two (exact) when the larger is above 2^60 or below 2^-60. Only IEEE ops (mul, add, sqrt), so the Triton
    kernel reproduces it bit for bit (``torch.hypot`` is a libm call whose rounding differs by device)."""
    mx = torch.maximum(a, b)
    s = torch.where(mx > 2.0 ** 60, 2.0 ** -64, torch.where(mx < 2.0 ** -60, 2.0 ** 64, 1.0))
    si = torch.where(mx > 2.0 ** 60, 2.0 ** 64, torch.where(mx < 2.0 ** -60, 2.0 ** -64, 1.0))
    a, b = a * s, b * s
    return sqrt_rn(a * a + b * b) * si


# ----------------------------------------------------------------------------------------------
# the two moment codecs
def _sr_uniforms(n: int, rounding: str, seed, u, device):
    """The SR uniforms of an encode: ``u`` when given (the caller's stream), else :func:`uniform_hash` of ``seed``."""
    if rounding != "sr":
        if u is not None:
            raise ValueError(f"uniforms were given for rounding={rounding!r}; they are for 'sr' only")
        return None
    if u is None:
        return uniform_hash(n, seed, device)
    if u.shape != (n,) or u.dtype != torch.float32:
        raise ValueError(f"SR uniforms must be float32 [{n}], got {u.dtype} {tuple(u.shape)}")
    return u


def encode_m(m: torch.Tensor, signs: torch.Tensor, *, rounding="sr", four_over_six=True, seed=None,
             chunk: int | None = None, sse64: bool = True, u: torch.Tensor | None = None):
    """First moment: RHT along the flat vector, then NVFP4 (SR + 4/6 by default). ``chunk``: see
    :func:`encode` (the optimizer uses per-chunk global scales, ``qadamw.SCALE_CHUNK``). SR draws its uniforms
    from ``seed`` (:func:`uniform_hash`) or takes them as ``u`` (float32 [numel], e.g. from
    :func:`shared_sr_uniforms`)."""
    m = m.reshape(-1).to(torch.float32)
    y = rht(m, signs) if signs is not None else m
    u = _sr_uniforms(m.numel(), rounding, seed, u, m.device)
    codes, scales, g = encode(y, rounding=rounding, four_over_six=four_over_six, u=u, chunk=chunk, sse64=sse64)
    return codes, scales, bits_from_f32(g)


def decode_m(codes, scales, gbits, signs, chunk: int | None = None) -> torch.Tensor:
    """Inverse of :func:`encode_m`: the flat FP32 first moment (decoded, then un-rotated when ``signs`` is
    given)."""
    y = decode(codes, scales, f32_from_bits(gbits), chunk)
    return inverse_rht(y, signs) if signs is not None else y


def encode_v(v: torch.Tensor, signs: torch.Tensor, *, tile=128, rounding="rtn", four_over_six=False, seed=None,
             from_sqrt: bool = False, chunk: int | None = None, sse64: bool = True, u: torch.Tensor | None = None):
    """Second moment: r = sqrt(v); mu = BF16 tile mean of r; NVFP4(RHT(r - mu)).

    ``from_sqrt=True`` means the input already is r = sqrt(v) (saves a sqrt/square pair in the step).
    SR uniforms: from ``seed`` or given as ``u``, as in :func:`encode_m`.
    Returns (codes, scales, gbits, mean_bits int16 [n/tile]).
    """
    v = v.reshape(-1).to(torch.float32)
    r = v if from_sqrt else v.clamp(min=0).sqrt()
    mu = tile_mean(r, tile).to(torch.bfloat16)
    res = (r.reshape(-1, tile) - mu.to(torch.float32).unsqueeze(-1)).reshape(-1)
    y = rht(res, signs) if signs is not None else res
    u = _sr_uniforms(v.numel(), rounding, seed, u, v.device)
    codes, scales, g = encode(y, rounding=rounding, four_over_six=four_over_six, u=u, chunk=chunk, sse64=sse64)
    return codes, scales, bits_from_f32(g), mu.view(torch.int16)


def decode_v_sqrt(codes, scales, gbits, mean_bits, signs, *, tile=128, floor: bool = False,
                  chunk: int | None = None, signed: bool = False) -> torch.Tensor:
    """Reconstructed sqrt(v) = max(dequant + mean, 0) (>= 0 and finite by construction).

    ``floor=True`` (what the optimizer uses) instead clamps at the *resolution* of the element's block: half
    the block's smallest nonzero E2M1 step, 0.25 * scale_b * global (the max over the Hadamard group when the
    rotation spans several blocks). A value the codec cannot resolve is never read back as ~0, so the update
    m / (sqrt(v) + eps) cannot blow up by 1/eps; unresolvable v are over- (never under-) estimated, which
    only shrinks their steps.

    ``signed=True``: dequant + mean as it is, negative values included (the state of Q-AdamW's
    ``v_state="signed"``, whose EMA keeps the sign; not with ``floor``).
    """
    if signed and floor:
        raise ValueError("decode_v_sqrt: signed and floor exclude each other")
    g = f32_from_bits(gbits)
    y = decode(codes, scales, g, chunk)
    res = inverse_rht(y, signs) if signs is not None else y
    mu = mean_bits.view(torch.bfloat16).to(torch.float32)
    r = (res.reshape(-1, tile) + mu.unsqueeze(-1)).reshape(-1)
    if signed:
        return r
    if not floor:
        return r.clamp(min=0)
    return torch.maximum(r, v_floor(scales, gbits, signs, r.numel(), chunk))


def v_floor(scales, gbits, signs, n: int, chunk: int | None = None) -> torch.Tensor:
    """The decoder's floor of :func:`decode_v_sqrt` (``floor=True``) for each of the ``n`` elements: 0.25 *
    scale_b * global, the max over the Hadamard group when the rotation spans several blocks."""
    lo = scales.view(torch.float8_e4m3fn).to(torch.float32) * per_block(f32_from_bits(gbits), n, chunk) * 0.25
    d = 16 if signs is None else max(16, signs.numel())
    return lo.reshape(-1, d // 16).amax(-1, keepdim=True).expand(-1, d).reshape(-1)


def decode_v(codes, scales, gbits, mean_bits, signs, *, tile=128, chunk: int | None = None) -> torch.Tensor:
    """The flat FP32 second moment: the square of :func:`decode_v_sqrt` (``floor=False``: sqrt(v) clamped at 0)."""
    return decode_v_sqrt(codes, scales, gbits, mean_bits, signs, tile=tile, chunk=chunk).square()


def direct_v_roundtrip(v: torch.Tensor, *, rounding="rtn", four_over_six=False, seed=None) -> torch.Tensor:
    """Baseline for the numerics report: v stored directly in NVFP4 (no transform), decoded."""
    v = v.reshape(-1).to(torch.float32)
    u = uniform_hash(v.numel(), seed, v.device) if rounding == "sr" else None
    c, s, g = encode(v, rounding=rounding, four_over_six=four_over_six, u=u)
    return decode(c, s, g)
