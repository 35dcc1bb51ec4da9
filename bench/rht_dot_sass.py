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

Then the whole of pass 1 on the tensor-core rotation (``dot pass 1``: ``_eden_pass1_kernel``'s EDEN arithmetic,
packing and stores, unchanged, after the ``tl.dot``), uncapped and at 128 registers, against pass 1 itself
(``bench/quantize_sass.py``'s count of ``_eden_pass1_kernel``, RHT-128, at its 96-register cap).

Per kernel: SASS instructions per element, shuffles per element, tensor-core instructions (HMMA / HGMMA) per
element, registers per thread and register-spill accesses (LDL + STL per thread). Left out: building the signed matrix (per call: fresh
signs) and the rotation's numerics (tensor-core FP32 accumulation in its own order: not the reference's butterfly,
so not bit-exact).

    python bench/rht_dot_sass.py
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fp4compile.formats.schemes import EDEN_INV_VAL_MAX, EDEN_VAL_MAX  # noqa: E402
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
def _dot_rotated(x_ptr, srow, h_ptr, BR: tl.constexpr, BC: tl.constexpr):
    """This program's [BR, BC] tile (aligned, no masks) times the [128, 128] matrix at ``h_ptr`` along each
    128-chunk, as [BR, BC/16, 16] FP32 (tensor-core product), and the tile's rows."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * srow + cols[None, :])
    hk = tl.arange(0, 128)
    h = tl.load(h_ptr + hk[:, None] * 128 + hk[None, :])
    return tl.reshape(tl.dot(tl.reshape(x, (BR * BC // 128, 128)), h), (BR, BC // 16, 16)), rows


@triton.jit
def _dot_skeleton(x_ptr, srow, R, Kd, h_ptr, amax_ptr, ss_ptr, BR: tl.constexpr, BC: tl.constexpr):
    NB: tl.constexpr = BC // 16
    pid_c = tl.program_id(1)
    y, rows = _dot_rotated(x_ptr, srow, h_ptr, BR, BC)
    a = tl.max(tl.abs(y), axis=2)
    s = tl.sum(y * y, axis=2)
    blk = pid_c * NB + tl.arange(0, NB)
    off = rows.to(tl.int64)[:, None] * (Kd // 16) + blk[None, :]
    tl.store(amax_ptr + off, a)
    tl.store(ss_ptr + off, s)


@triton.jit
def _dot_pass1(x_ptr, srow, R, Kd, h_ptr, codes_ptr, scratch_ptr, smax_ptr, VAL_MAX: tl.constexpr,
               INV_VAL_MAX: tl.constexpr, NORM: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
               MAGIC_PACK: tl.constexpr):
    """MS-EDEN pass 1 (``_eden_pass1_kernel``, 1x16 blocks, aligned tile) with the rotation as a tensor-core product:
    the same EDEN arithmetic, packing and stores after it."""
    NB: tl.constexpr = BC // 16
    pid_c = tl.program_id(1)
    y, rows = _dot_rotated(x_ptr, srow, h_ptr, BR, BC)
    lo, hi = tl.split(tl.permute(tl.reshape(y, (BR, NB, 2, 8)), (0, 1, 3, 2)))
    a_z = tl.maximum(tl.max(tl.abs(lo), axis=2), tl.max(tl.abs(hi), axis=2))
    a_y = a_z * NORM
    live = a_y >= K.AMAX_FLUSH
    enc = tl.where(live, tl.math.div_rn(VAL_MAX, tl.where(live, a_z, 1.0)), 0.0)
    alo = tl.abs(lo) * enc[:, :, None]
    ahi = tl.abs(hi) * enc[:, :, None]
    mlo = K._e2m1_mag_magic_le7(alo)
    mhi = K._e2m1_mag_magic_le7(ahi)
    num = K._tree2(alo * alo, ahi * ahi, BR, NB)
    den = K._tree2(alo * K._mag_value_magic(mlo), ahi * K._mag_value_magic(mhi), BR, NB)
    c = tl.where(live, tl.math.div_rn(num, tl.where(live, den, 1.0)), 0.0)
    s_corr = c * (a_y * INV_VAL_MAX)
    wlo = tl.where(live, K._pack_magic(mlo, lo, MAGIC_PACK), 0)
    whi = tl.where(live, K._pack_magic(mhi, hi, MAGIC_PACK), 0)
    w = tl.reshape(tl.join(wlo, whi), (BR, 2 * NB))
    blk = pid_c * NB + tl.arange(0, NB)
    wcol = pid_c * (2 * NB) + tl.arange(0, 2 * NB)
    tl.store(codes_ptr + rows.to(tl.int64)[:, None] * (Kd // 8) + wcol[None, :], w)
    tl.store(scratch_ptr + rows.to(tl.int64)[:, None] * (Kd // 16) + blk[None, :], s_corr)
    tl.atomic_max(smax_ptr, tl.max(tl.max(s_corr, axis=1), axis=0))


_SIG = dict(x_ptr="*bf16", srow="i32", R="i32", Kd="i32", signs_ptr="*fp32", h_ptr="*bf16", amax_ptr="*fp32",
            ss_ptr="*fp32", codes_ptr="*i32", scratch_ptr="*fp32", smax_ptr="*fp32")


def per_element(fn, br: int, bc: int, warps: int, maxnreg: int = 0, **constexprs):
    """(instructions, SHFL, HMMA + HGMMA per element; registers; spill accesses LDL + STL per thread) of one
    kernel's sm_90 cubin."""
    sig = {k: _SIG[k] for k in fn.arg_names if k in _SIG}
    cubin = compile_offline(fn, sig, dict(constexprs, BR=br, BC=bc), warps, upto="cubin",
                            divisible_by_16=tuple(sig), **({"maxnreg": maxnreg} if maxnreg else {}))
    n, ops, regs, _ = sass_stats(cubin)
    per_thread = br * bc / (32 * warps)
    return (n / per_thread, ops.get("SHFL", 0) / per_thread, (ops.get("HMMA", 0) + ops.get("HGMMA", 0)) / per_thread,
            regs, ops.get("LDL", 0) + ops.get("STL", 0))


