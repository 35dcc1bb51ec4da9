"""fp4compile.train model + loop: shapes and names, schedules, bit-exact resume, checkpoint errors, Ctrl-C."""
import dataclasses
import math
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from fp4compile.train import loop as L
from fp4compile.train.model import GPT, PRESETS, config_from_preset


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: tiny models are fastest that way, and a busy shared CPU does not oversubscribe."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_cfg(tmp_path, name="run", **kw):
    base = dict(out_dir=str(tmp_path / name), model="tiny", backend="none", steps=8, batch_size=4, seq_len=32,
                log_interval=2, eval_batches=2, progress=False, warmup_steps=2, lr=3e-3)
    base.update(kw)
    return L.TrainConfig(**base)


def losses(run_dir):
    return [(r["step"], r["loss"]) for r in L.read_metrics(run_dir) if "loss" in r and "event" not in r]


# -------------------------------------------------------------------------------------------------- model


def test_model_names_are_policy_friendly_and_tied():
    m = GPT(config_from_preset("tiny", vocab_size=256, max_seq_len=32))
    names = {n for n, _ in m.named_modules()}
    for n in ("embed", "lm_head", "blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.1.mlp.fc", "blocks.1.mlp.proj"):
        assert n in names
    assert m.lm_head.weight is m.embed.weight
    assert m.num_params() == m.cfg.num_params()
    untied = GPT(config_from_preset("tiny", vocab_size=256, tie_embeddings=False))
    assert untied.num_params() == untied.cfg.num_params() == m.num_params() + 256 * 128


def test_preset_sizes():
    # non-embedding parameter counts from the shapes alone (no allocation)
    assert abs(config_from_preset("30m", vocab_size=50304).num_params(True) / 1e6 - 30.5) < 0.5
    assert abs(config_from_preset("124m", vocab_size=50304).num_params() / 1e6 - 123.6) < 1
    assert abs(config_from_preset("350m", vocab_size=50304).num_params() / 1e6 - 360) < 5
    assert abs(config_from_preset("1b", vocab_size=50304).num_params() / 1e9 - 1.03) < 0.02
    for name in PRESETS:
        c = config_from_preset(name)
        assert c.d_model % 128 == 0 and c.hidden % 128 == 0, name        # Hadamard-128 friendly
        assert c.head_dim in (64, 128), name                               # Q-Attn kernel head sizes
    with pytest.raises(ValueError, match="unknown model preset"):
        config_from_preset("7b")


def test_model_is_causal_and_loss_matches_logits():
    torch.manual_seed(0)
    m = GPT(config_from_preset("tiny", vocab_size=256, max_seq_len=16))
    x = torch.randint(0, 256, (2, 16))
    x2 = x.clone()
    x2[:, 10:] = torch.randint(0, 256, (2, 6))
    a, b = m(x), m(x2)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6) and not torch.allclose(a[:, 10:], b[:, 10:])
    y = torch.roll(x, -1, 1)
    ref = torch.nn.functional.cross_entropy(a.reshape(-1, 256), y.reshape(-1))
    assert torch.allclose(m(x, y), ref, atol=1e-6)
    with pytest.raises(ValueError, match="max_seq_len"):
        m(torch.zeros(1, 17, dtype=torch.long))


# -------------------------------------------------------------------------------------------------- schedule


def test_lr_schedules():
    p = [torch.nn.Parameter(torch.zeros(2))]
    def sched(**kw):
        cfg = L.TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1, **kw)
        return L.LRSchedule(torch.optim.SGD(p, lr=1.0), cfg)
    c = sched(schedule="cosine")
    assert c.factor(0) == pytest.approx(0.1) and c.factor(9) == pytest.approx(1.0)
    assert c.factor(10) == pytest.approx(1.0) and c.factor(55) == pytest.approx(0.55)
    assert c.factor(100) == pytest.approx(0.1)
    w = sched(schedule="wsd", decay_frac=0.2)
    assert w.factor(50) == 1.0 and w.factor(79) == 1.0 and w.factor(80) == 1.0
    assert w.factor(90) == pytest.approx(0.55) and w.factor(100) == pytest.approx(0.1)
    assert sched(schedule="constant").factor(99) == 1.0
    opt = torch.optim.SGD(p, lr=2.0)
    s = L.LRSchedule(opt, L.TrainConfig(steps=10, warmup_steps=4))
    assert s.set(1) == pytest.approx(0.5) and opt.param_groups[0]["lr"] == pytest.approx(1.0)   # factor; 2.0 x 0.5


def test_config_validation_and_sections():
    with pytest.raises(ValueError, match="backend"):
        L.TrainConfig(backend="tensorrt").validate()
    with pytest.raises(ValueError, match="parallel"):
        L.TrainConfig(parallel="tp").validate()
    with pytest.raises(ValueError, match="unknown config keys"):
        L.TrainConfig.from_dict({"model": "tiny", "lerning_rate": 1})
    with pytest.raises(ValueError, match="compile_mode"):
        L.TrainConfig(compile_mode="max-autotune").validate()
    for bad in (dict(parallel="fsdp2"), dict(grad_accum=2), dict(backend="aot_eager")):
        with pytest.raises(ValueError, match="reduce-overhead"):
            L.TrainConfig(compile_mode="reduce-overhead", backend=bad.pop("backend", "inductor"), **bad).validate()
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    auto = L.TrainConfig(backend="fullstack_fp4")
    assert auto.compile_mode == "auto" and auto.resolve_compile_mode(cuda) == "reduce-overhead"
    assert auto.resolve_compile_mode(cpu) == "default"
    assert dataclasses.replace(auto, parallel="ddp").resolve_compile_mode(cuda) == "reduce-overhead"
    for other in (dict(parallel="fsdp2"), dict(grad_accum=2), dict(backend="aot_eager"), dict(backend_debug=True),
                  dict(check_finite=True)):
        assert dataclasses.replace(auto, **other).resolve_compile_mode(cuda) == "default", other
    with pytest.raises(ValueError, match="check_finite"):       # its host reads cannot be captured
        L.TrainConfig(compile_mode="reduce-overhead", backend="fullstack_fp4", check_finite=True).validate()
    with pytest.raises(ValueError, match="check_finite is an option of the fullstack_fp4"):
        L.TrainConfig(check_finite=True).validate()
    assert L.TrainConfig(compile_mode="default").resolve_compile_mode(cuda) == "default"
    # QRoot's NS follows the step into CUDA graphs unless set explicitly
    assert auto.resolved(cuda).optim_cuda_graphs is True and auto.resolved(cpu).optim_cuda_graphs is False
    assert dataclasses.replace(auto, compile_mode="default").resolved(cuda).optim_cuda_graphs is False
    assert dataclasses.replace(auto, optim_cuda_graphs=False).resolved(cuda).optim_cuda_graphs is False
    assert dataclasses.replace(auto, parallel="ddp").resolved(cuda).optim_cuda_graphs is False
    with pytest.raises(ValueError, match="FSDP2"):
        L.TrainConfig(parallel="fsdp2", lora=True).validate()
    with pytest.raises(ValueError, match="fsdp_reshard"):
        L.TrainConfig(parallel="ddp", fsdp_bf16_params=True).validate()
    L.TrainConfig(parallel="fsdp2", fsdp_reshard=False, fsdp_bf16_params=True).validate()
    with pytest.raises(ValueError, match="max_train_tokens"):
        L.TrainConfig(max_train_tokens=0).validate()
    with pytest.raises(ValueError, match="optim_cuda_graphs"):
        L.TrainConfig(parallel="fsdp2", optim_cuda_graphs=True).validate()
    cfg = L.TrainConfig.from_dict({"model": {"model": "tiny"}, "optim": {"lr": 0.5, "grad-accum": 2}})
    assert (cfg.model, cfg.lr, cfg.grad_accum) == ("tiny", 0.5, 2)


