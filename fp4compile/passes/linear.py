"""Pass 4 (joint ATen graph): every mm/addmm of a linear site -> quantize + quantize + ``fp4compile::gemm``.

A linear site (``Y = X·Wᵀ``, found by :mod:`.sites`) appears in the joint graph as mm/addmm nodes carrying
``meta["custom"]["fp4_site"]`` (or, failing that, ``source_fn_stack`` / the forward node's ``seq_nr``),
notes §6/§10:

=================  ================================================  =====================================
role               ATen form (F.linear; Conv1D/matmul are alike)     FP4 operands (both along the sum dim)
=================  ================================================  =====================================
``linear.fprop``   ``addmm(b, view(x), permute(W))`` / ``mm``         X along K, W along K
``linear.dgrad``   ``mm(dY, permute(permute(W)))``                    dY along N, W along N (Wᵀ copy)
``linear.wgrad``   ``mm(permute(dY), view(x))``                       dYᵀ and Xᵀ along the tokens M
=================  ================================================  =====================================

The forward GEMM is the one not fed by a tangent; a backward GEMM is dgrad if its other operand is made
of W, wgrad if it is made of X. Transposes are folded into the quantize's ``transpose`` flag, so no
transposed BF16 copy is ever materialized. How a spec applies to each operand is documented on
:class:`fp4compile.policy.NVFP4`. With a Hadamard spec both operands get the signs of one
``fp4compile::rht_signs`` node, drawn fresh on every call (never a baked constant). Operands come from
:class:`.reuse.QuantCache` (backward operands from the forward FP4 copies).

Lowering of the GEMM itself (``gemm_lowering``, see :data:`LOWERINGS`): one opaque ``fp4compile::gemm``
node (default), or exact bf16 block dequantization + an FP32-output GEMM + the global scale and cast as
plain aten ops. Either way the operands in the graph are the packed FP4 copies; the transient bf16
``dequantize_blocks`` nodes are tagged MUST_RECOMPUTE (through :class:`.reuse.QuantCache`) so the
partitioner never saves them for the backward. An ``addmm``'s bias is the ``fp4compile::gemm``'s own ``bias``
argument (added in FP32 before the one rounding, in the TMA GEMM's epilogue) where the GEMM's CUDA kernel is
the TMA GEMM (:data:`FUSE_BIAS`), else an ``aten.add`` after the GEMM that Inductor fuses into the consumer.

Anything else -- a contraction dim not a multiple of 16 (or of the Hadamard size), a non-float dtype,
``addmm`` with alpha/beta, a GEMM of a site that cannot be classified -- stays BF16 with a one-line warning
naming the node.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Dict, List, Optional, Tuple

import torch
from torch.fx import Graph, Node

from ..policy import NVFP4, Precision
from .assign import SITE_KEY
from .common import GEMMS, add_call, is_transpose2d, root, tangent_closure, val, warn_fallback
from .reuse import QSpec, QuantCache
from ..ops import _define

GEMM = torch.ops.fp4compile.gemm.default
GEMM_DQ = torch.ops.fp4compile.gemm_dequantized.default
DEQUANT_BLOCKS = torch.ops.fp4compile.dequantize_blocks.default
MM_F32 = torch.ops.fp4compile.mm_f32.default

#: how an NVFP4 GEMM is emitted (backend option ``gemm_lowering``):
#: "op"         -- one opaque ``fp4compile::gemm(codes, scales, global, ...)`` node; the CUDA kernel is picked
#:                 per shape at run time (``kernels/gemm.choose_impl``);
#: "dequant_mm" -- ``mm_f32(dequantize_blocks(A), dequantize_blocks(B)) * (a_global * b_global)`` then the
#:                 cast, the last two as plain aten ops that Inductor fuses into the consumer (bias add,
#:                 residual, activation). cuBLAS runs the GEMM; the FP32 output costs 2 extra bytes per
#:                 element written and read, the bf16 operand copies 2 bytes per element written and read.
#: "auto"       -- per GEMM by :func:`choose_lowering` (static shapes; symbolic ones get "op").
LOWERINGS = ("op", "dequant_mm", "auto")

#: which NVFP4 GEMMs read their operands as the copies' exact bf16 q * S made by the quantize launches
#: (:func:`use_dequantized_copies`): "fwd" (the forward GEMMs only; the default), "all" or "none" (every GEMM
#: dequantizes its codes; the same values). The environment variable ``FP4COMPILE_DQ_OPERANDS`` sets it at import
#: (A/B runs). H200, GPT-124M step (session 32, docs/BENCHMARKS.md): none 48.90, 48.94 ms; fwd 48.80; all 48.87,
#: 48.81 ms with 0.11 GiB more peak memory (the backward's bf16 operands live from their quantize to their GEMMs):
#: MS-EDEN's pass 2 that dequantizes costs what pass 2 and the dequantize kernel cost (bench/dq_operands.py: dgrad
#: 0.998, wgrad 0.995 of quantize + gemm; fprop 0.962).
DQ_OPERANDS = os.environ.get("FP4COMPILE_DQ_OPERANDS", "fwd")
if DQ_OPERANDS not in ("all", "fwd", "none"):
    raise ValueError(f"FP4COMPILE_DQ_OPERANDS must be all, fwd or none, got {DQ_OPERANDS!r}")

#: a linear's bias (``addmm``) goes into its ``fp4compile::gemm`` as the GEMM's ``bias`` -- added to the FP32 result
#: before the one rounding, in the TMA GEMM's epilogue -- where the GEMM's CUDA kernel by shape is the TMA GEMM
#: (:func:`bias_in_epilogue`; "op" lowering), instead of a separate ``aten.add`` after the bf16 result (which
#: Inductor fuses into the consumer, except where the consumer is an opaque op: Q-Attn after the qkv projection,
#: one read and write of the [tokens, 3d] output per layer). False: always the ``aten.add``.
#: ``FP4COMPILE_FUSE_BIAS=0`` sets it at import (A/B runs).
FUSE_BIAS = os.environ.get("FP4COMPILE_FUSE_BIAS", "1") != "0"


def gemm_default_impl() -> Optional[str]:
    """``kernels/gemm.DEFAULT_IMPL`` (``FP4COMPILE_GEMM_IMPL``), which the rewrite reads (:func:`cuda_impl`), so the
    joint pass's cache key holds it; None without Triton."""
    try:
        from ..kernels.gemm import DEFAULT_IMPL
    except ImportError:  # pragma: no cover - no Triton: no CUDA GEMM to match
        return None
    return DEFAULT_IMPL


