"""The NVFP4 reference encoder: bit-exactness against an independent ml_dtypes oracle, properties, errors."""
import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp4compile.formats import nvfp4
from fp4compile.formats.hadamard import fwht, hadamard_matrix, inverse_rht, random_signs, rht
from fp4compile.formats.schemes import e4m3_neighbours

F4 = ml_dtypes.float4_e2m1fn
F8 = ml_dtypes.float8_e4m3fn


# ---------------------------------------------------------------------------------------------- the oracle
def test_ml_dtypes_rounding_behaviour():
    """Pin what the oracle relies on: RNE ties, E2M1 saturation, E4M3 overflow (NaN past 464 -> clamp first)."""
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    assert mids.astype(F4).astype(np.float32).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert np.array([7.0, 100.0, -9.0], np.float32).astype(F4).astype(np.float32).tolist() == [6.0, 6.0, -6.0]
    assert np.array([-0.0, -0.1], np.float32).astype(F4).view(np.uint8).tolist() == [8, 8]  # signed zero
    assert np.array([0.26], np.float32).astype(F4).view(np.uint8).tolist() == [1]
    e = np.array([448, 464, 2.0 ** -10, 1.5 * 2.0 ** -9], np.float32).astype(F8).astype(np.float32)
    assert e.tolist() == [448.0, 448.0, 0.0, 2.0 ** -8]
    assert np.isnan(np.array([470.0], np.float32).astype(F8).astype(np.float32)[0])  # hence the clamp


