"""DDP / FSDP2 / distributed checkpoints / distributed Newton–Schulz on CPU (gloo, 2 ranks via torchrun).

One torchrun launch (2 ranks) runs, in sequence: DDP and FSDP2 in fp32 without compilation (FSDP2 saves a
checkpoint at step 3), the Newton–Schulz scenario, then DDP, FSDP2 and an FSDP2 negative control through
``fullstack_fp4`` with an RTN-only NVFP4 policy on every block linear (deterministic: no stochastic rounding,
no random signs). A plain process runs the 1-process references at the same time; then a plain process
resumes the checkpoint saved on 2 ranks.

References and tolerances.
* fp32: the 1-process run takes the whole global batch at once. DDP/FSDP2 average two half-batch mean
  gradients, which differs only in fp32 summation order: measured max relative loss difference ~1e-7;
  allowed FP32_RTOL = 2e-5.
* NVFP4: each GEMM operand is quantized with a per-tensor global scale from its own amax, so a rank
  quantizing half the batch is a different computation from one process quantizing all of it. The 1-process
  reference therefore runs the global batch as the 2 ranks' micro-batches (gradient accumulation, loss/2
  each): the very computation DDP/FSDP2 do, again up to fp32 summation order. Step 0 must agree to 1e-6.
  Later steps: RTN is discontinuous, so a 1-ulp weight difference occasionally flips one 4-bit code (a jump
  of up to a third of that element); measured 0 (DDP) and ≤ 7e-4 (FSDP2) over 5 steps; allowed
  NVFP4_RTOL = 3e-3.
* Both are far below what a wrong data split or a missing gradient average does (0.16 over the 5 steps,
  test_losses_are_sensitive_to_the_batch_split).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from fp4compile.train import distributed as D

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "dist_worker.py"
STEPS, SAVE_AT = 5, 3
D_MODEL, N_LAYER, BATCH = 128, 2, 6   # 48 tokens per rank: no activation shape equals a weight shape
COMMON = ["--steps", str(STEPS), "--batch", str(BATCH), "--d-model", str(D_MODEL), "--n-layer", str(N_LAYER),
          "--backend", "fullstack_fp4"]
FP32_RTOL, NVFP4_RTOL = 2e-5, 3e-3

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", TORCHINDUCTOR_FORCE_DISABLE_CACHES="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _torchrun(nproc, args, script=WORKER):
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            f"--master-port={_free_port()}", "--master-addr=127.0.0.1", str(script), *args]


def _wait(proc, what, timeout=400):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # SIGTERM first: torchrun then stops its workers. A SIGKILL would orphan them, and hung workers keep the
        # output pipe open, so the communicate() below would never return
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        raise AssertionError(f"{what} timed out after {timeout}s:\n{out[-4000:]}")
    assert proc.returncode == 0, f"{what} failed (rc={proc.returncode}):\n{out[-6000:]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    ck = tmp / "ckpt"
    kw = dict(env=_env(), cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    two = subprocess.Popen(_torchrun(2, [*COMMON, "--runs", "ddp_eager,fsdp2_eager,ns,qoptim,ddp,fsdp2,fsdp2_notag",
                                         "--qckpt", str(tmp / "q"),
                                         "--bucket-cap-mb", "1", "--save", str(ck), "--save-from", "fsdp2_eager",
                                         "--save-at", str(SAVE_AT), "--record-saved",
                                         "--out", str(tmp / "two.json")]), **kw)
    one = subprocess.Popen([sys.executable, str(WORKER), *COMMON, "--runs", "none_eager,none,qoptim", "--accum", "2",
                            "--record-saved", "--out", str(tmp / "one.json")], **kw)
    _wait(one, "1-process reference runs")
    _wait(two, "2-rank torchrun (ddp, fsdp2, ns, fsdp2_notag)")
    resume = subprocess.Popen([sys.executable, str(WORKER), *COMMON, "--runs", "resume_none_eager,qoptim_resume",
                               "--load", str(ck), "--qckpt", str(tmp / "q"), "--out", str(tmp / "resume.json")], **kw)
    _wait(resume, "1-process resume from the 2-rank checkpoint")
    res = {}
    for name in ("one", "two", "resume"):
        part = json.loads((tmp / f"{name}.json").read_text())
        if "qoptim" in part:
            res[f"qoptim_{name}"] = part.pop("qoptim")
        res.update(part)
    res["ckpt"] = ck
    return res


def _close(a, b, rtol):
    assert len(a) == len(b), (a, b)
    rel = max(abs(x - y) / abs(y) for x, y in zip(a, b))
    assert rel <= rtol, f"max relative loss difference {rel:.3g} > {rtol:g}:\n{a}\n{b}"
    return rel


def _uint8_saved(run):
    return Counter(tuple(sh) for dt, sh in run["saved"] if dt == "torch.uint8")


def _weight_code_shapes(run):
    """Shapes an NVFP4 copy of a weight would have (codes [R, C/2], raw E4M3 scales [R, C/16]), for the
    weight and its transpose, unsharded and as this rank's shard."""
    out = set()
    for name, (full, local) in run["param_shapes"].items():
        if len(full) != 2 or "blocks" not in name:
            continue
        for r, c in {tuple(full), tuple(local)}:
            for R, C in ((r, c), (c, r)):
                out |= {(R, C // 2), (R, C // 16)}
    return out


# ---------------------------------------------------------------------------------------------------------
# 2-rank runs vs the 1-process run with the same global batch
# ---------------------------------------------------------------------------------------------------------
def test_reference_runs_learn(runs):
    for mode in ("none", "none_eager"):
        ref = runs[mode]["losses"]
        assert len(ref) == STEPS and ref[-1] < ref[0] - 0.05, (mode, ref)


@pytest.mark.parametrize("mode", ["ddp_eager", "fsdp2_eager"])
def test_fp32_matches_single_process_full_batch(runs, mode):
    _close(runs[mode]["losses"], runs["none_eager"]["losses"], FP32_RTOL)


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_nvfp4_matches_single_process_same_micro_batches(runs, mode):
    ref = runs["none"]["losses"]
    _close(runs[mode]["losses"][:1], ref[:1], 1e-6)
    _close(runs[mode]["losses"], ref, NVFP4_RTOL)


def test_fsdp2_parameters_are_sharded(runs):
    for mode in ("fsdp2", "fsdp2_eager"):
        w = runs[mode]["param_shapes"]["blocks.0.mlp.fc.weight"]
        assert w == [[4 * D_MODEL, D_MODEL], [2 * D_MODEL, D_MODEL]], (mode, w)


def test_losses_are_sensitive_to_the_batch_split():
    """Control for the tolerances: the test's model and schedule trained on only one rank's half of each
    global batch (what a missing gradient average / wrong data split amounts to): the global-batch loss
    curve moves ≥ 10x NVFP4_RTOL away from the correct one."""
    sys.path.insert(0, str(ROOT / "tests"))
    import dist_worker as W

    curves = {}
    for name, rows in (("full", slice(0, BATCH)), ("half", slice(0, BATCH // 2))):
        m = W.make_model(d=D_MODEL, n_layer=N_LAYER)
        opt = W.make_optimizer(m, "adamw")
        curves[name] = []
        for step in range(STEPS):
            x, y = W.global_batch(step, BATCH)
            with torch.no_grad():
                curves[name].append(torch.nn.functional.cross_entropy(
                    m(x).reshape(-1, W.VOCAB), y.reshape(-1)).item())
            loss = torch.nn.functional.cross_entropy(m(x[rows]).reshape(-1, W.VOCAB), y[rows].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
    rel = max(abs(a - b) / b for a, b in zip(curves["half"], curves["full"]))
    assert rel > 10 * NVFP4_RTOL, (rel, curves)


def test_ddp_backend_called_once_per_bucket_with_reuse_inside(runs):
    """DDPOptimizer splits the Dynamo graph at 1 MiB gradient buckets: the backend is called once per bucket
    subgraph (the 1-process run compiles one graph). Each bucket graph has its own joint graph, and the FP4
    copies the backward reuses are saved exactly as in the unsplit 1-process graph: the activations' and (the
    default ``save_weight_copies``) the weights'."""
    calls = runs["ddp"]["backend_calls"]
    assert len(runs["none"]["backend_calls"]) == 1
    assert len(calls) >= 2, calls
    ddp, ref = _uint8_saved(runs["ddp"]), _uint8_saved(runs["none"])
    assert ddp and ddp == ref, (ddp, ref)
    assert len(set(ddp) & _weight_code_shapes(runs["ddp"])) >= 4, ddp


def _without(counter, shapes):
    return Counter({k: v for k, v in counter.items() if k not in shapes})


def test_fsdp2_saves_no_fp4_copy_of_unsharded_weights(runs):
    """FSDP2 (per-block compile, resharded after forward): the compiled blocks see unsharded parameters; autograd
    saves those params (FSDP frees and re-gathers their storage) and FP4 *activation* copies, never an FP4 copy of
    a weight (``wrap_model`` passes ``save_weight_copies=False``): the 1-process run's copies less its weights'."""
    saved = _uint8_saved(runs["fsdp2"])
    weights = _weight_code_shapes(runs["fsdp2"])
    assert saved and saved == _without(_uint8_saved(runs["none"]), weights), saved
    assert not set(saved) & weights, saved
    shapes = {tuple(sh) for dt, sh in runs["fsdp2"]["saved"] if dt == "torch.float32"}
    full, local = map(tuple, runs["fsdp2"]["param_shapes"]["blocks.0.mlp.fc.weight"])
    assert full in shapes and local not in shapes


def test_saved_tensor_check_detects_fp4_weight_copies(runs):
    """Negative control: the same FSDP2 run with the backend's MUST_RECOMPUTE tagging disabled saves FP4
    weight copies until backward, and the check above sees them (and the losses are unchanged)."""
    bad = set(_uint8_saved(runs["fsdp2_notag"])) & _weight_code_shapes(runs["fsdp2_notag"])
    assert len(bad) >= 4, bad
    _close(runs["fsdp2_notag"]["losses"], runs["fsdp2"]["losses"], FP32_RTOL)


def test_fsdp2_identical_blocks_share_one_compilation(runs):
    """torchtitan order with per-block localized policies: equal resolutions -> equal policies -> the two
    identical blocks share one compilation."""
    assert len(runs["fsdp2"]["backend_calls"]) == 1, runs["fsdp2"]["backend_calls"]


# ---------------------------------------------------------------------------------------------------------
# checkpoint: saved on 2 ranks (FSDP2, sharded DTensors), loaded on 1
# ---------------------------------------------------------------------------------------------------------
def test_checkpoint_saved_on_two_ranks_resumes_on_one(runs):
    meta = json.loads((runs["ckpt"] / "fp4compile_meta.json").read_text())
    assert meta["step"] == SAVE_AT and meta["world_size"] == 2 and meta["has_optim"]
    resumed = runs["resume_none_eager"]
    assert resumed["start"] == SAVE_AT
    # the resumed 1-process run continues the 2-rank FSDP2 run's curve (model + AdamW moments restored)
    _close(resumed["losses"], runs["fsdp2_eager"]["losses"][SAVE_AT:], FP32_RTOL)
    _close(resumed["losses"], runs["none_eager"]["losses"][SAVE_AT:], FP32_RTOL)


def test_checkpoint_without_optimizer_state_is_rejected(tmp_path):
    sys.path.insert(0, str(ROOT / "tests"))
    import dist_worker as W

    m = W.make_model(d=32, n_layer=1)
    D.save_checkpoint(tmp_path / "c", m)
    with pytest.raises(ValueError, match="no optimizer state"):
        D.load_checkpoint(tmp_path / "c", m, W.make_optimizer(m, "adamw"))
    with pytest.raises(FileNotFoundError):
        D.load_checkpoint(tmp_path / "missing", m)
    # model-only round trip in one process
    m2 = W.make_model(seed=1, d=32, n_layer=1)
    D.load_checkpoint(tmp_path / "c", m2)
    for (n, a), (_, b) in zip(m.state_dict().items(), m2.state_dict().items()):
        assert torch.equal(a, b), n


# ---------------------------------------------------------------------------------------------------------
# Newton–Schulz on whole matrices
# ---------------------------------------------------------------------------------------------------------
def test_distributed_newton_schulz_matches_full_matrix(runs):
    ns = runs["ns"]
    for key in ("sharded_all_to_all", "sharded_gather", "replicated_all_to_all", "replicated_gather"):
        assert ns[key]["max_err"] <= 1e-12, (key, ns[key])
    assert ns["sharded_all_to_all"]["layout_ok"] and ns["sharded_gather"]["layout_ok"]
    # all_to_all splits the NS work (6 matrices in 4 shape groups → at most 5 on one rank; gather runs all 6)
    assert ns["sharded_all_to_all"]["max_ns_calls_per_rank"] < 6
    assert ns["sharded_gather"]["max_ns_calls_per_rank"] == 6
    # QRoot-style stacked momenta: torch.stack of FSDP2 Shard(0) matrices is Shard(1); whole matrices per rank
    for n, most in ((3, 2), (1, 1)):
        r = ns[f"stack{n}"]
        assert r["is_shard1"] and r["same_layout"], r
        assert r["max_err"] <= 1e-12 and r["local_batch"] == most, r


def test_distributed_newton_schulz_single_process():
    sys.path.insert(0, str(ROOT / "tests"))
    import dist_worker as W

    mats = [torch.randn(32, 16, dtype=torch.float64), torch.randn(16, 48, dtype=torch.float64)]
    out = D.distributed_newton_schulz(mats, W.simple_ns)
    for o, m in zip(out, mats):
        assert torch.equal(o, W.simple_ns(m))
    with pytest.raises(ValueError, match="2-D"):
        D.distributed_newton_schulz([torch.randn(3)], W.simple_ns)
    with pytest.raises(ValueError, match="shape"):
        D.distributed_newton_schulz(mats, lambda m: m[:1])
    with pytest.raises(ValueError, match="strategy"):
        D.distributed_newton_schulz(mats, W.simple_ns, strategy="nope")


# ---------------------------------------------------------------------------------------------------------
# single-process helpers
# ---------------------------------------------------------------------------------------------------------
def test_batch_slice_and_local_batch():
    assert D.batch_slice(8, 0, 2) == slice(0, 4) and D.batch_slice(8, 1, 2) == slice(4, 8)
    assert D.batch_slice(6, 2, 3) == slice(4, 6)
    with pytest.raises(ValueError, match="divisible"):
        D.batch_slice(7, 0, 2)
    with pytest.raises(ValueError, match="out of range"):
        D.batch_slice(8, 2, 2)
    x, y = torch.arange(16).view(8, 2), torch.arange(8)
    env = D.DistEnv(rank=1, world_size=4)
    lx, ly = D.local_batch((x, y), env)
    assert torch.equal(lx, x[2:4]) and torch.equal(ly, y[2:4])
    assert torch.equal(D.local_batch({"a": y}, env)["a"], y[2:4])
    # the ranks' slices tile the global batch exactly
    parts = [D.local_batch(y, D.DistEnv(rank=r, world_size=4)) for r in range(4)]
    assert torch.equal(torch.cat(parts), y)
    with pytest.raises(ValueError, match="disagree"):
        D.local_batch((x, y[:4]), env)
    # no process group: the whole batch
    assert torch.equal(D.local_batch(y), y)


def test_single_process_helpers():
    assert D.setup("cpu") == D.DistEnv()
    assert D.is_main()
    assert D.reduce_metrics({"a": torch.tensor(2.0), "b": 3}) == {"a": 2.0, "b": 3.0}
    assert D.all_reduce_mean(torch.tensor(1.5)).item() == 1.5
    with pytest.raises(ValueError, match="op"):
        D.reduce_metrics({"a": 1.0}, op="avg")
    m = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="parallel"):
        D.wrap_model(m, "tp")
    with pytest.raises(RuntimeError, match="process group"):
        D.wrap_model(m, "ddp")
    with pytest.raises(ValueError, match="ModuleList"):
        D.find_blocks(m)


def test_localize_policy_keeps_path_rules_per_block():
    """A block compiled alone sees relative module paths; localize_policy resolves on the full path."""
    sys.path.insert(0, str(ROOT / "tests"))
    import dist_worker as W
    from fp4compile.policy import BF16, NVFP4, Policy

    m = W.make_model(d=32, n_layer=3)
    pol = Policy.bf16().override("*", NVFP4("rtn"), role="linear.fprop").override("blocks.1.*", "bf16")
    loc = [D.localize_policy(pol, b, f"blocks.{i}") for i, b in enumerate(m.blocks)]
    assert loc[0].resolve("mlp.fc", "linear.fprop") == NVFP4("rtn")
    assert loc[1].resolve("mlp.fc", "linear.fprop") == BF16
    assert loc[0].resolve("mlp.fc", "linear.dgrad") == BF16
    # without localization the block-1 rule would never match a relative path
    assert pol.resolve("mlp.fc", "linear.fprop") == NVFP4("rtn")
    # equal resolutions give equal (hashable, comparable) policies -> shared compilation
    assert loc[0] == loc[2] and loc[0] != loc[1] and hash(loc[0]) == hash(loc[2])
    assert D.localize_policy("bf16", m.blocks[0], "blocks.0").resolve("attn.qkv", "linear.fprop") == BF16
    with pytest.raises(TypeError):
        D.localize_policy(3, m.blocks[0], "blocks.0")


# ---------------------------------------------------------------------------------------------------------
# `fp4compile train --parallel fsdp2` under torchrun: same curve as 1 process, DCP checkpoint resumes on 1
# ---------------------------------------------------------------------------------------------------------
def _train_losses(out):
    return [json.loads(ln)["loss"] for ln in (out / "metrics.jsonl").read_text().splitlines()
            if ln.strip() and "loss" in json.loads(ln) and "event" not in json.loads(ln)]


def test_ddp_time_budget_stops_every_rank_at_the_same_step(tmp_path):
    """Under DDP the time budget is decided by all ranks together: with only rank 1 out of time (from its third
    step on, tests/ddp_stop_worker.py), both ranks stop at the next log step (4) with status time_budget and write
    the checkpoint; per-rank decisions hang in the next collective (the timeout turns that into a failure)."""
    run = tmp_path / "run"
    proc = subprocess.Popen(_torchrun(2, [str(run)], script=ROOT / "tests" / "ddp_stop_worker.py"), env=_env(),
                            cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait(proc, "torchrun ddp_stop_worker.py (a hang: the ranks did not stop together)", timeout=120)
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["status"], summary["step"]) == ("time_budget", 4), summary
    assert (run / "checkpoint").is_dir()


def test_cli_fsdp2_matches_one_process_and_resumes_on_one(tmp_path):
    """2 ranks x 4 sequences (FSDP2, stopped after step 2 with a checkpoint) then 1 process x 8 sequences
    resuming it, vs 1 process x 8 sequences uninterrupted: the same global batches (the data pipeline gives
    rank r rows [4r, 4r+4) of each global batch), fp32, grad clipping on. Backend "none" keeps it fast."""
    common = ["--model", "tiny", "--seq-len", "32", "--eval-batches", "1", "--log-interval", "1",
              "--no-progress", "--warmup-steps", "2", "--steps", "4", "--backend", "none", "--val-data", ""]
    kw = dict(env=_env(), cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ref, run = tmp_path / "ref", tmp_path / "run"
    two = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                            f"--master-port={_free_port()}", "--master-addr=127.0.0.1", "-m", "fp4compile", "train",
                            "--parallel", "fsdp2", "--batch-size", "4", "--stop-after", "2", "--out-dir", str(run),
                            *common], **kw)
    one = subprocess.Popen([sys.executable, "-m", "fp4compile", "train", "--batch-size", "8", "--out-dir", str(ref),
                            *common], **kw)
    _wait(one, "1-process fp4compile train")
    _wait(two, "torchrun fp4compile train --parallel fsdp2")
    assert (run / "checkpoint" / ".metadata").exists()
    assert json.loads((run / "summary.json").read_text())["world_size"] == 2
    resume = subprocess.Popen([sys.executable, "-m", "fp4compile", "train", "--batch-size", "8", "--resume",
                               "--out-dir", str(run), *common], **kw)
    _wait(resume, "1-process resume of the FSDP2 checkpoint")
    a, b = _train_losses(run), _train_losses(ref)
    assert len(b) == 4 and b[-1] < b[0], b
    _close(a, b, FP32_RTOL)


def test_cli_fsdp2_without_reshard_and_with_bf16_params_trains_like_fp32(tmp_path):
    """`--no-fsdp-reshard --fsdp-bf16-params` (the best FSDP2 setting on the H200s, docs/DISTRIBUTED.md): the
    2-rank run follows the fp32 1-process curve to BF16 parameter rounding, and its config records both."""
    common = ["--model", "tiny", "--seq-len", "32", "--eval-batches", "1", "--log-interval", "1", "--no-progress",
              "--warmup-steps", "2", "--steps", "3", "--backend", "none", "--val-data", ""]
    kw = dict(env=_env(), cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ref, run = tmp_path / "ref", tmp_path / "run"
    two = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                            f"--master-port={_free_port()}", "--master-addr=127.0.0.1", "-m", "fp4compile", "train",
                            "--parallel", "fsdp2", "--no-fsdp-reshard", "--fsdp-bf16-params", "--batch-size", "4",
                            "--out-dir", str(run), *common], **kw)
    one = subprocess.Popen([sys.executable, "-m", "fp4compile", "train", "--batch-size", "8", "--out-dir", str(ref),
                            *common], **kw)
    _wait(one, "1-process fp4compile train")
    _wait(two, "torchrun fp4compile train --parallel fsdp2 --no-fsdp-reshard --fsdp-bf16-params")
    a, b = _train_losses(run), _train_losses(ref)
    assert len(a) == 3 and a != b                      # BF16 parameters: not bit-equal to fp32 ...
    _close(a, b, 2e-2)                                 # ... but the same curve to BF16 rounding
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["fsdp_reshard"] is False and cfg["fsdp_bf16_params"] is True


@pytest.mark.parametrize("scale", [["--lora-realign-scale", "keep"],
                                   ["--lora-beta", "0.3", "--lora-realign-scale", "hold"],
                                   ["--no-lora-train-factors", "--weight-decay", "0.5"]],
                         ids=["keep", "hold", "frozen"])
def test_cli_ddp_with_lora_realignment_matches_one_process(tmp_path, scale):
    """`fp4compile train --parallel ddp --lora` realigning every 2 steps: 2 ranks x 4 sequences give the curve of
    1 process x 8 sequences (fp32; the constrained backward is linear in the gradient, so projecting each rank's
    gradient before DDP averages them equals projecting the average), and both log the same realignments. With
    realign_scale="hold" from beta 0.3, beta changes at the first realignment (to a power of two) and rank 0's
    value is broadcast with the factors. With frozen factors (no gradient, so DDP does not see them) each rank
    decays its own beta buffer by the decoupled weight decay; the two runs must end with the same betas."""
    common = ["--model", "tiny", "--seq-len", "32", "--eval-batches", "1", "--log-interval", "1", "--no-progress",
              "--warmup-steps", "2", "--steps", "5", "--backend", "none", "--val-data", "", "--lora",
              "--lora-rank", "8", "--lora-realign-every", "2", *scale]
    kw = dict(env=_env(), cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ref, run = tmp_path / "ref", tmp_path / "run"
    two = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                            f"--master-port={_free_port()}", "--master-addr=127.0.0.1", "-m", "fp4compile", "train",
                            "--parallel", "ddp", "--batch-size", "4", "--out-dir", str(run), *common], **kw)
    one = subprocess.Popen([sys.executable, "-m", "fp4compile", "train", "--batch-size", "8", "--out-dir", str(ref),
                            *common], **kw)
    _wait(one, "1-process fp4compile train --lora")
    _wait(two, "torchrun fp4compile train --parallel ddp --lora")
    a, b = _train_losses(run), _train_losses(ref)
    assert len(b) == 5 and b[-1] < b[0], b
    _close(a, b, FP32_RTOL)

    def events(d):
        return [json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines()
                if '"lora_realign"' in ln]
    assert [e["step"] for e in events(run)] == [e["step"] for e in events(ref)] == [2, 4]
    if "hold" in scale:
        betas = torch.load(run / "checkpoint" / "state.pt", weights_only=False)["lora"]["betas"]
        assert betas and all(b in (0.25, 0.5) for b in betas.values()), betas
    if "--no-lora-train-factors" in scale:
        def betas(d):
            return torch.load(d / "checkpoint" / "state.pt", weights_only=False)["lora"]["betas"]
        got, want = betas(run), betas(ref)
        # decayed since the last re-split (step 4) and not reset to 1: the decay ran, identically on every rank
        assert got.keys() == want.keys() and got and all(0 < want[k] < 1 for k in want), want
        assert all(abs(got[k] - want[k]) <= 1e-6 * want[k] for k in want), (got, want)


# ---------------------------------------------------------------------------------------------------------
# QAdamW / QRoot under FSDP2
# ---------------------------------------------------------------------------------------------------------
def _qoptim(runs):
    return runs["qoptim_two"], runs["qoptim_one"], runs["qoptim_resume"]


def test_qroot_fsdp2_whole_matrix_ns_matches_single_process_and_reshards(runs):
    """QRoot with NVFP4 Newton–Schulz: momenta are DTensor shards, NS runs on whole matrices (all-to-all).

    The NVFP4 NS is batched over each rank's stack of same-shaped matrices, with one global scale per stack
    (optim/root.py); a rank stacks only the matrices it orthogonalizes, so FSDP2 on 2 ranks and 1 process
    quantize with different global scales: the curves agree at step 0 and stay within NVFP4_RTOL after
    (measured 8e-5 over 4 steps), like the shard-local QAdamW below. The checkpoint (DTensor momenta) resumes
    exactly on 2 ranks (same stacks) and within NVFP4_RTOL on 1 process."""
    two, one, res = _qoptim(runs)
    _close(two["qroot"]["losses"][:1], one["qroot"]["losses"][:1], 1e-6)
    _close(two["qroot"]["losses"], one["qroot"]["losses"], NVFP4_RTOL)
    _close(two["qroot"]["resumed"], two["qroot"]["losses"][2:], FP32_RTOL)
    _close(res["qroot"]["resumed"], two["qroot"]["losses"][2:], NVFP4_RTOL)


def test_qadamw_fsdp2_shard_local(runs):
    """QAdamW on local shards: each shard's NVFP4 state has its own per-tensor scale, so the curve is close
    to, not identical with, the 1-process one (measured ≤ 4e-4 relative over 4 steps; allowed NVFP4_RTOL).
    Its per-shard state resumes exactly on 2 ranks; on 1 process the load refuses with a clear error."""
    two, one, res = _qoptim(runs)
    _close(two["qadamw"]["losses"][:1], one["qadamw"]["losses"][:1], 1e-6)
    _close(two["qadamw"]["losses"], one["qadamw"]["losses"], NVFP4_RTOL)
    _close(two["qadamw"]["resumed"], two["qadamw"]["losses"][2:], FP32_RTOL)
    assert "resumes on that many ranks only" in res["qadamw"].get("error", ""), res["qadamw"]


def test_qroot_with_qadamw_part_fsdp2(runs):
    """QRoot(adamw="qadamw"), the training loop's --optimizer qroot: Root on whole matrices, its QAdamW part on
    local shards: close to the 1-process curve, resumes exactly on 2 ranks, refused on 1."""
    two, one, res = _qoptim(runs)
    _close(two["qroot_q"]["losses"][:1], one["qroot_q"]["losses"][:1], 1e-6)
    _close(two["qroot_q"]["losses"], one["qroot_q"]["losses"], NVFP4_RTOL)
    _close(two["qroot_q"]["resumed"], two["qroot_q"]["losses"][2:], FP32_RTOL)
    assert "resumes on that many ranks only" in res["qroot_q"].get("error", ""), res["qroot_q"]


def test_shard_local_refuses_newton_schulz_optimizers():
    class FakeRoot(torch.optim.SGD):
        def orthogonalize(self, U, group):
            return U

    with pytest.raises(TypeError, match="whole_matrix"):
        D.shard_local(FakeRoot)


def test_fsdp2_compiles_the_gpt_head_as_its_own_region():
    """FSDP2 compiles per block; the GPT's ``head`` (final norm, LM head, fp32 cross-entropy) is compiled as a
    region too (``fsdp_compile_regions``), so its fp32 logits are not materialized eagerly. One process, a
    world of 1 (gloo): the backend sees the block graph and the head graph, and the loss equals eager."""
    import torch.distributed as dist

    from fp4compile.train.model import GPT, GPTConfig

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cfg = GPTConfig(vocab_size=64, d_model=32, n_layer=2, n_head=2, max_seq_len=16)
        torch.manual_seed(0)
        ref = GPT(cfg)
        model = GPT(cfg)
        model.load_state_dict(ref.state_dict())
        graphs = []

        def backend(gm, example_inputs):
            graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
            return gm.forward

        D.wrap_model(model, "fsdp2", backend=backend)
        idx = torch.randint(0, 64, (2, 16))
        loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        expect = ref(idx[:, :-1], idx[:, 1:])
        torch.testing.assert_close(loss, expect)
        assert len(graphs) == 2, graphs                    # identical blocks share one graph; plus the head
        assert sum(any("cross_entropy" in t or "log_softmax" in t for t in g) for g in graphs) == 1, graphs
        with pytest.raises(ValueError, match="no method"):
            D.wrap_model(GPT(cfg), "fsdp2", backend=backend, regions=("nope",))
    finally:
        dist.destroy_process_group()