def cuda_impl(M: int, N: int, K: int) -> Optional[str]:
    """The kernel an "op"-lowered NVFP4 GEMM of this shape runs on CUDA: ``kernels/gemm.choose_impl``'s choice under
    the default ``"auto"``; None for symbolic sizes, another ``FP4COMPILE_GEMM_IMPL`` or no Triton (no rule to
    match)."""
    if min(M, N, K) < 0 or gemm_default_impl() != "auto":
        return None
    from ..kernels.gemm import choose_impl

    return choose_impl(M, N, K)


def bias_in_epilogue(M: int, N: int, K: int) -> bool:
    """Whether an "op"-lowered NVFP4 GEMM of this shape adds a bias in its kernel's epilogue on CUDA: its kernel
    (:func:`cuda_impl`) is the TMA GEMM ("dq_triton")."""
    return cuda_impl(M, N, K) == "dq_triton"


def dequantizes_operands(M: int, N: int, K: int, lowering: str) -> bool:
    """Whether an NVFP4 GEMM of this shape and lowering dequantizes both operands to bf16 q * S before a bf16 GEMM:
    "dequant_mm" always; "op" where its kernel (:func:`cuda_impl`) is one of ``kernels/gemm.DQ_IMPLS`` -- not the
    skinny shapes, whose kernel dequantizes in registers from the codes. Symbolic sizes: no."""
    if min(M, N, K) < 0:
        return False
    if lowering == "dequant_mm":
        return True
    impl = cuda_impl(M, N, K)
    if impl is None:
        return False
    from ..kernels.gemm import DQ_IMPLS   # (imported by cuda_impl already)

    return impl in DQ_IMPLS


