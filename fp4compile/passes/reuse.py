"""Pass 5 (joint graph): one FP4 copy per (tensor, layout, rounding, Hadamard), and what backward consumes.

:class:`QuantCache` is the only place the linear rewrite gets quantized operands from:
- ``quantize(src, transpose, qspec, signs)`` returns the existing copy for the same key -- the key is the
  tensor under its views (``view(x, [M, K])`` of q/k/v projections share one copy), the layout
  (``transpose``), the :class:`QSpec` and the Hadamard sign node -- or inserts a new
  ``fp4compile::quantize`` right after the source.
- ``for_backward(...)`` gives a backward GEMM its non-gradient operand (W for dgrad, X for wgrad) from the
  forward's FP4 copy of that tensor: the copy itself when the layout and RTN quantization are identical,
  otherwise ``quantize(dequantize(forward copy))`` (Quartet II: "requantized from the forward FP4 copy"); a
  requantization along the copy's other dim dequantizes into a transposed tensor (``dequantize(...,
  transpose=True)``) and quantizes it row-wise, so no transposing copy of the BF16 values is made.
  Where the forward GEMM ran in BF16 (a BF16 fprop rule, a late switch), X is quantized for wgrad from X itself,
  with RHT signs drawn in the forward: the partitioner computes that copy in the forward and saves it packed (sites
  reading the same X may share it and its signs, after AOT's CSE: one copy per tensor, layout and rounding, as in
  the forward). The backward never reads a saved BF16 activation, unless a BF16 GEMM of the backward needs X.
- ``pair_layouts()`` merges a tensor's row-wise and transposed MS-EDEN copies (the gradient dY's, for dgrad and
  wgrad) into one ``fp4compile::quantize_both``: its row-wise pass writes the transpose the other copy is made
  from, instead of a transposing copy of dY (:data:`PAIR_LAYOUTS`).
- ``finalize()`` tags ``CheckpointPolicy.MUST_RECOMPUTE`` on every node made for the backward that does not
  depend on a gradient (and, with ``save_weight_copies=False``, on the forward's weight quantizes and their
  getitems), so the partitioner saves the packed forward activation copies (uint8 codes + E4M3 bytes), the packed
  forward weight copies (unless ``save_weight_copies=False``) and the BF16 parameters (free), never a dequantized
  BF16 tensor (notes/torch-compile.md §8); :meth:`recompute` adds other transient nodes made from FP4 copies (the
  bf16 ``dequantize_blocks`` operands of the "dequant_mm" GEMM lowering).
- ``with_dq(copy)`` turns a copy's ``quantize`` (``quantize_both``) into ``fp4compile::quantize_dq``
  (``quantize_both_dq``), whose dq outputs, the exact bf16 ``q * S``, a GEMM reads instead of dequantizing the codes
  again (``passes/linear.py``'s ``use_dequantized_copies``).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Dict, Optional, Set, Tuple

import torch
from torch.fx import Graph, Node
from torch.utils.checkpoint import CheckpointPolicy

from .common import VIEWS, add_call, later, val

QUANTIZE = torch.ops.fp4compile.quantize.default
DEQUANTIZE = torch.ops.fp4compile.dequantize.default
QUANTIZE_BOTH = torch.ops.fp4compile.quantize_both.default
QUANTIZE_DQ = torch.ops.fp4compile.quantize_dq.default
QUANTIZE_BOTH_DQ = torch.ops.fp4compile.quantize_both_dq.default
#: :meth:`QuantCache.with_dq`: the dq form of a quantize node, and where each of its outputs moves there (each
#: copy's (codes, scales, global) is followed by its dq)
_WITH_DQ = {QUANTIZE: (QUANTIZE_DQ, {0: 0, 1: 1, 2: 2}),
            QUANTIZE_BOTH: (QUANTIZE_BOTH_DQ, {0: 0, 1: 1, 2: 2, 3: 4, 4: 5, 5: 6})}
#: the output positions of the dq forms' bf16 q * S (each copy's fourth output)
DQ_OUTPUTS = {QUANTIZE_DQ: (3,), QUANTIZE_BOTH_DQ: (3, 7)}

#: the default of the backend option ``save_weight_copies`` (:class:`QuantCache`'s ``save_weight_copies``): the
#: forward's FP4 weight copies are left to the partitioner, which saves them for the backward, instead of being
#: tagged MUST_RECOMPUTE: the backward then requantizes W (for dgrad) from the saved codes instead of quantizing the
#: parameter again (its amax and quantize launches, per linear and step), for 0.5625 bytes per weight kept from the
#: forward to the backward. On since session 33 (GPT-124M step, CUDA graphs, alternating on one H200: 49.06, 48.67
#: vs 49.35, 49.06 ms; peak 6.154 vs 6.107 GiB). ``FP4COMPILE_SAVE_WEIGHT_COPIES=0`` turns it off at import. Under
#: FSDP2 with resharding the saved copies would keep every block's weights (as FP4) alive from forward to backward,
#: so ``train.distributed.wrap_model`` passes ``save_weight_copies=False`` there.
SAVE_WEIGHT_COPIES = os.environ.get("FP4COMPILE_SAVE_WEIGHT_COPIES", "1") != "0"

#: :meth:`QuantCache.pair_layouts` merges a tensor's two MS-EDEN copies (row-wise and transposed: a gradient's for
#: dgrad and wgrad) into one ``fp4compile::quantize_both`` (False: two ``quantize`` nodes; the same bytes)
PAIR_LAYOUTS = True


@dataclasses.dataclass(frozen=True)
class QSpec:
    """How one operand is quantized (along its contraction dim)."""

    rounding: str = "rtn"
    four_over_six: bool = False
    block2d: bool = False
    hadamard: int = 0            # 0: no rotation

    def __str__(self):
        s = self.rounding + ("+4/6" if self.four_over_six else "") + (f"+rht{self.hadamard}" if self.hadamard else "")
        return s + ("+2d" if self.block2d else "")


@dataclasses.dataclass
class QCopy:
    """An FP4 copy in the graph: quantize node, its three outputs, and how it was made."""

    node: Node
    codes: Node
    scales: Node
    glob: Node
    src: Node
    transpose: bool
    qspec: QSpec
    signs: Optional[Node]
    origin: str = ""             # "" | "shared" | "fwd copy" | "requant of fwd copy" | "2d fwd copy"
    dq: Optional[Node] = None    # the exact bf16 q * S of a ``quantize_dq`` node (:meth:`QuantCache.with_dq`)

    def outputs(self):
        """``(codes, scales, glob)``: the quantize node's three output nodes."""
        return (self.codes, self.scales, self.glob)