def test_policy_loading(tmp_path):
    from fp4compile.policy import BF16, NVFP4, Policy

    assert L.load_policy("quartet2") == Policy.quartet2()
    f = tmp_path / "p.toml"
    f.write_text('preset = "full_stack"\nname = "mine"\n'
                 '[[rules]]\npattern = "blocks.0.*"\nspec = "bf16"\n'
                 '[[rules]]\npattern = "*mlp.fc"\nrole = "linear.wgrad"\nspec = { rounding = "sr", hadamard = 16 }\n')
    p = L.load_policy(str(f))
    assert p.name == "mine"
    assert p.resolve("blocks.0.attn.qkv", "linear.fprop") == BF16
    assert p.resolve("blocks.1.mlp.fc", "linear.wgrad") == NVFP4("sr", hadamard=16)
    assert p.resolve("blocks.1.mlp.fc", "linear.fprop") == Policy.full_stack().resolve("x", "linear.fprop")
    with pytest.raises(ValueError, match="unknown policy preset"):
        L.load_policy("fp2")
    # the shipped Q-Root NS variant: only optim.ns changes
    ns46 = L.load_policy(str(Path(__file__).resolve().parents[1] / "configs" / "policy_full_stack_ns46.toml"))
    assert ns46.resolve("optim", "optim.ns") == NVFP4("rtn", four_over_six=True)
    assert Policy.full_stack().resolve("optim", "optim.ns") == NVFP4("rtn")
    assert ns46.resolve("blocks.1.mlp.fc", "linear.wgrad") == Policy.full_stack().resolve("blocks.1.mlp.fc", "linear.wgrad")


# -------------------------------------------------------------------------------------------------- runs


