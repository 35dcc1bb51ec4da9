"""Q-Attn numerics: the torch reference of the mixed-precision attention in ``kernels/attention.py``.

Six GEMMs, each with its own precision (policy roles, in this bit order of ``fp4_roles``):

    bit  role       product             contraction   NVFP4 operands (blocks run along the contraction)
    0    attn.qk    S  = Q·Kᵀ           head_dim      Q̂, K̂            (16x16 tiles, per-tensor global)
    1    attn.pv    O  = P·V            keys          P̃ (1x16 along keys, fixed global) and V̂ (16x16 tiles)
    2    attn.dov   dP = dO·Vᵀ          head_dim      dÔ, V̂           (16x16 tiles, per-tensor globals)
    3    attn.pdo   dV = Pᵀ·dO          queries       P (1x16 along queries, fixed global) and dÔ (16x16)
    4    attn.dsk   dQ = dS·K           keys          dS (1x16 along keys, per 64x64-tile global) and K̂
    5    attn.dsq   dK = dSᵀ·Q          queries       dS (1x16 along queries, per-tile global) and Q̂

**Which copy is reused, and why 16x16 tiles.** QKᵀ contracts over head_dim, but dS·K contracts over keys and
dSᵀ·Q over queries: a 1x16 (head_dim) copy of Q or K cannot serve the dS products. Q, K, V (and dO) are
therefore quantized ONCE with 16x16 2D blocks (16 sequence positions x 16 head-dim channels share one E4M3
scale), which is transpose-invariant: the same codes and scales are an exact NVFP4 operand along head_dim and
along the sequence. The forward's Q̂/K̂ (and V̂ when a V role is NVFP4) are what autograd saves, and the
backward reuses them, bit for bit, for the S recomputation and for dS·K / dSᵀ·Q / dO·Vᵀ. Nothing is
re-quantized. The price is a coarser scale (one per 256 values instead of per 16) -- the same trade NVIDIA's
recipe makes for weights.

**The 1x16 option (``QK_1X16``, bit 6 of the mask; ``passes.attention.QK_BLOCKS = "1x16"``, the pass's default
since session 61: 0.17 +- 0.05 point lower val-loss gap at 30M / 300M tokens over three seeds).** Q and K may
instead be quantized with 1x16 blocks along head_dim -- one E4M3 scale per row and 16 channels, the blocks of
QKᵀ's own contraction and the finer scale. That copy is what the forward's QKᵀ reads and what autograd saves; the
backward reuses it for the S recomputation. It is not an NVFP4 operand along the sequence (its blocks do not run
along the keys / queries that dS·K and dSᵀ·Q contract over), so for those two products the backward re-quantizes
it (``requantize_tiles``): the saved copy's values in 16x16 tiles, a second rounding of the same tensor, which is
what an FP4 tensor core would need; no BF16 Q or K is saved for it. Its per-tensor global is the saved copy's (the
re-quantization's own comes out exactly 1, see ``requantize_tiles``; the Triton backward makes it in its first
launch from the copy's codes and scales, ``attention._requant_body``). V and dO keep the tiles. The scales' layout
([..., T, D/16]) is the same for both blockings, so every consumer reads either copy unchanged.

**The transform inside the op (``QK_ROT``, ``K_SMOOTH``, bits 7 and 8; ``passes.attention.QK_TRANSFORM_IMPL =
"fused"``).** :func:`qk_transform`'s K centring and signed Hadamard may be left to the op: it is then given Q and K
as the model made them and quantizes ``apply_in_op_transform(q, k)`` -- on CUDA the launches that take Q's and K's
amax and quantize them compute the transform in registers, so the transformed BF16 Q', K' are never written or read
back -- and its autograd returns dQ, dK through the transform's transpose (``fp4compile::smooth_rotate``, as the
unfused graph's). Only with attn.qk, attn.dsk and attn.dsq all NVFP4 (``QK_READERS``): then Q', K' feed nothing but
their NVFP4 copies. The softmax scale's factor ``c`` stays the caller's.

Tensors made inside the kernels are quantized on the fly, in registers, along the contraction axis of the
product that consumes them, with 1x16 blocks:
  * P (pv, pdo): its values lie in [0, 1], so the per-tensor level is fixed: global decode scale 1/2688
    (= amax 1 / (6·448)); E4M3 block scales then cover block maxima down to ~2^-9·6/2688 ≈ 4e-6, and smaller
    probabilities flush to zero (they cannot move a convex combination measurably). In the forward (attn.pv),
    the quantized operand is the online-softmax P̃ = exp(S - m_running) of each 64-key tile (``PV_TILE``), as
    the kernel holds it; this reference runs the same key-tile loop. (Relative to exp(S - m_final) it differs
    by a per-row factor that the block scales absorb up to E4M3 rounding.) In the backward (attn.pdo), P is
    the exactly normalized exp(S - LSE).
  * dS (dsk, dsq): its range is unknown before it is computed and a per-tensor amax would need a second pass,
    so the two-level scale uses a per-tile global: amax over each 64x64 (query x key) tile of dS -- exactly the
    tile the backward kernels hold in registers (``DS_TILE``) -- floored to a power of two (``tile_scales``), and
    1x16 E4M3 blocks inside it.
  * Softmax normalization uses the unquantized row sum l (as FlashAttention does with its fp32 l).

The dequantized value of an NVFP4 element, code x E4M3 scale, is exact in BF16 (2 + 4 significant bits), so the
kernels run BF16 tensor-core products on exactly the NVFP4 values and apply the FP32 global scales to the
FP32 accumulators. This file computes the same math in float64 (``dtype=torch.float64``: the reference) or in
FP32 with the kernels' BF16 roundings of P and dS (``emulate_bf16=True``: the "same-precision PyTorch
implementation" of FlashAttention's test rule, and the CPU implementation of ``fp4compile::qattn``).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from ..formats import nvfp4

Tensor = torch.Tensor

ATTN_ROLES = ("attn.qk", "attn.pv", "attn.dov", "attn.pdo", "attn.dsk", "attn.dsq")
QK, PV, DOV, PDO, DSK, DSQ = (1 << i for i in range(6))
#: not a role: Q and K quantized with 1x16 blocks along head_dim instead of 16x16 tiles (module docstring)
QK_1X16 = 1 << 6
#: not roles: Q-Attn's Q, K transform (:func:`qk_transform`) applied by ``fp4compile::qattn`` itself to the Q and K
#: it is given, inside the launches that quantize them (module docstring, "The transform inside the op"):
#: ``QK_ROT`` rotates both by the signed Hadamard of :func:`hadamard_block` channels, ``K_SMOOTH`` centres K over T
QK_ROT = 1 << 7
K_SMOOTH = 1 << 8
IN_OP_TRANSFORM = QK_ROT | K_SMOOTH
#: every valid mask is below this (the role bits, ``QK_1X16``, ``QK_ROT``, ``K_SMOOTH``)
MASK_LIMIT = 1 << 9
#: the Full-Stack FP4 split: QKᵀ, dS·K, dSᵀ·Q in NVFP4; P·V, Pᵀ·dO, dO·Vᵀ in BF16
PAPER_ROLES = QK | DSK | DSQ
#: the roles that read Q and K: all three NVFP4 is what ``IN_OP_TRANSFORM`` needs (then the transformed Q, K feed
#: nothing but their NVFP4 copies, and no BF16 Q' or K' has to exist)
QK_READERS = QK | DSK | DSQ
#: rows x cols of the dS tile whose amax is the per-tile global scale (the backward kernels' tile)
DS_TILE = 64
#: key-tile width of the forward kernel: with attn.pv in NVFP4, P̃ is quantized per key tile relative to the
#: online-softmax running max, so this width is part of the numerics (the reference loops over the same tiles)
PV_TILE = 64
#: 6 * 448: maps a tensor's amax to the largest E2M1 value times the largest E4M3 scale
G_NUM = 6.0 * nvfp4.E4M3_MAX
#: fixed global decode scale for P, whose values are <= 1
P_GLOBAL = 1.0 / G_NUM


def roles_to_mask(fp4: dict) -> int:
    """{role: bool} -> the ``fp4_roles`` bit mask."""
    m = 0
    for i, r in enumerate(ATTN_ROLES):
        if fp4.get(r, False):
            m |= 1 << i
    return m


def qk_tiles(mask: int) -> bool:
    """Whether Q and K are quantized with 16x16 tiles (True) or 1x16 blocks along head_dim (``QK_1X16``)."""
    return not mask & QK_1X16


#: the roles that read each of Q's, K's and V's NVFP4 copies (forward or backward)
COPY_READERS = (QK | DSQ, QK | DSK, PV | DOV)


def needs_fp4(mask: int) -> tuple[bool, bool, bool]:
    """Which of Q, K, V have an NVFP4 consumer (forward or backward)."""
    return tuple(bool(mask & r) for r in COPY_READERS)


def saved_for_backward(mask: int) -> dict:
    """Which copies of Q, K, V the backward needs: {"q": (bf16?, fp4?), ...}.

    Q feeds S = Q·Kᵀ (recomputed, attn.qk) and dK = dSᵀ·Q (attn.dsq); K feeds S and dQ = dS·K (attn.dsk);
    V feeds only dP = dO·Vᵀ (attn.dov) in the backward (P·V is forward-only).
    """
    qk, dov, dsk, dsq = bool(mask & QK), bool(mask & DOV), bool(mask & DSK), bool(mask & DSQ)
    return {"q": (not qk or not dsq, qk or dsq), "k": (not qk or not dsk, qk or dsk), "v": (not dov, dov)}


# ---------------------------------------------------------------------------------------------------------
# quantization (torch; the Triton kernels reproduce these formulas operation by operation)
def quantize_2d(x: Tensor, tiles: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """NVFP4 RTN with 16x16 blocks over the last two dims (sequence x head_dim) of ``[..., T, D]``, or, with
    ``tiles=False``, with 1x16 blocks along head_dim (the ``QK_1X16`` copy of Q and K).

    Returns (codes uint8 [..., T, D/2], scales uint8 E4M3 bytes [..., T, D/16] -- each tile's scale replicated
    over its 16 rows, the contract's 2D layout; with ``tiles=False`` one scale per row and 16 channels -- and the
    per-tensor fp32 decode scale). T need not be a multiple of 16: the last tile is padded with zeros for its amax.
    """
    T = x.shape[-2]
    pad = (-T) % 16 if tiles else 0
    x32 = x.to(torch.float32)
    if pad:
        x32 = torch.nn.functional.pad(x32, (0, 0, 0, pad))
    codes, scales, g = nvfp4.quantize_rtn_(x32, block2d=tiles, four_over_six=False)
    return codes[..., :T, :].contiguous(), scales.view(torch.uint8)[..., :T, :].contiguous(), g


def dequantize_2d(codes: Tensor, scales: Tensor, global_scale: Tensor, dtype=torch.float64) -> Tensor:
    """Values of a ``quantize_2d`` copy (global scale included)."""
    one = torch.ones((), dtype=torch.float32, device=codes.device)
    v = nvfp4.dequantize_codes(codes, scales.view(torch.float8_e4m3fn), one).to(dtype)
    return v * global_scale.to(dtype)


def _pad_to(x: Tensor, dim: int, mult: int) -> Tensor:
    pad = (-x.shape[dim]) % mult
    if not pad:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat((x, x.new_zeros(shape)), dim)


def fake_quant_1d(x: Tensor, dim: int, s_enc: Tensor, g_dec: Tensor) -> Tensor:
    """NVFP4 RTN fake-quantization of ``x`` with 1x16 blocks along ``dim`` and given two-level scales.

    ``s_enc`` / ``g_dec`` (encode = 1/decode global) broadcast against ``x``. Block scale and codes follow
    ``formats.nvfp4.quantize_rtn_`` in FP32; the result (``code · E4M3 scale · g_dec``) is returned in x's dtype.
    """
    n = x.shape[dim]
    xt = _pad_to(x.movedim(dim, -1), -1, 16)
    se = _pad_to(torch.broadcast_to(s_enc, x.shape).movedim(dim, -1), -1, 16).to(torch.float32)
    gd = _pad_to(torch.broadcast_to(g_dec, x.shape).movedim(dim, -1), -1, 16).to(torch.float32)
    xb = xt.unflatten(-1, (-1, 16)).to(torch.float32)
    se = se.unflatten(-1, (-1, 16))[..., 0]
    gd = gd.unflatten(-1, (-1, 16))[..., 0]
    amax_b = xb.abs().amax(-1)
    sf = nvfp4.e4m3_rne(torch.clamp(amax_b / 6.0 * se, max=nvfp4.E4M3_MAX)).to(torch.float32)
    enc = 1.0 / (sf * gd)
    enc = torch.where(sf == 0, torch.zeros_like(enc), enc)
    q = nvfp4.e2m1_decode(nvfp4.e2m1_rne_codes(xb * enc.unsqueeze(-1)))
    out = (q.to(x.dtype) * (sf.to(x.dtype) * gd.to(x.dtype)).unsqueeze(-1)).flatten(-2)[..., :n]
    return out.movedim(-1, dim)


def tile_scales(x: Tensor, tile: int = DS_TILE, pow2: bool = True) -> tuple[Tensor, Tensor]:
    """Per-(tile x tile) two-level scales of the last two dims: (s_enc, g_dec), broadcast to ``x.shape``.

    s_enc is the FP32 quotient 2688 / amax rounded *down to a power of two* (so g_dec = 1/s_enc is exact): the
    tile's largest block scale lands in (224, 448] instead of at 448, and each block's E4M3 scale keeps its
    3-bit mantissa; what the tile gives up is at most one binade at the bottom of the E4M3 range. The kernels
    gain an exact BF16 operand code x E4M3 scale x g_dec, so dS·K accumulates into the MMA accumulator in
    place instead of through a separate product scaled by a per-tile FP32 global. ``pow2=False``: the exact
    quotient (what the kernels did before; ``bench/attention_ds_global.py`` compares the two)."""
    M, N = x.shape[-2:]
    xp = _pad_to(_pad_to(x.abs().to(torch.float32), -2, tile), -1, tile)
    t = xp.unflatten(-1, (-1, tile)).unflatten(-3, (-1, tile)).amax(dim=(-3, -1), keepdim=True)
    t = t.expand(*t.shape[:-4], t.shape[-4], tile, t.shape[-2], tile).flatten(-4, -3).flatten(-2)[..., :M, :N]
    zero = t < nvfp4.AMAX_FLUSH
    quot = torch.full_like(t, G_NUM) / torch.where(zero, torch.ones_like(t), t)
    if pow2:
        _, e = torch.frexp(quot)
        quot = torch.ldexp(torch.ones_like(t), e - 1)
    s_enc = torch.where(zero, torch.ones_like(t), quot)
    g_dec = torch.where(zero, torch.zeros_like(t), 1.0 / s_enc)
    return s_enc, g_dec


def quantize_p(p: Tensor, dim: int) -> Tensor:
    """P (values in [0, 1]) fake-quantized along ``dim`` with the fixed global 1/2688."""
    one = torch.ones((), dtype=torch.float32, device=p.device)
    return fake_quant_1d(p, dim, one * G_NUM, one * torch.tensor(P_GLOBAL, dtype=torch.float32))


def quantize_ds(ds: Tensor, dim: int) -> Tensor:
    """dS fake-quantized along ``dim`` with per-64x64-tile global scales."""
    s_enc, g_dec = tile_scales(ds)
    return fake_quant_1d(ds, dim, s_enc, g_dec)


# ---------------------------------------------------------------------------------------------------------
def bthd_empty(B: int, H: int, T: int, D: int, dtype: torch.dtype, device) -> Tensor:
    """An uninitialized [B, H, T, D] tensor stored as [B, T, H, D] (``torch.empty((B, T, H, D)).transpose(1, 2)``):
    the layout of every Q-Attn output and gradient (O, dQ, dK, dV), as torch SDPA's flash/cuDNN kernels return
    theirs. A model's ``y.transpose(1, 2).reshape(B, T, H * D)`` is then a view, not a transposing copy, and the
    gradients of Q/K/V split from one fused projection are concatenated row by row. Used by the Triton kernels'
    launchers, the op's CPU implementation and fake functions (``fp4compile/ops.py``) and the attention swap."""
    return torch.empty((B, T, H, D), dtype=dtype, device=device).transpose(1, 2)


