"""The training loop, top to bottom: config → data → model → (LoRA-SVD) → optimizer → compile → steps.

    from fp4compile.train.loop import TrainConfig, train
    result = train(TrainConfig(out_dir="runs/a", model="cpu", backend="fullstack_fp4", policy="full_stack"))

Everything a run writes goes to ``out_dir``:

    config.json        the resolved TrainConfig
    metrics.jsonl      one JSON object per line: {"step", "tokens", "loss", "lr"} per step, plus
                       throughput lines ({"tok_per_s", ...}) and eval lines ({"val_loss", "brown_loss"})
    checkpoint/        model.safetensors + state.pt (optimizer, LR schedule, RNG, step, data position)
    summary.json       final numbers (loss, val/brown loss, tokens/s, compile time, checkpoint save time, peak
                       memory)

Resume (``resume=True``) continues bit-exactly: batches are a pure function of (seed, sample index), the
optimizer/schedule/RNG state is restored, and metric lines past the checkpoint are dropped. Ctrl-C (SIGINT)
finishes the current step, saves a checkpoint and returns (a second Ctrl-C aborts at once); so does ``stop_file``
(after the step in which that file appears, under DDP at the next log step: a detached run stopped from
outside).

Time budget (``max_seconds`` from the loop's start, or ``deadline``, a Unix time that start-up counts against;
the smaller wins): the run stops, checkpoints and returns while three more steps and the checkpoint still fit. It
keeps 30 s for the save until one has been timed, then twice the slowest save of the run (this call's, or the
one the resumed call's ``summary.json`` records) plus 5 s (``checkpoint_reserve``).

Fork (``init_from=RUN_DIR``): start a new run at another run's checkpoint (its weights, optimizer state, LR
schedule, RNG and step) with the same model, optimizer and data order but, typically, another backend or
policy, or with LoRA-SVD added (its factors' AdamW moments derived from the dense weights', see
``LoRASVDHandle.init_state_from_dense``; with ``realign_scale`` "hold", beta as hold would keep it from a split
of the initial weights, ``LoRASVDHandle.hold_scale_from``). Arms forked from one shared checkpoint differ only
after it: how a study compares precisions over the late part of training without the early phase's spread.

Late switch (``late_bf16_at``, ``late_bf16_roles``; NVIDIA's NVFP4 pretraining recipe, which moves the GEMM
inputs to higher precision for the last part of training): from the switch step on, the model is recompiled
with the listed roles (default ``linear.fprop``) in BF16 for every module, the rest of the policy unchanged.
The step is a fraction of ``steps`` or a step number; ``metrics.jsonl`` records it as ``{"event":
"late_bf16"}``, and a run resumed at or after it compiles with the switched policy from its first step.

Multi-GPU hooks: ``rank``/``world_size`` come from the torchrun environment; each rank draws its own rows
of the global batch, and only rank 0 logs and writes files. ``parallel="ddp"|"fsdp2"`` (under torchrun)
wraps the model with ``fp4compile.train.distributed`` (DDP / FSDP2 in torchtitan's order), reduces the
logged losses over ranks and writes torch.distributed.checkpoint checkpoints (resumable on any world size).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import json
import math
import os
import resource
import shutil
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..determinism import deterministic_mode
from . import data as D
from .model import GPT, config_from_preset

BACKENDS = ("fullstack_fp4", "inductor", "aot_eager", "eager", "none")
OPTIMIZERS = ("adamw", "qadamw", "qroot", "qroot+adamw")
SCHEDULES = ("cosine", "wsd", "constant")
DTYPES = ("auto", "fp32", "bf16-autocast", "bf16")
COMPILE_MODES = ("auto", "default", "reduce-overhead")


#: TrainConfig fields that are QRoot's Root-group keys of the same name (None in the config: QRoot's default)
ROOT_GROUP_KEYS = ("ns_schedule", "ns_shift", "ns_steps", "ns_sym_b", "ns_residual", "ns_shared_x")


@dataclasses.dataclass
class TrainConfig:
    """Every knob of a run. CLI flags and TOML keys use the same names (``--grad-accum`` ↔ ``grad_accum``)."""

    out_dir: str = "runs/run"
    # model
    model: str = "cpu"                        # size preset: tiny, cpu, gpu-demo, 30m, 124m, 350m, 1b
    tie_embeddings: bool = True
    # data
    tokenizer: str = "bytes"                  # bytes | gpt2 | path.tiktoken | tokenizer.json
    train_data: str = "stdlib"                # see fp4compile.train.data
    val_data: str = "stdlib:val"              # "" for none
    brown_data: str = ""                      # a second held-out set (the study: corpus:brown), "" for none
    max_train_tokens: Optional[int] = None    # cap for text sources
    # precision
    backend: str = "inductor"                 # fullstack_fp4 | inductor | aot_eager | eager | none
    policy: str = "full_stack"                # preset name, policy .toml file or module:attr (fullstack_fp4 only)
    qk_transform: Optional[str] = None        # fullstack_fp4's qk_transform option: Q-Attn's Q, K transform (None:
                                              # passes.attention.QK_TRANSFORM, FP4COMPILE_QK_TRANSFORM)
    qk_blocks: Optional[str] = None           # fullstack_fp4's qk_blocks option: 16x16 | 1x16 (None:
                                              # passes.attention.QK_BLOCKS, FP4COMPILE_QK_BLOCKS)
    backend_debug: bool = False               # fullstack_fp4's debug variant: same passes, graphs run eagerly
    check_finite: bool = False                # fullstack_fp4's check_finite option: raise naming the NVFP4 GEMM a
                                              # NaN / Inf first reaches (a host read per copy; no CUDA graphs)
    compile_mode: str = "auto"                # auto | default | reduce-overhead (CUDA graphs), see resolve_compile_mode
    dtype: str = "auto"                       # auto (CUDA: bf16-autocast, CPU: fp32) | fp32 | bf16-autocast | bf16
    lora: bool = False                        # fp4compile.prepare (LoRA-SVD) before compiling
    lora_rank: Optional[int] = None           # None: prepare()'s default (resolved() records it)
    lora_beta: Optional[float] = None
    lora_realign_every: Optional[int] = None
    lora_realign_after: Optional[int] = None  # no realignment before this step (None: prepare's default, 0)
    lora_state_remap: Optional[str] = None    # project | reset | keep: optimizer state at a realignment (None: prepare's)
    lora_realign_scale: Optional[str] = None  # hold | keep: beta at a realignment (None: prepare's, hold)
    lora_train_factors: Optional[bool] = None  # False: factors frozen between realignments, W steps as if dense
    late_bf16_at: float = 0.0                 # late switch (NVIDIA's NVFP4 recipe): from this step on the roles in
                                              # late_bf16_roles run in BF16; a fraction of steps in (0, 1) or a
                                              # whole step >= 1; 0: never
    late_bf16_roles: str = "linear.fprop"     # comma list of model roles (linear.*, attn.*) switched to BF16
    # optimizer and schedule
    optimizer: str = "adamw"                  # adamw | qadamw | qroot (Root + QAdamW) | qroot+adamw (Root + AdamW)
    lr: float = 3e-3
    matrix_lr: Optional[float] = None         # QRoot's LR for hidden matrices (default: lr)
    ns_schedule: Optional[str] = None         # QRoot's NS coefficients: root | root_table | jordan | polar_express
    ns_shift: Optional[bool] = None           # QRoot's identity-shifted NVFP4 NS products (None: QRoot's default, on)
    ns_steps: Optional[int] = None            # QRoot's Newton–Schulz steps per update (None: QRoot's default, 5)
    ns_sym_b: Optional[bool] = None           # QRoot's NVFP4 NS: B of B·X in 16x16 blocks (None: QRoot's default,
                                              # on where the NS spec has no RHT)
    ns_residual: Optional[str] = None         # QRoot's NVFP4 NS: X's quantizations in two terms, comma list of
                                              # x (X·Xᵀ), xt (B·X), or x2d alone; "" or None: none (docs/OPTIM.md)
    ns_shared_x: Optional[bool] = None        # QRoot's NVFP4 NS: X quantized once per step (16x16 blocks) for both
                                              # products, 3 quantizations per step (None: QRoot's default, on
                                              # where the NS spec has no RHT and there is no ns_residual)
    qadamw_v_state: Optional[str] = None      # Q-AdamW's v_state (floored | signed; None: its default, floored)
    qadamw_v_four_over_six: Optional[bool] = None  # Q-AdamW's v_four_over_six (None: its default, on; off: ~9 %
                                              # less Q-AdamW time on the H200, docs/OPTIM.md "What v's 4/6 buys")
    optim_cuda_graphs: Optional[bool] = None  # QRoot(cuda_graphs=...): its Newton–Schulz replayed as CUDA graphs;
                                              # None: on when the model's step runs as CUDA graphs (resolved())
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0                    # 0 disables
    schedule: str = "cosine"                  # cosine | wsd | constant (all after linear warmup)
    warmup_steps: int = 20
    decay_frac: float = 0.2                   # WSD: fraction of steps in the final linear decay
    # batch
    batch_size: int = 16                      # sequences per micro-batch per rank
    seq_len: int = 256
    grad_accum: int = 1
    steps: int = 100
    seed: int = 0
    # bookkeeping
    eval_interval: int = 0                    # 0: only at the end
    eval_batches: int = 8
    ckpt_interval: int = 0                    # 0: only at the end (and on Ctrl-C / time budget)
    log_interval: int = 10
    resume: bool = False
    init_from: str = ""                       # fork: start at another run's checkpoint (weights, optimizer state,
                                              # schedule, RNG, step); it may add LoRA-SVD or change backend/policy
    max_seconds: Optional[float] = None       # wall-clock budget: checkpoint and stop before it runs out
    deadline: Optional[float] = None          # the same as a Unix time (time.time()) by which the run has saved
                                              # its checkpoint: start-up before the loop counts against it
    stop_after: Optional[int] = None          # checkpoint and stop after this step (resume continues the run;
                                              # resumed at or past it, the run trains nothing and stops)
    stop_file: str = ""                       # checkpoint and stop after the step in which this file appears
                                              # (status "stopped"; the file is then removed, so a resume goes on):
                                              # a detached run stopped early from outside, without a signal
    device: str = "auto"
    threads: Optional[int] = None             # CPU intra-op threads (torch.set_num_threads); None: torch's default
    deterministic: bool = False               # run under fp4compile.determinism.deterministic_mode: two runs of one
                                              # config, machine and thread count give the same bits (slower)
    progress: bool = True
    parallel: str = "none"                    # none | ddp | fsdp2 (under torchrun; fp4compile.train.distributed)
    fsdp_reshard: bool = True                 # FSDP2 reshard_after_forward (False: one all-gather per block/step)
    fsdp_bf16_params: bool = False            # FSDP2 MixedPrecisionPolicy(bf16 params, fp32 reduce) instead of autocast

    def validate(self) -> None:
        """Raise ``ValueError`` for an invalid config: a choice outside its allowed values, a size or count < 1,
        a negative ``warmup_steps`` or ``decay_frac`` outside [0, 1], or an unsupported combination (e.g.
        ``reduce-overhead`` where CUDA graphs cannot run, LoRA-SVD under FSDP2, ``optim_cuda_graphs`` with
        ``parallel``)."""
        def one_of(name, allowed):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}; choose one of {allowed}")

        one_of("backend", BACKENDS)
        one_of("optimizer", OPTIMIZERS)
        from ..kernels.attention_ref import QK_OPTIONS

        for name, allowed in QK_OPTIONS.items():
            one_of(name, (None,) + allowed)
        if (self.qk_transform is not None or self.qk_blocks is not None) and self.backend != "fullstack_fp4":
            raise ValueError(f"qk_transform / qk_blocks are options of the fullstack_fp4 backend; backend="
                             f"{self.backend!r} runs no Q-Attn")
        if self.check_finite and self.backend != "fullstack_fp4":
            raise ValueError(f"check_finite is an option of the fullstack_fp4 backend; backend={self.backend!r} "
                             "quantizes nothing")
        one_of("schedule", SCHEDULES)
        one_of("dtype", DTYPES)
        one_of("parallel", ("none", "ddp", "fsdp2"))
        one_of("compile_mode", COMPILE_MODES)
        why = self._cuda_graphs_excluded()
        if self.compile_mode == "reduce-overhead" and why:
            raise ValueError(f"compile_mode='reduce-overhead' (CUDA graphs): {why}; use compile_mode='default'")
        if self.ns_schedule is not None:
            from ..optim.root import SCHEDULES as NS_SCHEDULES

            one_of("ns_schedule", NS_SCHEDULES)
        for name, value in self._root_group_settings().items():
            if value is not None and not self.optimizer.startswith("qroot"):
                raise ValueError(f"{name} is QRoot's Newton–Schulz setting; optimizer={self.optimizer!r} has none")
        if self.qadamw_v_state is not None:
            from ..optim.qadamw import V_STATES

            one_of("qadamw_v_state", V_STATES)
            if self.optimizer not in ("qadamw", "qroot"):
                raise ValueError(f"qadamw_v_state is a Q-AdamW setting; optimizer={self.optimizer!r} has no Q-AdamW")
        if self.qadamw_v_four_over_six is not None:
            if not isinstance(self.qadamw_v_four_over_six, bool):
                raise ValueError(f"qadamw_v_four_over_six must be a bool, got {self.qadamw_v_four_over_six!r}")
            if self.optimizer not in ("qadamw", "qroot"):
                raise ValueError(f"qadamw_v_four_over_six is a Q-AdamW setting; optimizer={self.optimizer!r} has no "
                                 "Q-AdamW")
        if self.parallel != "fsdp2" and (not self.fsdp_reshard or self.fsdp_bf16_params):
            raise ValueError("fsdp_reshard / fsdp_bf16_params are FSDP2 settings; they need parallel='fsdp2'")
        if self.lora and self.parallel == "fsdp2":
            raise ValueError("lora=True (LoRA-SVD) does not run under FSDP2: its realignment needs whole matrices "
                             "and its constrained-backward hooks sit on the parameters FSDP2 shards; use "
                             "parallel='ddp'")
        if self.init_from and self.parallel != "none":
            raise ValueError("init_from (a fork of another run's checkpoint) runs in one process; "
                             "leave parallel='none'")
        if self.init_from and self.lora and self.optimizer != "adamw" and self.lora_train_factors is not False:
            raise ValueError("init_from with lora=True derives the LoRA-SVD factors' optimizer state from the dense "
                             f"weights' AdamW moments; optimizer={self.optimizer!r} is not supported there (with "
                             "lora_train_factors=False the factors have no state and any optimizer forks)")
        if self.optim_cuda_graphs and self.parallel != "none":
            raise ValueError("optim_cuda_graphs=True (QRoot's Newton–Schulz as CUDA graphs) is for one process; "
                             f"with parallel={self.parallel!r} leave it unset")
        late_roles(self.late_bf16_roles)                  # raises for an unknown or non-model role
        if self.late_bf16_at:
            at = self.late_bf16_at
            if at < 0 or (at >= 1 and at != int(at)):
                raise ValueError(f"late_bf16_at must be 0 (no switch), a fraction of the steps in (0, 1) or a whole "
                                 f"step >= 1, got {at!r}")
            if self.backend != "fullstack_fp4":
                raise ValueError(f"late_bf16_at switches roles of the fullstack_fp4 backend's policy; backend="
                                 f"{self.backend!r} runs no NVFP4 GEMMs to switch")
            if self.parallel != "none":
                raise ValueError("late_bf16_at recompiles the model at the switch step, which runs in one process "
                                 f"only; parallel={self.parallel!r} is not supported with it")
        if self.max_train_tokens is not None and self.max_train_tokens < 1:
            raise ValueError(f"max_train_tokens must be None (no cap) or >= 1, got {self.max_train_tokens}")
        for name in ("batch_size", "seq_len", "grad_accum", "steps", "eval_batches", "log_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup_steps < 0 or not 0 <= self.decay_frac <= 1:
            raise ValueError("warmup_steps must be >= 0 and decay_frac in [0, 1]")

    def late_switch_step(self) -> Optional[int]:
        """The first step (0-based, as the loop counts before the update) that runs with ``late_bf16_roles`` in
        BF16, or None when there is no late switch: ``round(late_bf16_at * steps)`` for a fraction, else the step."""
        if not self.late_bf16_at:
            return None
        at = self.late_bf16_at
        return int(round(at * self.steps)) if at < 1 else int(at)

    def _cuda_graphs_excluded(self) -> Optional[str]:
        """Why this run cannot use CUDA graphs at all, or None."""
        if self.parallel == "fsdp2":
            return "FSDP2 frees and re-gathers the parameters the graphs would capture"
        if self.grad_accum > 1:
            return ("the graph's backward writes each micro-batch's gradients into the same graph-owned buffers, "
                    "so it needs grad_accum=1 (raise batch_size instead)")
        if self.backend in ("eager", "aot_eager", "none"):
            return f"it needs a compiling backend (inductor or fullstack_fp4), not {self.backend!r}"
        if self.check_finite:
            return "check_finite reads every NVFP4 copy's global scale on the host, which a graph capture cannot"
        return None

    def _root_group_settings(self) -> Dict[str, Any]:
        """QRoot's Root-group keys this config sets (None: QRoot's default)."""
        out = {k: getattr(self, k) for k in ROOT_GROUP_KEYS}
        if out["ns_residual"] is not None:                 # "x,xt" -> QRoot's tuple
            out["ns_residual"] = tuple(filter(None, (v.strip() for v in out["ns_residual"].split(","))))
        return out

    def resolve_compile_mode(self, device: torch.device) -> str:
        """The torch.compile mode a run on ``device`` uses: ``compile_mode`` unless it is "auto", which picks
        CUDA graphs ("reduce-overhead") for a CUDA run, in one process or under DDP, that can use them (where
        they were validated, and where a launched-eagerly step is host-bound: 124M full stack on 2 H200s, DDP
        1.86x one GPU with graphs), else "default" (CPU, FSDP2, gradient accumulation, eager backends, the
        backend's debug variant)."""
        if self.compile_mode != "auto":
            return self.compile_mode
        graphs = (device.type == "cuda" and self.parallel in ("none", "ddp") and not self.backend_debug
                  and self._cuda_graphs_excluded() is None)
        return "reduce-overhead" if graphs else "default"

    def resolved(self, device: torch.device) -> "TrainConfig":
        """This config with what a run on ``device`` uses in place of its automatic choices: ``compile_mode``
        from :meth:`resolve_compile_mode`, and ``optim_cuda_graphs=None`` -> True exactly when that mode is
        CUDA graphs in one process (QRoot's NS is then graphed like the step; 30M full stack on the H200: 248k -> 414k
        tokens/s, ``docs/BENCHMARKS.md``), and with LoRA-SVD ``lora_rank=None`` -> ``prepare()``'s
        ``DEFAULT_RANK``, so a checkpoint records the rank it was built with and a later change of the default is
        caught as a structural difference instead of a shape mismatch (``lora_train_factors=None`` -> True, for the
        same reason)."""
        mode = self.resolve_compile_mode(device)
        graphs = self.optim_cuda_graphs if self.optim_cuda_graphs is not None else \
            mode == "reduce-overhead" and self.parallel == "none"
        rank = self.lora_rank
        if self.lora and rank is None:
            from ..nn.lora_svd import DEFAULT_RANK
            rank = DEFAULT_RANK
        factors = True if self.lora and self.lora_train_factors is None else self.lora_train_factors
        return dataclasses.replace(self, compile_mode=mode, optim_cuda_graphs=graphs, lora_rank=rank,
                                   lora_train_factors=factors)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "TrainConfig":
        """From a flat dict or one with TOML sections (``[model]``, ``[data]``, ...; section names are ignored)."""
        flat: Dict[str, Any] = {}
        for k, v in d.items():
            if isinstance(v, dict):
                flat.update({kk.replace("-", "_"): vv for kk, vv in v.items()})
            else:
                flat[k.replace("-", "_")] = v
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(flat) - fields)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; valid keys are {sorted(fields)}")
        return cls(**flat)


