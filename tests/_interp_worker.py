"""Runs the Triton kernels under TRITON_INTERPRET=1 in a fresh process (the interpreter must be chosen before
Triton is first imported) and prints a JSON report; driven by tests/test_quantize_kernels.py."""
import json
import os
import sys
import warnings

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fp4compile import ops  # noqa: E402
from fp4compile.kernels import quantize as K  # noqa: E402
from test_quantize_kernels import (BOTH_CASES, DQ_CASES, DQ_CONFIG, INTERP_CASES, NONFINITE_CASES, SEED,  # noqa: E402
                                   SIGNS, both_id, case_id, data)


def compare(got, ref):
    out = {}
    for name, a, b in zip(("codes", "scales", "global"), got, ref):
        a = a.cpu()
        out[name] = "shape/dtype" if (a.shape != b.shape or a.dtype != b.dtype) else int((a != b).sum())
    return out


@triton.jit
def _e2m1_probe(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    v = tl.load(x_ptr + offs, mask=m, other=0.0)
    # the signed code of _e2m1_mag_code (sign in bit 3), to compare with the reference's codes
    tl.store(out_ptr + offs, K._e2m1_mag_code(tl.abs(v)) | ((v.to(tl.int32, bitcast=True) >> 28) & 8), mask=m)


@triton.jit
def _e2m1_value_probe(out_ptr):
    c = tl.arange(0, 16)
    tl.store(out_ptr + c, K._e2m1_value(c))


def e2m1_decode_mismatches():
    """_e2m1_value (the kernels' E2M1 decoder) on all 16 codes against ml_dtypes' float4_e2m1fn decode (signs of zero included)."""
    import ml_dtypes
    import numpy as np

    out = torch.empty(16, dtype=torch.float32)
    _e2m1_value_probe[(1,)](out)
    ref = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    return int((out.numpy().view(np.uint32) != ref.view(np.uint32)).sum())


@triton.jit
def _mag_value_probe(x_ptr, out_ptr, out7_ptr, N: tl.constexpr):
    a = tl.load(x_ptr + tl.arange(0, N))
    tl.store(out_ptr + tl.arange(0, N), K._mag_value_magic(K._e2m1_mag_magic(a)))
    tl.store(out7_ptr + tl.arange(0, N), K._mag_value_magic(K._e2m1_mag_magic_le7(tl.minimum(a, 6.5))))


def mag_value_mismatches():
    """_mag_value_magic (the E2M1 magnitude value from MAGIC + code) of both magnitude code maps, on every E2M1
    grid point and rounding threshold with their FP32 neighbours and random magnitudes in [0, 8) (the clamped map
    also above 6, the le7 map below 7), against ml_dtypes' float4_e2m1fn rounding of the magnitude (clamped to 6)."""
    import ml_dtypes
    import numpy as np

    pts = torch.tensor([0, .25, .5, .75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 6.5, 7, 8, 100])
    near = torch.cat([pts, torch.nextafter(pts, pts + 1), torch.nextafter(pts, pts - 1).clamp(min=0)])
    g = torch.Generator().manual_seed(5)
    a = torch.cat([near, torch.rand(4096 - near.numel(), generator=g) * 8])
    out, out7 = torch.empty_like(a), torch.empty_like(a)
    _mag_value_probe[(1,)](a, out, out7, N=4096)
    ref = np.minimum(a.numpy(), 6.0).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    ref7 = np.minimum(a.numpy(), 6.5).clip(max=6.0).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    return int((out.numpy().view(np.uint32) != ref.view(np.uint32)).sum()
               + (out7.numpy().view(np.uint32) != ref7.view(np.uint32)).sum())


def e2m1_mismatches():
    """Every FP32 in [2^-3, 2^4) with the low 12 mantissa bits sampled at 0, 1, 2^11-1, 2^11, 2^11+1, 2^12-1
    (so every E2M1 tie and its neighbours), both signs, plus zeros, subnormals and huge values."""
    from fp4compile.formats.nvfp4 import e2m1_rne_codes

    lo, hi = torch.tensor([0.125, 16.0]).view(torch.int32).tolist()
    base = torch.arange(lo, hi, 4096, dtype=torch.int32)
    low = torch.tensor([0, 1, 2047, 2048, 2049, 4095], dtype=torch.int32)
    v = (base[:, None] + low[None, :]).reshape(-1).view(torch.float32)
    extra = torch.tensor([0.0, 1e-45, 1e-30, 0.0625, 7.0, 8.0, 1e10, 3e38])
    v = torch.cat([v, extra])
    v = torch.cat([v, -v])
    out = torch.empty(v.numel(), dtype=torch.int32)
    _e2m1_probe[(triton.cdiv(v.numel(), 4096),)](v, out, v.numel(), BLOCK=4096)
    return int((out != e2m1_rne_codes(v).to(torch.int32)).sum())


def dq_oracle_mismatches(codes, scales, dq):
    """Elements where ``dq`` (bf16) differs, bit for bit, from q * S decoded independently: each nibble by ml_dtypes'
    float4_e2m1fn, each scale byte by its float8_e4m3fn, the product in float64, rounded to bf16 by ml_dtypes."""
    import ml_dtypes
    import numpy as np

    c = codes.numpy()
    nib = np.stack([c & 15, c >> 4], axis=-1).reshape(c.shape[0], -1).astype(np.uint8)
    q = nib.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    sc = np.repeat(scales.numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float64), 16, axis=1)
    ref = (q * sc).astype(ml_dtypes.bfloat16).view(np.uint16)
    if dq.shape != tuple(ref.shape) or dq.dtype != torch.bfloat16:
        return "shape/dtype"
    return int((dq.view(torch.int16).numpy().view(np.uint16) != ref).sum())