def measure() -> list:
    """[(kernel, tile rows, tile columns, warps, register cap, per_element(...))]."""
    cfg = K.CONFIG
    e = (cfg["e_rows"], cfg["e_cols"], cfg["e_warps"], cfg["e_maxnreg"])
    rows = [("skeleton: butterfly (pass 1's load and RHT)", *e, per_element(_butterfly_skeleton, *e))]
    for br, bc, warps in ((16, 256, 4), (32, 256, 4), (64, 256, 4), (64, 256, 8), (128, 256, 8)):
        rows.append(("skeleton: tl.dot with a signed H128", br, bc, warps, 0,
                     per_element(_dot_skeleton, br, bc, warps)))
    from bench.quantize_sass import eden_pass1_spec, per_element as spec_per_element

    n, shfl, regs, spill = spec_per_element(eden_pass1_spec(128))
    rows.append(("pass 1 (_eden_pass1_kernel, RHT-128)", *e, (n, shfl, 0.0, regs, spill)))
    const = dict(VAL_MAX=EDEN_VAL_MAX, INV_VAL_MAX=EDEN_INV_VAL_MAX, NORM=1 / 128 ** 0.5, MAGIC_PACK=K._MAGIC_PACK)
    for br, bc, warps, cap in ((32, 256, 4, 0), (32, 256, 4, 128), (64, 256, 8, 0), (64, 256, 8, 128)):
        rows.append(("dot pass 1", br, bc, warps, cap, per_element(_dot_pass1, br, bc, warps, cap, **const)))
    return rows


def main() -> int:
    print("| kernel | tile | warps | register cap | SASS instructions per element | SHFL per element "
          "| HMMA/HGMMA per element | registers | spill LDL + STL |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, br, bc, warps, cap, (n, shfl, mma, regs, local) in measure():
        print(f"| {name} | {br}x{bc} | {warps} | {cap or '-'} | {n:.1f} | {shfl:.2f} | {mma:.3f} | {regs} | {local} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
