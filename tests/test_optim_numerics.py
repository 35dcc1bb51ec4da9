"""Numerics behind docs/OPTIM.md: second-moment reconstruction on real optimizer states, NVFP4 NS stability."""
import pytest
import torch

from fp4compile.formats.hadamard import random_signs
from fp4compile.optim import codec, newton_schulz
from fp4compile.optim.root import JORDAN
from fp4compile.optim.study import momentum_like, ns_error, tiny_gpt_states
from fp4compile.policy import NVFP4


@pytest.fixture(scope="module")
def real_v():
    # real AdamW second moments of a byte-level tiny GPT trained on the shared corpus (or package text)
    return tiny_gpt_states(steps=25, d=64, layers=1, seed=0)


def _pooled(states, fos_direct, rounding="rtn"):
    s = random_signs(16, torch.Generator().manual_seed(0))
    seed = torch.tensor(0)
    e0 = e1 = 0.0
    for v in states.values():
        v = v.reshape(-1)
        d = codec.direct_v_roundtrip(v, four_over_six=fos_direct, rounding=rounding, seed=seed)
        o = codec.decode_v(*codec.encode_v(v, s, tile=32, four_over_six=True, rounding=rounding, seed=seed), s,
                           tile=32)
        e0 += float(((d.double() - v.double()) ** 2).sum())
        e1 += float(((o.double() - v.double()) ** 2).sum())
    return 1 - e1 / e0


@pytest.mark.slow
def test_v_transform_beats_direct_nvfp4_on_real_states(real_v):
    assert len(real_v) >= 5
    # paper target: >= 60 % lower relative MSE than storing v directly in NVFP4 (plain RTN)
    assert _pooled(real_v, fos_direct=False) >= 0.60
    # against a direct baseline that also gets 4/6 the reduction is smaller (measured ~56 %, docs/OPTIM.md)
    assert _pooled(real_v, fos_direct=True) >= 0.45


@pytest.mark.slow
def test_v_transform_beats_direct_nvfp4_with_stochastic_rounding(real_v):
    # Q-AdamW's default rounds v stochastically (RTN compounds upwards over steps, docs/OPTIM.md): the transform
    # against direct NVFP4 storage with the same rounding (measured 74 % / 69 % without / with 4/6 on the direct side)
    assert _pooled(real_v, fos_direct=False, rounding="sr") >= 0.60
    assert _pooled(real_v, fos_direct=True, rounding="sr") >= 0.60


def test_plain_nvfp4_ns_diverges_and_guard_fixes_it():
    """The finding in docs/OPTIM.md: NVFP4 NS with Jordan's coefficients leaves the quintic's basin."""
    G = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    plain = newton_schulz(G, (JORDAN,) * 5, spec=NVFP4(), guard=None).float()
    guarded = newton_schulz(G, (JORDAN,) * 5, spec=NVFP4(), guard=1.0).float()
    assert not torch.isfinite(plain).all() or ns_error(G, plain) > 10
    assert torch.isfinite(guarded).all() and ns_error(G, guarded) < 0.6


def test_nvfp4_ns_on_clipped_momentum_is_bounded():
    G = momentum_like(64, 192, seed=3)
    eps = float(G.abs().flatten().quantile(0.99))
    O = newton_schulz(G.clamp(-eps, eps), (JORDAN,) * 5, spec=NVFP4())
    assert ns_error(G.clamp(-eps, eps), O) < 0.6
