"""Post-training NVFP4 evaluation: how much does quantizing the forward cost a model trained in BF16?

    python bench/ptq_eval.py RUN_DIR [RUN_DIR ...] [--policies bf16,quartet2,W,A] [--json OUT.jsonl]

Issue 7's question (docs/RESULTS.md, session 7): NVFP4 linears cost +3.4 % train loss under ROOT but +1.1 %
(seed 0) / +0.0 % (seed 1) under AdamW, and the forward's RTN + 4/6 quantization carries most of it. Either
ROOT-trained weights are intrinsically more fragile under the same forward noise (then a BF16-trained ROOT
model loses much more when its forward is quantized after training than an AdamW one), or the loss comes from
training through the noise (then both lose little post hoc).

For each finished run directory (``fp4compile train`` output: ``config.json`` and ``checkpoint/``) the model
is rebuilt from the run's own config, its final weights loaded, and evaluated with the run's evaluation code
(``fp4compile.train.loop.evaluate``, same batches as the run's own evals) under each policy:

- ``bf16``: Inductor, no quantization (must reproduce the run's own final val loss);
- ``quartet2``: NVFP4 forward GEMMs, RTN + 4/6 on both operands (the backward never runs);
- ``W`` / ``A``: only the weight / only the activation operand in NVFP4 (``configs/policy_quartet2_fwd_
  {weight,activation}_only.toml``);
- any other name: a preset or a policy file;
- ``NAME@rN`` (e.g. ``quartet2@r32``): the same after splitting every hidden linear post hoc into a BF16
  top-N SVD branch and an NVFP4 residual (``fp4compile.prepare(rank=N, init="exact")``, no realignment): what
  LoRA-SVD's BF16 principal subspace can remove from the forward's quantization error of *these* weights, with
  no training noise in the comparison. ``bf16@rN`` checks that the split keeps the function.

A LoRA-SVD run (``--lora``) is rebuilt with its low-rank branch; every policy above keeps the branch's factors
in BF16 (``*.lora_[ab]``), so NVFP4 reaches the residual weights and their inputs only.

Three sets of the run's ``eval_batches`` batches each: ``val`` and ``brown`` (as the run's own evals) and
``train-next`` (the batches of the training stream just after the last trained step: in-distribution text; a
run past one epoch has seen it once before). ``bf16`` reproduces the run's own final val loss.
Prints one table per run (loss and gap to ``bf16`` per set) and appends one JSON line per (run, policy) as each
policy finishes.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHORTHAND = {"W": "configs/policy_quartet2_fwd_weight_only.toml",
             "A": "configs/policy_quartet2_fwd_activation_only.toml"}


class _After:
    """The training stream's batches from window ``start`` on (``TokenBatches`` with an offset)."""

    def __init__(self, batches, start: int):
        self.b, self.start = batches, start
        self.n_windows = max(0, batches.n_windows - start)

    def batch(self, i, batch_size, rank, world, device=None):
        return self.b.batch(self.start + i, batch_size, rank, world, device=device)


def load_run(run_dir: Path, device: torch.device):
    """A finished run's ``(cfg, make_model, sets, step, autocast)``: its TrainConfig (compile mode "default"),
    a function returning a fresh model with the final weights loaded, the evaluation sets
    ``{name: (batches, n_batches)}``, the checkpoint's step and the run's autocast context factory."""
    from safetensors.torch import load_model

    from fp4compile.train import loop as L

    saved = json.loads((run_dir / "config.json").read_text())
    keys = {f.name for f in dataclasses.fields(L.TrainConfig)}
    cfg = L.TrainConfig.from_dict({k: v for k, v in saved.items() if k in keys})
    cfg = dataclasses.replace(cfg, compile_mode="default", device=str(device))
    state = torch.load(run_dir / "checkpoint" / "state.pt", map_location="cpu", weights_only=True)
    tok, _, train, evals = L.load_run_data(cfg)
    sets = {"train-next": (_After(train, state["step"] * cfg.batch_size * cfg.grad_accum), cfg.eval_batches),
            **{name: (batches, cfg.eval_batches) for name, batches in evals.items()}}
    dtype = L.resolve_dtype(cfg.dtype, device)

    def make_model():
        model, _ = L.build_model(cfg, tok, device, dtype)    # with a LoRA-SVD run's branch; the checkpoint sets it
        missing, unexpected = load_model(model, str(run_dir / "checkpoint" / "model.safetensors"), strict=False)
        if missing or unexpected:
            raise SystemExit(f"{run_dir}: checkpoint does not fit the model ({missing}, {unexpected})")
        return model

    return cfg, make_model, sets, state["step"], L.autocast_factory(cfg, dtype, device)


