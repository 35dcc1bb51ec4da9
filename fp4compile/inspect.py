"""``fp4compile.explain``: which GEMM runs in which precision, as a table, a networkx graph or DOT.

    report = fp4compile.explain(model, x, policy="quartet2")
    print(report)                       # one row per GEMM: module path, role, shape, precision, reuse
    report.sites                        # [SiteRecord(name, path, role, precision, spec, shape, reused, ...)]
    report.to_networkx(); report.to_dot()

``explain`` compiles the model with the backend's CPU debug variant and a recorder, runs one forward and
(when the output requires grad) one backward, and restores the parameters' ``.grad``.

Record API for passes (how an attention pass lists its GEMMs): put on the Dynamo node it handles
``node.meta["fp4"] = [dict(name=..., path=..., role=..., precision=..., spec=..., shape=..., reused=...)]``,
one dict per GEMM role (e.g. the six ``attn.*`` roles of one attention call); ``role`` must be in
``fp4compile.ROLES``, ``precision`` is ``"nvfp4"`` or ``"bf16"`` (or a spec, whose ``.name`` is used);
``shape`` (M, N, K), ``spec`` (str) and ``reused`` (str, e.g. "fwd copy") are optional. The linear passes write
the same records (``passes/assign.py`` the plan, ``passes/linear.py`` what was done); explain lists every
record, the joint pass's results replacing the plan for the same site and role.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch


@dataclasses.dataclass(frozen=True)
class SiteRecord:
    """One GEMM: ``name`` (site id in the Dynamo graph), module ``path``, ``role``, ``precision``
    ("nvfp4"/"bf16"), ``spec`` (e.g. "nvfp4(rtn,4/6)"), ``shape`` (M, N, K), ``reused`` (how its
    non-gradient operand was obtained: "", "shared", "fwd copy", "requant of fwd copy", "2d fwd copy"),
    ``graph`` ("fwd"/"bwd"/"plan"), ``node`` (joint-graph node), ``note`` (why BF16)."""

    name: str
    path: str
    role: str
    precision: str
    spec: str = ""
    shape: Tuple[int, ...] = ()
    reused: str = ""
    graph: str = ""
    node: str = ""
    note: str = ""

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "SiteRecord":
        """A record from a pass's record dict (module docstring): missing keys get defaults (``precision``
        "bf16", ``spec`` the precision's name, ``graph`` "plan"); a spec object as ``precision`` is replaced by
        its ``.name``."""
        prec = d.get("precision", "bf16")
        prec = getattr(prec, "name", prec)
        return cls(name=str(d.get("name", "")), path=str(d.get("path", "")), role=str(d.get("role", "")),
                   precision=str(prec), spec=str(d.get("spec", prec)), shape=tuple(d.get("shape") or ()),
                   reused=str(d.get("reused") or ""), graph=str(d.get("graph", "plan")),
                   node=str(d.get("node", "")), note=str(d.get("note") or ""))


def node_records(node: torch.fx.Node) -> List[Dict[str, Any]]:
    """The record dicts a pass left in ``node.meta["fp4"]`` (a dict or a list of dicts)."""
    meta = node.meta.get("fp4")
    if isinstance(meta, dict):
        return [meta]
    if isinstance(meta, (list, tuple)):
        return [m for m in meta if isinstance(m, dict)]
    return []


class Recorder:
    """Collects what the backend did (attach via ``Settings.recorder``)."""

    def __init__(self):
        self.planned: List[Dict[str, Any]] = []
        self.done: List[Dict[str, Any]] = []
        self.graphs: List[torch.fx.Graph] = []
        self.partitions: List[Tuple[str, torch.fx.GraphModule]] = []

    def dynamo(self, gm: torch.fx.GraphModule) -> None:
        """Backend hook after the Dynamo-graph passes: collect the plan records (``node.meta["fp4"]``) of ``gm``."""
        for n in gm.graph.nodes:
            self.planned.extend(node_records(n))

    def joint(self, graph: torch.fx.Graph, records: List[Dict[str, Any]]) -> None:
        """Backend hook after the joint-graph pass: keep its ``records`` (what was done) and a networkx snapshot
        of the rewritten ``graph``."""
        self.done.extend(records)
        self.graphs.append(_snapshot(graph))

    def partitioned(self, kind: str, gm: torch.fx.GraphModule) -> None:
        """Backend hook per partitioned graph: keep ``(kind, gm)``, ``kind`` being "fwd", "bwd" or "inference"."""
        self.partitions.append((kind, gm))

    def report(self) -> "Report":
        """The :class:`Report`: every joint-pass record, then the plan records the joint pass did not replace
        (no record of the same site and role; a planned ``linear.*`` role of a site with joint records is dropped)."""
        done_keys = {(r["name"], r["role"]) for r in self.done}
        done_sites = {r["name"] for r in self.done}
        recs = [SiteRecord.from_dict(r) for r in self.done]
        recs += [SiteRecord.from_dict(r) for r in self.planned
                 if (r.get("name"), r.get("role")) not in done_keys
                 and not (r.get("name") in done_sites and str(r.get("role", "")).startswith("linear."))]
        return Report(recs, self.graphs)


def _snapshot(graph: torch.fx.Graph):
    """A networkx DiGraph of the rewritten joint graph (the FX graph is later mutated by Inductor)."""
    import networkx as nx

    from .passes.common import tangent_closure

    bwd = tangent_closure(graph)
    g = nx.DiGraph()
    for n in graph.nodes:
        rec = n.meta.get("fp4") if isinstance(n.meta.get("fp4"), dict) else None
        target = n.target if isinstance(n.target, str) else (
            str(n.target) if isinstance(n.target, torch._ops.OpOverload) else getattr(n.target, "__name__", str(n.target)))
        g.add_node(n.name, op=n.op, target=target, side="bwd" if n in bwd else "fwd",
                   role=(rec or {}).get("role", ""), precision=(rec or {}).get("precision", ""),
                   path=(rec or {}).get("path", ""))
        for a in n.all_input_nodes:
            g.add_edge(a.name, n.name)
    return g


class Report:
    """The result of :func:`explain`: ``sites`` (list of :class:`SiteRecord`), printable as a table."""

    def __init__(self, sites: List[SiteRecord], graphs: Sequence = ()):
        self.sites = list(sites)
        self._graphs = list(graphs)

    def __str__(self) -> str:
        head = ("module path", "role", "graph", "M x N x K", "precision", "spec", "operand reuse / note")
        rows = [(s.path or "<root>", s.role, s.graph, "x".join(map(str, s.shape)) or "-", s.precision, s.spec,
                 s.reused or s.note or "-") for s in self.sites]
        widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
        line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
        n4 = sum(s.precision == "nvfp4" for s in self.sites)
        out = [line(head), line(["-" * w for w in widths]), *map(line, rows),
               f"{n4}/{len(self.sites)} GEMMs in NVFP4"]
        return "\n".join(out)

    __repr__ = __str__

    def to_networkx(self):
        """The rewritten joint graph(s) as one ``networkx.DiGraph`` (graph i's nodes prefixed ``g{i}/``);
        node attributes: op, target, side (fwd/bwd), role, precision, path."""
        import networkx as nx

        out = nx.DiGraph()
        for i, g in enumerate(self._graphs):
            out = nx.union(out, nx.relabel_nodes(g, {n: f"g{i}/{n}" for n in g.nodes}))
        return out

    def to_dot(self) -> str:
        """Graphviz DOT text of :meth:`to_networkx` (NVFP4 GEMMs green, BF16 GEMMs orange, FP4 quantize
        ops blue); render with ``dot -Tsvg``."""
        g = self.to_networkx()
        colors = {"nvfp4": "palegreen", "bf16": "orange"}
        lines = ["digraph fp4compile {", "  rankdir=TB; node [shape=box, fontsize=10];"]
        for n, a in g.nodes(data=True):
            label = f"{n}\\n{a.get('target', '')}"
            if a.get("role"):
                label += f"\\n{a['path']} {a['role']} {a['precision']}"
            color = colors.get(a.get("precision"), "lightblue" if "fp4compile" in a.get("target", "") else "white")
            lines.append(f'  "{n}" [label="{label}", style=filled, fillcolor={color}];')
        lines += [f'  "{u}" -> "{v}";' for u, v in g.edges]
        lines.append("}")
        return "\n".join(lines)


def explain(model: torch.nn.Module, *example_inputs, policy=None,
            options: Optional[Mapping[str, Any]] = None) -> Report:
    """Compile ``model`` with the fp4 backend (CPU debug variant), run forward + backward on
    ``example_inputs`` and report every GEMM site: module path, role, shape, precision, operand reuse.
    ``options``: other backend options (e.g. ``{"qk_blocks": "16x16"}``), validated as the backend does."""
    from .backend import Settings, compile_graph

    model = getattr(model, "_orig_mod", model)
    recorder = Recorder()
    opts = dict(options or {})
    if policy is not None:
        if opts.get("policy") is not None:
            raise ValueError("explain: pass the policy once, as policy= or in options, not both")
        opts["policy"] = policy
    settings = dataclasses.replace(Settings.from_options(opts), debug=True, recorder=recorder)
    compiled = torch.compile(model, backend=functools.partial(compile_graph, settings=settings))
    params = [p for p in model.parameters()]
    saved = [p.grad for p in params]
    try:
        out = compiled(*example_inputs)
        leaves = [t for t in torch.utils._pytree.tree_leaves(out)
                  if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
        if leaves:
            sum(t.float().sum() for t in leaves).backward()
    finally:
        for p, g in zip(params, saved):
            p.grad = g
    return recorder.report()


def triton_kernel_sources() -> Dict[str, str]:
    """``{"module.kernel": source}`` of every Triton kernel in the loaded ``fp4compile.kernels.*`` modules
    (the kernels the custom ops dispatch to; nothing on a CPU-only run)."""
    out = {}
    for modname, mod in list(sys.modules.items()):
        if not modname.startswith("fp4compile.kernels.") or mod is None:
            continue
        for attr, obj in list(vars(mod).items()):
            fn = obj if hasattr(obj, "src") else getattr(obj, "fn", None)     # JITFunction or Autotuner
            src = getattr(fn, "src", None)
            if isinstance(src, str) and hasattr(fn, "run"):
                out[f"{modname[len('fp4compile.kernels.'):]}.{attr}"] = src
    return out
