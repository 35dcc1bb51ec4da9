"""Interleaved A/B of the GPT-124M full-stack training step: every arm compiled in one process, then timed in
alternating blocks, so that a machine's drift (clocks, temperature, neighbours) falls on every arm alike.

    python bench/step_ab.py --arm base --arm nosc:fp4compile.kernels.gemm.SCALE_CAST=0
    python bench/step_ab.py --arm base --arm 'e128:fp4compile.kernels.quantize.CONFIG[e_maxnreg]=128' --rounds 12
    python bench/step_ab.py --arm fp4 --arm bf16:backend=inductor           # the step against BF16, interleaved
    python bench/step_ab.py --tiny --arm base --arm x:options.save_weight_copies=false     # CPU smoke run
    python bench/step_ab.py --arm fp4 --arm q2:options.policy=quartet2 --arm bf16:backend=inductor  # + linear-only

An arm is ``NAME[:SETTING,SETTING...]``; a setting is ``module.path.ATTR=JSON`` or ``module.path.ATTR[KEY]=JSON``
(a module switch or an entry of a module's dict such as ``fp4compile.kernels.quantize.CONFIG``, set while the arm
compiles, captures its CUDA graphs and runs, and restored after), ``options.KEY=JSON`` (a backend option of the
arm's ``torch.compile``) or ``backend=inductor`` (the BF16 baseline: plain Inductor in the same mode). The first arm
is the baseline. Each arm gets its own model (same seed, same data), its own ``torch.compile`` through a backend
function of its own (so its own Dynamo cache entry and, under ``reduce-overhead``, its own CUDA graphs; the run stops
if an arm compiles no graph) and its own fused AdamW. After every arm's first step and ``--warmup`` steps,
``--rounds`` rounds each time ``--block`` steps of every arm, the order reversed every other round (ABBA); a block's
time is its CUDA events' (or the host clock's) elapsed time over its steps.

Prints per arm: the median ms per step over the rounds, and against the baseline the median of the per-round paired
difference (arm minus baseline in the same round) with a bootstrap 95 % interval (:func:`median_ci`), its range,
and the ratio of medians; ``--json`` appends the
rows. Switches read when the graph is rewritten must be part of the joint pass's cache key (they are:
``FP4JointPass.uuid``), or two arms would share one compiled graph.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.train_step import GPT, policy_for  # noqa: E402


def parse_arm(spec: str):
    """``NAME[:SETTING,...]`` -> (name, {(module, attr, dict key or None): value}, {option: value})."""
    name, _, rest = spec.partition(":")
    switches, options = {}, {}
    for item in filter(None, rest.split(",")):
        key, eq, val = item.partition("=")
        if key == "backend" and val == "inductor":       # the BF16 baseline: Inductor alone, same mode
            options["backend"] = "inductor"
            continue
        if not eq or "." not in key:
            raise SystemExit(f"--arm {spec!r}: a setting is module.path.ATTR=JSON, module.path.ATTR[KEY]=JSON, "
                             f"options.KEY=JSON or backend=inductor, got {item!r}")
        try:
            value = json.loads(val)
        except json.JSONDecodeError:
            value = val                                   # a bare string
        if key.startswith("options."):
            options[key[len("options."):]] = value
            continue
        switches[parse_switch(spec, key)] = value
    return name, switches, options


def parse_switch(spec: str, key: str):
    """``module.path.ATTR`` or ``module.path.ATTR[KEY]`` (an entry of a module's dict, e.g. quantize.CONFIG) ->
    (module, attr, KEY or None), checked to exist; ``spec`` names the ``--arm`` in errors."""
    item = None
    if key.endswith("]") and "[" in key:
        key, _, item = key[:-1].partition("[")
    mod, _, attr = key.rpartition(".")
    module = importlib.import_module(mod)
    if not hasattr(module, attr):
        raise SystemExit(f"--arm {spec!r}: {mod} has no attribute {attr!r}")
    if item is not None and item not in getattr(module, attr):
        raise SystemExit(f"--arm {spec!r}: {mod}.{attr} has no entry {item!r}")
    return module, attr, item


def _get(module, attr, item):
    return getattr(module, attr) if item is None else getattr(module, attr)[item]


def _set(module, attr, item, value):
    if item is None:
        setattr(module, attr, value)
    else:
        getattr(module, attr)[item] = value


@contextlib.contextmanager
def applied(switches):
    """The arm's module switches set for the duration, the previous values restored after."""
    old = {k: _get(*k) for k in switches}
    try:
        for k, v in switches.items():
            _set(*k, v)
        yield
    finally:
        for k, v in old.items():
            _set(*k, v)


class Arm:
    """One compiled model with its optimizer and switches."""

    def __init__(self, spec, args, device, data):
        from fp4compile.backend import fullstack_fp4

        self.name, self.switches, options = parse_arm(spec)
        torch.manual_seed(0)
        dims = dict(vocab=256, d=64, n_layer=2, n_head=2, block_size=args.T) if args.tiny else {}
        self.model = GPT(**dims).to(device=device, dtype=torch.bfloat16)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=device == "cuda")
        if options.pop("backend", None) == "inductor":
            if options:
                raise SystemExit(f"--arm {spec!r}: the inductor arm takes no backend options")
            self.fn = torch.compile(self.model, mode=args.mode)
        else:
            opts = {**dict(policy=policy_for(args.policy), mode=args.mode), **options}   # options.policy=PRESET wins

            def backend(gm, example_inputs, **kw):
                # a function of its own per arm: torch.compile's wrapper of a custom backend compares equal for
                # equal options, and Dynamo would then hand every arm the first arm's compiled frame
                return fullstack_fp4(gm, example_inputs, **kw)

            self.fn = torch.compile(self.model, backend=backend, options=opts)
        self.data, self.mode = data, args.mode
        self.times = []
        self.loss = float("nan")

    def step(self, i):
        if self.mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
        d = self.data[i % len(self.data)]
        loss = self.fn(d[:, :-1], d[:, 1:])
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss

    def steps(self, n, start=0):
        loss = None
        with applied(self.switches):
            for i in range(n):
                loss = self.step(start + i)
        return loss


