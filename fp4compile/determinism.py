"""Run-to-run reproducibility: the settings under which two runs of one configuration give the same bits.

By default a training run is not bit-reproducible. Two GPU runs of the 30M full stack with the same seed, code and
machine differ from step 2 on (sessions 36 and 60; ``bench/compare_runs.py``). Two CPU runs (2 threads) of the full
stack differed too, from step 3 or 5: MKL's multithreaded SGEMM in Q-Attn's reference does not fix its summation
order unless told to. :func:`deterministic_mode` turns on every setting this project knows of:

* ``torch.use_deterministic_algorithms(True)``: deterministic CUDA kernels where PyTorch has one (e.g.
  ``index_put`` with accumulation, behind an embedding's backward), an error where it has none, and uninitialized
  memory filled (``torch.utils.deterministic.fill_uninitialized_memory``, unless :data:`FILL_UNINITIALIZED` is
  off). Inductor also stops benchmarking candidate kernels when this is on, and
  ``torch._inductor.config.deterministic`` (where the torch version has it) is set too. A benchmark picks by
  timing, and a different pick can sum in a different order.
* ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (unless set) and ``torch.backends.cudnn.deterministic``, as PyTorch's
  reproducibility notes ask.
* fp4compile's own autotuned GEMMs (``kernels/gemm.py``) launch a fixed tile instead of the fastest one timed
  (:func:`enabled` is what they check). Their tiles differ in ``BLOCK_K``, so in summation order.
* ``MKL_CBWR=AUTO,STRICT`` (unless set) for the CPU: MKL reads it at its first call, so it has to be set before the
  process's first matrix product. ``fp4compile train --deterministic`` sets it in time; in a process that has
  already run a matrix product it changes nothing (and cannot tell), so a long-lived process (a test session, a
  notebook) should set it in the environment before starting.

Everything is restored on exit except the two environment variables: a cuBLAS workspace or MKL mode already chosen
cannot be chosen again.

What stays outside: NCCL reductions across ranks, and Triton kernels that sum with atomics. fp4compile's kernels
use only ``atomic_max``, whose result does not depend on the order. Performance: deterministic modes are slower
(Inductor's untuned kernels, fixed GEMM tiles, filled memory); use it to reproduce, not to benchmark.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

#: the cuBLAS workspace setting PyTorch requires for deterministic cuBLAS with CUDA >= 10.2
CUBLAS_WORKSPACE = ":4096:8"
#: MKL's conditional numerical reproducibility mode: the fastest code path, summation order fixed
MKL_CBWR = "AUTO,STRICT"
#: whether deterministic mode leaves ``torch.utils.deterministic.fill_uninitialized_memory`` on (PyTorch's default
#: under deterministic algorithms): every ``torch.empty`` is then filled (NaN for floats), and under CUDA graphs the
#: fills are captured and replayed every step. Needed for the same bits only where a kernel reads memory it did not
#: write first; ``FP4COMPILE_DETERMINISTIC_FILL=0`` turns it off, to measure what the fills cost (two runs that
#: still agree bit for bit then show that nothing reads uninitialized memory). Session 62 (one H100, the 30M full
#: stack's default arm, 100 steps): with the fills 0.858x the default mode's tokens/s, without them 0.958x, and the
#: two deterministic runs gave the same train-loss bits at every step, so no kernel of that arm reads memory it did
#: not write. The fills stay on by default (PyTorch's choice: other policies and models are not checked); set
#: ``FP4COMPILE_DETERMINISTIC_FILL=0`` for the ~12 % once a configuration has been checked the same way.
FILL_UNINITIALIZED = os.environ.get("FP4COMPILE_DETERMINISTIC_FILL", "1") != "0"


def enabled() -> bool:
    """Whether deterministic algorithms are on (:func:`deterministic_mode`, or the user's own
    ``torch.use_deterministic_algorithms(True)``): fp4compile's autotuned kernels then launch a fixed config."""
    return torch.are_deterministic_algorithms_enabled()


def set_environment() -> None:
    """Set ``CUBLAS_WORKSPACE_CONFIG`` and ``MKL_CBWR`` unless the user has set them. They only take effect
    before the first cuBLAS / MKL call of the process."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    os.environ.setdefault("MKL_CBWR", MKL_CBWR)


@contextlib.contextmanager
def deterministic_mode(on: bool = True) -> Iterator[None]:
    """Within the block, run with every reproducibility setting of the module docstring (``on=False``: a no-op,
    so a caller can pass a config flag straight through). Restores torch's and Inductor's settings on exit."""
    if not on:
        yield
        return
    set_environment()
    import torch._inductor.config as inductor_config

    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
             torch.utils.deterministic.fill_uninitialized_memory)
    has_inductor_flag = hasattr(inductor_config, "deterministic")
    saved_inductor = inductor_config.deterministic if has_inductor_flag else None
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.utils.deterministic.fill_uninitialized_memory = FILL_UNINITIALIZED
    if has_inductor_flag:
        inductor_config.deterministic = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2], saved[3]
        torch.utils.deterministic.fill_uninitialized_memory = saved[4]
        if has_inductor_flag:
            inductor_config.deterministic = saved_inductor
