"""Multi-process training on PyTorch's own engines: DDP and FSDP2 (``fully_shard``) with ``fullstack_fp4``.

Everything here is launched by ``torchrun --nproc-per-node N`` (or works unchanged as a single process):

    env = setup()                                            # reads RANK / WORLD_SIZE / LOCAL_RANK
    model = wrap_model(model, "fsdp2", backend="fullstack_fp4", options={...})
    for step in range(steps):
        x, y = local_batch(get_global_batch(step), env)       # this rank's rows of the global batch
        loss = loss_fn(model(x), y); loss.backward(); opt.step(); opt.zero_grad()
        log0(step, reduce_metrics({"loss": loss})["loss"])  # mean over ranks, printed on rank 0
    save_checkpoint("ckpt/step_100", model, opt, step=100)   # torch.distributed.checkpoint, reshardable
    teardown()

Design (details and what was measured: ``docs/DISTRIBUTED.md``):

* **DDP: compile, then wrap** (``DDP(model.compile(backend=...))``). DDP's own forward (bucket rebuild,
  buffer broadcast) stays eager; the compiled frame runs inside DDP's ``_inside_ddp_forward`` context, so
  Dynamo's ``DDPOptimizer`` splits the graph at gradient-bucket boundaries and calls the backend **once per
  bucket subgraph**. Each subgraph gets its own joint forward+backward graph, so forward→backward quant
  reuse and weight re-quantization (``MUST_RECOMPUTE``) happen inside each bucket graph. This is also
  torchtitan's order (compile, then ``replicate``).
* **FSDP2: torchtitan's order**: ``block.compile(backend=...)`` for every transformer block, then
  ``fully_shard(block)`` for every block, then ``fully_shard(model)``. FSDP2's hooks run eagerly around the
  compiled blocks, which see *unsharded* parameters as plain tensors; identical blocks share one
  compilation. Methods the model lists in ``fsdp_compile_regions`` (the GPT's ``head``: final norm, LM head
  and the fp32 cross-entropy) are compiled as regions of their own, like torchtitan's compiled loss;
  without that, the eager cross-entropy over a 50k vocabulary keeps several fp32 copies of the logits
  alive (measured cause of FSDP2's peak memory: ``docs/DISTRIBUTED.md``). The embedding runs eagerly.
* **Data**: every rank reads the same global batch definition and keeps a contiguous ``B / world`` slice, so
  the mean-loss gradient that DDP/FSDP2 average equals the 1-process gradient of the same global batch.
* **Checkpoints**: ``torch.distributed.checkpoint`` with ``get_state_dict`` / ``set_state_dict``; keys are
  the plain model FQNs (no ``module.`` / ``_orig_mod.``), so a checkpoint saved on N ranks loads on M
  (including 1, without a process group).
* **Newton–Schulz under FSDP2**: :func:`distributed_newton_schulz` gives every rank whole matrices through
  one all-to-all (DTensor redistribute ``Shard(1)`` → ``Shard(0)`` of a stack of same-shape matrices), runs
  NS on its share, and sends the row shards back with a second all-to-all.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import gc
import json
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "DistEnv", "setup", "teardown", "current_env", "is_main", "barrier", "log0", "rank0_only",
    "wrap_model", "find_blocks", "localize_policy", "unwrap", "PARALLEL_MODES",
    "batch_slice", "local_batch", "reduce_metrics", "all_reduce_mean",
    "save_checkpoint", "load_checkpoint",
    "distributed_newton_schulz", "distributed_orthogonalize",
    "shard_local", "whole_matrix", "adapt_optimizer",
    "wrap_for_training", "resolve_backend", "bf16_params_policy", "save_train_checkpoint", "load_train_checkpoint",
]

PARALLEL_MODES = ("none", "ddp", "fsdp2")


# --------------------------------------------------------------------------------------------------------
# process group
# --------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DistEnv:
    """Where this process sits: ``rank`` of ``world_size``, its ``device`` and the process-group backend
    (``None`` when running as a plain single process)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: Optional[str] = None

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """Whether a process group is in use (``backend`` is not None)."""
        return self.backend is not None


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        return int(v)
    except ValueError as e:
        raise ValueError(f"environment variable {name}={v!r} is not an integer") from e


def setup(device: Optional[str | torch.device] = None, *, backend: Optional[str] = None,
          timeout_s: float = 1800.0) -> DistEnv:
    """Initialise ``torch.distributed`` from torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``) and pick this rank's device.

    ``device``: "cuda" / "cpu" / None (CUDA if available). On CUDA the device is ``cuda:LOCAL_RANK`` and the
    process-group backend ``nccl``; on CPU it is ``gloo``. ``backend`` overrides that choice. Without
    torchrun's variables (or with ``WORLD_SIZE=1``) nothing is initialised and a single-process
    :class:`DistEnv` is returned, so the same script runs both ways. NCCL environment variables (e.g.
    ``NCCL_NVLS_ENABLE``) are left exactly as the launcher set them.
    """
    rank, world, local = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1), _env_int("LOCAL_RANK", 0)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("setup(device='cuda') but CUDA is not available")
        if dev.index is None:
            dev = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    if dist.is_available() and dist.is_initialized():
        pg_backend = dist.get_backend()
        return DistEnv(dist.get_rank(), dist.get_world_size(), local, dev, pg_backend)
    if world <= 1:
        return DistEnv(0, 1, 0, dev, None)
    if not dist.is_available():
        raise RuntimeError(f"WORLD_SIZE={world} but this torch build has no torch.distributed")
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise RuntimeError(f"WORLD_SIZE={world} but MASTER_ADDR/MASTER_PORT are unset: launch with torchrun")
    if backend is None:
        backend = "nccl" if dev.type == "cuda" else "gloo"
    kw = {}
    if dev.type == "cuda" and backend == "nccl":
        kw["device_id"] = dev          # eager NCCL init bound to this device
    dist.init_process_group(backend=backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s), **kw)
    return DistEnv(rank, world, local, dev, backend)