class QuantizedQKV(NamedTuple):
    """The FP4 views of Q, K, V (codes, scales, global per tensor; empty tensors when not quantized)."""

    q_codes: Tensor
    q_scales: Tensor
    q_global: Tensor
    k_codes: Tensor
    k_scales: Tensor
    k_global: Tensor
    v_codes: Tensor
    v_scales: Tensor
    v_global: Tensor


def _empty_view(x: Tensor):
    e = x.new_empty((0,), dtype=torch.uint8)
    return e, e.clone(), x.new_zeros((), dtype=torch.float32)


def quantize_qkv(q: Tensor, k: Tensor, v: Tensor, mask: int, quantize=quantize_2d) -> QuantizedQKV:
    """NVFP4 copies of those of Q, K, V that some role consumes in NVFP4: 16x16 tiles, or for Q and K 1x16
    blocks along head_dim where ``mask`` has ``QK_1X16``. ``quantize(x, tiles)`` makes one copy."""
    out = []
    for x, need, tiles in zip((q, k, v), needs_fp4(mask), (qk_tiles(mask), qk_tiles(mask), True)):
        out.extend(quantize(x, tiles) if need else _empty_view(x))
    return QuantizedQKV(*out)


def requantize_tiles(codes: Tensor, scales: Tensor, global_scale: Tensor, dtype=torch.float64) -> Tensor:
    """Values of a 1x16 copy (``quantize_2d(x, tiles=False)``) quantized again in 16x16 tiles: the operand of dS·K
    and dSᵀ·Q under ``QK_1X16``, valid along the sequence. The code x scale values (global excluded) have amax
    exactly 6 x 448 = 2688 -- the largest block's scale is RN_E4M3(amax / 6 x 2688 / amax) = 448 and its largest
    element rounds to code 6 -- so their own two-level quantization has global decode scale 2688 / 2688 = 1 and the
    tiles carry the saved copy's global unchanged (the kernels apply that one global; the product here keeps the
    re-quantization's global in, as the reference must)."""
    one = torch.ones((), dtype=torch.float32, device=codes.device)
    c2, s2, g2 = quantize_2d(dequantize_2d(codes, scales, one, torch.float32), tiles=True)
    return dequantize_2d(c2, s2, g2 * global_scale, dtype)


