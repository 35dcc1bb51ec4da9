r"""LoRA-SVD linear layers: a BF16 principal subspace beside an NVFP4 residual.

The Full-Stack FP4 paper's fix for the late-training stall of NVFP4 linears splits every weight into a
low-rank principal part that stays in BF16 and a residual that goes through NVFP4 (``recipes.md`` §4). The
paper's text was not readable; its form, rank, beta, initialisation and backward are therefore the
project's own, documented choices below. All are arguments of :func:`prepare`.

Parametrisation
---------------
Each selected ``nn.Linear(in, out)`` with weight W (out x in) becomes a :class:`LoRASVDLinear`::

    W = W_res + beta * L2 @ L1          L2 = lora_b.weight (out x r),  L1 = lora_a.weight (r x in)
    y = F.linear(x, W_res, bias) + lora_b(lora_a(x) * beta)

* ``F.linear(x, W_res, bias)`` is an ordinary linear site at the module's *own* path (e.g. ``h.0.mlp.c_fc``),
  with the parameter still called ``weight``: the backend quantizes it to NVFP4 under the usual role names
  (``linear.fprop/dgrad/wgrad``), nothing about it is special.
* The low-rank path is two ordinary linear sites at ``<path>.lora_a`` and ``<path>.lora_b``. A policy keeps
  them BF16 with the rule ``Rule(LORA_BF16_GLOB, None, BF16)``, ``LORA_BF16_GLOB = "*.lora_[ab]"``. beta
  multiplies the r-wide intermediate, not the out-wide output (cheaper, same function).
* Initialisation (the paper is silent; PiSSA-style balanced split): with the top-r SVD W ~ U S V^T,
  ``L2 = U sqrt(S) / sqrt(beta)``, ``L1 = sqrt(S) V^T / sqrt(beta)``, so ``beta L2 L1 = U S V^T`` whatever
  beta is, and ``W_res = W - beta L2 L1`` is computed from the *stored* (rounded) factors, so that
  ``W_res + beta L2 L1`` reproduces W to the rounding of W_res's storage dtype. beta then only changes the
  training dynamics: factor gradients scale with sqrt(beta) relative to their size. Defaults: ``rank=64``,
  ``beta=1.0``. Rank 64 (32 until session 12): in the 30M study (d = 640, forked from BF16 at step 800; three
  seeds, ``docs/LORA.md`` session 12) it cuts the NVFP4-linear gap by 48 %, against 34 % at rank 32 and ~60 % at
  rank 128 (two seeds), at rank 32's step time (0.86x NVFP4 linears' throughput). A float rank scales with the
  width instead. Exact SVD for layers with min(in, out) <= 1024, else the randomized SVD below (4 power steps).
* Parameter count: each converted layer adds ``r * (in + out)`` parameters (W_res keeps in*out; bias is
  unchanged). Factors are stored in the weight's dtype unless ``factor_dtype`` says otherwise; "BF16" in the
  paper's sense means *not quantized to NVFP4* (under autocast or in a BF16 model the branch computes in BF16).
* A weight whose leading singular values are all zero (e.g. zero-initialised output projections) gets zero
  factors; they cannot move on their own (both factor gradients vanish), the residual trains normally, and the
  first realignment gives them the then-principal subspace.

Subspace-constrained backward (``constrain="cholesky_qr"``, the default; ``None`` = plain autograd)
------------------------------------------------------------------------------------------------------
Let G = dLoss/dW (the same for W_res and for the product). Plain autograd gives the residual all of G *and*
the branch ``dL2 = beta G L1^T, dL1 = beta L2^T G``, so the principal subspace receives the gradient twice
and is free to rotate every step. The constrained backward splits G instead. With orthonormal bases
U = orth(L2) (out x r) and V = orth(L1^T) (in x r) and P_U = U U^T, P_V = V V^T::

    G_par  = P_U G P_V                      -> the BF16 branch
    G_perp = G - P_U G P_V                  -> the NVFP4 residual:   dW_res = G - U (U^T G V) V^T
    dL2    = beta G_par L1^T = P_U (beta G L1^T)      (since P_V L1^T = L1^T)
    dL1    = beta L2^T G_par = (beta L2^T G) P_V      (since L2^T P_U = L2^T)

so the factor gradients are the plain ones projected onto the current column space of L2 / row space of L1:
under SGD the branch only re-weights inside the principal subspace (the subspace itself moves only at
realignment), and the residual no longer accumulates a principal component, which is what keeps its dynamic
range, and hence its NVFP4 error, small. Under Adam the element-wise normalisation bends the updates slightly
out of the subspace; realignment absorbs that.

Implementation: three tensor hooks on the leaf parameters (``weight``, ``lora_a.weight``,
``lora_b.weight``). They run on each parameter's incoming gradient before accumulation, after the compiled
backward produced it, so they cost no graph break (``torch.compile(fullgraph=True)`` works) and leave the
residual's wgrad an ordinary NVFP4 GEMM; under compiled autograd they are traced like any hook. They are
linear in G and use the factors' current values, so gradient accumulation and data-parallel averaging commute
with them. Cost per layer and step: 4 r in out FLOPs for the residual correction (two GEMMs the size of the
low-rank path's) plus O((in + out) r^2) for the bases.

Cholesky-QR (:func:`cholesky_qr`): U and V come from shifted Cholesky-QR (Fukaya, Kannan, Nakatsukasa,
Zhang, Yamamoto, SIAM J. Sci. Comput. 2020; three passes by default, two in the hooks, where one (U, V) pair
per layer and backward is shared by the three hooks) in float64: normalise A by its Frobenius norm, then passes
``G = Q^T Q + s I, R = chol(G), Q <- Q R^{-1}`` with ``s = 11 (m n + n (n + 1)) u ||Q||_F^2`` (u = 2^-53).
In float64 that shift is ~1e-9 relative, invisible for well-conditioned factors, and it keeps every Gram
matrix positive definite, so rank-deficient or ill-conditioned factors do not produce NaN: an exactly null
direction comes out as a zero column, a numerically null one is damped (its eigenvalue in U U^T lies in
[0, 1]); U U^T is then a (soft) projector onto the numerical range, which is what the hooks need. No host
synchronisation is needed. If a Cholesky factorisation still reports failure (only for non-finite input),
the hot path returns a zero basis (the branch gets no gradient that step, the residual takes all of G) and
``check=True`` instead falls back to Householder QR (``torch.linalg.qr``) with a one-line warning.

Realignment (every ``realign_every`` optimizer steps; ``handle.attach(optimizer)``)
--------------------------------------------------------------------------------
A randomized SVD (Halko, Martinsson, Tropp 2011, subspace iteration; :func:`randomized_svd`) of the current
``W = W_res + beta L2 L1`` (float32), *warm-started* from the current row space orth(L1^T) plus ``oversample``
random columns (``torch.svd_lowrank`` has no warm start), re-splits W: the new balanced factors are rotated by
the orthogonal r x r matrix (Procrustes) that brings them closest to the old ones, the rounded factors are
stored, and ``W_res = W - beta L2 L1`` is recomputed from them, so the layer's function is preserved to the
rounding of W_res's storage dtype (``realign`` returns the measured max |dW| / max |W|). Parameters are
updated in place, so optimizers keep their references.

Branch scale at realignment (``realign_scale``). Adam moves every factor entry by about the learning rate, so a
step of the branch moves W by about lr * beta * ||(L1, L2)||, and balanced factors have ||(L1, L2)||_F^2 =
2 sum(S) / beta. A realignment to the trained top-r subspace therefore raises the branch's effective learning rate
with the square root of its singular values: on the CPU preset the branch's per-step change in W doubles at the
first realignment and the loss rises for tens of steps (``bench/lora_realign_probe.py``, ``docs/LORA.md`` session
9). ``"hold"`` (the default) sets beta to the power of two nearest to the value that keeps beta * ||(L1, L2)||_F
at its pre-realignment size (a power of two: exact in every dtype, so the function is still preserved to W_res's
rounding), and the moments are remapped accordingly; ``"keep"`` leaves beta fixed. On the GPU (30M study, four
seeds) the first realignment raised the train-loss gap by +0.47 to +0.69 point with ``"keep"`` and by -0.15 to
+0.23 with ``"hold"`` (``docs/LORA.md``, session 10). beta is a float32 buffer read by ``forward``, so the change
neither recompiles nor re-records CUDA graphs; the handle's ``state_dict`` carries it.

Frozen factors (``train_factors=False``)
----------------------------------------
The factors then get no gradient (``requires_grad=False``; no optimizer holds them, no wgrad GEMMs for the branch)
and the backward is plain autograd, so the residual takes all of G: ``dW_res = G = dLoss/dW``. Any optimizer then
takes exactly the step it would take on the dense weight W (same gradient, same state, in W's coordinates), and
W = W_res + beta L2 L1 moves only through W_res. The branch is a BF16 carve-out of W's top-r subspace that is
refreshed at each realignment, which moves what W_res has accumulated along that subspace into the branch; between
realignments the forward quantizes W_res = W - (the branch as of the last realignment). Realignment changes
neither W nor any optimizer state (``state_remap`` and ``realign_scale`` have nothing to act on), so it can be
frequent and early. Decoupled weight decay (W_res <- (1 - lr wd) W_res: AdamW, QAdamW, QRoot) is applied to the
branch as well, by scaling beta's float32 device buffer after each optimizer step (``LoRASVDHandle.attach``), and
each realignment re-splits at ``prepare``'s beta again; coupled decay (SGD, Adam) cannot be followed (a warning). The motivation is an optimizer whose steps have no per-parameter scale: with
trained factors, an orthogonalized (ROOT / Muon) step of L1 and of L2, each of spectral norm ~ lr * scale, moves
W by ~ lr * scale * sqrt(beta * s_i) per principal direction i through the other factor, so the branch's subspace
trains at a different learning rate than the dense weight would (``docs/LORA.md``, session 13).

Optimizer state remap (``state_remap``), for any ``torch.optim.Optimizer`` (state dict entries per param):

* ``W_res``: kept. Its coordinates are the weight's own coordinates; only its value changed.
* factors, ``"project"`` (default): with old factors (L1, L2) and new (L1', L2'), gradients transform as
  ``g_L2' = g_L2 T_b``, ``T_b = (L1' L1^+)^T`` and ``g_L1' = T_a g_L1``, ``T_a = (L2^+ L2')^T`` (exact when the
  new subspace equals the old; otherwise the moments are projected onto the new basis, ``^+`` = pseudo-inverse
  in float64). First-moment-like entries (same shape as the param, e.g. ``exp_avg``, ``momentum_buffer``) are
  mapped linearly; second-moment-like entries (``exp_avg_sq``, ``max_exp_avg_sq``, other non-negative ones)
  by the squared coefficients, ``v' = v (T_b o T_b)`` resp. ``(T_a o T_a) v`` (independence approximation,
  non-negative by construction). Step counters are untouched.
* With ``realign_scale="hold"`` beta changes at the realignment (below), and the factor gradients carry beta
  (``g_L1 = beta L2^T G``): both maps are multiplied by beta'/beta (the quadratic ones by its square).
* ``"reset"``: same-shape factor state entries are zeroed and a per-param ``step`` is set to 0 (so Adam's
  bias correction restarts); ``"keep"``: nothing is touched (the Procrustes alignment keeps coordinates close).
* Optimizers with state entries that are not plain tensors of the param's shape (e.g. quantized moments)
  can implement ``optimizer.remap_param_state(param, linear, quadratic)`` (``linear``/``quadratic``: callables
  on a dense float32 tensor of the param's shape) and ``optimizer.reset_param_state(param)``; otherwise such
  entries are left as they are (``"keep"`` for them) with a one-line warning naming the optimizer and key.
"""
from __future__ import annotations

