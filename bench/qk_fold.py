"""Q-Attn's forward quantization of Q and K with the Q, K transform (``smooth_k+hadamard``) outside or inside the
quantize launches (issues 3 and 4, session 58).

    python bench/qk_fold.py [--json FILE]

Q, K are split from one fused QKV projection ([B, T, 3C] -> [B, H, T, D] views with rows 3C apart), as the 124M
model makes them, and quantized as the full-stack forward does (16x16 tiles, with their bf16 code x scale). Kinds,
each one CUDA graph of 20 calls (``triton.testing.do_bench_cudagraph``, median):

  plain        ``quantize_many`` of Q, K untransformed: the lower bound (not the same numbers)
  op           ``fp4compile::smooth_rotate`` of Q and of K (kernels/rotate.py), then ``quantize_many``: the
               ``QK_TRANSFORM_IMPL="op"`` forward
  fused        ``quantize_many(..., transforms)`` (``QK_TRANSFORM_IMPL="fused"``): the transform in the amax and
               quantize launches' registers, the rotation's +-1 operand built by every program

and prints each time, its ratio to ``op`` (below 1: the fold saves time) and to ``plain``, and the fraction of
fused's codes equal to ``op``'s (the op's rotation sums in another tile shape, so a product can round one BF16 step
apart). Session 58 also timed, at tree ``230201f`` (reverted), the operand loaded from a cached copy and made once per
2..8 slabs of 32 rows: none was faster than ``op`` (``docs/BENCHMARKS.md``, session 58).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from fp4compile.kernels import attention as A  # noqa: E402

#: (B, H, T, D): the 124M step's attention, and a long one with head dim 128
SHAPES = ((16, 12, 1024, 64), (4, 16, 4096, 128))


def split_qk(B: int, H: int, T: int, D: int, device="cuda"):
    g = torch.Generator(device=device).manual_seed(0)
    qkv = torch.randn(B, T, 3 * H * D, device=device, generator=g)
    qkv = (qkv + 2.0 * torch.randn(3 * H * D, device=device, generator=g)).bfloat16()
    q, k, _ = (t.view(B, T, H, D).transpose(1, 2) for t in qkv.split(H * D, dim=2))
    return q, k


def run_kind(kind: str, q, k):
    """One forward quantization of Q, K by ``kind``: [(codes, scales, global, bf16 code x scale)] for Q and K."""
    D = q.shape[-1]
    flags = dict(dequantized=[True, True], tiles=[True, True])
    if kind == "plain":
        return A.quantize_many([q, k], **flags)
    if kind == "op":
        rot = torch.ops.fp4compile.smooth_rotate
        return A.quantize_many([rot(q, False, D, False), rot(k, True, D, False)], **flags)
    return A.quantize_many([q, k], **flags, transforms=[(False, D), (True, D)])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import triton.testing

    import fp4compile.ops  # noqa: F401  (registers fp4compile::smooth_rotate)
    kinds = ["plain", "op", "fused"]
    dev = torch.cuda.get_device_name()
    print(f"Q, K forward quantization with the transform; {dev}, torch {torch.__version__}")
    rows = []
    for B, H, T, D in SHAPES:
        q, k = split_qk(B, H, T, D)
        outs = {kind: run_kind(kind, q, k) for kind in kinds}
        times = {}
        for kind in kinds:
            times[kind] = triton.testing.do_bench_cudagraph(lambda: run_kind(kind, q, k), rep=200) * 1e3
        eq = "  ".join(f"{(a[0] == b[0]).float().mean().item():.5f}" for a, b in zip(outs["fused"], outs["op"]))
        print(f"\n[B, H, T, D] = {[B, H, T, D]}; fused's Q, K codes equal to op's: {eq}")
        print(f"{'kind':<8}{'us':>9}{'vs op':>8}{'vs plain':>10}")
        for kind in kinds:
            print(f"{kind:<8}{times[kind]:9.1f}{times[kind] / times['op']:8.3f}{times[kind] / times['plain']:10.3f}")
            rows.append(dict(shape=[B, H, T, D], kind=kind, us=times[kind], vs_op=times[kind] / times["op"]))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(dict(date=datetime.date.today().isoformat(), device=dev, rows=rows)) + "\n")


if __name__ == "__main__":
    main()
