"""The fullstack_fp4 backend on CPU: exactness against an eager reference built from the same ops, training,
saved-for-backward tensors, recompiles, fallbacks, option errors, Hadamard signs, inference graphs.

Most tests use the backend's CPU debug variant (``options={"debug": True}``: the same passes and
partitioner, the partitioned graphs run eagerly) because Inductor's C++ compile takes minutes on the 2-core
CI machine; ``test_inductor_path_*`` covers the Inductor path on a tiny model.
"""
import copy
import functools
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fp4compile  # noqa: F401  (these tests use fp4compile's ops directly; the entry-point test does not)
from fp4compile.backend import FP4JointPass, Settings, compile_graph
from fp4compile.inspect import Recorder
from fp4compile.passes.linear import SiteInfo
from fp4compile.policy import BF16, NVFP4, Policy

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from fp4ref import use_reference_linears  # noqa: E402
from nanogpt import GPT, batch  # noqa: E402

def rtn_policy():
    """Every linear GEMM RTN NVFP4 (attention untouched: the eager references use plain SDPA)."""
    return functools.reduce(lambda p, r: p.override("*", NVFP4("rtn"), role=r),
                            ("linear.fprop", "linear.dgrad", "linear.wgrad"), Policy((), "rtn-only"))


RTN = rtn_policy()


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test starts from a clean Dynamo cache (no automatic-dynamic shapes from earlier tests)."""
    torch._dynamo.reset()
    yield


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def compile_recorded(model, policy, debug=True, gemm_lowering="op", save_weight_copies=None):
    rec = Recorder()
    settings = Settings(policy, debug=debug, recorder=rec, gemm_lowering=gemm_lowering,
                        save_weight_copies=save_weight_copies)
    return torch.compile(model, backend=functools.partial(compile_graph, settings=settings)), rec



# ------------------------------------------------------------------------------------------------
def test_nanogpt_matches_eager_reference_of_same_ops():
    """Loss and every gradient equal an eager model whose nn.Linear layers call quantize/gemm by hand."""
    torch.manual_seed(0)
    model = GPT()
    ref = use_reference_linears(copy.deepcopy(model))
    exact = copy.deepcopy(model)
    x, y = batch(0)
    compiled = torch.compile(model, backend="fullstack_fp4", options={"policy": RTN, "debug": True})
    loss = compiled(x, y)
    loss.backward()
    loss_ref = ref(x, y)
    loss_ref.backward()
    exact(x, y).backward()
    assert abs(loss.item() - loss_ref.item()) < 1e-5
    exact_match = 0
    for (name, p), pr, pe in zip(model.named_parameters(), ref.parameters(), exact.parameters()):
        err, fp4_err = rel(p.grad, pr.grad), rel(pr.grad, pe.grad)
        # The compiled graph computes LayerNorm/GELU/softmax with Inductor's decompositions, eager with
        # ATen kernels: ~1e-7 differences flip an RTN code now and then, and a flipped code moves a block
        # scale of the requantized (transposed) copy. Most gradients are equal to fp32 accumulation order;
        # every one is far closer to the same-op reference than FP4 is to the exact fp32 gradients.
        exact_match += err < 1e-5
        assert err < 0.2 * fp4_err, (name, err, fp4_err)
    assert exact_match >= len(list(model.parameters())) // 2


@pytest.mark.parametrize("lowering", ["op", "dequant_mm"])
def test_linear_stack_equals_eager_reference_exactly(lowering):
    """Without decomposed non-linearities in between, compiled == hand-written reference (same bytes), with
    either GEMM lowering (one fp4compile::gemm, or dequantize_blocks + mm_f32 + scale/cast as aten ops)."""
    torch.manual_seed(0)
    model = nn.Sequential(Stack(), nn.ReLU(), nn.Linear(32, 48))
    ref = use_reference_linears(copy.deepcopy(model))
    x = torch.randn(48, 64, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    compiled, rec = compile_recorded(model, RTN, gemm_lowering=lowering)
    y = compiled(x)
    (y * torch.linspace(-1, 1, 48)).sum().backward()
    yr = ref(xr)
    (yr * torch.linspace(-1, 1, 48)).sum().backward()
    assert rel(y, yr) < 1e-6 and rel(x.grad, xr.grad) < 1e-6
    for (name, p), pr in zip(model.named_parameters(), ref.parameters()):
        assert rel(p.grad, pr.grad) < 1e-6, name
    assert [s.precision for s in rec.report().sites] == ["nvfp4"] * 12
    g = rec.graphs[0]
    targets = [a["target"] for _, a in g.nodes(data=True)]
    n_gemm, n_mm = targets.count("fp4compile.gemm.default"), targets.count("fp4compile.mm_f32.default")
    assert (n_gemm, n_mm) == ((12, 0) if lowering == "op" else (0, 12)), (n_gemm, n_mm)
    if lowering == "dequant_mm":   # (DQ_OPERANDS "fwd", the default) the 4 forward GEMMs read quantize_dq's bf16
        assert targets.count("fp4compile.quantize_dq.default") == 8     # q * S, the 8 backward ones dequantize
        assert targets.count("fp4compile.dequantize_blocks.default") == 16
    else:                          # these skinny shapes' CUDA GEMM dequantizes in registers: the codes
        assert targets.count("fp4compile.quantize_dq.default") == 0
    # the backward's requantized operands (Wᵀ for dgrad, Xᵀ for wgrad) are dequantized straight into transposed
    # tensors and quantized row-wise: no transposed quantize (no transposing copy) of a dequantization
    bwd = [gm for kind, gm in rec.partitions if kind == "bwd"][0]
    DQ = torch.ops.fp4compile.dequantize.default
    Q = (torch.ops.fp4compile.quantize.default, torch.ops.fp4compile.quantize_dq.default)
    deqs = [n for n in bwd.graph.nodes if n.target is DQ]
    assert len(deqs) == 8 and all(n.args[6] is True for n in deqs), bwd.code
    requants = [u for n in deqs for u in n.users]
    assert len(requants) == 8 and all(u.target in Q and not u.args[7] for u in requants), bwd.code


@pytest.mark.parametrize("hadamard_t", [16, 32])
def test_gradient_ms_eden_copies_are_one_node_with_the_same_gradients(monkeypatch, hadamard_t):
    """Quartet II's backward (MS-EDEN on dY for dgrad and for wgrad): the two copies of each dY are one
    fp4compile::quantize_both node (its CUDA kernel makes the transposed copy from the row-wise pass), and the
    gradients equal those of the two-quantize graph bit for bit, also when dgrad and wgrad rotate by different
    Hadamard sizes. The merged node draws its two seeds at one point of the graph, so the order of the draws
    differs: every draw (RHT signs, MS-EDEN seeds) is made a constant here (the op tests check that each copy gets
    its own signs and seed)."""
    from fp4compile.passes import reuse

    def constant_randint(low, high=None, size=None, *, generator=None, device=None, dtype=None, **kw):
        low, size = (0, high) if size is None else (low, size)
        return torch.full(tuple(size), low, device=device, dtype=dtype or torch.int64)

    monkeypatch.setattr(torch, "randint", constant_randint)
    policy = Policy((), "q2-small").override("*", NVFP4("rtn", four_over_six=True), role="linear.fprop")
    policy = policy.override("*", NVFP4("ms_eden", hadamard=16), role="linear.dgrad")
    policy = policy.override("*", NVFP4("ms_eden", hadamard=hadamard_t), role="linear.wgrad")
    base = nn.Sequential(Stack(), nn.ReLU(), nn.Linear(32, 48))
    x0 = torch.randn(64, 64)
    grads, graphs = {}, {}
    for paired in (True, False):
        monkeypatch.setattr(reuse, "PAIR_LAYOUTS", paired)
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        compiled, rec = compile_recorded(model, policy)
        x = x0.clone().requires_grad_()
        (compiled(x) * torch.linspace(-1, 1, 48)).sum().backward()
        grads[paired] = [x.grad] + [p.grad for p in model.parameters()]
        graphs[paired] = [gm for kind, gm in rec.partitions if kind == "bwd"][0].graph
    QB, Q = torch.ops.fp4compile.quantize_both.default, torch.ops.fp4compile.quantize.default
    count = lambda g, t: sum(n.target is t for n in g.nodes)  # noqa: E731
    eden_q = lambda g: [n for n in g.nodes if n.target is Q and n.args[1] == "ms_eden"]  # noqa: E731
    # four linears, each dY quantized both ways (x requires grad, so the first layer has a dgrad too); the
    # non-gradient operands stay requantizations of the forward copies (quantize nodes)
    assert count(graphs[True], QB) == 4 and count(graphs[False], QB) == 0
    assert len(eden_q(graphs[False])) - len(eden_q(graphs[True])) == 8
    for a, b in zip(grads[True], grads[False]):
        assert torch.equal(a, b)


def test_nanogpt_all_linear_gemms_nvfp4_and_loss_decreases():
    torch.manual_seed(0)
    model = GPT()
    compiled, rec = compile_recorded(model, RTN)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(4):
        x, y = batch(step)
        loss = compiled(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.2, losses
    linear = [s for s in rec.report().sites if s.role.startswith("linear.")]
    n_linear = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert len(linear) == 3 * n_linear
    assert all(s.precision == "nvfp4" for s in linear)
    assert {s.role for s in linear} == {"linear.fprop", "linear.dgrad", "linear.wgrad"}
    assert len(rec.graphs) == 1                                   # one graph: the backend broke nothing


ENTRY_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {here!r})
    import torch
    from nanogpt import GPT, batch
    assert "fp4compile" not in sys.modules
    torch.manual_seed(0)
    model = GPT()
    expl = torch._dynamo.explain(model)(*batch(0))
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, backend="fullstack_fp4", options={{"debug": True}})
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(4):
        x, y = batch(step)
        loss = compiled(x, y); loss.backward(); opt.step(); opt.zero_grad(); losses.append(loss.item())
    print(json.dumps(dict(losses=losses, breaks=expl.graph_break_count,
                          graphs=torch._dynamo.utils.counters["stats"]["unique_graphs"],
                          loaded="fp4compile.backend" in sys.modules)))
""")


