"""tests/conftest.py: ``FP4COMPILE_TEST_TIMES`` (one line per test phase, written as the phase ends) and the threads
of a pytest-xdist worker."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


def _conftest():
    """A fresh copy of tests/conftest.py as a module."""
    spec = importlib.util.spec_from_file_location("_conftest_under_test", ROOT / "tests" / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


W = {"PYTEST_XDIST_WORKER": "gw3"}


@pytest.mark.parametrize("env,cpus,want", [
    ({**W, "PYTEST_XDIST_WORKER_COUNT": "8"}, 16, 2), ({**W, "PYTEST_XDIST_WORKER_COUNT": "3"}, 16, 5),
    ({**W, "PYTEST_XDIST_WORKER_COUNT": "32"}, 16, 1), ({**W, "PYTEST_XDIST_WORKER_COUNT": "8"}, 1, 1),
    ({**W, "PYTEST_XDIST_WORKER_COUNT": "8", "OMP_NUM_THREADS": "4"}, 16, None), ({}, 16, None),
    ({"PYTEST_XDIST_WORKER_COUNT": "8"}, 16, None), ({**W, "PYTEST_XDIST_WORKER_COUNT": ""}, 16, 16),
])
def test_an_xdist_worker_gets_its_share_of_the_cpus(env, cpus, want):
    assert _conftest().xdist_worker_threads(env, cpus) == want


def test_the_configure_hook_sets_the_workers_threads_and_their_subprocesses(monkeypatch):
    mod, before = _conftest(), torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "")  # recorded, so that the hook's value is undone after the test
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(4 * mod._cpus()))
    try:
        mod.pytest_configure(None)
        assert torch.get_num_threads() == 1 and os.environ["OMP_NUM_THREADS"] == "1"
        monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's value: left alone, torch's threads too
        mod.pytest_configure(None)
        assert os.environ["OMP_NUM_THREADS"] == "3" and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
