"""Q-Attn's error on a trained model's own Q, K, V, with each ``qk_transform`` (issues 4, 7).

    python bench/attn_qk_error.py RUN_DIR [--batches 2] [--batch-size 4] [--json OUT.json]

RUN_DIR is a finished ``fp4compile train`` run (``config.json`` and ``checkpoint/``; ``bench/ptq_eval.py`` rebuilds
it, LoRA-SVD branch included). Its val batches go through the model eagerly (the run's autocast); every attention
call's Q, K, V (after RoPE: what SDPA receives) is captured. For each layer and each transform
(``attention_ref.QK_TRANSFORMS``) the paper split (QKᵀ, dS·K, dSᵀ·Q in NVFP4) runs through ``qattn_sdpa`` (the
Triton kernels on CUDA) with a fixed N(0, 1) dO; the table gives the relative Frobenius error of O, dQ and dK against
float64 attention of the *untransformed* Q, K, V. It also gives how much of K's energy is its mean over the
sequence (``T·‖mean_t k‖² / ‖k‖²``, per head and channel, summed): what ``smooth_k`` removes before quantization.

A second table splits the error without a transform: the paper split's QKᵀ alone in NVFP4 (O, dQ, dK) and its two
dS products alone (dQ, dK), through the same op; and O of float64 attention of Q, K fake-quantized by the format's
RTN (``formats.nvfp4.quantize_rtn_``) in Q-Attn's 16x16 tiles, with 4/6, and in 1x16 blocks along head_dim (which
the backward could not reuse along the sequence): what the tile costs the forward. A line per transform (none, the
default smooth_k+hadamard) gives the op's O, dQ, dK errors with Q and K in 1x16 blocks (``attention_ref.QK_1X16``,
the attention pass's ``QK_BLOCKS = "1x16"``) against those of the tiles.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def capture_qkv(model, batches, n_batches: int, batch_size: int, autocast, device) -> list:
    """[(layer, q, k, v)] of every attention call of ``n_batches`` batches (eager, no grad)."""
    import fp4compile.train.model as M

    seen, orig = [], M.F.scaled_dot_product_attention

    def grab(q, k, v, *a, **kw):
        seen.append((q.detach(), k.detach(), v.detach()))
        return orig(q, k, v, *a, **kw)

    n_layers = len(model.blocks) if hasattr(model, "blocks") else None
    M.F.scaled_dot_product_attention = grab
    try:
        with torch.no_grad(), autocast():
            for i in range(n_batches):
                x, _ = batches.batch(i, batch_size, 0, 1, device=device)
                model(x)
    finally:
        M.F.scaled_dot_product_attention = orig
    per_pass = n_layers or len(seen) // max(1, n_batches)
    return [(j % per_pass, q, k, v) for j, (q, k, v) in enumerate(seen)]


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


#: fake quantizations of Q and K for the forward-only comparison: name -> (16x16 tiles, 4/6)
FAKE_QUANT = {"16x16": (True, False), "16x16 4/6": (True, True), "1x16": (False, False), "1x16 4/6": (False, True)}


def fake_quant(x, block2d: bool, four_over_six: bool):
    """x's RTN NVFP4 values (per-tensor global; 16x16 tiles over the last two dims or 1x16 blocks), float64."""
    from fp4compile.formats import nvfp4

    codes, scales, g = nvfp4.quantize_rtn_(x.float(), block2d, four_over_six)
    return nvfp4.dequantize_codes(codes, scales, g).double()


def reference(q, k, v, seed: int = 0):
    """The fixed N(0, 1) dO and float64 attention of q, k, v: (dO, O, dQ, dK), computed once per layer."""
    from fp4compile.kernels import attention_ref as R

    g = torch.Generator(device=q.device).manual_seed(seed)
    do = torch.randn(q.shape, generator=g, device=q.device).to(q.dtype)
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    o64 = R.sdpa_math_ref(*ref, is_causal=True)
    g64 = torch.autograd.grad(o64, ref, do.double())
    return do, o64.detach(), g64[0], g64[1]


def forward_errors(q, k, v, o64) -> dict:
    """O's relative error, float64 attention of fake-quantized Q, K (each :data:`FAKE_QUANT`) against ``o64``, that
    of Q, K."""
    from fp4compile.kernels import attention_ref as R

    return {name: rel(R.sdpa_math_ref(fake_quant(q, *f), fake_quant(k, *f), v, is_causal=True), o64)
            for name, f in FAKE_QUANT.items()}


def errors(q, k, v, ref, how: str, roles: int | None = None) -> tuple[float, float, float]:
    """Relative errors of O, dQ, dK of the paper split (or the precision mask ``roles``) with ``how`` against
    ``ref`` (:func:`reference` of q, k, v)."""
    from fp4compile.kernels import attention_ref as R
    from fp4compile.passes.attention import qattn_sdpa

    do, o64, dq64, dk64 = ref
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = qattn_sdpa(*leaves, is_causal=True, fp4_roles=R.PAPER_ROLES if roles is None else roles, qk_transform=how)
    gq, gk, _ = torch.autograd.grad(out, leaves, do)
    return rel(out, o64), rel(gq, dq64), rel(gk, dk64)


