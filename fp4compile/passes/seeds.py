"""One draw for all of the backward's stochastic-rounding seeds: ``fp4compile::draw_seeds`` (opt-in).

A stochastic ``fp4compile::quantize*`` node (MS-EDEN or SR) whose ``seed`` is None draws its own int64 seed on the
device each time it runs: one RNG launch per quantized copy, 192 in the GPT-124M step (0.47 ms of kernel time in
session 33's profile, ~2.4 us each for one number). With :data:`POOL_SEEDS` the joint pass gives the backward's
nodes their seeds from one ``fp4compile::draw_seeds(like, n)`` node instead, one ``select`` view per seed slot
(``quantize_both`` has two: its row-wise and its transposed copy). Every slot still gets its own seed, drawn anew
on every run of the graph (CUDA-graph replays too: torch's generator advances its Philox offset per replay, as for
the op's own draw and ``fp4compile::rht_signs``). The pool is drawn from the first pooled node's input, so it is
computed from a tangent and lands in the backward graph. Forward nodes are left alone: a forward copy that the
backward recomputes must not take its seed from a tensor that the partitioner could recompute or save differently.

Off by default (``FP4COMPILE_POOL_SEEDS=1`` turns it on): timed in session 43 (``bench/run_h200.sh s40_mean``, the
124M step interleaved), +0.03 ms of 48.70 (95 % CI -0.20 ... +0.21): the 192 draws it saves are not on the step's
critical path under CUDA graphs.
"""
from __future__ import annotations

import os
from typing import List, Set, Tuple

import torch
from torch.fx import Graph, Node

from ..formats.random import draw_seed
from ..ops import _define
from .common import add_call, tangent_closure
from .reuse import QUANTIZE, QUANTIZE_BOTH, QUANTIZE_BOTH_DQ, QUANTIZE_DQ, _copy_meta

#: give the backward's stochastic quantize nodes their seeds from one draw (read when the joint pass runs; in its
#: cache key)
POOL_SEEDS = os.environ.get("FP4COMPILE_POOL_SEEDS", "0") == "1"

#: the seed argument positions of each quantize op, and the position of its rounding (None: always MS-EDEN)
SEED_ARGS = {QUANTIZE: ((6,), 1), QUANTIZE_DQ: ((6,), 1), QUANTIZE_BOTH: ((3, 6), None),
             QUANTIZE_BOTH_DQ: ((3, 6), None)}


def _draw_seeds_op(like: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` fresh int64 seeds (``formats.random.draw_seed``) on ``like``'s device. ``like`` only orders the draw
    (after the tensor it is drawn for, e.g. a gradient in the backward)."""
    return draw_seed(device=like.device, shape=(n,))


def _draw_seeds_fake(like, n):
    return like.new_empty((n,), dtype=torch.int64)


draw_seeds = _define("draw_seeds", _draw_seeds_op, _draw_seeds_fake, tags=(torch.Tag.nondeterministic_seeded,))
DRAW_SEEDS = torch.ops.fp4compile.draw_seeds.default


def seed_slots(graph: Graph, tangents: Set[Node]) -> List[Tuple[Node, int]]:
    """(node, argument position) of every seed that a backward stochastic quantize node leaves to its own draw,
    in graph order."""
    slots = []
    for n in graph.nodes:
        spec = SEED_ARGS.get(n.target) if n.op == "call_function" else None
        if spec is None or n not in tangents:
            continue
        positions, rounding = spec
        if rounding is not None and (len(n.args) <= rounding or n.args[rounding] == "rtn"):
            continue
        slots += [(n, i) for i in positions if len(n.args) > i and n.args[i] is None]
    return slots


def pool_seeds(graph: Graph) -> int:
    """With :data:`POOL_SEEDS`: one ``draw_seeds`` node before the first of :func:`seed_slots` (the backward: the
    nodes computed from a tangent, as the graph is now) and a ``select`` of it in every slot. Returns the number of
    slots filled (0 when off or when there are none)."""
    if not POOL_SEEDS:
        return 0
    slots = seed_slots(graph, tangent_closure(graph))
    if not slots:
        return 0
    first = slots[0][0]
    like = first.args[0]
    pool = add_call(graph, DRAW_SEEDS, (like, len(slots)), before=first, anchor=like)
    _copy_meta(like, pool)
    for k, (n, i) in enumerate(slots):
        seed = add_call(graph, torch.ops.aten.select.int, (pool, 0, k), before=n, anchor=pool)
        _copy_meta(n, seed)
        args = list(n.args)
        args[i] = seed
        n.args = tuple(args)
    return len(slots)

