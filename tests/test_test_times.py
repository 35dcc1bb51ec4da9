"""``FP4COMPILE_TEST_TIMES`` (tests/conftest.py): one line per test phase, written as the phase ends."""

import os
import subprocess
import sys
from pathlib import Path

NODE = "tests/test_nvfp4_format.py::test_ml_dtypes_rounding_behaviour"
ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path, **env):
    """Run NODE in a fresh pytest with FP4COMPILE_TEST_TIMES set (and ENV); the times file's path."""
    path = tmp_path / "times.tsv"
    full = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    full.update(FP4COMPILE_TEST_TIMES=str(path), **env)
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", NODE], cwd=ROOT, env=full,
                   check=True, capture_output=True)
    return path


def test_every_phase_is_written_with_its_outcome_and_seconds(tmp_path):
    rows = [line.split("\t") for line in _run(tmp_path).read_text().splitlines()]
    assert [tuple(r[:3]) for r in rows] == [(NODE, w, "passed") for w in ("setup", "call", "teardown")]
    assert all(float(r[3]) >= 0 for r in rows)


def test_an_xdist_worker_writes_nothing(tmp_path):
    assert not _run(tmp_path, PYTEST_XDIST_WORKER="gw0").exists()
