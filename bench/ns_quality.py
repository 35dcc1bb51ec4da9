"""How far Q-Root's NVFP4 Newton–Schulz lands from the BF16 one, per NVFP4 operand format (CPU or GPU).

    python bench/ns_quality.py                       # the 30M study's block shapes, 4 seeds, the format table
    python bench/ns_quality.py --model 124m --seeds 2

Issue 7's 30M study measured the full stack +4.80 % above BF16 trained with the same ROOT optimizer, with
Q-Root's NS in NVFP4 RTN (``Policy.full_stack()``'s ``optim.ns``) and the unshifted products
(``ns_shift=False``). This script asks which NVFP4 operand format, with or without the identity-shifted
products (``--shift``), brings the NS output closest to what the BF16 run's optimizer computes. (Session 6
found that the training loss does not follow: a BF16 NS leaves the full stack's gap unchanged; docs/OPTIM.md.) Inputs are what
``QRoot.orthogonalize`` gets: momentum-like matrices (``fp4compile.optim.study.momentum_like``: Gaussian
times a column profile, plus outliers), clipped at ROOT's 0.99 quantile, with ROOT's coefficients
(``ns_schedule="root"``), 5 steps and the sigma_max guard. For each format it prints, averaged over seeds:

- ``dev``: ||O - O_bf16||_F / ||O_bf16||_F, the relative distance from the BF16 NS of the same input. The
  optimizer-matched BF16 arm applies O_bf16, so this is the NVFP4 error of the update direction;
- ``cos``: the cosine between O and O_bf16;
- ``polar``: ||O - polar(G)||_F / ||polar(G)||_F, the distance from the exact orthogonal factor (float64 SVD).
  BF16 NS is itself not exact here, since ROOT's coefficients do not fully converge.

The inputs are synthetic. They rank the formats; they do not predict a training loss.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fp4compile.optim.root import SCHEDULES, clip_by_quantile, newton_schulz, ns_coefficients  # noqa: E402
from fp4compile.optim.study import momentum_like, ns_error  # noqa: E402
from fp4compile.policy import NVFP4  # noqa: E402

#: the NVFP4 operand formats compared (name -> spec); "rtn" is Policy.full_stack()'s optim.ns
FORMATS = {
    "rtn (full_stack default)": NVFP4("rtn"),
    "rtn + 4/6": NVFP4("rtn", four_over_six=True),
    "rtn + rht16": NVFP4("rtn", hadamard=16),
    "rtn + rht128": NVFP4("rtn", hadamard=128),
    "rtn + 4/6 + rht16": NVFP4("rtn", four_over_six=True, hadamard=16),
    "sr": NVFP4("sr"),
    "sr + rht16": NVFP4("sr", hadamard=16),
}


def block_shapes(model: str):
    """The (rows, cols) of the block matrices QRoot orthogonalizes for a fp4compile.train.model preset."""
    from fp4compile.train.model import PRESETS

    p = PRESETS[model]
    d, h = p["d_model"], p["hidden"]
    return [(3 * d, d), (d, d), (2 * h, d), (d, h)]


def trained_momenta(model: str = "cpu", steps: int = 150, seed: int = 0):
    """Real NS inputs: the Nesterov momenta ``g + mu * (mu * buf + g)`` of a ``model`` preset's block matrices after
    ``steps`` steps of ROOT (BF16 NS) + AdamW on the standard-library byte corpus, 16 x 128 tokens per step
    (CPU, ~1 minute for "cpu"). Returns a list of float32 matrices."""
    from fp4compile.optim import QRoot
    from fp4compile.train import data as D
    from fp4compile.train.model import GPT, config_from_preset

    torch.manual_seed(seed)
    tok = D.get_tokenizer("bytes")
    net = GPT(config_from_preset(model, vocab_size=tok.vocab_size, max_seq_len=128))
    batches = D.TokenBatches(D.load_tokens("stdlib", tok, "bytes", 2_000_000), 128, seed=seed)
    opt = QRoot(QRoot.param_groups_for(net), lr=3e-3, precision="bf16", adamw="adamw")
    for step in range(steps):
        x, y = batches.batch(step * 16, 16)
        net(x, y).backward()
        if step < steps - 1:
            opt.step()
            opt.zero_grad(set_to_none=True)
    # QRoot's NS input for this step's gradient: buf' = mu buf + g, then the Nesterov u = g + mu buf'
    return [(p.grad + g["momentum"] * (g["momentum"] * opt.state[p]["momentum_buffer"] + p.grad)).float()
            for g in opt.param_groups if g["use_root"] for p in g["params"]]


def guarded_exact(G: torch.Tensor, coeffs, guard: float = 1.0) -> torch.Tensor:
    """The NVFP4 NS path with its sigma_max guard but exact operands and FP32 products: what the guard alone
    changes against plain BF16 NS (``newton_schulz``'s BF16 path has no guard)."""
    from fp4compile.optim.root import _ns_nvfp4_stack

    X = G.to(torch.bfloat16)
    tall = X.shape[-2] > X.shape[-1]
    X = X.mT if tall else X
    X = (X / (X.norm() + 1e-7)).unsqueeze(0).contiguous()
    X = _ns_nvfp4_stack(X, coeffs, NVFP4("rtn"), None, None, guard, quant=lambda t, *_: t,
                        product=lambda a, b: torch.bmm(a.float(), b.float().mT).to(torch.bfloat16))[0]
    return X.mT if tall else X


def synthetic_inputs(shapes, seeds):
    """``momentum_like`` matrices, one per shape and seed."""
    return [momentum_like(m, k, seed) for (m, k) in shapes for seed in seeds]


def measure(inputs, device, formats=FORMATS, steps=5, schedule="root", shifts=(False, True)):
    """{format: (dev, cos, polar)} averaged over the ``inputs`` (each clipped first, as QRoot does); "bf16"
    (dev 0) and "guard only" rows first. The reference is always BF16 NS with ROOT's coefficients (what the
    optimizer-matched BF16 arm runs); the other rows use ``schedule``'s coefficients, each format once per
    value in ``shifts`` (``newton_schulz(shift=)``: the identity-shifted products, rows marked "shifted")."""
    rows = {(f"{name}, shifted" if sh else name): (spec, sh) for sh in shifts for name, spec in formats.items()}
    sums = {name: [0.0, 0.0, 0.0] for name in ["bf16", "guard only (exact products)", *rows]}
    n = 0
    for seed, raw in enumerate(inputs):
        m, k = raw.shape
        ref_coeffs = ns_coefficients((m, k), steps, "root")
        coeffs = ns_coefficients((m, k), steps, schedule)
        norm_scale = 1.01 if schedule == "polar_express" else 1.0      # as QRoot.orthogonalize
        G = clip_by_quantile(raw, 0.99).to(device)          # ROOT's default clip_quantile
        ref = newton_schulz(G, ref_coeffs).float()
        sums["bf16"][1] += 1.0
        sums["bf16"][2] += ns_error(G.cpu(), ref.cpu())

        def add(name, O):
            s = sums[name]
            s[0] += float((O - ref).norm() / ref.norm())
            s[1] += float((O * ref).sum() / (O.norm() * ref.norm()))
            s[2] += ns_error(G.cpu(), O.cpu())

        add("guard only (exact products)", guarded_exact(G, ref_coeffs).float())
        for name, (spec, sh) in rows.items():
            gen = torch.Generator().manual_seed(1000 + seed)
            signs = (torch.randint(0, 2, (spec.hadamard,), generator=gen) * 2 - 1).float().to(device) \
                if spec.hadamard else None
            sd = torch.tensor(seed * 7919 + 13, dtype=torch.int64, device=device) \
                if spec.rounding != "rtn" else None
            add(name, newton_schulz(G, coeffs, spec=spec, signs=signs, seed=sd, norm_scale=norm_scale,
                                    guard=1.0, shift=sh).float())
        n += 1
    return {name: tuple(v / n for v in s) for name, s in sums.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="30m", help="fp4compile.train.model preset whose block shapes to use")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--schedule", default="root", choices=SCHEDULES,
                    help="NS coefficients of the NVFP4 rows (the BF16 reference keeps ROOT's)")
    ap.add_argument("--inputs", default="synthetic", choices=("synthetic", "trained"),
                    help="momentum_like matrices of --model's shapes, or the real momenta of a short CPU run of "
                         "the 'cpu' preset (trained_momenta)")
    ap.add_argument("--formats", default=None,
                    help=f"comma-separated subset of the format rows (default all: {', '.join(FORMATS)})")
    ap.add_argument("--shift", default="both", choices=("off", "on", "both"),
                    help="the formats with the unshifted products, the identity-shifted ones (QRoot's default "
                         "ns_shift=True), or both")
    args = ap.parse_args(argv)
    formats = FORMATS if args.formats is None else {k: FORMATS[k] for k in args.formats.split(",")}
    t0 = time.perf_counter()
    if args.inputs == "synthetic":
        shapes = block_shapes(args.model)
        inputs = synthetic_inputs(shapes, range(args.seeds))
        what = f"momentum-like matrices of the {args.model} block shapes {shapes}, {args.seeds} seeds"
    else:
        inputs = trained_momenta()
        what = f"the {len(inputs)} block-matrix momenta of the 'cpu' preset after 150 ROOT steps"
    shifts = {"off": (False,), "on": (True,), "both": (False, True)}[args.shift]
    res = measure(inputs, torch.device(args.device), formats, schedule=args.schedule, shifts=shifts)
    print(f"## NVFP4 Newton–Schulz ({args.schedule} coefficients) vs BF16 NS (ROOT's) on {what} "
          f"({args.device}, torch {torch.__version__}, {time.perf_counter() - t0:.0f} s)\n")
    print("| NS operand format | dev from BF16 NS | cos to BF16 NS | error vs polar |")
    print("|---|---|---|---|")
    for name, (dev, cos, pol) in res.items():
        print(f"| {name} | {dev:.3f} | {cos:.4f} | {pol:.3f} |" if name != "bf16" else
              f"| bf16 (reference) | 0 | 1 | {pol:.3f} |")
    return res


if __name__ == "__main__":
    main()
