"""Q-Attn's forward quantization of Q and K with the Q, K transform (``smooth_k+hadamard``) outside or inside the
quantize launches (issues 3 and 4, session 58).

    python bench/qk_fold.py [--json FILE]

Q, K are split from one fused QKV projection ([B, T, 3C] -> [B, H, T, D] views with rows 3C apart), as the 124M
model makes them, and quantized as the full-stack forward does (16x16 tiles, with their bf16 code x scale). Kinds,
each one CUDA graph of 20 calls (``triton.testing.do_bench_cudagraph``, median):

  plain        ``quantize_many`` of Q, K untransformed: the lower bound (not the same numbers)
  op           ``fp4compile::smooth_rotate`` of Q and of K (kernels/rotate.py), then ``quantize_many``: the
               ``QK_TRANSFORM_IMPL="op"`` forward
  fused:OP:N   ``quantize_many(..., transforms)`` (``QK_TRANSFORM_IMPL="fused"``): the transform in the amax and
               quantize launches' registers, the rotation's operand built in registers ("regs") or loaded ("load")
               once per program of N slabs of 32 rows (``attention.HADAMARD_OPERAND``, ``attention.FOLD_SLABS``)

and prints each time, its ratio to ``op`` (below 1: the fold saves time) and to ``plain``. Every fused variant's
codes, scales, globals and bf16 copies are checked equal, bit for bit, to the first fused variant's (the same
products in the same tile shape), and the fraction of its codes equal to ``op``'s is printed (the op's rotation
sums in another tile shape, so a product can round one BF16 step apart).
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
#: (operand source, slabs per program) of the fused variants
FUSED = (("regs", 1), ("regs", 2), ("regs", 4), ("regs", 8), ("load", 1), ("load", 4), ("load", 8))


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
    _, src, nsub = kind.split(":")
    A.HADAMARD_OPERAND, A.FOLD_SLABS = src, int(nsub)
    return A.quantize_many([q, k], **flags, transforms=[(False, D), (True, D)])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import triton.testing

    import fp4compile.ops  # noqa: F401  (registers fp4compile::smooth_rotate)
    kinds = ["plain", "op"] + [f"fused:{s}:{n}" for s, n in FUSED]
    dev = torch.cuda.get_device_name()
    print(f"Q, K forward quantization with the transform; {dev}, torch {torch.__version__}")
    rows = []
    saved = (A.HADAMARD_OPERAND, A.FOLD_SLABS)
    try:
        for B, H, T, D in SHAPES:
            q, k = split_qk(B, H, T, D)
            outs = {kind: run_kind(kind, q, k) for kind in kinds}
            first = outs[kinds[2]]
            times = {}
            for kind in kinds:
                if kind.startswith("fused"):
                    same = all(torch.equal(a, b) for o1, o2 in zip(outs[kind], first) for a, b in zip(o1, o2))
                    if not same:
                        raise SystemExit(f"{kind} differs from {kinds[2]} at {(B, H, T, D)}")
                times[kind] = triton.testing.do_bench_cudagraph(lambda: run_kind(kind, q, k), rep=200) * 1e3
                torch.cuda.synchronize()
            op_codes = [o[0] for o in outs["op"]]
            print(f"\n[B, H, T, D] = {[B, H, T, D]}")
            print(f"{'kind':<16}{'us':>9}{'vs op':>8}{'vs plain':>10}  codes equal to op's")
            for kind in kinds:
                eq = ""
                if kind.startswith("fused"):
                    eq = "  ".join(f"{(a == b).float().mean().item():.5f}"
                                   for a, b in zip((o[0] for o in outs[kind]), op_codes))
                print(f"{kind:<16}{times[kind]:9.1f}{times[kind] / times['op']:8.3f}"
                      f"{times[kind] / times['plain']:10.3f}  {eq}")
                rows.append(dict(shape=[B, H, T, D], kind=kind, us=times[kind], vs_op=times[kind] / times["op"]))
    finally:
        A.HADAMARD_OPERAND, A.FOLD_SLABS = saved
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(dict(date=datetime.date.today().isoformat(), device=dev, rows=rows)) + "\n")


if __name__ == "__main__":
    main()
