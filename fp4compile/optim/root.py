"""Q-Root: the ROOT optimizer (arXiv 2511.20626) for 2-D weights, with Newton–Schulz products in NVFP4.

    groups = QRoot.param_groups_for(model)          # Root for hidden matrices, (Q-)AdamW for the rest
    opt = fp4compile.QRoot(groups, lr=1e-3)         # policy: Policy.full_stack() -> optim.ns is NVFP4

Root update of a matrix parameter W (m x n), per step (ROOT's official example, defaults configurable):

    M   = mu * M + G                                  momentum buffer (FP32)
    U   = G + mu * M   (Nesterov; U = M without)
    eps = quantile(|U|, clip_quantile) + 1e-9         Full-Stack FP4: p99 (default); ROOT's code: 0.90
    B   = clamp(U, -eps, eps)                         outlier soft-threshold: B = U - T_eps(U)
    O   = NS(B)                                       quintic Newton–Schulz, 5 steps, shape-aware (a, b, c)
    W  <- W * (1 - lr * wd) - lr * 0.2 * sqrt(max(m, n)) * O

NS runs on the short side (X is transposed when m > n), X0 = B / (||B||_F + 1e-7) in BF16, and per step
A = X Xᵀ, B = b A + c A², X <- a X + B X. Same-shaped matrices are stacked ([S, m, n]) and orthogonalized
together: one bmm per product in BF16, and under an NVFP4 ``optim.ns`` spec (:func:`_ns_nvfp4_stack`) one
``torch.ops.fp4compile.quantize`` per operand per product for the whole stack plus one batched product:

- Quantization of a stack: the op is 2-D, so the stack [S, r, K] is quantized as its 2-D view [S·r, K] along
  the product's contraction dim K (the last dim of every operand: X along n for X Xᵀ, A along m for A·A —
  A is symmetric so one copy serves both operands —, B along m, and X column-wise for B·X, i.e. Xᵀ made
  contiguous in torch ([S, n, m]) and quantized row-wise). Stacking only concatenates rows, so every 1x16
  block, 16x16 block (r is a multiple of 16) and Hadamard rotation (along K, the same signs for all) is
  exactly the one of the per-matrix quantization; the one thing that changes is the FP32 global scale,
  which now spans the stack (amax over all S matrices). NS iterates are Frobenius-normalized, so the S
  ranges match to within a small factor, and a per-stack global only costs precision where a block scale of
  some matrix would fall below E4M3's normal range (2^-6 of 448, a spread of 2^15 in block amax); within
  that range E4M3 scales have the same 3-bit relative precision at any magnitude. Measured (H200, GPT-124M
  stacks, error vs an FP64 NS; docs/BENCHMARKS.md "Q-Root batched NVFP4 Newton–Schulz"): per-stack and
  per-matrix globals agree to within 0.7 % of the error, with both signs.
- Product with exact NVFP4 semantics (:func:`_bgemm_nvfp4`): ``torch.ops.fp4compile.dequantize_blocks``
  (exact bf16 q·S, no global) of both stacked operands, one ``torch.bmm`` with FP32 accumulation and FP32
  output (``out_dtype=torch.float32`` on CUDA; FP32 bmm of the upcast operands elsewhere — exact products
  of bf16 values, FP32 sums), then × both global scales in FP32 and one rounding to BF16: what
  ``fp4compile::gemm`` computes per matrix (its reference is the same formula: bit-exact on CPU, where both
  are the FP32 matmul of the same values; its CUDA kernel may sum in another order, so the tests require
  FP32 summation-order tolerance there — measured bit-exact on the GPT-124M stacks on the H200).
- SR seeds: one seed per stacked quantize (``seed + i``); the counter-based hash is keyed by position, so
  the S matrices get independent rounding noise.

:func:`_ns_nvfp4_one` (per matrix, per-matrix global scales, ``fp4compile::gemm``) is kept as the reference
the tests and the error study compare against.

Other parameters (1-D, embeddings, heads; ``use_root=False`` groups) get (Q-)AdamW with the group's
``betas``/``eps``/``weight_decay`` and the Q-AdamW storage settings (``adamw="qadamw"`` default, or
``"adamw"`` for FP32 states).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import warnings
from typing import Iterable, Optional, Sequence, Tuple

import torch
from torch.optim import Optimizer

from .. import ops as _ops  # (also registers torch.ops.fp4compile.*)
from ..kernels import ns_glue
from . import qadamw as _qa

Coeffs = Tuple[float, float, float]

#: Keller Jordan's Muon coefficients (ROOT's fallback for shapes outside its table)
JORDAN: Coeffs = (3.4445, -4.7750, 2.0315)

#: ROOT's shape-specific coefficients, key (min(m, n), max(m, n)) (huawei-noah/noah-research ROOT example)
ROOT_TABLE = {
    (2048, 2048): (3.4916, -4.8224, 2.1095),
    (2048, 3072): (3.4509, -4.5790, 1.9325),
    (2048, 8192): (2.9794, -3.6674, 1.6207),
    (2048, 16384): (3.1943, -3.8221, 1.5322),
}

#: Polar Express degree-5 schedule for l = 1e-3, u = 1 (Amsel et al., arXiv 2505.16932)
POLAR_EXPRESS = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)

SCHEDULES = ("root", "root_table", "jordan", "polar_express")


# ----------------------------------------------------------------------------------------------
# coefficients
def _mp_singular_values(m: int, n: int, proxy: int = 256, seed: int = 0) -> torch.Tensor:
    """Singular values of a Frobenius-normalized Gaussian m x n matrix (m <= n), float64.

    Computed on a proxy of the same aspect ratio (short side ``proxy``) and rescaled to m values
    (sum sigma^2 = 1, so sigma scales as 1/sqrt(m)); the spectrum's shape depends only on m/n
    (Marchenko–Pastur). Exact when m <= proxy.
    """
    gen = torch.Generator().manual_seed(seed)
    k = min(m, proxy)
    kn = max(k, round(n * k / m))
    g = torch.randn(k, kn, generator=gen, dtype=torch.float64)
    s = torch.linalg.svdvals(g / g.norm())
    return s * math.sqrt(k / m)


@functools.lru_cache(maxsize=256)
def fit_ns_coefficients(m: int, n: int, steps: int = 5) -> Coeffs:
    """Fit one (a, b, c) for shape (m, n): minimize the mean squared deviation from 1 of the 5-fold composed
    quintic p(s) = a s + b s^3 + c s^5 over the singular values of Frobenius-normalized Gaussian matrices of
    that shape (plus a penalty keeping p's iterates in [0, 1.5] so the iteration stays stable).

    This is our reading of ROOT's "fit per shape" principle (their fitting code is not public); see
    docs/OPTIM.md for how the fit compares with the four shapes ROOT published.
    """
    m, n = min(m, n), max(m, n)
    s = _mp_singular_values(m, n)
    # weight the smallest singular values as much as the bulk: fit on log-spaced quantiles of the spectrum
    grid = torch.cat([s, torch.logspace(math.log10(float(s.min())), 0, 64, dtype=torch.float64)])
    theta = torch.tensor(JORDAN, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([theta], lr=0.5, max_iter=200, line_search_fn="strong_wolfe")

    def loss_fn():
        opt.zero_grad()
        a, b, c = theta
        x = grid
        pen = 0.0
        for _ in range(steps):
            x = a * x + b * x ** 3 + c * x ** 5
            pen = pen + torch.relu(x - 1.5).pow(2).mean() + torch.relu(-x).pow(2).mean()
        loss = (x - 1).pow(2).mean() + 10 * pen
        loss.backward()
        return loss

    opt.step(loss_fn)
    a, b, c = (float(v) for v in theta.detach())
    if not all(math.isfinite(v) for v in (a, b, c)):
        return JORDAN
    return (round(a, 4), round(b, 4), round(c, 4))


def ns_coefficients(shape: Sequence[int], steps: int = 5, schedule: str = "root") -> Tuple[Coeffs, ...]:
    """The (a, b, c) of each NS step for a matrix of ``shape`` under ``schedule``:

    - ``"root"``: ROOT's table for its shapes, :func:`fit_ns_coefficients` for every other shape;
    - ``"root_table"``: ROOT's table, Jordan's fallback elsewhere (exactly ROOT's official code);
    - ``"jordan"``: Jordan's (3.4445, -4.7750, 2.0315) every step;
    - ``"polar_express"``: Polar Express, safety factor 1.01 on all but the last step.
    """
    m, n = int(shape[-2]), int(shape[-1])
    key = (min(m, n), max(m, n))
    if schedule == "jordan":
        return (JORDAN,) * steps
    if schedule == "root_table":
        return (ROOT_TABLE.get(key, JORDAN),) * steps
    if schedule == "root":
        return (ROOT_TABLE.get(key) or fit_ns_coefficients(*key, steps=steps),) * steps
    if schedule == "polar_express":
        seq = [POLAR_EXPRESS[min(i, len(POLAR_EXPRESS) - 1)] for i in range(steps)]
        return tuple((a / 1.01, b / 1.01 ** 3, c / 1.01 ** 5) if i < steps - 1 else (a, b, c)
                     for i, (a, b, c) in enumerate(seq))
    raise ValueError(f"unknown NS schedule {schedule!r}; choose one of {SCHEDULES}")


# ----------------------------------------------------------------------------------------------
# Newton–Schulz
def _nvfp4_ok(m: int, n: int) -> bool:
    return m % 16 == 0 and n % 16 == 0


def _q(x: torch.Tensor, spec, signs, transpose=False, seed=None, amax=None):
    return torch.ops.fp4compile.quantize(x, rounding=spec.rounding, four_over_six=spec.four_over_six,
                                         block2d=spec.block == (16, 16), hadamard=spec.hadamard or 0,
                                         signs=signs, seed=seed, transpose=transpose, amax=amax)


def _qgemm(qa, qb) -> torch.Tensor:
    return torch.ops.fp4compile.gemm(qa[0], qa[1], qa[2], qb[0], qb[1], qb[2], out_dtype=torch.bfloat16)


def _seed_stream(seeds):
    """A callable giving ``seeds + 1``, ``seeds + 2``, ... (one SR seed per quantize), or always None."""
    count = [0]

    def seed():
        if seeds is None:
            return None
        count[0] += 1
        return seeds + count[0]
    return seed


def _ns_nvfp4_one(x: torch.Tensor, coeffs, spec, signs, seeds, guard=1.0, shift=False) -> torch.Tensor:
    """NS on one [m, n] BF16 matrix (m <= n) with all three products in NVFP4 (``guard``: see below;
    ``shift``: the identity-shifted products of :func:`_shifted_poly`).

    The per-matrix reference of :func:`_ns_nvfp4_stack` (per-matrix global scales, ``fp4compile::gemm``);
    :func:`newton_schulz` runs the batched path."""
    seed = _seed_stream(seeds)

    for a, b, c in coeffs:
        qx = _q(x, spec, signs, seed=seed())                 # along n: X Xᵀ contracts over the long dim
        A = _qgemm(qx, qx)                                   # [m, m]
        if guard is not None:
            # NVFP4 products carry ~10 % error; an iterate whose top singular value leaves the quintic's basin
            # (~1.3 for Jordan's p) explodes. Estimate sigma_max^2 = lambda_max(A) by power iteration (O(m^2)
            # per matvec, no host sync) and rescale X, A so that sigma_max <= guard.
            A32 = A.float()
            v = torch.ones(A32.shape[0], device=A32.device) / math.sqrt(A32.shape[0])
            for _ in range(6):
                v = A32 @ v
                v = v / (v.norm() + 1e-30)
            lam = v @ (A32 @ v)
            s = torch.clamp(guard * guard / torch.clamp(lam, min=1e-30), max=1.0)
            A = (A32 * s).to(A.dtype)
            x = (x.float() * s.sqrt()).to(x.dtype)
        if shift:
            def square(E):
                qE = _q(E[0], spec, signs, seed=seed())
                return _qgemm(qE, qE)[None], None
            B, beta = _shifted_poly(A.unsqueeze(0), b, c, square)
            B, beta = B[0], beta[0]
        else:
            qA = _q(A, spec, signs, seed=seed())             # along m; A symmetric: A·A = A·Aᵀ
            B, beta = b * A + c * _qgemm(qA, qA), None
        qB = _q(B, spec, signs, seed=seed())                 # rows of B along m
        qxt = _q(x, spec, signs, transpose=True, seed=seed())  # Xᵀ rows along m
        x = _ns_update(x, a, beta, _qgemm(qB, qxt))          # B·X = qB · qxtᵀ  [m, n]
    return x


def _ns_update(X: torch.Tensor, a: float, beta: Optional[torch.Tensor], BX: torch.Tensor) -> torch.Tensor:
    """The NS step's new iterate from the product ``BX``: ``a X + BX`` (BF16 arithmetic, the unshifted form), or,
    with ``beta`` from :func:`_shifted_poly`, ``(a + beta) X + Bs X`` in FP32, rounded once to X's dtype
    (``kernels.ns_glue.axpy_rows``: the FP32 product and sum rounded as two separate ops, as in the upcast form, the
    same bits, without the FP32 copies of X and BX)."""
    if beta is None:
        return a * X + BX
    return ns_glue.axpy_rows(X, (a + beta).float(), BX, X.dtype)


def _shifted_poly(A: torch.Tensor, b: float, c: float, square, slots=(None, None)):
    """The NS polynomial B = b A + c A² of a stack A [S, m, m] split as ``beta I + Bs``, with the one product it
    needs taken of the shifted matrix: ``(Bs, beta)``, Bs BF16 [S, m, m], beta FP32 [S, 1, 1]. E and Bs each in one
    pass from A's values (``kernels.ns_glue.sub_diag``, ``shift_poly``). ``slots``: ns_glue amax slots (or None) that
    the two passes fill with E's and Bs's max|·| (``square`` may read E's from its slot: it runs after).
    ``square(E)`` returns (E², None) with E² in bf16, or (FP32 product, global scale) for ``shift_poly`` to scale and
    round in its own pass (the same bits).

    With alpha = mean(diag A) per matrix and E = A - alpha I (exact algebra):
    A² = E² + 2 alpha E + alpha² I, so B = (b + 2 c alpha) E + c E² + (b alpha + c alpha²) I. ``square(E)``
    computes E² (NVFP4: quantize E, one product). The step X <- a X + B X then becomes
    X <- (a + beta) X + Bs X, with only Bs X in NVFP4. Why: an NVFP4 product's error scales with its operands'
    magnitudes, and an NS iterate's Gram matrix A sits near a multiple of I (the iterates' singular values are
    pushed towards 1), so A and B are dominated by their identity parts. Quantizing A and B whole puts ~10 %
    of that identity part into the error of A² and B X; the shifted form computes the identity parts exactly
    (a scale of X) and quantizes only what deviates from them (E, Bs), whose error is proportionally smaller.
    Measured (``bench/ns_quality.py --shift``): distance to the BF16 NS 0.271 -> 0.176 on the 30M block shapes.
    """
    alpha = torch.diagonal(A, dim1=-2, dim2=-1).float().mean(-1)                     # [S]
    e_slot, b_slot = slots
    E = ns_glue.sub_diag(A, alpha, torch.bfloat16, amax=e_slot)      # E = A - alpha I from A's values, one pass
    E2, e2_scale = square(E)
    Bs = ns_glue.shift_poly(A, alpha, b + 2 * c * alpha, c, E2, torch.bfloat16, amax=b_slot, e2_scale=e2_scale)
    return Bs, (b * alpha + c * alpha * alpha)[:, None, None]


def _q_stack(x: torch.Tensor, spec, signs, seed=None, transpose=False, amax=None):
    """Quantize a stack ``x`` [S, r, K] along K as its 2-D view [S·r, K] (one op call, one global scale for
    the stack) -> (codes [S, r, K/2], scales [S, r, K/16], global fp32 []). ``amax``: the stack's max|x| when the
    pass that made x took it (the op's ``amax``: no amax pass of its own).

    ``transpose``: quantize each matrix's transpose instead, x [S, K, r] -> the stack of xᵀ [S, r, K], by the op's
    own transposed quantize of the 2-D view [S·K, r] (one transposing pass that also takes the amax, then the
    row-wise kernels), with no transposed copy of the stack: the result [r, S·K] holds row j of every xᵀ side by
    side, and is returned as [S, r, ·] views of that layout (:func:`_dequantize_stack` reads them as they are).
    The blocks along K are those of each xᵀ (K is a multiple of 16, and of the RHT size: the caller checks), so
    RTN gives the bits of quantizing the transposed copy; SR draws its bits at other flat indices."""
    if transpose:
        S, k, r = x.shape
        codes, scales, g = _q(x.reshape(S * k, r), spec, signs, transpose=True, seed=seed, amax=amax)
        return (codes.view(r, S, k // 2).permute(1, 0, 2), scales.view(r, S, k // 16).permute(1, 0, 2), g)
    S, r, k = x.shape
    codes, scales, g = _q(x.reshape(S * r, k), spec, signs, seed=seed, amax=amax)
    return codes.view(S, r, k // 2), scales.view(S, r, k // 16), g


def _bmm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b.mT`` of bf16 stacks a [S, M, K], b [S, N, K] with FP32 accumulation and an FP32 result, split
    by device like ``fp4compile::mm_f32``: cuBLAS ``torch.bmm(..., out_dtype=torch.float32)`` on CUDA (measured
    available on torch 2.11 / H200), elsewhere the FP32 bmm of the upcast operands (exact products of bf16
    values, FP32 sums)."""
    if a.is_cuda:
        return torch.bmm(a, b.mT, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float().mT)


def _env_rows(name: str) -> Optional[int]:
    """The row count in environment variable ``name`` (None when unset or empty; a clear error otherwise)."""
    value = os.environ.get(name, "")
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(f"{name} must be a row count (a non-negative integer) or unset, got {value!r}")
    return int(value)


#: the smallest row count m from which a stack's Gram product a·aᵀ (X·Xᵀ; A·A and E² of a symmetric A or E) is
#: computed as a symmetric product (:func:`_gram`): the blocks on and right of the diagonal of a 2 x 2 split, 3/4 of
#: the flops, then the mirror. None (the default): always the full product; timed in session 43 at 512 rows, the
#: 124M set's Q-Root step took 35.44 ms against 34.38 (the second launch and the copy cost more than they save).
#: ``FP4COMPILE_NS_SYMMETRIC=<rows>`` sets it at import.
SYMMETRIC_MIN_ROWS = _env_rows("FP4COMPILE_NS_SYMMETRIC")


def _gram(a: torch.Tensor, f32: bool) -> torch.Tensor:
    """``a @ a.mT`` of a stack a [S, m, K]: with ``f32`` FP32 accumulation and an FP32 result (:func:`_bmm_f32`),
    else in a's dtype (``@``: FP32 accumulation, one rounding).

    From :data:`SYMMETRIC_MIN_ROWS` rows on (m even), symmetric: with a = [a1; a2] split at h = m/2, one product
    a · a2ᵀ gives the right block column [a1 a2ᵀ; a2 a2ᵀ], one product a1 · a1ᵀ the top-left block, and the
    bottom-left block is the transpose of the top-right one: 3/4 of the full product's multiply-adds, two products
    and a copy of m²/4 entries instead of one product. Every entry is the dot product of the same two rows as in the
    full product (equal up to FP32 summation order), and the result is exactly symmetric."""
    mm = _bmm_f32 if f32 else (lambda x, y: x @ y.mT)
    S, m, _ = a.shape
    if SYMMETRIC_MIN_ROWS is None or m < SYMMETRIC_MIN_ROWS or m % 2:
        return mm(a, a)
    h = m // 2
    right = mm(a, a[:, h:])                                    # [S, m, m - h]
    out = torch.empty((S, m, m), dtype=right.dtype, device=a.device)
    out[:, :, h:] = right
    out[:, :h, :h] = mm(a[:, :h], a[:, :h])
    out[:, h:, :h] = right[:, :h].mT
    return out


def _bgemm_nvfp4(qa, qb, out_dtype=torch.bfloat16) -> torch.Tensor:
    """Batched NVFP4 product of two quantized stacks (as from :func:`_q_stack`, both along K): qa [S, M, ·],
    qb [S, N, ·] -> [S, M, N] = (qa·qbᵀ) * (a_global * b_global) in FP32, one rounding to ``out_dtype``.

    Exact NVFP4 semantics, as ``fp4compile::gemm`` per matrix: ``dequantize_blocks`` gives the exact bf16
    q·S of each operand (one call per operand for the whole stack; once when ``qa is qb``), one bmm with FP32
    accumulation, the global scales applied in FP32 after it."""
    pa = _dq_form(qa)
    if qb is qa:
        return _bgemm_dq(pa, pa, out_dtype)
    if qb[0].shape[0] != qa[0].shape[0] or qb[0].shape[2] != qa[0].shape[2]:
        raise ValueError(f"_bgemm_nvfp4: stacks {tuple(qa[0].shape)} and {tuple(qb[0].shape)} do not match")
    return _bgemm_dq(pa, _dq_form(qb), out_dtype)


def _dequantize_stack(q) -> torch.Tensor:
    """The exact bf16 q·S [S, r, K] (``dequantize_blocks``, no global scale) of a stack from :func:`_q_stack`: one
    call on the stack's 2-D storage, row-major [S·r, ·] or, from ``transpose=True``, [r, S·(·)] (then a strided
    [S, r, K] view of the result, which the batched products take as it is)."""
    codes, scales, _ = q
    S, r, hk = codes.shape
    if codes.is_contiguous():
        dq = torch.ops.fp4compile.dequantize_blocks(codes.reshape(S * r, hk), scales.reshape(S * r, -1))
        return dq.view(S, r, 2 * hk)
    dq = torch.ops.fp4compile.dequantize_blocks(codes.permute(1, 0, 2).reshape(r, S * hk),
                                                scales.permute(1, 0, 2).reshape(r, -1))
    return dq.view(r, S, 2 * hk).permute(1, 0, 2)


def _dq_form(q):
    """A quantized stack as (bf16 q·S, global), the operand form of :func:`_bgemm_dq`: :func:`_q_stack_dq`'s pair
    as it is, :func:`_q_stack`'s (codes, scales, global) dequantized (one ``dequantize_blocks``)."""
    return q if len(q) == 2 else (_dequantize_stack(q), q[2])


def _dequantized(q) -> torch.Tensor:
    """The FP32 value q·S·global of a quantized stack (either form, :func:`_dq_form`)."""
    dq, g = _dq_form(q)
    return dq.float() * g.float()


#: the NVFP4 NS's operands as ``fp4compile::quantize_dq`` gives them (:func:`_q_stack_dq`, :func:`_bgemm_dq`):
#: the bf16 q·S stored by the quantize launch itself (RTN and SR in the quantize kernel, MS-EDEN in its pass 2)
#: instead of codes that a ``dequantize_blocks`` pass per operand reads back; the same values (dq is
#: dequantize_blocks of the same codes by the op's definition), 4 passes fewer per NS step. False (the default):
#: quantize + dequantize_blocks; timed in session 43, 34.58 against 34.38 ms (124M set) and 347.7 against 344.2 ms (1B):
#: the bf16 store costs what the passes did. ``FP4COMPILE_NS_DQ=1`` sets it at import.
NS_DQ = os.environ.get("FP4COMPILE_NS_DQ", "0") not in ("", "0")
#: the NVFP4 NS's amax passes folded into the passes that make the quantized operands (``kernels.ns_glue``'s
#: ``amax=`` slots: the new iterate X from the update, E from ``sub_diag``, Bs from ``shift_poly``), which then give
#: the quantize op its ``amax`` instead of it reading each operand once more; RTN and SR specs without an RHT (the op
#: takes no amax otherwise), the stack's own quantizers. The same bits (the op's CPU reference checks that a given
#: amax is max|x|). On by default since session 47 (H200, with ns_sym_b and ns_shared_x: the 124M set's NS step 12.56
#: -> 12.36 ms, the 1B set's 134.1 -> 131.7 ms; docs/BENCHMARKS.md session 46); ``FP4COMPILE_NS_AMAX=0`` turns it off
#: at import.
FUSE_AMAX = os.environ.get("FP4COMPILE_NS_AMAX", "1") not in ("", "0")


def _q_stack_dq(x: torch.Tensor, spec, signs, seed=None, transpose=False, amax=None):
    """:func:`_q_stack` through ``fp4compile::quantize_dq``: a stack ``x`` [S, r, K] quantized along K as its 2-D
    view -> (dq bf16 [S, r, K] = the exact q·S, global fp32 []); ``transpose``: as :func:`_q_stack`'s (x [S, K, r],
    dq a strided [S, r, K] view of the [r, S·K] result)."""
    S = x.shape[0]
    a, b = x.shape[1:]
    _, _, g, dq = torch.ops.fp4compile.quantize_dq(
        x.reshape(S * a, b), rounding=spec.rounding, four_over_six=spec.four_over_six,
        block2d=spec.block == (16, 16), hadamard=spec.hadamard or 0, signs=signs, seed=seed, transpose=transpose,
        amax=amax)
    return (dq.view(b, S, a).permute(1, 0, 2) if transpose else dq.view(S, a, b)), g


def _bgemm_dq(pa, pb, out_dtype=torch.bfloat16) -> torch.Tensor:
    """The product of two stacks of (bf16 q·S, global) pairs, as :func:`_q_stack_dq` gives them (and
    :func:`_bgemm_nvfp4` after its dequantization): (dq_a · dq_bᵀ) * (a_global * b_global) in FP32, one rounding to
    ``out_dtype`` (symmetric :func:`_gram` when ``pa is pb``)."""
    return ns_glue.scale_rows(*_bgemm_dq_parts(pa, pb), out_dtype)   # one pass, rounded once


def _bgemm_dq_parts(pa, pb):
    """:func:`_bgemm_dq` before its scaling: (dq_a · dq_bᵀ FP32, a_global * b_global FP32 0-dim)."""
    a, ag = pa
    b, bg = pb
    return _gram(a, True) if pb is pa else _bmm_f32(a, b), ag.float() * bg.float()


#: what ``residual`` may quantize in two terms: X of X Xᵀ ("x"), Xᵀ of B·X ("xt"), or ("x2d", alone) X once per
#: step in 16x16 blocks, whose two terms serve both products (2-D blocks are transpose-invariant)
RESIDUAL_OPERANDS = ("x", "xt", "x2d")


def _q_two_term(x: torch.Tensor, qfn, spec, signs, seed):
    """``x`` [S, r, K] quantized in two terms along K: (q1, q2) with q1 = Q(x) and q2 = Q(x - q1) (the FP32
    residual of the first quantization, quantized with its own global and block scales), so that
    q1 + q2 = x up to ~the square of one NVFP4 quantization's relative error. Both in :func:`_bgemm_dq`'s
    operand form (:func:`_dq_form`: each dequantized once, for the residual and every product it enters);
    ``seed``: a callable drawing one seed per quantization."""
    p1 = _dq_form(qfn(x, spec, signs, seed()))
    return p1, _dq_form(qfn(x.float() - _dequantized(p1), spec, signs, seed()))


def _check_ns_options(spec, sym_b: bool, residual, shared_x: bool = False) -> None:
    """The NVFP4 NS options' clear errors (:func:`_ns_nvfp4_stack`; QRoot checks its groups with it):
    ``residual`` a tuple or list of :data:`RESIDUAL_OPERANDS` names, ``"x2d"`` alone; ``shared_x`` without
    ``residual`` (each of those quantizes X its own way); none of them with an RHT spec (a rotation along K breaks
    B's symmetry, moves the residual out of X's coordinates, and makes X's copy differ from its transpose's)."""
    if (isinstance(residual, str) or not isinstance(residual, (tuple, list))
            or set(residual) - set(RESIDUAL_OPERANDS) or ("x2d" in residual and len(set(residual)) > 1)):
        raise ValueError(f"residual (QRoot's ns_residual) must be a tuple of names from {RESIDUAL_OPERANDS}, "
                         f"\"x2d\" alone; got {residual!r}")
    if shared_x and residual:
        raise ValueError(f"shared_x (QRoot's ns_shared_x) quantizes X once for both products; residual (ns_residual) "
                         f"{tuple(residual)!r} quantizes it its own way (\"x2d\" is the two-term shared X): use one")
    hadamard = spec.hadamard if spec is not None and spec.name == "nvfp4" else None
    if hadamard and shared_x:
        raise ValueError(f"shared_x (QRoot's ns_shared_x) serves B·X with the transpose of X's 16x16-block copy, which "
                         f"an RHT along K does not give; the NS spec {spec} has hadamard={hadamard}")
    if hadamard and sym_b:
        raise ValueError(f"sym_b (QRoot's ns_sym_b) quantizes a symmetric B in 16x16 blocks, which an RHT does not "
                         f"keep symmetric; the NS spec {spec} has hadamard={hadamard}")
    if hadamard and residual:
        raise ValueError(f"residual (QRoot's ns_residual) takes X's residual in X's own coordinates, which an RHT "
                         f"rotates; the NS spec {spec} has hadamard={hadamard}")


def _loop_gemm_nvfp4(qa, qb, out_dtype=torch.bfloat16) -> torch.Tensor:
    """Reference for :func:`_bgemm_nvfp4`: the same quantized stacks, one ``fp4compile::gemm`` per matrix (each
    matrix's codes and scales made contiguous: a stack from ``_q_stack(transpose=True)`` holds strided views)."""
    c = torch.Tensor.contiguous
    return torch.stack([torch.ops.fp4compile.gemm(c(qa[0][i]), c(qa[1][i]), qa[2], c(qb[0][i]), c(qb[1][i]), qb[2],
                                                  out_dtype=out_dtype) for i in range(qa[0].shape[0])])


def _ns_nvfp4_stack(X: torch.Tensor, coeffs, spec, signs, seeds, guard=1.0, product=_bgemm_nvfp4,
                    quant=None, shift=False, sym_b=False, residual=(), shared_x=False) -> torch.Tensor:
    """NS on a stack X [S, m, n] of BF16 matrices (m <= n), all three products in NVFP4, batched over the
    stack (see the module docstring): per step 4 quantize calls, 4 ``dequantize_blocks`` and 3 bmm whatever S.

    ``product``: :func:`_bgemm_nvfp4` (default) or :func:`_loop_gemm_nvfp4` (the per-matrix reference on the
    same quantized operands). ``guard``: as in :func:`_ns_nvfp4_one`, per matrix (batched power iteration).
    ``quant``: the operand quantizer (default :func:`_q_stack`; :func:`_q_stack_dq` with ``product``
    :func:`_bgemm_dq` under :data:`NS_DQ`); ``bench/ns_quality.py`` passes an identity with an exact ``product``
    to separate the guard's effect from the products' error. ``shift``: compute A² and B X
    from the identity-shifted matrices (:func:`_shifted_poly`; same number of products and quantizations).
    ``sym_b``: B of B·X quantized in 16x16 blocks (``spec`` with ``block=(16, 16)``): a symmetric B gets a
    symmetric quantized copy (a 16x16 tile and its mirror share one amax), so B's quantization error is a
    symmetric matrix, which moves X's singular values but not, to first order, its singular vectors
    (``study.ns_step_increments``, docs/OPTIM.md).
    ``residual``: operands of :data:`RESIDUAL_OPERANDS` quantized in two terms (:func:`_q_two_term`), each
    product with such an operand a :func:`_bgemm_dq` of the terms (what ``product`` computes of NVFP4 operands),
    summed in FP32 and rounded once: ``"x"``: A = q1 q1ᵀ + C + Cᵀ
    with C = q1 q2ᵀ (q2 q2ᵀ, of the order of the residual squared, is left out), one product more;
    ``"xt"``: B·X = qB q1ᵀ + qB q2ᵀ, one product more. Each adds a quantization and a product per step.
    ``("x2d",)``: X quantized once per step, in 16x16 blocks and two terms, before the guard; the terms serve
    X Xᵀ as with ``"x"`` and, transposed, B·X as with ``"xt"`` (a 16x16-block quantization of Xᵀ is the transpose
    of X's), the guard's rescaling of X applied to B·X's FP32 result: 4 quantizations per step, as without
    ``residual``, and 5 products.
    ``shared_x``: X quantized once per step, in 16x16 blocks and one term, before the guard: its copy is X Xᵀ's
    operand and, transposed, B·X's (the same values as a 16x16-block quantization of Xᵀ), the guard's rescaling
    applied with B·X's global scale (one factor g·sqrt(s) per matrix on the FP32 product); with ``shift`` the update
    also takes X's sqrt(s) in its factor, X <- ((a + beta) sqrt(s)) X + (g sqrt(s)) P in one pass, with no rescaled
    copy of X. 3 quantizations and 3 dequantizations per step instead of 4 and 4, no transposing pass and one pass
    over X fewer, the same 3 products. Its error against the polar factor, with ``sym_b``: the default's within
    −2 … +5 % on synthetic momenta, +3 … +6 % (direction +6 … +13 %) on a tiny GPT's real ones (docs/OPTIM.md).
    """
    qfn = quant or _q_stack
    S, m, _ = X.shape
    seed = _seed_stream(seeds)

    _check_ns_options(spec, sym_b, residual, shared_x)
    if residual and product not in (_bgemm_nvfp4, _bgemm_dq):
        raise ValueError("residual's products are _bgemm_dq of the dequantized terms: it runs with the default "
                         "product only")
    x2d = "x2d" in residual
    spec2d = dataclasses.replace(spec, block=(16, 16))
    # FUSE_AMAX: per step three int32 amax slots (E, Bs, next X), zeroed by one fill for the whole NS
    fuse = FUSE_AMAX and qfn in (_q_stack, _q_stack_dq) and _ops.takes_amax(spec.rounding, spec.hadamard or 0)
    slots = torch.zeros(3 * len(coeffs), dtype=torch.int32, device=X.device) if fuse else None

    def slot(i):
        return None if slots is None else slots[i:i + 1]

    def q(x, qspec, sl=None):                                # qfn with the slot's amax, when there is one
        seed_ = seed()
        return qfn(x, qspec, signs, seed_) if sl is None else qfn(x, qspec, signs, seed_, amax=ns_glue.amax_value(sl))
    x_slot = None                                            # X's amax, when the previous update took it
    for step, (a, b, c) in enumerate(coeffs):
        e_slot, b_slot = slot(3 * step), slot(3 * step + 1)
        nx_slot = slot(3 * step + 2) if step + 1 < len(coeffs) else None
        s = None                                             # the guard's per-matrix rescaling of A (X by sqrt)
        if "x" in residual or x2d:                           # along n: X Xᵀ contracts over the long dim
            px, rx = _q_two_term(X, qfn, spec2d if x2d else spec, signs, seed)
            C = _bgemm_dq(px, rx, torch.float32)
            A = (_bgemm_dq(px, px, torch.float32) + C + C.mT).to(torch.bfloat16)
        elif shared_x:                                       # X once, 16x16 blocks: also B·X's operand
            qx = q(X, spec2d, x_slot)
            px = _dq_form(qx)                                # dequantized once, for both products
            A = _bgemm_dq(px, px) if product in (_bgemm_nvfp4, _bgemm_dq) else product(qx, qx)
        else:
            qx = q(X, spec, x_slot)
            A = product(qx, qx)                              # [S, m, m]
        x_slot = None
        if guard is not None:
            # the guard of _ns_nvfp4_one per matrix, with fewer launches: 6 power-iteration matvecs normalized
            # once half-way (normalizing is only a scale; with lambda_max(A) of an NS iterate in ~[1e-4, 10] no
            # FP32 under/overflow), then the Rayleigh quotient v'Av / v'v
            # (A v: ns_glue.matvec, A.float() @ v from A's bf16 values, no FP32 copy of A on CUDA)
            v = torch.full((S, m, 1), 1.0 / math.sqrt(m), device=A.device)
            for i in range(6):
                v = ns_glue.matvec(A, v)
                if i == 2:
                    v = v / (v.norm(dim=1, keepdim=True) + 1e-30)
            lam = torch.bmm(v.mT, ns_glue.matvec(A, v)) / (torch.bmm(v.mT, v) + 1e-30)   # [S, 1, 1]
            s = torch.clamp(guard * guard / torch.clamp(lam, min=1e-30), max=1.0)
            A = ns_glue.scale_rows(A, s, A.dtype)            # (A.float() * s).to(bf16) in one pass
            if not (shared_x and shift):                     # (shared_x + shift: sqrt(s) in the update's factors)
                X = ns_glue.scale_rows(X, s.sqrt(), X.dtype)
        if shift:
            def square(E):
                qE = q(E, spec, e_slot)                      # E symmetric, like A
                if product in (_bgemm_nvfp4, _bgemm_dq):     # its scale and rounding in shift_poly's pass
                    pE = _dq_form(qE)
                    return _bgemm_dq_parts(pE, pE)
                return product(qE, qE), None
            B, beta = _shifted_poly(A, b, c, square, (e_slot, b_slot))   # B here is Bs = B - beta I
        else:
            qA = qfn(A, spec, signs, seed())                 # along m; A symmetric: A·A = A·Aᵀ
            B, beta, b_slot = b * A + c * product(qA, qA), None, None
        qB = q(B, spec2d if sym_b else spec, b_slot)         # rows of B along m
        if shared_x and beta is not None:                    # B·X over X's 16x16-block copy, transposed view;
            P, g = _bgemm_dq_parts(_dq_form(qB), (px[0].mT, px[1]))     # the guard's sqrt(s) with both factors
            k = (a + beta).float()
            if s is not None:
                k, g = k * s.sqrt(), g * s.sqrt()
            X = ns_glue.axpy_rows(X, k, P, X.dtype, y_scale=g, amax=nx_slot)
            x_slot = nx_slot
            continue
        if x2d or shared_x or "xt" in residual:              # B·X over Xᵀ's terms [S, n, m]
            if x2d or shared_x:                              # X's own terms, transposed views
                terms = [(t.mT, g) for t, g in ((px,) if shared_x else (px, rx))]
            else:
                terms = _q_two_term(X.mT.contiguous(), qfn, spec, signs, seed)
            pB = _dq_form(qB)
            BX = sum(_bgemm_dq(pB, t, torch.float32) for t in terms)
            if (x2d or shared_x) and s is not None:
                BX = BX * s.sqrt()                           # X was quantized before the guard rescaled it
            X = _ns_update(X, a, beta, BX.to(torch.bfloat16))
            continue
        if qfn in (_q_stack, _q_stack_dq) and m % (spec.hadamard or 16) == 0:
            qxt = qfn(X, spec, signs, seed(), transpose=True)    # Xᵀ, no transposed copy
        else:
            qxt = qfn(X.mT.contiguous(), spec, signs, seed())
        if beta is not None and product in (_bgemm_nvfp4, _bgemm_dq):
            # (a + beta) X + Bs X from the FP32 product and its global scale in one pass: the bits of
            # _ns_update(X, a, beta, product(qB, qxt)) without the bf16 B·X stored and read back
            P, g = _bgemm_dq_parts(_dq_form(qB), _dq_form(qxt))
            X = ns_glue.axpy_rows(X, (a + beta).float(), P, X.dtype, y_scale=g, amax=nx_slot)
            x_slot = nx_slot
        else:
            X = _ns_update(X, a, beta, product(qB, qxt))     # X <- a X + B·X  [S, m, n]
    return X


def ns_input(G: torch.Tensor, norm_scale: float = 1.0, eps: float = 1e-7):
    """NS's first iterate of ``G`` ([m, n] or [B, m, n]): (X0 [B, m', n'] BF16 with m' <= n', tall), X0 =
    G / (||G||_F * norm_scale + eps) per matrix, transposed when ``G`` is tall (``tall``)."""
    X = G.unsqueeze(0) if G.dim() == 2 else G
    if X.dim() != 3:
        raise ValueError(f"newton_schulz takes [m, n] or [B, m, n], got shape {tuple(G.shape)}")
    X = X.to(torch.bfloat16)
    tall = X.shape[-2] > X.shape[-1]
    if tall:
        X = X.mT
    return X / (X.norm(dim=(-2, -1), keepdim=True) * norm_scale + eps), tall


def newton_schulz(G: torch.Tensor, coeffs: Sequence[Coeffs], *, spec=None, signs=None, seed=None,
                  eps: float = 1e-7, norm_scale: float = 1.0, guard: Optional[float] = 1.0,
                  shift: bool = False, sym_b: bool = False, residual: Sequence[str] = (),
                  shared_x: bool = False) -> torch.Tensor:
    """Orthogonalize ``G`` ([m, n] or a stack [B, m, n]) with the quintic NS iteration; returns BF16.

    ``spec``: None/BF16 for BF16 matmuls, or a ``policy.NVFP4`` spec for NVFP4 products (matrices whose
    dims are not multiples of 16 fall back to BF16 with a warning). ``signs``: the RHT sign vector when the
    spec has a Hadamard size. ``seed``: int64 0-dim tensor for stochastic rounding specs. ``guard``
    (NVFP4 only; None disables): before each step rescale the iterate so its power-iteration estimate of
    sigma_max is <= guard. Without it NVFP4 NS with Jordan's or ROOT's coefficients diverges (docs/OPTIM.md).
    ``shift`` (NVFP4 only): quantize A - alpha I and B - beta I instead of A and B (:func:`_shifted_poly`).
    ``sym_b`` (NVFP4 only): B of B·X in 16x16 blocks (:func:`_ns_nvfp4_stack`).
    ``residual`` (NVFP4 only): X's quantizations to take in two terms, names of :data:`RESIDUAL_OPERANDS`
    (:func:`_ns_nvfp4_stack`). ``shared_x`` (NVFP4 only): X quantized once per step in 16x16 blocks for both
    products (:func:`_ns_nvfp4_stack`).
    """
    squeeze = G.dim() == 2
    X, tall = ns_input(G, norm_scale, eps)
    use_fp4 = spec is not None and spec.name == "nvfp4"
    if use_fp4 and not _nvfp4_ok(X.shape[-2], X.shape[-1]):
        warnings.warn(f"Q-Root: NS of a {tuple(G.shape[-2:])} matrix runs in BF16 (NVFP4 needs dims that are "
                      f"multiples of 16)", stacklevel=2)
        use_fp4 = False
    if use_fp4:
        dq = dict(quant=_q_stack_dq, product=_bgemm_dq) if NS_DQ else {}
        X = _ns_nvfp4_stack(X.contiguous(), coeffs, spec, signs, seed, guard, shift=shift, sym_b=sym_b,
                            residual=residual, shared_x=shared_x, **dq)
    else:
        for a, b, c in coeffs:
            A = _gram(X, False)
            B = b * A + c * _gram(A, False)                  # A symmetric: A·A = A·Aᵀ
            X = a * X + B @ X
    if tall:
        X = X.mT
    return X.squeeze(0) if squeeze else X


#: how :func:`abs_quantile` finds the two order statistics it interpolates: ``"topk"`` (the default since session 43:
#: ``torch.topk`` of the row's largest N - lo values, the two smallest of which are the ones wanted, a selection
#: instead of a whole sort) or ``"sort"`` (sort each row); the same values bit for bit. ``FP4COMPILE_ROOT_QUANTILE``
#: sets it at import. CPU (2 cores, 12 rows of 768·3072): sort 1.54 s, topk 0.17 s. H200 (session 43, CUDA graphs),
#: Q-Root step on the 124M set 34.38 -> 30.49 ms (BF16 NS 13.75 -> 9.91), on the 1B set 344.2 -> 316.6 ms (BF16 NS
#: 149.1 -> 120.6): the sort's radix passes were 4.3 ms of the 124M step.
QUANTILE_IMPL = os.environ.get("FP4COMPILE_ROOT_QUANTILE", "topk")
#: Root's element-wise step (the momentum buffers, the Nesterov direction, the step counters, weight decay and the
#: update) by ``torch._foreach_*`` ops, one multi-tensor launch per op for a group's matrices, as torch.optim's
#: optimizers do by default on CUDA, instead of a few launches per matrix; the same arithmetic per element.
#: ``FP4COMPILE_ROOT_FOREACH=0`` turns it off at import (the per-matrix loop).
ROOT_FOREACH = os.environ.get("FP4COMPILE_ROOT_FOREACH", "1") not in ("", "0")
QUANTILE_IMPLS = ("sort", "topk")


def abs_quantile(x: torch.Tensor, q: float, impl: Optional[str] = None) -> torch.Tensor:
    """Per-row q-quantile of |x| for x [B, N], linear interpolation (torch.quantile's default), any size.

    With s the row's |x| sorted ascending, pos = q (N - 1), lo = floor(pos), hi = min(lo + 1, N - 1) and
    w = pos - lo, the quantile is ``s[lo] * (1 - w) + s[hi] * w`` (FP32). ``impl`` (default
    :data:`QUANTILE_IMPL`): ``"sort"`` sorts the row; ``"topk"`` takes the N - lo largest values sorted
    descending, whose last two are s[lo] and s[lo + 1]. Both return elements of |x| (NaN sorts above every
    number in both), so the results are equal bit for bit."""
    return _abs_quantile_and_max(x, q, impl)[0]


def _abs_quantile_and_max(x: torch.Tensor, q: float, impl: Optional[str] = None):
    """(:func:`abs_quantile`, the row's max |x|: NaN if the row has a NaN), the max from the same sort or top-k."""
    impl = impl or QUANTILE_IMPL
    if impl not in QUANTILE_IMPLS:
        raise ValueError(f"FP4COMPILE_ROOT_QUANTILE / root.QUANTILE_IMPL must be one of {QUANTILE_IMPLS}, "
                         f"got {impl!r}")
    n = x.shape[-1]
    pos = q * (n - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, n - 1)
    w = pos - lo
    a = x.abs().float()
    if impl == "sort":
        s = a.sort(dim=-1).values
        return s[:, lo] * (1 - w) + s[:, hi] * w, s[:, -1]
    k = n - lo                                     # s[lo] is the k-th largest, s[hi] the (k - 1)-th (hi > lo)
    t = a.topk(k, dim=-1, largest=True, sorted=True).values
    return t[:, k - 1] * (1 - w) + t[:, k - 1 - (hi - lo)] * w, t[:, 0]


def clip_by_quantile(U: torch.Tensor, q: float) -> torch.Tensor:
    """ROOT's soft-threshold clip: each matrix of ``U`` ([m, n] or a stack [B, m, n]) clamped to
    +-(its ``q``-quantile of |U| + 1e-9).

    A matrix with a NaN or an Inf comes back all NaN (its bound is NaN: + 0 x its max |U|, which adds exactly 0
    otherwise), so the update of a diverging parameter is NaN, as an unclipped NS would make it; the clamp alone
    would turn an Inf into the finite bound and keep it there every step (the momentum buffer stays Inf)."""
    X = U if U.dim() == 3 else U.unsqueeze(0)
    qv, mx = _abs_quantile_and_max(X.reshape(X.shape[0], -1), q)
    eps = (qv + 1e-9 + 0.0 * mx).view(-1, 1, 1)
    X = torch.clamp(X, -eps, eps)                   # one pass (eps > 0: the same as max(min(X, eps), -eps))
    return X if U.dim() == 3 else X[0]


# ----------------------------------------------------------------------------------------------
# the optimizer
ROOT_DEFAULTS = dict(use_root=None, momentum=0.95, nesterov=True, clip_quantile=0.99, ns_steps=5,
                     ns_schedule="root", ns_guard=1.0, ns_shift=True, ns_sym_b=None, ns_residual=(),
                     ns_shared_x=None, update_scale=0.2, betas=(0.9, 0.95), eps=1e-8, adamw="qadamw")


class QRoot(Optimizer):
    """ROOT for matrices (NS in the precision of the policy's ``optim.ns`` role) + (Q-)AdamW for the rest.

    Args:
        params: parameters or groups. Group key ``use_root``: True (Root), False ((Q-)AdamW) or None (auto:
            Root for 2-D tensors). :meth:`param_groups_for` builds ROOT's split (embeddings, heads, 1-D ->
            AdamW) from a module.
        lr, weight_decay: shared by both parts (Root's update is RMS-matched to AdamW by ``update_scale``
            * sqrt(max(m, n)), Moonlight-style, so one lr serves both).
        momentum, nesterov, clip_quantile (0.99; ROOT's own code uses 0.90), ns_steps (5),
        ns_schedule ("root" | "root_table" | "jordan" | "polar_express", see :func:`ns_coefficients`),
        update_scale (0.2), ns_guard (1.0: sigma_max guard of the NVFP4 NS iterates; None disables),
        ns_shift (True: NVFP4 NS quantizes the identity-shifted A - alpha I and B - beta I, see
        :func:`_shifted_poly`; False: A and B themselves, the unshifted form of sessions 1-5),
        ns_sym_b (None: on where the NS spec allows it, an NVFP4 spec without an RHT; True: NVFP4 NS quantizes B of
        B·X in 16x16 blocks, a symmetric copy of a symmetric B; False: in 1x16 blocks along K),
        ns_residual (() or a subset of ("x", "xt"): X's quantizations for X Xᵀ / for B·X taken in two NVFP4
        terms, one product and one quantization more per step each; or ("x2d",): one two-term quantization of X
        in 16x16 blocks serving both, 4 quantizations and 5 products per step; neither option with an RHT spec; see
        :func:`_ns_nvfp4_stack`; error against the polar factor in docs/OPTIM.md).
        ns_shared_x (None: on where the NS spec allows it, an NVFP4 spec without an RHT and no ``ns_residual``;
        True: NVFP4 NS quantizes X once per step, in 16x16 blocks, for both X Xᵀ and B·X: 3 quantizations per step
        instead of 4 and no transposing pass, at a few per cent more error; not with ``ns_residual`` or an RHT spec;
        :func:`_ns_nvfp4_stack`). The resolved value is stored in the group (and its state dict).
        betas, eps, adamw ("qadamw" | "adamw") and the Q-AdamW storage keys (``min_numel``, ``tile``, ...):
            the AdamW part.
        policy: a ``fp4compile.Policy`` or preset name (default ``Policy.full_stack()``); the NS precision is
            ``policy.resolve(module_path, "optim.ns")``. ``precision``: a spec ("bf16", "nvfp4", ``BF16``,
            ``NVFP4(...)``) that overrides the policy. ``module_path``: the path the policy is asked about.
        fused: the AdamW part through Q-AdamW's fused multi-tensor kernels (None: for CUDA parameters; True
            requires them; False: the per-parameter torch step, compiled per ``compile``).
        compile: torch.compile the AdamW part's per-parameter torch steps where they run (None: on CUDA).
        cuda_graphs: for CUDA parameters, capture the orthogonalization of each shape stack as a CUDA graph
            on its first step (after one eager warm-up run) and replay it afterwards
            (:meth:`orthogonalize_graphed`): the NVFP4 Newton–Schulz issues ~470 ops per stack and step, and
            launched eagerly it is bound by the host (H200, 124M: 28.1 ms graphed vs 44.5 ms eager per step).
            Off by default for the class; ``fp4compile train`` turns it on when the model runs as CUDA graphs.

    Non-finite gradients: a NaN or an Inf in a matrix's gradient makes that parameter all NaN at the step (the clip
    passes it on, :func:`clip_by_quantile`; its momentum keeps it, so it stays NaN), and under NVFP4 NS every matrix
    of the same shape too (they are orthogonalized as one stack with one global scale); a diverging run shows as
    one. The AdamW part follows (Q-)AdamW.
    """

    #: weight decay is W <- (1 - lr wd) W, outside the gradient (LoRA-SVD's frozen branches follow it)
    decoupled_weight_decay = True

    def __init__(self, params, lr=1e-3, weight_decay=0.1, *, policy=None, precision=None,
                 module_path: str = "optim", compile: Optional[bool] = None, fused: Optional[bool] = None,
                 cuda_graphs: bool = False, **kw):
        from ..policy import BF16, NVFP4, Policy

        known = set(ROOT_DEFAULTS) | set(_qa.QADAMW_DEFAULTS)
        unknown = set(kw) - known
        if unknown:
            raise TypeError(f"QRoot got unexpected keyword arguments {sorted(unknown)}")
        defaults = dict(lr=lr, weight_decay=weight_decay, maximize=False, amsgrad=False, differentiable=False,
                        **{**_qa.QADAMW_DEFAULTS, **ROOT_DEFAULTS, **kw})
        super().__init__(params, defaults)
        if precision is not None:
            if isinstance(precision, str):
                precision = {"bf16": BF16, "nvfp4": NVFP4()}.get(precision)
                if precision is None:
                    raise ValueError("precision must be 'bf16', 'nvfp4', BF16 or an NVFP4(...) spec")
            spec = precision
        else:
            if policy is None:
                policy = Policy.full_stack()
            elif isinstance(policy, str):
                policy = Policy.preset(policy)
            spec = policy.resolve(module_path, "optim.ns")
        if spec.name not in ("bf16", "nvfp4"):
            raise ValueError(f"unsupported NS precision {spec!r}")
        self.ns_spec = spec
        self._ns_signs = None
        if spec.name == "nvfp4" and spec.hadamard:
            gen = torch.Generator().manual_seed(0x5EED)
            self._ns_signs = (torch.randint(0, 2, (spec.hadamard,), generator=gen) * 2 - 1).float()
        self._signs_by_device = {}   # _ns_signs copied once per device (orthogonalize)
        if not isinstance(cuda_graphs, bool):
            raise TypeError(f"cuda_graphs must be a bool, got {cuda_graphs!r}")
        self._cuda_graphs = cuda_graphs
        self._graphs = {}            # orthogonalize_graphed: key -> (graph, static input, static output)
        self._graph_pool = None      # one memory pool shared by those graphs (replayed one after another)
        for g in self.param_groups:
            self._check_group(g)
        self._compile_flag = compile
        self._fused_flag = fused
        self._plans = {}         # fused AdamW-part tables per param group (fused.FusedPlan)
        self._plan_version = 0   # bumped when states are created or loaded
        self._lr_bufs = _qa._LrBuffers()
        self._index = {}

    # -- groups ---------------------------------------------------------------------------------
    @staticmethod
    def param_groups_for(model: torch.nn.Module, head_names: Iterable[str] = ("lm_head", "head", "wte", "wpe",
                                                                              "embed")) -> list:
        """ROOT's split: 2-D weights of non-embedding modules -> Root; embeddings, heads, 1-D -> AdamW."""
        emb = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
        root, other, seen = [], [], set()
        for name, p in model.named_parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            is_head = any(h in name.split(".") or name.startswith(h) for h in head_names)
            (root if p.dim() == 2 and id(p) not in emb and not is_head else other).append(p)
        groups = []
        if root:
            groups.append({"params": root, "use_root": True})
        if other:
            groups.append({"params": other, "use_root": False})
        return groups

    def _check_group(self, g):
        if not 0.0 <= g["momentum"] < 1.0:
            raise ValueError(f"Invalid momentum: {g['momentum']}")
        if not 0.0 < g["clip_quantile"] <= 1.0:
            raise ValueError(f"clip_quantile must be in (0, 1], got {g['clip_quantile']}")
        if g["ns_schedule"] not in SCHEDULES:
            raise ValueError(f"unknown ns_schedule {g['ns_schedule']!r}; choose one of {SCHEDULES}")
        if not isinstance(g["ns_steps"], int) or g["ns_steps"] < 1:
            raise ValueError(f"ns_steps must be a positive int, got {g['ns_steps']!r}")
        if g["adamw"] not in ("qadamw", "adamw"):
            raise ValueError(f"adamw must be 'qadamw' or 'adamw', got {g['adamw']!r}")
        if not isinstance(g.get("ns_shift", False), bool):
            raise ValueError(f"ns_shift must be a bool, got {g['ns_shift']!r}")
        for key in ("ns_sym_b", "ns_shared_x"):
            if g.get(key) is not None and not isinstance(g[key], bool):
                raise ValueError(f"{key} must be a bool or None (on where the NS spec allows it), got {g[key]!r}")
        spec = getattr(self, "ns_spec", None)
        if spec is not None:   # None (the default): on for an NVFP4 NS spec without an RHT (_check_ns_options)
            plain = spec.name == "nvfp4" and not spec.hadamard
            if g.get("ns_sym_b") is None:
                g["ns_sym_b"] = plain
            if g.get("ns_shared_x") is None:
                g["ns_shared_x"] = plain and not g.get("ns_residual", ())
        _check_ns_options(spec, bool(g.get("ns_sym_b")), g.get("ns_residual", ()), bool(g.get("ns_shared_x")))
        g["ns_residual"] = tuple(sorted(set(g.get("ns_residual", ()))))
        _qa.check_group({**g, "quantize": g["quantize"] and g["adamw"] == "qadamw"})
        if g["use_root"]:
            bad = [tuple(p.shape) for p in g["params"] if p.dim() != 2]
            if bad:
                raise ValueError(f"use_root=True needs 2-D parameters, got shapes {bad}")

    def add_param_group(self, param_group):
        """Add a parameter group (as ``torch.optim.Optimizer.add_param_group``: missing hyperparameters take the
        constructor's defaults), then validate it (``use_root=True`` needs 2-D parameters); a bad value raises
        ``ValueError`` and leaves the optimizer's groups as they were."""
        super().add_param_group(param_group)
        if hasattr(self, "ns_spec"):
            try:
                self._check_group(self.param_groups[-1])
            except Exception:
                self.param_groups.pop()
                raise

    @staticmethod
    def _is_root(p, group) -> bool:
        u = group["use_root"]
        return p.dim() == 2 if u is None else bool(u)

    def _param_index(self, p) -> int:
        return _qa.param_index(self, p)

    def _adamw_group(self, g):
        return {**g, "quantize": g["quantize"] and g["adamw"] == "qadamw", "amsgrad": False}

    # -- step -----------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """Perform one optimization step (``closure`` re-evaluates the loss, as in torch.optim): Root's update
        (Nesterov momentum, outlier clipping, Newton–Schulz under ``ns_spec``, shape-aware scaling) for the 2-D
        parameters of groups with Root, (Q-)AdamW for the rest."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            root_ps, adam_ps = [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("QRoot does not support sparse gradients")
                (root_ps if self._is_root(p, group) else adam_ps).append(p)
            if adam_ps:
                self._adamw_update(adam_ps, group, gi)
            if root_ps:
                self._root_update(root_ps, group)
        return loss

    def _adamw_update(self, params, group, gi):
        ag = self._adamw_group(group)
        params = _qa.init_and_run_fused(self, gi, ag, params)
        for p in params:
            use_compile = _qa.resolve_compile(self._compile_flag, [p])
            _qa.run_adamw_update(p, self.state[p], ag, gi, self._lr_bufs, use_compile)

    def orthogonalize(self, U: torch.Tensor, group: dict) -> torch.Tensor:
        """Clip + NS of a stack U [B, m, n] of Nesterov momenta (the Root direction before scaling)."""
        Bc = clip_by_quantile(U, group["clip_quantile"])
        coeffs = ns_coefficients(U.shape, group["ns_steps"], group["ns_schedule"])
        norm_scale = 1.01 if group["ns_schedule"] == "polar_express" else 1.0
        # the seed and the RHT signs live on U's device: a CPU tensor would be copied to the GPU by every
        # quantize call, and a blocking host-to-device copy synchronizes the stream (~20 per NS stack)
        seed = None
        if self.ns_spec.name == "nvfp4" and self.ns_spec.rounding != "rtn":
            seed = torch.randint(0, 2 ** 31 - 1, (), dtype=torch.int64, device=U.device)
        signs = None
        if self._ns_signs is not None:
            signs = self._signs_by_device.get(U.device)
            if signs is None:
                signs = self._signs_by_device[U.device] = self._ns_signs.to(U.device)
        return newton_schulz(Bc, coeffs, spec=self.ns_spec, signs=signs, seed=seed,
                             norm_scale=norm_scale, guard=group["ns_guard"], shift=group["ns_shift"],
                             sym_b=group["ns_sym_b"], residual=group["ns_residual"],
                             shared_x=group["ns_shared_x"])

    def orthogonalize_graphed(self, U, group: dict) -> torch.Tensor:
        """:meth:`orthogonalize` of a CUDA stack, replayed from a CUDA graph.

        ``U``: the stack [S, m, n], or its S matrices as a list (stacked straight into the graph's static
        input: no separate stack tensor and copy per step). One graph per (stack shape, dtype, device, NS
        hyper-parameters), captured on first use after an eager warm-up run on a side stream (which fits the NS
        coefficients, compiles the kernels and fills the cached tensors, none of which may happen during a
        capture); later calls fill the static input and replay. The result is the graph's static output: valid
        until the same graph is replayed again (``_root_update`` consumes it first). Stochastic-rounding seeds
        are drawn inside the graph from the CUDA generator, which advances on every replay, so each step still
        rounds with fresh randomness. All the graphs share one memory pool: they are replayed one after another
        on the same stream.
        """
        mats = None if isinstance(U, torch.Tensor) else list(U)
        first = U if mats is None else mats[0]
        shape = tuple(U.shape) if mats is None else (len(mats), *first.shape)
        key = (shape, first.dtype, first.device, group["clip_quantile"], group["ns_steps"], group["ns_schedule"],
               group["ns_guard"], group["ns_shift"], group["ns_sym_b"], group["ns_residual"], group["ns_shared_x"],
               QUANTILE_IMPL, FUSE_AMAX,
               SYMMETRIC_MIN_ROWS, NS_DQ, ns_glue.KERNEL)  # switches: captured
        entry = self._graphs.get(key)
        if entry is None:
            static_in = U.clone() if mats is None else torch.stack(mats)
            cur = torch.cuda.current_stream(first.device)
            side = torch.cuda.Stream(first.device)
            side.wait_stream(cur)
            with torch.cuda.stream(side):
                self.orthogonalize(static_in, group)
            cur.wait_stream(side)
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._graph_pool):
                static_out = self.orthogonalize(static_in, group)
            entry = self._graphs[key] = (graph, static_in, static_out)
        else:
            static_in = entry[1]
            if mats is None:
                static_in.copy_(U)
            else:
                torch.stack(mats, out=static_in)
        graph, _, static_out = entry
        graph.replay()
        return static_out

    def _root_update(self, params, group):
        mu, lr, wd = group["momentum"], group["lr"], group["weight_decay"]
        states = []
        for p in params:
            st = self.state[p]
            if not st:
                st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                st["momentum_buffer"] = torch.zeros_like(p, dtype=torch.float32)
            if st["step"].device != p.device:
                st["step"] = st["step"].to(p.device)
            states.append(st)
        bufs = [st["momentum_buffer"] for st in states]
        if ROOT_FOREACH:
            # one multi-tensor launch per op for the group's matrices on each device, the gradients as they are
            # (a BF16 one is promoted per element, as its FP32 copy would be: the same values, no copies kept)
            us = list(bufs)
            by_dev = {}
            for i, p in enumerate(params):
                by_dev.setdefault(p.device, []).append(i)
            for idx in by_dev.values():
                b, g = [bufs[i] for i in idx], [params[i].grad for i in idx]
                torch._foreach_add_([states[i]["step"] for i in idx], 1)
                torch._foreach_mul_(b, mu)
                torch._foreach_add_(b, g)
                if group["nesterov"]:
                    for i, u in zip(idx, torch._foreach_add(g, b, alpha=mu)):
                        us[i] = u
        else:
            us = []
            for p, st, buf in zip(params, states, bufs):
                st["step"].add_(1)
                g = p.grad.to(torch.float32)
                buf.mul_(mu).add_(g)
                us.append(g.add(buf, alpha=mu) if group["nesterov"] else buf)
        by_shape = {}
        for p, u in zip(params, us):
            by_shape.setdefault((tuple(p.shape), p.device, p.dtype), []).append((p, u))
        for (shape, dev, dtype), items in by_shape.items():
            us_ = [u for _, u in items]
            O = self.orthogonalize_graphed(us_, group) if self._cuda_graphs and dev.type == "cuda" else \
                self.orthogonalize(torch.stack(us_), group)
            scale = group["update_scale"] * math.sqrt(max(shape))
            ps_ = [p for p, _ in items]
            if ROOT_FOREACH and not isinstance(lr, torch.Tensor):
                torch._foreach_mul_(ps_, 1 - lr * wd)
                torch._foreach_add_(ps_, list(O.to(dtype).unbind(0)), alpha=-lr * scale)
                continue
            for p, o in zip(ps_, O):
                p.mul_(1 - lr * wd)
                p.add_(o.to(p.dtype), alpha=-lr * scale) if not isinstance(lr, torch.Tensor) else \
                    p.sub_(o.to(p.dtype) * (lr * scale))

    # -- state dict -----------------------------------------------------------------------------
    def load_state_dict(self, state_dict):
        """Validate every entry first (a bad checkpoint raises and changes nothing), then load."""
        def validate_entry(p, merged, st, where):
            if self._is_root(p, merged):
                _check_root_state(p, st, where)
            else:
                _qa.validate_state(p, self._adamw_group(merged), st, where)

        _qa.validate_loadable(self, state_dict, check_group_fn=self._check_group, validate_entry=validate_entry)
        super().load_state_dict(state_dict)
        _qa.post_load(self, state_dict)
        _qa.invalidate_plans(self)

    def __setstate__(self, state):
        super().__setstate__(state)
        _qa.restore_plan_fields(self)
        self.__dict__.setdefault("_signs_by_device", {})
        self.__dict__.setdefault("_cuda_graphs", False)
        self.__dict__.setdefault("_graphs", {})
        for g in self.param_groups:
            # state dicts saved before ns_shift existed were trained with the unshifted NS: resume them so
            g.setdefault("ns_shift", False)
            g.setdefault("ns_sym_b", False)
            g.setdefault("ns_shared_x", False)
            # a tuple (part of the CUDA-graph key): a JSON round trip (safetensors metadata) gives back a list
            g["ns_residual"] = tuple(g.get("ns_residual", ()))
        self.__dict__.setdefault("_graph_pool", None)


def _check_root_state(p, st, where):
    if set(st) != {"step", "momentum_buffer"}:
        raise ValueError(f"{where}: Root state must have exactly 'step' and 'momentum_buffer', got {sorted(st)}")
    buf = st["momentum_buffer"]
    if not isinstance(buf, torch.Tensor) or tuple(buf.shape) != tuple(p.shape):
        raise ValueError(f"{where}: momentum_buffer has shape {tuple(getattr(buf, 'shape', ()))}, expected "
                         f"{tuple(p.shape)}")
    if buf.dtype != torch.float32:
        raise ValueError(f"{where}: momentum_buffer has dtype {buf.dtype}, expected torch.float32")
    if not bool(torch.isfinite(buf).all()):
        raise ValueError(f"{where}: momentum_buffer contains NaN/Inf")
    s = float(st["step"])
    if not math.isfinite(s) or s < 0 or s != math.floor(s):
        raise ValueError(f"{where}: corrupt step counter {s}")
