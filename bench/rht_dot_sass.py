"""Static sm_90 SASS of the RHT-128 by butterflies against RHT-128 as a tensor-core product, on a machine without a
GPU (issues 2 and 3: is a tensor-core rotation worth giving up MS-EDEN's bit-exact butterfly?).

Two skeletons of MS-EDEN's pass 1 that do the same work up to the rotation and nothing after it but the two
per-block statistics every EDEN pass needs (max |z| and the sum of squares over each 16-block, stored):

* ``butterfly``: pass 1's own load (:func:`fp4compile.kernels.quantize._load_halves`, a whole 16-block per thread)
  and rotation (``_rht_halves``: stages h = 1..8 in registers, h = 16, 32, 64 across lanes), at pass 1's tile and
  register cap (``CONFIG`` ``e_*``, ``e_maxnreg``);
* ``dot``: the tile loaded as [BR, BC] bf16 and rotated by ``tl.dot`` with a given bf16 [128, 128] matrix (the
  Hadamard matrix with the signs folded into its rows: every entry +-1, exact in bf16; FP32 accumulation), the
  statistics taken on the MMA layout.

Per kernel: SASS instructions per element, shuffles per element, tensor-core instructions (HMMA / HGMMA) per
element, registers per thread and local-memory bytes (spills). The dot skeleton leaves out what a real kernel would
add: building the signed matrix (per call: fresh signs), converting the MMA layout to the block-per-thread one for
the E2M1 packing, and the rotation's numerics (tensor-core FP32 accumulation in its own order: not the reference's
butterfly, so not bit-exact).

    python bench/rht_dot_sass.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fp4compile.kernels import quantize as K  # noqa: E402
from fp4compile.kernels.offline import compile_offline, sass_stats  # noqa: E402


@triton.jit
def _butterfly_skeleton(x_ptr, srow, R, Kd, signs_ptr, amax_ptr, ss_ptr, BR: tl.constexpr, BC: tl.constexpr):
    NB: tl.constexpr = BC // 16
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    lo, hi, rows = K._load_halves(x_ptr, srow, 1, R, Kd, pid_r, pid_c, signs_ptr, 128, 1.0, 1, 0, BR, BC, False)
    a = tl.maximum(tl.max(tl.abs(lo), axis=2), tl.max(tl.abs(hi), axis=2))
    s = K._tree2(lo * lo, hi * hi, BR, NB)
    blk = pid_c * NB + tl.arange(0, NB)
    off = rows.to(tl.int64)[:, None] * (Kd // 16) + blk[None, :]
    tl.store(amax_ptr + off, a)
    tl.store(ss_ptr + off, s)


@triton.jit
def _dot_skeleton(x_ptr, srow, R, Kd, h_ptr, amax_ptr, ss_ptr, BR: tl.constexpr, BC: tl.constexpr):
    NB: tl.constexpr = BC // 16
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BR + tl.arange(0, BR)
    cols = pid_c * BC + tl.arange(0, BC)
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * srow + cols[None, :])
    hk = tl.arange(0, 128)
    h = tl.load(h_ptr + hk[:, None] * 128 + hk[None, :])
    y = tl.reshape(tl.dot(tl.reshape(x, (BR * BC // 128, 128)), h), (BR, NB, 16))
    a = tl.max(tl.abs(y), axis=2)
    s = tl.sum(y * y, axis=2)
    blk = pid_c * NB + tl.arange(0, NB)
    off = rows.to(tl.int64)[:, None] * (Kd // 16) + blk[None, :]
    tl.store(amax_ptr + off, a)
    tl.store(ss_ptr + off, s)


_SIG = dict(x_ptr="*bf16", srow="i32", R="i32", Kd="i32", amax_ptr="*fp32", ss_ptr="*fp32")


def per_element(fn, extra_ptr: str, br: int, bc: int, warps: int, maxnreg: int = 0):
    """(instructions, SHFL, HMMA + HGMMA per element; registers; local bytes) of one skeleton's sm_90 cubin."""
    sig = dict(_SIG, **{extra_ptr: "*fp32" if extra_ptr == "signs_ptr" else "*bf16"})
    sig = {k: sig[k] for k in fn.arg_names if k in sig}
    cubin = compile_offline(fn, sig, dict(BR=br, BC=bc), warps, upto="cubin", divisible_by_16=tuple(sig),
                            **({"maxnreg": maxnreg} if maxnreg else {}))
    n, ops, regs, local = sass_stats(cubin)
    per_thread = br * bc / (32 * warps)
    return (n / per_thread, ops.get("SHFL", 0) / per_thread, (ops.get("HMMA", 0) + ops.get("HGMMA", 0)) / per_thread,
            regs, local)


def measure() -> list:
    cfg = K.CONFIG
    rows = [("butterfly (pass 1's load and RHT)", cfg["e_rows"], cfg["e_cols"], cfg["e_warps"],
             per_element(_butterfly_skeleton, "signs_ptr", cfg["e_rows"], cfg["e_cols"], cfg["e_warps"],
                         cfg["e_maxnreg"]))]
    for br, bc, warps in ((16, 256, 4), (32, 256, 4), (64, 256, 4), (64, 256, 8), (128, 256, 8)):
        rows.append(("tl.dot with a signed H128", br, bc, warps, per_element(_dot_skeleton, "h_ptr", br, bc, warps)))
    return rows


def main() -> int:
    print("| rotation | tile | warps | SASS instructions per element | SHFL per element | HMMA/HGMMA per element "
          "| registers | local bytes |")
    print("|---|---|---|---|---|---|---|---|")
    for name, br, bc, warps, (n, shfl, mma, regs, local) in measure():
        print(f"| {name} | {br}x{bc} | {warps} | {n:.1f} | {shfl:.2f} | {mma:.3f} | {regs} | {local} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