def test_entry_point_trains_without_importing_fp4compile():
    out = subprocess.run([sys.executable, "-c", ENTRY_SCRIPT.format(here=HERE)], capture_output=True, text=True,
                         timeout=900, env={**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    import json
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["loaded"] and res["breaks"] == 0 and res["graphs"] == 1, res
    assert res["losses"][-1] < res["losses"][0] - 0.2, res


SOURCE_TREE_SCRIPT = textwrap.dedent("""
    import importlib.metadata as md, json, sys
    sys.path.insert(0, {root!r})
    if {hide}:  # what a source tree without `pip install` looks like: no fp4compile distribution, no entry point
        real_dist, real_eps = md.distribution, md.entry_points
        def distribution(name):
            if name == "fp4compile":
                raise md.PackageNotFoundError(name)
            return real_dist(name)
        def entry_points(**kw):
            eps = real_eps(**kw)
            if kw.get("group") != "torch_dynamo_backends":
                return eps
            return md.EntryPoints(ep for ep in eps if ep.value.split(".")[0] != "fp4compile")
        md.distribution, md.entry_points = distribution, entry_points
    import torch
    import fp4compile
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    x = torch.randn(8, 64)
    compiled = torch.compile(model, backend="fullstack_fp4", options={{"debug": True, "policy": "bf16"}})
    out = compiled(x)
    out.sum().backward()
    from torch._dynamo.backends import registry
    print(json.dumps(dict(err=float((out - model(x)).abs().max()), loaded="fp4compile.backend" in sys.modules,
                          via=registry._COMPILER_FNS["fullstack_fp4"].__module__,
                          grad=model.weight.grad is not None)))
""")


@pytest.mark.parametrize("hide", [True, False], ids=["source_tree", "installed"])
def test_backend_name_works_after_import_with_or_without_the_entry_point(hide):
    """Without the entry point (source tree, PYTHONPATH only) ``import fp4compile`` registers the backend; installed,
    importing fp4compile before compiling must not register it a second time (Dynamo asserts on a duplicate name
    when the entry point loads), so the entry point's function is the one used."""
    root = os.path.dirname(HERE)
    out = subprocess.run([sys.executable, "-c", SOURCE_TREE_SCRIPT.format(root=root, hide=hide)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    import json
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["loaded"] and res["grad"], res
    assert res["err"] < 1e-5, res  # the BF16 policy on a float32 model: the plain linear
    assert res["via"] == ("fp4compile" if hide else "fp4compile.backend"), res

# ------------------------------------------------------------------------------------------------
class Stack(nn.Module):
    """A linear stack (no non-linearity), shapes chosen so every tensor shape is distinct."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(64, 128), nn.Linear(128, 96), nn.Linear(96, 32)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


def _saved(rec):
    fwd = [gm for kind, gm in rec.partitions if kind == "fwd"][0]
    outs = [n for n in fwd.graph.nodes if n.op == "output"][0].args[0]
    return [(a.op, a.meta["val"].dtype, tuple(a.meta["val"].shape)) for a in outs[1:]]   # [0] is the output


@pytest.mark.parametrize("lowering", ["op", "dequant_mm"])
def test_saved_for_backward_are_packed_fp4_and_no_weight_copy(lowering):
    """Saved with ``save_weight_copies=False``: the packed FP4 activation copies only -- no bf16 activation, no FP4
    weight copy and (with the "dequant_mm" lowering) no dequantized bf16 operand and no FP32 GEMM output."""
    torch.manual_seed(0)
    model = Stack().to(torch.bfloat16)
    x = torch.randn(48, 64, dtype=torch.bfloat16, requires_grad=True)
    compiled, rec = compile_recorded(model, RTN, gemm_lowering=lowering, save_weight_copies=False)
    compiled(x).float().sum().backward()
    saved = _saved(rec)
    activations = [s for s in saved if s[0] != "placeholder"]       # placeholders: params/inputs (free)
    assert activations, saved
    assert all(dt in (torch.uint8, torch.float32) for _, dt, _ in activations), saved
    assert not any(dt == torch.float32 and shp for _, dt, shp in activations), saved   # only 0-dim global scales
    # packed copies of the three layer inputs (48x64, 48x128, 48x96 -> codes [48, K/2], scales [48, K/16])
    assert {shp for _, dt, shp in activations if dt == torch.uint8} == {(48, 32), (48, 4), (48, 64), (48, 8),
                                                                       (48, 48), (48, 6)}, saved
    # no FP4 weight copy (W codes would be [N, K/2]: (128, 32), (96, 64), (32, 48) or transposed)
    weight_codes = {(128, 32), (96, 64), (32, 48), (64, 64), (128, 48), (96, 16)}
    assert not any(shp in weight_codes for _, _, shp in activations), saved
    # the test can fail: the BF16 policy saves BF16 activations
    model2 = Stack().to(torch.bfloat16)
    compiled2, rec2 = compile_recorded(model2, Policy.bf16())
    compiled2(x).float().sum().backward()
    assert any(dt == torch.bfloat16 and op != "placeholder" for op, dt, _ in _saved(rec2))


def _forward_backward(base, x0, policy, grad_weights=None, **compile_kw):
    """One compiled forward and backward of a fresh copy of ``base`` on ``x0`` (the RNG seeded right before the
    forward, so every arm draws the same seeds and signs), the loss ``sum(y * grad_weights)``: ([y, dL/dx, dL/dparam
    ...], the recorder)."""
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    compiled, rec = compile_recorded(model, policy, **compile_kw)
    x = x0.clone().requires_grad_()
    torch.manual_seed(1)
    y = compiled(x)
    (y.float() if grad_weights is None else y.float() * grad_weights).sum().backward()
    return [y, x.grad] + [p.grad for p in model.parameters()], rec


@pytest.mark.parametrize("lowering", ["op", "dequant_mm"])
def test_gemms_take_quantize_dq_operands_with_the_same_results(monkeypatch, lowering):
    """An NVFP4 GEMM that would dequantize both operands before a bf16 GEMM (every "dequant_mm" one; an "op" one
    whose CUDA implementation by shape is a dequantize-then-GEMM one) reads them as its copies' bf16 q * S from
    ``quantize_dq`` / ``quantize_both_dq`` (``passes.linear.DQ_OPERANDS``: "all", "fwd" or "none"): the same output
    and gradients, bit for bit, in all three graphs (the full-stack policy: RTN 4/6 forward, MS-EDEN + RHT backward
    with a paired dY, whose seeds and signs are drawn in the same order); the same saved tensors, none of them a
    bf16 q * S; no dequantize pass left where every GEMM reads dq."""
    from fp4compile.passes import linear

    class Two(nn.Module):    # every GEMM of fwd, dgrad and wgrad has M, N > 256: the TMA GEMM / cuBLAS split-K ones
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(384, 512), nn.Linear(512, 384)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    torch.manual_seed(0)
    base = Two().to(torch.bfloat16)
    x0 = torch.randn(512, 384, dtype=torch.bfloat16)
    out, graphs, saved = {}, {}, {}
    for arm in ("all", "fwd", "none"):
        monkeypatch.setattr(linear, "DQ_OPERANDS", arm)
        out[arm], rec = _forward_backward(base, x0, Policy.full_stack(), torch.linspace(-1, 1, 384),
                                          gemm_lowering=lowering)
        graphs[arm] = {kind: gm.graph for kind, gm in rec.partitions}
        saved[arm] = _saved(rec)
        assert sum(bool(r.get("dq")) for r in rec.done) == {"all": 6, "fwd": 2, "none": 0}[arm]
    for arm in ("fwd", "all"):
        for a, b in zip(out[arm], out["none"]):
            assert torch.equal(a, b), arm
        assert saved[arm] == saved["none"]
    assert not any(dt == torch.bfloat16 and op != "placeholder" for op, dt, _ in saved["all"]), saved["all"]
    count = lambda g, t: sum(n.target is t for n in g.nodes)  # noqa: E731
    ops_ = torch.ops.fp4compile
    for arm, part in (("all", "fwd"), ("all", "bwd"), ("fwd", "fwd")):          # GEMMs that read dq
        g = graphs[arm][part]
        assert count(g, ops_.dequantize_blocks.default) == count(g, ops_.gemm.default) == 0, (arm, part)
        assert count(g, ops_.gemm_dequantized.default) == (2 if part == "fwd" else 4) * (lowering == "op")
        assert count(g, ops_.quantize.default) == count(g, ops_.quantize_both.default) == 0, (arm, part)
    assert count(graphs["all"]["fwd"], ops_.quantize_dq.default) == 4
    assert count(graphs["all"]["bwd"], ops_.quantize_both_dq.default) == 2              # each layer's dY, paired
    # the switch works (the test can fail): "fwd" leaves the backward on the codes, "none" everything
    assert count(graphs["fwd"]["bwd"], ops_.gemm.default if lowering == "op" else ops_.dequantize_blocks.default)
    assert count(graphs["none"]["fwd"], ops_.quantize_dq.default) == 0


def test_linear_bias_goes_into_the_gemm_epilogue(monkeypatch):
    """Where an NVFP4 GEMM's CUDA kernel is the TMA GEMM (``linear.bias_in_epilogue``), an addmm's bias is the
    GEMM's own ``bias`` argument: no ``aten.add`` after it, and the output is the FP32 GEMM result plus the bias,
    rounded once -- the ops called by hand. ``linear.FUSE_BIAS = False`` gives the separate add (the bf16 result
    plus the bias, rounded again: another output, so the test can fail); a skinny GEMM keeps the add either way."""
    from fp4compile.passes import linear

    ops_ = torch.ops.fp4compile
    torch.manual_seed(0)
    lin = nn.Linear(384, 512).to(torch.bfloat16)
    with torch.no_grad():
        lin.bias.normal_(0.0, 0.5)
    x = torch.randn(512, 384, dtype=torch.bfloat16)
    assert linear.bias_in_epilogue(512, 512, 384) and not linear.bias_in_epilogue(200, 512, 384)
    out, adds = {}, {}
    for fuse in (True, False):
        monkeypatch.setattr(linear, "FUSE_BIAS", fuse)
        torch._dynamo.reset()
        compiled, rec = compile_recorded(copy.deepcopy(lin), RTN)
        out[fuse] = compiled(x.clone().requires_grad_())
        fwd = [gm for kind, gm in rec.partitions if kind == "fwd"][0]
        adds[fuse] = sum(n.target is torch.ops.aten.add.Tensor for n in fwd.graph.nodes)
        assert [r.get("bias") for r in rec.done if r["role"] == "linear.fprop"] == (["epilogue"] if fuse else [None])
    q = lambda t: ops_.quantize(t, "rtn", False, False, 0, None, None, False)  # noqa: E731
    f32 = ops_.gemm(*q(x), *q(lin.weight.detach()), torch.float32)
    assert torch.equal(out[True], (f32 + lin.bias.float()).to(torch.bfloat16))
    assert torch.equal(out[False], (f32.to(torch.bfloat16).float() + lin.bias.float()).to(torch.bfloat16))
    assert not torch.equal(out[True], out[False])
    assert adds == {True: 0, False: 1}, adds
    # a skinny GEMM (its kernel dequantizes in registers): the add stays
    torch._dynamo.reset()
    compiled, rec = compile_recorded(copy.deepcopy(lin), RTN)
    compiled(x[:200].clone().requires_grad_())
    assert [r.get("bias") for r in rec.done if r["role"] == "linear.fprop"] == [None]


@pytest.mark.parametrize("policy", ["full_stack", "rtn"])
@pytest.mark.parametrize("mode, row", [("all", 0), ("norms", 0), ("all", 128), ("all", 65536)])
def test_fused_amax_gives_the_same_bytes_and_reaches_only_inductor_made_tensors(monkeypatch, policy, mode, row):
    """``passes/amax.py`` (``FUSE_AMAX``): an RTN quantize of a tensor an Inductor kernel makes (LayerNorm, GELU;
    with the RTN policy also the GELU's backward, a gradient) gets its amax from the graph, the same output and
    gradients bit for bit (the CPU reference raises if a given amax is not max|x|, so a wrong one cannot pass);
    graph inputs (x, the weights, the loss's tangent) and MS-EDEN copies keep the op's own amax; off, none is
    given one (the test can fail). ``"norms"`` reaches only the LayerNorm's tensors; ``POINTWISE_ROW`` reshapes
    the GELU's (a pointwise producer's) first reduction, not the LayerNorm's, and leaves a GELU tensor whose size
    is not a multiple of it alone."""
    from fp4compile.passes import amax as amax_pass

    quantizes = (torch.ops.fp4compile.quantize.default, torch.ops.fp4compile.quantize_dq.default)
    pol = Policy.full_stack() if policy == "full_stack" else RTN
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(128, 128), nn.LayerNorm(128), nn.Linear(128, 256), nn.GELU(),
                         nn.Linear(256, 128)).to(torch.bfloat16)
    x0 = torch.randn(384, 128, dtype=torch.bfloat16)
    monkeypatch.setattr(amax_pass, "POINTWISE_ROW", row)
    out, given, amaxes, views = {}, {}, {}, {}
    for on in ("off", mode):
        monkeypatch.setattr(amax_pass, "FUSE_AMAX", on)
        out[on], rec = _forward_backward(base, x0, pol)
        parts = dict(rec.partitions)
        given[on] = {kind: sum(n.target in quantizes and len(n.args) > 8 and isinstance(n.args[8], torch.fx.Node)
                               for n in gm.graph.nodes) for kind, gm in parts.items()}
        amaxes[on] = {kind: sum(n.target is torch.ops.aten.amax.default and n.args[1] == [0] for n in gm.graph.nodes)
                      for kind, gm in parts.items()}
        views[on] = sum(n.target is torch.ops.aten.amax.default and n.args[0].target is torch.ops.aten.view.default
                        for gm in parts.values() for n in gm.graph.nodes)
    assert all(torch.equal(a, b) for a, b in zip(out["off"], out[mode]))
    assert given["off"] == amaxes["off"] == {"fwd": 0, "bwd": 0}
    # forward: the LayerNorm's and the GELU's outputs (x and the three weights are graph inputs). Backward, with RTN:
    # the GELU backward's and the LayerNorm backward's outputs (dY of the 2nd and 1st linear), each quantized
    # row-wise (dgrad) and transposed (wgrad) with one amax; the last linear's dY is the tangent; MS-EDEN takes none
    per_side = 2 if mode == "all" and 384 * 256 % max(row, 1) == 0 else 1
    assert given[mode] == {"fwd": per_side, "bwd": 2 * per_side if policy == "rtn" else 0}, given
    assert amaxes[mode] == {"fwd": per_side, "bwd": per_side if policy == "rtn" else 0}, amaxes
    # the reshaped row: the GELU's output, and with RTN its backward's (pointwise); never a LayerNorm's
    assert views[mode] == (0 if per_side == 1 or row == 0 else 2 if policy == "rtn" else 1), views


def test_fuse_amax_setting_is_checked(monkeypatch):
    """``FUSE_AMAX`` takes ``"off"`` / ``"norms"`` / ``"all"`` or a bool, and names the setting when it is wrong."""
    from fp4compile.passes import amax as amax_pass

    for value, mode in ((False, "off"), (True, "all"), ("1", "all"), ("0", "off"), ("Norms", "norms")):
        monkeypatch.setattr(amax_pass, "FUSE_AMAX", value)
        assert amax_pass.fuse_amax_mode() == mode
    monkeypatch.setattr(amax_pass, "FUSE_AMAX", "some")
    with pytest.raises(ValueError, match="FUSE_AMAX"):
        amax_pass.fuse_amax_mode()


def test_saved_weight_copies_option_keeps_the_gradients():
    """The backend option ``save_weight_copies`` (default ``reuse.SAVE_WEIGHT_COPIES``, on): the forward's FP4 weight
    copies are saved (their codes among the saved tensors) instead of recomputed in the backward, with the same
    output and gradients bit for bit (full-stack policy); off, no weight copy is saved (the test can fail)."""
    from fp4compile.passes import reuse

    assert reuse.SAVE_WEIGHT_COPIES is True and Settings.from_options({}).save_weight_copies is None
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128)).to(torch.bfloat16)
    x0 = torch.randn(384, 128, dtype=torch.bfloat16)         # (every dim a multiple of RHT-128; no shape shared)
    out, saved = {}, {}
    for on in (None, False):
        out[on], rec = _forward_backward(base, x0, Policy.full_stack(), save_weight_copies=on)
        saved[on] = {shp for op, dt, shp in _saved(rec) if dt == torch.uint8}
    for a, b in zip(out[None], out[False]):
        assert torch.equal(a, b)
    weight_codes = {(256, 64), (128, 128)}                     # W [N, K] -> codes [N, K/2] of the two layers
    assert weight_codes <= saved[None] and not weight_codes & saved[False], (saved[None], saved[False])


def test_save_weight_copies_option_is_validated():
    assert Settings.from_options({"save_weight_copies": False}).save_weight_copies is False
    with pytest.raises(TypeError, match="save_weight_copies must be True or False"):
        Settings.from_options({"save_weight_copies": "no"})


def test_forward_in_bf16_with_nvfp4_wgrad_saves_the_packed_wgrad_copy():
    """A late switch's graph (``late_bf16_roles="linear.fprop"``: forward GEMMs in BF16, wgrad NVFP4) has no forward
    FP4 copy of a layer input for wgrad to reuse. X is then quantized for wgrad (transposed, RHT-128 along the
    tokens, its signs drawn in the forward) in the forward and the packed copy is saved, not the bf16 X: the saved
    tensors stay packed FP4 (+ the RHT signs), as before the switch. (Until session 16 the backward quantized a
    saved bf16 X, and a run's peak memory rose at the switch to near a BF16 run's: docs/RESULTS.md, session 16.)"""
    from fp4compile.train.loop import late_policy

    torch.manual_seed(0)
    x = torch.randn(256, 64, dtype=torch.bfloat16, requires_grad=True)     # wgrad's RHT-128 runs over the tokens
    saved = {}
    for name, pol in (("before", Policy.quartet2()), ("after", late_policy(Policy.quartet2(), "linear.fprop"))):
        compiled, rec = compile_recorded(Stack().to(torch.bfloat16), pol)
        compiled(x).float().sum().backward()
        saved[name] = {(dt, shp) for op, dt, shp in _saved(rec) if op != "placeholder"}
        nvfp4 = [r["role"] for r in rec.done if r["precision"] == "nvfp4"]
        assert nvfp4.count("linear.wgrad") == 3 and nvfp4.count("linear.fprop") == (3 if name == "before" else 0)
    for name in saved:
        assert not any(dt == torch.bfloat16 for dt, _ in saved[name]), (name, saved)
    # after: X^T of each layer (K x 256 tokens) packed: codes [K, 128] and E4M3 scale bytes [K, 16], and the signs
    packed_xt = {(torch.uint8, (k, 128)) for k in (64, 128, 96)} | {(torch.uint8, (k, 16)) for k in (64, 128, 96)}
    assert packed_xt <= saved["after"] and (torch.float32, (128,)) in saved["after"], saved
    # before: the forward's row-wise copies [256, K/2], [256, K/16], which wgrad re-quantizes from
    assert {(torch.uint8, (256, k // 2)) for k in (64, 128, 96)} <= saved["before"], saved


@pytest.mark.parametrize("save", [False, None])
def test_weight_quantizes_are_must_recompute(save):
    """With ``save_weight_copies=False`` the forward's weight quantizes are tagged MUST_RECOMPUTE and the backward
    quantizes each BF16 parameter again; by default (saved copies) neither happens."""
    from torch.utils.checkpoint import CheckpointPolicy
    torch.manual_seed(0)
    model = Stack()
    compiled, rec = compile_recorded(model, RTN, save_weight_copies=save)
    compiled(torch.randn(48, 64, requires_grad=True)).sum().backward()
    g = rec.graphs[0]
    quants = [n for n, a in g.nodes(data=True) if a["target"] == "fp4compile.quantize.default"]
    assert len(quants) >= 9          # 3 x (fwd X, fwd W, dY, dYᵀ, requant Wᵀ, requant Xᵀ) minus dX of layer a
    bwd = [gm for kind, gm in rec.partitions if kind == "bwd"][0]
    # the backward recomputes W's forward copy from the BF16 parameter (a quantize of a primal)
    prim = [n for n in bwd.graph.nodes if n.op == "call_function" and n.target is torch.ops.fp4compile.quantize.default
            and n.args[0].op == "placeholder" and n.args[0].meta["val"].shape in ((128, 64), (96, 128), (32, 96))]
    assert len(prim) == (3 if save is False else 0), bwd.code
    fwd = [gm for kind, gm in rec.partitions if kind == "fwd"][0]
    tagged = [n for n in fwd.graph.nodes if n.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE
              and n.target is torch.ops.fp4compile.quantize.default]
    assert all(n.args[0].op == "placeholder" for n in tagged)                           # the fwd W copies
    assert len(tagged) == (3 if save is False else 0), fwd.code


def test_policy_change_recompiles_same_policy_same_key():
    calls = []

    def counting(policy):
        def backend(gm, ex):
            calls.append(policy.name)
            return compile_graph(gm, ex, Settings(policy, debug=True))
        return backend

    torch.manual_seed(0)
    model, x = Stack(), torch.randn(48, 64)
    a = torch.compile(model, backend=counting(RTN))
    a(x)
    a(x)
    b = torch.compile(model, backend=counting(Policy.bf16()))
    yb = b(x)
    assert calls == ["rtn-only", "bf16"]
    assert torch.allclose(yb, model(x))                        # bf16 policy: the plain model
    table = {"linear": SiteInfo("a", (("linear.fprop", NVFP4()),), 1)}
    k1 = FP4JointPass(RTN, table).uuid()
    assert k1 == FP4JointPass(rtn_policy(), dict(table)).uuid()
    assert k1 != FP4JointPass(RTN.override("a", "bf16"), table).uuid()
    assert k1 != FP4JointPass(RTN, {"linear": SiteInfo("b", (("linear.fprop", NVFP4()),), 1)}).uuid()
    assert k1 != FP4JointPass(RTN, table, gemm_lowering="dequant_mm").uuid()
    # the rewrite's module switches (read when the pass runs) are part of the key too
    from fp4compile.kernels import gemm
    from fp4compile.passes import amax, linear, reuse

    for mod, name, other in ((linear, "DQ_OPERANDS", "none"), (linear, "FUSE_BIAS", not linear.FUSE_BIAS),
                             (reuse, "PAIR_LAYOUTS", False),
                             (amax, "FUSE_AMAX", "norms" if amax.fuse_amax_mode() != "norms" else "all"),
                             (amax, "POINTWISE_ROW", amax.POINTWISE_ROW + 1024),
                             (gemm, "DEFAULT_IMPL", "full" if gemm.DEFAULT_IMPL == "auto" else "auto"),
                             (reuse, "SAVE_WEIGHT_COPIES", not reuse.SAVE_WEIGHT_COPIES)):
        old = getattr(mod, name)
        try:
            setattr(mod, name, other)
            assert k1 != FP4JointPass(RTN, table).uuid(), name
        finally:
            setattr(mod, name, old)
    assert k1 == FP4JointPass(RTN, table).uuid()
    # the backend option overrides the module default, and is part of the key the same way
    assert k1 != FP4JointPass(RTN, table, save_weight_copies=not reuse.SAVE_WEIGHT_COPIES).uuid()
    assert k1 == FP4JointPass(RTN, table, save_weight_copies=reuse.SAVE_WEIGHT_COPIES).uuid()


def test_inference_graph_no_grad():
    torch.manual_seed(0)
    model = Stack()
    ref = use_reference_linears(copy.deepcopy(model))
    compiled, rec = compile_recorded(model, RTN)
    x = torch.randn(48, 64)
    with torch.no_grad():
        y = compiled(x)
        assert rel(y, ref(x)) < 1e-5
    assert {s.role for s in rec.report().sites} == {"linear.fprop"}
    assert all(s.precision == "nvfp4" for s in rec.report().sites)


def test_dynamic_shapes_keep_static_contractions_fp4_and_warn_for_symbolic_ones():
    torch.manual_seed(0)
    model = Stack()
    rec = Recorder()
    backend = functools.partial(compile_graph, settings=Settings(RTN, debug=True, recorder=rec))
    compiled = torch.compile(model, backend=backend, dynamic=True)
    x = torch.randn(48, 64, requires_grad=True)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        y = compiled(x)
        y.sum().backward()
    assert rel(y, use_reference_linears(copy.deepcopy(model))(x)) < 1e-5
    by_role = {}
    for s in rec.report().sites:
        by_role.setdefault(s.role, set()).add(s.precision)
    assert by_role["linear.fprop"] == {"nvfp4"} and by_role["linear.dgrad"] == {"nvfp4"}   # K, N static
    assert by_role["linear.wgrad"] == {"bf16"}                                           # sum over tokens M
    assert sum("symbolic (dynamic-shape) contraction dim" in str(m.message) for m in w) == 3


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(24, 32), nn.Linear(32, 16)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_fallbacks_warn_once_per_gemm_and_stay_correct():
    torch.manual_seed(0)
    model = Odd()
    policy = Policy((), "p").override("*", NVFP4("rtn")).override("*", NVFP4("rtn", hadamard=128),
                                                                   role="linear.wgrad")
    compiled, rec = compile_recorded(model, policy)
    x = torch.randn(48, 24, requires_grad=True)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        compiled(x).sum().backward()
    msgs = [str(m.message) for m in w if "fp4compile" in str(m.message)]
    k24 = [m for m in msgs if "contraction dim 24 is not a multiple of 16" in m]
    had = [m for m in msgs if "not a multiple of the Hadamard size 128" in m]
    assert len(k24) == 1 and "(a, linear.fprop)" in k24[0], msgs
    assert len(had) == 2 and all("\n" not in m for m in msgs), msgs           # wgrad of a and b: M = 48
    assert all(" stays FP32: " in m for m in k24 + had), msgs                  # an fp32 model: the GEMMs stay fp32
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as w:                            # a bf16 model's stay BF16
        warnings.simplefilter("always")
        torch.compile(copy.deepcopy(model).bfloat16(), backend="fullstack_fp4",
                      options={"policy": policy, "debug": True})(x.detach().bfloat16())
    k24 = [str(m.message) for m in w if "contraction dim 24" in str(m.message)]
    assert len(k24) == 1 and " stays BF16: " in k24[0], k24
    recs = {(s.path, s.role): s for s in rec.report().sites}
    assert recs[("a", "linear.fprop")].precision == "bf16" and recs[("b", "linear.fprop")].precision == "nvfp4"
    assert recs[("a", "linear.wgrad")].precision == "bf16" and recs[("b", "linear.dgrad")].precision == "nvfp4"
    y_ref = model(x)                         # eager: layer a in fp32, so the output differs only by b's FP4
    assert rel(compiled(x), y_ref) < 0.2


def test_rht_signs_are_drawn_fresh_every_step():
    torch.manual_seed(0)
    model = Stack()
    exact = copy.deepcopy(model)
    h16 = NVFP4("rtn", hadamard=16)
    policy = RTN.override("*", h16, role="linear.dgrad").override("*", h16, role="linear.wgrad")
    compiled, rec = compile_recorded(model, policy)
    x = torch.randn(48, 64, requires_grad=True)
    grads = []
    for _ in range(2):
        compiled(x).sum().backward()
        grads.append(model.a.weight.grad.clone())
        model.zero_grad()
    exact(x).sum().backward()
    assert not torch.equal(grads[0], grads[1])               # different signs -> different rounding
    assert all(rel(g, exact.a.weight.grad) < 0.3 for g in grads)
    g = rec.graphs[0]
    signs = [n for n, a in g.nodes(data=True) if a["target"] == "fp4compile.rht_signs.default"]
    assert len(signs) == 6                                   # one per backward GEMM (3 dgrad + 3 wgrad)
    assert all(a["side"] == "bwd" for n, a in g.nodes(data=True) if n in signs)


@pytest.mark.parametrize("pool", [False, True])
def test_quartet2_backward_is_unbiased_statistically(monkeypatch, pool):
    """dgrad/wgrad with RHT-128 + MS-EDEN (fresh signs and seeds every step) average to the exact gradient:
    the error of the mean of 16 steps is well below a single step's error (it would not be if the graph
    reused one baked draw). ``pool``: the seeds from one draw per step (passes/seeds.py)."""
    from fp4compile.passes import seeds

    monkeypatch.setattr(seeds, "POOL_SEEDS", pool)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Linear(128, 128, bias=False)
    bwd = Policy.quartet2().resolve("x", "linear.dgrad")
    policy = Policy((), "bwd-only").override("*", bwd, role="linear.dgrad").override("*", bwd, role="linear.wgrad")
    compiled, rec = compile_recorded(model, policy)
    x = torch.randn(128, 128, requires_grad=True)
    dy = torch.randn(128, 128)
    exact_w = dy.t() @ x.detach()
    exact_x = dy @ model.weight.detach()
    gw, gx = [], []
    for _ in range(16):
        x.grad = None
        model.zero_grad()
        (compiled(x) * dy).sum().backward()
        gw.append(model.weight.grad.clone())
        gx.append(x.grad.clone())
    assert all(s.precision == "nvfp4" for s in rec.report().sites if s.role != "linear.fprop")
    for g, exact in ((gw, exact_w), (gx, exact_x)):
        single = sum(rel(a, exact) for a in g) / len(g)
        mean = rel(torch.stack(g).mean(0), exact)
        assert 0.02 < single < 0.3 and mean < 0.45 * single, (single, mean)


def cuda_graph_weight_grads(model, policy, n: int = 16):
    """``model`` (a square nn.Linear on CUDA) compiled under ``policy`` with CUDA graphs; its weight gradient from
    ``n`` replays of one x and dy, and the exact (float64) one."""
    from fp4compile.backend import fullstack_fp4

    dev, d = model.weight.device, model.weight.shape[0]
    compiled = torch.compile(model, backend=fullstack_fp4, options={"policy": policy, "mode": "reduce-overhead"})
    x = torch.randn(d, d, device=dev, requires_grad=True)
    dy = torch.randn(d, d, device=dev)
    gw = []
    for _ in range(n):
        torch.compiler.cudagraph_mark_step_begin()
        model.zero_grad(set_to_none=True)
        x.grad = None                        # a graph output: the next replay overwrites it, never accumulate
        (compiled(x) * dy).sum().backward()
        gw.append(model.weight.grad.clone())
    return gw, (dy.double().t() @ x.detach().double()).float()


@pytest.mark.gpu
@pytest.mark.parametrize("pool", [False, True])
def test_gpu_cuda_graph_replays_draw_fresh_seeds_and_stay_unbiased(monkeypatch, pool):
    """The same statistics under CUDA graphs (``mode="reduce-overhead"``): the seeds and Hadamard signs are
    drawn on the GPU inside the captured graph, so every replay must draw new ones (a graph that froze its
    first draw would give 16 identical gradients, whose mean is no better than one of them). The kernels'
    cached placeholders are dropped first, so they are created during the graphs' warmup (they must not land
    in the graph pool: fp4compile.devcache). ``pool``: the seeds from one draw per replay (passes/seeds.py)."""
    from fp4compile.kernels import launch
    from fp4compile.passes import seeds

    monkeypatch.setattr(seeds, "POOL_SEEDS", pool)
    torch._dynamo.reset()
    launch._PLACEHOLDERS.clear()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    model = nn.Linear(256, 256, bias=False, device=dev)
    bwd = Policy.quartet2().resolve("x", "linear.dgrad")
    policy = Policy((), "bwd-only").override("*", bwd, role="linear.dgrad").override("*", bwd, role="linear.wgrad")
    gw, exact_w = cuda_graph_weight_grads(model, policy)
    assert not any(torch.equal(gw[i], gw[i + 1]) for i in range(len(gw) - 1))
    single = sum(rel(a, exact_w) for a in gw) / len(gw)
    mean = rel(torch.stack(gw).mean(0), exact_w)
    assert 0.02 < single < 0.3 and mean < 0.45 * single, (single, mean)


def test_bad_options_give_clear_errors():
    model, x = Stack(), torch.randn(48, 64)
    for opts, msg in [({"polcy": "bf16"}, r"unknown option\(s\) \['polcy'\]"),
                      ({"policy": "fp8"}, "unknown policy preset 'fp8'"),
                      ({"policy": 1.0}, "must be a fp4compile.Policy"),
                      ({"dump_dir": 3}, "dump_dir must be a path"),
                      ({"gemm_lowering": "cutlass"}, "gemm_lowering must be one of"),
                      ({"mode": 3}, "mode must be a torch.compile mode name"),
                      ({"mode": "fastest"}, "unknown mode")]:
        torch._dynamo.reset()
        with pytest.raises(Exception, match=msg):
            torch.compile(model, backend="fullstack_fp4", options=opts)(x)
    with pytest.raises(ValueError, match="unknown mode"):
        from fp4compile.backend import fullstack_fp4
        gm = torch.fx.symbolic_trace(model)
        fullstack_fp4(gm, [x], mode="fastest", options={"policy": "bf16"})


def test_a_rewrite_that_fails_to_compile_falls_back_unquantized_with_one_warning(monkeypatch):
    """A failure inside compile_fx (here the joint pass raising; on the H200 once Inductor's Triton code for a pass's
    ops) leaves the graph to plain Inductor with one warning naming the error and the NVFP4 sites; the model trains
    (forward and gradients equal plain Inductor's); on_error='raise' (or FP4COMPILE_ON_ERROR=raise) re-raises."""
    import fp4compile.backend as B

    def boom(self, graph):
        raise RuntimeError("joint pass exploded\nsecond line")

    monkeypatch.setattr(FP4JointPass, "__call__", boom)
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(48, 64)
    ref_model = copy.deepcopy(model)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = torch.compile(model, backend="fullstack_fp4", options={"policy": RTN, "precompile": False})(x)
    msgs = [str(m.message) for m in w if "failed to compile" in str(m.message)]
    assert len(msgs) == 1 and "\n" not in msgs[0], msgs
    assert "RuntimeError: joint pass exploded" in msgs[0] and "a, b, c run unquantized" in msgs[0], msgs[0]
    ref = torch.compile(ref_model, backend="inductor")(x)
    torch.testing.assert_close(out, ref)
    out.square().sum().backward()
    ref.square().sum().backward()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    for how in ({"on_error": "raise"}, {}):
        torch._dynamo.reset()
        if not how:
            monkeypatch.setattr(B, "ON_ERROR", "raise")
        with pytest.raises(Exception, match="joint pass exploded"):
            torch.compile(Stack(), backend="fullstack_fp4", options={"policy": RTN, "precompile": False, **how})(x)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="on_error must be one of"):
        torch.compile(Stack(), backend="fullstack_fp4", options={"policy": RTN, "on_error": "eager"})(x)
    monkeypatch.setattr(B, "ON_ERROR", "ignore")
    torch._dynamo.reset()
    with pytest.raises(Exception, match="FP4COMPILE_ON_ERROR must be one of"):
        torch.compile(Stack(), backend="fullstack_fp4", options={"policy": RTN, "precompile": False})(x)


def test_a_backward_graph_that_fails_to_compile_falls_back_too(monkeypatch, tmp_path):
    """Inductor failing on the backward graph only: with the fallback the backward is compiled inside compile_fx, so
    the failure is caught there, and training goes on unquantized (gradients equal plain Inductor's)."""
    import torch._inductor.compile_fx as cfx

    inner = cfx.compile_fx_inner

    def failing_bw(gm, example_inputs, **kw):        # the backend's recording wrapper imports it at each call
        if kw.get("is_backward"):
            raise RuntimeError("backward lowering failed")
        return inner(gm, example_inputs, **kw)

    monkeypatch.setattr(cfx, "compile_fx_inner", failing_bw)
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(48, 64)
    ref_model = copy.deepcopy(model)
    opts = {"policy": RTN, "precompile": False, "dump_dir": str(tmp_path)}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = torch.compile(model, backend="fullstack_fp4", options=opts)(x)
    assert any("RuntimeError: backward lowering failed" in str(m.message) for m in w)
    out.sum().backward()
    ref_model(x).sum().backward()
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    torch._dynamo.reset()
    out = torch.compile(Stack(), backend="fullstack_fp4", options={**opts, "on_error": "raise"})(x)
    with pytest.raises(Exception, match="backward lowering failed"):   # lazily, as without fp4compile
        out.sum().backward()


def test_check_raises_when_a_site_is_silently_bf16():
    from torch.fx.experimental.proxy_tensor import make_fx

    from fp4compile.passes.check import FP4CheckError, check

    gm = make_fx(lambda x, w: torch.ops.aten.mm.default(x, w.t()))(torch.randn(16, 32), torch.randn(8, 32))
    mm = [n for n in gm.graph.nodes if n.target is torch.ops.aten.mm.default][0]
    mm.meta["custom"] = {"fp4_site": "linear"}
    table = {"linear": SiteInfo("fc", (("linear.fprop", NVFP4()), ("linear.dgrad", BF16), ("linear.wgrad", BF16)))}
    with pytest.raises(FP4CheckError, match="forward GEMM was not found"):
        check(gm.graph, table, [])
    rec = dict(name="linear", path="fc", role="linear.fprop", precision="nvfp4", node=mm.name)
    with pytest.raises(FP4CheckError, match="should be an fp4compile::gemm"):
        check(gm.graph, table, [rec])


def test_matmul_with_parameter_and_conv1d_style_addmm_sites():
    class Mat(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(64, 32) * 0.1)       # x @ W (W is [K, N])
            self.b = nn.Parameter(torch.zeros(32))
            self.v = nn.Parameter(torch.randn(32, 48) * 0.1)

        def forward(self, x):
            h = torch.addmm(self.b, x, self.w)                       # transformers' Conv1D form
            return h @ self.v

    torch.manual_seed(0)
    model = Mat()
    exact = copy.deepcopy(model)
    compiled, rec = compile_recorded(model, RTN)
    x = torch.randn(48, 64, requires_grad=True)
    xe = x.detach().clone().requires_grad_()
    compiled(x).sum().backward()
    exact(xe).sum().backward()
    sites = rec.report().sites
    assert len(sites) == 6 and all(s.precision == "nvfp4" for s in sites), [str(s) for s in sites]
    assert {s.path for s in sites} == {""}                        # issued by the root module
    for p, pe in ((model.w, exact.w), (model.v, exact.v), (x, xe)):
        assert 0 < rel(p.grad, pe.grad) < 0.3


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_transformers_models_train_with_all_linears_nvfp4(arch):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      attn_implementation="sdpa")
        model = transformers.GPT2LMHeadModel(cfg)
        kinds = (nn.Linear, transformers.pytorch_utils.Conv1D)
    else:
        cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       max_position_embeddings=64, attn_implementation="sdpa")
        model = transformers.LlamaForCausalLM(cfg)
        kinds = (nn.Linear,)
    exact = copy.deepcopy(model)
    ref = use_reference_linears(copy.deepcopy(model))
    compiled, rec = compile_recorded(model, RTN)
    x, _ = batch(0, B=2, T=32)
    loss = compiled(input_ids=x, labels=x).loss
    loss.backward()
    exact(input_ids=x, labels=x).loss.backward()
    loss_ref = ref(input_ids=x, labels=x).loss
    loss_ref.backward()
    paths = {n for n, m in model.named_modules() if isinstance(m, kinds)}
    sites = rec.report().sites
    by = {(s.path, s.role): s.precision for s in sites}
    for p in paths:
        for role in ("linear.fprop", "linear.dgrad", "linear.wgrad"):
            assert by.get((p, role)) == "nvfp4", (p, role, sorted(by))
    assert torch.isfinite(loss) and abs(loss.item() - loss_ref.item()) < 1e-4
    # same criterion as the nanoGPT test: far closer to the same-op reference than FP4 is to fp32
    for (n, p), pr, pe in zip(model.named_parameters(), ref.parameters(), exact.parameters()):
        if pe.grad is not None and pe.grad.norm() > 0:
            assert rel(p.grad, pr.grad) < 0.2 * rel(pr.grad, pe.grad), (n, rel(p.grad, pr.grad), rel(pr.grad, pe.grad))


# ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_inductor_path_dump_dir_and_compile_cache(tmp_path, monkeypatch):
    """The real Inductor path: same numbers as the debug variant, dump files, FX-graph cache keyed on policy."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_FORCE_DISABLE_CACHES", raising=False)
    torch._inductor.config.force_disable_caches = False
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(48, 64, requires_grad=True)
    dump = tmp_path / "dump"
    torch._dynamo.reset()
    y = torch.compile(model, backend="fullstack_fp4", options={"policy": RTN, "dump_dir": str(dump)})(x)
    y.sum().backward()
    g_ind = model.a.weight.grad.clone()
    model.zero_grad()
    y_dbg = torch.compile(model, backend="fullstack_fp4", options={"policy": RTN, "debug": True})(x)
    y_dbg.sum().backward()
    assert rel(y, y_dbg) < 1e-5 and rel(g_ind, model.a.weight.grad) < 1e-5
    files = sorted(os.listdir(dump))
    assert any(f.endswith("_fwd_graph.py") for f in files) and any(f.endswith("_bwd_graph.py") for f in files)
    code = "".join(open(dump / f).read() for f in files if f.endswith("_inductor.py"))
    assert "fp4compile.gemm" in code and "fp4compile.quantize" in code
    # same policy again -> FX graph cache hit; another policy -> miss
    counters.clear()
    torch._dynamo.reset()
    torch.compile(model, backend="fullstack_fp4", options={"policy": RTN})(x).sum().backward()
    assert counters["inductor"]["fxgraph_cache_hit"] >= 2 and counters["inductor"]["fxgraph_cache_miss"] == 0
    counters.clear()
    torch._dynamo.reset()
    torch.compile(model, backend="fullstack_fp4", options={"policy": RTN.override("b", "bf16")})(x)
    assert counters["inductor"]["fxgraph_cache_miss"] >= 1 and counters["inductor"]["fxgraph_cache_hit"] == 0


def test_choose_lowering_per_shape():
    """gemm_lowering="auto": cuBLAS (dequant_mm) for wgrad-like long-K / few-tile GEMMs and the short d x d
    GEMMs, the fp4compile::gemm op elsewhere and for symbolic sizes."""
    from fp4compile.passes.linear import choose_lowering

    assert choose_lowering(768, 768, 16384) == "dequant_mm"          # 124M proj.wgrad
    assert choose_lowering(3072, 768, 16384) == "dequant_mm"         # 124M fc1.wgrad
    assert choose_lowering(16384, 768, 768) == "dequant_mm"          # 124M proj.fprop
    assert choose_lowering(16384, 3072, 768) == "op"                 # 124M fc1.fprop
    assert choose_lowering(16384, 768, 3072) == "op"                 # 124M fc1.dgrad
    assert choose_lowering(8192, 2048, 16384) == "op"                # 1B fc1.wgrad: enough tiles
    assert choose_lowering(-1, 768, 768) == "op"


@pytest.mark.parametrize("operands", ["weight", "activation"])
def test_fprop_one_operand_nvfp4(operands):
    """NVFP4(operands=...) on linear.fprop: only that operand is quantized (RTN + 4/6 here), dequantized and
    multiplied with the other in the original BF16-style GEMM; with BF16 backward roles the gradients are the
    plain model's, bit for bit (the backward GEMMs use the unquantized operands: straight-through)."""
    torch.manual_seed(0)
    spec = NVFP4("rtn", four_over_six=True, operands=operands)
    policy = Policy((), "one-operand").override("*", spec, role="linear.fprop")
    model = nn.Linear(64, 48)
    plain = copy.deepcopy(model)
    x = torch.randn(32, 64, requires_grad=True)
    xp = x.detach().clone().requires_grad_()
    compiled, rec = compile_recorded(model, policy)
    c = torch.linspace(-1, 1, 48)
    y = compiled(x)
    (y * c).sum().backward()
    (plain(xp) * c).sum().backward()

    def fq(t):
        q = torch.ops.fp4compile.quantize(t, "rtn", True, False, 0, None, None, False)
        return torch.ops.fp4compile.dequantize(*q, 0, None, t.dtype)

    w, b = plain.weight.detach(), plain.bias.detach()
    ref = x.detach() @ fq(w).T + b if operands == "weight" else fq(x.detach()) @ w.T + b
    assert rel(y, ref) < 1e-6
    assert 1e-3 < rel(y, plain(x.detach())) < 0.2          # quantized, and by an NVFP4-sized error
    assert torch.equal(x.grad, xp.grad) and torch.equal(model.weight.grad, plain.weight.grad)
    sites = rec.report().sites
    assert [(s.role, s.precision) for s in sites if s.role == "linear.fprop"] == [("linear.fprop", "nvfp4")]
    assert f"{operands}-only" in str(spec)


def test_fprop_one_operand_with_hadamard_and_backward_fp4():
    """Weight-only NVFP4 with RHT-16 (signs drawn in the graph; the dequantization undoes the rotation) next
    to NVFP4 backward roles, compiled by Inductor: the output stays within NVFP4 error of the exact one, and it
    trains like the plain model."""
    torch.manual_seed(0)
    policy = RTN.override("*", NVFP4("rtn", hadamard=16, operands="weight"), role="linear.fprop")
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))
    plain = copy.deepcopy(model)
    compiled, _ = compile_recorded(model, policy, debug=False)      # through Inductor (the debug variant skips it)
    x = torch.randn(64, 64)
    assert rel(compiled(x), plain(x)) < 0.15
    target = torch.randn(64, 32)

    def train(m, fn):
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        losses = []
        for _ in range(15):
            loss = F.mse_loss(fn(x), target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    fp4, ref = train(model, compiled), train(plain, plain)
    assert fp4[-1] < 0.9 * fp4[0] and abs(fp4[-1] - ref[-1]) < 0.05 * ref[-1], (fp4, ref)


def test_one_operand_spec_is_fprop_only_and_validated():
    with pytest.raises(ValueError, match="operands"):
        NVFP4(operands="x")
    policy = RTN.override("*", NVFP4("rtn", operands="weight"), role="linear.dgrad")
    compiled = torch.compile(nn.Linear(32, 32), backend="fullstack_fp4", options={"policy": policy})
    with pytest.raises(Exception, match="applies to linear.fprop only"):
        compiled(torch.randn(16, 32, requires_grad=True)).sum().backward()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("operands", ["weight", "activation"])
def test_gpu_fprop_one_operand_under_cuda_graphs(operands):
    """NVFP4(operands=...) on CUDA through Inductor with CUDA graphs (how `fp4compile train` runs it): the
    output equals the BF16 GEMM of the dequantized operand to BF16 GEMM tolerance, and the gradients are the
    plain model's (straight-through; backward roles BF16)."""
    torch.manual_seed(0)
    spec = NVFP4("rtn", four_over_six=True, operands=operands)
    policy = Policy((), "one-operand").override("*", spec, role="linear.fprop")
    model = nn.Linear(256, 128).cuda().bfloat16()
    plain = copy.deepcopy(model)
    compiled = torch.compile(model, backend="fullstack_fp4", options={"policy": policy, "mode": "reduce-overhead"})
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)

    def fq(t):
        q = torch.ops.fp4compile.quantize(t, "rtn", True, False, 0, None, None, False)
        return torch.ops.fp4compile.dequantize(*q, 0, None, t.dtype)

    w, b = plain.weight.detach(), plain.bias.detach()
    ref = (x @ fq(w).T + b) if operands == "weight" else (fq(x) @ w.T + b)
    for _ in range(3):                                   # warm-up, capture, replay
        xg = x.clone().requires_grad_()
        model.zero_grad()
        y = compiled(xg)
        y.float().sum().backward()
    assert rel(y.detach(), ref) < 1e-2 and rel(y.detach(), plain(x).detach()) > 1e-3
    xp = x.clone().requires_grad_()
    plain(xp).float().sum().backward()
    assert rel(xg.grad, xp.grad) < 1e-2 and rel(model.weight.grad, plain.weight.grad) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode, row", [("all", 0), ("norms", 0), ("all", 1024)])
