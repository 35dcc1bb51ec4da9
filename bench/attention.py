"""Q-Attn on the GPU: correctness against the float64 reference, then time vs torch SDPA (cuDNN/flash, BF16).

    python bench/attention.py [--out DIR] [--quick]

Correctness (FlashAttention's rule, relative Frobenius errors): err(Triton) <= 2·err(torch FP32 + BF16-rounding
implementation of the same mixed-precision math) + 1e-3, against float64 with the same NVFP4 operands; the
all-BF16 roles against torch SDPA in the same form; opcheck of the CUDA op.

Benchmark: B·H = 64 (B=4, H=16), T in {1024, 2048, 4096}, d in {64, 128}, causal, bf16. Forward and
forward+backward through autograd, for torch SDPA (whatever backend torch picks), qattn with the paper's split
(QKᵀ, dS·K, dSᵀ·Q NVFP4; includes quantizing Q/K), and qattn with all six roles BF16 (the same Triton kernels
without FP4: separates the kernels' quality from the cost of FP4). FLOPs: causal forward 2·B·H·T²·d (half of
4·B·H·T²·d), backward 2.5× forward; TFLOP/s are against the 790 TFLOP/s BF16 matmul rate measured on this GPU.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fp4compile.ops  # noqa: E402,F401
from fp4compile.kernels import attention as A  # noqa: E402
from fp4compile.kernels import attention_ref as R  # noqa: E402
from fp4compile.passes.attention import qattn_sdpa  # noqa: E402

CEILING = 790.0
LOG = []


def say(*a):
    line = " ".join(str(x) for x in a)
    print(line, flush=True)
    LOG.append(line)


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def check(mask, causal, B, H, Hkv, T, D, mk=None):
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, H, T, D, device=dev, generator=g).bfloat16()
    k = torch.randn(B, Hkv, T, D, device=dev, generator=g).bfloat16()
    v = torch.randn(B, Hkv, T, D, device=dev, generator=g).bfloat16()
    do = torch.randn(B, H, T, D, device=dev, generator=g).bfloat16()
    am = None
    if mk:
        keep = torch.rand(B, 1, T, T, device=dev, generator=g) > 0.3
        keep[..., 0] = True
        am = keep if mk == "bool" else torch.where(keep, torch.randn(keep.shape, device=dev, generator=g),
                                                   torch.full(keep.shape, -1e4, device=dev))
    sc = 1 / math.sqrt(D)
    views = R.quantize_qkv(q, k, v, mask, quantize=A.quantize_2d)
    ref_views = R.quantize_qkv(q, k, v, mask)
    same = all(torch.equal(a, b) for a, b in zip(views, ref_views))
    o, lse = A.attention_fwd(q, k, v, views, am, causal, sc, mask)
    o64, l64 = R.attention_fwd_ref(q, k, v, views, am, causal, sc, mask, out_dtype=torch.float64)
    opt, lpt = R.attention_fwd_ref(q, k, v, views, am, causal, sc, mask, dtype=torch.float32, emulate_bf16=True)
    gr = A.attention_bwd(do, q, k, v, views, o, lse, am, causal, sc, mask)
    g64 = R.attention_bwd_ref(do, q, k, v, views, o64, l64, am, causal, sc, mask, out_dtype=torch.float64)
    gpt = R.attention_bwd_ref(do, q, k, v, views, opt, lpt, am, causal, sc, mask, dtype=torch.float32,
                              emulate_bf16=True)
    ok = same and (lse.double() - l64).abs().max().item() < 1e-4
    parts = []
    for name, a, b, c in [("O", o, opt, o64)] + list(zip(("dQ", "dK", "dV"), gr, gpt, g64)):
        ek, ep = rel(a, c), rel(b, c)
        ok &= ek <= 2 * ep + 1e-3
        parts.append(f"{name} {ek:.4f}/{ep:.4f}")
    say(f"check roles={mask:06b} causal={causal} B{B} H{H}/{Hkv} T{T} d{D} mask={mk}: quant2d==ref {same}; "
        f"kernel/pt rel err: {', '.join(parts)} -> {'PASS' if ok else 'FAIL'}")
    if mask == 0 and mk is None:  # all-BF16 roles vs torch SDPA
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = qattn_sdpa(*leaves, is_causal=causal, enable_gqa=H != Hkv, fp4_roles=0)
        gq = torch.autograd.grad(out, leaves, do)
        sd = [t.clone().requires_grad_() for t in (q, k, v)]
        so = F.scaled_dot_product_attention(*sd, is_causal=causal, enable_gqa=H != Hkv)
        gs = torch.autograd.grad(so, sd, do)
        s64 = [t.double().requires_grad_() for t in (q, k, v)]
        o_64 = R.sdpa_math_ref(*s64, is_causal=causal)
        g_64 = torch.autograd.grad(o_64, s64, do.double())
        errs = [(rel(out, o_64), rel(so, o_64))] + [(rel(a, c), rel(b, c)) for a, b, c in zip(gq, gs, g_64)]
        ok2 = all(a <= 2 * b + 1e-3 for a, b in errs)
        say("check bf16 roles vs SDPA (qattn/sdpa rel err vs fp64): "
            + ", ".join(f"{n} {a:.4f}/{b:.4f}" for n, (a, b) in zip(("O", "dQ", "dK", "dV"), errs))
            + f" -> {'PASS' if ok2 else 'FAIL'}")
        ok &= ok2
    return ok


def bench_one(fn, warmup=3, rep=20):
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep)


def bench(quick=False):
    rows = []
    B, H = 4, 16
    Ts = (1024, 2048) if quick else (1024, 2048, 4096)
    for D in (64, 128):
        for T in Ts:
            q, k, v, do = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            fl_f = 2.0 * B * H * T * T * D  # causal forward
            fl_fb = fl_f * 3.5
            res = {}
            impls = {
                "sdpa": lambda *a: F.scaled_dot_product_attention(*a, is_causal=True),
                "qattn paper": lambda *a: qattn_sdpa(*a, is_causal=True, fp4_roles=R.PAPER_ROLES),
                "qattn bf16": lambda *a: qattn_sdpa(*a, is_causal=True, fp4_roles=0),
            }
            for name, f in impls.items():
                try:
                    with torch.no_grad():
                        tf = bench_one(lambda: f(q, k, v))

                    def fb():
                        out = f(*leaves)
                        torch.autograd.grad(out, leaves, do)
                    tfb = bench_one(fb)
                    res[name] = (tf, tfb)
                except Exception as e:  # report and continue
                    say(f"bench {name} T{T} d{D} failed: {type(e).__name__}: {e}")
            for name, (tf, tfb) in res.items():
                sf = res.get("sdpa", (float("nan"),) * 2)
                rows.append((name, T, D, tf, fl_f / tf / 1e9, sf[0] / tf, tfb, fl_fb / tfb / 1e9, sf[1] / tfb))
            del q, k, v, do, leaves
    say("")
    say(f"| impl | T | d | fwd ms | fwd TFLOP/s (% of {CEILING:.0f}) | fwd speed vs SDPA | fwd+bwd ms | "
        "fwd+bwd TFLOP/s (%) | fwd+bwd vs SDPA |")
    say("|---|---|---|---|---|---|---|---|---|")
    for name, T, D, tf, tff, sf, tfb, tffb, sfb in rows:
        say(f"| {name} | {T} | {D} | {tf:.3f} | {tff:.0f} ({100 * tff / CEILING:.0f}%) | {sf:.2f}x | {tfb:.3f} | "
            f"{tffb:.0f} ({100 * tffb / CEILING:.0f}%) | {sfb:.2f}x |")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-check", action="store_true")
    args = ap.parse_args()
    say(torch.__version__, torch.cuda.get_device_name(), "triton", __import__("triton").__version__)
    t0 = time.time()
    ok = True
    if not args.skip_check:
        for cfg in [(R.PAPER_ROLES, True, 2, 4, 2, 300, 64, None), (63, False, 1, 2, 2, 200, 128, "bool"),
                    (0, True, 2, 4, 2, 257, 128, None), (R.PDO | R.DOV | R.QK, False, 1, 2, 1, 130, 64, "add")]:
            try:
                ok &= check(*cfg)
            except Exception:
                ok = False
                say("check", cfg, "raised:", traceback.format_exc()[-1500:])
        try:
            q, k, v = (torch.randn(1, 2, 80, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            torch.library.opcheck(torch.ops.fp4compile.qattn.default, (q, k, v, None, True, 0.125, R.PAPER_ROLES))
            say("opcheck qattn cuda: PASS")
        except Exception:
            ok = False
            say("opcheck qattn cuda: FAIL", traceback.format_exc()[-1500:])
        say(f"checks {'ALL PASS' if ok else 'SOME FAILED'} ({time.time() - t0:.0f} s)")
    bench(args.quick)
    say(f"total {time.time() - t0:.0f} s")
    with open(os.path.join(args.out, "attention_bench.log"), "w") as f:
        f.write("\n".join(LOG) + "\n")


if __name__ == "__main__":
    main()
