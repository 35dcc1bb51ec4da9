"""SR, MS-EDEN, 4/6: statistics (unbiasedness, error vs SR, effective bits), the RNG, and the custom ops."""
import math

import numpy as np
import pytest
import torch

from fp4compile import ops  # noqa: F401  (registers torch.ops.fp4compile.*)
from fp4compile.formats import nvfp4
from fp4compile.formats import random as frandom
from fp4compile.formats.hadamard import random_signs


def eff_bits(x, y):
    rel = ((y.double() - x.double()) ** 2).mean() / (x.double() ** 2).mean()
    return -math.log2(rel.item()) / 2


def gauss(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def heavy(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.exp(1.5 * torch.randn(shape, generator=g))


# ---------------------------------------------------------------------------------------------- RNG
def _lowbias32_np(x):
    x = np.uint64(x)
    m = np.uint64(0xFFFFFFFF)
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & m
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x846CA68B)) & m
    x ^= x >> np.uint64(16)
    return int(x)


def test_hash_matches_independent_uint32_model():
    seed = -0x0123456789ABCDEF
    idx = torch.tensor([0, 1, 2, 2 ** 31, 2 ** 32 - 1, 123456789])
    s = seed & 0xFFFFFFFFFFFFFFFF
    k0 = _lowbias32_np((s & 0xFFFFFFFF) ^ 0x9E3779B9)
    k1 = _lowbias32_np((s >> 32) ^ k0)
    want = [_lowbias32_np(_lowbias32_np(int(i) ^ k0) ^ k1) for i in idx]
    assert frandom.random_bits(torch.tensor(seed), idx).tolist() == want


def test_uniform_distribution():
    u = frandom.uniform(torch.tensor(42), torch.arange(1 << 18))
    assert u.min() >= 0 and u.max() < 1
    counts = torch.histc(u, bins=64, min=0, max=1)
    expected = u.numel() / 64
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    assert chi2 < 120, chi2                            # 63 dof: p ~ 1e-5 at 120
    v = frandom.uniform(torch.tensor(43), torch.arange(1 << 18))
    assert abs(torch.corrcoef(torch.stack([u, v]))[0, 1].item()) < 0.01   # seeds give independent streams
    assert abs(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1].item()) < 0.01  # neighbours uncorrelated


def test_seed_reproducibility():
    x = gauss((32, 128))
    seed = torch.tensor(7)
    for r in ("sr", "ms_eden"):
        a = nvfp4.quantize(x, rounding=r, seed=seed)
        b = nvfp4.quantize(x, rounding=r, seed=seed)
        c = nvfp4.quantize(x, rounding=r, seed=torch.tensor(8))
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8))
        assert not (torch.equal(a.codes, c.codes) and torch.equal(a.scales.view(torch.uint8), c.scales.view(torch.uint8)))
    g1 = torch.Generator().manual_seed(5)
    g2 = torch.Generator().manual_seed(5)
    assert torch.equal(nvfp4.quantize(x, rounding="sr", generator=g1).codes,
                       nvfp4.quantize(x, rounding="sr", generator=g2).codes)


# ---------------------------------------------------------------------------------------------- SR
def _mean_err_curve(draw, x, ns):
    """MSE of the running mean of draws vs x at each N in ns."""
    acc = torch.zeros_like(x, dtype=torch.float64)
    out, n = [], 0
    for target in ns:
        while n < target:
            acc += draw(n).double()
            n += 1
        out.append(((acc / n - x.double()) ** 2).mean().item())
    return out


@pytest.mark.parametrize("block", [16, (16, 16)])
@pytest.mark.parametrize("four_over_six", [False, True])
def test_sr_unbiased(block, four_over_six):
    """Mean of N SR draws -> x with MSE ~ 1/N: the MSE of the mean drops ~2x per doubling of N (no bias floor)."""
    x = heavy((32, 64), seed=1)
    N = 256
    # all N draws in one call: the same tensor stacked N times sees the same scales and independent bits
    t = nvfp4.quantize(x.expand(N, *x.shape), rounding="sr", block=block, four_over_six=four_over_six,
                       seed=torch.tensor(11))
    d = t.dequantize(torch.float32)
    ns = [16, 32, 64, 128, 256]
    mse = [((d[:n].double().mean(0) - x.double()) ** 2).mean().item() for n in ns]
    per_doubling = [a / b for a, b in zip(mse, mse[1:])]
    overall = mse[0] / mse[-1]                     # 16x more draws: ideally 16x lower MSE
    assert overall > 10, (mse, per_doubling)
    assert all(r > 1.4 for r in per_doubling), per_doubling
    # per-element: no element's mean error exceeds ~5 standard errors of its own SR variance
    var = d.double().var(0)
    err = d.double().mean(0) - x.double()
    z = err / torch.sqrt(var / N)
    assert z[var > 0].abs().max() < 6
    # (elements with zero sample variance are skipped: with a small round-up probability p, no round-up in
    # N draws is likely; the MSE-of-the-mean curve above is what catches a bias)


