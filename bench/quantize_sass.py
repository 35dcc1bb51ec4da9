"""Static sm_90 SASS of the quantize kernels, on a machine without a GPU (a CPU-side proxy for their ALU cost).

Compiles RTN's quantize kernel and MS-EDEN's pass 1 with the default tiles and the 16-divisibility a launch on an
aligned large tensor gets (``fp4compile.kernels.offline``), and prints SASS instructions per element, shuffles
per element and registers. MS-EDEN's pass 1 with RHT-128, RHT-16 and none shows what the RHT's butterfly costs
inside the kernel (issue 2's MS-EDEN + RHT-128 throughput question). The ``*_spec`` functions describe each
kernel's compile (signature, constexprs, warps, elements per program) for this script and for the tests that
inspect the generated code (``tests/test_quantize_kernels.py``).

    python bench/quantize_sass.py
"""
from __future__ import annotations

import os
import sys
from typing import NamedTuple, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fp4compile.formats.schemes import (EDEN_INV_VAL_MAX, EDEN_VAL_MAX, block_max_targets,  # noqa: E402
                                        global_numerator)
from fp4compile.kernels import quantize as K  # noqa: E402
from fp4compile.kernels.offline import compile_offline, sass_stats  # noqa: E402


class KernelSpec(NamedTuple):
    """One kernel compile: ``fn`` with runtime ``signature`` and ``constexprs`` on ``num_warps`` warps, each
    program handling ``elements`` elements of x."""
    fn: object
    signature: dict
    constexprs: dict
    num_warps: int
    elements: int
    options: Optional[dict] = None  # further launch options (``maxnreg``: CONFIG's register cap where it applies)

    def compile(self, upto="ptx"):
        """The PTX (text) or cubin (bytes), every runtime argument specialized as 16-divisible."""
        return compile_offline(self.fn, self.signature, self.constexprs, self.num_warps, upto=upto,
                               divisible_by_16=tuple(self.signature), **(self.options or {}))


def quantize_spec(rounding="rtn", cfg=None, **constexprs) -> KernelSpec:
    """RTN/SR's quantize kernel (``_quantize_kernel``) with CONFIG's plain tile, 1D blocks, no RHT."""
    cfg = cfg or K.CONFIG
    m6, _ = block_max_targets(rounding)
    br, bc = cfg["q_rows"], cfg["q_cols"]
    sig = dict(x_ptr="*bf16", srow="i32", R="i32", K="i32", amax_ptr="*fp32", seed_ptr="*i64", signs_ptr="*fp32",
               codes_ptr="*i32", scales_ptr="*u8", gscale_ptr="*fp32", dq_ptr="*bf16")
    const = dict(scol=1, G=global_numerator(rounding, False), M6=m6, M4=4.0, ROUNDING=K._ROUNDING_ID[rounding],
                 FOUR_SIX=False, BLOCK2D=False, HAD=0, NORM=1.0, RHT_IMPL=cfg["rht_impl"], TLOAD=False, BR=br,
                 BC=bc, MAGIC_PACK=K._MAGIC_PACK)
    return KernelSpec(K._quantize_kernel, sig, {**const, **constexprs}, cfg["q_warps"], br * bc)


def quantize46_spec(rounding="rtn", cfg=None, dq=False) -> KernelSpec:
    """The 4/6 quantize kernel (``_quantize_kernel`` with FOUR_SIX) as launched: CONFIG's ``s_*`` tile and its
    register cap (``s_maxnreg``), 1D blocks, no RHT; ``dq``: also storing the bf16 q * S (``quantize_dq``)."""
    cfg = cfg or K.CONFIG
    _, m4 = block_max_targets(rounding)
    tile = {"q_rows": cfg["s_rows"], "q_cols": cfg["s_cols"], "q_warps": cfg["s_warps"]}
    spec = quantize_spec(rounding, {**cfg, **tile}, FOUR_SIX=True, G=global_numerator(rounding, True), M4=m4, DQ=dq)
    return spec._replace(options={"maxnreg": cfg["s_maxnreg"]} if cfg["s_maxnreg"] else None)


