"""Pass 2 (Dynamo graph): the policy decides each site's precision per role.

For every :class:`~fp4compile.passes.sites.Site` it writes
- ``node.meta["fp4"]``: a list of report records ``{"name", "path", "role", "precision", "spec"}``, one per
  role (``linear.fprop``, ``linear.dgrad``, ``linear.wgrad``) -- the *plan*; ``fp4compile.inspect`` shows
  it, overwritten by what the joint-graph passes really did;
- ``node.meta["custom"]["fp4_site"] = site.name``: AOTAutograd copies ``meta["custom"]`` onto every ATen node
  traced from this node, forward and backward (notes/torch-compile.md §6), which is how the joint pass
  finds a site's mm/addmm nodes again.

Returns ``{site name: {role: spec}}``. ``backend.py`` turns it into the site table ``{site name: SiteInfo}``
(path, specs, weight position) that the joint pass receives and hashes into its cache key, so the compiled
artefact depends on the module paths the policy saw.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from ..policy import NVFP4, Policy, Precision
from .sites import Site

LINEAR_ROLES = ("linear.fprop", "linear.dgrad", "linear.wgrad")
SITE_KEY = "fp4_site"


def assign(gm: torch.fx.GraphModule, sites: List[Site], policy: Policy) -> Dict[str, Dict[str, Precision]]:
    """Resolve ``policy`` for the three linear roles of every site, annotate the site's node (plan records and
    the ``fp4_site`` tag, see the module docstring) and return the site table ``{site name: {role: spec}}``.
    Raises ``ValueError`` for a spec the rewrite cannot honour (:func:`check_spec`): before compiling, so a
    policy mistake is never taken for a failed compile."""
    table: Dict[str, Dict[str, Precision]] = {}
    nodes = {n.name: n for n in gm.graph.nodes}
    for site in sites:
        node = nodes[site.name]
        specs = {role: policy.resolve(site.path, role) for role in LINEAR_ROLES}
        for role, spec in specs.items():
            check_spec(site.path, role, spec)
        table[site.name] = specs
        node.meta["fp4"] = [dict(name=site.name, path=site.path, role=role, precision=spec.name, spec=str(spec))
                            for role, spec in specs.items()]
        custom = dict(node.meta.get("custom") or {})
        custom[SITE_KEY] = site.name
        node.meta["custom"] = custom
    return table


def check_spec(path: str, role: str, spec: Precision) -> None:
    """Raise ``ValueError`` for a spec the rewrite cannot honour at this role: ``NVFP4(operands=...)`` other than
    ``"both"`` outside linear.fprop."""
    if isinstance(spec, NVFP4) and spec.operands != "both" and role != "linear.fprop":
        raise ValueError(f"fp4compile: {path or '<root>'}, {role}: NVFP4(operands={spec.operands!r}) "
                         f"applies to linear.fprop only; the backward roles quantize both operands")
