"""torch.library custom ops of fp4compile: schema, fake (meta) kernel, CPU reference, CUDA -> kernels/.

Ops are opaque to Inductor (not ``triton_op``; see ARCHITECTURE.md). Every op has a torch reference
implementation registered for all devices; the CUDA kernels in ``fp4compile/kernels/`` override it on CUDA
when Triton is available (:func:`register_cuda`).

The non-differentiable ops (quantize, quantize_dq, quantize_both(_dq), dequantize, gemm, gemm_dequantized,
dequantize_blocks, mm_f32; rht_signs in ``passes/linear.py``) are defined straight on the dispatcher
(:func:`_define`: schema inferred from the reference's annotations, the reference as the
``CompositeExplicitAutograd`` kernel, a fake kernel), not through ``torch.library.custom_op``: a compiled training
step calls them ~600 times, and custom_op routes every call through Python autograd, backend and dynamo-disable
wrappers (dispatch 20.6 us per call against 2.7 us this way on the H200 machine, ``bench/host_overhead.py``). The
differentiable Q-Attn ops keep ``custom_op`` (they need ``register_autograd`` for eager use).

    fp4compile::quantize(x, rounding, four_over_six, block2d, hadamard, signs, seed, transpose, amax=None)
        -> (codes uint8 [R, C/2], scales uint8 [R, C/16], global_scale fp32 [])
        x is 2D [M, K]; quantized along K, or along M when transpose=True (the "column-wise" copy that
        wgrad needs: the result is the quantization of x.T). hadamard=0 means no rotation.
        ``scales`` are the raw E4M3 bytes (``.view(torch.float8_e4m3fn)`` gives the values): the op ABI
        uses uint8 so every op passes ``torch.library.opcheck`` (CPU fp8 tensors lack the ops it compares with).
        ``seed`` (int64 0-dim) keys the stochastic rounding of "sr"/"ms_eden" through the counter-based hash of
        ``formats/random.py``: the same seed gives the same bytes on CPU (reference) and CUDA (Triton). With
        ``seed=None`` a fresh one is drawn from torch's default generator on x's device at every call (so a
        compiled graph re-randomizes every step); ``hadamard`` without ``signs`` likewise draws fresh signs.
        ``amax`` (fp32 0-dim, RTN / SR without a rotation): max|x| computed by the caller -- the backend's amax
        fusion (passes/amax.py) reduces it inside the Inductor kernel that produces x -- so the CUDA kernels read x
        once instead of twice (no amax pass). It must be max|x| exactly: the CPU reference checks that and raises
        otherwise; the CUDA path trusts it (no host sync). The same bytes as without it.
        The CUDA path does not check for NaN/Inf.
    fp4compile::quantize_both(x, hadamard, signs, seed, hadamard_t, signs_t, seed_t) -> six tensors
        = quantize(x, "ms_eden", hadamard=hadamard, signs=signs, seed=seed)
          + quantize(x, "ms_eden", hadamard=hadamard_t, signs=signs_t, seed=seed_t, transpose=True):
        one tensor's MS-EDEN copies along both dims (a gradient dY for dgrad and for wgrad; the backend merges
        such pairs, passes/reuse.py). CUDA: the row-wise pass 1 also writes x's transpose, which the second
        quantization reads (no separate transposing copy); the same bytes as the two ops.
    fp4compile::dequantize(codes, scales, global_scale, hadamard, signs, dtype, transpose) -> [R, C] in dtype
        (inverse RHT included); with transpose=True the same values stored transposed, a contiguous [C, R]
        tensor: the backward re-quantizes a forward copy along its other dim (W for dgrad, X for wgrad) from
        that, row-wise, instead of transposing a [R, C] dequantization in a separate copy.
    fp4compile::gemm(a_codes, a_scales, a_global, b_codes, b_scales, b_global, out_dtype, bias=None) -> [M, N]
        TN layout: A [M, K/2] and B [N, K/2], both quantized along K; C = A @ B^T * (a_global*b_global)
        (+ bias [N], in FP32 before the one rounding to out_dtype: a linear's bias in the GEMM's epilogue).
        CUDA (sm_90, no FP4 tensor cores): kernels/gemm.py, impl chosen per shape by ``choose_impl``: exact
        bf16 dequantization of both operands + a persistent TMA bf16 GEMM with the global scales in its FP32
        epilogue (split-K for long-K / small-output wgrad shapes), or in-register dequantization kernels.
    fp4compile::quantize_dq(x, rounding, four_over_six, block2d, hadamard, signs, seed, transpose, amax=None)
        -> (codes, scales, global_scale, dq bf16 [R, C]): quantize, plus dq = dequantize_blocks(codes, scales),
        the copy's exact q * S as a GEMM operand. CUDA: RTN / SR store dq from the quantize kernel itself (no
        dequantize pass reading the codes back); MS-EDEN stores it from its pass 2, which makes the scales.
    fp4compile::quantize_both_dq(x, hadamard, signs, seed, hadamard_t, signs_t, seed_t) -> eight tensors
        = quantize_dq's four of each of quantize_both's two copies (row-wise, then transposed).
    fp4compile::gemm_dequantized(a bf16 [M, K], a_global, b bf16 [N, K], b_global, out_dtype, bias=None) -> [M, N]
        = gemm of two copies given as their dequantize_blocks (quantize_dq's dq): C = A @ B^T * (a_global *
        b_global), FP32 accumulation, one rounding to out_dtype. CUDA: the bf16 half of the gemm op's
        "dequantize, then a bf16 GEMM" implementations (the TMA GEMM, its split-K form or cuBLAS, by shape).
    fp4compile::dequantize_blocks(codes, scales) -> bf16 [R, C]: exact q * S (no global scale)
    fp4compile::mm_f32(a bf16 [M, K], b bf16 [N, K]) -> fp32 [M, N] = a @ b^T, FP32 out (cuBLAS on CUDA)
        the two halves of the graph-level lowering ``gemm_lowering="dequant_mm"`` (passes/linear.py):
        mm_f32(dequantize_blocks(A), dequantize_blocks(B)) * (a_global * b_global) -> cast, as plain aten
        ops after the GEMM so that Inductor fuses the scale and the cast into the consumer.
"""
from __future__ import annotations

