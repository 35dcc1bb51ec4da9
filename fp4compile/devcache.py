"""Small device tensors cached across calls (placeholders, lookup tables), allocated outside CUDA-graph pools.

Inductor's CUDA-graph trees (``mode="reduce-overhead"``) run each new graph once eagerly before recording it
(the *warmup*), and during that warmup every allocation of the calling thread goes to the graphs' private
memory pool. A tensor created there and kept in a module-level cache is a live allocation the pool does not
track: the next recording stops with "Detected N tensor(s) in the cudagraph pool not tracked as outputs". While
a stream is capturing, a cached tensor would even belong to the captured graph. :func:`cached` builds such
tensors where neither can happen.
"""
from __future__ import annotations

import threading
from typing import Callable, Hashable

import torch

__all__ = ["cached"]


def cached(cache: dict, key: Hashable, device, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``cache[key]``, built by ``make()`` (a tensor on ``device``) on the first call.

    On CUDA the tensor is built in a short-lived helper thread, whose allocations go to the ordinary caching
    allocator even while this thread's go to a CUDA-graph pool; the helper waits for its initialisation to
    finish before handing it over (once per entry). While the current stream is capturing a CUDA graph,
    ``make()`` runs in place and its tensor is returned uncached (it belongs to the graph being captured).
    """
    t = cache.get(key)
    if t is not None:
        return t
    device = torch.device(device)
    if device.type != "cuda":
        t = make()
    elif torch.cuda.is_current_stream_capturing():
        return make()
    else:
        box: list = []

        def build():
            try:
                with torch.cuda.device(device):
                    box.append(make())
                    torch.cuda.current_stream().synchronize()
            except BaseException as e:  # re-raised in the caller's thread
                box[:] = [e]

        th = threading.Thread(target=build, name="fp4compile-devcache", daemon=True)
        th.start()
        th.join()
        if isinstance(box[0], BaseException):
            raise box[0]
        t = box[0]
    cache[key] = t
    return t
