"""Test-suite hooks.

``FP4COMPILE_TEST_TIMES=PATH`` appends one tab-separated line per test phase to PATH as each phase ends: node id,
phase (setup / call / teardown), outcome and seconds. Unlike ``--durations``, which prints only when the session
ends, the file survives a run that a time limit kills, so a GPU-suite call cut short still says where its time went
(``bash bench/run_h200.sh gpu_suite`` sets it). Under pytest-xdist only the controller writes: the workers' reports
reach it through the same hook.

Under pytest-xdist each worker's CPU ops get the machine's CPUs shared out among the workers (at least one thread
each; ``OMP_NUM_THREADS``, where set, wins). Without that every worker starts one OpenMP thread per CPU: 8 workers
on 16 CPUs ran 128 threads, and the GPU tests' CPU references (a Newton–Schulz in NVFP4, a float64 SVD) took
~300 s in the suite against ~13 s alone (session 64; the GPU suite has not yet run with this). On 2 CPUs, 4
processes of that CPU reference with 2 threads each took 10x as long as with 1.
"""

import os


def pytest_runtest_logreport(report):
    path = os.environ.get("FP4COMPILE_TEST_TIMES")
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"{report.nodeid}\t{report.when}\t{report.outcome}\t{report.duration:.3f}\n")


def _cpus():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS, Windows)
        return os.cpu_count() or 1


def xdist_worker_threads(env, cpus):
    """Threads for one pytest-xdist worker's CPU ops: ``cpus`` shared out among ``PYTEST_XDIST_WORKER_COUNT`` workers,
    at least one; None outside a worker or where ``OMP_NUM_THREADS`` is set (the user's choice stands)."""
    if not env.get("PYTEST_XDIST_WORKER") or env.get("OMP_NUM_THREADS"):
        return None
    return max(1, cpus // max(1, int(env.get("PYTEST_XDIST_WORKER_COUNT") or 1)))


def pytest_configure(config):
    n = xdist_worker_threads(os.environ, _cpus())
    if n is not None:
        import torch

        os.environ["OMP_NUM_THREADS"] = str(n)  # the worker's subprocesses too
        torch.set_num_threads(n)
