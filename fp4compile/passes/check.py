"""Pass 6 (joint graph): every GEMM the policy sent to NVFP4 is NVFP4 in the final graph.

Checks, after the rewrite:
- each site with an NVFP4 ``linear.fprop`` spec has a forward GEMM record (its mm was found at all);
- each record marked "nvfp4" points to an ``fp4compile::gemm`` node (or its bias add) still in the graph, or to
  an ``fp4compile::gemm_dequantized`` of two ``quantize_dq`` / ``quantize_both_dq`` outputs, or, with
  ``gemm_lowering="dequant_mm"``, to the scale/cast (or bias add) of an ``fp4compile::mm_f32`` whose operands are
  both dequantized FP4 copies (``dequantize_blocks`` or ``quantize_dq``), or, for a one-operand ``linear.fprop``
  (``NVFP4(operands=...)``), to the BF16 GEMM one of whose operands is an ``fp4compile::dequantize``;
- no ``aten.mm``/``addmm`` of a site remains for a role the policy sent to NVFP4 unless a fallback warning
  was given for it.
Raises :class:`FP4CheckError` naming the site and role otherwise: a silent BF16 GEMM is a bug.
"""
from __future__ import annotations

import operator
from typing import Dict, List

import torch
from torch.fx import Graph

from ..policy import NVFP4
from .common import GEMMS
from .linear import DEQUANT_BLOCKS, GEMM, GEMM_DQ, MM_F32, site_of
from .reuse import DEQUANTIZE, DQ_OUTPUTS


def is_dequantized_copy(a) -> bool:
    """``a`` is the exact bf16 ``q * S`` of an FP4 copy: an ``fp4compile::dequantize_blocks``, or the fourth
    output of an ``fp4compile::quantize_dq`` (one of ``quantize_both_dq``'s two)."""
    if a.op != "call_function":
        return False
    if a.target is DEQUANT_BLOCKS:
        return True
    if a.target is not operator.getitem or a.args[0].op != "call_function":
        return False
    return a.args[1] in DQ_OUTPUTS.get(a.args[0].target, ())


def is_fp4_product(n, depth: int = 4) -> bool:
    """``n`` is, or is made within ``depth`` pointwise steps from, an NVFP4 GEMM: ``fp4compile::gemm``, or
    ``fp4compile::gemm_dequantized`` / ``fp4compile::mm_f32`` of two dequantized FP4 copies
    (:func:`is_dequantized_copy`)."""
    if n is None or n.op != "call_function":
        return False
    if n.target is GEMM:
        return True
    if n.target is GEMM_DQ:
        return is_dequantized_copy(n.args[0]) and is_dequantized_copy(n.args[2])
    if n.target is MM_F32:
        return all(is_dequantized_copy(a) for a in n.args[:2])
    return depth > 0 and any(is_fp4_product(a, depth - 1) for a in n.all_input_nodes)


def has_fp4_operand(n) -> bool:
    """``n`` is a GEMM one of whose two operands is (a transpose of) an ``fp4compile::dequantize`` of an FP4
    copy: the one-operand ``linear.fprop`` of ``NVFP4(operands="weight" | "activation")``."""
    if n is None or n.op != "call_function" or n.target not in GEMMS:
        return False
    for a in n.args[-2:]:
        if a.op == "call_function" and a.target is torch.ops.aten.permute.default:
            a = a.args[0]
        if a.op == "call_function" and a.target is DEQUANTIZE:
            return True
    return False


class FP4CheckError(RuntimeError):
    """A GEMM the policy sent to NVFP4 is not NVFP4 in the compiled graph."""


def check(graph: Graph, table: Dict, records: List[dict]) -> None:
    """Run the checks of the module docstring on the rewritten joint ``graph``, given the site table
    ``{site name: SiteInfo}`` and the linear rewrite's ``records``; raises :class:`FP4CheckError` at the first
    failure."""
    nodes = {n.name: n for n in graph.nodes}
    accounted = {r["node"] for r in records}
    for site, info in table.items():
        mine = [r for r in records if r["name"] == site]
        if isinstance(info.spec("linear.fprop"), NVFP4) and not any(r["role"] == "linear.fprop" for r in mine):
            raise FP4CheckError(f"fp4compile: linear site {site} ({info.path or '<root>'}) is NVFP4 by policy but "
                                f"its forward GEMM was not found in the joint graph")
    for r in records:
        if r["precision"] != "nvfp4":
            continue
        n = nodes.get(r["node"])
        ok = has_fp4_operand(n) if r.get("operands", "both") != "both" else is_fp4_product(n)
        if not ok:
            raise FP4CheckError(f"fp4compile: {r['role']} of {r['path'] or '<root>'} should be an fp4compile::gemm "
                                f"but node {r['node']} is not")
    for n in graph.nodes:
        if n.op == "call_function" and n.target in GEMMS:
            site = site_of(n, table)
            if site in table and n.name not in accounted:
                roles = [role for role, spec in table[site].specs if isinstance(spec, NVFP4)]
                if roles:
                    raise FP4CheckError(f"fp4compile: {n.name} of linear site {site} ({table[site].path}) "
                                        f"is still a BF16 {n.target} although the policy sends {roles} to NVFP4")
