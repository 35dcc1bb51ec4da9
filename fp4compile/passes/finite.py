"""Optional pass (joint graph, backend option ``check_finite``): fail loudly where a NaN or Inf enters NVFP4.

A NaN or Inf element in a quantized tensor makes the copy's global decode scale non-finite in every scheme
(``formats/schemes.py``, "Non-finite inputs"), so every GEMM output through it is NaN or Inf, as a diverging BF16
run would show it, only over the whole tensor. To find where a run first diverges, this pass routes each global
scale of every ``quantize`` / ``quantize_dq`` / ``quantize_both`` / ``quantize_both_dq`` node through
``fp4compile::check_finite``, which raises ``FloatingPointError`` naming the NVFP4 GEMMs the copy feeds (module
path, role, forward or backward graph). Q-Attn's copies of Q, K and V, made inside ``fp4compile::qattn``, are
checked as well: their global scales (outputs of the op, saved for its backward) go through the same check, named
by the attention's module path and the roles that read the copy (``blocks.0.attn attention's Q copy (attn.qk,
attn.dsq) (fwd)``); the checks of a forward copy run in the forward graph. Not checked: V's copy where no backward
role reads it (attn.pv without attn.dov: its global is no node of the joint graph; a NaN there reaches the
attention's output and the next check), and the copy of dO that ``fp4compile::qattn_bwd`` makes inside itself
where attn.dov / attn.pdo are NVFP4 (neither is in the paper's split). One host read per copy and step: a
debugging aid, off by default, not for CUDA graphs (the backend refuses ``mode="reduce-overhead"`` with it).
"""
from __future__ import annotations

import operator
from typing import List, Optional

import torch
from torch.fx import Graph, Node

from ..kernels.attention_ref import ATTN_ROLES, COPY_READERS
from .attention import module_path
from .common import add_call
from .reuse import QUANTIZE, QUANTIZE_BOTH, QUANTIZE_BOTH_DQ, QUANTIZE_DQ

CHECK = torch.ops.fp4compile.check_finite.default
#: each quantize op's outputs that are a copy's global decode scale
GLOBALS = {QUANTIZE: (2,), QUANTIZE_DQ: (2,), QUANTIZE_BOTH: (2, 5), QUANTIZE_BOTH_DQ: (2, 6)}
QATTN = torch.ops.fp4compile.qattn.default
#: fp4compile::qattn's outputs that are the global scales of Q's, K's and V's copies (ops.py), and the role bits
#: that read each copy (attention_ref.COPY_READERS)
QATTN_GLOBALS = {4: ("Q", COPY_READERS[0]), 7: ("K", COPY_READERS[1]), 10: ("V", COPY_READERS[2])}


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


def _where(q: Node, g: Node) -> Optional[str]:
    """What the getitem ``g`` of the quantize or ``fp4compile::qattn`` node ``q`` scales, as the check's error names it,
    or None if ``g`` is not a copy's global scale. A linear copy: the NVFP4 GEMMs it feeds. A Q-Attn copy: "PATH
    attention's Q copy (attn.qk, attn.dsq) (fwd)", the roles of the node's mask (``fp4_roles``) that read it; with none
    the op makes no such copy (``needs_fp4``)."""
    i = g.args[1]
    if q.target is QATTN:
        tensor, readers = QATTN_GLOBALS.get(i, (None, 0))
        mask = int(q.args[6] if len(q.args) > 6 else q.kwargs["fp4_roles"])
        read = [r for b, r in enumerate(ATTN_ROLES) if mask & readers & (1 << b)]
        return f"{module_path(q) or '<root>'} attention's {tensor} copy ({', '.join(read)}) (fwd)" if read else None
    if i not in GLOBALS[q.target]:
        return None
    return ", ".join(consumers(g)) or f"the copy of {q.args[0]}"


def _check(graph: Graph, g: Node, where: str) -> None:
    """Route every use of the global scale ``g`` through a check naming ``where``; the check inherits ``g``'s
    recompute tag (``reuse``'s ``finalize``), so a copy made for the backward is checked where it is made."""
    c = add_call(graph, CHECK, (g, where), after=g)
    g.replace_all_uses_with(c, delete_user_cb=lambda user, c=c: user is not c)
    if "recompute" in g.meta:
        c.meta["recompute"] = g.meta["recompute"]


def guard_finite(graph: Graph) -> int:
    """Insert ``fp4compile::check_finite`` after every global-scale output of a quantize node, and of each
    ``fp4compile::qattn`` node whose copy exists, and route all its uses through it; returns the number of checks."""
    checks = 0
    for q in list(graph.nodes):
        if q.op != "call_function" or (q.target is not QATTN and q.target not in GLOBALS):
            continue
        for g in list(q.users):
            where = _where(q, g) if g.target is operator.getitem else None
            if where is not None:
                _check(graph, g, where)
                checks += 1
    return checks