def oracle_rtn(x: np.ndarray, block2d=False, four_over_six=False):
    """NVFP4 RTN written independently with numpy + ml_dtypes casts (clamping done here)."""
    x = x.astype(np.float32)
    lead, K = x.shape[:-1], x.shape[-1]
    amax = np.float32(np.abs(x).max()) if x.size else np.float32(0)
    if amax < np.float32(2.0 ** -100):      # the format's flush threshold (nvfp4.AMAX_FLUSH), incl. amax == 0
        return (np.zeros((*lead, K // 2), np.uint8), np.zeros((*lead, K // 16), np.uint8), np.float32(0))
    s_enc = np.float32(6 * (256 if four_over_six else 448)) / amax
    g = np.float32(1) / s_enc
    xb = x.reshape(*lead, K // 16, 16)
    ab = np.abs(xb).max(-1)
    if block2d:
        t = ab.reshape(*lead[:-1], lead[-1] // 16, 16, K // 16).max(-2, keepdims=True)
        ab = np.broadcast_to(t, (*lead[:-1], lead[-1] // 16, 16, K // 16)).reshape(ab.shape)

    def enc(m):
        s = np.minimum(ab / np.float32(m) * s_enc, np.float32(448)).astype(np.float32).astype(F8)
        sf = s.astype(np.float32)
        with np.errstate(divide="ignore"):
            e = np.where(sf == 0, np.float32(0), np.float32(1) / (sf * g)).astype(np.float32)
        v = np.clip(xb * e[..., None], -6, 6).astype(np.float32)
        v = np.where(np.signbit(xb * e[..., None]), -np.abs(v), np.abs(v))  # keep -0
        q = v.astype(F4)
        # 4/6 error as defined by the reference: FP32, in units of the global decode scale, adjacent-pair tree
        d = (xb * s_enc).astype(np.float32) - (q.astype(np.float32) * sf[..., None]).astype(np.float32)
        err = (d * d).astype(np.float32)
        while err.shape[-1] > 1:
            err = (err[..., 0::2] + err[..., 1::2]).astype(np.float32)
        return s.view(np.uint8), q.view(np.uint8) & 0xF, err[..., 0]

    s6, q6, e6 = enc(6.0)
    if four_over_six:
        s4, q4, e4 = enc(4.0)
        if block2d:
            def tile(e):
                t = e.reshape(*lead[:-1], lead[-1] // 16, 16, K // 16)
                while t.shape[-2] > 1:
                    t = (t[..., 0::2, :] + t[..., 1::2, :]).astype(np.float32)
                return np.broadcast_to(t, (*lead[:-1], lead[-1] // 16, 16, K // 16)).reshape(e.shape)
            e6, e4 = tile(e6), tile(e4)
        pick = e4 < e6
        s6 = np.where(pick, s4, s6)
        q6 = np.where(pick[..., None], q4, q6)
    q = q6.reshape(*lead, K)
    codes = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    return codes, s6.astype(np.uint8), g


def assert_matches_oracle(x, **kw):
    t = nvfp4.quantize(x, **kw)
    codes, scales, g = oracle_rtn(x.float().numpy(), block2d=kw.get("block") == (16, 16),
                                  four_over_six=kw.get("four_over_six", False))
    np.testing.assert_array_equal(t.codes.numpy(), codes)
    np.testing.assert_array_equal(t.scales.view(torch.uint8).numpy(), scales)
    assert t.global_scale.item() == float(g)
    assert t.codes.shape == (*x.shape[:-1], x.shape[-1] // 2) and t.scales.dtype == torch.float8_e4m3fn


def _data(kind, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "gauss":
        return torch.randn(shape, generator=g)
    if kind == "heavy":  # Student-t with 2 degrees of freedom
        return torch.randn(shape, generator=g) / torch.sqrt(torch.distributions.Chi2(2.0).sample(shape) / 2)
    if kind == "wide":  # 40 binades of dynamic range
        return torch.randn(shape, generator=g) * torch.exp2(torch.randint(-20, 20, shape, generator=g).float())
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["gauss", "heavy", "wide"])
@pytest.mark.parametrize("block", [16, (16, 16)])
@pytest.mark.parametrize("four_over_six", [False, True])
def test_rtn_bit_exact_vs_oracle(kind, block, four_over_six):
    torch.manual_seed(0)
    assert_matches_oracle(_data(kind, (64, 256)), block=block, four_over_six=four_over_six)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rtn_bit_exact_batched_and_dtypes(dtype):
    x = _data("heavy", (2, 3, 32, 64), seed=3).to(dtype)
    assert_matches_oracle(x)
    assert_matches_oracle(x, block=(16, 16))


def test_rtn_exact_ties():
    """Elements landing exactly on every E2M1 midpoint round to even, as the oracle and the hardware do."""
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]
    rows = []
    for S in (1.0, 2.0, 0.25, 2.0 ** -6):  # E4M3 powers of two: the block scale is exact, so is x * enc
        row = [m * S for m in mids] + [-m * S for m in mids]
        rows.append(row)
    x = torch.tensor(rows + [[2688.0] + [0.0] * 15], dtype=torch.float32)  # amax 2688: s_enc = global = 1
    t = nvfp4.quantize(x)
    assert t.global_scale.item() == 1.0
    q = nvfp4.unpack_nibbles(t.codes)[:4]
    expected = [0, 2, 2, 4, 4, 6, 6, 7]
    assert q[:, :8].tolist() == [expected] * 4
    assert q[:, 8:].tolist() == [[c | 8 for c in expected]] * 4
    assert_matches_oracle(x)


def test_zero_and_underflowing_blocks():
    x = torch.zeros(4, 64)
    x[0, :16] = torch.linspace(-1000, 1000, 16)
    x[1, 16:32] = 1e-30                           # underflows the E4M3 scale: encodes as zeros
    x[2, 32:48] = -0.0                            # negative zeros keep their sign bit (code 8)
    t = nvfp4.quantize(x)
    s = t.scales.float()
    assert s[1, 1] == 0 and s[3].abs().sum() == 0
    y = t.dequantize(torch.float32)
    assert torch.isfinite(y).all() and (y[1:] == 0).all()
    assert_matches_oracle(x)


@pytest.mark.parametrize("rounding", ["rtn", "sr", "ms_eden"])
@pytest.mark.parametrize("tiny", [1.401298464324817e-45, 1e-38, 7e-31])
def test_tiny_amax_flushes_to_zero(rounding, tiny):
    """amax below AMAX_FLUSH (2^-100): G / amax would overflow FP32 or leave subnormal decode scales, so the tensor
    encodes as all-zero (found by hypothesis: a single 1.4e-45 among zeros used to give NaN scales). Just above
    the threshold the encoding is finite and the largest element keeps its value to E2M1/E4M3 precision."""
    x = torch.zeros(4, 32)
    x[3, 31] = tiny
    t = nvfp4.quantize(x, rounding=rounding, hadamard=16 if rounding == "ms_eden" else None)
    assert (t.codes == 0).all() and (t.scales.float() == 0).all() and t.global_scale.item() == 0.0
    assert (t.dequantize(torch.float32) == 0).all()
    x[3, 31] = 2.0 ** -99
    t = nvfp4.quantize(x)
    y = t.dequantize(torch.float32)
    assert torch.isfinite(y).all() and torch.isfinite(t.scales.float()).all()
    assert abs(y[3, 31].item() - 2.0 ** -99) <= 0.25 * 2.0 ** -99


@pytest.mark.parametrize("rounding", ["rtn", "sr", "ms_eden"])
def test_all_zero_tensor(rounding):
    t = nvfp4.quantize(torch.zeros(16, 64), rounding=rounding, hadamard=16 if rounding == "ms_eden" else None)
    assert (t.codes == 0).all() and (t.scales.float() == 0).all() and t.global_scale.item() == 0.0
    y = t.dequantize(torch.float32)
    assert (y == 0).all() and torch.isfinite(y).all()


def test_packing_matches_float4_e2m1fn_x2():
    t = nvfp4.quantize(_data("gauss", (16, 64)))
    q = nvfp4.unpack_nibbles(t.codes)
    assert torch.equal(q[:, 0::2], t.codes & 0xF) and torch.equal(q[:, 1::2], t.codes >> 4)
    if hasattr(torch, "float4_e2m1fn_x2"):
        assert t.codes.view(torch.float4_e2m1fn_x2).shape == t.codes.shape


def test_2d_blocks_are_transpose_invariant():
    x = _data("heavy", (64, 128), seed=5)
    a = nvfp4.quantize(x, block=(16, 16)).dequantize(torch.float32)
    b = nvfp4.quantize(x.t().contiguous(), block=(16, 16)).dequantize(torch.float32)
    assert torch.equal(a, b.t())


# ---------------------------------------------------------------------------------------------- properties
finite = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=60, deadline=None)
@given(st.lists(finite, min_size=64, max_size=64), st.sampled_from([False, True]))
def test_rtn_error_bound_per_block(vals, four_over_six):
    """|x - x^| <= scale (half the largest E2M1 step), or the saturation overshoot, or amax_b if the scale is 0."""
    x = torch.tensor(vals, dtype=torch.float32).view(4, 16)
    t = nvfp4.quantize(x, four_over_six=four_over_six)
    err = (t.dequantize(torch.float32) - x).abs()
    scale = t.scales.float().squeeze(-1) * t.global_scale
    amax_b = x.abs().amax(-1)
    bound = torch.maximum(scale, amax_b - 6 * scale)
    bound = torch.where(scale == 0, amax_b, bound) * (1 + 1e-6) + 1e-30
    assert (err.amax(-1) <= bound).all()


e4m3_pow2 = st.integers(-6, 5).map(lambda e: 2.0 ** e)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 15), min_size=48, max_size=48), st.lists(e4m3_pow2, min_size=3, max_size=3))
def test_idempotent_on_grid(codes, scales):
    """Values already on the NVFP4 grid (global = 1, each block's max = 6 * its scale) come back unchanged."""
    q = torch.tensor(codes, dtype=torch.uint8).view(3, 16)
    q[:, 0] = 7                                            # the block max is 6 -> the stored scale is exact
    vals = nvfp4.e2m1_decode(q) * torch.tensor(scales).view(3, 1)
    x = torch.cat([vals.flatten(), torch.tensor([2688.0] + [0.0] * 15)]).view(4, 16)
    t = nvfp4.quantize(x)
    assert t.global_scale.item() == 1.0
    y = t.dequantize(torch.float32)
    assert torch.equal(y, x)
    t2 = nvfp4.quantize(y)
    assert torch.equal(t2.codes, t.codes) and torch.equal(t2.scales.view(torch.uint8), t.scales.view(torch.uint8))


@settings(max_examples=20, deadline=None)
@given(st.sampled_from([16, 32, 64, 128]), st.integers(0, 2 ** 31))
def test_hadamard_orthonormal_and_invertible(d, seed):
    h = hadamard_matrix(d, torch.float64)
    assert torch.allclose(h @ h.t(), torch.eye(d, dtype=torch.float64), atol=1e-12)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 2 * d, generator=g)
    s = random_signs(d, g)
    y = rht(x, s)
    ref = ((x.double().unflatten(-1, (2, d)) * s.double()) @ h).flatten(-2)
    assert torch.allclose(y.double(), ref, atol=1e-5)                         # = (x * s) @ H / sqrt(d)
    assert torch.allclose(inverse_rht(y, s), x, atol=1e-5)                     # invertible
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)           # norm-preserving
    assert torch.equal(fwht(torch.eye(d)), torch.sign(hadamard_matrix(d)))      # butterfly = Sylvester order


def test_e4m3_neighbours_exhaustive():
    vals = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (vals[:-1] + vals[1:]) / 2
    lo, hi = e4m3_neighbours(mids)
    assert torch.equal(lo, vals[:-1]) and torch.equal(hi, vals[1:])
    lo, hi = e4m3_neighbours(vals)
    assert torch.equal(lo, vals) and torch.equal(hi, vals)


# ---------------------------------------------------------------------------------------------- bad input
def test_bad_inputs():
    with pytest.raises(TypeError, match="float"):
        nvfp4.quantize(torch.ones(4, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4.quantize(torch.ones(4, 24))
    with pytest.raises(ValueError, match="2D 16x16"):
        nvfp4.quantize(torch.ones(8, 16), block=(16, 16))
    with pytest.raises(ValueError, match="NaN or Inf"):
        nvfp4.quantize(torch.tensor([float("nan")] + [0.0] * 15))
    with pytest.raises(ValueError, match="NaN or Inf"):
        nvfp4.quantize(torch.tensor([float("inf")] + [0.0] * 15))
    with pytest.raises(ValueError, match="hadamard"):
        nvfp4.quantize(torch.ones(4, 32), hadamard=8)
    with pytest.raises(ValueError, match="multiple of the Hadamard"):
        nvfp4.quantize(torch.ones(4, 48), hadamard=32)
    with pytest.raises(ValueError, match="rounding"):
        nvfp4.quantize(torch.ones(4, 16), rounding="stochastic")
    with pytest.raises(ValueError, match="four_over_six"):
        nvfp4.quantize(torch.ones(4, 16), rounding="ms_eden", four_over_six=True)
    with pytest.raises(ValueError, match="signs"):
        nvfp4.quantize(torch.ones(4, 32), hadamard=16, signs=torch.ones(32))
    with pytest.raises(ValueError, match="block"):
        nvfp4.quantize(torch.ones(4, 32), block=32)


def test_effective_bits_helper_is_sane():
    x = _data("gauss", (8, 64))
    y = nvfp4.quantize(x).dequantize(torch.float32)
    rel = ((y - x) ** 2).mean() / (x ** 2).mean()
    assert 3.0 < -math.log2(rel.item()) / 2 < 4.0
