"""Q-Attn: numerics of fp4compile::qattn (reference + Triton kernels), the attention swap pass, the saved
tensors of a compiled training graph, and the PV ablation.

Error metric: relative Frobenius error ‖x - ref‖/‖ref‖ against a float64 reference that applies the SAME NVFP4
quantization to the same operands. FlashAttention's rule (peers.md §6) is applied to the Triton kernel:
err(kernel) <= 2·err(pt) + atol, where pt is a PyTorch implementation of the identical mixed-precision math in
FP32 with the kernel's BF16 roundings (``emulate_bf16=True``). The Frobenius norm is used instead of the max
because NVFP4 rounding is discontinuous: an FP32-vs-FP64 difference can flip one element by a whole E2M1 step,
which dominates a max-abs metric in whichever implementation happens to flip, without saying anything about
the kernel's accuracy.
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
import torch.nn as nn
import torch.nn.functional as F

import fp4compile.ops  # noqa: F401  (registers the ops)
from fp4compile.kernels import attention_ref as R
from fp4compile.passes.attention import qattn_sdpa, qk_blocks_mode, qk_transform_mode, swap_attention
from fp4compile.policy import BF16, NVFP4, Policy

ALL = 63
PAPER = R.PAPER_ROLES
ABLATION = R.PAPER_ROLES | R.PV | R.DOV
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _qkv(B=1, H=2, Hkv=2, Tq=48, Tk=48, D=64, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Tq, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, Tk, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, Tk, D, generator=g).to(dtype)
    do = torch.randn(B, H, Tq, D, generator=g).to(dtype)
    return q, k, v, do


def _run_ref(q, k, v, do, attn_mask, causal, mask, **kw):
    scale = 1 / math.sqrt(q.shape[-1])
    views = R.quantize_qkv(q, k, v, mask)
    o, lse = R.attention_fwd_ref(q, k, v, views, attn_mask, causal, scale, mask, **kw)
    g = R.attention_bwd_ref(do, q, k, v, views, o, lse, attn_mask, causal, scale, mask, **kw)
    return o, lse, g


# ---------------------------------------------------------------------------------------------------------
# quantization
@pytest.mark.parametrize("shape", [(2, 32, 64), (1, 48, 128), (3, 16, 16)])
def test_quantize_2d_copy_serves_both_axes(shape):
    """The 16x16-tile copy is transpose-invariant: one copy is an exact NVFP4 operand along head_dim (QKᵀ) and
    along the sequence (dS·K, dSᵀ·Q), which is why the forward's copy can be reused by the backward."""
    x = torch.randn(shape) * torch.logspace(-3, 2, shape[-1])
    a = R.dequantize_2d(*R.quantize_2d(x))
    b = R.dequantize_2d(*R.quantize_2d(x.transpose(-2, -1).contiguous()))
    assert torch.equal(a, b.transpose(-2, -1))
    # one E4M3 scale per 16x16 tile, replicated over the tile's rows
    s = R.quantize_2d(x)[1]
    tiles = s.unflatten(-2, (-1, 16))
    assert torch.equal(tiles, tiles[..., :1, :].expand_as(tiles))
    y = torch.randn(shape)  # NVFP4 RTN on Gaussian data: ~10% relative error, 16x16 tiles a bit more
    assert 0.05 < rel(R.dequantize_2d(*R.quantize_2d(y)), y) < 0.2


def test_quantize_2d_odd_length_pads_with_zeros():
    x = torch.randn(2, 37, 64)
    c, s, g = R.quantize_2d(x)
    assert c.shape == (2, 37, 32) and s.shape == (2, 37, 4)
    full = R.quantize_2d(torch.cat((x, torch.zeros(2, 11, 64)), 1))
    assert torch.equal(c, full[0][:, :37]) and torch.equal(s, full[1][:, :37]) and torch.equal(g, full[2])


def _np_fake_quant(x, s_enc, g_dec):
    """Independent NVFP4 fake-quant along the last axis with ml_dtypes' E4M3 and E2M1 casts."""
    ml = pytest.importorskip("ml_dtypes")
    xb = x.reshape(*x.shape[:-1], -1, 16).astype(np.float32)
    s_enc = np.float32(s_enc)
    g_dec = np.float32(g_dec)
    amax = np.abs(xb).max(-1, keepdims=True)
    sf = np.minimum(amax / np.float32(6.0) * s_enc, np.float32(448)).astype(ml.float8_e4m3fn).astype(np.float32)
    with np.errstate(divide="ignore"):
        enc = np.where(sf == 0, np.float32(0), np.float32(1) / (sf * g_dec)).astype(np.float32)
    q = (xb * enc).astype(ml.float4_e2m1fn).astype(np.float32)
    return (q * (sf * g_dec)).reshape(x.shape)


def test_fake_quant_1d_matches_ml_dtypes():
    torch.manual_seed(1)
    p = torch.softmax(torch.randn(32, 64) * 3, -1)
    got = R.quantize_p(p, -1).numpy()
    want = _np_fake_quant(p.numpy(), R.G_NUM, np.float32(R.P_GLOBAL))
    np.testing.assert_array_equal(got, want)
    # along the other axis (dV = Pᵀ·dO contracts over queries)
    got = R.quantize_p(p, -2).numpy()
    want = _np_fake_quant(p.numpy().T.copy(), R.G_NUM, np.float32(R.P_GLOBAL)).T
    np.testing.assert_array_equal(got, want)
    # dS: per-64x64-tile global, 2688/amax floored to a power of two (here from the FP32 quotient's float64 log2)
    for ds in (torch.randn(64, 64) * 1e-3, torch.randn(64, 64) * 7.5):
        amax = np.float32(ds.abs().max().item())
        s_enc = np.float32(2.0 ** np.floor(np.log2(np.float64(np.float32(R.G_NUM) / amax))))
        got = R.quantize_ds(ds, -1).numpy()
        np.testing.assert_array_equal(got, _np_fake_quant(ds.numpy(), s_enc, np.float32(1) / s_enc))


@settings(max_examples=60, deadline=None)
@given(st.floats(min_value=-60.0, max_value=60.0), st.integers(0, 2**32 - 1))
def test_ds_tile_scales_are_powers_of_two_that_keep_amax_in_range(log2_amax, seed):
    """Every tile's s_enc is a power of two (so g_dec = 1/s_enc is exact and can ride in the BF16 operand), the
    largest such that amax·s_enc <= 2688, and it is per 64x64 tile (ragged edges included)."""
    g = torch.Generator().manual_seed(seed)
    ds = torch.randn(100, 70, generator=g) * 2.0 ** log2_amax
    s_enc, g_dec = R.tile_scales(ds)
    m, e = torch.frexp(s_enc)
    assert torch.all(m == 0.5) and torch.equal(g_dec * s_enc, torch.ones_like(s_enc))
    for r0 in (0, 64):
        for c0 in (0, 64):
            t = ds[r0:r0 + 64, c0:c0 + 64]
            amax = t.abs().max().to(torch.float64)
            s = s_enc[r0, c0].to(torch.float64)
            assert torch.all(s_enc[r0:r0 + 64, c0:c0 + 64] == s_enc[r0, c0])
            assert amax * s <= R.G_NUM * (1 + 2 ** -23) and amax * s * 2 > R.G_NUM * (1 - 2 ** -23)


# ---------------------------------------------------------------------------------------------------------
# reference numerics
CASES = [
    # (label, kwargs for _qkv, causal, mask kind)
    ("plain", {}, False, None),
    ("causal", {}, True, None),
    ("gqa-odd", dict(H=4, Hkv=2, Tq=37, Tk=37), True, None),
    ("cross-odd", dict(Tq=21, Tk=70), False, None),
    ("bool-mask", dict(Tq=40, Tk=40), False, "bool"),
    ("additive-mask", dict(Tq=40, Tk=40), False, "add"),
]


def _mask_for(kind, q, k):
    if kind is None:
        return None
    g = torch.Generator().manual_seed(3)
    keep = torch.rand(q.shape[0], 1, q.shape[2], k.shape[2], generator=g) > 0.3
    keep[..., 0] = True
    if kind == "bool":
        return keep
    return torch.where(keep, torch.randn(keep.shape, generator=g), torch.full(keep.shape, -1e4))


@pytest.mark.parametrize("mask", [0, PAPER, ALL], ids=["bf16", "paper", "all-fp4"])
@pytest.mark.parametrize("label,kw,causal,mkind", CASES, ids=[c[0] for c in CASES])
def test_reference_fp32_vs_fp64(label, kw, causal, mkind, mask):
    """The CPU implementation (FP32 + BF16 roundings) vs the float64 reference of the same quantized math.

    Tolerances: BF16 unit roundoff is 2^-8; O and the gradients are stored in BF16 and P/dS are rounded to
    BF16 before their products, so the relative error of a BF16 path is a few 2^-9 (observed ~0.002-0.005):
    bound 0.01. NVFP4 dS paths add rare E2M1 flips (fp32 vs fp64 dS on a rounding boundary) that move one
    element by one E2M1 step: bound 0.05 (observed <= 0.015). LSE is FP32 in both: 1e-5 absolute."""
    q, k, v, do = _qkv(**kw)
    am = _mask_for(mkind, q, k)
    o64, lse64, g64 = _run_ref(q, k, v, do, am, causal, mask, out_dtype=torch.float64)
    o, lse, g = _run_ref(q, k, v, do, am, causal, mask, dtype=torch.float32, emulate_bf16=True)
    assert rel(o, o64) < 0.01
    assert (lse.double() - lse64).abs().max().item() < 1e-5
    tol_q = 0.05 if mask & R.DSK else 0.01
    tol_k = 0.05 if mask & R.DSQ else 0.01
    for got, want, tol in zip(g, g64, (tol_q, tol_k, 0.01)):
        assert torch.isfinite(got).all()
        assert rel(got, want) < tol


def _term_magnitudes(q, k, v, do, causal):
    """float64 sums of the absolute values of the terms each output element adds up (unquantized operands):
    O = P·V -> P·|V|; dS = P∘(dP - D) -> P∘(|dO|·|V|ᵀ + rowsum(|dO|∘|O|)); dQ = dS·K·scale, dK = dSᵀ·Q·scale and
    dV = Pᵀ·dO likewise with absolute values (GQA heads summed). Rounding and E2M1 flips in such a sum err
    relative to these magnitudes, not to the sum itself, which cancels: a query that sees one key has dS = 0 in
    exact arithmetic, and its dQ is pure rounding."""
    q, k, v, do = (t.double() for t in (q, k, v, do))
    g, scale = q.shape[1] // k.shape[1], 1 / math.sqrt(q.shape[-1])
    kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ kr.transpose(-2, -1) * scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), -math.inf)
    p = torch.softmax(s, -1)
    mds = p * (do.abs() @ vr.abs().transpose(-2, -1) + (do.abs() * (p @ vr).abs()).sum(-1, keepdim=True))
    fold = lambda t: t.unflatten(1, (k.shape[1], g)).sum(2)  # noqa: E731
    return (p @ vr.abs(), mds @ kr.abs() * scale, fold(mds.transpose(-2, -1) @ q.abs() * scale),
            fold(p.transpose(-2, -1) @ do.abs()))


def _rows_within(got, want, mag, tol):
    """Every row's error within ``tol`` of its terms' magnitude (``_term_magnitudes``)."""
    got, want, mag = (t.double().flatten(0, -2) for t in (got, want, mag))
    return bool(((got - want).norm(dim=-1) <= tol * mag.norm(dim=-1)).all())


