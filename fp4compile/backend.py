"""The ``fullstack_fp4`` torch.compile backend.

    model = torch.compile(model, backend="fullstack_fp4")            # found through the entry point
    model = torch.compile(model, backend="fullstack_fp4",
                          options={"policy": Policy.quartet2(), "dump_dir": "fp4_dump/"})

Pipeline (one screen; each step is one file of ``fp4compile/passes``):

    Dynamo FX graph
      1. sites      GEMM sites: F.linear, matmul/mm/addmm with a parameter           passes/sites.py
      2. assign     Policy(module path, role) -> spec in node.meta["fp4"]             passes/assign.py
      3. swap       attention -> fp4compile::qattn (when passes/attention.py exists);
                    Q, K first transformed where QK_TRANSFORM says (K smoothed + Hadamard)  passes/attention.py
    compile_fx(..., config_patches={"joint_custom_pre_pass": FP4JointPass(...)})
      joint ATen graph (forward + backward)
      4. linear     site mm/addmm by role -> quantize + quantize + fp4compile::gemm   passes/linear.py
                    (a bias into the GEMM's epilogue where its kernel is the TMA GEMM)
      5. reuse      one FP4 copy per tensor/layout/rounding; backward from forward    passes/reuse.py
                    copies; a gradient's two MS-EDEN copies from one pass (quantize_both);
                    GEMMs that dequantize both operands read them as bf16 q * S        passes/linear.py
                    from the quantize launches (quantize_dq, gemm_dequantized);
                    forward weight copies saved (or MUST_RECOMPUTE: save_weight_copies)
                    an activation's amax from the kernel that makes it (FUSE_AMAX)  passes/amax.py
                    the backward's seeds from one draw (POOL_SEEDS, opt-in)           passes/seeds.py
      6. check      every GEMM the policy sent to NVFP4 is NVFP4                      passes/check.py
                    (option check_finite: each copy's global scale checked, NaN/Inf   passes/finite.py
                    raise naming the GEMMs it feeds, or the attention and its copy)
      7. precompile the graph's fp4compile:: calls -> worker processes that compile     precompile.py
                    their Triton kernels into Triton's disk cache while Inductor compiles
    -> Inductor partitions and compiles the rest around the opaque fp4compile ops

This module does not register itself (the entry point does; self-registration would trip Dynamo's
duplicate-name assertion; a source tree without the entry point is registered by ``import fp4compile``).
Options: ``policy`` (a :class:`~fp4compile.policy.Policy` or preset name, default ``full_stack``), ``dump_dir``
(write graphs, Inductor code and Triton kernel sources), ``debug`` (CPU debug variant: same passes, partitioned
graphs run eagerly -- for tests), ``gemm_lowering`` ("op": one opaque ``fp4compile::gemm`` per NVFP4 GEMM,
default; "dequant_mm": exact bf16 block dequantization + FP32-output cuBLAS GEMM + scale/cast as aten ops fused
into the consumer; see passes/linear.py), ``mode`` (a torch.compile mode, for use together with other options:
``torch.compile`` refuses ``mode=`` next to ``options=``), ``precompile`` (False: no worker processes compiling
fp4compile's Triton kernels ahead of their first launch; default: on unless ``FP4COMPILE_PRECOMPILE=0``),
``save_weight_copies`` (True: the forward's FP4 weight copies are kept for the backward, 0.5625 bytes per weight;
False: the backward quantizes each weight again; default ``reuse.SAVE_WEIGHT_COPIES``, True unless
``FP4COMPILE_SAVE_WEIGHT_COPIES=0``; FSDP2 with resharding passes False, see ``train.distributed.wrap_model``),
``on_error`` (``"bf16"``: a graph whose NVFP4 rewrite fails to compile warns in one line and runs as plain Inductor
compiles it; ``"raise"``; default :data:`ON_ERROR`), ``qk_transform`` and ``qk_blocks`` (what Q-Attn does to Q and K
before quantizing them and in which blocks it quantizes them, for this compile; defaults
``passes.attention.QK_TRANSFORM`` and ``QK_BLOCKS``, set by ``FP4COMPILE_QK_TRANSFORM`` / ``FP4COMPILE_QK_BLOCKS``),
``check_finite`` (True: every linear NVFP4 copy's global scale, and that of Q-Attn's copies of Q, K and V that its
backward reads, is checked as it is made, and a NaN or Inf in a quantized tensor raises ``FloatingPointError``
naming the GEMMs it feeds or the attention and its copy (``passes/finite.py`` lists what is not checked): a
debugging aid, one host read per copy, not with CUDA graphs; default False: a NaN or Inf makes the GEMM outputs
through that copy NaN or Inf).

Speed: a training step launches many small kernels through the fp4compile custom ops (quantize, dequantize,
GEMM: ~600 op calls and ~1,300 Triton launches per GPT-124M step); launched eagerly from Python, the step is
host-bound. Use CUDA graphs:
``torch.compile(model, backend="fullstack_fp4", options={"policy": ..., "mode": "reduce-overhead"})`` (or
``mode="reduce-overhead"`` alone when no other option is given). The custom ops are graph-safe: they allocate
through PyTorch, draw seeds/signs with on-device RNG, and never synchronize with the host
(``impl="tuned"`` of ``fp4compile::gemm`` falls back to its static rule inside a capture).
"""
from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from . import ops  # noqa: F401  (registers the fp4compile:: custom ops)
from . import precompile
from .passes.assign import assign
from .passes.check import check
from .passes.common import tangent_closure
from .passes.finite import guard_finite
from .passes import amax, linear, reuse, seeds
from .passes.amax import fuse_amax
from .passes.linear import LOWERINGS, SiteInfo, rewrite_linears, use_dequantized_copies
from .passes.reuse import QuantCache
from .passes.seeds import pool_seeds
from .passes.sites import find_sites
from .policy import NVFP4, Policy

