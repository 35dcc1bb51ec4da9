"""Compile fp4compile's Triton kernels before their first launch, in worker processes, while Inductor compiles.

fp4compile's Triton kernels (quantize, GEMM, attention, ...) are compiled by Triton's JIT at their first launch,
one after another in the training process, in the middle of the first step: ~19 compiles, ~10 s of the
GPT-124M full-stack first step on the H200 (``bench/compile_time.py``). Inductor compiles its own kernels in
parallel worker processes; this module does the same for ours, in three steps:

* :func:`prestart`, at the backend's entry: up to :data:`MAX_WORKERS` background processes (``python -m
  fp4compile.precompile --device cuda:N``) start importing fp4compile and set up CUDA and Triton while
  AOTAutograd traces the joint graph and the passes rewrite it;
* :func:`start`, at the end of the joint-graph pass: every ``fp4compile::`` op call of the graph (op, argument
  shapes, strides, storage offsets, dtypes, constants; see :func:`op_calls`) not sent before is queued, calls
  that compile the same kernels together and the slowest compiles first (:func:`plan`), and each waiting worker
  gets its queue;
* :func:`release`, when the compile is over: idle workers exit.

Each worker runs its calls once on random inputs of exactly those shapes and layouts on the same GPU, so Triton
compiles the same specializations (alignment, divisibility, constexprs) and writes them to its on-disk cache
(autotuned GEMMs: every config, and the autotuner's choice, ``kernels/gemm.py``). When the training process
reaches a kernel, Triton's JIT finds it in that cache instead of compiling it. (That needs kernel cache keys that
do not depend on the order in which a process launches kernels: :func:`fp4compile.kernels.launch.stable_cache_keys`.)

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
import threading
import time
import warnings
from typing import Callable, Iterable, List, Optional

import torch

__all__ = ["enabled", "op_calls", "plan", "prestart", "start", "release", "wait", "replay", "trace_compiles",
           "MAX_WORKERS", "MEMORY_FACTOR", "COMPILE_COST"]

#: most worker processes per :func:`start` (each pays a torch import and a CUDA context, ~300 MiB of GPU memory)
MAX_WORKERS = 4
#: a worker replays a call only with this many times its inputs' bytes free on the GPU (outputs, workspace)
MEMORY_FACTOR = 4
#: rough seconds of Triton compiling at an op's first call (the H200's worker logs, session 23): :func:`plan`
#: orders and spreads the calls by it (ops not listed: 0.5; quantize_both compiles quantize's MS-EDEN kernels, one of
#: them with the transposed store, so it gets quantize's figure)
COMPILE_COST = {"qattn_bwd": 3.2, "qattn": 2.3, "gemm": 1.5, "quantize": 1.5, "quantize_both": 1.5,
                "dequantize": 1.4}
_WORKERS: List[subprocess.Popen] = []   # every worker started (killed at exit if still running)
_IDLE: List[subprocess.Popen] = []      # prestarted workers that have no calls yet
_FEEDERS: List = []                     # the threads writing the workers' calls
_SENT: set = set()
_NS = "fp4compile"
_SPAWN_ERRORS = (OSError, ValueError, subprocess.SubprocessError)  # a worker that cannot start: no head start


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
def _kernel_key(call) -> str:
    """Calls that most likely compile the same Triton kernels: same op, constants and dtypes (shapes aside).
    They go to one worker, which compiles them once (other workers would compile the same kernel again)."""
    def strip(d):
        if "tensor" in d:
            return {"tensor": [len(d["tensor"][0]), d["tensor"][3]]}
        if "list" in d:
            return {"list": [strip(i) for i in d["list"]]}
        return d
    return json.dumps([call["op"], [strip(a) for a in call["args"]],
                       {k: strip(v) for k, v in sorted(call["kwargs"].items())}])


def _op_name(call) -> str:
    return call["op"].split("::")[-1].split(".")[0]


def plan(calls: List[dict], n: int) -> List[List[dict]]:
    """Split ``calls`` into at most ``n`` worker queues: calls grouped by :func:`_kernel_key`, groups assigned
    most expensive first (:data:`COMPILE_COST`) to the least loaded queue (longest-processing-time-first), so the
    attention backward, the slowest compile, starts at the head of a queue of its own."""
    groups: dict = {}
    for c in calls:
        groups.setdefault(_kernel_key(c), []).append(c)

    def cost(g):
        return COMPILE_COST.get(_op_name(g[0]), 0.5) + 0.05 * (len(g) - 1)
    queues: List[List[dict]] = [[] for _ in range(max(1, n))]
    load = [0.0] * len(queues)
    for g in sorted(groups.values(), key=cost, reverse=True):  # (stable: ties keep the graph's order)
        i = load.index(min(load))
        queues[i].extend(g)
        load[i] += cost(g)
    return [q for q in queues if q]


def _n_workers(max_workers: int) -> int:
    return max(1, min(max_workers, (os.cpu_count() or 2) // 2))


def _spawn(device: Optional[str] = None) -> subprocess.Popen:
    """One worker process; it imports fp4compile (and with ``device``, sets up CUDA and Triton) and then waits
    for its calls on stdin. Registered for the exit-time kill at once."""
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, FP4COMPILE_PRECOMPILE="0")  # a worker never starts workers
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    log_dir = os.environ.get("FP4COMPILE_PRECOMPILE_LOG")
    log = subprocess.DEVNULL
    cmd = [sys.executable, "-m", "fp4compile.precompile"] + (["--device", device] if device else [])
    try:
        if log_dir:
            log = open(os.path.join(log_dir, f"precompile-{os.getpid()}-{len(_WORKERS)}.log"), "w")
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True)
    finally:
        if log is not subprocess.DEVNULL:
            log.close()
    _WORKERS.append(p)  # (killed at exit if still running, whatever happens next)
    return p


def _feed(p: subprocess.Popen, calls: List[dict]) -> None:
    """Send a worker its calls and close its stdin, from a thread: a prestarted worker reads them only when its
    set-up is done, and a queue larger than the pipe's buffer must not stall the compile meanwhile."""
    def send():
        try:
            p.stdin.write(json.dumps(calls).encode())
            p.stdin.close()
        except (OSError, ValueError):  # the worker died: only a missed head start
            pass
    t = threading.Thread(target=send, name="fp4compile-precompile-feed", daemon=True)
    t.start()
    _FEEDERS.append(t)


