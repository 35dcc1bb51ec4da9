"""A lower bound on what NVFP4 adds to a training step on a GPU without FP4 tensor cores (issue 3's 0.9× target),
from the model's shapes and the policy alone (CPU, no GPU, a second).

    python bench/step_bound.py                       # GPT-124M of bench/train_step.py, B=16, T=1024, full_stack
    python bench/step_bound.py --policy quartet2 --bf16-ms 31.07 --copy-gbs 4223

Every NVFP4 GEMM operand is a quantization of a BF16 tensor that the policy's recipe makes per step: for a linear
Y = X Wᵀ with X [T, K], W [N, K] and NVFP4 fprop, dgrad, wgrad: X and W (fprop), dY and W along N (dgrad), dYᵀ
and Xᵀ along the tokens (wgrad); for Q-Attn's QKᵀ (``attn.qk``): Q and K. (dS and the sequence-wise copies of
Q, K for dQ = dS K and dK = dSᵀ Q live inside the attention kernels and move no HBM bytes of their own.) The
script counts those operand copies and their sources and bounds the bytes as if every source tensor were read once
(2 B per element) for all its copies, by the best fusion there could be (X's fprop and wgrad copies both made in
the forward, dY's two copies in one pass, W's two in the forward), with no amax pass, no second pass for MS-EDEN's
scales and no transposing copy; and each copy written once:

- ``ideal``: 0.5625 B per element (the codes and E4M3 scales), and a GEMM that consumes the codes at BF16
  tensor-core speed. What a GPU with FP4 tensor cores approaches.
- ``bf16 tensor cores``: 2 B per element: the copy leaves its quantization as the bf16 q·S that a BF16 tensor-core
  GEMM reads (in place of the BF16 source the BF16 step's GEMM reads, so the GEMM's own traffic is unchanged). This
  is how the step runs on sm_90 (the GEMMs dequantize in a pass of their own; Triton GEMMs that dequantize in their
  main loop measured 0.15–0.55× of cuBLAS BF16, docs/BENCHMARKS.md session 25).

Time = bytes / the copy bandwidth (default: 4,223 GB/s, a bf16 copy on the H200, docs/BENCHMARKS.md), every pass
assumed at that bandwidth. The best ratio to BF16 is then BF16 step / (BF16 step + bound). Both bounds leave out
everything else NVFP4 costs (RHT, the MS-EDEN arithmetic, the 4/6 search, Q-Attn's kernels, seeds, launch gaps), so
a real step is slower.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

#: bytes written per element of one operand copy: codes + E4M3 scales, or the bf16 q·S a BF16 GEMM reads
IDEAL = 0.5 + 1 / 16
BF16_TC = 2.0


def operand_elements(model: nn.Module, policy, tokens: int, head_dim_total=None) -> list:
    """Rows (module path, role, operand, elements) of every NVFP4 operand quantization one training step of
    ``model`` makes under ``policy`` with ``tokens`` tokens per step. ``head_dim_total``: {attention module path:
    H·D} for the ``attn.qk`` rows (Q and K, [tokens, H·D] each); None: no attention rows."""
    rows = []
    for path, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        n, k = mod.out_features, mod.in_features
        roles = {r: policy.resolve(path, r) for r in ("linear.fprop", "linear.dgrad", "linear.wgrad")}
        fp4 = {r: s.name == "nvfp4" for r, s in roles.items()}
        if fp4["linear.fprop"]:
            which = roles["linear.fprop"].operands
            if which in ("both", "activation"):
                rows.append((path, "linear.fprop", "X", tokens * k))
            if which in ("both", "weight"):
                rows.append((path, "linear.fprop", "W", n * k))
        if fp4["linear.dgrad"]:
            rows += [(path, "linear.dgrad", "dY", tokens * n), (path, "linear.dgrad", "W", n * k)]
        if fp4["linear.wgrad"]:
            rows += [(path, "linear.wgrad", "dY", tokens * n), (path, "linear.wgrad", "X", tokens * k)]
    for path, hd in (head_dim_total or {}).items():
        if policy.resolve(path, "attn.qk").name == "nvfp4":
            rows += [(path, "attn.qk", "Q", tokens * hd), (path, "attn.qk", "K", tokens * hd)]
    return rows


def traffic(rows, per_copy_write: float) -> dict:
    """{kind: (source elements, copy elements, bytes)} of :func:`operand_elements`' rows: one 2-byte read of each
    distinct source tensor (module path, operand) for all its copies (the best any fusion can do: X's fprop and
    wgrad copies both made in the forward, dY's two in one backward pass, W's two in the forward) and
    ``per_copy_write`` bytes written per element of each copy. ``kind``: the operand (X, W, dY, Q/K)."""
    seen, src, copies = set(), {}, {}
    for path, _, operand, n in rows:
        kind = "Q/K" if operand in ("Q", "K") else operand
        copies[kind] = copies.get(kind, 0) + n
        if (path, operand) not in seen:                 # the source's one read, at its first copy
            seen.add((path, operand))
            src[kind] = src.get(kind, 0) + n
    return {k: (src[k], c, 2.0 * src[k] + per_copy_write * c) for k, c in copies.items()}


def bound_ms(nbytes: float, copy_gbs: float) -> float:
    """Milliseconds to move ``nbytes`` at ``copy_gbs`` GB/s."""
    return nbytes / (copy_gbs * 1e9) * 1e3


def main(argv=None):
    from bench.train_step import GPT, policy_for

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policy", default="full_stack", help="full_stack | quartet2 | rtn (bench/train_step.py)")
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--bf16-ms", type=float, default=31.07,
                    help="the BF16 step's ms (default: session 39's step_ab, CUDA graphs, H200)")
    ap.add_argument("--copy-gbs", type=float, default=4223.0, help="copy bandwidth, GB/s (default: H200, bf16)")
    args = ap.parse_args(argv)
    with torch.device("meta"):
        model = GPT(block_size=args.T)
    policy = policy_for(args.policy)
    attn = {f"h.{i}": model.h[i].c_attn.in_features for i in range(len(model.h))} \
        if args.policy == "full_stack" else {}
    rows = operand_elements(model, policy, args.B * args.T, attn)
    lo_t, hi_t = traffic(rows, IDEAL), traffic(rows, BF16_TC)
    n_src, n_cp = sum(v[0] for v in lo_t.values()), sum(v[1] for v in lo_t.values())
    print(f"GPT-124M (bench/train_step.py), B={args.B}, T={args.T}, policy {args.policy}: {len(rows)} NVFP4 operand "
          f"copies per step ({n_cp / 1e9:.3f} G elements) of {n_src / 1e9:.3f} G source elements; copy bandwidth "
          f"{args.copy_gbs:,.0f} GB/s, BF16 step {args.bf16_ms} ms\n")
    print("| operand | source G elements | copies, G elements | ideal ms | bf16 tensor cores ms |")
    print("|---|---|---|---|---|")
    for kind in lo_t:
        s_, c_, b_lo = lo_t[kind]
        print(f"| {kind} | {s_ / 1e9:.3f} | {c_ / 1e9:.3f} | {bound_ms(b_lo, args.copy_gbs):.2f} | "
              f"{bound_ms(hi_t[kind][2], args.copy_gbs):.2f} |")
    lo = bound_ms(sum(v[2] for v in lo_t.values()), args.copy_gbs)
    hi = bound_ms(sum(v[2] for v in hi_t.values()), args.copy_gbs)
    print(f"| **total** | {n_src / 1e9:.3f} | {n_cp / 1e9:.3f} | {lo:.2f} | {hi:.2f} |")
    print(f"\nbest step ratio to BF16: ideal {args.bf16_ms / (args.bf16_ms + lo):.3f}×, "
          f"bf16 tensor cores {args.bf16_ms / (args.bf16_ms + hi):.3f}×; 0.9× allows "
          f"{args.bf16_ms / 0.9 - args.bf16_ms:.2f} ms of NVFP4 overhead")


if __name__ == "__main__":
    main()
