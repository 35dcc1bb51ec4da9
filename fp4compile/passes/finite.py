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
where attn.dov / attn.pdo are NVFP4 (neither is in the paper's split). One
host read per copy and step: a debugging aid, off by default, not for CUDA graphs (the backend refuses
``mode="reduce-overhead"`` with it).
"""
from __future__ import annotations

import operator
from typing import List

import torch
from torch.fx import Graph, Node

from ..kernels.attention_ref import ATTN_ROLES, needs_fp4
from .attention import module_path
from .common import add_call
from .reuse import QUANTIZE, QUANTIZE_BOTH, QUANTIZE_BOTH_DQ, QUANTIZE_DQ

CHECK = torch.ops.fp4compile.check_finite.default
#: each quantize op's outputs that are a copy's global decode scale
GLOBALS = {QUANTIZE: (2,), QUANTIZE_DQ: (2,), QUANTIZE_BOTH: (2, 5), QUANTIZE_BOTH_DQ: (2, 6)}
QATTN = torch.ops.fp4compile.qattn.default
#: fp4compile::qattn's outputs that are the global scales of Q's, K's and V's copies (ops.py), and the roles of
#: attention_ref.ATTN_ROLES that read each copy
QATTN_GLOBALS = {4: ("Q", ("attn.qk", "attn.dsq")), 7: ("K", ("attn.qk", "attn.dsk")),
                 10: ("V", ("attn.pv", "attn.dov"))}


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


def _qattn_mask(node: Node) -> int:
    """The ``fp4_roles`` argument of a ``fp4compile::qattn`` node (positional or keyword)."""
    return int(node.args[6] if len(node.args) > 6 else node.kwargs["fp4_roles"])


def _qattn_copy(node: Node, index: int) -> str:
    """What a global-scale output of a ``fp4compile::qattn`` node scales: "PATH attention's Q copy (attn.qk,
    attn.dsq) (fwd)", the roles those of the node's mask that read it in NVFP4."""
    tensor, roles = QATTN_GLOBALS[index]
    mask = _qattn_mask(node)
    read = [r for r in roles if mask & (1 << ATTN_ROLES.index(r))]
    return f"{module_path(node) or '<root>'} attention's {tensor} copy ({', '.join(read)}) (fwd)"


def _check(graph: Graph, g: Node, where: str) -> None:
    """Route every use of the global scale ``g`` through a check naming ``where``; the check inherits ``g``'s
    recompute tag (``reuse``'s ``finalize``), so a copy made for the backward is checked where it is made."""
    c = add_call(graph, CHECK, (g, where), after=g)
    g.replace_all_uses_with(c, delete_user_cb=lambda user, c=c: user is not c)
    if "recompute" in g.meta:
        c.meta["recompute"] = g.meta["recompute"]


def guard_finite(graph: Graph) -> int:
    """Insert ``fp4compile::check_finite`` after every global-scale output of a quantize node, and of each
    ``fp4compile::qattn`` node whose copy exists (``needs_fp4`` of its mask), and route all its uses through it;
    returns the number of checks."""
    checks = 0
    for q in list(graph.nodes):
        if q.op != "call_function" or q.target not in GLOBALS and q.target is not QATTN:
            continue
        if q.target is QATTN:
            made = dict(zip(QATTN_GLOBALS, needs_fp4(_qattn_mask(q))))
            for g in list(q.users):
                if g.target is operator.getitem and made.get(g.args[1], False):
                    _check(graph, g, _qattn_copy(q, g.args[1]))
                    checks += 1
            continue
        for g in list(q.users):
            if g.target is not operator.getitem or g.args[1] not in GLOBALS[q.target]:
                continue
            sites = consumers(g)
            _check(graph, g, ", ".join(sites) if sites else f"the copy of {q.args[0]}")
            checks += 1
    return checks