def test_sr_never_saturates():
    """With the 16/17 headroom in block *and* global scales, |x * enc| <= 6 for every element."""
    x = heavy((64, 256), seed=2)
    t = nvfp4.quantize(x, rounding="sr", seed=torch.tensor(0))
    s = (t.scales.float() * t.global_scale).unsqueeze(-1)
    v = x.unflatten(-1, (16, 16)) / s
    assert v.abs().max() <= 6.0 * (1 + 1e-6)
    assert t.scales.float().max() == 448.0          # the top block's scale lands on 448, not clamped from 476
    t46 = nvfp4.quantize(x, rounding="sr", four_over_six=True, seed=torch.tensor(0))
    s46 = (t46.scales.float() * t46.global_scale).unsqueeze(-1)
    assert (x.unflatten(-1, (16, 16)) / s46).abs().max() <= 6.0 * (1 + 1e-6)
    assert t46.scales.float().max() <= 384.0        # 4/6 with SR: 256-ceiling global, 4-candidate at most 1.5x


# ---------------------------------------------------------------------------------------------- MS-EDEN
def _eden_draw(x, i, block=16, d=128):
    g = torch.Generator().manual_seed(1000 + i)
    return nvfp4.quantize(x, rounding="ms_eden", hadamard=d, block=block, generator=g).dequantize(torch.float32)


@pytest.mark.parametrize("block", [16, (16, 16)])
def test_ms_eden_unbiased(block):
    """Averaged over fresh RHT signs + scale SR, the mean of N MS-EDEN draws -> x (MSE ~ 1/N)."""
    x = gauss((16, 256), seed=3)
    ns = [4, 16, 64]
    mse = _mean_err_curve(lambda i: _eden_draw(x, i, block), x, ns)
    assert mse[0] / mse[1] > 2.5 and mse[1] / mse[2] > 2.5, mse   # 4x more draws: ideally 4x lower MSE


@pytest.mark.parametrize("data", ["gauss", "heavy"])
def test_ms_eden_beats_sr_2x_after_rht128(data, capsys):
    """Quartet II's claim: MS-EDEN has >= 2x lower MSE than SR (both after RHT-128)."""
    x = (gauss if data == "gauss" else heavy)((256, 1024), seed=4)
    g = torch.Generator().manual_seed(0)
    s = random_signs(128, g)
    mse = {}
    for r in ("sr", "ms_eden"):
        y = nvfp4.quantize(x, rounding=r, hadamard=128, signs=s, seed=torch.tensor(3)).dequantize(torch.float32)
        mse[r] = ((y.double() - x.double()) ** 2).mean().item()
    ratio = mse["sr"] / mse["ms_eden"]
    with capsys.disabled():
        print(f"\n[MS-EDEN vs SR after RHT-128, {data}] MSE ratio SR/MS-EDEN = {ratio:.2f}")
    assert ratio >= 2.0, ratio


def test_ms_eden_post_hoc_scales():
    """The post hoc range alignment (formats.schemes): per block the EDEN identity <y, q S'> = ||y||^2 holds for
    the normalized rotation y = rht(x) (checked in FP64, independent of the kernel-shaped FP32 formulas, incl.
    the 1/sqrt(d) folded into S'); global = max S' / 256, the top scale is stored as exactly 256, every stored
    scale is an E4M3 neighbour of S'/global, and over seeds the stored scale averages to S'/global."""
    from fp4compile.formats.hadamard import rht
    from fp4compile.formats.nvfp4 import e2m1_decode
    from fp4compile.formats.schemes import e4m3_neighbours, eden_block_scales

    x = heavy((32, 256), seed=11)
    s = random_signs(128, torch.Generator().manual_seed(2))
    q, s_corr = eden_block_scales(x, False, s)
    y = rht(x, s).double().unflatten(-1, (16, 16))
    proj = (y * e2m1_decode(q).double()).sum(-1) * s_corr.double()
    assert (s_corr > 0).all()
    torch.testing.assert_close(proj, (y * y).sum(-1), rtol=2e-6, atol=0)
    r = s_corr / (s_corr.max() * 2.0 ** -8)
    lo, hi = e4m3_neighbours(r)
    acc = torch.zeros_like(r, dtype=torch.float64)
    n = 200
    # 64-bit seeds with varied high words: the hash gives u = 0 at the flat index equal to the seed's high word
    # (bits(i) = lowbias32(lowbias32(i ^ k0) ^ k1) with k1 = lowbias32(hi ^ k0)), so seeds 0..n would always
    # round block 0 up; draw_seed's random 64-bit seeds move that index at random
    for seed in range(n):
        seed = (seed + 1) * 0x9E3779B97F4A7C15 % (1 << 63)
        t = nvfp4.quantize(x, rounding="ms_eden", hadamard=128, signs=s, seed=torch.tensor(seed))
        sc = t.scales.float()
        assert t.global_scale.item() == s_corr.max().item() / 256 and sc.max().item() == 256.0
        assert ((sc == lo) | (sc == hi)).all()
        acc += sc.double()
    step = (hi - lo).double()
    exact = step == 0                                          # r is an E4M3 value (e.g. the top scale, 256)
    assert torch.equal(acc[exact] / n, r.double()[exact])
    z = (acc / n - r.double())[~exact] / (step[~exact] * 0.5 / math.sqrt(n))   # SR of one scale: std <= step / 2
    assert z.abs().max() < 5, z.abs().max()


