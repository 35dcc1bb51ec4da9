"""Compile fp4compile's Triton kernels before their first launch, in worker processes, while Inductor compiles.

fp4compile's Triton kernels (quantize, GEMM, attention, ...) are compiled by Triton's JIT at their first launch,
one after another in the training process, in the middle of the first step: ~19 compiles, ~10 s of the
GPT-124M full-stack first step on the H200 (``bench/compile_time.py``). Inductor compiles its own kernels in
parallel worker processes; this module does the same for ours. When the joint-graph pass has rewritten the
graph, :func:`start` collects every ``fp4compile::`` op call of it (op, argument shapes, strides, storage
offsets, dtypes, constants; see :func:`op_calls`), drops the ones already sent, and hands them to up to
:data:`MAX_WORKERS` background processes (``python -m fp4compile.precompile``). Each worker runs its calls once
on random inputs of exactly those shapes and layouts on the same GPU, so Triton compiles the same
specializations (alignment, divisibility, constexprs) and writes them to its on-disk cache (autotuned GEMMs:
every config). When the training process reaches a kernel, Triton's JIT finds it in that cache instead of
compiling it.

Nothing waits for the workers and nothing depends on them: a kernel that is not ready yet is compiled by the
training process as before (Triton's cache writes are atomic), a call a worker cannot replay (an exception, not
enough free GPU memory: it needs :data:`MEMORY_FACTOR` x its inputs' bytes free) is skipped, and results never
come back from a worker. Workers still running when the training process exits are killed.

Off with ``options={"precompile": False}`` or ``FP4COMPILE_PRECOMPILE=0``. Only graphs on CUDA start workers (the
CPU runs the torch references, which compile nothing), and under torchrun only local rank 0's (the ranks of a
host share Triton's cache directory). ``FP4COMPILE_PRECOMPILE_LOG=DIR`` keeps each
worker's log (one line per call: op, seconds, ok / skipped / the error) in ``DIR``.
"""
from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import time
import warnings
from typing import Iterable, List, Optional

import torch

__all__ = ["enabled", "op_calls", "start", "wait", "replay", "MAX_WORKERS", "MEMORY_FACTOR"]

#: most worker processes per :func:`start` (each pays a torch import and a CUDA context, ~300 MiB of GPU memory)
MAX_WORKERS = 4
#: a worker replays a call only with this many times its inputs' bytes free on the GPU (outputs, workspace)
MEMORY_FACTOR = 4
_WORKERS: List[subprocess.Popen] = []
_SENT: set = set()
_NS = "fp4compile"


def enabled(option: Optional[bool] = None) -> bool:
    """Whether :func:`start` should run: the backend option if given, else ``FP4COMPILE_PRECOMPILE`` (default on)."""
    if option is not None:
        return bool(option)
    return os.environ.get("FP4COMPILE_PRECOMPILE", "1") != "0"


# ------------------------------------------------------------------------------------------------ descriptions
def _describe(x):
    """JSON-able description of one op argument; None if it cannot be replayed (a symbolic shape, an unknown type)."""
    from torch.fx import Node

    if isinstance(x, Node):
        x = x.meta.get("val")
        if not isinstance(x, torch.Tensor):
            return None
    if isinstance(x, torch.Tensor):
        shape, stride, offset = list(x.shape), list(x.stride()), x.storage_offset()
        if not all(type(s) is int for s in shape + stride + [offset]):  # symbolic (dynamic shapes): never int()
            return None                                                  # a SymInt (that would add a guard)
        return {"tensor": [shape, stride, offset, str(x.dtype).replace("torch.", ""), str(x.device)]}
    if isinstance(x, torch.dtype):
        return {"dtype": str(x).replace("torch.", "")}
    if x is None or isinstance(x, (bool, int, float, str)):
        return {"const": x}
    if isinstance(x, (list, tuple)):
        items = [_describe(i) for i in x]
        return None if any(i is None for i in items) else {"list": items}
    return None


def op_calls(graph: torch.fx.Graph) -> List[dict]:
    """The distinct ``fp4compile::`` op calls of ``graph`` whose arguments all have static shapes: one dict per
    call, ``{"op": "fp4compile::gemm.default", "args": [...], "kwargs": {...}, "device": "cuda:0"}``."""
    calls, seen = [], set()
    for n in graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        if n.target.namespace != _NS:
            continue
        args = [_describe(a) for a in n.args]
        kwargs = {k: _describe(v) for k, v in n.kwargs.items()}
        if any(a is None for a in args) or any(v is None for v in kwargs.values()):
            continue
        devices = {d["tensor"][4] for d in _tensors(args + list(kwargs.values()))}
        if len(devices) != 1:
            continue
        call = {"op": f"{n.target._schema.name}.{n.target._overloadname}", "args": args, "kwargs": kwargs,
                "device": devices.pop()}
        key = json.dumps(call, sort_keys=True)
        if key not in seen:
            seen.add(key)
            calls.append(call)
    return calls


def _tensors(descs: Iterable):
    for d in descs:
        if "tensor" in d:
            yield d
        elif "list" in d:
            yield from _tensors(d["list"])