def test_bit_exact_resume(tmp_path):
    """8 steps straight == 4 steps + resume + 4 steps: the same per-step losses bit for bit, same weights."""
    straight = L.train(tiny_cfg(tmp_path, "straight", grad_accum=2))
    half = L.train(tiny_cfg(tmp_path, "split", grad_accum=2, stop_after=4))
    assert half.status == "stopped" and half.step == 4
    resumed = L.train(tiny_cfg(tmp_path, "split", grad_accum=2, resume=True))
    assert resumed.step == 8
    a, b = losses(tmp_path / "straight"), losses(tmp_path / "split")
    assert [s for s, _ in a] == list(range(1, 9))
    assert a == b                                                       # exact float equality
    from safetensors.torch import load_file

    wa = load_file(tmp_path / "straight" / "checkpoint" / "model.safetensors")
    wb = load_file(tmp_path / "split" / "checkpoint" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert straight.summary["val_loss"] == resumed.summary["val_loss"]
    # the loss went down: it trained
    assert a[-1][1] < a[0][1] - 0.5


@pytest.mark.slow
def test_bit_exact_resume_compiled(tmp_path):
    """Same with torch.compile (aot_eager): recompiling after resume reproduces the run."""
    L.train(tiny_cfg(tmp_path, "straight", backend="aot_eager", steps=6))
    L.train(tiny_cfg(tmp_path, "split", backend="aot_eager", steps=6, stop_after=3))
    L.train(tiny_cfg(tmp_path, "split", backend="aot_eager", steps=6, resume=True))
    assert losses(tmp_path / "straight") == losses(tmp_path / "split")


def test_structural_diffs_lora_rank_only_with_lora(tmp_path):
    """lora_rank is structural only where a run has LoRA-SVD: a BF16 run resumes under a study-wide
    --lora-rank flag (session 11's fork with --lora-rank 64 failed on its BF16 arm), a LoRA run does not."""
    cfg = tiny_cfg(tmp_path, steps=2, val_data="")
    saved = dataclasses.asdict(cfg)
    assert L.structural_diffs(saved, dataclasses.replace(cfg, lora_rank=64)) == []
    assert L.structural_diffs(saved, dataclasses.replace(cfg, lora=True, lora_rank=64)) == [
        "lora: checkpoint False != run True", "lora_rank: checkpoint None != run 64"]
    lora = dict(saved, lora=True, lora_rank=32)
    assert L.structural_diffs(lora, dataclasses.replace(cfg, lora=True, lora_rank=64)) == [
        "lora_rank: checkpoint 32 != run 64"]
    assert L.structural_diffs(lora, dataclasses.replace(cfg, lora=True, lora_rank=32)) == []
    # a LoRA checkpoint from before lora_train_factors existed had trained factors
    legacy = {k: v for k, v in lora.items() if k != "lora_train_factors"}
    run = dataclasses.replace(cfg, lora=True, lora_rank=32, lora_train_factors=True)
    assert L.structural_diffs(legacy, run) == []
    assert L.structural_diffs(legacy, dataclasses.replace(run, lora_train_factors=False)) == [
        "lora_train_factors: checkpoint None != run False"]
    # end to end: the no-LoRA run resumes with another rank setting
    L.train(dataclasses.replace(cfg, stop_after=1))
    r = L.train(dataclasses.replace(cfg, lora_rank=64, resume=True))
    assert r.summary["steps"] == 2


def test_resolved_records_the_default_lora_rank(tmp_path):
    """With LoRA-SVD and no --lora-rank, the resolved config (what a checkpoint saves) carries prepare()'s
    DEFAULT_RANK, so a checkpoint written before a change of the default (which saved None) is refused by name
    instead of failing on the factors' shapes; a run without LoRA-SVD records nothing."""
    from fp4compile.nn import DEFAULT_RANK

    cpu = torch.device("cpu")
    cfg = tiny_cfg(tmp_path, steps=2, val_data="")
    assert cfg.resolved(cpu).lora_rank is None
    assert dataclasses.replace(cfg, lora=True).resolved(cpu).lora_rank == DEFAULT_RANK
    assert dataclasses.replace(cfg, lora=True, lora_rank=8).resolved(cpu).lora_rank == 8
    old = dict(dataclasses.asdict(cfg), lora=True)                       # lora_rank None, as saved before
    assert L.structural_diffs(old, dataclasses.replace(cfg, lora=True).resolved(cpu)) == [
        f"lora_rank: checkpoint None != run {DEFAULT_RANK}"]


def test_checkpoint_errors(tmp_path):
    cfg = tiny_cfg(tmp_path, steps=2, val_data="")
    L.train(cfg)
    with pytest.raises(L.CheckpointError, match="already holds a checkpoint"):
        L.train(cfg)
    # mismatched model
    with pytest.raises(L.CheckpointError, match=r"incompatible run:\n  model: checkpoint 'tiny' != run 'cpu'"):
        L.train(dataclasses.replace(cfg, model="cpu", resume=True))
    # corrupt model file: one flipped byte in the tensor data
    mpath = tmp_path / "run" / "checkpoint" / "model.safetensors"
    raw = bytearray(mpath.read_bytes())
    raw[-5] ^= 0xFF
    mpath.write_bytes(bytes(raw))
    with pytest.raises(L.CheckpointError, match="corrupt: its sha256"):
        L.train(dataclasses.replace(cfg, resume=True, steps=4))
    # truncated state file
    spath = tmp_path / "run" / "checkpoint" / "state.pt"
    spath.write_bytes(spath.read_bytes()[:100])
    with pytest.raises(L.CheckpointError, match="state .* is corrupt or unreadable"):
        L.train(dataclasses.replace(cfg, resume=True, steps=4))
    spath.unlink()
    with pytest.raises(L.CheckpointError, match="state.pt is missing"):
        L.train(dataclasses.replace(cfg, resume=True, steps=4))


def test_resume_without_checkpoint_starts_fresh_and_warns_on_soft_changes(tmp_path):
    cfg = tiny_cfg(tmp_path, steps=2, val_data="", resume=True)
    assert L.train(cfg).step == 2
    with pytest.warns(UserWarning, match="lr: 0.003 -> 0.001"):
        r = L.train(dataclasses.replace(cfg, steps=3, lr=1e-3))
    assert r.step == 3


def test_qroot_ns_schedule_reaches_the_root_group():
    model = GPT(config_from_preset("tiny", vocab_size=64, max_seq_len=32))
    cfg = L.TrainConfig(model="tiny", optimizer="qroot+adamw", policy="bf16", ns_schedule="polar_express")
    cfg.validate()
    opt = L.build_optimizer(model, cfg, None)
    roots = [g for g in opt.param_groups if g["use_root"]]
    assert len(roots) == 1 and roots[0]["ns_schedule"] == "polar_express"
    assert all(g["ns_schedule"] == "root" for g in opt.param_groups if not g["use_root"])   # QRoot's default
    with pytest.raises(ValueError, match="ns_schedule"):
        L.TrainConfig(optimizer="qroot", ns_schedule="newton").validate()
    with pytest.raises(ValueError, match="ns_schedule"):
        L.TrainConfig(optimizer="adamw", ns_schedule="jordan").validate()


def test_qroot_ns_shift_reaches_the_root_group():
    """--ns-shift / --no-ns-shift set QRoot's ns_shift on the Root group only; None keeps QRoot's default (on);
    the key is QRoot's, so other optimizers refuse it."""
    for value, expect in ((None, True), (False, False), (True, True)):
        cfg = L.TrainConfig(model="tiny", optimizer="qroot+adamw", policy="bf16", ns_shift=value)
        cfg.validate()
        opt = L.build_optimizer(GPT(config_from_preset("tiny", vocab_size=64, max_seq_len=32)), cfg, None)
        roots = [g for g in opt.param_groups if g["use_root"]]
        assert len(roots) == 1 and roots[0]["ns_shift"] is expect
    with pytest.raises(ValueError, match="ns_shift"):
        L.TrainConfig(optimizer="adamw", ns_shift=False).validate()


def test_qroot_ns_accuracy_options_reach_the_root_group():
    """--ns-sym-b, --ns-residual x,xt and --ns-shared-x set QRoot's ns_sym_b / ns_residual / ns_shared_x on the Root
    group (the comma list as QRoot's tuple); an unknown operand, or the shared X with a residual, is QRoot's clear
    error; other optimizers refuse them."""
    model = GPT(config_from_preset("tiny", vocab_size=64, max_seq_len=32))
    cfg = L.TrainConfig(model="tiny", optimizer="qroot", ns_sym_b=True, ns_residual="x, xt")
    cfg.validate()
    root = [g for g in L.build_optimizer(model, cfg, None).param_groups if g["use_root"]][0]
    assert root["ns_sym_b"] is True and root["ns_residual"] == ("x", "xt") and root["ns_shared_x"] is False
    root = [g for g in L.build_optimizer(model, L.TrainConfig(model="tiny", optimizer="qroot"), None).param_groups
            if g["use_root"]][0]
    assert root["ns_sym_b"] is True and root["ns_shared_x"] is True and root["ns_residual"] == ()   # the defaults
    cfg = L.TrainConfig(model="tiny", optimizer="qroot", ns_sym_b=False, ns_shared_x=False)
    root = [g for g in L.build_optimizer(model, cfg, None).param_groups if g["use_root"]][0]
    assert root["ns_sym_b"] is False and root["ns_shared_x"] is False
    with pytest.raises(ValueError, match="ns_residual"):
        L.build_optimizer(model, L.TrainConfig(model="tiny", optimizer="qroot", ns_residual="x,b"), None)
    with pytest.raises(ValueError, match="ns_residual"):
        L.TrainConfig(optimizer="adamw", ns_residual="x").validate()
    cfg = L.TrainConfig(model="tiny", optimizer="qroot", ns_sym_b=True, ns_shared_x=True)
    root = [g for g in L.build_optimizer(model, cfg, None).param_groups if g["use_root"]][0]
    assert root["ns_shared_x"] is True and root["ns_sym_b"] is True
    with pytest.raises(ValueError, match="ns_shared_x"):
        L.TrainConfig(optimizer="qadamw", ns_shared_x=True).validate()
    with pytest.raises(ValueError, match="shared_x"):
        L.build_optimizer(model, L.TrainConfig(model="tiny", optimizer="qroot", ns_shared_x=True, ns_residual="x2d"),
                          None)


def test_qadamw_v_state_reaches_every_qadamw_group():
    """--qadamw-v-state sets Q-AdamW's v_state (QAdamW, and QRoot's Q-AdamW part); None keeps "floored"; an
    optimizer without Q-AdamW, or a value Q-AdamW does not know, is refused."""
    model = GPT(config_from_preset("tiny", vocab_size=64, max_seq_len=32))
    for opt_name in ("qadamw", "qroot"):
        for value, expect in ((None, "floored"), ("signed", "signed")):
            cfg = L.TrainConfig(model="tiny", optimizer=opt_name, policy="bf16", qadamw_v_state=value)
            cfg.validate()
            groups = L.build_optimizer(model, cfg, None).param_groups
            assert {g["v_state"] for g in groups} == {expect}
    with pytest.raises(ValueError, match="qadamw_v_state"):
        L.TrainConfig(optimizer="qroot+adamw", qadamw_v_state="signed").validate()
    with pytest.raises(ValueError, match="qadamw_v_state"):
        L.TrainConfig(optimizer="qadamw", qadamw_v_state="clamped").validate()


def test_qadamw_v_four_over_six_reaches_every_qadamw_group():
    """--no-qadamw-v-four-over-six turns Q-AdamW's 4/6 scaling of v off (QAdamW, and QRoot's Q-AdamW part); None keeps
    it on; an optimizer without Q-AdamW, or a value that is not a bool, is refused."""
    model = GPT(config_from_preset("tiny", vocab_size=64, max_seq_len=32))
    for opt_name in ("qadamw", "qroot"):
        for value, expect in ((None, True), (False, False)):
            cfg = L.TrainConfig(model="tiny", optimizer=opt_name, policy="bf16", qadamw_v_four_over_six=value)
            cfg.validate()
            groups = L.build_optimizer(model, cfg, None).param_groups
            assert {g["v_four_over_six"] for g in groups} == {expect}
            assert {g["m_four_over_six"] for g in groups} == {True}      # m keeps its own setting
    with pytest.raises(ValueError, match="qadamw_v_four_over_six"):
        L.TrainConfig(optimizer="adamw", qadamw_v_four_over_six=False).validate()
    with pytest.raises(ValueError, match="qadamw_v_four_over_six"):
        L.TrainConfig(optimizer="qadamw", qadamw_v_four_over_six="no").validate()


def test_qroot_ns_steps_reaches_the_root_group():
    """--ns-steps sets QRoot's ns_steps on the Root group (None keeps 5); QRoot validates it; other optimizers
    refuse it."""
    model = GPT(config_from_preset("tiny", vocab_size=64, max_seq_len=32))
    for value, expect in ((None, 5), (2, 2)):
        cfg = L.TrainConfig(model="tiny", optimizer="qroot+adamw", policy="bf16", ns_steps=value)
        cfg.validate()
        roots = [g for g in L.build_optimizer(model, cfg, None).param_groups if g["use_root"]]
        assert len(roots) == 1 and roots[0]["ns_steps"] == expect
    with pytest.raises(ValueError, match="ns_steps"):
        L.build_optimizer(model, L.TrainConfig(model="tiny", optimizer="qroot+adamw", policy="bf16", ns_steps=0), None)
    with pytest.raises(ValueError, match="ns_steps"):
        L.TrainConfig(optimizer="adamw", ns_steps=2).validate()


def test_logged_lr_is_the_lr_flag_not_qroots_matrix_lr(tmp_path):
    L.train(tiny_cfg(tmp_path, steps=3, val_data="", optimizer="qroot+adamw", lr=3e-3, matrix_lr=0.05,
                     warmup_steps=2, schedule="constant"))
    lrs = [r["lr"] for r in L.read_metrics(tmp_path / "run") if "lr" in r]
    assert lrs == pytest.approx([1.5e-3, 3e-3, 3e-3])


def test_time_budget_does_not_count_compile_steps_as_step_time():
    # a 70 s compile step must not stop a 250 s budget after one step (the session-5 LoRA realign run did)
    assert not L.out_of_time(71.0, [70.0], 250.0)
    assert not L.out_of_time(80.0, [70.0, 9.0], 250.0)
    assert L.out_of_time(225.0, [70.0, 9.0], 250.0)           # the compile steps alone used the budget
    # steady steps: room for three more plus 30 s of checkpoint
    assert not L.out_of_time(100.0, [70.0, 9.0, 1.0, 1.0], 250.0)
    assert L.out_of_time(218.0, [70.0, 9.0, 1.0, 1.0], 250.0)  # 218 + 3 + 30 > 250
    assert not L.out_of_time(216.0, [70.0, 9.0, 1.0, 1.0], 250.0)


def test_time_budget_checkpoints_and_resumes(tmp_path):
    cfg = tiny_cfg(tmp_path, steps=50, val_data="", max_seconds=1e-3)
    r = L.train(cfg)
    assert r.status == "time_budget" and 1 <= r.step < 50
    assert (tmp_path / "run" / "checkpoint" / "model.safetensors").is_file()
    r2 = L.train(dataclasses.replace(cfg, steps=r.step + 2, max_seconds=None, resume=True))
    assert r2.status == "done" and r2.step == r.step + 2
    assert [s for s, _ in losses(tmp_path / "run")] == list(range(1, r.step + 3))


def test_time_budget_reserve_follows_the_measured_checkpoint_time():
    # 30 s until a save has been timed, then 2 x the save + 5 s (session 20 kept 30 + 40 s for 22-24 s of work)
    assert L.checkpoint_reserve(None) == L.CKPT_RESERVE_S == 30.0
    assert L.checkpoint_reserve(0.0) == 30.0
    assert L.checkpoint_reserve(2.5) == 10.0
    assert L.checkpoint_reserve(40.0) == 85.0      # a slow save gets more than the default, not less
    steps = [70.0, 9.0, 1.0, 1.0]
    assert L.out_of_time(238.0, steps, 250.0, reserve=10.0)      # 238 + 3 + 10 > 250
    assert not L.out_of_time(236.0, steps, 250.0, reserve=10.0)
    assert L.out_of_time(236.0, steps, 250.0)                    # the default 30 s would have stopped it


def test_deadline_is_the_smaller_budget_and_counts_from_the_clock():
    assert L.time_budget(None, None, 1000.0) is None
    assert L.time_budget(120.0, None, 1000.0) == 120.0
    assert L.time_budget(None, 1100.0, 1000.0) == 100.0
    assert L.time_budget(120.0, 1100.0, 1000.0) == 100.0
    assert L.time_budget(80.0, 1100.0, 1000.0) == 80.0
    assert L.time_budget(None, 990.0, 1000.0) == -10.0           # already past: stop after the first step


def test_deadline_stops_checkpoints_records_the_save_and_resume_reserves_it(tmp_path, monkeypatch):
    cfg = tiny_cfg(tmp_path, steps=50, val_data="", deadline=time.time() - 1.0)
    r = L.train(cfg)
    assert r.status == "time_budget" and 1 <= r.step < 50
    save_s = json.loads((tmp_path / "run" / "summary.json").read_text())["checkpoint_s"]
    assert save_s is not None and save_s > 0
    seen = []
    real = L.out_of_time

    def spy(elapsed, step_times, max_seconds, ahead=3, reserve=L.CKPT_RESERVE_S):
        seen.append((max_seconds, reserve))
        return real(elapsed, step_times, max_seconds, ahead, reserve)

    monkeypatch.setattr(L, "out_of_time", spy)
    r2 = L.train(dataclasses.replace(cfg, steps=r.step + 2, deadline=time.time() + 3600.0, resume=True))
    assert r2.status == "done" and r2.step == r.step + 2
    assert seen and all(res == pytest.approx(2.0 * save_s + 5.0) for _, res in seen)
    assert all(3000.0 < b <= 3600.0 for b, _ in seen)


def test_stop_file_stops_after_the_current_step_is_removed_and_resume_matches(tmp_path):
    """``stop_file``: once the file exists the run checkpoints after the current step and stops ("stopped"), removes
    the file (so a resume with the same config trains on), and the stop + resume gives the straight run's losses."""
    stop = tmp_path / "STOP"
    cfg = tiny_cfg(tmp_path, "stopped", steps=8, val_data="", log_interval=2, stop_file=str(stop))
    L.train(dataclasses.replace(cfg, out_dir=str(tmp_path / "absent")))     # no file: the run is not stopped
    assert L.read_metrics(tmp_path / "absent")[-1]["step"] == 8
    stop.write_text("")
    r = L.train(cfg)
    assert (r.status, r.step) == ("stopped", 1) and not stop.exists()
    assert torch.load(tmp_path / "stopped" / "checkpoint" / "state.pt", weights_only=True)["step"] == 1
    r2 = L.train(dataclasses.replace(cfg, resume=True))
    assert (r2.status, r2.step) == ("done", 8)
    assert losses(tmp_path / "stopped") == losses(tmp_path / "absent")


def test_ctrl_c_saves_a_checkpoint_and_resume_matches(tmp_path):
    cfg = tiny_cfg(tmp_path, "intr", steps=400, val_data="", log_interval=1, schedule="constant")
    metrics = tmp_path / "intr" / "metrics.jsonl"

    def interrupt_after_a_few_steps():
        deadline = time.time() + 120
        while time.time() < deadline:
            if metrics.exists() and sum(1 for ln in metrics.read_text().splitlines() if '"loss"' in ln) >= 3:
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.02)

    before = signal.getsignal(signal.SIGINT)    # Python's default_int_handler, or SIG_IGN in a background job
    t = threading.Thread(target=interrupt_after_a_few_steps, daemon=True)
    t.start()
    r = L.train(cfg)
    t.join()
    assert r.status == "interrupted" and 3 <= r.step < 400
    state = torch.load(tmp_path / "intr" / "checkpoint" / "state.pt", weights_only=True)
    assert state["step"] == r.step
    # the interrupted run + resume gives the same losses as a straight run of the same length
    L.train(dataclasses.replace(cfg, steps=r.step + 2, resume=True))
    L.train(tiny_cfg(tmp_path, "straight", steps=r.step + 2, val_data="", log_interval=1, schedule="constant"))
    assert losses(tmp_path / "intr") == losses(tmp_path / "straight")
    assert signal.getsignal(signal.SIGINT) is before                      # handler restored


