"""Numerics behind docs/OPTIM.md: second-moment reconstruction on real optimizer states, NVFP4 NS stability."""
import math

import pytest
import torch

from fp4compile.optim import newton_schulz
from fp4compile.optim.root import JORDAN
from fp4compile.optim.study import momentum_like, ns_error, tiny_gpt_states, v_error_pooled
from fp4compile.policy import NVFP4


@pytest.fixture(scope="module")
def real_v():
    # real AdamW second moments of a byte-level tiny GPT trained on the shared corpus (or package text)
    return tiny_gpt_states(steps=25, d=64, layers=1, seed=0)


def _pooled(states, fos_direct, rounding="rtn"):
    return v_error_pooled(states, rounding=rounding, direct_four_over_six=fos_direct)[0]


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


def _orthonormal(n, k, gen):
    return torch.linalg.qr(torch.randn(n, k, generator=gen, dtype=torch.float64))[0]


def test_ns_error_parts_against_a_constructed_output():
    """ns_error_parts on outputs built from G's own SVD: singular values off 1 with G's singular vectors give a
    pure ``sigma`` error and no ``direction`` error; a rotation of the left factor gives a pure ``direction``."""
    from fp4compile.optim.study import ns_error_parts

    gen = torch.Generator().manual_seed(1)
    U, V = _orthonormal(32, 32, gen), _orthonormal(80, 32, gen)
    G = U @ torch.diag(torch.linspace(0.1, 3.0, 32, dtype=torch.float64)) @ V.T
    sig = torch.linspace(0.7, 1.2, 32, dtype=torch.float64)
    parts = ns_error_parts(G, U @ torch.diag(sig) @ V.T)
    assert parts["sigma"] == pytest.approx(0.3, abs=1e-9)
    assert parts["direction"] < 1e-9
    assert parts["polar"] == pytest.approx(float((sig - 1).norm() / 32 ** 0.5), rel=1e-9)
    # rotate the left singular vectors by theta in the first plane: ||R - I||_F = 2 sqrt(2) sin(theta / 2)
    theta = 0.2
    c, s = math.cos(theta), math.sin(theta)
    R = torch.eye(32, dtype=torch.float64)
    R[0, 0] = R[1, 1] = c
    R[0, 1], R[1, 0] = -s, s
    parts = ns_error_parts(G, U @ R @ V.T)
    expected = 2 * 2 ** 0.5 * math.sin(theta / 2) / 32 ** 0.5
    assert parts["sigma"] < 1e-9
    assert parts["direction"] == pytest.approx(expected, rel=1e-6)
    assert parts["polar"] == pytest.approx(expected, rel=1e-6)
    assert ns_error_parts(G, torch.full_like(G, float("nan")))["polar"] == float("inf")


def test_ns_step_increments_locate_the_direction_error():
    """ns_step_increments: exact steps keep the singular vectors (increments at rounding level); NVFP4 steps turn
    them, most in the middle steps; stepping one step at a time is the NS itself (the last cumulative value is
    newton_schulz's direction error); with every operand exact the NVFP4 path's increments shrink to the BF16
    iterate's rounding, and with Xᵀ alone exact the total drops (B·X's right operand is the largest share)."""
    from fp4compile.optim.root import clip_by_quantile, ns_coefficients
    from fp4compile.optim.study import ns_error_parts, ns_step_increments

    G = momentum_like(64, 256, 0)
    exact = ns_step_increments(G, spec=None)
    assert max(r["increment"] for r in exact) < 1e-9
    spec = NVFP4("rtn")
    rows = ns_step_increments(G, spec=spec)
    inc = [r["increment"] for r in rows]
    assert max(inc[1:4]) > 0.01 and max(inc[1:4]) > 3 * inc[0], inc
    Gc = clip_by_quantile(G, 0.99)
    O = newton_schulz(Gc, ns_coefficients(Gc.shape, 7, "polar_express"), spec=spec, norm_scale=1.01, shift=True)
    assert rows[-1]["cumulative"] == pytest.approx(ns_error_parts(Gc, O.float())["direction"], rel=1e-9)
    assert rows[1]["sigma_max"] > rows[0]["sigma_max"]
    none = ns_step_increments(G, spec=spec, exact=("x", "e", "b", "xt"))
    assert max(r["increment"] for r in none) < 0.2 * max(inc), [r["increment"] for r in none]
    assert ns_step_increments(G, spec=spec, exact=("xt",))[-1]["cumulative"] < 0.8 * rows[-1]["cumulative"]
    with pytest.raises(ValueError, match="exact"):
        ns_step_increments(G, spec=spec, exact=("y",))


def test_ns_error_table_ranks_the_variants():
    """The per-shape table of docs/OPTIM.md on one shape: plain NVFP4 NS diverges, QRoot's default NVFP4 NS (shape-
    aware + clip + guard + shift) is finite and closer to the polar factor than without the shift, and seven
    Polar Express steps with the shift come closer still."""
    from fp4compile.optim.study import ns_error_table

    rows = {name: parts for _, name, parts in ns_error_table([(64, 256)], seed=0)}
    assert rows["nvfp4 jordan, plain"]["polar"] > 10
    default = rows["nvfp4 shape-aware + clip + guard + shift (QRoot default)"]["polar"]
    assert default < rows["nvfp4 shape-aware + clip + guard"]["polar"]
    assert rows["nvfp4 polar-express 7 steps + clip + guard + shift"]["polar"] < default
    assert rows["bf16 polar-express 7 steps + clip"]["polar"] < 0.1


def test_tiny_gpt_momenta_are_the_block_weights_exp_avg():
    """bench/ns_error.py --real's inputs: every block weight matrix of the tiny GPT (qkv, proj, fc, fc2 per layer,
    nothing else), each AdamW's first moment after the steps: finite, non-zero, of the weight's shape, and what a
    second run with the same seed gives (deterministic)."""
    from fp4compile.optim.study import tiny_gpt_momenta

    data = torch.randint(0, 256, (20_000,), generator=torch.Generator().manual_seed(0))
    got = tiny_gpt_momenta(steps=3, d=32, layers=2, seed=1, data=data)
    assert sorted(got) == sorted(f"blocks.{i}.{k}.weight" for i in range(2) for k in ("qkv", "proj", "fc", "fc2"))
    shapes = {"qkv": (96, 32), "proj": (32, 32), "fc": (128, 32), "fc2": (32, 128)}
    for name, M in got.items():
        assert tuple(M.shape) == shapes[name.split(".")[2]] and torch.isfinite(M).all() and M.abs().sum() > 0
    again = tiny_gpt_momenta(steps=3, d=32, layers=2, seed=1, data=data)
    assert all(torch.equal(got[k], again[k]) for k in got)
