"""Triton kernel of ``fp4compile::smooth_rotate``: Q-Attn's Q, K transform in one pass per tensor.

The numerics are ``attention_ref.smooth_rotate``'s: ``x`` [B, H, T, D] (any strides, the last dim contiguous)
minus its FP32 mean over T (``smooth``), rounded once to x's dtype, then times the +-1 signed Hadamard ``S`` of
``attention_ref.signed_hadamard(D, block=block)`` (or ``Sᵀ``) on tensor cores with FP32 accumulation, rounded once.
The mean is one ``torch.mean(x, -2, dtype=float32)`` (a read of x; ``MEAN_IMPL = "torch"``, the default) or
``_col_sums_kernel``'s deterministic partial sums over chunks of T that the rotation kernel adds up (``"triton"``,
``FP4COMPILE_ROTATE_MEAN=triton``: the same read at the kernel's bandwidth instead of torch's strided reduction,
measured at ~0.7 TB/s in session 39; timed in session 43: -0.12 ms of the 124M step's 48.70, 95 % CI -0.25 ... +0.05,
and slower than torch's mean at B=4, T=4096, D=128, so it stays off); the kernel then reads each [BT, D] tile once,
builds ``S`` in registers from the same integer formula, and writes the result in Q-Attn's layout
(``attention_ref.bthd_empty``). Inductor's version of the same transform (``FP4COMPILE_QK_TRANSFORM_IMPL=torch``)
takes a copy of Q split from a fused projection, a separate subtraction pass and a cuBLAS GEMM per tensor.
Sums of 64 or 128 products may round differently from cuBLAS's or torch's order (FP32), so a value near a BF16
rounding midpoint can land one BF16 step away from the reference's.
"""
from __future__ import annotations

import os

import torch

from .attention_ref import bthd_empty
from .launch import cdiv, placeholder, stable_cache_keys

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU wheel without Triton: only the torch reference is available
    triton = None

Tensor = torch.Tensor
#: head dims the kernel takes (tl.arange needs a power of two; tl.dot at least 16); others use the reference
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
BT = 64
#: how K's mean over T is taken: "torch" (``torch.mean``) or "triton" (``_col_sums_kernel``); read at each call
MEAN_IMPL = os.environ.get("FP4COMPILE_ROTATE_MEAN", "torch")
MEAN_IMPLS = ("torch", "triton")
#: the partial sums' grid aims at this many programs (a few waves of the H200's 132 SMs)
MEAN_PROGRAMS = 512

if triton is not None:
    from .attention import _cast_like, _mma, _signed_hadamard

    @triton.jit
    def _col_sums_kernel(X, P, T, H, sxb, sxh, sxt, TILES: tl.constexpr, D: tl.constexpr, BT: tl.constexpr):
        """Grid (chunks of T, batch*head): P[bh, chunk, :] = the FP32 sum over the chunk's TILES x BT rows of x
        (rows past T count 0). Each chunk's sum is its own; no atomics, so the mean is the same on every run."""
        pid_c = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        offs_d = tl.arange(0, D)
        acc = tl.zeros([D], dtype=tl.float32)
        for i in range(TILES):
            offs_t = (pid_c * TILES + i) * BT + tl.arange(0, BT)
            x = tl.load(X + b * sxb + h * sxh + offs_t[:, None] * sxt + offs_d[None, :], mask=(offs_t < T)[:, None],
                        other=0.0)
            acc += tl.sum(x.to(tl.float32), axis=0)
        tl.store(P + (pid_bh * tl.num_programs(0) + pid_c) * D + offs_d, acc)

    @triton.jit
    def _smooth_rotate_kernel(X, M, Y, T, H, sxb, sxh, sxt, syb, syh, syt,
                              SMOOTH: tl.constexpr, BLOCK: tl.constexpr, LOGB: tl.constexpr,
                              TRANS: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, NC: tl.constexpr,
                              NCP: tl.constexpr):
        """Grid (time blocks, batch*head): y = (x - mean if SMOOTH) @ (S or Sᵀ if BLOCK) for one [BT, D] tile.
        The mean is M[bh, :] (NC = 0), or the sum of the NC partial sums M[bh, 0:NC, :] over T divided by T (NC > 0;
        NCP: NC's next power of two)."""
        pid_t = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b = pid_bh // H
        h = pid_bh % H
        offs_t = pid_t * BT + tl.arange(0, BT)
        offs_d = tl.arange(0, D)
        mt = offs_t < T
        x = tl.load(X + b * sxb + h * sxh + offs_t[:, None] * sxt + offs_d[None, :], mask=mt[:, None], other=0.0)
        if SMOOTH:
            if NC > 0:
                offs_c = tl.arange(0, NCP)
                part = tl.load(M + (pid_bh * NC + offs_c[:, None]) * D + offs_d[None, :],
                               mask=(offs_c < NC)[:, None], other=0.0)
                mean = tl.sum(part, axis=0) / T
            else:
                mean = tl.load(M + pid_bh * D + offs_d)
            x = _cast_like(x.to(tl.float32) - mean[None, :], Y)
        if BLOCK > 0:
            acc = _mma(x, _signed_hadamard(D, BLOCK, LOGB, TRANS).to(Y.dtype.element_ty))
            out = _cast_like(acc, Y)
        else:
            out = x
        tl.store(Y + b * syb + h * syh + offs_t[:, None] * syt + offs_d[None, :], out, mask=mt[:, None])


