"""Device time of each Q-Attn kernel at the GPT-124M step's shape, for the tree on ``PYTHONPATH`` (issue 4).

For comparing kernel versions across commits in one device call (the same machine, the same process order):
``PYTHONPATH=.ab/<rev> python bench/attention_kernels_at.py --label <rev>`` for each tree. Uses only the kernel
API that every tree since session 20 has (``attention_fwd`` / ``attention_bwd`` / ``quantize_2d`` and
``attention_ref.quantize_qkv``), with contiguous [B, H, T, D] inputs and dO, paper split and all-BF16 roles.
Prints one table row per (roles, kernel): mean device µs over 20 forward+backward calls (profiler), and a digest of
dQ, dK, dV (trees whose kernels compute the same values print the same digest).

    python bench/attention_kernels_at.py [--label NAME] [--shape B,H,T,D]
"""
from __future__ import annotations

import argparse
import hashlib

import torch
from torch.profiler import ProfilerActivity, profile

import fp4compile
from fp4compile.kernels import attention as A
from fp4compile.kernels import attention_ref as R


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default="this tree")
    ap.add_argument("--shape", default="16,12,1024,64")
    args = ap.parse_args()
    B, H, T, D = map(int, args.shape.split(","))
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, H, T, D, device="cuda", generator=g).bfloat16() for _ in range(4))
    print(f"# {args.label}: {fp4compile.__file__}, {torch.cuda.get_device_name()}, shape {B},{H},{T},{D}")
    for mask, name in ((R.PAPER_ROLES, "paper"), (0, "bf16")):
        views = R.quantize_qkv(q, k, v, mask, quantize=A.quantize_2d)

        def step():
            o, lse = A.attention_fwd(q, k, v, views, None, True, D ** -0.5, mask)
            return A.attention_bwd(do, q, k, v, views, o, lse, None, True, D ** -0.5, mask)

        for _ in range(3):
            grads = step()
        torch.cuda.synchronize()
        digest = hashlib.sha256(b"".join(g.float().cpu().numpy().tobytes() for g in grads[:3])).hexdigest()[:16]
        print(f"# {args.label} {name}: sha256 of dQ, dK, dV {digest}", flush=True)
        n = 20
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                step()
            torch.cuda.synchronize()
        for e in sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total):
            if "_kernel" in e.key and e.self_device_time_total > 0:
                print(f"| {args.label} | {name} | {e.key} | {e.self_device_time_total / n:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
