"""Attention swap (pre-AOT): route attention in the Dynamo graph through ``fp4compile::qattn``.

Matches, in the Dynamo FX graph (torch IR, before AOT autograd):

1. ``F.scaled_dot_product_attention`` (``torch._C._nn.scaled_dot_product_attention``) call_function nodes;
2. hand-written attention, as in older nanoGPT or ``transformers``' ``eager_attention_forward``::

       matmul(q, k.transpose(-2, -1))  ->  [mul/div by a constant]  ->  [masked_fill(cond, -inf) | + bias]
       ->  softmax(dim=-1)  ->  [.to(dtype)]  ->  [dropout with p=0 or training=False]  ->  matmul(., v)

   (each intermediate used once; q/k/v 4D; the attention-weights tensor not used elsewhere).

Produces: the SDPA node retargeted (hand-written chains replaced by one node) to ``qattn_sdpa``, an
SDPA-compatible entry that calls ``torch.ops.fp4compile.qattn`` with the six per-role precisions resolved by
``policy.resolve(module_path, role)`` for the roles ``attn.qk, attn.pv, attn.dov, attn.pdo, attn.dsk, attn.dsq``.
AOT autograd then traces the op's registered autograd (forward returns the FP4 Q/K views its backward uses).
The op returns [B, H, T, D] over [B, T, H, D] storage, as SDPA's CUDA kernels do; a direct ``.view`` of the
attention output that only a contiguous tensor allows (valid after ``att @ v``) gets a ``.contiguous()`` first.

Left alone: sites whose six roles all resolve to BF16 (``Policy.bf16()``, ``quartet2``), and unsupported cases
(dropout_p > 0, head dim not 64/128, masks of more than 4 dims or not broadcastable, a mask that requires grad,
non-constant scale/dropout/is_causal, mismatched head counts without ``enable_gqa``), each with a one-line
warning naming the node. Every site found, swapped or not, is returned as an ``AttnSite`` and annotated:

    node.meta["fp4"] = [dict(name=..., path=..., role="attn.qk", precision="nvfp4", spec="nvfp4(rtn)",
                             shape=(Tq, Tk, D), reused="", note=...), ...]   # explain()'s record API, 6 roles
    node.meta["fp4_attn"] = {
        "module_path": "transformer.h.0.attn",      # from nn_module_stack ("" at the root)
        "source": "sdpa" | "handwritten",
        "swapped": True | False,
        "reason": None | "dropout_p=0.1 is not supported",   # why SDPA was kept
        "roles": {"attn.qk": NVFP4(...), "attn.pv": BF16, ...},   # the six resolved specs (policy order)
        "fp4_roles": 0b110001,                         # the op's bit mask (bit i = ATTN_ROLES[i] in NVFP4)
        "qk_transform": "none" | "smooth_k" | ...,     # what the site does to Q, K first (QK_TRANSFORM)
        "qk_blocks": "16x16" | "1x16",                 # the blocks of Q's and K's copies (QK_BLOCKS)
    }

NVFP4 specs other than plain RTN (SR, MS-EDEN, 4/6, Hadamard) are implemented as RTN for attention operands
(a one-line warning says so); Q and K use 1x16 blocks along head_dim (16x16 tiles with :data:`QK_BLOCKS`
``"16x16"``), V/dO 16x16 tiles and P/dS 1x16 blocks along the contraction (see ``kernels/attention_ref.py`` for why).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import operator
import os
import re
import warnings
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..kernels.attention_ref import (ATTN_ROLES, DSK, DSQ, PAPER_ROLES, QK, QK_1X16, QK_READERS, bthd_empty,
                                     check_qk_option, in_op_transform, in_op_transform_bits)
from ..kernels.attention_ref import qk_transform as _qk_transform

SUPPORTED_HEAD_DIMS = (64, 128)
_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}

#: what a swapped site does to Q and K before Q-Attn quantizes them (``attention_ref.qk_transform``: ``"none"``,
#: ``"smooth_k"``, ``"hadamard"``, ``"smooth_k+hadamard"``), where attn.qk, attn.dsk or attn.dsq is NVFP4.
#: ``FP4COMPILE_QK_TRANSFORM`` sets it at import. The swap writes it into the node's kwargs, so the graph (and with
#: it every compile cache key) differs between settings. Default ``"smooth_k+hadamard"`` since session 37: in 30M
#: runs forked from one BF16 checkpoint at step 800 of 1,525 (two seeds) it took the Q-Attn arm's val-loss gap to
#: BF16 from +1.05 / +1.16 % to +0.82 / +0.85 % (Q-Attn alone costs ~0.6 point there); the 30M full stack at 300M
#: tokens ended at +1.51 % with it (seeds 0, 1, 2: +1.42, +1.63, +1.48), +1.84 % without (seeds 0, 1: +1.89, +1.78).
#: It costs 1.1 ms of the 124M step's 48.6 with :data:`QK_TRANSFORM_IMPL` ``"op"`` (docs/BENCHMARKS.md, sessions
#: 37-40). K's mean is over the whole sequence, so with a causal mask a position's rounding depends on later keys
#: (as it already does within a 16x16 tile); the attention function does not.
QK_TRANSFORM = os.environ.get("FP4COMPILE_QK_TRANSFORM", "smooth_k+hadamard")

#: how a swapped site computes its Q, K transform: ``"op"`` (``fp4compile::smooth_rotate``: one Triton pass per
#: tensor after K's mean, ``kernels/rotate.py``, on CUDA; the torch reference elsewhere; its gradient likewise) or
#: ``"torch"`` (``attention_ref.qk_transform``'s aten ops, left to Inductor: a copy of Q split from a fused
#: projection, a subtraction pass, a cuBLAS GEMM per tensor). The same function; sums may round one BF16 step apart
#: (none of Q', K' at the 124M shape, D=64; 6e-5 of them at D=128 in bench/qk_transform.py).
#: ``FP4COMPILE_QK_TRANSFORM_IMPL`` sets it at import; the swap writes it into the node's kwargs (cache keys see it).
#: Default ``"op"`` since session 39: the 124M step (CUDA graphs) 0.44 ms [0.38, 0.49] and 0.30 ms [0.19, 0.62]
#: faster than with ``"torch"`` in two A/Bs; the transform's GPU kernels 136 against 171 us per layer forward +
#: backward there and 598 against 1,852 us at B=4, T=4096, H=16, D=128. Without CUDA graphs the op's launches cost
#: more host time than Inductor's kernels (docs/BENCHMARKS.md, session 39).
#: ``"fused"`` (session 57, opt-in): the transform left to ``fp4compile::qattn`` itself
#: (``attention_ref.IN_OP_TRANSFORM``): on CUDA its two quantize launches compute it in registers, so Q', K' are never
#: written or read back in BF16; the backward as with ``"op"``. Only where attn.qk, attn.dsk and attn.dsq are all
#: NVFP4 (the paper's split); elsewhere ``"op"``. Slower on an H100 (session 58): +0.28 ms [0.04, 0.53] in the 124M
#: step, the latency-bound quantize launch 146 against 133 us for the kernel and the launch (bench/qk_fold.py).
QK_TRANSFORM_IMPL = os.environ.get("FP4COMPILE_QK_TRANSFORM_IMPL", "op")
QK_TRANSFORM_IMPLS = ("torch", "op", "fused")

#: the blocks of a swapped site's NVFP4 copies of Q and K (after :data:`QK_TRANSFORM`): ``"16x16"`` (tiles of 16
#: positions x 16 channels: one copy that is a valid NVFP4 operand along head_dim and along the sequence, saved and
#: reused by QKᵀ, dS·K and dSᵀ·Q) or ``"1x16"`` (one scale per position and 16 channels: QKᵀ's own blocks, a finer
#: scale; that copy is saved, and the backward's dS products, which contract over the sequence, take it re-quantized
#: in 16x16 tiles: ``attention_ref.requantize_tiles``). ``"1x16"`` applies only where attn.qk is NVFP4: for the dS
#: products alone the tiles are already their operand. V and dO keep the tiles. ``FP4COMPILE_QK_BLOCKS`` sets it at
#: import, the backend option ``qk_blocks`` per compile; the swap writes it into the node's ``fp4_roles`` (bit
#: ``attention_ref.QK_1X16``), so graphs and cache keys differ. Default ``"1x16"`` since session 61 (``"16x16"``
#: before): in 30M forks from one checkpoint at step 800 of 1,525 it ended 0.0020 and 0.0041 lower in val loss than
#: the tiles (seeds 0, 1; O's error on the runs' Q, K 0.79-0.81x the tiles', dQ's 0.98-1.00x) at 1.4 % fewer
#: tokens/s; at 300M tokens, with today's Newton-Schulz defaults, the 30M full stack ended +1.47, +1.46, +1.56 % over
#: BF16 in val loss (seeds 0-2) where the tiles ended +1.71, +1.54, +1.76 %: 0.17 +- 0.05 point lower, paired. With
#: its re-quantization inside the backward's prep launch it costs the 124M step +0.83 ms, 1.016x (docs/BENCHMARKS.md,
#: sessions 49-61).
QK_BLOCKS = os.environ.get("FP4COMPILE_QK_BLOCKS", "1x16")


def _checked_impl(impl: str, what: str) -> str:
    if impl not in QK_TRANSFORM_IMPLS:
        raise ValueError(f"{what} must be one of {QK_TRANSFORM_IMPLS}, got {impl!r}")
    return impl


def qk_transform_impl() -> str:
    """:data:`QK_TRANSFORM_IMPL`, checked."""
    return _checked_impl(QK_TRANSFORM_IMPL, "QK_TRANSFORM_IMPL / FP4COMPILE_QK_TRANSFORM_IMPL")


def _smooth_rotate_op(x, smooth: bool, block: int):
    """One tensor's part of the transform by ``fp4compile::smooth_rotate`` (``attention_ref.qk_transform``'s op)."""
    from .. import ops  # noqa: F401  (registers fp4compile::smooth_rotate)

    return torch.ops.fp4compile.smooth_rotate(x, smooth, block, False)


def qk_transform_mode() -> str:
    """:data:`QK_TRANSFORM`, checked."""
    return check_qk_option("qk_transform", QK_TRANSFORM, "QK_TRANSFORM / FP4COMPILE_QK_TRANSFORM")


def qk_blocks_mode() -> str:
    """:data:`QK_BLOCKS`, checked."""
    return check_qk_option("qk_blocks", QK_BLOCKS, "QK_BLOCKS / FP4COMPILE_QK_BLOCKS")


def qattn_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
               *, fp4_roles: int = PAPER_ROLES, qk_transform: str = "none", qk_impl: str = "op"):
    """Drop-in for ``F.scaled_dot_product_attention`` on [B, H, T, D] tensors, computed by ``fp4compile::qattn``
    with the precision mask ``fp4_roles`` (bit i set: ``ATTN_ROLES[i]`` runs in NVFP4; bit 6,
    ``attention_ref.QK_1X16``: Q and K in 1x16 blocks along head_dim, see :data:`QK_BLOCKS`). No dropout. The output is
    [B, H, T, D] stored as [B, T, H, D], as SDPA's CUDA kernels return it (``.transpose(1, 2)`` is contiguous).
    ``qk_transform``: Q and K go through ``attention_ref.qk_transform`` first (the same attention function; see
    :data:`QK_TRANSFORM`), by ``fp4compile::smooth_rotate`` (``qk_impl="op"``), inside ``fp4compile::qattn``
    (``"fused"``, where attn.qk, attn.dsk, attn.dsq are NVFP4) or as aten ops (``"torch"``; see
    :data:`QK_TRANSFORM_IMPL`). The defaults are the bare op's (tiles, no transform); what the backend writes into a
    swapped site follows :data:`QK_TRANSFORM` and :data:`QK_BLOCKS`."""
    if dropout_p:
        raise ValueError(f"qattn_sdpa does not support dropout (dropout_p={dropout_p})")
    if attn_mask is not None and is_causal:
        raise ValueError("qattn_sdpa: pass either attn_mask or is_causal, not both (as SDPA)")
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(f"qattn_sdpa: {query.shape[1]} query heads vs {key.shape[1]} KV heads needs enable_gqa=True")
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    impl = _checked_impl(qk_impl, "qattn_sdpa: qk_impl")
    if impl == "fused" and qk_transform != "none" and fp4_roles & QK_READERS == QK_READERS:
        fp4_roles |= in_op_transform_bits(qk_transform)        # the op transforms Q, K inside its quantization
        block = in_op_transform(fp4_roles, query.shape[-1])[1]
        scale = scale / block if block else scale
    else:
        op = _smooth_rotate_op if impl in ("op", "fused") else None
        query, key, c = _qk_transform(query, key, qk_transform, op=op)
        scale = scale * c
    if _plain_eager(query, key, value, attn_mask):  # same implementation and saved tensors, less host time
        from ..ops import qattn_eager

        return qattn_eager(query, key, value, attn_mask, bool(is_causal), float(scale), int(fp4_roles))
    return torch.ops.fp4compile.qattn(query, key, value, attn_mask, bool(is_causal), float(scale), int(fp4_roles))[0]


def _plain_eager(*tensors) -> bool:
    """True outside torch.compile/export tracing, functorch transforms and tensor subclasses / dispatch modes:
    then ``qattn_sdpa`` may skip the custom-op layers. Anything traced (Dynamo, AOT autograd's fake and
    functional tensors, make_fx) sees ``fp4compile::qattn``."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return False
    if getattr(torch._C, "_are_functorch_transforms_active", lambda: False)():
        return False
    return all(t is None or type(t) is torch.Tensor for t in tensors)


