"""LoRA-SVD study: BF16 vs NVFP4 linear-only vs NVFP4 linear + LoRA-SVD on a small GPT (issue 6).

Same seed, same initial weights, same data order and same number of steps for every variant; prints final
train/val loss, relative gaps to BF16, the share of the NVFP4 linear-only gap that LoRA-SVD removes (target
>= 40 %), step times (overhead of the low-rank path), NVFP4 weight-quantization error, and writes
``curves.png`` + ``results.json`` to ``--out``.

NVFP4 comes from one of two sources (``--quant``; printed in the results):
  backend   torch.compile(model, backend="fullstack_fp4") with Policy.quartet2() + BF16 for the LM head and
            the LoRA factors (``fp4compile.nn.LORA_BF16_GLOB``); needs ``fp4compile.backend``.
  emulate   in-script fake quantization with the NVFP4 reference (``fp4compile.formats.nvfp4.quantize``):
            fprop RTN + 4/6 on X and W; dgrad/wgrad operands RHT (128, or the largest of 64/32/16 dividing K)
            + ``--bwd-rounding`` (ms_eden if the reference implements it, else rtn, with a warning).
            Step times of this mode measure the emulation, not NVFP4 kernels.
  auto      (default) backend if importable, else emulate.

Examples:
  python bench/lora_study.py --tiny                                  # CPU smoke run, ~1-2 min
  python bench/lora_study.py --prepare-data data_lora --train-tokens 20000000   # CPU: tokenize for the GPU
  python bench/lora_study.py --data-dir data_lora --budget-seconds 420 --out $OUT   # GPU
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import lzma
import math
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fp4compile  # noqa: E402
from fp4compile.nn import LORA_BF16_GLOB, LoRASVDLinear  # noqa: E402

DATA = Path("/work/shared/data")
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


# ----------------------------------------------------------------------------------------------
# data
def gpt2_encoding(path: Path):
    import tiktoken
    import tiktoken.load
    return tiktoken.Encoding(name="gpt2", pat_str=GPT2_PAT, mergeable_ranks=tiktoken.load.load_tiktoken_bpe(str(path)),
                             special_tokens={"<|endoftext|>": 50256})


def tokenize_files(files, n_tokens: int, data_root: Path) -> torch.Tensor:
    """First ``n_tokens`` GPT-2 tokens of the given .txt.xz files (documents joined by <|endoftext|>)."""
    enc = gpt2_encoding(data_root / "gpt2.tiktoken")
    out, total = [], 0
    for f in files:
        with lzma.open(f, "rt", encoding="utf-8") as fh:
            buf = []
            for line in fh:
                buf.append(line)
                if len(buf) >= 2000:
                    ids = enc.encode("".join(buf), allowed_special={"<|endoftext|>"})
                    out.append(torch.tensor(ids, dtype=torch.int32))
                    total += len(ids)
                    buf = []
                    if total >= n_tokens:
                        break
            if buf and total < n_tokens:
                ids = enc.encode("".join(buf), allowed_special={"<|endoftext|>"})
                out.append(torch.tensor(ids, dtype=torch.int32))
                total += len(ids)
        if total >= n_tokens:
            break
    toks = torch.cat(out)[:n_tokens]
    if toks.numel() < n_tokens:
        print(f"[data] only {toks.numel()} tokens available (asked {n_tokens})")
    return toks.to(torch.int32)


def prepare_data(out_dir: Path, train_tokens: int, val_tokens: int, data_root: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = sorted((data_root / "corpus").glob("train-*.txt.xz"))
    t0 = time.time()
    tr = tokenize_files(shards, train_tokens, data_root)
    va = tokenize_files([data_root / "corpus" / "val.txt.xz"], val_tokens, data_root)
    tr.to(torch.int64).numpy().astype("uint16").tofile(out_dir / "train.bin")
    va.to(torch.int64).numpy().astype("uint16").tofile(out_dir / "val.bin")
    print(f"[data] wrote {tr.numel()} train + {va.numel()} val tokens to {out_dir} in {time.time() - t0:.0f}s")


def load_tokens(args, split: str, n_tokens: int) -> torch.Tensor:
    if args.data_dir:
        import numpy as np
        arr = np.fromfile(Path(args.data_dir) / f"{split}.bin", dtype=np.uint16)
        return torch.from_numpy(arr[:n_tokens].astype("int64"))
    files = (sorted((DATA / "corpus").glob("train-*.txt.xz")) if split == "train" else [DATA / "corpus" / "val.txt.xz"])
    return tokenize_files(files, n_tokens, DATA).to(torch.int64)


class Batches:
    """Fixed-order batches of contiguous windows: window order is a seeded permutation (same for all runs)."""

    def __init__(self, tokens: torch.Tensor, batch: int, seq: int, seed: int):
        self.tokens, self.batch, self.seq = tokens, batch, seq
        self.n = (tokens.numel() - 1) // seq
        if self.n < batch:
            raise ValueError(f"{tokens.numel()} tokens are too few for batch {batch} x seq {seq}")
        self.perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(seed))

    def get(self, i: int):
        idx = torch.stack([self.perm[(i * self.batch + j) % self.n] for j in range(self.batch)])
        starts = idx * self.seq
        ar = torch.arange(self.seq + 1)
        w = self.tokens[starts[:, None] + ar[None]]
        return w[:, :-1], w[:, 1:]


# ----------------------------------------------------------------------------------------------
# a minimal GPT (nanoGPT-style; kept here so the study does not depend on fp4compile.train)
@dataclasses.dataclass
class GPTConfig:
    vocab: int = 50304
    seq: int = 512
    n_layer: int = 8
    n_head: int = 8
    d: int = 512
    tie: bool = True


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.n_head = c.n_head
        self.ln_1 = nn.LayerNorm(c.d)
        self.c_attn = nn.Linear(c.d, 3 * c.d)
        self.c_proj = nn.Linear(c.d, c.d)
        self.ln_2 = nn.LayerNorm(c.d)
        self.c_fc = nn.Linear(c.d, 4 * c.d)
        self.mlp_proj = nn.Linear(4 * c.d, c.d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.wte = nn.Embedding(c.vocab, c.d)
        self.wpe = nn.Embedding(c.seq, c.d)
        self.h = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.d)
        self.lm_head = nn.Linear(c.d, c.vocab, bias=False)
        if c.tie:
            self.lm_head.weight = self.wte.weight
        for n, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * c.n_layer) if n.endswith(("c_proj.weight", "mlp_proj.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif n.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.h:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


# ----------------------------------------------------------------------------------------------
# NVFP4 emulation (fake quantization with the reference quantizer)
def _had(k: int):
    for h in (128, 64, 32, 16):
        if k % h == 0:
            return h
    return None


def _fq_eager(x, rounding="rtn", four_over_six=False, hadamard=None, signs=None):
    from fp4compile.formats.nvfp4 import quantize
    t = quantize(x, rounding=rounding, four_over_six=four_over_six, hadamard=hadamard, signs=signs, check=False)
    return t.dequantize(torch.float32, rotated=True)


_FQ = {"fn": _fq_eager}


def _fq(x, **kw):
    """Quantize-dequantize (values in the rotated basis when ``hadamard`` is set)."""
    return _FQ["fn"](x, **kw)


def use_compiled_fq() -> None:
    """Fuse the reference quantizer with Inductor (eager it is ~30 small kernels per call)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    _FQ["fn"] = torch.compile(_fq_eager, fullgraph=True, dynamic=None)


