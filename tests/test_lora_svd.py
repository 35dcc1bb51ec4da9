"""LoRA-SVD (fp4compile.nn): reparametrisation, constrained backward, Cholesky-QR, realignment, state remap."""
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import fp4compile
from fp4compile.nn import LORA_BF16_GLOB, LoRASVDLinear, cholesky_qr, merge, prepare, randomized_svd


class MLP(nn.Module):
    def __init__(self, d=32, h=64, vocab=48, dtype=torch.float32):
        super().__init__()
        self.fc1 = nn.Linear(d, h, dtype=dtype)
        self.fc2 = nn.Linear(h, d, bias=False, dtype=dtype)
        self.lm_head = nn.Linear(d, vocab, dtype=dtype)

    def forward(self, x):
        return self.lm_head(x + self.fc2(F.gelu(self.fc1(x))))


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matrices: one intra-op thread is much faster than two on a shared CPU box."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def n_params(m):
    return sum(p.numel() for p in m.parameters())


# ------------------------------------------------------------------------------------------------------
# reparametrisation
def test_lazy_public_api():
    assert fp4compile.prepare is prepare and fp4compile.merge is merge


def test_prepare_merge_identity_and_param_count():
    torch.manual_seed(0)
    m = MLP()
    x = torch.randn(5, 7, 32)
    y0 = m(x).detach()
    n0 = n_params(m)
    w_fc1 = m.fc1.weight
    h = prepare(m, rank=4, beta=0.7)
    assert set(h.modules) == {"fc1", "fc2"}                 # lm_head excluded by default
    assert isinstance(m.fc1, LoRASVDLinear) and type(m.lm_head) is nn.Linear
    assert m.fc1.weight is w_fc1                            # W_res reuses the Parameter
    expect_added = 4 * (32 + 64) + 4 * (64 + 32)
    assert h.added_parameters == expect_added and n_params(m) - n0 == expect_added
    torch.testing.assert_close(m(x), y0, rtol=1e-5, atol=1e-5)
    merge(m)
    assert type(m.fc1) is nn.Linear and type(m.fc2) is nn.Linear and m.fc1.weight is w_fc1
    assert n_params(m) == n0
    torch.testing.assert_close(m(x), y0, rtol=1e-5, atol=1e-5)
    assert not m.fc1.weight._backward_hooks                 # constraint hooks removed


def test_initial_split_is_top_r_svd():
    torch.manual_seed(1)
    lin = nn.Linear(40, 24).double()
    w = lin.weight.detach().clone()
    m = LoRASVDLinear.from_linear(lin, 5, beta=2.0)
    u, s, vh = torch.linalg.svd(w)
    low = 2.0 * m.lora_b.weight @ m.lora_a.weight
    torch.testing.assert_close(low, u[:, :5] * s[:5] @ vh[:5], rtol=1e-10, atol=1e-10)
    # balanced factors: equal singular values, sqrt(S / beta)
    torch.testing.assert_close(torch.linalg.svdvals(m.lora_b.weight), (s[:5] / 2.0).sqrt(), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(torch.linalg.svdvals(m.lora_a.weight), (s[:5] / 2.0).sqrt(), rtol=1e-10, atol=1e-10)
    assert torch.linalg.svdvals(m.weight)[0] <= s[5] * (1 + 1e-9)   # residual = the tail


def test_include_exclude_tied_and_errors():
    torch.manual_seed(0)
    m = MLP()
    h = prepare(m, rank=2, include="fc*", exclude="fc2")
    assert set(h.modules) == {"fc1"}
    with pytest.raises(ValueError, match="already contains"):
        prepare(m)
    h.undo()
    assert type(m.fc1) is nn.Linear

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
            self.b.weight = self.a.weight

    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        h = prepare(Tied(), rank=2)
    msgs = [str(r.message) for r in rec]
    assert any("shared" in s_ for s_ in msgs) and any("selected no" in s_ for s_ in msgs)
    assert not h.modules
    with pytest.raises(ValueError, match="fc1"):
        prepare(MLP(), rank=100)
    with pytest.raises(ValueError, match="constrain"):
        prepare(MLP(), constrain="qr")
    h = prepare(MLP(), rank=0.25)                            # fraction of min(in, out)
    assert {k: v.rank for k, v in h.modules.items()} == {"fc1": 8, "fc2": 8}


def test_low_rank_sites_have_lora_paths():
    """The low-rank GEMMs are linear calls inside submodules named lora_a / lora_b (policy glob)."""
    import fnmatch
    m = MLP()
    prepare(m, rank=2)
    paths = [p for p, mod in m.named_modules() if type(mod) is nn.Linear]
    lora = [p for p in paths if fnmatch.fnmatchcase(p, LORA_BF16_GLOB)]
    assert sorted(lora) == ["fc1.lora_a", "fc1.lora_b", "fc2.lora_a", "fc2.lora_b"]
    assert not fnmatch.fnmatchcase("fc1", LORA_BF16_GLOB)


# ------------------------------------------------------------------------------------------------------
# subspace-constrained backward
def _reference_grads(w, l1, l2, beta, x, dy):
    g = dy.T @ x
    u = torch.linalg.qr(l2).Q
    v = torch.linalg.qr(l1.T).Q
    gpar = u @ u.T @ g @ v @ v.T
    return g - gpar, beta * gpar @ l1.T, beta * l2.T @ gpar, g


@pytest.mark.parametrize("compiled", [False, True])
def test_constrained_backward_matches_math(compiled):
    torch.manual_seed(2)
    lin = nn.Linear(48, 40).double()
    x = torch.randn(16, 48, dtype=torch.float64)
    dy = torch.randn(16, 40, dtype=torch.float64)
    m = LoRASVDLinear.from_linear(lin, 6, beta=0.5)
    f = torch.compile(m, backend="aot_eager", fullgraph=True) if compiled else m
    (f(x) * dy).sum().backward()
    l1, l2 = m.lora_a.weight.detach(), m.lora_b.weight.detach()
    d_res, d_b, d_a, g = _reference_grads(m.weight.detach(), l1, l2, 0.5, x, dy)
    torch.testing.assert_close(m.weight.grad, d_res, rtol=0, atol=1e-9)
    torch.testing.assert_close(m.lora_b.weight.grad, d_b, rtol=0, atol=1e-9)
    torch.testing.assert_close(m.lora_a.weight.grad, d_a, rtol=0, atol=1e-9)
    # the residual gradient has no component in the principal subspace ...
    u, v = torch.linalg.qr(l2).Q, torch.linalg.qr(l1.T).Q
    assert (u.T @ m.weight.grad @ v).abs().max() < 1e-9
    # ... and is not trivially the full gradient
    assert (m.weight.grad - g).abs().max() > 1e-3


def test_unconstrained_is_plain_autograd():
    torch.manual_seed(3)
    lin = nn.Linear(24, 16).double()
    x, dy = torch.randn(8, 24, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64)
    m = LoRASVDLinear.from_linear(lin, 3, beta=1.5, constrain=None)
    (m(x) * dy).sum().backward()
    g = dy.T @ x
    torch.testing.assert_close(m.weight.grad, g)
    torch.testing.assert_close(m.lora_b.weight.grad, 1.5 * g @ m.lora_a.weight.detach().T)


def test_no_graph_break_and_compiled_model_matches_eager():
    torch.manual_seed(4)
    m = MLP()
    prepare(m, rank=4)
    x = torch.randn(4, 32)
    expl = torch._dynamo.explain(m)(x)
    assert expl.graph_break_count == 0 and expl.graph_count == 1
    m(x).square().mean().backward()
    ref = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    torch._dynamo.reset()
    cm = torch.compile(m, backend="aot_eager", fullgraph=True)
    cm(x).square().mean().backward()
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-5, atol=1e-6, msg=n)


