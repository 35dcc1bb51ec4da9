"""GPT-124M training step: fullstack_fp4 (linear-only NVFP4) vs the default ``inductor`` backend in BF16.

    python bench/train_step.py                       # H200: B=16, T=1024, GPT-2 124M, policy quartet2,
                                                     # BF16 and fp4 in both compile modes (default and
                                                     # reduce-overhead = CUDA graphs)
    python bench/train_step.py --policy rtn          # RTN-only NVFP4 linears (no RHT / MS-EDEN)
    python bench/train_step.py --tiny                # CPU smoke run at toy size
    python bench/train_step.py --impls auto,full --profile   # time several GEMM impls on one compiled model,
                                                     # then a torch.profiler top-25 kernel table

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
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.timing import profile_steps  # noqa: E402


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
    if name == "full_stack":
        return Policy.full_stack()             # + Q-Attn (QK^T and dS in NVFP4) on top of the quartet2 linears
    if name == "rtn":
        return Policy((), "rtn-linear").override("*", NVFP4("rtn"), role="linear.fprop") \
            .override("*", NVFP4("rtn"), role="linear.dgrad").override("*", NVFP4("rtn"), role="linear.wgrad") \
            .override("*lm_head*", "bf16")
    raise SystemExit(f"unknown --policy {name!r} (quartet2 | full_stack | rtn)")


def run(label, backend, options, args, device, impls=(None,), profile=False):
    torch.manual_seed(0)
    dims = dict(vocab=256, d=64, n_layer=2, n_head=2, block_size=args.T) if args.tiny else {}
    model = GPT(**dims).to(device=device, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    if backend == "fullstack_fp4":  # the function itself: works without the installed entry point too
        from fp4compile.backend import fullstack_fp4
        # torch.compile refuses mode= next to options=: the backend takes the mode as an option
        step_fn = torch.compile(model, backend=fullstack_fp4, options=dict(options, mode=args.mode))
    else:
        step_fn = torch.compile(model, backend=backend, options=options, mode=args.mode)
    vocab = model.wte.num_embeddings
    g = torch.Generator(device="cpu").manual_seed(1)
    data = [torch.randint(0, vocab, (args.B, args.T + 1), generator=g).to(device) for _ in range(4)]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def step(i):
        if args.mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()
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
    results = []
    for impl in impls:
        # the same compiled graph, another kernel behind fp4compile::gemm (read at call time): no recompile
        if backend is not None and device == "cuda":
            import os
            from fp4compile.kernels import gemm as G
            G.DEFAULT_IMPL = impl or os.environ.get("FP4COMPILE_GEMM_IMPL", "auto")
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
        results.append(dict(label=label + (f" [{impl}]" if impl else ""), tokens_per_s=args.B * args.T * args.steps / dt,
                            ms_per_step=1e3 * dt / args.steps, peak_gib=peak, first_compile_s=compile_s,
                            first_loss=first_loss, last_loss=last_loss))
        r = results[-1]
        print(f"  {r['label']}: {r['tokens_per_s']:.0f} tok/s, {r['ms_per_step']:.1f} ms/step, peak {peak:.2f} GiB, "
              f"first step {compile_s:.1f} s, loss {first_loss:.3f} -> {last_loss:.3f}", flush=True)
    try:
        from fp4compile.kernels import gemm as G
        if G.TUNED_CHOICES:
            print("  impl='tuned' choices (M, N, K): " + "; ".join(
                f"{k[:3]} {v[0]} (" + ", ".join(f"{i} {1e3 * t:.0f}us" for i, t in v[1].items()) + ")"
                for k, v in G.TUNED_CHOICES.items()), flush=True)
    except ImportError:
        pass
    if profile:
        n = 2
        table = profile_steps(lambda k: [step(i) for i in range(k)], n, top=args.profile_top)
        print(f"\n== profile: {label}" + (f" [{impls[-1]}]" if impls[-1] else "") + f", {n} steps ==")
        print(table, flush=True)
    del model, opt, step_fn
    torch._dynamo.reset()
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default="quartet2", help="quartet2 (default) | full_stack | rtn")
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="toy model on CPU (smoke test)")
    ap.add_argument("--json", help="append the results as one JSON line to this file")
    ap.add_argument("--impls", default="",
                    help="comma list of fp4compile::gemm impls to time on the same compiled fp4 model "
                         "(e.g. auto,full,dq_triton); default: the registered default only")
    ap.add_argument("--profile", action="store_true",
                    help="print a torch.profiler CUDA-kernel table (--profile-top rows) of each fp4 step (last impl)")
    ap.add_argument("--profile-bf16", action="store_true", help="also profile the BF16 step")
    ap.add_argument("--profile-top", type=int, default=25, help="rows of the profile's kernel table (default 25)")
    ap.add_argument("--skip-bf16", action="store_true", help="no BF16 baseline run")
    ap.add_argument("--modes", default=None,
                    help="comma list of torch.compile modes, each timed for BF16 and fp4: 'default' (kernels "
                         "launched eagerly by Python) and/or 'reduce-overhead' (CUDA graphs: no per-launch "
                         "host cost). Default: both on CUDA, 'default' on CPU")
    ap.add_argument("--lowerings", default="op",
                    help="comma list of backend gemm_lowering values to compile and time (op, auto, dequant_mm); "
                         "--impls applies to 'op' and 'auto'")
    ap.add_argument("--quantize-config", default=None, metavar="JSON",
                    help="update fp4compile.kernels.quantize.CONFIG for this run (an A/B of kernel options in one "
                         "tree), e.g. '{\"e_maxnreg\": 96}'")
    args = ap.parse_args()
    if args.quantize_config:
        from fp4compile.kernels import quantize as QK
        extra = json.loads(args.quantize_config)
        unknown = set(extra) - set(QK.CONFIG)
        if unknown:
            ap.error(f"--quantize-config: unknown CONFIG keys {sorted(unknown)}")
        QK.CONFIG.update(extra)
        print(f"quantize CONFIG updated: {extra}", flush=True)
    if args.tiny:
        args.B, args.T, args.steps, args.warmup = 2, 64, 2, 1
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    modes = (args.modes or ("default,reduce-overhead" if device == "cuda" else "default")).split(",")
    impls = tuple(args.impls.split(",")) if args.impls else (None,)
    print(f"\nGPT {'tiny' if args.tiny else '124M'} train step, B={args.B} T={args.T}, {device}, "
          f"torch {torch.__version__}", flush=True)
    head = f"{'backend':<44}{'tokens/s':>10}{'ratio':>7}{'ms/step':>9}{'peak GiB':>9}{'compile s':>10}{'loss0->N':>16}"
    all_rows, summary = [], []
    for mode in modes:
        args.mode = None if mode == "default" else mode
        tag = f" ({mode})"
        rows = [] if args.skip_bf16 else [dict(r, label=r["label"] + tag) for r in run(
            "inductor bf16", "inductor", None, args, device, profile=args.profile_bf16)]
        for low in args.lowerings.split(","):
            use = impls if low in ("op", "auto") else (None,)
            if args.mode == "reduce-overhead":   # impl="tuned" times kernels: not inside a CUDA-graph capture
                use = tuple(i for i in use if i != "tuned") or (None,)
            rows += [dict(r, label=r["label"] + tag) for r in run(
                f"fullstack_fp4 {args.policy}" + ("" if low == "op" else f" {low}"), "fullstack_fp4",
                {"policy": policy_for(args.policy), "gemm_lowering": low}, args, device, impls=use,
                profile=args.profile)]
        base = rows[0]
        summary.append("")
        summary.append(head)
        for r in rows:
            summary.append(f"{r['label']:<44}{r['tokens_per_s']:>10.0f}{r['tokens_per_s'] / base['tokens_per_s']:>7.3f}"
                           f"{r['ms_per_step']:>9.1f}{r['peak_gib']:>9.2f}{r['first_compile_s']:>10.1f}"
                           f"{r['first_loss']:>8.3f}->{r['last_loss']:.3f}")
        if args.skip_bf16:   # no baseline: the ratios above are against the first fp4 row, and no target is judged
            summary.append(f"[{mode}] no BF16 baseline (--skip-bf16): ratios are against the first row; no targets")
        else:
            fp4 = max(rows[1:] or rows, key=lambda r: r["tokens_per_s"])
            summary.append(f"[{mode}] best fp4 row: {fp4['label']}; targets: tokens/s ratio "
                           f"{fp4['tokens_per_s'] / base['tokens_per_s']:.3f} (>= 0.9), peak {fp4['peak_gib']:.2f} vs "
                           f"{base['peak_gib']:.2f} GiB (lower), compile "
                           f"{fp4['first_compile_s'] / base['first_compile_s']:.2f}x inductor (<= 1.5)")
        print("\n".join(summary[-len(rows) - 3:]), flush=True)
        all_rows += rows
    print(f"\n== GPT {'tiny' if args.tiny else '124M'} train step, B={args.B} T={args.T}, {device}, "
          f"torch {torch.__version__}: all modes ==" + "\n".join(summary))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(dict(args=vars(args), device=device, torch=torch.__version__, rows=all_rows)) + "\n")


if __name__ == "__main__":
    main()
