"""The backend option ``check_finite`` (passes/finite.py) and what it stands on: a NaN or Inf in a quantized tensor
makes the copy's global scale non-finite in every scheme (formats/schemes.py, "Non-finite inputs"; the kernels'
side is in tests/test_quantize_kernels.py)."""
import warnings

import pytest
import torch
import torch.nn as nn

import fp4compile  # noqa: F401  (registers the backend name and the ops)
from fp4compile import backend as B
from fp4compile.formats.hadamard import random_signs
from fp4compile.passes import finite


def _mlp():
    torch.manual_seed(0)
    # every dim a multiple of 128 with 128 tokens: all nine GEMMs NVFP4 under full_stack (RHT-128 in the backward)
    return nn.Sequential(nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 128))


def _compiled(model, debug=True, **options):
    torch._dynamo.reset()
    return torch.compile(model, backend="fullstack_fp4", options={"debug": debug, **options})


@pytest.mark.parametrize("rounding,hadamard", [("rtn", 0), ("rtn", 16), ("sr", 0), ("ms_eden", 0), ("ms_eden", 128)])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_nonfinite_element_makes_the_whole_copy_nonfinite(rounding, hadamard, bad):
    """The ops' reference (what CPU runs; the kernels match it in tests/test_quantize_kernels.py): one NaN or Inf
    element gives a non-finite global and a copy that decodes to no finite value, so a GEMM through it cannot return
    finite numbers. Until session 52 MS-EDEN's global was 0 here: a NaN or Inf gradient became an all-zero one."""
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    x[7, 100] = bad
    signs = random_signs(hadamard, torch.Generator().manual_seed(2)) if hadamard else None
    codes, scales, g = torch.ops.fp4compile.quantize(x, rounding, rounding == "rtn", False, hadamard, signs,
                                                     torch.tensor(5))
    assert not torch.isfinite(g)
    deq = torch.ops.fp4compile.dequantize(codes, scales, g, hadamard, signs, torch.float32)
    assert not torch.isfinite(deq).any()


def test_check_finite_raises_at_the_first_nvfp4_gemm_a_nan_reaches():
    """Forward: a NaN in the input names the first layer's fprop; backward: an Inf in the loss weights (so in the last
    layer's output gradient) names that layer's dgrad / wgrad, in the debug variant and through Inductor alike."""
    model = _mlp()
    x = torch.randn(128, 128)
    for debug in (True, False):
        c = _compiled(model, debug=debug, check_finite=True)
        c(x).sum().backward()                                     # finite: no error
        xn = x.clone()
        xn[5, 9] = float("nan")
        with pytest.raises(FloatingPointError, match=r"operand of 0 linear\.fprop \(fwd\).*check_finite"):
            c(xn)
        y = c(x)
        w = torch.ones_like(y)
        w[3, 4] = float("inf")
        with pytest.raises(FloatingPointError, match=r"4 linear\.(dgrad|wgrad) \(bwd\)"):
            (y * w).sum().backward()


def test_check_finite_changes_no_value():
    """On finite values the checks return the global scales unchanged: outputs and gradients equal, bit for bit, to
    the same compile without the option (same seeds)."""
    outs = []
    for check in (False, True):
        model = _mlp()
        c = _compiled(model, check_finite=check)
        torch.manual_seed(3)
        x = torch.randn(128, 128)
        y = c(x)
        y.square().sum().backward()
        outs.append([y.detach()] + [p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_every_global_scale_goes_through_one_check(monkeypatch):
    """In the joint graph every global-scale output of a quantize node (each of quantize_both's two) has exactly one
    user, its check, and every check names at least one GEMM."""
    seen = {}

    def spy(graph):
        n = finite.guard_finite(graph)
        globals_ = [g for q in graph.nodes if q.op == "call_function" and q.target in finite.GLOBALS
                    for g in q.users if g.args[1] in finite.GLOBALS[q.target]]
        seen.update(checks=n, globals=len(globals_), both=sum(
            1 for q in graph.nodes if q.op == "call_function" and q.target in (finite.QUANTIZE_BOTH,
                                                                                 finite.QUANTIZE_BOTH_DQ)),
            single_user=all(len(g.users) == 1 and next(iter(g.users)).target is finite.CHECK for g in globals_),
            named=all(" linear." in c.args[1] for c in graph.nodes if c.target is finite.CHECK))
        return n

    monkeypatch.setattr(B, "guard_finite", spy)
    model = _mlp()
    _compiled(model, check_finite=True)(torch.randn(128, 128)).sum().backward()
    assert seen["checks"] == seen["globals"] > 0 and seen["both"] > 0, seen
    assert seen["single_user"] and seen["named"], seen


def _attention_only_gpt(roles=("attn.qk", "attn.dsk", "attn.dsq")):
    from fp4compile.policy import Policy
    from fp4compile.train.model import GPT, config_from_preset

    torch.manual_seed(0)
    model = GPT(config_from_preset("tiny", vocab_size=256, max_seq_len=64))
    policy = Policy.bf16()
    for role in roles:   # Q-Attn's paper split by default, every linear BF16
        policy = policy.override("*", "nvfp4", role=role)
    return model, policy


def _record_checks(monkeypatch) -> dict:
    """``seen["checks"]``: what every check of the last joint graph names, sorted (the backend's guard_finite spied)."""
    seen = {}

    def spy(graph):
        n = finite.guard_finite(graph)
        seen["checks"] = sorted(c.args[1] for c in graph.nodes if c.target is finite.CHECK)
        return n

    monkeypatch.setattr(B, "guard_finite", spy)
    return seen


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_check_finite_names_the_attention_whose_copy_a_nan_reaches(monkeypatch, device):
    """Q-Attn's Q, K copies are made inside ``fp4compile::qattn``; their global scales go through the check too, in
    the forward graph: with every linear BF16 (so no other check can fire), a NaN in one token's embedding raises in
    the forward, naming the first block's attention and the copy's roles, in the debug variant and through Inductor.
    Every such check is one of the op's Q / K globals (V has no copy in the paper's split)."""
    seen = _record_checks(monkeypatch)
    model, policy = _attention_only_gpt()
    model = model.to(device)
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1)).to(device)
    for debug in (True, False) if device == "cpu" else (False,):   # CUDA: the kernels under Inductor, bf16 autocast
        c = _compiled(model, debug=debug, check_finite=True, policy=policy)
        with torch.autocast("cuda", torch.bfloat16, enabled=device == "cuda"):
            c(x).float().square().mean().backward()               # finite: no error
        assert seen["checks"] == sorted(f"blocks.{i}.attn attention's {t} copy (attn.qk, attn.ds{d}) (fwd)"
                                                for i in (0, 1) for t, d in (("Q", "q"), ("K", "k"))), seen
        emb = next(p for n, p in model.named_parameters() if "emb" in n)
        saved = emb.detach().clone()
        with torch.no_grad():
            emb[int(x[0, 3])] = float("nan")
        try:
            with pytest.raises(FloatingPointError, match=r"blocks\.0\.attn attention's [QK] copy \(attn\.qk, attn\.ds"
                                                         r"[qk]\) \(fwd\).*check_finite"), \
                    torch.autocast("cuda", torch.bfloat16, enabled=device == "cuda"):
                c(x)
        finally:
            with torch.no_grad():
                emb.copy_(saved)


