"""QRoot: coefficient schedules, NS accuracy, equality with an independent BF16 Root, NVFP4 NS, state dict."""
import copy
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fp4compile
from fp4compile.optim import QRoot, newton_schulz, ns_coefficients
from fp4compile.optim.root import (JORDAN, abs_quantile, clip_by_quantile, ROOT_TABLE, _bgemm_nvfp4, _loop_gemm_nvfp4, _ns_nvfp4_one, _ns_nvfp4_stack,
                                    _q, _q_stack)
from fp4compile.optim.study import momentum_like, ns_error
from fp4compile.policy import BF16, NVFP4, Policy

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_public_name_and_policy_resolution():
    assert fp4compile.QRoot is QRoot
    p = [torch.nn.Parameter(torch.randn(32, 32))]
    assert QRoot(p).ns_spec.name == "nvfp4"                      # full_stack default: optim.ns NVFP4
    assert QRoot(p, policy=Policy.bf16()).ns_spec is BF16
    assert QRoot(p, policy="full_stack", precision="bf16").ns_spec is BF16
    assert QRoot(p, policy=Policy.full_stack().override("optim", BF16, role="optim.ns")).ns_spec is BF16


def test_add_param_group_validates_and_leaves_the_groups_on_failure():
    """A bad group added after construction raises ``ValueError`` and is not left in ``param_groups``."""
    opt = QRoot([torch.nn.Parameter(torch.randn(32, 16))], lr=1e-3)
    extra = torch.nn.Parameter(torch.randn(16, 16))
    vector = torch.nn.Parameter(torch.randn(16))
    for bad in ({"momentum": 1.0}, {"clip_quantile": 0.0}, {"ns_schedule": "magic"},
                {"use_root": True, "params": [vector]}):
        with pytest.raises(ValueError):
            opt.add_param_group({"params": [extra], **bad})
        assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [extra]})
    assert len(opt.param_groups) == 2


def test_coefficient_schedules():
    assert ns_coefficients((2048, 8192), 5, "root") == (ROOT_TABLE[(2048, 8192)],) * 5
    assert ns_coefficients((8192, 2048), 5, "root_table") == (ROOT_TABLE[(2048, 8192)],) * 5
    assert ns_coefficients((64, 256), 5, "root_table") == (JORDAN,) * 5
    pe = ns_coefficients((64, 64), 3, "polar_express")
    assert pe[0][0] == pytest.approx(8.28721201814563 / 1.01) and pe[-1][0] == pytest.approx(3.9486908534822946)
    with pytest.raises(ValueError):
        ns_coefficients((4, 4), 5, "magic")


def _ns_f64(G, coeffs):
    X = G.double()
    tall = X.shape[0] > X.shape[1]
    X = X.T if tall else X
    X = X / (X.norm() + 1e-7)
    for a, b, c in coeffs:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


@pytest.mark.parametrize("shape", [(32, 96), (96, 32), (48, 48)])
def test_bf16_ns_matches_float64_iteration(shape):
    G = torch.randn(*shape)
    O = newton_schulz(G, (JORDAN,) * 5).double()
    ref = _ns_f64(G, (JORDAN,) * 5)
    assert float((O - ref).norm() / ref.norm()) < 0.06  # BF16 rounding through 15 products
    assert O.shape == G.shape


def test_polar_express_converges_closer_than_jordan():
    G = momentum_like(64, 128, seed=1)
    e_j = ns_error(G, newton_schulz(G, ns_coefficients(G.shape, 5, "jordan")))
    e_p = ns_error(G, newton_schulz(G, ns_coefficients(G.shape, 8, "polar_express"), norm_scale=1.01))
    assert e_p < e_j


def test_nvfp4_ns_stable_and_close_with_guard():
    G = momentum_like(64, 128, seed=2)
    eps = float(G.abs().flatten().quantile(0.99))
    Gc = G.clamp(-eps, eps)
    O = newton_schulz(Gc, (JORDAN,) * 5, spec=NVFP4())
    assert torch.isfinite(O.float()).all()
    e = ns_error(Gc, O)
    e_bf16 = ns_error(Gc, newton_schulz(Gc, (JORDAN,) * 5))
    assert e < e_bf16 + 0.35, (e, e_bf16)


def test_nvfp4_ns_falls_back_for_odd_shapes():
    with pytest.warns(UserWarning, match="BF16"):
        O = newton_schulz(torch.randn(20, 40), (JORDAN,) * 2, spec=NVFP4())
    assert O.shape == (20, 40)


def _stack(S, m, n, seed=0):
    G = torch.stack([momentum_like(m, n, seed=seed + i) for i in range(S)])
    return (G / G.norm(dim=(-2, -1), keepdim=True)).bfloat16()


_SPECS = [NVFP4(), NVFP4("sr"), NVFP4(four_over_six=True, hadamard=16), NVFP4(block=(16, 16))]


@pytest.mark.parametrize("shape", [(32, 64), (64, 32)])
@pytest.mark.parametrize("spec", _SPECS, ids=str)
def test_stack_quantize_equals_per_matrix_when_globals_match(spec, shape):
    """Quantizing the [S*r, K] view changes nothing but the global scale: with equal per-matrix amax (so equal
    globals; here the matrices are row permutations of one another, which keeps the amax with or without the
    Hadamard rotation along K) the stacked codes and scales are bit-identical to quantizing each matrix alone
    (no block or Hadamard group straddles two matrices)."""
    base = _stack(1, *shape)[0]
    gen = torch.Generator().manual_seed(3)
    X = torch.stack([base[torch.randperm(shape[0], generator=gen)] for _ in range(3)])
    signs = torch.ones(16) if spec.hadamard else None
    seed = torch.tensor(7) if spec.rounding != "rtn" else None
    qc, qs, qg = _q_stack(X, spec, signs, seed)
    for i in range(3):
        c, s, g = _q(X[i], spec, signs, seed=seed)
        assert torch.equal(g, qg)
        if seed is None:   # SR: the hash is keyed by position, so only RTN bytes match per matrix
            assert torch.equal(c, qc[i]) and torch.equal(s, qs[i])


@pytest.mark.parametrize("spec", _SPECS, ids=str)
def test_batched_nvfp4_ns_equals_per_matrix_gemm_loop(spec):
    """The batched product (dequantize_blocks + one FP32 bmm + globals) equals one fp4compile::gemm per
    matrix on the same per-stack-quantized operands; on CPU both are the FP32 matmul of the same values, so
    single products and the whole 5-step NS are bit-exact."""
    X = _stack(3, 32, 64)
    qx = _q_stack(X, NVFP4(), None)
    qt = _q_stack(X.mT.contiguous(), NVFP4(), None)
    for qa, qb in ((qx, qx), (qt, qt)):
        assert torch.equal(_bgemm_nvfp4(qa, qb, torch.float32), _loop_gemm_nvfp4(qa, qb, torch.float32))
    signs = torch.ones(16) if spec.hadamard else None
    seed = torch.tensor(5) if spec.rounding != "rtn" else None
    o1 = _ns_nvfp4_stack(X, (JORDAN,) * 5, spec, signs, seed)
    o2 = _ns_nvfp4_stack(X, (JORDAN,) * 5, spec, signs, seed, product=_loop_gemm_nvfp4)
    assert torch.isfinite(o1.float()).all() and torch.equal(o1, o2)