@dataclasses.dataclass
class RunResult:
    status: str                   # "done" | "interrupted" | "time_budget" | "stopped"
    step: int
    summary: Dict[str, Any]


# ----------------------------------------------------------------------------------------------------------
# pieces of a run


def dist_info():
    """(rank, world_size) from the torchrun environment (1 process without it)."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def resolve_device(spec: str) -> torch.device:
    """``"auto"``: CUDA when available, else CPU; any other spec goes to ``torch.device``."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


def resolve_dtype(spec: str, device: torch.device) -> str:
    """The dtype mode of a run: ``"auto"`` -> "bf16-autocast" on CUDA, "fp32" elsewhere; any other spec as is."""
    if spec == "auto":
        return "bf16-autocast" if device.type == "cuda" else "fp32"
    return spec


def load_policy(spec: str):
    """A ``fp4compile.Policy`` from a preset name, a ``.toml`` file or ``module:attr``.

    Policy TOML::

        preset = "full_stack"            # optional starting point (default: an empty policy = all BF16)
        name = "my_policy"
        [[rules]]                        # appended in order; the last matching rule wins
        pattern = "blocks.0.*"
        role = "linear.fprop"            # optional; omitted = every role
        spec = "bf16"                    # "bf16", "nvfp4", or a table of NVFP4 fields
        [[rules]]
        pattern = "*mlp*"
        spec = { rounding = "sr", hadamard = 16 }
    """
    from ..policy import NVFP4, Policy

    if isinstance(spec, Policy):
        return spec
    if spec.endswith(".toml"):
        import tomllib

        path = Path(spec)
        if not path.is_file():
            raise FileNotFoundError(f"policy file not found: {path}")
        d = tomllib.loads(path.read_text())
        policy = Policy.preset(d["preset"]) if "preset" in d else Policy((), d.get("name", path.stem))
        for i, r in enumerate(d.get("rules", [])):
            if "pattern" not in r or "spec" not in r:
                raise ValueError(f"{path}: rule {i} needs 'pattern' and 'spec'")
            s = NVFP4(**r["spec"]) if isinstance(r["spec"], dict) else r["spec"]
            policy = policy.override(r["pattern"], s, role=r.get("role"))
        return dataclasses.replace(policy, name=d.get("name", policy.name))
    if ":" in spec:
        import importlib

        mod, attr = spec.split(":", 1)
        obj = getattr(importlib.import_module(mod), attr)
        obj = obj() if callable(obj) and not isinstance(obj, Policy) else obj
        if not isinstance(obj, Policy):
            raise TypeError(f"{spec} is a {type(obj).__name__}, not a fp4compile.Policy")
        return obj
    return Policy.preset(spec)