def use_dequantized_copies(graph: Graph, cache: QuantCache) -> int:
    """After the rewrite (and :meth:`.reuse.QuantCache.pair_layouts`): every NVFP4 GEMM that dequantizes both
    operands before a bf16 GEMM (:func:`dequantizes_operands`; :data:`DQ_OPERANDS` says which roles) reads its two
    copies' exact bf16 ``q * S`` from their quantize nodes instead, each made a ``quantize_dq`` /
    ``quantize_both_dq`` (:meth:`.reuse.QuantCache.with_dq`): RTN / SR's quantize kernel stores the bf16 values it
    holds, MS-EDEN's pass 2 dequantizes the tile whose scales it makes, and no dequantize pass reads the codes back.
    "op": the ``fp4compile::gemm`` node becomes ``fp4compile::gemm_dequantized`` (the same bf16 GEMM, so the same
    bytes); "dequant_mm": the ``dequantize_blocks`` nodes give way to the copies' dq. Returns the number of GEMMs."""
    done = 0
    for nodes, rec in cache.gemms:
        if DQ_OPERANDS == "none" or (DQ_OPERANDS == "fwd" and rec["role"] != "linear.fprop"):
            continue
        if not dequantizes_operands(*rec["shape"], rec["lowering"]):
            continue
        if rec["lowering"] == "op":
            n, = nodes
            a, b = cache.copy_of(n.args[0]), cache.copy_of(n.args[3])
            if a is None or b is None:
                continue
            a, b = cache.with_dq(a), cache.with_dq(b)
            n.target, n.args = GEMM_DQ, (a.dq, a.glob, b.dq, b.glob, *n.args[6:])      # out_dtype[, bias]
        else:
            copies = [cache.copy_of(d.args[0]) for d in nodes]
            if None in copies:
                continue
            for d, c in zip(nodes, copies):
                c = cache.with_dq(c)
                d.replace_all_uses_with(c.dq)
                cache.erase(d)
        rec["dq"] = True
        done += 1
    return done


def choose_lowering(M: int, N: int, K: int) -> str:
    """``gemm_lowering="auto"``: "dequant_mm" (cuBLAS on exact bf16 operands, FP32 output fused into the
    consumer) where the Triton GEMMs lose to cuBLAS on the H200 -- long contractions with few output tiles
    (wgrad: K = tokens, where cuBLAS splits K) and the d x d GEMMs with K = N <= 1024 -- else "op"
    (``fp4compile::gemm``, kernel per shape by ``kernels/gemm.choose_impl``). Symbolic sizes (-1): "op"."""
    if min(M, N, K) < 0:
        return "op"
    if K >= 8192 and M * N <= 8 * 2 ** 20:
        return "dequant_mm"
    if max(N, K) <= 1024 and M >= 4096:
        return "dequant_mm"
    return "op"


# ------------------------------------------------------------------------------------------------
# fresh RHT signs inside the graph
def _rht_signs_op(like: torch.Tensor, d: int) -> torch.Tensor:
    """A fresh Rademacher vector (float32 ±1, length ``d``) on ``like``'s device. ``like`` only orders the
    draw (after the tensor it rotates is computed, e.g. in the backward for a gradient)."""
    return torch.randint(0, 2, (d,), device=like.device, dtype=torch.float32).mul_(2.0).sub_(1.0)


def _rht_signs_fake(like, d):
    return like.new_empty((d,), dtype=torch.float32)


rht_signs = _define("rht_signs", _rht_signs_op, _rht_signs_fake, tags=(torch.Tag.nondeterministic_seeded,))