@dataclasses.dataclass
class AttnSite:
    """One attention site found by ``swap_attention``."""

    node: str
    module_path: str
    source: str
    swapped: bool
    reason: Optional[str]
    roles: dict
    fp4_roles: int = 0
    qk_transform: str = "none"
    qk_blocks: str = "16x16"

    def meta(self) -> dict:
        """This site as the ``node.meta["fp4_attn"]`` dict (see the module docstring)."""
        return {"module_path": self.module_path, "source": self.source, "swapped": self.swapped,
                "reason": self.reason, "roles": dict(self.roles), "fp4_roles": self.fp4_roles,
                "qk_transform": self.qk_transform, "qk_blocks": self.qk_blocks}


# ---------------------------------------------------------------------------------------------------------
def module_path(node: fx.Node) -> str:
    """Innermost module of a Dynamo node as a dotted path ("transformer.h.0.attn"; "" at the root)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    raw = list(stack.values())[-1]
    raw = raw[0] if isinstance(raw, tuple) else str(raw)
    path = re.sub(r"^L\['[^']*'\]", "", raw)
    path = re.sub(r"^L__self__", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']*)'\]", r".\1", path)
    path = path.replace("._modules.", ".")
    return path.strip(".")


def _val(n: Any):
    """The example (fake) value of a node argument, or the constant itself."""
    if isinstance(n, fx.Node):
        return n.meta.get("example_value", n.meta.get("val"))
    return n


def _is_const(x) -> bool:
    return x is None or isinstance(x, (bool, numbers.Number))


def _resolve(policy, path: str) -> tuple[dict, int, list]:
    from ..policy import NVFP4

    roles, mask, notes = {}, 0, []
    for i, role in enumerate(ATTN_ROLES):
        spec = policy.resolve(path, role)
        roles[role] = spec
        if spec.name == "nvfp4":
            mask |= 1 << i
            if spec != NVFP4("rtn", block=spec.block) or spec.block not in (16, (16, 16)):
                notes.append(f"{role}={spec}")
    return roles, mask, notes


def _check(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa) -> Optional[str]:
    """None if qattn supports the call, else the reason."""
    if not all(_is_const(x) for x in (dropout_p, is_causal, scale, enable_gqa)):
        return "non-constant dropout_p/is_causal/scale/enable_gqa"
    if dropout_p:
        return f"dropout_p={dropout_p} is not supported"
    if any(not isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "q/k/v have no example value"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return f"q/k/v must be 4D [B, H, T, D], got {q.dim()}D/{k.dim()}D/{v.dim()}D"
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1]) or q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        return f"head dim {q.shape[-1]}/{k.shape[-1]}/{v.shape[-1]} is not one of {SUPPORTED_HEAD_DIMS}"
    if not q.dtype.is_floating_point:
        return f"dtype {q.dtype} is not supported"
    if k.shape[1] != v.shape[1] or q.shape[0] != k.shape[0] or k.shape[2] != v.shape[2]:
        return "k/v shapes do not match"
    if q.shape[1] != k.shape[1] and not (enable_gqa and q.shape[1] % k.shape[1] == 0):
        return f"{q.shape[1]} query heads vs {k.shape[1]} KV heads without enable_gqa"
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            return "attn_mask has no example value"
        if is_causal:
            return "attn_mask together with is_causal"
        if mask.dim() > 4 or not (mask.dtype == torch.bool or mask.dtype.is_floating_point):
            return f"attn_mask of shape {tuple(mask.shape)} / dtype {mask.dtype} is not supported"
        try:
            torch.broadcast_shapes(tuple(mask.shape), (q.shape[0], q.shape[1], q.shape[2], k.shape[2]))
        except RuntimeError:
            return f"attn_mask of shape {tuple(mask.shape)} does not broadcast to [B, H, Tq, Tk]"
        if mask.requires_grad:
            return "attn_mask requires grad (qattn does not differentiate the mask)"
    return None


_REUSED = {"attn.dsk": "2d fwd copy", "attn.dsq": "2d fwd copy", "attn.dov": "2d fwd copy"}


def _gemm_records(node: fx.Node, site: AttnSite, args: Optional[dict]) -> list:
    """explain()'s records (``inspect.py`` API): one per role, with the per-head GEMM shape (M, N, K)."""
    shape = {}
    q, k = (_val(args["query"]), _val(args["key"])) if args else (None, None)
    if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == 4 and k.dim() == 4:
        tq, tk, d = q.shape[-2], k.shape[-2], q.shape[-1]
        shape = {"attn.qk": (tq, tk, d), "attn.pv": (tq, d, tk), "attn.dov": (tq, tk, d),
                 "attn.pdo": (tk, d, tq), "attn.dsk": (tq, d, tk), "attn.dsq": (tk, d, tq)}
    recs = []
    for role, spec in site.roles.items():
        fp4 = site.swapped and spec.name == "nvfp4"
        rec = dict(name=site.node, path=site.module_path, role=role, precision="nvfp4" if fp4 else "bf16",
                   spec=str(spec) if fp4 else "bf16", reused=_REUSED.get(role, "") if fp4 else "")
        if role in shape:
            rec["shape"] = tuple(int(x) for x in shape[role])
        if not site.swapped and spec.name == "nvfp4":
            rec["note"] = f"kept SDPA: {site.reason}"
        elif fp4 and role in ("attn.qk", "attn.dsk", "attn.dsq"):
            notes = [f"Q, K {site.qk_transform} first"] if site.qk_transform != "none" else []
            if site.qk_blocks != "16x16":
                notes.append(f"Q, K in {site.qk_blocks} blocks along head_dim")
                if role != "attn.qk":   # the 1x16 copy is no operand along T: re-quantized in tiles
                    rec["reused"] = "requant of fwd copy"
            if notes:
                rec["note"] = "; ".join(notes)
        recs.append(rec)
    return recs


