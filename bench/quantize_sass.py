"""Static sm_90 SASS of the quantize kernels, on a machine without a GPU (a CPU-side proxy for their ALU cost).

Compiles RTN's quantize kernel and MS-EDEN's pass 1 with the default tiles and the 16-divisibility a launch on an
aligned large tensor gets (``fp4compile.kernels.offline``), and prints SASS instructions per element, shuffles
per element and registers. MS-EDEN's pass 1 with RHT-128, RHT-16 and none shows what the RHT's butterfly costs
inside the kernel (issue 2's MS-EDEN + RHT-128 throughput question).

    python bench/quantize_sass.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fp4compile.formats.schemes import (EDEN_INV_VAL_MAX, EDEN_VAL_MAX, block_max_targets,  # noqa: E402
                                        global_numerator)
from fp4compile.kernels import quantize as K  # noqa: E402
from fp4compile.kernels.offline import compile_offline, sass_stats  # noqa: E402


def per_element(fn, sig, const, num_warps, elements):
    """(instructions, shuffles) per element and registers of ``fn``'s sm_90 cubin; ``elements`` per program."""
    n, ops, regs, _ = sass_stats(compile_offline(fn, sig, const, num_warps, upto="cubin",
                                                 divisible_by_16=tuple(sig)))
    threads = 32 * num_warps
    return n / (elements / threads), ops.get("SHFL", 0) / (elements / threads), regs


def measure(cfg=None) -> list:
    """[(kernel, (instructions per element, SHFL per element, registers))] for the table (``cfg``: CONFIG)."""
    cfg = cfg or K.CONFIG
    rows = []
    m6, _ = block_max_targets("rtn")
    br, bc, w = cfg["q_rows"], cfg["q_cols"], cfg["q_warps"]
    qsig = dict(x_ptr="*bf16", srow="i32", R="i32", K="i32", amax_ptr="*fp32", seed_ptr="*i64", signs_ptr="*fp32",
                codes_ptr="*i32", scales_ptr="*u8", gscale_ptr="*fp32")
    qc = dict(scol=1, G=global_numerator("rtn", False), M6=m6, M4=4.0, ROUNDING=0, FOUR_SIX=False, BLOCK2D=False,
              HAD=0, NORM=1.0, RHT_IMPL=cfg["rht_impl"], TLOAD=False, BR=br, BC=bc, MAGIC_PACK=K._MAGIC_PACK)
    rows.append(("RTN quantize pass", per_element(K._quantize_kernel, qsig, qc, w, br * bc)))
    br, bc, w = cfg["e_rows"], cfg["e_cols"], cfg["e_warps"]
    esig = dict(x_ptr="*bf16", srow="i32", R="i32", K="i32", signs_ptr="*fp32", codes_ptr="*i32",
                scratch_ptr="*fp32", smax_ptr="*fp32")
    for had in (128, 16, 0):
        ec = dict(scol=1, VAL_MAX=EDEN_VAL_MAX, INV_VAL_MAX=EDEN_INV_VAL_MAX, BLOCK2D=False, HAD=had,
                  NORM=1.0 / had ** 0.5 if had else 1.0, RHT_IMPL=cfg["rht_impl"], TLOAD=False, BR=br,
                  BC=max(bc, had or 16), MAGIC_PACK=K._MAGIC_PACK)
        rows.append((f"MS-EDEN pass 1, RHT-{had}" if had else "MS-EDEN pass 1, no RHT",
                     per_element(K._eden_pass1_kernel, esig, ec, w, br * max(bc, had or 16))))
    return rows


def main() -> int:
    rows = measure()
    print("| kernel (sm_90, default tiles) | SASS instructions per element | SHFL per element | registers |")
    print("|---|---|---|---|")
    for name, (n, shfl, regs) in rows:
        print(f"| {name} | {n:.1f} | {shfl:.1f} | {regs} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
