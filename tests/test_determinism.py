"""fp4compile.determinism: the settings deterministic mode turns on and gives back, the GEMM tiles it launches
instead of timing them, and two `fp4compile train --deterministic` runs giving the same bits on the CPU."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from fp4compile import determinism
from fp4compile.train.loop import read_metrics, train_losses


def test_deterministic_mode_sets_and_restores_torch_and_inductor(monkeypatch):
    import torch._inductor.config as inductor_config

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")                   # the user's own value is kept
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
              torch.backends.cudnn.benchmark, getattr(inductor_config, "deterministic", None))
    assert not before[0] and not determinism.enabled()
    with determinism.deterministic_mode(False):
        assert not determinism.enabled()
    with determinism.deterministic_mode():
        assert determinism.enabled() and torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        if hasattr(inductor_config, "deterministic"):
            assert inductor_config.deterministic is True
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == determinism.CUBLAS_WORKSPACE
        assert os.environ["MKL_CBWR"] == "COMPATIBLE"
    after = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark, getattr(inductor_config, "deterministic", None))
    assert after == before
    with pytest.raises(ZeroDivisionError):                          # restored on an error too
        with determinism.deterministic_mode():
            1 / 0
    assert not determinism.enabled()


@pytest.mark.parametrize("fill", [True, False])
def test_deterministic_mode_fill_switch_sets_and_restores_the_fill(monkeypatch, fill):
    """FILL_UNINITIALIZED (FP4COMPILE_DETERMINISTIC_FILL) decides torch's fill of uninitialized memory inside the
    block, and the user's own setting comes back after it; with the fill on, torch.empty under deterministic mode
    gives NaN (PyTorch's documented fill)."""
    monkeypatch.setattr(determinism, "FILL_UNINITIALIZED", fill)
    monkeypatch.setattr(torch.utils.deterministic, "fill_uninitialized_memory", not fill)
    with determinism.deterministic_mode():
        assert torch.utils.deterministic.fill_uninitialized_memory is fill
        if fill:
            assert torch.isnan(torch.empty(1000)).all()
    assert torch.utils.deterministic.fill_uninitialized_memory is (not fill)


def test_deterministic_gemm_tiles_are_the_autotuners_candidates_in_order():
    """The tiles deterministic mode tries are exactly those Triton's autotuner would keep after
    ``_prune_configs``, in the same order (built from triton.Config objects, as ``_get_tuned_kernel`` builds them)."""
    triton = pytest.importorskip("triton")
    from fp4compile.kernels import gemm as G

    for impl, space in G.CONFIG_SPACES.items():
        configs = [triton.Config({k: v for k, v in c.items() if k not in ("num_warps", "num_stages")},
                                 num_warps=c["num_warps"], num_stages=c["num_stages"]) for c in space]
        for M, N in ((4096, 4096), (1000, 64), (96, 3000), (256, 256), (64, 64), (4096, 200)):
            kept = G._prune_configs(configs, {"M": M, "N": N})
            want = [dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages) for c in kept]
            assert G.deterministic_configs(impl, M, N) == want, (impl, M, N)


def test_first_that_fits_skips_only_out_of_resources():
    from fp4compile.kernels import gemm as G

    class OutOfResources(Exception):
        pass

    tried = []

    def run(c):
        tried.append(c)
        if c < 2:
            raise OutOfResources("shared memory")
        return c * 10

    assert G.first_that_fits([0, 1, 2, 3], run) == 20 and tried == [0, 1, 2]
    tried.clear()                                     # with a key the choice is kept: the next call launches it
    assert G.first_that_fits([0, 1, 2, 3], run, key="test-shape") == 20 and tried == [0, 1, 2]
    assert G.first_that_fits([0, 1, 2, 3], run, key="test-shape") == 20 and tried == [0, 1, 2, 2]
    G._FITS.pop("test-shape")
    with pytest.raises(RuntimeError, match="none of 2 GEMM tiles"):
        G.first_that_fits([0, 1], run)

    def broken(c):
        raise ValueError("a real bug")

    with pytest.raises(ValueError, match="a real bug"):
        G.first_that_fits([2, 3], broken)


def _train_cli(out, *extra, fill=True):
    cmd = [sys.executable, "-m", "fp4compile", "train", "--model", "cpu", "--tokenizer", "bytes",
           "--train-data", "stdlib", "--val-data", "stdlib:val", "--batch-size", "4", "--seq-len", "64",
           "--steps", "6", "--warmup-steps", "1", "--eval-batches", "2", "--log-interval", "1",
           "--out-dir", str(out), "--no-progress", "--device", "cpu", "--seed", "0", "--backend", "fullstack_fp4",
           "--policy", "full_stack", "--optimizer", "qroot", "--threads", "2", *extra]
    env = {k: v for k, v in os.environ.items()
           if k not in ("MKL_CBWR", "CUBLAS_WORKSPACE_CONFIG", "FP4COMPILE_DETERMINISTIC_FILL")}
    if not fill:
        env["FP4COMPILE_DETERMINISTIC_FILL"] = "0"
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=600)
    return read_metrics(out)


def test_two_deterministic_cpu_runs_of_the_full_stack_are_the_same_bits(tmp_path):
    """The full stack (Q-Attn, NVFP4 linears, Q-Root) on 2 CPU threads, two processes: with --deterministic every
    step's train loss and the final val loss are the same bits. (Without it, session 60 saw such runs part at step 3
    or 5 in three pairs out of three: MKL's threaded SGEMM in Q-Attn's reference.) A third run with torch's fill of
    uninitialized memory off (``FP4COMPILE_DETERMINISTIC_FILL=0``) gives the same bits too: with the fill every
    ``torch.empty`` starts as NaN, so no op of the CPU path reads memory it did not write."""
    runs = [_train_cli(tmp_path / "a", "--deterministic"), _train_cli(tmp_path / "b", "--deterministic"),
            _train_cli(tmp_path / "nofill", "--deterministic", fill=False)]
    losses = [train_losses(run) for run in runs]
    assert len(losses[0]) == 6 and losses[0] == losses[1] == losses[2]
    vals = [[r["val_loss"] for r in run if "val_loss" in r] for run in runs]
    assert vals[0] and vals[0] == vals[1] == vals[2]