def teardown() -> None:
    """Destroy the default process group if one exists (idempotent), after a barrier.

    The barrier makes every rank finish its last collective before any rank destroys the group. The
    ``gc.collect()`` afterwards frees objects in reference cycles that still hold the group (FSDP2 modules
    keep it through their device mesh) while the interpreter is still alive. Without it, the group's C++
    worker threads can be torn down during interpreter finalization. This mitigates a one-off abort
    ("terminate called without an active exception", exit -6) of rank 1 after a finished 2-rank gloo FSDP2
    run in CI (session 22). It did not reproduce in 11 local runs, so that cause is not confirmed."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        gc.collect()


def current_env() -> DistEnv:
    """The :class:`DistEnv` of an already initialised process (single-process if none)."""
    if dist.is_available() and dist.is_initialized():
        be = dist.get_backend()
        dev = torch.device("cuda", torch.cuda.current_device()) if be == "nccl" else torch.device("cpu")
        return DistEnv(dist.get_rank(), dist.get_world_size(), _env_int("LOCAL_RANK", 0), dev, be)
    return DistEnv()


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main() -> bool:
    """True on rank 0 (and in a single process)."""
    return _rank_world()[0] == 0


def barrier() -> None:
    """``dist.barrier()`` when distributed, else nothing."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def log0(*args, **kwargs) -> None:
    """``print`` on rank 0 only (flushes)."""
    if is_main():
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


def rank0_only(fn: Callable) -> Callable:
    """Decorator: run ``fn`` on rank 0 only (others get ``None``). For log/plot/CSV writers."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs) if is_main() else None
    return wrapper


# --------------------------------------------------------------------------------------------------------
# model wrapping
# --------------------------------------------------------------------------------------------------------
def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of ``model``: the children of its largest ``nn.ModuleList``
    (``model.transformer.h`` in nanoGPT, ``model.layers`` in torchtitan's Llama). Raises if there is none."""
    best: Optional[nn.ModuleList] = None
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > 0:
            if best is None or len(m) > len(best):
                best = m
    if best is None:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of blocks; pass blocks=[...] to wrap_model")
    return list(best)


def localize_policy(policy, module: nn.Module, prefix: str):
    """The policy that ``module`` compiled *on its own* must get so that every GEMM resolves exactly as in
    the whole model, where the module lives at path ``prefix``.

    Dynamo names modules relative to the compiled module, so a block compiled alone (FSDP2, torchtitan
    order) reports ``attn.qkv`` where the whole model reports ``blocks.3.attn.qkv``; rules such as
    ``"blocks.11.*" -> bf16`` or NVIDIA's last-blocks-in-BF16 would silently stop matching. This returns an
    explicit rule per (relative module path, role), resolved on the full path. Blocks whose resolutions are
    equal get *equal* policies (same name, same rules), so identical blocks still share one compilation.
    ``policy``: a ``fp4compile.Policy`` or a preset name."""
    import glob

    from ..policy import ROLES, Policy, Rule

    if isinstance(policy, str):
        policy = Policy.preset(policy)
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a fp4compile.Policy or a preset name, got {type(policy).__name__}")
    extra = {"user": False} if "user" in {f.name for f in dataclasses.fields(Rule)} else {}
    rules = []
    for rel, _ in module.named_modules():
        full = ".".join(x for x in (prefix, rel) if x)
        for role in ROLES:
            rules.append(Rule(glob.escape(rel), role, policy.resolve(full, role), **extra))
    return dataclasses.replace(policy, rules=tuple(rules), name=f"{policy.name}@block")


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under DDP / ``torch.compile`` wrappers (FSDP2 wraps in place)."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def _compile_inplace(module: nn.Module, backend, options, mode: Optional[str] = None) -> None:
    kw: dict[str, Any] = {"backend": backend}
    if options:
        kw["options"] = dict(options)
    if mode is not None:
        kw["mode"] = mode
    module.compile(**kw)


def _is_fullstack(backend: Any) -> bool:
    """``backend`` is the fullstack_fp4 backend: its name, the function, or a wrapper of it that sets ``__wrapped__``
    (the ``functools.wraps`` convention)."""
    import inspect

    from ..backend import fullstack_fp4

    if isinstance(backend, str):
        return backend == "fullstack_fp4"
    return inspect.unwrap(backend) is fullstack_fp4