def test_missing_features_give_clear_errors(tmp_path, monkeypatch):
    import fp4compile

    def unavailable(name):
        raise ImportError(f"cannot import name {name!r}")

    for attr in ("QAdamW", "QRoot", "prepare"):
        monkeypatch.delitem(fp4compile.__dict__, attr, raising=False)
    monkeypatch.setattr(fp4compile, "__getattr__", unavailable)
    with pytest.raises(L.FeatureUnavailable, match="QAdamW is not available.*optimizer issue"):
        L.train(tiny_cfg(tmp_path, "a", optimizer="qadamw"))
    with pytest.raises(L.FeatureUnavailable, match="prepare is not available.*LoRA-SVD"):
        L.train(tiny_cfg(tmp_path, "b", lora=True))


def test_evaluation_frees_each_batch_graph_before_the_next_forward():
    """Evaluation runs the training graph with autograd on: a batch's loss carries the saved activations,
    so it must be gone before the next batch's forward (holding it doubled the evaluation's peak memory)."""
    import contextlib
    import weakref

    import numpy as np

    from fp4compile.train import data as D

    torch.manual_seed(0)
    model = GPT(config_from_preset("tiny", vocab_size=256, max_seq_len=32))
    refs = []

    def fn(x, y):
        assert all(r() is None for r in refs), "an earlier batch's loss (and its graph) is still alive"
        loss = model(x, y)
        assert loss.grad_fn is not None
        refs.append(weakref.ref(loss))
        return loss

    batches = D.TokenBatches(np.arange(4096, dtype=np.uint16) % 256, 32, shuffle=False, name="t")
    v = L.evaluate(fn, batches, 3, 4, 0, 1, torch.device("cpu"), contextlib.nullcontext)
    assert len(refs) == 3 and math.isfinite(v)


def test_metrics_log_contents(tmp_path):
    r = L.train(tiny_cfg(tmp_path, steps=4, eval_interval=2))
    recs = L.read_metrics(tmp_path / "run")
    assert recs[0]["event"] == "start" and recs[0]["params"] > 0
    assert [x["step"] for x in recs if "val_loss" in x] == [2, 4]
    assert any("tok_per_s" in x and x["tok_per_s"] > 0 for x in recs)
    assert recs[-1]["event"] == "done"
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s == r.summary and s["peak_mem_mib"] > 10 and s["tokens"] == 4 * 4 * 32
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    assert cfg["model"] == "tiny"