class FeatureUnavailable(RuntimeError):
    """A part of fp4compile this run needs (backend, LoRA-SVD, quantized optimizers) is not in this checkout."""


def _feature(attr: str, issue: str):
    """``fp4compile.<attr>`` or a clear error naming the issue that provides it."""
    import fp4compile

    try:
        return getattr(fp4compile, attr)
    except (ImportError, AttributeError) as e:
        raise FeatureUnavailable(f"fp4compile.{attr} is not available in this checkout ({type(e).__name__}: {e}); "
                           f"it is built by {issue}. Run without it (e.g. --optimizer adamw, no --lora).") from e


def _call_supported(fn, *args, **kwargs):
    """Call ``fn`` with the keyword arguments its signature accepts (None values are dropped)."""
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn(*args, **kwargs)
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        dropped = sorted(set(kwargs) - set(params))
        if dropped:
            warnings.warn(f"{getattr(fn, '__qualname__', fn)} does not take {dropped}; ignoring them")
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return fn(*args, **kwargs)


def apply_lora(model: torch.nn.Module, cfg: TrainConfig):
    """LoRA-SVD reparametrization of the model's linears (``prepare``'s default excludes the LM head)."""
    prepare = _feature("prepare", "the LoRA-SVD issue (branch lora)")
    return _call_supported(prepare, model, rank=cfg.lora_rank, beta=cfg.lora_beta,
                           realign_every=cfg.lora_realign_every, realign_after=cfg.lora_realign_after,
                           state_remap=cfg.lora_state_remap, realign_scale=cfg.lora_realign_scale, seed=cfg.seed,
                           sync_replicas=cfg.parallel == "ddp", train_factors=cfg.lora_train_factors)


def lora_state(handle) -> dict:
    """What a LoRA-SVD handle needs to realign on schedule after a resume: its counters
    (``handle.state_dict()``) and the state of the randomized SVD's generators (not in that state dict; without
    them the first realignment after a resume draws different test matrices than an uninterrupted run)."""
    state = dict(handle.state_dict()) if hasattr(handle, "state_dict") else {
        "steps": handle.steps, "realignments": handle.realignments}
    state["generators"] = {str(d): g.get_state() for d, g in getattr(handle, "_generators", {}).items()}
    return state