def wrap_model(model: nn.Module, parallel: str = "none", *, backend: Any = "fullstack_fp4",
               options: Optional[Mapping[str, Any]] = None, blocks: Optional[Iterable[nn.Module]] = None,
               mesh=None, mp_policy=None, reshard_after_forward: bool = True,
               bucket_cap_mb: Optional[float] = None, compile: bool = True,
               find_unused_parameters: bool = False,
               regions: Optional[Iterable[str]] = None, mode: Optional[str] = None) -> nn.Module:
    """Compile ``model`` with ``backend`` and wrap it for data parallelism.

    parallel:
      * ``"none"``: ``model.compile(backend=...)`` (in place); returns ``model``.
      * ``"ddp"``: compile the whole model in place, then ``DistributedDataParallel(model)``. Dynamo's
        ``DDPOptimizer`` splits the graph per gradient bucket (``bucket_cap_mb``, DDP's default 25) and calls
        the backend once per bucket. Returns the DDP module (``unwrap`` gives ``model`` back).
      * ``"fsdp2"``: torchtitan's order: ``block.compile(backend=...)`` for each block (``blocks`` or
        :func:`find_blocks`), ``fully_shard(block)`` for each block (the last one keeps its parameters
        unsharded after forward, since backward needs them first), then ``fully_shard(model)``. Parameters
        become DTensors sharded on dim 0 over ``mesh`` (default: a 1-D mesh over all ranks).
        ``mp_policy``: an ``torch.distributed.fsdp.MixedPrecisionPolicy`` (e.g. ``param_dtype=bf16,
        reduce_dtype=fp32``). ``regions``: names of ``model``'s methods to compile as separate regions
        (default: ``model.fsdp_compile_regions`` if the model defines it, else none), e.g. a method holding
        the LM head and the loss. With ``reshard_after_forward`` the fullstack_fp4 backend gets
        ``save_weight_copies=False`` unless ``options`` set it (the backward quantizes the re-gathered weights
        instead of keeping every block's FP4 weight copies from the forward). Returns ``model`` (sharded in place).

    ``compile=False`` skips compilation (eager reference runs with identical wrapping). ``options`` are the
    backend's options (e.g. ``{"policy": ...}``; the fullstack_fp4 backend takes its torch.compile mode there,
    ``{"mode": "reduce-overhead"}``). ``mode``: torch.compile's mode for a backend without options (e.g.
    ``"reduce-overhead"`` for Inductor's CUDA graphs); "none" and "ddp" only (FSDP2 re-gathers the parameters
    that CUDA graphs would capture).
    """
    if parallel not in PARALLEL_MODES:
        raise ValueError(f"parallel must be one of {PARALLEL_MODES}, got {parallel!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"wrap_model expects an nn.Module, got {type(model).__name__}")
    rank, world = _rank_world()
    if parallel != "none" and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"parallel={parallel!r} needs an initialised process group: call setup() under torchrun")
    if mode is not None and (options or parallel == "fsdp2"):
        raise ValueError("wrap_model: mode= is for backends without options under 'none'/'ddp'; give the "
                         "fullstack_fp4 backend its mode inside options, and FSDP2 none")
    if parallel == "none":
        if compile:
            _compile_inplace(model, backend, options, mode)
        return model

    if parallel == "ddp":
        if compile:
            _compile_inplace(model, backend, options, mode)
        dev = next(model.parameters()).device
        kw: dict[str, Any] = {"find_unused_parameters": find_unused_parameters}
        if bucket_cap_mb is not None:
            first = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 1 << 20)
            if compile and bucket_cap_mb * (1 << 20) < first:
                raise ValueError(f"bucket_cap_mb={bucket_cap_mb} is below DDP's first-bucket size "
                                 f"({first / (1 << 20):g} MiB): Dynamo's DDPOptimizer rejects it")
            kw["bucket_cap_mb"] = bucket_cap_mb
        if dev.type == "cuda":
            kw["device_ids"] = [dev]
        return nn.parallel.DistributedDataParallel(model, **kw)

    # fsdp2
    from torch.distributed.fsdp import fully_shard

    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        dev_type = next(model.parameters()).device.type
        mesh = init_device_mesh(dev_type, (world,))
    blocks = list(blocks) if blocks is not None else find_blocks(model)
    if _is_fullstack(backend) and reshard_after_forward:
        # resharded parameters are gathered again for the backward: FP4 weight copies saved from the forward would
        # keep every block's weights alive in between (the caller's own setting wins)
        options = {"save_weight_copies": False, **(options or {})}
    if compile:
        names = {id(m): n for n, m in model.named_modules()}
        for b in blocks:
            opts = options
            if options and options.get("policy") is not None:
                # a block compiled alone sees module paths relative to itself ("attn.qkv"): give it the
                # policy as resolved on its full paths ("blocks.3.attn.qkv"), so path rules keep working
                opts = {**options, "policy": localize_policy(options["policy"], b, names.get(id(b), ""))}
            _compile_inplace(b, backend, opts)
        for name in (regions if regions is not None else getattr(model, "fsdp_compile_regions", ())):
            fn = getattr(model, name, None)
            if not callable(fn):
                raise ValueError(f"regions: {type(model).__name__} has no method {name!r} to compile")
            # paths inside a method of the root module are the root's own ("lm_head"): no localization
            kw: dict[str, Any] = {"backend": backend}
            if options:
                kw["options"] = dict(options)
            setattr(model, name, torch.compile(fn, **kw))
    fs_kw: dict[str, Any] = {"mesh": mesh}
    if mp_policy is not None:
        fs_kw["mp_policy"] = mp_policy
    for i, b in enumerate(blocks):
        fully_shard(b, reshard_after_forward=reshard_after_forward and i < len(blocks) - 1, **fs_kw)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **fs_kw)
    return model


# --------------------------------------------------------------------------------------------------------
# data and metrics
# --------------------------------------------------------------------------------------------------------
def batch_slice(global_batch_size: int, rank: Optional[int] = None, world_size: Optional[int] = None) -> slice:
    """Rows ``[rank·B/W, (rank+1)·B/W)`` of a global batch of ``B`` sequences. ``B`` must divide evenly:
    unequal local batches would make DDP/FSDP2's gradient mean differ from the global-batch mean."""
    if rank is None or world_size is None:
        r, w = _rank_world()
        rank = r if rank is None else rank
        world_size = w if world_size is None else world_size
    if global_batch_size <= 0:
        raise ValueError(f"global batch size must be positive, got {global_batch_size}")
    if global_batch_size % world_size:
        raise ValueError(f"global batch size {global_batch_size} is not divisible by world size {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world size {world_size}")
    n = global_batch_size // world_size
    return slice(rank * n, (rank + 1) * n)


