"""passes/draws.py: the backward's RHT-sign and seed draws pooled into one launch per graph side (CPU, debug backend)."""
import copy
import functools

import pytest
import torch
import torch.nn as nn

import fp4compile  # noqa: F401
from fp4compile.backend import Settings, compile_graph
from fp4compile.inspect import Recorder
from fp4compile.passes import draws
from fp4compile.policy import NVFP4, Policy


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(256, 384), nn.Linear(384, 256)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def compiled(model, policy):
    rec = Recorder()
    settings = Settings(policy, debug=True, recorder=rec)
    return torch.compile(model, backend=functools.partial(compile_graph, settings=settings)), rec


def run(model, policy, x, steps=1):
    torch._dynamo.reset()
    fn, rec = compiled(model, policy)
    grads = []
    for _ in range(steps):
        model.zero_grad()
        xx = x.clone().requires_grad_()
        (fn(xx).float() * torch.linspace(-1, 1, 256)).sum().backward()
        grads.append([xx.grad] + [p.grad.clone() for p in model.parameters()])
    return grads, {kind: gm.graph for kind, gm in rec.partitions}


def count(g, op):
    return sum(n.target is op for n in g.nodes)


def test_pools_replace_every_draw_and_give_the_same_gradients_for_the_same_draws(monkeypatch):
    """Pooled (POOL_DRAWS): the backward has no per-GEMM ``rht_signs`` left, one ``rht_signs_pool`` per Hadamard size
    and one ``random_seeds``, every MS-EDEN quantize gets its seed from it; with every draw made a constant (so
    pooled and per-operand draws are the same numbers) the gradients are the same bits as without pooling."""
    def constant_randint(low, high=None, size=None, *, generator=None, device=None, dtype=None, **kw):
        low, size = (0, high) if size is None else (low, size)
        return torch.full(tuple(size), low, device=device, dtype=dtype or torch.int64)

    monkeypatch.setattr(torch, "randint", constant_randint)
    torch.manual_seed(0)
    base = Two().to(torch.bfloat16)
    x = torch.randn(512, 256, dtype=torch.bfloat16)
    out, graphs = {}, {}
    for pooled in (True, False):
        monkeypatch.setattr(draws, "POOL_DRAWS", pooled)
        out[pooled], graphs[pooled] = run(copy.deepcopy(base), Policy.full_stack(), x)
    for a, b in zip(out[True][0], out[False][0]):
        assert torch.equal(a, b)
    ops = torch.ops.fp4compile
    bwd, ref = graphs[True]["bwd"], graphs[False]["bwd"]
    # unpooled, a layer's dgrad and wgrad draws (same gradient, same size) end up as one node after the compile's
    # CSE; pooled, each of the 4 backward GEMMs keeps its own row
    assert count(ref, ops.rht_signs.default) == 2 and count(bwd, ops.rht_signs.default) == 0
    assert count(bwd, ops.rht_signs_pool.default) == 1 and count(bwd, ops.random_seeds.default) == 1
    assert next(n for n in bwd.nodes if n.target is ops.rht_signs_pool.default).args[1:] == (4, 128)
    quantizes = [n for n in bwd.nodes if n.target in (ops.quantize.default, ops.quantize_both.default,
                                                       ops.quantize_dq.default, ops.quantize_both_dq.default)]
    eden = [n for n in quantizes if n.target in (ops.quantize_both.default, ops.quantize_both_dq.default)
            or n.args[1] == "ms_eden"]
    assert eden and all(a is not None for n in eden for a in draws_of(n)), [n.args for n in eden]
    pool = next(n for n in bwd.nodes if n.target is ops.random_seeds.default)
    assert pool.args[1] == sum(len(draws_of(n)) for n in eden)           # one pool element per seed


def draws_of(n):
    ops = torch.ops.fp4compile
    pos = (3, 6) if n.target in (ops.quantize_both.default, ops.quantize_both_dq.default) else (6,)
    return [n.args[i] for i in pos]