def test_bit_exact_resume_with_lora_realignment(tmp_path):
    """LoRA-SVD realigns every 3 steps; its step count and SVD RNG live in the checkpoint, so a run split at
    step 4 realigns at step 6 exactly like the straight run."""
    pytest.importorskip("fp4compile.nn.lora_svd")
    kw = dict(lora=True, lora_rank=8, lora_realign_every=3, val_data="")
    L.train(tiny_cfg(tmp_path, "straight", **kw))
    L.train(tiny_cfg(tmp_path, "split", stop_after=4, **kw))
    L.train(tiny_cfg(tmp_path, "split", resume=True, **kw))
    assert losses(tmp_path / "straight") == losses(tmp_path / "split")
    # realignment changes the run (so the equality above is not vacuous)
    L.train(tiny_cfg(tmp_path, "norealign", **{**kw, "lora_realign_every": 0}))
    assert losses(tmp_path / "norealign")[-1] != losses(tmp_path / "straight")[-1]
    # every realignment is a metrics event with its function-preservation check
    ev = [r for r in L.read_metrics(tmp_path / "straight") if r.get("event") == "lora_realign"]
    assert [r["step"] for r in ev] == [3, 6] and [r["realignments"] for r in ev] == [1, 2]
    assert all(r["layers"] > 0 and 0 <= r["max_rel_change"] < 1e-5 for r in ev), ev
    # the optimizer-state rule is a config choice: resetting the factors' moments gives another run
    L.train(tiny_cfg(tmp_path, "reset", lora_state_remap="reset", **kw))
    a, b = losses(tmp_path / "reset"), losses(tmp_path / "straight")
    assert a[:1] == b[:1] and a[-1] != b[-1]
    with pytest.raises(ValueError, match="state_remap"):
        L.train(tiny_cfg(tmp_path, "bad", lora_state_remap="rotate", **kw))
    # no realignment before lora_realign_after: the multiples of 3 from step 5 on
    L.train(tiny_cfg(tmp_path, "late", lora_realign_after=5, **kw))
    assert [r["step"] for r in L.read_metrics(tmp_path / "late") if r.get("event") == "lora_realign"] == [6]


def test_fork_continues_the_source_run_bit_exactly(tmp_path):
    """init_from: a run forked from another run's step-4 checkpoint with the same settings continues it bit for
    bit (weights, optimizer state, schedule, RNG, data position); its log starts at the fork with a start event
    naming the source; stopped and resumed, a fork continues from its own checkpoint (same numbers again)."""
    kw = dict(val_data="")
    L.train(tiny_cfg(tmp_path, "straight", **kw))
    L.train(tiny_cfg(tmp_path, "src", stop_after=4, **kw))
    res = L.train(tiny_cfg(tmp_path, "fork", init_from=str(tmp_path / "src"), **kw))
    assert res.step == 8
    straight, fork = losses(tmp_path / "straight"), losses(tmp_path / "fork")
    assert [s for s, _ in fork] == [5, 6, 7, 8] and fork == straight[4:]           # exact float equality
    start = [r for r in L.read_metrics(tmp_path / "fork") if r.get("event") == "start"]
    assert len(start) == 1 and start[0]["step"] == 4 and start[0]["forked_from"].endswith("checkpoint")
    # the source is untouched and a fork of a fork stopped at 6, then resumed, ends where the straight run does
    assert torch.load(tmp_path / "src" / "checkpoint" / "state.pt", weights_only=False)["step"] == 4
    L.train(tiny_cfg(tmp_path, "fork2", init_from=str(tmp_path / "src" / "checkpoint"), stop_after=6, **kw))
    L.train(tiny_cfg(tmp_path, "fork2", init_from=str(tmp_path / "src"), resume=True, **kw))
    assert losses(tmp_path / "fork2") == straight[4:]
    # a fork changes what it is for (here the learning rate, with a warning) and nothing else
    with pytest.warns(UserWarning, match="forking from .* changed settings: lr"):
        L.train(tiny_cfg(tmp_path, "fork_lr", init_from=str(tmp_path / "src"), **{**kw, "lr": 1e-3}))
    assert losses(tmp_path / "fork_lr")[0] == straight[4] and losses(tmp_path / "fork_lr")[-1] != straight[-1]


def test_fork_errors(tmp_path):
    """A fork needs a readable single-process checkpoint of a run without LoRA-SVD, with the same model,
    optimizer and data order; adding LoRA-SVD is for AdamW; a fork runs in one process."""
    kw = dict(val_data="")
    with pytest.raises(L.CheckpointError, match="incomplete"):
        L.train(tiny_cfg(tmp_path, "f0", init_from=str(tmp_path / "nothing"), **kw))
    L.train(tiny_cfg(tmp_path, "src", stop_after=2, **kw))
    with pytest.raises(L.CheckpointError, match="seed: checkpoint 0 != run 1"):
        L.train(tiny_cfg(tmp_path, "f1", init_from=str(tmp_path / "src"), seed=1, **kw))
    with pytest.raises(L.CheckpointError, match="batch_size"):
        L.train(tiny_cfg(tmp_path, "f2", init_from=str(tmp_path / "src"), batch_size=2, **kw))
    with pytest.raises(L.CheckpointError, match="training tokens: fingerprint"):      # same source, other tokens
        L.train(tiny_cfg(tmp_path, "f2b", init_from=str(tmp_path / "src"), max_train_tokens=50_000, **kw))
    with pytest.raises(ValueError, match="init_from with lora=True"):
        L.train(tiny_cfg(tmp_path, "f3", init_from=str(tmp_path / "src"), lora=True, optimizer="qadamw", **kw))
    with pytest.raises(ValueError, match="one process"):
        tiny_cfg(tmp_path, "f4", init_from=str(tmp_path / "src"), parallel="ddp").validate()
    pytest.importorskip("fp4compile.nn.lora_svd")
    L.train(tiny_cfg(tmp_path, "lora_src", stop_after=2, lora=True, lora_rank=4, **kw))
    with pytest.raises(L.CheckpointError, match="trained with LoRA-SVD"):
        L.train(tiny_cfg(tmp_path, "f5", init_from=str(tmp_path / "lora_src"), lora=True, lora_rank=4, **kw))


def test_fork_adds_lora_svd_with_the_dense_optimizer_state(tmp_path):
    """A fork of a run without LoRA-SVD that adds it: the split preserves the function at the fork (its first
    loss is the source's next loss to FP32 rounding), every parameter, factors included, continues the source's
    AdamW step count (the factors' moments come from the dense weights'), and the realignment schedule counts the
    run's steps (realign_every=3 from the fork at 4: step 6). LR 3e-2, so that four steps grow the weights'
    singular values enough for realign_scale "hold" to lower beta at the fork."""
    pytest.importorskip("fp4compile.nn.lora_svd")
    kw = dict(val_data="", lr=3e-2)
    L.train(tiny_cfg(tmp_path, "straight", **kw))
    L.train(tiny_cfg(tmp_path, "src", stop_after=4, **kw))
    L.train(tiny_cfg(tmp_path, "fork", init_from=str(tmp_path / "src"), lora=True, lora_rank=8,
                     lora_realign_every=3, **kw))
    straight, fork = losses(tmp_path / "straight"), losses(tmp_path / "fork")
    assert fork[0][0] == 5 and fork[0][1] == pytest.approx(straight[4][1], rel=1e-5)
    assert fork[-1][1] != straight[-1][1]                                          # LoRA-SVD changes the run
    state = torch.load(tmp_path / "fork" / "checkpoint" / "state.pt", weights_only=False)
    steps = {float(st["step"]) for st in state["optimizer"]["state"].values()}
    assert steps == {8.0}, steps                                                   # 4 from the source + 4
    factors = [st for st in state["optimizer"]["state"].values() if st["exp_avg"].dim() == 2
               and min(st["exp_avg"].shape) == 8]
    assert len(factors) >= 2 and all(st["exp_avg_sq"].min() >= 0 for st in factors)
    ev = [r for r in L.read_metrics(tmp_path / "fork") if r.get("event") == "lora_realign"]
    assert [r["step"] for r in ev] == [6] and 0 < ev[0]["beta_min"] <= ev[0]["beta_max"]
    # realign_scale "hold" (the default): the fork's betas are what hold keeps relative to the initial weights
    # (powers of two, in the start event and the checkpoint); "keep": prepare's beta
    start = [r for r in L.read_metrics(tmp_path / "fork") if r.get("event") == "start"][0]
    betas = state["lora"]["betas"]
    assert betas and all(math.log2(b) == round(math.log2(b)) for b in betas.values())
    assert start["lora_betas"] and max(start["lora_betas"]) < 1
    assert all(math.log2(b) == round(math.log2(b)) for b in start["lora_betas"])
    L.train(tiny_cfg(tmp_path, "fork_keep", init_from=str(tmp_path / "src"), lora=True, lora_rank=8,
                     lora_realign_scale="keep", **kw))
    start = [r for r in L.read_metrics(tmp_path / "fork_keep") if r.get("event") == "start"][0]
    assert start["lora_betas"] == [1.0]


