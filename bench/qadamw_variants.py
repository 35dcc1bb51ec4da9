"""Q-AdamW fused-kernel variants vs ``torch.optim.AdamW(fused=True)``: step time per variant (what each part of
the kernel costs, and the block-per-thread kernel against the first version).

    python bench/qadamw_variants.py --out variants.json      # H200: 124M and 1B sets (~60 s)
    python bench/qadamw_variants.py --tiny                   # CPU smoke run (TRITON_INTERPRET=1)
    python bench/qadamw_variants.py --only 11,0,12           # chosen variants (VARIANTS indices) after the default

Each row: CUDA-event ms per step (20 steps after 3 warm-up steps, compile included in the warm-up), and the
ratio to fused AdamW measured in the same run on the same parameter set.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from optim import SETS, TINY, gpt_shapes, make_params, time_steps  # noqa: E402
from fp4compile.optim import QAdamW, fused  # noqa: E402

NO46 = dict(m_four_over_six=False, v_four_over_six=False)
NORHT = dict(m_hadamard=None, v_hadamard=None)
#: (label, fused-module settings, QAdamW keyword arguments)
VARIANTS = [
    ("k2 default (2 warps, reuse 4/6 codes)", dict(), {}),
    ("k1 (first version, 4 warps)", dict(KERNEL=1), {}),
    ("k2 1 warp", dict(NUM_WARPS=1), {}),
    ("k2 no 4/6", dict(), NO46),
    ("k2 PROF=1 approx sqrt/div (timing only)", dict(PROF=1), {}),
    ("k2 PROF=2 no SR hash (timing only)", dict(PROF=2), {}),
    ("k2 no RHT", dict(), NORHT),
    ("k2 RTN m", dict(), dict(m_rounding="rtn")),
    ("k2 no reuse of 4/6 codes", dict(REUSE=0), {}),
    ("k2 no 4/6, no RHT, RTN m", dict(), {**NO46, **NORHT, "m_rounding": "rtn"}),
    ("k2 4 warps", dict(NUM_WARPS=4), {}),
    ("k2 SR codes by the comparison form (SR_RP off)", dict(SR_RP=False), {}),
    ("k2 register cap 128", dict(MAXNREG=128), {}),
    ("k2 no 4/6 for v (v_four_over_six=False)", dict(), dict(v_four_over_six=False)),
]


def run(label, settings, qkw, cfg, device, iters, warmup):
    saved = {k: getattr(fused, k) for k in settings}
    try:
        for k, v in settings.items():
            setattr(fused, k, v)
        ps = make_params(gpt_shapes(**cfg), device)
        opt = QAdamW(ps, lr=1e-4, **qkw) if label != "AdamW" else torch.optim.AdamW(
            ps, lr=1e-4, fused=device.type == "cuda")
        ms = time_steps(opt, device, iters, warmup)
        del opt, ps
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return ms
    finally:
        for k, v in saved.items():
            setattr(fused, k, v)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--sets", default="124M,1B", help="sets for the default kernel (variants run on the first)")
    ap.add_argument("--only", default="", help="comma list of VARIANTS indices to run on the first set, in this "
                    "order, repeats allowed (default: every variant after the default, once)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    sets = TINY if args.tiny else {k: SETS[k] for k in args.sets.split(",")}
    iters, warmup = (2, 1) if args.tiny else (20, 3)
    rows = []

    def emit(r):
        rows.append(r)
        print("[row] " + " | ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()),
              flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)

    # the default kernel vs AdamW on every set first (the numbers that matter), then the variants on the first set
    refs = {}
    jobs = [j for name in sets for j in ((name, "AdamW", {}, {}), (name,) + VARIANTS[0])]
    order = [int(i) for i in args.only.split(",")] if args.only else range(1, len(VARIANTS))
    jobs += [(next(iter(sets)),) + VARIANTS[i] for i in order]
    for name, label, settings, qkw in jobs:
        cfg = sets[name]
        nparam = sum(math.prod(s) for s in gpt_shapes(**cfg))
        try:
            t0 = time.perf_counter()
            ms = run(label, settings, qkw, cfg, device, iters, warmup)
            if label == "AdamW":
                refs[name] = ms
            emit(dict(set=name, params=nparam, variant=label, ms=ms, ratio_vs_adamw=ms / refs[name],
                      wall_s=time.perf_counter() - t0))
        except Exception as e:
            traceback.print_exc()
            emit(dict(set=name, variant=label, error=f"{type(e).__name__}: {e}"))


if __name__ == "__main__":
    main()