def load_lora_state(handle, state: dict) -> None:
    """Inverse of :func:`lora_state`: restore the handle's counters and its randomized-SVD generators."""
    state = dict(state)
    generators = state.pop("generators", {})
    if hasattr(handle, "load_state_dict"):
        handle.load_state_dict(state)
    else:
        handle.steps, handle.realignments = state["steps"], state["realignments"]
    for dev, st in generators.items():
        g = torch.Generator(device=dev)
        g.set_state(st)
        handle._generators[torch.device(dev)] = g


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, policy=None, device=torch.device("cpu")):
    """AdamW / QAdamW with weight decay on matrices only, or QRoot: Root (Newton–Schulz in the policy's
    ``optim.ns`` precision) for the blocks' 2-D matrices, (Q-)AdamW for embeddings, head and 1-D params."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    matrices = [p for n, p in params if p.dim() >= 2]
    vectors = [p for n, p in params if p.dim() < 2]
    adam_kw = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)

    if cfg.optimizer in ("adamw", "qadamw"):
        groups = [{"params": matrices, "weight_decay": cfg.weight_decay}, {"params": vectors, "weight_decay": 0.0}]
        if cfg.optimizer == "adamw":
            extra = {"fused": True} if device.type == "cuda" else {"foreach": True}
            return torch.optim.AdamW(groups, **adam_kw, **extra)
        return _call_supported(_feature("QAdamW", "the optimizer issue (branch optim)"), groups, **adam_kw,
                               v_state=cfg.qadamw_v_state, v_four_over_six=cfg.qadamw_v_four_over_six)
    QRoot = _feature("QRoot", "the optimizer issue (branch optim)")
    hidden = [p for n, p in params if p.dim() == 2 and n.startswith("blocks.")]
    ids = {id(p) for p in hidden}
    root_group = {"params": hidden, "use_root": True, "weight_decay": cfg.weight_decay, "lr": cfg.matrix_lr or cfg.lr,
                  **{k: v for k, v in cfg._root_group_settings().items() if v is not None}}
    groups = [root_group,
              {"params": [p for p in matrices if id(p) not in ids], "use_root": False,
               "weight_decay": cfg.weight_decay},
              {"params": vectors, "use_root": False, "weight_decay": 0.0}]
    return _call_supported(QRoot, groups, weight_decay=cfg.weight_decay, policy=policy,
                           adamw="adamw" if cfg.optimizer == "qroot+adamw" else "qadamw",
                           cuda_graphs=bool(cfg.optim_cuda_graphs) or None, v_state=cfg.qadamw_v_state,
                           v_four_over_six=cfg.qadamw_v_four_over_six, **adam_kw)


class LRSchedule:
    """Linear warmup, then cosine decay to ``min_lr_ratio``, WSD (stable, then linear decay over the last
    ``decay_frac`` of steps) or constant. Sets ``group["lr"] = base_lr · factor(step)`` for every group."""

    def __init__(self, optimizer, cfg: TrainConfig):
        self.optimizer, self.cfg = optimizer, cfg
        self.base_lrs = [g["lr"] if not torch.is_tensor(g["lr"]) else float(g["lr"]) for g in optimizer.param_groups]

    def factor(self, step: int) -> float:
        """The LR multiplier at 0-based ``step``: ``(step + 1) / warmup_steps`` during warmup, then 1 (constant),
        cosine decay, or WSD's stable phase and linear decay, both reaching ``min_lr_ratio`` at step ``steps``."""
        c = self.cfg
        if step < c.warmup_steps:
            return (step + 1) / c.warmup_steps
        if c.schedule == "constant":
            return 1.0
        if c.schedule == "cosine":
            t = (step - c.warmup_steps) / max(1, c.steps - c.warmup_steps)
            return c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))
        decay_start = c.steps - int(round(c.decay_frac * c.steps))          # WSD
        if step < decay_start:
            return 1.0
        t = (step - decay_start) / max(1, c.steps - decay_start)
        return 1.0 - (1 - c.min_lr_ratio) * min(t, 1.0)

    def set(self, step: int) -> float:
        """Set every group's LR to its base LR x :meth:`factor` (in place for a tensor LR); returns the factor."""
        f = self.factor(step)
        for g, base in zip(self.optimizer.param_groups, self.base_lrs):
            if torch.is_tensor(g["lr"]):
                g["lr"].fill_(base * f)
            else:
                g["lr"] = base * f
        return f

    def state_dict(self):
        """The base LRs (the step is not part of it: the loop passes it to :meth:`set`)."""
        return {"base_lrs": list(self.base_lrs)}

    def load_state_dict(self, sd):
        """Restore the base LRs of :meth:`state_dict`."""
        self.base_lrs = list(sd["base_lrs"])


def late_roles(roles: str) -> Tuple[str, ...]:
    """The roles of a ``late_bf16_roles`` comma list; ``ValueError`` for an unknown role or one outside the model's
    GEMMs (``linear.*``, ``attn.*``: the late switch recompiles the model, not the optimizer)."""
    from ..policy import ROLES

    out = tuple(r.strip() for r in roles.split(",") if r.strip())
    bad = [r for r in out if r not in ROLES or not r.startswith(("linear.", "attn."))]
    if bad or not out:
        model_roles = [r for r in ROLES if r.startswith(("linear.", "attn."))]
        raise ValueError(f"late_bf16_roles={roles!r}: {bad or 'no role'} not a model role; choose from {model_roles}")
    return out


def late_policy(policy, roles: str):
    """``policy`` with each role of the comma list ``roles`` in BF16 for every module (one last rule per role,
    matching every module path, so it overrides the earlier rules): what a run uses after its late switch."""
    parsed = late_roles(roles)
    for r in parsed:
        policy = policy.override("*", "bf16", role=r)
    return dataclasses.replace(policy, name=f"{policy.name}+late_bf16({','.join(parsed)})")


def backend_options(cfg: TrainConfig) -> dict:
    """The fullstack_fp4 options a config sets besides the policy: ``qk_transform`` / ``qk_blocks`` where given,
    ``check_finite`` where on."""
    from ..kernels.attention_ref import QK_OPTIONS

    out = {k: getattr(cfg, k) for k in QK_OPTIONS if getattr(cfg, k) is not None}
    return {**out, "check_finite": True} if cfg.check_finite else out


def compile_model(model: torch.nn.Module, cfg: TrainConfig, policy=None):
    """``torch.compile`` with the chosen backend; the FP4 backend gets the policy through ``options``.

    ``dynamic=False``: a run has one batch shape (evaluation reuses it), and static shapes keep Dynamo from
    handing symbolic sizes to the backend when several runs share a process (tests, ``demo --in-process``).
    ``cfg.compile_mode="reduce-overhead"`` replays the compiled forward and backward as CUDA graphs (the
    loop marks each step with ``torch.compiler.cudagraph_mark_step_begin``); on CPU Inductor skips the
    graphs and runs as in the default mode."""
    if cfg.backend == "none":
        return model
    mode = None if cfg.compile_mode == "default" else cfg.compile_mode
    if cfg.backend == "fullstack_fp4":
        from .distributed import resolve_backend

        try:
            backend = resolve_backend("fullstack_fp4")
        except ImportError as e:
            raise FeatureUnavailable("the fullstack_fp4 backend is not available in this checkout "
                               f"({e}); it is built by the backend issue. Use --backend inductor for BF16.") from e
        options = {"policy": policy, **({"debug": True} if cfg.backend_debug else {}),
                   **({"mode": mode} if mode else {}), **backend_options(cfg)}
        return torch.compile(model, backend=backend, options=options, dynamic=False)
    return torch.compile(model, backend=cfg.backend, mode=mode, dynamic=False)


def _marking_steps(model_fn):
    """Calls ``model_fn`` after ``torch.compiler.cudagraph_mark_step_begin()``: under CUDA graphs every
    training forward and every evaluation forward starts a new replay generation (the previous outputs,
    already consumed by the loop, may then be overwritten)."""
    mark = torch.compiler.cudagraph_mark_step_begin

    def run(*args, **kwargs):
        mark()
        return model_fn(*args, **kwargs)

    return run