def test_batched_nvfp4_ns_error_matches_per_matrix_globals():
    """Per-stack global scales (batched path) vs per-matrix ones (the reference loop, ``_ns_nvfp4_one``): the
    same mean error vs an FP64 NS, on clipped momentum-like matrices whose scales span 10^3 before the
    Frobenius normalization (the stack's amax spread after it is what a per-stack global has to cover)."""
    Gs = torch.stack([momentum_like(32, 64, seed=10 + i, decay=0.3 * i) * 10.0 ** (i / 2 - 1.5) for i in range(6)])
    eps = abs_quantile(Gs.reshape(6, -1), 0.99).view(-1, 1, 1) + 1e-9
    Gs = torch.maximum(torch.minimum(Gs, eps), -eps)
    X = (Gs / (Gs.norm(dim=(-2, -1), keepdim=True) + 1e-7)).bfloat16()
    coeffs = (JORDAN,) * 5
    ref = torch.stack([_ns_f64(X[i].float(), coeffs) for i in range(6)])

    def err(O):
        return float(((O.double() - ref).norm(dim=(-2, -1)) / ref.norm(dim=(-2, -1))).mean())

    e_stack = err(newton_schulz(Gs, coeffs, spec=NVFP4()))
    e_one = err(torch.stack([_ns_nvfp4_one(X[i].contiguous(), coeffs, NVFP4(), None, None) for i in range(6)]))
    e_bf16 = err(newton_schulz(Gs, coeffs))
    assert e_bf16 < 0.1 and abs(e_stack - e_one) < 0.05 * e_one, (e_stack, e_one, e_bf16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", [NVFP4(), NVFP4(four_over_six=True, hadamard=16)], ids=str)
def test_batched_nvfp4_ns_cuda_matches_gemm_loop(spec):
    """CUDA: the batched product (cuBLAS bmm, FP32 accumulation) vs the fp4compile::gemm kernel per matrix on
    the same operands, also as the strided views of Xᵀ's transposed quantize: FP32 outputs agree to
    summation-order tolerance. Whole NS runs (batched vs per-matrix
    gemm on CUDA, CUDA vs CPU) can differ where a summation-order ulp flips a later FP4 rounding: they must
    stay far closer to each other than to the FP64 NS (the NVFP4 error itself)."""
    X = _stack(4, 64, 192).cuda()
    signs = torch.ones(16, device="cuda") if spec.hadamard else None
    qx = _q_stack(X, spec, signs)
    qt = _q_stack(X.mT.contiguous(), spec, signs)
    qs = _q_stack(X, spec, signs, transpose=True)        # the same operand as strided views (what the NS uses)
    assert all(torch.equal(u, v) for u, v in zip(qs, qt)) and not qs[0].is_contiguous()
    for qa, qb in ((qx, qx), (qt, qt), (qs, qs)):
        a, b = _bgemm_nvfp4(qa, qb, torch.float32), _loop_gemm_nvfp4(qa, qb, torch.float32)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5 * float(b.abs().max()))
    coeffs = (JORDAN,) * 5
    o1 = _ns_nvfp4_stack(X, coeffs, spec, signs, None).cpu()
    o2 = _ns_nvfp4_stack(X, coeffs, spec, signs, None, product=_loop_gemm_nvfp4).cpu()
    o3 = _ns_nvfp4_stack(X.cpu(), coeffs, spec, None if signs is None else signs.cpu(), None)
    ref = torch.stack([_ns_f64(x.float(), coeffs) for x in X.cpu()])
    e_fp4 = float((o3.double() - ref).norm() / ref.norm())
    for o in (o2, o3):
        assert torch.isfinite(o1.float()).all()
        assert float((o1.float() - o.float()).norm() / o.float().norm()) < 0.25 * e_fp4


class PlainRoot:
    """An independent BF16 Root (ROOT's official example, written from the paper's equations)."""

    def __init__(self, params, lr, wd, mu=0.95, q=0.99):
        self.params, self.lr, self.wd, self.mu, self.q = list(params), lr, wd, mu, q
        self.bufs = [torch.zeros_like(p) for p in self.params]

    @torch.no_grad()
    def step(self):
        for p, buf in zip(self.params, self.bufs):
            g = p.grad.float()
            buf.mul_(self.mu).add_(g)
            u = g + self.mu * buf
            eps = torch.quantile(u.abs().flatten(), self.q) + 1e-9
            b = torch.clamp(u, -eps, eps)
            X = b.bfloat16()
            tall = X.size(0) > X.size(1)
            if tall:
                X = X.T
            X = X / (X.norm() + 1e-7)
            for _ in range(5):
                A = X @ X.T
                B = JORDAN[1] * A + JORDAN[2] * A @ A
                X = JORDAN[0] * X + B @ X
            if tall:
                X = X.T
            p.mul_(1 - self.lr * self.wd)
            p.add_(X.float(), alpha=-self.lr * 0.2 * math.sqrt(max(p.shape)))


def test_qroot_bf16_equals_plain_root():
    torch.manual_seed(0)
    ps1 = [torch.nn.Parameter(torch.randn(48, 80)) for _ in range(2)] + [torch.nn.Parameter(torch.randn(96, 32))]
    ps2 = [torch.nn.Parameter(p.detach().clone()) for p in ps1]
    init = [p.detach().clone() for p in ps1]
    o1 = PlainRoot(ps1, lr=1e-2, wd=0.1)
    o2 = QRoot(ps2, lr=1e-2, weight_decay=0.1, precision="bf16", ns_schedule="jordan")
    for _ in range(4):
        gs = [torch.randn_like(p) for p in ps1]
        for p, q, g in zip(ps1, ps2, gs):
            p.grad, q.grad = g.clone(), g.clone()
        o1.step()
        o2.step()
    for p, q, p0 in zip(ps1, ps2, init):
        # same algorithm, independently written: BF16 rounding differs (e.g. the Frobenius norm of a BF16
        # tensor, bmm vs mm) and NS amplifies it; the BF16 iteration itself is ~3 % from its float64 version
        # (test above), so the accumulated updates must agree to 3 % (a wrong clip, scale, momentum or
        # coefficient gives >> 10 %)
        d1, d2 = (p - p0).detach(), (q - p0).detach()
        assert float((d1 - d2).norm() / d1.norm()) < 0.03


def test_ns_seed_and_signs_are_drawn_or_cached_on_the_update_device(monkeypatch):
    """An SR + RHT NS spec: every orthogonalize gets a fresh seed and the same cached signs, both on the
    parameters' device (a CPU seed or sign vector would be copied to the GPU, with a stream sync, by every
    quantize call of the NS)."""
    import fp4compile.optim.root as R

    seen = []
    real = R.newton_schulz

    def spy(G, coeffs, **kw):
        seen.append((G.device, kw["signs"], kw["seed"]))
        return real(G, coeffs, **kw)

    monkeypatch.setattr(R, "newton_schulz", spy)
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(32, 64)) for _ in range(2)]
    opt = QRoot(ps, lr=1e-2, precision=NVFP4("sr", hadamard=16))
    for _ in range(2):
        for p in ps:
            p.grad = torch.randn_like(p)
        opt.step()
    assert len(seen) == 2
    (d0, s0, k0), (d1, s1, k1) = seen
    assert s0 is s1 and s0.device == d0 and torch.equal(s0.abs(), torch.ones(16))
    assert k0.device == d0 and k0.dtype == torch.int64 and k0.dim() == 0 and not torch.equal(k0, k1)
    assert all(torch.isfinite(p).all() for p in ps)


def _root_run(ps0, grads, **kw):
    ps = [torch.nn.Parameter(p.detach().clone()) for p in ps0]
    opt = QRoot(ps, lr=1e-2, **kw)
    for gs in grads:
        for p, g in zip(ps, gs):
            p.grad = g.clone()
        opt.step()
    return ps, opt


def test_cuda_graphs_flag_is_validated_and_a_no_op_off_cuda():
    with pytest.raises(TypeError, match="cuda_graphs"):
        QRoot([torch.nn.Parameter(torch.randn(16, 32))], cuda_graphs="yes")
    torch.manual_seed(0)
    ps0 = [torch.randn(32, 64) for _ in range(2)] + [torch.randn(48, 32)]
    grads = [[torch.randn_like(p) for p in ps0] for _ in range(2)]
    a, _ = _root_run(ps0, grads, precision="nvfp4")
    b, opt = _root_run(ps0, grads, precision="nvfp4", cuda_graphs=True)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and opt._graphs == {}


