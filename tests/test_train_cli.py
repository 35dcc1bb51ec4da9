"""The ``fp4compile`` CLI: train (config + flags), plot, demo (reduced), explain, python -m fp4compile."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp4compile.train import cli

ROOT = Path(__file__).resolve().parents[1]




@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


TINY = ["--model", "tiny", "--batch-size", "4", "--seq-len", "32", "--eval-batches", "2", "--log-interval", "2",
        "--no-progress", "--warmup-steps", "2"]


def test_train_config_file_and_flags(tmp_path, capsys):
    cfg = tmp_path / "cfg.toml"
    cfg.write_text('[model]\nmodel = "tiny"\n[run]\nsteps = 50\nbackend = "none"\nlr = 0.01\n')
    out = tmp_path / "run"
    rc = cli.main(["train", "--config", str(cfg), "--steps", "6", "--out-dir", str(out)] + TINY[2:])
    assert rc == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["steps"] == 6 and saved["lr"] == 0.01 and saved["model"] == "tiny"    # flag beats file
    assert json.loads((out / "summary.json").read_text())["step"] == 6
    assert "done at step 6/6" in capsys.readouterr().out
    # errors are one clear line and exit code 2, not a traceback
    assert cli.main(["train", "--config", str(cfg), "--out-dir", str(out)] + TINY[2:]) == 2
    assert "already holds a checkpoint" in capsys.readouterr().err
    assert cli.main(["train", "--config", str(cfg), "--out-dir", str(tmp_path / "x"), "--optimizer", "sgd"]) == 2
    assert "optimizer='sgd'" in capsys.readouterr().err


def test_plot_writes_png(tmp_path):
    for name, lr in (("a", "0.003"), ("b", "0.001")):
        assert cli.main(["train", "--out-dir", str(tmp_path / name), "--backend", "none", "--steps", "6",
                         "--lr", lr, "--eval-interval", "3"] + TINY) == 0
    out = tmp_path / "cmp.png"
    assert cli.main(["plot", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(out)]) == 0
    head = out.read_bytes()[:8]
    assert head == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert cli.main(["plot", str(tmp_path / "nothing")]) == 2


def test_gap_curve_starts_both_emas_at_the_first_common_step():
    """A run forked at step 10 that repeats the base's losses has gap 0 from its first step on (with each run's
    own EMA, the fork's would start at its first raw loss against the base's lagging average: a false gap); a
    run 1 % above the base has +1 % everywhere."""
    base = {t: 5.0 - 0.2 * t for t in range(1, 21)}
    fork = {t: base[t] for t in range(11, 21)}
    common, gap = cli.gap_curve(base, fork, 0.9)
    assert common == list(range(11, 21)) and max(abs(g) for g in gap) < 1e-12
    common, gap = cli.gap_curve(base, {t: 1.01 * v for t, v in base.items()}, 0.9)
    assert len(common) == 20 and all(abs(g - 1.0) < 1e-9 for g in gap)


def test_demo_quick_plumbing(tmp_path, capsys):
    """The reduced demo end to end (both arms, table, PNG) with stand-in backends; the real FP4 arm is below."""
    out = tmp_path / "demo"
    assert cli.main(["demo", "--quick", "--out-dir", str(out), "--in-process", "--no-progress",
                     "--bf16-backend", "none", "--fp4-backend", "none"]) == 0
    text = capsys.readouterr().out
    assert "bf16" in text and "nvfp4" in text and "gap (val)" in text
    assert (out / "loss.png").stat().st_size > 10_000
    assert (out / "table.txt").read_text().strip() in text
    for arm in ("bf16", "nvfp4"):
        assert json.loads((out / arm / "summary.json").read_text())["step"] == 8


def test_demo_quick_fullstack_fp4(tmp_path, capsys):
    out = tmp_path / "demo"
    assert cli.main(["demo", "--quick", "--out-dir", str(out), "--in-process", "--no-progress"]) == 0
    s = {a: json.loads((out / a / "summary.json").read_text()) for a in ("bf16", "nvfp4")}
    assert s["nvfp4"]["backend"] == "fullstack_fp4" and s["nvfp4"]["policy"] == "full_stack"
    # NVFP4 changes the numbers, but training still works: finite and not far from BF16 after 8 steps
    assert s["nvfp4"]["loss"] != s["bf16"]["loss"]
    assert abs(s["nvfp4"]["val_loss"] - s["bf16"]["val_loss"]) / s["bf16"]["val_loss"] < 0.1


def test_explain_command(capsys, monkeypatch):
    torch._dynamo.reset()        # earlier tests compiled GPTs of other shapes (automatic dynamic shapes)
    assert cli.main(["explain", "--model", "tiny", "--seq", "32"]) == 0
    out = capsys.readouterr().out
    assert "blocks.0.mlp.fc" in out


def test_explain_factory_target(tmp_path, monkeypatch):
    mod = tmp_path / "my_models.py"
    mod.write_text("import torch\n"
                   "class M(torch.nn.Module):\n"
                   "    def __init__(self):\n        super().__init__(); self.fc = torch.nn.Linear(32, 32)\n"
                   "    def forward(self, x):\n        return self.fc(x).sum()\n"
                   "def make():\n    return M(), (torch.randn(4, 32),)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    model, inputs = cli.build_explain_target("my_models:make", 2, 16, 256)
    assert isinstance(model, torch.nn.Module) and inputs[0].shape == (4, 32)
    with pytest.raises(ValueError, match="module:factory"):
        cli.build_explain_target("nonsense", 2, 16, 256)


def test_python_dash_m_entry_point():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "fp4compile", "--help"], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=300)
    assert r.returncode == 0
    for sub in ("demo", "train", "plot", "explain"):
        assert sub in r.stdout