RHT_SIGNS = torch.ops.fp4compile.rht_signs.default


# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SiteInfo:
    """What the joint pass knows of a Dynamo site: module path, spec per role, and which fprop operand
    (0 = A, 1 = B of ``mm(A, B)``) is the weight."""

    path: str
    specs: Tuple[Tuple[str, Precision], ...]
    weight_pos: int = 1

    def spec(self, role: str) -> Precision:
        """The spec of ``role`` (``KeyError`` for a role not in ``specs``)."""
        return dict(self.specs)[role]


@dataclasses.dataclass
class Gemm:
    """One GEMM of a site to rewrite."""

    node: Node
    site: str
    role: str


def _operand(n: Node, along: int) -> Tuple[Node, bool]:
    """Quantizing ``n`` along dim ``along`` == quantizing the returned source with ``transpose``."""
    while is_transpose2d(n):
        n, along = n.args[0], 1 - along
    return n, along == 0


def site_of(n: Node, table) -> Optional[str]:
    """The Dynamo site a joint-graph node was traced from: ``meta["custom"]["fp4_site"]`` (set by
    :mod:`.assign`), else the Dynamo node name in ``(fwd_)source_fn_stack`` (torch versions that do not
    copy ``custom``)."""
    site = (n.meta.get("custom") or {}).get(SITE_KEY)
    if site in table:
        return site
    for key in ("source_fn_stack", "fwd_source_fn_stack"):
        stack = n.meta.get(key) or ()
        if stack and stack[-1][0] in table:
            return stack[-1][0]
    return None


def find_gemms(graph: Graph, table: Dict[str, SiteInfo]) -> Tuple[List[Gemm], List[Tuple[Node, str, str]]]:
    """The site GEMMs with their roles, and the ones that could not be classified (node, site, reason)."""
    tangents = tangent_closure(graph)
    groups: Dict[str, List[Node]] = {}
    by_seq: Dict[int, str] = {}
    loose = []
    for n in graph.nodes:
        if n.op != "call_function" or n.target not in GEMMS:
            continue
        site = site_of(n, table)
        if site in table:
            groups.setdefault(site, []).append(n)
            if n.meta.get("seq_nr") is not None:
                by_seq.setdefault(n.meta["seq_nr"], site)
        elif n in tangents and n.meta.get("seq_nr") is not None:
            loose.append(n)
    for n in loose:                               # backward nodes whose custom meta was not copied
        if n.meta["seq_nr"] in by_seq:
            groups[by_seq[n.meta["seq_nr"]]].append(n)

    out, bad = [], []
    for site, nodes in groups.items():
        fwd = [n for n in nodes if n not in tangents]
        if len(fwd) != 1:
            bad += [(n, site, f"{len(fwd)} forward GEMMs for one linear site") for n in nodes]
            continue
        f = fwd[0]
        a, b = f.args[-2:]
        w_root = root((a, b)[table[site].weight_pos])
        x_root = root((a, b)[1 - table[site].weight_pos])
        out.append(Gemm(f, site, "linear.fprop"))
        for n in nodes:
            if n is f:
                continue
            ops = n.args[-2:]
            if sum(o in tangents for o in ops) != 1:
                bad.append((n, site, "backward GEMM without exactly one gradient operand"))
                continue
            other = root(ops[1] if ops[0] in tangents else ops[0])
            if other is w_root and other is not x_root:
                out.append(Gemm(n, site, "linear.dgrad"))
            elif other is x_root and other is not w_root:
                out.append(Gemm(n, site, "linear.wgrad"))
            else:
                bad.append((n, site, "backward GEMM whose operands are neither W nor X of its site"))
    return out, bad


