"""Paired fork A/B of training options on the CPU (small models, seconds per run): for each seed, one source run to
step AT, then every arm continues that checkpoint to STEPS with its own settings (``fp4compile train``'s
``init_from``), so the arms share the early phase and differ only in what they name. Prints each arm's final val
loss per seed and its paired difference to the first arm (mean ± standard error over the seeds).

It answers "is there a difference at this scale", not "what is it at 30M": a CPU-sized model trains for minutes, and
an option whose effect shows only late in a long run will look free here. The GPU's version of the same protocol is
``bash bench/run_h200.sh fork`` (30M, from step 800 of 1,525).

    python bench/cpu_fork_ab.py --optimizer qadamw --arm base --arm v6:qadamw_v_four_over_six=false
    python bench/cpu_fork_ab.py --optimizer qroot --policy full_stack --arm base \\
        --arm nsold:ns_sym_b=false,ns_shared_x=false

``--deterministic`` makes the runs reproducible (same numbers on a rerun). It is not expected to make a paired
difference less noisy (not measured): training amplifies an arm's own change as it amplifies a change of summation
order.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import step_ab  # noqa: E402
from bench.seed_gaps import mean_se  # noqa: E402
from fp4compile import determinism  # noqa: E402
from fp4compile.train import loop as L  # noqa: E402


def parse_arm(spec: str):
    """``NAME[:key=value,...]`` -> (name, TrainConfig overrides, module switches); values as JSON where they parse
    (true, 3, 0.5), else strings. A key with a dot is a module switch, ``module.path.ATTR`` or
    ``module.path.ATTR[KEY]`` (``bench/step_ab.py``'s syntax), set while the arm trains and restored after."""
    name, _, rest = spec.partition(":")
    over, switches = {}, {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
        if "." in key:
            switches[step_ab.parse_switch(spec, key)] = value
        else:
            over[key] = value
    bad = set(over) - {f.name for f in dataclasses.fields(L.TrainConfig)}
    if bad:
        raise SystemExit(f"--arm {spec!r}: {sorted(bad)} are not TrainConfig fields")
    return name, over, switches


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arm", action="append", required=True, help="NAME[:key=value,...] (the first is the reference)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--at", type=int, default=150, help="the source run's step every arm starts from")
    ap.add_argument("--model", default="cpu")
    ap.add_argument("--optimizer", default="qadamw")
    ap.add_argument("--policy", default="bf16")
    ap.add_argument("--backend", default="none", help="none (eager) or fullstack_fp4 (its eager debug variant)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--out", default=None, help="run directories (default: a temporary directory)")
    ap.add_argument("--deterministic", action="store_true",
                    help="every run under fp4compile.determinism.deterministic_mode, MKL_CBWR set before the first "
                         "matrix product: a rerun gives the same numbers, and two arms with the same settings the "
                         "same bits (without it the CPU's threaded SGEMM makes reruns drift apart)")
    args = ap.parse_args(argv)
    if args.deterministic:
        determinism.set_environment()       # before this process's first MKL call
    arms = [parse_arm(a) for a in args.arm]
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out or tempfile.mkdtemp(prefix="cpu_fork_ab_"))
    base = dict(model=args.model, optimizer=args.optimizer, policy=args.policy, backend=args.backend,
                backend_debug=args.backend != "none", batch_size=args.batch_size, seq_len=args.seq_len,
                steps=args.steps, lr=args.lr, warmup_steps=max(1, args.steps // 20), eval_batches=args.eval_batches,
                progress=False, log_interval=max(1, args.steps // 10), ckpt_interval=0,
                deterministic=args.deterministic)
    val = {name: {} for name, _, _ in arms}
    t0 = time.time()
    for seed in seeds:
        src = out / f"seed{seed}" / "source"
        L.train(L.TrainConfig(**base, seed=seed, out_dir=str(src), stop_after=args.at, val_data=""))
        for name, over, switches in arms:
            with step_ab.applied(switches):
                res = L.train(L.TrainConfig(**{**base, **over}, seed=seed, out_dir=str(out / f"seed{seed}" / name),
                                            init_from=str(src)))
            val[name][seed] = res.summary["val_loss"]
            print(f"[cpu_fork_ab] seed {seed} {name}: val {val[name][seed]:.4f} ({time.time() - t0:.0f} s)",
                  flush=True)
    ref = arms[0][0]
    ref_mean = mean_se(list(val[ref].values()))[0]
    print(f"\n{args.model} GPT, {args.optimizer}, policy {args.policy}, backend {args.backend}; fork at step {args.at} "
          f"of {args.steps} ({args.batch_size}x{args.seq_len} byte tokens per step), seeds {seeds}; {out}\n")
    print("| arm | settings | " + " | ".join(f"val, seed {s}" for s in seeds) + f" | minus {ref}, mean ± s.e. |")
    print("|---|---|" + "---|" * len(seeds) + "---|")
    for (name, _, _), spec in zip(arms, args.arm):
        settings = spec.partition(":")[2]
        diffs = [val[name][s] - val[ref][s] for s in seeds]
        m, se = mean_se(diffs)                                          # se: None for one seed
        cell = "—" if name == ref else f"{m:+.4f}{'' if se is None else f' ± {se:.4f}'} ({100 * m / ref_mean:+.2f} %)"
        print(f"| {name} | {settings or 'defaults'} | " + " | ".join(f"{val[name][s]:.4f}" for s in seeds) + f" | {cell} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