def nonfinite_globals():
    """A NaN, +Inf or -Inf element in the input: {case: [kernel's global finite, reference's global finite]} for each
    scheme and pass-1 variant (formats/schemes.py, "Non-finite inputs": both must be non-finite)."""
    out = {}
    for bad in ("nan", "inf", "-inf"):
        x = data("heavy", (48, 256))
        x[37, 200] = float(bad)
        for name, args, cfg in NONFINITE_CASES:
            try:
                got = K.quantize(x, *args, SEED, False, config=cfg)
                ref = ops._quantize_reference(x, *args, SEED, False)
                out[f"{name}-{bad}"] = [bool(torch.isfinite(got[2])), bool(torch.isfinite(ref[2]))]
            except Exception as e:  # noqa: BLE001
                out[f"{name}-{bad}"] = f"{type(e).__name__}: {e}"
        try:
            got = K.quantize_both(x, 128, SIGNS, SEED, 16, SIGNS[:16], SEED + 1)
            out[f"both-{bad}"] = [bool(torch.isfinite(got[2])), bool(torch.isfinite(got[5]))]
            got = K.quantize(x, "rtn", amax=K.amax(x))
            out[f"given-amax-{bad}"] = [bool(torch.isfinite(got[2])), False]
            got = K.quantize(x, "rtn", transpose=True)   # the transposing copy's amax
            ref = ops._quantize_reference(x, "rtn", False, False, 0, None, SEED, True)
            out[f"rtn-T-{bad}"] = [bool(torch.isfinite(got[2])), bool(torch.isfinite(ref[2]))]
        except Exception as e:  # noqa: BLE001
            out[f"both-{bad}"] = f"{type(e).__name__}: {e}"
    return out


