"""Small FX helpers shared by the joint-graph passes (no pass logic here)."""
from __future__ import annotations

import operator
import warnings
from typing import Set

import torch
from torch.fx import Graph, Node

aten = torch.ops.aten

#: ops that only relabel a 2D matrix's axes
TRANSPOSES = (aten.permute.default, aten.t.default, aten.transpose.int)
#: ops that only reshape (same values, same order)
VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.clone.default,
         aten.alias.default)
GEMMS = (aten.mm.default, aten.addmm.default)


def is_transpose2d(n: Node) -> bool:
    """``n`` is a 2D transpose of its first argument."""
    if not isinstance(n, Node) or n.op != "call_function" or n.target not in TRANSPOSES:
        return False
    if n.target is aten.permute.default:
        return list(n.args[1]) == [1, 0]
    if n.target is aten.transpose.int:
        return sorted(d % 2 for d in n.args[1:3]) == [0, 1] and val(n).dim() == 2
    return True


def root(n: Node) -> Node:
    """Strip views and transposes: the tensor whose values ``n`` is made of."""
    while isinstance(n, Node) and n.op == "call_function" and (n.target in VIEWS or n.target in TRANSPOSES):
        n = n.args[0]
    return n


def val(n):
    """The fake value (``meta["val"]``) of an FX node; anything else (a constant argument) is returned as is."""
    return n.meta["val"] if isinstance(n, Node) else n


def fake_call(anchor: Node, op, *args):
    """Run ``op`` on the fake values of ``args`` under ``anchor``'s fake mode (the inserted node's meta["val"])."""
    mode = val(anchor).fake_mode
    with mode:
        return op(*[val(a) if isinstance(a, Node) else a for a in args])


def add_call(graph: Graph, op, args, *, after: Node = None, before: Node = None, anchor: Node = None):
    """Insert ``op(*args)`` after ``after`` (or before ``before``) with its meta["val"]; a multi-output op
    also gets getitem nodes and the call returns ``(node, item0, item1, ...)``."""
    ctx = graph.inserting_after(after) if after is not None else graph.inserting_before(before)
    with ctx:
        node = graph.call_function(op, tuple(args))
    node.meta["val"] = fake_call(anchor or after or before, op, *args)
    if isinstance(node.meta["val"], (tuple, list)):
        items, last = [], node
        for i, v in enumerate(node.meta["val"]):
            with graph.inserting_after(last):
                g = graph.call_function(operator.getitem, (node, i))
            g.meta["val"] = v
            items.append(g)
            last = g
        return (node, *items)
    return node


def later(a: Node, b: Node) -> Node:
    """The later of two nodes in graph order (``b`` may be None)."""
    if b is None:
        return a
    for n in a.graph.nodes:
        if n is a:
            return b
        if n is b:
            return a
    return a


def tangent_closure(graph: Graph) -> Set[Node]:
    """Nodes computed from a ``tangents_*`` placeholder (the backward part of a joint graph)."""
    out: Set[Node] = set()
    for n in graph.nodes:
        if n.op == "placeholder" and "tangent" in str(n.target):
            out.add(n)
        elif any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


#: how a fallback warning names the precision a GEMM keeps (its output dtype: BF16 under autocast or in a bf16 model,
#: the model's own dtype otherwise)
_PRECISION_NAMES = {torch.bfloat16: "BF16", torch.float16: "FP16", torch.float32: "FP32", torch.float64: "FP64"}


def warn_fallback(node: Node, what: str, reason: str) -> None:
    """The one-line warning of a GEMM that is not NVFP4: it stays in the precision it was traced in (BF16 in a bf16
    or autocast model; a float32 / float64 model's GEMM says so)."""
    dtype = getattr(node.meta.get("val"), "dtype", torch.bfloat16)
    prec = _PRECISION_NAMES.get(dtype, str(dtype))
    warnings.warn(f"fp4compile: {node.name} ({what}) stays {prec}: {reason}", stacklevel=3)
