"""Worker for tests/test_distributed.py: launched by ``torchrun --nproc-per-node N`` (or as a plain process).

Trains a tiny user-defined GPT (user-defined nn.Module subclasses: after DDP's graph breaks, Dynamo skips
frames that live in torch/nn, so an nn.Sequential-only model would never reach the backend) on a fixed
synthetic global batch per step, and writes per-step losses, backend-call counts and saved-tensor summaries
to ``--out`` (rank 0).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time

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
    """The same (x, y) global batch on every rank: a deterministic function of the step. Sequences follow
    t[i+1] = (5·t[i] + 3) mod V with 10 % random tokens, so the loss falls and the curves mean something."""
    g = torch.Generator().manual_seed(seed + step)
    data = torch.empty(batch, T + 1, dtype=torch.long)
    data[:, 0] = torch.randint(0, VOCAB, (batch,), generator=g)
    for i in range(T):
        data[:, i + 1] = (5 * data[:, i] + 3) % VOCAB
    noise = torch.rand(batch, T + 1, generator=g) < 0.1
    data[noise] = torch.randint(0, VOCAB, (int(noise.sum()),), generator=g)
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


def rtn_policy():
    """NVFP4 RTN on every linear role (deterministic: no stochastic rounding, no random Hadamard signs);
    the LM head and embeddings stay BF16 (the presets' convention), attention stays unquantized."""
    from fp4compile.policy import NVFP4, Policy

    p = Policy.bf16()
    for role in ("linear.fprop", "linear.dgrad", "linear.wgrad"):
        p = p.override("*", NVFP4("rtn"), role=role)
    return p.override("*lm_head*", "bf16")


class CountingBackend:
    """Wraps a backend name; records every call (the graph's size) — DDPOptimizer calls it per bucket."""

    def __init__(self, name):
        self.name, self.calls = name, []
        if name == "fullstack_fp4":         # (functools.wraps' convention: wrap_model sees the backend it wraps)
            from fp4compile.backend import fullstack_fp4

            self.__wrapped__ = fullstack_fp4

    def __call__(self, gm, example_inputs, **kw):
        from torch._dynamo.backends.registry import lookup_backend

        self.calls.append({"n_placeholders": sum(n.op == "placeholder" for n in gm.graph.nodes),
                           "n_linear": sum(n.op == "call_function" and n.target is F.linear or
                                           n.op == "call_module" for n in gm.graph.nodes)})
        if self.name == "fullstack_fp4":
            from fp4compile.backend import fullstack_fp4

            return fullstack_fp4(gm, example_inputs, **kw)
        return lookup_backend(self.name)(gm, example_inputs, **kw)


def run(mode, args, env):
    """mode: <parallel>[_notag][_eager], parallel = none | ddp | fsdp2, optionally prefixed "resume_" (load
    --load first, continue to --steps). _eager: fp32 without compilation (and, for none, the full global
    batch in one micro-batch); _notag: see below."""
    resume = mode.startswith("resume_")
    eager = mode.endswith("_eager") or args.eager
    parallel = (mode[len("resume_"):] if resume else mode).replace("_eager", "").replace("_notag", "")
    model = make_model(d=args.d_model, n_layer=args.n_layer)
    backend = CountingBackend(args.backend)
    options = None
    if args.backend == "fullstack_fp4":
        options = {"policy": rtn_policy(), "debug": True}
        import fp4compile.backend  # noqa: F401  (registers the fp4compile ops)
        from fp4compile.passes import reuse

        if not hasattr(reuse.QuantCache, "_orig_finalize"):
            reuse.QuantCache._orig_finalize = reuse.QuantCache.finalize
        # negative control ("<mode>_notag"): skip the MUST_RECOMPUTE tagging, so FP4 weight copies get saved
        reuse.QuantCache.finalize = ((lambda self: None) if mode.endswith("_notag")
                                     else reuse.QuantCache._orig_finalize)
    wrapped = D.wrap_model(model, parallel, backend=backend, options=options, compile=not eager,
                           bucket_cap_mb=args.bucket_cap_mb)
    opt = make_optimizer(model, args.optim)
    start = 0
    if resume:
        start = D.load_checkpoint(args.load, model, opt)["step"]
    losses, saved = [], []
    accum = args.accum if parallel == "none" and not eager else 1
    for step in range(start, args.steps):
        gx, gy = D.local_batch(global_batch(step, args.batch), env)
        total = 0.0
        for i in range(accum):          # accum > 1: one process emulating `accum` ranks' local batches
            x, y = D.local_batch((gx, gy), D.DistEnv(rank=i, world_size=accum))
            record = args.record_saved and step == start and i == 0 and not eager
            ctx = (torch.autograd.graph.saved_tensors_hooks(
                lambda t: (saved.append([str(t.dtype), list(t.shape)]), t)[1], lambda t: t)
                if record else contextlib.nullcontext())
            with ctx:
                logits = wrapped(x)
                loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1))
            (loss / accum).backward()
            total += loss.detach() / accum
        loss = total
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(D.reduce_metrics({"loss": loss})["loss"])
        if args.save and mode == args.save_from and step + 1 == args.save_at:
            D.save_checkpoint(args.save, model, opt, step=step + 1)
    shapes = {n: [list(p.shape), list(p.to_local().shape) if hasattr(p, "to_local") else list(p.shape)]
              for n, p in model.named_parameters()}
    return {"losses": losses, "backend_calls": backend.calls, "saved": saved, "start": start,
            "param_shapes": shapes}