OPTIONS = ("policy", "dump_dir", "debug", "gemm_lowering", "mode", "precompile", "save_weight_copies", "on_error",
           "qk_transform", "qk_blocks", "check_finite")
#: torch.compile modes that run the graphs as CUDA graphs (``check_finite``'s host reads cannot be captured)
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")
#: what a graph whose NVFP4 rewrite fails to compile does: ``"bf16"`` (a one-line warning naming the error and the
#: graph's NVFP4 sites, then the graph as Dynamo traced it, compiled by plain Inductor: the model's own dtype,
#: BF16 under autocast) or ``"raise"``. ``FP4COMPILE_ON_ERROR`` sets it at import; the ``on_error`` option overrides it.
#: Failures inside ``compile_fx`` are caught, the backward graph's included (with a fallback the backward is compiled
#: there, not at the first backward); a bad setting raises before it. ``bench/study.py`` runs its arms with
#: ``"raise"``.
ON_ERROR = os.environ.get("FP4COMPILE_ON_ERROR", "bf16")
ON_ERROR_MODES = ("bf16", "raise")
_HERE = os.path.dirname(os.path.abspath(__file__))
PASS_FILES = tuple(os.path.join(_HERE, f) for f in (
    "backend.py", "policy.py", "passes/sites.py", "passes/assign.py", "passes/linear.py", "passes/reuse.py",
    "passes/amax.py", "passes/seeds.py", "passes/check.py", "passes/finite.py", "passes/common.py",
    # the kernels whose shape rules the rewrite reads (kernels/gemm.py's choose_impl, for quantize_dq operands)
    "kernels/gemm.py"))