import fnmatch
import math
import warnings
import weakref
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "LoRASVDLinear", "LoRASVDHandle", "prepare", "merge", "cholesky_qr", "randomized_svd",
    "LORA_BF16_GLOB", "DEFAULT_RANK", "DEFAULT_BETA", "DEFAULT_EXCLUDE",
]

#: policy glob that matches the two low-rank linear sites of every LoRA-SVD layer (keep them BF16)
LORA_BF16_GLOB = "*.lora_[ab]"
DEFAULT_RANK = 64
DEFAULT_BETA = 1.0
#: module paths never converted by default (the LM head stays BF16 in every preset and is often tied)
DEFAULT_EXCLUDE = ("*lm_head*",)
CONSTRAINTS = ("cholesky_qr", None)
#: ``prepare(constrain=...)`` also takes "auto": "cholesky_qr" with trained factors, None with frozen ones
AUTO_CONSTRAIN = "auto"
STATE_REMAPS = ("project", "reset", "keep")
REALIGN_SCALES = ("keep", "hold")

_F64_TINY = torch.finfo(torch.float64).tiny


# ----------------------------------------------------------------------------------------------
# numerics
def cholesky_qr(a: torch.Tensor, *, passes: int = 3, check: bool = False) -> torch.Tensor:
    """Orthonormal basis of the column space of ``a`` (m x n, m >= n) by shifted Cholesky-QR in float64.

    Returns Q (m x n, float32 or float64 if ``a`` is float64) with ``Q^T Q = I`` for well-conditioned ``a``
    and ``Q Q^T`` a (soft) projector onto the numerical range otherwise: exactly null directions give zero
    columns, nothing gives NaN for finite input. No host synchronisation unless ``check=True``.

    Args:
        passes: number of Cholesky-QR passes (first shifted pass + ``passes - 1`` re-orthogonalisations; 3 is
            "shifted CholeskyQR3").
        check: raise on non-finite input and, if a factorisation failed, fall back to Householder QR
            (``torch.linalg.qr``) with a warning. Without it a failed factorisation returns a zero basis.
    """
    if a.dim() != 2:
        raise ValueError(f"cholesky_qr expects a 2-D tensor, got shape {tuple(a.shape)}")
    m, n = a.shape
    if m < n:
        raise ValueError(f"cholesky_qr expects a tall matrix (m >= n), got {m} x {n}")
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    out_dtype = torch.float64 if a.dtype == torch.float64 else torch.float32
    if check and not bool(torch.isfinite(a).all()):
        raise ValueError("cholesky_qr: input has non-finite entries")
    x = a.to(torch.float64)
    x = x / torch.linalg.matrix_norm(x).clamp_min(_F64_TINY)
    c = 11.0 * (m * n + n * (n + 1)) * (torch.finfo(torch.float64).eps / 2)
    eye = torch.eye(n, dtype=torch.float64, device=a.device)
    ok = torch.ones((), dtype=torch.bool, device=a.device)
    for _ in range(passes):
        g = x.mT @ x
        shift = c * g.diagonal().sum().clamp_min(1.0)   # the clamp covers a == 0 (then Q = 0)
        r, info = torch.linalg.cholesky_ex(g + shift * eye, upper=True)
        ok = ok & (info == 0)
        x = torch.linalg.solve_triangular(r, x, upper=True, left=False)
    if check:
        if not bool(ok) or not bool(torch.isfinite(x).all()):
            warnings.warn("cholesky_qr: Cholesky factorisation failed; falling back to torch.linalg.qr")
            x = torch.linalg.qr(a.to(torch.float64), mode="reduced").Q
    else:
        x = torch.where(ok, x, torch.zeros_like(x))
    return x.to(out_dtype)


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for splits/merges: float32, or float64 for float64 layers."""
    return torch.promote_types(dtype, torch.float32)


def _orth(a: torch.Tensor) -> torch.Tensor:
    return torch.linalg.qr(a, mode="reduced").Q


def randomized_svd(w: torch.Tensor, rank: int, *, oversample: int = 8, niter: int = 2,
                   init: Optional[torch.Tensor] = None, generator: Optional[torch.Generator] = None
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-``rank`` SVD ``w ~ U diag(S) Vh`` by randomized subspace iteration (Halko et al. 2011, Alg. 4.4).

    ``init`` (n x k0) warm-starts the first k0 columns of the row-space test matrix (e.g. the current factors'
    row space); init columns shorter than half the longest (e.g. the zero columns of a null factor) and the
    remaining columns are Gaussian from ``generator``. Computes in float32 or
    float64 (whichever ``w`` is, bf16/fp16 are promoted to float32). Returns (U m x r, S r, Vh r x n).
    """
    if w.dim() != 2:
        raise ValueError(f"randomized_svd expects a 2-D tensor, got shape {tuple(w.shape)}")
    m, n = w.shape
    if not 1 <= rank <= min(m, n):
        raise ValueError(f"rank must be in [1, {min(m, n)}], got {rank}")
    dt = torch.float64 if w.dtype == torch.float64 else torch.float32
    w = w.to(dt)
    k = min(rank + max(oversample, 0), min(m, n))
    omega = torch.randn(n, k, generator=generator, device=w.device, dtype=dt)
    if init is not None:                      # warm start; (near-)zero init columns stay Gaussian
        k0 = min(init.shape[1], k)
        cols = init[:, :k0].to(dt)
        norms = torch.linalg.vector_norm(cols, dim=0)
        keep = norms > 0.5 * norms.max()
        omega[:, :k0] = torch.where(keep, cols, omega[:, :k0])
    q = _orth(w @ omega)
    for _ in range(niter):
        q = _orth(w @ _orth(w.mT @ q))
    ub, s, vh = torch.linalg.svd(q.mT @ w, full_matrices=False)
    return (q @ ub)[:, :rank], s[:rank], vh[:rank]