def simple_ns(g, steps=5):
    """Quintic Newton–Schulz (Muon's coefficients) in the input dtype: the test's whole-matrix reference."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g / (g.norm() + 1e-7)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    for _ in range(steps):
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if tall else x


def ns_scenario(env):
    """distributed_newton_schulz on FSDP2-style Shard(0) DTensors (even and uneven rows) and on
    replicated tensors, both strategies, against simple_ns of the full matrix."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (env.world_size,))
    torch.manual_seed(0)
    shapes = [(64, 32), (64, 32), (64, 32), (33, 48), (48, 33), (16, 16)]
    fulls = [torch.randn(s, dtype=torch.float64) for s in shapes]
    ref = [simple_ns(m) for m in fulls]
    res = {}
    for strategy in ("all_to_all", "gather"):
        calls = []

        def ns(m):
            calls.append(tuple(m.shape))
            return simple_ns(m)

        dts = [distribute_tensor(m, mesh, [Shard(0)]) for m in fulls]
        D.barrier()
        t0 = time.perf_counter()
        outs = D.distributed_newton_schulz(dts, ns, strategy=strategy)
        dt = time.perf_counter() - t0
        err = max((o.full_tensor() - r).abs().max().item() for o, r in zip(outs, ref))
        layout_ok = all(isinstance(o, DTensor) and o.placements == d.placements and
                        o.to_local().shape == d.to_local().shape for o, d in zip(outs, dts))
        n_calls = D.reduce_metrics({"n": len(calls)}, op="max")["n"]
        res["sharded_" + strategy] = {"max_err": err, "layout_ok": layout_ok, "max_ns_calls_per_rank": n_calls,
                                      "seconds": dt}
        calls.clear()
        outs = D.distributed_newton_schulz(fulls, ns, strategy=strategy)
        err = max((o - r).abs().max().item() for o, r in zip(outs, ref))
        n_calls = D.reduce_metrics({"n": len(calls)}, op="max")["n"]
        res["replicated_" + strategy] = {"max_err": err, "max_ns_calls_per_rank": n_calls}
    # a stack of FSDP2-sharded momenta (torch.stack of Shard(0) DTensors = Shard(1)), QRoot-style batched fn
    batches = []

    def batched(u):
        batches.append(int(u.shape[0]))
        return torch.stack([simple_ns(m) for m in u]) if u.shape[0] else u

    for n in (3, 1):                                # 3 over 2 ranks: 2 + 1 matrices; 1: rank 1 idle
        full = torch.stack(fulls[:n])
        stacked = torch.stack([distribute_tensor(m, mesh, [Shard(0)]) for m in fulls[:n]])
        batches.clear()
        out = D.distributed_orthogonalize(stacked, batched)
        res[f"stack{n}"] = {"is_shard1": tuple(stacked.placements) == (Shard(1),),
                            "same_layout": out.placements == stacked.placements and
                            out.to_local().shape == stacked.to_local().shape,
                            "max_err": (out.full_tensor() - torch.stack([simple_ns(m) for m in full])).abs().max().item(),
                            "local_batch": D.reduce_metrics({"b": batches[0] if batches else -1}, op="max")["b"]}
    return res


