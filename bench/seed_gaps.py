"""Relative loss gaps of arms to their same-seed baselines, across seeds: a table and a plot.

Each ``--pair LABEL BASE_RUN ARM_RUN`` names one seed's comparison (run directories holding ``metrics.jsonl``).
For every pair it prints the gap of the train loss (mean of the 10 steps up to each listed step, the way
``bench/study.py`` reports "train") and of each eval (val, Brown) at the steps both runs logged; then, per label,
the mean over its pairs with the standard error and the paired difference between two labels (``--diff A B``,
repeatable: A's gap minus B's, per seed, the pairs matched by their base run, e.g. the NVFP4-linear gap minus
the LoRA-SVD gap; a seed only one label has is left out and counted). Gaps compare the same step, so a run stopped
early by a time budget is compared at its last step. ``--windows 560-600,601-620`` adds the train gap over step
ranges and its change from the first range, per pair and per label (e.g. the jump of the gap across a realignment
at step 600). ``--png`` draws every pair's gap curve (EMA of the train loss from
the first common step, ``fp4compile.train.cli.gap_curve``), one colour per label.
``--evals`` prints each pair's val gap at every eval both runs logged and, per ``--diff``, the difference at each
eval (at how many A is lower, and the mean). ``--val-png`` draws each pair's val gap at every eval both runs logged
against tokens seen (for pairs on different schedules, e.g. ``--pair 100M ... --pair 200M ...``).

    python bench/seed_gaps.py --pair quartet2 s0/bf16 s0/quartet2 --pair lora s0/bf16 s0/lora \\
        --pair quartet2 s1/bf16 s1/quartet2 --pair lora s1/bf16 s1/lora --diff quartet2 lora --png gaps.png
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from fp4compile.train.cli import gap_curve
from fp4compile.train.loop import eval_losses, read_metrics, train_losses

EVALS = ("val_loss", "brown_loss")


def _curves(run) -> Tuple[Dict[int, float], Dict[str, Dict[int, float]]]:
    recs = read_metrics(run)
    return train_losses(recs), eval_losses(recs, EVALS)


def _window_gap(at: Dict[int, float], bt: Dict[int, float], lo: int, hi: int) -> Optional[float]:
    """Gap (in %) of the mean train loss over steps lo..hi (those both runs logged); None if there are none."""
    w = [k for k in range(lo, hi + 1) if k in at and k in bt]
    if not w:
        return None
    a, b = statistics.fmean(at[k] for k in w), statistics.fmean(bt[k] for k in w)
    return 100 * (a - b) / b


def pair_gaps(base_run, arm_run, steps: Sequence[int] = (), window: int = 10,
              windows: Sequence[Tuple[int, int]] = ()) -> dict:
    """Gaps (in %) of ``arm_run`` to ``base_run``: ``train`` at each of ``steps`` that both reached plus the arm's
    last step (mean of the ``window`` steps ending there), each eval key at the steps both logged, and
    ``windows``: the train gap over each (first, last) step range (None where neither run logged a step)."""
    bt, be = _curves(base_run)
    at, ae = _curves(arm_run)
    last = max(s for s in at if s in bt)
    out = {"last": last, "train": {}}
    for s in sorted({*(x for x in steps if x <= last), last}):
        out["train"][s] = _window_gap(at, bt, s - window + 1, s)
    for k in EVALS:
        out[k] = {s: 100 * (ae[k][s] - be[k][s]) / be[k][s] for s in sorted(ae[k]) if s in be[k]}
    out["windows"] = {w: _window_gap(at, bt, *w) for w in windows}
    return out


def eval_gap_points(base_run, arm_run, key: str = "val_loss") -> List[Tuple[float, float]]:
    """(tokens seen, gap in %) of ``arm_run``'s eval ``key`` to ``base_run``'s at every step both evaluated: the
    x axis of runs with different schedules (e.g. the same model on a 100M- and a 200M-token schedule)."""
    def evals(run):
        return {r["step"]: (r["tokens"], r[key]) for r in read_metrics(run) if key in r and "tokens" in r}
    b, a = evals(base_run), evals(arm_run)
    return [(a[s][0], 100 * (a[s][1] - b[s][1]) / b[s][1]) for s in sorted(a) if s in b]


def _gap_figure(draw, xlabel: str, ylabel: str, out: Path) -> Path:
    """A gap plot written to ``out``: ``draw(ax, plt)`` adds the lines; a zero line, labels, grid and legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    draw(ax, plt)
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_eval_gaps(pairs, out: Path, key: str = "val_loss") -> Path:
    """One line per pair: its :func:`eval_gap_points` against tokens (in millions)."""
    def draw(ax, plt):
        for label, base, arm in pairs:
            pts = eval_gap_points(base, arm, key)
            ax.plot([t / 1e6 for t, _ in pts], [g for _, g in pts], "o-", lw=1.2, label=label)

    return _gap_figure(draw, "tokens seen (M)", f"{key.replace('_', ' ')} gap to the baseline (%)", out)