def _operand(x: Optional[Tensor], codes: Tensor, scales: Tensor, g: Tensor, fp4: bool, dtype,
             requant: bool = False) -> Tensor:
    if fp4:
        return requantize_tiles(codes, scales, g, dtype) if requant else dequantize_2d(codes, scales, g, dtype)
    if x is None:
        raise RuntimeError("qattn: a BF16 operand was not saved for backward (precision mask mismatch)")
    return x.to(dtype)


def _bias(attn_mask: Optional[Tensor], dtype) -> Optional[Tensor]:
    if attn_mask is None:
        return None
    if attn_mask.dtype == torch.bool:
        return torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device).masked_fill(~attn_mask, -math.inf)
    return attn_mask.to(dtype)


def _scores(qa, ka, attn_mask, is_causal, scale, dtype):
    groups = qa.shape[1] // ka.shape[1]
    s = (qa @ ka.repeat_interleave(groups, 1).transpose(-2, -1)) * scale
    b = _bias(attn_mask, dtype)
    if b is not None:
        s = s + b
    if is_causal:
        Tq, Tk = s.shape[-2:]
        keep = torch.ones(Tq, Tk, dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, -math.inf)
    return s


def _bf16(x: Tensor, on: bool) -> Tensor:
    return x.to(torch.bfloat16).to(x.dtype) if on else x


