"""bench/cpu_fork_ab.py, the CPU's paired fork A/B: its arm syntax, and one tiny run in which every arm continues the
source's checkpoint with its own settings (the reference arm against itself differs by exactly 0)."""
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import cpu_fork_ab  # noqa: E402
from fp4compile.train import loop as L  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def test_arm_syntax():
    from fp4compile.optim import qadamw

    assert cpu_fork_ab.parse_arm("base") == ("base", {}, {})
    assert cpu_fork_ab.parse_arm("v6:qadamw_v_four_over_six=false,lr=0.001,ns_residual=x2d") == (
        "v6", {"qadamw_v_four_over_six": False, "lr": 0.001, "ns_residual": "x2d"}, {})
    # a dotted key is a module switch (bench/step_ab.py's syntax), a module's dict entry in brackets
    assert cpu_fork_ab.parse_arm("t:fp4compile.optim.qadamw.QADAMW_DEFAULTS[tile]=16,lr=0.001") == (
        "t", {"lr": 0.001}, {(qadamw, "QADAMW_DEFAULTS", "tile"): 16})
    with pytest.raises(SystemExit, match="not TrainConfig fields"):
        cpu_fork_ab.parse_arm("bad:no_such_key=1")
    with pytest.raises(SystemExit, match="has no attribute 'NOPE'"):
        cpu_fork_ab.parse_arm("bad:fp4compile.optim.qadamw.NOPE=1")
    with pytest.raises(SystemExit, match="has no entry 'nope'"):
        cpu_fork_ab.parse_arm("bad:fp4compile.optim.qadamw.QADAMW_DEFAULTS[nope]=1")


def test_tiny_fork_ab(tmp_path, capsys, monkeypatch):
    from fp4compile.optim import root

    seen, train = [], L.train
    monkeypatch.setattr(L, "train", lambda cfg: seen.append(root.FUSE_AMAX) or train(cfg))
    default = root.FUSE_AMAX
    assert cpu_fork_ab.main(["--model", "tiny", "--steps", "4", "--at", "2", "--seeds", "0", "--batch-size", "2",
                             "--seq-len", "32", "--eval-batches", "1", "--out", str(tmp_path), "--arm", "base",
                             "--arm", "again", "--arm", "v6:qadamw_v_four_over_six=false",
                             "--arm", f"amax:fp4compile.optim.root.FUSE_AMAX={str(not default).lower()}"]) == 0
    out = capsys.readouterr().out
    assert "| again | defaults | " in out and "| +0.0000 (+0.00 %) |" in out   # the same fork twice: equal
    assert "| v6 | qadamw_v_four_over_six=false |" in out
    for arm, flag in (("base", True), ("v6", False), ("amax", True)):
        metrics = L.read_metrics(tmp_path / "seed0" / arm)
        assert [r["step"] for r in metrics if "loss" in r and "event" not in r][0] > 2     # started at the fork
        groups = L.read_checkpoint(tmp_path / "seed0" / arm / "checkpoint")["optimizer"]["param_groups"]
        assert {g["v_four_over_six"] for g in groups} == {flag}
    # the module switch holds while its arm trains (source, base, again, v6, amax) and is restored after
    assert seen == [default] * 4 + [not default] and root.FUSE_AMAX == default


def test_deterministic_fork_ab_gives_two_equal_arms_the_same_bits(tmp_path):
    """--deterministic, in a fresh process (MKL_CBWR must precede the first matrix product): the full stack through
    fullstack_fp4's eager variant (Q-Attn's reference, whose threaded SGEMM otherwise sums in a varying order) on
    2 threads; two arms with the same settings log the same train loss at every step and the same val loss."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    subprocess.run([sys.executable, str(ROOT / "bench" / "cpu_fork_ab.py"), "--model", "cpu", "--steps", "8",
                    "--at", "2", "--seeds", "0", "--batch-size", "4", "--seq-len", "64", "--eval-batches", "2",
                    "--optimizer", "qroot", "--policy", "full_stack", "--backend", "fullstack_fp4",
                    "--out", str(tmp_path), "--deterministic", "--arm", "base:threads=2", "--arm", "again:threads=2"],
                   check=True, env=env, capture_output=True, timeout=600)
    runs = [L.read_metrics(tmp_path / "seed0" / arm) for arm in ("base", "again")]
    losses = [L.train_losses(m) for m in runs]
    assert len(losses[0]) >= 2 and losses[0] == losses[1]
    vals = [[r["val_loss"] for r in m if "val_loss" in r] for m in runs]
    assert vals[0] and vals[0] == vals[1]
