"""Q-Attn's Q, K transform (``smooth_k+hadamard``) alone, forward + backward, on the GPU (issue 3).

    python bench/qk_transform.py [--json FILE]

Q, K are split from one fused QKV projection ([B, T, 3C] -> [B, H, T, D] views with rows 3C apart, as nanoGPT
and the 124M benchmark model make them). Four ways, each compiled with Inductor and timed forward + backward
(``triton.testing.do_bench``, median; a random cotangent):

  aten   ``attention_ref.qk_transform`` as aten ops (``QK_TRANSFORM_IMPL="torch"``)
  op     ``fp4compile::smooth_rotate`` per tensor (``QK_TRANSFORM_IMPL="op"``, the default since session 39;
         kernels/rotate.py)
  op_tmean  the op with K's mean (and its gradient's) by the partial-sums kernel instead of ``torch.mean``
         (``kernels.rotate.MEAN_IMPL = "triton"``, ``FP4COMPILE_ROTATE_MEAN=triton``; session 40)
  copy   the baseline: ``clone`` of Q and K forward and of their gradients backward, the fewest bytes any
         transform must move (read Q, K and write Q', K'; the same for the gradients)

and prints each time and its ratio to the copy (1.0 = at copy bandwidth), plus the op's largest difference from
the aten forward (and op_tmean's from the op's) in BF16 steps of the tensor's largest magnitude (a sum of 64 or 128
products that cancels to near 0 differs in many steps of its own tiny value when the FP32 summation order differs,
and in none at the tensor's scale) and the fraction of elements that differ at all. ``--profile`` adds, per kind,
its GPU kernels' summed time per forward + backward from ``torch.profiler`` (the gap to the timed median is host
time: launches, autograd, guards).
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
from fp4compile.kernels import rotate as _rot  # noqa: E402
from fp4compile.passes.attention import _smooth_rotate_op  # noqa: E402

SHAPES = [(16, 1024, 12, 64), (4, 4096, 16, 128)]   # (B, T, H, D): the 124M step's layer; a long-context one
HOW = "smooth_k+hadamard"
KINDS = ("copy", "aten", "op", "op_tmean")


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
        op = _smooth_rotate_op if kind.startswith("op") else None

        def f(qkv):
            q, k = split_qk(qkv, H, D)
            q2, k2, _ = R.qk_transform(q, k, HOW, op=op)
            return q2, k2
    return torch.compile(f, fullgraph=True)


def mean_impl(kind: str, default: str) -> str:
    """The ``kernels.rotate.MEAN_IMPL`` that ``kind`` runs with (read by the op's CUDA implementation per call)."""
    return "triton" if kind == "op_tmean" else default


def bf16_step(m: torch.Tensor) -> float:
    """The spacing of BF16 numbers at magnitude ``m`` (8 significant bits)."""
    return float(torch.ldexp(torch.ones(()), torch.frexp(m.cpu().clamp_min(1e-30))[1] - 8))


def difference(got, want) -> tuple:
    """(largest difference in BF16 steps at the tensors' largest magnitude, fraction of elements that differ)."""
    steps = max(float((a.float() - b.float()).abs().max() / bf16_step(b.float().abs().max()))
                for a, b in zip(got, want))
    frac = sum(int((a != b).sum()) for a, b in zip(got, want)) / sum(b.numel() for b in want)
    return steps, frac


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
    print(f"{str(shape):>18} {kind:>8} GPU kernels {total:9.1f} us per fwd+bwd; longest: "
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
    print(f"{'B,T,H,D':>18} {'kind':>8} {'us':>9} {'copy/kind':>10}")
    rows = []
    for B, T, H, D in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        qkv = (torch.randn(B, T, 3 * H * D, device="cuda", generator=g)
               + 2.0 * torch.randn(3 * H * D, device="cuda", generator=g)).bfloat16().requires_grad_()
        cot = [torch.randn(B, H, T, D, device="cuda", generator=g).bfloat16() for _ in range(2)]
        outs, times = {}, {}
        default = _rot.MEAN_IMPL
        for kind in KINDS:
            f = make(kind, H, D)

            def step():
                _rot.MEAN_IMPL = mean_impl(kind, default)
                o = f(qkv)
                torch.autograd.backward(o, cot)
                return o

            outs[kind] = [t.detach() for t in step()]
            qkv.grad = None
            times[kind] = triton.testing.do_bench(step, grad_to_none=[qkv], warmup=25, rep=200,
                                                  return_mode="median") * 1e3
            if args.profile:
                profile_kind(kind, (B, T, H, D), step, qkv)
        _rot.MEAN_IMPL = default
        for kind in KINDS:
            r = times["copy"] / times[kind]
            print(f"{str((B, T, H, D)):>18} {kind:>8} {times[kind]:9.1f} {r:10.3f}")
            rows.append({"shape": [B, T, H, D], "kind": kind, "us": times[kind], "copy_ratio": r})
        for a_kind, b_kind in (("op", "aten"), ("op_tmean", "op")):
            steps, frac = difference(outs[a_kind], outs[b_kind])
            print(f"{'':>18} {a_kind} vs {b_kind} forward: largest difference {steps:.3f} BF16 steps at the "
                  f"tensor's largest magnitude; {frac:.2e} of the elements differ")
            rows.append({"shape": [B, T, H, D], f"{a_kind}_vs_{b_kind}_steps_at_max": steps,
                         f"{a_kind}_vs_{b_kind}_frac_differ": frac})
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": dev, "torch": torch.__version__, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