def _cuda_device(example_inputs) -> Optional[str]:
    for x in example_inputs or ():
        if isinstance(x, torch.Tensor) and x.device.type == "cuda":
            return str(x.device if x.device.index is not None else torch.device("cuda", 0))
    return None


def prestart(example_inputs, max_workers: int = MAX_WORKERS) -> int:
    """Start idle workers at the backend's entry, when the graph has CUDA inputs: their imports, CUDA context
    and Triton set-up (a few seconds each) then overlap AOTAutograd's tracing and the joint-graph passes, and
    :func:`start` only hands them their calls. Returns how many it started; never raises. Call :func:`release`
    when the compile is over (the idle ones exit)."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return 0
    device = _cuda_device(example_inputs)
    if device is None:
        return 0
    started = 0
    for _ in range(_n_workers(max_workers) - len(_IDLE)):
        try:
            _IDLE.append(_spawn(device))
        except _SPAWN_ERRORS:
            break
        started += 1
    return started


def release() -> int:
    """Let the idle prestarted workers go (an empty queue: they exit); returns how many."""
    n = 0
    while _IDLE:
        _feed(_IDLE.pop(), [])
        n += 1
    return n


def start(graph: torch.fx.Graph, max_workers: int = MAX_WORKERS) -> int:
    """Send ``graph``'s not yet sent CUDA op calls to workers (prestarted ones first, else new ones), split by
    :func:`plan`; returns how many workers got calls. Never raises for a worker problem (the kernels then compile
    at first launch as before). Under torchrun only local rank 0 sends: the ranks of a host share Triton's cache
    directory."""
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
    started = 0
    for queue in plan(fresh, _n_workers(max_workers)):
        try:
            p = _IDLE.pop(0) if _IDLE else _spawn()
        except _SPAWN_ERRORS:
            break
        _feed(p, queue)
        started += 1
    return started


def wait(timeout: Optional[float] = None) -> List[int]:
    """Wait for the workers started so far (benchmarks and tests; training never needs to): their exit codes,
    None for one still running at ``timeout`` seconds. Idle prestarted workers are released first."""
    release()
    t_end = None if timeout is None else time.monotonic() + timeout
    for t in list(_FEEDERS):
        t.join(None if t_end is None else max(0.0, t_end - time.monotonic()))
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


def _warm_up(device: str) -> None:
    """A prestarted worker's set-up while it waits for its calls: the CUDA context, and one tiny Triton compile
    and launch (loads Triton's CUDA backend and its launcher stub, ~1 s the first real compile would pay)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _fp4compile_warm_up(x_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(x_ptr + i, tl.load(x_ptr + i) + 1.0)

    dev = torch.device(device)
    torch.cuda.set_device(dev)
    x = torch.zeros(16, device=dev)
    _fp4compile_warm_up[(1,)](x, N=16)
    torch.cuda.synchronize(dev)


def trace_compiles(on_compile: Callable) -> None:
    """Wrap ``triton.compile`` in this process: after each call, ``on_compile(name, wall_start, seconds, key,
    spec)`` with the kernel's name, its wall-clock start (``time.time()``), the seconds it took (a disk-cache hit
    takes ~0), the first 12 hex digits of the source's specialization hash (what Triton's cache key is built from)
    and, with ``FP4COMPILE_PRECOMPILE_SPEC=1``, the whole specialization as text (else None). The workers log it;
    ``bench/compile_time.py`` lines the training process's compiles up against theirs."""
    import triton
    import triton.compiler as tc

    real = tc.compile

    def traced(src, *a, **k):
        t0, w0 = time.perf_counter(), time.time()
        try:
            return real(src, *a, **k)
        finally:
            name = getattr(src, "name", None) or getattr(getattr(src, "fn", None), "__name__", "?")
            key = src.hash()[:12] if hasattr(src, "hash") else "?"
            spec = (f"attrs {getattr(src, 'attrs', '?')} sig {getattr(src, 'signature', '?')} "
                    f"consts {getattr(src, 'constants', '?')}") if os.environ.get("FP4COMPILE_PRECOMPILE_SPEC") \
                else None
            on_compile(name, w0, time.perf_counter() - t0, key, spec)
    tc.compile = triton.compile = traced


def _log_compile(name, w0, dt, key, spec) -> None:
    print(f"  triton.compile {name} at {w0:.2f} {dt:.2f} s key {key}", flush=True)
    if spec:
        print(f"    {spec}", flush=True)


def _main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    device = argv[argv.index("--device") + 1] if "--device" in argv else None
    t0 = time.perf_counter()
    import fp4compile.backend  # noqa: F401  (registers every op: fp4compile.ops and the passes' own)

    if device is not None and device.startswith("cuda"):
        try:
            _warm_up(device)
        except Exception as e:  # the replay reports its own errors; this was only a head start
            print(f"warm-up failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
    if device is not None:
        print(f"ready in {time.perf_counter() - t0:.1f} s", flush=True)
    try:
        trace_compiles(_log_compile)
    except (ImportError, AttributeError):
        pass
    calls = json.loads(sys.stdin.read() or "[]")
    print(f"calls received at {time.time():.2f}", flush=True)
    t0 = time.perf_counter()
    counts = replay(calls, log=sys.stdout)
    print(f"done: {counts} in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