@settings(max_examples=12, deadline=None)
@given(tq=st.integers(1, 70), tk=st.integers(1, 70), groups=st.sampled_from([1, 2]), causal=st.booleans(),
       mask=st.sampled_from([0, PAPER, ALL, R.PV | R.PDO]), seed=st.integers(0, 2**16))
@example(tq=3, tk=7, groups=2, causal=True, mask=ALL, seed=527)      # a dS flip: dQ off by 21 % of its norm
@example(tq=1, tk=28, groups=2, causal=True, mask=ALL, seed=20476)   # one visible key: dQ is rounding only
@example(tq=5, tk=53, groups=2, causal=True, mask=PAPER, seed=45465)  # a flip on 10 dQ rows
@example(tq=2, tk=36, groups=1, causal=True, mask=PAPER, seed=45144)  # dK: 72 rows, 4 with terms, all cancel
def test_reference_properties(tq, tk, groups, causal, mask, seed):
    """Any lengths (ragged tiles, Tq != Tk, causal top-left aligned), GQA, any role mask: finite; FP32 close to
    float64, row by row relative to the magnitudes of the terms summed (``_term_magnitudes``: observed over 300
    random cases <= 0.005 on all-BF16 paths, <= 0.03 where P or dS is NVFP4; bounds 0.02 and 0.1); with 32 or
    more rows that have terms also as a whole relative to the result (the bounds of test_reference_fp32_vs_fp64,
    plus E2M1 flips on the P paths; on fewer rows one flip can move a row by a third of its norm, 21 % of a
    3 x 7 dQ, and a few cancelling rows dominate); rows see only their admissible keys."""
    q, k, v, do = _qkv(H=2, Hkv=2 // groups, Tq=tq, Tk=tk, seed=seed)
    o64, lse64, g64 = _run_ref(q, k, v, do, None, causal, mask, out_dtype=torch.float64)
    o, lse, g = _run_ref(q, k, v, do, None, causal, mask, dtype=torch.float32, emulate_bf16=True)
    assert all(torch.isfinite(t).all() for t in (o, lse, *g))
    tol = 0.02 if mask == 0 else 0.1
    for got, want, mag, whole in zip((o, *g), (o64, *g64), _term_magnitudes(q, k, v, do, causal),
                                     (0.05 if mask & R.PV else 0.01, 0.1, 0.1, 0.1)):
        assert _rows_within(got, want, mag, tol)
        if int((mag.flatten(0, -2).norm(dim=-1) > 0).sum()) >= 32:    # rows with terms (keys some query sees)
            assert rel(got, want) < whole or want.abs().max() < 1e-6
    if causal:  # query 0 sees only key 0: O[0] is V̂[0] (or V[0]) exactly up to rounding
        v0 = R.dequantize_2d(*R.quantize_2d(v))[:, :, 0] if mask & R.PV else v[:, :, 0].double()
        torch.testing.assert_close(o64[:, :, 0], v0.repeat_interleave(groups, 1), rtol=2e-2, atol=1e-6)


def test_bf16_roles_match_torch_sdpa():
    """All six roles BF16: qattn matches torch SDPA (its own CPU kernel, BF16) to BF16 tolerance, in the
    FlashAttention form: err(qattn) <= 2·err(SDPA bf16) + 1e-3 against float64 math."""
    for causal, kw in ((True, dict(H=4, Hkv=2, Tq=45, Tk=45)), (False, dict(Tq=33, Tk=50))):
        q, k, v, do = _qkv(**kw)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        gqa = q.shape[1] != k.shape[1]
        out = qattn_sdpa(*leaves, is_causal=causal, enable_gqa=gqa, fp4_roles=0)
        grads = torch.autograd.grad(out, leaves, do)
        sd = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_out = F.scaled_dot_product_attention(*sd, is_causal=causal, enable_gqa=gqa)
        ref_grads = torch.autograd.grad(ref_out, sd, do)
        s64 = [t.double().requires_grad_() for t in (q, k, v)]
        o64 = R.sdpa_math_ref(*s64, is_causal=causal)
        g64 = torch.autograd.grad(o64, s64, do.double())
        assert rel(out, o64) <= 2 * rel(ref_out, o64) + 1e-3
        for a, b, c in zip(grads, ref_grads, g64):
            assert rel(a, c) <= 2 * rel(b, c) + 1e-3


def test_fp4_roles_are_applied_and_bounded():
    """NVFP4 roles change the result by NVFP4-sized amounts (not bf16-sized, not garbage), and each role bit
    only touches its own product."""
    q, k, v, do = _qkv(Tq=64, Tk=64)
    o0, _, g0 = _run_ref(q, k, v, do, None, True, 0, out_dtype=torch.float64)
    o1, _, g1 = _run_ref(q, k, v, do, None, True, PAPER, out_dtype=torch.float64)
    assert 0.01 < rel(o1, o0) < 0.3          # QKᵀ in NVFP4 moves O
    assert 0.01 < rel(g1[0], g0[0]) < 0.5    # dQ: dS·K in NVFP4
    assert 0.01 < rel(g1[1], g0[1]) < 0.5    # dK: dSᵀ·Q in NVFP4
    # attn.pv only: the forward's P and V are quantized, LSE is untouched
    o2, lse2, _ = _run_ref(q, k, v, do, None, True, R.PV, out_dtype=torch.float64)
    _, lse0, _ = _run_ref(q, k, v, do, None, True, 0, out_dtype=torch.float64)
    assert torch.equal(lse2, lse0) and rel(o2, o0) > 0.01
    # attn.pdo only: dV changes, dQ/dK do not
    _, _, g3 = _run_ref(q, k, v, do, None, True, R.PDO, out_dtype=torch.float64)
    assert rel(g3[2], g0[2]) > 0.01 and torch.equal(g3[0], g0[0]) and torch.equal(g3[1], g0[1])


def test_causal_equals_tril_bool_mask_and_additive_mask():
    q, k, v, do = _qkv(Tq=50, Tk=50)
    tril = torch.ones(50, 50, dtype=torch.bool).tril()
    add = torch.zeros(50, 50).masked_fill(~tril, -math.inf)
    a = _run_ref(q, k, v, do, None, True, PAPER)
    b = _run_ref(q, k, v, do, tril, False, PAPER)
    c = _run_ref(q, k, v, do, add, False, PAPER)
    for x, y, z in zip((a[0], a[1], *a[2]), (b[0], b[1], *b[2]), (c[0], c[1], *c[2])):
        assert torch.equal(x, y) and torch.equal(x, z)


@pytest.mark.parametrize("roles", [0, PAPER, ALL], ids=["bf16", "paper", "all-fp4"])
def test_eager_path_equals_op(roles):
    """qattn_sdpa outside torch.compile runs ``ops._QAttnEager`` (no custom-op layers): bit-identical output and
    gradients to the op with its registered autograd, and the same tensors saved for backward."""
    q, k, v, do = _qkv(H=4, Hkv=2)
    outs, grads, saved = [], [], []
    for eager in (True, False):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        if eager:
            o = qattn_sdpa(*leaves, is_causal=True, enable_gqa=True, fp4_roles=roles)
            assert type(o.grad_fn).__name__ == "_QAttnEagerBackward"
        else:
            o = torch.ops.fp4compile.qattn(*leaves, None, True, 0.125, roles)[0]
        saved.append([t.dtype if t is not None else None for t in o.grad_fn.saved_tensors]
                     if eager else None)
        outs.append(o)
        grads.append(torch.autograd.grad(o, leaves, do))
    assert torch.equal(outs[0], outs[1])
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[1]))
    # the FP4 copies (uint8 codes/scales), not bf16 Q/K, are saved where a role consumes them in NVFP4
    need = R.saved_for_backward(roles)
    assert (saved[0][0] is None) == (not need["q"][0]) and (saved[0][3] is None) == (not need["q"][1])


def test_eager_path_not_taken_when_traced():
    """Under tracing (make_fx here; Dynamo/AOT alike) qattn_sdpa emits the custom op, never the eager Function."""
    from torch.fx.experimental.proxy_tensor import make_fx

    q, k, v, _ = _qkv()
    gm = make_fx(lambda a, b, c: qattn_sdpa(a, b, c, is_causal=True, fp4_roles=PAPER))(q, k, v)
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert any("fp4compile.qattn" in t for t in targets), targets


def test_gqa_equals_repeated_kv():
    """GQA (2 KV heads for 4 query heads) == repeating K/V: same quantized copies (same amax, same tiles);
    dK/dV are the group sums."""
    q, k, v, do = _qkv(H=4, Hkv=2, Tq=32, Tk=32)
    o, lse, (dq, dk, dv) = _run_ref(q, k, v, do, None, True, ALL, out_dtype=torch.float64)
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    o2, lse2, (dq2, dk2, dv2) = _run_ref(q, kr, vr, do, None, True, ALL, out_dtype=torch.float64)
    assert torch.equal(o, o2) and torch.equal(lse, lse2) and torch.equal(dq, dq2)
    torch.testing.assert_close(dk, dk2.unflatten(1, (2, 2)).sum(2), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dv, dv2.unflatten(1, (2, 2)).sum(2), rtol=1e-12, atol=1e-12)


def test_fully_masked_row_gives_zero_and_finite_grads():
    q, k, v, do = _qkv(Tq=16, Tk=16)
    keep = torch.ones(16, 16, dtype=torch.bool)
    keep[3] = False
    o, lse, g = _run_ref(q, k, v, do, keep, False, PAPER, dtype=torch.float32, emulate_bf16=True)
    assert torch.all(o[:, :, 3] == 0) and torch.isinf(lse[:, :, 3]).all()
    assert all(torch.isfinite(t).all() for t in g) and torch.all(g[0][:, :, 3] == 0)


def test_opcheck_cpu():
    q, k, v, do = _qkv(Tq=20, Tk=20)
    for mask in (PAPER, ALL, PAPER | R.IN_OP_TRANSFORM):
        # the full opcheck suite on the paper split and with the Q, K transform inside the op; schema + fake tensors
        # on the all-NVFP4 variant (CI time)
        utils = None if mask != ALL else ("test_schema", "test_faketensor")
        kw = {} if utils is None else {"test_utils": utils}
        args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), None, True, 0.125, mask)
        torch.library.opcheck(torch.ops.fp4compile.qattn.default, args, **kw)
        out = torch.ops.fp4compile.qattn(*args)
        need = R.saved_for_backward(mask)
        views = list(out[2:])
        for i, n in enumerate("qkv"):
            if not need[n][1]:
                views[3 * i:3 * i + 3] = [None] * 3
        bargs = (do, q.detach() if need["q"][0] else None, k.detach() if need["k"][0] else None,
                 v.detach() if need["v"][0] else None, *[t.detach() if t is not None else None for t in views],
                 out[0].detach(), out[1].detach(), None, True, 0.125, mask)
        # the backward op has no autograd of its own: schema + fake tensors suffice
        torch.library.opcheck(torch.ops.fp4compile.qattn_bwd.default, bargs,
                              test_utils=("test_schema", "test_faketensor"))


