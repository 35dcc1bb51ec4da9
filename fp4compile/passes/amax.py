"""Pass 5b (joint graph, after the linear rewrite): an activation's amax reduced where the activation is made.

An RTN / SR quantize (``fp4compile::quantize`` / ``quantize_dq``) needs the tensor's max|x| before its first block
scale, so on CUDA it reads x twice: an amax pass, then the quantize pass. For a tensor made by an Inductor kernel
(a LayerNorm, a GELU: the inputs of a block's qkv, fc and mlp-proj linears; with an RTN backward policy, gradients
too), :func:`fuse_amax` computes the amax in the graph instead, as ``amax(amax(|x|, -1), 0)`` in FP32, and gives it
to the quantize node (its ``amax`` argument). The first reduction has the producer's iteration space (rows x
features), so Inductor can fuse it into the kernel that writes x; the second reduces one value per row (on the CPU
Inductor fuses both into the LayerNorm's and the GELU's loops). The quantize kernel then reads x once. The values
are the same (max is exact in any order; the CPU reference checks that a given amax equals max|x|).

Which producers (:data:`FUSE_AMAX`, ``FP4COMPILE_FUSE_AMAX``; part of the joint pass's cache key): ``"off"``;
``"norms"``, only tensors whose producer is a pointwise function of a reduction over the tensor's rows (the joint
graph is decomposed: a LayerNorm, RMSNorm, softmax or their backwards; Inductor's kernel for it reduces every row
anyway, one more max is nearly free); ``"all"`` (the default), every tensor an Inductor kernel makes. A pointwise
producer such as a GELU becomes a reduction kernel: over its 3,072-wide rows the 124M step's GELU kernel went from
63 to 116 µs per call on the H200 (session 35), more than the amax pass it saved (+0.29 ms a step); over rows of
:data:`POINTWISE_ROW` = 1,024 elements (a view of the contiguous tensor) it is a persistent reduction, 80 µs, and
the step 0.20 ms faster than with the pass off, as ``"norms"`` is.

Left alone: weights (graph inputs: a reduction there is one more pass, nothing to fuse into), tensors made by an
opaque op (fp4compile's own ops such as Q-Attn, GEMMs, SDPA), MS-EDEN copies (their global scale is aligned after
their block scales) and rotated copies (their amax is the rotated tensor's). A tensor quantized twice (a gradient,
row-wise and transposed) gets one amax.
"""
from __future__ import annotations

import operator
import os
from typing import Dict, Optional

import torch
from torch.fx import Graph, Node

from .. import ops  # noqa: F401  (defines the fp4compile ops that .reuse looks up at import)
from .common import add_call, root
from .reuse import QUANTIZE, QUANTIZE_DQ, _copy_meta

_MODES = ("off", "norms", "all")


def _mode(value) -> str:
    """``FUSE_AMAX``'s value as one of ``_MODES`` (a bool, ``"0"`` / ``"1"`` read as ``"off"`` / ``"all"``)."""
    if isinstance(value, bool):
        return "all" if value else "off"
    text = str(value).strip().lower()
    mode = {"0": "off", "1": "all", "": "off"}.get(text, text)
    if mode not in _MODES:
        raise ValueError(f"FUSE_AMAX / FP4COMPILE_FUSE_AMAX must be one of {_MODES} (or 0 / 1), got {value!r}")
    return mode


#: which quantized tensors :func:`fuse_amax` gives an amax from the graph: ``"off"``, ``"norms"`` or ``"all"``
#: (module docstring). ``"all"`` by default (with :data:`POINTWISE_ROW` 1024 the 124M step is 0.20 and 0.43 ms faster
#: than off on the H200 in two calls, session 35; ``"norms"`` 0.20 and 0.27; ``"all"`` over the GELU's last dim 0.29 ms
#: slower); ``FP4COMPILE_FUSE_AMAX`` sets it at import.
FUSE_AMAX = _mode(os.environ.get("FP4COMPILE_FUSE_AMAX", "all"))


def fuse_amax_mode() -> str:
    """:data:`FUSE_AMAX` as one of ``"off"``, ``"norms"``, ``"all"`` (a bool read as ``"off"`` / ``"all"``)."""
    return _mode(FUSE_AMAX)


#: with ``"all"``: a pointwise producer's first reduction runs over rows of this many elements (the tensor viewed
#: as ``[-1, POINTWISE_ROW]``: Inductor makes the producer a persistent reduction over short rows); a tensor that is
#: not contiguous or whose size is not a multiple is left alone. 0: over the tensor's last dim, whatever it is (a
#: GELU's 3,072 became a looped reduction, 63 -> 116 µs per call). ``FP4COMPILE_AMAX_ROW`` sets it at import.
POINTWISE_ROW = int(os.environ.get("FP4COMPILE_AMAX_ROW", "1024"))

#: the position of the ``amax`` argument of the quantize ops
_AMAX_ARG = 8