def _view_root(n: Node) -> Node:
    while isinstance(n, Node) and n.op == "call_function" and n.target in VIEWS:
        n = n.args[0]
    return n


class QuantCache:
    """FP4 copies of one joint graph (see the module docstring)."""

    def __init__(self, graph: Graph, tangent_nodes: Set[Node], save_weight_copies: Optional[bool] = None):
        self.graph = graph
        self.tangents = tangent_nodes
        #: the forward's FP4 weight copies are saved for the backward (False: tagged MUST_RECOMPUTE)
        self.save_weight_copies = SAVE_WEIGHT_COPIES if save_weight_copies is None else save_weight_copies
        self.copies: Dict[Tuple, QCopy] = {}
        self.fwd: Dict[Tuple[str, str], QCopy] = {}
        self.dequants: Dict[Tuple[Node, bool], Node] = {}
        self._recompute: Set[Node] = set()
        #: the rewrite's NVFP4 GEMMs: (the GEMM node, or the "dequant_mm" lowering's two dequantize_blocks, record)
        self.gemms: list = []

    # -- building blocks -------------------------------------------------------------------------
    def quantize(self, src: Node, transpose: bool, qspec: QSpec, signs: Optional[Node]) -> QCopy:
        """The FP4 copy of ``src`` (quantized transposed if ``transpose``) under ``qspec`` and ``signs``: the cached
        copy for the same key (origin "shared" unless it has one already), or a new ``fp4compile::quantize``
        inserted after ``src`` and ``signs``."""
        shape = tuple(d if isinstance(d, int) else str(d) for d in val(src).shape)    # SymInts are unhashable
        key = (_view_root(src), shape, transpose, qspec, signs)
        hit = self.copies.get(key)
        if hit is not None:
            return dataclasses.replace(hit, origin=hit.origin or "shared")
        args = (src, qspec.rounding, qspec.four_over_six, qspec.block2d, qspec.hadamard, signs, None, transpose)
        q, codes, scales, glob = add_call(self.graph, QUANTIZE, args, after=later(src, signs), anchor=src)
        for n in (q, codes, scales, glob):
            _copy_meta(src, n)
        copy = QCopy(q, codes, scales, glob, src, transpose, qspec, signs)
        self.copies[key] = copy
        return copy

    def copy_of(self, codes: Node) -> Optional[QCopy]:
        """The copy whose codes are the node ``codes`` (None if it is not one of this cache's copies)."""
        for c in self.copies.values():
            if c.codes is codes:
                return c
        return None

    def with_dq(self, copy: QCopy) -> QCopy:
        """``copy`` with its exact bf16 ``q * S`` (``dq``): its ``quantize`` (``quantize_both``) node becomes one
        ``fp4compile::quantize_dq`` (``quantize_both_dq``): the same arguments and outputs, with each copy's
        dequantization after its global scale, a GEMM operand with no dequantize pass of its own. Once per node;
        every record of the node's copies follows. Only GEMMs read ``dq``; the backward's sources are the codes, so
        ``dq`` is never saved (a saved weight copy saves its codes; with ``save_weight_copies=False`` the node is
        recomputed whole, as before)."""
        if copy.dq is not None:
            return copy
        old = copy.node
        if old.target not in _WITH_DQ:
            raise ValueError(f"with_dq needs a copy made by fp4compile::quantize(_both), got {old.target}")
        target, where = _WITH_DQ[old.target]
        node, *items = add_call(self.graph, target, old.args, after=old, anchor=copy.src)
        for n in (node, *items):
            _copy_meta(copy.src, n)
        index = {o: o.args[1] for o in old.users}                            # its getitems: output index
        for o, i in index.items():
            o.replace_all_uses_with(items[where[i]])
        # (a recomputed weight copy is recomputed as a whole node: its dq too. An activation's dq is read by its
        # forward GEMM only, and a getitem tagged apart from its multi-output node is a conflict for the partitioner)
        self._replace((*index, old), (node, *items))

        def upgraded(c: QCopy) -> QCopy:
            i = where[index[c.codes]]                                        # the copy's first output, moved
            return dataclasses.replace(c, node=node, codes=items[i], scales=items[i + 1], glob=items[i + 2],
                                       dq=items[i + 3])

        for table in (self.copies, self.fwd):
            for k, c in table.items():
                if c.node is old:
                    table[k] = upgraded(c)
        for (n, t) in [k for k in self.dequants if k[0] is old]:
            self.dequants[(node, t)] = self.dequants.pop((n, t))
        return upgraded(copy)

    def _replace(self, olds, news=()) -> None:
        """Erase the nodes ``olds`` (users first; nothing may use them any more) and give their MUST_RECOMPUTE tag, if
        any of them had it, to all of ``news``."""
        recompute = any(n in self._recompute for n in olds)
        for n in olds:
            self._recompute.discard(n)
            self.graph.erase_node(n)
        if recompute:
            self._recompute.update(news)

    def erase(self, node: Node) -> None:
        """Erase ``node`` (one this cache may have tagged; nothing may use it any more)."""
        self._replace((node,))

    def dequantize(self, copy: QCopy, transpose: bool = False) -> Node:
        """An ``fp4compile::dequantize`` node of ``copy`` to its source's dtype, stored transposed if ``transpose``
        (made once per copy and layout, right after it, then reused)."""
        d = self.dequants.get((copy.node, transpose))
        if d is None:
            args = (*copy.outputs(), copy.qspec.hadamard, copy.signs, val(copy.src).dtype)
            d = add_call(self.graph, DEQUANTIZE, args + ((True,) if transpose else ()), after=copy.glob,
                         anchor=copy.src)
            _copy_meta(copy.src, d)
            self.dequants[(copy.node, transpose)] = d
        return d

    def replace_source(self, old: Node, new: Node) -> None:
        """``old`` (a GEMM the linear rewrite replaced) is ``new`` from now on: copies made from it (or keyed on it
        through a view) are re-keyed and re-sourced on ``new``, so later lookups of the same tensor find them and
        their ``src`` is a node of the graph. A copy already keyed on ``new`` is kept."""
        for key in [k for k in self.copies if k[0] is old]:
            c = self.copies.pop(key)
            self.copies.setdefault((new,) + key[1:], dataclasses.replace(c, src=new) if c.src is old else c)
        for k, c in self.fwd.items():
            if c.src is old:
                self.fwd[k] = dataclasses.replace(c, src=new)

    def pair_layouts(self) -> int:
        """Merge each tensor's row-wise and transposed MS-EDEN copies (1x16 blocks, each a fresh ``quantize``
        node) into one ``fp4compile::quantize_both`` node, whose CUDA kernel makes the transposed copy from the
        transpose written by the row-wise pass (no transposing copy of its own): Quartet II's dY, quantized for
        dgrad along N and for wgrad along the tokens. Same signs and seeds as before (each drawn by the op when
        None). Call after the linear rewrite; returns the number of merged pairs."""
        if not PAIR_LAYOUTS:
            return 0
        groups: Dict[Tuple, Dict[bool, Tuple]] = {}
        for key, c in self.copies.items():
            q = c.qspec
            if c.node.target is not QUANTIZE or q.rounding != "ms_eden" or q.block2d or q.four_over_six:
                continue
            groups.setdefault(key[:2], {}).setdefault(c.transpose, (key, c))
        merged = 0
        for pair in groups.values():
            if len(pair) != 2:
                continue
            (krow, row), (kcol, col) = pair[False], pair[True]
            src = row.src
            args = (src, row.qspec.hadamard, row.signs, None, col.qspec.hadamard, col.signs, None)
            node, *items = add_call(self.graph, QUANTIZE_BOTH, args, after=later(later(src, row.signs), col.signs),
                                    anchor=src)
            for n in (node, *items):
                _copy_meta(src, n)
            for old, new in zip(row.outputs() + col.outputs(), items):
                old.replace_all_uses_with(new)
            self._replace((*row.outputs(), row.node, *col.outputs(), col.node), (node, *items))
            self.copies[krow] = dataclasses.replace(row, node=node, codes=items[0], scales=items[1], glob=items[2])
            self.copies[kcol] = dataclasses.replace(col, node=node, codes=items[3], scales=items[4], glob=items[5])
            merged += 1
        return merged

    # -- policy of reuse -------------------------------------------------------------------------
    def forward_copy(self, site: str, operand: str, src: Node, transpose: bool, qspec: QSpec,
                     signs: Optional[Node], is_weight: bool) -> QCopy:
        """The fprop operand ``operand`` ("x" or "w") of ``site``; remembered for the backward."""
        copy = self.quantize(src, transpose, qspec, signs)
        self.fwd[(site, operand)] = copy
        if is_weight and not self.save_weight_copies:
            self._recompute.update((copy.node, copy.codes, copy.scales, copy.glob))
        return copy

    def for_backward(self, site: str, operand: str, src: Node, transpose: bool, qspec: QSpec,
                     signs: Optional[Node], is_weight: bool) -> QCopy:
        """A backward GEMM's non-gradient operand, taken from the forward FP4 copy when there is one."""
        fwd = self.fwd.get((site, operand))
        deterministic = qspec.rounding == "rtn" and not qspec.hadamard and signs is None
        if fwd is None:                                       # fprop ran in BF16: quantize the source
            copy = self.quantize(src, transpose, qspec, signs)
            if not is_weight:
                # an activation (X for wgrad, e.g. after a late switch): its quantize and RHT signs depend on
                # forward nodes only (rewrite_gemm draws the signs after X), so the partitioner computes it in the
                # forward and saves the packed copy, which is smaller than X; nothing needs forcing
                return copy
        elif deterministic and fwd.transpose == transpose and fwd.qspec == qspec:
            return dataclasses.replace(fwd, origin="fwd copy")
        elif deterministic and is_weight and qspec.block2d and fwd.qspec == qspec:
            # 16x16 tiles are transpose-invariant: quantizing W^T from the parameter gives exactly the
            # forward's 2D copy, transposed (NVIDIA's W_fprop == W_bprop)
            copy = dataclasses.replace(self.quantize(src, transpose, qspec, signs), origin="2d fwd copy")
        else:
            # dequantize(fwd) holds src, or src^T when the forward copy was the transposed one; where the
            # requantization runs along the copy's other dim, the dequantization stores its result transposed
            # and the quantize reads it row-wise (no separate transposing copy)
            flip = transpose != fwd.transpose
            copy = dataclasses.replace(self.quantize(self.dequantize(fwd, flip), False, qspec, signs),
                                       origin="requant of fwd copy")
        self._recompute.update(n for n in (copy.node, copy.codes, copy.scales, copy.glob) if n is not None)
        if fwd is not None:
            dequants = (self.dequants.get((fwd.node, t)) for t in (False, True))
            self._recompute.update(d for d in dequants if d is not None)
        return copy

    def recompute(self, node: Node) -> None:
        """Tag ``node`` MUST_RECOMPUTE at :meth:`finalize` unless it depends on a gradient (for transient
        nodes made from FP4 copies, e.g. the bf16 ``dequantize_blocks`` of the "dequant_mm" lowering)."""
        self._recompute.add(node)

    def finalize(self) -> None:
        """Tag MUST_RECOMPUTE (see the module docstring); nodes fed by a gradient are left alone."""
        grad_fed: Set[Node] = set()
        for n in self.graph.nodes:
            if n in self.tangents or any(a in self.tangents or a in grad_fed for a in n.all_input_nodes):
                grad_fed.add(n)
        for n in self._recompute:
            if n not in grad_fed and n.graph is self.graph:
                n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE


def _copy_meta(src: Node, dst: Node) -> None:
    for k in ("partitioner_tag", "seq_nr", "nn_module_stack", "fwd_nn_module_stack", "custom", "stack_trace"):
        if k in src.meta and k not in dst.meta:
            dst.meta[k] = src.meta[k]