def test_bit_exact_resume_with_lora_realign_scale_hold(tmp_path):
    """With realign_scale="hold", beta changes at a realignment (0.3 -> a power of two) and is part of the
    function: the checkpoint carries it, so a run split at step 4 matches the straight run bit for bit."""
    pytest.importorskip("fp4compile.nn.lora_svd")
    kw = dict(lora=True, lora_rank=8, lora_realign_every=3, lora_beta=0.3, lora_realign_scale="hold", val_data="")
    L.train(tiny_cfg(tmp_path, "straight", **kw))
    L.train(tiny_cfg(tmp_path, "split", stop_after=4, **kw))
    L.train(tiny_cfg(tmp_path, "split", resume=True, **kw))
    assert losses(tmp_path / "straight") == losses(tmp_path / "split")
    betas = torch.load(tmp_path / "split" / "checkpoint" / "state.pt", weights_only=False)["lora"]["betas"]
    assert betas and all(b in (0.25, 0.5) for b in betas.values()), betas
    L.train(tiny_cfg(tmp_path, "keep", **{**kw, "lora_realign_scale": "keep"}))
    assert losses(tmp_path / "keep")[-1] != losses(tmp_path / "straight")[-1]
    with pytest.raises(ValueError, match="realign_scale"):
        L.train(tiny_cfg(tmp_path, "bad", **{**kw, "lora_realign_scale": "grow"}))




@pytest.mark.parametrize("optimizer", ["adamw", "qroot+adamw"])
def test_lora_frozen_factors_train_like_the_dense_model(tmp_path, optimizer):
    """lora_train_factors=False: without quantization (backend none) the run's losses are the dense run's to
    FP32 rounding, realignments included (every 3 steps), while trained factors change the run (the control);
    a frozen-factor run stopped at step 4 and resumed continues bit for bit (the decayed betas are in the
    checkpoint); a changed lora_train_factors refuses to resume; and a fork may add frozen LoRA-SVD under ROOT."""
    pytest.importorskip("fp4compile.nn.lora_svd")
    kw = dict(val_data="", optimizer=optimizer, lr=1e-2, policy="bf16")     # Q-Root: the NS in BF16
    lora = dict(lora=True, lora_rank=8, lora_realign_every=3)
    L.train(tiny_cfg(tmp_path, "dense", **kw))
    L.train(tiny_cfg(tmp_path, "frozen", lora_train_factors=False, **lora, **kw))
    L.train(tiny_cfg(tmp_path, "trained", **lora, **kw))
    dense, frozen, trained = (losses(tmp_path / n) for n in ("dense", "frozen", "trained"))
    tol = 1e-5 if optimizer == "adamw" else 2e-3       # ROOT's BF16 Newton-Schulz can flip a rounding
    assert [s for s, _ in frozen] == [s for s, _ in dense]
    assert all(abs(a - b) <= tol * b for (_, a), (_, b) in zip(frozen, dense)), (frozen, dense)
    assert abs(trained[-1][1] - dense[-1][1]) > 10 * abs(frozen[-1][1] - dense[-1][1])
    ev = [r for r in L.read_metrics(tmp_path / "frozen") if r.get("event") == "lora_realign"]
    assert [r["step"] for r in ev] == [3, 6]
    L.train(tiny_cfg(tmp_path, "split", lora_train_factors=False, stop_after=4, **lora, **kw))
    L.train(tiny_cfg(tmp_path, "split", lora_train_factors=False, resume=True, **lora, **kw))
    assert losses(tmp_path / "split") == frozen
    with pytest.raises(L.CheckpointError, match="lora_train_factors"):
        L.train(tiny_cfg(tmp_path, "split", resume=True, steps=10, **lora, **kw))
    if optimizer == "adamw":
        return
    L.train(tiny_cfg(tmp_path, "src", stop_after=4, **kw))
    L.train(tiny_cfg(tmp_path, "fork", init_from=str(tmp_path / "src"), lora_train_factors=False, **lora, **kw))
    fork = losses(tmp_path / "fork")
    assert [s for s, _ in fork] == [5, 6, 7, 8]
    assert all(abs(a - b) <= tol * b for (_, a), (_, b) in zip(fork, dense[4:])), (fork, dense)


def test_fork_takes_the_runs_optimizer_options(tmp_path):
    """A fork keeps the source's optimizer state but runs with its own encode and Newton–Schulz options: Q-AdamW's
    v_four_over_six and QRoot's ns_sym_b / ns_shared_x come from the fork's config, not from the saved groups
    (``reapply_group_settings``), so a fork A/B of those options compares what it names."""
    kw = dict(optimizer="qroot", policy="full_stack", steps=6, val_data="")
    L.train(tiny_cfg(tmp_path, "src", stop_after=3, **kw))
    opts = dict(qadamw_v_four_over_six=False, ns_sym_b=False, ns_shared_x=False)
    L.train(tiny_cfg(tmp_path, "fork", init_from=str(tmp_path / "src"), **opts, **kw))
    src = L.read_checkpoint(tmp_path / "src" / "checkpoint")["optimizer"]["param_groups"]
    fork = L.read_checkpoint(tmp_path / "fork" / "checkpoint")["optimizer"]["param_groups"]
    assert {g["v_four_over_six"] for g in src} == {True} and {g["v_four_over_six"] for g in fork} == {False}
    root = lambda groups: [g for g in groups if g["use_root"]]                         # noqa: E731
    for key in ("ns_sym_b", "ns_shared_x"):       # the Root group's (QRoot's defaults: on for this NVFP4 NS spec)
        assert [g[key] for g in root(src)] == [True] and [g[key] for g in root(fork)] == [False], key


def test_fullstack_fp4_under_bf16_autocast(tmp_path):
    """The GPU default (fp32 master weights + bf16 autocast) through the FP4 backend (its eager debug variant
    here): it trains, and the numbers differ from the same run without FP4."""
    kw = dict(steps=4, val_data="", dtype="bf16-autocast", policy="full_stack")
    fp4 = L.train(tiny_cfg(tmp_path, "fp4", backend="fullstack_fp4", backend_debug=True, **kw))
    ref = L.train(tiny_cfg(tmp_path, "ref", backend="none", **kw))
    a, b = losses(tmp_path / "fp4"), losses(tmp_path / "ref")
    assert all(math.isfinite(v) for _, v in a) and a[-1][1] < a[0][1]
    assert a[0][1] == pytest.approx(b[0][1], rel=0.02)              # same init and data: close at step 1
    assert a != b                                                   # ... but not equal: FP4 GEMMs ran
    assert fp4.summary["backend"] == "fullstack_fp4" and fp4.summary["dtype"] == "bf16-autocast"


@pytest.mark.slow
def test_bit_exact_resume_through_fullstack_fp4(tmp_path):
    """Full-stack NVFP4 (MS-EDEN/RHT backward, Q-Attn): 4 steps straight == 2 + resume (fresh Dynamo) + 2."""
    kw = dict(backend="fullstack_fp4", backend_debug=True, policy="full_stack", val_data="", steps=4)
    L.train(tiny_cfg(tmp_path, "straight", **kw))
    L.train(tiny_cfg(tmp_path, "split", stop_after=2, **kw))
    torch._dynamo.reset()
    L.train(tiny_cfg(tmp_path, "split", resume=True, **kw))
    assert losses(tmp_path / "straight") == losses(tmp_path / "split")