def local_batch(batch, env: Optional[DistEnv] = None, *, dim: int = 0):
    """This rank's slice (along ``dim``) of a global batch: a tensor, or a tuple/list/dict of tensors with
    the same batch size. With ``env=None`` the current process group decides."""
    rank, world = (env.rank, env.world_size) if env is not None else _rank_world()
    if isinstance(batch, torch.Tensor):
        return batch.narrow(dim, *_start_len(batch_slice(batch.shape[dim], rank, world)))
    if isinstance(batch, Mapping):
        return type(batch)({k: local_batch(v, env, dim=dim) for k, v in batch.items()})
    if isinstance(batch, (tuple, list)):
        sizes = {t.shape[dim] for t in batch}
        if len(sizes) != 1:
            raise ValueError(f"batch tensors disagree on dim {dim}: sizes {sorted(sizes)}")
        return type(batch)(local_batch(t, env, dim=dim) for t in batch)
    raise TypeError(f"local_batch: unsupported batch type {type(batch).__name__}")


def _start_len(s: slice) -> tuple[int, int]:
    return s.start, s.stop - s.start


def all_reduce_mean(x: torch.Tensor | float) -> torch.Tensor:
    """Mean of ``x`` over ranks (a detached fp32 tensor; ``x`` itself unchanged)."""
    t = torch.as_tensor(x.detach() if isinstance(x, torch.Tensor) else x, dtype=torch.float32)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        t = t.to(_collective_device()).clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t = t / dist.get_world_size()
    return t


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_metrics(metrics: Mapping[str, torch.Tensor | float], op: str = "mean") -> dict[str, float]:
    """Reduce a dict of scalar metrics over ranks with ONE collective; returns python floats on every rank.

    op: "mean" | "sum" | "max" | "min". Use "sum" for counts (tokens), "max" for peak memory."""
    ops = {"mean": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if op not in ops:
        raise ValueError(f"op must be one of {sorted(ops)}, got {op!r}")
    keys = list(metrics)
    if not keys:
        return {}
    vals = []
    for k in keys:
        v = metrics[k]
        v = v.detach().float().reshape(()) if isinstance(v, torch.Tensor) else torch.tensor(float(v))
        vals.append(v.cpu() if not (dist.is_available() and dist.is_initialized()) else v.to(_collective_device()))
    t = torch.stack(vals)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=ops[op])
        if op == "mean":
            t = t / dist.get_world_size()
    return dict(zip(keys, t.tolist()))


# --------------------------------------------------------------------------------------------------------
# distributed checkpoints
# --------------------------------------------------------------------------------------------------------
_META = "fp4compile_meta.json"


def _optimizers(optimizer) -> list:
    if optimizer is None:
        return []
    if isinstance(optimizer, (list, tuple)):
        return list(optimizer)
    if hasattr(optimizer, "optimizers"):          # fp4compile.train.loop.OptimizerList
        return list(optimizer.optimizers)
    return [optimizer]


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer=None, *,
                    step: Optional[int] = None, extra: Optional[Mapping[str, Any]] = None) -> Path:
    """Save model (+ optimizer) state with ``torch.distributed.checkpoint`` into directory ``path``.

    Collective: every rank calls it. State comes from ``get_state_dict`` (plain FQNs; DTensor shards under
    FSDP2; replicated DDP tensors are written once), so the checkpoint can be loaded on any number of ranks
    with :func:`load_checkpoint`. ``step`` and ``extra`` (JSON-able) go to ``fp4compile_meta.json``, written
    by rank 0."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    path = Path(path)
    opts = _optimizers(optimizer)
    msd, osd = get_state_dict(model, opts)
    state = {"model": msd}
    if opts:
        state["optim"] = osd
    dcp.save(state, checkpoint_id=str(path))
    if is_main():
        meta = {"step": step, "extra": dict(extra or {}), "world_size": _rank_world()[1],
                "has_optim": bool(opts)}
        (path / _META).write_text(json.dumps(meta, indent=1))
    barrier()
    return path


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer=None) -> dict:
    """Load a :func:`save_checkpoint` directory into ``model`` (+ ``optimizer``), resharding as needed
    (saved on N ranks, loaded on M; M=1 needs no process group). Collective when distributed.
    Returns the metadata dict (``step``, ``extra``, ``world_size`` of the save)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    if not (path / ".metadata").exists():
        raise FileNotFoundError(f"{path} is not a torch.distributed.checkpoint directory (no .metadata)")
    meta = json.loads((path / _META).read_text()) if (path / _META).exists() else {}
    opts = _optimizers(optimizer)
    if opts and meta.get("has_optim") is False:
        raise ValueError(f"{path} holds no optimizer state, but an optimizer was given")
    if opts:
        from torch.distributed.checkpoint import FileSystemReader

        keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        world = _rank_world()[1]
        ranked = sorted({k.rsplit("of", 1)[-1] for k in keys if "@rank" in k})
        if ranked and ranked != [str(world)]:
            raise ValueError(f"{path} holds per-shard quantized optimizer state (shard_local) written on "
                             f"{'/'.join(ranked)} ranks; it resumes on that many ranks only, not {world}")
    msd, osd = get_state_dict(model, opts)
    state = {"model": msd}
    if opts:
        state["optim"] = osd
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, opts, model_state_dict=state["model"], optim_state_dict=state.get("optim", {}))
    return meta