def attention_fwd_ref(q: Tensor, k: Tensor, v: Tensor, views: QuantizedQKV, attn_mask: Optional[Tensor],
                      is_causal: bool, scale: float, mask: int, *, dtype=torch.float64,
                      emulate_bf16: bool = False, out_dtype=None) -> tuple[Tensor, Tensor]:
    """Forward of the mixed-precision attention: (O in q's dtype, LSE fp32 [B, H, Tq]).

    q: [B, H, Tq, D]; k, v: [B, Hkv, Tk, D] with H % Hkv == 0. ``views`` from ``quantize_qkv``. Rows with no
    admissible key give O = 0 and LSE = +inf (so the backward's P is 0 there). ``out_dtype`` (default: q's
    dtype for O, fp32 for LSE) keeps e.g. the float64 reference unrounded.
    """
    qa = _operand(q, views.q_codes, views.q_scales, views.q_global, bool(mask & QK), dtype)
    ka = _operand(k, views.k_codes, views.k_scales, views.k_global, bool(mask & QK), dtype)
    va = _operand(v, views.v_codes, views.v_scales, views.v_global, bool(mask & PV), dtype)
    s = _scores(qa, ka, attn_mask, is_causal, scale, dtype)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    groups = q.shape[1] // v.shape[1]
    va = va.repeat_interleave(groups, 1)
    if mask & PV:  # the kernel's key-tile loop: P̃ relative to the running max, quantized per tile
        acc = torch.zeros((*s.shape[:-1], va.shape[-1]), dtype=dtype, device=s.device)
        m_run = torch.full_like(l, -math.inf)
        for j in range(0, s.shape[-1], PV_TILE):
            sb = s[..., j:j + PV_TILE]
            m_new = torch.maximum(m_run, sb.amax(-1, keepdim=True))
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            acc = acc * torch.exp(m_run - m_safe) + quantize_p(torch.exp(sb - m_safe), -1) @ va[..., j:j + PV_TILE, :]
            m_run = m_new
        o = acc / l
    else:
        o = (_bf16(p, emulate_bf16) @ va) / l
    o = torch.where(l == 0, torch.zeros_like(o), o)
    lse = torch.where(l == 0, torch.full_like(l, math.inf), m + torch.log(l)).squeeze(-1)
    return o.to(out_dtype or q.dtype), lse.to(torch.float32 if out_dtype is None else out_dtype)


