"""Are two training runs the same bits? Step-by-step train loss of two run directories, compared exactly.

Issue 7's 300M-token reruns of one arm and seed differ by 0.1-0.2 point of val gap across sessions and machines.
Two runs of one arm, seed, code and machine, compared here step by step, tell whether part of that spread is
run-to-run nondeterminism (e.g. atomics in a backward): the first step whose loss differs, the largest difference
and the difference at the last common step. ``bench/run_h200.sh s60_det`` runs it on two fresh runs.

    python bench/compare_runs.py RUN_A RUN_B [--json OUT.json]

Exit status 0 whether or not they differ (a difference is a result, not an error); 2 when the runs share no step.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Dict, List, Optional

from fp4compile.train.loop import read_metrics, train_losses


def compare(a: Dict[int, float], b: Dict[int, float]) -> Optional[dict]:
    """The exact comparison of two runs' ``train_losses`` (``fp4compile.train.loop``): common steps, how many differ,
    the first that does, the largest absolute difference and its step, and the last common step's difference
    (``None`` if no step is common). NaN equals NaN here (both runs diverged alike)."""
    steps = sorted(set(a) & set(b))
    if not steps:
        return None

    def same(x: float, y: float) -> bool:
        return x == y or (math.isnan(x) and math.isnan(y))

    diffs = [(s, a[s] - b[s]) for s in steps if not same(a[s], b[s])]
    worst = max(diffs, key=lambda d: abs(d[1]) if not math.isnan(d[1]) else math.inf, default=None)
    last = steps[-1]
    return {
        "common_steps": len(steps), "first_step": steps[0], "last_step": last,
        "n_differ": len(diffs), "first_differ": diffs[0][0] if diffs else None,
        "max_abs_diff": abs(worst[1]) if worst else 0.0, "max_abs_diff_step": worst[0] if worst else None,
        "last_diff": a[last] - b[last], "last_loss_a": a[last], "last_loss_b": b[last],
    }


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_a")
    ap.add_argument("run_b")
    ap.add_argument("--json", help="also write the comparison as one JSON object here")
    args = ap.parse_args(argv)
    res = compare(train_losses(read_metrics(args.run_a)), train_losses(read_metrics(args.run_b)))
    if res is None:
        print(f"{args.run_a} and {args.run_b} share no step with a train loss", file=sys.stderr)
        return 2
    if res["n_differ"] == 0:
        print(f"identical: the train loss of all {res['common_steps']} common steps "
              f"({res['first_step']}..{res['last_step']}) is the same bits")
    else:
        print(f"differ: {res['n_differ']} of {res['common_steps']} common steps; first at step {res['first_differ']}; "
              f"largest |A - B| {res['max_abs_diff']:.3e} at step {res['max_abs_diff_step']}; "
              f"last step {res['last_step']}: {res['last_loss_a']:.6f} vs {res['last_loss_b']:.6f} "
              f"({res['last_diff']:+.3e})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
