"""Triton kernels for the element-wise passes around the NVFP4 Newton–Schulz's products (``optim/root.py``).

Each NS step of Q-Root's NVFP4 path scales stacks of matrices by a per-matrix FP32 factor and rounds them to bf16:
the products' global scales, the σ guard's rescaling of X and A, and the shifted update (a + β) X + Bs X. In torch
these are ``torch.mul`` / ``torch.add`` with a broadcast [S, 1, 1] FP32 operand and a bf16 output, which run in
torch's generic strided element-wise kernel (H200, session 43: 120 such calls, ~7 ms of a 124M-set Q-Root step's
~24 ms). Here one contiguous pass each:

* :func:`scale_rows`: ``(t.float() * s[b]).to(dtype)`` for a stack t [S, ...] and s [S] (or one scalar);
* :func:`axpy_rows`: ``(t.float() * s[b] + y.float()).to(dtype)``, the product and the sum rounded separately in
  FP32 as torch's two ops round them (launched without FMA contraction), then once to ``dtype``; with ``y_scale``,
  y is an FP32 product whose global scale the same pass applies (rounded to ``dtype`` first, as
  :func:`scale_rows` would round it): the NS update from B·X's FP32 product without a bf16 B·X in between;
* :func:`sub_diag` and :func:`shift_poly`: the identity-shifted NS polynomial's two passes over a stack of square
  matrices A (``optim.root._shifted_poly``): E = A - alpha I rounded to ``dtype`` (the operand of E²), and
  Bs = k (A - alpha I) + c E² rounded once, each from A's bf16 values, instead of torch's six (FP32 copies of A and
  E², the diagonal shift, a broadcast product, a scalar product, a sum, two casts); with ``e2_scale`` E² comes as
  its product's FP32 result and global scale, rounded to bf16 in the same pass (as ``axpy_rows``' ``y_scale``);
* :func:`matvec`: the σ guard's power-iteration products A v from a bf16 A, without an FP32 copy of A (FP32
  arithmetic; the one function here whose CUDA result is not the torch form's bits: another summation order).

The passes whose output is quantized next (:func:`axpy_rows`' new iterate X, :func:`sub_diag`'s E,
:func:`shift_poly`'s Bs) can also take that output's amax on the way (``amax=``, an int32 slot): the quantize op
then gets the global amax it needs from the slot instead of reading the tensor once more (its amax pass). The slot
holds FP32 bit patterns as int32, whose order is the floats' for |x| (and NaN's above inf's), so an atomic integer
max is the exact max|x| of the rounded output, NaN included.

The Triton passes are the default on CUDA (:data:`KERNEL`). H200, session 44, CUDA graphs: the 124M set's Q-Root
step 23.8 → 17.7 ms by the scale-and-round passes, → 16.6 ms with the shift and the update, → 14.4 ms without index
division in the kernels and with :func:`matvec` (the 1B set's 248 → 187 → 171 → 149.6 ms).

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
#: the Triton pass on CUDA (True, the default since the H200 timed it: ``bash bench/run_h200.sh s44_glue``) or the torch
#: ops there too (False; ``FP4COMPILE_NS_GLUE=0`` at import). Read at each call. Under ``TRITON_INTERPRET=1`` the
#: kernel always runs on CPU (the CPU tests of the kernel).
KERNEL = os.environ.get("FP4COMPILE_NS_GLUE", "1") not in ("", "0")
BLOCK = 2048

if triton is not None:
    @triton.jit
    def _amax_bits(o, mask, amax_ptr):
        """Raise the int32 slot ``amax_ptr`` to the largest |o| (o: the rounded output values, any shape; masked
        lanes left out) as an FP32 bit pattern: the sign bit cleared, an integer max (exact; NaN's bits are above
        inf's)."""
        bits = tl.where(mask, o.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)
        tl.atomic_max(amax_ptr, tl.max(tl.reshape(bits, (bits.numel,)), axis=0))

    @triton.jit
    def _rows_kernel(t_ptr, s_ptr, y_ptr, ys_ptr, out_ptr, amax_ptr, per, s_step, ys_step, BLOCK: tl.constexpr,
                     ADD: tl.constexpr, YSCALE: tl.constexpr, AMAX: tl.constexpr):
        """out[i] = t[i] * s (+ y[i], with YSCALE first rounded to out's dtype as y[i] * ys), FP32 arithmetic,
        rounded once to out's dtype; all contiguous. A program covers BLOCK elements of matrix program_id(1) (per
        elements each), whose factors are s_ptr[mat * s_step] and ys_ptr[mat * ys_step] (step 0: one for all): no
        index division. AMAX: also raise the int32 slot amax_ptr to max|out| (:func:`_amax_bits`)."""
        mat = tl.program_id(1)
        r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = r < per
        offs = mat.to(tl.int64) * per + r
        v = tl.load(t_ptr + offs, mask=mask, other=0.0).to(tl.float32) * tl.load(s_ptr + mat * s_step)
        if ADD:
            y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            if YSCALE:
                y = (y * tl.load(ys_ptr + mat * ys_step)).to(out_ptr.dtype.element_ty).to(tl.float32)
            v = v + y
        o = v.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + offs, o, mask=mask)
        if AMAX:
            _amax_bits(o, mask, amax_ptr)

    @triton.jit
    def _shift_kernel(a_ptr, alpha_ptr, k_ptr, e2_ptr, e2s_ptr, out_ptr, amax_ptr, m, c, e2s_step,
                      BR: tl.constexpr, BC: tl.constexpr, POLY: tl.constexpr, E2S: tl.constexpr, AMAX: tl.constexpr):
        """A stack of square m x m matrices, all contiguous, one BR x BC tile of matrix program_id(2) a program
        (no index division: the diagonal is row == col): e = a - alpha[s] on the diagonal (a elsewhere), FP32;
        out = e, or with POLY out = k[s] * e + c * e2 (FP32, each op rounded); rounded once to out's dtype. E2S: e2
        is an FP32 product, first scaled by e2s_ptr[mat * e2s_step] and rounded to bf16 (the product's own
        scale-and-round). AMAX: also raise the int32 slot amax_ptr to max|out| (:func:`_amax_bits`)."""
        mat = tl.program_id(2)
        rows = tl.program_id(0) * BR + tl.arange(0, BR)[:, None]
        cols = tl.program_id(1) * BC + tl.arange(0, BC)[None, :]
        mask = (rows < m) & (cols < m)
        offs = mat.to(tl.int64) * m * m + rows * m + cols
        a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        e = tl.where(rows == cols, a - tl.load(alpha_ptr + mat), a)
        if POLY:
            e2 = tl.load(e2_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            if E2S:
                e2 = (e2 * tl.load(e2s_ptr + mat * e2s_step)).to(tl.bfloat16).to(tl.float32)
            e = tl.load(k_ptr + mat) * e + c * e2
        o = e.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + offs, o, mask=mask)
        if AMAX:
            _amax_bits(o, mask, amax_ptr)

    @triton.jit
    def _matvec_kernel(a_ptr, v_ptr, out_ptr, m, BM: tl.constexpr, BK: tl.constexpr, K_TILES: tl.constexpr):
        """out[s, i] = sum_k float(a[s, i, k]) * v[s, k] for a stack of square m x m matrices (contiguous), FP32
        products and sums; BM rows of matrix program_id(1) a program, K_TILES = cdiv(m, BK) steps (a constexpr:
        the interpreter takes no runtime loop bound)."""
        mat = tl.program_id(1)
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        base = mat.to(tl.int64) * m * m
        acc = tl.zeros([BM, BK], dtype=tl.float32)
        for kk in range(0, K_TILES):
            cols = kk * BK + tl.arange(0, BK)
            a = tl.load(a_ptr + base + rows[:, None] * m + cols[None, :],
                        mask=(rows[:, None] < m) & (cols[None, :] < m), other=0.0).to(tl.float32)
            v = tl.load(v_ptr + mat.to(tl.int64) * m + cols, mask=cols < m, other=0.0)
            acc += a * v[None, :]
        tl.store(out_ptr + mat.to(tl.int64) * m + rows, tl.sum(acc, axis=1), mask=rows < m)


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