def test_outputs_are_stored_like_sdpa():
    """O, dQ, dK, dV are [B, H, T, D] views of [B, T, H, D] storage, as SDPA's flash/cuDNN outputs: a model's
    ``y.transpose(1, 2).reshape(B, T, H * D)`` is then a view and the Q/K/V gradients of a fused projection are
    concatenated row by row. The fake functions (what Inductor plans with) give the same strides as the op, and a
    gradient arriving in that layout is read in place."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v, _ = _qkv(B=2, H=4, Hkv=2, Tq=24, Tk=24)
    do = torch.randn(2, 24, 4, 64).bfloat16().transpose(1, 2)  # the layout the model's reshape hands back
    for mask in (0, PAPER):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = torch.ops.fp4compile.qattn(*leaves, None, True, 0.125, mask)
        grads = torch.autograd.grad(out[0], leaves, do)
        for name, t in zip(("out", "dq", "dk", "dv"), (out[0], *grads)):
            assert t.transpose(1, 2).is_contiguous(), (mask, name, t.stride())
        o64, _, g64 = _run_ref(q, k, v, do, None, True, mask, out_dtype=torch.float64)
        assert rel(out[0], o64) < 0.02 and all(rel(a, b) < 0.05 for a, b in zip(grads, g64)), mask
        need = R.saved_for_backward(mask)
        views = [t if need["qkv"[i // 3]][1] else None for i, t in enumerate(out[2:])]
        bargs = (do, q if need["q"][0] else None, k if need["k"][0] else None, v if need["v"][0] else None,
                 *views, out[0].detach(), out[1], None, True, 0.125, mask)
        real = torch.ops.fp4compile.qattn_bwd(*bargs)
        with FakeTensorMode(allow_non_fake_inputs=True) as fm:
            fargs = [fm.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in bargs]
            fake = torch.ops.fp4compile.qattn_bwd(*fargs)
            ffwd = torch.ops.fp4compile.qattn(*(fm.from_tensor(t) for t in (q, k, v)), None, True, 0.125, mask)
        assert [t.stride() for t in fake] == [t.stride() for t in real] == [g.stride() for g in grads], mask
        assert ffwd[0].stride() == out[0].stride(), mask


def test_bad_inputs_raise_clear_errors():
    q, k, v, _ = _qkv(H=3, Hkv=2)
    with pytest.raises(Exception, match="multiple of"):
        torch.ops.fp4compile.qattn(q, k, v, None, False, 0.1, PAPER)
    q, k, v, _ = _qkv()
    with pytest.raises(ValueError, match="dropout"):
        qattn_sdpa(q, k, v, dropout_p=0.1)


# ---------------------------------------------------------------------------------------------------------
# the Triton kernels under the interpreter (CPU), FlashAttention's 2x rule
_INTERP_SCRIPT = r"""
import math, os, torch
import triton.runtime.interpreter as I
_orig = I._patch_lang_tensor
def _patched(tensor, scope):  # Triton 3.6's interpreter calls int() on 1-element arrays; numpy >= 2.4 refuses
    _orig(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
I._patch_lang_tensor = _patched
from fp4compile.kernels import attention as A, attention_ref as R
import triton, triton.language as tl
@triton.jit
def THRESHOLD_CODE(a):  # the E2M1 magnitude code of a >= 0 by its seven rounding thresholds (ties to even)
    return ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
            + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
@triton.jit
def E2M1_CHECK(X, Y, Z, W, U, N: tl.constexpr):
    o = tl.arange(0, N)
    a = tl.load(X + o)
    tl.store(Y + o, A._e2m1_mag_code(a))  # _quant2d_kernel's magnitude codes
    tl.store(Z + o, THRESHOLD_CODE(a))
    tl.store(W + o, A._e2m1_round(-a))
    tl.store(U + o, A._e2m1_round(a))
def rel(a, b):
    a, b = a.double(), b.double(); return ((a - b).norm() / b.norm()).item()
DEV = os.environ.get("QATTN_TEST_DEVICE", "cpu")
torch.manual_seed(0)
x = torch.randn(1, 2, 40, 64).bfloat16().to(DEV)
assert all(torch.equal(a, b) for a, b in zip(A.quantize_2d(x), R.quantize_2d(x))), "quant2d kernel != reference"
xs = [x, (torch.randn(2, 33, 1, 64).bfloat16().transpose(1, 2) * 3).to(DEV),
      torch.zeros(1, 1, 20, 64).bfloat16().to(DEV)]
for got, t in zip(A.quantize_many(xs, [True, False, True]), xs):  # one amax + one quantize launch for three
    assert all(torch.equal(a, b) for a, b in zip(got[:3], R.quantize_2d(t))), "quantize_many != reference"
    assert len(got) == 3 or torch.equal(got[3], A.dequantize_2d(got[0], got[1]))
# Q and K in 1x16 blocks along head_dim (QK_1X16) beside a tiled V, in the same two launches
for got, t, tl_ in zip(A.quantize_many(xs, [True, True, False], [False, False, True]), xs, (False, False, True)):
    assert all(torch.equal(a, b) for a, b in zip(got[:3], R.quantize_2d(t, tl_))), "quantize_many 1x16 != ref"
    assert len(got) == 3 or torch.equal(got[3], A.dequantize_2d(got[0], got[1]))
# the backward's prep launch dequantizes two saved copies of different lengths (ragged last row block), one of
# them with E4M3-subnormal scales (rows over seven decades), to the reference's exact bf16 code x scale
y = (torch.randn(3, 1, 70, 64) * torch.logspace(-7, 0, 70)[:, None]).bfloat16().to(DEV)
cq = [R.quantize_2d(t) for t in (x, y)]
assert ((cq[1][1] & 0x78) == 0).any() and (cq[1][1] > 0).any(), "no subnormal scale to check"
one = torch.ones((), device=DEV)
for (c, sc, _), d in zip(cq, A.dequantize_many([(c, sc) for c, sc, _ in cq])):
    assert torch.equal(d, R.dequantize_2d(c, sc, one, torch.bfloat16)), "dequantize_many != reference"
# the backward's prep launch re-quantizes saved 1x16 copies in 16x16 tiles from their codes and scales (QK_1X16's
# dS operands): the reference's requantize_tiles (global excluded), and the same values as the quantize launches on
# the copies' code x scale (their own amax pass). Copies of several heads and lengths (T = 40, 33, 70: the last tile
# padded with zeros, per head), an all-zero one, one with E4M3-subnormal scales; one beside an unre-quantized copy
c1 = [R.quantize_2d(t.contiguous(), False)[:2] for t in xs + [y]]
for pair in ((c1[0], c1[1]), (c1[2], c1[3])):
    _, deqs, reqs = A._bwd_prep(None, None, list(pair), [True, True])
    for (c, sc), d, z in zip(pair, deqs, reqs):
        assert torch.equal(d, R.dequantize_2d(c, sc, one, torch.bfloat16)), "prep's code x scale != reference"
        assert torch.equal(z, R.requantize_tiles(c, sc, one, torch.bfloat16)), "prep's re-quantization != reference"
        assert torch.equal(z, A.quantize_many([d], [True])[0][3]), "prep's re-quantization != the quantize pass"
_, _, reqs = A._bwd_prep(None, None, [c1[1], c1[0]], [False, True])
assert reqs[0] is None and torch.equal(reqs[1], R.requantize_tiles(*c1[0], one, torch.bfloat16))
# head dim 128 (two 32-bit words of scale bytes per row, 16-row steps), T = 40: a ragged last step per head
c128 = R.quantize_2d((torch.randn(1, 2, 40, 128) * torch.logspace(-3, 1, 128)).bfloat16().to(DEV), False)[:2]
_, deqs, reqs = A._bwd_prep(None, None, [c128], [True])
assert torch.equal(deqs[0], R.dequantize_2d(*c128, one, torch.bfloat16)), "prep's code x scale (d=128) != reference"
assert torch.equal(reqs[0], R.requantize_tiles(*c128, one, torch.bfloat16)), "prep's re-quantization (d=128) != ref"
# a NaN or an Inf element: Q-Attn's copy has a non-finite global (the reference's NaN / Inf), tiles and 1x16 alike
for bad in (float("nan"), float("inf"), -float("inf")):
    xb = xs[0].clone()
    xb[0, 0, 17, 5] = bad
    for tl_ in (True, False):
        got, ref = A.quantize_many([xb], [True], [tl_])[0], R.quantize_2d(xb, tl_)
        assert not torch.isfinite(got[2]) and not torch.isfinite(ref[2]), ("non-finite input, finite global", bad)
# bench/attention_prep.py's own check of both prep forms (delta, code x scale, tiles), on a small case
import bench.attention_prep as P
P.check(*P.inputs(1, 2, 40, 64, DEV))
# the last two: causal, long enough that every loop (diagonal band, unmasked blocks, ragged tail) runs, with
# non-default tiles (the fp4-dS backward: 128-row dS tiles holding two 64x64 scale tiles)
CASES = [(R.PAPER_ROLES, True, 2, 1, 80, None, None, None), (63, False, 2, 2, 70, "bool", None, None),
         (R.PDO | R.DOV | R.QK, True, 2, 1, 64, None, None, None), (0, False, 1, 1, 50, "add", None, None),
         (R.PAPER_ROLES, True, 1, 1, 160, None, dict(BM=64, BN=32), {"dkdv": dict(BN=128), "dq": dict(BM=128)}),
         (0, True, 1, 1, 100, None, dict(BM=32, BN=16, num_warps=4),
          {"dkdv": dict(BM=16, BN=32), "dq": dict(BM=32, BN=16)}),
         (R.PAPER_ROLES | R.QK_1X16, True, 2, 1, 64, None, None,
          {"dkdv": dict(BN=64), "dq": dict(BM=128, num_warps=8)}),   # s54_next's 128-query dQ programs
         (R.PAPER_ROLES | R.QK_1X16, True, 2, 1, 48, None, None, None),   # ragged: re-quantized tiles padded
         (R.PAPER_ROLES | R.QK_1X16, True, 1, 1, 80, None, None, None, 128)]   # head dim 128
x = torch.rand(4096) * 8
x[:14] = torch.tensor([0, .25, .75, 1.25, 1.75, 2, 2.5, 3.5, 4, 5, 6, 7, 1e30, float("inf")])
x = x.to(DEV)
y = torch.empty_like(x, dtype=torch.int32)
z = torch.empty_like(x, dtype=torch.int32)
w = torch.empty_like(x)
u = torch.empty_like(x)
E2M1_CHECK[(1,)](x, y, z, w, u, N=4096)
assert torch.equal(y, z), "_e2m1_mag_code != threshold form"
zv = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6], device=DEV)[z.long()]
assert torch.equal(u, zv) and torch.equal(w, -zv), "_e2m1_round(+-x) != +-(threshold form)"
for mask, causal, H, Hkv, T, mk, fcfg, bcfg, *hd in CASES:
    D = hd[0] if hd else 64
    if mask == R.PDO | R.DOV | R.QK:  # [B, T, H, D] storage seen as [B, H, T, D]: strided inputs
        q, k, v, do = (torch.randn(1, T, n, D).bfloat16().transpose(1, 2).to(DEV) for n in (H, Hkv, Hkv, H))
    else:
        q = torch.randn(1, H, T, D).bfloat16(); k = torch.randn(1, Hkv, T, D).bfloat16()
        v = torch.randn(1, Hkv, T, D).bfloat16(); do = torch.randn(1, H, T, D).bfloat16()
        q, k, v, do = (t.to(DEV) for t in (q, k, v, do))
    am = None
    if mk:
        keep = torch.rand(1, 1, T, T) > 0.3; keep[..., 0] = True
        am = keep if mk == "bool" else torch.where(keep, torch.randn(keep.shape), torch.full(keep.shape, -1e4))
        am = am.to(DEV)
    views = R.quantize_qkv(q, k, v, mask)
    sc = 0.125
    o, lse = A.attention_fwd(q, k, v, views, am, causal, sc, mask, config=fcfg)
    o64, l64 = R.attention_fwd_ref(q, k, v, views, am, causal, sc, mask, out_dtype=torch.float64)
    opt, lpt = R.attention_fwd_ref(q, k, v, views, am, causal, sc, mask, dtype=torch.float32, emulate_bf16=True)
    g = A.attention_bwd(do, q, k, v, views, o, lse, am, causal, sc, mask, config=bcfg)
    g64 = R.attention_bwd_ref(do, q, k, v, views, o64, l64, am, causal, sc, mask, out_dtype=torch.float64)
    gpt = R.attention_bwd_ref(do, q, k, v, views, opt, lpt, am, causal, sc, mask, dtype=torch.float32, emulate_bf16=True)
    for name, a, b, c in [("o", o, opt, o64)] + list(zip(("dq", "dk", "dv"), g, gpt, g64)):
        ek, ep = rel(a, c), rel(b, c)
        print(f"mask={mask} causal={causal} {name}: kernel {ek:.5f} pt {ep:.5f}")
        assert ek <= 2 * ep + 1e-3, (mask, causal, name, ek, ep)
    if bcfg is not None and mask & (R.DSK | R.DSQ):
        # the same dS quantization (64x64 scale tiles inside 128-row register tiles) as the reference: given the
        # same O and LSE, the kernel's dQ/dK are far closer to the FP32 implementation than either is to fp64
        gs = A.attention_bwd(do, q, k, v, views, opt, lpt, am, causal, sc, mask, config=bcfg)
        for name, a, b, c in zip(("dq", "dk"), gs, gpt, g64):
            assert rel(a, b) <= 0.25 * rel(b, c), (mask, name, rel(a, b), rel(b, c))
    assert (lse.double() - l64).abs().max() < 1e-5
