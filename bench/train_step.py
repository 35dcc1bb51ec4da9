"""GPT-124M training step: fullstack_fp4 (linear-only NVFP4) vs the default ``inductor`` backend in BF16.

    python bench/train_step.py                       # H200: B=16, T=1024, GPT-2 124M, policy quartet2
    python bench/train_step.py --policy rtn          # RTN-only NVFP4 linears (no RHT / MS-EDEN)
    python bench/train_step.py --tiny                # CPU smoke run at toy size

Both models are built from the same seed in one process and timed the same way: first step (Dynamo +
AOT + Inductor compile of forward and backward, plus one step) = "first compile"; then ``--steps`` timed
steps after ``--warmup`` untimed ones (forward, backward, fused AdamW step outside the compiled region).
Linear-only: ``--policy quartet2`` (Quartet II: fprop RTN+4/6, dgrad/wgrad RHT-128 + MS-EDEN; attention
BF16) or ``--policy rtn`` (every block linear GEMM RTN NVFP4, no RHT); in both the LM head stays BF16
(the presets' edge rules). Prints one table row per backend and the ratios; ``--json`` appends a JSON line.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, n_head):
        super().__init__()
        self.n_head = n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    """GPT-2 (124M at the defaults: 12 layers, d=768, 12 heads, vocab 50304, tied LM head)."""

    def __init__(self, vocab=50304, d=768, n_layer=12, n_head=12, block_size=1024):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block_size, d)
        self.h = nn.ModuleList([Block(d, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.h:
            x = b(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def policy_for(name):
    from fp4compile.policy import NVFP4, Policy

    if name == "quartet2":
        return Policy.quartet2()
    if name == "rtn":
        return Policy((), "rtn-linear").override("*", NVFP4("rtn"), role="linear.fprop") \
            .override("*", NVFP4("rtn"), role="linear.dgrad").override("*", NVFP4("rtn"), role="linear.wgrad") \
            .override("*lm_head*", "bf16")
    raise SystemExit(f"unknown --policy {name!r} (quartet2 | rtn)")


def run(label, backend, options, args, device):
    torch.manual_seed(0)
    dims = dict(vocab=256, d=64, n_layer=2, n_head=2, block_size=args.T) if args.tiny else {}
    model = GPT(**dims).to(device=device, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    step_fn = torch.compile(model, backend=backend, options=options)
    vocab = model.wte.num_embeddings
    g = torch.Generator(device="cpu").manual_seed(1)
    data = [torch.randint(0, vocab, (args.B, args.T + 1), generator=g).to(device) for _ in range(4)]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def step(i):
        d = data[i % len(data)]
        loss = step_fn(d[:, :-1], d[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    first_loss = step(0).item()
    compile_s = time.perf_counter() - t0
    for i in range(args.warmup):
        step(i + 1)
    sync()
    t0 = time.perf_counter()
    for i in range(args.steps):
        loss = step(i)
    last_loss = loss.item()
    sync()
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    del model, opt, step_fn
    torch._dynamo.reset()
    return dict(label=label, tokens_per_s=args.B * args.T * args.steps / dt, ms_per_step=1e3 * dt / args.steps,
                peak_gib=peak, first_compile_s=compile_s, first_loss=first_loss, last_loss=last_loss)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default="quartet2", help="quartet2 (default) | rtn")
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="toy model on CPU (smoke test)")
    ap.add_argument("--json", help="append the results as one JSON line to this file")
    args = ap.parse_args()
    if args.tiny:
        args.B, args.T, args.steps, args.warmup = 2, 64, 2, 1
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    rows = [run("inductor bf16", "inductor", None, args, device),
            run(f"fullstack_fp4 {args.policy}", "fullstack_fp4", {"policy": policy_for(args.policy)}, args, device)]
    base = rows[0]
    print(f"\nGPT {'tiny' if args.tiny else '124M'} train step, B={args.B} T={args.T}, {device}, torch {torch.__version__}")
    print(f"{'backend':<26}{'tokens/s':>12}{'ratio':>8}{'ms/step':>10}{'peak GiB':>10}{'compile s':>11}{'loss0->N':>16}")
    for r in rows:
        print(f"{r['label']:<26}{r['tokens_per_s']:>12.0f}{r['tokens_per_s'] / base['tokens_per_s']:>8.3f}"
              f"{r['ms_per_step']:>10.1f}{r['peak_gib']:>10.2f}{r['first_compile_s']:>11.1f}"
              f"{r['first_loss']:>8.3f}->{r['last_loss']:.3f}")
    fp4 = rows[1]
    print(f"targets: tokens/s ratio {fp4['tokens_per_s'] / base['tokens_per_s']:.3f} (>= 0.9), "
          f"peak {fp4['peak_gib']:.2f} vs {base['peak_gib']:.2f} GiB (lower), "
          f"compile {fp4['first_compile_s'] / base['first_compile_s']:.2f}x inductor (<= 1.5)")
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(dict(args=vars(args), device=device, torch=torch.__version__, rows=rows)) + "\n")


if __name__ == "__main__":
    main()
