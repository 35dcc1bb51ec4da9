"""Q-AdamW's second-moment rounding in training: torch AdamW vs Q-AdamW with RTN v vs Q-AdamW with SR v (CPU).

A small GPT (the ``tiny`` preset: 2 layers, d_model 128) on GPT-2 tokens of the shared corpus, the vocabulary cut
to its ``--vocab`` most frequent tokens (the rest map to one id) so that a 2-core CPU runs it: most parameters are
still the tied embedding, whose rows see rare, sparse gradients (where the H200 run's RTN state ran away,
docs/OPTIM.md). Same data order, seed and schedule per arm, FP32 (no autocast): the optimizer is the only
difference. Printed per arm: train loss (mean of the last 50 steps), val loss at each eval, and the embedding's
drift: how many of its 32-element tiles have a decoded mean sqrt(v) more than 10x that of an exact FP64 second
moment kept beside it (the same beta2, the same gradients), and the largest such ratio.

    python bench/qadamw_v_train_cpu.py [--steps 1000] [--vocab 8192] [--arms adamw,qadamw_rtn,qadamw_sr]
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np
import torch

from fp4compile.optim import QAdamW
from fp4compile.optim.qadamw import decoded_sqrt_v
from fp4compile.train.data import TokenBatches, get_tokenizer, load_tokens, padded_vocab
from fp4compile.train.model import GPT, config_from_preset

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"


def drift(opt, p, v_exact) -> tuple[int, float]:
    """(tiles whose decoded mean sqrt(v) is > 10x the exact one's, the largest ratio) of ``p``'s Q-AdamW state."""
    st = opt.state.get(p)
    if not st or "v_mean" not in st:
        return 0, float("nan")
    tile = opt.param_groups[0]["tile"]
    got = decoded_sqrt_v(st, opt.param_groups[0]).double().reshape(-1, tile).mean(-1)
    exact = v_exact.reshape(-1).sqrt().reshape(-1, tile).mean(-1).clamp(min=1e-30)
    ratio = got / exact
    return int((ratio > 10).sum()), float(ratio.max())


def cut_vocab(tokens, keep: int, counts):
    """Token ids -> ranks by ``counts`` (most frequent 0); ranks >= keep - 1 become keep - 1."""
    rank = np.empty(len(counts), dtype=np.int64)
    rank[np.argsort(-counts, kind="stable")] = np.arange(len(counts))
    return np.minimum(rank[np.asarray(tokens, dtype=np.int64)], keep - 1).astype(np.int32)


def run_arm(arm, args, train, val, vocab):
    torch.manual_seed(args.seed)
    model = GPT(config_from_preset("tiny", vocab_size=vocab, max_seq_len=args.seq))
    kw = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    if arm == "adamw":
        opt = torch.optim.AdamW(model.parameters(), **kw)
    else:
        opt = QAdamW(model.parameters(), v_rounding=arm.split("_")[1], **kw)
    warm = max(1, args.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    emb = model.embed.weight
    v_exact = torch.zeros_like(emb, dtype=torch.float64)
    losses, evals, t0 = [], [], time.time()
    for step in range(1, args.steps + 1):
        x, y = train.batch((step - 1) * args.batch, args.batch)
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        v_exact.mul_(0.95).add_(emb.grad.double().square(), alpha=0.05)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % args.eval_every == 0 or step == args.steps:
            model.eval()
            with torch.no_grad():
                vl = sum(float(model(*val.batch(i * args.batch, args.batch))) for i in range(args.eval_batches))
            model.train()
            n, ratio = drift(opt, emb, v_exact) if arm != "adamw" else (0, float("nan"))
            evals.append((step, vl / args.eval_batches, n, ratio))
            print(f"[{arm}] step {step}: train {sum(losses[-50:]) / len(losses[-50:]):.4f} val "
                  f"{evals[-1][1]:.4f} tiles > 10x exact sqrt(v): {n} (max ratio {ratio:.3g}) "
                  f"{time.time() - t0:.0f}s", flush=True)
    return sum(losses[-50:]) / len(losses[-50:]), evals


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", default="adamw,qadamw_rtn,qadamw_sr")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-batches", type=int, default=16)
    ap.add_argument("--train-tokens", type=int, default=4_000_000)
    ap.add_argument("--data-dir", type=Path, default=DATA)
    args = ap.parse_args(argv)
    tok = get_tokenizer(str(args.data_dir / "gpt2.tiktoken"))
    corpus = args.data_dir / "corpus"
    tr = load_tokens(str(corpus / "train-00.txt.xz"), tok, max_tokens=args.train_tokens)
    va = load_tokens(str(corpus / "val.txt.xz"), tok)
    counts = np.bincount(np.asarray(tr, dtype=np.int64), minlength=tok.vocab_size)
    vocab = padded_vocab(args.vocab)
    train = TokenBatches(cut_vocab(tr, vocab, counts), args.seq, seed=args.seed)
    val = TokenBatches(cut_vocab(va, vocab, counts), args.seq, shuffle=False, name="val")
    results = {arm: run_arm(arm, args, train, val, vocab) for arm in args.arms.split(",")}
    print(f"\n{args.steps} steps x {args.batch} x {args.seq} tokens, tiny GPT, vocab {vocab}, lr {args.lr}, seed "
          f"{args.seed}\n")
    steps = [e[0] for e in next(iter(results.values()))[1]]
    print("| arm | train (last 50) | " + " | ".join(f"val @{s}" for s in steps)
          + " | embedding tiles > 10x exact sqrt(v), end | largest ratio |")
    print("|---|---|" + "---|" * len(steps) + "---|---|")
    for arm, (loss, ev) in results.items():
        print(f"| {arm} | {loss:.4f} | " + " | ".join(f"{e[1]:.4f}" for e in ev)
              + f" | {ev[-1][2]} | {ev[-1][3]:.3g} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