def mean_se(xs: List[float]) -> Tuple[float, Optional[float]]:
    """Mean and standard error (None for a single value)."""
    m = statistics.fmean(xs)
    return m, (statistics.stdev(xs) / len(xs) ** 0.5 if len(xs) > 1 else None)


def _fmt(m: float, se: Optional[float]) -> str:
    return f"{m:+.2f} %" + (f" ± {se:.2f}" if se is not None else "")


def plot(pairs, out: Path) -> Path:
    """Every pair's train-loss gap curve (EMA 0.9), one colour per label."""
    def draw(ax, plt):
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        order = list(dict.fromkeys(p[0] for p in pairs))
        seen = set()
        for label, base, arm in pairs:
            bt, _ = _curves(base)
            at, _ = _curves(arm)
            common, gap = gap_curve(bt, at, 0.9)
            ax.plot(common, gap, color=colors[order.index(label) % len(colors)], lw=1.2,
                    label=None if label in seen else label)
            seen.add(label)

    return _gap_figure(draw, "step", "train-loss gap to the same-seed baseline (%, EMA 0.9)", out)


def _print_windows(rows: Dict[str, List[dict]], windows: Sequence[Tuple[int, int]]) -> None:
    """Per pair: the train gap over each window, then its change from the first window; per label: the mean
    change with its standard error (e.g. the jump of the gap across a realignment and what of it stays)."""
    names = [f"{a}-{b}" for a, b in windows]
    print("\n| label | pair | train gap over " + ", ".join(names) + " | change from " + names[0] + " |")
    print("|---|---|---|---|")
    changes: Dict[str, List[List[float]]] = {}
    for label, gs in rows.items():
        for i, g in enumerate(gs):
            v = [g["windows"][w] for w in windows]
            d = [x - v[0] for x in v[1:]] if None not in v else []
            if d:
                changes.setdefault(label, []).append(d)
            print(f"| {label} | {i} | " + ", ".join("–" if x is None else f"{x:+.2f}" for x in v) + " | "
                  + (", ".join(f"{x:+.2f}" for x in d) or "–") + " |")
    for label, ds in changes.items():
        print(f"{label}: change from {names[0]} to " + "; ".join(
            f"{n} {_fmt(*mean_se([d[j] for d in ds]))}" for j, n in enumerate(names[1:])) + f" ({len(ds)} pairs)")


