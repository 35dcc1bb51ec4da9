"""NVFP4 optimizer-state codecs: bit-exact RTN vs the format reference, unbiased SR, safe v reconstruction."""
import numpy as np
import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from fp4compile.formats import hadamard, nvfp4
from fp4compile.optim import codec


def _exact_block_sse(x, codes, scales_u8, gs):
    """Per-16-block squared error of a stored encoding against x, in float64 with exact products
    (E2M1 value x E4M3 scale x FP32 global scale needs at most 2 + 4 + 24 significant bits)."""
    q = nvfp4.e2m1_decode(nvfp4.unpack_nibbles(codes)).double().reshape(-1, 16)
    sf = scales_u8.view(torch.float8_e4m3fn).double().unsqueeze(-1)
    return ((x.double().reshape(-1, 16) - q * sf * gs.double()) ** 2).sum(-1)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), logscale=st.floats(-20, 20), fos=st.booleans())
@example(seed=41848, logscale=0.0, fos=True)  # block 21: both 4/6 candidates decode to the same values (6·40 = 4·60)
@example(seed=41848, logscale=0.0, fos=False)
def test_rtn_matches_format_reference_bitwise(seed, logscale, fos):
    """``codec.encode`` (one global scale, RTN) against ``formats.nvfp4.quantize_rtn_``: the same global scale, and
    the same codes and block scales in every block but 4/6 ties. The two compute the candidates' squared errors
    with different roundings (the codec: x - code·(S·g); the format reference: x·s_enc - code·S in FP32), so a
    block whose two candidates are exactly as good may be resolved either way (CI found one: seed 41848). A block
    may differ only with 4/6 on and only if the two stored choices' exact errors agree to 1e-6 (relative)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, generator=g) * torch.rand(512, generator=g) ** 3 * 2.0 ** logscale
    c, s, gs = codec.encode(x, rounding="rtn", four_over_six=fos)
    c2, s2, g2 = nvfp4.quantize_rtn_(x, False, fos)
    s2 = s2.view(torch.uint8)
    assert torch.equal(gs, g2)
    differ = (c.reshape(-1, 8) != c2.reshape(-1, 8)).any(-1) | (s != s2)
    if not fos:
        assert not differ.any()
        return
    e, e2 = _exact_block_sse(x, c, s, gs)[differ], _exact_block_sse(x, c2, s2, g2)[differ]
    assert torch.all((e - e2).abs() <= 1e-6 * torch.maximum(e, e2)), (differ.nonzero().flatten(), e, e2)
    assert differ.sum() <= 2  # ties are rare: a systematic difference is not one


def test_zero_tensor_roundtrips_to_zero():
    c, s, g = codec.encode(torch.zeros(64), rounding="sr", four_over_six=True, u=torch.rand(64))
    assert torch.equal(codec.decode(c, s, g), torch.zeros(64))


def test_butterfly_hadamard_matches_matrix_rht():
    x = torch.randn(8, 64)
    for d in (16, 32, 64):
        s = hadamard.random_signs(d, torch.Generator().manual_seed(d))
        torch.testing.assert_close(codec.rht(x, s), hadamard.rht(x, s), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(codec.inverse_rht(codec.rht(x, s), s), x, atol=1e-5, rtol=1e-5)


def test_decode_matches_lut():
    cs = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(codec.e2m1_decode(cs), nvfp4.e2m1_decode(cs))


def test_hash_uniforms_are_uniform():
    u = codec.uniform_hash(1 << 16, torch.tensor(7), "cpu")
    hist = torch.histc(u, bins=16, min=0, max=1)
    expected = u.numel() / 16
    chi2 = float(((hist - expected) ** 2 / expected).sum())
    assert chi2 < 50  # 15 dof: p ~ 1e-5
    assert not torch.equal(u, codec.uniform_hash(1 << 16, torch.tensor(8), "cpu"))


def test_stochastic_rounding_is_unbiased():
    x = torch.linspace(-5.9, 5.9, 64).repeat(1)
    acc = torch.zeros_like(x)
    n = 400
    for i in range(n):
        acc += codec.e2m1_decode(codec.e2m1_sr_codes(x, codec.uniform_hash(64, torch.tensor(i), "cpu")))
    mean = acc / n
    # worst-case per-element std of one draw is step/2 <= 1; 5 sigma of the mean of 400 draws
    assert float((mean - x).abs().max()) < 5 * 1.0 / n ** 0.5


def test_shared_sr_uniforms_are_the_two_halves_of_one_hash_and_independent():
    """Q-AdamW's two SR streams (m: high 16 bits, v: low 16 bits of one hash word) against bit operations in
    numpy on the hash words, then uniformity (chi-square per stream) and independence (correlation of the two
    streams, and of the joint 4x4 histogram) over 2^16 elements."""
    n, seed = 1 << 16, torch.tensor(11)
    um, uv = codec.shared_sr_uniforms(n, seed, "cpu")
    h = codec.hash_bits(n, seed, "cpu").numpy().astype(np.uint64)
    np.testing.assert_array_equal(um.numpy(), (h >> np.uint64(16)).astype(np.float64) / 65536.0)
    np.testing.assert_array_equal(uv.numpy(), (h & np.uint64(0xFFFF)).astype(np.float64) / 65536.0)
    # the high half is the 24-bit stream's top 16 bits
    np.testing.assert_array_equal(um.numpy(), np.floor(codec.uniform_hash(n, seed, "cpu").numpy() * 65536) / 65536)
    expected = n / 16
    for u in (um, uv):
        assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
        chi2 = float(((torch.histc(u, bins=16, min=0, max=1) - expected) ** 2 / expected).sum())
        assert chi2 < 50  # 15 dof: p ~ 1e-5
    rho = float(np.corrcoef(um.numpy(), uv.numpy())[0, 1])
    assert abs(rho) < 5 / n ** 0.5  # 5 sigma of the sample correlation of independent streams
    joint = np.histogram2d(um.numpy(), uv.numpy(), bins=4, range=[[0, 1], [0, 1]])[0]
    chi2 = float(((joint - n / 16) ** 2 / (n / 16)).sum())
    assert chi2 < 50  # 15 dof


def test_stochastic_rounding_with_16_bit_shared_uniforms_is_unbiased():
    """Both 16-bit streams round without bias: the mean of N draws approaches x as 1/sqrt(N) (the bias of a
    16-bit uniform, < 2^-16 of a grid step, is far below the 5-sigma bound)."""
    x = torch.linspace(-5.9, 5.9, 64)
    acc_m, acc_v = torch.zeros_like(x), torch.zeros_like(x)
    n = 400
    for i in range(n):
        um, uv = codec.shared_sr_uniforms(64, torch.tensor(i), "cpu")
        acc_m += codec.e2m1_decode(codec.e2m1_sr_codes(x, um))
        acc_v += codec.e2m1_decode(codec.e2m1_sr_codes(x, uv))
    for acc in (acc_m, acc_v):
        assert float((acc / n - x).abs().max()) < 5 * 1.0 / n ** 0.5


def test_encode_takes_given_uniforms_and_rejects_wrong_ones():
    m = torch.randn(1024)
    s = hadamard.random_signs(16, torch.Generator().manual_seed(0))
    um, uv = codec.shared_sr_uniforms(1024, torch.tensor(5), "cpu")
    # the given uniforms decide the rounding: u = 0 rounds every off-grid element up, u -> 1 down
    up = codec.encode_m(m, s, u=torch.zeros(1024))
    down = codec.encode_m(m, s, u=torch.full((1024,), 1 - 2 ** -16))
    assert not torch.equal(up[0], down[0])
    assert torch.equal(up[1], down[1])  # scales and the 4/6 choice do not depend on them
    # the low half is another stream than the seed's 24-bit one (the high half is its top 16 bits)
    assert not torch.equal(codec.encode_m(m, s, u=uv)[0], codec.encode_m(m, s, seed=torch.tensor(5))[0])
    assert all(torch.equal(x, y) for x, y in zip(codec.encode_m(m, s, u=um), codec.encode_m(m, s, u=um.clone())))
    with pytest.raises(ValueError, match="float32 \\[1024\\]"):
        codec.encode_m(m, s, u=um[:512])
    with pytest.raises(ValueError, match="for 'sr' only"):
        codec.encode_v(m.abs(), s, tile=32, rounding="rtn", u=um)


def test_bf16_stochastic_round_unbiased():
    x = torch.full((4096,), 1.0 + 2 ** -10)  # between two bf16 values (ulp 2^-7)
    y = codec.bf16_stochastic_round(x, torch.tensor(3)).float()
    assert set(y.unique().tolist()) <= {1.0, 1.0 + 2 ** -7}
    assert abs(float(y.mean()) - (1.0 + 2 ** -10)) < 4 * (2 ** -7 * 0.35) / 64


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 1000), spread=st.floats(0, 30))
def test_v_reconstruction_nonnegative_finite(seed, spread):
    g = torch.Generator().manual_seed(seed)
    v = torch.exp(torch.randn(1024, generator=g) * spread).clamp(max=1e30) * 1e-12
    v[::7] = 0.0
    s = hadamard.random_signs(16, g)
    enc = codec.encode_v(v, s, tile=32, four_over_six=True)
    for floor in (False, True):
        r = codec.decode_v_sqrt(*enc, s, tile=32, floor=floor)
        assert torch.isfinite(r).all() and (r >= 0).all()
    assert (codec.decode_v_sqrt(*enc, s, tile=32, floor=True) >= codec.decode_v_sqrt(*enc, s, tile=32)).all()


def test_m_codec_error_small():
    m = torch.randn(4096) * 1e-3
    s = hadamard.random_signs(16, torch.Generator().manual_seed(0))
    mh = codec.decode_m(*codec.encode_m(m, s, seed=torch.tensor(1)), s)
    rel = float(((mh - m) ** 2).sum() / (m ** 2).sum())
    assert rel < 0.03
