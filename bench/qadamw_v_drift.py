"""Does Q-AdamW's stored second moment follow the exact one when it is re-encoded every step? (CPU, ~1 minute)

v is decoded, updated and re-encoded at every step, so a rounding bias of the codec compounds. Two measurements,
for ``v_rounding`` RTN (the default before session 17) and SR (the default since):

1. synthetic: a 16x1024 parameter gets one gradient with magnitudes spread over decades (lognormal, sigma 2), then
   zero gradients; the exact sqrt(v) decays by sqrt(beta2) a step. Printed: decoded / exact sqrt(v), summed over
   elements, for the largest element, and summed over the largest 1 % (by exact value), at steps 100-600, seeds 0
   and 1. The largest element alone is one random walk under SR (0.65-1.40 at step 600 over seeds 0-5, session 19);
   the largest 1 % average 164 of them.
2. replay (when the file is there): 256 rows of the tied embedding's state saved from the 30M full-stack run at
   300M tokens on the H200 (session 17), in which RTN had grown some tiles' sqrt(v) to 1e14 and beyond. Forty
   more steps with gradients of 1e-5: the largest sqrt(v) relative to its start, against the exact decay.

    python bench/qadamw_v_drift.py [--steps 600] [--state docs/bench_logs/session17_qadamw_embed_v_state_...]
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from fp4compile.optim import QAdamW
from fp4compile.optim.qadamw import decoded_sqrt_v

ROOT = Path(__file__).resolve().parents[1]
STATE = ROOT / "docs" / "bench_logs" / "session17_qadamw_embed_v_state_rows256-511_h200_2026-12-02.safetensors"
BETA2 = 0.95


def sqrt_v(opt: QAdamW, p: torch.Tensor) -> torch.Tensor:
    """The decoded sqrt(v) of ``p`` (first param group), FP64."""
    return decoded_sqrt_v(opt.state[p], opt.param_groups[0]).double()


def synthetic(seed: int, steps: int, report, **qkw) -> dict[int, tuple[float, float, float]]:
    """One lognormal gradient, then zeros, into ``QAdamW(**qkw)``: {step: (decoded / exact sqrt(v) summed over
    elements, of the largest element, summed over the largest 1 %)} at the ``report`` steps."""
    torch.manual_seed(seed)
    p = torch.nn.Parameter(torch.zeros(16, 1024))
    opt = QAdamW([p], lr=0.0, weight_decay=0.0, betas=(0.9, BETA2), **qkw)
    g0 = torch.randn(16, 1024).sign() * torch.exp(2.0 * torch.randn(16, 1024))
    p.grad = g0
    opt.step()
    p.grad = torch.zeros_like(g0)
    ratios = {}
    for t in range(2, steps + 1):
        opt.step()
        if t in report:
            exact = math.sqrt(1 - BETA2) * g0.abs().double().reshape(-1) * math.sqrt(BETA2) ** (t - 1)
            r = sqrt_v(opt, p)
            top = exact.topk(exact.numel() // 100).indices
            ratios[t] = (float(r.sum() / exact.sum()), float(r.max() / exact.max()),
                         float(r[top].sum() / exact[top].sum()))
    return ratios


def replay(path: Path, v_rounding: str, steps: int = 40) -> tuple[float, float]:
    from safetensors.torch import load_file

    saved = load_file(str(path))
    rows = saved["v_mean"].numel() * 32 // 640
    p = torch.nn.Parameter(torch.zeros(rows, 640))
    opt = QAdamW([p], lr=2e-4, weight_decay=0.1, betas=(0.9, BETA2), v_rounding=v_rounding)
    p.grad = torch.zeros_like(p)
    opt.step()  # creates the state; then it is replaced by the saved one
    for k, v in saved.items():
        opt.state[p][k].copy_(v.reshape(opt.state[p][k].shape))
    start = float(sqrt_v(opt, p).max())
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        p.grad = torch.randn(rows, 640, generator=gen) * 1e-5
        opt.step()
    return float(sqrt_v(opt, p).max()) / start, math.sqrt(BETA2) ** steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--state", type=Path, default=STATE)
    args = ap.parse_args(argv)
    report = [t for t in (100, 200, 300, 400, 600) if t <= args.steps]
    print("decoded / exact sqrt(v) after one gradient then zeros (sum over elements / largest element / largest 1 %)\n")
    print("| v rounding | seed | " + " | ".join(f"step {t}" for t in report) + " |")
    print("|---|---|" + "---|" * len(report))
    for vr in ("rtn", "sr"):
        for seed in (0, 1):
            cells = synthetic(seed, args.steps, report, v_rounding=vr).values()
            row = " | ".join(f"{s:.3g} / {m:.3g} / {t:.3g}" for s, m, t in cells)
            print(f"| {vr} | {seed} | {row} |", flush=True)
    if args.state.is_file():
        print(f"\nreplay of {args.state.name}: 40 steps, gradient 1e-5; largest sqrt(v) / its start\n")
        print("| v rounding | largest sqrt(v) / start | exact decay |")
        print("|---|---|---|")
        for vr in ("rtn", "sr"):
            got, exact = replay(args.state, vr)
            print(f"| {vr} | {got:.3f} | {exact:.3f} |", flush=True)
    else:
        print(f"\n(no replay: {args.state} not found)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