def _print_eval_gaps(rows: Dict[str, List[dict]], diffs: Sequence[Tuple[str, str]], key: str = "val_loss") -> None:
    """Per pair: the ``key`` gap at every eval both runs logged; per ``--diff A B`` and base run both labels share:
    A's gap minus B's at every eval all four runs logged, at how many of them A is lower, and their mean (a curve
    of differences says more than the last eval alone: sessions 58-59 read two runs' split from it)."""
    print(f"\n| label | arm run | {key.replace('_', ' ')} gap (%) at each eval (step: gap) |")
    print("|---|---|---|")
    for label, gs in rows.items():
        for g in gs:
            print(f"| {label} | {g['arm']} | " + ", ".join(f"{s}: {v:+.2f}" for s, v in g[key].items()) + " |")
    for a, b in diffs:
        ga = {g["base"]: g[key] for g in rows[a]}
        for g in rows[b]:
            if g["base"] not in ga:
                continue
            steps = [s for s in ga[g["base"]] if s in g[key]]
            if not steps:
                continue
            d = [ga[g["base"]][s] - g[key][s] for s in steps]
            print(f"\n{a} − {b}, {key} gap at each eval (base {g['base']}): "
                  + ", ".join(f"{s}: {x:+.2f}" for s, x in zip(steps, d))
                  + f"; {a} lower at {sum(x < 0 for x in d)} of {len(d)}, mean {statistics.fmean(d):+.2f} points")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", nargs=3, action="append", required=True, metavar=("LABEL", "BASE_RUN", "ARM_RUN"))
    ap.add_argument("--steps", default="400,800,1000,1200", help="comma-separated steps for the train gap")
    ap.add_argument("--diff", nargs=2, action="append", default=[], metavar=("A", "B"),
                    help="paired per-seed difference A - B, pairs matched by their base run; repeatable")
    ap.add_argument("--windows", default="", help="comma-separated step ranges FIRST-LAST (e.g. 560-600,601-620): "
                    "the train gap over each, and its change from the first range, per pair and per label")
    ap.add_argument("--evals", action="store_true", help="each pair's val gap at every eval both runs logged, and "
                    "for each --diff A B the difference at every eval (pairs matched by their base run)")
    ap.add_argument("--png", type=Path)
    ap.add_argument("--val-png", type=Path, help="the val gap at every eval both runs logged, against tokens seen, "
                    "one line per pair (runs on different schedules)")
    args = ap.parse_args(argv)
    steps = [int(s) for s in args.steps.split(",") if s]
    windows = [tuple(int(v) for v in w.split("-")) for w in args.windows.split(",") if w]
    if any(len(w) != 2 or w[0] > w[1] for w in windows):
        raise SystemExit(f"--windows: expected FIRST-LAST ranges, got {args.windows!r}")
    rows: Dict[str, List[dict]] = {}
    print("| label | arm run | last step | train gap at " + ", ".join(map(str, steps)) + ", last | val (last eval) "
          "| Brown (last eval) |")
    print("|---|---|---|---|---|---|")
    for label, base, arm in args.pair:
        g = pair_gaps(base, arm, steps, windows=windows)
        g["base"], g["arm"] = str(Path(base).resolve()), arm
        rows.setdefault(label, []).append(g)
        tr = ", ".join("–" if v is None else f"{v:+.2f}" for v in g["train"].values())  # None: before a fork
        ev = [f"{d[max(d)]:+.2f} % (step {max(d)})" if d else "–" for d in (g["val_loss"], g["brown_loss"])]
        print(f"| {label} | {arm} | {g['last']} | {tr} | {ev[0]} | {ev[1]} |")
    print("\n| label | seeds | train gap, last step | val gap, last eval | Brown gap, last eval |")
    print("|---|---|---|---|---|")
    finals: Dict[str, Dict[str, List[Tuple[str, float]]]] = {}   # label -> metric -> [(base run, final gap)]
    for label, gs in rows.items():
        f = {"train": [(g["base"], g["train"][g["last"]]) for g in gs]}
        for k in EVALS:
            f[k] = [(g["base"], g[k][max(g[k])]) for g in gs if g[k]]
        finals[label] = f
        print(f"| {label} | {len(gs)} | " + " | ".join(_fmt(*mean_se([v for _, v in f[k]])) if f[k] else "–"
                                                       for k in ("train", *EVALS)) + " |")
    for a, b in args.diff:
        for k in ("train", "val_loss"):
            # pairs are matched by their base run (the same seed's baseline); a seed one label lacks is left out
            fa, fb = dict(finals[a][k]), dict(finals[b][k])
            if len(fa) != len(finals[a][k]) or len(fb) != len(finals[b][k]):
                raise SystemExit(f"--diff {a} {b}: a label has two pairs with the same base run")
            both = [base for base in fa if base in fb]
            if not both:
                raise SystemExit(f"--diff {a} {b}: no base run with {k} values in both labels")
            d = [fa[base] - fb[base] for base in both]
            m, se = mean_se(d)
            ref = statistics.fmean(fa[base] for base in both)
            share = f"{100 * m / ref:.0f} % of {a}'s mean gap" if ref else f"{a}'s mean gap is 0"
            left = len(fa) + len(fb) - 2 * len(both)
            print(f"\npaired {a} − {b}, {k}: per seed " + ", ".join(f"{x:+.2f}" for x in d)
                  + f"; mean {_fmt(m, se)} points = {share}"
                  + (f" ({left} pair(s) without a same-base partner left out)" if left else ""))
    if windows:
        _print_windows(rows, windows)
    if args.evals:
        _print_eval_gaps(rows, args.diff)
    if args.png:
        print(f"\nwrote {plot(args.pair, args.png)}")
    if args.val_png:
        print(f"\nwrote {plot_eval_gaps(args.pair, args.val_png)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
