"""Low-overhead launches of plain ``@triton.jit`` kernels on CUDA.

A compiled training step launches ~1300 of fp4compile's Triton kernels. Triton 3.6's ``fn[grid](...)``
costs ~17 us of host time per launch on the H200 machine (binding every argument, computing the cache key,
checking globals, building launch metadata); at that rate the default (non-CUDA-graph) step is bound by
the host. :func:`launch` keeps Triton's compiled kernels but replaces the per-call bookkeeping with one
dictionary lookup keyed on exactly what Triton specializes a compiled kernel on:

* every tensor argument: its dtype and whether its address is 16-byte aligned;
* every int argument: whether it equals 1 and whether it is divisible by 16, and whether it fits int32;
* every float / bool / None argument: its kind;
* every host-side ``TensorDescriptor`` (TMA): its element type, block shape, padding and rank;
* the constexpr and launch-option keyword arguments, by value;
* the current device.

The first call of each key goes through ``fn[grid](...)`` (which compiles if needed and returns the
``CompiledKernel``); later calls hand the same argument list to the compiled kernel's launcher directly.
Launch hooks (profilers that set ``triton.knobs.runtime.launch_enter_hook``) still get their metadata.

Not used on CPU (``TRITON_INTERPRET=1`` has no compiled kernels): there :func:`launch` is ``fn[grid](...)``.
If the installed Triton's ``CompiledKernel`` lacks the launcher attributes this relies on, the fast path
switches itself off for the process (:data:`FAST`) and every launch goes through ``fn[grid](...)``.
Only for kernels that are not autotuned (call the chosen config's kernel directly instead).
"""
from __future__ import annotations

import os

import torch

from ..devcache import cached

try:
    import triton as _triton
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - Triton is a dependency on Linux
    _triton = _knobs = None

#: the fast path is on (set FP4COMPILE_FAST_LAUNCH=0 to launch every kernel through ``fn[grid](...)``)
FAST = os.environ.get("FP4COMPILE_FAST_LAUNCH", "1") != "0" and os.environ.get("TRITON_INTERPRET", "0") != "1"

_CACHE: dict = {}
_I32 = 2 ** 31
_PLACEHOLDERS: dict = {}


def stable_cache_keys(namespace: dict) -> None:
    """Compute the Triton cache key of every ``@triton.jit`` function of a module, in definition order; called at
    the end of each kernel module's import.

    Triton 3.6 folds a callee's global constexprs (``_DOT_F32``, ...) into its caller's key only when the callee's
    own key was computed before the caller's; otherwise they are left out. Computed lazily, at first launch, a
    kernel's key -- and with it the name of its entry in Triton's disk cache -- then depends on which kernels the
    process happened to launch first: the attention backward compiled by a precompile worker
    (``fp4compile/precompile.py``) was never found by the training process, which compiled it again (session 24).
    Computed here, at import, helpers come before the kernels that call them, in every process alike."""
    jit = getattr(getattr(_triton, "runtime", None), "JITFunction", None) if _triton is not None else None
    if jit is None:
        return
    for v in list(namespace.values()):
        if isinstance(v, jit):  # (under TRITON_INTERPRET=1 kernels are not JITFunctions: nothing to do)
            v.cache_key


def placeholder(device, dtype: torch.dtype) -> torch.Tensor:
    """A cached one-element tensor for kernel arguments that a launch never reads (the signs without an RHT,
    RTN's seed, an unused attention slot): no allocation and fill launch per call. Built outside CUDA-graph
    memory pools, and not cached while a CUDA graph is being captured (``fp4compile.devcache.cached``)."""
    device = torch.device(device)
    return cached(_PLACEHOLDERS, (device, dtype), device, lambda: torch.zeros(1, dtype=dtype, device=device))


def cdiv(a: int, b: int) -> int:
    """Ceiling division of host ints. (``triton.cdiv`` is a Triton constexpr function: called from Python it
    unwraps its arguments through Triton's machinery, several microseconds per call on a launch path.)"""
    return -(-a // b)


def _arg_key(a):
    t = type(a)
    if t is int:
        return (a == 1, a % 16 == 0, -_I32 <= a < _I32)
    if t is bool:
        return ("b", a)
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if t is float:
        return "f"
    if a is None:
        return None
    if isinstance(a, int):  # an int subclass: keyed like an int
        return (int(a) == 1, int(a) % 16 == 0, -_I32 <= int(a) < _I32)
    base = getattr(a, "base", None)
    if isinstance(base, torch.Tensor):  # a host-side TMA TensorDescriptor: compiled per dtype, block, padding
        return ("desc", base.dtype, tuple(a.block_shape), a.padding, len(a.shape))
    return (t, a)  # anything else: keyed by value (e.g. a dtype)


def launch(fn, grid, *args, **meta):
    """``fn[grid](*args, **meta)`` with less host work per call on CUDA (see the module docstring).

    ``args``: the kernel's runtime arguments, positionally, in signature order (the first one a tensor or a
    TMA descriptor: its device picks the path); ``meta``: constexprs and
    launch options (``num_warps``, ``enable_fp_fusion``, ...) by keyword. ``grid``: a tuple of 1-3 ints.
    """
    global FAST
    first = args[0]
    if not FAST or not getattr(first, "base", first).is_cuda:
        return fn[grid](*args, **meta)
    dev = torch.cuda.current_device()
    key = (fn, dev, tuple(meta.items()), tuple(map(_arg_key, args)))
    hit = _CACHE.get(key)
    if hit is None:
        kernel = fn[grid](*args, **meta)
        # the compiled launcher takes every parameter in signature order, constexprs included
        tail = []
        for p in fn.params[len(args):]:
            if p.name in meta:
                tail.append(meta[p.name])
            elif p.has_default:
                tail.append(p.default)
            else:
                raise TypeError(f"{fn.__name__}: missing argument {p.name!r}")
        try:
            kernel._init_handles()
            hit = (kernel, kernel.function, kernel.packed_metadata, tuple(tail))
        except AttributeError:  # a Triton without this launcher API: Triton's own path from now on
            FAST = False
            return kernel
        _CACHE[key] = hit
        return kernel
    kernel, function, packed, tail = hit
    g = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
    stream = torch._C._cuda_getCurrentRawStream(dev)  # what Triton itself launches on
    full = args + tail
    enter = _knobs.runtime.launch_enter_hook
    md = kernel.launch_metadata(g, stream, *full) if enter is not None else None
    kernel.run(g[0], g[1], g[2], stream, function, packed, md, enter, _knobs.runtime.launch_exit_hook, *full)
    return kernel
