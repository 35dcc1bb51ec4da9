"""Small device tensors cached across calls (placeholders, lookup tables), allocated outside CUDA-graph pools.

Inductor's CUDA-graph trees (``mode="reduce-overhead"``) run each new graph once eagerly before recording it
(the *warmup*), and during that warmup every allocation of the calling thread goes to the graphs' private
memory pool. A tensor created there and kept in a module-level cache is a live allocation the pool does not
track: the next recording stops with "Detected N tensor(s) in the cudagraph pool not tracked as outputs". While
a stream is capturing, a cached tensor would even belong to the captured graph. :func:`persistent` builds
such tensors where neither can happen.
"""
from __future__ import annotations

import threading
from typing import Callable, Optional

import torch

__all__ = ["persistent"]


def persistent(make: Callable[[], torch.Tensor], device) -> Optional[torch.Tensor]:
    """``make()`` for a tensor that will be cached and reused across calls on ``device``.

    CPU: ``make()``. CUDA: ``None`` while the current stream is capturing a CUDA graph (the caller uses an
    uncached tensor then); otherwise ``make()`` runs in a short-lived helper thread, whose allocations go to
    the ordinary caching allocator even while this thread's go to a CUDA-graph pool, and the helper waits
    for the tensor's initialisation to finish before it is handed over (once per cache entry).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return make()
    if torch.cuda.is_current_stream_capturing():
        return None
    box: list = []

    def build():
        try:
            with torch.cuda.device(device):
                t = make()
                torch.cuda.current_stream().synchronize()
            box.append(t)
        except BaseException as e:  # re-raised in the caller's thread
            box.append(e)

    th = threading.Thread(target=build, name="fp4compile-persistent", daemon=True)
    th.start()
    th.join()
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]