def quantize_sr_spec(cfg=None, SR_RP=True, **constexprs) -> KernelSpec:
    """SR's quantize kernel as launched: CONFIG's ``s_*`` tile (the 4/6 kernels') and its register cap, 1D blocks, no
    RHT; ``SR_RP``: its E2M1 codes by directed-rounding PTX (the default, ``quantize.SR_RP``) or the comparison form."""
    cfg = cfg or K.CONFIG
    tile = {"q_rows": cfg["s_rows"], "q_cols": cfg["s_cols"], "q_warps": cfg["s_warps"]}
    spec = quantize_spec("sr", {**cfg, **tile}, SR_RP=SR_RP, **constexprs)
    return spec._replace(options={"maxnreg": cfg["s_maxnreg"]} if cfg["s_maxnreg"] else None)


def amax_spec(cfg=None, **constexprs) -> KernelSpec:
    """The amax kernel (``_amax_kernel``) with CONFIG's tile, no RHT."""
    cfg = cfg or K.CONFIG
    br, bc = cfg["a_rows"], cfg["a_cols"]
    sig = dict(x_ptr="*bf16", srow="i32", R="i32", K="i32", signs_ptr="*fp32", amax_ptr="*fp32")
    const = dict(scol=1, HAD=0, NORM=1.0, RHT_IMPL=cfg["rht_impl"], TLOAD=False, BR=br, BC=bc,
                 HALVES=cfg["a_impl"] == 2)
    return KernelSpec(K._amax_kernel, sig, {**const, **constexprs}, cfg["a_warps"], br * bc)


def eden_pass1_spec(hadamard=128, cfg=None, tstore=False) -> KernelSpec:
    """MS-EDEN's block-per-thread pass 1 (``_eden_pass1_kernel``, ``e_impl`` 0) with CONFIG's tile and register cap
    (``e_maxnreg``); ``tstore``: the variant that also stores the tile transposed (``quantize_both``)."""
    cfg = cfg or K.CONFIG
    br, bc = cfg["e_rows"], max(cfg["e_cols"], hadamard or 16)
    sig = dict(x_ptr="*bf16", srow="i32", R="i32", K="i32", signs_ptr="*fp32", codes_ptr="*i32",
               scratch_ptr="*fp32", smax_ptr="*fp32", xt_ptr="*bf16")
    const = dict(scol=1, VAL_MAX=EDEN_VAL_MAX, INV_VAL_MAX=EDEN_INV_VAL_MAX, BLOCK2D=False, HAD=hadamard,
                 NORM=1.0 / hadamard ** 0.5 if hadamard else 1.0, RHT_IMPL=cfg["rht_impl"], TLOAD=False, BR=br,
                 BC=bc, MAGIC_PACK=K._MAGIC_PACK, TSTORE=tstore)
    cap = {"maxnreg": cfg["e_maxnreg"]} if cfg["e_maxnreg"] else {}
    return KernelSpec(K._eden_pass1_kernel, sig, const, cfg["e_warps"], br * bc, cap)


def eden_pass1_half_spec(cfg=None) -> KernelSpec:
    """MS-EDEN's pass 1 with half a 128-chunk per thread (``_eden_pass1_half_kernel``, ``e_impl`` 2, RHT-128 on
    contiguous rows) with CONFIG's ``h_*`` tile and register cap (``h_maxnreg``; 0: uncapped)."""
    cfg = cfg or K.CONFIG
    sig = dict(x_ptr="*bf16", srow="i32", R="i32", K="i32", signs_ptr="*fp32", codes_ptr="*i32",
               scratch_ptr="*fp32", smax_ptr="*fp32")
    const = dict(VAL_MAX=EDEN_VAL_MAX, INV_VAL_MAX=EDEN_INV_VAL_MAX, NORM=1.0 / 128 ** 0.5, BR=cfg["h_rows"],
                 BC=cfg["h_cols"], MAGIC_PACK=K._MAGIC_PACK)
    cap = {"maxnreg": cfg["h_maxnreg"]} if cfg["h_maxnreg"] else {}
    return KernelSpec(K._eden_pass1_half_kernel, sig, const, cfg["h_warps"], cfg["h_rows"] * cfg["h_cols"], cap)


def eden_pass1_quarter_spec(cfg=None) -> KernelSpec:
    """MS-EDEN's pass 1 with a quarter of a 128-chunk per thread (``_eden_pass1_quarter_kernel``, ``e_impl`` 3, RHT-128
    on contiguous rows) with CONFIG's ``u_*`` tile and register cap (``u_maxnreg``; 0: uncapped)."""
    cfg = cfg or K.CONFIG
    spec = eden_pass1_half_spec(dict(cfg, h_rows=cfg["u_rows"], h_cols=cfg["u_cols"], h_warps=cfg["u_warps"],
                                     h_maxnreg=cfg["u_maxnreg"]))
    return spec._replace(fn=K._eden_pass1_quarter_kernel)