class _FQLinear(torch.autograd.Function):
    """Y = Q(X) Q(W)^T;  dX = Q(R dY) Q(R W^T)^T;  dW = Q(R dY^T) Q(R X^T)^T  (R: RHT along the contraction)."""

    @staticmethod
    def forward(ctx, x, w, bwd_rounding, gen):
        ctx.save_for_backward(x, w)
        ctx.bwd_rounding, ctx.gen = bwd_rounding, gen
        return _fq(x, four_over_six=True) @ _fq(w, four_over_six=True).T

    @staticmethod
    def backward(ctx, gy):
        from fp4compile.formats.hadamard import random_signs
        x, w = ctx.saved_tensors
        gy = gy.to(torch.float32)
        r = ctx.bwd_rounding
        h = _had(gy.shape[1])
        s = random_signs(h, ctx.gen, device=gy.device) if h else None
        dx = _fq(gy, rounding=r, hadamard=h, signs=s) @ _fq(w.T.contiguous().float(), rounding=r, hadamard=h, signs=s).T
        h2 = _had(gy.shape[0])
        s2 = random_signs(h2, ctx.gen, device=gy.device) if h2 else None
        dw = _fq(gy.T.contiguous(), rounding=r, hadamard=h2, signs=s2) @ _fq(x.T.contiguous().float(), rounding=r, hadamard=h2,
                                                                   signs=s2).T
        return dx.to(x.dtype), dw.to(w.dtype), None, None