def _qspecs(spec: NVFP4, role: str) -> Tuple[QSpec, QSpec]:
    """(activation-or-gradient operand, weight-or-activation operand) quantization of one role."""
    h = spec.hadamard or 0
    two_d = spec.block == (16, 16)
    if role == "linear.fprop":
        x = QSpec(spec.rounding, spec.four_over_six, False, h)
        return x, dataclasses.replace(x, block2d=two_d)
    other_rounding = "ms_eden" if spec.rounding == "ms_eden" else "rtn"
    g = QSpec(spec.rounding, spec.four_over_six and spec.rounding == "rtn", False, h)
    o = QSpec(other_rounding, spec.four_over_six and other_rounding == "rtn", two_d and role == "linear.dgrad", h)
    return g, o


def _why_not(g: Gemm, spec: NVFP4) -> Optional[str]:
    n = g.node
    if n.target is torch.ops.aten.addmm.default and (n.kwargs.get("beta", 1) != 1 or n.kwargs.get("alpha", 1) != 1):
        return "addmm with alpha/beta"
    a, b = (val(x) for x in n.args[-2:])
    if a.dtype not in (torch.float32, torch.bfloat16, torch.float16) or b.dtype != a.dtype:
        return f"dtype {a.dtype}/{b.dtype}"
    k = a.shape[1]
    if not isinstance(k, int):
        return "symbolic (dynamic-shape) contraction dim: its multiple-of-16 cannot be checked"
    if k % 16:
        return f"contraction dim {k} is not a multiple of 16"
    if spec.hadamard and k % spec.hadamard:
        return f"contraction dim {k} is not a multiple of the Hadamard size {spec.hadamard}"
    if spec.block == (16, 16) and g.role != "linear.wgrad" and not all(
            isinstance(d, int) and d % 16 == 0 for d in (a.shape[0], b.shape[1])):
        return f"2D 16x16 weight blocks need both output dims to be multiples of 16, got {a.shape[0]}x{b.shape[1]}"
    return None


def emit_gemm(graph: Graph, qa, qb, out_dtype, before: Node, lowering: str = "op",
              bias: Optional[Node] = None) -> Node:
    """The NVFP4 GEMM of two FP4 copies (``QCopy``-like: ``.outputs()`` = codes, scales, global), inserted
    before ``before`` (every new node takes its partitioner / module / stack metadata); returns the node
    holding the ``out_dtype`` result (see :data:`LOWERINGS`); :func:`use_dequantized_copies` may later give it the
    copies' bf16 ``q * S`` instead of their codes. ``bias`` ("op" only): the GEMM's bias argument."""
    if lowering == "op":
        args = (*qa.outputs(), *qb.outputs(), out_dtype) + ((bias,) if bias is not None else ())
        out = add_call(graph, GEMM, args, before=before, anchor=before)
        _copy_meta(before, out)
        return out
    if lowering != "dequant_mm":
        raise ValueError(f"gemm_lowering must be one of {LOWERINGS}, got {lowering!r}")
    aten = torch.ops.aten
    da = add_call(graph, DEQUANT_BLOCKS, (qa.codes, qa.scales), before=before, anchor=before)
    db = add_call(graph, DEQUANT_BLOCKS, (qb.codes, qb.scales), before=before, anchor=before)
    acc = add_call(graph, MM_F32, (da, db), before=before, anchor=before)
    alpha = add_call(graph, aten.mul.Tensor, (qa.glob, qb.glob), before=before, anchor=before)
    y = add_call(graph, aten.mul.Tensor, (acc, alpha), before=before, anchor=before)
    out = y if out_dtype == torch.float32 else \
        add_call(graph, torch.ops.prims.convert_element_type.default, (y, out_dtype), before=before, anchor=before)
    for m in (da, db, acc, alpha, y, out):
        _copy_meta(before, m)
    out.meta["fp4_dequant_nodes"] = (da, db)
    return out


def _copy_meta(src: Node, dst: Node) -> None:
    for k_ in ("partitioner_tag", "seq_nr", "nn_module_stack", "fwd_nn_module_stack", "custom", "stack_trace"):
        if k_ in src.meta:
            dst.meta[k_] = src.meta[k_]