def peak_memory_mib(device: torch.device) -> float:
    """CUDA: ``max_memory_allocated``; CPU: the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024      # Linux reports KiB


# ----------------------------------------------------------------------------------------------------------
# checkpoints

#: TrainConfig fields that must match to resume (the state would not fit otherwise)
STRUCTURAL = ("model", "tie_embeddings", "tokenizer", "optimizer", "lora", "lora_rank", "lora_train_factors", "dtype")
#: fields whose change is allowed on resume but breaks bit-exact continuation (a warning)
SOFT = ("seed", "batch_size", "seq_len", "grad_accum", "train_data", "lr", "matrix_lr", "schedule",
        "warmup_steps", "steps", "backend", "policy", "weight_decay", "beta1", "beta2", "eps",
        "grad_clip", "late_bf16_at", "late_bf16_roles", "qk_transform", "qk_blocks", "deterministic") + ROOT_GROUP_KEYS
#: Q-AdamW's group keys the TrainConfig sets that only choose how states are encoded, not their format
QADAMW_GROUP_KEYS = ("v_four_over_six",)
#: the param-group hyper-parameters the TrainConfig sets (lr, matrix_lr, weight_decay, beta1/beta2, eps, QRoot's NS
#: settings and Q-AdamW's encode choices); a resumed or forked run takes them from its config, not from the
#: checkpoint's optimizer state
GROUP_SETTINGS = ("lr", "weight_decay", "betas", "eps") + ROOT_GROUP_KEYS + QADAMW_GROUP_KEYS


def structural_diffs(saved: dict, cfg, keys=STRUCTURAL) -> list:
    """The settings among ``keys`` (default ``STRUCTURAL``) in which a checkpoint's config ``saved`` differs from
    ``cfg``, as lines ``"key: checkpoint X != run Y"``. ``lora_rank`` and ``lora_train_factors`` count only where
    either run has LoRA-SVD on: a run without it has no low-rank factors, so e.g. one ``--lora-rank`` flag given to
    every arm of a study still resumes the BF16 arm. A checkpoint from before ``lora_train_factors`` existed had
    trained factors (None there reads as True)."""
    lora = saved.get("lora") or getattr(cfg, "lora")

    def norm(k, v):
        return (v is not False) if k == "lora_train_factors" else v
    return [f"{k}: checkpoint {saved.get(k)!r} != run {getattr(cfg, k)!r}" for k in keys
            if norm(k, saved.get(k)) != norm(k, getattr(cfg, k)) and (k not in ("lora_rank", "lora_train_factors")
                                                                       or lora)]


def changed_settings(saved: dict, cfg, keys=SOFT) -> list:
    """The settings among ``keys`` (default ``SOFT``) that ``cfg`` changes from a checkpoint's config ``saved``,
    as lines ``"key: X -> Y"`` (for the warning of a resume or a fork that will not match the saved run)."""
    return [f"{k}: {saved.get(k)!r} -> {getattr(cfg, k)!r}" for k in keys if saved.get(k) != getattr(cfg, k)]


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, corrupt, or written by an incompatible run."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def save_checkpoint(out_dir: Path, model, optimizer, schedule, cfg: TrainConfig, step: int, extra: dict) -> Path:
    """Write ``out_dir/checkpoint/{model.safetensors,state.pt}`` atomically (tmp dir + rename)."""
    from safetensors.torch import save_model

    final, tmp = out_dir / "checkpoint", out_dir / "checkpoint.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_model(model, str(tmp / "model.safetensors"))
    state = {
        "format": "fp4compile-train-v1",
        "step": step,
        "config": dataclasses.asdict(cfg),
        "model_sha256": _sha256(tmp / "model.safetensors"),
        "optimizer": optimizer.state_dict(),
        "schedule": schedule.state_dict(),
        "rng_cpu": torch.get_rng_state(),
        "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        **extra,
    }
    torch.save(state, tmp / "state.pt")
    old = out_dir / "checkpoint.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(ckpt_dir: Path, model, optimizer, schedule, cfg: TrainConfig) -> dict:
    """Restore model/optimizer/schedule/RNG from ``ckpt_dir``; return the state dict (step, metadata).

    Raises ``CheckpointError`` for missing files, a hash mismatch (corrupt model file), an unreadable
    state file, or a run whose structural settings (``STRUCTURAL``) differ; warns on ``SOFT`` differences.
    """
    state = read_checkpoint(ckpt_dir)
    saved = state["config"]
    diffs = structural_diffs(saved, cfg)
    if diffs:
        raise CheckpointError(f"checkpoint {ckpt_dir} was written by an incompatible run:\n  " + "\n  ".join(diffs)
                              + "\nuse the same settings, or a new --out-dir to start over")
    soft = changed_settings(saved, cfg)
    if soft:
        warnings.warn("resuming with changed settings (the run will not match an uninterrupted one): "
                      + "; ".join(soft))
    load_model_file(ckpt_dir, model)
    load_optimizer_state(ckpt_dir, state, optimizer)
    restore_schedule_and_rng(schedule, state)
    return state


def read_checkpoint(ckpt_dir: Path) -> dict:
    """The state dict of a single-process checkpoint, after checking that both files exist, that ``state.pt``
    is an fp4compile training state and that ``model.safetensors`` has the sha256 it records
    (``CheckpointError`` otherwise)."""
    mpath, spath = ckpt_dir / "model.safetensors", ckpt_dir / "state.pt"
    for p in (mpath, spath):
        if not p.is_file():
            raise CheckpointError(f"checkpoint {ckpt_dir} is incomplete: {p.name} is missing")
    try:
        state = torch.load(spath, map_location="cpu", weights_only=True)
    except Exception as e:                                              # noqa: BLE001 - re-raised with context
        raise CheckpointError(f"checkpoint state {spath} is corrupt or unreadable: {type(e).__name__}: {e}") from e
    if not isinstance(state, dict) or state.get("format") != "fp4compile-train-v1":
        raise CheckpointError(f"{spath} is not an fp4compile training checkpoint")
    if _sha256(mpath) != state["model_sha256"]:
        raise CheckpointError(f"checkpoint model file {mpath} is corrupt: its sha256 does not match the one "
                              "recorded in state.pt")
    return state


def load_model_file(ckpt_dir: Path, model) -> None:
    """Load ``ckpt_dir/model.safetensors`` into ``model`` (every tensor, no extra: ``CheckpointError`` otherwise)."""
    from safetensors.torch import load_model

    mpath = ckpt_dir / "model.safetensors"
    try:
        missing, unexpected = load_model(model, str(mpath), strict=False)
    except Exception as e:                                              # noqa: BLE001
        raise CheckpointError(f"checkpoint model file {mpath} does not fit the model: {e}") from e
    if missing or unexpected:
        raise CheckpointError(f"checkpoint model file {mpath} does not fit the model: missing {sorted(missing)}, "
                              f"unexpected {sorted(unexpected)}")


def load_optimizer_state(ckpt_dir: Path, state: dict, optimizer) -> None:
    """Load the optimizer state of a checkpoint's ``state`` (``CheckpointError`` if it does not fit)."""
    try:
        optimizer.load_state_dict(state["optimizer"])
    except Exception as e:                                              # noqa: BLE001
        raise CheckpointError(f"optimizer state in {ckpt_dir / 'state.pt'} does not fit the optimizer: {e}") from e


#: settings a fork (``init_from``) must share with the run it starts from: the model and its parameter layout,
#: the optimizer (its state format) and the data order (batches are a function of seed and sample index)
FORK_MATCH = ("model", "tie_embeddings", "tokenizer", "optimizer", "dtype", "seed", "batch_size", "seq_len",
              "grad_accum", "train_data")


def open_fork_source(spec: str, cfg: TrainConfig, train_fingerprint: Optional[str] = None) -> Tuple[Path, dict]:
    """The checkpoint a fork starts from (``spec``: a run directory or its ``checkpoint/``) and its state, checked:
    a single-process checkpoint of a run without LoRA-SVD whose ``FORK_MATCH`` settings equal ``cfg``'s and whose
    training tokens have ``train_fingerprint`` (when both are known; ``CheckpointError`` otherwise). Other
    differences of ``SOFT`` settings than the backend and policy (what a fork changes) give a warning."""
    ckpt = Path(spec)
    if (ckpt / "checkpoint").is_dir():
        ckpt = ckpt / "checkpoint"
    if (ckpt / ".metadata").exists():
        raise CheckpointError(f"{ckpt} is a distributed checkpoint; a fork starts from a single-process run's")
    state = read_checkpoint(ckpt)
    saved = state["config"]
    if saved.get("lora"):
        raise CheckpointError(f"{ckpt} was trained with LoRA-SVD; a fork starts from a run without it (it may add it)")
    diffs = structural_diffs(saved, cfg, FORK_MATCH)
    saved_fp = state.get("train_fingerprint")
    if train_fingerprint and saved_fp and saved_fp != train_fingerprint:
        diffs.append(f"training tokens: fingerprint {saved_fp} != {train_fingerprint}")
    if diffs:
        raise CheckpointError(f"cannot fork from {ckpt}: it was written by a run with other settings:\n  "
                              + "\n  ".join(diffs))
    soft = changed_settings(saved, cfg, [k for k in SOFT if k not in FORK_MATCH + ("backend", "policy")])
    if soft:
        warnings.warn(f"forking from {ckpt} with changed settings: " + "; ".join(soft))
    return ckpt, state