# ------------------------------------------------------------------------------------------------------
# Cholesky-QR
def _check_basis(a, q, tol):
    assert torch.isfinite(q).all()
    proj = q.double() @ q.double().T
    a = a.double()
    # a projector-like map: eigenvalues in [0, 1], and it keeps the numerical range of A
    ev = torch.linalg.eigvalsh(q.double().T @ q.double())
    assert ev.min() >= -tol and ev.max() <= 1 + tol
    assert torch.linalg.matrix_norm(a - proj @ a) <= tol * torch.linalg.matrix_norm(a).clamp_min(1e-300)


def test_cholesky_qr_well_conditioned_is_orthonormal_with_same_range():
    torch.manual_seed(5)
    a = torch.randn(200, 12)
    q = cholesky_qr(a)
    assert q.dtype == torch.float32
    torch.testing.assert_close(q.T @ q, torch.eye(12), atol=1e-6, rtol=0)
    qh = torch.linalg.qr(a.double()).Q
    torch.testing.assert_close(q.double() @ q.double().T, qh @ qh.T, atol=1e-6, rtol=0)


def test_cholesky_qr_rank_deficient_and_ill_conditioned():
    torch.manual_seed(6)
    b = torch.randn(100, 4, dtype=torch.float64)
    cases = {
        "zero": torch.zeros(50, 8),
        "zero_column": torch.cat([torch.randn(50, 7), torch.zeros(50, 1)], 1),
        "duplicate_columns": torch.cat([b, b, b[:, :2]], 1),            # rank 4 of 10
        "rank_one": torch.randn(64, 1) @ torch.randn(1, 16),
        "bf16_rank_def": torch.cat([b, b], 1).bfloat16(),
    }
    u, _ = torch.linalg.qr(torch.randn(80, 10, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(10, 10, dtype=torch.float64))
    for k in (1e8, 1e12, 1e20):
        s = torch.logspace(0, -math.log10(k), 10, dtype=torch.float64)
        cases[f"cond{k:.0e}"] = (u * s) @ v.T
    cases["tiny_scale"] = torch.randn(30, 5, dtype=torch.float64) * 1e-200
    cases["huge_scale"] = torch.randn(30, 5, dtype=torch.float64) * 1e200
    for name, a in cases.items():
        q = cholesky_qr(a)
        assert torch.isfinite(q).all(), name
        _check_basis(a, q, 1e-5)
    assert cholesky_qr(torch.zeros(50, 8)).abs().max() == 0          # null directions -> zero columns
    q = cholesky_qr(cases["cond1e+08"].float())                      # float32 input with kappa 1e8
    assert torch.isfinite(q).all()


@settings(max_examples=40, deadline=None)
@given(m=st.integers(4, 60), n=st.integers(1, 8), log_cond=st.floats(0, 30), log_scale=st.floats(-30, 30),
       seed=st.integers(0, 2**31 - 1), passes=st.sampled_from([2, 3]))
def test_cholesky_qr_property_no_nan(m, n, log_cond, log_scale, seed, passes):
    n = min(n, m)
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(m, n, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    s = torch.logspace(0, -log_cond, n, dtype=torch.float64) * 10.0 ** log_scale
    a = (u * s) @ v.T
    q = cholesky_qr(a, passes=passes)
    assert torch.isfinite(q).all()
    _check_basis(a, q, 1e-6)


def test_cholesky_qr_failure_fallbacks(monkeypatch):
    a = torch.randn(30, 4)
    real = torch.linalg.cholesky_ex

    def failing(x, *args, **kw):
        r, info = real(x, *args, **kw)
        return r, torch.ones_like(info)

    monkeypatch.setattr(torch.linalg, "cholesky_ex", failing)
    assert cholesky_qr(a).abs().max() == 0                            # hot path: zero basis
    with pytest.warns(UserWarning, match="falling back"):
        q = cholesky_qr(a, check=True)
    torch.testing.assert_close(q.T @ q, torch.eye(4), atol=1e-6, rtol=0)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="non-finite"):
        cholesky_qr(torch.full((5, 2), float("nan")), check=True)
    with pytest.raises(ValueError, match="tall"):
        cholesky_qr(torch.randn(2, 5))


# ------------------------------------------------------------------------------------------------------
# randomized SVD and realignment
def test_randomized_svd_matches_exact_on_decaying_spectrum():
    torch.manual_seed(7)
    u, _ = torch.linalg.qr(torch.randn(120, 60))
    v, _ = torch.linalg.qr(torch.randn(90, 60))
    s = 0.8 ** torch.arange(60.0)
    w = (u * s) @ v.T
    g = torch.Generator().manual_seed(0)
    ur, sr, vhr = randomized_svd(w, 6, oversample=8, niter=2, generator=g)
    torch.testing.assert_close(sr, s[:6], rtol=1e-4, atol=0)
    # same subspace: principal angles ~ 0
    assert torch.linalg.svdvals(ur.T @ u[:, :6]).min() > 1 - 1e-4
    assert torch.linalg.svdvals(vhr @ v[:, :6]).min() > 1 - 1e-4


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2.0 ** -8)])
def test_realign_preserves_function_and_finds_new_subspace(dtype, tol):
    torch.manual_seed(8)
    lin = nn.Linear(64, 48, dtype=dtype)
    m = LoRASVDLinear.from_linear(lin, 4)
    with torch.no_grad():                         # a new dominant direction grows in the residual
        m.weight.add_(5.0 * torch.randn(48, 1, dtype=dtype) @ torch.randn(1, 64, dtype=dtype) / 8)
    x = torch.randn(10, 64, dtype=dtype)
    w_before = m.merged_weight()
    y_before = F.linear(x.float(), w_before, m.bias.float())
    info = m.realign_()
    w_after = m.merged_weight()
    assert float(info["rel_change"]) <= tol
    assert (w_after - w_before).abs().max() <= tol * w_before.abs().max()
    torch.testing.assert_close(m(x).float(), y_before, rtol=4 * tol, atol=4 * tol * y_before.abs().max().item())
    u, s, vh = torch.linalg.svd(w_before)
    l2 = m.lora_b.weight.float()
    assert torch.linalg.svdvals(torch.linalg.qr(l2).Q.T @ u[:, :4]).min() > 0.99   # new factors span top-4


