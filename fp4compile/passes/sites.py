"""Pass 1 (Dynamo graph): find the GEMM sites.

Matches, in the torch-IR graph Dynamo hands the backend:
- ``F.linear`` / ``torch._C._nn.linear`` (any weight), and
- ``torch.matmul`` / ``@`` / ``torch.mm`` / ``torch.addmm`` (functions or tensor methods) with an
  ``nn.Parameter`` operand, possibly behind ``.t()`` / ``.T`` / ``.transpose`` (e.g. GPT-2's ``Conv1D``).

Produces one :class:`Site` per node: its node name, the module path that issued the GEMM (from
``nn_module_stack``, in ``model.named_modules()`` spelling) and the operand shapes. Attention sites are the
attention pass's business (``fp4compile.passes.attention``).
"""
from __future__ import annotations

import dataclasses
import operator
import re
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

LINEAR_FNS = (F.linear, torch._C._nn.linear)
MATMUL_FNS = (torch.matmul, operator.matmul, torch.mm, torch.addmm, torch.Tensor.matmul, torch.Tensor.mm)
MATMUL_METHODS = ("matmul", "mm", "addmm", "__matmul__")
_TRANSPOSE_METHODS = ("t", "transpose", "permute", "to", "contiguous", "type_as")


@dataclasses.dataclass(frozen=True)
class Site:
    """One linear GEMM site of the Dynamo graph."""

    name: str                       # Dynamo node name (unique in its graph)
    path: str                       # module path, e.g. "transformer.h.0.mlp.c_fc"
    kind: str                       # "linear" | "matmul"
    shape: Tuple[Tuple[int, ...], ...] = ()   # operand shapes as traced (activation, weight)


def module_path(node: torch.fx.Node) -> str:
    """The innermost module path of ``node`` in ``named_modules()`` spelling ("" for the root)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return normalize_path(path)


def normalize_path(path: str) -> str:
    """``L['self'].h[0]._modules['fc']`` / ``L['m'].h.0.fc`` / ``L['args'][0].h.0.fc`` -> ``h.0.fc``."""
    path = re.sub(r"^L(\[[^\]]*\])+\.?", "", str(path))
    path = re.sub(r"\._modules\[['\"]([^'\"]+)['\"]\]", r".\1", path)
    path = re.sub(r"\[['\"]([^'\"]+)['\"]\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    return path.lstrip(".")


def _placeholder_params(gm: torch.fx.GraphModule, example_inputs: Sequence) -> set:
    params = set()
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, n in enumerate(phs):
        ex = example_inputs[i] if i < len(example_inputs) else None
        grapharg = n.meta.get("grapharg")
        fake = getattr(grapharg, "fake_tensor", None)
        if isinstance(ex, torch.nn.Parameter) or isinstance(fake, torch.nn.Parameter):
            params.add(n)
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            try:
                if isinstance(gm.get_parameter(n.target), torch.nn.Parameter):
                    params.add(n)
            except AttributeError:
                pass
    return params


def _is_param(arg, params: set, depth: int = 0) -> bool:
    if not isinstance(arg, torch.fx.Node) or depth > 4:
        return False
    if arg in params:
        return True
    if arg.op == "call_method" and arg.target in _TRANSPOSE_METHODS:
        return _is_param(arg.args[0], params, depth + 1)
    if arg.op == "call_function" and arg.target in (torch.t, torch.transpose, operator.attrgetter) :
        return _is_param(arg.args[0], params, depth + 1)
    if arg.op == "call_function" and arg.target is getattr and arg.args[1] in ("T", "mT"):
        return _is_param(arg.args[0], params, depth + 1)
    return False


def _shape(a) -> Tuple[int, ...]:
    val = a.meta.get("example_value") if isinstance(a, torch.fx.Node) else None
    return tuple(int(s) if isinstance(s, int) else -1 for s in val.shape) if isinstance(val, torch.Tensor) else ()


def find_sites(gm: torch.fx.GraphModule, example_inputs: Sequence = ()) -> List[Site]:
    """All linear GEMM sites of a Dynamo graph, in graph order."""
    params = _placeholder_params(gm, example_inputs)
    sites = []
    for n in gm.graph.nodes:
        kind: Optional[str] = None
        operands = n.args
        if n.op == "call_function" and n.target in LINEAR_FNS:
            kind = "linear"
            operands = n.args[:2]
        elif (n.op == "call_function" and n.target in MATMUL_FNS) or \
                (n.op == "call_method" and n.target in MATMUL_METHODS):
            operands = n.args[1:3] if n.target in (torch.addmm, "addmm") else n.args[:2]
            if len(operands) == 2 and sum(_is_param(a, params) for a in operands) == 1:
                kind = "matmul"
        if kind is not None:
            sites.append(Site(n.name, module_path(n), kind, tuple(_shape(a) for a in operands)))
    return sites