def main():
    warnings.simplefilter("ignore")  # 1/0 in a discarded where() branch
    report = {}
    for case in INTERP_CASES:
        kind, shape, r, f46, b2, h, tr = case[:7]
        cfg = case[7] if len(case) > 7 else None
        x = data(kind, shape)
        if kind == "bf16":
            x = data("heavy", shape).to(torch.bfloat16)
        sg = SIGNS[:h] if h else None
        try:
            got = K.quantize(x, r, f46, b2, h, sg, SEED, tr, config=cfg)
            ref = ops._quantize_reference(x, r, f46, b2, h, sg, SEED, tr)
            report[case_id(case)] = compare(got, ref)
            if case in DQ_CASES:  # quantize_dq: the same copy, plus its bf16 q * S
                got = K.quantize(x, r, f46, b2, h, sg, SEED, tr, config=dict(cfg or {}, **DQ_CONFIG), dq=True)
                report[case_id(case) + "-dq"] = dict(compare(got, ref),
                                                     dq=dq_oracle_mismatches(got[0], got[1], got[3]))
        except Exception as e:  # noqa: BLE001  (reported per case)
            report[case_id(case)] = f"{type(e).__name__}: {e}"
    for h, dt in [(0, torch.bfloat16), (16, torch.float32), (128, torch.bfloat16)]:
        x = data("heavy", (16, 256))
        sg = SIGNS[:h] if h else None
        c, s, g = ops._quantize_reference(x, "rtn", False, False, h, sg, None, False)
        try:
            got = K.dequantize(c, s, g, h, sg, dt, config={"rht_impl": 1} if h == 16 else None)
            report[f"dequantize-{h}-{dt}"] = int((got != torch.ops.fp4compile.dequantize(c, s, g, h, sg, dt)).sum())
        except Exception as e:  # noqa: BLE001
            report[f"dequantize-{h}-{dt}"] = f"{type(e).__name__}: {e}"
    # transposed store ([C, R] out): ragged row tiles (40 rows, 64-row tiles) and several column tiles
    for h, dt in [(0, torch.bfloat16), (16, torch.float32), (128, torch.bfloat16)]:
        x = data("heavy", (40, 384))
        sg = SIGNS[:h] if h else None
        c, s, g = ops._quantize_reference(x, "rtn", False, False, h, sg, None, False)
        key = f"dequantize-T-{h}-{dt}"
        try:
            got = K.dequantize(c, s, g, h, sg, dt, transpose=True)
            ref = torch.ops.fp4compile.dequantize(c, s, g, h, sg, dt)
            report[key] = ("shape" if got.shape != (384, 40) or not got.is_contiguous()
                           else int((got != ref.t()).sum()))
        except Exception as e:  # noqa: BLE001
            report[key] = f"{type(e).__name__}: {e}"
    for case in BOTH_CASES:
        kind, shape, h, ht, dt, cfg = case
        x = data(kind, shape).to(dt)
        args = (h, SIGNS[:h] if h else None, SEED, ht, SIGNS[:ht].flip(0) if ht else None, SEED + 1)
        try:
            got, ref = K.quantize_both(x, *args, config=cfg), ops._quantize_both_op(x, *args)
            report[both_id(case)] = {f"{k}{t}": v for t, sl in (("", slice(0, 3)), ("_t", slice(3, 6)))
                                     for k, v in compare(got[sl], ref[sl]).items()}
            got = K.quantize_both(x, *args, config=dict(cfg or {}, **DQ_CONFIG), dq=True)
            report[both_id(case) + "-dq"] = {
                f"{k}{t}": v for t, sl, rsl in (("", slice(0, 4), slice(0, 3)), ("_t", slice(4, 8), slice(3, 6)))
                for k, v in dict(compare(got[sl], ref[rsl]),
                                 dq=dq_oracle_mismatches(got[sl][0], got[sl][1], got[sl][3])).items()}
        except Exception as e:  # noqa: BLE001
            report[both_id(case)] = f"{type(e).__name__}: {e}"
    # MS-EDEN pass 2's 64-bit index path (taken for >= 2^31 scale entries) against the 32-bit one, 2D keys included
    scratch = data("heavy", (48, 24)).abs()
    outs = []
    for wide in (False, True):
        sc, g = torch.empty((48, 24), dtype=torch.uint8), torch.empty((), dtype=torch.float32)
        K._eden_pass2_kernel[(triton.cdiv(48 * 24, 256),)](scratch, scratch.max().reshape(()), SEED, sc, g, 48 * 24, 24,
                                                          BLOCK2D=True, BLOCK=256, WIDE=wide)
        outs.append((sc, g))
    report["pass2-wide"] = int((outs[0][0] != outs[1][0]).sum()) + int(outs[0][1] != outs[1][1])
    report["e2m1"] = e2m1_mismatches()
    report["e2m1-decode"] = e2m1_decode_mismatches()
    report["mag-value"] = mag_value_mismatches()
    x = data("heavy", (32, 256))
    got = K.quantize(x, "sr", hadamard=32, signs=SIGNS[:32], seed=SEED, amax=K.amax(x, 32, SIGNS[:32]))
    report["given-amax"] = compare(got, ops._quantize_reference(x, "sr", False, False, 32, SIGNS[:32], SEED, False))
    report["nonfinite"] = nonfinite_globals()
    print("REPORT" + json.dumps(report))


if __name__ == "__main__":
    main()