@pytest.mark.gpu
@pytest.mark.parametrize("spec", [NVFP4("rtn"), NVFP4("sr", hadamard=16)], ids=["rtn", "sr-rht16"])
def test_gpu_cuda_graph_orthogonalize_matches_eager(spec):
    """``cuda_graphs=True`` replays captured NS graphs: with RTN the parameters after 3 steps equal the eager
    optimizer's exactly (same kernels, same inputs); with SR the graph draws a fresh seed on every replay
    (two replays of the same input differ) and stays as close to the BF16 NS as the eager SR run."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    ps0 = [torch.randn(256, 512, device=dev) * 0.02 for _ in range(3)] + [torch.randn(512, 256, device=dev) * 0.02]
    grads = [[torch.randn_like(p) for p in ps0] for _ in range(3)]
    eager, _ = _root_run(ps0, grads, precision=spec)
    graphed, opt = _root_run(ps0, grads, precision=spec, cuda_graphs=True)
    assert len(opt._graphs) == 2                                          # one per shape stack
    if spec.rounding == "rtn":
        assert all(torch.equal(x, y) for x, y in zip(eager, graphed))
    else:
        ref, _ = _root_run(ps0, grads, precision="bf16")
        err = lambda ps: sum(float((p - r).norm() / (r - p0).norm()) for p, r, p0 in zip(ps, ref, ps0))  # noqa: E731
        assert err(graphed) < 1.5 * err(eager) + 1e-3
        U = torch.randn(3, 256, 512, device=dev)
        g = opt.param_groups[0]
        o1 = opt.orthogonalize_graphed(U, g).clone()
        o2 = opt.orthogonalize_graphed(U, g).clone()
        assert not torch.equal(o1, o2)


def test_param_groups_for_and_adamw_part():
    m = torch.nn.ModuleDict(dict(wte=torch.nn.Embedding(64, 32), fc=torch.nn.Linear(32, 64),
                                 lm_head=torch.nn.Linear(32, 64, bias=False)))
    groups = QRoot.param_groups_for(m)
    root = {id(p) for p in groups[0]["params"]}
    assert root == {id(m["fc"].weight)}
    opt = QRoot(groups, lr=1e-3, precision="bf16")
    for p in m.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    assert set(opt.state[m["fc"].weight]) == {"step", "momentum_buffer"}
    assert "exp_avg" in opt.state[m["fc"].bias]
    assert "exp_avg" in opt.state[m["wte"].weight]  # 64 x 32 = 2048 < min_numel: FP32 AdamW state


def test_qroot_state_roundtrip_and_corrupt():
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(32, 64)), torch.nn.Parameter(torch.randn(64))]
    opt = QRoot(ps, lr=1e-2, precision="bf16")
    for _ in range(2):
        for p in ps:
            p.grad = torch.randn_like(p)
        opt.step()
    sd = copy.deepcopy(opt.state_dict())
    bad = copy.deepcopy(sd)
    bad["state"][0]["momentum_buffer"] = bad["state"][0]["momentum_buffer"][:3]
    snap = opt.state[ps[0]]["momentum_buffer"].clone()
    with pytest.raises(ValueError, match="momentum_buffer"):
        opt.load_state_dict(bad)
    assert torch.equal(opt.state[ps[0]]["momentum_buffer"], snap)
    ps2 = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt2 = QRoot(ps2, lr=1e-2, precision="bf16")
    opt2.load_state_dict(sd)
    g = [torch.randn_like(p) for p in ps]
    for a, b, gg in zip(ps, ps2, g):
        a.grad, b.grad = gg.clone(), gg.clone()
    opt.step()
    opt2.step()
    for a, b in zip(ps, ps2):
        assert torch.equal(a, b)


def test_ns_stack_with_exact_operands_is_the_bf16_iteration_and_the_guard_moves_it():
    """``_ns_nvfp4_stack(quant=identity, product=exact)`` (bench/ns_quality.py's "guard only" row) runs the BF16
    iteration: without the guard it lands on plain BF16 NS (to BF16 rounding); with guard=1.0 on a square
    matrix it lands measurably elsewhere (the guard rescales iterates that ROOT's coefficients push past 1)."""
    G = clip_by_quantile(momentum_like(128, 128, 0), 0.99)
    coeffs = ns_coefficients((128, 128), 5, "root")
    ref = newton_schulz(G, coeffs).float()
    X = (G / (G.norm() + 1e-7)).to(torch.bfloat16).unsqueeze(0).contiguous()

    def run(guard):
        return _ns_nvfp4_stack(X, coeffs, NVFP4("rtn"), None, None, guard, quant=lambda t, *_: t,
                               product=lambda a, b: torch.bmm(a.float(), b.float().mT).to(torch.bfloat16))[0].float()

    assert float((run(None) - ref).norm() / ref.norm()) < 0.03
    assert float((run(1.0) - ref).norm() / ref.norm()) > 0.1


def _exact_stack_ns(X, coeffs, shift):
    """The NVFP4 NS path with identity quantization and FP32 products (no guard): plain NS arithmetic."""
    return _ns_nvfp4_stack(X, coeffs, NVFP4("rtn"), None, None, None, quant=lambda t, *_: t, shift=shift,
                           product=lambda a, b: torch.bmm(a.float(), b.float().mT).to(torch.bfloat16))


def test_shifted_ns_is_the_same_iteration():
    """The identity-shifted form (ns_shift) is exact algebra: with exact operands it lands where the unshifted
    iteration does, to BF16 rounding, and both land on the float64 NS."""
    G = clip_by_quantile(momentum_like(64, 128, 3), 0.99)
    coeffs = ns_coefficients((64, 128), 5, "root")
    X = (G / (G.norm() + 1e-7)).to(torch.bfloat16).unsqueeze(0).contiguous()
    ref = _ns_f64(G, coeffs)
    for shift in (False, True):
        O = _exact_stack_ns(X, coeffs, shift)[0].double()
        assert float((O - ref).norm() / ref.norm()) < 0.02, shift


@pytest.mark.parametrize("spec", [NVFP4(), NVFP4("sr", four_over_six=True, hadamard=16)], ids=str)
def test_shifted_nvfp4_ns_stack_equals_loop_and_per_matrix(spec):
    """Shifted NVFP4 NS: the batched product equals one fp4compile::gemm per matrix (CPU: bit-exact), and a
    stack of one matrix equals the per-matrix reference _ns_nvfp4_one (same global scales, same seeds)."""
    X = _stack(3, 32, 64)
    signs = torch.ones(16) if spec.hadamard else None
    seed = torch.tensor(5) if spec.rounding != "rtn" else None
    o1 = _ns_nvfp4_stack(X, (JORDAN,) * 5, spec, signs, seed, shift=True)
    o2 = _ns_nvfp4_stack(X, (JORDAN,) * 5, spec, signs, seed, product=_loop_gemm_nvfp4, shift=True)
    assert torch.isfinite(o1.float()).all() and torch.equal(o1, o2)
    if seed is None:
        one = _ns_nvfp4_one(X[0].contiguous(), (JORDAN,) * 5, spec, signs, None, shift=True)
        assert torch.equal(_ns_nvfp4_stack(X[:1].contiguous(), (JORDAN,) * 5, spec, signs, None, shift=True)[0], one)
    assert not torch.equal(o1, _ns_nvfp4_stack(X, (JORDAN,) * 5, spec, signs, seed, shift=False))


def test_shifted_nvfp4_ns_is_closer_to_bf16_ns():
    """What ns_shift is for: on clipped momentum-like matrices, NVFP4 NS with the shifted products lands
    closer to the BF16 NS the optimizer-matched BF16 run applies (ROOT's coefficients, guard 1.0) than the
    unshifted form, on every matrix, and by >= 20 % on average (measured at the 30M shapes: 0.271 -> 0.176)."""
    devs = {False: [], True: []}
    for seed, (m, n) in enumerate([(64, 64), (64, 192), (128, 64), (96, 96)]):
        G = clip_by_quantile(momentum_like(m, n, seed), 0.99)
        coeffs = ns_coefficients((m, n), 5, "root")
        ref = newton_schulz(G, coeffs).float()
        for shift in (False, True):
            O = newton_schulz(G, coeffs, spec=NVFP4("rtn"), shift=shift).float()
            devs[shift].append(float((O - ref).norm() / ref.norm()))
    assert all(s < u for s, u in zip(devs[True], devs[False])), devs
    assert sum(devs[True]) < 0.8 * sum(devs[False]), devs


def test_qroot_ns_shift_group_key_and_old_state_dicts():
    """ns_shift is a validated group key (default True); a state dict saved before the key existed resumes
    with the unshifted NS it was trained with; the CUDA-graph cache key includes it."""
    ps = [torch.nn.Parameter(torch.randn(32, 64))]
    opt = QRoot(ps, lr=1e-2)
    assert opt.param_groups[0]["ns_shift"] is True
    with pytest.raises(ValueError, match="ns_shift"):
        QRoot([torch.nn.Parameter(torch.randn(32, 64))], ns_shift="yes")
    ps[0].grad = torch.randn_like(ps[0])
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    del sd["param_groups"][0]["ns_shift"]
    opt2 = QRoot([torch.nn.Parameter(ps[0].detach().clone())], lr=1e-2)
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["ns_shift"] is False


# ----------------------------------------------------------------------------------------------
# the symmetric B (ns_sym_b) and the two-term X (ns_residual)
def test_two_term_quantization_recovers_the_residual():
    """_q_two_term: q1 + q2 reproduces x an order of magnitude closer than q1 alone, with both operand kinds
    (codes and scales; bf16 q·S) giving the same values, on a stack of momentum-like matrices (outliers
    included)."""
    from fp4compile.optim.root import _dequantized, _q_stack_dq, _q_two_term, _seed_stream

    x = torch.stack([momentum_like(32, 64, s) for s in range(3)]).to(torch.bfloat16)
    spec = NVFP4("rtn")
    vals = []
    for qfn in (_q_stack, _q_stack_dq):
        q1, q2 = _q_two_term(x, qfn, spec, None, _seed_stream(None))
        vals.append((_dequantized(q1), _dequantized(q2)))
    assert torch.equal(vals[0][0], vals[1][0]) and torch.equal(vals[0][1], vals[1][1])
    one, two = vals[0][0], vals[0][0] + vals[0][1]
    e1 = float((x.float() - one).norm() / x.float().norm())
    e2 = float((x.float() - two).norm() / x.float().norm())
    assert 0.03 < e1 < 0.2 and e2 < 0.1 * e1, (e1, e2)


def test_symmetric_b_is_quantized_symmetrically():
    """What ns_sym_b relies on: in 16x16 blocks a symmetric matrix's quantized copy is exactly symmetric (a
    tile and its mirror share one amax and one scale), in 1x16 blocks it is not."""
    from fp4compile.optim.root import _dequantized

    g = torch.randn(2, 64, 64)
    B = (g + g.mT).to(torch.bfloat16)
    two_d = _dequantized(_q_stack(B, NVFP4("rtn", block=(16, 16)), None))
    one_d = _dequantized(_q_stack(B, NVFP4("rtn"), None))
    assert torch.equal(two_d, two_d.mT)
    assert not torch.equal(one_d, one_d.mT)


def test_sym_b_and_residual_bring_nvfp4_ns_below_bf16_ns():
    """docs/OPTIM.md's table on one shape (64x256, clipped, 7 Polar Express steps, guard, shift): each option
    lowers the NVFP4 NS's direction error (measured 0.044 -> 0.038 with the symmetric B, 0.016 with the
    two-term Xᵀ as well), and with both of X's quantizations in two terms the NVFP4 NS lands closer to the
    float64 polar factor than the BF16 NS of the same schedule (0.012 against 0.032)."""
    from fp4compile.optim.study import ns_error_parts

    G = clip_by_quantile(momentum_like(64, 256, 0), 0.99)
    coeffs = ns_coefficients(G.shape, 7, "polar_express")
    spec = NVFP4("rtn")

    def parts(**kw):
        return ns_error_parts(G, newton_schulz(G, coeffs, norm_scale=1.01, shift=True, **kw).float())
    base, sym = parts(spec=spec), parts(spec=spec, sym_b=True)
    xt, both = parts(spec=spec, sym_b=True, residual=("xt",)), parts(spec=spec, sym_b=True, residual=("x", "xt"))
    x2d, bf16 = parts(spec=spec, sym_b=True, residual=("x2d",)), parts()
    assert base["direction"] > sym["direction"] > 1.5 * xt["direction"], (base, sym, xt)
    for p in (both, x2d):                                # x2d measured 0.014
        assert p["polar"] < 0.5 * base["polar"] and p["polar"] < bf16["polar"], (p, base, bf16)
    for bad in (("b",), ("x2d", "x")):
        with pytest.raises(ValueError, match="residual"):
            parts(spec=spec, residual=bad)
    with pytest.raises(ValueError, match="default product"):
        _ns_nvfp4_stack(G[None].bfloat16(), coeffs, spec, None, None, product=_loop_gemm_nvfp4, residual=("x",))


@pytest.mark.parametrize("residual,shared_x,expect", [((), False, 4), (("x", "xt"), False, 6), (("x2d",), False, 4),
                                                      ((), True, 3)])
def test_ns_residual_quantizations_per_step(monkeypatch, residual, shared_x, expect):
    """Quantize launches per NVFP4 NS step: 4 by default (X, E, B, Xᵀ), 6 with X and Xᵀ in two terms, 4 with
    the one two-term 16x16-block X serving both products (the x2d form's point), and 3 with the shared one-term X
    (no transposed quantization at all). Each quantized operand is dequantized once (one ``dequantize_blocks`` per
    quantize): a term enters the residual and up to two products from that one dequantized copy."""
    calls, deq = [], []
    real, real_deq = torch.ops.fp4compile.quantize, torch.ops.fp4compile.dequantize_blocks
    monkeypatch.setattr(torch.ops.fp4compile, "quantize", lambda *a, **k: calls.append(k.get("transpose")) or
                        real(*a, **k))
    monkeypatch.setattr(torch.ops.fp4compile, "dequantize_blocks", lambda *a: deq.append(1) or real_deq(*a))
    G = clip_by_quantile(momentum_like(32, 64, 0), 0.99)
    newton_schulz(G, (JORDAN,) * 3, spec=NVFP4("rtn"), shift=True, residual=residual, shared_x=shared_x)
    assert len(calls) == 3 * expect
    assert len(deq) == 3 * expect
    assert (True in calls) == (not residual and not shared_x)   # only the default quantizes Xᵀ by transposing


def test_qroot_sym_b_and_residual_group_keys():
    """ns_sym_b / ns_residual / ns_shared_x are validated group keys, reach the NS (the update changes), survive
    a safetensors round trip (ns_residual as a tuple), and old state dicts without them resume with all off. The
    default (None) resolves per group: sym_b and shared_x on for an NVFP4 NS spec without an RHT (shared_x off
    with a residual), off for an RHT spec or a BF16 NS, stored as bools."""
    from fp4compile.optim import load_safetensors_state, save_safetensors_state

    torch.manual_seed(0)
    w = torch.randn(32, 64)
    g = torch.randn(32, 64)

    def one_step(**kw):
        p = torch.nn.Parameter(w.clone())
        opt = QRoot([p], lr=1e-2, adamw="adamw", **kw)
        p.grad = g.clone()
        opt.step()
        return p.detach(), opt
    base, opt = one_step()
    assert opt.param_groups[0]["ns_sym_b"] is True and opt.param_groups[0]["ns_shared_x"] is True
    assert opt.param_groups[0]["ns_residual"] == ()
    off, _ = one_step(ns_sym_b=False, ns_shared_x=False)
    assert not torch.equal(base, off)
    for kw in (dict(precision=NVFP4(hadamard=16)), dict(precision="bf16")):
        g0 = QRoot([torch.nn.Parameter(w.clone())], **kw).param_groups[0]
        assert g0["ns_sym_b"] is False and g0["ns_shared_x"] is False, kw
    both, opt = one_step(ns_sym_b=True, ns_residual=["xt", "x"])
    assert opt.param_groups[0]["ns_residual"] == ("x", "xt") and opt.param_groups[0]["ns_shared_x"] is False
    assert not torch.equal(base, both) and not torch.equal(off, both)
    for bad in (dict(ns_sym_b=1), dict(ns_residual="x"), dict(ns_residual=("b",)), dict(ns_residual=("x2d", "xt")),
                dict(ns_shared_x=1), dict(ns_shared_x=True, ns_residual=("x2d",))):
        with pytest.raises(ValueError, match=next(iter(bad))):
            QRoot([torch.nn.Parameter(w.clone())], **bad)
    for key, value in (("ns_sym_b", True), ("ns_residual", ("x",)), ("ns_shared_x", True)):
        with pytest.raises(ValueError, match=key):
            QRoot([torch.nn.Parameter(w.clone())], precision=NVFP4(hadamard=16), **{key: value})
    with pytest.raises(ValueError, match="residual"):
        newton_schulz(w, (JORDAN,), spec=NVFP4(hadamard=16), residual=("xt",))
    with pytest.raises(ValueError, match="shared_x"):
        newton_schulz(w, (JORDAN,), spec=NVFP4(), residual=("x",), shared_x=True)
    shared, opt_s = one_step(ns_sym_b=False, ns_shared_x=True)
    assert opt_s.param_groups[0]["ns_shared_x"] is True and not torch.equal(off, shared)
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        save_safetensors_state(opt.state_dict(), d + "/o.safetensors")
        sd = load_safetensors_state(d + "/o.safetensors")
    opt2 = QRoot([torch.nn.Parameter(w.clone())], lr=1e-2, adamw="adamw")
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["ns_residual"] == ("x", "xt") and opt2.param_groups[0]["ns_sym_b"] is True
    with tempfile.TemporaryDirectory() as d:
        save_safetensors_state(opt_s.state_dict(), d + "/s.safetensors")
        opt2.load_state_dict(load_safetensors_state(d + "/s.safetensors"))
    assert opt2.param_groups[0]["ns_shared_x"] is True
    old = copy.deepcopy(opt.state_dict())
    del old["param_groups"][0]["ns_sym_b"], old["param_groups"][0]["ns_residual"], old["param_groups"][0]["ns_shared_x"]
    opt3 = QRoot([torch.nn.Parameter(w.clone())], lr=1e-2, adamw="adamw")
    opt3.load_state_dict(old)
    assert opt3.param_groups[0]["ns_sym_b"] is False and opt3.param_groups[0]["ns_residual"] == ()
    assert opt3.param_groups[0]["ns_shared_x"] is False


# ----------------------------------------------------------------------------------------------
# the shared X (ns_shared_x): X quantized once per step, 16x16 blocks, for both products
def _shared_x_reference(X, coeffs, spec, shift, sym_b, guard=None, rescale_copy=True):
    """Independent per-matrix form of the shared-X NS, from the ops: X's 16x16-block copy by ``fp4compile::quantize``
    for X Xᵀ, and for B·X the op's own transposed quantize of the same X (``transpose=True``: Xᵀ's 16x16 blocks are
    X's, so it must give the same values), each product one ``fp4compile::gemm``; the shifted polynomial written out
    in FP32 from its definition (E = A - alpha I, Bs = (b + 2 c alpha) E + c E²). ``guard``: the power-iteration
    sigma guard in plain torch; the copy was taken before the rescaling, so B·X is multiplied by sqrt(s): without
    the shift its FP32 product, rounded then to bf16; with the shift, as the documented one-pass update
    X <- ((a + beta) sqrt(s)) X + (g sqrt(s)) P (the second factor given to ``fp4compile::gemm`` as the global scales
    1 and g sqrt(s), whose product it forms exactly) of the unscaled X (``rescale_copy=False``: sqrt(s) left out
    of B·X, a wrong form the tests tell apart)."""
    spec2d = NVFP4(spec.rounding, four_over_six=spec.four_over_six, block=(16, 16))
    g = torch.ops.fp4compile.gemm
    m = X.shape[0]
    for a, b, c in coeffs:
        qx = _q(X, spec2d, None)
        qxt = _q(X, spec2d, None, transpose=True)
        A = g(*qx, *qx, out_dtype=torch.bfloat16)
        s = None
        if guard is not None:
            v = torch.full((m, 1), 1.0 / math.sqrt(m))
            for i in range(6):
                v = A.float() @ v
                if i == 2:
                    v = v / (v.norm() + 1e-30)
            lam = (v.T @ (A.float() @ v)) / (v.T @ v + 1e-30)
            s = torch.clamp(guard * guard / torch.clamp(lam, min=1e-30), max=1.0).reshape(())
            A = (A.float() * s).bfloat16()
            if not shift:
                X = (X.float() * s.sqrt()).bfloat16()
        if shift:
            alpha = torch.diagonal(A).float().mean()
            E = A.float() - alpha * torch.eye(m)
            qe = _q(E.bfloat16(), spec, None)
            B = (E * (b + 2 * c * alpha) + c * g(*qe, *qe, out_dtype=torch.bfloat16).float()).bfloat16()
            beta = b * alpha + c * alpha * alpha
        else:
            qa = _q(A, spec, None)
            B, beta = b * A + c * g(*qa, *qa, out_dtype=torch.bfloat16), None
        qb = _q(B, spec2d if sym_b else spec, None)
        r = s.sqrt() if s is not None and rescale_copy else torch.ones(())
        if shift:
            one = torch.ones((), dtype=torch.float32)
            BX = g(qb[0], qb[1], one, qxt[0], qxt[1], (qb[2] * qxt[2]) * r, out_dtype=torch.bfloat16)
            k = (a + beta) * (s.sqrt() if s is not None else 1.0)
            X = (X.float() * k + BX.float()).bfloat16()
        else:
            BX = g(*qb, *qxt, out_dtype=torch.bfloat16 if s is None else torch.float32)
            X = a * X + (BX * r).bfloat16()
    return X


@pytest.mark.parametrize("spec", [NVFP4(), NVFP4(four_over_six=True)], ids=str)
@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("sym_b", [False, True])
def test_shared_x_ns_equals_per_matrix_reference(spec, shift, sym_b):
    """shared_x without the guard, one matrix: the batched NS (X's 16x16-block copy dequantized once and read
    transposed for B·X, the update in one pass from B·X's FP32 product) gives the per-matrix reference's bits, and
    differs from the default NS (which quantizes X and Xᵀ in 1x16 blocks)."""
    X = _stack(1, 32, 96)
    coeffs = (JORDAN,) * 4
    out = _ns_nvfp4_stack(X, coeffs, spec, None, None, guard=None, shift=shift, sym_b=sym_b, shared_x=True)
    ref = _shared_x_reference(X[0], coeffs, spec, shift, sym_b)
    assert torch.isfinite(out.float()).all() and torch.equal(out[0], ref)
    assert not torch.equal(out, _ns_nvfp4_stack(X, coeffs, spec, None, None, guard=None, shift=shift, sym_b=sym_b))


@pytest.mark.parametrize("shift", [False, True])
def test_shared_x_guard_rescales_the_shared_copy(shift):
    """With the guard active (an iterate with sigma_max ~1.6, so s < 1 in the first step), X's copy, taken before
    the rescaling, enters B·X times sqrt(s), and with the shift X's own sqrt(s) goes into the update's factor: the
    stack gives the per-matrix reference's bits, not those of the reference that leaves sqrt(s) out of B·X; a stack
    of 3 with the loop product (one fp4compile::gemm per matrix for X Xᵀ) gives the batched product's bits."""
    X = (_stack(3, 32, 96).float() * 1.6).bfloat16()
    coeffs = (JORDAN,) * 3
    spec = NVFP4()
    kw = dict(guard=1.0, shift=shift, shared_x=True)
    out = _ns_nvfp4_stack(X, coeffs, spec, None, None, **kw)
    assert torch.equal(out, _ns_nvfp4_stack(X, coeffs, spec, None, None, product=_loop_gemm_nvfp4, **kw))
    one = _ns_nvfp4_stack(X[:1].contiguous(), coeffs, spec, None, None, **kw)[0].float()
    ref = _shared_x_reference(X[0], coeffs, spec, shift, False, guard=1.0).float()
    wrong = _shared_x_reference(X[0], coeffs, spec, shift, False, guard=1.0, rescale_copy=False).float()
    assert torch.isfinite(one).all() and torch.equal(one, ref)
    assert float((one - wrong).norm()) > 0.05 * float(one.norm())


# ----------------------------------------------------------------------------------------------
# the amax passes folded into ns_glue's passes (root.FUSE_AMAX)
def _count_amax(monkeypatch):
    """Wrap the quantize ops: -> list of (amax given?) per call."""
    calls = []
    for name in ("quantize", "quantize_dq"):
        real = getattr(torch.ops.fp4compile, name)
        monkeypatch.setattr(torch.ops.fp4compile, name,
                            lambda *a, real=real, **k: calls.append(k.get("amax") is not None) or real(*a, **k))
    return calls


@pytest.mark.parametrize("kw,given", [
    (dict(spec=NVFP4()), 8), (dict(spec=NVFP4("sr", four_over_six=True), seed=torch.tensor(3)), 8),
    (dict(spec=NVFP4(), sym_b=True, shared_x=True), 8), (dict(spec=NVFP4(four_over_six=True), shared_x=True), 8),
    (dict(spec=NVFP4(), residual=("x2d",)), 6), (dict(spec=NVFP4(), shift=False), 0),
    (dict(spec=NVFP4(hadamard=16), signs=torch.ones(16)), 0), (dict(spec=NVFP4("ms_eden"), seed=torch.tensor(4)), 0)],
    ids=["rtn", "sr-46", "sym-shared", "46-shared", "x2d", "unshifted", "rht", "ms_eden"])
@pytest.mark.parametrize("dq", [False, True], ids=["codes", "dq"])
def test_fused_amax_keeps_the_ns_bits(monkeypatch, kw, given, dq):
    """FUSE_AMAX: the NS's quantize calls take the amax that the pass making their operand recorded (3 steps: E and
    Bs of each step and X of steps 1 and 2 under the shift; the first X, two-term X's, the unshifted form (whose
    update is torch's), RHT and MS-EDEN specs measure their own), and the NS keeps its bits; the op's CPU reference checks every given
    amax against max|x| (it raises otherwise), through codes and through quantize_dq's operands alike."""
    import fp4compile.optim.root as R

    G = torch.stack([clip_by_quantile(momentum_like(32, 96, s), 0.99) for s in range(2)])
    kw = dict(dict(shift=True), **kw)
    monkeypatch.setattr(R, "NS_DQ", dq)
    ref = newton_schulz(G, (JORDAN,) * 3, **kw)
    monkeypatch.setattr(R, "FUSE_AMAX", True)
    calls = _count_amax(monkeypatch)
    out = newton_schulz(G, (JORDAN,) * 3, **kw)
    assert torch.isfinite(out.float()).all() and torch.equal(out, ref)
    assert sum(calls) == given, calls


def test_fused_amax_under_the_interpreter(tmp_path):
    """FUSE_AMAX with ns_glue's Triton kernels (TRITON_INTERPRET=1, a fresh process): the slots the kernels fill by
    atomic max pass the quantize op's check (max|x| exactly, else it raises) in the default NS and with the shared X,
    and the NS is the one without the fused amax bit for bit (the same kernels either way)."""
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {REPO!r})
        import fp4compile.optim.root as R
        from fp4compile.kernels import ns_glue
        from fp4compile.optim import newton_schulz
        from fp4compile.optim.study import momentum_like
        from fp4compile.policy import NVFP4
        assert ns_glue._use_kernel(torch.ones(1))
        G = torch.stack([R.clip_by_quantile(momentum_like(32, 64, s), 0.99) for s in range(2)])
        for kw in (dict(), dict(sym_b=True, shared_x=True)):
            R.FUSE_AMAX = False
            ref = newton_schulz(G, (R.JORDAN,) * 3, spec=NVFP4(), shift=True, **kw)
            R.FUSE_AMAX = True
            out = newton_schulz(G, (R.JORDAN,) * 3, spec=NVFP4(), shift=True, **kw)
            assert torch.isfinite(out.float()).all() and torch.equal(out, ref), kw
        print("ok")
    """))
    r = subprocess.run([sys.executable, str(script)], env=dict(os.environ, TRITON_INTERPRET="1"),
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


@pytest.mark.parametrize("shape", [(64, 256), (128, 512), (640, 1792)])
def test_shared_x_error_is_the_defaults(shape):
    """docs/OPTIM.md's rows: QRoot's default NS with the symmetric B and the shared X (3 quantizations per step
    instead of 4) turns the singular vectors about as far as the default (direction error, mean of 3 seeds,
    measured 0.035 / 0.084 / 0.068 against 0.038 / 0.096 / 0.082 here; on the tall shapes it is worse, 0.055 /
    0.064 against 0.043 / 0.049, in bench/ns_error.py's table), and stays on the polar factor's side of the BF16
    NS's unconverged singular values (polar error within 10 % of the default's; measured +4.4 %, +0.4 %, −0.5 %)."""
    from fp4compile.optim.study import ns_error_parts

    coeffs = ns_coefficients(shape, 5, "root")
    d, p = {}, {}
    for name, kw in (("default", {}), ("shared", dict(sym_b=True, shared_x=True))):
        parts = [ns_error_parts(G, newton_schulz(G, coeffs, spec=NVFP4(), shift=True, **kw).float())
                 for G in (clip_by_quantile(momentum_like(*shape, s), 0.99) for s in range(3))]
        d[name] = sum(q["direction"] for q in parts) / 3
        p[name] = sum(q["polar"] for q in parts) / 3
    assert d["shared"] < d["default"] and p["shared"] < 1.1 * p["default"], (d, p)


# ----------------------------------------------------------------------------------------------
# abs_quantile: the sort and the top-k selection
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=80, deadline=None)
@given(rows=st.integers(1, 4), n=st.integers(1, 300), q=st.floats(0.0, 1.0), seed=st.integers(0, 2 ** 16),
       ties=st.booleans(), special=st.sampled_from([None, "nan", "inf", "zeros"]))
def test_abs_quantile_topk_equals_sort_and_numpy(rows, n, q, seed, ties, special):
    """``abs_quantile``'s top-k selection returns the sorted form's values bit for bit (ties, zeros, +-inf and NaN
    included), and both match numpy's float64 linear-interpolation quantile of the same FP32 |x| (an independent
    oracle) to FP32 rounding."""
    import numpy as np

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g)
    if ties:
        x = (x * 4).round() / 4                          # many equal magnitudes, some zeros
    if special == "nan":
        x[0, seed % n] = float("nan")
    elif special == "inf":
        x[-1, seed % n] = -float("inf")
    elif special == "zeros":
        x[:, : n // 2] = 0.0
    a = abs_quantile(x, q, "sort")
    b = abs_quantile(x, q, "topk")
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    with np.errstate(invalid="ignore"):                  # inf - inf inside numpy's lerp: a NaN we filter out
        ref = np.quantile(x.abs().double().numpy(), q, axis=-1, method="linear")
    finite = np.isfinite(ref)
    # three FP32 roundings (two products, one sum) of non-negative terms: within 1e-6 relative (and an FP32
    # underflow of s[hi] * w for a q of ~1e-300 below 1e-30 absolute)
    np.testing.assert_allclose(a.double().numpy()[finite], ref[finite], rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("impl", ["sort", "topk"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_clip_makes_a_nonfinite_matrix_nan(bad, impl, monkeypatch):
    """ROOT's clip of a stack with a NaN or an Inf in one matrix: that matrix comes back all NaN (a clamp alone turns
    an Inf into the finite bound: a diverging momentum would go on as a finite update every step); every other
    matrix is what the clamp to +-(its p99 of |U| + 1e-9) gives, bit for bit (the NaN-making term adds exactly 0)."""
    import fp4compile.optim.root as R

    monkeypatch.setattr(R, "QUANTILE_IMPL", impl)
    U = torch.stack([momentum_like(32, 64, seed=s) for s in range(3)])
    U[1, 4, 7] = bad
    out = clip_by_quantile(U, 0.99)
    assert out[1].isnan().all()
    for i in (0, 2):
        eps = float(abs_quantile(U[i].reshape(1, -1), 0.99, impl)) + 1e-9
        assert torch.equal(out[i], U[i].clamp(-eps, eps))
    assert torch.equal(clip_by_quantile(U[0], 0.99), out[0])       # a single matrix too


@pytest.mark.parametrize("precision", ["bf16", "nvfp4"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_qroot_nonfinite_gradient_makes_its_parameter_nan(bad, precision):
    """One NaN or Inf in a matrix's gradient: after the step that whole parameter is NaN, as BF16 Muon without the
    clip would make it (before session 53 an Inf was clipped into a finite update, silently), and stays so; a
    parameter of another shape is untouched. Under NVFP4 NS the matrices of the same shape share the stack's global
    scale, so they turn NaN too (documented in ``QRoot``)."""
    torch.manual_seed(0)
    a, b, c = (torch.nn.Parameter(torch.randn(*shape)) for shape in ((128, 128), (128, 128), (64, 128)))
    opt = QRoot([a, b, c], lr=1e-3, precision=precision)
    for step in range(2):
        for p in (a, b, c):
            p.grad = torch.randn_like(p)
        if step == 0:
            a.grad[3, 5] = bad
        opt.step()
        assert a.isnan().all() and torch.isfinite(c).all()
        assert torch.isfinite(b).all() == (precision == "bf16")


@settings(max_examples=40, deadline=None)
@given(S=st.integers(1, 3), r16=st.integers(1, 2), k16=st.integers(1, 8), log2=st.integers(-12, 12),
       outliers=st.booleans(), fos=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_two_term_quantization_squares_the_error(S, r16, k16, log2, outliers, fos, seed):
    """Property of ``_q_two_term`` over stack shapes, magnitudes (2^±12), outliers and 4/6: one NVFP4 quantization
    of any stack leaves at most ~20 % of its Frobenius norm (a block's elements sit within one grid step, at most
    S = amax/6, of the codes), and the second term, a quantization of that residual, leaves at most ~20 % of the
    residual: together under ~4 % of x."""
    from fp4compile.optim.root import _dequantized, _q_two_term, _seed_stream

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, 16 * r16, 16 * k16, generator=g) * 2.0 ** log2
    if outliers:
        x.view(-1)[torch.randint(0, x.numel(), (max(1, x.numel() // 64),), generator=g)] *= 100.0
    x = x.to(torch.bfloat16)
    q1, q2 = _q_two_term(x, _q_stack, NVFP4("rtn", four_over_six=fos), None, _seed_stream(None))
    e1 = x.double() - _dequantized(q1).double()
    e2 = e1 - _dequantized(q2).double()
    assert float(e1.norm()) <= 0.2 * float(x.double().norm())
    assert float(e2.norm()) <= 0.2 * float(e1.norm())


def test_abs_quantile_rejects_an_unknown_impl(monkeypatch):
    import fp4compile.optim.root as R

    with pytest.raises(ValueError, match="QUANTILE_IMPL"):
        abs_quantile(torch.ones(1, 4), 0.5, "heap")
    x = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    for impl in R.QUANTILE_IMPLS:
        monkeypatch.setattr(R, "QUANTILE_IMPL", impl)    # the module switch is what the default follows
        assert torch.equal(abs_quantile(x, 0.9), abs_quantile(x, 0.9, impl))
        monkeypatch.setattr(R, "QUANTILE_IMPL", "heap")
        with pytest.raises(ValueError, match="QUANTILE_IMPL"):
            abs_quantile(x, 0.9)


# ----------------------------------------------------------------------------------------------
# the symmetric Gram product (root.SYMMETRIC_MIN_ROWS)
def _exact_stack(S, m, K, seed):
    """bf16 values k/8, |k| <= 8: every product and every partial sum over K <= 96 is exact in FP32, so any
    summation order gives the same result."""
    return (torch.randint(-8, 9, (S, m, K), generator=torch.Generator().manual_seed(seed)) / 8).bfloat16()


@pytest.mark.parametrize("f32", [True, False])
def test_symmetric_gram_equals_the_full_product_with_a_quarter_fewer_flops(monkeypatch, f32):
    import fp4compile.optim.root as R
    from torch.utils.flop_counter import FlopCounterMode

    a = _exact_stack(3, 64, 96, 0)
    monkeypatch.setattr(R, "SYMMETRIC_MIN_ROWS", None)
    with FlopCounterMode(display=False) as fc_full:
        full = R._gram(a, f32)
    monkeypatch.setattr(R, "SYMMETRIC_MIN_ROWS", 64)
    with FlopCounterMode(display=False) as fc_sym:
        sym = R._gram(a, f32)
    assert sym.dtype == full.dtype == (torch.float32 if f32 else torch.bfloat16)
    assert torch.equal(sym, full) and torch.equal(sym, sym.mT)
    assert fc_full.get_total_flops() == 2 * 3 * 64 * 64 * 96
    assert fc_sym.get_total_flops() == fc_full.get_total_flops() * 3 // 4
    # below the threshold, and for an odd row count, the full product
    monkeypatch.setattr(R, "SYMMETRIC_MIN_ROWS", 128)
    with FlopCounterMode(display=False) as fc:
        R._gram(a, f32)
    assert fc.get_total_flops() == fc_full.get_total_flops()
    monkeypatch.setattr(R, "SYMMETRIC_MIN_ROWS", 16)
    odd = _exact_stack(2, 33, 96, 1)
    with FlopCounterMode(display=False) as fc:
        out = R._gram(odd, f32)
    assert fc.get_total_flops() == 2 * 2 * 33 * 33 * 96 and torch.equal(out, odd.float() @ odd.float().mT
                                                                        if f32 else odd @ odd.mT)


@pytest.mark.parametrize("spec", [None, NVFP4()])
def test_newton_schulz_with_symmetric_products(monkeypatch, spec):
    """The BF16 and the NVFP4 NS with the symmetric products (X·Xᵀ, A·A or E²) against the full ones on a clipped
    momentum-like stack: the same iteration up to FP32 summation order (equal on this CPU), and the symmetric
    path really taken (fewer flops)."""
    import fp4compile.optim.root as R
    from torch.utils.flop_counter import FlopCounterMode

    G = torch.stack([clip_by_quantile(momentum_like(64, 256, s), 0.99) for s in range(2)])
    coeffs = ns_coefficients((64, 256), 5, "root")
    monkeypatch.setattr(R, "SYMMETRIC_MIN_ROWS", None)
    with FlopCounterMode(display=False) as fc_full:
        full = newton_schulz(G, coeffs, spec=spec, shift=True).float()
    monkeypatch.setattr(R, "SYMMETRIC_MIN_ROWS", 32)
    with FlopCounterMode(display=False) as fc_sym:
        sym = newton_schulz(G, coeffs, spec=spec, shift=True).float()
    assert torch.isfinite(sym).all()
    assert float((sym - full).norm() / full.norm()) < 1e-2
    assert fc_sym.get_total_flops() < fc_full.get_total_flops()


# ----------------------------------------------------------------------------------------------
# NS operands from fp4compile::quantize_dq (root.NS_DQ)
@pytest.mark.parametrize("spec,shape", [(NVFP4(), (64, 256)), (NVFP4("rtn", four_over_six=True), (64, 256)),
                                        (NVFP4("sr", hadamard=16), (64, 256)),
                                        (NVFP4("ms_eden", hadamard=128), (128, 256))])
@pytest.mark.parametrize("shift", [False, True])
def test_ns_with_quantize_dq_operands_is_the_same_iteration(monkeypatch, spec, shape, shift):
    """NS_DQ takes each operand's bf16 q·S from the quantize call (``fp4compile::quantize_dq``) instead of a
    ``dequantize_blocks`` of its codes: the same NS bit for bit, and no dequantize_blocks call left."""
    import fp4compile.optim.root as R
    from fp4compile.formats.hadamard import random_signs

    G = torch.stack([clip_by_quantile(momentum_like(*shape, s), 0.99) for s in range(3)])
    coeffs = ns_coefficients(shape, 5, "root")
    signs = random_signs(spec.hadamard, torch.Generator().manual_seed(0)) if spec.hadamard else None
    seed = torch.tensor(7) if spec.rounding != "rtn" else None
    monkeypatch.setattr(R, "NS_DQ", False)
    ref = newton_schulz(G, coeffs, spec=spec, signs=signs, seed=seed, shift=shift)
    calls = []
    real = torch.ops.fp4compile.dequantize_blocks
    monkeypatch.setattr(torch.ops.fp4compile, "dequantize_blocks", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(R, "NS_DQ", True)
    out = newton_schulz(G, coeffs, spec=spec, signs=signs, seed=seed, shift=shift)
    assert torch.isfinite(out.float()).all() and torch.equal(out, ref)
    assert calls == []
    monkeypatch.setattr(R, "NS_DQ", False)
    newton_schulz(G, coeffs, spec=spec, signs=signs, seed=seed, shift=shift)
    # the default path, per step: one for X·Xᵀ and one for A·A (or E²), whose operands are one copy; two for B·X
    assert len(calls) == 4 * 5


@pytest.mark.parametrize("spec", [NVFP4(), NVFP4("sr", four_over_six=True)], ids=["rtn", "sr-46"])
@pytest.mark.parametrize("option", [dict(residual=("x", "xt")), dict(residual=("x2d",)), dict(shared_x=True)],
                         ids=["x-xt", "x2d", "shared_x"])
def test_ns_accuracy_options_under_quantize_dq_operands(monkeypatch, spec, option):
    """ns_sym_b / ns_residual / ns_shared_x through NS_DQ's operands (quantize_dq's bf16 q·S) are the same NS bit for
    bit as through codes and dequantize_blocks (SR: the same seed stream, one seed per quantization)."""
    import fp4compile.optim.root as R

    G = torch.stack([clip_by_quantile(momentum_like(64, 256, s), 0.99) for s in range(2)])
    kw = dict(spec=spec, seed=torch.tensor(7) if spec.rounding != "rtn" else None, shift=True,
              sym_b=True, **option)
    coeffs = ns_coefficients((64, 256), 5, "root")
    monkeypatch.setattr(R, "NS_DQ", False)
    ref = newton_schulz(G, coeffs, **kw)
    monkeypatch.setattr(R, "NS_DQ", True)
    out = newton_schulz(G, coeffs, **kw)
    assert torch.isfinite(out.float()).all() and torch.equal(out, ref)


def test_bgemm_dq_equals_bgemm_nvfp4():
    import fp4compile.optim.root as R

    X = (torch.randn(3, 32, 128, generator=torch.Generator().manual_seed(2)) / 8).bfloat16()
    Y = (torch.randn(3, 48, 128, generator=torch.Generator().manual_seed(3)) / 8).bfloat16()
    spec = NVFP4("rtn", four_over_six=True)
    qx, qy = R._q_stack(X, spec, None), R._q_stack(Y, spec, None)
    px, py = R._q_stack_dq(X, spec, None), R._q_stack_dq(Y, spec, None)
    assert torch.equal(R._bgemm_dq(px, py), R._bgemm_nvfp4(qx, qy))
    assert torch.equal(R._bgemm_dq(px, px, torch.float32), R._bgemm_nvfp4(qx, qx, torch.float32))


@pytest.mark.gpu
def test_gpu_step_switches_keep_the_root_update(monkeypatch):
    """CUDA, the session-41 switches in the optimizer as the GPU runs it (CUDA graphs, 124M-like stack shapes): the
    top-k clip threshold, the quantize_dq operands, the per-matrix loop in place of the default foreach ops and the
    amax slots of ns_glue's passes (session 45) give the default's parameters bit for bit; the symmetric
    products may differ where a summation-order ulp flips a later FP4 rounding: far less than NVFP4 differs from
    a BF16 NS."""
    import fp4compile.optim.root as R

    torch.manual_seed(0)
    dev = torch.device("cuda")
    ps0 = [torch.randn(768, 3072, device=dev) * 0.02 for _ in range(2)] + [torch.randn(768, 768, device=dev) * 0.02]
    grads = [[torch.randn_like(p) for p in ps0] for _ in range(2)]
    ref, _ = _root_run(ps0, grads, precision=NVFP4(), cuda_graphs=True)
    bf16, _ = _root_run(ps0, grads, precision="bf16", cuda_graphs=True)

    @torch.no_grad()
    def dist(ps, qs):
        return sum(float((p - q).norm() / (q - p0).norm()) for p, q, p0 in zip(ps, qs, ps0))

    for attr, value, exact in (("QUANTILE_IMPL", "sort", True), ("NS_DQ", True, True), ("ROOT_FOREACH", False, True),
                               ("FUSE_AMAX", True, True), ("SYMMETRIC_MIN_ROWS", 512, False)):
        monkeypatch.setattr(R, attr, value)
        out, opt = _root_run(ps0, grads, precision=NVFP4(), cuda_graphs=True)
        monkeypatch.undo()
        if exact:
            assert all(torch.equal(x, y) for x, y in zip(ref, out)), attr
        else:
            assert dist(out, ref) < 0.25 * dist(ref, bf16), attr
    a = torch.randn(4, 768 * 3072, device=dev)
    assert torch.equal(abs_quantile(a, 0.99, "topk"), abs_quantile(a, 0.99, "sort"))


@pytest.mark.gpu
@pytest.mark.parametrize("residual", [("x", "xt"), ("x2d",)])
def test_gpu_sym_b_and_residual_ns_match_the_cpu(residual):
    """CUDA: the NS with the symmetric B and the two-term X (CUDA quantize kernels and cuBLAS products) lands where
    the CPU reference does (the same operands; FP32 summation order may flip a later FP4 rounding: far closer to it
    than to the BF16 NS), below BF16 NS's error; and QRoot with both options runs as CUDA graphs, replaying the
    same update as eagerly."""
    from fp4compile.optim.study import ns_error_parts

    G = torch.stack([clip_by_quantile(momentum_like(256, 1024, s), 0.99) for s in range(3)])
    coeffs = ns_coefficients((256, 1024), 7, "polar_express")
    kw = dict(spec=NVFP4("rtn"), norm_scale=1.01, shift=True, sym_b=True, residual=residual)
    cpu = newton_schulz(G, coeffs, **kw).float()
    gpu = newton_schulz(G.cuda(), coeffs, **kw).float().cpu()
    bf16 = newton_schulz(G, coeffs, norm_scale=1.01).float()
    assert float((gpu - cpu).norm()) < 0.5 * float((cpu - bf16).norm())
    for i in range(3):
        e_cpu, e_gpu = (ns_error_parts(G[i], o[i])["polar"] for o in (cpu, gpu))
        assert e_gpu < 0.025 and abs(e_gpu - e_cpu) < 0.2 * e_cpu, (e_gpu, e_cpu)
    torch.manual_seed(0)
    ps0 = [torch.randn(768, 3072, device="cuda") * 0.02 for _ in range(2)]
    grads = [[torch.randn_like(p) for p in ps0] for _ in range(3)]
    opts = dict(precision=NVFP4(), ns_sym_b=True, ns_residual=residual)
    graphed, _ = _root_run(ps0, grads, cuda_graphs=True, **opts)
    eager, _ = _root_run(ps0, grads, **opts)
    assert all(torch.equal(x, y) for x, y in zip(graphed, eager))


@pytest.mark.gpu
def test_gpu_shared_x_ns_matches_the_cpu():
    """CUDA: the NS with the symmetric B and the shared X (CUDA quantize kernels in 16x16 blocks, cuBLAS products on
    the copy and its transposed view, the update kernel's per-matrix g·sqrt(s)) lands where the CPU reference does
    (FP32 summation order may flip a later FP4 rounding: far closer to it than to the BF16 NS), at the CPU's error
    against the polar factor; and QRoot with the options replays as CUDA graphs the update it computes eagerly."""
    from fp4compile.optim.study import ns_error_parts

    G = torch.stack([clip_by_quantile(momentum_like(256, 1024, s), 0.99) for s in range(3)])
    coeffs = ns_coefficients((256, 1024), 5, "root")
    kw = dict(spec=NVFP4("rtn"), shift=True, sym_b=True, shared_x=True)
    cpu = newton_schulz(G, coeffs, **kw).float()
    gpu = newton_schulz(G.cuda(), coeffs, **kw).float().cpu()
    bf16 = newton_schulz(G, coeffs).float()
    assert float((gpu - cpu).norm()) < 0.5 * float((cpu - bf16).norm())
    for i in range(3):
        e_cpu, e_gpu = (ns_error_parts(G[i], o[i])["polar"] for o in (cpu, gpu))
        assert abs(e_gpu - e_cpu) < 0.2 * e_cpu, (e_gpu, e_cpu)
    torch.manual_seed(0)
    ps0 = [torch.randn(768, 3072, device="cuda") * 0.02 for _ in range(2)] + [torch.randn(768, 768, device="cuda")
                                                                           * 0.02]
    grads = [[torch.randn_like(p) for p in ps0] for _ in range(3)]
    opts = dict(precision=NVFP4(), ns_sym_b=True, ns_shared_x=True)
    graphed, _ = _root_run(ps0, grads, cuda_graphs=True, **opts)
    eager, _ = _root_run(ps0, grads, **opts)
    assert all(torch.equal(x, y) for x, y in zip(graphed, eager))


# ----------------------------------------------------------------------------------------------
# Root's element-wise step by torch._foreach ops (root.ROOT_FOREACH)
class _CountOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten calls made under it (CPU: one kernel launch each on a GPU)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("tensor_lr", [False, True])
def test_root_foreach_step_equals_the_per_matrix_loop(monkeypatch, dtype, nesterov, tensor_lr):
    """ROOT_FOREACH (the default) against the per-matrix loop: parameters, momentum buffers and step counters equal
    bit for bit after 3 steps (FP32 and BF16 parameters, Nesterov on and off, a float and a tensor lr), with fewer
    aten calls per step (one multi-tensor call per op instead of one per matrix)."""
    import fp4compile.optim.root as R

    def run(foreach):
        monkeypatch.setattr(R, "ROOT_FOREACH", foreach)
        g = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter((torch.randn(64, 128, generator=g) * 0.02).to(dtype)) for _ in range(6)]
        ps.append(torch.nn.Parameter((torch.randn(128, 64, generator=g) * 0.02).to(dtype)))
        lr = torch.tensor(1e-2) if tensor_lr else 1e-2
        opt = QRoot([{"params": ps, "use_root": True, "nesterov": nesterov}], lr=lr, precision=NVFP4())
        counts = []
        for _ in range(3):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g).to(dtype)
            with _CountOps() as c:
                opt.step()
            counts.append(c.n)
        return ps, opt, counts[-1]

    a, oa, na = run(True)
    b, ob, nb = run(False)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
        for key in ("momentum_buffer", "step"):
            assert torch.equal(oa.state[x][key], ob.state[y][key])
    assert na < nb - 6 * (2 if tensor_lr else 4), (na, nb)


def test_clip_by_quantile_is_roots_soft_threshold():
    """clip_by_quantile against ROOT's B = U - T_eps(U) = U - sign(U) max(|U| - eps, 0), written out independently
    (float64, eps from numpy's quantile), per matrix of a stack of different scales; signed zeros pass through (a
    NaN or an Inf makes its whole matrix NaN since session 53: test_clip_makes_a_nonfinite_matrix_nan)."""
    import numpy as np

    scales = torch.tensor([1.0, 10.0, 0.01])[:, None, None]
    U = torch.randn(3, 16, 40, generator=torch.Generator().manual_seed(4)) * scales
    out = clip_by_quantile(U, 0.9)
    for i in range(3):
        u = U[i].double().numpy()
        eps = np.quantile(np.abs(u), 0.9) + 1e-9
        ref = u - np.sign(u) * np.maximum(np.abs(u) - eps, 0)
        np.testing.assert_allclose(out[i].double().numpy(), ref, rtol=1e-6, atol=1e-7 * eps)
    Z = torch.randn(1, 16, 16, generator=torch.Generator().manual_seed(5))
    Z[0, 0, :2] = torch.tensor([-0.0, 0.0])
    out = clip_by_quantile(Z, 0.5)
    assert torch.signbit(out[0, 0, 0]) and out[0, 0, 0] == 0 and not torch.signbit(out[0, 0, 1])


# ----------------------------------------------------------------------------------------------
# the NVFP4 NS's glue (session 43; the scale-and-round itself: tests/test_ns_glue.py): the update, Xᵀ quantized
# without a transposed copy
def test_ns_update_is_the_fp32_sum_rounded_once():
    """The shifted NS update ((a + beta) X + Bs X in FP32, rounded once) as two passes equals the upcast form."""
    import fp4compile.optim.root as R

    g = torch.Generator().manual_seed(1)
    X = torch.randn(3, 16, 48, generator=g).to(torch.bfloat16)
    BX = torch.randn(3, 16, 48, generator=g).to(torch.bfloat16)
    beta = torch.randn(3, 1, 1, generator=g)
    ref = ((2.3 + beta) * X.float() + BX.float()).to(torch.bfloat16)
    assert torch.equal(R._ns_update(X, 2.3, beta, BX), ref)
    assert torch.equal(R._ns_update(X, 2.3, None, BX), 2.3 * X + BX)


@pytest.mark.parametrize("spec", [NVFP4(), NVFP4("rtn", four_over_six=True), NVFP4("rtn", hadamard=16),
                                  NVFP4("sr"), NVFP4("ms_eden", hadamard=128)],
                         ids=["rtn", "rtn-46", "rtn-rht16", "sr", "ms_eden-rht128"])
def test_transposed_stack_quantize_needs_no_transposed_copy(spec):
    """_q_stack(X, transpose=True) quantizes each matrix's transpose through the op's own transposed quantize of
    the stack's 2-D view: for RTN the same codes, scales, global scale and dequantized values as quantizing the
    transposed copy X.mT.contiguous(); for the stochastic schemes valid draws of the same scheme (their bits come
    from other flat indices), each operand's q·S within the format's error; the dq path (_q_stack_dq) agrees with
    the codes path bit for bit."""
    import fp4compile.optim.root as R
    from fp4compile.formats.hadamard import random_signs

    g = torch.Generator().manual_seed(2)
    X = (torch.randn(3, 128, 96, generator=g) * torch.linspace(0.2, 3, 96)).to(torch.bfloat16)   # [S, K=128, r=96]
    signs = random_signs(spec.hadamard, torch.Generator().manual_seed(0)) if spec.hadamard else None
    seed = torch.tensor(5) if spec.rounding != "rtn" else None
    qt = R._q_stack(X, spec, signs, seed, transpose=True)
    qc = R._q_stack(X.mT.contiguous(), spec, signs, seed)
    assert qt[0].shape == qc[0].shape == (3, 96, 64) and not qt[0].is_contiguous()
    dt, dc = R._dequantize_stack(qt), R._dequantize_stack(qc)
    if spec.rounding == "rtn":
        assert all(torch.equal(a, b) for a, b in zip(qt, qc))
        assert torch.equal(dt, dc)
    else:   # two draws of the same (rotated) quantization: each ~0.1 from the rotated X
        a, b = dt.float() * qt[2], dc.float() * qc[2]
        assert 0 < float((a - b).norm() / b.norm()) < 0.3
    pdq = R._q_stack_dq(X, spec, signs, seed, transpose=True)
    assert torch.equal(pdq[0], dt) and torch.equal(pdq[1], qt[2])
