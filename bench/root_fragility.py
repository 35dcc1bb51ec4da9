"""Why does an NVFP4 forward cost a ROOT-trained model four times more than an AdamW-trained one?

    python bench/root_fragility.py RUN_DIR [RUN_DIR ...] [--set val] [--draws 2] [--json OUT.json]
    python bench/root_fragility.py RUN_DIR --policy-out P.toml [--bf16-layers 4] [--preset full_stack]

Session 7 found (bench/ptq_eval.py, 30M, 100M tokens, seed 0) that quantizing the forward GEMMs of a finished
BF16 model (RTN + 4/6, both operands) raises the val loss by +3.17 % for the model trained with ROOT + AdamW
and by +0.74 % for the one trained with AdamW, about what training through NVFP4 costs each. Two explanations:

- **larger quantization error**: the ROOT model's weights / activations are shaped so that NVFP4 rounds them
  with a larger relative error (block distributions, outliers);
- **larger sensitivity**: the relative errors are alike but the ROOT model's loss reacts more to the same
  error (sharper minimum, less redundancy), which a random perturbation of the same size would show as well.

For each run (weights from ``checkpoint/``, model in eager mode under the run's autocast, evaluation batches of
``--set`` as the run evaluates them) it measures, per hidden linear layer (``blocks.*``: qkv, attn proj, MLP fc,
MLP proj):

- ``eW``, ``eX``: relative Frobenius error of NVFP4 RTN + 4/6 (1x16 blocks along K, the torch reference
  ``fp4compile.formats.nvfp4.quantize``) of the weight and of the layer's input on the first batch;
- ``eYw``, ``eYx``: relative error of the layer's output when only W, only X is quantized;
- ``kW``: excess kurtosis of W's elements; ``srank``: stable rank ||W||_F^2 / ||W||_2^2 of W;
- ``dLw``, ``dLx``: relative loss increase when only this layer's W, only its X is quantized.

A LoRA-SVD layer (``W = W_res + beta L2 L1``, the factors in BF16) quantizes only the residual GEMM: "W" is
``W_res`` and "X" the residual's input (the branch keeps the exact input); ``eW`` is relative to ``W_res``, the
output errors to the whole layer's output, ``srank`` is the merged weight's, and ``res`` = ||W_res|| / ||W||
(1 for a plain layer) is the share of the weight that stays in NVFP4.

And for the whole model (relative loss increase over the ``--set`` batches): every W quantized; every W
perturbed by Gaussian noise of the same Frobenius norm as its quantization error (``--draws`` draws); every X
quantized; every X perturbed by Gaussian noise of its quantization error's norm (per call, per tensor).
Similar errors and a larger loss increase under noise too mean sensitivity; larger errors mean the format.

``--policy-out``: also write a precision policy (TOML for ``fp4compile train --policy``) that starts from
``--preset`` and keeps the ``--bf16-layers`` layers with the largest ``dLw + dLx`` in BF16. On the 30M ROOT model
the top four are exactly block 0's linears, half of the summed increase (docs/RESULTS.md, session 8). A
per-layer ranking ignores interactions (the increases do not add up exactly), so evaluate the policy after
writing it (``bench/ptq_eval.py RUN --policies bf16,quartet2,P.toml``).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ptq_eval import load_run  # noqa: E402


def qdq(x: torch.Tensor) -> torch.Tensor:
    """NVFP4 RTN + 4/6 along the last dim and back, in FP32 (the forward GEMM operands' rounding)."""
    from fp4compile.formats.nvfp4 import dequantize, quantize

    shape = x.shape
    t = quantize(x.reshape(-1, shape[-1]).float(), rounding="rtn", four_over_six=True)
    return dequantize(t, torch.float32).reshape(shape)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def merged(m) -> torch.Tensor:
    """The layer's whole weight (``W_res + beta L2 L1`` for a LoRA-SVD layer), FP32."""
    return m.merged_weight().float() if hasattr(m, "merged_weight") else m.weight.detach().float()


class Perturb:
    """Replace the NVFP4 GEMM input of chosen layers: by its NVFP4 copy (``mode="q"``) or by the input plus
    Gaussian noise of the same norm as its quantization error (``mode="noise"``). A plain linear gets a
    forward pre-hook; a LoRA-SVD layer an instance ``forward`` in which only the residual GEMM sees it."""

    def __init__(self, layers, mode: str, gen: torch.Generator):
        self.mode, self.gen, self.handles, self.patched = mode, gen, [], []
        for m in layers:
            if hasattr(m, "lora_a"):
                m.forward = (lambda x, m=m: F.linear(self.perturb(x), m.weight, m.bias)
                             + m.lora_b(m.lora_a(x) * m.beta))
                self.patched.append(m)
            else:
                self.handles.append(m.register_forward_pre_hook(lambda mod, args: (self.perturb(args[0]),)
                                                                + args[1:]))

    def perturb(self, x: torch.Tensor) -> torch.Tensor:
        xq = qdq(x)
        if self.mode == "q":
            return xq.to(x.dtype)
        err = (xq - x.float()).norm()
        n = torch.randn(x.shape, device=x.device, generator=self.gen)
        return (x.float() + n * (err / n.norm())).to(x.dtype)

    def remove(self):
        for h in self.handles:
            h.remove()
        for m in self.patched:
            del m.forward


@torch.no_grad()
def analyse(run_dir: Path, set_name: str, draws: int, device: torch.device) -> dict:
    cfg, make_model, sets, step, autocast = load_run(run_dir, device)
    model = make_model().eval()
    batches, n = sets[set_name]
    n = min(n, max(1, batches.n_windows // cfg.batch_size))
    data = [batches.batch(i * cfg.batch_size, cfg.batch_size, 0, 1, device=device) for i in range(n)]

    def loss() -> float:
        with autocast():
            return sum(float(model(x, y)) for x, y in data) / len(data)

    def is_site(name, m):       # the NVFP4 GEMM sites: plain linears and LoRA-SVD layers (not their factors)
        return hasattr(m, "lora_a") or (isinstance(m, torch.nn.Linear) and not name.endswith((".lora_a", ".lora_b")))

    layers = {name: m for name, m in model.named_modules() if name.startswith("blocks.") and is_site(name, m)}
    base = loss()
    gen = torch.Generator(device=device).manual_seed(0)

    # inputs and outputs of every layer on the first batch (BF16 autocast, as trained)
    inputs = {}
    hooks = [m.register_forward_hook(lambda mod, a, o, k=k: inputs.__setitem__(k, a[0].detach()))
             for k, m in layers.items()]
    with autocast():
        model(*data[0])
    for h in hooks:
        h.remove()

    per_layer = {}
    originals = {k: m.weight.detach().clone() for k, m in layers.items()}
    quantized = {k: qdq(w) for k, w in originals.items()}
    for k, m in layers.items():
        w, wq, x, wm = originals[k].float(), quantized[k], inputs[k].float(), merged(m)
        x2 = x.reshape(-1, x.shape[-1])
        xq = qdq(x2)
        y = x2 @ wm.t()
        w64 = wm.double()
        s = torch.linalg.svdvals(w64)
        z = (w64 - w64.mean()) / w64.std()
        row = dict(eW=rel(wq, w), eX=rel(xq, x2), eYw=float((x2 @ (wq - w).t()).norm() / y.norm()),
                   eYx=float(((xq - x2) @ w.t()).norm() / y.norm()), kW=float((z ** 4).mean() - 3),
                   srank=float((s ** 2).sum() / s[0] ** 2), res=float(w.norm() / wm.norm()))
        m.weight.copy_(wq.to(m.weight.dtype))
        row["dLw"] = loss() / base - 1
        m.weight.copy_(originals[k])
        p = Perturb([m], "q", gen)
        row["dLx"] = loss() / base - 1
        p.remove()
        per_layer[k] = row

    whole = {}
    for k, m in layers.items():
        m.weight.copy_(quantized[k].to(m.weight.dtype))
    whole["W quantized"] = loss() / base - 1
    noise = []
    for _ in range(draws):
        for k, m in layers.items():
            e = (quantized[k] - originals[k].float()).norm()
            g = torch.randn(originals[k].shape, device=device, generator=gen)
            m.weight.copy_((originals[k].float() + g * (e / g.norm())).to(m.weight.dtype))
        noise.append(loss() / base - 1)
    whole["W + noise of the same norm"] = sum(noise) / len(noise)
    for k, m in layers.items():
        m.weight.copy_(originals[k])
    for mode, label in (("q", "X quantized"), ("noise", "X + noise of the same norm")):
        p = Perturb(list(layers.values()), mode, gen)
        whole[label] = loss() / base - 1
        p.remove()
    return dict(run=str(run_dir), step=step, set=set_name, base_loss=base, per_layer=per_layer, whole=whole)


def report(r: dict) -> str:
    cols = ("eW", "eX", "eYw", "eYx", "kW", "srank", "res", "dLw", "dLx")
    lines = [f"{r['run']} (step {r['step']}, {r['set']} loss {r['base_loss']:.4f})",
             "| layer | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    pct = {"dLw", "dLx"}
    for k, row in r["per_layer"].items():
        lines.append(f"| {k} | " + " | ".join(f"{100 * row[c]:+.3f} %" if c in pct else f"{row[c]:.4f}"
                                               for c in cols) + " |")
    mean = {c: sum(row[c] for row in r["per_layer"].values()) / len(r["per_layer"]) for c in cols}
    lines.append("| **mean** | " + " | ".join(f"{100 * mean[c]:+.3f} %" if c in pct else f"{mean[c]:.4f}"
                                            for c in cols) + " |")
    lines += ["", "| whole model | loss increase |", "|---|---|"]
    lines += [f"| {k} | {100 * v:+.2f} % |" for k, v in r["whole"].items()]
    return "\n".join(lines)


def sensitive_policy(r: dict, k: int, preset: str = "full_stack") -> str:
    """Policy TOML: ``preset`` with the ``k`` hidden linears of largest ``dLw + dLx`` (``analyse``'s per-layer
    loss increases) in BF16, ordered by that sum; comments give each layer's share of the summed increase."""
    rows = r["per_layer"]
    if not 0 <= k <= len(rows):
        raise ValueError(f"k must be in [0, {len(rows)}], got {k}")
    score = {name: row["dLw"] + row["dLx"] for name, row in rows.items()}
    total = sum(max(v, 0.0) for v in score.values()) or 1.0
    top = sorted(score, key=score.get, reverse=True)[:k]
    lines = [f"# {preset} with the {k} most sensitive hidden linears in BF16 (bench/root_fragility.py on",
             f"# {r['run']}, step {r['step']}, {r['set']} set; dLw + dLx, share of the summed increase:",
             f"# {100 * sum(max(score[n], 0.0) for n in top) / total:.1f} % kept in BF16)",
             f'preset = "{preset}"', f'name = "{preset}_bf16_top{k}"']
    for name in top:
        lines += ["", f"# dLw {100 * rows[name]['dLw']:+.3f} %, dLx {100 * rows[name]['dLx']:+.3f} %, "
                  f"{100 * max(score[name], 0.0) / total:.1f} % of the sum", "[[rules]]",
                  f'pattern = "{name}"', 'spec = "bf16"']
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--set", default="val", help="train-next | val | brown")
    ap.add_argument("--draws", type=int, default=2)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", default=None)
    ap.add_argument("--policy-out", default=None, help="write a policy TOML keeping the most sensitive layers BF16")
    ap.add_argument("--bf16-layers", type=int, default=4, help="how many layers --policy-out keeps in BF16")
    ap.add_argument("--preset", default="full_stack", help="the policy --policy-out starts from")
    args = ap.parse_args(argv)
    if args.policy_out and len(args.runs) != 1:
        ap.error("--policy-out takes exactly one run")
    from fp4compile.train.loop import resolve_device

    device = resolve_device(args.device)
    results = []
    for run in args.runs:
        r = analyse(Path(run), args.set, args.draws, device)
        print(report(r), flush=True)
        results.append(r)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    if args.policy_out:
        Path(args.policy_out).write_text(sensitive_policy(results[0], args.bf16_layers, args.preset))
        print(f"[fragility] wrote {args.policy_out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
