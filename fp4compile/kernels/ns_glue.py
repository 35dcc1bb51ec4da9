"""Triton kernels for the element-wise passes around the NVFP4 Newton–Schulz's products (``optim/root.py``).

Each NS step of Q-Root's NVFP4 path scales stacks of matrices by a per-matrix FP32 factor and rounds them to bf16:
the products' global scales, the σ guard's rescaling of X and A, and the shifted update (a + β) X + Bs X. In torch
these are ``torch.mul`` / ``torch.add`` with a broadcast [S, 1, 1] FP32 operand and a bf16 output, which run in
torch's generic strided element-wise kernel (H200, session 43: 120 such calls, ~7 ms of a 124M-set Q-Root step's
~24 ms). Here one contiguous pass each:

* :func:`scale_rows`: ``(t.float() * s[b]).to(dtype)`` for a stack t [S, ...] and s [S] (or one scalar);
* :func:`axpy_rows`: ``(t.float() * s[b] + y.float()).to(dtype)``, the product and the sum rounded separately in
  FP32 as torch's two ops round them (launched without FMA contraction), then once to ``dtype``.

The Triton pass is opt-in (:data:`KERNEL`) until the GPU has timed it.

The torch expressions are the reference and the CPU path (the same bits: TensorIterator computes in FP32 and rounds
once on the store). CUDA, or CPU under ``TRITON_INTERPRET=1`` for the tests (whose interpreter truncates on the
bf16 cast instead of rounding to nearest even: one bf16 ulp there).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from .launch import cdiv, launch, stable_cache_keys

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU wheel without Triton: only the torch reference is available
    triton = None

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
#: the Triton pass on CUDA (True) or the torch ops there too (False, the default until the H200 has timed it and run
#: its GPU test: ``bash bench/run_h200.sh s44_glue``). ``FP4COMPILE_NS_GLUE=1`` sets it at import; read at each call.
#: Under ``TRITON_INTERPRET=1`` the kernel always runs (the CPU tests of the kernel).
KERNEL = os.environ.get("FP4COMPILE_NS_GLUE", "0") not in ("", "0")
BLOCK = 2048

if triton is not None:
    @triton.jit
    def _rows_kernel(t_ptr, s_ptr, y_ptr, out_ptr, per, numel, BLOCK: tl.constexpr, ADD: tl.constexpr):
        """out[i] = t[i] * s[i // per] (+ y[i]), FP32 arithmetic, rounded once to out's dtype; all contiguous."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        s = tl.load(s_ptr + offs // per, mask=mask, other=0.0)
        v = tl.load(t_ptr + offs, mask=mask, other=0.0).to(tl.float32) * s
        if ADD:
            v = v + tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=mask)


def _use_kernel(t: torch.Tensor) -> bool:
    return triton is not None and ((t.is_cuda and KERNEL) or (_INTERPRET and t.device.type == "cpu"))


def _per_matrix(t: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``s`` as [S] FP32 for a stack ``t`` [S, ...]: one factor per matrix ([S], [S, 1, 1]) or one for all (0-dim
    or one element), checked."""
    if s.dtype != torch.float32:
        raise TypeError(f"ns_glue: the scale must be FP32, got {s.dtype}")
    if s.numel() == 1:
        return s.reshape(1)
    if t.dim() < 1 or s.numel() != t.shape[0] or any(d != 1 for d in s.shape[1:]) or s.shape[0] != t.shape[0]:
        raise ValueError(f"ns_glue: a scale of shape {tuple(s.shape)} is neither one per matrix of a stack "
                         f"{tuple(t.shape)} nor a scalar")
    return s.reshape(-1)


def _broadcast(t: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The checked factor (:func:`_per_matrix`) shaped to broadcast against ``t`` in the torch forms (a one-element
    tensor, not a 0-dim one: torch would not let a 0-dim FP32 tensor promote a bf16 ``t`` to FP32)."""
    s = _per_matrix(t, s)
    return s.reshape((-1,) + (1,) * (t.dim() - 1)) if s.numel() > 1 else s


def _launch(t, s, y, dtype):
    s = _per_matrix(t, s).contiguous()
    out = torch.empty(t.shape, dtype=dtype, device=t.device)
    n = t.numel()
    if n:
        per = n // s.numel()
        opts = {"enable_fp_fusion": False} if t.is_cuda else {}
        launch(_rows_kernel, (cdiv(n, BLOCK),), t, s, t if y is None else y, out, per, n, BLOCK=BLOCK,
               ADD=y is not None, num_warps=4, **opts)
    return out


def scale_rows(t: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(t.float() * s).to(dtype)`` for a stack ``t`` [S, ...] and an FP32 ``s`` of one factor per matrix ([S] or
    [S, 1, 1]) or a scalar: one pass on CUDA (:func:`_rows_kernel`), the torch expression elsewhere."""
    if _use_kernel(t) and t.is_contiguous():
        return _launch(t, s, None, dtype)
    return torch.mul(t, _broadcast(t, s), out=torch.empty(t.shape, dtype=dtype, device=t.device))


def axpy_rows(t: torch.Tensor, s: torch.Tensor, y: torch.Tensor, dtype: Optional[torch.dtype] = None
              ) -> torch.Tensor:
    """``(t.float() * s + y.float()).to(dtype)`` (default: t's dtype), the product and the sum each rounded in FP32
    as torch's two ops round them, then once to ``dtype``: one pass on CUDA, two torch ops elsewhere."""
    dtype = dtype or t.dtype
    if y.shape != t.shape:
        raise ValueError(f"ns_glue.axpy_rows: y {tuple(y.shape)} and t {tuple(t.shape)} differ")
    if _use_kernel(t) and t.is_contiguous() and y.is_contiguous():
        return _launch(t, s, y, dtype)
    return torch.add(torch.mul(t, _broadcast(t, s)), y, out=torch.empty(t.shape, dtype=dtype, device=t.device))


if triton is not None:
    stable_cache_keys(globals())  # Triton cache keys independent of launch order (kernels/launch.py)