def attention_bwd_ref(grad_out: Tensor, q: Optional[Tensor], k: Optional[Tensor], v: Optional[Tensor],
                      views: QuantizedQKV, out: Tensor, lse: Tensor, attn_mask: Optional[Tensor], is_causal: bool,
                      scale: float, mask: int, *, dtype=torch.float64, emulate_bf16: bool = False,
                      do_views: Optional[tuple] = None, out_dtype=None) -> tuple[Tensor, Tensor, Tensor]:
    """Backward: (dQ, dK, dV) in the input dtype. ``q``/``k``/``v`` may be None where only the FP4 copy is
    needed (``saved_for_backward``). dO is quantized with 16x16 tiles (per-tensor global) when attn.dov or
    attn.pdo is NVFP4 (``do_views`` overrides that quantization, for tests)."""
    qk = bool(mask & QK)
    qa = _operand(q, views.q_codes, views.q_scales, views.q_global, qk, dtype)
    ka = _operand(k, views.k_codes, views.k_scales, views.k_global, qk, dtype)
    s = _scores(qa, ka, attn_mask, is_causal, scale, dtype)
    p = torch.exp(s - lse.to(dtype).unsqueeze(-1))
    groups = grad_out.shape[1] // views_heads(k, views)
    do = grad_out.to(dtype)
    if mask & (DOV | PDO):
        dov_ = do_views if do_views is not None else quantize_2d(grad_out)
        do_q = dequantize_2d(*dov_, dtype)
    dpdo = do_q if mask & PDO else do
    ddov = do_q if mask & DOV else do
    delta = (do * out.to(dtype)).sum(-1, keepdim=True)
    # dV = Pᵀ·dO (contraction over queries)
    pt = quantize_p(p, -2) if mask & PDO else _bf16(p, emulate_bf16)
    dv = pt.transpose(-2, -1) @ dpdo
    # dP = dO·Vᵀ
    va = _operand(v, views.v_codes, views.v_scales, views.v_global, bool(mask & DOV), dtype)
    dp = ddov @ va.repeat_interleave(groups, 1).transpose(-2, -1)
    ds = p * (dp - delta)
    # dQ = dS·K (contraction over keys); dK = dSᵀ·Q (contraction over queries)
    # under QK_1X16 the dS products take the saved 1x16 copies re-quantized in 16x16 tiles (valid along T)
    rq = not qk_tiles(mask)
    kd = _operand(k, views.k_codes, views.k_scales, views.k_global, bool(mask & DSK), dtype, rq)
    qd = _operand(q, views.q_codes, views.q_scales, views.q_global, bool(mask & DSQ), dtype, rq)
    ds_k = quantize_ds(ds, -1) if mask & DSK else _bf16(ds, emulate_bf16)
    ds_q = quantize_ds(ds, -2) if mask & DSQ else _bf16(ds, emulate_bf16)
    dq = (ds_k @ kd.repeat_interleave(groups, 1)) * scale
    dk = (ds_q.transpose(-2, -1) @ qd) * scale
    B, Hkv = dk.shape[0], dk.shape[1] // groups
    dk = dk.unflatten(1, (Hkv, groups)).sum(2)
    dv = dv.unflatten(1, (Hkv, groups)).sum(2)
    odt = out_dtype or grad_out.dtype
    return dq.to(odt), dk.to(odt), dv.to(odt)