if DEV == "cuda":  # the op: globals of tensors without an FP4 copy are 0 (written by the forward kernel)
    import fp4compile.ops
    junk = [torch.full((), float("nan"), device=DEV) for _ in range(256)]
    del junk
    q = torch.randn(1, 2, 64, 64, device=DEV).bfloat16()
    for roles, zero in ((0, (4, 7, 10)), (R.PAPER_ROLES, (10,))):
        r = torch.ops.fp4compile.qattn(q, q, q, None, True, 0.125, roles)
        assert all(r[i].item() == 0.0 for i in zero), [r[i].item() for i in zero]
    # the CUDA op's own copies with QK_1X16 (Q and K in rows, V in tiles where attn.pv is NVFP4)
    k = torch.randn(1, 2, 64, 64, device=DEV).bfloat16() * 3
    r = torch.ops.fp4compile.qattn(q, k, k, None, True, 0.125, R.PAPER_ROLES | R.PV | R.QK_1X16)
    for got, x, tiles in ((r[2:5], q, False), (r[5:8], k, False), (r[8:11], k, True)):
        assert all(torch.equal(a, b) for a, b in zip(got, R.quantize_2d(x, tiles))), "qattn 1x16 copies != ref"
print("INTERPRETER-OK")
"""


def _run_kernel_script(tmp_path, env):
    # from a file: compiling @triton.jit functions (E2M1_CHECK) needs their source file
    script = tmp_path / "qattn_kernel_cases.py"
    script.write_text(_INTERP_SCRIPT)
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "INTERPRETER-OK" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


def test_triton_kernels_interpreter_fa_rule(tmp_path):
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    _run_kernel_script(tmp_path, env)


def _bench_module(name: str):
    """bench/<name>.py loaded as a module (the bench scripts are not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", os.path.join(REPO, "bench", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("kernel", ["prep", "prep_1x16"])
@pytest.mark.parametrize("D", [64, 128])
def test_bwd_prep_loads_codes_and_scales_as_vectors(D, kernel):
    """The backward's prep launch compiled for sm_90 (CPU, bench/attention_sass.py): the saved NVFP4 Q/K copies are
    read with vector loads, not one byte load per element (what it did until session 22: 128 per thread at d=128),
    also where it re-quantizes them in tiles (QK_1X16, "prep_1x16")."""
    pytest.importorskip("triton")
    ptx = _bench_module("attention_sass").compile_kernel(kernel, D, True, upto="ptx")
    assert not re.search(r"ld\.global(\.\w+)*\.(b8|u8|s8)\b", ptx)
    assert re.search(r"ld\.global(\.\w+)*\.v4\.b32", ptx)


@pytest.mark.parametrize("kernel", ["dkdv", "dq", "dkdv_1x16", "dq_1x16"])
def test_ds_quantizer_keeps_nan_on_sm90(kernel):
    """The paper split's backward kernels compiled for sm_90 (CPU): the in-register E2M1 rounding of dS clamps to
    +-6 with ``max.NaN`` / ``min.NaN`` (``_e2m1_round``), so a NaN in dS stays NaN into dS·K and dSᵀ·Q. With plain
    ``max.f32`` / ``min.f32`` (what ``tl.maximum`` / ``tl.minimum`` give, and these kernels had until session 53) a NaN
    saturates to +-6 on the GPU; the interpreter's np.maximum keeps it, so only the PTX shows this."""
    pytest.importorskip("triton")
    ptx = _bench_module("attention_sass").compile_kernel(kernel, 64, True, upto="ptx")
    lo = re.findall(r"\bmax(\.\w+)*\.f32\s+%\w+, %\w+, 0fC0C00000;", ptx)   # max(x, -6.0)
    hi = re.findall(r"\bmin(\.\w+)*\.f32\s+%\w+, %\w+, 0f40C00000;", ptx)   # min(., 6.0)
    assert lo and hi
    assert set(lo) == {".NaN"} and set(hi) == {".NaN"}, (set(lo), set(hi))


def _nan_rows_of_grads(device, roles):
    """Which rows of dQ, dK, dV are NaN after a causal Q-Attn backward with one NaN in dO (head 1, query 70)."""
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, 2, 128, 64, device=device, generator=g, dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    do = torch.randn(1, 2, 128, 64, device=device, generator=g, dtype=torch.bfloat16)
    do[0, 1, 70, 5] = float("nan")
    qattn_sdpa(q, k, v, is_causal=True, fp4_roles=roles).backward(do)
    return [t.grad.isnan().any(-1)[0] for t in (q, k, v)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("roles", [PAPER, PAPER | R.QK_1X16], ids=["tiles", "1x16"])
def test_nan_in_ds_reaches_dq_and_dk(roles, device):
    """A NaN in one row of dO makes that row of dP, and so of dS, NaN: through dS·K and dSᵀ·Q (NVFP4 in the paper
    split) the gradients have NaN in exactly the rows the all-BF16 kernels give NaN (query 70's dQ row, and on CPU
    every dK and dV row of head 1, as a masked P = 0 times NaN is NaN), not the finite values a NaN-dropping clamp
    made of dS on the GPU until session 53 (``_e2m1_round``). On CPU the reference op."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    got, want = _nan_rows_of_grads(device, roles), _nan_rows_of_grads(device, 0)
    assert want[0][1].nonzero().flatten().tolist() == [70] and not any(w[0].any() for w in want)
    for a, b in zip(got, want):
        assert torch.equal(a, b), (a.nonzero().tolist(), b.nonzero().tolist())


@pytest.mark.parametrize("kernel", ["amax", "quant2d"])
def test_qattn_amax_keeps_nan_on_sm90(kernel):
    """Q-Attn's per-tensor amax compiled for sm_90 (CPU) reduces with NaN-propagating max (``max.NaN.f32``): the
    partial maxima kernel only with it, the quantize kernel for the max of the partials (its block maxima may drop
    a NaN). ``tl.max`` alone compiles to ``max.f32``, which drops a NaN on the GPU; the interpreter case above runs
    ``quantize._amax_all``'s interpreter branch instead, so only the PTX shows the GPU's reduction."""
    pytest.importorskip("triton")
    from fp4compile.kernels import attention as KA
    from fp4compile.kernels.offline import compile_offline

    fn = KA._amax_kernel if kernel == "amax" else KA._quant2d_kernel
    const = dict(BT=32, D=64, SM0=False, RO0=0, SM1=False, RO1=0, LOGR=0)
    if kernel == "quant2d":
        const.update(NP2=256, WD0=True, WD1=True, WD2=False, RW0=False, RW1=False, RW2=False)
    ptr = {"X": "*bf16", "C": "*u8", "S": "*u8", "Y": "*bf16", "G": "*fp32", "M": "*fp32"}   # X0, ...; rest ints

    def typ(n):
        return "*fp32" if n == "PART" else ptr[n[0]] if len(n) == 2 and n[0] in ptr and n[1].isdigit() else "i32"

    ptx = compile_offline(fn, {n: typ(n) for n in fn.arg_names if n not in const}, const, 4)
    nan_max, plain = len(re.findall(r"\bmax\.NaN\.f32\b", ptx)), len(re.findall(r"\bmax\.f32\b", ptx))
    assert nan_max > 0
    assert kernel != "amax" or plain == 0, plain


@pytest.mark.parametrize("D", [64, 128])
def test_bwd_prep_requantization_costs_few_registers(D):
    """QK_1X16's prep launch (sm_90, CPU) re-quantizes each saved copy from the same read that dequantizes it, in
    steps of 2048 elements: at most 16 registers over the plain prep launch (56 against 44 at d = 64, 79 and 79 at
    d = 128). Session 50's form, two reads in separate tasks, took 80 / 112; the whole 64-row block at once 80 / 155
    (fewer programs per SM for a memory-bound launch)."""
    pytest.importorskip("triton")
    from fp4compile.kernels.offline import sass_stats

    sass = _bench_module("attention_sass")
    regs = {k: sass_stats(sass.compile_kernel(k, D, True))[2] for k in ("prep", "prep_1x16")}
    assert 0 < regs["prep"] and regs["prep_1x16"] <= regs["prep"] + 16, regs


def test_bwd_prep_rejects_what_the_requantization_cannot_read():
    """The prep launch's re-quantization reads codes per head and scale rows as 32-bit words: a non-contiguous copy,
    more than two copies, or scales not 4-byte aligned are refused before any launch."""
    pytest.importorskip("triton")
    from fp4compile.kernels.attention import _bwd_prep

    c = torch.zeros(1, 1, 16, 32, dtype=torch.uint8)
    s = torch.zeros(1, 1, 16, 4, dtype=torch.uint8)
    odd = torch.zeros(s.numel() + 1, dtype=torch.uint8)[1:].view(s.shape)
    with pytest.raises(ValueError, match="4-byte aligned"):
        _bwd_prep(None, None, [(c, odd)], [True])
    with pytest.raises(ValueError, match="contiguous"):
        _bwd_prep(None, None, [(c.transpose(2, 3).contiguous().transpose(2, 3), s)], [True])
    with pytest.raises(ValueError, match="at most two"):
        _bwd_prep(None, None, [(c, s)] * 3)


@pytest.mark.parametrize("kernel,programs", [("dkdv", 3), ("dq", 4)])
def test_bwd_defaults_fit_their_programs_per_sm(kernel, programs):
    """The paper split's backward kernels at D = 64 as launched by default (bench/attention_sass.py, sm_90, CPU): their
    register caps and stages (attention.BWD_CONFIGS) let 3 dK/dV / 4 dQ programs of 4 warps share an SM's 65,536
    registers and 227 KB of shared memory. Uncapped, dK/dV takes 184 registers (2 per SM; 308.9 against 250.2 us on
    the H200, session 30) and dQ at 3 stages 66.5 KB (3 per SM; 204.4 against 201.8 us). Both run 2 stages (dK/dV
    since session 31: 230-233 -> 211-215 us)."""
    pytest.importorskip("triton")
    from fp4compile.kernels.offline import sass_stats

    meta = {}
    _, _, regs, _ = sass_stats(_bench_module("attention_sass").compile_kernel(kernel, 64, True, metadata=meta))
    assert 0 < regs and programs * 128 * regs <= 65536, regs
    assert 0 < meta["shared"] and programs * meta["shared"] <= 227 * 1024, meta["shared"]


def _fma32(a, b, c):
    """fp32 fma of numpy fp32 arrays, emulated exactly: the product is exact in float64; the sum, which may need
    more than 53 bits, is split by TwoSum and rounded once (ties to even) from the float64 sum and the sign of
    its error."""
    f32, f64 = np.float32, np.float64
    x, y = a.astype(f64) * b.astype(f64), c.astype(f64)
    s = x + y
    bb = s - x
    err = (x - (s - bb)) + (y - bb)
    t = s.astype(f32)
    d = s - t.astype(f64)
    other = np.where(d > 0, np.nextafter(t, f32(np.inf)), np.nextafter(t, f32(-np.inf)))
    mid = (d != 0) & (2 * d == other.astype(f64) - t.astype(f64))
    return np.where(mid & (np.sign(err) == np.sign(d)), other, t)


def _rn32(fr):
    """Round-to-nearest-even fp32 of a positive Fraction in the normal range (exact rational oracle)."""
    from fractions import Fraction
    e = fr.numerator.bit_length() - fr.denominator.bit_length()
    while Fraction(2) ** e > fr:
        e -= 1
    while Fraction(2) ** (e + 1) <= fr:
        e += 1
    ulp = Fraction(2) ** (e - 23)
    n, rem = divmod(fr, ulp)
    n += rem * 2 > ulp or (rem * 2 == ulp and n % 2 == 1)
    return np.float32(float(n * ulp))


def test_fma_emulation_against_rationals():
    """The test's fp32 fma emulation (_fma32) against exact rationals on random operands whose product is small
    against the addend (the sum's rounding is what matters)."""
    from fractions import Fraction
    rng = np.random.default_rng(0)
    a, c = (rng.standard_normal(4000).astype(np.float32) for _ in range(2))
    b = (rng.standard_normal(4000) * 2.0 ** -20).astype(np.float32)
    got = _fma32(a, b, c)
    for x, y, z, g in zip(a, b, c, got):
        exact = Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z))
        assert g == np.sign(float(exact)) * _rn32(abs(exact))


def test_div6_sequence_is_div_rn_for_every_significand():
    """The dS quantizer's RN(x / 6) on the GPU (attention._div6_rn: q = RN(x * RN(1/6)), r = fma(-q, 6, x),
    fma(r, RN(1/6), q)) equals the correctly rounded quotient for every fp32 significand, in four binades
    (the sequence commutes with powers of two away from subnormals; quotients below 2^-121 only meet a scale
    that rounds them to E4M3 zero). Oracle: float64 division rounded to fp32 (no double rounding: x / 3 is
    never within 2^-53 of an fp32 midpoint)."""
    inv6 = np.float32(float.fromhex("0x1.555556p-3"))
    assert inv6 == np.float32(1) / np.float32(6)
    x = (np.arange(1 << 23, dtype=np.uint32) | np.uint32(0x3F800000)).view(np.float32)
    for scale in (1.0, 2.0 ** -121, 2.0 ** -60, 2.0 ** 100):
        xs = x * np.float32(scale)
        q = xs * inv6
        got = _fma32(_fma32(-q, np.full_like(q, 6.0), xs), np.full_like(q, inv6), q)
        want = (xs.astype(np.float64) / 6.0).astype(np.float32)
        assert np.array_equal(got, want), (scale, int((got != want).sum()))


def test_e4m3_reciprocal_sequence_is_correctly_rounded():
    """The dS quantizer's RN(1 / sf) on the GPU (attention._rcp_e4m3_rn: y = rcp.approx(sf), within one ulp by
    PTX's spec; fma(fma(-sf, y, 1), y, y)) is the correctly rounded reciprocal of every positive E4M3 value
    (ml_dtypes), from every seed within two ulps of the exact reciprocal (exact rational oracle)."""
    from fractions import Fraction

    ml_dtypes = pytest.importorskip("ml_dtypes")
    vals = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    vals = np.unique(vals[np.isfinite(vals) & (vals > 0)])
    assert len(vals) == 126
    one = np.ones(1, np.float32)
    for sf in vals:
        exact = 1 / Fraction(float(sf))
        rn = _rn32(exact)
        seeds = [rn]
        for _ in range(3):
            seeds = sorted({t for y in seeds for t in (np.nextafter(y, np.float32(0)), y,
                                                       np.nextafter(y, np.float32(np.inf)))})
        seeds = [y for y in seeds if abs(Fraction(float(y)) - exact) <= 2 * Fraction(float(np.spacing(rn)))]
        assert len(seeds) >= 3
        for y in seeds:
            y1, s1 = np.array([y], np.float32), np.array([sf], np.float32)
            assert _fma32(_fma32(-s1, y1, one), y1, y1)[0] == rn, (sf, y)


def test_ds_quantizer_uses_the_short_divisions():
    """The paper split's backward kernels compiled for sm_90 (CPU): the per-block divisions of dS's quantizer are
    the short sequences the tests above prove (rcp.approx + two FMAs, one FMUL + two FMAs), not div.rn (left for
    the per-tile globals only)."""
    pytest.importorskip("triton")
    mod = _bench_module("attention_sass")
    for kernel in ("dkdv", "dq"):
        ptx = mod.compile_kernel(kernel, 64, True, upto="ptx")
        assert ptx.count("rcp.approx.ftz.f32") > 0 and ptx.count("div.rn.f32") <= 4, kernel


def test_tile_sweep_starts_from_the_defaults():
    """bench/attention.py's SWEEP lists each group's default configuration first (its rows report every config's
    output difference against that first entry, and the docs read it as the default's time)."""
    from fp4compile.kernels import attention as A

    for (kind, D, *rest), cfgs in _bench_module("attention").SWEEP.items():
        if kind == "fwd":
            assert cfgs[0] == A.FWD_CONFIGS[D], (kind, D)
        else:
            want = A.BWD_CONFIGS[(D, rest[0])]
            assert (cfgs[0][0], cfgs[0][1]) == (want["dkdv"], want["dq"]), (kind, D, rest)


@pytest.mark.gpu
def test_cuda_kernels_fa_rule(tmp_path):
    """The same cases compiled for the GPU (wgmma, hardware conversions), plus the CUDA op's zero globals."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    env = dict(os.environ, QATTN_TEST_DEVICE="cuda", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    _run_kernel_script(tmp_path, env)


# ---------------------------------------------------------------------------------------------------------
# the pass
class Block(nn.Module):
    """Causal self-attention; ``style`` = sdpa | nanogpt (hand-written, masked_fill) | hf (eager, additive)."""

    def __init__(self, d=128, heads=2, style="sdpa", T=32, dropout=0.0, kv_heads=None):
        super().__init__()
        self.h, self.hkv, self.style, self.p = heads, kv_heads or heads, style, dropout
        self.hd = d // heads
        self.qkv = nn.Linear(d, (heads + 2 * self.hkv) * self.hd)
        self.proj = nn.Linear(d, d)
        self.register_buffer("bias", torch.tril(torch.ones(T, T)).view(1, 1, T, T))

    def forward(self, x, add_mask=None):
        B, T, C = x.shape
        qkv = self.qkv(x).view(B, T, self.h + 2 * self.hkv, self.hd).transpose(1, 2)
        q, k, v = qkv.split([self.h, self.hkv, self.hkv], dim=1)
        if self.style == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.p if self.training else 0.0,
                                               enable_gqa=self.h != self.hkv)
        elif self.style == "nanogpt":
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            y = att @ v
        else:  # transformers' eager_attention_forward
            w = torch.matmul(q, k.transpose(2, 3)) * self.hd ** -0.5
            w = w + add_mask
            w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
            w = F.dropout(w, p=0.0, training=self.training)
            y = torch.matmul(w, v)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Captured:
    """A test backend: swap_attention, then AOT autograd with identity compilers that keep the graphs."""

    def __init__(self, policy):
        self.policy, self.sites, self.fw, self.bw, self.dynamo = policy, [], None, None, None

    def __call__(self, gm, example_inputs):
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        self.sites += swap_attention(gm, self.policy)
        self.dynamo = gm

        def fw(g, _):
            self.fw = g
            return make_boxed_func(g.forward)

        def bw(g, _):
            self.bw = g
            return make_boxed_func(g.forward)

        return aot_autograd(fw_compiler=fw, bw_compiler=bw)(gm, example_inputs)


def _compile_run(model, policy, *args):
    torch._dynamo.reset()
    be = Captured(policy)
    out = torch.compile(model, backend=be)(*args)
    return be, out


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _eager_qattn(m, x, **qattn_kw):
    """``m`` run eagerly with every SDPA call replaced by ``qattn_sdpa(..., **qattn_kw)``: its output and the gradient
    of its sum with respect to a copy of ``x``."""
    torch._dynamo.reset()
    x2 = x.detach().clone().requires_grad_()
    orig = F.scaled_dot_product_attention
    try:
        F.scaled_dot_product_attention = lambda *a, **k: qattn_sdpa(*a, **k, **qattn_kw)
        ref = m(x2)
    finally:
        F.scaled_dot_product_attention = orig
    (gx2,) = torch.autograd.grad(ref.sum(), x2)
    return ref, gx2


def test_swap_sdpa_full_stack_matches_op_and_saves_fp4_qk():
    torch.manual_seed(0)
    m = Block(style="sdpa", kv_heads=1)
    x = torch.randn(2, 32, 128, requires_grad=True)
    be, out = _compile_run(m, Policy.full_stack(), x)
    (gx,) = torch.autograd.grad(out.sum(), x)
    assert [s.swapped for s in be.sites] == [True]
    assert F.scaled_dot_product_attention not in _targets(be.dynamo)
    meta = [n.meta["fp4_attn"] for n in be.dynamo.graph.nodes if "fp4_attn" in n.meta][0]
    # the defaults (session 61): Q, K smoothed and rotated, then quantized in 1x16 blocks along head_dim (QK_1X16 bit)
    assert set(meta["roles"]) == set(R.ATTN_ROLES) and meta["fp4_roles"] == PAPER | R.QK_1X16
    assert meta["source"] == "sdpa" and meta["qk_blocks"] == qk_blocks_mode() == "1x16"
    assert meta["roles"]["attn.qk"].name == "nvfp4" and meta["roles"]["attn.pv"] is BF16
    assert meta["qk_transform"] == qk_transform_mode() == "smooth_k+hadamard"
    # eager model with the same op and transform: identical result
    ref, gx2 = _eager_qattn(m, x, fp4_roles=PAPER | R.QK_1X16, qk_transform=qk_transform_mode())
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(gx, gx2)
    # the backward consumes the forward's FP4 Q/K (uint8 codes + uint8 E4M3 scales), not bf16/fp32 Q/K
    (bwd,) = [n for n in be.bw.graph.nodes if n.target is torch.ops.fp4compile.qattn_bwd.default]
    names = ["grad_out", "q", "k", "v", "q_codes", "q_scales", "q_global", "k_codes", "k_scales", "k_global",
             "v_codes", "v_scales", "v_global"]
    a = dict(zip(names, bwd.args))
    assert a["q"] is None and a["k"] is None
    for n in ("q_codes", "q_scales", "k_codes", "k_scales"):
        assert a[n].op == "placeholder" and a[n].meta["val"].dtype == torch.uint8
    assert a["q_codes"].meta["val"].shape == (2, 2, 32, 32) and a["k_scales"].meta["val"].shape == (2, 1, 32, 4)
    # paper split: V's only backward consumer (dO·Vᵀ) is BF16, so V itself is saved, not an FP4 copy
    assert a["v"] is not None and a["v_codes"] is None
    saved = [o for o in be.fw.graph.output_node().args[0][1:] if o is not None]
    assert sum(s.meta["val"].dtype == torch.uint8 for s in saved) == 4


def test_pv_dov_fp4_saves_fp4_v():
    m = Block(style="sdpa")
    pol = Policy.full_stack().override("*", NVFP4(), role="attn.pv").override("*", NVFP4(), role="attn.dov")
    be, out = _compile_run(m, pol, torch.randn(1, 32, 128, requires_grad=True))
    out.sum().backward()
    (bwd,) = [n for n in be.bw.graph.nodes if n.target is torch.ops.fp4compile.qattn_bwd.default]
    assert bwd.args[1] is None and bwd.args[2] is None and bwd.args[3] is None
    assert bwd.args[10].meta["val"].dtype == torch.uint8


def test_bf16_policies_leave_sdpa():
    for pol in (Policy.bf16(), Policy.quartet2()):
        be, _ = _compile_run(Block(style="sdpa"), pol, torch.randn(1, 32, 128))
        assert F.scaled_dot_product_attention in _targets(be.dynamo)
        assert [s.swapped for s in be.sites] == [False] and be.sites[0].reason is None


@pytest.mark.parametrize("kind", ["dropout", "headdim"])
def test_unsupported_keeps_sdpa_with_warning(kind):
    m = Block(style="sdpa", dropout=0.1) if kind == "dropout" else Block(d=64, heads=2)
    with pytest.warns(UserWarning, match="keeps SDPA"):
        be, out = _compile_run(m, Policy.full_stack(), torch.randn(1, 32, m.qkv.in_features))
    assert F.scaled_dot_product_attention in _targets(be.dynamo)
    assert not be.sites[0].swapped and be.sites[0].reason
    assert torch.isfinite(out).all()


def test_handwritten_nanogpt_attention_is_swapped():
    torch.manual_seed(0)
    m = Block(style="nanogpt")
    x = torch.randn(2, 32, 128, requires_grad=True)
    be, out = _compile_run(m, Policy.full_stack(), x)
    assert [(s.source, s.swapped) for s in be.sites] == [("handwritten", True)]
    assert F.softmax not in _targets(be.dynamo) and qattn_sdpa in _targets(be.dynamo)
    sd = Block(style="sdpa")
    sd.load_state_dict(m.state_dict())
    be2, out2 = _compile_run(sd, Policy.full_stack(), x)
    torch.testing.assert_close(out, out2)  # causal via the tril buffer == is_causal (same quantized math)
    g1 = torch.autograd.grad(out.sum(), x)[0]
    g2 = torch.autograd.grad(out2.sum(), x)[0]
    torch.testing.assert_close(g1, g2)


class ViewBlock(Block):
    """Hand-written attention whose output is ``.view``-ed directly: valid on the contiguous ``att @ v``, not on
    qattn's [B, T, H, D]-stored output without a copy."""

    def forward(self, x, add_mask=None):
        B, T, C = x.shape
        qkv = self.qkv(x).view(B, T, 3 * self.h, self.hd).transpose(1, 2)
        q, k, v = qkv.split([self.h, self.h, self.h], dim=1)
        att = ((q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1))))
        att = F.softmax(att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf")), dim=-1)
        y = (att @ v).view(B, self.h, T * self.hd)  # merges T and D: needs contiguous [B, H, T, D]
        return self.proj(y.view(B, self.h, T, self.hd).transpose(1, 2).reshape(B, T, C))


def test_swap_keeps_direct_views_of_the_output_valid():
    """qattn's output layout differs from ``att @ v``'s: a direct ``.view`` that needs the contiguous layout gets a
    ``.contiguous()`` in front (the model compiles and matches its eager output); the usual transpose + reshape
    gets none (that is where the layout saves the copy)."""
    torch.manual_seed(0)
    x = torch.randn(2, 32, 128, requires_grad=True)
    m = ViewBlock(style="nanogpt")
    be, out = _compile_run(m, Policy.full_stack(), x)
    assert [(s.source, s.swapped) for s in be.sites] == [("handwritten", True)]
    (attn,) = [n for n in be.dynamo.graph.nodes if n.target is qattn_sdpa]
    assert [u.target for u in attn.users] == ["contiguous"]
    assert rel(out, m(x)) < 0.05
    for style in ("sdpa", "nanogpt"):
        be, _ = _compile_run(Block(style=style), Policy.full_stack(), x)
        (attn,) = [n for n in be.dynamo.graph.nodes if n.target is qattn_sdpa]
        assert "contiguous" not in [u.target for u in attn.users], style


def test_handwritten_transformers_eager_attention_is_swapped():
    torch.manual_seed(0)
    m = Block(style="hf").eval()
    x = torch.randn(2, 32, 128)
    add = torch.zeros(2, 1, 32, 32).masked_fill(~torch.ones(32, 32, dtype=torch.bool).tril(), torch.finfo(torch.float32).min)
    be, out = _compile_run(m, Policy.full_stack(), x, add)
    assert [(s.source, s.swapped) for s in be.sites] == [("handwritten", True)]
    sd = Block(style="sdpa").eval()
    sd.load_state_dict(m.state_dict())
    _, out2 = _compile_run(sd, Policy.full_stack(), x)
    torch.testing.assert_close(out, out2, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# ablation: the paper's split trains; NVFP4 in P·V and dO·Vᵀ widens the gap to BF16
class TinyLM(nn.Module):
    """Embedding + one causal attention head (d=64) + readout: the attention must learn a positional lookup."""

    def __init__(self, vocab=16, d=64, T=32, fp4_roles=0):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(T, d))
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, vocab)
        self.fp4_roles = fp4_roles

    def forward(self, idx):
        B, T = idx.shape
        x = self.emb(idx) + self.pos[:T]
        q, k, v = self.qkv(x).view(B, T, 3, 1, 64).permute(2, 0, 3, 1, 4)
        y = qattn_sdpa(q, k, v, is_causal=True, fp4_roles=self.fp4_roles).transpose(1, 2).reshape(B, T, -1)
        return self.out(y)