from typing import Optional

import torch

from .formats import nvfp4
from .formats.hadamard import inverse_rht

Tensor = torch.Tensor

#: the dispatcher fragment holding the non-differentiable fp4compile ops and their CUDA kernels
_LIB = torch.library.Library("fp4compile", "FRAGMENT")


def _define(name: str, reference, fake, tags=()):
    """Define ``fp4compile::<name>`` on the dispatcher and return its ``OpOverload``.

    The schema is inferred from ``reference``'s annotations (as ``custom_op`` would); ``reference`` is the
    kernel for every device (``CompositeExplicitAutograd``) until :func:`register_cuda` overrides CUDA;
    ``fake`` computes output shapes for fake/meta tensors. No autograd kernel (the outputs are codes, scales
    and GEMM results consumed inside compiled graphs): the reference runs under ``torch.no_grad()``, so its
    outputs never carry a ``grad_fn``, as with ``custom_op``.
    """
    _LIB.define(name + torch.library.infer_schema(reference, mutates_args=()), tags=tags)
    _LIB.impl(name, torch.no_grad()(reference), "CompositeExplicitAutograd")
    torch.library.register_fake(f"fp4compile::{name}", fake, lib=_LIB)
    return getattr(torch.ops.fp4compile, name).default


def register_cuda(name: str, fn) -> None:
    """Make ``fn`` the CUDA kernel of ``fp4compile::<name>`` (one of the ops made by :func:`_define`):
    registered directly at the ``CUDA`` dispatch key, so a call costs the dispatcher plus ``fn`` itself."""
    _LIB.impl(name, fn, "CUDA")


def takes_amax(rounding: str, hadamard: int) -> bool:
    """Whether ``fp4compile::quantize(_dq)`` takes a caller's ``amax`` for this scheme: RTN / SR without a rotation
    (MS-EDEN aligns its global scale after the block scales; under an RHT the amax is the rotated tensor's)."""
    return rounding != "ms_eden" and not hadamard


def check_amax(amax: Optional[Tensor], rounding: str, hadamard: int) -> None:
    """The ``amax`` argument of ``fp4compile::quantize(_dq)``: a 0-dim fp32 tensor, where :func:`takes_amax`."""
    if amax is None:
        return
    if not takes_amax(rounding, hadamard):
        raise ValueError(f"fp4compile::quantize: amax is for rtn / sr without hadamard, got rounding={rounding!r}, "
                         f"hadamard={hadamard}")
    if amax.dim() != 0 or amax.dtype != torch.float32:
        raise ValueError(f"fp4compile::quantize: amax must be a 0-dim float32 tensor, got {amax.dtype} "
                         f"{tuple(amax.shape)}")


def _quantize_reference(x: Tensor, rounding: str, four_over_six: bool, block2d: bool, hadamard: int,
                        signs: Optional[Tensor], seed: Optional[Tensor], transpose: bool,
                        amax: Optional[Tensor] = None):
    """The torch reference behind the op on every device without a kernel (CPU in CI).

    Same seed -> same bytes as the CUDA kernels (``formats/random.py``). ``seed=None`` draws a fresh int64
    seed from torch's default generator on ``x``'s device (so every call of a compiled graph is fresh);
    ``hadamard`` without ``signs`` draws fresh random signs the same way. A given ``amax`` must equal max|x|
    (checked here; the reference measures it itself).
    """
    from .formats.random import draw_seed
    from .formats.schemes import quantize_fp32

    if x.dim() != 2:
        raise ValueError(f"fp4compile::quantize takes a 2D tensor, got shape {tuple(x.shape)}")
    if rounding not in nvfp4.ROUNDINGS:
        raise ValueError(f"rounding must be one of {nvfp4.ROUNDINGS}, got {rounding!r}")
    check_amax(amax, rounding, hadamard)
    src = x.t() if transpose else x
    block = (16, 16) if block2d else 16
    nvfp4.check_input(src, block, hadamard or None, check_finite=False)
    if amax is not None:
        true = (x.abs().amax().to(torch.float32) if x.numel() else torch.zeros((), dtype=torch.float32)).cpu()
        given = amax.detach().cpu()
        if not (torch.equal(given, true) or (bool(given.isnan()) and bool(true.isnan()))):   # (NaN x: NaN amax)
            raise ValueError(f"fp4compile::quantize: amax={float(amax)} is not max|x|={float(true)}")
    dev = x.device
    if rounding != "rtn" and seed is None:
        seed = draw_seed(device=dev)
    t = quantize_fp32(src.to(torch.float32).cpu(), rounding=rounding, block=block,
                      four_over_six=four_over_six, hadamard=hadamard or None, generator=None,
                      signs=None if signs is None else signs.cpu(), seed=None if seed is None else seed.cpu())
    return (t.codes.contiguous().to(dev), t.scales.view(torch.uint8).contiguous().to(dev),
            t.global_scale.to(dev))