def _record(node: fx.Node, site: AttnSite, sites: list, args: Optional[dict] = None):
    node.meta["fp4_attn"] = site.meta()
    node.meta["fp4"] = _gemm_records(node, site, args)
    sites.append(site)
    if site.reason is not None:
        warnings.warn(f"fp4compile: attention {node.name} at '{site.module_path}' keeps SDPA/eager: {site.reason}",
                      stacklevel=3)


def _plan(node: fx.Node, policy, source: str, args: dict, sites: list, qk: tuple = (None, None)) -> Optional[int]:
    """Resolve the policy and check support; returns the fp4_roles mask if the site is to be swapped. ``qk``: the
    (qk_transform, qk_blocks) options of this compile (None: :data:`QK_TRANSFORM`, :data:`QK_BLOCKS`)."""
    path = module_path(node)
    roles, mask, notes = _resolve(policy, path)
    site = AttnSite(node.name, path, source, False, None, roles, mask)
    if mask == 0:  # all six roles BF16: leave SDPA (or the hand-written code) untouched
        _record(node, site, sites, args)
        return None
    reason = _check(_val(args["query"]), _val(args["key"]), _val(args["value"]), _val(args["attn_mask"]),
                    args["dropout_p"], args["is_causal"], args["scale"], args["enable_gqa"])
    if reason is not None:
        site.reason = reason
        _record(node, site, sites, args)
        return None
    if notes:
        warnings.warn(f"fp4compile: attention {node.name} at '{path}': {', '.join(notes)} run as NVFP4 RTN "
                      "(Q-Attn implements RTN; Q/K in QK_BLOCKS blocks, V/dO in 16x16 tiles, P/dS in 1x16 blocks)",
                      stacklevel=3)
    site.swapped = True
    if mask & (QK | DSK | DSQ):
        site.qk_transform = qk[0] if qk[0] is not None else qk_transform_mode()
        blocks = qk[1] if qk[1] is not None else qk_blocks_mode()
        if blocks == "1x16" and mask & QK:   # QKᵀ's blocks; the dS products alone read the tiles
            site.qk_blocks = blocks
            mask |= QK_1X16
    else:
        site.qk_transform = "none"
    site.fp4_roles = mask
    _record(node, site, sites, args)
    return mask