def _train(fp4_roles, steps=40, seed=0, lag=3):
    torch.manual_seed(seed)
    m = TinyLM(fp4_roles=fp4_roles)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed + 1)
    losses = []
    for _ in range(steps):
        # target at position t is the token at t - lag: solvable only by attending to the right position
        idx = torch.randint(0, 16, (8, 32), generator=g)
        logits = m(idx)[:, lag:]
        loss = F.cross_entropy(logits.reshape(-1, 16), idx[:, :-lag].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
def test_ablation_pv_dov_fp4():
    """Reported, not asserted beyond finiteness and 'the paper split trains' (the gap depends on the task)."""
    base, paper, ablation = _train(0), _train(PAPER), _train(ABLATION)
    tail = lambda ls: sum(ls[-5:]) / 5  # noqa: E731
    print(f"\nablation final loss (mean of last 5 of {len(base)} steps; ln 16 = 2.77): bf16 {tail(base):.4f} | "
          f"paper split {tail(paper):.4f} (gap {tail(paper) - tail(base):+.4f}) | "
          f"+PV,dO·Vᵀ NVFP4 {tail(ablation):.4f} (gap {tail(ablation) - tail(base):+.4f})")
    assert all(math.isfinite(v) for v in base + paper + ablation)
    assert tail(paper) < 0.7 * paper[0]


def test_real_backend_explain_lists_six_attention_roles():
    """Through ``fullstack_fp4`` (backend.py calls swap_attention): explain() shows the six roles."""
    import fp4compile

    torch.manual_seed(0)
    rep = fp4compile.explain(Block(style="sdpa", kv_heads=1), torch.randn(2, 32, 128, requires_grad=True),
                             policy="full_stack")
    attn = {s.role: s for s in rep.sites if s.role.startswith("attn.")}
    assert set(attn) == set(R.ATTN_ROLES)
    assert {r for r, s in attn.items() if s.precision == "nvfp4"} == {"attn.qk", "attn.dsk", "attn.dsq"}
    # the default QK_BLOCKS "1x16": the dS products take the forward's copy re-quantized in tiles (valid along T)
    assert attn["attn.dsk"].reused == "requant of fwd copy" and tuple(attn["attn.qk"].shape) == (32, 32, 64)


def test_backend_options_set_qk_transform_and_blocks_per_compile():
    """The ``qk_transform`` / ``qk_blocks`` backend options override the module defaults for one compile (two
    compiles in one process, each with its own), leave the defaults as they were, and are validated up front."""
    import fp4compile
    import fp4compile.passes.attention as A
    from fp4compile.backend import Settings

    defaults = (A.QK_TRANSFORM, A.QK_BLOCKS)
    x = torch.randn(2, 32, 128, requires_grad=True)
    for opts, blocks, note in (({"qk_blocks": "16x16"}, "16x16", "Q, K smooth_k+hadamard first"),
                               ({"qk_blocks": "1x16", "qk_transform": "none"}, "1x16",
                                "Q, K in 1x16 blocks along head_dim")):
        torch.manual_seed(0)
        rep = fp4compile.explain(Block(style="sdpa", kv_heads=1), x, policy="full_stack", options=opts)
        attn = {s.role: s for s in rep.sites if s.role.startswith("attn.")}
        assert attn["attn.dsk"].reused == ("2d fwd copy" if blocks == "16x16" else "requant of fwd copy")
        assert attn["attn.qk"].note == note, attn["attn.qk"].note
    assert (A.QK_TRANSFORM, A.QK_BLOCKS) == defaults
    with pytest.raises(ValueError, match="qk_blocks must be one of"):
        Settings.from_options({"qk_blocks": "2d"})
    with pytest.raises(ValueError, match="qk_transform must be one of"):
        Settings.from_options({"qk_transform": "hadamard16"})
    with pytest.raises(ValueError, match="policy once"):
        fp4compile.explain(Block(style="sdpa"), x, policy="bf16", options={"policy": "full_stack"})


# ---------------------------------------------------------------------------------------------------------
# Q and K transformed before quantization (attention_ref.qk_transform, the pass's QK_TRANSFORM)
TRANSFORMS = ("smooth_k", "hadamard", "smooth_k+hadamard")


@pytest.mark.parametrize("d", [1, 2, 16, 64, 128])
def test_signed_hadamard_is_a_signed_sylvester_matrix(d):
    """Against Sylvester's recursion H_2d = [[H, H], [H, -H]] built by Kronecker products (written independently of
    the bit-parity formula): each row is +-1 times that row, over sqrt(d); the matrix is orthogonal."""
    syl = torch.ones(1, 1, dtype=torch.float64)
    while syl.shape[0] < d:
        syl = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64), syl)
    h = R.signed_hadamard(d, dtype=torch.float64) * math.sqrt(d)
    signs = h[:, 0]
    assert set(signs.tolist()) <= {-1.0, 1.0}
    assert torch.equal(h, signs[:, None] * syl)
    if d >= 16:
        assert (signs < 0).any() and (signs > 0).any()
    torch.testing.assert_close(R.signed_hadamard(d, dtype=torch.float64) @ R.signed_hadamard(d, dtype=torch.float64).T,
                               torch.eye(d, dtype=torch.float64), rtol=0, atol=1e-15)
    pm1 = R.signed_hadamard(d, dtype=torch.bfloat16, normalize=False)
    assert pm1.dtype == torch.bfloat16 and torch.equal(pm1.double(), h)      # +-1: exact in BF16
    with pytest.raises(ValueError, match="power-of-two"):
        R.signed_hadamard(48)


