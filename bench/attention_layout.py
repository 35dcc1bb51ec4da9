"""Q-Attn backward: what the memory layout of dO and of the gradients costs (issue 4, session 26).

The op stores O, dQ, dK, dV as [B, T, H, D] (``kernels.attention.bthd_empty``, SDPA's layout), so that a GPT's
head merge and the Q/K/V gradient concatenation are views or row copies; dO then arrives in that layout too. This
times ``attention_bwd`` (kernel level, ``triton.testing.do_bench``, median) and each backward kernel (profiler) for
dO contiguous [B, H, T, D] or [B, T, H, D] (read in place), and gradients written [B, T, H, D] or contiguous (the
latter by swapping ``bthd_empty`` for a contiguous allocation), at the GPT-124M step's shape and at the attention
table's. (Session 26 also timed a contiguous dO copy written by the backward's prep launch, commit 87f13e9: no gain
in the step, removed.)

    python bench/attention_layout.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from fp4compile.kernels import attention as A  # noqa: E402
from fp4compile.kernels import attention_ref as R  # noqa: E402

BTHD = A.bthd_empty


def _contig(B, H, T, D, dtype, device):
    return torch.empty((B, H, T, D), dtype=dtype, device=device)


def main() -> int:
    print(torch.__version__, torch.cuda.get_device_name())
    print("| shape (B, H, T, D) | roles | dO layout | grads layout | bwd ms | vs first row | dkdv us | dq us "
          "| prep us |")
    print("|---|---|---|---|---|---|---|---|---|")
    for B, H, T, D in ((16, 12, 1024, 64), (4, 16, 4096, 64), (4, 16, 4096, 128)):
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, T, H, D, device="cuda", generator=g).bfloat16().transpose(1, 2) for _ in range(3))
        for mask, name in ((R.PAPER_ROLES, "paper"), (0, "bf16")):
            views = R.quantize_qkv(q, k, v, mask, quantize=A.quantize_2d)
            o, lse = A.attention_fwd(q, k, v, views, None, True, D ** -0.5, mask)
            base = None
            do0 = torch.randn(B, H, T, D, device="cuda", generator=g).bfloat16()
            for do_l, g_l in (("BHTD", "BHTD"), ("BHTD", "BTHD"), ("BTHD", "BHTD"), ("BTHD", "BTHD")):
                do = do0 if do_l == "BHTD" else do0.transpose(1, 2).contiguous().transpose(1, 2)
                A.bthd_empty = BTHD if g_l == "BTHD" else _contig
                fn = lambda: A.attention_bwd(do, q, k, v, views, o, lse, None, True, D ** -0.5, mask)  # noqa
                ms = do_bench(fn, warmup=5, rep=50, return_mode="median")
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(5):
                        fn()
                    torch.cuda.synchronize()
                ks = {e.key: e.self_device_time_total / 5 for e in prof.key_averages() if "_kernel" in e.key}
                base = base or ms
                print(f"| {B}, {H}, {T}, {D} | {name} | {do_l} | {g_l} | "
                      f"{ms:.3f} | {base / ms:.3f} | {ks.get('_attn_bwd_dkdv_kernel', 0):.0f} | "
                      f"{ks.get('_attn_bwd_dq_kernel', 0):.0f} | {ks.get('_bwd_prep_kernel', 0):.0f} |", flush=True)
            A.bthd_empty = BTHD
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