def supported(x: Tensor, block: int) -> bool:
    """Whether the kernel takes ``x``: CUDA, 4D, a BF16 / FP16 tensor of a supported head dim."""
    return (triton is not None and x.is_cuda and x.dim() == 4 and x.dtype in (torch.bfloat16, torch.float16)
            and x.shape[-1] in SUPPORTED_HEAD_DIMS and block <= x.shape[-1])


def smooth_rotate(x: Tensor, smooth: bool, block: int, transpose: bool) -> Tensor:
    """``attention_ref.smooth_rotate(x, smooth, block, transpose)`` in Q-Attn's layout, by the Triton kernel
    (``supported(x, block)`` must hold)."""
    B, H, T, D = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = bthd_empty(B, H, T, D, x.dtype, x.device)
    if y.numel() == 0:
        return y
    mean, nc = placeholder(x.device, torch.float32), 0
    if smooth:
        mean, nc = _mean_over_t(x, mean_impl())
    _smooth_rotate_kernel[(cdiv(T, BT), B * H)](
        x, mean, y, T, H, x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1), y.stride(2),
        SMOOTH=bool(smooth), BLOCK=int(block), LOGB=max(int(block).bit_length() - 1, 0), TRANS=bool(transpose),
        D=D, BT=BT, NC=nc, NCP=triton.next_power_of_2(max(nc, 1)), num_warps=4)
    return y


def mean_impl() -> str:
    """:data:`MEAN_IMPL`, checked (a bad ``FP4COMPILE_ROTATE_MEAN`` raises at the first smoothed call)."""
    if MEAN_IMPL not in MEAN_IMPLS:
        raise ValueError(f"FP4COMPILE_ROTATE_MEAN / rotate.MEAN_IMPL must be one of {MEAN_IMPLS}, got {MEAN_IMPL!r}")
    return MEAN_IMPL


def mean_chunks(T: int, bh: int) -> tuple:
    """(chunks, BT-row tiles per chunk) of ``_col_sums_kernel``'s grid for a sequence of T rows and ``bh`` = batch x
    heads sequences: about :data:`MEAN_PROGRAMS` programs in all (chunks x bh), each over whole tiles."""
    tiles = cdiv(T, BT)
    want = max(1, min(tiles, cdiv(MEAN_PROGRAMS, max(bh, 1))))
    per = cdiv(tiles, want)
    return cdiv(tiles, per), per


def _mean_over_t(x: Tensor, impl: str) -> tuple:
    """x's FP32 mean over T as the rotation kernel takes it: (M, NC) with M [B*H, D] and NC = 0 ("torch"), or
    M [B*H, NC, D] partial sums and NC their count ("triton")."""
    B, H, T, D = x.shape
    if impl == "torch":
        return torch.mean(x, dim=-2, dtype=torch.float32).contiguous(), 0
    nc, per = mean_chunks(T, B * H)
    part = torch.empty(B * H, nc, D, dtype=torch.float32, device=x.device)
    _col_sums_kernel[(nc, B * H)](x, part, T, H, x.stride(0), x.stride(1), x.stride(2), TILES=per, D=D, BT=BT,
                                  num_warps=4)
    return part, nc


stable_cache_keys(globals())  # Triton cache keys independent of launch order (kernels/launch.py)
