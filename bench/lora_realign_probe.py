"""What a LoRA-SVD realignment does to the size of the weight updates (CPU, BF16, no quantization).

Trains the ``cpu`` preset with the same seed and data, LoRA-SVD in every run: one run never realigns, one realigns
at step ``--at`` (and every ``--at`` steps after), and with ``--hold`` a third realigns with
``realign_scale="hold"``. After every optimizer step it records, per converted layer:
* ``dW``: the change of the layer's function W = W_res + beta L2 L1 in that step (Frobenius norm; a realignment
  itself keeps W, so this is the optimizer's update alone);
* ``dW_branch``: the change of beta L2 L1 (the realignment step itself is left out: the re-split moves it);
* ``rms_L``: the RMS entry of the factors L1, L2.

It prints, summed over layers and averaged over step windows around the realignment, each run's ``dW`` and
``dW_branch``, their ratio to the never-realigning run's, and the train-loss gap to that run. If realigning
raises the update size in the principal subspace (the factors' scale sqrt(S / beta) grows with the trained
singular values, and Adam's per-element steps on the factors move W in proportion to it), dW_branch jumps at the
realignment together with the loss.

    python bench/lora_realign_probe.py --steps 300 --at 150 [--hold]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from fp4compile.nn.lora_svd import LoRASVDLinear
from fp4compile.train.loop import TrainConfig, read_metrics, train, train_losses


def _rms(m) -> float:
    f = torch.cat([m.lora_a.weight.detach().flatten(), m.lora_b.weight.detach().flatten()]).float()
    return float(f.pow(2).mean().sqrt())


def run(out_dir: Path, steps: int, realign_at, args, hold: bool = False) -> dict:
    """Train; return {step: (sum dW, sum dW_branch, mean rms_L)} and the per-step losses."""
    stats, prev, layers, rms = {}, {}, [], {}
    step = [0]

    def snapshot(m):
        with torch.no_grad():
            low = m.beta * (m.lora_b.weight.float() @ m.lora_a.weight.float())
            return m.weight.float() + low, low

    def hook(opt, a, kw):
        if not layers:
            return
        step[0] += 1
        dw = db = 0.0
        for m in layers:
            w, low = snapshot(m)
            if m in prev:
                dw += float((w - prev[m][0]).norm())
                db += float((low - prev[m][1]).norm())
            prev[m] = (w, low)
            rms[m] = _rms(m)
        stats[step[0]] = (dw, db, statistics.fmean(rms.values()))

    import fp4compile.train.loop as L

    orig = L.build_optimizer

    def build_optimizer(model, *a, **k):  # the converted layers exist once the optimizer is built
        layers[:] = [m for m in model.modules() if isinstance(m, LoRASVDLinear)]
        prev.clear()
        for m in layers:
            prev[m] = snapshot(m)
        return orig(model, *a, **k)

    handle = register_optimizer_step_post_hook(hook)
    L.build_optimizer = build_optimizer
    try:
        cfg = TrainConfig(model="cpu", tokenizer="bytes", train_data="stdlib", val_data="stdlib:val",
                          batch_size=args.batch_size, seq_len=args.seq_len, steps=steps, warmup_steps=args.warmup,
                          lr=args.lr, eval_interval=0, eval_batches=2, log_interval=1, backend=args.backend,
                          policy="bf16", out_dir=str(out_dir), progress=False, device="cpu", lora=True,
                          lora_rank=args.rank, lora_realign_every=realign_at or 10 ** 9,
                          lora_realign_after=realign_at or 0, seed=args.seed,
                          lora_realign_scale="hold" if hold else "keep")
        train(cfg)
    finally:
        handle.remove()
        L.build_optimizer = orig
    losses = train_losses(read_metrics(out_dir))
    return {"stats": stats, "loss": losses}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--at", type=int, default=150, help="the realignment step of the realigning run")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default="eager", help="eager is deterministic on CPU (inductor's CPU kernels "
                    "are not: the runs then differ before the realignment)")
    ap.add_argument("--hold", action="store_true", help="also run with realign_scale='hold' (prepare's option)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        runs = {"never": run(Path(tmp) / "never", args.steps, None, args),
                "realigned": run(Path(tmp) / "realign", args.steps, args.at, args)}
        if args.hold:
            runs["realigned, scale held"] = run(Path(tmp) / "hold", args.steps, args.at, args, hold=True)
    a, base = args.at, runs["never"]
    # step a itself is left out: its post-step state is already re-split (the realignment runs in the optimizer's
    # own post-step hook, before this script's global one), so its dW_branch measures the re-split
    windows = [(a - 20, a - 1), (a + 1, a + 5), (a + 6, a + 15), (a + 16, a + 50), (a + 51, args.steps)]
    for name, r in runs.items():
        diff = [k for k in sorted(base["loss"]) if k in r["loss"] and base["loss"][k] != r["loss"][k]]
        print(f"{name}: first step whose loss differs from 'never': {diff[0] if diff else None}")
    print(f"\nrealignment at step {a} (rank {args.rank}, backend {args.backend}); dW, dW_branch: sums over the "
          "LoRA-SVD layers; every column a mean over the window; ratios and gaps against 'never'")
    print("| run | steps | dW | ratio | dW_branch | ratio | rms(L) | train-loss gap |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in runs.items():
        for lo, hi in windows:
            ks = [k for k in range(lo, hi + 1) if k in base["stats"] and k in r["stats"]]
            if not ks:
                continue
            m = lambda run, i: statistics.fmean(run["stats"][k][i] for k in ks)  # noqa: E731
            lb = statistics.fmean(base["loss"][k] for k in ks)
            lr_ = statistics.fmean(r["loss"][k] for k in ks)
            print(f"| {name} | {lo}–{hi} | {m(r, 0):.4f} | {m(r, 0) / m(base, 0):.2f} | {m(r, 1):.4f} "
                  f"| {m(r, 1) / m(base, 1):.2f} | {m(r, 2):.4f} | {100 * (lr_ - lb) / lb:+.2f} % |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