def _train_steps(model, opt, env, steps, accum, batch, save=None, save_at=None):
    losses = []
    for step in steps:
        gx, gy = D.local_batch(global_batch(step, batch), env)
        total = 0.0
        for i in range(accum):
            x, y = D.local_batch((gx, gy), D.DistEnv(rank=i, world_size=accum))
            loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
            (loss / accum).backward()
            total += loss.detach() / accum
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(D.reduce_metrics({"loss": total})["loss"])
        if save is not None and step + 1 == save_at:
            D.save_checkpoint(save, model, opt, step=step + 1)
    return losses


def qoptim_scenario(env, args, resume_only=False):
    """fp4compile's quantized optimizers under FSDP2 (eager fp32 model, 4 steps): QAdamW through
    shard_local, QRoot (NVFP4 Newton–Schulz, AdamW for the rest) through whole_matrix. World 1: the
    reference with the 2 ranks' micro-batches. World 2: also saves at step 2 and resumes a fresh model on 2
    ranks. resume_only (world 1): resume the 2-rank checkpoints on 1 process."""
    from fp4compile.optim import QAdamW, QRoot
    world = env.world_size

    def build(name):
        m = make_model(d=64, n_layer=2)
        D.wrap_model(m, "fsdp2" if world > 1 else "none", compile=False)
        if name == "qadamw":
            cls = D.shard_local(QAdamW) if world > 1 else QAdamW
            return m, cls(m.parameters(), lr=3e-3, min_numel=1024)
        cls = D.whole_matrix(QRoot) if world > 1 else QRoot
        return m, cls(QRoot.param_groups_for(m), lr=3e-3, adamw="qadamw" if name == "qroot_q" else "adamw",
                      precision="nvfp4", min_numel=1024)

    res = {}
    for name in ("qadamw", "qroot", "qroot_q"):
        ck = f"{args.qckpt}_{name}" if args.qckpt else None
        r = res[name] = {}
        if resume_only:
            m, opt = build(name)
            try:
                D.load_checkpoint(ck, m, opt)
                r["resumed"] = _train_steps(m, opt, env, range(2, 4), 2, args.batch)
            except ValueError as e:
                r["error"] = str(e)
            continue
        m, opt = build(name)
        r["losses"] = _train_steps(m, opt, env, range(4), 2 if world == 1 else 1, args.batch,
                                   save=ck if world > 1 else None, save_at=2)
        if world > 1:
            m, opt = build(name)
            D.load_checkpoint(ck, m, opt)
            r["resumed"] = _train_steps(m, opt, env, range(2, 4), 1, args.batch)
    return res


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--runs", default="none",
                   help="comma list: none | ddp | fsdp2 | resume_<mode> | ns, run in sequence")
    p.add_argument("--backend", default="aot_eager")
    p.add_argument("--accum", type=int, default=1, help="mode none: split each global batch in N micro-batches")
    p.add_argument("--eager", action="store_true")
    p.add_argument("--optim", default="adamw")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--d-model", type=int, default=D_MODEL)
    p.add_argument("--n-layer", type=int, default=N_LAYER)
    p.add_argument("--bucket-cap-mb", type=float, default=None)
    p.add_argument("--save", default=None)
    p.add_argument("--save-from", default="fsdp2")
    p.add_argument("--save-at", type=int, default=3)
    p.add_argument("--load", default=None)
    p.add_argument("--qckpt", default=None, help="checkpoint path prefix of the qoptim scenario")
    p.add_argument("--record-saved", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.use_deterministic_algorithms(True)
    env = D.setup("cpu")
    results = {"world_size": env.world_size}
    for mode in args.runs.split(","):
        torch._dynamo.reset()
        if mode == "ns":
            results[mode] = ns_scenario(env)
        elif mode in ("qoptim", "qoptim_resume"):
            results[mode] = qoptim_scenario(env, args, resume_only=mode == "qoptim_resume")
        else:
            results[mode] = run(mode, args, env)
    if env.is_main:
        with open(args.out, "w") as f:
            json.dump(results, f)
    D.teardown()


if __name__ == "__main__":
    main()