def fq_linear(x, w, b, bwd_rounding, gen):
    y = _FQLinear.apply(x.reshape(-1, x.shape[-1]).float(), w, bwd_rounding, gen).to(x.dtype)
    y = y.view(*x.shape[:-1], w.shape[0])
    return y if b is None else y + b.to(y.dtype)


def emulate_nvfp4(model: nn.Module, bwd_rounding: str, gen) -> int:
    """Route every transformer linear (not lm_head, not LoRA factors) through the fake-quant linear."""
    n = 0
    for path, mod in model.named_modules():
        if "lm_head" in path or path.endswith((".lora_a", ".lora_b")):
            continue
        if isinstance(mod, LoRASVDLinear):
            mod.forward = (lambda m: lambda x: fq_linear(x, m.weight, m.bias, bwd_rounding, gen)
                           + m.lora_b(m.lora_a(x) * m.beta))(mod)
            n += 1
        elif type(mod) is nn.Linear:
            mod.forward = (lambda m: lambda x: fq_linear(x, m.weight, m.bias, bwd_rounding, gen))(mod)
            n += 1
    return n


def pick_bwd_rounding(requested: str) -> str:
    from fp4compile.formats.nvfp4 import quantize
    try:
        quantize(torch.randn(4, 32), rounding=requested, hadamard=16, generator=torch.Generator().manual_seed(0))
        return requested
    except NotImplementedError:
        warnings.warn(f"NVFP4 reference has no rounding={requested!r} yet; emulating the backward with 'rtn'")
        return "rtn"


def weight_quant_error(model: nn.Module) -> float:
    """sum ||Q(W_q) - W_q||_F^2 / sum ||W||_F^2 over transformer linears, W_q = the NVFP4-quantized weight
    (W_res for LoRA-SVD layers, W otherwise), RTN + 4/6 as in fprop."""
    num = den = 0.0
    with torch.no_grad():
        for path, mod in model.named_modules():
            if "lm_head" in path or path.endswith((".lora_a", ".lora_b")):
                continue
            if isinstance(mod, LoRASVDLinear):
                wq, full = mod.weight.float(), mod.merged_weight()
            elif type(mod) is nn.Linear:
                wq = full = mod.weight.float()
            else:
                continue
            num += float((_fq(wq, four_over_six=True) - wq).square().sum())
            den += float(full.square().sum())
    return num / max(den, 1e-30)


