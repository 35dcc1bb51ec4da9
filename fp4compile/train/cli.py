"""The ``fp4compile`` command line.

    fp4compile demo                       BF16 vs full-stack NVFP4 on a small GPT (stdlib corpus, bytes)
    fp4compile train --config cfg.toml    one training run (every TrainConfig field is also a flag)
    fp4compile plot runs/a runs/b         loss curves overlaid + relative gap to the first run
    fp4compile explain [--model cpu]      the precision-annotated graph table of a model
    fp4compile data tokenize ...          tokenize a corpus into a compact .bin (see fp4compile.train.data)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
import typing
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

# ----------------------------------------------------------------------------------------------------------
# train


def _add_config_flags(ap: argparse.ArgumentParser):
    """One flag per TrainConfig field; defaults are None so that only given flags override the config file."""
    from .loop import TrainConfig

    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        t = hints[f.name]
        args = typing.get_args(t)
        base = next((a for a in args if a is not type(None)), t) if args else t
        helptext = f"(default: {f.default!r})"
        if base is bool:
            ap.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=helptext)
        else:
            ap.add_argument(flag, dest=f.name, type=base, default=None, help=helptext)


def load_config_file(path: str) -> Dict:
    """A TOML (or JSON) config file as a dict."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file not found: {p}")
    if p.suffix == ".json":
        return json.loads(p.read_text())
    import tomllib

    return tomllib.loads(p.read_text())


def config_from_args(args: argparse.Namespace):
    """The TrainConfig of ``fp4compile train``: the ``--config`` file (if any) with every flag given on the
    command line overriding it."""
    from .loop import TrainConfig

    base = load_config_file(args.config) if args.config else {}
    cfg = TrainConfig.from_dict(base)
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
             if getattr(args, f.name, None) is not None}
    return dataclasses.replace(cfg, **given)


def cmd_train(args) -> int:
    """``fp4compile train``: one training run; rank 0 prints a summary line. Exit code 130 if the run was
    interrupted (Ctrl-C), else 0."""
    from .loop import train

    cfg = config_from_args(args)
    result = train(cfg)
    s = result.summary
    if int(os.environ.get("RANK", "0")) == 0:             # under torchrun: rank 0 reports
        print(f"[fp4compile] {result.status} at step {result.step}/{cfg.steps}: "
              + ", ".join(f"{k}={_fmt(s.get(k))}" for k in ("loss", "val_loss", "brown_loss", "tok_per_s",
                                                           "peak_mem_mib") if s.get(k) is not None)
              + f"  ({cfg.out_dir})")
    return 130 if result.status == "interrupted" else 0


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v)


# ----------------------------------------------------------------------------------------------------------
# plot


def _ema(xs: List[float], alpha: float) -> List[float]:
    out, m = [], None
    for x in xs:
        m = x if m is None else alpha * m + (1 - alpha) * x
        out.append(m)
    return out


def gap_curve(base: Dict[float, float], arm: Dict[float, float], alpha: float) -> Tuple[List[float], List[float]]:
    """The relative gap (in %) of ``arm`` to ``base`` (x -> raw train loss each) at their common x: both EMAs
    (factor ``alpha``) start at the first common point, so a run forked from the base, or one that logs from a
    later step, is compared from where both exist rather than against the base's longer EMA history."""
    common = sorted(set(base) & set(arm))
    b, a = _ema([base[t] for t in common], alpha), _ema([arm[t] for t in common], alpha)
    return common, [100 * (y - x) / x for x, y in zip(b, a)]


