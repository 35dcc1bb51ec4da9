"""Device time of each Q-Attn kernel at the GPT-124M step's shape, for the tree on ``PYTHONPATH`` (issue 4).

For comparing kernel versions across commits in one device call (the same machine, the same process order):
``PYTHONPATH=.ab/<rev> python bench/attention_kernels_at.py --label <rev>`` for each tree. Uses only the kernel
API that every tree since session 20 has (``attention_fwd`` / ``attention_bwd`` / ``quantize_2d`` and
``attention_ref.quantize_qkv``), with contiguous [B, H, T, D] inputs and dO, paper split and all-BF16 roles.
Prints one table row per (roles, kernel): mean device µs over 20 forward+backward calls (profiler), and a digest of
dQ, dK, dV (trees whose kernels compute the same values print the same digest).

    python bench/attention_kernels_at.py [--label NAME] [--shape B,H,T,D] [--sass] [--bwd-config JSON] [--masks M,...]

``--masks``: the role masks timed, in order (default ``paper,bf16``); ``paper1x16`` is the paper split with Q and K
in 1x16 blocks (``QK_1X16``: the dS products on the copies re-quantized in tiles by the backward's prep launch),
for trees since session 50.

``--sass``: also print, for every backward kernel the runs compiled (Triton's in-process cache), its registers,
spills, shared memory, SASS instruction count and a digest of its instruction sequence (addresses and encodings
dropped), and the same for the kernel as ``bench/attention_sass.py`` compiles it offline: whether two trees launch
the same machine code, and whether the offline compile is the launched one (issue 4's dK/dV question: session 29
found 310 µs for a tree whose offline SASS is that of the 271-µs kernel).
"""
from __future__ import annotations

import argparse
import hashlib
import json

import torch
from torch.profiler import ProfilerActivity, profile

import fp4compile
from fp4compile.kernels import attention as A
from fp4compile.kernels import attention_ref as R


def role_masks() -> dict:
    """The role masks this script times, by name: ``paper`` (the paper's split), ``bf16`` (every role BF16), and on
    trees since session 50 ``paper1x16`` (the paper's split with Q, K in 1x16 blocks)."""
    known = {"paper": R.PAPER_ROLES, "bf16": 0}
    if hasattr(R, "QK_1X16"):
        known["paper1x16"] = R.PAPER_ROLES | R.QK_1X16
    return known


def make_inputs(shape) -> tuple:
    """Q, K, V, dO: [B, H, T, D] BF16 on the GPU, the same values on every call (generator seed 0)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    return tuple(torch.randn(*shape, device="cuda", generator=g).bfloat16() for _ in range(4))


def make_step(q, k, v, do, mask: int, bwd_cfg=None):
    """The profiled unit: Q-Attn's forward and backward kernels (causal) with the role mask ``mask`` on Q, K, V's
    NVFP4 copies made once here; ``bwd_cfg`` overrides the backward's config where the mask has an NVFP4 role."""
    views = R.quantize_qkv(q, k, v, mask, quantize=A.quantize_2d)
    scale = q.shape[-1] ** -0.5

    def step():
        o, lse = A.attention_fwd(q, k, v, views, None, True, scale, mask)
        if mask and bwd_cfg:
            return A.attention_bwd(do, q, k, v, views, o, lse, None, True, scale, mask, config=bwd_cfg)
        return A.attention_bwd(do, q, k, v, views, o, lse, None, True, scale, mask)
    return step


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", default="this tree")
    ap.add_argument("--shape", default="16,12,1024,64")
    ap.add_argument("--sass", action="store_true", help="digest the launched backward kernels' SASS")
    ap.add_argument("--bwd-config", default="", help='JSON backward config override for the paper split, e.g. '
                    '\'{"dkdv": {"maxnreg": 160}}\' (trees since session 20 take attention_bwd(config=...))')
    ap.add_argument("--masks", default="paper,bf16", help="comma-separated of paper, paper1x16, bf16")
    args = ap.parse_args()
    known = role_masks()
    names = args.masks.split(",")
    if not set(names) <= set(known):
        ap.error(f"--masks: comma-separated of {sorted(known)}, got {args.masks!r}")
    masks = [(known[m], m) for m in names]
    bwd_cfg = json.loads(args.bwd_config) if args.bwd_config else None
    B, H, T, D = map(int, args.shape.split(","))
    q, k, v, do = make_inputs((B, H, T, D))
    print(f"# {args.label}: {fp4compile.__file__}, {torch.cuda.get_device_name()}, shape {B},{H},{T},{D}")
    for mask, name in masks:
        step = make_step(q, k, v, do, mask, bwd_cfg)
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
    if args.sass:
        sass_report(args.label, D)
    return 0


def _digest(cubin: bytes) -> tuple:
    """(instruction count, registers, local bytes, 12-hex digest of the instruction sequence) of a cubin: each
    SASS line without its address comment and encoding, so two compiles of the same code digest alike."""
    import re

    from fp4compile.kernels.offline import disassemble, sass_stats

    n, _, regs, local = sass_stats(cubin)
    lines = []
    for line in disassemble(cubin).splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?);", line)
        if m:
            lines.append(re.sub(r"\s+", " ", m.group(1)))
    return n, regs, local, hashlib.sha256("\n".join(lines).encode()).hexdigest()[:12]


def sass_report(label: str, D: int) -> None:
    """The launched backward kernels' machine code (from Triton's in-process cache) and the offline compile's."""
    import os
    import sys

    for kname in ("_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel"):
        fn = getattr(A, kname)
        for dev, caches in fn.device_caches.items():
            for key, k in caches[0].items():
                n, regs, local, dig = _digest(k.asm["cubin"])
                shared, warps, stages = (getattr(k.metadata, a, "?") for a in ("shared", "num_warps", "num_stages"))
                print(f"# {label} launched {kname}: {n} SASS, {regs} regs, {local} B local, shared {shared}, "
                      f"warps {warps}, stages {stages}, sequence {dig}, "
                      f"key {hashlib.sha256(str(key).encode()).hexdigest()[:12]}", flush=True)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        import attention_sass as S

        for kname in ("dkdv", "dq"):
            for fp4 in (False, True):
                n, regs, local, dig = _digest(S.compile_kernel(kname, D, fp4))
                print(f"# {label} offline {kname} fp4={fp4}: {n} SASS, {regs} regs, {local} B local, "
                      f"sequence {dig}", flush=True)
    except Exception as e:  # noqa: BLE001  (an old tree's kernel signature the offline spec does not fit)
        print(f"# {label} offline compile failed: {type(e).__name__}: {str(e)[:200]}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
