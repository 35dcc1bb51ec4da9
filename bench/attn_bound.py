"""How fast Q-Attn's core would have to run to reach issue 4's ≥ 1.0× SDPA, from a ``bench/attention.py`` log
(CPU, no GPU, a second).

    python bench/attn_bound.py                                   # session 64's H200 rows
    python bench/attn_bound.py --log LOG --bh 64 --copy-gbs 4223 --ceiling 790

The bound is for an ideal paper split (QKᵀ, dS·K and dSᵀ·Q in NVFP4, the rest BF16) in which every extra cost except
memory traffic is free:
- the kernels consume Q's and K's NVFP4 codes inside their loops at no cost, with no BF16 copies;
- dS is quantized in registers at no cost.

What is left is the least traffic the formats need, at the copy bandwidth:
- forward: Q and K each read twice (the per-tensor amax has to be complete before the first element is encoded),
  and their codes and E4M3 scales written: 2 + 2 + 0.5625 B per element each;
- backward: each 1×16 copy re-read and written again as 16×16 tiles for dS·K and dSᵀ·Q: 2 × 0.5625 B per element.

SDPA's time minus that traffic is what the core may take. Its FLOPs over that time are the TFLOP/s the core would
need. The script prints that beside SDPA's own rate and our all-BF16 kernels' rate (the same design as Q-Attn, no
FP4), as fractions of the BF16 ceiling. FLOPs count as ``bench/attention.py`` counts them: causal forward
2·BH·T²·d, forward + backward 3.5× that.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
from typing import Dict, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.attention import CEILING, FB_FACTOR, causal_fwd_flops  # noqa: E402  (the tables' FLOP convention)
from bench.step_bound import IDEAL  # noqa: E402  (codes + E4M3 scales, bytes per element)

#: the log whose CUDA-graph rows the default run reads (session 64, H200, torch 2.11)
DEFAULT_LOG = os.path.join(ROOT, "docs", "bench_logs", "session64_h200_2026-12-06.txt")
#: bytes per element of Q or K that the forward must move: the amax read, the encode read, codes + E4M3 scales
FWD_BYTES = 2 + 2 + IDEAL
#: bytes per element of Q or K that the backward must move: the 1x16 copy read, its 16x16 tile copy written
BWD_BYTES = 2 * IDEAL

_ROW = re.compile(r"^\|\s*(sdpa|qattn bf16|qattn paper) \(CUDA graph\)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*([\d.]+)\s*\|"
                  r"[^|]*\|[^|]*\|\s*([\d.]+)\s*\|")


def read_rows(text: str) -> Dict[Tuple[str, int, int], Tuple[float, float]]:
    """``bench/attention.py``'s CUDA-graph table rows: {(impl, T, d): (fwd ms, fwd+bwd ms)}."""
    rows = {}
    for line in text.splitlines():
        m = _ROW.match(line.strip())
        if m:
            rows[(m.group(1), int(m.group(2)), int(m.group(3)))] = (float(m.group(4)), float(m.group(5)))
    return rows


def least_traffic_s(bh: int, T: int, d: int, copy_bps: float) -> Tuple[float, float]:
    """Seconds of the least quantization traffic: (forward, forward + backward), Q and K of [bh, T, d]."""
    n = bh * T * d
    fwd = 2 * n * FWD_BYTES / copy_bps
    return fwd, fwd + 2 * n * BWD_BYTES / copy_bps


def bound_rows(rows, bh: int, copy_bps: float, ceiling_tflops: float) -> list:
    """One dict per (T, d) with SDPA's row: the core TFLOP/s needed for 1.0x (forward; forward + backward), and
    SDPA's and the all-BF16 kernels' own rates, all also as fractions of the ceiling."""
    out = []
    for (impl, T, d), (sf, sfb) in sorted(rows.items(), key=lambda kv: (kv[0][2], kv[0][1])):
        if impl != "sdpa":
            continue
        fl = causal_fwd_flops(bh, T, d)
        qf, qfb = least_traffic_s(bh, T, d, copy_bps)
        # traffic alone at or past SDPA's time: no core speed reaches 1.0x
        rates = dict(need_fwd=fl / (sf * 1e-3 - qf) / 1e12 if sf * 1e-3 > qf else math.inf,
                     need_fb=FB_FACTOR * fl / (sfb * 1e-3 - qfb) / 1e12 if sfb * 1e-3 > qfb else math.inf,
                     sdpa_fwd=fl / sf / 1e9, sdpa_fb=FB_FACTOR * fl / sfb / 1e9)
        bf = rows.get(("qattn bf16", T, d))
        if bf:
            rates.update(bf16_fwd=fl / bf[0] / 1e9, bf16_fb=FB_FACTOR * fl / bf[1] / 1e9)
        out.append(dict(T=T, d=d, sdpa_fwd_ms=sf, sdpa_fb_ms=sfb, traffic_fwd_us=qf * 1e6, traffic_fb_us=qfb * 1e6,
                        **rates, **{k + "_pct": 100 * v / ceiling_tflops for k, v in rates.items()}))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log", default=DEFAULT_LOG, help="a log holding bench/attention.py's CUDA-graph table")
    ap.add_argument("--bh", type=int, default=64, help="batch x heads of the benchmark's shapes (issue 4: 64)")
    ap.add_argument("--copy-gbs", type=float, default=4223.0, help="copy bandwidth, GB/s (H200 bf16 copy)")
    ap.add_argument("--ceiling", type=float, default=CEILING, help="BF16 TFLOP/s ceiling (bench/attention.py's)")
    args = ap.parse_args(argv)
    with open(args.log) as f:
        rows = read_rows(f.read())
    out = bound_rows(rows, args.bh, args.copy_gbs * 1e9, args.ceiling)
    if not out:
        raise SystemExit(f"no 'sdpa (CUDA graph)' rows in {args.log}")
    c = args.ceiling
    print(f"| T | d | SDPA fwd ms | least traffic fwd µs | core fwd needed TFLOP/s (% of {c:.0f}) | SDPA fwd+bwd ms | "
          "least traffic fwd+bwd µs | core fwd+bwd needed (%) | SDPA's own fwd / fwd+bwd | BF16 design fwd / fwd+bwd |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in out:
        bf = (f"{r['bf16_fwd_pct']:.0f} / {r['bf16_fb_pct']:.0f} %" if "bf16_fwd" in r else "–")
        print(f"| {r['T']} | {r['d']} | {r['sdpa_fwd_ms']:.3f} | {r['traffic_fwd_us']:.1f} | {r['need_fwd']:.0f} "
              f"({r['need_fwd_pct']:.0f} %) | {r['sdpa_fb_ms']:.3f} | {r['traffic_fb_us']:.1f} | {r['need_fb']:.0f} "
              f"({r['need_fb_pct']:.0f} %) | {r['sdpa_fwd_pct']:.0f} / {r['sdpa_fb_pct']:.0f} % | {bf} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
