"""Pass 5b (joint graph, after the linear rewrite): an activation's amax reduced where the activation is made.

An RTN / SR quantize (``fp4compile::quantize`` / ``quantize_dq``) needs the tensor's max|x| before its first block
scale, so on CUDA it reads x twice: an amax pass, then the quantize pass. For a tensor made by an Inductor kernel
(a LayerNorm, a GELU: the inputs of a block's qkv, fc and mlp-proj linears; with an RTN backward policy, gradients
too), :func:`fuse_amax` computes the amax in the graph instead, as ``amax(amax(|x|, -1), 0)`` in FP32, and gives it
to the quantize node (its ``amax`` argument). The first reduction has the producer's iteration space (rows x
features), so Inductor can fuse it into the kernel that writes x; the second reduces one value per row (on the CPU
Inductor fuses both into the LayerNorm's and the GELU's loops). The quantize kernel then reads x once. The values
are the same (max is exact in any order; the CPU reference checks that a given amax equals max|x|).

Left alone: weights (graph inputs: a reduction there is one more pass, nothing to fuse into), tensors made by an
opaque op (fp4compile's own ops such as Q-Attn, GEMMs, SDPA), MS-EDEN copies (their global scale is aligned after
their block scales) and rotated copies (their amax is the rotated tensor's). A tensor quantized twice (a gradient,
row-wise and transposed) gets one amax. :data:`FUSE_AMAX` switches the pass (``FP4COMPILE_FUSE_AMAX``); it is part
of the joint pass's cache key.
"""
from __future__ import annotations

import operator
import os
from typing import Dict

import torch
from torch.fx import Graph, Node

from .. import ops  # noqa: F401  (defines the fp4compile ops that .reuse looks up at import)
from .common import add_call, root
from .reuse import QUANTIZE, QUANTIZE_DQ, _copy_meta

#: :func:`fuse_amax` runs (the backend's joint pass). Off by default until its step A/B on the GPU;
#: ``FP4COMPILE_FUSE_AMAX=1`` turns it on at import.
FUSE_AMAX = os.environ.get("FP4COMPILE_FUSE_AMAX", "0") != "0"

#: the position of the ``amax`` argument of the quantize ops
_AMAX_ARG = 8

#: producers Inductor does not generate a kernel for (nothing to fuse the reduction into)
_OPAQUE = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.baddbmm.default}


def _producer(src: Node) -> Node:
    """The node that computes ``src``'s values: through views and transposes (``common.root``), and through a
    getitem to its multi-output op."""
    n = root(src)
    if n.op == "call_function" and n.target is operator.getitem:
        n = n.args[0]
    return n


def _fusable(src: Node) -> bool:
    p = _producer(src)
    if p.op != "call_function" or p.target in _OPAQUE:
        return False
    ns = getattr(p.target, "namespace", None)
    name = str(getattr(p.target, "__name__", p.target))
    return ns not in ("fp4compile",) and "scaled_dot_product" not in name and "flash" not in name


def fuse_amax(graph: Graph) -> Dict[str, int]:
    """Give each RTN / SR quantize without a rotation whose source an Inductor kernel makes its amax from the graph
    (module docstring). Returns ``{"fused": quantize nodes given an amax, "skipped": other RTN / SR quantize
    nodes}``."""
    stats = {"fused": 0, "skipped": 0}
    if not FUSE_AMAX:
        return stats
    aten = torch.ops.aten
    done: Dict[Node, Node] = {}        # one amax per tensor (a gradient's row-wise and transposed copies share it)
    for q in list(graph.nodes):
        if q.op != "call_function" or q.target not in (QUANTIZE, QUANTIZE_DQ):
            continue
        src, rounding, hadamard = q.args[0], q.args[1], q.args[4]
        if rounding not in ("rtn", "sr") or len(q.args) > _AMAX_ARG:
            continue
        if hadamard or not _fusable(src):
            stats["skipped"] += 1
            continue
        key = root(src)                            # (max|x| is the same for every view or transpose of it)
        amax = done.get(key)
        if amax is None:
            absx = add_call(graph, aten.abs.default, (src,), after=src, anchor=src)
            rows = add_call(graph, aten.amax.default, (absx, [-1]), after=absx, anchor=src)
            whole = add_call(graph, aten.amax.default, (rows, [0]), after=rows, anchor=src)
            amax = add_call(graph, torch.ops.prims.convert_element_type.default, (whole, torch.float32),
                            after=whole, anchor=src)
            for n in (absx, rows, whole, amax):
                _copy_meta(src, n)
            done[key] = amax
        args = list(q.args) + [None] * (_AMAX_ARG - len(q.args))
        q.args = tuple(args + [amax])
        stats["fused"] += 1
    return stats