def fork_state(fork: Tuple[Path, dict], optimizer, schedule, dense_optimizer=None, lora_handle=None) -> int:
    """Continue the run :func:`open_fork_source` opened (its weights are already in the model): the optimizer
    state (loaded as saved, or, when this run adds LoRA-SVD, taken over from ``dense_optimizer`` holding the
    source's state for the dense parameters, the factors' derived by ``lora_handle.init_state_from_dense``), the
    LR schedule, the RNG and the step, with this run's hyper-parameters. The LoRA-SVD step counter starts at the
    fork's step, so ``realign_every`` / ``realign_after`` keep counting the run's optimizer steps. Returns the step."""
    ckpt, state = fork
    settings = config_group_settings(optimizer)
    if dense_optimizer is None:
        load_optimizer_state(ckpt, state, optimizer)
    else:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if dense_optimizer.state.get(p):
                    optimizer.state[p] = dense_optimizer.state[p]
        lora_handle.init_state_from_dense(optimizer, dense_optimizer.state)
    restore_schedule_and_rng(schedule, state)
    reapply_group_settings(optimizer, schedule, settings)
    if lora_handle is not None:
        lora_handle.load_state_dict({"steps": state["step"], "realignments": 0})
    return int(state["step"])


def config_group_settings(optimizer) -> List[Dict[str, Any]]:
    """Each param group's ``GROUP_SETTINGS`` as the optimizer was built from the config (an LR as a float)."""
    return [{k: (float(g[k]) if k == "lr" and torch.is_tensor(g[k]) else g[k]) for k in GROUP_SETTINGS if k in g}
            for g in optimizer.param_groups]


def reapply_group_settings(optimizer, schedule, settings: List[Dict[str, Any]]) -> None:
    """After a checkpoint's optimizer state is loaded: put back the config's hyper-parameters (``settings`` from
    :func:`config_group_settings` taken before loading) and the schedule's base LRs. ``load_state_dict`` keeps
    the *saved* groups' values, so without this a resumed run would warn about a changed ``--lr`` or
    ``--weight-decay`` (``SOFT``) and silently keep the old one. Unchanged settings give the same values back,
    so an uninterrupted resume stays bit-exact."""
    if len(settings) != len(optimizer.param_groups):
        raise CheckpointError(f"the checkpoint's optimizer has {len(optimizer.param_groups)} param groups, this run's "
                              f"{len(settings)}")
    for g, fresh in zip(optimizer.param_groups, settings):
        g.update({k: v for k, v in fresh.items() if k != "lr"})     # the LR: set by the schedule every step
    schedule.base_lrs = [fresh["lr"] for fresh in settings]


def restore_schedule_and_rng(schedule, state: dict) -> None:
    """Load the LR schedule and the CPU/CUDA RNG states of a checkpoint's ``state`` (both checkpoint formats)."""
    schedule.load_state_dict(state["schedule"])
    torch.set_rng_state(state["rng_cpu"])
    if state["rng_cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng_cuda"])


# ----------------------------------------------------------------------------------------------------------
# logging


class MetricsLog:
    """Append-only JSONL log (rank 0 only). On resume, lines past the checkpoint's step are dropped."""

    def __init__(self, path: Path, enabled: bool, resume_step: Optional[int]):
        self.path, self.enabled = path, enabled
        if not enabled:
            return
        if resume_step is None:
            path.write_text("")
        elif path.exists():
            kept = [ln for ln in path.read_text().splitlines() if ln.strip()
                    and json.loads(ln).get("step", 0) <= resume_step]
            path.write_text("".join(ln + "\n" for ln in kept))

    def write(self, **rec):
        """Append ``rec`` as one JSON line (nothing when the log is disabled, i.e. off rank 0)."""
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")


def read_metrics(run_dir: os.PathLike) -> List[dict]:
    """All records of a run's ``metrics.jsonl``."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (is {run_dir} a training run directory?)")
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def train_losses(records: List[dict]) -> Dict[int, float]:
    """``{step: train loss}`` of a run's :func:`read_metrics` records (its start and eval event records left out; a
    resumed run's later record of a step replaces its earlier one)."""
    return {int(r["step"]): float(r["loss"]) for r in records if "loss" in r and "step" in r and "event" not in r}


def eval_losses(records: List[dict], keys: Tuple[str, ...] = ("val_loss", "brown_loss")) -> Dict[str, Dict[int, float]]:
    """``{key: {step: loss}}`` of each eval ``key`` in a run's :func:`read_metrics` records (a resumed run's later
    record of a step replaces its earlier one; an empty dict for a key never logged)."""
    return {k: {int(r["step"]): float(r[k]) for r in records if k in r and "step" in r and "event" not in r}
            for k in keys}


@contextlib.contextmanager
def _sigint_flag():
    """While active, the first Ctrl-C sets ``flag["stop"]``; a second one raises KeyboardInterrupt."""
    flag = {"stop": False}
    if threading_main():
        def handler(signum, frame):
            if flag["stop"]:
                raise KeyboardInterrupt
            flag["stop"] = True
            print("\n[fp4compile] Ctrl-C: finishing this step and saving a checkpoint "
                  "(Ctrl-C again to abort)", file=sys.stderr, flush=True)

        old = signal.signal(signal.SIGINT, handler)
        try:
            yield flag
        finally:
            signal.signal(signal.SIGINT, old)
    else:
        yield flag


def threading_main() -> bool:
    """Whether this is the main thread (only it can install the SIGINT handler)."""
    import threading

    return threading.current_thread() is threading.main_thread()


# ----------------------------------------------------------------------------------------------------------
# the loop