def split_rank(name: str):
    """``"quartet2@r32"`` -> ``("quartet2", 32)``; a name without an ``@r<digits>`` suffix -> ``(name, 0)``."""
    base, sep, r = name.rpartition("@r")
    if not sep or not r.isdigit():          # no suffix (a file such as "a@run.toml" keeps its name)
        return name, 0
    if int(r) < 1:
        raise SystemExit(f"policy {name!r}: the rank after @r must be >= 1")
    return base, int(r)


def evaluate_run(run_dir: Path, policies, device: torch.device, on_result=None):
    """``{policy: {set: loss}}`` for the final weights of ``run_dir``; ``on_result(policy, losses, step)`` is
    called as each policy finishes (a time-boxed call keeps the rows it got to)."""
    from fp4compile.train import loop as L

    cfg, make_model, sets, step, autocast = load_run(run_dir, device)
    out = {}
    for name in policies:
        torch._dynamo.reset()
        model = make_model()
        name_, rank = split_rank(name)
        if rank:
            if cfg.lora:
                raise SystemExit(f"{run_dir}: {name}: the run already has a LoRA-SVD branch")
            from fp4compile import prepare

            prepare(model, rank=rank, init="exact", realign_every=None)
        if name_ == "bf16":
            rcfg = dataclasses.replace(cfg, backend="inductor" if device.type == "cuda" else "aot_eager")
            policy = None
        else:
            rcfg = dataclasses.replace(cfg, backend="fullstack_fp4", backend_debug=device.type != "cuda")
            policy = L.load_policy(SHORTHAND.get(name_, name_))
        fn = L.compile_model(model, rcfg, policy)
        t0 = time.perf_counter()
        out[name] = {s: L.evaluate(fn, b, n, cfg.batch_size, 0, 1, device, autocast) for s, (b, n) in sets.items()}
        print(f"[ptq] {run_dir} {name}: {out[name]} ({time.perf_counter() - t0:.0f}s)", file=sys.stderr)
        if on_result is not None:
            on_result(name, out[name], step)
    return out, step


def table(run_dir, res, step) -> str:
    sets = list(next(iter(res.values())))
    base = res.get("bf16")
    lines = [f"{run_dir} (step {step})", "| policy | " + " | ".join(sets) + " | "
             + " | ".join(f"gap {s}" for s in sets) + " |", "|---" * (1 + 2 * len(sets)) + "|"]
    for name, r in res.items():
        gaps = [f"{100 * (r[s] / base[s] - 1):+.2f} %" if base else "—" for s in sets]
        lines.append(f"| {name} | " + " | ".join(f"{r[s]:.4f}" for s in sets) + " | " + " | ".join(gaps) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--policies", default="bf16,quartet2,W,A", help="comma list; bf16 first gives the gaps")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", default=None, help="append one JSON line per (run, policy)")
    args = ap.parse_args(argv)
    from fp4compile.train.loop import resolve_device

    device = resolve_device(args.device)
    def write(run, name, r, step):
        with open(args.json, "a") as f:
            f.write(json.dumps({"run": run, "step": step, "policy": name, **r}) + "\n")

    for run in args.runs:
        res, step = evaluate_run(Path(run), args.policies.split(","), device,
                                 on_result=functools.partial(write, run) if args.json else None)
        print(table(run, res, step))
    return 0


if __name__ == "__main__":
    sys.exit(main())