def dequantize_spec(transpose=False, cfg=None) -> KernelSpec:
    """The dequantize kernel (``_dequantize_kernel``, bf16 out, no RHT) with CONFIG's tile, row-major or stored
    transposed (``dt_*``, the backward's requantization source), as launched on CUDA (native RNE cast)."""
    cfg = cfg or K.CONFIG
    pre = "dt" if transpose else "d"
    br, bc = cfg[pre + "_rows"], cfg[pre + "_cols"]
    sig = dict(codes_ptr="*u8", scales_ptr="*u8", gscale_ptr="*fp32", signs_ptr="*fp32", out_ptr="*bf16", R="i32",
               K="i32")
    const = dict(HAD=0, NORM=1.0, RHT_IMPL=cfg["rht_impl"], OUT_BF16=True, BR=br, BC=bc, TRANS=transpose,
                 RNE_BITS=False)
    return KernelSpec(K._dequantize_kernel, sig, const, cfg[pre + "_warps"], br * bc)


def per_element(spec: KernelSpec):
    """(instructions, shuffles) per element, registers and spill accesses (LDL + STL per thread) of the spec's
    sm_90 cubin."""
    n, ops, regs, _ = sass_stats(spec.compile("cubin"))
    per_thread = spec.elements / (32 * spec.num_warps)
    return n / per_thread, ops.get("SHFL", 0) / per_thread, regs, ops.get("LDL", 0) + ops.get("STL", 0)


def measure(cfg=None) -> list:
    """[(kernel, (instructions per element, SHFL per element, registers, spills))] for the table (``cfg``:
    CONFIG)."""
    rows = [("RTN quantize pass", per_element(quantize_spec(cfg=cfg))),
            ("RTN quantize pass + bf16 q * S (quantize_dq)", per_element(quantize_spec(cfg=cfg, DQ=True))),
            ("RTN 4/6 quantize pass", per_element(quantize46_spec(cfg=cfg))),
            ("RTN 4/6 quantize pass + bf16 q * S (quantize_dq)", per_element(quantize46_spec(cfg=cfg, dq=True))),
            ("SR quantize pass", per_element(quantize_sr_spec(cfg))),
            ("SR quantize pass, comparison form (SR_RP=0)", per_element(quantize_sr_spec(cfg, SR_RP=False))),
            ("SR quantize pass + bf16 q * S (quantize_dq)", per_element(quantize_sr_spec(cfg, DQ=True)))]
    for had in (128, 16, 0):
        rows.append((f"MS-EDEN pass 1, RHT-{had}" if had else "MS-EDEN pass 1, no RHT",
                     per_element(eden_pass1_spec(had, cfg))))
    rows.append(("MS-EDEN pass 1, RHT-128, + transposed store (quantize_both)",
                 per_element(eden_pass1_spec(128, cfg, tstore=True))))
    for cap in (0, 128):   # half a 128-chunk per thread (e_impl 2), uncapped and capped
        rows.append((f"MS-EDEN half-chunk pass 1 (e_impl 2), RHT-128, {cap or 'no'} register cap",
                     per_element(eden_pass1_half_spec(dict(cfg or K.CONFIG, h_maxnreg=cap)))))
    # a quarter of a 128-chunk per thread (e_impl 3): CONFIG's u_* tile at its cap and uncapped; one quarter per thread
    for name, over in (("", {}), (", no register cap", dict(u_maxnreg=0)),
                       (", one per thread (8x512), no register cap", dict(u_rows=8, u_cols=512, u_maxnreg=0))):
        rows.append((f"MS-EDEN quarter-chunk pass 1 (e_impl 3), RHT-128{name}",
                     per_element(eden_pass1_quarter_spec(dict(cfg or K.CONFIG, **over)))))
    rows.append(("dequantize, row-major", per_element(dequantize_spec(False, cfg))))
    rows.append(("dequantize, stored transposed", per_element(dequantize_spec(True, cfg))))
    return rows


def main() -> int:
    rows = measure()
    print("| kernel (sm_90, default tiles) | SASS instructions per element | SHFL per element | registers "
          "| spill LDL + STL |")
    print("|---|---|---|---|---|")
    for name, (n, shfl, regs, spill) in rows:
        print(f"| {name} | {n:.1f} | {shfl:.1f} | {regs} | {spill} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
