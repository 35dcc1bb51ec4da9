"""DDP / FSDP2 / distributed checkpoints / distributed Newton–Schulz on CPU (gloo, 2 ranks via torchrun).

One torchrun launch (2 ranks) runs DDP, FSDP2 and the Newton–Schulz scenario; a plain process runs the
1-process reference at the same time; then a plain process resumes the FSDP2 checkpoint saved on 2 ranks.
Everything is fp32 on CPU with deterministic algorithms, so runs differ only by floating-point reduction order
(gradient all-reduce / reduce-scatter of two half-batch means instead of one full-batch mean): the losses
must agree to ~1e-7 relative (measured ≤ 2e-7); we allow 2e-5 relative, still ~1000× below the change
caused by a wrong data split or a missing gradient average (≥ 1e-2 after one step; see test below).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp4compile.train import distributed as D

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "dist_worker.py"
STEPS, SAVE_AT = 5, 3
COMMON = ["--steps", str(STEPS), "--batch", "8", "--d-model", "128", "--n-layer", "2"]
RTOL = 2e-5

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


def _torchrun(nproc, args):
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            f"--master-port={_free_port()}", "--master-addr=127.0.0.1", str(WORKER), *args]


def _wait(proc, what, timeout=300):
    try:
        out, _ = proc.communicate(timeout=timeout)
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
    two = subprocess.Popen(_torchrun(2, [*COMMON, "--runs", "ddp,fsdp2,ns", "--bucket-cap-mb", "1",
                                         "--save", str(ck), "--save-from", "fsdp2", "--save-at", str(SAVE_AT),
                                         "--record-saved", "--out", str(tmp / "two.json")]), **kw)
    one = subprocess.Popen([sys.executable, str(WORKER), *COMMON, "--runs", "none", "--record-saved",
                            "--out", str(tmp / "one.json")], **kw)
    _wait(one, "1-process reference run")
    _wait(two, "2-rank torchrun (ddp, fsdp2, ns)")
    resume = subprocess.Popen([sys.executable, str(WORKER), *COMMON, "--runs", "resume_none", "--load", str(ck),
                               "--out", str(tmp / "resume.json")], **kw)
    _wait(resume, "1-process resume from the 2-rank checkpoint")
    res = {}
    for name in ("one", "two", "resume"):
        res.update(json.loads((tmp / f"{name}.json").read_text()))
    res["ckpt"] = ck
    return res


def _close(a, b, rtol=RTOL):
    assert len(a) == len(b), (a, b)
    rel = max(abs(x - y) / abs(y) for x, y in zip(a, b))
    assert rel <= rtol, f"max relative loss difference {rel:.3g} > {rtol:g}:\n{a}\n{b}"
    return rel


# ---------------------------------------------------------------------------------------------------------
# 2-rank runs vs the 1-process run with the same global batch
# ---------------------------------------------------------------------------------------------------------
def test_ddp_matches_single_process(runs):
    ref = runs["none"]["losses"]
    assert len(ref) == STEPS and ref[0] > ref[-1] - 1.0  # sane losses (log 64 ≈ 4.16 at init)
    _close(runs["ddp"]["losses"], ref)


def test_fsdp2_matches_single_process(runs):
    _close(runs["fsdp2"]["losses"], runs["none"]["losses"])
    # parameters really are sharded: dim 0 of every block parameter is split over the 2 ranks
    shapes = runs["fsdp2"]["param_shapes"]
    w = shapes["blocks.0.mlp.fc.weight"]
    assert w[0] == [512, 128] and w[1] == [256, 128], w


def test_losses_are_sensitive_to_the_batch_split():
    """Control for the tolerance: training on only one rank's half of each global batch (what a missing
    gradient average / wrong data split amounts to) moves the loss far beyond RTOL after one step."""
    sys.path.insert(0, str(ROOT / "tests"))
    import dist_worker as W

    torch.manual_seed(0)
    losses = {}
    for name, rows in (("full", slice(0, 8)), ("half", slice(0, 4))):
        m = W.make_model(d=32, n_layer=1)
        opt = W.make_optimizer(m, "adamw")
        out = []
        for step in range(2):
            x, y = W.global_batch(step, 8)
            loss = torch.nn.functional.cross_entropy(m(x[rows]).reshape(-1, W.VOCAB), y[rows].reshape(-1))
            loss.backward(); opt.step(); opt.zero_grad()
            x, y = W.global_batch(step, 8)
            with torch.no_grad():
                out.append(torch.nn.functional.cross_entropy(m(x).reshape(-1, W.VOCAB), y.reshape(-1)).item())
        losses[name] = out
    rel = abs(losses["full"][-1] - losses["half"][-1]) / losses["full"][-1]
    assert rel > 100 * RTOL, (rel, losses)


def test_ddp_backend_called_once_per_bucket(runs):
    """DDPOptimizer splits the Dynamo graph at 1 MiB gradient buckets: the backend is called once per bucket
    subgraph, every linear lands in exactly one subgraph; the 1-process run compiles one graph."""
    calls = runs["ddp"]["backend_calls"]
    n_params = sum(1 for _ in runs["none"]["param_shapes"])
    assert len(runs["none"]["backend_calls"]) == 1
    assert len(calls) >= 2, calls
    # each bucket graph holds a part of the model: parameters are graph inputs, split across the calls
    assert sum(c["n_linear"] for c in calls) >= runs["none"]["backend_calls"][0]["n_linear"]
    assert n_params > 0


def test_fsdp2_compiles_blocks_once(runs):
    """torchtitan order: blocks are compiled individually; identical blocks share one compilation."""
    calls = runs["fsdp2"]["backend_calls"]
    assert 1 <= len(calls) <= 2, calls


def test_fsdp2_compiled_blocks_save_unsharded_params(runs):
    """Under FSDP2 the compiled block receives *unsharded* parameters as plain tensors, and autograd saves
    those (FSDP frees their storage after forward and re-gathers it before backward), never the local shard."""
    saved = {tuple(sh) for dt, sh in runs["fsdp2"]["saved"]}
    shapes = runs["fsdp2"]["param_shapes"]
    for name in ("blocks.0.mlp.fc.weight", "blocks.0.attn.qkv.weight"):
        full, local = map(tuple, shapes[name])
        assert full in saved and local not in saved, (name, full, local, sorted(saved))


# ---------------------------------------------------------------------------------------------------------
# checkpoint: saved on 2 ranks (FSDP2, sharded DTensors), loaded on 1
# ---------------------------------------------------------------------------------------------------------
def test_checkpoint_saved_on_two_ranks_resumes_on_one(runs):
    meta = json.loads((runs["ckpt"] / "fp4compile_meta.json").read_text())
    assert meta["step"] == SAVE_AT and meta["world_size"] == 2 and meta["has_optim"]
    resumed = runs["resume_none"]
    assert resumed["start"] == SAVE_AT
    # the resumed 1-process run continues the 2-rank FSDP2 run's curve (model + AdamW moments restored)
    _close(resumed["losses"], runs["fsdp2"]["losses"][SAVE_AT:])
    _close(resumed["losses"], runs["none"]["losses"][SAVE_AT:])


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
