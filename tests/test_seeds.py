"""passes/seeds.py: the backward's stochastic-rounding seeds from one ``fp4compile::draw_seeds`` (opt-in,
``POOL_SEEDS``). ``test_backend.py``'s unbiasedness tests (Quartet II, CPU and CUDA graphs) also run with the pool
on; there the Hadamard signs are random too, so the seeds' own freshness is tested here, with SR and no rotation."""
import copy

import pytest
import torch
import torch.nn as nn
from test_backend import compile_recorded, cuda_graph_weight_grads, rel

from fp4compile.passes import seeds
from fp4compile.policy import Policy


def _slots(gm):
    """(node, position, argument) of every seed slot of a stochastic quantize node in ``gm``."""
    out = []
    for n in gm.graph.nodes:
        spec = seeds.SEED_ARGS.get(n.target) if n.op == "call_function" else None
        if spec is None or (spec[1] is not None and n.args[spec[1]] == "rtn"):
            continue
        out += [(n, i, n.args[i]) for i in spec[0]]
    return out


@pytest.mark.parametrize("pool", [False, True])
def test_backward_seeds_come_from_one_draw(monkeypatch, pool):
    """Quartet II on a two-layer MLP: with the pool, the backward graph has one draw_seeds node of exactly as many
    seeds as its stochastic quantize nodes have slots, each slot a distinct element of it, and the forward none;
    without it, every slot is None (the op draws its own) and there is no draw_seeds node. The compiled step is
    the same computation either way: each gradient is within NVFP4's error of the exact one."""
    monkeypatch.setattr(seeds, "POOL_SEEDS", pool)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256, bias=False), nn.GELU(), nn.Linear(256, 128, bias=False))
    exact = copy.deepcopy(model)
    compiled, rec = compile_recorded(model, Policy.quartet2())
    x = torch.randn(128, 128)
    compiled(x).square().mean().backward()
    exact(x).square().mean().backward()
    for p, pe in zip(model.parameters(), exact.parameters()):
        assert 0 < rel(p.grad, pe.grad) < 0.3
    parts = dict(rec.partitions)
    fwd, bwd = parts["fwd"], parts["bwd"]
    assert not [n for n in fwd.graph.nodes if n.target is seeds.DRAW_SEEDS]
    draws = [n for n in bwd.graph.nodes if n.target is seeds.DRAW_SEEDS]
    slots = _slots(bwd)
    assert len(slots) >= 4                            # dY's two copies per layer, the requantized W and X
    if not pool:
        assert not draws and all(a is None for _, _, a in slots)
        return
    (draw,) = draws
    assert draw.args[1] == len(slots)
    picked = []
    for _, _, a in slots:
        assert a.target is torch.ops.aten.select.int and a.args[0] is draw and a.args[1] == 0
        picked.append(a.args[2])
    assert sorted(picked) == list(range(len(slots)))


def test_seed_slots_leave_forward_and_rtn_nodes_alone():
    """seed_slots on a hand-made graph: a backward MS-EDEN quantize_both (two slots), a backward RTN quantize (none),
    a backward quantize with its seed given (none), a forward SR quantize (none: not computed from a tangent)."""
    from torch.fx import Graph

    q, qb = torch.ops.fp4compile.quantize.default, torch.ops.fp4compile.quantize_both.default
    g = Graph()
    x, t = g.placeholder("primals_1"), g.placeholder("tangents_1")
    given = g.placeholder("seed")
    fwd_sr = g.call_function(q, (x, "sr", False, False, 0, None, None, False))
    both = g.call_function(qb, (t, 128, None, None, 128, None, None))
    rtn = g.call_function(q, (t, "rtn", False, False, 0, None, None, False))
    seeded = g.call_function(q, (t, "ms_eden", False, False, 128, None, given, False))
    tangents = {t, both, rtn, seeded}
    assert seeds.seed_slots(g, tangents) == [(both, 3), (both, 6)]
    assert fwd_sr not in tangents


@pytest.mark.parametrize("pool", [False, True])
def test_pooled_seeds_are_fresh_every_step(monkeypatch, pool):
    """Backward GEMMs in SR without a Hadamard: the seeds are the only randomness, so 16 steps' gradients differ
    from each other (a seed baked into the graph, or one draw reused, would give 16 identical gradients; a constant
    draw_seeds fails this test) and their mean is closer to the exact gradient than one of them. Not by 1/sqrt(16):
    with SR the GEMM's other operand (X in wgrad) is rounded to nearest (policy.NVFP4), a fixed error that no mean
    removes (here ~0.10 of the exact gradient against one step's ~0.18, 0.57x; a frozen seed would give 1x)."""
    import dataclasses

    monkeypatch.setattr(seeds, "POOL_SEEDS", pool)
    torch._dynamo.reset()
    torch.manual_seed(0)
    sr = dataclasses.replace(Policy.quartet2().resolve("x", "linear.dgrad"), rounding="sr", hadamard=None)
    policy = Policy((), "sr-bwd").override("*", sr, role="linear.dgrad").override("*", sr, role="linear.wgrad")
    model = nn.Linear(128, 128, bias=False)
    compiled, rec = compile_recorded(model, policy)
    x = torch.randn(128, 128, requires_grad=True)
    dy = torch.randn(128, 128)
    exact = dy.t() @ x.detach()
    gw = []
    for _ in range(16):
        model.zero_grad()
        x.grad = None
        (compiled(x) * dy).sum().backward()
        gw.append(model.weight.grad.clone())
    bwd = dict(rec.partitions)["bwd"]
    assert len([n for n in bwd.graph.nodes if n.target is seeds.DRAW_SEEDS]) == int(pool)
    assert not any(torch.equal(gw[i], gw[i + 1]) for i in range(len(gw) - 1))
    single = sum(rel(g, exact) for g in gw) / len(gw)
    assert 0.01 < single < 0.3 and rel(torch.stack(gw).mean(0), exact) < 0.75 * single


@pytest.mark.gpu
def test_gpu_pooled_seeds_are_fresh_every_replay(monkeypatch):
    """The pool under CUDA graphs (``mode="reduce-overhead"``): draw_seeds is captured in the backward graph, and
    every replay must draw anew (torch's generator advances its Philox offset per replay). SR without a Hadamard,
    so the seeds are the only randomness: 16 replays give 16 different gradients whose mean beats one of them."""
    import dataclasses

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setattr(seeds, "POOL_SEEDS", True)
    torch._dynamo.reset()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    sr = dataclasses.replace(Policy.quartet2().resolve("x", "linear.dgrad"), rounding="sr", hadamard=None)
    policy = Policy((), "sr-bwd").override("*", sr, role="linear.dgrad").override("*", sr, role="linear.wgrad")
    gw, exact = cuda_graph_weight_grads(nn.Linear(256, 256, bias=False, device=dev), policy)
    assert not any(torch.equal(gw[i], gw[i + 1]) for i in range(len(gw) - 1))
    single = sum(rel(g, exact) for g in gw) / len(gw)
    assert 0.01 < single < 0.3 and rel(torch.stack(gw).mean(0), exact) < 0.75 * single