def _check_amax_slot(amax: Optional[torch.Tensor], t: torch.Tensor) -> None:
    if amax is not None and (amax.dtype != torch.int32 or amax.numel() != 1 or amax.device != t.device):
        raise ValueError(f"ns_glue: amax must be a one-element int32 slot on {t.device}, got {amax.dtype} "
                         f"{tuple(amax.shape)} on {amax.device}")


def _record_amax(out: torch.Tensor, amax: Optional[torch.Tensor]) -> torch.Tensor:
    """The torch form of the kernels' ``amax``: raise the int32 slot to max|out|'s FP32 bit pattern; -> out."""
    if amax is not None and out.numel():
        torch.maximum(amax, out.float().abs().amax().view(torch.int32), out=amax.view(-1))
    return out


def amax_value(slot: torch.Tensor) -> torch.Tensor:
    """An ``amax`` slot as the 0-dim FP32 max|x| the quantize op takes (a view: read after the pass that fills it;
    a slot must start at 0)."""
    return slot.view(torch.float32).reshape(())


def _launch(t, s, y, dtype, ys=None, amax=None):
    s = _per_matrix(t, s).contiguous()
    yscale = ys is not None
    ys = ys if yscale else s                           # a placeholder pointer when not read
    out = torch.empty(t.shape, dtype=dtype, device=t.device)
    n = t.numel()
    if n:
        mats = max(s.numel(), ys.numel())              # 1, or the stack's S (each factor one per matrix or one)
        opts = {"enable_fp_fusion": False} if t.is_cuda else {}
        launch(_rows_kernel, (cdiv(n // mats, BLOCK), mats), t, s, t if y is None else y, ys, out,
               s if amax is None else amax, n // mats, int(s.numel() > 1), int(ys.numel() > 1), BLOCK=BLOCK,
               ADD=y is not None, YSCALE=yscale, AMAX=amax is not None, num_warps=4, **opts)
    return out


def _rows_kernel_ok(t: torch.Tensor, *others: torch.Tensor) -> bool:
    """The kernel's limits (else the torch form): contiguous operands, at most 65535 matrices (the grid's y) and
    fewer than 2³¹ elements (int32 offsets within the part one factor covers)."""
    return (_use_kernel(t) and t.is_contiguous() and all(x.is_contiguous() for x in others)
            and (t.dim() == 0 or t.shape[0] <= 65535) and t.numel() < 2 ** 31)


def scale_rows(t: torch.Tensor, s: torch.Tensor, dtype: torch.dtype, amax: Optional[torch.Tensor] = None
               ) -> torch.Tensor:
    """``(t.float() * s).to(dtype)`` for a stack ``t`` [S, ...] and an FP32 ``s`` of one factor per matrix ([S] or
    [S, 1, 1]) or a scalar: one pass on CUDA (:func:`_rows_kernel`), the torch expression elsewhere. ``amax``: an
    int32 slot raised to max|result| (module docstring; :func:`amax_value`)."""
    _check_amax_slot(amax, t)
    if _rows_kernel_ok(t):
        return _launch(t, s, None, dtype, amax=amax)
    return _record_amax(torch.mul(t, _broadcast(t, s), out=torch.empty(t.shape, dtype=dtype, device=t.device)),
                        amax)


def axpy_rows(t: torch.Tensor, s: torch.Tensor, y: torch.Tensor, dtype: Optional[torch.dtype] = None,
              y_scale: Optional[torch.Tensor] = None, amax: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``(t.float() * s + y.float()).to(dtype)`` (default: t's dtype), the product and the sum each rounded in FP32
    as torch's two ops round them, then once to ``dtype``: one pass on CUDA, two torch ops elsewhere.

    ``y_scale`` (FP32, one per matrix or a scalar, as ``s``): y is first ``scale_rows(y, y_scale, dtype)``, rounded
    to ``dtype`` as that op rounds it (an FP32 product's global scale, applied in the same pass on CUDA). ``amax``:
    an int32 slot raised to max|result| (module docstring)."""
    dtype = dtype or t.dtype
    if y.shape != t.shape:
        raise ValueError(f"ns_glue.axpy_rows: y {tuple(y.shape)} and t {tuple(t.shape)} differ")
    _check_amax_slot(amax, t)
    if _rows_kernel_ok(t, y):
        return _launch(t, s, y, dtype, None if y_scale is None else _per_matrix(y, y_scale).contiguous(), amax)
    if y_scale is not None:
        y = scale_rows(y, y_scale, dtype)
    return _record_amax(torch.add(torch.mul(t, _broadcast(t, s)), y,
                                  out=torch.empty(t.shape, dtype=dtype, device=t.device)), amax)


def _check_square_stack(A: torch.Tensor, alpha: torch.Tensor, name: str) -> None:
    if A.dim() != 3 or A.shape[1] != A.shape[2]:
        raise ValueError(f"ns_glue.{name}: A must be a stack of square matrices [S, m, m], got {tuple(A.shape)}")
    if alpha.dtype != torch.float32 or alpha.shape != A.shape[:1]:
        raise ValueError(f"ns_glue.{name}: alpha must be FP32 [S] = [{A.shape[0]}], got {alpha.dtype} "
                         f"{tuple(alpha.shape)}")


def _shifted_f32(A: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """The torch form's E = A - alpha I in FP32 (a new tensor)."""
    E = A.to(torch.float32, copy=True)
    torch.diagonal(E, dim1=-2, dim2=-1).sub_(alpha[:, None])
    return E


SHIFT_TILE = (16, 128)   # rows x columns of one _shift_kernel program


def _launch_shift(A, alpha, k, c, E2, dtype, amax=None, e2s=None):
    out = torch.empty(A.shape, dtype=dtype, device=A.device)
    S, m, _ = A.shape
    if A.numel():
        opts = {"enable_fp_fusion": False} if A.is_cuda else {}
        poly = E2 is not None
        br, bc = SHIFT_TILE
        launch(_shift_kernel, (cdiv(m, br), cdiv(m, bc), S), A, alpha.contiguous(), k.contiguous() if poly else alpha,
               E2 if poly else A, alpha if e2s is None else e2s, out, alpha if amax is None else amax, m, float(c),
               0 if e2s is None else int(e2s.numel() > 1), BR=br, BC=bc, POLY=poly, E2S=e2s is not None,
               AMAX=amax is not None, num_warps=4, **opts)
    return out


def _square_kernel_ok(A: torch.Tensor, *others: torch.Tensor) -> bool:
    """The limits of the kernels over a stack of square matrices (:func:`_shift_kernel`, :func:`_matvec_kernel`;
    else the torch form): contiguous operands, S <= 65535 (a grid dimension past x), m² < 2³¹ (int32 offsets within a
    matrix)."""
    return (_use_kernel(A) and A.is_contiguous() and all(t.is_contiguous() for t in others)
            and A.shape[0] <= 65535 and A.shape[1] ** 2 < 2 ** 31)


def sub_diag(A: torch.Tensor, alpha: torch.Tensor, dtype: torch.dtype, amax: Optional[torch.Tensor] = None
             ) -> torch.Tensor:
    """``E = A - alpha I`` of a stack of square matrices A [S, m, m] and FP32 ``alpha`` [S], computed in FP32 from
    A's values and rounded once to ``dtype``: one pass on CUDA (:func:`_shift_kernel`), torch's FP32 copy, diagonal
    subtraction and cast elsewhere. ``amax``: an int32 slot raised to max|E| (module docstring)."""
    _check_square_stack(A, alpha, "sub_diag")
    _check_amax_slot(amax, A)
    if _square_kernel_ok(A):
        return _launch_shift(A, alpha, None, 0.0, None, dtype, amax)
    return _record_amax(_shifted_f32(A, alpha).to(dtype), amax)


def shift_poly(A: torch.Tensor, alpha: torch.Tensor, k: torch.Tensor, c: float, E2: torch.Tensor,
               dtype: torch.dtype, amax: Optional[torch.Tensor] = None, e2_scale: Optional[torch.Tensor] = None
               ) -> torch.Tensor:
    """``k (A - alpha I) + c E2`` for a stack A [S, m, m], FP32 ``alpha`` and ``k`` [S], a Python ``c`` (used as
    FP32, as torch uses a scalar operand) and ``E2`` [S, m, m]: FP32 arithmetic, the two products and the sum each
    rounded (no FMA), then once to ``dtype``. One pass on CUDA, the torch ops elsewhere. ``amax``: an int32 slot
    raised to max|result| (module docstring). ``e2_scale`` (FP32, one per matrix or a scalar): E2 is an FP32
    product whose global scale this pass applies, E2 first becoming ``scale_rows(E2, e2_scale, torch.bfloat16)``
    (the product's own scale-and-round, in the same pass on CUDA: no bf16 E2 written and read)."""
    _check_square_stack(A, alpha, "shift_poly")
    if k.dtype != torch.float32 or k.shape != alpha.shape or E2.shape != A.shape:
        raise ValueError(f"ns_glue.shift_poly: k must be FP32 [S] and E2 [S, m, m] like A {tuple(A.shape)}, got "
                         f"k {k.dtype} {tuple(k.shape)}, E2 {tuple(E2.shape)}")
    _check_amax_slot(amax, A)
    if _square_kernel_ok(A, E2):
        return _launch_shift(A, alpha, k, c, E2, dtype, amax,
                             None if e2_scale is None else _per_matrix(E2, e2_scale).contiguous())
    if e2_scale is not None:
        E2 = scale_rows(E2, e2_scale, torch.bfloat16)
    return _record_amax((k[:, None, None] * _shifted_f32(A, alpha) + c * E2.float()).to(dtype), amax)


MATVEC_TILE = (16, 128)   # rows x columns of one _matvec_kernel step


def matvec(A: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``A.float() @ v`` for a stack of square matrices A [S, m, m] (bf16 or FP32) and FP32 v [S, m, 1] -> FP32
    [S, m, 1]: on CUDA one Triton pass reading A in its own dtype (the NS guard's power iteration on a bf16 A without
    its FP32 copy; FP32 products and sums in another order than cuBLAS's, so equal up to FP32 rounding), torch's
    FP32 bmm elsewhere."""
    if A.dim() != 3 or A.shape[1] != A.shape[2] or v.shape != (A.shape[0], A.shape[1], 1):
        raise ValueError(f"ns_glue.matvec: A must be [S, m, m] and v [S, m, 1], got {tuple(A.shape)} and "
                         f"{tuple(v.shape)}")
    if v.dtype != torch.float32:
        raise TypeError(f"ns_glue.matvec: v must be FP32, got {v.dtype}")
    S, m, _ = A.shape
    if _square_kernel_ok(A) and A.numel():
        out = torch.empty((S, m, 1), dtype=torch.float32, device=A.device)
        bm, bk = MATVEC_TILE
        launch(_matvec_kernel, (cdiv(m, bm), S), A, v.contiguous(), out, m, BM=bm, BK=bk, K_TILES=cdiv(m, bk),
               num_warps=4)
        return out
    return torch.bmm(A.float(), v)


if triton is not None:
    stable_cache_keys(globals())  # Triton cache keys independent of launch order (kernels/launch.py)
