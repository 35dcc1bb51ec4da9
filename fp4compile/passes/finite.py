"""Optional pass (joint graph, backend option ``check_finite``): fail loudly where a NaN or Inf enters NVFP4.

A NaN or Inf element in a quantized tensor makes the copy's global decode scale non-finite in every scheme
(``formats/schemes.py``, "Non-finite inputs"), so every GEMM output through it is NaN or Inf, as a diverging BF16
run would show it, only over the whole tensor. To find where a run first diverges, this pass routes each global
scale of every ``quantize`` / ``quantize_dq`` / ``quantize_both`` / ``quantize_both_dq`` node through
``fp4compile::check_finite``, which raises ``FloatingPointError`` naming the NVFP4 GEMMs the copy feeds (module
path, role, forward or backward graph). One host read per copy and step: a debugging aid, off by default, not for
CUDA graphs (the backend refuses ``mode="reduce-overhead"`` with it).
"""
from __future__ import annotations

import operator
from typing import List

import torch
from torch.fx import Graph, Node

from .common import add_call
from .reuse import QUANTIZE, QUANTIZE_BOTH, QUANTIZE_BOTH_DQ, QUANTIZE_DQ

CHECK = torch.ops.fp4compile.check_finite.default
#: each quantize op's outputs that are a copy's global decode scale
GLOBALS = {QUANTIZE: (2,), QUANTIZE_DQ: (2,), QUANTIZE_BOTH: (2, 5), QUANTIZE_BOTH_DQ: (2, 6)}


def consumers(node: Node, depth: int = 8) -> List[str]:
    """The NVFP4 GEMMs downstream of ``node`` (their ``meta["fp4"]`` records: "path role (fwd|bwd)"), through at most
    ``depth`` nodes (dequantize and re-quantize steps, views, scale products); sorted, each once."""
    seen, found, frontier = {node}, set(), [node]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            for u in n.users:
                if u in seen:
                    continue
                seen.add(u)
                rec = u.meta.get("fp4")
                if isinstance(rec, dict) and "role" in rec:
                    found.add(f"{rec['path'] or '<root>'} {rec['role']} ({rec.get('graph', '?')})")
                else:
                    nxt.append(u)
        frontier = nxt
    return sorted(found)


def guard_finite(graph: Graph) -> int:
    """Insert ``fp4compile::check_finite`` after every global-scale output of a quantize node and route all its
    uses through it; returns the number of checks. A check inherits its getitem's recompute tag (``reuse``'s
    ``finalize``), so a copy made for the backward is checked where it is made."""
    checks = 0
    for q in list(graph.nodes):
        if q.op != "call_function" or q.target not in GLOBALS:
            continue
        for g in list(q.users):
            if g.target is not operator.getitem or g.args[1] not in GLOBALS[q.target]:
                continue
            sites = consumers(g)
            where = ", ".join(sites) if sites else f"the copy of {q.args[0]}"
            c = add_call(graph, CHECK, (g, where), after=g)
            g.replace_all_uses_with(c, delete_user_cb=lambda user, c=c: user is not c)
            if "recompute" in g.meta:
                c.meta["recompute"] = g.meta["recompute"]
            checks += 1
    return checks