def timed_block(arm, n, device):
    """ms per step of ``n`` steps of ``arm`` (CUDA events on CUDA, the host clock elsewhere)."""
    if device == "cuda":
        torch.cuda.synchronize()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        loss = arm.steps(n)
        t1.record()
        torch.cuda.synchronize()
        ms = t0.elapsed_time(t1)
    else:
        t = time.perf_counter()
        loss = arm.steps(n)
        ms = 1e3 * (time.perf_counter() - t)
    arm.loss = loss.item()
    return ms / n


def median_ci(diffs, level=0.95, resamples=2000, seed=0):
    """A bootstrap (percentile) interval of the median of the per-round paired differences: the arm's effect is
    resolved when it excludes 0. Fixed seed: the same data give the same interval."""
    import numpy as np

    d = np.asarray(diffs, dtype=np.float64)
    if d.size < 2:
        return float(d.mean()), float(d.mean())
    rng = np.random.default_rng(seed)
    meds = np.median(d[rng.integers(0, d.size, size=(resamples, d.size))], axis=1)
    a = (1 - level) / 2
    return float(np.quantile(meds, a)), float(np.quantile(meds, 1 - a))


def parse_arm_name(spec: str) -> str:
    return spec.partition(":")[0]


def profile_arm(arm, top):
    """Print the profiler's kernel table of 2 steps of ``arm`` (``bench/timing.profile_steps``)."""
    from bench.timing import profile_steps

    table = profile_steps(arm.steps, 2, top=top)
    print(f"\n== profile: arm {arm.name}, 2 steps ==")
    print(table, flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arm", action="append", required=True,
                    help="NAME[:SETTING,...], SETTING: module.ATTR=JSON | module.ATTR[KEY]=JSON | options.KEY=JSON | "
                         "backend=inductor (module docstring); the first arm is the baseline")
    ap.add_argument("--policy", default="full_stack", help="full_stack (default) | quartet2 | rtn")
    ap.add_argument("--mode", default=None, help="torch.compile mode (default: reduce-overhead on CUDA, else default)")
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--block", type=int, default=10, help="steps per timed block")
    ap.add_argument("--tiny", action="store_true", help="toy model (CPU smoke run)")
    ap.add_argument("--json", help="append the result rows as one JSON line to this file")
    ap.add_argument("--profile", action="append", default=[], metavar="ARM",
                    help="after the timing, a torch.profiler kernel table of 2 steps of this arm (repeatable)")
    ap.add_argument("--profile-top", type=int, default=40, help="rows of each profile table (default 40)")
    args = ap.parse_args(argv)
    if len(args.arm) < 2:
        raise SystemExit("need at least two --arm (the first is the baseline)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.tiny:
        args.B, args.T = min(args.B, 2), min(args.T, 64)
    args.mode = args.mode or ("reduce-overhead" if device == "cuda" else "default")
    vocab = 256 if args.tiny else 50304
    g = torch.Generator(device="cpu").manual_seed(1)
    data = [torch.randint(0, vocab, (args.B, args.T + 1), generator=g).to(device) for _ in range(4)]

    from torch._dynamo.utils import counters

    unknown = set(args.profile) - {parse_arm_name(a) for a in args.arm}
    if unknown:
        raise SystemExit(f"--profile names no arm: {sorted(unknown)}")
    arms = []
    for spec in args.arm:
        arm = Arm(spec, args, device, data)
        before = counters["stats"]["unique_graphs"]
        t = time.perf_counter()
        arm.first_loss = arm.steps(1).item()
        arm.compile_s = time.perf_counter() - t
        arm.graphs = counters["stats"]["unique_graphs"] - before
        if arm.graphs < 1:
            raise SystemExit(f"arm {arm.name}: Dynamo compiled no graph of its own (it would time another arm's)")
        arm.steps(args.warmup, start=1)
        arms.append(arm)
        print(f"  {arm.name}: first step {arm.compile_s:.1f} s ({arm.graphs} Dynamo graphs), loss "
              f"{arm.first_loss:.4f}", flush=True)
    for r in range(args.rounds):
        for arm in (arms if r % 2 == 0 else arms[::-1]):
            arm.times.append(timed_block(arm, args.block, device))

    base = arms[0]
    dev = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"\nGPT step A/B ({args.policy}, B={args.B} T={args.T}, {args.mode}), {args.rounds} rounds x {args.block} "
          f"steps, ABBA order; {dev}, torch {torch.__version__}")
    print(f"{'arm':<10} {'median ms':>10} {'min':>8} {'max':>8} {'vs base: median diff':>21} {'95% CI':>18} "
          f"{'diff range':>18} {'ratio':>7}  last loss")
    rows = []
    for arm in arms:
        med = statistics.median(arm.times)
        diffs = [a - b for a, b in zip(arm.times, base.times)]
        lo, hi = median_ci(diffs)
        row = dict(arm=arm.name, median_ms=med, min_ms=min(arm.times), max_ms=max(arm.times), times=arm.times,
                   median_diff_ms=statistics.median(diffs), diff_ci95=[lo, hi], diff_min=min(diffs),
                   diff_max=max(diffs), ratio=med / statistics.median(base.times), last_loss=arm.loss,
                   first_step_s=arm.compile_s)
        rows.append(row)
        rng = "" if arm is base else f"[{row['diff_min']:+.3f}, {row['diff_max']:+.3f}]"
        ci = "" if arm is base else f"[{lo:+.3f}, {hi:+.3f}]"
        mdiff = "" if arm is base else f"{row['median_diff_ms']:+.3f}"
        print(f"{arm.name:<10} {med:>10.3f} {row['min_ms']:>8.3f} {row['max_ms']:>8.3f} {mdiff:>21} {ci:>18} "
              f"{rng:>18} {row['ratio']:>7.4f}  {arm.loss:.4f}")
    for name in args.profile:
        profile_arm(next(a for a in arms if a.name == name), args.profile_top)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(dict(policy=args.policy, B=args.B, T=args.T, mode=args.mode, rounds=args.rounds,
                                    block=args.block, device=dev, torch=torch.__version__, rows=rows)) + "\n")
    return rows


if __name__ == "__main__":
    main()