@pytest.mark.parametrize("d,block", [(96, 32), (80, 16), (112, 16), (64, 64), (64, 16)])
def test_signed_hadamard_blocks(d, block):
    """A head dim that is not a power of two is rotated in diagonal blocks: torch.block_diag of Sylvester's
    matrix (Kronecker products, as above), each row signed as the full matrix's row of that index; orthogonal."""
    syl = torch.ones(1, 1, dtype=torch.float64)
    while syl.shape[0] < block:
        syl = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64), syl)
    assert R.hadamard_block(d) == (block if block == d or d != 64 else 64)
    h = R.signed_hadamard(d, dtype=torch.float64, normalize=False, block=block)
    signs = h.abs().sum(1).clamp(max=1) * h[torch.arange(d), (torch.arange(d) // block) * block].sign()
    assert torch.equal(h, signs[:, None] * torch.block_diag(*[syl] * (d // block)))
    want = [1 - 2 * ((((i * 0x9E3779B1) & 0xFFFFFFFF) >> 13) & 1) for i in range(d)]
    assert signs.tolist() == want
    hn = R.signed_hadamard(d, dtype=torch.float64, block=block)
    torch.testing.assert_close(hn @ hn.T, torch.eye(d, dtype=torch.float64), rtol=0, atol=1e-15)
    for bad in (24, 128, 0):
        with pytest.raises(ValueError, match="power-of-two"):
            R.signed_hadamard(d, block=bad)


def test_signed_hadamard_traces_with_int32_literals_and_its_signs():
    """A traced graph computes the matrix (no captured constant) with integer literals that Inductor's Triton code
    can hold (it types a literal as int32: ``2654435761*x1`` failed to compile on the H200 in session 37); its signs
    are bit 13 of ``i * 0x9E3779B1`` mod 2^32, computed here with Python integers."""
    from torch.fx.experimental.proxy_tensor import make_fx
    g = make_fx(lambda x: R.signed_hadamard(128, x.device))(torch.zeros(1))
    assert not any(n.op == "get_attr" for n in g.graph.nodes)
    lits = [a for n in g.graph.nodes for a in (*n.args, *n.kwargs.values())
            if isinstance(a, int) and not isinstance(a, bool)]
    assert lits and all(-2**31 <= a < 2**31 for a in lits), lits
    want = [1 - 2 * ((((i * 0x9E3779B1) & 0xFFFFFFFF) >> 13) & 1) for i in range(128)]
    assert (R.signed_hadamard(128, dtype=torch.float64)[:, 0] * math.sqrt(128)).tolist() == want


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 96])
@pytest.mark.parametrize("how", TRANSFORMS)
def test_qk_transform_compiles_for_cuda(how, D):
    """Inductor's Triton code for the transform (what a compiled training step runs), against eager."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(2, 4, 256, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    got = torch.compile(R.qk_transform, backend="inductor", fullgraph=True)(q, k, how)
    want = R.qk_transform(q, k, how)
    assert got[2] == want[2]
    for a, b in zip(got[:2], want[:2]):
        torch.testing.assert_close(a.float(), b.float(), rtol=0.02, atol=0.02)


def test_qk_transform_compiles_again_for_another_head_dim():
    """Inductor's CPU code for the rotation after a recompile for another head dim (which makes it dynamic): the
    sign matrix's integer arithmetic once went through a vectorized int64 shift that did not compile (the GPU
    test above failed the same way at D=96 after D=64); equal to eager."""
    torch._dynamo.reset()
    f = torch.compile(R.qk_transform, backend="inductor", fullgraph=True)
    for D in (64, 96):
        q, k = (torch.randn(1, 2, 32, D, dtype=torch.bfloat16) for _ in range(2))
        got, want = f(q, k, "hadamard"), R.qk_transform(q, k, "hadamard")
        assert got[2] == want[2] and all(torch.equal(a, b) for a, b in zip(got[:2], want[:2]))


@pytest.mark.parametrize("how", TRANSFORMS)
@pytest.mark.parametrize("causal,gqa", [(True, False), (False, True)])
def test_qk_transform_is_the_same_attention(how, causal, gqa):
    """Unquantized float64 attention of the transformed Q, K with the scale times the returned factor equals that of
    Q, K (K's smoothing runs in FP32 at least, so to FP32 accuracy), outputs and the gradients that autograd takes back through the transform; with an additive
    mask too."""
    q, k, v, do = _qkv(H=4, Hkv=2 if gqa else 4, Tq=40, Tk=40, dtype=torch.float64)
    k = k + 3.0 * torch.linspace(-1, 1, 64, dtype=torch.float64)   # a channel bias for smoothing to remove
    mask = None if causal else torch.randn(40, 40, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = R.sdpa_math_ref(*leaves, attn_mask=mask, is_causal=causal) if not gqa else \
        R.sdpa_math_ref(leaves[0], *(t.repeat_interleave(2, 1) for t in leaves[1:]), attn_mask=mask, is_causal=causal)
    g_ref = torch.autograd.grad(ref, leaves, do)
    leaves2 = [t.clone().requires_grad_() for t in (q, k, v)]
    q2, k2, c = R.qk_transform(leaves2[0], leaves2[1], how)
    assert q2.dtype == k2.dtype == torch.float64
    assert not torch.allclose(k2, leaves2[1])
    assert c == (1 / 64 if "hadamard" in how else 1.0)
    v2 = leaves2[2]
    if gqa:
        k2, v2 = k2.repeat_interleave(2, 1), v2.repeat_interleave(2, 1)
    out = R.sdpa_math_ref(q2, k2, v2, attn_mask=mask, is_causal=causal, scale=c / 8.0)
    g = torch.autograd.grad(out, leaves2, do)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if "smooth_k" in how and "hadamard" not in how:
        assert torch.equal(q2, leaves2[0])
        torch.testing.assert_close(k2.mean(-2), torch.zeros_like(k2.mean(-2)), rtol=0, atol=1e-5)


@pytest.mark.parametrize("D", [96, 80])
def test_qk_transform_is_the_same_attention_for_other_head_dims(D):
    """Head dims that are not powers of two (rotated in blocks of hadamard_block(D) channels, factor 1 / block):
    float64 attention of the transformed Q, K equals that of Q, K, outputs and gradients."""
    q, k, v, do = _qkv(H=2, Tq=24, Tk=24, D=D, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = R.sdpa_math_ref(*leaves, is_causal=True)
    g_ref = torch.autograd.grad(ref, leaves, do)
    leaves2 = [t.clone().requires_grad_() for t in (q, k, v)]
    q2, k2, c = R.qk_transform(leaves2[0], leaves2[1], "smooth_k+hadamard")
    assert c == 1 / R.hadamard_block(D) and not torch.allclose(q2, leaves2[0])
    out = R.sdpa_math_ref(q2, k2, leaves2[2], is_causal=True, scale=c / math.sqrt(D))
    g = torch.autograd.grad(out, leaves2, do)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_qk_transform_keeps_the_bthd_layout_and_rounds_once():
    """Q, K as [B, H, T, D] views of [B, T, H, D] storage (split from a fused projection) come back as such views,
    with no copy in between; the BF16 product is float64's rounded once (FP32 accumulation may move a value that
    sits near a rounding midpoint by one BF16 step, nothing more)."""
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(2, 32, 4, 64, generator=g).to(torch.bfloat16).transpose(1, 2) for _ in range(2))
    q2, k2, c = R.qk_transform(q, k, "hadamard")
    assert c == 1 / 64 and q2.dtype == k2.dtype == torch.bfloat16
    assert q2.transpose(1, 2).is_contiguous() and k2.transpose(1, 2).is_contiguous()
    s64 = R.signed_hadamard(64, dtype=torch.float64, normalize=False)
    for got, x in ((q2, q), (k2, k)):
        want = (x.double() @ s64).to(torch.bfloat16)
        ulp = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
        assert ulp.max() <= 1 and (ulp == 0).float().mean() > 0.99


def test_qk_transform_none_and_bad_value():
    q, k, _, _ = _qkv()
    a, b, c = R.qk_transform(q, k, "none")
    assert a is q and b is k and c == 1.0
    with pytest.raises(ValueError, match="smooth_k"):
        R.qk_transform(q, k, "smooth_q")


@settings(max_examples=60, deadline=None)
@given(st.floats(min_value=-30.0, max_value=30.0), st.floats(min_value=0.0, max_value=6.0), st.integers(0, 2**32 - 1))
def test_requantize_tiles_keeps_the_global_and_lands_on_the_tile_grid(log2_scale, decades, seed):
    """The dS products' operand under QK_1X16: the 1x16 copy's values quantized again in 16x16 tiles. Its own global
    is exactly 1 (so the kernels may apply the saved copy's global to it), it lies on a 16x16-tile NVFP4 grid along
    both axes (quantizing it again, or its transpose, changes nothing), and it is a second rounding, not the copy."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, 48, 64, generator=g) * 2.0 ** log2_scale
         * torch.logspace(0, decades, 48, base=10.0)[:, None]).bfloat16()
    codes, scales, glob = R.quantize_2d(x, tiles=False)
    one = torch.ones(())
    vals = R.dequantize_2d(codes, scales, one, torch.float32)
    assert vals.abs().max().item() == 2688.0 and R.quantize_2d(vals, tiles=True)[2].item() == 1.0
    rq = R.requantize_tiles(codes, scales, glob, torch.float64)
    again = R.dequantize_2d(*R.quantize_2d((rq / glob.double()).float(), tiles=True)) * glob.double()
    assert torch.equal(again, rq)
    t = (rq / glob.double()).float().transpose(-2, -1).contiguous()
    assert torch.equal(R.dequantize_2d(*R.quantize_2d(t, tiles=True)).transpose(-2, -1) * glob.double(), rq)
    assert not torch.equal(rq, R.dequantize_2d(codes, scales, glob))


def _qattn_errors(q, k, v, do, how, fp4_roles=PAPER):
    """Relative errors of the paper split's (or ``fp4_roles``') O, dQ, dK (CPU op) against float64 attention of the
    original Q, K."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = qattn_sdpa(*leaves, is_causal=True, fp4_roles=fp4_roles, qk_transform=how)
    g = torch.autograd.grad(out, leaves, do)
    s64 = [t.double().requires_grad_() for t in (q, k, v)]
    o64 = R.sdpa_math_ref(*s64, is_causal=True)
    g64 = torch.autograd.grad(o64, s64, do.double())
    return rel(out, o64), rel(g[0], g64[0]), rel(g[1], g64[1])


def test_smooth_k_cuts_the_error_of_a_k_with_channel_biases():
    """K with large per-channel offsets shared by every position (what trained models' keys show): one 16x16 tile's
    scale is set by the offset channel, the others lose their resolution. Smoothing removes the offsets before
    quantization: O, dQ and dK all come closer to float64 attention."""
    q, k, v, do = _qkv(H=2, Tq=128, Tk=128, dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    k = (k + 6.0 * torch.randn(1, 2, 1, 64, generator=g)).bfloat16()
    q, v, do = q.bfloat16(), v.bfloat16(), do.bfloat16()
    base = _qattn_errors(q, k, v, do, "none")
    smooth = _qattn_errors(q, k, v, do, "smooth_k")
    assert all(s < 0.75 * b for s, b in zip(smooth, base)), (base, smooth)


def test_hadamard_cuts_the_error_of_outlier_channels():
    """Q and K whose first channels are 10x larger and vary by position (no mean to remove): the rotation spreads
    them over all 64 channels and the 16x16 tiles' scales fit the rest; smoothing K alone cannot help."""
    q, k, v, do = _qkv(H=2, Tq=128, Tk=128, dtype=torch.float32)
    boost = torch.ones(64)
    boost[:4] = 10.0
    q, k = (q * boost).bfloat16(), (k * boost).bfloat16()
    v, do = v.bfloat16(), do.bfloat16()
    base = _qattn_errors(q, k, v, do, "none")
    had = _qattn_errors(q, k, v, do, "hadamard")
    assert had[0] < 0.75 * base[0] and had[1] < base[1] and had[2] < base[2], (base, had)


def _swapped_block(monkeypatch, **switches):
    """A GQA ``Block`` compiled with the full stack while ``passes.attention``'s module ``switches`` are set: (model,
    input, output, gradient of the output's sum, the swapped ``qattn_sdpa`` node)."""
    import fp4compile.passes.attention as A

    for name, value in switches.items():
        monkeypatch.setattr(A, name, value)
    torch.manual_seed(0)
    m = Block(style="sdpa", kv_heads=1)
    x = torch.randn(2, 32, 128, requires_grad=True)
    be, out = _compile_run(m, Policy.full_stack(), x)
    (gx,) = torch.autograd.grad(out.sum(), x)
    (node,) = [n for n in be.dynamo.graph.nodes if n.target is qattn_sdpa]
    return m, x, out, gx, node


@pytest.mark.parametrize("how", ["none", "smooth_k", "smooth_k+hadamard"])
def test_swap_writes_the_transform_into_the_graph(monkeypatch, how):
    """QK_TRANSFORM reaches the swapped node's kwargs (so every cache key sees it), the site's meta and explain()'s
    notes; the compiled model equals the eager model calling qattn_sdpa with the same transform, gradients too."""
    # QK_BLOCKS pinned: the notes and the mask of the transform alone
    m, x, out, gx, node = _swapped_block(monkeypatch, QK_TRANSFORM=how, QK_BLOCKS="16x16")
    assert node.kwargs.get("qk_transform", "none") == how
    assert ("qk_transform" in node.kwargs) == (how != "none")
    assert node.meta["fp4_attn"]["qk_transform"] == how
    notes = {r["role"]: r.get("note") for r in node.meta["fp4"]}
    assert (notes["attn.qk"] == f"Q, K {how} first") == (how != "none") and notes["attn.pv"] is None
    ref, gx2 = _eager_qattn(m, x, fp4_roles=PAPER, qk_transform=how)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(gx, gx2)


@pytest.mark.parametrize("D", [96, 80])
def test_qattn_sdpa_transforms_head_dims_that_are_not_powers_of_two(D):
    """qattn_sdpa (public, any head dim that is a multiple of 16; the pass swaps 64 and 128 only) with each transform
    at head dims 96 and 80: it runs, and its O, dQ, dK stay as close to float64 attention as without one."""
    q, k, v, do = _qkv(H=2, Tq=64, Tk=64, D=D)
    base = _qattn_errors(q, k, v, do, "none")
    for how in TRANSFORMS:
        errs = _qattn_errors(q, k, v, do, how)
        assert all(e < 1.25 * b for e, b in zip(errs, base)), (how, base, errs)


def test_qk_transform_setting_is_checked_and_left_out_without_fp4_qk(monkeypatch):
    import fp4compile.passes.attention as A

    monkeypatch.setattr(A, "QK_TRANSFORM", "smoothk")
    with pytest.raises(Exception, match="FP4COMPILE_QK_TRANSFORM"):   # Dynamo wraps the backend's ValueError
        _compile_run(Block(style="sdpa"), Policy.full_stack(), torch.randn(1, 32, 128))
    # only P·V in NVFP4: Q and K are not quantized, so they are not transformed
    monkeypatch.setattr(A, "QK_TRANSFORM", "smooth_k")
    pol = Policy.bf16().override("*", NVFP4(), role="attn.pv")
    be, _ = _compile_run(Block(style="sdpa"), pol, torch.randn(1, 32, 128))
    (node,) = [n for n in be.dynamo.graph.nodes if n.target is qattn_sdpa]
    assert "qk_transform" not in node.kwargs and node.meta["fp4_attn"]["qk_transform"] == "none"


# ---------------------------------------------------------------------------------------------------------
# Q and K in 1x16 blocks along head_dim (attention_ref.QK_1X16, the pass's QK_BLOCKS)
def test_quantize_1x16_copy_matches_ml_dtypes_oracle():
    """``quantize_2d(x, tiles=False)``: one E4M3 scale per position and 16 channels under the per-tensor global
    2688/amax, element for element the ml_dtypes fake-quantization along head_dim; the scales' layout is the
    tiles' one ([..., T, D/16]); odd lengths need no padding."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 37, 64, generator=g) * torch.logspace(-2, 1, 37)[:, None]   # positions over three decades
    codes, scales, glob = R.quantize_2d(x, tiles=False)
    assert codes.shape == (2, 37, 32) and scales.shape == (2, 37, 4)
    got = R.dequantize_2d(codes, scales, glob, torch.float32).numpy()
    amax = np.float32(x.abs().max().item())
    s_enc = np.float32(R.G_NUM) / amax
    # equal up to the order of the fp32 products code·scale·global (a flipped code or scale would be >= 2^-4 off)
    np.testing.assert_allclose(got, _np_fake_quant(x.numpy(), s_enc, np.float32(1) / s_enc), rtol=2.0 ** -22, atol=0)
    # the scales differ between the rows of a 16x16 tile (the tiles' copy replicates them)
    assert not torch.equal(scales[:, :16], scales[:, :1].expand(-1, 16, -1))
    tiles = R.quantize_2d(x)
    assert torch.equal(tiles[2], glob) and not torch.equal(tiles[1], scales)


def test_qk_1x16_reference_saves_the_row_copies():
    """With QK_1X16 the saved copies of Q and K (the ones QKᵀ reads; the backward's dS products take them
    re-quantized in tiles) are the 1x16 copies, V's stays in tiles, and the op's forward (CPU) is float64 softmax
    attention over exactly those values (an independent computation)."""
    q, k, v, do = _qkv(H=2, Hkv=1, Tq=48, Tk=48)
    mask = PAPER | R.QK_1X16
    views = R.quantize_qkv(q, k, v, mask | R.PV)
    for name, x, tiles in (("q", q, False), ("k", k, False), ("v", v, True)):
        want = R.quantize_2d(x, tiles=tiles)
        assert all(torch.equal(a, b) for a, b in zip(
            (getattr(views, f"{name}_codes"), getattr(views, f"{name}_scales"), getattr(views, f"{name}_global")),
            want)), name
    qh = R.dequantize_2d(views.q_codes, views.q_scales, views.q_global)
    kh = R.dequantize_2d(views.k_codes, views.k_scales, views.k_global).repeat_interleave(2, 1)
    s = (qh @ kh.transpose(-2, -1)) / 8.0
    s = s.masked_fill(~torch.ones(48, 48, dtype=torch.bool).tril(), -math.inf)
    o64 = torch.softmax(s, -1) @ v.double().repeat_interleave(2, 1)
    out = torch.ops.fp4compile.qattn(q, k, v, None, True, 0.125, mask)[0]
    assert rel(out, o64) < 4e-3                       # BF16 P and output rounding only
    plain = torch.ops.fp4compile.qattn(q, k, v, None, True, 0.125, PAPER)[0]
    assert rel(plain, o64) > 3 * rel(out, o64)        # ... and the tiles' copy is measurably another operand
    with pytest.raises(Exception, match="6-bit role mask"):
        torch.ops.fp4compile.qattn(q, k, v, None, True, 0.125, R.MASK_LIMIT)


def test_qk_1x16_cuts_the_error_of_positions_with_different_magnitudes():
    """Q and K whose positions differ in magnitude (one loud position in a 16x16 tile sets the scale of 15 quiet
    ones): the 1x16 copies give every position its own scale, and O, dQ, dK all come closer to float64 attention."""
    q, k, v, do = _qkv(H=2, Tq=128, Tk=128, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    loud = torch.where(torch.rand(1, 1, 128, 1, generator=g) < 0.1, 8.0, 1.0)
    q, k = (q * loud).bfloat16(), (k * loud.roll(3, 2)).bfloat16()
    v, do = v.bfloat16(), do.bfloat16()
    tiles = _qattn_errors(q, k, v, do, "none")
    rows = _qattn_errors(q, k, v, do, "none", PAPER | R.QK_1X16)
    assert all(r < 0.8 * t for r, t in zip(rows, tiles)), (tiles, rows)


@pytest.mark.parametrize("blocks", ["16x16", "1x16"])
def test_swap_writes_qk_blocks_into_the_graph(monkeypatch, blocks):
    """QK_BLOCKS reaches the swapped node's fp4_roles (bit QK_1X16, so cache keys see it), the site's meta and
    explain()'s records; the compiled model equals the eager model calling qattn_sdpa with that mask."""
    m, x, out, gx, node = _swapped_block(monkeypatch, QK_BLOCKS=blocks)
    want = PAPER | (R.QK_1X16 if blocks == "1x16" else 0)
    assert node.kwargs["fp4_roles"] == want and node.meta["fp4_attn"]["fp4_roles"] == want
    assert node.meta["fp4_attn"]["qk_blocks"] == blocks
    recs = {r["role"]: r for r in node.meta["fp4"]}
    assert ("1x16 blocks" in recs["attn.qk"]["note"]) == (blocks == "1x16")
    assert recs["attn.dsk"]["reused"] == ("requant of fwd copy" if blocks == "1x16" else "2d fwd copy")
    ref, gx2 = _eager_qattn(m, x, fp4_roles=want, qk_transform=qk_transform_mode())
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(gx, gx2)


def test_qk_blocks_setting_is_checked_and_left_out_without_fp4_qk(monkeypatch):
    import fp4compile.passes.attention as A

    monkeypatch.setattr(A, "QK_BLOCKS", "1x32")
    with pytest.raises(Exception, match="FP4COMPILE_QK_BLOCKS"):   # Dynamo wraps the backend's ValueError
        _compile_run(Block(style="sdpa"), Policy.full_stack(), torch.randn(1, 32, 128))
    monkeypatch.setattr(A, "QK_BLOCKS", "1x16")   # only P·V in NVFP4: no Q, K copies, no bit
    pol = Policy.bf16().override("*", NVFP4(), role="attn.pv")
    be, _ = _compile_run(Block(style="sdpa"), pol, torch.randn(1, 32, 128))
    (node,) = [n for n in be.dynamo.graph.nodes if n.target is qattn_sdpa]
    assert node.kwargs["fp4_roles"] == R.PV and node.meta["fp4_attn"]["qk_blocks"] == "16x16"
    # dS·K and dSᵀ·Q in NVFP4 but QKᵀ in BF16: the copies serve only the dS products, whose operand the tiles are
    pol = Policy.bf16().override("*", NVFP4(), role="attn.dsk").override("*", NVFP4(), role="attn.dsq")
    be, _ = _compile_run(Block(style="sdpa"), pol, torch.randn(1, 32, 128))
    (node,) = [n for n in be.dynamo.graph.nodes if n.target is qattn_sdpa]
    assert node.kwargs["fp4_roles"] == R.DSK | R.DSQ and node.meta["fp4_attn"]["qk_blocks"] == "16x16"

