"""Pass 6 (joint graph): every GEMM the policy sent to NVFP4 is NVFP4 in the final graph.

Checks, after the rewrite:
- each site with an NVFP4 ``linear.fprop`` spec has a forward GEMM record (its mm was found at all);
- each record marked "nvfp4" points to an ``fp4compile::gemm`` node (or its bias add) still in the graph;
- no ``aten.mm``/``addmm`` of a site remains for a role the policy sent to NVFP4 unless a fallback warning
  was given for it.
Raises :class:`FP4CheckError` naming the site and role otherwise: a silent BF16 GEMM is a bug.
"""
from __future__ import annotations

from typing import Dict, List

import torch
from torch.fx import Graph

from ..policy import NVFP4
from .common import GEMMS
from .linear import site_of

GEMM = torch.ops.fp4compile.gemm.default


class FP4CheckError(RuntimeError):
    """A GEMM the policy sent to NVFP4 is not NVFP4 in the compiled graph."""


def check(graph: Graph, table: Dict, records: List[dict]) -> None:
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
        ok = n is not None and (n.target is GEMM or any(a.target is GEMM for a in n.all_input_nodes
                                                         if a.op == "call_function"))
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