def test_effective_bits_thresholds():
    """Quartet II's kernel-test thresholds on N(0,1): RNE 3.38, 4/6 3.52, EDEN 3.32 (SR ~2.7 for reference)."""
    x = gauss((256, 1024), seed=5)
    b = {
        "rtn": eff_bits(x, nvfp4.quantize(x).dequantize(torch.float32)),
        "4/6": eff_bits(x, nvfp4.quantize(x, four_over_six=True).dequantize(torch.float32)),
        "eden": eff_bits(x, nvfp4.quantize(x, rounding="ms_eden", hadamard=128,
                                            generator=torch.Generator().manual_seed(0)).dequantize(torch.float32)),
        "sr": eff_bits(x, nvfp4.quantize(x, rounding="sr", seed=torch.tensor(1)).dequantize(torch.float32)),
    }
    assert b["rtn"] >= 3.38 and b["4/6"] >= 3.52 and b["eden"] >= 3.32, b
    assert 2.6 <= b["sr"] <= 2.85, b


@pytest.mark.parametrize("data", ["gauss", "heavy"])
@pytest.mark.parametrize("block", [16, (16, 16)])
def test_four_over_six_lowers_mse(data, block):
    """4/6 beats RTN on N(0,1) and Student-t(3). (On extreme log-normal-scaled data one tensor's MSE is set by
    a few outlier blocks and can go either way, because 4/6's 256 global ceiling re-rounds every scale: one
    such draw measured 4.144 vs 4.150 bits; averaged over draws 4/6 still wins.)"""
    if data == "gauss":
        x = gauss((128, 256), seed=6)
    else:
        torch.manual_seed(6)
        x = torch.distributions.StudentT(3.0).sample((128, 256))
    e_rtn = eff_bits(x, nvfp4.quantize(x, block=block).dequantize(torch.float32))
    e_46 = eff_bits(x, nvfp4.quantize(x, block=block, four_over_six=True).dequantize(torch.float32))
    if block == 16:
        assert e_46 > e_rtn, (e_46, e_rtn)
    else:  # 16x16 tiles: the max of 256 values rarely prefers 4; measured ~neutral on t(3) (2.4795 vs 2.4809)
        assert e_46 > e_rtn - 0.01, (e_46, e_rtn)
    # per block, 4/6 picks the better of its two candidates, so it never loses to its own 6-candidate
    t6 = nvfp4.quantize(x, block=block)
    t46 = nvfp4.quantize(x, block=block, four_over_six=True)
    assert t46.global_scale.item() == pytest.approx(t6.global_scale.item() * 448 / 256, rel=1e-6)


def test_sr_four_over_six_picks_lower_expected_error():
    x = gauss((64, 256), seed=7)
    mse = []
    for f in (False, True):
        t = nvfp4.quantize(x.expand(32, *x.shape), rounding="sr", four_over_six=f, seed=torch.tensor(5))
        mse.append(((t.dequantize(torch.float32).double() - x.double()) ** 2).mean().item())
    assert mse[1] < mse[0], mse