def plot_runs(run_dirs: Sequence[os.PathLike], out: os.PathLike, smooth: Optional[float] = None,
              labels: Optional[Sequence[str]] = None, title: Optional[str] = None) -> Path:
    """Overlay the train (EMA-smoothed) and eval losses of runs against tokens; the relative gap of each run
    to the first one (:func:`gap_curve`: smoothed train losses from their first common step, in %) goes on a
    second y axis. Writes a PNG.
    ``smooth``: EMA factor (default 0.9, or 0.6 for runs under 200 steps, where 0.9 would lag)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .loop import read_metrics

    if not run_dirs:
        raise ValueError("plot needs at least one run directory")
    labels = list(labels) if labels else [Path(d).name or str(d) for d in run_dirs]
    fig, ax = plt.subplots(figsize=(9, 5.5))
    ax2 = ax.twinx() if len(run_dirs) > 1 else None
    base = None
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (d, label) in enumerate(zip(run_dirs, labels)):
        recs = read_metrics(d)
        steps = [r for r in recs if "loss" in r and "step" in r and "tokens" in r and "event" not in r]
        if not steps:
            raise ValueError(f"{d}: metrics.jsonl has no loss records yet")
        c = colors[i % len(colors)]
        x = [r["tokens"] for r in steps]
        alpha = smooth if smooth is not None else (0.9 if len(steps) >= 200 else 0.6)
        y = _ema([r["loss"] for r in steps], alpha)
        ax.plot(x, [r["loss"] for r in steps], color=c, alpha=0.15, lw=0.8)
        ax.plot(x, y, color=c, lw=1.6, label=f"{label} train")
        for key, marker in (("val_loss", "o"), ("brown_loss", "s")):
            ev = [r for r in recs if key in r]
            if ev:
                ax.plot([r["tokens"] for r in ev], [r[key] for r in ev], marker=marker, ls="--", color=c, ms=4,
                        label=f"{label} {key.split('_')[0]}")
        raw = dict(zip(x, (r["loss"] for r in steps)))
        if base is None:
            base = raw
        elif ax2 is not None:
            common, gap = gap_curve(base, raw, alpha)
            if common:
                ax2.plot(common, gap, color=c, ls=":", lw=1.4, label=f"gap {label} vs {labels[0]} (%)")
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    handles, labs = ax.get_legend_handles_labels()
    if ax2 is not None:
        ax2.set_ylabel(f"relative gap to {labels[0]} (%)")
        ax2.axhline(0, color="grey", lw=0.5)
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labs = handles + h2, labs + l2
    ax.legend(handles, labs, fontsize=8, loc="upper right")
    ax.set_title(title or "training loss")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def cmd_plot(args) -> int:
    """``fp4compile plot``: write the loss plot of ``args.runs`` (default ``<first run>/loss.png``); exit code 0."""
    out = args.out or str(Path(args.runs[0]) / "loss.png")
    path = plot_runs(args.runs, out, smooth=args.smooth, labels=args.labels.split(",") if args.labels else None)
    print(f"wrote {path}")
    return 0


# ----------------------------------------------------------------------------------------------------------
# demo

#: CPU defaults sized for about 3 minutes on 2 cores. The FP4 arm runs the reference (torch) quantize and
#: Q-Attn ops, ~15x slower per token than BF16 on a CPU (measured: ~350 vs ~5,700 tokens/s, one thread), so
#: the budget buys only ~40k tokens: 40 steps of 8 x 128 byte tokens. On CUDA the demo trains far longer.
DEMO_CPU = dict(model="cpu", batch_size=8, seq_len=128, steps=40, lr=3e-3, warmup_steps=4, eval_batches=4,
                log_interval=10)
DEMO_CUDA = dict(model="gpu-demo", batch_size=32, seq_len=512, steps=600, lr=2e-3, warmup_steps=50,
                 eval_batches=20, log_interval=25)
DEMO_QUICK = dict(model="tiny", batch_size=4, seq_len=64, steps=8, lr=3e-3, warmup_steps=2, eval_batches=2,
                  log_interval=4)


def demo_configs(out_dir: Path, quick: bool, device: str, overrides: Dict, bf16_backend: Optional[str],
                 fp4_backend: str, policy: str, fp4_debug: Optional[bool] = None):
    """The two arms' TrainConfigs: identical except for the backend (and the policy it gets).

    On CUDA both arms use Inductor (the FP4 arm through ``fullstack_fp4``). On a CPU, Inductor's C++
    compilation would take most of the demo's 3-minute budget while buying nothing for a 1M-parameter
    model, so by default the BF16 arm runs ``aot_eager`` and the FP4 arm the backend's debug variant
    (the same FP4 graph passes, the partitioned graphs run eagerly)."""
    import torch

    from .loop import TrainConfig

    on_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if bf16_backend is None:
        bf16_backend = "inductor" if on_cuda else "aot_eager"
    if fp4_debug is None:
        fp4_debug = not on_cuda and fp4_backend == "fullstack_fp4"
    base = dict(DEMO_QUICK if quick else DEMO_CUDA if on_cuda else DEMO_CPU)
    base.update(tokenizer="bytes", train_data="stdlib", val_data="stdlib:val", device=device, eval_interval=0,
                ckpt_interval=0, seed=0, optimizer="adamw")
    base.update({k: v for k, v in overrides.items() if v is not None})
    return {
        "bf16": TrainConfig(**base, out_dir=str(out_dir / "bf16"), backend=bf16_backend, policy="bf16"),
        "nvfp4": TrainConfig(**base, out_dir=str(out_dir / "nvfp4"), backend=fp4_backend, policy=policy,
                             backend_debug=fp4_debug),
    }


def _run_arm_subprocess(cfg) -> Dict:
    """Run one arm in a fresh interpreter (clean peak-memory numbers, no state shared between the arms)."""
    cfg_path = Path(cfg.out_dir + ".json")
    cfg_path.parent.mkdir(parents=True, exist_ok=True)
    cfg_path.write_text(json.dumps(dataclasses.asdict(cfg)))
    cmd = [sys.executable, "-m", "fp4compile", "train", "--config", str(cfg_path)]
    import fp4compile

    env = dict(os.environ)
    root = str(Path(fp4compile.__file__).resolve().parents[1])          # the same fp4compile in the child
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # OpenMP threads that sleep instead of spinning: ~8x faster 2-thread steps on a busy shared CPU
    # (measured 2,184 vs 261 tokens/s for the BF16 arm at load 4.7 on 2 cores), ~no cost on an idle one.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    rc = subprocess.run(cmd, env=env).returncode
    cfg_path.unlink(missing_ok=True)
    if rc != 0:
        raise RuntimeError(f"demo arm {cfg.out_dir} failed (exit code {rc}): {' '.join(cmd)}")
    return json.loads((Path(cfg.out_dir) / "summary.json").read_text())


def demo_table(summaries: Dict[str, Dict]) -> str:
    """Side-by-side table; the relative gap is (arm − bf16) / bf16 of the final train and val losses."""
    b = summaries["bf16"]
    rows = [("", "loss", "val loss", "gap (loss)", "gap (val)", "tokens/s", "1st step s", "peak MiB", "backend")]
    for name, s in summaries.items():
        gap = lambda k: "—" if name == "bf16" or s.get(k) is None else f"{100 * (s[k] - b[k]) / b[k]:+.2f}%"  # noqa
        rows.append((name, f"{s['loss']:.4f}", f"{s.get('val_loss', float('nan')):.4f}", gap("loss"),
                     gap("val_loss"), f"{s['tok_per_s']:,.0f}", f"{s['first_step_s']:.1f}",
                     f"{s['peak_mem_mib']:,.0f}", s["backend"] + (" (debug)" if s.get("backend_debug") else "")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def cmd_demo(args) -> int:
    """``fp4compile demo``: train the BF16 and NVFP4 arms (each in a fresh interpreter unless ``--in-process``),
    then print the comparison table and write it and the loss plot under ``--out-dir``; exit code 0."""
    import torch

    out_dir = Path(args.out_dir)
    overrides = {k: getattr(args, k) for k in ("model", "steps", "batch_size", "seq_len", "lr", "threads")}
    cfgs = demo_configs(out_dir, args.quick, args.device, overrides, args.bf16_backend, args.fp4_backend,
                        args.policy, args.fp4_debug)
    for c in cfgs.values():
        shutil.rmtree(c.out_dir, ignore_errors=True)
        c.progress = not args.no_progress
    first, fp4 = cfgs["bf16"], cfgs["nvfp4"]
    print(f"[fp4compile demo] {first.model} GPT, {first.steps} steps of {first.batch_size}x{first.seq_len} byte "
          f"tokens from the Python {sys.version_info.major}.{sys.version_info.minor} standard library; "
          f"arms: bf16 ({first.backend}) vs nvfp4 ({fp4.backend}{' debug variant' if fp4.backend_debug else ''}, "
          f"policy {fp4.policy})", flush=True)
    t0 = time.perf_counter()
    summaries = {}
    for name, cfg in cfgs.items():
        if args.in_process:
            from .loop import train

            summaries[name] = train(cfg).summary
        else:
            summaries[name] = _run_arm_subprocess(cfg)
    total = time.perf_counter() - t0
    png = plot_runs([c.out_dir for c in cfgs.values()], out_dir / "loss.png", labels=list(cfgs),
                    title=f"fp4compile demo: BF16 vs full-stack NVFP4 ({first.model} GPT, bytes)")
    table = demo_table(summaries)
    (out_dir / "table.txt").write_text(table + "\n")
    print()
    print(table)
    print(f"\nloss = mean train loss of the last 10 steps; val = held-out stdlib modules; gap = (nvfp4 - bf16)/bf16; "
          f"tokens/s excludes the first two steps (compilation). device: {summaries['bf16']['device']}, "
          f"torch {torch.__version__}; total {total:.0f}s")
    print(f"plot: {png}")
    return 0


# ----------------------------------------------------------------------------------------------------------
# explain


def build_explain_target(model_spec: str, batch: int, seq: int, vocab: int):
    """(model, example inputs) for ``explain``: a built-in preset, or ``module:factory`` returning a model
    or a ``(model, example_inputs_tuple)`` pair."""
    import importlib

    import torch

    from .model import GPT, PRESETS, config_from_preset

    if model_spec in PRESETS:
        model = GPT(config_from_preset(model_spec, vocab_size=vocab, max_seq_len=seq))
        x = torch.randint(0, vocab, (batch, seq))
        return model, (x, torch.roll(x, -1, 1))
    if ":" not in model_spec:
        raise ValueError(f"--model must be a preset {sorted(PRESETS)} or module:factory, got {model_spec!r}")
    mod, attr = model_spec.split(":", 1)
    sys.path.insert(0, os.getcwd())
    obj = getattr(importlib.import_module(mod), attr)()
    if isinstance(obj, tuple):
        model, inputs = obj
        return model, tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    if isinstance(obj, GPT):
        x = torch.randint(0, obj.cfg.vocab_size, (batch, seq))
        return obj, (x, torch.roll(x, -1, 1))
    raise TypeError(f"{model_spec} returned a {type(obj).__name__}; return a GPT or (model, example_inputs)")


def cmd_explain(args) -> int:
    """``fp4compile explain``: print the :func:`fp4compile.explain` table of a preset or ``module:factory``
    model under ``--policy``; exit code 0."""
    from .loop import _feature, load_policy

    explain = _feature("explain", "the backend issue (branch backend)")
    model, inputs = build_explain_target(args.model, args.batch, args.seq, args.vocab)
    report = explain(model, *inputs, policy=load_policy(args.policy))
    print(report)
    return 0


# ----------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``fp4compile`` argument parser: subcommands demo, train, plot, explain and data, each setting ``fn``
    (its handler: parsed args -> exit code)."""
    ap = argparse.ArgumentParser(prog="fp4compile", description="Pretrain GPTs with full-stack NVFP4 "
                                 "(torch.compile backend 'fullstack_fp4').")
    sub = ap.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="train a small GPT in BF16 and in full-stack NVFP4; print a table, plot")
    d.add_argument("--out-dir", default="fp4compile_demo")
    d.add_argument("--quick", action="store_true", help="a tiny model for a few steps (smoke test)")
    d.add_argument("--device", default="auto")
    d.add_argument("--model", default=None, help="size preset (default: cpu on CPU, gpu-demo on CUDA)")
    d.add_argument("--steps", type=int, default=None)
    d.add_argument("--batch-size", type=int, default=None)
    d.add_argument("--seq-len", type=int, default=None)
    d.add_argument("--lr", type=float, default=None)
    d.add_argument("--threads", type=int, default=None, help="CPU threads per arm")
    d.add_argument("--policy", default="full_stack", help="policy of the NVFP4 arm (default: full_stack)")
    d.add_argument("--bf16-backend", default=None, help="default: inductor on CUDA, aot_eager on CPU")
    d.add_argument("--fp4-debug", action=argparse.BooleanOptionalAction, default=None,
                   help="run fullstack_fp4's debug variant (default: on CPU yes, on CUDA no)")
    d.add_argument("--fp4-backend", default="fullstack_fp4",
                   help="backend of the NVFP4 arm (another backend only for testing the demo's plumbing)")
    d.add_argument("--in-process", action="store_true", help="run both arms in this process")
    d.add_argument("--no-progress", action="store_true")
    d.set_defaults(fn=cmd_demo)

    t = sub.add_parser("train", help="one training run; flags override the --config file")
    t.add_argument("--config", default=None, help="TOML (or JSON) file of TrainConfig keys")
    _add_config_flags(t)
    t.set_defaults(fn=cmd_train)

    p = sub.add_parser("plot", help="loss curves of runs, relative gap to the first run on a second axis")
    p.add_argument("runs", nargs="+")
    p.add_argument("--out", default=None, help="PNG path (default: <first run>/loss.png)")
    p.add_argument("--labels", default=None, help="comma-separated labels")
    p.add_argument("--smooth", type=float, default=None, help="EMA factor for train losses (default 0.9; 0.6 "
                   "for runs under 200 steps)")
    p.set_defaults(fn=cmd_plot)

    e = sub.add_parser("explain", help="precision-annotated graph of a model under a policy")
    e.add_argument("--model", default="cpu", help="size preset or module:factory")
    e.add_argument("--policy", default="full_stack")
    e.add_argument("--batch", type=int, default=2)
    e.add_argument("--seq", type=int, default=128)
    e.add_argument("--vocab", type=int, default=384, help="vocabulary of a built-in preset")
    e.set_defaults(fn=cmd_explain)

    dd = sub.add_parser("data", help="data tools (tokenize, train-bpe); see python -m fp4compile.train.data -h",
                        add_help=False)
    dd.add_argument("rest", nargs=argparse.REMAINDER)
    dd.set_defaults(fn=lambda a: __import__("fp4compile.train.data", fromlist=["main"]).main(a.rest))
    return ap


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console-script entry point ``fp4compile``."""
    args = build_parser().parse_args(argv)
    from .loop import CheckpointError, FeatureUnavailable

    try:
        return args.fn(args)
    except (CheckpointError, FeatureUnavailable, ValueError, FileNotFoundError) as e:
        if os.environ.get("FP4COMPILE_DEBUG"):
            raise
        print(f"fp4compile: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