@pytest.mark.gpu
@pytest.mark.parametrize("backend,policy", [("inductor", "bf16"), ("fullstack_fp4", "quartet2")])
def test_gpu_cuda_graph_runs_match_default_mode(tmp_path, backend, policy):
    """``compile_mode="reduce-overhead"`` (CUDA graphs, one replay generation per forward) trains like the
    default mode: the BF16 run gives the same losses up to float reassociation, the NVFP4 run (stochastic
    rounding drawn inside the graphs, so a different random stream) stays within a few per cent; the
    mid-run evaluations (forwards without backward between steps) come out finite and equal in both modes
    for the deterministic BF16 arm. The CUDA-graph run goes first, with the kernels' cached placeholders
    dropped, as in a fresh process (where they are created during the graphs' warmup)."""
    from fp4compile.kernels import launch

    launch._PLACEHOLDERS.clear()
    torch._dynamo.reset()
    kw = dict(device="cuda", dtype="bf16-autocast", backend=backend, policy=policy, steps=8, eval_interval=4,
              val_data="stdlib:val")
    cg = L.train(tiny_cfg(tmp_path, "cg", compile_mode="reduce-overhead", **kw))
    ref = L.train(tiny_cfg(tmp_path, "default", compile_mode="default", **kw))
    a, b = losses(tmp_path / "default"), losses(tmp_path / "cg")
    assert [s for s, _ in a] == [s for s, _ in b] == list(range(1, 9))
    tol = 1e-3 if backend == "inductor" else 0.03
    assert [v for _, v in b] == pytest.approx([v for _, v in a], rel=tol)
    assert b[-1][1] < b[0][1] - 0.3                                     # it trained
    va = [r["val_loss"] for r in L.read_metrics(tmp_path / "default") if "val_loss" in r]
    vb = [r["val_loss"] for r in L.read_metrics(tmp_path / "cg") if "val_loss" in r]
    assert len(va) == len(vb) == 2 and vb == pytest.approx(va, rel=tol)
    assert cg.summary["status"] == "done"


@pytest.mark.parametrize("optimizer", ["adamw", "qroot+adamw"])
def test_resume_applies_changed_hyperparameters(tmp_path, optimizer):
    """A resumed run uses its own config's LR (and the other SOFT optimizer settings), not the checkpoint's:
    resuming with --lr 0 (constant schedule) leaves the weights exactly where the checkpoint had them.
    (torch's Optimizer.load_state_dict keeps the saved groups' values; before the fix the run warned about the
    changed LR and went on training with the old one.)"""
    from safetensors.torch import load_file

    base = dict(val_data="", schedule="constant", warmup_steps=1, ckpt_interval=2, log_interval=1,
                optimizer=optimizer, policy="bf16")
    L.train(tiny_cfg(tmp_path, steps=2, **base))
    w2 = load_file(str(tmp_path / "run" / "checkpoint" / "model.safetensors"))
    with pytest.warns(UserWarning, match="lr: 0.003 -> 0.0"):
        L.train(tiny_cfg(tmp_path, steps=4, resume=True, **{**base, "lr": 0.0}))
    w4 = load_file(str(tmp_path / "run" / "checkpoint" / "model.safetensors"))
    assert w2.keys() == w4.keys() and all(torch.equal(w2[k], w4[k]) for k in w2)


def test_reapply_group_settings_after_loading_an_optimizer_state():
    model = GPT(config_from_preset("tiny", vocab_size=64, max_seq_len=32))
    old = L.TrainConfig(model="tiny", optimizer="qroot+adamw", policy="bf16", lr=3e-3, weight_decay=0.1)
    new = L.TrainConfig(model="tiny", optimizer="qroot+adamw", policy="bf16", lr=1e-3, matrix_lr=2e-3,
                        weight_decay=0.0, beta2=0.99, ns_steps=3)
    saved = L.build_optimizer(model, old, None).state_dict()
    opt = L.build_optimizer(model, new, None)
    schedule = L.LRSchedule(opt, new)
    settings = L.config_group_settings(opt)
    opt.load_state_dict(saved)
    schedule.load_state_dict({"base_lrs": [3e-3] * len(opt.param_groups)})
    assert opt.param_groups[0]["weight_decay"] == 0.1                 # what load_state_dict leaves
    L.reapply_group_settings(opt, schedule, settings)
    root = [g for g in opt.param_groups if g["use_root"]][0]
    assert root["ns_steps"] == 3 and root["weight_decay"] == 0.0 and root["betas"] == (0.9, 0.99)
    assert schedule.base_lrs == [2e-3, 1e-3, 1e-3]                    # matrix_lr for the Root group
    with pytest.raises(L.CheckpointError, match="param groups"):
        L.reapply_group_settings(opt, schedule, settings[:1])


def test_late_switch_config_and_policy():
    """late_bf16_at / late_bf16_roles: the switch step (fraction or step), the validation, and the switched
    policy (the listed roles BF16 everywhere, every other role as before)."""
    assert L.TrainConfig(steps=100).late_switch_step() is None
    assert L.TrainConfig(steps=100, late_bf16_at=0.85).late_switch_step() == 85
    assert L.TrainConfig(steps=100, late_bf16_at=0.004).late_switch_step() == 0
    assert L.TrainConfig(steps=100, late_bf16_at=60).late_switch_step() == 60
    ok = dict(backend="fullstack_fp4")
    L.TrainConfig(late_bf16_at=0.9, **ok).validate()
    for bad, match in [(dict(late_bf16_at=-0.1, **ok), "late_bf16_at must be"),
                       (dict(late_bf16_at=1.5, **ok), "late_bf16_at must be"),
                       (dict(late_bf16_at=0.9, backend="inductor"), "fullstack_fp4"),
                       (dict(late_bf16_at=0.9, parallel="ddp", **ok), "one process"),
                       (dict(late_bf16_roles="linear.fwd"), "not a model role"),
                       (dict(late_bf16_roles="optim.ns"), "not a model role"),
                       (dict(late_bf16_roles=" , "), "no role")]:
        with pytest.raises(ValueError, match=match):
            L.TrainConfig(**bad).validate()
    from fp4compile.policy import Policy

    full = Policy.full_stack()
    late = L.late_policy(full, "linear.fprop, attn.qk")
    assert late.name == "full_stack+late_bf16(linear.fprop,attn.qk)"
    for path in ("blocks.0.mlp.fc", "blocks.3.attn.qkv", "lm_head"):
        assert str(late.resolve(path, "linear.fprop")) == "bf16"
        assert late.resolve(path, "linear.dgrad") == full.resolve(path, "linear.dgrad")
        assert late.resolve(path, "linear.wgrad") == full.resolve(path, "linear.wgrad")
    assert str(late.resolve("blocks.1.attn", "attn.qk")) == "bf16"
    assert late.resolve("blocks.1.attn", "attn.dsq") == full.resolve("blocks.1.attn", "attn.dsq")
    assert str(full.resolve("blocks.0.mlp.fc", "linear.fprop")) != "bf16"      # the switch changed something


def test_late_switch_recompiles_at_the_step_and_resumes_across_it(tmp_path, monkeypatch):
    """A run with a late switch at step 3 of 5 (FP4 backend, debug variant): steps 1-3 are the plain run's bit
    for bit, from step 4 the loss differs (the forward GEMMs left NVFP4), the model was compiled once with the
    policy and once with the switched policy, and the metrics record the switch. A run stopped at step 2 and
    resumed, and one stopped at step 4 (after the switch) and resumed, give the uninterrupted run's losses."""
    compiled = []
    orig = L.compile_model

    def spy(model, cfg, policy=None):
        compiled.append(policy)
        return orig(model, cfg, policy)

    monkeypatch.setattr(L, "compile_model", spy)
    kw = dict(backend="fullstack_fp4", backend_debug=True, policy="quartet2", val_data="", steps=5,
              log_interval=1)
    L.train(tiny_cfg(tmp_path, "plain", **kw))
    compiled.clear()
    L.train(tiny_cfg(tmp_path, "late", late_bf16_at=3, **kw))
    plain, late = losses(tmp_path / "plain"), losses(tmp_path / "late")
    assert late[:3] == plain[:3] and all(a != b for (_, a), (_, b) in zip(late[3:], plain[3:]))
    assert [p.name for p in compiled] == ["quartet2", "quartet2+late_bf16(linear.fprop)"]
    assert str(compiled[1].resolve("blocks.0.mlp.fc", "linear.fprop")) == "bf16"
    ev = [r for r in L.read_metrics(tmp_path / "late") if r.get("event") == "late_bf16"]
    assert [(r["step"], r["roles"]) for r in ev] == [(3, "linear.fprop")]
    for stop in (2, 3, 4):
        name = f"split{stop}"
        L.train(tiny_cfg(tmp_path, name, late_bf16_at=3, stop_after=stop, **kw))
        torch._dynamo.reset()
        compiled.clear()
        L.train(tiny_cfg(tmp_path, name, late_bf16_at=3, resume=True, **kw))
        assert losses(tmp_path / name) == late
        # resumed at or after the switch: compiled with the switched policy only; before it: both, in order. The
        # switch is recorded once, also when the first part stopped right before it
        assert [p.name for p in compiled] == (["quartet2+late_bf16(linear.fprop)"] if stop >= 3 else
                                              ["quartet2", "quartet2+late_bf16(linear.fprop)"])
        ev = [r["step"] for r in L.read_metrics(tmp_path / name) if r.get("event") == "late_bf16"]
        assert ev == [3]
    # a fork of the plain run at its step-4 checkpoint, past the switch: compiled with the switched policy from its
    # first step, which its log records; its step 5 (plain's weights, the forward in BF16) is not plain's step 5
    L.train(tiny_cfg(tmp_path, "plain4", stop_after=4, **kw))
    compiled.clear()
    L.train(tiny_cfg(tmp_path, "fork", late_bf16_at=3, init_from=str(tmp_path / "plain4"), **kw))
    assert [p.name for p in compiled] == ["quartet2+late_bf16(linear.fprop)"]
    assert [r["step"] for r in L.read_metrics(tmp_path / "fork") if r.get("event") == "late_bf16"] == [4]
    (s5, v5), = losses(tmp_path / "fork")
    assert s5 == 5 and math.isfinite(v5) and v5 != dict(plain)[5]