# --------------------------------------------------------------------------------------------------------
# Newton–Schulz on whole matrices under FSDP2 / DDP
# --------------------------------------------------------------------------------------------------------
def distributed_newton_schulz(mats: Sequence[torch.Tensor], ns_fn: Callable[[torch.Tensor], torch.Tensor], *,
                              strategy: str = "all_to_all") -> list[torch.Tensor]:
    """Apply ``ns_fn`` (whole-matrix orthogonalization, e.g. Newton–Schulz) to each 2-D matrix of ``mats``
    when the matrices are sharded (FSDP2 DTensors) or replicated (DDP) across ranks.

    Returns a list in the same order and *layout* as ``mats``: a DTensor with the input's placements for a
    DTensor input, a plain tensor for a plain one. Results equal ``ns_fn(full_matrix)`` on every rank.

    Strategies (same results, different cost; ``docs/DISTRIBUTED.md`` has the measurements):

    * ``"all_to_all"`` (default): matrices are grouped by (shape, dtype, mesh); a group of n matrices is
      stacked into an ``[n, R, C]`` DTensor. Sharded groups (``Shard(0)`` per matrix = ``Shard(1)`` of the
      stack) are redistributed to ``Shard(0)`` of the stack: one all-to-all after which each rank holds
      ⌈n/W⌉ *whole* matrices, round-robin by position. Each rank runs ``ns_fn`` on its own matrices only,
      and a second all-to-all returns the row shards. Communication ≈ 2× the matrices' size per step (the
      same as one FSDP all-gather + reduce-scatter), compute = 1/W of the NS work per rank, peak extra
      memory ≈ the rank's share of whole matrices. Replicated groups (DDP, plain tensors) skip the first
      exchange (each rank takes its chunk locally) and end with one all-gather — Muon's DDP pattern.
    * ``"gather"``: every rank ``full_tensor()``-gathers every matrix and runs ``ns_fn`` on all of them,
      keeping its own shard. No second exchange, but W× redundant NS compute and whole-model-size
      temporary memory: only for small models / a reference.

    ``ns_fn`` takes and returns one 2-D ``[R, C]`` matrix. Outside a process group (or world size 1) this is
    ``[ns_fn(m) for m in mats]``.
    """
    if strategy not in ("all_to_all", "gather"):
        raise ValueError(f"strategy must be 'all_to_all' or 'gather', got {strategy!r}")
    from torch.distributed.tensor import DTensor

    for i, m in enumerate(mats):
        if m.ndim != 2:
            raise ValueError(f"distributed_newton_schulz: matrix {i} has shape {tuple(m.shape)}, expected 2-D")
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    out: list[Optional[torch.Tensor]] = [None] * len(mats)
    if not distributed:
        for i, m in enumerate(mats):
            out[i] = _ns_plain(m.full_tensor() if isinstance(m, DTensor) else m, ns_fn)
            if isinstance(m, DTensor):
                out[i] = _like_dtensor(out[i], m)
        return out

    if strategy == "gather":
        for i, m in enumerate(mats):
            if isinstance(m, DTensor):
                out[i] = _like_dtensor(_ns_plain(m.full_tensor(), ns_fn), m)
            else:
                out[i] = _ns_plain(m, ns_fn)
        return out

    groups: dict[tuple, list[int]] = {}
    for i, m in enumerate(mats):
        if isinstance(m, DTensor):
            key = ("dt", tuple(m.shape), m.dtype, id(m.device_mesh), tuple(m.placements))
        else:
            key = ("plain", tuple(m.shape), m.dtype, m.device)
        groups.setdefault(key, []).append(i)
    for key, idx in groups.items():
        members = [mats[i] for i in idx]
        results = _ns_group_dtensor(members, ns_fn) if key[0] == "dt" else _ns_group_replicated(members, ns_fn)
        for i, r in zip(idx, results):
            out[i] = r
    return out