def _top_svd(w: torch.Tensor, rank: int, init: str, generator) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if init == "exact" or (init == "auto" and min(w.shape) <= 1024):
        u, s, vh = torch.linalg.svd(w, full_matrices=False)
        return u[:, :rank], s[:rank], vh[:rank]
    return randomized_svd(w, rank, niter=4, generator=generator)


# ----------------------------------------------------------------------------------------------
# the layer
class LoRASVDLinear(nn.Module):
    """``y = F.linear(x, W_res, bias) + lora_b(lora_a(x) * beta)``, i.e. W = W_res + beta * L2 @ L1.

    ``weight`` is the residual W_res (NVFP4 under the backend), ``lora_a.weight`` = L1 (r x in) and
    ``lora_b.weight`` = L2 (out x r) are the BF16 low-rank branch. Build with :meth:`from_linear` or
    :func:`prepare`; fold back with :meth:`to_linear` or :func:`merge`. See the module docstring for the
    math of the constrained backward and of :meth:`realign_`.
    """

    def __init__(self, in_features: int, out_features: int, rank: int, *, beta: float = DEFAULT_BETA,
                 bias: bool = True, device=None, dtype=None, factor_dtype=None):
        super().__init__()
        if not 1 <= rank <= min(in_features, out_features):
            raise ValueError(f"rank must be in [1, min(in, out) = {min(in_features, out_features)}], got {rank}")
        if not (isinstance(beta, (int, float)) and math.isfinite(beta) and beta > 0):
            raise ValueError(f"beta must be a positive finite number, got {beta!r}")
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        # beta lives in a float32 0-dim buffer that forward reads (so changing it, see realign_(hold_scale=True),
        # neither recompiles nor re-records a CUDA graph) and in a Python float mirror for host-side math (no
        # device sync). Not in the state dict: LoRASVDHandle.state_dict carries it.
        self.register_buffer("_beta", torch.tensor(float(beta), dtype=torch.float32, device=device),
                             persistent=False)
        self._beta_value = float(beta)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
        fdt = factor_dtype or dtype
        self.lora_a = nn.Linear(in_features, rank, bias=False, device=device, dtype=fdt)
        self.lora_b = nn.Linear(rank, out_features, bias=False, device=device, dtype=fdt)
        self.constrain: Optional[str] = None
        self._beta_decays = False                 # frozen factors: LoRASVDHandle decays the buffer in place
        self._hooks: List = []
        self._basis_cache = None

    @property
    def beta(self) -> float:
        """Scale of the branch, W = W_res + beta L2 L1 (a positive float). With frozen factors the buffer is the
        truth (the optimizer's weight decay scales it on the device every step) and this reads it back."""
        return float(self._beta) if self._beta_decays else self._beta_value

    @beta.setter
    def beta(self, value: float) -> None:
        value = float(value)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"beta must be a positive finite number, got {value!r}")
        self._beta_value = value
        self._beta.fill_(value)

    def _apply(self, fn, recurse=True):
        # .to(dtype) / .half() would round the buffer to the model's dtype: keep it float32 and equal to the mirror
        # (with frozen factors the buffer is the truth: bring the mirror up to date first)
        if self._beta_decays:
            self._beta_value = float(self._beta)
        super()._apply(fn, recurse)
        self._buffers["_beta"] = torch.tensor(self._beta_value, dtype=torch.float32, device=self._beta.device)
        return self

    # construction -------------------------------------------------------------------------
    @classmethod
    def from_linear(cls, linear: nn.Linear, rank: int, *, beta: float = DEFAULT_BETA, factor_dtype=None,
                    init: str = "auto", constrain: Optional[str] = "cholesky_qr",
                    generator: Optional[torch.Generator] = None) -> "LoRASVDLinear":
        """Reparametrise ``linear`` (its weight/bias Parameters are reused: W_res is written into ``weight``)."""
        w = linear.weight
        mod = cls(linear.in_features, linear.out_features, rank, beta=beta, bias=linear.bias is not None,
                  device=w.device, dtype=w.dtype, factor_dtype=factor_dtype)
        mod.weight = w                      # same Parameter object: optimizers/state_dict keys stay put
        if linear.bias is not None:
            mod.bias = linear.bias
        with torch.no_grad():
            w32 = w.detach().to(_acc(w.dtype))
            u, s, vh = _top_svd(w32, rank, init, generator)
            mod._set_split_(w32, u, s, vh)
        mod.set_constraint(constrain)
        return mod

    @torch.no_grad()
    def _set_split_(self, w32: torch.Tensor, u: torch.Tensor, s: torch.Tensor, vh: torch.Tensor,
                    align_to: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> None:
        """Balanced split of the fp32 weight ``w32`` from its top-r SVD, optionally Procrustes-aligned."""
        root = (s.clamp_min(0) / self.beta).sqrt()
        b = u * root                          # L2 = U sqrt(S / beta)
        a = root[:, None] * vh                # L1 = sqrt(S / beta) V^T
        if align_to is not None:              # rotate (b R, R^T a) as close as possible to the old factors
            old_a, old_b = align_to
            mm = (b.mT.double() @ old_b.double()) + (a.double() @ old_a.mT.double())
            pu, _, pvh = torch.linalg.svd(mm)
            rot = (pu @ pvh).to(b.dtype)
            b, a = b @ rot, rot.mT @ a
        self.lora_b.weight.copy_(b)
        self.lora_a.weight.copy_(a)
        self._set_residual_(w32)

    def _set_residual_(self, w: torch.Tensor) -> None:
        """W_res = w - beta L2 L1 from the *stored* (rounded) factors, in ``w``'s dtype: W is then ``w`` up to
        W_res's rounding."""
        low = self.lora_b.weight.to(w.dtype) @ self.lora_a.weight.to(w.dtype)
        self.weight.copy_(w - self.beta * low)

    # function -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.lora_b(self.lora_a(x) * self._beta)

    def merged_weight(self) -> torch.Tensor:
        """W = W_res + beta L2 L1 in float32 (float64 for a float64 layer), detached."""
        acc = _acc(self.weight.dtype)
        with torch.no_grad():
            low = self.lora_b.weight.to(acc) @ self.lora_a.weight.to(acc)
            return self.weight.to(acc) + self.beta * low

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` with the folded weight; reuses this layer's weight/bias Parameter objects."""
        self.remove_constraint()
        with torch.no_grad():
            w = self.merged_weight()
            self.weight.copy_(w)
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                        device=self.weight.device, dtype=self.weight.dtype)
        lin.weight = self.weight
        if self.bias is not None:
            lin.bias = self.bias
        return lin

    # subspace-constrained backward ------------------------------------------------------------
    def bases(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(U, V): orthonormal bases (float32; float64 for float64 factors) of the columns of L2 (out x r) and of
        the rows of L1 (in x r), by shifted Cholesky-QR2.

        Cached on the factors' autograd version counters, so the three hooks of one backward share one pair
        (any in-place update of the factors, e.g. an optimizer step, invalidates it; writes through ``.data``
        bypass version counters: call ``clear_basis_cache()`` after those).
        """
        a, b = self.lora_a.weight, self.lora_b.weight
        if torch.compiler.is_compiling():      # compiled autograd traces the hooks: no Python-side cache
            return cholesky_qr(b.detach(), passes=2), cholesky_qr(a.detach().mT, passes=2)
        key = (a._version, b._version, a.data_ptr(), b.data_ptr(), a.device)
        cache = self._basis_cache
        if cache is None or cache[0] != key:
            cache = (key, cholesky_qr(b.detach(), passes=2), cholesky_qr(a.detach().mT, passes=2))
            self._basis_cache = cache
        return cache[1], cache[2]

    def clear_basis_cache(self) -> None:
        """Drop the cached :meth:`bases` (needed after writes through ``.data``, which bypass version counters)."""
        self._basis_cache = None

    def _hook_res(self, g: torch.Tensor) -> torch.Tensor:
        u, v = self.bases()                       # dW_res = G - U (U^T G V) V^T
        ct = torch.promote_types(g.dtype, torch.float32)
        u, v = u.to(ct), v.to(ct)
        gv = (g @ v.to(g.dtype)).to(ct)
        left = u @ (u.mT @ gv)
        return torch.addmm(g, left.to(g.dtype), v.mT.to(g.dtype), alpha=-1)

    def _hook_b(self, g: torch.Tensor) -> torch.Tensor:
        ct = torch.promote_types(g.dtype, torch.float32)
        u = self.bases()[0].to(ct)                # dL2 <- U U^T dL2
        return (u @ (u.mT @ g.to(ct))).to(g.dtype)

    def _hook_a(self, g: torch.Tensor) -> torch.Tensor:
        ct = torch.promote_types(g.dtype, torch.float32)
        v = self.bases()[1].to(ct)                # dL1 <- dL1 V V^T
        return ((g.to(ct) @ v) @ v.mT).to(g.dtype)

    def set_constraint(self, constrain: Optional[str]) -> None:
        """Install (``"cholesky_qr"``) or remove (``None``) the subspace-constrained backward hooks."""
        if constrain not in CONSTRAINTS:
            raise ValueError(f"constrain must be one of {CONSTRAINTS}, got {constrain!r}")
        self.remove_constraint()
        if constrain == "cholesky_qr":
            self._hooks = [self.weight.register_hook(self._hook_res),
                           self.lora_b.weight.register_hook(self._hook_b),
                           self.lora_a.weight.register_hook(self._hook_a)]
        self.constrain = constrain

    def remove_constraint(self) -> None:
        """Remove the constrained-backward hooks, if any; ``constrain`` becomes None."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.constrain = None

    # realignment --------------------------------------------------------------------------
    @torch.no_grad()
    def realign_(self, *, oversample: int = 8, niter: int = 2, generator: Optional[torch.Generator] = None,
                 hold_scale: bool = False, beta: Optional[float] = None) -> Dict[str, torch.Tensor]:
        """Re-split W = W_res + beta L2 L1 along its current top-r singular subspace (function preserved).

        ``hold_scale``: also change beta (to a power of two, so that it is exact in every float dtype) such that
        beta * ||(L1, L2)||_F, which sets the size of an Adam step of the branch in W, stays what it was before
        the re-split instead of growing with the new subspace's singular values (module docstring). ``beta``:
        re-split at this beta instead (frozen factors: back to prepare's beta after the weight decay shrank it).

        Returns old/new factors (float32, for optimizer-state remapping), ``beta_ratio`` = new beta / old beta
        and ``rel_change`` = max |W_after - W_before| / max |W_before|.
        """
        acc = _acc(self.weight.dtype)
        old_a = self.lora_a.weight.detach().to(acc).clone()
        old_b = self.lora_b.weight.detach().to(acc).clone()
        old_beta = self.beta
        w = self.merged_weight()
        init = cholesky_qr(old_a.mT)              # warm start: the current row space
        u, s, vh = randomized_svd(w, self.rank, oversample=oversample, niter=niter, init=init,
                                  generator=generator)
        if hold_scale:                            # one host read for both sums
            factor_sq, sum_s = torch.stack([old_a.square().sum() + old_b.square().sum(),
                                            s.clamp_min(0).sum().to(acc)]).tolist()
            self.beta = _held_beta(old_beta, factor_sq, sum_s)
        elif beta is not None:
            self.beta = beta
        self._set_split_(w, u, s, vh, align_to=(old_a, old_b))
        self.clear_basis_cache()
        rel = (self.merged_weight() - w).abs().max() / w.abs().max().clamp_min(torch.finfo(torch.float32).tiny)
        return {"old_a": old_a, "old_b": old_b, "new_a": self.lora_a.weight.detach().to(acc),
                "new_b": self.lora_b.weight.detach().to(acc), "beta_ratio": self.beta / old_beta, "rel_change": rel}

    @torch.no_grad()
    def set_beta_(self, beta: float) -> None:
        """Change beta keeping the function: the factors are scaled by sqrt(old / new beta) (they stay balanced)
        and W_res is recomputed from the stored factors, so W is preserved to W_res's rounding."""
        w = self.merged_weight()
        k = math.sqrt(self.beta / float(beta))
        self.beta = beta
        self.lora_a.weight.mul_(k)
        self.lora_b.weight.mul_(k)
        self._set_residual_(w)
        self.clear_basis_cache()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
                f"beta={self.beta}, bias={self.bias is not None}, constrain={self.constrain!r}")


def _held_beta(beta: float, factor_sq: float, sum_s: float) -> float:
    """The power of two nearest (in log) to the beta at which balanced factors of singular values summing to
    ``sum_s`` give beta * ||(L1, L2)||_F = the current ``beta * sqrt(factor_sq)``: balanced factors have
    ||(L1, L2)||_F^2 = 2 sum_s / beta, so beta' = beta^2 factor_sq / (2 sum_s). ``beta`` if either is zero."""
    if not (factor_sq > 0 and sum_s > 0):
        return beta
    return _nearest_pow2(beta * beta * factor_sq / (2.0 * sum_s))


def _nearest_pow2(x: float) -> float:
    """The power of two nearest to ``x`` > 0 in log (exponent clamped to [-40, 40])."""
    return 2.0 ** min(max(round(math.log2(x)), -40), 40)


# ----------------------------------------------------------------------------------------------
# optimizer-state remapping
_LINEAR_KEYS = {"exp_avg", "momentum_buffer", "m", "mu", "momentum"}
_QUADRATIC_KEYS = {"exp_avg_sq", "max_exp_avg_sq", "v", "square_avg", "sum", "nu"}
_warned: set = set()


def _decoupled_decay(optimizer) -> bool:
    """Whether ``optimizer`` decays weights as W <- (1 - lr wd) W outside the gradient (AdamW and its kin:
    ``torch.optim.AdamW``, a group with ``decoupled_weight_decay=True``, or a class that says so with a
    ``decoupled_weight_decay = True`` attribute, as ``QAdamW`` and ``QRoot`` do)."""
    return (isinstance(optimizer, torch.optim.AdamW) or getattr(optimizer, "decoupled_weight_decay", False) is True
            or any(g.get("decoupled_weight_decay", False) for g in optimizer.param_groups))


def _second_moment_like(key: str, t: torch.Tensor) -> bool:
    """An optimizer-state entry that maps by squared coefficients: a known second-moment key, or an unknown key
    whose values are all non-negative."""
    return key in _QUADRATIC_KEYS or (key not in _LINEAR_KEYS and bool((t >= 0).all()))


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, stacklevel=3)


def _factor_transforms(info: Dict[str, torch.Tensor]):
    """(linear, quadratic) maps for L1 (``a``) and L2 (``b``) moments, see the module docstring."""
    old_a, old_b, new_a, new_b = (info[k].double() for k in ("old_a", "old_b", "new_a", "new_b"))
    ratio = float(info["beta_ratio"])                                # the gradients carry beta: g_L1 = beta L2^T G
    t_b = ratio * (new_a @ torch.linalg.pinv(old_a, rtol=1e-7)).mT  # g_L2' = g_L2 T_b
    t_a = ratio * (torch.linalg.pinv(old_b, rtol=1e-7) @ new_b).mT  # g_L1' = T_a g_L1
    maps_b = (lambda m: m @ t_b.to(m.dtype), lambda v: v @ (t_b * t_b).to(v.dtype))
    maps_a = (lambda m: t_a.to(m.dtype) @ m, lambda v: (t_a * t_a).to(v.dtype) @ v)
    return maps_a, maps_b


def _remap_param_state(optimizer, p: torch.nn.Parameter, mode: str, maps) -> None:
    state = optimizer.state.get(p)
    if not state:
        return
    name = type(optimizer).__name__
    if mode == "reset":
        if hasattr(optimizer, "reset_param_state"):
            optimizer.reset_param_state(p)
            return
        for key, t in state.items():
            if key == "step":
                if torch.is_tensor(t):
                    t.zero_()
                else:
                    state[key] = 0
            elif torch.is_tensor(t) and t.shape == p.shape and t.is_floating_point():
                t.zero_()
            elif torch.is_tensor(t) and t.numel() > 1:
                _warn_once(f"LoRA-SVD: cannot reset state {key!r} of {name} (shape {tuple(t.shape)}); left as is")
        return
    linear, quadratic = maps
    if hasattr(optimizer, "remap_param_state"):
        optimizer.remap_param_state(p, linear, quadratic)
        return
    for key, t in state.items():
        if not torch.is_tensor(t) or t.numel() <= 1 or key == "step":
            continue
        if t.shape != p.shape or not t.is_floating_point():
            _warn_once(f"LoRA-SVD: cannot remap state {key!r} of {name} (shape {tuple(t.shape)}, "
                       f"dtype {t.dtype}); left as is")
            continue
        fn = quadratic if _second_moment_like(key, t) else linear
        t.copy_(fn(t.to(_acc(t.dtype))).to(t.dtype))


# ----------------------------------------------------------------------------------------------
# model-level API
def _as_globs(x: Union[str, Iterable[str], None]) -> Tuple[str, ...]:
    if x is None:
        return ()
    if isinstance(x, str):
        return (x,)
    return tuple(x)


def _resolve_rank(rank: Union[int, float], in_f: int, out_f: int, path: str) -> int:
    lim = min(in_f, out_f)
    if isinstance(rank, bool) or not isinstance(rank, (int, float)):
        raise TypeError(f"rank must be an int or a float fraction in (0, 1), got {rank!r}")
    if isinstance(rank, float):
        if not 0 < rank < 1:
            raise ValueError(f"a float rank is a fraction of min(in, out) and must be in (0, 1), got {rank}")
        return max(1, round(rank * lim))
    if not 1 <= rank <= lim:
        raise ValueError(f"rank {rank} is out of range for {path!r} (Linear {in_f} -> {out_f}: rank must be "
                         f"in [1, {lim}]); pass a smaller rank, a float fraction, or exclude the layer")
    return rank


class LoRASVDHandle:
    """What :func:`prepare` returns: the converted layers, realignment scheduling, undo/merge.

    ``attach(optimizer)`` registers a step post-hook that counts optimizer steps and calls
    :meth:`realign` every ``realign_every`` steps, remapping the state of every attached optimizer (the first
    attached optimizer is the clock). ``state_dict()``/``load_state_dict()`` carry the counters for resumes.
    ``train_factors`` is :func:`prepare`'s (False: frozen factors, nothing to remap at a realignment).
    """

    def __init__(self, model: nn.Module, modules: Dict[str, LoRASVDLinear], *, realign_every: Optional[int],
                 state_remap: str, oversample: int, niter: int, seed: int, realign_after: int = 0,
                 sync_replicas: bool = False, realign_scale: str = "hold", train_factors: bool = True):
        self._model_ref = weakref.ref(model)
        self.train_factors = train_factors
        self.modules = modules
        self._base_beta = {path: m.beta for path, m in modules.items()}   # frozen factors re-split at this beta
        # frozen factors: each W_res parameter's layer (parameters keep their identity through .to() and
        # realignments; the layer's _beta buffer is read at each use, since .to() replaces it)
        self._layer_of_weight = {id(m.weight): m for m in modules.values()}
        for m in modules.values():
            m._beta_decays = not train_factors
        self.realign_every = realign_every
        self.realign_after = realign_after
        self.sync_replicas = sync_replicas
        self.state_remap = state_remap
        self.realign_scale = realign_scale
        self.oversample, self.niter, self.seed = oversample, niter, seed
        self.steps = 0
        self.realignments = 0
        self.last_realign: Dict[str, float] = {}
        self._optimizers: List[Tuple[weakref.ref, object]] = []
        self._generators: Dict[torch.device, torch.Generator] = {}

    # params ---------------------------------------------------------------------------------
    @property
    def added_parameters(self) -> int:
        """Parameters added by the reparametrisation: sum over layers of r * (in + out)."""
        return sum(m.rank * (m.in_features + m.out_features) for m in self.modules.values())

    def factor_parameters(self) -> List[nn.Parameter]:
        """The low-rank factors (``lora_a.weight``, ``lora_b.weight``) of every converted layer."""
        return [p for m in self.modules.values() for p in (m.lora_a.weight, m.lora_b.weight)]

    # optimizer hook ---------------------------------------------------------------------------
    def attach(self, optimizer) -> "LoRASVDHandle":
        """Realign every ``realign_every`` steps of ``optimizer`` and remap its state (any torch optimizer)."""
        if not hasattr(optimizer, "register_step_post_hook"):
            raise TypeError(f"{type(optimizer).__name__} has no register_step_post_hook; call "
                            f"handle.step(optimizer) after each optimizer step instead")
        handle_ref = weakref.ref(self)

        @torch.compiler.disable
        def _post_hook(opt, args, kwargs):
            h = handle_ref()
            if h is None:
                return
            if not h.train_factors:
                h._decay_frozen_branches(opt)
            if h._is_clock(opt):
                h.step()

        hook = optimizer.register_step_post_hook(_post_hook)
        self._optimizers.append((weakref.ref(optimizer), hook))
        if not self.train_factors and not _decoupled_decay(optimizer) and any(
                g.get("weight_decay", 0) for g in optimizer.param_groups):
            _warn_once(f"LoRA-SVD: {type(optimizer).__name__} applies weight decay through the gradient; with frozen "
                       "factors the residual's gradient then carries wd * W_res instead of wd * W, so W does not "
                       "step exactly as the dense weight would (decoupled decay, e.g. AdamW, does)")
        return self

    def _decay_frozen_branches(self, optimizer) -> None:
        """Frozen factors: apply ``optimizer``'s decoupled weight decay, W_res <- (1 - lr wd) W_res, to the branch
        too (beta <- (1 - lr wd) beta, in place on the device buffer: no host sync, a tensor lr stays a tensor),
        so that W = W_res + beta L2 L1 decays as the dense weight would. One foreach launch per param group.
        Groups and buffers are looked up at every call, not cached at ``attach``: ``optimizer.load_state_dict``
        (a resume) replaces the group dicts, whose lr the schedule then sets, and ``.to()`` replaces the buffers
        (a cached plan broke the bit-exact resume test)."""
        if not _decoupled_decay(optimizer):
            return
        layers = self._layer_of_weight
        for g in optimizer.param_groups:
            wd = g.get("weight_decay", 0.0)
            betas = [layers[id(p)]._beta for p in g["params"] if id(p) in layers] if wd else []
            if not betas:
                continue
            factor = 1 - g["lr"] * wd
            if torch.is_tensor(factor):
                torch._foreach_mul_(betas, factor.to(device=betas[0].device, dtype=torch.float32))
            else:
                torch._foreach_mul_(betas, float(factor))

    def _check_coverage(self) -> None:
        owned = {id(p) for m in self.modules.values() for p in (m.weight, m.lora_a.weight, m.lora_b.weight)
                 if p.requires_grad}
        seen = {id(p) for r, _ in self._optimizers if r() is not None
                for g in r().param_groups for p in g["params"]}
        if owned - seen:
            _warn_once(f"LoRA-SVD: the attached optimizers do not hold {len(owned - seen)} LoRA-SVD parameters "
                       f"(built before prepare()? build the optimizer after prepare)")

    def _is_clock(self, optimizer) -> bool:
        """Only the first attached optimizer counts steps (e.g. QRoot for matrices + AdamW for the rest both
        attached: one step of the pair is one step); every attached optimizer gets its state remapped."""
        return bool(self._optimizers) and self._optimizers[0][0]() is optimizer

    def detach(self) -> None:
        """Remove the optimizer hooks."""
        for _, hook in self._optimizers:
            hook.remove()
        self._optimizers = []

    def state_dict(self) -> Dict[str, object]:
        """Step/realignment counters and each layer's beta (the factors themselves live in the model's state
        dict; beta changes at realignments with ``realign_scale="hold"``)."""
        return {"steps": self.steps, "realignments": self.realignments,
                "betas": {path: m.beta for path, m in self.modules.items()}}

    def load_state_dict(self, state: Dict[str, object]) -> None:
        """Restore :meth:`state_dict` (a state without ``betas``, from before they were saved, keeps them)."""
        self.steps, self.realignments = int(state["steps"]), int(state["realignments"])
        betas = state.get("betas") or {}
        unknown = sorted(set(betas) - set(self.modules))
        if unknown:
            raise ValueError(f"LoRA-SVD state has betas for layers this model does not convert: {unknown[:5]}")
        for path, b in betas.items():
            self.modules[path].beta = b

    def step(self, optimizer=None) -> bool:
        """Count one optimizer step; realign when due, remapping the state of ``optimizer`` (or, if None, of
        every attached optimizer). True if realigned."""
        if self.steps == 0 and self._optimizers:
            self._check_coverage()
        self.steps += 1
        if (self.realign_every and self.steps % self.realign_every == 0 and self.steps >= self.realign_after
                and self.modules):
            self.realign(optimizer)
            return True
        return False

    def _generator(self, device: torch.device) -> torch.Generator:
        g = self._generators.get(device)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(self.seed)
            self._generators[device] = g
        return g

    @torch.no_grad()
    def realign(self, optimizer=None) -> Dict[str, float]:
        """Realign every layer now; returns ``{path: max|dW|/max|W|}`` (the function-preservation check)."""
        opts = [optimizer] if optimizer is not None else [r() for r, _ in self._optimizers if r() is not None]
        out = {}
        for path, m in self.modules.items():
            info = m.realign_(oversample=self.oversample, niter=self.niter, generator=self._generator(m.weight.device),
                              hold_scale=self.realign_scale == "hold" and self.train_factors,
                              beta=None if self.train_factors else self._base_beta.get(path))
            out[path] = float(info["rel_change"])
            if self.state_remap == "keep" or not self.train_factors:   # frozen factors have no optimizer state
                continue
            maps_a, maps_b = _factor_transforms(info) if self.state_remap == "project" else (None, None)
            for opt in opts:
                _remap_param_state(opt, m.lora_a.weight, self.state_remap, maps_a)
                _remap_param_state(opt, m.lora_b.weight, self.state_remap, maps_b)
        if self.sync_replicas:
            self._broadcast_from_rank0(opts)
        self.realignments += 1
        self.last_realign = out
        return out

    @torch.no_grad()
    def hold_scale_from(self, reference: Dict[str, torch.Tensor]) -> Dict[str, float]:
        """Give each layer the beta that ``realign_scale="hold"`` would keep had the layer been split from
        ``reference[path]`` (e.g. the run's initial weight) and then realigned onto its current weight: balanced
        factors of singular values summing to S have ||(L1, L2)||_F^2 = 2 S / beta, so the power of two nearest
        to beta * S_r(reference) / S_r(current) (``LoRASVDLinear.set_beta_``: function preserved). For a fork that
        adds LoRA-SVD to trained weights, the branch then starts with the Adam step size in W a from-scratch run's
        branch had, instead of one grown with the trained singular values. Layers without a reference keep their
        beta. Returns ``{path: beta}`` for the layers with a reference; ``{}`` with frozen factors (``train_factors
        =False``: beta then has no effect on training)."""
        out = {}
        if not self.train_factors:
            return out
        for path, m in self.modules.items():
            ref = reference.get(path)
            if ref is None:
                continue
            acc = _acc(m.weight.dtype)
            s_ref = torch.linalg.svdvals(ref.detach().to(device=m.weight.device, dtype=acc))[:m.rank].sum()
            a, b = m.lora_a.weight.detach().to(acc), m.lora_b.weight.detach().to(acc)
            s_ref, factor_sq = torch.stack([s_ref, a.square().sum() + b.square().sum()]).tolist()
            # the current split's singular values sum to beta * factor_sq / 2, so beta * s_ref / that sum is
            # 2 s_ref / factor_sq
            new = _nearest_pow2(2.0 * s_ref / factor_sq) if s_ref > 0 and factor_sq > 0 else m.beta
            if new != m.beta:
                m.set_beta_(new)
            out[path] = new
        return out

    @torch.no_grad()
    def init_state_from_dense(self, optimizer, dense_state) -> int:
        """Give ``optimizer`` state for every converted layer, derived from the state its dense weight had
        before :func:`prepare` (``dense_state[layer.weight]``, a per-parameter state dict such as
        ``torch.optim.AdamW``'s; e.g. a run forked from a checkpoint trained without LoRA-SVD, where fresh
        moments at full LR would cost a transient like ``state_remap="reset"``). W_res keeps the weight's
        entries (its coordinates are the weight's, as at a realignment). The factors' entries follow the chain
        rule g_L2 = beta G L1^T, g_L1 = beta L2^T G: first-moment-like entries are mapped linearly and then
        projected like the constrained backward's gradients (if the layer has it); second-moment-like entries get
        the squared coefficients (the independence approximation of the realignment's remap); step counts are
        copied.
        With frozen factors (``train_factors=False``) only W_res gets state, a copy of the weight's (any optimizer's
        entries: W_res's gradient is then the dense weight's).
        Returns the number of layers seeded; a layer whose weight has no state is skipped. Raises
        ``ValueError`` for an entry that is not a float tensor of the weight's shape (e.g. quantized moments)."""
        seeded = 0
        for path, m in self.modules.items():
            src = dense_state.get(m.weight)
            if not src:
                continue
            if not self.train_factors:
                optimizer.state[m.weight] = {k: t.clone() if torch.is_tensor(t) else t for k, t in src.items()}
                seeded += 1
                continue
            a, b = m.lora_a.weight, m.lora_b.weight
            acc = _acc(a.dtype)
            l1, l2, beta = a.detach().to(acc), b.detach().to(acc), m.beta
            st_w, st_a, st_b = {}, {}, {}
            for key, t in src.items():
                if not torch.is_tensor(t) or t.numel() <= 1 or key == "step":   # counts: one copy each (AdamW
                    for st in (st_w, st_a, st_b):                                # increments them in place)
                        st[key] = t.clone() if torch.is_tensor(t) else t
                    continue
                if t.shape != m.weight.shape or not t.is_floating_point():
                    raise ValueError(f"LoRA-SVD: cannot derive factor state from {type(optimizer).__name__}'s "
                                     f"{key!r} of {path} (shape {tuple(t.shape)}, dtype {t.dtype}): only float "
                                     "tensors of the weight's shape (e.g. AdamW's moments) are supported")
                st_w[key] = t.clone()
                g = t.to(acc)
                if _second_moment_like(key, t):
                    tb, ta = beta * beta * (g @ (l1 * l1).mT), beta * beta * ((l2 * l2).mT @ g)
                else:
                    tb, ta = beta * (g @ l1.mT), beta * (l2.mT @ g)
                    if m.constrain == "cholesky_qr":          # as the hooks project the factors' gradients
                        tb, ta = m._hook_b(tb), m._hook_a(ta)
                st_b[key], st_a[key] = tb.to(t.dtype), ta.to(t.dtype)
            optimizer.state[m.weight], optimizer.state[a], optimizer.state[b] = st_w, st_a, st_b
            seeded += 1
        return seeded

    @torch.no_grad()
    def _broadcast_from_rank0(self, optimizers) -> None:
        """Rank 0's re-split factors, residual weights and their optimizer state on every rank of the default
        process group (nothing outside one). Every replica realigns the same weights with the same seed; this
        pins down the last bits a different reduction order in a solver could leave apart, as DDP needs its
        replicas identical."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return
        for m in self.modules.values():
            if self.realign_scale == "hold" and self.train_factors:   # beta is part of the function
                dist.broadcast(m._beta, src=0)
                m.beta = float(m._beta)
            for p in (m.weight, m.lora_a.weight, m.lora_b.weight):
                dist.broadcast(p.data, src=0)
                for opt in optimizers:
                    for t in opt.state.get(p, {}).values():
                        if torch.is_tensor(t) and t.numel() > 1 and t.device == p.device:  # not a CPU step count
                            dist.broadcast(t, src=0)

    # undo ---------------------------------------------------------------------------------------
    def merge(self) -> nn.Module:
        """Fold every layer back into a plain ``nn.Linear`` (W = W_res + beta L2 L1), drop hooks; returns the model."""
        model = self._model_ref()
        if model is None:
            raise RuntimeError("the model of this LoRA-SVD handle no longer exists")
        self.detach()
        _merge_modules(model, set(self.modules))
        self.modules = {}
        return model

    undo = merge

    def __repr__(self):
        return (f"LoRASVDHandle({len(self.modules)} layers, +{self.added_parameters} params, "
                f"realign_every={self.realign_every}, steps={self.steps}, realignments={self.realignments}"
                f"{'' if self.train_factors else ', factors frozen'})")


def prepare(model: nn.Module, *, rank: Union[int, float] = DEFAULT_RANK, beta: float = DEFAULT_BETA,
            realign_every: Optional[int] = 2048, realign_after: int = 0, include: Union[str, Sequence[str]] = "*",
            exclude: Union[str, Sequence[str], None] = DEFAULT_EXCLUDE, constrain: Optional[str] = AUTO_CONSTRAIN,
            factor_dtype: Optional[torch.dtype] = None, init: str = "auto", state_remap: str = "project",
            oversample: int = 8, niter: int = 2, seed: int = 0, optimizer=None,
            sync_replicas: bool = False, realign_scale: str = "hold", train_factors: bool = True) -> LoRASVDHandle:
    """Reparametrise the selected ``nn.Linear`` layers of ``model`` in place as LoRA-SVD layers.

    Args:
        rank: int (same rank everywhere) or float in (0, 1) (fraction of min(in, out), at least 1).
        beta: scale of the low-rank branch, W = W_res + beta L2 L1 (> 0).
        realign_every: optimizer steps between randomized-SVD realignments (None/0: never); needs
            ``handle.attach(optimizer)`` (or ``optimizer=`` here) or manual ``handle.step()`` calls.
        realign_after: no realignment before this many optimizer steps (the multiples of ``realign_every``
            from here on realign). Early realignments, while the principal subspace still rotates fast, cost
            a loss transient in the 30M study (``docs/LORA.md``).
        include / exclude: fnmatch globs on module paths (``model.named_modules()`` names); a layer is converted
            if it matches some ``include`` and no ``exclude``. Linears whose weight is shared with another
            module (tied) are skipped with a warning.
        constrain: "cholesky_qr" (subspace-constrained backward), None (plain autograd) or "auto" (the default:
            "cholesky_qr" with trained factors, None with frozen ones, which need the residual to take all of G).
        factor_dtype: storage dtype of L1/L2 (default: the weight's).
        init: "auto" | "exact" | "randomized": SVD used for the initial split.
        state_remap: "project" | "reset" | "keep": optimizer-state rule at realignment.
        realign_scale: "hold" (default) | "keep". "hold": at each realignment beta becomes the power of two that
            keeps beta * ||(L1, L2)||_F (the size of the branch's Adam steps in W) at its pre-realignment value,
            instead of letting it grow with the trained singular values; "keep": beta fixed (module docstring;
            ``docs/LORA.md``, sessions 9 and 10). Neither this nor ``state_remap`` acts with frozen factors.
        oversample, niter: randomized-SVD oversampling and power iterations at realignment.
        seed: seed of the randomized SVD's Gaussian test matrices (same on every rank).
        optimizer: attach this optimizer right away (it must already hold the new parameters).
        sync_replicas: the model is a data-parallel replica (DDP): after each realignment, broadcast rank 0's
            factors, residuals and their optimizer state to the other ranks of the default process group.
        train_factors: True (default): L1, L2 are trained parameters. False: they are frozen between
            realignments (``requires_grad=False``, not for the optimizer), the backward is plain autograd and any
            optimizer steps W exactly as it would the dense weight; realignments refresh the BF16 carve-out of W's
            top-r subspace and touch no optimizer state (module docstring, "Frozen factors").

    Build the optimizer *after* ``prepare`` (new factor parameters exist only now). Returns a
    :class:`LoRASVDHandle`.
    """
    if not isinstance(train_factors, bool):
        raise TypeError(f"train_factors must be a bool, got {train_factors!r}")
    if constrain == AUTO_CONSTRAIN:
        constrain = "cholesky_qr" if train_factors else None
    if constrain not in CONSTRAINTS:
        raise ValueError(f"constrain must be one of {CONSTRAINTS + (AUTO_CONSTRAIN,)}, got {constrain!r}")
    if constrain is not None and not train_factors:
        raise ValueError(f"constrain={constrain!r} projects the principal subspace out of the residual's gradient; "
                         "with frozen factors (train_factors=False) W could then not move along it between "
                         "realignments: use constrain=None or 'auto'")
    if state_remap not in STATE_REMAPS:
        raise ValueError(f"state_remap must be one of {STATE_REMAPS}, got {state_remap!r}")
    if realign_scale not in REALIGN_SCALES:
        raise ValueError(f"realign_scale must be one of {REALIGN_SCALES}, got {realign_scale!r}")
    if init not in ("auto", "exact", "randomized"):
        raise ValueError(f"init must be 'auto', 'exact' or 'randomized', got {init!r}")
    if realign_every is not None and (not isinstance(realign_every, int) or realign_every < 0):
        raise ValueError(f"realign_every must be a non-negative int or None, got {realign_every!r}")
    if not isinstance(realign_after, int) or realign_after < 0:
        raise ValueError(f"realign_after must be a non-negative int, got {realign_after!r}")
    if any(isinstance(m, LoRASVDLinear) for m in model.modules()):
        raise ValueError("model already contains LoRA-SVD layers; call fp4compile.merge(model) first")
    inc, exc = _as_globs(include), _as_globs(exclude)

    weight_owners: Dict[int, int] = {}
    for _, mod in model.named_modules(remove_duplicate=False):
        w = getattr(mod, "weight", None)
        if isinstance(w, torch.Tensor):
            weight_owners[id(w)] = weight_owners.get(id(w), 0) + 1

    selected = []
    for path, mod in model.named_modules():
        if type(mod) is not nn.Linear:      # exact type: e.g. MultiheadAttention's out_proj is not called as a Linear
            continue
        if not any(fnmatch.fnmatchcase(path, g) for g in inc) or any(fnmatch.fnmatchcase(path, g) for g in exc):
            continue
        if weight_owners.get(id(mod.weight), 0) > 1:
            warnings.warn(f"LoRA-SVD: skipping {path!r}: its weight is shared with another module (tied)")
            continue
        selected.append((path, mod))

    gens: Dict[torch.device, torch.Generator] = {}
    converted: Dict[str, LoRASVDLinear] = {}
    for path, lin in selected:
        r = _resolve_rank(rank, lin.in_features, lin.out_features, path)
        dev = lin.weight.device
        if dev not in gens:
            gens[dev] = torch.Generator(device=dev)
            gens[dev].manual_seed(seed)
        new = LoRASVDLinear.from_linear(lin, r, beta=beta, factor_dtype=factor_dtype, init=init,
                                        constrain=constrain, generator=gens[dev])
        if not train_factors:
            new.lora_a.weight.requires_grad_(False)
            new.lora_b.weight.requires_grad_(False)
        _set_submodule(model, path, new)
        converted[path] = new
    if not converted:
        warnings.warn("LoRA-SVD: prepare() selected no nn.Linear layer (check include/exclude)")
    handle = LoRASVDHandle(model, converted, realign_every=realign_every, state_remap=state_remap,
                           oversample=oversample, niter=niter, seed=seed, realign_after=realign_after,
                           sync_replicas=sync_replicas, realign_scale=realign_scale, train_factors=train_factors)
    for m in converted.values():
        m._handle_ref = weakref.ref(handle)
    if optimizer is not None:
        handle.attach(optimizer)
    return handle


def _set_submodule(model: nn.Module, path: str, new: nn.Module) -> None:
    if path == "":
        raise ValueError("prepare()/merge() cannot replace the root module itself; wrap it in a container")
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, name, new)


def _merge_modules(model: nn.Module, only: Optional[set] = None) -> int:
    found = [(p, m) for p, m in model.named_modules() if isinstance(m, LoRASVDLinear)
             and (only is None or p in only)]
    for path, m in found:
        h = getattr(m, "_handle_ref", lambda: None)()
        if h is not None:
            h.detach()
            h.modules.pop(path, None)
        _set_submodule(model, path, m.to_linear())
    return len(found)


def merge(model: nn.Module) -> nn.Module:
    """Fold every LoRA-SVD layer of ``model`` back into a plain ``nn.Linear`` (in place; returns ``model``).

    The folded weight is W_res + beta L2 L1 computed in float32 and stored in the weight's dtype, into the same
    Parameter object. Backward hooks and the optimizer hooks of the owning handle are removed.
    """
    if isinstance(model, LoRASVDLinear):
        raise ValueError("merge() needs the parent model; use layer.to_linear() for a single layer")
    _merge_modules(model)
    return model
