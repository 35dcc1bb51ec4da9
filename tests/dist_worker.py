"""Worker for tests/test_distributed.py: launched by ``torchrun --nproc-per-node N`` (or as a plain process).

Trains a tiny user-defined GPT (user-defined nn.Module subclasses: after DDP's graph breaks, Dynamo skips
frames that live in torch/nn, so an nn.Sequential-only model would never reach the backend) on a fixed
synthetic global batch per step, and writes per-step losses, backend-call counts and saved-tensor summaries
to ``--out`` (rank 0).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fp4compile.train import distributed as D  # noqa: E402

VOCAB, D_MODEL, N_HEAD, N_LAYER, T = 64, 32, 2, 2, 16


class Attention(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        B, T_, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T_, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T_, C))


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.out(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, h)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = MLP(d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab=VOCAB, d=D_MODEL, h=N_HEAD, n_layer=N_LAYER, t=T):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(t, d)
        self.blocks = nn.ModuleList([Block(d, h) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def global_batch(step: int, batch: int, seed: int = 1234):
    """The same (x, y) global batch on every rank: a deterministic function of the step."""
    g = torch.Generator().manual_seed(seed + step)
    data = torch.randint(0, VOCAB, (batch, T + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def make_model(seed=0, d=D_MODEL, n_layer=N_LAYER):
    torch.manual_seed(seed)
    return TinyGPT(d=d, n_layer=n_layer)


def make_optimizer(model, name):
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    raise ValueError(name)


class CountingBackend:
    """Wraps a backend name; records every call (the graph's size) — DDPOptimizer calls it per bucket."""

    def __init__(self, name, options=None):
        self.name, self.options, self.calls = name, options, []

    def __call__(self, gm, example_inputs, **kw):
        from torch._dynamo.backends.registry import lookup_backend

        self.calls.append({"n_placeholders": sum(n.op == "placeholder" for n in gm.graph.nodes),
                           "n_linear": sum(n.op == "call_function" and n.target is F.linear or
                                           n.op == "call_module" for n in gm.graph.nodes)})
        if self.options:
            kw["options"] = self.options
        return lookup_backend(self.name)(gm, example_inputs, **kw)


def run(parallel, args, env):
    model = make_model(d=args.d_model, n_layer=args.n_layer)
    backend = CountingBackend(args.backend)
    wrapped = D.wrap_model(model, parallel, backend=backend, compile=not args.eager,
                           bucket_cap_mb=args.bucket_cap_mb)
    opt = make_optimizer(model, args.optim)
    start = 0
    if args.load:
        meta = D.load_checkpoint(args.load, model, opt)
        start = meta["step"]
    losses = []
    saved = []
    for step in range(start, args.steps):
        x, y = D.local_batch(global_batch(step, args.batch), env)
        if args.record_saved and step == start:
            hook_ctx = torch.autograd.graph.saved_tensors_hooks(
                lambda t: (saved.append([str(t.dtype), list(t.shape)]), t)[1], lambda t: t)
        else:
            import contextlib
            hook_ctx = contextlib.nullcontext()
        with hook_ctx:
            logits = wrapped(x)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(D.reduce_metrics({"loss": loss})["loss"])
        if args.save and step + 1 == args.save_at:
            D.save_checkpoint(args.save, model, opt, step=step + 1)
    return {"losses": losses, "backend_calls": backend.calls, "saved": saved, "start": start}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--runs", default="none", help="comma list of parallel modes to run in sequence")
    p.add_argument("--backend", default="aot_eager")
    p.add_argument("--eager", action="store_true")
    p.add_argument("--optim", default="adamw")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--d-model", type=int, default=D_MODEL)
    p.add_argument("--n-layer", type=int, default=N_LAYER)
    p.add_argument("--bucket-cap-mb", type=float, default=None)
    p.add_argument("--save", default=None)
    p.add_argument("--save-at", type=int, default=3)
    p.add_argument("--load", default=None)
    p.add_argument("--record-saved", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.use_deterministic_algorithms(True)
    env = D.setup("cpu")
    results = {"world_size": env.world_size}
    for mode in args.runs.split(","):
        torch._dynamo.reset()
        results[mode] = run(mode, args, env)
    if env.is_main:
        with open(args.out, "w") as f:
            json.dump(results, f)
    D.teardown()


if __name__ == "__main__":
    main()