@dataclasses.dataclass
class Settings:
    """Validated backend options (plus the recorder ``fp4compile.explain`` attaches)."""

    policy: Policy
    dump_dir: Optional[str] = None
    debug: bool = False
    recorder: Optional[Any] = None          # fp4compile.inspect.Recorder
    gemm_lowering: str = "op"               # passes/linear.py LOWERINGS
    mode: Optional[str] = None              # torch.compile mode (e.g. "reduce-overhead": CUDA graphs)
    precompile: Optional[bool] = None       # fp4compile/precompile.py (None: FP4COMPILE_PRECOMPILE, default on)
    save_weight_copies: Optional[bool] = None   # None: reuse.SAVE_WEIGHT_COPIES (read when the pass runs)
    on_error: Optional[str] = None          # ON_ERROR_MODES (None: ON_ERROR, read when the graph compiles)
    qk_transform: Optional[str] = None      # attention_ref.QK_TRANSFORMS (None: passes.attention.QK_TRANSFORM)
    qk_blocks: Optional[str] = None         # attention_ref.QK_BLOCK_CHOICES (None: passes.attention.QK_BLOCKS)
    check_finite: bool = False              # passes/finite.py

    @classmethod
    def from_options(cls, options: Optional[Mapping[str, Any]]) -> "Settings":
        """Validated settings from backend ``options`` (keys from ``OPTIONS``; None = no options). Raises
        ``ValueError`` for an unknown key, ``gemm_lowering`` or policy preset, ``TypeError`` for a ``dump_dir`` that
        is not a path, a ``mode`` that is not a string, a ``precompile``, ``save_weight_copies`` or ``check_finite``
        that is not a bool or a policy of the wrong type; ``ValueError`` for ``check_finite`` with a CUDA-graph
        ``mode``; ``ValueError`` for an ``on_error`` not in ``ON_ERROR_MODES`` or a
        ``qk_transform`` / ``qk_blocks`` not in ``attention_ref.QK_OPTIONS``."""
        options = dict(options or {})
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ValueError(f"fullstack_fp4: unknown option(s) {unknown}; options are {list(OPTIONS)}")
        dump_dir = options.get("dump_dir")
        if dump_dir is not None and not isinstance(dump_dir, (str, os.PathLike)):
            raise TypeError(f"fullstack_fp4: dump_dir must be a path, got {dump_dir!r}")
        lowering = options.get("gemm_lowering", "op")
        if lowering not in LOWERINGS:
            raise ValueError(f"fullstack_fp4: gemm_lowering must be one of {list(LOWERINGS)}, got {lowering!r}")
        mode = options.get("mode")
        if mode is not None and not isinstance(mode, str):
            raise TypeError(f"fullstack_fp4: mode must be a torch.compile mode name, got {mode!r}")
        precompile = options.get("precompile")
        if precompile is not None and not isinstance(precompile, bool):
            raise TypeError(f"fullstack_fp4: precompile must be True or False, got {precompile!r}")
        save_w = options.get("save_weight_copies")
        if save_w is not None and not isinstance(save_w, bool):
            raise TypeError(f"fullstack_fp4: save_weight_copies must be True or False, got {save_w!r}")
        check_finite = options.get("check_finite", False)
        if not isinstance(check_finite, bool):
            raise TypeError(f"fullstack_fp4: check_finite must be True or False, got {check_finite!r}")
        check_cudagraph_mode(check_finite, mode)
        on_error = options.get("on_error")
        if on_error is not None and on_error not in ON_ERROR_MODES:
            raise ValueError(f"fullstack_fp4: on_error must be one of {list(ON_ERROR_MODES)}, got {on_error!r}")
        from .kernels.attention_ref import QK_OPTIONS, check_qk_option

        qk_transform, qk_blocks = options.get("qk_transform"), options.get("qk_blocks")
        for k in QK_OPTIONS:
            if options.get(k) is not None:
                check_qk_option(k, options[k], f"fullstack_fp4: {k}")
        return cls(Policy.from_options(options), None if dump_dir is None else os.fspath(dump_dir),
                   bool(options.get("debug", False)), gemm_lowering=lowering, mode=mode, precompile=precompile,
                   save_weight_copies=save_w, on_error=on_error, qk_transform=qk_transform, qk_blocks=qk_blocks,
                   check_finite=check_finite)


def check_cudagraph_mode(check_finite: bool, mode: Optional[str]) -> None:
    """``check_finite`` reads each global scale on the host, which a CUDA graph capture cannot: a clear error for
    a CUDA-graph ``mode`` instead of a failed capture."""
    if check_finite and mode in CUDAGRAPH_MODES:
        raise ValueError(f"fullstack_fp4: check_finite reads values on the host after each quantization and cannot "
                         f"run inside CUDA graphs (mode={mode!r}); use mode=None or 'default' while debugging")