def test_check_finite_checks_the_copies_that_a_mask_makes(monkeypatch):
    """With attn.pv and attn.dov in NVFP4 too, V's copy is checked as well, Q's and K's as before; with QKᵀ alone,
    the copies name attn.qk only. (With attn.pv alone V's global has no node in the joint graph -- nothing after the
    forward reads it -- so it is not checked; the module docstring says so.)"""
    seen = _record_checks(monkeypatch)
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    for roles, want in ((("attn.qk", "attn.dsk", "attn.dsq", "attn.pv", "attn.dov"),
                         ("Q copy (attn.qk, attn.dsq)", "K copy (attn.qk, attn.dsk)", "V copy (attn.pv, attn.dov)")),
                        (("attn.qk",), ("Q copy (attn.qk)", "K copy (attn.qk)"))):
        model, policy = _attention_only_gpt(roles)
        _compiled(model, check_finite=True, policy=policy)(x).float().mean().backward()
        assert seen["checks"] == sorted(f"blocks.{i}.attn attention's {w} (fwd)" for i in (0, 1) for w in want), seen


def test_check_finite_option_is_validated():
    with pytest.raises(TypeError, match="check_finite"):
        B.Settings.from_options({"check_finite": 1})
    with pytest.raises(ValueError, match="CUDA graphs"):
        B.Settings.from_options({"check_finite": True, "mode": "reduce-overhead"})
    assert B.Settings.from_options({"check_finite": True}).check_finite
    assert not B.Settings.from_options(None).check_finite
    # torch.compile(mode=...) reaches the backend as its mode argument
    model = _mlp()
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = torch.fx.symbolic_trace(model)
        with pytest.raises(ValueError, match="CUDA graphs"):
            B.fullstack_fp4(gm, [torch.randn(128, 128)], mode="max-autotune", options={"check_finite": True})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_check_finite_on_cuda():
    """The CUDA kernels under Inductor (bf16 autocast): a NaN in the input names the first fprop, an Inf in the output
    gradient the last layer's backward; finite steps run."""
    model = _mlp().cuda()
    x = torch.randn(128, 128, device="cuda")
    c = _compiled(model, debug=False, check_finite=True)
    with torch.autocast("cuda", torch.bfloat16):
        c(x).float().sum().backward()
        xn = x.clone()
        xn[5, 9] = float("nan")
        with pytest.raises(FloatingPointError, match=r"operand of 0 linear\.fprop \(fwd\)"):
            c(xn)
        y = c(x).float()
    w = torch.ones_like(y)
    w[3, 4] = float("inf")
    with pytest.raises(FloatingPointError, match=r"4 linear\.(dgrad|wgrad) \(bwd\)"):
        (y * w).sum().backward()


def test_train_passes_check_finite_to_the_backend(tmp_path, monkeypatch):
    """``fp4compile train --check-finite``: the TrainConfig field reaches the backend's options of every compile, and
    a finite run trains with it (the raising itself is tested above)."""
    from fp4compile.train import loop as L

    cfg = L.TrainConfig(out_dir=str(tmp_path / "run"), model="tiny", backend="fullstack_fp4", backend_debug=True,
                        check_finite=True, steps=2, batch_size=4, seq_len=32, val_data="", progress=False,
                        log_interval=1, warmup_steps=1)
    assert L.backend_options(cfg) == {"check_finite": True}
    assert L.backend_options(L.TrainConfig(qk_blocks="1x16", backend="fullstack_fp4")) == {"qk_blocks": "1x16"}
    seen = []
    real = B.Settings.from_options

    def spy(options):
        seen.append(dict(options or {}))
        return real(options)

    monkeypatch.setattr(B.Settings, "from_options", staticmethod(spy))
    L.train(cfg)
    assert seen and all(o.get("check_finite") is True for o in seen), seen
