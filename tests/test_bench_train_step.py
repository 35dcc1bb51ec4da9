"""bench/train_step.py's summary line: a target verdict only against a BF16 baseline run in the same process."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("skip_bf16", [False, True])
def test_summary_judges_targets_only_against_a_bf16_run(skip_bf16):
    cmd = [sys.executable, os.path.join(ROOT, "bench", "train_step.py"), "--tiny"] + (["--skip-bf16"] if skip_bf16
                                                                                     else [])
    r = subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = r.stdout.split("all modes ==")[1]
    assert ("inductor bf16" in summary) is not skip_bf16
    assert ("targets: tokens/s ratio" in summary) is not skip_bf16
    assert ("no BF16 baseline (--skip-bf16)" in summary) is skip_bf16