def k_mean_share(k) -> float:
    """The share of K's energy in its sequence mean: T·‖mean_t k‖² / ‖k‖² over [B, H, T, D]."""
    kf = k.double()
    return (kf.shape[-2] * kf.mean(-2).pow(2).sum() / kf.pow(2).sum()).item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a finished fp4compile train run directory")
    ap.add_argument("--batches", type=int, default=2, help="val batches to capture")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--json", type=Path, help="write the per-layer numbers here")
    args = ap.parse_args(argv)

    from bench.ptq_eval import load_run
    from fp4compile.kernels import attention_ref as R
    from fp4compile.kernels.attention_ref import QK_TRANSFORMS

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg, make_model, sets, step, autocast = load_run(args.run, device)
    batches, _ = sets["val"]
    model = make_model().eval()
    calls = capture_qkv(model, batches, args.batches, args.batch_size, autocast, device)
    rows = {}
    for layer, q, k, v in calls:
        q, k, v = (t.to(torch.bfloat16).contiguous() for t in (q, k, v))
        r = rows.setdefault(layer, {"k_mean_share": [], "qk_only": [], "ds_only": [], "fwd": [],
                                    **{h: [] for h in QK_TRANSFORMS}})
        r["k_mean_share"].append(k_mean_share(k))
        ref = reference(q, k, v)
        for how in QK_TRANSFORMS:
            r[how].append(errors(q, k, v, ref, how))
        for how in ("none", "smooth_k+hadamard"):   # the op's 1x16 copies of Q and K (QK_BLOCKS "1x16")
            r.setdefault(f"1x16 {how}", []).append(errors(q, k, v, ref, how, roles=R.PAPER_ROLES | R.QK_1X16))
        r["qk_only"].append(errors(q, k, v, ref, "none", roles=R.QK))
        r["ds_only"].append(errors(q, k, v, ref, "none", roles=R.DSK | R.DSQ))
        r["fwd"].append(forward_errors(q, k, v, ref[1]))
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    print(f"{args.run} (step {step}, {cfg.model}): {args.batches} val batches of {args.batch_size} x {cfg.seq_len}; "
          f"relative error against float64 attention, O / dQ / dK; device {device}")
    head = " | ".join(f"{h:>20s}" for h in QK_TRANSFORMS)
    print(f"layer  K mean share | {head}")
    summary = {"run": str(args.run), "step": step, "layers": {}}
    for layer in sorted(rows):
        r = rows[layer]
        cells = {h: tuple(mean([e[i] for e in r[h]]) for i in range(3)) for h in QK_TRANSFORMS}
        share = mean(r["k_mean_share"])
        summary["layers"][layer] = {"k_mean_share": share, **cells}
        print(f"{layer:5d}  {share:12.3f} | " + " | ".join("{:.3f}/{:.3f}/{:.3f}".format(*cells[h]).rjust(20)
                                                          for h in QK_TRANSFORMS))
    avg = {h: tuple(mean([summary["layers"][la][h][i] for la in rows]) for i in range(3)) for h in QK_TRANSFORMS}
    print("  all  " + " " * 12 + " | " + " | ".join("{:.3f}/{:.3f}/{:.3f}".format(*avg[h]).rjust(20)
                                                   for h in QK_TRANSFORMS))
    print("vs none (all layers): " + ", ".join(
        f"{h} " + "/".join(f"{a / b:.2f}x" for a, b in zip(avg[h], avg["none"])) for h in QK_TRANSFORMS[1:]))
    summary["mean"] = avg
    for how in ("none", "smooth_k+hadamard"):
        key = f"1x16 {how}"
        for la in rows:
            summary["layers"][la][key] = tuple(mean([e[i] for e in rows[la][key]]) for i in range(3))
        m = tuple(mean([summary["layers"][la][key][i] for la in rows]) for i in range(3))
        summary["mean"][key] = m
        print(f"Q, K in 1x16 blocks (the op with QK_1X16), {how} (all layers): " + "{:.3f}/{:.3f}/{:.3f}".format(*m)
              + " = " + "/".join(f"{a / b:.2f}x" for a, b in zip(m, avg[how])) + " of the 16x16 tiles'")
    print("\nwithout a transform, split: the op with QK^T alone in NVFP4 (O/dQ/dK), with dS*K and dS^T*Q alone "
          "(dQ/dK); float64 attention of Q, K fake-quantized, O: " + ", ".join(FAKE_QUANT))
    print("layer |          QK^T only |   dS only | " + " | ".join(f"{n:>9s}" for n in FAKE_QUANT))
    for layer in sorted(rows):
        r = rows[layer]
        qk = tuple(mean([e[i] for e in r["qk_only"]]) for i in range(3))
        ds = tuple(mean([e[i] for e in r["ds_only"]]) for i in (1, 2))
        fwd = {n: mean([e[n] for e in r["fwd"]]) for n in FAKE_QUANT}
        summary["layers"][layer].update(qk_only=qk, ds_only=ds, fwd=fwd)
        print(f"{layer:5d} | {qk[0]:.3f}/{qk[1]:.3f}/{qk[2]:.3f} | {ds[0]:.3f}/{ds[1]:.3f} | "
              + " | ".join(f"{fwd[n]:9.3f}" for n in FAKE_QUANT))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
