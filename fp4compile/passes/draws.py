"""Pass 5b (joint graph, after the linear rewrite): one random draw per graph side instead of one per operand.

Quartet II's backward draws fresh randomness at every step: the RHT signs of each backward GEMM (an
``fp4compile::rht_signs`` node each: a ``randint`` and two elementwise kernels) and the seed of every MS-EDEN / SR
copy (drawn inside each ``fp4compile::quantize`` / ``quantize_both`` call whose ``seed`` is None: a ``randint``
kernel each). In the GPT-124M full-stack step those are ~300 launches of one-element or 128-element kernels a step,
a few microseconds each even inside a CUDA graph. :func:`pool_draws` makes them two launches per graph side:

* every ``rht_signs(like, d)`` of a side (grouped by ``d``) becomes row ``i`` of one ``fp4compile::rht_signs_pool(
  like0, n, d)`` [n, d] (``aten.select``: a view, no kernel);
* every ``seed=None`` of a quantize node of a side becomes element ``i`` of one ``fp4compile::random_seeds(like0,
  n)`` [n] int64, given to the node as its ``seed`` (a 0-dim view).

Each pool node sits where the side's first draw was, ordered after that draw's ``like`` (its first input): the
backward's pools after the first gradient they serve, the forward's (a late switch's wgrad copies of X, quantized in
the forward) in the forward. The draws stay fresh every call (the pools are drawn from torch's generator on every
run of the graph, CUDA graphs included), independent across operands (distinct rows and elements of one draw), and
keep their distributions (Rademacher signs, uniform int64 seeds in [-2^62, 2^62)): only the order in which the
generator's stream is consumed changes. :data:`POOL_DRAWS` switches it (``FP4COMPILE_POOL_DRAWS``).
"""
from __future__ import annotations

import os
from typing import Dict, List, Set, Tuple

import torch
from torch.fx import Graph, Node

from ..ops import _define
from .common import add_call
from .linear import RHT_SIGNS
from .reuse import QUANTIZE, QUANTIZE_BOTH, QUANTIZE_BOTH_DQ, QUANTIZE_DQ

#: :func:`pool_draws` runs (the backend's joint pass; ``FP4COMPILE_POOL_DRAWS=0`` turns it off at import). Off by
#: default until its step A/B on the GPU (``bash bench/run_h200.sh s34_b``: one process, interleaved blocks).
POOL_DRAWS = os.environ.get("FP4COMPILE_POOL_DRAWS", "0") != "0"

#: the ``seed`` argument positions of the quantize ops whose draws are pooled (the rounding must be random)
_SEED_ARGS = {QUANTIZE: (6,), QUANTIZE_DQ: (6,), QUANTIZE_BOTH: (3, 6), QUANTIZE_BOTH_DQ: (3, 6)}


def _rht_signs_pool_op(like: torch.Tensor, n: int, d: int) -> torch.Tensor:
    """``n`` fresh Rademacher vectors (float32 ±1, [n, d]) on ``like``'s device, in one draw; ``like`` only orders the
    draw (after the tensor it serves is computed)."""
    return torch.randint(0, 2, (n, d), device=like.device, dtype=torch.float32).mul_(2.0).sub_(1.0)


def _rht_signs_pool_fake(like, n, d):
    return like.new_empty((n, d), dtype=torch.float32)


def _random_seeds_op(like: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` fresh int64 seeds in [-2^62, 2^62) (``formats.random.draw_seed``'s range) on ``like``'s device, in one
    draw."""
    return torch.randint(-(2 ** 62), 2 ** 62, (n,), device=like.device, dtype=torch.int64)


def _random_seeds_fake(like, n):
    return like.new_empty((n,), dtype=torch.int64)


_SEEDED = (torch.Tag.nondeterministic_seeded,)
rht_signs_pool = _define("rht_signs_pool", _rht_signs_pool_op, _rht_signs_pool_fake, tags=_SEEDED)
random_seeds = _define("random_seeds", _random_seeds_op, _random_seeds_fake, tags=_SEEDED)
RHT_SIGNS_POOL = torch.ops.fp4compile.rht_signs_pool.default
RANDOM_SEEDS = torch.ops.fp4compile.random_seeds.default


def _seed_slots(n: Node) -> List[int]:
    """The ``seed`` argument positions of quantize node ``n`` that draw inside the op (None, random rounding)."""
    slots = _SEED_ARGS.get(n.target, ())
    if n.target in (QUANTIZE, QUANTIZE_DQ) and n.args[1] == "rtn":
        return []
    return [i for i in slots if len(n.args) > i and n.args[i] is None]


def _grad_fed(graph: Graph, tangents: Set[Node]) -> Set[Node]:
    fed: Set[Node] = set()
    for n in graph.nodes:
        if n in tangents or any(a in tangents or a in fed for a in n.all_input_nodes):
            fed.add(n)
    return fed


def _meta_from(src: Node, dst: Node) -> None:
    for k in ("partitioner_tag", "seq_nr", "custom", "stack_trace"):
        if k in src.meta:
            dst.meta[k] = src.meta[k]


def pool_draws(graph: Graph, tangents: Set[Node]) -> Dict[str, int]:
    """Pool the graph's RHT-sign and seed draws (module docstring); ``tangents``: the backward's placeholders (and
    what the pass knows is computed from them). Returns ``{"signs": draws pooled, "seeds": ..., "pools": nodes}``."""
    stats = {"signs": 0, "seeds": 0, "pools": 0}
    if not POOL_DRAWS:
        return stats
    fed = _grad_fed(graph, {n for n in graph.nodes if n in tangents or (n.op == "placeholder"
                                                                         and "tangent" in str(n.target))})
    signs: Dict[Tuple[bool, int], List[Node]] = {}
    seeds: Dict[bool, List[Tuple[Node, int]]] = {}
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is RHT_SIGNS:
            signs.setdefault((n in fed, n.args[1]), []).append(n)
        for i in _seed_slots(n):
            seeds.setdefault(n in fed, []).append((n, i))
    select = torch.ops.aten.select.int
    for (_, d), nodes in signs.items():
        if len(nodes) < 2:
            continue
        first = nodes[0]
        pool = add_call(graph, RHT_SIGNS_POOL, (first.args[0], len(nodes), d), before=first, anchor=first.args[0])
        _meta_from(first, pool)
        for i, s in enumerate(nodes):
            row = add_call(graph, select, (pool, 0, i), before=s, anchor=pool)
            _meta_from(s, row)
            s.replace_all_uses_with(row)
            graph.erase_node(s)
        stats["signs"] += len(nodes)
        stats["pools"] += 1
    for _, slots in seeds.items():
        if len(slots) < 2:
            continue
        first = slots[0][0]
        pool = add_call(graph, RANDOM_SEEDS, (first.args[0], len(slots)), before=first, anchor=first.args[0])
        _meta_from(first, pool)
        for i, (n, pos) in enumerate(slots):
            seed = add_call(graph, select, (pool, 0, i), before=n, anchor=pool)
            _meta_from(n, seed)
            args = list(n.args)
            args[pos] = seed
            n.args = tuple(args)
        stats["seeds"] += len(slots)
        stats["pools"] += 1
    return stats
