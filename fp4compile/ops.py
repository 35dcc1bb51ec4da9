"""torch.library custom ops of fp4compile: schema, fake (meta) kernel, CPU reference, CUDA -> kernels/.

Ops are opaque to Inductor (``torch.library.custom_op``, not ``triton_op``; see ARCHITECTURE.md). Every op
has a torch reference implementation registered for all devices; the CUDA kernels in
``fp4compile/kernels/`` override it on CUDA when Triton is available.

    fp4compile::quantize(x, rounding, four_over_six, block2d, hadamard, signs, seed, transpose)
        -> (codes uint8 [R, C/2], scales uint8 [R, C/16], global_scale fp32 [])
        x is 2D [M, K]; quantized along K, or along M when transpose=True (the "column-wise" copy that
        wgrad needs: the result is the quantization of x.T). hadamard=0 means no rotation.
        ``scales`` are the raw E4M3 bytes (``.view(torch.float8_e4m3fn)`` gives the values): the op ABI
        uses uint8 so every op passes ``torch.library.opcheck`` (CPU fp8 tensors lack the ops it compares with).
    fp4compile::dequantize(codes, scales, global_scale, hadamard, signs, dtype) -> [R, C] in dtype
    fp4compile::gemm(a_codes, a_scales, a_global, b_codes, b_scales, b_global, out_dtype) -> [M, N]
        TN layout: A [M, K/2] and B [N, K/2], both quantized along K; C = A @ B^T * (a_global*b_global).
"""
from __future__ import annotations

from typing import Optional

import torch

from .formats import nvfp4
from .formats.hadamard import inverse_rht

Tensor = torch.Tensor


def _quantize_reference(x: Tensor, rounding: str, four_over_six: bool, block2d: bool, hadamard: int,
                        signs: Optional[Tensor], seed: Optional[Tensor], transpose: bool):
    """The torch reference behind the op on every device without a kernel (CPU in CI).

    Same seed -> same bytes as the CUDA kernels (``formats/random.py``). ``seed=None`` draws a fresh int64
    seed from torch's default generator on ``x``'s device (so every call of a compiled graph is fresh);
    ``hadamard`` without ``signs`` draws fresh random signs the same way.
    """
    from .formats.random import draw_seed
    from .formats.schemes import quantize_fp32

    if x.dim() != 2:
        raise ValueError(f"fp4compile::quantize takes a 2D tensor, got shape {tuple(x.shape)}")
    if rounding not in nvfp4.ROUNDINGS:
        raise ValueError(f"rounding must be one of {nvfp4.ROUNDINGS}, got {rounding!r}")
    src = x.t() if transpose else x
    block = (16, 16) if block2d else 16
    nvfp4.check_input(src, block, hadamard or None, check_finite=False)
    dev = x.device
    if rounding != "rtn" and seed is None:
        seed = draw_seed(device=dev)
    t = quantize_fp32(src.to(torch.float32).cpu(), rounding=rounding, block=block,
                      four_over_six=four_over_six, hadamard=hadamard or None, generator=None,
                      signs=None if signs is None else signs.cpu(), seed=None if seed is None else seed.cpu())
    return (t.codes.contiguous().to(dev), t.scales.view(torch.uint8).contiguous().to(dev),
            t.global_scale.to(dev))


@torch.library.custom_op("fp4compile::quantize", mutates_args=())
def quantize(x: Tensor, rounding: str = "rtn", four_over_six: bool = False, block2d: bool = False,
             hadamard: int = 0, signs: Optional[Tensor] = None, seed: Optional[Tensor] = None,
             transpose: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    return _quantize_reference(x, rounding, four_over_six, block2d, hadamard, signs, seed, transpose)


@quantize.register_fake
def _(x, rounding="rtn", four_over_six=False, block2d=False, hadamard=0, signs=None, seed=None, transpose=False):
    torch._check(x.dim() == 2, lambda: f"fp4compile::quantize takes a 2D tensor, got {x.dim()}D")
    rows, cols = (x.shape[1], x.shape[0]) if transpose else (x.shape[0], x.shape[1])
    torch._check(cols % 16 == 0, lambda: f"quantized dim must be a multiple of 16, got {cols}")
    codes = x.new_empty((rows, cols // 2), dtype=torch.uint8)
    scales = x.new_empty((rows, cols // 16), dtype=torch.uint8)
    return codes, scales, x.new_empty((), dtype=torch.float32)


@torch.library.custom_op("fp4compile::dequantize", mutates_args=())
def dequantize(codes: Tensor, scales: Tensor, global_scale: Tensor, hadamard: int = 0,
               signs: Optional[Tensor] = None, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    vals = nvfp4.dequantize_codes(codes, scales.view(torch.float8_e4m3fn), global_scale)
    if hadamard:
        vals = inverse_rht(vals, signs)
    return vals.to(dtype)


@dequantize.register_fake
def _(codes, scales, global_scale, hadamard=0, signs=None, dtype=torch.bfloat16):
    return codes.new_empty((*codes.shape[:-1], codes.shape[-1] * 2), dtype=dtype)


def _gemm_reference(a_codes, a_scales, a_global, b_codes, b_scales, b_global, out_dtype):
    one = torch.ones((), device=a_codes.device)
    a = nvfp4.dequantize_codes(a_codes, a_scales.view(torch.float8_e4m3fn), one)
    b = nvfp4.dequantize_codes(b_codes, b_scales.view(torch.float8_e4m3fn), one)
    return ((a @ b.t()) * (a_global.float() * b_global.float())).to(out_dtype)


@torch.library.custom_op("fp4compile::gemm", mutates_args=())
def gemm(a_codes: Tensor, a_scales: Tensor, a_global: Tensor, b_codes: Tensor, b_scales: Tensor,
         b_global: Tensor, out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    return _gemm_reference(a_codes, a_scales, a_global, b_codes, b_scales, b_global, out_dtype)


@gemm.register_fake
def _(a_codes, a_scales, a_global, b_codes, b_scales, b_global, out_dtype=torch.bfloat16):
    torch._check(a_codes.shape[-1] == b_codes.shape[-1], lambda: "gemm: K mismatch")
    return a_codes.new_empty((a_codes.shape[0], b_codes.shape[0]), dtype=out_dtype)


def _register_cuda_kernels():
    """Attach the Triton implementations on CUDA (no-op without Triton)."""
    from torch.utils._triton import has_triton

    if not has_triton():
        return
    from .kernels import register_cuda  # noqa: F401  (each kernel module registers itself on import)


_register_cuda_kernels()