class FP4JointPass(CustomGraphPass):
    """The joint-graph passes (linear -> reuse -> check) as Inductor's ONE ``joint_custom_pre_pass``.

    ``uuid()`` hashes the pass sources, the policy and the site table, so Inductor's / AOTAutograd's caches
    hit for the same policy and miss when anything that changes the rewrite changes."""

    def __init__(self, policy: Policy, table: Dict[str, SiteInfo], recorder=None, gemm_lowering: str = "op",
                 precompile: Optional[bool] = None, save_weight_copies: Optional[bool] = None,
                 check_finite: bool = False):
        self.policy, self.table, self.recorder = policy, table, recorder
        self.gemm_lowering = gemm_lowering
        self.precompile = precompile  # not part of uuid(): it changes no graph
        self.save_weight_copies = save_weight_copies
        self.check_finite = check_finite

    def _save_weights(self) -> bool:
        return reuse.SAVE_WEIGHT_COPIES if self.save_weight_copies is None else self.save_weight_copies

    def __call__(self, graph: torch.fx.Graph) -> None:
        from torch._inductor.pattern_matcher import stable_topological_sort

        cache = QuantCache(graph, tangent_closure(graph), save_weight_copies=self._save_weights())
        records = rewrite_linears(graph, self.table, cache, self.gemm_lowering)
        cache.pair_layouts()                            # a gradient's two MS-EDEN copies from one pass over it
        use_dequantized_copies(graph, cache)            # GEMM operands as bf16 q * S from the quantize launches
        fuse_amax(graph)                                # an activation's amax from the kernel that makes it
        pool_seeds(graph)                               # the backward's seeds from one draw (opt-in: POOL_SEEDS)
        stable_topological_sort(graph)
        cache.finalize()
        check(graph, self.table, records)
        if self.check_finite:
            guard_finite(graph)                         # option: NaN / Inf raise where they enter NVFP4
        graph.eliminate_dead_code()
        graph.lint()
        if self.recorder is not None:
            self.recorder.joint(graph, records)
        if precompile.enabled(self.precompile):
            precompile.start(graph)                     # 7. the graph's Triton kernels, compiled in workers

    def uuid(self) -> bytes:
        # the module switches of the rewrite are read at call time, so they are part of the key (an A/B of
        # FP4COMPILE_DQ_OPERANDS in one machine's cache would otherwise replay the other arm's graph)
        switches = (linear.DQ_OPERANDS, linear.FUSE_BIAS, reuse.PAIR_LAYOUTS, self._save_weights(),
                    amax.fuse_amax_mode(), amax.POINTWISE_ROW, linear.gemm_default_impl(), seeds.POOL_SEEDS)
        return get_hash_for_files(PASS_FILES, extra=repr((self.policy, sorted(self.table.items()),
                                                          self.gemm_lowering, switches, self.check_finite)))


def fullstack_fp4(gm: torch.fx.GraphModule, example_inputs: Sequence, *, mode: Optional[str] = None,
                  options: Optional[Mapping[str, Any]] = None):
    """torch.compile backend: NVFP4 GEMMs per policy, the rest compiled by Inductor (see module docstring)."""
    settings = Settings.from_options(options)
    return compile_graph(gm, example_inputs, settings, mode or settings.mode)


def compile_graph(gm, example_inputs, settings: Settings, mode: Optional[str] = None):
    """The pipeline, for already validated settings (``fp4compile.explain`` calls this with a recorder)."""
    policy = settings.policy
    fallback = _bf16_fallback(gm, settings)               # the graph as traced, should the rewrite fail to compile
    sites = find_sites(gm, example_inputs)                                        # 1
    specs = assign(gm, sites, policy)                                             # 2
    table = {s.name: SiteInfo(s.path, tuple(specs[s.name].items()), _weight_pos(gm, s)) for s in sites}
    attn = _swap_attention(gm, policy, settings.qk_transform, settings.qk_blocks)  # 3
    policy.warn_unmatched(_site_paths(gm))
    if settings.recorder is not None:
        settings.recorder.dynamo(gm)
    check_cudagraph_mode(settings.check_finite, mode)
    joint = FP4JointPass(policy, table, settings.recorder, settings.gemm_lowering,  # 4-7
                         settings.precompile, settings.save_weight_copies, settings.check_finite)
    if settings.debug:
        return _debug_compile(gm, example_inputs, joint, settings)
    from torch._inductor.compile_fx import compile_fx

    mode_patches = _mode_options(mode)
    patches = {**mode_patches, "joint_custom_pre_pass": joint}
    kw = {}
    if settings.dump_dir or settings.recorder is not None:
        kw["inner_compile"] = _recording_inner(settings)
    rewritten = any(isinstance(spec, NVFP4) for roles in specs.values() for spec in roles.values()) or any(
        a.swapped for a in attn)
    if precompile.enabled(settings.precompile) and rewritten:
        precompile.prestart(example_inputs)       # 7: workers set up meanwhile (graphs with CUDA inputs)
    amax.fuse_amax_mode()                         # a bad setting raises here, not as a failed compile
    try:
        with torch._functorch.config.patch(**_eager_backward(fallback)):
            return compile_fx(gm, example_inputs, config_patches=patches, **kw)
    except Exception as e:
        if fallback is None or not rewritten:
            raise
        _warn_fallback(e, table, attn)
        return compile_fx(_fallback_module(gm, fallback), example_inputs, config_patches=dict(mode_patches))
    finally:
        precompile.release()                      # workers 7 left without calls exit