def test_a_copy_of_a_run_stopped_at_the_switch_step_resumes_as_the_late_run(tmp_path):
    """``bench/study.py --pair-late``: a run without the switch (fullbest's kind: LoRA-SVD with frozen factors,
    re-split every 2 steps, Q-Root) stopped at the switch step, its directory copied, and the copy resumed with the
    switch gives the losses of the run that had the switch from step 0, bit for bit, and records the switch once;
    the original, resumed without it, gives the uninterrupted run's losses. Resumed with the same ``stop_after``
    it reached, a run stops at once."""
    import shutil

    kw = dict(backend="fullstack_fp4", backend_debug=True, policy="quartet2", val_data="", steps=5, log_interval=1,
              optimizer="qroot", lora=True, lora_rank=4, lora_train_factors=False, lora_realign_every=2,
              lora_realign_after=2)
    L.train(tiny_cfg(tmp_path, "plain", **kw))
    L.train(tiny_cfg(tmp_path, "late", late_bf16_at=3, **kw))
    L.train(tiny_cfg(tmp_path, "base", stop_after=3, **kw))
    # a rerun with the same stop_after (a study call retried after the step was reached) trains nothing, leaves the
    # checkpoint as it was and stops at the same step instead of one step past it
    ckpt = (tmp_path / "base" / "checkpoint" / "state.pt").read_bytes()
    again = L.train(tiny_cfg(tmp_path, "base", stop_after=3, resume=True, **kw))
    assert (again.status, again.step) == ("stopped", 3) and again.summary["tok_per_s"] is None
    assert (tmp_path / "base" / "checkpoint" / "state.pt").read_bytes() == ckpt
    shutil.copytree(tmp_path / "base", tmp_path / "fork")
    with pytest.warns(UserWarning, match="late_bf16_at"):          # resuming with a changed setting says so
        L.train(tiny_cfg(tmp_path, "fork", late_bf16_at=3, resume=True, **kw))
    L.train(tiny_cfg(tmp_path, "base", resume=True, **kw))
    plain, late = losses(tmp_path / "plain"), losses(tmp_path / "late")
    assert late[:3] == plain[:3] and late[3:] != plain[3:]
    assert losses(tmp_path / "fork") == late and losses(tmp_path / "base") == plain
    assert [r["step"] for r in L.read_metrics(tmp_path / "fork") if r.get("event") == "late_bf16"] == [3]


@pytest.mark.gpu
def test_gpu_late_switch_under_cuda_graphs(tmp_path, monkeypatch):
    """The late switch with CUDA graphs (the study's mode): the recompiled model with the linears' forward in BF16
    replays its own graphs after the switch, the run finishes with finite losses that go down, the metrics record the
    switch, and the switch step's recompilation stays out of tokens/s (no step is timed at the compile's length)."""
    from fp4compile.kernels import launch

    launch._PLACEHOLDERS.clear()
    torch._dynamo.reset()
    compiled = []
    orig = L.compile_model
    monkeypatch.setattr(L, "compile_model", lambda m, c, p=None: compiled.append(p) or orig(m, c, p))
    kw = dict(device="cuda", dtype="bf16-autocast", backend="fullstack_fp4", policy="quartet2", steps=10,
              val_data="stdlib:val", compile_mode="reduce-overhead", log_interval=1)
    res = L.train(tiny_cfg(tmp_path, "late", late_bf16_at=0.5, **kw))
    assert res.status == "done" and [p.name for p in compiled] == ["quartet2", "quartet2+late_bf16(linear.fprop)"]
    a = losses(tmp_path / "late")
    assert [s for s, _ in a] == list(range(1, 11)) and all(math.isfinite(v) for _, v in a)
    assert a[-1][1] < a[0][1] - 0.3
    assert [r["step"] for r in L.read_metrics(tmp_path / "late") if r.get("event") == "late_bf16"] == [5]
    assert math.isfinite(res.summary["val_loss"])


def test_each_compilation_is_wrapped_for_cuda_graph_steps_once(tmp_path, monkeypatch):
    """Under compile_mode="reduce-overhead" every compiled model is wrapped by ``_marking_steps`` exactly once: once
    for a plain run, once more for the recompilation of a late switch (a stub compiler; the wrapping is what counts)."""
    wraps = []
    orig = L._marking_steps
    monkeypatch.setattr(L, "_marking_steps", lambda fn: wraps.append(fn) or orig(fn))
    monkeypatch.setattr(L, "compile_model", lambda model, cfg, policy=None: model)
    monkeypatch.setattr(L.TrainConfig, "_cuda_graphs_excluded", lambda self: None)
    kw = dict(backend="fullstack_fp4", compile_mode="reduce-overhead", policy="quartet2", val_data="", steps=4)
    L.train(tiny_cfg(tmp_path, "plain", **kw))
    assert len(wraps) == 1
    L.train(tiny_cfg(tmp_path, "late", late_bf16_at=2, **kw))
    assert len(wraps) == 3


def test_qk_options_reach_the_backend_and_are_validated(monkeypatch):
    """TrainConfig.qk_transform / qk_blocks (``--qk-transform``, ``--qk-blocks``) become the fullstack_fp4 options of
    the same names in compile_model (absent when unset, so the module defaults apply) and in the parallel wrap;
    a bad value, or one with another backend, fails validation."""
    from fp4compile.train import distributed as DP

    seen = []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: seen.append(kw) or model)
    monkeypatch.setattr(DP, "resolve_backend", lambda name: name)
    m = torch.nn.Linear(4, 4)
    L.compile_model(m, L.TrainConfig(backend="fullstack_fp4", qk_blocks="16x16", qk_transform="none",
                                     compile_mode="default"), "P")
    L.compile_model(m, L.TrainConfig(backend="fullstack_fp4", compile_mode="default"), "P")
    assert seen[0]["options"] == {"policy": "P", "qk_transform": "none", "qk_blocks": "16x16"}
    assert seen[1]["options"] == {"policy": "P"}
    wrapped = []
    monkeypatch.setattr(DP, "wrap_model", lambda model, parallel, **kw: wrapped.append(kw) or model)
    DP.wrap_for_training(m, "ddp", "fullstack_fp4", "P", None, options={"qk_blocks": "1x16"})
    assert wrapped[0]["options"] == {"qk_blocks": "1x16", "policy": "P"}
    for bad in (dict(backend="fullstack_fp4", qk_blocks="2d"), dict(backend="fullstack_fp4", qk_transform="rot"),
                dict(backend="inductor", qk_blocks="1x16")):
        with pytest.raises(ValueError, match="qk_"):
            L.TrainConfig(**bad).validate()
    L.TrainConfig(backend="fullstack_fp4", qk_blocks="1x16", qk_transform="smooth_k").validate()