def _factor_grads(m, x, dy):
    m.zero_grad()
    (m(x) * dy).sum().backward()
    return m.lora_a.weight.grad.clone(), m.lora_b.weight.grad.clone()


def test_state_remap_project_is_exact_when_subspace_unchanged():
    """Imbalanced factors (L2 * 3, L1 / 3) re-balanced by realign: moments follow the change of variables."""
    torch.manual_seed(9)
    lin = nn.Linear(32, 24).double()
    model = nn.Sequential(lin)
    h = prepare(model, rank=3, realign_every=None, constrain=None)
    m = model[0]
    with torch.no_grad():
        m.lora_b.weight.mul_(3.0)
        m.lora_a.weight.div_(3.0)
    x, dy = torch.randn(16, 32, dtype=torch.float64), torch.randn(16, 24, dtype=torch.float64)
    ga, gb = _factor_grads(m, x, dy)
    opt = torch.optim.Adam(model.parameters())
    opt.state[m.lora_a.weight] = {"step": torch.tensor(5.0), "exp_avg": ga.clone(), "exp_avg_sq": ga.square()}
    opt.state[m.lora_b.weight] = {"step": torch.tensor(5.0), "exp_avg": gb.clone(), "exp_avg_sq": gb.square()}
    h.realign(opt)
    ga2, gb2 = _factor_grads(m, x, dy)
    assert (ga2 - ga).abs().max() > 1e-2                      # the coordinates really changed
    torch.testing.assert_close(opt.state[m.lora_a.weight]["exp_avg"], ga2, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(opt.state[m.lora_b.weight]["exp_avg"], gb2, rtol=1e-5, atol=1e-6)
    assert (opt.state[m.lora_a.weight]["exp_avg_sq"] >= 0).all()
    assert float(opt.state[m.lora_a.weight]["step"]) == 5.0


def test_hold_scale_remaps_moments_with_beta_when_subspace_unchanged():
    """realign_scale="hold": factors shrunk by 2 (W_res compensating) -> beta * ||L|| halved; the realignment
    restores balance at beta / 4 (a power of two), keeps the function, and the remapped moments equal the
    gradients in the new coordinates, which carry the new beta."""
    torch.manual_seed(9)
    model = nn.Sequential(nn.Linear(32, 24).double())
    h = prepare(model, rank=3, realign_every=None, constrain=None, realign_scale="hold")
    m = model[0]
    with torch.no_grad():
        w = m.merged_weight()
        m.lora_b.weight.mul_(0.5)
        m.lora_a.weight.mul_(0.5)
        m.weight.copy_(w - m.beta * m.lora_b.weight @ m.lora_a.weight)
    x, dy = torch.randn(16, 32, dtype=torch.float64), torch.randn(16, 24, dtype=torch.float64)
    y = m(x)
    ga, gb = _factor_grads(m, x, dy)
    opt = torch.optim.Adam(model.parameters())
    opt.state[m.lora_a.weight] = {"step": torch.tensor(5.0), "exp_avg": ga.clone(), "exp_avg_sq": ga.square()}
    opt.state[m.lora_b.weight] = {"step": torch.tensor(5.0), "exp_avg": gb.clone(), "exp_avg_sq": gb.square()}
    h.realign(opt)
    assert m.beta == 0.25 and float(m._beta) == 0.25
    torch.testing.assert_close(m(x), y, rtol=1e-12, atol=1e-12)
    ga2, gb2 = _factor_grads(m, x, dy)
    torch.testing.assert_close(opt.state[m.lora_a.weight]["exp_avg"], ga2, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(opt.state[m.lora_b.weight]["exp_avg"], gb2, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(opt.state[m.lora_a.weight]["exp_avg_sq"], ga2.square(), rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("scale", ["keep", "hold", None])
def test_realign_scale_holds_the_branch_step_size(scale):
    """A dominant direction grows in W: with "keep" beta * ||(L1, L2)||_F (the size of an Adam step of the
    branch in W) grows with the new singular values; "hold" (also the default, None here) keeps it within the
    power-of-two rounding (a factor sqrt(2)), at a beta that is a power of two; the function is preserved either
    way."""
    torch.manual_seed(8)
    model = nn.Sequential(nn.Linear(64, 48))
    h = prepare(model, rank=4, realign_every=None, **({} if scale is None else {"realign_scale": scale}))
    m = model[0]
    with torch.no_grad():
        m.weight.add_(20.0 * torch.randn(48, 1) @ torch.randn(1, 64) / 8)

    def q():  # beta * ||(L1, L2)||_F
        a, b = m.lora_a.weight.detach(), m.lora_b.weight.detach()
        return m.beta * float(torch.cat([a.flatten(), b.flatten()]).norm())

    q0, w0 = q(), m.merged_weight()
    out = h.realign()
    assert out["0"] < 1e-6 and (m.merged_weight() - w0).abs().max() <= 1e-6 * w0.abs().max()
    if scale == "keep":
        assert m.beta == 1.0 and q() > 2 * q0
    else:
        assert math.log2(m.beta) == round(math.log2(m.beta)) and m.beta < 1.0
        assert 2 ** -0.5 <= q() / q0 <= 2 ** 0.5
        assert h.state_dict()["betas"] == {"0": m.beta}


def test_hold_scale_from_a_reference_weight():
    """handle.hold_scale_from({path: R}): beta becomes the power of two that gives the current split the
    branch step size beta * ||(L1, L2)||_F a beta-1 split of R has (within the power-of-two rounding, sqrt 2),
    with the function preserved; a layer without a reference keeps beta 1."""
    torch.manual_seed(11)
    ref = 0.02 * torch.randn(48, 64)
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 32))
    with torch.no_grad():
        model[0].weight.copy_(ref + 3.0 * torch.randn(48, 1) @ torch.randn(1, 64) / 8)
    h = prepare(model, rank=4, realign_every=None)
    m = model[0]
    w0 = m.merged_weight()

    def size(layer):  # beta * ||(L1, L2)||_F
        a, b = layer.lora_a.weight.detach(), layer.lora_b.weight.detach()
        return layer.beta * float(torch.cat([a.flatten(), b.flatten()]).norm())

    target = math.sqrt(2 * float(torch.linalg.svdvals(ref)[:4].sum()))      # beta 1: ||L||^2 = 2 sum S
    before = size(m)
    out = h.hold_scale_from({"0": ref})
    assert set(out) == {"0"} and out["0"] == m.beta and m.beta < 1 and math.log2(m.beta) == round(math.log2(m.beta))
    assert before > 2 * target and 2 ** -0.5 <= size(m) / target <= 2 ** 0.5
    assert (m.merged_weight() - w0).abs().max() <= 1e-6 * w0.abs().max()
    a, b = m.lora_a.weight.detach(), m.lora_b.weight.detach()
    assert float(a.norm()) == pytest.approx(float(b.norm()), rel=1e-4)       # still balanced
    assert model[1].beta == 1.0


@pytest.mark.parametrize("constrain", ["cholesky_qr", None])
def test_init_state_from_dense_matches_the_factor_gradients(constrain):
    """handle.init_state_from_dense (a fork that adds LoRA-SVD to a run trained without it): after one AdamW step
    at lr 0 on the dense weight, exp_avg = (1 - b1) G and exp_avg_sq = (1 - b2) G^2. The factors' derived
    exp_avg must equal (1 - b1) times the gradient autograd (with the constrained backward's hooks, when on) gives
    L1 and L2 for the same upstream gradient; W_res keeps the weight's entries; step counts are copied. With G
    a single entry the squared-coefficient map of exp_avg_sq is exact: (1 - b2) (autograd's g_L)^2 unprojected."""
    torch.manual_seed(5)
    b1, b2, beta = 0.9, 0.95, 0.5
    for single in (False, True):
        model = nn.Sequential(nn.Linear(24, 16, bias=False, dtype=torch.float64))
        x, gy = torch.randn(8, 24, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64)
        if single:                                   # G = 1.5 e_3 e_7^T
            x, gy = torch.zeros(1, 24, dtype=torch.float64), torch.zeros(1, 16, dtype=torch.float64)
            x[0, 7], gy[0, 3] = 1.0, 1.5
        dense = torch.optim.AdamW(model.parameters(), lr=0.0, betas=(b1, b2))
        model(x).backward(gy)
        dense.step()
        w = model[0].weight
        h = prepare(model, rank=4, beta=beta, realign_every=None, constrain=constrain)
        m = model[0]
        assert m.weight is w                          # the same Parameter: its dense state is W_res's
        opt = torch.optim.AdamW(model.parameters(), lr=0.0, betas=(b1, b2))
        assert h.init_state_from_dense(opt, dense.state) == 1
        model.zero_grad()
        m(x).backward(gy)                             # autograd's factor gradients (through the hooks if on)
        for p in (m.lora_a.weight, m.lora_b.weight):
            st = opt.state[p]
            assert float(st["step"]) == 1.0 and st["step"] is not opt.state[w]["step"]
            torch.testing.assert_close(st["exp_avg"], (1 - b1) * p.grad, rtol=1e-10, atol=1e-14)
            if single and constrain is None:
                torch.testing.assert_close(st["exp_avg_sq"], (1 - b2) * p.grad ** 2, rtol=1e-10, atol=1e-16)
            assert (st["exp_avg_sq"] >= 0).all()
        assert torch.equal(opt.state[w]["exp_avg"], dense.state[w]["exp_avg"])
    bad = {w: {"step": torch.tensor(1.0), "packed": torch.zeros(3, dtype=torch.uint8)}}
    with pytest.raises(ValueError, match="cannot derive factor state"):
        h.init_state_from_dense(opt, bad)


def test_beta_buffer_follows_the_setter_dtype_casts_and_handle_state(tmp_path):
    """forward reads beta from a float32 buffer: the setter updates it, .to(bfloat16) keeps it float32, a
    compiled model sees a new beta without recompiling, and the handle's state_dict restores it."""
    torch.manual_seed(3)
    model = MLP()
    h = prepare(model, rank=4, realign_every=None)
    x = torch.randn(5, 32)
    from torch._dynamo.testing import CompileCounter

    cnt = CompileCounter()
    compiled = torch.compile(model, backend=cnt)
    y1 = compiled(x)
    model.fc1.beta = 0.5                               # W changes: W_res + 0.5 L2 L1
    with torch.no_grad():
        want = F.linear(x, model.fc1.merged_weight(), model.fc1.bias)
    torch.testing.assert_close(model.fc1(x), want, rtol=1e-5, atol=1e-5)
    y2 = compiled(x)
    assert cnt.frame_count == 1 and not torch.allclose(y1, y2)
    torch.testing.assert_close(y2, model(x))
    state = h.state_dict()
    assert state["betas"]["fc1"] == 0.5
    model2 = MLP()
    h2 = prepare(model2, rank=4, realign_every=None)
    model2.load_state_dict(model.state_dict())
    h2.load_state_dict(state)
    torch.testing.assert_close(model2(x), model(x))
    h2.load_state_dict({"steps": 0, "realignments": 0})    # a state from before betas were saved: kept
    assert model2.fc1.beta == 0.5
    with pytest.raises(ValueError, match="does not convert"):
        h2.load_state_dict({"steps": 0, "realignments": 0, "betas": {"nope": 1.0}})
    with pytest.raises(ValueError, match="beta"):
        model2.fc1.beta = -1.0
    model2.to(torch.bfloat16)
    assert model2.fc1._beta.dtype == torch.float32 and float(model2.fc1._beta) == 0.5


def test_state_remap_reset_and_unknown_entries():
    torch.manual_seed(10)
    model = nn.Sequential(nn.Linear(32, 32))
    h = prepare(model, rank=2, realign_every=None, state_remap="reset")
    m = model[0]
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    opt.state[m.lora_a.weight]["packed"] = torch.ones(7, dtype=torch.uint8)    # e.g. a quantized moment
    res_state = opt.state[m.weight]["exp_avg"].clone()
    with pytest.warns(UserWarning, match="packed"):
        h.realign(opt)
    st_a = opt.state[m.lora_a.weight]
    assert float(st_a["step"]) == 0 and st_a["exp_avg"].abs().max() == 0 and st_a["exp_avg_sq"].abs().max() == 0
    torch.testing.assert_close(opt.state[m.weight]["exp_avg"], res_state)       # W_res state kept


def test_attach_realigns_on_schedule_and_uses_optimizer_protocol():
    torch.manual_seed(11)
    model = MLP()
    h = prepare(model, rank=2, realign_every=3)

    class Opt(torch.optim.SGD):
        calls = []

        def remap_param_state(self, p, linear, quadratic):
            self.calls.append(p)

    opt = Opt(model.parameters(), lr=1e-2, momentum=0.9)
    h.attach(opt)
    for _ in range(7):
        opt.zero_grad()
        model(torch.randn(4, 32)).square().mean().backward()
        opt.step()
    assert h.steps == 7 and h.realignments == 2
    assert len(Opt.calls) == 2 * 4                          # 2 realignments x 2 layers x 2 factors
    h.merge()
    opt.step()                                               # hooks detached: no further counting
    assert h.steps == 7


def test_realign_after_skips_the_early_realignments():
    model = MLP()
    h = prepare(model, rank=2, realign_every=3, realign_after=5)
    steps = [s for s in range(1, 13) if h.step()]
    assert steps == [6, 9, 12] and h.realignments == 3
    with pytest.raises(ValueError, match="realign_after"):
        prepare(MLP(), rank=2, realign_after=-1)


def test_loss_curve_has_no_spike_at_realignment():
    """Tiny classification task, full batch, AdamW; realign every 25 steps. No jump and no slow-down of the
    (here strictly monotone) loss at the realignments."""
    torch.manual_seed(12)
    d, vocab = 32, 48
    teacher = MLP(d, 64, vocab)
    x = torch.randn(256, d)
    target = teacher(x).argmax(-1)
    model = MLP(d, 64, vocab)
    with torch.no_grad():                                     # grow a dominant direction, like trained weights
        model.fc1.weight.add_(torch.randn(64, 1) @ torch.randn(1, d) * 0.5)
    h = prepare(model, rank=4, realign_every=25)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    h.attach(opt)
    losses, changes = [], []
    for step in range(100):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if h.steps % 25 == 0:
            changes.append(max(h.last_realign.values()))
    assert h.realignments == 4 and max(changes) < 1e-5
    diffs = [losses[i + 1] - losses[i] for i in range(len(losses) - 1)]
    # full-batch AdamW: the loss decreases at every step, realignments included ...
    assert max(diffs) < 0, [(i, d_) for i, d_ in enumerate(diffs) if d_ >= 0]
    # ... and a realignment does not even slow the decrease down: losses[t] is the last loss before the
    # realignment after optimizer step t + 1, diffs[t] the change across it, diffs[t + 1] the change made by
    # the first update with the remapped optimizer state
    for t in (24, 49, 74):
        assert max(diffs[t], diffs[t + 1]) <= 0.5 * diffs[t - 1], (t, diffs[t - 2:t + 3])
    assert losses[-1] < 0.7 * losses[0]


def test_bf16_model_forward_backward():
    torch.manual_seed(13)
    m = MLP(dtype=torch.bfloat16)
    prepare(m, rank=4)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    m(x).float().square().mean().backward()
    for n, p in m.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.bfloat16 and torch.isfinite(p.grad).all(), n


# ------------------------------------------------------------------------------------------------------
# through the fullstack_fp4 backend (CPU debug variant: same passes and partitioner, graphs run eagerly)
def test_fullstack_backend_residual_nvfp4_lowrank_bf16():
    from fp4compile.policy import BF16, NVFP4, Policy

    torch._dynamo.reset()      # no automatic-dynamic shapes carried over from other tests' compiles
    torch.manual_seed(14)
    policy = Policy((), "rtn+lora").override("*", NVFP4("rtn")).override("*lm_head*", BF16) \
        .override(LORA_BF16_GLOB, BF16)
    model = MLP(d=32, h=64)
    prepare(model, rank=4)
    x = torch.randn(2, 16, 32, requires_grad=True)      # so that fc1 has a dgrad too

    report = fp4compile.explain(model, x, policy=policy)
    prec = {}
    for s in report.sites:
        prec.setdefault((s.path, s.role), set()).add(s.precision)
    for path in ("fc1", "fc2"):
        for role in ("linear.fprop", "linear.dgrad", "linear.wgrad"):
            assert prec.get((path, role)) == {"nvfp4"}, (path, role, prec)
    lora_paths = {p for p, _ in prec if p.endswith((".lora_a", ".lora_b"))}
    assert lora_paths == {"fc1.lora_a", "fc1.lora_b", "fc2.lora_a", "fc2.lora_b"}, prec
    assert all(prec[k] == {"bf16"} for k in prec if k[0] in lora_paths)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fullstack_fp4", options={"policy": policy, "debug": True},
                             fullgraph=True)
    loss = compiled(x).square().mean()
    loss.backward()
    assert torch.isfinite(loss)
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
    # the constrained backward still applies to the NVFP4 wgrad of the residual
    m = model.fc1
    u, v = cholesky_qr(m.lora_b.weight.detach()), cholesky_qr(m.lora_a.weight.detach().T)
    assert (u.T @ m.weight.grad @ v).abs().max() < 1e-5 * m.weight.grad.abs().max()
    # and the compiled (NVFP4) loss differs from the exact one: the residual really is quantized
    assert (loss - model(x).square().mean()).abs() > 0
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_zero_initialised_layer_gets_factors_at_realignment():
    """A zero weight gives zero factors (they cannot move); the residual trains, and realignment then
    captures its top-r subspace even though the warm start (the null factors' row space) is empty."""
    torch.manual_seed(15)
    lin = nn.Linear(48, 40)
    with torch.no_grad():
        lin.weight.zero_()
    m = LoRASVDLinear.from_linear(lin, 4)
    assert m.lora_a.weight.abs().max() == 0 and m.lora_b.weight.abs().max() == 0
    x = torch.randn(8, 48)
    m(x).square().sum().backward()                       # no NaN from the zero bases
    assert torch.isfinite(m.weight.grad).all() and m.lora_a.weight.grad.abs().max() == 0
    u, _ = torch.linalg.qr(torch.randn(40, 6))
    v, _ = torch.linalg.qr(torch.randn(48, 6))
    with torch.no_grad():
        m.weight.copy_((u * torch.tensor([9.0, 7, 5, 3, 0.1, 0.05])) @ v.T)
    m.realign_(oversample=2, niter=1, generator=torch.Generator().manual_seed(0))
    q = torch.linalg.qr(m.lora_b.weight.detach()).Q
    assert torch.linalg.svdvals(q.T @ u[:, :4]).min() > 0.99


def test_two_attached_optimizers_count_one_clock():
    torch.manual_seed(16)
    model = MLP()
    h = prepare(model, rank=2, realign_every=2)
    mats = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    o1, o2 = torch.optim.SGD(mats, lr=1e-2, momentum=0.9), torch.optim.AdamW(rest, lr=1e-3)
    h.attach(o1).attach(o2)
    for _ in range(4):
        model(torch.randn(4, 32)).square().mean().backward()
        o1.step()
        o2.step()
        o1.zero_grad()
        o2.zero_grad()
    assert h.steps == 4 and h.realignments == 2
    assert h.state_dict() == {"steps": 4, "realignments": 2, "betas": {"fc1": 1.0, "fc2": 1.0}}


def test_optimizer_built_before_prepare_warns():
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    h = prepare(model, rank=2).attach(opt)
    model(torch.randn(4, 32)).sum().backward()
    with pytest.warns(UserWarning, match="do not hold"):
        opt.step()


# ------------------------------------------------------------------------------------------------------
# frozen factors
def _dense_twin(model):
    """A plain MLP with the LoRA-SVD model's merged weights (the reference a frozen-factor run must follow)."""
    twin = MLP(dtype=torch.float64)
    with torch.no_grad():
        for name in ("fc1", "fc2", "lm_head"):
            m, t = getattr(model, name), getattr(twin, name)
            t.weight.copy_(m.merged_weight() if isinstance(m, LoRASVDLinear) else m.weight)
            if t.bias is not None:
                t.bias.copy_(m.bias)
    return twin


def _make_opt(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=5e-2, momentum=0.9)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    from fp4compile.optim import QRoot
    mats = [p for p in params if p.dim() == 2]
    return QRoot([{"params": mats, "use_root": True}, {"params": [p for p in params if p.dim() != 2],
                  "use_root": False}], lr=1e-2, precision="bf16", adamw="adamw", fused=False, compile=False)


def _deviation_from_dense(kind, train_factors, steps=9):
    """Train a float64 LoRA-SVD MLP (rank 4, realigned every 3 steps) and its dense twin on the same batches;
    return max over steps and layers of |W - W_dense| / |W_dense - W_0| (the deviation relative to how far
    training moved the weight)."""
    torch.manual_seed(21)
    model = MLP(dtype=torch.float64)
    with torch.no_grad():                                      # a spectrum with structure, as after training
        for lin in (model.fc1, model.fc2):
            lin.weight.mul_(3.0)
    h = prepare(model, rank=4, realign_every=3, train_factors=train_factors)
    twin = _dense_twin(model)
    w0 = {n: getattr(twin, n).weight.detach().clone() for n in ("fc1", "fc2")}
    opt = _make_opt(kind, [p for p in model.parameters() if p.requires_grad])
    opt_t = _make_opt(kind, list(twin.parameters()))
    h.attach(opt)
    worst = 0.0
    for _ in range(steps):
        x = torch.randn(16, 32, dtype=torch.float64)
        y = torch.randint(0, 48, (16,))
        for m, o in ((model, opt), (twin, opt_t)):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
        for n in ("fc1", "fc2"):
            wd, w = getattr(twin, n).weight.detach(), getattr(model, n).merged_weight()
            worst = max(worst, float((w - wd).norm() / (wd - w0[n]).norm()))
    assert h.realignments == 3
    return worst, h


@pytest.mark.parametrize("kind", ["sgd", "adamw", "qroot"])
def test_frozen_factors_step_like_the_dense_weight(kind):
    """train_factors=False: every optimizer (momentum SGD, AdamW, ROOT with a BF16 Newton-Schulz) moves
    W = W_res + beta L2 L1 exactly as it moves the dense weight, realignments included (they touch no optimizer
    state); with trained factors (the default) the same run leaves the dense trajectory (the control)."""
    frozen, h = _deviation_from_dense(kind, train_factors=False)
    trained, _ = _deviation_from_dense(kind, train_factors=True)
    # float64 throughout, but beta is a float32 buffer that the weight decay scales every step (~1e-7 relative);
    # ROOT's NS rounds to BF16, so a last-bit difference in G can flip a few BF16 roundings
    assert frozen < {"sgd": 1e-9, "adamw": 1e-5, "qroot": 1e-2}[kind], frozen
    assert trained > 0.05, trained
    assert trained > 20 * frozen


def test_frozen_factors_contract():
    torch.manual_seed(22)
    model = MLP()
    h = prepare(model, rank=4, realign_every=2, train_factors=False)
    assert not h.train_factors and "factors frozen" in repr(h)
    for m in h.modules.values():
        assert m.constrain is None and m.weight.requires_grad
        assert not m.lora_a.weight.requires_grad and not m.lora_b.weight.requires_grad
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    h.attach(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                       # no "do not hold" warning: the factors are not trained
        model(torch.randn(4, 32)).square().mean().backward()
        assert all(p.grad is None for p in h.factor_parameters())
        opt.step()
    # AdamW's decoupled decay (lr 1e-2, its default wd 1e-2) shrank the frozen branches with W_res
    decayed = float(torch.tensor(1 - 1e-2 * 1e-2, dtype=torch.float32))
    assert {p: m.beta for p, m in h.modules.items()} == {"fc1": decayed, "fc2": decayed}
    model.double().float()                                   # a dtype round trip keeps the decayed buffer
    assert {p: m.beta for p, m in h.modules.items()} == {"fc1": decayed, "fc2": decayed}
    state_before = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in opt.state}
    x = torch.randn(4, 32)
    before = model(x)
    h.realign()                      # re-split at prepare's beta; realign_scale "hold" has nothing to act on
    assert torch.allclose(model(x), before, atol=1e-5)
    assert {p: m.beta for p, m in h.modules.items()} == {"fc1": 1.0, "fc2": 1.0}
    assert h.state_dict()["betas"] == {"fc1": 1.0, "fc2": 1.0}
    for p in opt.state:
        for k, v in opt.state[p].items():
            assert torch.equal(v, state_before[id(p)][k])
    # a frozen branch with the constrained backward could not follow W's principal subspace: refused
    with pytest.raises(ValueError, match="frozen factors"):
        prepare(MLP(), rank=2, train_factors=False, constrain="cholesky_qr")
    with pytest.raises(TypeError, match="train_factors"):
        prepare(MLP(), rank=2, train_factors="no")
    assert prepare(MLP(), rank=2, constrain="auto").modules["fc1"].constrain == "cholesky_qr"


def test_fullstack_backend_with_frozen_factors_has_no_branch_wgrad():
    """Compiled by the backend, a frozen branch keeps its BF16 fprop/dgrad sites and has no wgrad GEMMs; the
    residual's three sites stay NVFP4 and its gradient is plain autograd's (no projection)."""
    from fp4compile.policy import BF16, NVFP4, Policy

    torch._dynamo.reset()
    torch.manual_seed(23)
    policy = Policy((), "rtn+lora").override("*", NVFP4("rtn")).override("*lm_head*", BF16) \
        .override(LORA_BF16_GLOB, BF16)
    model = MLP(d=32, h=64)
    prepare(model, rank=4, train_factors=False)
    x = torch.randn(2, 16, 32, requires_grad=True)
    report = fp4compile.explain(model, x, policy=policy)
    roles = {}
    for s in report.sites:
        roles.setdefault(s.path, set()).add((s.role, s.precision))
    for path in ("fc1", "fc2"):
        assert roles[path] == {(r, "nvfp4") for r in ("linear.fprop", "linear.dgrad", "linear.wgrad")}, roles
        for f in ("lora_a", "lora_b"):
            assert roles[f"{path}.{f}"] == {("linear.fprop", "bf16"), ("linear.dgrad", "bf16")}, roles
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fullstack_fp4", options={"policy": policy, "debug": True},
                             fullgraph=True)
    compiled(x).square().mean().backward()
    m = model.fc1
    assert m.lora_a.weight.grad is None and m.lora_b.weight.grad is None
    assert m.weight.grad is not None and torch.isfinite(m.weight.grad).all()
    u, v = cholesky_qr(m.lora_b.weight.detach()), cholesky_qr(m.lora_a.weight.detach().T)
    assert (u.T @ m.weight.grad @ v).abs().max() > 1e-3 * m.weight.grad.abs().max()   # not projected out
