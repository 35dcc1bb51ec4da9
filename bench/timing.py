"""Timers and profiler tables shared by the bench scripts (imported as ``bench.timing``; the scripts put the repo root on sys.path)."""
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


def profile_steps(run_steps, steps: int, top: int = 25) -> str:
    """:func:`kernel_table` of a torch.profiler trace of ``run_steps(steps)`` (CPU and, where there is one, CUDA
    activity; the GPU drained before the trace ends)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        run_steps(steps)
        if cuda:
            torch.cuda.synchronize()
    return kernel_table(prof, steps, top=top)


def kernel_table(prof, steps, top=25):
    """Top CUDA kernels (self device time per step) of a torch.profiler trace, and totals by family."""
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0)
        if t > 0 and getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type):
            rows.append((t / steps, e.count // steps, e.key))
    if not rows:  # older profilers: take every event with device time
        for e in prof.key_averages():
            t = getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0))
            if t > 0:
                rows.append((t / steps, e.count // steps, e.key))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    out = [f"{'us/step':>10} {'%':>6} {'calls':>6}  kernel (top {top} of {len(rows)}; total {total / 1e3:.2f} ms/step)"]
    for t, c, k in rows[:top]:
        out.append(f"{t:>10.0f} {100 * t / total:>6.1f} {c:>6}  {k[:110]}")
    fam = {}
    for t, c, k in rows:
        n = k.lower()
        f = ("nvfp4 gemm (triton)" if any(x in n for x in ("_nvfp4", "_bf16_tma", "_bf16_nvfp4")) else
             "nvfp4 quantize" if any(x in n for x in ("_quantize_kernel", "_amax_kernel", "_eden_pass",
                                                      "_transpose_kernel", "_quant2d_kernel")) else
             "nvfp4 dequantize" if "dequant" in n else
             "attention" if any(x in n for x in ("flash", "fmha", "cudnn", "attention", "sdpa", "_attn_")) else
             "cuBLAS gemm" if any(x in n for x in ("gemm", "nvjet", "xmma", "cutlass", "sm90")) else
             "inductor fused (triton_*)" if "triton" in n else
             "optimizer" if any(x in n for x in ("adam", "foreach", "multi_tensor")) else "other")
        fam[f] = fam.get(f, 0.0) + t
    out.append("by family (us/step): " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(fam.items(), key=lambda x: -x[1])))
    return "\n".join(out)