def rewrite_gemm(graph: Graph, g: Gemm, info: SiteInfo, cache: QuantCache, tangents, lowering: str = "op") -> dict:
    """Replace one GEMM node; returns its report record."""
    n, role = g.node, g.role
    spec = info.spec(role)
    a, b = n.args[-2:]
    (a_src, a_tr), (b_src, b_tr) = _operand(a, 1), _operand(b, 0)
    rec = dict(name=g.site, path=info.path, role=role, precision="nvfp4", spec=str(spec),
               shape=_shape(n),
               graph="bwd" if n in tangents else "fwd", node=n.name, reused="")
    main, other = _qspecs(spec, role)
    if role == "linear.fprop" and spec.operands != "both":
        return _rewrite_one_operand(graph, g, info, cache, spec, rec, (main, other), ((a_src, a_tr), (b_src, b_tr)))
    if role == "linear.fprop":
        w_pos = info.weight_pos
        signs = _signs(graph, (a_src, b_src)[1 - w_pos], spec)
        srcs = ((a_src, a_tr), (b_src, b_tr))
        xq = cache.forward_copy(g.site, "x", *srcs[1 - w_pos], main, signs, is_weight=False)
        wq = cache.forward_copy(g.site, "w", *srcs[w_pos], other, signs, is_weight=True)
        qa, qb = (wq, xq) if w_pos == 0 else (xq, wq)
        rec["reused"] = "shared" if xq.origin == "shared" else ""
    else:
        grad_first = a in tangents
        (g_src, g_tr), (o_src, o_tr) = ((a_src, a_tr), (b_src, b_tr)) if grad_first else ((b_src, b_tr), (a_src, a_tr))
        # the RHT signs are drawn after the tensor they order the draw behind: the gradient, except for a wgrad whose
        # forward ran in BF16 (no forward FP4 copy of X): then X is quantized in the forward and its packed copy saved
        # instead of X (QuantCache.for_backward), and the signs it shares with the gradient must exist by then
        x_in_fwd = role == "linear.wgrad" and (g.site, "x") not in cache.fwd
        signs = _signs(graph, o_src if x_in_fwd else g_src, spec)
        gq = cache.quantize(g_src, g_tr, main, signs)
        oq = cache.for_backward(g.site, "w" if role == "linear.dgrad" else "x", o_src, o_tr, other, signs,
                                is_weight=role == "linear.dgrad")
        qa, qb = (gq, oq) if grad_first else (oq, gq)
        rec["reused"] = oq.origin
    if lowering == "auto":
        lowering = choose_lowering(*rec["shape"])
    rec["lowering"] = lowering
    bias = n.args[0] if n.target is torch.ops.aten.addmm.default else None
    if bias is not None and FUSE_BIAS and lowering == "op" and bias_in_epilogue(*rec["shape"]) \
            and tuple(val(bias).shape) == (rec["shape"][1],):
        rec["bias"] = "epilogue"
    out = emit_gemm(graph, qa, qb, val(n).dtype, n, lowering, bias if rec.get("bias") else None)
    dequants = out.meta.pop("fp4_dequant_nodes", ())
    for d in dequants:
        cache.recompute(d)                       # transient bf16 operand copies: never saved for backward
    cache.gemms.append((dequants or (out,), rec))
    if bias is not None and not rec.get("bias"):
        out = add_call(graph, torch.ops.aten.add.Tensor, (out, bias), before=n, anchor=n)
        _copy_meta(n, out)
    out.meta["fp4"] = rec
    rec["node"] = out.name
    n.replace_all_uses_with(out)
    cache.replace_source(n, out)
    graph.erase_node(n)
    return rec