def test_gpu_fused_amax_same_bytes_through_inductor_and_cuda_graphs(monkeypatch, mode, row):
    """``passes/amax.py`` on CUDA through Inductor's Triton kernels with CUDA graphs: the reductions Inductor fuses
    into the LayerNorm / GELU kernels give the quantize kernels the amax their own pass would measure -- the same
    bytes: the RTN policy's output and gradients (deterministic, the gradients' amax fused too), the full stack's
    output (its backward's MS-EDEN draws fresh randomness every replay). Each mode of ``FUSE_AMAX``, and a pointwise
    producer's reduction over rows of 1024 (``POINTWISE_ROW``)."""
    from fp4compile.passes import amax as amax_pass

    monkeypatch.setattr(amax_pass, "POINTWISE_ROW", row)

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(256, 256), nn.LayerNorm(256), nn.Linear(256, 512), nn.GELU(),
                         nn.Linear(512, 256)).cuda().bfloat16()
    x0 = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16)
    for policy in ("full_stack", RTN):
        out = {}
        for on in ("off", mode):
            monkeypatch.setattr(amax_pass, "FUSE_AMAX", on)
            torch._dynamo.reset()
            model = copy.deepcopy(base)
            compiled = torch.compile(model, backend="fullstack_fp4",
                                     options={"policy": policy, "mode": "reduce-overhead"})
            for _ in range(3):                               # warm-up, capture, replay
                torch.compiler.cudagraph_mark_step_begin()
                model.zero_grad()
                xg = x0.clone().requires_grad_()
                y = compiled(xg)
                y.float().sum().backward()
            out[on] = [y.detach().clone(), xg.grad.clone()] + [p.grad.clone() for p in model.parameters()]
            if policy == "full_stack":
                out[on] = out[on][:1]
        assert all(torch.equal(a, b) for a, b in zip(out["off"], out[mode])), policy