#: what ``qk_transform`` may do to Q and K before they are quantized (the attention pass's ``QK_TRANSFORM``)
QK_TRANSFORMS = ("none", "smooth_k", "hadamard", "smooth_k+hadamard")
#: the blocks of Q's and K's copies: 16x16 tiles or 1x16 blocks along head_dim (``QK_1X16``; the pass's ``QK_BLOCKS``)
QK_BLOCK_CHOICES = ("16x16", "1x16")
#: Q-Attn's two Q, K settings and their values (the pass's module defaults, the backend options, TrainConfig)
QK_OPTIONS = {"qk_transform": QK_TRANSFORMS, "qk_blocks": QK_BLOCK_CHOICES}


def check_qk_option(name: str, value, what: Optional[str] = None):
    """``value`` if it is one of ``QK_OPTIONS[name]``, else ``ValueError`` naming the setting as ``what``."""
    if value not in QK_OPTIONS[name]:
        raise ValueError(f"{what or name} must be one of {QK_OPTIONS[name]}, got {value!r}")
    return value


def signed_hadamard(d: int, device=None, dtype=torch.float32, *, normalize: bool = True,
                    block: Optional[int] = None) -> Tensor:
    """The orthogonal [d, d] matrix ``diag(s) @ H_d / sqrt(d)`` (``H_d`` Sylvester's Hadamard matrix, entry (i, j)
    ``(-1)^popcount(i & j)``; ``s`` fixed signs, bit 13 of ``i * 0x9E3779B1`` mapped to +-1), built from
    integer ops only, so that a traced graph computes it rather than capturing a constant. ``d`` a power of two,
    or ``block`` (a power of two dividing ``d``) given: then ``H_block`` on each of the ``d / block`` diagonal
    blocks (zero elsewhere), over ``sqrt(block)``. ``normalize=False``: the matrix times ``sqrt(block or d)``, +-1 and
    0 entries, exact in every float dtype (its square is ``block I``).
    Every literal fits in int32 (Inductor's Triton code types an integer literal as int32 and rejects a larger one):
    bit 13 of a product depends only on the factors' low 14 bits, so the multiplier is 0x9E3779B1's, 0x39B1."""
    p = d if block is None else block
    if p < 1 or p & (p - 1) or d % p:
        raise ValueError(f"signed_hadamard needs a power-of-two size or block dividing it, got d={d}, block={block}")
    # H_p by Sylvester's doubling [[H, H], [H, -H]] (entry (i, j) = (-1)^popcount(i & j)), block-diagonal by a
    # Kronecker product; no shifts or bitwise ands: Inductor's vectorized CPU code miscompiles an int64 shift once a
    # recompile has made the head dim dynamic (tests/test_attention.py, test_qk_transform_compiles_for_cuda)
    i = torch.arange(d, device=device, dtype=torch.int64)
    h = torch.ones((1, 1), device=device, dtype=torch.int64)
    for _ in range(p.bit_length() - 1):
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    if p < d:
        h = torch.kron(torch.eye(d // p, device=device, dtype=torch.int64), h)
    signs = 1 - 2 * ((i * 0x39B1) // 8192 % 2)       # = bit 13 of i * 0x9E3779B1
    h = (h * signs[:, None]).to(dtype)
    return h / math.sqrt(p) if normalize else h


def hadamard_block(d: int) -> int:
    """The block size of Q-Attn's rotation of a head dim ``d``: the largest power of two dividing it (``d`` itself
    for 64 or 128; 32 for 96, 16 for 80 or 112)."""
    if d < 1:
        raise ValueError(f"hadamard_block needs a positive size, got {d}")
    return d & -d


def _times_last(x: Tensor, m: Tensor) -> Tensor:
    """``x @ m`` along x's last dim, without the copy ``matmul`` makes of a [B, H, T, D] view of dense [B, T, H, D]
    storage (what a pointwise op on such a view returns, e.g. K after smoothing): the product is taken in that
    storage order and comes back as the same kind of view. Q split from a fused QKV projection (rows 3C apart) is
    not dense in either order and still takes matmul's copy."""
    if x.dim() == 4 and not x.is_contiguous() and x.transpose(1, 2).is_contiguous():
        return (x.transpose(1, 2) @ m).transpose(1, 2)
    return x @ m


def smooth_rotate(x: Tensor, smooth: bool, block: int, transpose: bool = False) -> Tensor:
    """One tensor's part of :func:`qk_transform`: ``x`` [..., T, D] minus its mean over T (``smooth``; in FP32 at
    least, one rounding to x's dtype), then times the +-1 ``signed_hadamard(D, block=block)`` ``S`` (``block`` > 0;
    ``Sᵀ`` with ``transpose``) in x's dtype, one rounding. Both maps are linear and the centring projection is
    symmetric, so the gradient of ``smooth_rotate(x, s, b)`` is ``smooth_rotate(g, s, b, transpose=True)``.
    The reference of ``fp4compile::smooth_rotate`` (``fp4compile/ops.py``, Triton: ``kernels/rotate.py``)."""
    if smooth:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        x = (xf - xf.mean(dim=-2, keepdim=True)).to(x.dtype)
    if block:
        s = signed_hadamard(x.shape[-1], x.device, x.dtype, normalize=False, block=block)
        x = _times_last(x, s.T if transpose else s)
    return x


def in_op_transform(mask: int, d: int) -> tuple[bool, int]:
    """(K centred over T, the rotation's block or 0) of the Q, K transform that ``mask`` asks ``fp4compile::qattn``
    to apply itself (``QK_ROT``, ``K_SMOOTH``), for head dim ``d``."""
    return bool(mask & K_SMOOTH), hadamard_block(d) if mask & QK_ROT else 0


def in_op_transform_bits(how: str) -> int:
    """The ``fp4_roles`` bits that run :func:`qk_transform` ``how`` inside ``fp4compile::qattn``."""
    if how not in QK_TRANSFORMS:
        raise ValueError(f"qk_transform: how must be one of {QK_TRANSFORMS}, got {how!r}")
    return (QK_ROT if "hadamard" in how else 0) | (K_SMOOTH if "smooth_k" in how else 0)


def apply_in_op_transform(q: Tensor, k: Tensor, mask: int, op=None) -> tuple[Tensor, Tensor]:
    """Q and K as :func:`qk_transform` makes them for the bits ``mask`` carries (``op`` as there; the softmax
    scale's factor is the caller's, as with ``qk_transform``): what ``fp4compile::qattn`` quantizes under
    ``IN_OP_TRANSFORM``. The CPU implementation of the op, and its CUDA one where the kernels cannot fold it."""
    smooth, block = in_op_transform(mask, q.shape[-1])
    op = smooth_rotate if op is None else op
    if smooth or block:
        k = op(k, smooth, block)
    return (op(q, False, block) if block else q), k


def qk_transform(q: Tensor, k: Tensor, how: str = "none", op=None) -> tuple[Tensor, Tensor, float]:
    """Q and K changed so that NVFP4 quantizes them more finely, and the factor ``c`` that the softmax scale takes
    so that ``softmax(c * scale * q'·k'ᵀ) = softmax(scale * q·kᵀ)``:

    * ``"smooth_k"``: K minus its mean over the sequence (per batch, head and channel; SageAttention's smoothing),
      taken in FP32 and rounded once. Every score of query i moves by the same ``q_i·mean(k)``, which a softmax row
      does not see (masks and causality included). Autograd's dK is then ``dK' - mean(dK')``. ``c = 1``.
    * ``"hadamard"``: both times the +-1 :func:`signed_hadamard` ``S`` along head_dim (FlashAttention-3's incoherent
      processing): ``(qS)(kS)ᵀ = d q·kᵀ``, so ``c = 1 / d``; a channel of large values is spread over every channel
      of the 16x16 tile. ``S`` is exact in the inputs' dtype, so the product is one matmul in that dtype (FP32
      accumulation on GPUs) with one rounding; dQ, dK come back through ``Sᵀ``. NVFP4's scales follow the tensor's
      amax, so the factor ``sqrt(d)`` in Q, K's size does not change what is quantized. A head dim that is not a
      power of two (96, 80, ...) is rotated in diagonal blocks of :func:`hadamard_block` channels (``c = 1 /
      block``), each a whole number of 16-channel NVFP4 blocks.

    ``"none"`` returns q, k themselves and ``c = 1``. ``op``: what computes each tensor's part, called as
    ``op(x, smooth, block)`` (default :func:`smooth_rotate`; the pass gives ``fp4compile::smooth_rotate``)."""
    if how not in QK_TRANSFORMS:
        raise ValueError(f"qk_transform: how must be one of {QK_TRANSFORMS}, got {how!r}")
    if how == "none":
        return q, k, 1.0
    op = smooth_rotate if op is None else op
    p = hadamard_block(q.shape[-1]) if "hadamard" in how else 0
    k = op(k, "smooth_k" in how, p)
    if not p:
        return q, k, 1.0                              # Q untouched: no copy of it
    return op(q, False, p), k, 1.0 / p


def views_heads(k: Optional[Tensor], views: QuantizedQKV) -> int:
    """Number of KV heads, from K or from its FP4 copy."""
    for t in (k, views.k_codes, views.v_codes):
        if t is not None and t.dim() == 4:
            return t.shape[1]
    raise RuntimeError("qattn backward: neither K nor its FP4 copy was saved")


def sdpa_math_ref(q, k, v, attn_mask=None, is_causal=False, scale=None, dtype=torch.float64):
    """Plain (unquantized) attention in ``dtype``: the all-BF16 comparison target."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = _scores(q.to(dtype), k.to(dtype), attn_mask, is_causal, scale, dtype)
    groups = q.shape[1] // v.shape[1]
    return torch.softmax(s, -1) @ v.to(dtype).repeat_interleave(groups, 1)
