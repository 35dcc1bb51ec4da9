"""fp4compile.explain / Report / dump_dir / the record API for attention passes."""
import os
import sys
import types

import pytest
import torch
import torch.nn as nn

import fp4compile
from fp4compile.inspect import Recorder, Report, SiteRecord, triton_kernel_sources
from fp4compile.policy import NVFP4, Policy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from nanogpt import GPT, batch  # noqa: E402

RTN = Policy((), "rtn-only").override("*", NVFP4("rtn"), role="linear.fprop") \
    .override("*", NVFP4("rtn"), role="linear.dgrad").override("*", NVFP4("rtn"), role="linear.wgrad") \
    .override("lm_head", "bf16")
ATTN_ROLES = ("attn.qk", "attn.pv", "attn.dov", "attn.pdo", "attn.dsk", "attn.dsq")


@pytest.fixture(scope="module")
def report():
    torch.manual_seed(0)
    model = GPT(n_layer=1)
    x, y = batch(0)
    rep = fp4compile.explain(model, x, y, policy=RTN)
    assert all(p.grad is None for p in model.parameters())          # explain leaves .grad alone
    return rep


def test_explain_lists_every_linear_gemm(report):
    roles = {(s.path, s.role): s for s in report.sites}
    for path in ("h.0.attn.c_attn", "h.0.attn.c_proj", "h.0.mlp.c_fc", "h.0.mlp.c_proj"):
        for role in ("linear.fprop", "linear.dgrad", "linear.wgrad"):
            s = roles[(path, role)]
            assert s.precision == "nvfp4" and s.spec == "nvfp4(rtn)" and len(s.shape) == 3
    assert roles[("lm_head", "linear.fprop")].precision == "bf16"
    assert roles[("lm_head", "linear.fprop")].note == "policy"
    assert roles[("h.0.mlp.c_fc", "linear.fprop")].shape == (128, 256, 64)
    assert roles[("h.0.mlp.c_fc", "linear.wgrad")].reused == "requant of fwd copy"
    assert roles[("h.0.mlp.c_fc", "linear.wgrad")].shape == (256, 64, 128)     # dW = dYᵀ·X: N x K, sum over M


def test_report_table_is_readable(report):
    text = str(report)
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["module", "path", "role"]
    assert any(l.startswith("h.0.mlp.c_fc") and "linear.wgrad" in l and "nvfp4" in l for l in lines)
    # 4 linears x 3 roles NVFP4, LM head x 3 BF16, one attention call x 6 roles BF16 (linear-only policy)
    assert lines[-1] == "12/21 GEMMs in NVFP4"
    assert sum(l.startswith("h.0.attn ") and "bf16" in l for l in lines) == 6


def test_networkx_and_dot(report):
    g = report.to_networkx()
    gemms = [a for _, a in g.nodes(data=True) if a["target"] == "fp4compile.gemm.default"]
    assert len(gemms) == 12
    assert {a["role"] for _, a in g.nodes(data=True) if a["precision"] == "nvfp4"} == {
        "linear.fprop", "linear.dgrad", "linear.wgrad"}
    assert all(a["side"] in ("fwd", "bwd") for _, a in g.nodes(data=True))
    dot = report.to_dot()
    assert dot.startswith("digraph fp4compile {") and dot.rstrip().endswith("}")
    assert dot.count("palegreen") == 12 and "->" in dot


def test_attention_pass_records_appear_in_report(monkeypatch):
    """An attention pass (hooked in by the backend when fp4compile.passes.attention exists) adds six
    records on the node it handles; explain lists them."""
    def swap_attention(gm, policy, *, qk_transform=None, qk_blocks=None):   # the pass's interface
        assert qk_transform is None and qk_blocks is None          # no such option given
        for n in gm.graph.nodes:
            if n.op == "call_function" and n.target is torch._C._nn.scaled_dot_product_attention:
                path = "h.0.attn"
                n.meta["fp4"] = [dict(name=n.name, path=path, role=r, precision=policy.resolve(path, r),
                                      shape=(32, 32, 32)) for r in ATTN_ROLES]

    fake = types.ModuleType("fp4compile.passes.attention")
    fake.swap_attention = swap_attention
    monkeypatch.setitem(sys.modules, "fp4compile.passes.attention", fake)
    torch.manual_seed(0)
    rep = fp4compile.explain(GPT(n_layer=1), *batch(0), policy=RTN.override("*", NVFP4("rtn"), role="attn.qk"))
    attn = {s.role: s for s in rep.sites if s.role.startswith("attn.")}
    assert set(attn) == set(ATTN_ROLES)
    assert attn["attn.qk"].precision == "nvfp4" and attn["attn.pv"].precision == "bf16"
    assert "attn.dsq" in str(rep)


def test_recorder_merges_plan_and_result():
    rec = Recorder()
    rec.planned = [dict(name="linear", path="fc", role="linear.fprop", precision="nvfp4"),
                   dict(name="sdpa", path="attn", role="attn.qk", precision="nvfp4")]
    rec.done = [dict(name="linear", path="fc", role="linear.fprop", precision="bf16", note="K % 16")]
    rep = rec.report()
    assert [(s.name, s.precision) for s in rep.sites] == [("linear", "bf16"), ("sdpa", "nvfp4")]
    assert isinstance(rep, Report) and isinstance(rep.sites[0], SiteRecord)


def test_dump_dir_writes_graphs(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))

    class Wrap(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, x):
            return self.m(x)

    compiled = torch.compile(Wrap(), backend="fullstack_fp4",
                             options={"policy": RTN, "debug": True, "dump_dir": str(tmp_path)})
    compiled(torch.randn(16, 32, requires_grad=True)).sum().backward()
    files = sorted(os.listdir(tmp_path))
    fwd = [f for f in files if f.endswith("_fwd_graph.py")]
    bwd = [f for f in files if f.endswith("_bwd_graph.py")]
    assert len(fwd) == 1 and len(bwd) == 1, files
    assert "fp4compile.gemm" in (tmp_path / fwd[0]).read_text()
    assert "fp4compile.quantize" in (tmp_path / bwd[0]).read_text()


def test_triton_kernel_sources_finds_loaded_kernels(monkeypatch, tmp_path):
    pytest.importorskip("triton")
    import importlib.util

    path = tmp_path / "probe.py"
    path.write_text("import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
                    "def probe_kernel(x_ptr):\n    tl.store(x_ptr, 1.0)\n")
    spec = importlib.util.spec_from_file_location("fp4compile.kernels._probe", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    out = triton_kernel_sources()
    assert "_probe.probe_kernel" in out and "tl.store(x_ptr, 1.0)" in out["_probe.probe_kernel"]