def test_pooled_draws_are_fresh_every_step_and_unbiased(monkeypatch):
    """With pooling, every step draws new signs and seeds (two steps' gradients differ) and the backward stays
    unbiased: the mean of 16 steps' gradients is much closer to the exact one than a single step's."""
    monkeypatch.setattr(draws, "POOL_DRAWS", True)
    torch.manual_seed(0)
    model = nn.Linear(128, 128, bias=False)
    bwd = Policy.quartet2().resolve("x", "linear.dgrad")
    policy = Policy((), "bwd-only").override("*", bwd, role="linear.dgrad").override("*", bwd, role="linear.wgrad")
    torch._dynamo.reset()
    fn, rec = compiled(model, policy)
    x = torch.randn(128, 128, requires_grad=True)
    dy = torch.randn(128, 128)
    exact_w = dy.t() @ x.detach()
    gw = []
    for _ in range(16):
        model.zero_grad()
        (fn(x) * dy).sum().backward()
        gw.append(model.weight.grad.clone())
    g = {kind: gm.graph for kind, gm in rec.partitions}["bwd"]
    assert count(g, torch.ops.fp4compile.random_seeds.default) == 1
    assert not torch.equal(gw[0], gw[1])
    rel = lambda a: ((a - exact_w).norm() / exact_w.norm()).item()  # noqa: E731
    single = sum(rel(a) for a in gw) / len(gw)
    assert 0.02 < single < 0.3 and rel(torch.stack(gw).mean(0)) < 0.45 * single


def test_pool_ops_draw_distinct_rows_and_seeds():
    """The pool ops: n Rademacher rows (±1 only, rows not all equal), n int64 seeds in [-2^62, 2^62) (distinct),
    fresh on every call; ``like`` only orders the draw."""
    like = torch.zeros(3)
    s = torch.ops.fp4compile.rht_signs_pool(like, 64, 128)
    assert s.shape == (64, 128) and s.dtype == torch.float32 and set(s.unique().tolist()) == {-1.0, 1.0}
    assert len({tuple(r.tolist()) for r in s}) == 64
    assert abs(s.mean().item()) < 0.05                                   # 8192 fair signs: sd of the mean 0.011
    k = torch.ops.fp4compile.random_seeds(like, 1000)
    assert k.shape == (1000,) and k.dtype == torch.int64 and len(set(k.tolist())) == 1000
    assert k.min() >= -(2 ** 62) and k.max() < 2 ** 62
    assert not torch.equal(k, torch.ops.fp4compile.random_seeds(like, 1000))
    torch.library.opcheck(torch.ops.fp4compile.random_seeds.default, (like, 4), test_utils=("test_schema",
                                                                                             "test_faketensor"))
    torch.library.opcheck(torch.ops.fp4compile.rht_signs_pool.default, (like, 2, 16),
                          test_utils=("test_schema", "test_faketensor"))


def test_off_by_default_and_in_the_cache_key(monkeypatch):
    """Opt-in until its GPU A/B (module docstring); the switch is part of the joint pass's cache key."""
    from fp4compile.backend import FP4JointPass
    from fp4compile.passes.linear import SiteInfo

    assert draws.POOL_DRAWS is (__import__("os").environ.get("FP4COMPILE_POOL_DRAWS", "0") != "0")
    table = {"linear": SiteInfo("a", (("linear.fprop", NVFP4()),), 1)}
    k0 = FP4JointPass(Policy.full_stack(), table).uuid()
    monkeypatch.setattr(draws, "POOL_DRAWS", not draws.POOL_DRAWS)
    assert FP4JointPass(Policy.full_stack(), table).uuid() != k0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_pooled_draws_in_cuda_graph_replays(monkeypatch):
    """On CUDA with CUDA graphs (reduce-overhead): pooled draws are fresh at every replay (two steps' gradients
    differ) and the full-stack step's gradients stay unbiased enough to train (loss falls)."""
    monkeypatch.setattr(draws, "POOL_DRAWS", True)
    torch.manual_seed(0)
    model = Two().cuda()
    torch._dynamo.reset()
    fn = torch.compile(model, backend="fullstack_fp4", mode="reduce-overhead")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(512, 256, device="cuda")
    target = torch.randn(512, 256, device="cuda")
    losses, grads = [], []
    for _ in range(6):
        torch.compiler.cudagraph_mark_step_begin()
        opt.zero_grad()
        loss = ((fn(x) - target) ** 2).mean()
        loss.backward()
        grads.append(model.a.weight.grad.clone())
        losses.append(loss.item())
        opt.step()
    assert not torch.equal(grads[-1], grads[-2])
    assert losses[-1] < losses[0]
