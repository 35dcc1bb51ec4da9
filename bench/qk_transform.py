"""Q-Attn's Q, K transform (``smooth_k+hadamard``) alone, forward + backward, on the GPU (issue 3).

    python bench/qk_transform.py [--json FILE]

Q, K are split from one fused QKV projection ([B, T, 3C] -> [B, H, T, D] views with rows 3C apart, as nanoGPT
and the 124M benchmark model make them). Three ways, each compiled with Inductor and timed forward + backward
(``triton.testing.do_bench``, median; a random cotangent):

  aten   ``attention_ref.qk_transform`` as aten ops (``QK_TRANSFORM_IMPL="torch"``)
  op     ``fp4compile::smooth_rotate`` per tensor (``QK_TRANSFORM_IMPL="op"``, the default since session 39;
         kernels/rotate.py)
  copy   the baseline: ``clone`` of Q and K forward and of their gradients backward, the fewest bytes any
         transform must move (read Q, K and write Q', K'; the same for the gradients)

and prints each time and its ratio to the copy (1.0 = at copy bandwidth), plus the op's largest difference from
the aten forward in BF16 steps of the tensor's largest magnitude (a sum of 64 or 128 products that cancels to near 0
differs in many steps of its own tiny value when the FP32 summation order differs, and in none at the tensor's scale)
and the fraction of elements that differ at all. ``--profile`` adds, per kind, its GPU kernels' summed time per
forward + backward from ``torch.profiler`` (the gap to the timed median is host time: launches, autograd, guards).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from fp4compile import ops  # noqa: E402,F401  (registers the ops and their CUDA kernels)
from fp4compile.kernels import attention_ref as R  # noqa: E402
from fp4compile.passes.attention import _smooth_rotate_op  # noqa: E402

SHAPES = [(16, 1024, 12, 64), (4, 4096, 16, 128)]   # (B, T, H, D): the 124M step's layer; a long-context one
HOW = "smooth_k+hadamard"


def split_qk(qkv: torch.Tensor, H: int, D: int):
    B, T, _ = qkv.shape
    q, k, _ = (t.view(B, T, H, D).transpose(1, 2) for t in qkv.split(H * D, dim=2))
    return q, k


def make(kind: str, H: int, D: int):
    if kind == "copy":
        def f(qkv):
            q, k = split_qk(qkv, H, D)
            return q.clone(), k.clone()
    else:
        op = _smooth_rotate_op if kind == "op" else None

        def f(qkv):
            q, k = split_qk(qkv, H, D)
            q2, k2, _ = R.qk_transform(q, k, HOW, op=op)
            return q2, k2
    return torch.compile(f, fullgraph=True)


def bf16_step(m: torch.Tensor) -> float:
    """The spacing of BF16 numbers at magnitude ``m`` (8 significant bits)."""
    return float(torch.ldexp(torch.ones(()), torch.frexp(m.cpu().clamp_min(1e-30))[1] - 8))


def profile_kind(kind: str, shape, step, qkv, n: int = 10) -> None:
    """Print ``kind``'s summed GPU kernel time per forward + backward and its three longest kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
            qkv.grad = None
        torch.cuda.synchronize()
    ev = [e for e in prof.key_averages() if e.self_device_time_total > 0]   # CUDA activity only: kernels, copies
    total = sum(e.self_device_time_total for e in ev) / n
    top = sorted(ev, key=lambda e: -e.self_device_time_total)[:3]
    print(f"{str(shape):>18} {kind:>6} GPU kernels {total:9.1f} us per fwd+bwd; longest: "
          + "; ".join(f"{e.key[:48]} {e.self_device_time_total / n:.1f} us x{e.count // n}" for e in top))


def main():
    import triton

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", action="store_true", help="also print each kind's GPU kernel time and top kernels")
    args = ap.parse_args()
    dev = torch.cuda.get_device_name()
    print(f"Q, K transform ({HOW}) forward + backward; {dev}, torch {torch.__version__}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"{'B,T,H,D':>18} {'kind':>6} {'us':>9} {'copy/kind':>10}")
    rows = []
    for B, T, H, D in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        qkv = (torch.randn(B, T, 3 * H * D, device="cuda", generator=g)
               + 2.0 * torch.randn(3 * H * D, device="cuda", generator=g)).bfloat16().requires_grad_()
        cot = [torch.randn(B, H, T, D, device="cuda", generator=g).bfloat16() for _ in range(2)]
        outs, times = {}, {}
        for kind in ("copy", "aten", "op"):
            f = make(kind, H, D)

            def step():
                o = f(qkv)
                torch.autograd.backward(o, cot)
                return o

            outs[kind] = [t.detach() for t in step()]
            qkv.grad = None
            times[kind] = triton.testing.do_bench(step, grad_to_none=[qkv], warmup=25, rep=200,
                                                  return_mode="median") * 1e3
            if args.profile:
                profile_kind(kind, (B, T, H, D), step, qkv)
        for kind in ("copy", "aten", "op"):
            r = times["copy"] / times[kind]
            print(f"{str((B, T, H, D)):>18} {kind:>6} {times[kind]:9.1f} {r:10.3f}")
            rows.append({"shape": [B, T, H, D], "kind": kind, "us": times[kind], "copy_ratio": r})
        steps = max(float((a.float() - b.float()).abs().max() / bf16_step(b.float().abs().max()))
                    for a, b in zip(outs["op"], outs["aten"]))
        frac = sum(int((a != b).sum()) for a, b in zip(outs["op"], outs["aten"])) / sum(
            b.numel() for b in outs["aten"])
        print(f"{'':>18} op vs aten forward: largest difference {steps:.3f} BF16 steps at the tensor's largest "
              f"magnitude; {frac:.2e} of the elements differ")
        rows.append({"shape": [B, T, H, D], "op_vs_aten_steps_at_max": steps, "op_vs_aten_frac_differ": frac})
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": dev, "torch": torch.__version__, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