def _on_error(settings: Settings) -> str:
    mode = settings.on_error if settings.on_error is not None else ON_ERROR
    if mode not in ON_ERROR_MODES:
        raise ValueError(f"fullstack_fp4: ON_ERROR / FP4COMPILE_ON_ERROR must be one of {list(ON_ERROR_MODES)}, "
                         f"got {mode!r}")
    return mode


def _bf16_fallback(gm, settings: Settings) -> Optional[torch.fx.Graph]:
    """A copy of Dynamo's graph before the passes touch it, when ``on_error`` is ``"bf16"``; None when a failure
    should raise (and for ``explain``'s recorder or ``debug``). Only a graph: :func:`_fallback_module` builds the
    module (and its Python code) should it be needed."""
    if _on_error(settings) != "bf16" or settings.recorder is not None or settings.debug:
        return None
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return graph


def _fallback_module(gm, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """``graph`` over ``gm``'s parameters and buffers (shared, not copied), with ``gm``'s meta."""
    module = torch.fx.GraphModule(gm, graph)
    module.meta = dict(getattr(gm, "meta", {}))
    return module


def _eager_backward(fallback) -> Dict[str, bool]:
    """With a fallback, AOTAutograd compiles the backward graph inside ``compile_fx`` (as it does for graphs with
    symbolic sizes) instead of at the first backward, so that its failure is caught too (the same compile work, done
    earlier; torch versions without the switch keep the lazy backward)."""
    import torch._functorch.config as aot_config

    if fallback is None or not hasattr(aot_config, "force_non_lazy_backward_lowering"):
        return {}
    return {"force_non_lazy_backward_lowering": True}


def _warn_fallback(error: BaseException, table: Dict[str, SiteInfo], attn) -> None:
    import warnings

    paths = sorted({info.path or "<root>" for info in table.values()
                    if any(isinstance(spec, NVFP4) for _, spec in info.specs)}
                   | {f"{a.module_path or '<root>'} (attention)" for a in attn if a.swapped})
    shown = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    first = (str(error).strip().splitlines() or [""])[0][:200]
    warnings.warn(f"fp4compile: this graph's NVFP4 rewrite failed to compile ({type(error).__name__}: {first}); "
                  f"its NVFP4 sites {shown} run unquantized instead (plain Inductor, the model's own dtype). "
                  f"on_error='raise' (FP4COMPILE_ON_ERROR=raise) stops here.", stacklevel=2)


# ------------------------------------------------------------------------------------------------
def _mode_options(mode: Optional[str]) -> Dict[str, Any]:
    if mode in (None, "default"):
        return {}
    try:
        return torch._inductor.list_mode_options(mode)
    except (KeyError, RuntimeError) as e:
        raise ValueError(f"fullstack_fp4: unknown mode {mode!r}") from e


def _weight_pos(gm, site) -> int:
    """Position of the weight among the two GEMM operands of the traced mm (F.linear: the second)."""
    if site.kind == "linear":
        return 1
    from .passes.sites import _is_param, _placeholder_params

    node = next(n for n in gm.graph.nodes if n.name == site.name)
    params = _placeholder_params(gm, ())
    operands = node.args[1:3] if node.target in (torch.addmm, "addmm") else node.args[:2]
    return 0 if _is_param(operands[0], params) else 1


def _swap_attention(gm, policy, qk_transform: Optional[str] = None, qk_blocks: Optional[str] = None) -> list:
    """Step 3: the attention sites sent to ``fp4compile::qattn`` (none without ``passes/attention.py``), with the
    ``qk_transform`` / ``qk_blocks`` options (None: the pass's module defaults)."""
    try:
        from .passes.attention import swap_attention
    except ImportError:                        # no attention pass in this build: say so if it mattered
        import warnings

        from .passes.sites import module_path
        from .policy import NVFP4

        attn_roles = ("attn.qk", "attn.pv", "attn.dov", "attn.pdo", "attn.dsk", "attn.dsq")
        for n in gm.graph.nodes:
            if n.op == "call_function" and n.target is torch._C._nn.scaled_dot_product_attention and any(
                    isinstance(policy.resolve(module_path(n), r), NVFP4) for r in attn_roles):
                warnings.warn(f"fp4compile: {n.name} ({module_path(n) or '<root>'}, attention) stays BF16: "
                              f"fp4compile.passes.attention is not available", stacklevel=2)
        return []
    return swap_attention(gm, policy, qk_transform=qk_transform, qk_blocks=qk_blocks)


def _site_paths(gm) -> List[str]:
    from .inspect import node_records

    return [rec.get("path", "") for n in gm.graph.nodes for rec in node_records(n)]


_DUMP_COUNTER = itertools.count()


def _recording_inner(settings: Settings) -> Callable:
    from torch._inductor.compile_fx import compile_fx_inner

    def inner(gm, example_inputs, **kw):                  # kw passed through untouched: version-safe
        kind = "bwd" if kw.get("is_backward") else ("inference" if kw.get("is_inference") else "fwd")
        readable = gm.print_readable(print_output=False)
        if settings.recorder is not None:
            settings.recorder.partitioned(kind, gm)
        compiled = compile_fx_inner(gm, example_inputs, **kw)
        if settings.dump_dir:
            _dump(settings.dump_dir, kind, readable, getattr(compiled, "source_code", None))
        return compiled

    return inner


def _debug_compile(gm, example_inputs, joint: FP4JointPass, settings: Settings):
    """Same passes; AOTAutograd with Inductor's decompositions and partitioner, graphs run eagerly."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    def partition(joint_gm, joint_inputs, **kw):
        joint(joint_gm.graph)
        joint_gm.recompile()
        return min_cut_rematerialization_partition(joint_gm, joint_inputs, compiler="inductor", **kw)

    def compiler(kind):
        def compile_(g, ex):
            if kind == "inference":
                joint(g.graph)
                g.recompile()
            if settings.recorder is not None:
                settings.recorder.partitioned(kind, g)
            if settings.dump_dir:
                _dump(settings.dump_dir, kind, g.print_readable(print_output=False), None)
            return make_boxed_func(g.forward)
        return compile_

    return aot_autograd(fw_compiler=compiler("fwd"), bw_compiler=compiler("bwd"),
                        inference_compiler=compiler("inference"), partition_fn=partition,
                        decompositions=select_decomp_table())(gm, example_inputs)


def _dump(dump_dir: str, kind: str, graph_src: str, output_code: Optional[str]) -> None:
    """Write one compiled graph's readable FX graph, Inductor output code and the fp4compile Triton kernels."""
    os.makedirs(dump_dir, exist_ok=True)
    idx = next(_DUMP_COUNTER)
    with open(os.path.join(dump_dir, f"{idx:03d}_{kind}_graph.py"), "w") as f:
        f.write(graph_src)
    if output_code:
        with open(os.path.join(dump_dir, f"{idx:03d}_{kind}_inductor.py"), "w") as f:
            f.write(output_code)
    from .inspect import triton_kernel_sources

    kdir = os.path.join(dump_dir, "kernels")
    for name, src in triton_kernel_sources().items():
        os.makedirs(kdir, exist_ok=True)
        with open(os.path.join(kdir, f"{name}.py"), "w") as f:
            f.write(src)
