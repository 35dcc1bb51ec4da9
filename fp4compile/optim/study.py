"""Numerics studies behind docs/OPTIM.md (used by tests/test_optim_numerics.py and bench/optim.py).

* :func:`tiny_gpt_states` trains a byte-level tiny GPT on real text (the shared corpus's ``val.txt.xz``, or
  any text) with torch's AdamW and returns the real second moments ``exp_avg_sq`` of its matrices;
* :func:`v_error_table` compares the relative MSE of v through the Q-AdamW transform vs direct NVFP4;
* :func:`ns_error` measures an NS variant's distance to the float64 SVD polar factor, :func:`ns_error_parts`
  splits it into non-orthogonality and direction, :func:`ns_error_table` tabulates the NS variants per shape.
"""
from __future__ import annotations

import lzma
import math
import os
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..formats.hadamard import random_signs
from . import codec

CORPUS = "/work/shared/data/corpus/val.txt.xz"


def load_bytes(path: Optional[str] = None, limit: int = 2_000_000) -> torch.Tensor:
    """Byte tokens of ``path`` (.xz is decompressed); falls back to this package's source text."""
    path = path or os.environ.get("FP4COMPILE_CORPUS", CORPUS)
    if os.path.exists(path):
        opener = lzma.open if path.endswith(".xz") else open
        with opener(path, "rb") as f:
            data = f.read(limit)
    else:  # any real English-ish text works; the package's own docstrings are always there
        here = os.path.dirname(os.path.dirname(__file__))
        data = b""
        for root, _, files in os.walk(here):
            for fn in sorted(files):
                if fn.endswith(".py"):
                    with open(os.path.join(root, fn), "rb") as f:
                        data += f.read()
        data = data[:limit]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class TinyGPT(nn.Module):
    """A minimal pre-LN GPT (byte vocabulary) for optimizer-state studies and parity tests."""

    def __init__(self, d=64, layers=2, heads=4, ctx=64, vocab=256):
        super().__init__()
        self.heads = heads
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(nn.ModuleDict(dict(
                ln1=nn.LayerNorm(d), qkv=nn.Linear(d, 3 * d), proj=nn.Linear(d, d),
                ln2=nn.LayerNorm(d), fc=nn.Linear(d, 4 * d), fc2=nn.Linear(4 * d, d))))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets=None):
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for b in self.blocks:
            q, k, v = b["qkv"](b["ln1"](x)).split(x.shape[-1], dim=-1)
            q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
            x = x + b["proj"](y)
            x = x + b["fc2"](F.gelu(b["fc"](b["ln2"](x))))
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batches(data: torch.Tensor, batch: int, ctx: int, seed: int = 0):
    """Endless ``(x, y)`` batches of ``batch`` windows of ``data`` at random positions (generator seeded with
    ``seed``): ``[batch, ctx]`` each, ``y`` = ``x`` shifted by one token."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        ix = torch.randint(0, data.numel() - ctx - 1, (batch,), generator=gen)
        x = torch.stack([data[i:i + ctx] for i in ix])
        y = torch.stack([data[i + 1:i + ctx + 1] for i in ix])
        yield x, y


def train(model, opt, steps, data, batch=8, ctx=64, seed=0):
    """Train for ``steps``; returns the list of losses."""
    losses = []
    it = batches(data, batch, ctx, seed)
    for _ in range(steps):
        x, y = next(it)
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def tiny_gpt_states(steps=60, d=64, layers=2, seed=0, data=None, tile=128):
    """Real AdamW second moments {name: exp_avg_sq} of a tiny GPT after ``steps`` steps on text."""
    torch.manual_seed(seed)
    model = TinyGPT(d=d, layers=layers)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    data = load_bytes() if data is None else data
    train(model, opt, steps, data, seed=seed)
    out = {}
    for name, p in model.named_parameters():
        st = opt.state.get(p)
        if st and p.dim() == 2 and p.numel() % tile == 0 and p.numel() >= 4096:
            out[name] = st["exp_avg_sq"].detach().clone()
    return out


def tiny_gpt_momenta(steps=400, d=128, layers=2, seed=0, data=None) -> dict:
    """Real momentum-like matrices {name: exp_avg} of a tiny GPT's block weights (the matrices Q-Root
    orthogonalizes) after ``steps`` AdamW steps on text: what ROOT's momentum buffer holds, with real gradients'
    row and column structure (e.g. a few input features with large norms), unlike :func:`momentum_like`."""
    torch.manual_seed(seed)
    model = TinyGPT(d=d, layers=layers)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    train(model, opt, steps, load_bytes() if data is None else data, seed=seed)
    return {name: opt.state[p]["exp_avg"].detach().clone() for name, p in model.named_parameters()
            if p.dim() == 2 and name.startswith("blocks.")}


def rel_mse(a, b) -> float:
    """Relative MSE of ``a`` against the reference ``b``: sum((a - b)^2) / sum(b^2), in float64 (reference
    second, unlike ``formats.report.rel_mse``)."""
    a, b = a.double(), b.double()
    return float(((a - b) ** 2).sum() / (b ** 2).sum())


def v_error_table(states: dict, rounding="rtn", tile=128, hadamard=16, seed=0):
    """{name: (relMSE direct NVFP4, relMSE Q-AdamW transform, reduction)} for real v tensors."""
    gen = torch.Generator().manual_seed(seed)
    signs = (torch.randint(0, 2, (hadamard,), generator=gen) * 2 - 1).float() if hadamard else None
    rows = {}
    for name, v in states.items():
        s = torch.tensor(seed, dtype=torch.int64)
        direct = codec.direct_v_roundtrip(v, rounding=rounding, seed=s)
        enc = codec.encode_v(v, signs, tile=tile, rounding=rounding, seed=s)
        ours = codec.decode_v(*enc, signs, tile=tile)
        e0, e1 = rel_mse(direct, v.reshape(-1)), rel_mse(ours, v.reshape(-1))
        rows[name] = (e0, e1, 1 - e1 / e0)
    return rows


def v_error_pooled(states: dict, *, rounding="rtn", four_over_six=True, direct_four_over_six=False, tile=32,
                   hadamard=16, seed=0):
    """Q-AdamW's v transform against direct NVFP4 storage of v over all tensors of ``states`` ({name: v}), one
    encode each: (1 - its summed squared error / direct's, its summed squared error, direct's), in float64.
    ``four_over_six``: 4/6 in the transform (``v_four_over_six``); ``direct_four_over_six``: on the direct side."""
    signs = random_signs(hadamard, torch.Generator().manual_seed(seed))
    s = torch.tensor(seed)
    e_direct = e_ours = 0.0
    for v in states.values():
        v = v.reshape(-1)
        d = codec.direct_v_roundtrip(v, four_over_six=direct_four_over_six, rounding=rounding, seed=s)
        o = codec.decode_v(*codec.encode_v(v, signs, tile=tile, four_over_six=four_over_six, rounding=rounding,
                                           seed=s), signs, tile=tile)
        e_direct += float(((d.double() - v.double()) ** 2).sum())
        e_ours += float(((o.double() - v.double()) ** 2).sum())
    return 1 - e_ours / e_direct, e_ours, e_direct


def polar_factor(G: torch.Tensor) -> torch.Tensor:
    """float64 U Vᵀ of the SVD."""
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    return U @ Vh


def ns_error(G: torch.Tensor, O: torch.Tensor) -> float:
    """||O - polar(G)||_F / ||polar(G)||_F."""
    P = polar_factor(G)
    return float((O.double() - P).norm() / P.norm())


def momentum_like(m: int, n: int, seed: int = 0, decay: float = 1.0) -> torch.Tensor:
    """A test matrix with a momentum-like spectrum: Gaussian times a decaying column profile, plus a few
    large outlier entries (what ROOT's clipping targets)."""
    gen = torch.Generator().manual_seed(seed)
    G = torch.randn(m, n, generator=gen) * torch.linspace(0.1, 3.0, n) ** decay
    idx = torch.randint(0, m * n, (max(1, m * n // 2000),), generator=gen)
    G.view(-1)[idx] *= 30.0
    return G


class NSVariant(NamedTuple):
    """One row of :func:`ns_error_table`: ``inputs`` "raw" (G) or "clip" (G clipped at the quantile); ``fp4``:
    NVFP4 products (else BF16); ``schedule``, ``steps``: :func:`~fp4compile.optim.root.ns_coefficients`; ``guard``,
    ``shift``, ``sym_b`` (B of B·X in 16x16 blocks), ``residual`` (X's two-term quantizations), ``shared_x`` (X
    once per step in 16x16 blocks for both products): :func:`~fp4compile.optim.root.newton_schulz`'s ``guard``,
    ``shift``, ``sym_b``, ``residual``, ``shared_x``."""
    name: str
    inputs: str
    fp4: bool
    schedule: str
    steps: int
    guard: Optional[float]
    shift: bool
    sym_b: bool = False
    residual: tuple = ()
    shared_x: bool = False


#: the NS variants of :func:`ns_error_table`. "plain" is NVFP4 NS as a drop-in for BF16 NS (Jordan's coefficients,
#: no guard, no shift); "(QRoot default)" marks QRoot's defaults (ROOT's coefficients or their fit, clipping at
#: 0.99, the guard at 1.0, shifted products, 5 steps); the rows starting "+" add QRoot's ``ns_sym_b``,
#: ``ns_residual`` and ``ns_shared_x`` options to the default and to the best schedule
NS_VARIANTS = (
    NSVariant("bf16 jordan", "raw", False, "jordan", 5, None, False),
    NSVariant("nvfp4 jordan, plain", "raw", True, "jordan", 5, None, False),
    NSVariant("nvfp4 jordan + guard", "raw", True, "jordan", 5, 1.0, False),
    NSVariant("nvfp4 shape-aware + clip + guard", "clip", True, "root", 5, 1.0, False),
    NSVariant("nvfp4 shape-aware + clip + guard + shift (QRoot default)", "clip", True, "root", 5, 1.0, True),
    NSVariant("  + symmetric B + two-term X, Xᵀ", "clip", True, "root", 5, 1.0, True, True, ("x", "xt")),
    NSVariant("  + shared 16x16-block X (ns_shared_x)", "clip", True, "root", 5, 1.0, True, False, (), True),
    NSVariant("  + symmetric B + shared 16x16-block X", "clip", True, "root", 5, 1.0, True, True, (), True),
    NSVariant("nvfp4 polar-express + clip + guard + shift", "clip", True, "polar_express", 5, 1.0, True),
    NSVariant("nvfp4 polar-express 7 steps + clip + guard + shift", "clip", True, "polar_express", 7, 1.0, True),
    NSVariant("  + symmetric B (ns_sym_b)", "clip", True, "polar_express", 7, 1.0, True, True),
    NSVariant("  + symmetric B + two-term Xᵀ (ns_residual=('xt',))", "clip", True, "polar_express", 7, 1.0, True,
              True, ("xt",)),
    NSVariant("  + symmetric B + two-term X, Xᵀ (ns_residual=('x', 'xt'))", "clip", True, "polar_express", 7, 1.0,
              True, True, ("x", "xt")),
    NSVariant("  + symmetric B + two-term 16x16-block X for both (ns_residual=('x2d',))", "clip", True,
              "polar_express", 7, 1.0, True, True, ("x2d",)),
    NSVariant("  + symmetric B + shared 16x16-block X (ns_shared_x)", "clip", True, "polar_express", 7, 1.0, True,
              True, (), True),
    NSVariant("bf16 shape-aware + clip", "clip", False, "root", 5, None, False),
    NSVariant("bf16 polar-express 7 steps + clip", "clip", False, "polar_express", 7, None, False),
)


def ns_error_parts(G: torch.Tensor, O: torch.Tensor) -> dict:
    """The distance of an NS output ``O`` from the polar factor P = U Vᵀ of its input ``G``, and its two parts:

    - ``polar``: ||O - P||_F / ||P||_F (:func:`ns_error`);
    - ``sigma``: max_i |sigma_i(O) - 1|, how far O is from orthogonal (1 - sigma_min when small directions of G
      have not converged);
    - ``direction``: ||polar(O) - P||_F / ||P||_F, how far O's own orthogonal factor is from G's: the error an
      NS iteration cannot correct later, since its steps change singular values and keep singular vectors.
    """
    P = polar_factor(G)
    O64 = O.double()
    if not torch.isfinite(O64).all():
        return dict(polar=math.inf, sigma=math.inf, direction=math.inf)
    sv = torch.linalg.svdvals(O64)
    return dict(polar=float((O64 - P).norm() / P.norm()), sigma=float((sv - 1).abs().max()),
                direction=float((polar_factor(O64) - P).norm() / P.norm()))


def ns_step_increments(G: torch.Tensor, steps: int = 7, schedule: str = "polar_express", spec=None, sym_b=False,
                       clip_quantile: float = 0.99, guard: Optional[float] = 1.0, shift: bool = True,
                       exact: tuple = ()) -> list:
    """Where an NVFP4 NS loses G's singular vectors: the NS of ``G`` clipped at ``clip_quantile`` (as QRoot runs
    it: :func:`~fp4compile.optim.root.ns_input`, then :func:`~fp4compile.optim.root._ns_nvfp4_stack` one step at a
    time with ``spec``, ``sym_b``, ``guard``, ``shift``), and per step k a dict:

    - ``increment``: ||polar(X_{k+1}) - polar(X_k)||_F / ||polar(X_k)||_F, how far step k alone turned the
      iterate's singular vectors (an exact NS step keeps them: its output is p(X Xᵀ) X);
    - ``cumulative``: the same between the clipped G (float64) and X_{k+1} (after the last step:
      ``ns_error_parts``' direction of the NS output);
    - ``sigma_min``, ``sigma_max``: X_k's extreme singular values as the step receives it (before the guard).

    ``spec=None``: the steps in float64 (exact products), whose increments are rounding-level. ``exact``: names
    of the step's operands to leave unquantized (their BF16 values, exact in the FP32 product), the others in
    NVFP4: ``"x"`` (X of X Xᵀ), ``"e"`` (E of E², the shifted A), ``"b"`` (B of B·X), ``"xt"`` (Xᵀ of B·X), in
    the order :func:`~fp4compile.optim.root._ns_nvfp4_stack` quantizes them with ``shift``."""
    from .root import _bgemm_dq, _ns_nvfp4_stack, _q_stack_dq, clip_by_quantile, ns_coefficients, ns_input

    order = ("x", "e", "b", "xt")
    if set(exact) - set(order) or (exact and not shift):
        raise ValueError(f"exact takes operand names of {order} (with shift=True), got {exact!r}")
    hooks = {}
    if exact:
        calls = []

        def quant(x, qspec, signs, seed=None):  # one step's four quantizations, in ``order``
            name = order[len(calls) % 4]
            calls.append(name)
            return (x, torch.ones((), dtype=torch.float32)) if name in exact else _q_stack_dq(x, qspec, signs, seed)

        hooks = dict(quant=quant, product=_bgemm_dq)

    Gc = clip_by_quantile(G, clip_quantile)
    coeffs = ns_coefficients(tuple(Gc.shape), steps, schedule)
    X, tall = ns_input(Gc, 1.01 if schedule == "polar_express" else 1.0)
    X = X.contiguous() if spec is not None else X.double()
    P0 = polar_factor(Gc.mT if tall else Gc)         # the reference: the clipped input's, before BF16 rounding
    P = polar_factor(X[0])
    rows = []
    for k, (a, b, c) in enumerate(coeffs):
        sv = torch.linalg.svdvals(X[0].double())
        if spec is not None:
            X = _ns_nvfp4_stack(X, [(a, b, c)], spec, None, None, guard, shift=shift, sym_b=sym_b, **hooks)
        else:
            A = X @ X.mT
            X = a * X + (b * A + c * A @ A) @ X
        P1 = polar_factor(X[0])
        rows.append(dict(step=k, increment=float((P1 - P).norm() / P.norm()),
                         cumulative=float((P1 - P0).norm() / P0.norm()), sigma_min=float(sv.min()),
                         sigma_max=float(sv.max())))
        P = P1
    return rows


def ns_error_table(shapes, seed=0, spec=None, clip_quantile=0.99, variants=NS_VARIANTS):
    """Rows (shape, variant name, :func:`ns_error_parts` of the output) of every NS variant on the
    :func:`momentum_like` matrix of each shape. NVFP4 products use ``spec`` (default RTN 1x16, no 4/6, no RHT)."""
    from ..policy import NVFP4
    from .root import clip_by_quantile, newton_schulz, ns_coefficients

    spec = spec or NVFP4()
    rows = []
    for (m, n) in shapes:
        G = momentum_like(m, n, seed)
        inputs = {"raw": G, "clip": clip_by_quantile(G, clip_quantile)}
        for v in variants:
            inp = inputs[v.inputs]
            coeffs = ns_coefficients((m, n), v.steps, v.schedule)
            ns_scale = 1.01 if v.schedule == "polar_express" else 1.0
            O = newton_schulz(inp, coeffs, spec=spec if v.fp4 else None, norm_scale=ns_scale, guard=v.guard,
                              shift=v.shift, sym_b=v.sym_b, residual=v.residual,
                              shared_x=v.shared_x).float()
            rows.append(((m, n), v.name, ns_error_parts(inp, O)))
    return rows