#: producers Inductor does not generate a kernel for (nothing to fuse the reduction into)
_OPAQUE = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.baddbmm.default}

#: how many pointwise nodes :func:`_after_row_reduction` walks back from a producer
_WALK = 24


def _reduces_last_dim(n: Node, val) -> bool:
    """``n`` reduces the last dim (only) of a tensor with ``val``'s rows: its Inductor kernel loops over rows."""
    if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload) \
            or torch.Tag.reduction not in n.target.tags or not isinstance(n.args[0], Node):
        return False
    src = n.args[0].meta.get("val")
    dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    if src is None or not isinstance(dims, (list, tuple)) or len(dims) != 1:
        return False
    return dims[0] % src.dim() == src.dim() - 1 and src.shape[-1] == val.shape[-1] and src.numel() == val.numel()


def _after_row_reduction(p: Node, val) -> bool:
    """``p`` is a pointwise function of a reduction over the rows of ``val`` (a decomposed LayerNorm, RMSNorm,
    softmax or their backwards: Inductor fuses the pointwise tail into the reduction's kernel, which reads every row
    anyway). Walks back at most ``_WALK`` pointwise nodes."""
    todo, seen = [p], set()
    while todo and len(seen) < _WALK:
        n = todo.pop()
        if n in seen or n.op != "call_function":
            continue
        seen.add(n)
        if n.target is operator.getitem:
            todo.append(n.args[0])
        elif _reduces_last_dim(n, val):
            return True
        elif isinstance(n.target, torch._ops.OpOverload) and torch.Tag.pointwise in n.target.tags:
            todo.extend(a for a in n.args if isinstance(a, Node))
    return False


def _producer(src: Node) -> Node:
    """The node that computes ``src``'s values: through views and transposes (``common.root``), and through a
    getitem to its multi-output op."""
    n = root(src)
    if n.op == "call_function" and n.target is operator.getitem:
        n = n.args[0]
    return n


def _row(src: Node, mode: str) -> Optional[int]:
    """The row of ``src``'s first amax reduction: 0 for its last dim (a row reduction's tail), ``POINTWISE_ROW``
    for another Inductor-made tensor in ``"all"`` mode; None to leave it alone (an opaque producer; in ``"all"``
    with ``POINTWISE_ROW`` set, a tensor that cannot be viewed in such rows: its last dim could be a slow row)."""
    p = _producer(src)
    if p.op != "call_function" or p.target in _OPAQUE or getattr(p.target, "namespace", None) == "fp4compile":
        return None
    name = str(getattr(p.target, "__name__", p.target))
    if "scaled_dot_product" in name or "flash" in name:
        return None
    val = src.meta["val"]
    if _after_row_reduction(p, val):
        return 0
    if mode == "norms":
        return None
    if not POINTWISE_ROW:
        return 0
    return POINTWISE_ROW if val.is_contiguous() and val.numel() % POINTWISE_ROW == 0 else None


def fuse_amax(graph: Graph) -> Dict[str, int]:
    """Give each RTN / SR quantize without a rotation whose source an Inductor kernel makes its amax from the graph
    (module docstring). Returns ``{"fused": quantize nodes given an amax, "skipped": other RTN / SR quantize
    nodes}``."""
    stats = {"fused": 0, "skipped": 0}
    mode = fuse_amax_mode()
    if mode == "off":
        return stats
    aten = torch.ops.aten
    done: Dict[Node, Node] = {}        # one amax per tensor (a gradient's row-wise and transposed copies share it)
    for q in list(graph.nodes):
        if q.op != "call_function" or q.target not in (QUANTIZE, QUANTIZE_DQ):
            continue
        src, rounding, hadamard = q.args[0], q.args[1], q.args[4]
        if rounding not in ("rtn", "sr") or len(q.args) > _AMAX_ARG:
            continue
        row = None if hadamard else _row(src, mode)
        if row is None:
            stats["skipped"] += 1
            continue
        key = root(src)                            # (max|x| is the same for every view or transpose of it)
        amax = done.get(key)
        if amax is None:
            absx = add_call(graph, aten.abs.default, (src,), after=src, anchor=src)
            flat = absx if not row else add_call(graph, aten.view.default, (absx, [-1, row]), after=absx, anchor=src)
            rows = add_call(graph, aten.amax.default, (flat, [-1]), after=flat, anchor=src)
            whole = add_call(graph, aten.amax.default, (rows, list(range(rows.meta["val"].dim()))), after=rows,
                             anchor=src)
            amax = add_call(graph, torch.ops.prims.convert_element_type.default, (whole, torch.float32),
                            after=whole, anchor=src)
            for n in dict.fromkeys((absx, flat, rows, whole, amax)):
                _copy_meta(src, n)
            done[key] = amax
        args = list(q.args) + [None] * (_AMAX_ARG - len(q.args))
        q.args = tuple(args + [amax])
        stats["fused"] += 1
    return stats