@torch.no_grad()
def quant_error_probe(d: int, rank: int, tokens: int, seed: int, bwd_rounding: str):
    """Relative error of the fprop output and the dgrad input gradient of one d x 4d linear, NVFP4 linear-only
    vs NVFP4 residual + exact low-rank branch, for a Gaussian weight (init-like, flat spectrum) and for the same
    weight plus a rank-8 spike (sigma_1..8 = 5x the bulk edge, like trained weights' leading directions).
    Activations X ~ N(0, 1) with a few outlier channels; dY ~ N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)                       # MS-EDEN / SR draw from the default generator
    out_f = 4 * d
    x = torch.randn(tokens, d, generator=g)
    x[:, :4] *= 8.0
    dy = torch.randn(tokens, out_f, generator=g)
    base = torch.randn(out_f, d, generator=g) * 0.02
    edge = 0.02 * (math.sqrt(out_f) + math.sqrt(d))
    u, _ = torch.linalg.qr(torch.randn(out_f, 8, generator=g))
    v, _ = torch.linalg.qr(torch.randn(d, 8, generator=g))
    spiked = base + 5 * edge * (u @ v.T)
    h = _had(out_f)
    rows = []
    for name, w in (("gaussian", base), ("spiked", spiked)):
        lin = nn.Linear(d, out_f, bias=False)
        with torch.no_grad():
            lin.weight.copy_(w)
        m = LoRASVDLinear.from_linear(lin, rank, init="exact")
        y, dx = x @ w.T, dy @ w
        res = {}
        for label, wq, low_y, low_dx in (("nvfp4", w, 0, 0),
                                         ("nvfp4+lora", m.weight.detach(),
                                          (x @ m.lora_a.weight.T) @ m.lora_b.weight.T * m.beta,
                                          (dy @ m.lora_b.weight) @ m.lora_a.weight * m.beta)):
            yq = _fq(x, four_over_six=True) @ _fq(wq, four_over_six=True).T + low_y
            s = fp4compile.formats.hadamard.random_signs(h, g) if h else None
            dxq = _fq(dy, rounding=bwd_rounding, hadamard=h, signs=s) @ \
                _fq(wq.T.contiguous(), rounding=bwd_rounding, hadamard=h, signs=s).T + low_dx
            res[label] = (float((yq - y).norm() / y.norm()), float((dxq - dx).norm() / dx.norm()))
        rows.append((name, res))
    print(f"\nquantization error of one {d}x{out_f} linear, {tokens} tokens, LoRA-SVD rank {rank} (fprop RTN+4/6, "
          f"dgrad RHT-{h}+{bwd_rounding}):")
    print("| weight | fprop rel err nvfp4 | + LoRA-SVD | change | dgrad rel err nvfp4 | + LoRA-SVD | change |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows:
        (y0, d0), (y1, d1) = r["nvfp4"], r["nvfp4+lora"]
        print(f"| {name} | {y0:.4f} | {y1:.4f} | {100 * (y1 / y0 - 1):+.1f} % | {d0:.4f} | {d1:.4f} | "
              f"{100 * (d1 / d0 - 1):+.1f} % |")
    return rows


# ----------------------------------------------------------------------------------------------
# one run
def lr_at(step, steps, lr, warmup):
    if step < warmup:
        return lr * (step + 1) / warmup
    p = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def build(variant: str, args, cfg: GPTConfig, device, quant: str, bwd_rounding: str):
    torch.manual_seed(args.seed)
    model = GPT(cfg).to(device)
    handle = None
    if variant.endswith("lora"):
        handle = fp4compile.prepare(model, rank=args.rank, beta=args.beta, realign_every=args.realign_every,
                                    constrain=None if args.no_constrain else "cholesky_qr", seed=args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.wd,
                            fused=device.type == "cuda")
    if handle is not None:
        handle.attach(opt)
    fwd = model
    nvfp4 = variant.startswith("nvfp4")
    if nvfp4 and quant == "emulate":
        gen = torch.Generator(device=device)
        gen.manual_seed(args.seed + 1)
        emulate_nvfp4(model, bwd_rounding, gen)
    if nvfp4 and quant == "backend":
        pol = fp4compile.Policy.quartet2().override("*lm_head*", "bf16")
        if handle is not None:
            pol = pol.override(LORA_BF16_GLOB, "bf16")
        # on CPU the backend's debug variant (same passes, partitioned graphs run eagerly): Inductor's C++
        # compile takes minutes on a small CPU box
        fwd = torch.compile(model, backend="fullstack_fp4", options={"policy": pol, "debug": device.type == "cpu"})
    elif args.compile:
        fwd = torch.compile(model)
    return model, fwd, opt, handle


def evaluate(fwd, val: Batches, n_batches: int, device, amp):
    losses = []
    with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=amp):
        for i in range(n_batches):
            x, y = val.get(i)
            losses.append(float(fwd(x.to(device), y.to(device))))
    return sum(losses) / len(losses)


def run_variant(variant, args, cfg, device, train, val, steps, quant, bwd_rounding, time_only=0):
    model, fwd, opt, handle = build(variant, args, cfg, device, quant, bwd_rounding)
    amp = device.type == "cuda"
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    curve, vcurve, times = [], [], []
    n = time_only or steps
    for step in range(n):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, args.lr, args.warmup)
        x, y = train.get(step)
        sync()
        t0 = time.perf_counter()
        with torch.autocast(device.type, torch.bfloat16, enabled=amp):
            loss = fwd(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
        loss.backward()
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t0)
        if time_only:
            continue
        curve.append(loss.item())
        if (step + 1) % args.eval_every == 0 or step + 1 == steps:
            vcurve.append((step + 1, evaluate(fwd, val, args.eval_batches, device, amp)))
        if args.log_every and (step + 1) % args.log_every == 0:
            print(f"  [{variant}] step {step + 1}/{steps} loss {curve[-1]:.4f}"
                  + (f" val {vcurve[-1][1]:.4f}" if vcurve and vcurve[-1][0] == step + 1 else ""), flush=True)
    warm = times[min(len(times) - 1, args.timing_warmup):] if len(times) > args.timing_warmup else times
    step_s = sorted(warm)[len(warm) // 2]
    if time_only:
        return {"step_s": step_s}
    k = max(1, min(args.train_avg, len(curve)))
    return {"variant": variant, "train_loss": sum(curve[-k:]) / k, "val_loss": vcurve[-1][1], "curve": curve,
            "val_curve": vcurve, "step_s": step_s, "realignments": handle.realignments if handle else 0,
            "weight_qerr": weight_quant_error(model),
            "params": sum(p.numel() for p in model.parameters())}


def plot(results, path: Path, title: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in results:
        c = r["curve"]
        w = max(1, len(c) // 50)
        sm = [sum(c[max(0, i - w + 1):i + 1]) / len(c[max(0, i - w + 1):i + 1]) for i in range(len(c))]
        ax[0].plot(range(1, len(c) + 1), sm, label=r["variant"])
        ax[1].plot([s for s, _ in r["val_curve"]], [v for _, v in r["val_curve"]], marker="o", label=r["variant"])
    ax[0].set(xlabel="step", ylabel="train loss (moving avg)", title="train")
    ax[1].set(xlabel="step", ylabel="val loss", title="validation")
    for a in ax:
        a.legend()
        a.grid(alpha=0.3)
    lo = min(min(r["curve"][len(r["curve"]) // 2:]) for r in results)
    hi = max(r["curve"][len(r["curve"]) // 4] for r in results)
    if hi > lo:
        ax[0].set_ylim(lo - 0.05 * (hi - lo), hi)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ----------------------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke size (overrides model/data sizes)")
    ap.add_argument("--prepare-data", type=Path, help="tokenize into DIR/{train,val}.bin (uint16) and exit")
    ap.add_argument("--train-tokens", type=int, default=20_000_000)
    ap.add_argument("--val-tokens", type=int, default=262_144)
    ap.add_argument("--data-dir", type=Path, help="folder with train.bin/val.bin from --prepare-data")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "lora_study_out")))
    ap.add_argument("--variants", default="bf16,bf16_lora,nvfp4,nvfp4_lora",
                    help="comma list of bf16, bf16_lora, nvfp4, nvfp4_lora")
    ap.add_argument("--quant", choices=("auto", "backend", "emulate"), default="auto")
    ap.add_argument("--bwd-rounding", default="ms_eden", help="emulate mode: rounding of backward operands")
    ap.add_argument("--budget-seconds", type=float, default=0,
                    help="total training time for all variants: steps are chosen from timed probes")
    ap.add_argument("--steps", type=int, default=0, help="training steps per variant (overrides the budget)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=0, help="warmup steps (default: 5%% of steps)")
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--beta", type=float, default=1.0)
    ap.add_argument("--realign-every", type=int, default=0, help="default: min(2048, steps // 4)")
    ap.add_argument("--no-constrain", action="store_true", help="LoRA-SVD without the constrained backward")
    ap.add_argument("--eval-every", type=int, default=0, help="default: steps // 8")
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--train-avg", type=int, default=20, help="final train loss = mean of the last N steps")
    ap.add_argument("--timing-warmup", type=int, default=3)
    ap.add_argument("--log-every", type=int, default=0)
    ap.add_argument("--compile", action="store_true", help="torch.compile the bf16 / emulated runs (inductor)")
    ap.add_argument("--compile-fq", choices=("auto", "on", "off"), default="auto",
                    help="emulate mode: compile the fake quantizer (auto: on CUDA only)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--qerr", action="store_true",
                    help="only the single-layer quantization-error probe (CPU, seconds) and exit")
    args = ap.parse_args(argv)

    if args.qerr:
        import fp4compile.formats.hadamard  # noqa: F401
        quant_error_probe(args.d, args.rank, 2048, args.seed, pick_bwd_rounding(args.bwd_rounding))
        return

    if args.prepare_data:
        prepare_data(args.prepare_data, args.train_tokens, args.val_tokens, DATA)
        return
    if args.tiny:
        args.d, args.layers, args.heads, args.seq, args.batch = 128, 2, 2, 64, 4   # dims % 128 for RHT-128
        args.rank = min(args.rank, 8)
        args.train_tokens, args.val_tokens = min(args.train_tokens, 120_000), min(args.val_tokens, 16_384)
        args.eval_batches = min(args.eval_batches, 4)
        if not args.steps and not args.budget_seconds:
            args.steps = 30
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = set(variants) - {"bf16", "bf16_lora", "nvfp4", "nvfp4_lora"}
    if bad:
        raise SystemExit(f"unknown variants {sorted(bad)}")
    quant = args.quant
    if quant == "auto":
        try:
            import fp4compile.backend  # noqa: F401
            quant = "backend"
        except ImportError:
            quant = "emulate"
    bwd_rounding = pick_bwd_rounding(args.bwd_rounding) if quant == "emulate" else "backend policy"
    if quant == "emulate" and (args.compile_fq == "on" or (args.compile_fq == "auto" and device.type == "cuda")):
        use_compiled_fq()
    cfg = GPTConfig(vocab=50304, seq=args.seq, n_layer=args.layers, n_head=args.heads, d=args.d)
    print(f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}), torch "
          f"{torch.__version__}, NVFP4 via {quant} (backward rounding: {bwd_rounding})", flush=True)

    t_data = time.time()
    train = Batches(load_tokens(args, "train", args.train_tokens), args.batch, args.seq, args.seed)
    val = Batches(load_tokens(args, "val", args.val_tokens), args.batch, args.seq, args.seed + 7)
    print(f"data: {train.tokens.numel()} train / {val.tokens.numel()} val tokens ({time.time() - t_data:.0f}s)")

    steps = args.steps
    if not steps:
        if not args.budget_seconds:
            raise SystemExit("give --steps or --budget-seconds")
        user_realign, args.realign_every = args.realign_every, 10 ** 9     # no realignment inside the probes
        t_probe, probe, fixed = time.time(), {}, 0.0
        n_probe = args.timing_warmup + 5
        for v in variants:
            t1 = time.time()
            probe[v] = run_variant(v, args, cfg, device, train, val, 10, quant, bwd_rounding, time_only=n_probe)["step_s"]
            fixed += max(0.0, time.time() - t1 - n_probe * probe[v])     # build + compile + first steps
        per_step = sum(probe.values())
        left = args.budget_seconds - (time.time() - t_probe) - fixed          # the real runs pay `fixed` again
        left -= 9 * args.eval_batches / 3 * per_step                           # ~9 evals, forward ~ 1/3 step
        steps = max(20, int(0.9 * left / per_step))
        args.realign_every = user_realign
        if left <= 0:
            print(f"[budget] {args.budget_seconds}s does not cover probing/compilation; running the minimum 20 steps")
        print(f"probe step times {json.dumps({k: round(v, 4) for k, v in probe.items()})} -> {steps} steps/variant")
    args.warmup = args.warmup or max(1, steps // 20)
    args.realign_every = args.realign_every or min(2048, max(1, steps // 4))
    args.eval_every = args.eval_every or max(1, steps // 8)
    tokens = steps * args.batch * args.seq
    print(f"model d={args.d} L={args.layers} H={args.heads} seq={args.seq} batch={args.batch}; {steps} steps "
          f"({tokens / 1e6:.1f}M tokens, {tokens / train.tokens.numel():.2f} epochs); LoRA rank={args.rank} "
          f"beta={args.beta} realign_every={args.realign_every} constrain={not args.no_constrain}", flush=True)

    results = []
    for v in variants:
        t0 = time.time()
        r = run_variant(v, args, cfg, device, train, val, steps, quant, bwd_rounding)
        r["wall_s"] = time.time() - t0
        results.append(r)
        print(f"  {v:<11} train {r['train_loss']:.4f}  val {r['val_loss']:.4f}  step {1e3 * r['step_s']:.1f} ms  "
              f"({r['wall_s']:.0f}s)", flush=True)

    by = {r["variant"]: r for r in results}
    base = by.get("bf16")
    summary = {}
    if base:
        for r in results:
            r["train_gap_pct"] = 100 * (r["train_loss"] - base["train_loss"]) / base["train_loss"]
            r["val_gap_pct"] = 100 * (r["val_loss"] - base["val_loss"]) / base["val_loss"]
        if "nvfp4" in by and "nvfp4_lora" in by:
            for k in ("train", "val"):
                g0, g1 = by["nvfp4"][f"{k}_gap_pct"], by["nvfp4_lora"][f"{k}_gap_pct"]
                summary[f"{k}_gap_cut_pct"] = 100 * (1 - g1 / g0) if g0 > 0 else float("nan")
        if all(v in by for v in ("nvfp4", "nvfp4_lora", "bf16_lora")):
            # the fair comparison: each NVFP4 arm against the BF16 arm of the same parametrization, so that
            # what LoRA-SVD changes in the optimization itself (measured by bf16_lora vs bf16) cancels
            lb = by["bf16_lora"]
            for k in ("train", "val"):
                g1 = 100 * (by["nvfp4_lora"][f"{k}_loss"] - lb[f"{k}_loss"]) / lb[f"{k}_loss"]
                g0 = by["nvfp4"][f"{k}_gap_pct"]
                summary[f"{k}_gap_lora_vs_bf16_lora_pct"] = g1
                summary[f"{k}_matched_gap_cut_pct"] = 100 * (1 - g1 / g0) if g0 > 0 else float("nan")
    if "nvfp4" in by and "nvfp4_lora" in by:
        summary["lowrank_step_overhead_pct"] = 100 * (by["nvfp4_lora"]["step_s"] / by["nvfp4"]["step_s"] - 1)
    if "bf16" in by and "bf16_lora" in by:
        summary["lowrank_step_overhead_bf16_pct"] = 100 * (by["bf16_lora"]["step_s"] / by["bf16"]["step_s"] - 1)

    args.out.mkdir(parents=True, exist_ok=True)
    meta = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    meta.update(steps=steps, quant=quant, bwd_rounding=bwd_rounding, device=str(device), torch=torch.__version__)
    (args.out / "results.json").write_text(json.dumps({"config": meta, "summary": summary, "runs": results}, indent=1))
    title = (f"GPT d={args.d} L={args.layers}, {steps} steps x {args.batch}x{args.seq}, NVFP4 via {quant}; "
             f"LoRA-SVD r={args.rank} beta={args.beta} realign={args.realign_every}")
    plot(results, args.out / "curves.png", title)

    print("\n| variant | train loss | val loss | train gap % | val gap % | step ms | W quant err | realigns |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['variant']} | {r['train_loss']:.4f} | {r['val_loss']:.4f} | {r.get('train_gap_pct', float('nan')):+.3f} "
              f"| {r.get('val_gap_pct', float('nan')):+.3f} | {1e3 * r['step_s']:.1f} | {r['weight_qerr']:.4e} "
              f"| {r['realignments']} |")
    for k, v in summary.items():
        print(f"{k}: {v:.1f}")
    key = "val_matched_gap_cut_pct" if "val_matched_gap_cut_pct" in summary else "val_gap_cut_pct"
    if key in summary:
        print(f"target ({key} >= 40 %): {'MET' if summary[key] >= 40 else 'NOT met'}"
              + ("  [--tiny smoke run: not evidence either way]" if args.tiny else ""))
    if quant == "emulate":
        print("note: NVFP4 is emulated (fake quantization); step times measure the emulation, not NVFP4 kernels")
    print(f"wrote {args.out / 'results.json'} and {args.out / 'curves.png'}")


if __name__ == "__main__":
    main()