def _rewrite_one_operand(graph: Graph, g: Gemm, info: SiteInfo, cache: QuantCache, spec: NVFP4, rec: dict,
                         qspecs, srcs) -> dict:
    """``linear.fprop`` with ``spec.operands`` "weight" or "activation": quantize that operand (its forward copy,
    remembered for the backward like any other), dequantize it (inverse RHT included) to the GEMM's dtype, and
    put it in place of the original operand of the BF16 GEMM node, which stays."""
    n = g.node
    w_pos = info.weight_pos
    is_w = spec.operands == "weight"
    pos = w_pos if is_w else 1 - w_pos
    src, tr = srcs[pos]
    signs = _signs(graph, src, spec)
    q = cache.forward_copy(g.site, "w" if is_w else "x", src, tr, qspecs[1] if is_w else qspecs[0], signs,
                           is_weight=is_w)
    new = [cache.dequantize(q)]                  # one per copy: a copy shared by several sites is dequantized once
    if pos == 1:       # the second GEMM operand is [K, N]; its copy, quantized along K, holds the transpose
        # (aten.permute, not aten.t: Inductor decomposes t and refuses it as a graph node)
        new.append(add_call(graph, torch.ops.aten.permute.default, (new[0], [1, 0]), before=n, anchor=n))
        _copy_meta(n, new[-1])
    for m in new:
        cache.recompute(m)                       # transient bf16 operand: never saved for backward
    args = list(n.args)
    args[len(args) - 2 + pos] = new[-1]
    n.args = tuple(args)
    rec.update(lowering="dequantize + bf16 mm", reused="shared" if q.origin == "shared" else "",
               operands=spec.operands)
    n.meta["fp4"] = rec
    return rec


def _signs(graph: Graph, like: Node, spec: NVFP4) -> Optional[Node]:
    if not spec.hadamard:
        return None
    s = add_call(graph, RHT_SIGNS, (like, spec.hadamard), after=like, anchor=like)
    for k_ in ("partitioner_tag", "seq_nr", "custom"):
        if k_ in like.meta:
            s.meta[k_] = like.meta[k_]
    return s


def rewrite_linears(graph: Graph, table: Dict[str, SiteInfo], cache: QuantCache, lowering: str = "op") -> List[dict]:
    """Rewrite every classifiable site GEMM the policy sends to NVFP4; returns one record per site GEMM
    (``precision`` "nvfp4", or "bf16" with a ``note`` for policy-BF16 and fallbacks). ``lowering``: how
    each NVFP4 GEMM is emitted (:data:`LOWERINGS`)."""
    if lowering not in LOWERINGS:
        raise ValueError(f"gemm_lowering must be one of {LOWERINGS}, got {lowering!r}")
    gemms, bad = find_gemms(graph, table)
    records = []
    for n, site, reason in bad:
        warn_fallback(n, f"{table[site].path or '<root>'}, linear.?", reason)
        records.append(dict(name=site, path=table[site].path, role="linear.?", precision="bf16", spec="bf16",
                            shape=_shape(n), graph="?", node=n.name, reused="", note=reason))
    # forward first: the backward takes its operands from the forward copies
    gemms.sort(key=lambda g: g.role != "linear.fprop")
    for g in gemms:
        info = table[g.site]
        spec = info.spec(g.role)
        why = _why_not(g, spec) if isinstance(spec, NVFP4) else None
        if isinstance(spec, NVFP4) and why is None:
            records.append(rewrite_gemm(graph, g, info, cache, cache.tangents, lowering))
            continue
        note = "policy" if not isinstance(spec, NVFP4) else why
        if why:
            warn_fallback(g.node, f"{info.path or '<root>'}, {g.role}", why)
        records.append(dict(name=g.site, path=info.path, role=g.role, precision="bf16", spec=str(spec),
                            shape=_shape(g.node), graph="bwd" if g.node in cache.tangents else "fwd",
                            node=g.node.name, reused="", note=note, fallback=bool(why)))
    return records


def _shape(n: Node):
    """(M, N, K) of a GEMM node; -1 for a symbolic size (never specializes a dynamic shape)."""
    a, b = (val(x) for x in n.args[-2:])
    return tuple(d if isinstance(d, int) else -1 for d in (a.shape[0], b.shape[1], a.shape[1]))