def _quantize_op(x: Tensor, rounding: str = "rtn", four_over_six: bool = False, block2d: bool = False,
                 hadamard: int = 0, signs: Optional[Tensor] = None, seed: Optional[Tensor] = None,
                 transpose: bool = False, amax: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    return _quantize_reference(x, rounding, four_over_six, block2d, hadamard, signs, seed, transpose, amax)


def _quantize_fake(x, rounding="rtn", four_over_six=False, block2d=False, hadamard=0, signs=None, seed=None,
                   transpose=False, amax=None):
    torch._check(x.dim() == 2, lambda: f"fp4compile::quantize takes a 2D tensor, got {x.dim()}D")
    check_amax(amax, rounding, hadamard)
    rows, cols = (x.shape[1], x.shape[0]) if transpose else (x.shape[0], x.shape[1])
    torch._check(cols % 16 == 0, lambda: f"quantized dim must be a multiple of 16, got {cols}")
    codes = x.new_empty((rows, cols // 2), dtype=torch.uint8)
    scales = x.new_empty((rows, cols // 16), dtype=torch.uint8)
    return codes, scales, x.new_empty((), dtype=torch.float32)


quantize = _define("quantize", _quantize_op, _quantize_fake)


def _quantize_dq_op(x: Tensor, rounding: str = "rtn", four_over_six: bool = False, block2d: bool = False,
                    hadamard: int = 0, signs: Optional[Tensor] = None, seed: Optional[Tensor] = None,
                    transpose: bool = False, amax: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    codes, scales, glob = _quantize_reference(x, rounding, four_over_six, block2d, hadamard, signs, seed, transpose,
                                              amax)
    return codes, scales, glob, _dequantize_blocks_op(codes, scales)


def _quantize_dq_fake(x, rounding="rtn", four_over_six=False, block2d=False, hadamard=0, signs=None, seed=None,
                      transpose=False, amax=None):
    codes, scales, glob = _quantize_fake(x, rounding, four_over_six, block2d, hadamard, signs, seed, transpose,
                                         amax)
    return codes, scales, glob, _dequantize_blocks_fake(codes, scales)


quantize_dq = _define("quantize_dq", _quantize_dq_op, _quantize_dq_fake)


def _quantize_both_op(x: Tensor, hadamard: int = 0, signs: Optional[Tensor] = None, seed: Optional[Tensor] = None,
                      hadamard_t: int = 0, signs_t: Optional[Tensor] = None, seed_t: Optional[Tensor] = None
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return (_quantize_reference(x, "ms_eden", False, False, hadamard, signs, seed, False)
            + _quantize_reference(x, "ms_eden", False, False, hadamard_t, signs_t, seed_t, True))


def _quantize_both_fake(x, hadamard=0, signs=None, seed=None, hadamard_t=0, signs_t=None, seed_t=None):
    return _quantize_fake(x) + _quantize_fake(x, transpose=True)


quantize_both = _define("quantize_both", _quantize_both_op, _quantize_both_fake)


def _quantize_both_dq_op(x: Tensor, hadamard: int = 0, signs: Optional[Tensor] = None,
                         seed: Optional[Tensor] = None, hadamard_t: int = 0, signs_t: Optional[Tensor] = None,
                         seed_t: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                    Tensor, Tensor]:
    c, s, g, ct, st, gt = _quantize_both_op(x, hadamard, signs, seed, hadamard_t, signs_t, seed_t)
    return c, s, g, _dequantize_blocks_op(c, s), ct, st, gt, _dequantize_blocks_op(ct, st)


def _quantize_both_dq_fake(x, hadamard=0, signs=None, seed=None, hadamard_t=0, signs_t=None, seed_t=None):
    c, s, g, ct, st, gt = _quantize_both_fake(x, hadamard, signs, seed, hadamard_t, signs_t, seed_t)
    return c, s, g, _dequantize_blocks_fake(c, s), ct, st, gt, _dequantize_blocks_fake(ct, st)


quantize_both_dq = _define("quantize_both_dq", _quantize_both_dq_op, _quantize_both_dq_fake)


def _dequantize_op(codes: Tensor, scales: Tensor, global_scale: Tensor, hadamard: int = 0,
                   signs: Optional[Tensor] = None, dtype: torch.dtype = torch.bfloat16,
                   transpose: bool = False) -> Tensor:
    if hadamard and signs is None:
        raise ValueError("dequantize with hadamard needs the signs used to quantize")
    if transpose and codes.dim() != 2:
        raise ValueError(f"dequantize with transpose=True takes 2D codes, got shape {tuple(codes.shape)}")
    vals = nvfp4.dequantize_codes(codes, scales.view(torch.float8_e4m3fn), global_scale)
    if hadamard:
        vals = inverse_rht(vals, signs)
    vals = vals.to(dtype)
    return vals.t().contiguous() if transpose else vals


def _dequantize_fake(codes, scales, global_scale, hadamard=0, signs=None, dtype=torch.bfloat16, transpose=False):
    if transpose:
        return codes.new_empty((codes.shape[1] * 2, codes.shape[0]), dtype=dtype)
    return codes.new_empty((*codes.shape[:-1], codes.shape[-1] * 2), dtype=dtype)


dequantize = _define("dequantize", _dequantize_op, _dequantize_fake)


def _gemm_reference(a_codes, a_scales, a_global, b_codes, b_scales, b_global, out_dtype, bias=None):
    """The gemm of two copies = :func:`_gemm_dequantized_op` of their exact bf16 q * S (dequantize_blocks)."""
    return _gemm_dequantized_op(_dequantize_blocks_op(a_codes, a_scales), a_global,
                                _dequantize_blocks_op(b_codes, b_scales), b_global, out_dtype, bias)


def _gemm_op(a_codes: Tensor, a_scales: Tensor, a_global: Tensor, b_codes: Tensor, b_scales: Tensor,
             b_global: Tensor, out_dtype: torch.dtype = torch.bfloat16, bias: Optional[Tensor] = None) -> Tensor:
    return _gemm_reference(a_codes, a_scales, a_global, b_codes, b_scales, b_global, out_dtype, bias)


def _check_bias(bias, n):
    """A GEMM's optional bias is a floating-point [n] vector (the ops' fakes and references, and kernels/gemm.py)."""
    if bias is not None:
        torch._check(bias.dim() == 1 and bias.shape[0] == n and bias.is_floating_point(),
                     lambda: f"gemm: bias must be a floating-point [N] = [{n}] vector, got {bias.dtype} "
                             f"{tuple(bias.shape)}")


def _gemm_fake(a_codes, a_scales, a_global, b_codes, b_scales, b_global, out_dtype=torch.bfloat16, bias=None):
    torch._check(a_codes.shape[-1] == b_codes.shape[-1], lambda: "gemm: K mismatch")
    _check_bias(bias, b_codes.shape[0])
    return a_codes.new_empty((a_codes.shape[0], b_codes.shape[0]), dtype=out_dtype)


gemm = _define("gemm", _gemm_op, _gemm_fake)


def _gemm_dequantized_check(a, b):
    torch._check(a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[1],
                 lambda: "gemm_dequantized: need [M, K] and [N, K] operands")
    torch._check(a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16,
                 lambda: f"gemm_dequantized takes bf16 operands (exact q * S), got {a.dtype}/{b.dtype}")


def _gemm_dequantized_op(a: Tensor, a_global: Tensor, b: Tensor, b_global: Tensor,
                         out_dtype: torch.dtype = torch.bfloat16, bias: Optional[Tensor] = None) -> Tensor:
    _gemm_dequantized_check(a, b)
    _check_bias(bias, b.shape[0])
    y = (a.float() @ b.float().t()) * (a_global.float() * b_global.float())
    return (y if bias is None else y + bias.float()).to(out_dtype)


def _gemm_dequantized_fake(a, a_global, b, b_global, out_dtype=torch.bfloat16, bias=None):
    _gemm_dequantized_check(a, b)
    _check_bias(bias, b.shape[0])
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


gemm_dequantized = _define("gemm_dequantized", _gemm_dequantized_op, _gemm_dequantized_fake)


def _dequantize_blocks_op(codes: Tensor, scales: Tensor) -> Tensor:
    """Packed NVFP4 ``[R, K/2]`` codes + ``[R, K/16]`` E4M3 bytes -> bf16 ``q * S`` (no global scale).

    Exact: an E2M1 value times an E4M3 scale has at most 6 significant bits and lies in [2^-10, 2688], so
    it is representable in bf16. The operand half of the "dequantize + cuBLAS" GEMM lowering
    (``passes/linear.py``); CUDA: one Triton pass (``kernels/gemm.dequantize_bf16``)."""
    torch._check(codes.dim() == 2 and scales.dim() == 2, lambda: "dequantize_blocks takes 2D codes and scales")
    one = torch.ones((), device=codes.device)
    return nvfp4.dequantize_codes(codes, scales.view(torch.float8_e4m3fn), one).to(torch.bfloat16)


def _dequantize_blocks_fake(codes, scales):
    torch._check(codes.dim() == 2 and scales.dim() == 2, lambda: "dequantize_blocks takes 2D codes and scales")
    torch._check(scales.shape[1] * 8 == codes.shape[1], lambda: "dequantize_blocks: scales must be [R, K/16]")
    return codes.new_empty((codes.shape[0], codes.shape[1] * 2), dtype=torch.bfloat16)


dequantize_blocks = _define("dequantize_blocks", _dequantize_blocks_op, _dequantize_blocks_fake)


def _mm_f32_op(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b.T`` of bf16 ``a [M, K]`` and ``b [N, K]`` with FP32 accumulation and an FP32 result (no
    rounding to bf16). CUDA: cuBLAS (``torch.mm(..., out_dtype=torch.float32)``); elsewhere FP32 matmul of
    the upcast operands (exact products of bf16 values, FP32 sums)."""
    torch._check(a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[1], lambda: "mm_f32: need [M, K], [N, K]")
    return a.float() @ b.float().t()


def _mm_f32_fake(a, b):
    torch._check(a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[1], lambda: "mm_f32: need [M, K], [N, K]")
    return a.new_empty((a.shape[0], b.shape[0]), dtype=torch.float32)


@torch.no_grad()
def _mm_f32_cuda(a, b):
    return torch.mm(a, b.t(), out_dtype=torch.float32)


mm_f32 = _define("mm_f32", _mm_f32_op, _mm_f32_fake)
register_cuda("mm_f32", _mm_f32_cuda)


def _check_finite_op(global_scale: Tensor, where: str) -> Tensor:
    """A copy of an NVFP4 copy's global decode scale, after checking that it is finite (the backend option
    ``check_finite``, ``passes/finite.py``). A NaN or Inf element in a quantized tensor makes its global non-finite
    in every scheme (``formats/schemes.py``, "Non-finite inputs"), so this raises ``FloatingPointError`` naming
    ``where`` (the GEMMs the copy feeds) at the first quantization a NaN or Inf reaches. Reads the value on the
    host: not for CUDA graphs."""
    if not bool(torch.isfinite(global_scale).all()):
        raise FloatingPointError(
            f"fp4compile: NaN or Inf reached an NVFP4 quantization (global scale {float(global_scale)}): the operand "
            f"of {where} (backend option check_finite)")
    return global_scale.clone()


def _check_finite_fake(global_scale, where):
    return torch.empty_like(global_scale)


check_finite = _define("check_finite", _check_finite_op, _check_finite_fake)


def _register_cuda_kernels():
    """Attach the Triton implementations on CUDA (no-op without Triton)."""
    from torch.utils._triton import has_triton

    if not has_triton():
        return
    from .kernels import register_cuda  # noqa: F401  (each kernel module registers itself on import)


_register_cuda_kernels()


# =========================================================================================================
# Q-Attn: fp4compile::qattn / fp4compile::qattn_bwd  (numerics: kernels/attention_ref.py; kernels: attention.py)
#
#   fp4compile::qattn(q [B,H,Tq,D], k [B,Hkv,Tk,D], v [B,Hkv,Tk,D], attn_mask?, is_causal, scale, fp4_roles)
#       -> (out [B,H,Tq,D] (stored as [B,Tq,H,D], like SDPA's: attention_ref.bthd_empty), lse fp32 [B,H,Tq],
#           q_codes u8 [B,H,Tq,D/2], q_scales u8 [B,H,Tq,D/16], q_global f32 [],   (16x16 tiles, or 1x16: bit 6)
#           k_codes, k_scales, k_global, v_codes, v_scales, v_global)
#       fp4_roles: bit mask over (attn.qk, attn.pv, attn.dov, attn.pdo, attn.dsk, attn.dsq) = bits 0..5; bit 6
#       (attention_ref.QK_1X16): Q's and K's copies in 1x16 blocks along head_dim instead of 16x16 tiles; bits 7, 8
#       (attention_ref.QK_ROT, K_SMOOTH): the Q, K transform applied by the op to q, k before quantizing them (needs
#       attn.qk, attn.dsk, attn.dsq in NVFP4; the copies are then of the transformed tensors, dq, dk are for q, k).
#       A tensor with no NVFP4 consumer gets codes/scales of shape [0] and global 0.
#       attn_mask: bool (True = attend) or additive float, broadcastable to [B,H,Tq,Tk]; not differentiated.
#   fp4compile::qattn_bwd(grad_out, q?, k?, v?, <the nine view tensors>?, out, lse, attn_mask?, is_causal,
#                         scale, fp4_roles) -> (dq, dk, dv)   (each stored as [B, T, heads, D])
#       consumes exactly what qattn's autograd saved: the FP4 views of Q/K (and V when attn.dov is NVFP4) and
#       the BF16 tensors only where a BF16 role needs them (see attention_ref.saved_for_backward).
# =========================================================================================================
from .kernels import attention_ref as _aref  # noqa: E402


def _qattn_views(views) -> "_aref.QuantizedQKV":
    out = []
    for i, t in enumerate(views):
        if t is None:
            t = torch.zeros((), dtype=torch.float32) if i % 3 == 2 else torch.empty((0,), dtype=torch.uint8)
        out.append(t)
    return _aref.QuantizedQKV(*out)


def _bthd(t: Tensor) -> Tensor:
    """``t`` in the Q-Attn output layout (``attention_ref.bthd_empty``)."""
    return _aref.bthd_empty(*t.shape, t.dtype, t.device).copy_(t)


def _qattn_check(q: Tensor, k: Tensor, v: Tensor, fp4_roles: int):
    torch._check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4,
                 lambda: f"qattn takes [B, H, T, D] tensors, got {q.dim()}D/{k.dim()}D/{v.dim()}D")
    torch._check(q.shape[-1] == k.shape[-1] == v.shape[-1], lambda: "qattn: q, k, v head dims differ")
    torch._check(q.shape[-1] % 16 == 0, lambda: f"qattn: head dim must be a multiple of 16, got {q.shape[-1]}")
    torch._check(k.shape[1] == v.shape[1] and q.shape[1] % k.shape[1] == 0,
                 lambda: f"qattn: {q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads")
    torch._check(0 <= fp4_roles < _aref.MASK_LIMIT,
                 lambda: f"qattn: fp4_roles must be a 6-bit role mask, plus bits 6 (QK_1X16), 7 (QK_ROT) and 8 "
                         f"(K_SMOOTH), got {fp4_roles}")
    torch._check(not fp4_roles & _aref.IN_OP_TRANSFORM or fp4_roles & _aref.QK_READERS == _aref.QK_READERS,
                 lambda: f"qattn: the Q, K transform inside the op (bits 7, 8) needs attn.qk, attn.dsk and attn.dsq in "
                         f"NVFP4, got fp4_roles={fp4_roles}")


@torch.library.custom_op("fp4compile::qattn", mutates_args=())
def qattn(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor], is_causal: bool, scale: float,
          fp4_roles: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                   Tensor]:
    """Mixed-precision attention forward (torch reference: FP32 with the kernels' BF16 roundings)."""
    return _qattn_fwd_ref(q, k, v, attn_mask, is_causal, scale, fp4_roles)


def _qattn_fwd_ref(q, k, v, attn_mask, is_causal, scale, fp4_roles):
    _qattn_check(q, k, v, fp4_roles)
    q, k = _aref.apply_in_op_transform(q, k, fp4_roles)
    views = _aref.quantize_qkv(q, k, v, fp4_roles)
    out, lse = _aref.attention_fwd_ref(q, k, v, views, attn_mask, is_causal, scale, fp4_roles,
                                       dtype=torch.float32, emulate_bf16=True)
    return (_bthd(out), lse, *views)


@qattn.register_fake
def _(q, k, v, attn_mask, is_causal, scale, fp4_roles):
    _qattn_check(q, k, v, fp4_roles)
    B, H, Tq, D = q.shape
    out = [_aref.bthd_empty(B, H, Tq, D, q.dtype, q.device), q.new_empty((B, H, Tq), dtype=torch.float32)]
    for x, need in zip((q, k, v), _aref.needs_fp4(fp4_roles)):
        if need:
            out += [x.new_empty((*x.shape[:-1], D // 2), dtype=torch.uint8),
                    x.new_empty((*x.shape[:-1], D // 16), dtype=torch.uint8)]
        else:
            out += [x.new_empty((0,), dtype=torch.uint8), x.new_empty((0,), dtype=torch.uint8)]
        out.append(x.new_empty((), dtype=torch.float32))
    return tuple(out)


@torch.library.custom_op("fp4compile::qattn_bwd", mutates_args=())
def qattn_bwd(grad_out: Tensor, q: Optional[Tensor], k: Optional[Tensor], v: Optional[Tensor],
              q_codes: Optional[Tensor], q_scales: Optional[Tensor], q_global: Optional[Tensor],
              k_codes: Optional[Tensor], k_scales: Optional[Tensor], k_global: Optional[Tensor],
              v_codes: Optional[Tensor], v_scales: Optional[Tensor], v_global: Optional[Tensor],
              out: Tensor, lse: Tensor, attn_mask: Optional[Tensor], is_causal: bool, scale: float,
              fp4_roles: int) -> tuple[Tensor, Tensor, Tensor]:
    """Mixed-precision attention backward (torch reference)."""
    return _qattn_bwd_ref(grad_out, q, k, v, q_codes, q_scales, q_global, k_codes, k_scales, k_global, v_codes,
                          v_scales, v_global, out, lse, attn_mask, is_causal, scale, fp4_roles)


def _qattn_bwd_ref(grad_out, q, k, v, q_codes, q_scales, q_global, k_codes, k_scales, k_global, v_codes, v_scales,
                   v_global, out, lse, attn_mask, is_causal, scale, fp4_roles):
    views = _qattn_views((q_codes, q_scales, q_global, k_codes, k_scales, k_global, v_codes, v_scales, v_global))
    grads = _aref.attention_bwd_ref(grad_out, q, k, v, views, out, lse, attn_mask, is_causal, scale, fp4_roles,
                                    dtype=torch.float32, emulate_bf16=True)
    return tuple(_bthd(g) for g in grads)


def _qattn_kv_shape(k, k_codes, v, v_codes):
    for t, packed in ((k, False), (k_codes, True), (v, False), (v_codes, True)):
        if t is not None and t.dim() == 4:
            return (*t.shape[:-1], t.shape[-1] * 2) if packed else tuple(t.shape)
    raise RuntimeError("qattn_bwd: neither K/V nor their FP4 copies were given")


@qattn_bwd.register_fake
def _(grad_out, q, k, v, q_codes, q_scales, q_global, k_codes, k_scales, k_global, v_codes, v_scales, v_global,
      out, lse, attn_mask, is_causal, scale, fp4_roles):
    kv = _qattn_kv_shape(k, k_codes, v, v_codes)
    dt, dev = grad_out.dtype, grad_out.device
    return (_aref.bthd_empty(*grad_out.shape, dt, dev), _aref.bthd_empty(*kv, dt, dev),
            _aref.bthd_empty(*kv, dt, dev))


def _qattn_setup_context(ctx, inputs, output):
    q, k, v, attn_mask, is_causal, scale, fp4_roles = inputs
    out, lse = output[0], output[1]
    views = list(output[2:])
    need = _aref.saved_for_backward(fp4_roles)
    keep = []
    for i, (name, x) in enumerate((("q", q), ("k", k), ("v", v))):
        bf16, fp4 = need[name]
        keep.append(x if bf16 else None)
        if not fp4:
            views[3 * i:3 * i + 3] = [None, None, None]
    ctx.save_for_backward(*keep, *views, out, lse, attn_mask)
    ctx.qattn_args = (is_causal, scale, fp4_roles)
    # LSE and the FP4 views are never differentiated: no zero-filled gradients for them (one fill kernel each)
    ctx.set_materialize_grads(False)


def _qattn_backward(ctx, grad_out, *unused):
    saved = ctx.saved_tensors
    q, k, v = saved[:3]
    views = saved[3:12]
    out, lse, attn_mask = saved[12:15]
    is_causal, scale, fp4_roles = ctx.qattn_args
    if grad_out is None:  # the output itself was not used
        return None, None, None, None, None, None, None
    dq, dk, dv = torch.ops.fp4compile.qattn_bwd(grad_out, q, k, v, *views, out, lse, attn_mask,
                                                is_causal, scale, fp4_roles)
    dq, dk = _in_op_transform_grads(dq, dk, fp4_roles)
    return dq, dk, dv, None, None, None, None


def _in_op_transform_grads(dq: Tensor, dk: Tensor, fp4_roles: int) -> tuple[Tensor, Tensor]:
    """dQ, dK for the q, k the op was given, from those for the transformed Q', K' (``qattn_bwd``'s) under
    ``IN_OP_TRANSFORM``: the transform's transpose by ``fp4compile::smooth_rotate``, the op the unfused graph's
    autograd runs."""
    rot = torch.ops.fp4compile.smooth_rotate
    return _aref.apply_in_op_transform(dq, dk, fp4_roles, op=lambda x, smooth, block: rot(x, smooth, block, True))


qattn.register_autograd(_qattn_backward, setup_context=_qattn_setup_context)


def _register_qattn_cuda():
    from .kernels import attention as _attn

    if _attn.triton is None:
        return

    qattn.register_kernel("cuda")(_qattn_fwd_cuda)
    qattn_bwd.register_kernel("cuda")(_qattn_bwd_cuda)
    _IMPLS["cuda"] = (_qattn_fwd_cuda, _qattn_bwd_cuda)


def _qattn_fwd_cuda(q, k, v, attn_mask, is_causal, scale, fp4_roles):
    from .kernels import attention as _attn

    _qattn_check(q, k, v, fp4_roles)
    if q.shape[-1] not in _attn.SUPPORTED_HEAD_DIMS:
        raise ValueError(f"qattn CUDA kernel supports head dims {_attn.SUPPORTED_HEAD_DIMS}, got {q.shape[-1]}")
    # the FP4 copies (saved for backward) of every tensor with an NVFP4 consumer, and, where the forward
    # reads it, its bf16 code x scale (transient): two launches for all of them; under IN_OP_TRANSFORM those two
    # launches apply the Q, K transform in registers (or, where they cannot, fp4compile::smooth_rotate first)
    smooth, block = _aref.in_op_transform(fp4_roles, q.shape[-1])
    folded = _attn.folds_transform(q, block)
    if (smooth or block) and not folded:
        q, k = _aref.apply_in_op_transform(q, k, fp4_roles, op=lambda x, s, b: smooth_rotate(x, s, b, False))
    transforms = {"q": (False, block), "k": (smooth, block)} if folded else {}
    tiles = _aref.qk_tiles(fp4_roles)
    todo = [(name, x, bool(fp4_roles & r), t) for name, x, need, r, t in
            zip("qkv", (q, k, v), _aref.needs_fp4(fp4_roles), (_aref.QK, _aref.QK, _aref.PV), (tiles, tiles, True))
            if need]
    done = dict(zip((t[0] for t in todo), _attn.quantize_many(
        [t[1] for t in todo], [t[2] for t in todo], [t[3] for t in todo],
        [transforms.get(t[0], (False, 0)) for t in todo]) if todo else ()))
    vals, deq, zero = [], {}, 0
    for i, (name, x) in enumerate((("q", q), ("k", k), ("v", v))):
        if name in done:
            vals += done[name][:3]
            if len(done[name]) == 4:
                deq[name] = done[name][3]
        else:  # empty codes/scales; the global is set to 0 by the forward kernel (no fill launch)
            vals += [x.new_empty((0,), dtype=torch.uint8), x.new_empty((0,), dtype=torch.uint8),
                     x.new_empty((), dtype=torch.float32)]
            zero |= 1 << i
    views = _aref.QuantizedQKV(*vals)
    out, lse = _attn.attention_fwd(q, k, v, views, attn_mask, is_causal, scale, fp4_roles, dequantized=deq,
                                   zero_globals=zero)
    return (out, lse, *views)


def _qattn_bwd_cuda(grad_out, q, k, v, q_codes, q_scales, q_global, k_codes, k_scales, k_global, v_codes, v_scales,
                v_global, out, lse, attn_mask, is_causal, scale, fp4_roles):
    from .kernels import attention as _attn
    from .kernels.launch import placeholder

    views = [q_codes, q_scales, q_global, k_codes, k_scales, k_global, v_codes, v_scales, v_global]
    dev = grad_out.device
    # copies that were not saved are never read by the kernels (their roles are BF16): placeholders
    g0, c0 = placeholder(dev, torch.float32), placeholder(dev, torch.uint8)
    views = _aref.QuantizedQKV(*[t if t is not None else (g0 if i % 3 == 2 else c0)
                                 for i, t in enumerate(views)])
    return _attn.attention_bwd(grad_out, q, k, v, views, out, lse, attn_mask, is_causal, scale, fp4_roles)


#: per device type: (forward, backward) implementations behind the ops, for the eager path below
_IMPLS = {}


class _QAttnEager(torch.autograd.Function):
    """Eager-mode twin of ``fp4compile::qattn`` + its registered autograd: the same implementation functions
    (Triton on CUDA, the torch reference elsewhere), the same saved tensors (``_qattn_setup_context``), without
    the custom-op dispatch layers (Python dispatcher, autograd wrapper, alias checks), which cost more host time
    than the kernels at T <= 2048. Used by ``passes.attention.qattn_sdpa`` outside torch.compile only; traced
    graphs always contain the op."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, is_causal, scale, fp4_roles):
        fwd = _IMPLS.get(q.device.type, (_qattn_fwd_ref, _qattn_bwd_ref))[0]
        res = fwd(q, k, v, attn_mask, is_causal, scale, fp4_roles)
        _qattn_setup_context(ctx, (q, k, v, attn_mask, is_causal, scale, fp4_roles), res)
        return res[0]

    @staticmethod
    def backward(ctx, grad_out):
        if grad_out is None:
            return None, None, None, None, None, None, None
        saved = ctx.saved_tensors
        is_causal, scale, fp4_roles = ctx.qattn_args
        bwd = _IMPLS.get(grad_out.device.type, (_qattn_fwd_ref, _qattn_bwd_ref))[1]
        dq, dk, dv = bwd(grad_out, *saved[:12], saved[12], saved[13], saved[14], is_causal, scale,
                         fp4_roles)
        dq, dk = _in_op_transform_grads(dq, dk, fp4_roles)
        return dq, dk, dv, None, None, None, None


def qattn_eager(q, k, v, attn_mask, is_causal: bool, scale: float, fp4_roles: int) -> Tensor:
    """The attention output of ``fp4compile::qattn`` through ``_QAttnEager`` (eager callers only)."""
    return _QAttnEager.apply(q, k, v, attn_mask, is_causal, scale, fp4_roles)


_register_qattn_cuda()


# =========================================================================================================
# Q-Attn's Q, K transform: fp4compile::smooth_rotate  (numerics: attention_ref.smooth_rotate; kernel: rotate.py)
#
#   fp4compile::smooth_rotate(x [B,H,T,D], smooth, block, transpose) -> [B,H,T,D] (stored as [B,T,H,D])
#       = (x - mean over T if smooth) @ (S, or Sᵀ with transpose), S the +-1 signed Hadamard in diagonal blocks
#       of ``block`` channels (block 0: no rotation); one rounding after each step, FP32 in between.
#       Differentiable: its gradient is the same op with ``transpose`` flipped (both maps are linear, the centring
#       symmetric). Used by passes.attention.qattn_sdpa when QK_TRANSFORM_IMPL is "op" (the default).
# =========================================================================================================
def _smooth_rotate_check(x: Tensor, smooth: bool, block: int):
    torch._check(x.dim() == 4, lambda: f"smooth_rotate takes [B, H, T, D] tensors, got {x.dim()}D")
    torch._check(x.dtype.is_floating_point, lambda: f"smooth_rotate takes a float tensor, got {x.dtype}")
    torch._check(bool(smooth) or block > 0, lambda: "smooth_rotate: nothing to do (smooth=False, block=0)")
    torch._check(block == 0 or (block & (block - 1) == 0 and x.shape[-1] % block == 0),
                 lambda: f"smooth_rotate: block must be 0 or a power of two dividing {x.shape[-1]}, got {block}")


def _smooth_rotate_ref(x: Tensor, smooth: bool, block: int, transpose: bool) -> Tensor:
    return _bthd(_aref.smooth_rotate(x, smooth, block, transpose))


@torch.library.custom_op("fp4compile::smooth_rotate", mutates_args=())
def smooth_rotate(x: Tensor, smooth: bool, block: int, transpose: bool) -> Tensor:
    """See the block comment above; the torch reference (CPU and any device without the kernel)."""
    _smooth_rotate_check(x, smooth, block)
    return _smooth_rotate_ref(x, smooth, block, transpose)


@smooth_rotate.register_fake
def _smooth_rotate_fake(x, smooth, block, transpose):
    _smooth_rotate_check(x, smooth, block)
    return _aref.bthd_empty(*x.shape, x.dtype, x.device)


def _smooth_rotate_setup(ctx, inputs, output):
    ctx.args = inputs[1:]


def _smooth_rotate_backward(ctx, grad):
    smooth, block, transpose = ctx.args
    return torch.ops.fp4compile.smooth_rotate(grad, smooth, block, not transpose), None, None, None


smooth_rotate.register_autograd(_smooth_rotate_backward, setup_context=_smooth_rotate_setup)


def _smooth_rotate_cuda(x, smooth, block, transpose):
    from .kernels import rotate as _rot

    _smooth_rotate_check(x, smooth, block)
    impl = _rot.smooth_rotate if _rot.supported(x, block) else _smooth_rotate_ref
    return impl(x, smooth, block, transpose)


def _register_smooth_rotate_cuda():
    """The CUDA kernel where Triton is present, as for the Q-Attn ops (kernels/rotate.py is imported at the first
    call: importing it here would close a cycle, kernels.attention -> kernels.quantize -> ops -> rotate)."""
    import importlib.util

    if importlib.util.find_spec("triton") is not None:
        smooth_rotate.register_kernel("cuda")(_smooth_rotate_cuda)


_register_smooth_rotate_cuda()