# ---------------------------------------------------------------------------------------------------------
def _sdpa_args(node: fx.Node) -> dict:
    args = dict(_SDPA_DEFAULTS)
    args.update(zip(_SDPA_PARAMS, node.args))
    args.update(node.kwargs)
    return args


def _is_sdpa(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is F.scaled_dot_product_attention


_SOFTMAX = {F.softmax, torch.softmax, torch.Tensor.softmax, torch.special.softmax}
_MATMUL = {operator.matmul, torch.matmul, torch.Tensor.matmul}


def _is_call(n, fns=(), methods=()) -> bool:
    if not isinstance(n, fx.Node):
        return False
    return (n.op == "call_function" and n.target in fns) or (n.op == "call_method" and n.target in methods)


def _single_use(n: fx.Node) -> bool:
    return len(n.users) == 1


def _last_two(dims, ndim) -> bool:
    return sorted(d % ndim for d in dims) == [ndim - 2, ndim - 1]


def _untranspose(kt: fx.Node) -> Optional[fx.Node]:
    """k from kᵀ = k.transpose(-2, -1) / torch.transpose / permute(0, 1, 3, 2); else None."""
    if not _single_use(kt):
        return None
    if _is_call(kt, (torch.transpose,), ("transpose",)) and len(kt.args) == 3:
        k = kt.args[0]
        ndim = _val(k).dim() if isinstance(_val(k), torch.Tensor) else 4
        return k if _last_two(kt.args[1:], ndim) else None
    if _is_call(kt, (torch.permute,), ("permute",)):
        dims = kt.args[1] if len(kt.args) == 2 and isinstance(kt.args[1], (tuple, list)) else kt.args[1:]
        return kt.args[0] if tuple(dims) == (0, 1, 3, 2) else None
    return None


def _match_handwritten(sm: fx.Node):
    """From a softmax node, the whole hand-written attention chain, or None."""
    dim = sm.kwargs.get("dim", sm.args[1] if len(sm.args) > 1 else None)
    x = sm.args[0]
    if dim not in (-1, 3) or not isinstance(x, fx.Node) or not _single_use(x) or not _single_use(sm):
        return None
    chain = [sm]
    mask, kind = None, None
    # optional mask
    if _is_call(x, (torch.masked_fill, torch.Tensor.masked_fill), ("masked_fill",)):
        fill = x.args[2] if len(x.args) > 2 else x.kwargs.get("value")
        if not isinstance(fill, numbers.Number) or fill > -1e4:
            return None
        mask, kind = x.args[1], "fill"
        chain.append(x)
        x = x.args[0]
    elif _is_call(x, (operator.add, torch.add), ("add",)) and len(x.args) == 2:
        a, b = x.args
        main = a if _is_call(a, {operator.mul, torch.mul, operator.truediv, torch.div} | _MATMUL,
                             ("mul", "div", "matmul")) else b
        mask, kind = (b if main is a else a), "add"
        if not isinstance(mask, fx.Node):
            return None
        chain.append(x)
        x = main
    if not isinstance(x, fx.Node) or not _single_use(x):
        return None
    # optional constant scale
    scale = 1.0
    if _is_call(x, (operator.mul, torch.mul), ("mul",)):
        a, b = x.args[:2]
        node_arg, c = (a, b) if isinstance(b, numbers.Number) else (b, a)
        if not isinstance(c, numbers.Number) or not isinstance(node_arg, fx.Node):
            return None
        scale = float(c)
        chain.append(x)
        x = node_arg
    elif _is_call(x, (operator.truediv, torch.div), ("div",)):
        a, c = x.args[:2]
        if not isinstance(c, numbers.Number) or not isinstance(a, fx.Node):
            return None
        scale = 1.0 / float(c)
        chain.append(x)
        x = a
    if not _is_call(x, _MATMUL, ("matmul",)) or not _single_use(x):
        return None
    q, kt = x.args[:2]
    k = _untranspose(kt) if isinstance(kt, fx.Node) else None
    if k is None:
        return None
    chain += [x, kt]
    # forward from softmax: optional cast, optional no-op dropout, then matmul with v
    prev = sm
    y = next(iter(sm.users))
    if _is_call(y, (), ("to", "type_as", "float", "bfloat16", "half")) and _single_use(y) and y.args[0] is prev:
        chain.append(y)
        prev, y = y, next(iter(y.users))
    if _is_call(y, (F.dropout, torch.dropout), ("dropout",)) and y.args[0] is prev:
        p = y.kwargs.get("p", y.args[1] if len(y.args) > 1 else 0.5)
        training = y.kwargs.get("training", y.args[2] if len(y.args) > 2 else True)
        if not _single_use(y) or not isinstance(p, numbers.Number) or (p and training is not False):
            return {"reject": f"attention dropout p={p} is not supported", "at": y}
        chain.append(y)
        prev, y = y, next(iter(y.users))
    if not _is_call(y, _MATMUL, ("matmul",)) or y.args[0] is not prev:
        return None
    v = y.args[1]
    return {"q": q, "k": k, "v": v, "mask": mask, "kind": kind, "scale": scale, "out": y, "chain": chain + [y]}


def _is_view_of(u: fx.Node, node: fx.Node) -> bool:
    return bool(u.args) and u.args[0] is node and (
        (u.op == "call_method" and u.target == "view") or (u.op == "call_function" and u.target is torch.Tensor.view))


def _view_ok_on_qattn_layout(val, sizes) -> bool:
    """Whether ``.view(*sizes)`` is valid on qattn's output layout (``attention_ref.bthd_empty``) of ``val``'s
    [B, H, T, D] shape; False when that cannot be decided."""
    shape = [_val(x) for x in sizes]
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = list(shape[0])
    dims = list(getattr(val, "shape", ()))
    # static sizes only (never int() a SymInt here: that would specialize it); otherwise undecided
    if len(dims) != 4 or not all(type(x) is int for x in dims + [x for x in shape if not isinstance(x, torch.dtype)]):
        return False
    B, H, T, D = dims
    try:
        bthd_empty(B, H, T, D, torch.float32, "meta").view(*shape)
        return True
    except RuntimeError:
        return False


def _guard_views(graph: fx.Graph, node: fx.Node):
    """qattn returns [B, H, T, D] over [B, T, H, D] storage, as SDPA's CUDA kernels do, while ``att @ v`` (and
    SDPA on CPU) give a contiguous tensor: a direct ``.view`` of the attention output that only the contiguous
    layout allows gets a ``.contiguous()`` in front of it, so the rewrite never breaks a model. (The usual
    ``y.transpose(1, 2).contiguous().view(B, T, C)`` / ``.reshape`` is left alone: there the layout saves a copy.)"""
    val = _val(node)
    for u in list(node.users):
        if not _is_view_of(u, node) or (val is not None and _view_ok_on_qattn_layout(val, u.args[1:])):
            continue
        with graph.inserting_before(u):
            c = graph.call_method("contiguous", (node,))
        if val is not None:
            c.meta["example_value"] = val
        u.replace_input_with(node, c)


def _transform_kwargs(site: AttnSite) -> dict:
    """``qattn_sdpa``'s ``qk_transform`` and ``qk_impl`` (:data:`QK_TRANSFORM_IMPL`) kwargs for a swapped site (none
    when its transform is ``"none"``, which ``_plan`` sets where Q and K are not quantized: the node then reads as
    before)."""
    if site.qk_transform == "none":
        return {}
    return {"qk_transform": site.qk_transform, "qk_impl": qk_transform_impl()}


def swap_attention(gm: fx.GraphModule, policy, *, qk_transform: Optional[str] = None,
                   qk_blocks: Optional[str] = None) -> list[AttnSite]:
    """Rewrite SDPA and hand-written attention in a Dynamo graph into ``fp4compile::qattn`` (see module doc).

    ``qk_transform`` / ``qk_blocks`` (the backend options of the same names) override :data:`QK_TRANSFORM` /
    :data:`QK_BLOCKS` for this graph. Mutates ``gm`` in place (and recompiles it); returns one ``AttnSite`` per
    attention site found.
    """
    qk = (qk_transform, qk_blocks)
    for name, value in zip(("qk_transform", "qk_blocks"), qk):
        if value is not None:
            check_qk_option(name, value, f"swap_attention: {name}")
    sites: list[AttnSite] = []
    graph = gm.graph
    changed = False
    for node in list(graph.nodes):
        if _is_sdpa(node):
            args = _sdpa_args(node)
            mask = _plan(node, policy, "sdpa", args, sites, qk)
            if mask is None:
                continue
            kwargs = {k: args[k] for k in _SDPA_PARAMS[3:]}
            kwargs["fp4_roles"] = mask
            kwargs.update(_transform_kwargs(sites[-1]))
            node.target = qattn_sdpa
            node.args = (args["query"], args["key"], args["value"])
            node.kwargs = kwargs
            _guard_views(graph, node)
            changed = True
        elif _is_call(node, _SOFTMAX, ("softmax",)):
            m = _match_handwritten(node)
            if m is None:
                continue
            out = m.get("out", m.get("at"))
            if "reject" in m:
                path = module_path(out)
                roles, fmask, _ = _resolve(policy, path)
                if fmask:
                    _record(out, AttnSite(out.name, path, "handwritten", False, m["reject"], roles, fmask), sites)
                continue
            args = dict(_SDPA_DEFAULTS, query=m["q"], key=m["k"], value=m["v"], scale=m["scale"])
            if m["mask"] is not None:
                args["attn_mask"] = m["mask"]
            mask = _plan(out, policy, "handwritten", args, sites, qk)
            if mask is None:
                continue
            with graph.inserting_before(out):
                attn_mask = m["mask"]
                if m["kind"] == "fill":  # masked_fill(cond, -inf): attend where cond is False
                    attn_mask = graph.call_function(torch.logical_not, (m["mask"],))
                    try:
                        attn_mask.meta["example_value"] = torch.logical_not(_val(m["mask"]))
                    except Exception:  # meta only; AOT re-traces the graph anyway
                        pass
                new = graph.call_function(qattn_sdpa, (m["q"], m["k"], m["v"]),
                                          {"attn_mask": attn_mask, "scale": m["scale"], "fp4_roles": mask,
                                           **_transform_kwargs(sites[-1])})
            new.meta = dict(out.meta)
            out.replace_all_uses_with(new)
            _guard_views(graph, new)
            dead = [n for n in m["chain"]]
            while dead:  # erase consumers before producers
                free = [n for n in dead if not n.users]
                if not free:
                    break
                for n in free:
                    graph.erase_node(n)
                    dead.remove(n)
            changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return sites