def distributed_orthogonalize(U: torch.Tensor, batched_fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``batched_fn`` (whole-matrix orthogonalization of a ``[B, m, n]`` stack, e.g. ``QRoot.orthogonalize``)
    applied to a stack ``U`` whose matrices are FSDP2-sharded.

    ``U`` is what ``torch.stack`` of B same-shape FSDP2 momenta gives: a DTensor placed ``Shard(1)`` (each
    matrix row-sharded) on a 1-D mesh, or ``Replicate()``; a plain tensor is passed straight to
    ``batched_fn``. One all-to-all (``Shard(1)`` → ``Shard(0)``) hands each rank ⌈B/W⌉ whole matrices,
    ``batched_fn`` runs once on that local stack, and a second all-to-all restores ``Shard(1)``. The result
    is a DTensor with ``U``'s placements, equal to ``batched_fn`` of the full stack whenever ``batched_fn``
    treats the matrices of a stack independently."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(U, DTensor):
        return batched_fn(U)
    if U.ndim != 3:
        raise ValueError(f"distributed_orthogonalize expects a [B, m, n] stack, got shape {tuple(U.shape)}")
    mesh, placements = U.device_mesh, tuple(U.placements)
    if mesh.ndim != 1 or placements not in ((Shard(1),), (Replicate(),), (Shard(0),)):
        warnings.warn(f"distributed_orthogonalize: placements {placements} on a {mesh.ndim}-D mesh; "
                      "gathering the full stack on every rank", stacklevel=2)
        return distribute_like(batched_fn(U.full_tensor()), U)
    whole = U.redistribute(mesh, [Shard(0)])                   # all-to-all (Replicate: local chunk, no comm)
    mine = whole.to_local()
    done = batched_fn(mine) if mine.shape[0] else mine.clone()
    if tuple(done.shape) != tuple(mine.shape):
        raise ValueError(f"batched_fn returned shape {tuple(done.shape)} for input {tuple(mine.shape)}")
    out = DTensor.from_local(done.to(U.dtype), mesh, [Shard(0)], run_check=False, shape=U.shape,
                             stride=U.stride())
    return out.redistribute(mesh, list(placements))


def distribute_like(full: torch.Tensor, ref) -> Any:
    """``full`` (the same on every rank) as a DTensor laid out like ``ref`` (no communication)."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(ref.dtype), ref.device_mesh, ref.placements, src_data_rank=None)


def _ns_plain(m: torch.Tensor, ns_fn) -> torch.Tensor:
    r = ns_fn(m)
    if not isinstance(r, torch.Tensor) or tuple(r.shape) != tuple(m.shape):
        raise ValueError(f"ns_fn must return a tensor of shape {tuple(m.shape)}, got "
                         f"{getattr(r, 'shape', type(r).__name__)}")
    return r


_like_dtensor = distribute_like


def _ns_group_dtensor(members, ns_fn):
    """Same-shape DTensors sharded on dim 0 over a 1-D mesh → all-to-all of whole matrices."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    ref = members[0]
    mesh = ref.device_mesh
    if mesh.ndim != 1 or tuple(ref.placements) not in ((Shard(0),), (Replicate(),)):
        # not the FSDP2 1-D layout: correct but slower
        warnings.warn(f"distributed_newton_schulz: placements {ref.placements} on a {mesh.ndim}-D mesh; "
                      "falling back to full_tensor() gathering", stacklevel=3)
        return [_like_dtensor(_ns_plain(m.full_tensor(), ns_fn), m) for m in members]
    if ref.placements[0] == Replicate():
        res = _ns_group_replicated([m.to_local() for m in members], ns_fn, mesh=mesh)
        return [DTensor.from_local(r, mesh, ref.placements, run_check=False) for r in res]
    n, (R, C) = len(members), tuple(ref.shape)
    local = torch.stack([m.to_local() for m in members], dim=0)            # [n, r_local, C]
    stacked = DTensor.from_local(local, mesh, [Shard(1)], run_check=False, shape=(n, R, C),
                                 stride=(R * C, C, 1))
    whole = stacked.redistribute(mesh, [Shard(0)])                          # all-to-all: whole matrices
    mine = whole.to_local()                                                 # [≈n/W, R, C]
    done = torch.stack([_ns_plain(x, ns_fn) for x in mine], dim=0) if mine.shape[0] else mine.clone()
    back = DTensor.from_local(done.to(local.dtype), mesh, [Shard(0)], run_check=False, shape=(n, R, C),
                              stride=(R * C, C, 1)).redistribute(mesh, [Shard(1)])   # all-to-all back
    back_local = back.to_local()
    return [DTensor.from_local(back_local[j].contiguous(), mesh, ref.placements, run_check=False,
                               shape=ref.shape, stride=ref.stride()) for j in range(n)]


def _ns_group_replicated(members, ns_fn, mesh=None):
    """Same-shape replicated matrices: rank r orthogonalizes chunk r of the stack, then one all-gather."""
    rank, world = _rank_world()
    n = len(members)
    per = -(-n // world)
    lo, hi = min(rank * per, n), min((rank + 1) * per, n)
    mine = [_ns_plain(members[j], ns_fn) for j in range(lo, hi)]
    ref = members[0]
    buf = torch.zeros((per,) + tuple(ref.shape), dtype=ref.dtype, device=ref.device)
    if mine:
        buf[: len(mine)] = torch.stack(mine).to(ref.dtype)
    gathered = torch.empty((world * per,) + tuple(ref.shape), dtype=ref.dtype, device=ref.device)
    group = mesh.get_group() if mesh is not None else None
    dist.all_gather_into_tensor(gathered, buf, group=group)
    return [gathered[j].clone() for j in range(n)]


# --------------------------------------------------------------------------------------------------------
# quantized optimizers under FSDP2
# --------------------------------------------------------------------------------------------------------
_RANK_KEY = "@rank{rank}of{world}"


class _LocalShards:
    """Mixin: run the wrapped optimizer's per-parameter update on the *local shard* of the FSDP2 DTensor
    parameters that ``_fp4_is_local`` selects, and keep their non-elementwise state checkpointable."""

    _fp4_shard_local = True

    def _fp4_is_local(self, p, group) -> bool:
        from torch.distributed.tensor import DTensor

        return isinstance(p, DTensor)

    def _install_hooks(self):
        if not getattr(self, "_fp4_hooks", False):
            self.register_state_dict_post_hook(_LocalShards._expose_state)
            self._fp4_hooks = True

    def _fp4_key_params(self, sd) -> dict:
        """State-dict key -> (param, selected?) through the param_groups' id lists (ints from
        ``state_dict()``, FQNs from torch.distributed.checkpoint's ``set_state_dict``)."""
        out = {}
        for sg, g in zip(sd["param_groups"], self.param_groups):
            for key, p in zip(sg["params"], g["params"]):
                out[key] = (p, self._fp4_is_local(p, g))
        return out

    @contextlib.contextmanager
    def _local_params(self, with_grads: bool):
        """Swap the selected DTensor parameters (and their state keys) for their local shards, and back."""
        swapped = []
        for group in self.param_groups:
            for i, p in enumerate(group["params"]):
                if not self._fp4_is_local(p, group):
                    continue
                lp = p.to_local()
                if with_grads:
                    lp.grad = p.grad.to_local() if p.grad is not None else None
                group["params"][i] = lp
                if p in self.state:
                    self.state[lp] = self.state.pop(p)
                swapped.append((group, i, p, lp))
        try:
            yield
        finally:
            for group, i, p, lp in swapped:
                group["params"][i] = p
                if lp in self.state:
                    self.state[p] = self.state.pop(lp)
                if with_grads:
                    lp.grad = None

    @torch.no_grad()
    def step(self, closure=None):
        with self._local_params(with_grads=True):
            return super().step(closure)

    def load_state_dict(self, state_dict):
        state_dict = _LocalShards._accept_state(self, state_dict)
        with self._local_params(with_grads=False):
            super().load_state_dict(state_dict)

    @staticmethod
    def _expose_state(opt, sd):
        from torch.distributed.tensor import DTensor

        keyed = opt._fp4_key_params(sd)
        rank, world = _rank_world()
        for idx, st in list(sd["state"].items()):
            p, local = keyed.get(idx, (None, False))
            if not local:
                continue
            local_shape = p.to_local().shape
            new = {}
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and v.ndim > 0 \
                        and v.shape == local_shape:
                    new[k] = DTensor.from_local(v, p.device_mesh, p.placements, run_check=False,
                                                shape=p.shape, stride=p.stride())
                elif isinstance(v, torch.Tensor) and k != "step":
                    new[k + _RANK_KEY.format(rank=rank, world=world)] = v
                else:
                    new[k] = v
            sd["state"][idx] = new
        return sd

    @staticmethod
    def _accept_state(opt, sd):
        from torch.distributed.tensor import DTensor

        rank, world = _rank_world()
        suffix = _RANK_KEY.format(rank=rank, world=world)
        keyed = opt._fp4_key_params(sd)
        sd = {**sd, "state": dict(sd["state"])}
        for idx, st in list(sd["state"].items()):
            if not keyed.get(idx, (None, False))[1]:
                continue
            new = {}
            for k, v in st.items():
                if "@rank" in k:
                    if not k.endswith(suffix):
                        raise ValueError(f"optimizer state {k!r} belongs to another rank/world size than "
                                         f"this process ({suffix[1:]}): per-shard quantized state resumes "
                                         "on the same number of ranks only")
                    k = k[: -len(suffix)]
                new[k] = v.to_local() if isinstance(v, DTensor) else v
            sd["state"][idx] = new
        return sd


def shard_local(optimizer_cls: type) -> type:
    """A subclass of ``optimizer_cls`` (e.g. ``fp4compile.QAdamW``) whose per-parameter update runs on each
    rank's *local shard* of FSDP2 DTensor parameters (plain tensors are untouched).

    Needed for optimizers whose state is not elementwise-shaped like the parameter (QAdamW's NVFP4 state is
    flat codes/scales/means plus per-tensor scalars) and therefore cannot live in DTensors. Semantics: the
    state quantizes each shard on its own (own per-tensor scale, own stochastic-rounding counters), a valid
    NVFP4 state but not bit-identical to one process holding the whole tensor.

    State dict: states shaped like the local shard are exposed as DTensors laid out like the parameter
    (reshardable by torch.distributed.checkpoint, N ranks → M); any other per-shard tensor is exposed under
    a rank-suffixed key (``m_codes@rank0of2``), so a checkpoint with quantized state resumes on the same
    number of ranks only; :func:`load_checkpoint` says so instead of failing obscurely.
    """
    if getattr(optimizer_cls, "_fp4_shard_local", False):
        return optimizer_cls
    if hasattr(optimizer_cls, "orthogonalize"):
        raise TypeError(f"{optimizer_cls.__name__} orthogonalizes whole matrices: local shards would give a "
                        "silently wrong Newton–Schulz; use whole_matrix() for it")

    class ShardLocal(_LocalShards, optimizer_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._install_hooks()

    ShardLocal.__name__ = ShardLocal.__qualname__ = f"ShardLocal{optimizer_cls.__name__}"
    ShardLocal.__doc__ = f"{optimizer_cls.__name__} on FSDP2 local shards (fp4compile.train.distributed.shard_local)."
    return ShardLocal


def adapt_optimizer(optimizer) -> None:
    """Make an already built optimizer (or ``OptimizerList``) FSDP2-ready, in place: fp4compile's
    Newton–Schulz optimizers (those with ``orthogonalize``) become :func:`whole_matrix`, its other optimizers
    (QAdamW) :func:`shard_local`; torch.optim optimizers handle DTensors themselves and are left alone."""
    for o in _optimizers(optimizer):
        cls = type(o)
        if not cls.__module__.startswith("fp4compile."):
            continue
        o.__class__ = whole_matrix(cls) if hasattr(cls, "orthogonalize") else shard_local(cls)
        o._install_hooks()


def whole_matrix(root_cls: type) -> type:
    """A subclass of a QRoot-like optimizer (one with ``orthogonalize(U [B, m, n], group)`` and
    ``_is_root(p, group)``) for FSDP2: its Newton–Schulz runs on whole matrices via
    :func:`distributed_orthogonalize`, while momentum, clipping and the update stay DTensor ops on the shards.
    Its QAdamW part (non-Root parameters, ``adamw="qadamw"``) runs on local shards, as :func:`shard_local`;
    with ``adamw="adamw"`` the whole state is DTensor-shaped and checkpoints reshard N → M."""
    if getattr(root_cls, "_fp4_whole_matrix", False):
        return root_cls

    class WholeMatrix(_LocalShards, root_cls):
        _fp4_whole_matrix = True

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._install_hooks()

        def _fp4_is_local(self, p, group) -> bool:
            # local shards only for the QAdamW part (NVFP4 state); Root and plain-AdamW parts work on
            # DTensors directly, which keeps their checkpoints reshardable
            is_root = getattr(self, "_is_root", None)
            return (_LocalShards._fp4_is_local(self, p, group) and group.get("adamw", "qadamw") == "qadamw"
                    and not (is_root is not None and is_root(p, group)))

        def orthogonalize(self, U, group):
            return distributed_orthogonalize(U, lambda u: root_cls.orthogonalize(self, u, group))

    WholeMatrix.__name__ = WholeMatrix.__qualname__ = f"WholeMatrix{root_cls.__name__}"
    return WholeMatrix


# --------------------------------------------------------------------------------------------------------
# hooks for fp4compile.train.loop (``fp4compile train --parallel ddp|fsdp2``)
# --------------------------------------------------------------------------------------------------------
def resolve_backend(name):
    """A Dynamo backend name as ``torch.compile`` accepts it: "fullstack_fp4" is registered by the package's
    entry point when fp4compile is installed; from a plain checkout (``PYTHONPATH=.``) it is the function."""
    if name != "fullstack_fp4":
        return name
    from torch._dynamo.backends.registry import list_backends

    from ..backend import fullstack_fp4

    return name if name in list_backends(exclude_tags=()) else fullstack_fp4


def bf16_params_policy():
    """FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: BF16 parameter all-gathers and
    compute, FP32 gradient reduction (``fp4compile train --fsdp-bf16-params``, ``bench/distributed.py
    --bf16-params``)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def wrap_for_training(model: nn.Module, parallel: str, backend: str, policy=None,
                      mode: Optional[str] = None, options: Optional[dict] = None, **wrap_kw) -> nn.Module:
    """The training loop's backend names mapped onto :func:`wrap_model`: "none" = no compilation,
    "fullstack_fp4" gets ``options={"policy": policy}`` (plus ``"mode"`` and ``options``, its other backend
    options), anything else is a plain Dynamo backend name (with ``mode=``). ``mode``: None or a torch.compile mode
    such as "reduce-overhead"; ``wrap_kw``: further :func:`wrap_model` arguments (``mp_policy``, ...)."""
    if backend == "none":
        return wrap_model(model, parallel, compile=False, **wrap_kw)
    if backend == "fullstack_fp4":
        options = {**(options or {}), **({"policy": policy} if policy is not None else {})}
        if mode is not None:
            options["mode"] = mode
        return wrap_model(model, parallel, backend=resolve_backend(backend), options=options or None, **wrap_kw)
    return wrap_model(model, parallel, backend=backend, mode=mode, **wrap_kw)


TRAIN_DCP_FORMAT = "fp4compile-train-dcp-v1"


def save_train_checkpoint(out_dir: Path, model, optimizer, schedule, cfg, step: int, extra: dict) -> Path:
    """The training loop's checkpoint for ``--parallel ddp|fsdp2``: model + optimizer through
    torch.distributed.checkpoint (every rank writes its shards), plus ``state.pt`` (rank 0: step, config,
    LR schedule, RNG, ``extra``). Written to ``checkpoint.tmp`` and renamed, as the 1-process checkpoint."""
    import shutil

    out_dir = Path(out_dir)
    final, tmp, old = out_dir / "checkpoint", out_dir / "checkpoint.tmp", out_dir / "checkpoint.old"
    if is_main():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    save_checkpoint(tmp, model, optimizer, step=step)
    if is_main():
        state = {"format": TRAIN_DCP_FORMAT, "step": step, "config": dataclasses.asdict(cfg),
                 "schedule": schedule.state_dict(), "rng_cpu": torch.get_rng_state(),
                 "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
                 "world_size": _rank_world()[1], **extra}
        torch.save(state, tmp / "state.pt")
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def load_train_checkpoint(ckpt_dir: Path, model, optimizer, schedule, cfg) -> dict:
    """Resume a :func:`save_train_checkpoint` directory on any number of ranks (including a plain
    process), with the same structural checks as the 1-process checkpoint. A 1-process (safetensors)
    checkpoint is delegated to ``fp4compile.train.loop.load_checkpoint`` when parameters are not sharded."""
    from .loop import SOFT, CheckpointError, changed_settings, structural_diffs
    from .loop import load_checkpoint as load_single

    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / ".metadata").exists():
        if (ckpt_dir / "model.safetensors").exists():
            if getattr(cfg, "parallel", "none") == "fsdp2":
                raise CheckpointError(f"{ckpt_dir} is a 1-process checkpoint; resume it with --parallel none or "
                                      "ddp (FSDP2 checkpoints are written with torch.distributed.checkpoint)")
            return load_single(ckpt_dir, model, optimizer, schedule, cfg)
        raise CheckpointError(f"checkpoint {ckpt_dir} is incomplete: no .metadata / model.safetensors")
    try:
        state = torch.load(ckpt_dir / "state.pt", map_location="cpu", weights_only=True)
    except Exception as e:                                              # noqa: BLE001 - re-raised with context
        raise CheckpointError(f"checkpoint state {ckpt_dir / 'state.pt'} is missing or unreadable: {e}") from e
    if not isinstance(state, dict) or state.get("format") != TRAIN_DCP_FORMAT:
        raise CheckpointError(f"{ckpt_dir} is not an fp4compile distributed training checkpoint")
    saved = state["config"]
    diffs = structural_diffs(saved, cfg)
    if diffs:
        raise CheckpointError(f"checkpoint {ckpt_dir} was written by an incompatible run:\n  " + "\n  ".join(diffs))
    # batch_size is per rank: resuming on another world size with the same *global* batch is no change
    same_global = saved.get("batch_size", 0) * state.get("world_size", 1) == cfg.batch_size * _rank_world()[1]
    soft = changed_settings(saved, cfg, [k for k in SOFT if not (k == "batch_size" and same_global)])
    if soft:
        warnings.warn("resuming with changed settings (the run will not match an uninterrupted one): "
                      + "; ".join(soft))
    try:
        load_checkpoint(ckpt_dir, model, optimizer)
    except Exception as e:                                              # noqa: BLE001
        raise CheckpointError(f"checkpoint {ckpt_dir} does not fit the model/optimizer: {e}") from e
    from .loop import restore_schedule_and_rng

    restore_schedule_and_rng(schedule, state)
    return state