def evaluate(model_fn, batches: D.TokenBatches, n_batches: int, batch_size: int, rank: int, world: int,
             device, autocast) -> float:
    """Mean loss over the first ``n_batches`` global batches of a held-out set (in order, no shuffling).

    The compiled training graph is reused (the forward runs with autograd on; nothing is backpropagated),
    so evaluation costs no second compilation; the model has no dropout, so train mode is eval mode. Each
    batch's loss (and with it the autograd graph holding the batch's saved activations) is dropped before
    the next forward starts: keeping it in a variable across iterations doubled the evaluation's peak memory.
    """
    total = torch.zeros((), device=device, dtype=torch.float64)
    n = min(n_batches, max(1, batches.n_windows // (batch_size * world)))
    for i in range(n):
        x, y = batches.batch(i * batch_size * world, batch_size, rank, world, device=device)
        with autocast():
            total += model_fn(x, y).detach().double()
    return float(total / n)


#: seconds a time budget keeps for the final checkpoint while no save of the run has been timed
CKPT_RESERVE_S = 30.0


def checkpoint_reserve(save_s: Optional[float]) -> float:
    """Seconds a time budget keeps for the final checkpoint and the exit: :data:`CKPT_RESERVE_S` until a save of
    this run has been timed (``save_s``: the slowest one, this call's or the summary's of the call it resumes),
    then twice that plus 5 s. In session 20's 124M runs this 30 s and the 40 s ``bench/study.py`` kept for start-up
    covered what took 22-24 s in all: every arm ended 45-51 s before its budget, in every call."""
    return CKPT_RESERVE_S if not save_s else 2.0 * save_s + 5.0


def time_budget(max_seconds: Optional[float], deadline: Optional[float], now: float) -> Optional[float]:
    """The loop's budget in seconds from ``now`` (``time.time()`` at its start): ``max_seconds``, or what is left
    until ``deadline``, whichever is smaller; None without either."""
    left = None if deadline is None else deadline - now
    if max_seconds is None:
        return left
    return max_seconds if left is None else min(max_seconds, left)


def out_of_time(elapsed: float, step_times: list[float], max_seconds: float, ahead: int = 3,
                reserve: float = CKPT_RESERVE_S) -> bool:
    """Whether a run ``elapsed`` seconds in, with these per-step times so far, must stop to keep ``max_seconds``.

    It keeps room for ``ahead`` more steps (three; under DDP, where the ranks decide together only every
    ``log_interval`` steps, that many more) and ``reserve`` seconds for the checkpoint (:func:`checkpoint_reserve`).
    The step time is the mean of the steps after the first two, which compile (and, with CUDA graphs, warm up and
    capture): those two only count against the budget through ``elapsed``, or one compile-length step would stop a
    short budget before it trained at all.
    """
    if len(step_times) <= 2:
        return elapsed + reserve > max_seconds
    steady = step_times[2:]           # host times; on CUDA the log-step syncs amortize
    return elapsed + ahead * sum(steady) / len(steady) + reserve > max_seconds


def load_run_data(cfg: TrainConfig):
    """A run's data: ``(tokenizer, train token array, shuffled train TokenBatches, {"val"/"brown": TokenBatches})``
    (the evaluation sets in order, only those the config names)."""
    tok = D.tokenizer_for_sources(cfg.tokenizer, [cfg.train_data, cfg.val_data, cfg.brown_data])
    train_tokens = D.load_tokens(cfg.train_data, tok, cfg.tokenizer, cfg.max_train_tokens)
    train_batches = D.TokenBatches(train_tokens, cfg.seq_len, seed=cfg.seed, name=cfg.train_data)
    evals = {name: D.TokenBatches(D.load_tokens(spec, tok, cfg.tokenizer), cfg.seq_len, shuffle=False, name=spec)
             for name, spec in (("val", cfg.val_data), ("brown", cfg.brown_data)) if spec}
    return tok, train_tokens, train_batches, evals


def build_model(cfg: TrainConfig, tok, device: torch.device, dtype: str):
    """The run's GPT on ``device`` (all-BF16 for ``dtype="bf16"``), LoRA-SVD applied when configured:
    ``(model, lora_handle or None)``."""
    mcfg = config_from_preset(cfg.model, vocab_size=D.padded_vocab(tok.vocab_size), max_seq_len=cfg.seq_len,
                              tie_embeddings=cfg.tie_embeddings)
    model = GPT(mcfg).to(device)
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    return model, (apply_lora(model, cfg) if cfg.lora else None)


def autocast_factory(cfg: TrainConfig, dtype: str, device: torch.device):
    """A zero-argument context factory: BF16 autocast for ``dtype="bf16-autocast"`` (unless FSDP2's BF16
    parameters replace it), else a null context."""
    if dtype == "bf16-autocast" and not cfg.fsdp_bf16_params:
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def train(cfg: TrainConfig) -> RunResult:
    """Run (or resume) one training run as configured; see the module docstring for what it writes. With
    ``cfg.deterministic`` the whole run is inside :func:`fp4compile.determinism.deterministic_mode`."""
    cfg.validate()
    with deterministic_mode(cfg.deterministic):
        return _train(cfg)


def _train(cfg: TrainConfig) -> RunResult:
    denv = None
    if cfg.parallel != "none":                    # torchrun: init the process group (gloo on CPU, nccl on CUDA)
        from . import distributed as DP
        denv = DP.setup(None if cfg.device == "auto" else cfg.device)
    rank, world = dist_info()
    is_main = rank == 0
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt_dir = out_dir / "checkpoint"
    if (ckpt_dir.exists() or (out_dir / "checkpoint.old").exists()) and not cfg.resume:
        raise CheckpointError(f"{out_dir} already holds a checkpoint: pass --resume to continue it, "
                              "or choose another --out-dir")
    device = denv.device if denv is not None else resolve_device(cfg.device)
    cfg = cfg.resolved(device)      # "auto" compile mode and optim_cuda_graphs=None -> what runs
    dtype = resolve_dtype(cfg.dtype, device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)

    # 1. data: tokenizer, the token streams, deterministic batches
    tok, train_tokens, train_batches, evals = load_run_data(cfg)

    # 2. the model (plain PyTorch), optionally reparametrized with LoRA-SVD. A fork (init_from) loads the source
    # run's weights first, and with LoRA-SVD also its optimizer state for the dense weights, before prepare()
    has_ckpt = ckpt_dir.exists() or (out_dir / "checkpoint.old").exists()
    train_fingerprint = D.fingerprint(train_tokens)
    fork = (open_fork_source(cfg.init_from, cfg, train_fingerprint)
            if cfg.init_from and not (cfg.resume and has_ckpt) else None)
    model, lora_handle = build_model(dataclasses.replace(cfg, lora=False) if fork else cfg, tok, device, dtype)
    dense_optimizer = None
    if fork is not None:
        # the model is still at its initialisation (the source run's, same seed): with realign_scale "hold" the
        # branch keeps the step size a split of these weights would have had (LoRASVDHandle.hold_scale_from)
        init = {n: m.weight.detach().clone() for n, m in model.named_modules()
                if isinstance(m, torch.nn.Linear)} if cfg.lora else {}
        load_model_file(fork[0], model)
        if cfg.lora:
            dense_optimizer = build_optimizer(model, cfg, None, device)
            load_optimizer_state(fork[0], fork[1], dense_optimizer)
            lora_handle = apply_lora(model, cfg)
            if lora_handle.realign_scale == "hold":      # prepare()'s setting, its default included
                lora_handle.hold_scale_from(init)
        del init

    # 3. policy, optimizer, LR schedule
    policy = load_policy(cfg.policy) if cfg.backend == "fullstack_fp4" or cfg.optimizer.startswith("qroot") else None
    if policy is not None and lora_handle is not None:
        from ..nn import LORA_BF16_GLOB

        policy = policy.override(LORA_BF16_GLOB, "bf16")   # the low-rank branch is the BF16 part by design
    model_fn = None
    if denv is not None:                          # FSDP2 swaps parameters for DTensors: wrap before the optimizer
        fsdp_kw = {}
        if cfg.parallel == "fsdp2":
            fsdp_kw["reshard_after_forward"] = cfg.fsdp_reshard
            if cfg.fsdp_bf16_params:
                fsdp_kw["mp_policy"] = DP.bf16_params_policy()
        model_fn = DP.wrap_for_training(model, cfg.parallel, cfg.backend, policy,
                                        None if cfg.compile_mode == "default" else cfg.compile_mode,
                                        options=backend_options(cfg), **fsdp_kw)
    optimizer = build_optimizer(model, cfg, policy, device)
    if denv is not None and cfg.parallel == "fsdp2":
        DP.adapt_optimizer(optimizer)             # QAdamW on local shards, QRoot's NS on whole matrices
    if lora_handle is not None:
        lora_handle.attach(optimizer)                 # realign every realign_every steps, remap optimizer state
    schedule = LRSchedule(optimizer, cfg)

    # 4. resume, or fork
    start_step, tokens_per_step = 0, cfg.batch_size * cfg.seq_len * cfg.grad_accum * world
    resume_step = None
    if fork is not None:
        start_step = fork_state(fork, optimizer, schedule, dense_optimizer, lora_handle)
        dense_optimizer = None
        if is_main:
            print(f"[fp4compile] forked {fork[0]} at step {start_step}", file=sys.stderr)
    elif cfg.resume:
        if has_ckpt:
            if not ckpt_dir.exists():                 # crashed between the two renames of save_checkpoint
                (out_dir / "checkpoint.old").rename(ckpt_dir)
            settings = config_group_settings(optimizer)
            if denv is not None or (ckpt_dir / ".metadata").exists():
                from . import distributed as DP
                state = DP.load_train_checkpoint(ckpt_dir, model, optimizer, schedule, cfg)
            else:
                state = load_checkpoint(ckpt_dir, model, optimizer, schedule, cfg)
            reapply_group_settings(optimizer, schedule, settings)
            start_step = resume_step = state["step"]
            if lora_handle is not None:
                load_lora_state(lora_handle, state["lora"])
            if is_main:
                print(f"[fp4compile] resumed {ckpt_dir} at step {start_step}", file=sys.stderr)
        elif is_main:
            print(f"[fp4compile] no checkpoint in {out_dir}: starting from step 0", file=sys.stderr)
    if is_main:
        (out_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1) + "\n")
    log = MetricsLog(out_dir / "metrics.jsonl", is_main, resume_step)
    if resume_step is None:
        log.write(step=start_step, event="start", params=model.num_params(),
                  params_non_embedding=model.num_params(True), tokens_per_step=tokens_per_step, device=str(device),
                  dtype=dtype, backend=cfg.backend, policy=cfg.policy if policy is not None else None,
                  train_tokens=len(train_tokens), train_fingerprint=train_fingerprint,
                  **({"forked_from": str(fork[0])} if fork is not None else {}),
                  **({"lora_betas": sorted({m.beta for m in lora_handle.modules.values()})}
                     if fork is not None and lora_handle is not None else {}))

    # 5. compile (the BF16 arm: inductor; the FP4 arm: fullstack_fp4 with the policy; after a late switch, with
    # the switched roles in BF16: a run resumed at or after the switch step starts with that policy)
    switch = cfg.late_switch_step()
    late = late_policy(policy, cfg.late_bf16_roles) if switch is not None else None

    def compiled(pol):
        fn = compile_model(model, cfg, pol)
        return _marking_steps(fn) if cfg.compile_mode == "reduce-overhead" else fn

    if model_fn is None:
        model_fn = compiled(late if switch is not None and start_step >= switch else policy)
    elif cfg.compile_mode == "reduce-overhead":
        model_fn = _marking_steps(model_fn)

    def note_switch(at):
        log.write(step=at, event="late_bf16", roles=",".join(late_roles(cfg.late_bf16_roles)))
        if is_main:
            print(f"[fp4compile] step {at}: {cfg.late_bf16_roles} in BF16 from here on (late switch)", file=sys.stderr)

    if switch is not None and start_step > switch and resume_step is None:
        note_switch(start_step)     # a fork that starts past the switch: its log says which policy its steps ran with
    autocast = autocast_factory(cfg, dtype, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    # 6. the steps
    bar = None
    if is_main and cfg.progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=cfg.steps, initial=start_step, desc=Path(cfg.out_dir).name, unit="step",
                   dynamic_ncols=True)
    t_start = time.perf_counter()
    budget_s = time_budget(cfg.max_seconds, cfg.deadline, time.time())
    step_times: List[float] = []
    pending: List[tuple] = []                     # (step, loss tensor, lr): synced every log_interval
    recent_losses: List[float] = []
    first_step_s = None
    eval_results: Dict[str, float] = {}
    status = "done"

    def flush_pending():
        if not pending:
            return
        vals = torch.stack([p[1] for p in pending])
        vals = (DP.all_reduce_mean(vals) if denv is not None else vals).tolist()   # mean over ranks
        for (s, _, lr), v in zip(pending, vals):
            log.write(step=s, tokens=s * tokens_per_step, loss=v, lr=lr)
            recent_losses.append(v)
        del recent_losses[:-20]
        pending.clear()

    def run_evals(step):
        for name, batches in evals.items():
            t0 = time.perf_counter()
            v = evaluate(model_fn, batches, cfg.eval_batches, cfg.batch_size, rank, world, device, autocast)
            if denv is not None:
                v = float(DP.all_reduce_mean(v))
            eval_results[name] = v
            log.write(step=step, tokens=step * tokens_per_step, **{f"{name}_loss": v},
                      eval_s=round(time.perf_counter() - t0, 3))

    # the slowest checkpoint save of this run so far (this call's, or the resumed call's from its summary): what a
    # time budget keeps for the final one (checkpoint_reserve)
    save_s = None
    if resume_step is not None and (out_dir / "summary.json").is_file():
        try:
            save_s = float(json.loads((out_dir / "summary.json").read_text()).get("checkpoint_s") or 0) or None
        except (ValueError, TypeError, AttributeError):   # an unreadable summary: keep the default reserve
            save_s = None

    def checkpoint(step):
        nonlocal save_s
        t_save = time.perf_counter()
        extra = {"tokens": step * tokens_per_step, "train_fingerprint": train_fingerprint}
        if lora_handle is not None:
            extra["lora"] = lora_state(lora_handle)
        if denv is not None:                      # collective: every rank writes its shards
            DP.save_train_checkpoint(out_dir, model, optimizer, schedule, cfg, step, extra)
        elif is_main:
            save_checkpoint(out_dir, model, optimizer, schedule, cfg, step, extra)
        save_s = max(save_s or 0.0, time.perf_counter() - t_save)

    step = start_step
    with _sigint_flag() as flag:
        skip_times = 0
        while step < cfg.steps:
            # stop_after is checked before a step, so a run resumed at or past it trains nothing (a rerun with the
            # same stop_after does not go one step past it)
            if cfg.stop_after is not None and step >= cfg.stop_after:
                status = "stopped"            # the same step on every rank
                break
            if switch is not None and step == switch:
                # the late switch: one recompile with the switched policy (Dynamo's backend guard keeps the old
                # graphs apart); its compile and CUDA-graph warm-up steps stay out of the tokens/s, as the first ones
                # do. A run that starts at the switch step (resumed there, or switching at 0) compiled with it already
                if step > start_step:
                    model_fn = compiled(late)
                    skip_times = 2
                note_switch(step)
            t0 = time.perf_counter()
            lr = cfg.lr * schedule.set(step)          # the logged LR is --lr's (QRoot's first group has --matrix-lr)
            loss_sum = torch.zeros((), device=device)
            for micro in range(cfg.grad_accum):
                x, y = train_batches.batch((step * cfg.grad_accum + micro) * cfg.batch_size * world,
                                           cfg.batch_size, rank, world, device=device)
                with autocast():
                    loss = model_fn(x, y)
                (loss / cfg.grad_accum).backward()
                loss_sum += loss.detach().float()
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            realigned = lora_handle.realignments if lora_handle is not None else 0
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if lora_handle is not None and lora_handle.realignments != realigned:
                # the realignment ran in the optimizer's post-hook: its function check goes into the metrics
                rel = list(lora_handle.last_realign.values())
                betas = [m.beta for m in lora_handle.modules.values()] or [0.0]
                log.write(step=step, event="lora_realign", realignments=lora_handle.realignments, layers=len(rel),
                          max_rel_change=max(rel, default=0.0), beta_min=min(betas), beta_max=max(betas))
            pending.append((step, loss_sum / cfg.grad_accum, lr))
            if step % cfg.log_interval == 0 or step == cfg.steps:
                flush_pending()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            dt = time.perf_counter() - t0
            if first_step_s is None:
                first_step_s = dt
            if skip_times:
                skip_times -= 1
            else:
                step_times.append(dt)
            if bar is not None:
                steady = step_times[2:] or step_times
                post = {"tok/s": f"{tokens_per_step * len(steady) / sum(steady):,.0f}"}
                if recent_losses:
                    post["loss"] = f"{recent_losses[-1]:.4f}"
                bar.set_postfix(post, refresh=False)
                bar.update(1)
            if step % cfg.log_interval == 0:
                steady = step_times[2:] or step_times
                log.write(step=step, tok_per_s=tokens_per_step * len(steady) / sum(steady),
                          elapsed_s=round(time.perf_counter() - t_start, 3),
                          peak_mem_mib=round(peak_memory_mib(device), 1))
            if cfg.eval_interval and step % cfg.eval_interval == 0 and step < cfg.steps:
                run_evals(step)
            if cfg.ckpt_interval and step % cfg.ckpt_interval == 0 and step < cfg.steps:
                checkpoint(step)
            # Ctrl-C and the time budget depend on each process's signals and clock: under DDP the ranks decide
            # together, at the log steps (where they synchronize anyway), or one rank would stop and checkpoint
            # while the others train on into a collective that never completes
            if denv is None or step % cfg.log_interval == 0 or step == cfg.steps:
                stop = [flag["stop"], budget_s is not None and step < cfg.steps and out_of_time(
                    time.perf_counter() - t_start, step_times, budget_s,
                    3 if denv is None else 3 + cfg.log_interval, checkpoint_reserve(save_s)),
                    bool(cfg.stop_file) and step < cfg.steps and os.path.exists(cfg.stop_file)]
                if denv is not None:                  # any rank's flag stops every rank: mean over ranks > 0
                    stop = (DP.all_reduce_mean(torch.tensor(stop, dtype=torch.float32)) > 0).tolist()
                if stop[0]:
                    status = "interrupted"
                    break
                if stop[1]:
                    status = "time_budget"
                    break
                if stop[2]:
                    status = "stopped"
                    if is_main:
                        print(f"[fp4compile] {cfg.stop_file} found: saving a checkpoint at step {step} and stopping",
                              file=sys.stderr, flush=True)
                        with contextlib.suppress(FileNotFoundError):
                            os.remove(cfg.stop_file)
                    break
        flush_pending()
        if bar is not None:
            bar.close()
        if status == "done":
            run_evals(step)
        if step != resume_step:                       # resumed and no step trained: its checkpoint is this step's
            checkpoint(step)

    steady = step_times[2:] or step_times
    summary = {
        "status": status,
        "step": step,
        "steps": cfg.steps,
        "tokens": step * tokens_per_step,
        "loss": sum(recent_losses[-10:]) / max(1, len(recent_losses[-10:])) if recent_losses else None,
        **{f"{k}_loss": v for k, v in eval_results.items()},
        "tok_per_s": tokens_per_step * len(steady) / sum(steady) if steady else None,
        "first_step_s": first_step_s,
        "checkpoint_s": save_s,
        "wall_s": time.perf_counter() - t_start,
        "peak_mem_mib": peak_memory_mib(device),
        "params": model.num_params(),
        "backend": cfg.backend,
        "backend_debug": cfg.backend_debug,
        "compile_mode": cfg.compile_mode,
        "policy": cfg.policy if policy is not None else None,
        "optimizer": cfg.optimizer,
        "lora": cfg.lora,
        "device": str(device),
        "dtype": dtype,
        "parallel": cfg.parallel,
        "world_size": world,
    }
    if is_main:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        log.write(step=step, event=status, **{k: v for k, v in summary.items() if k in ("loss", "wall_s")})
    if denv is not None:
        DP.teardown()
    return RunResult(status, step, summary)