# ---------------------------------------------------------------------------------------------- ops
OPCHECK_CASES = [
    dict(),
    dict(rounding="rtn", four_over_six=True),
    dict(rounding="rtn", block2d=True),
    dict(rounding="rtn", transpose=True),
    dict(rounding="sr", seed=torch.tensor(3)),
    dict(rounding="sr", four_over_six=True, block2d=True, seed=torch.tensor(3)),
    dict(rounding="ms_eden", hadamard=128, signs=torch.ones(128), seed=torch.tensor(3)),
    dict(rounding="ms_eden", hadamard=16, signs=-torch.ones(16), seed=torch.tensor(3), transpose=True),
    dict(rounding="rtn", hadamard=32, signs=torch.ones(32)),
]


@pytest.mark.parametrize("kw", OPCHECK_CASES, ids=lambda kw: ",".join(f"{k}" for k in kw) or "default")
def test_opcheck_quantize(kw):
    x = heavy((32, 128), seed=8).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.fp4compile.quantize.default, (x,), kw)


@pytest.mark.parametrize("kw", [dict(rounding="rtn", four_over_six=True), dict(rounding="sr", seed=torch.tensor(3),
                                                                                  transpose=True)])
def test_opcheck_quantize_with_amax(kw):
    """The ``amax`` argument (passes/amax.py gives it): schema, fake and autograd registration of both ops."""
    x = heavy((32, 128), seed=8).to(torch.bfloat16)
    kw = dict(kw, amax=x.abs().amax().float())
    torch.library.opcheck(torch.ops.fp4compile.quantize.default, (x,), kw)
    torch.library.opcheck(torch.ops.fp4compile.quantize_dq.default, (x,), kw)


@pytest.mark.parametrize("h", [0, 16, 128])
def test_opcheck_dequantize(h):
    x = heavy((32, 128), seed=9)
    s = torch.ones(h) if h else None
    c, sc, g = torch.ops.fp4compile.quantize(x, hadamard=h, signs=s)
    torch.library.opcheck(torch.ops.fp4compile.dequantize.default, (c, sc, g), dict(hadamard=h, signs=s))
    torch.library.opcheck(torch.ops.fp4compile.dequantize.default, (c, sc, g),
                          dict(hadamard=h, signs=s, dtype=torch.float32))
    torch.library.opcheck(torch.ops.fp4compile.dequantize.default, (c, sc, g),
                          dict(hadamard=h, signs=s, transpose=True))
    t = torch.ops.fp4compile.dequantize(c, sc, g, h, s, torch.float32, True)
    assert t.shape == (128, 32) and t.is_contiguous()
    assert torch.equal(t, torch.ops.fp4compile.dequantize(c, sc, g, h, s, torch.float32).t())


def test_op_matches_eager_api_and_transpose():
    x = heavy((48, 64), seed=10)
    seed = torch.tensor(99)
    for r in ("rtn", "sr", "ms_eden"):
        s = torch.ones(16)
        c, sc, g = torch.ops.fp4compile.quantize(x, r, False, False, 16, s, seed, True)
        t = nvfp4.quantize(x.t(), rounding=r, hadamard=16, signs=s, seed=seed)
        assert torch.equal(c, t.codes) and torch.equal(sc, t.scales.view(torch.uint8))
        assert c.shape == (64, 24) and sc.shape == (64, 3)
        y = torch.ops.fp4compile.dequantize(c, sc, g, 16, s, torch.float32)
        assert torch.equal(y, t.dequantize(torch.float32))


def test_op_seed_none_is_fresh_each_call():
    x = gauss((16, 64))
    a = torch.ops.fp4compile.quantize(x, "sr")
    b = torch.ops.fp4compile.quantize(x, "sr")
    assert not torch.equal(a[0], b[0])
    torch.manual_seed(1)
    c = torch.ops.fp4compile.quantize(x, "sr")
    torch.manual_seed(1)
    d = torch.ops.fp4compile.quantize(x, "sr")
    assert torch.equal(c[0], d[0])            # drawn from torch's default generator: reproducible


def test_op_bad_inputs():
    with pytest.raises(ValueError, match="multiple of 16"):
        torch.ops.fp4compile.quantize(torch.ones(16, 24))
    with pytest.raises(ValueError, match="2D"):
        torch.ops.fp4compile.quantize(torch.ones(2, 16, 16))
    with pytest.raises(ValueError, match="rounding"):
        torch.ops.fp4compile.quantize(torch.ones(16, 16), "nearest")
    with pytest.raises(TypeError):
        torch.ops.fp4compile.quantize(torch.ones(16, 16, dtype=torch.int64))
    c, s, g = torch.ops.fp4compile.quantize(torch.ones(16, 32), hadamard=16, signs=torch.ones(16))
    with pytest.raises(ValueError, match="signs"):
        torch.ops.fp4compile.dequantize(c, s, g, 16)
