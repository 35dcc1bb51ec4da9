"""Timers shared by the bench scripts (imported as ``bench.timing``; the scripts put the repo root on sys.path)."""
from __future__ import annotations

import time

import torch


def host_us(fn, n: int, warmup: int = 5) -> float:
    """Host microseconds per call of ``fn`` on CUDA: ``warmup`` calls, then ``n`` calls queued without a sync
    inside the timed loop (at these counts the launch queue does not fill), i.e. what the Python / launch side
    costs per call; the GPU is drained before and after."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return us
