"""Test-suite hooks.

``FP4COMPILE_TEST_TIMES=PATH`` appends one tab-separated line per test phase to PATH as each phase ends: node id,
phase (setup / call / teardown), outcome and seconds. Unlike ``--durations``, which prints only when the session
ends, the file survives a run that a time limit kills, so a GPU-suite call cut short still says where its time went
(``bash bench/run_h200.sh gpu_suite`` sets it). Under pytest-xdist only the controller writes: the workers' reports
reach it through the same hook.
"""

import os


def pytest_runtest_logreport(report):
    path = os.environ.get("FP4COMPILE_TEST_TIMES")
    if not path or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"{report.nodeid}\t{report.when}\t{report.outcome}\t{report.duration:.3f}\n")
