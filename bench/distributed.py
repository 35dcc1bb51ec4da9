"""Data-parallel throughput and memory: 1 GPU vs DDP vs FSDP2 with the fullstack_fp4 backend.

    # 1 GPU baseline, then 2 GPUs (same per-GPU micro-batch, so the global batch doubles: weak scaling)
    python bench/distributed.py --model 124m --parallel none
    torchrun --nproc-per-node 2 bench/distributed.py --model 124m --parallel ddp
    torchrun --nproc-per-node 2 bench/distributed.py --model 124m --parallel fsdp2
    # the same with CUDA graphs (1 GPU and DDP; FSDP2 re-gathers parameters, so it has none)
    python bench/distributed.py --model 124m --parallel none --mode reduce-overhead
    torchrun --nproc-per-node 2 bench/distributed.py --model 124m --parallel ddp --mode reduce-overhead
    # FSDP2 variants: keep gathered blocks from forward to backward; gather BF16 parameters; profile
    torchrun --nproc-per-node 2 bench/distributed.py --model 124m --parallel fsdp2 --no-reshard --bf16-params --profile
    # CPU smoke test (gloo): the same code path on a tiny model
    torchrun --nproc-per-node 2 bench/distributed.py --tiny --parallel fsdp2
    # Newton–Schulz on FSDP2 shards: all_to_all (whole matrices per rank) vs gather (all on every rank)
    torchrun --nproc-per-node 2 bench/distributed.py --model 124m --ns

Prints one table row on rank 0 (and ``--json`` writes it): tokens/s over all ranks (timed steps only, after
``--warmup`` steps that include compilation), ms/step, first-step (compile) seconds, and peak memory per
rank (``torch.cuda.max_memory_allocated``; CPU: max RSS). Scaling = tokens/s(N GPUs) / tokens/s(1 GPU)
from two runs of this script; the target in issue 8 is >= 1.8x on 2 GPUs.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fp4compile.train import distributed as D  # noqa: E402


def build_model(args, device):
    from fp4compile.train.model import GPT, config_from_preset

    cfg = config_from_preset("tiny" if args.tiny else args.model, vocab_size=args.vocab, max_seq_len=args.seq)
    torch.manual_seed(0)
    return GPT(cfg).to(device), cfg


def build_optimizer(model, name, lr=3e-4):
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, fused=None)
    if name == "qadamw":
        from fp4compile.optim import QAdamW

        return QAdamW(model.parameters(), lr=lr, weight_decay=0.1)
    raise ValueError(f"unknown optimizer {name!r}")


def peak_memory_gib(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20     # KiB -> GiB


def muon_ns(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Quintic Newton–Schulz in BF16 (Muon's coefficients): the bench's stand-in for QRoot's NS."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.to(torch.bfloat16)
    x = x / (x.norm() + 1e-7)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    for _ in range(steps):
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return (x.T if tall else x).to(g.dtype)


def ns_bench(args, env, cfg):
    """Newton–Schulz of every block matrix of the model, FSDP2-sharded (Shard(0)) over the ranks:
    all_to_all (whole matrices assigned to ranks) vs gather (every rank gathers and orthogonalizes all)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    d, h, L = cfg.d_model, cfg.hidden, cfg.n_layer
    shapes = [(3 * d, d), (d, d), (2 * h, d), (d, h)] * L
    torch.manual_seed(0)
    mats = [torch.randn(s, device=env.device) for s in shapes]
    if env.distributed:
        mesh = init_device_mesh(env.device.type, (env.world_size,))
        mats = [distribute_tensor(m, mesh, [Shard(0)]) for m in mats]
    rows = []
    # one process: no mesh, the whole matrices (both strategies reduce to NS of every matrix): the 1-GPU baseline
    for strategy in ("all_to_all", "gather") if env.distributed else ("1 process",):
        for i in range(args.warmup + args.steps):
            if i == args.warmup:
                if env.device.type == "cuda":
                    torch.cuda.synchronize()
                D.barrier()
                t0 = time.perf_counter()
            D.distributed_newton_schulz(mats, muon_ns, strategy=strategy if env.distributed else "all_to_all")
        if env.device.type == "cuda":
            torch.cuda.synchronize()
        D.barrier()
        ms = 1e3 * (time.perf_counter() - t0) / args.steps
        rows.append((strategy, D.reduce_metrics({"ms": ms}, op="max")["ms"]))
    if env.is_main:
        print(f"NS of {len(shapes)} block matrices ({sum(a * b for a, b in shapes) / 1e6:.1f}M params), "
              f"{env.world_size} ranks, {env.device.type}")
        for s, ms in rows:
            print(f"  {s:10s} {ms:9.2f} ms/step")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ns_ms": dict(rows), "world_size": env.world_size, "n_matrices": len(shapes)}, f)
    D.teardown()
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parallel", choices=D.PARALLEL_MODES, default="none")
    p.add_argument("--model", default="124m", help="fp4compile.train.model preset")
    p.add_argument("--tiny", action="store_true", help="tiny model on CPU (smoke test)")
    p.add_argument("--backend", default="fullstack_fp4")
    p.add_argument("--policy", default="full_stack", help="preset name passed as options={'policy': ...}")
    p.add_argument("--optim", default="adamw", choices=("adamw", "qadamw"))
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per rank per step (default 16; tiny 4)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 1024; tiny 64)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (default 50304; tiny 384)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps incl. compile (default 5; tiny 2)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 20; tiny 3)")
    p.add_argument("--bf16-params", action="store_true",
                   help="FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) instead of autocast")
    p.add_argument("--no-reshard", action="store_true",
                   help="FSDP2 reshard_after_forward=False: keep each block's gathered parameters from forward to "
                        "backward (one all-gather per block per step instead of two; more memory)")
    p.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP gradient bucket size (default 25)")
    p.add_argument("--ns", action="store_true", help="benchmark distributed Newton–Schulz strategies instead")
    p.add_argument("--mode", default="default", choices=("default", "reduce-overhead"),
                   help="torch.compile mode (reduce-overhead = CUDA graphs; not with fsdp2)")
    p.add_argument("--profile", action="store_true",
                   help="after the timed steps, profile 3 more (every rank) and print rank 0's CUDA-kernel table "
                        "and top host ops: kernel time per step against ms/step shows whether a mode is host-bound")
    p.add_argument("--json", default=None, help="write the result row here (rank 0)")
    args = p.parse_args(argv)
    dflt = dict(micro_batch=4, seq=64, vocab=384, warmup=2, steps=3) if args.tiny else \
        dict(micro_batch=16, seq=1024, vocab=50304, warmup=5, steps=20)
    for k, v in dflt.items():
        if getattr(args, k) is None:
            setattr(args, k, v)

    env = D.setup("cpu" if args.tiny else None)
    dev = env.device
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    if args.ns:
        from fp4compile.train.model import config_from_preset

        return ns_bench(args, env, config_from_preset("tiny" if args.tiny else args.model))
    model, cfg = build_model(args, dev)
    n_params = sum(p.numel() for p in model.parameters())
    mode = None if args.mode == "default" else args.mode
    if mode is not None and args.parallel == "fsdp2":
        p.error("--mode reduce-overhead does not combine with --parallel fsdp2")
    fp4 = args.backend == "fullstack_fp4"
    mp = None
    if args.bf16_params and args.parallel == "fsdp2":
        mp = D.bf16_params_policy()
    if args.no_reshard and args.parallel != "fsdp2":
        p.error("--no-reshard is an FSDP2 option")
    kw = dict(mp_policy=mp, bucket_cap_mb=args.bucket_cap_mb if args.parallel == "ddp" else None)
    if args.no_reshard:
        kw["reshard_after_forward"] = False
    wrapped = D.wrap_for_training(model, args.parallel, args.backend, args.policy if fp4 else None, mode, **kw)
    opt = build_optimizer(model, args.optim)
    if args.parallel == "fsdp2":
        D.adapt_optimizer(opt)            # QAdamW on local shards (no-op for torch.optim.AdamW)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda" and mp is None)

    g = torch.Generator().manual_seed(1234 + env.rank)

    def step():
        idx = torch.randint(0, cfg.vocab_size, (args.micro_batch, args.seq + 1), generator=g).to(dev)
        if mode is not None:
            torch.compiler.cudagraph_mark_step_begin()
        with autocast:
            loss = wrapped(idx[:, :-1], idx[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        D.barrier()

    t0 = time.perf_counter()
    loss = step()
    sync()
    first_s = time.perf_counter() - t0
    for _ in range(args.warmup - 1):
        loss = step()
    sync()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    sync()
    dt = time.perf_counter() - t0
    tokens = args.steps * args.micro_batch * args.seq * env.world_size
    mem = peak_memory_gib(dev)
    mems = [mem]
    if env.distributed:
        mems = [None] * env.world_size
        torch.distributed.all_gather_object(mems, mem)
    last = D.reduce_metrics({"loss": loss})["loss"]
    row = {"parallel": args.parallel, "world_size": env.world_size, "model": "tiny" if args.tiny else args.model,
           "params_M": n_params / 1e6, "backend": args.backend, "policy": args.policy if fp4 else None,
           "optim": args.optim, "mode": args.mode, "micro_batch": args.micro_batch, "seq": args.seq,
           "global_batch": args.micro_batch * env.world_size, "tokens_per_s": tokens / dt,
           "ms_per_step": 1e3 * dt / args.steps, "first_step_s": first_s, "peak_mem_gib_per_rank": mems,
           "final_loss": last, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "torch": torch.__version__, "reshard_after_forward": not args.no_reshard, "bf16_params": args.bf16_params}
    if env.is_main:
        print("parallel  ranks  params(M)  tokens/s     ms/step  first(s)  peak GiB/rank  loss")
        print(f"{args.parallel:8s}  {env.world_size:5d}  {n_params / 1e6:9.1f}  {row['tokens_per_s']:11.0f}  "
              f"{row['ms_per_step']:7.1f}  {first_s:8.1f}  {' '.join(f'{m:.2f}' for m in mems):13s}  {last:.4f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(row, f, indent=1)
    if args.profile and dev.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        from bench.timing import kernel_table

        n = 3
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(n):
                step()
            sync()
            wall = time.perf_counter() - t0
        if env.is_main:
            print(f"\n== profile, rank 0, {n} steps: {1e3 * wall / n:.1f} ms/step under the profiler ==")
            print(kernel_table(prof, n, top=15))
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15), flush=True)
    D.teardown()
    return row


if __name__ == "__main__":
    main()