# ------------------------------------------------------------------------------------------------ main process
def start(graph: torch.fx.Graph, max_workers: int = MAX_WORKERS) -> int:
    """Send ``graph``'s not yet sent CUDA op calls to new worker processes; returns how many it started.
    Never raises for a worker problem (it then starts none: the kernels compile at first launch as before).
    Under torchrun only local rank 0 starts workers: the ranks of a host share Triton's cache directory."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return 0
    try:
        calls = [c for c in op_calls(graph) if c["device"].startswith("cuda")]
    except Exception as e:  # a graph this module does not understand: no head start, never a failed compile
        warnings.warn(f"fp4compile.precompile: no workers started ({type(e).__name__}: {e})", stacklevel=2)
        return 0
    fresh = []
    for c in calls:
        key = json.dumps(c, sort_keys=True)
        if key not in _SENT:
            _SENT.add(key)
            fresh.append(c)
    if not fresh:
        return 0
    n = max(1, min(max_workers, len(fresh), (os.cpu_count() or 2) // 2))
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, FP4COMPILE_PRECOMPILE="0")  # a worker never starts workers
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    log_dir = os.environ.get("FP4COMPILE_PRECOMPILE_LOG")
    started = 0
    for i in range(n):
        part = fresh[i::n]
        log = subprocess.DEVNULL
        try:
            if log_dir:
                log = open(os.path.join(log_dir, f"precompile-{os.getpid()}-{len(_WORKERS)}.log"), "w")
            p = subprocess.Popen([sys.executable, "-m", "fp4compile.precompile"], stdin=subprocess.PIPE,
                                 stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            _WORKERS.append(p)  # (killed at exit if still running, whatever happens next)
            p.stdin.write(json.dumps(part).encode())
            p.stdin.close()
        except OSError:
            break
        finally:
            if log is not subprocess.DEVNULL:
                log.close()
        started += 1
    return started


def wait(timeout: Optional[float] = None) -> List[int]:
    """Wait for the workers started so far (benchmarks and tests; training never needs to): their exit codes,
    None for one still running at ``timeout`` seconds."""
    t_end = None if timeout is None else time.monotonic() + timeout
    codes = []
    for p in _WORKERS:
        try:
            left = None if t_end is None else max(0.0, t_end - time.monotonic())
            codes.append(p.wait(left))
        except subprocess.TimeoutExpired:
            codes.append(None)
    return codes


@atexit.register
def _stop():
    for p in _WORKERS:
        if p.poll() is None:
            p.kill()


# ------------------------------------------------------------------------------------------------ worker
def _build(d, gen: torch.Generator):
    """A tensor / constant from its description; tensors get random contents of their dtype."""
    if "const" in d:
        return d["const"]
    if "dtype" in d:
        return getattr(torch, d["dtype"])
    if "list" in d:
        return [_build(i, gen) for i in d["list"]]
    shape, stride, offset, dtype, device = d["tensor"]
    dtype = getattr(torch, dtype)
    extent = offset + sum((s - 1) * st for s, st in zip(shape, stride) if s > 0) + 1 if all(shape) else offset
    n = max(extent, 1)
    if dtype.is_floating_point and dtype.itemsize >= 2:
        flat = torch.randn(n, generator=gen, device=device).to(dtype)
        if not shape:  # a 0-dim float (a global scale): positive
            flat = flat.abs() + 0.5
    elif dtype.is_floating_point:  # float8: small positive values
        flat = (torch.rand(n, generator=gen, device=device) + 0.5).to(dtype)
    elif dtype == torch.bool:
        flat = torch.rand(n, generator=gen, device=device) < 0.5
    else:
        hi = 256 if dtype == torch.uint8 else 2 ** 20
        flat = torch.randint(0, hi, (n,), generator=gen, device=device).to(dtype)
    return flat.as_strided(shape, stride, offset)


def _nbytes(call) -> int:
    return sum(max(1, torch.Size(d["tensor"][0]).numel()) * getattr(torch, d["tensor"][3]).itemsize
               for d in _tensors(call["args"] + list(call["kwargs"].values())))


def replay(calls: List[dict], log=None) -> dict:
    """Run each described call once on random inputs (what a worker does); returns ``{"ok", "skipped",
    "failed"}`` counts. ``log``: a text stream for one line per call."""
    counts = {"ok": 0, "skipped": 0, "failed": 0}
    for call in calls:
        t0 = time.perf_counter()
        dev = torch.device(call["device"])
        try:
            if dev.type == "cuda":
                free, _ = torch.cuda.mem_get_info(dev)
                if _nbytes(call) * MEMORY_FACTOR > free:
                    counts["skipped"] += 1
                    print(f"{call['op']}: skipped (needs {MEMORY_FACTOR} x {_nbytes(call)} B, {free} B free)",
                          file=log, flush=True)
                    continue
            name, overload = call["op"].split("::")[1].split(".")
            op = getattr(getattr(torch.ops.fp4compile, name), overload)
            gen = torch.Generator(device=dev).manual_seed(0)
            with torch.no_grad():
                args = [_build(a, gen) for a in call["args"]]
                kwargs = {k: _build(v, gen) for k, v in call["kwargs"].items()}
                op(*args, **kwargs)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            counts["ok"] += 1
            print(f"{call['op']}: ok {time.perf_counter() - t0:.2f} s", file=log, flush=True)
        except Exception as e:  # a call that cannot be replayed is only a missed head start
            counts["failed"] += 1
            print(f"{call['op']}: failed {type(e).__name__}: {str(e)[:300]}", file=log, flush=True)
        finally:
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return counts


def _main() -> int:
    calls = json.loads(sys.stdin.read() or "[]")
    import fp4compile.backend  # noqa: F401  (registers every op: fp4compile.ops and the passes' own)

    t0 = time.perf_counter()
    counts = replay(calls, log=sys.stdout)
    print(f"done: {counts} in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
