"""fp4compile::gemm: the Triton kernels (interpreter on CPU, real on CUDA) against a float64 reference.

The float64 reference decodes E2M1 codes and E4M3 scales with ml_dtypes (independent of fp4compile's own
decoder), multiplies in float64 and applies a_global * b_global. Our kernels accumulate in FP32, so fp32
output must agree to FP32-accumulation level (relative Frobenius error <= 1e-5) and bf16 output to bf16
rounding (elementwise |err| <= 2^-8 |ref| + a tiny FP32-accumulation slack).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest
import torch

import fp4compile.ops  # noqa: F401  (registers the ops)
from fp4compile.formats import nvfp4
from fp4compile.ops import _gemm_reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def operands(M, N, K, seed=0, device="cpu", scale_a=1.0, scale_b=1.0):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(M, K, generator=g) * scale_a).to(device)
    b = (torch.randn(N, K, generator=g) * scale_b).to(device)
    qa, qb = nvfp4.quantize(a), nvfp4.quantize(b)
    return (qa.codes, qa.scales.view(torch.uint8), qa.global_scale,
            qb.codes, qb.scales.view(torch.uint8), qb.global_scale)


def decode64(codes, scales):
    """Independent float64 decode: ml_dtypes float4_e2m1fn / float8_e4m3fn tables."""
    c = codes.cpu().numpy()
    nib = np.stack([c & 0xF, c >> 4], axis=-1).reshape(c.shape[0], -1)
    e2m1 = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    s = scales.cpu().numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return e2m1[nib] * np.repeat(s, 16, axis=1)


def reference64(args):
    a = decode64(args[0], args[1])
    b = decode64(args[3], args[4])
    return (a @ b.T) * (float(args[2]) * float(args[5]))


def check_close(out, ref, out_dtype, bf16_ulps=0.5):
    out = out.double().cpu().numpy()
    if out_dtype == torch.float32:
        rel = np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-300)
        assert rel <= 1e-5, rel
    else:
        # one bf16 rounding of the FP32 result: RNE is within half an ulp, ulp <= 2^-7 |v| (8 significant
        # bits), plus FP32-accumulation slack
        tol = bf16_ulps * 2.0 ** -7 * np.abs(ref) + 1e-5 * np.abs(ref).max()
        assert np.all(np.abs(out - ref) <= tol), np.max(np.abs(out - ref) - tol)


def test_decode_reference_is_independent():
    """The ml_dtypes decode agrees with fp4compile's reference decoder (sanity for the oracle itself)."""
    args = operands(8, 4, 64)
    one = torch.ones(())
    mine = nvfp4.dequantize_codes(args[0], args[1].view(torch.float8_e4m3fn), one).double().numpy()
    np.testing.assert_array_equal(decode64(args[0], args[1]), mine)


def test_cpu_reference_op_matches_float64():
    args = operands(37, 29, 96, seed=1)
    for dt in (torch.float32, torch.bfloat16):
        check_close(torch.ops.fp4compile.gemm(*args, out_dtype=dt), reference64(args), dt)


def test_opcheck_cpu():
    args = operands(16, 8, 32, seed=2)
    torch.library.opcheck(torch.ops.fp4compile.gemm.default, args, {"out_dtype": torch.float32})


def test_gemm_bias_is_added_in_fp32_before_the_rounding():
    """``bias`` of ``fp4compile::gemm`` / ``gemm_dequantized`` (CPU reference): the FP32 result plus the bias, one
    rounding to the output dtype -- not the bf16 result plus the bias rounded again (that differs: the test can
    fail) -- the same for both ops; a bias that is not an [N] float vector raises."""
    args = operands(64, 48, 96, seed=4)
    bias = (torch.randn(48, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
    f32 = torch.ops.fp4compile.gemm(*args, out_dtype=torch.float32)
    out = torch.ops.fp4compile.gemm(*args, out_dtype=torch.bfloat16, bias=bias)
    assert torch.equal(out, (f32 + bias.float()).to(torch.bfloat16))
    twice = (torch.ops.fp4compile.gemm(*args, out_dtype=torch.bfloat16).float() + bias.float()).to(torch.bfloat16)
    assert not torch.equal(out, twice)
    a16 = torch.ops.fp4compile.dequantize_blocks(args[0], args[1])
    b16 = torch.ops.fp4compile.dequantize_blocks(args[3], args[4])
    assert torch.equal(torch.ops.fp4compile.gemm_dequantized(a16, args[2], b16, args[5], torch.bfloat16, bias), out)
    check_close(torch.ops.fp4compile.gemm(*args, out_dtype=torch.float32, bias=bias),
                reference64(args) + bias.double().numpy()[None, :], torch.float32)
    torch.library.opcheck(torch.ops.fp4compile.gemm.default, args, {"out_dtype": torch.float32, "bias": bias})
    torch.library.opcheck(torch.ops.fp4compile.gemm_dequantized.default, (a16, args[2], b16, args[5]),
                          {"out_dtype": torch.bfloat16, "bias": bias})
    for bad in (bias[:47], bias.reshape(1, 48), torch.ones(48, dtype=torch.int32)):
        with pytest.raises(RuntimeError, match="bias must be"):
            torch.ops.fp4compile.gemm(*args, out_dtype=torch.float32, bias=bad)


def test_gemm_dequantized_reference_equals_gemm_of_the_codes():
    """``fp4compile::gemm_dequantized`` of two copies given as ``dequantize_blocks`` (quantize_dq's fourth output):
    the gemm op's values, bit for bit, on CPU (both FP32 matmuls of the same exact products), and the float64
    oracle's to the usual tolerance; wrong operands raise."""
    args = operands(37, 29, 96, seed=3)
    a16 = torch.ops.fp4compile.dequantize_blocks(args[0], args[1])
    b16 = torch.ops.fp4compile.dequantize_blocks(args[3], args[4])
    for dt in (torch.float32, torch.bfloat16):
        out = torch.ops.fp4compile.gemm_dequantized(a16, args[2], b16, args[5], dt)
        assert out.dtype == dt and torch.equal(out, torch.ops.fp4compile.gemm(*args, out_dtype=dt))
        check_close(out, reference64(args), dt)
    torch.library.opcheck(torch.ops.fp4compile.gemm_dequantized.default, (a16, args[2], b16, args[5]),
                          {"out_dtype": torch.float32})
    with pytest.raises(RuntimeError, match="need"):
        torch.ops.fp4compile.gemm_dequantized(a16, args[2], b16[:, :64], args[5], torch.float32)
    with pytest.raises(RuntimeError, match="bf16 operands"):
        torch.ops.fp4compile.gemm_dequantized(a16.float(), args[2], b16, args[5], torch.float32)


# ------------------------------------------------------------------------------------ interpreter (CPU)
_INTERP_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, {root!r})
    cfg_kw = dict(PREFETCH_S=True)
    from fp4compile.kernels import gemm as G
    from fp4compile.formats import nvfp4
    res = []
    for (M, N, K, impl, od, seed, cfg) in {cases!r}:
        g = torch.Generator().manual_seed(seed)
        a = torch.randn(M, K, generator=g) * 3
        b = torch.randn(N, K, generator=g) * 0.01
        qa, qb = nvfp4.quantize(a), nvfp4.quantize(b)
        args = (qa.codes, qa.scales.view(torch.uint8), qa.global_scale,
                qb.codes, qb.scales.view(torch.uint8), qb.global_scale)
        dt = torch.float32 if od == "fp32" else torch.bfloat16
        out = G.nvfp4_gemm(*args, out_dtype=dt, impl=impl, config=None if cfg is None else G._cfg(*cfg, **cfg_kw))
        torch.save({{"args": args, "out": out}}, {tmp!r} + f"/case{{len(res)}}.pt")
        res.append(len(res))
    # split-K with explicit splits (the CPU default is one split): 5 K-tiles of 32 in 1, 2, 3 and 5 splits
    for sk in (1, 2, 3, 5):
        out = G.bf16_gemm_splitk(G.dequantize_bf16(args[0], args[1]), G.dequantize_bf16(args[3], args[4]),
                                 args[2], args[5], torch.float32, split_k=sk)
        torch.save({{"args": args, "out": out}}, {tmp!r} + f"/split{{sk}}.pt")
    # a bias [N] (the linear's, in the GEMM): every implementation, FP32 out, without and with it
    bias = (torch.randn(args[3].shape[0], generator=g) * 50).to(torch.bfloat16)
    for impl in ("dq_triton", "dq_splitk", "full", "half"):    # (cuBLAS's: the GPU test)
        o0 = G.nvfp4_gemm(*args, out_dtype=torch.float32, impl=impl)
        o1 = G.nvfp4_gemm(*args, torch.float32, bias, impl=impl)
        torch.save({{"args": args, "bias": bias, "out": o0, "out_bias": o1}}, {tmp!r} + f"/bias_{{impl}}.pt")
    o2 = G.nvfp4_gemm(*args, torch.bfloat16, bias, impl="dq_triton")
    torch.save(o2, {tmp!r} + "/bias_bf16.pt")
    # the cuBLAS tail in one pass (scale_cast): an FP32 product of a ragged size, with and without the bias
    acc = torch.randn(33, 40, generator=g) * 1e3
    sc = [G.scale_cast(acc, args[2], args[5], dt, bb) for dt in (torch.float32, torch.bfloat16)
          for bb in (None, bias)]
    torch.save({{"acc": acc, "args": args, "bias": bias, "out": sc}}, {tmp!r} + "/scale_cast.pt")
    d = G.dequantize_bf16(qa.codes, qa.scales.view(torch.uint8))
    torch.save(d, {tmp!r} + "/deq.pt")
    torch.save((qa.codes, qa.scales.view(torch.uint8)), {tmp!r} + "/deq_in.pt")
    print(json.dumps(res))
""")

# edge shapes: M, N not multiples of the interpreter tile (32x32, or 16x16 with the scale prefetch), K = 16
# and 48 (K not a multiple of BLOCK_K), M >= N (the "half" kernel computes C^T and stores it transposed) and
# M < N (the "half_rega" kernel swaps operands)
INTERP_CASES = [
    (33, 17, 16, "full", "fp32", 0, None),
    (33, 17, 48, "half", "fp32", 1, None),
    (17, 40, 48, "half", "bf16", 2, (16, 16, 32, 4, 1)),
    (17, 40, 80, "half_rega", "fp32", 3, (16, 16, 32, 4, 1)),
    (40, 24, 80, "full", "bf16", 4, None),
    (33, 40, 48, "dq_triton", "fp32", 5, None),       # persistent TMA GEMM: M, N, K tails (OOB zero-fill)
    (40, 24, 80, "dq_triton", "bf16", 6, (16, 16, 32, 4, 1)),
    (33, 40, 80, "dq_splitk", "fp32", 7, None),
]


def test_triton_kernels_under_interpreter(tmp_path):
    """The real Triton kernels (portable fp32 dequant path) run eagerly on CPU under TRITON_INTERPRET=1."""
    script = _INTERP_SCRIPT.format(root=ROOT, cases=INTERP_CASES, tmp=str(tmp_path))
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    idx = json.loads(r.stdout.strip().splitlines()[-1])
    assert idx == list(range(len(INTERP_CASES)))
    for i, (M, N, K, impl, od, _, _) in enumerate(INTERP_CASES):
        d = torch.load(tmp_path / f"case{i}.pt")
        assert d["out"].shape == (M, N)
        dt = torch.float32 if od == "fp32" else torch.bfloat16
        assert d["out"].dtype == dt
        # the interpreter's fp32 -> bf16 cast truncates (the GPU rounds to nearest): allow one ulp there
        check_close(d["out"], reference64(d["args"]), dt, bf16_ulps=1.0)
    for sk in (1, 2, 3, 5):
        d = torch.load(tmp_path / f"split{sk}.pt")
        assert d["out"].shape == (33, 40)
        check_close(d["out"], reference64(d["args"]), torch.float32)
    # the bias: added in FP32 to the scaled FP32 result, exactly (the TMA GEMM's epilogue; the FP32 results of the
    # others), close to the float64 oracle plus the bias; the bf16 epilogue within the interpreter's truncation
    for impl in ("dq_triton", "dq_splitk", "full", "half"):    # (cuBLAS's: the GPU test)
        d = torch.load(tmp_path / f"bias_{impl}.pt")
        assert torch.equal(d["out_bias"], d["out"] + d["bias"].float()), impl
        ref = reference64(d["args"]) + d["bias"].double().numpy()[None, :]
        check_close(d["out_bias"], ref, torch.float32)
    check_close(torch.load(tmp_path / "bias_bf16.pt"), ref, torch.bfloat16, bf16_ulps=1.0)
    # scale_cast: the torch ops' FP32 values exactly; bf16 within the interpreter's truncating cast (one ulp)
    d = torch.load(tmp_path / "scale_cast.pt")
    alpha = d["args"][2].float().reshape(()) * d["args"][5].float().reshape(())
    cases = [(dt, bb) for dt in (torch.float32, torch.bfloat16) for bb in (None, d["bias"])]
    for (dt, bb), got in zip(cases, d["out"]):
        want = d["acc"] * alpha + (0.0 if bb is None else bb.float())
        assert got.dtype == dt and got.shape == (33, 40)
        if dt == torch.float32:
            assert torch.equal(got, want), bb is None
        else:
            assert ((got.float() - want).abs() <= want.abs() * 2.0 ** -7).all()
    codes, scales = torch.load(tmp_path / "deq_in.pt")
    np.testing.assert_array_equal(torch.load(tmp_path / "deq.pt").double().numpy(), decode64(codes, scales))


# ------------------------------------------------------------------------------------ input validation
def test_bad_inputs_raise_clear_errors():
    pytest.importorskip("triton")
    from fp4compile.kernels import gemm as G

    args = list(operands(16, 16, 32))
    c = lambda t: t.contiguous()  # noqa: E731
    with pytest.raises(ValueError, match="multiple of 16"):
        G._check_inputs(c(args[0][:, :4]), c(args[1][:, :0]), args[2], c(args[3][:, :4]), c(args[4][:, :0]),
                        args[5], torch.bfloat16)
    with pytest.raises(ValueError, match="K mismatch"):
        G._check_inputs(args[0], args[1], args[2], c(args[3][:, :8]), c(args[4][:, :1]), args[5], torch.bfloat16)
    with pytest.raises(ValueError, match="scales must be"):
        G._check_inputs(args[0], c(args[1][:, :1]), *args[2:], torch.bfloat16)
    with pytest.raises(TypeError, match="uint8"):
        G._check_inputs(args[0], args[1].view(torch.float8_e4m3fn), *args[2:], torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous"):
        G._check_inputs(args[0].t().contiguous().t(), *args[1:], torch.bfloat16)
    with pytest.raises(ValueError, match="out_dtype"):
        G._check_inputs(*args, torch.float16)


def test_module_imports_and_registers_without_cuda():
    """kernels.gemm imports on a CPU-only machine and the op still runs its CPU reference there."""
    r = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, %r); "
                        "import fp4compile.kernels.gemm as G; import torch; print(G.DEFAULT_IMPL)" % ROOT],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


# ------------------------------------------------------------------------------------ GPU
GPU_SHAPES = [(1000, 520, 784), (129, 257, 48), (64, 64, 16), (300, 200, 4096), (16, 4096, 256), (4096, 8, 512)]


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("impl", ["half", "half_rega", "full", "dequant_cublas", "dq_triton", "dq_splitk"])
@pytest.mark.parametrize("dequant", ["asm", "fp32"])
@pytest.mark.parametrize("shape", GPU_SHAPES)
def test_gpu_kernels_match_float64(impl, dequant, shape):
    from fp4compile.kernels import gemm as G

    if impl == "dequant_cublas" and dequant == "fp32":
        pytest.skip("dequant_cublas uses the default dequant path; covered by the asm case")
    M, N, K = shape
    if impl.startswith("dq_") and not G.tma_ok(M, N, K, torch.bfloat16):
        pytest.skip("TMA row alignment (auto routes such shapes elsewhere)")
    args = operands(M, N, K, seed=M + N + K, device="cuda", scale_a=100.0, scale_b=1e-3)
    ref = reference64(args)
    for dt in (torch.float32, torch.bfloat16):
        if impl == "dequant_cublas":
            out = G.nvfp4_gemm(*args, out_dtype=dt, impl=impl)
        elif impl.startswith("dq_"):
            out = G.nvfp4_gemm(*args, out_dtype=dt, impl=impl, dequant=dequant)       # autotuned / auto split
        else:
            out = G.nvfp4_gemm(*args, out_dtype=dt, impl=impl, dequant=dequant,
                               config=G._cfg(64, 64, 64, 4, 3, PREFETCH_S=impl != "full"))
        check_close(out, ref, dt)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("shape", [(768, 768, 16384), (300, 520, 4096), (1000, 256, 784)])
def test_gpu_splitk_and_tma_tiles_match_float64(shape):
    """Split-K with explicit split counts (incl. a ragged last split) and every TMA tile config."""
    from fp4compile.kernels import gemm as G

    M, N, K = shape
    args = operands(M, N, K, seed=11, device="cuda", scale_a=100.0, scale_b=1e-3)
    ref = reference64(args)
    a16, b16 = G.dequantize_bf16(args[0], args[1]), G.dequantize_bf16(args[3], args[4])
    for sk in (1, 3, 7, None):
        for dt in (torch.float32, torch.bfloat16):
            check_close(G.bf16_gemm_splitk(a16, b16, args[2], args[5], dt, split_k=sk), ref, dt)
    for cfg in G.TMA_CONFIGS:
        for dt in (torch.float32, torch.bfloat16):
            try:
                out = G.bf16_gemm_scaled(a16, b16, args[2], args[5], dt, config=cfg)
            except Exception as e:  # noqa: BLE001  (a tile that does not fit shared memory for fp32 output)
                if "OutOfResources" in type(e).__name__ or "out of resource" in str(e).lower():
                    continue
                raise
            check_close(out, ref, dt)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("impl", ["full", "half", "half_rega", "dq_triton"])
def test_gpu_deterministic_mode_launches_the_first_fitting_tile_without_timing(impl, monkeypatch):
    """Under deterministic mode the autotuned GEMMs launch the first candidate tile that fits (no autotuner, no
    stored choice): the same bits as that tile launched explicitly, on every call, and correct against float64."""
    from fp4compile import determinism
    from fp4compile.kernels import gemm as G

    def no_autotune(*a, **k):
        raise AssertionError("deterministic mode must not autotune")

    monkeypatch.setattr(G, "_get_tuned_kernel", no_autotune)
    monkeypatch.setattr(G, "_get_tma_kernel", no_autotune)
    M, N, K = 1000, 768, 1024
    args = operands(M, N, K, seed=5, device="cuda", scale_a=100.0, scale_b=1e-3)
    ref = reference64(args)
    for dt in (torch.float32, torch.bfloat16):
        with determinism.deterministic_mode():
            outs = [G.nvfp4_gemm(*args, out_dtype=dt, impl=impl) for _ in range(2)]
        assert torch.equal(outs[0], outs[1])
        check_close(outs[0], ref, dt)
        if impl == "dq_triton":
            a16, b16 = G.dequantize_bf16(args[0], args[1]), G.dequantize_bf16(args[3], args[4])
            explicit = G.first_that_fits(G.TMA_CONFIGS, lambda c: G.bf16_gemm_scaled(
                a16, b16, args[2], args[5], dt, config=c))
        else:
            mn = (M, N) if impl == "full" else ((M, N) if (impl == "half") == (M < N) else (N, M))
            explicit = G.first_that_fits(G.deterministic_configs(impl, *mn), lambda c: G.nvfp4_gemm(
                *args, out_dtype=dt, impl=impl, config=c))
        assert torch.equal(outs[0], explicit)


@pytest.mark.gpu
@cuda
def test_gpu_tuned_impl_times_candidates_and_matches_float64():
    from fp4compile.kernels import gemm as G

    args = operands(768, 512, 4096, seed=9, device="cuda")
    out = G.nvfp4_gemm(*args, impl="tuned")
    check_close(out, reference64(args), torch.bfloat16)
    best, times = G.TUNED_CHOICES[(768, 512, 4096, torch.bfloat16, args[0].device.index)]
    assert set(times) == set(G.TUNED_CANDIDATES) and best == min(times, key=times.get), times


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("shape", [(16384, 2304, 768), (16384, 768, 3072), (768, 3072, 16384), (300, 520, 4096),
                                   (1000, 256, 784)])
def test_gpu_gemm_dequantized_is_the_gemm_of_the_codes(shape):
    """``fp4compile::gemm_dequantized`` (the forward GEMM of quantize_dq operands) gives the bytes of the gemm op
    on the same copies wherever the op's implementation by shape dequantizes both operands first (the same bf16
    GEMM on the same bf16 operands), and the float64 oracle's values elsewhere; every DQ_IMPLS implementation."""
    from fp4compile.kernels import gemm as G

    M, N, K = shape
    args = operands(M, N, K, seed=13, device="cuda", scale_a=100.0, scale_b=1e-3)
    ref = reference64(args) if M * N * K <= 2 ** 33 else None
    a16, b16 = G.dequantize_bf16(args[0], args[1]), G.dequantize_bf16(args[3], args[4])
    for dt in (torch.float32, torch.bfloat16):
        out = torch.ops.fp4compile.gemm_dequantized(a16, args[2], b16, args[5], dt)
        if G.choose_impl(M, N, K, dt) in G.DQ_IMPLS:
            assert torch.equal(out, torch.ops.fp4compile.gemm(*args, out_dtype=dt)), (shape, dt)
        if ref is not None:
            check_close(out, ref, dt)
            for impl in G.DQ_IMPLS:
                if impl != "dequant_cublas" and not G.tma_ok(M, N, K, dt):
                    continue
                check_close(G.gemm_dequantized(a16, args[2], b16, args[5], dt, impl=impl), ref, dt)
    torch.library.opcheck(torch.ops.fp4compile.gemm_dequantized.default,
                          (a16[:64], args[2], b16[:32], args[5]), {"out_dtype": torch.bfloat16})


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("shape", [(16384, 2304, 768), (768, 3072, 16384), (1000, 256, 784)])
def test_gpu_gemm_bias_added_in_fp32_before_the_rounding(shape):
    """A linear's bias in the GEMM on CUDA: the TMA GEMM's epilogue adds it to the scaled FP32 accumulator before the
    one rounding (its bf16 result = the same tile's FP32 result plus the bias, rounded once, with and without the
    split epilogue store); split-K, cuBLAS and the in-register kernels likewise from their FP32 results; the op, by
    shape, close to the float64 oracle plus the bias."""
    from fp4compile.kernels import gemm as G

    M, N, K = shape
    args = operands(M, N, K, seed=17, device="cuda", scale_a=100.0, scale_b=1e-3)
    bias = (torch.randn(N, generator=torch.Generator().manual_seed(3)) * 0.5).to(torch.bfloat16).cuda()
    once = lambda f32: (f32 + bias.float()).to(torch.bfloat16)  # noqa: E731
    a16, b16 = G.dequantize_bf16(args[0], args[1]), G.dequantize_bf16(args[3], args[4])
    if G.tma_ok(M, N, K):
        f32 = G.bf16_gemm_scaled(a16, b16, args[2], args[5], torch.float32, config=G._cfg(128, 128, 64, 4, 3))
        for sub in (False, True):
            cfg = G._cfg(128, 128, 64, 4, 3, EPI_SUBTILE=sub)
            got = G.bf16_gemm_scaled(a16, b16, args[2], args[5], torch.bfloat16, config=cfg, bias=bias)
            assert torch.equal(got, once(f32)), (shape, sub)
        impls = ("dq_splitk", "dequant_cublas")
    else:
        impls = ("dequant_cublas",)
    for impl in impls:
        f32 = G.gemm_dequantized(a16, args[2], b16, args[5], torch.float32, impl=impl)
        got = G.gemm_dequantized(a16, args[2], b16, args[5], torch.bfloat16, bias, impl=impl)
        assert torch.equal(got, once(f32)), (shape, impl)
    if min(M, N) <= 768:
        f32 = G.nvfp4_gemm(*args, torch.float32, impl="full")
        assert torch.equal(G.nvfp4_gemm(*args, torch.bfloat16, bias, impl="full"), once(f32)), shape
    if M * N * K <= 2 ** 33:
        ref = reference64(args) + bias.double().cpu().numpy()[None, :]
        check_close(torch.ops.fp4compile.gemm(*args, out_dtype=torch.bfloat16, bias=bias), ref, torch.bfloat16)
        check_close(torch.ops.fp4compile.gemm_dequantized(a16, args[2], b16, args[5], torch.float32, bias), ref,
                    torch.float32)


@pytest.mark.gpu
@cuda
def test_gpu_scale_cast_is_the_torch_tail(monkeypatch):
    """``kernels.gemm.scale_cast`` (the cuBLAS GEMM's FP32 product scaled, biased and cast in one pass; ``SCALE_CAST``):
    the bytes of the eager torch ops it replaces, bf16 and FP32 out, with and without a bias, ragged sizes; and
    ``gemm_dequantized``'s cuBLAS path with it gives the same bytes as without."""
    from fp4compile.kernels import gemm as G

    g = torch.Generator().manual_seed(5)
    for M, N in ((768, 3072), (37, 129)):
        acc = (torch.randn(M, N, generator=g) * 1e3).cuda()
        ag, bg = torch.tensor(0.0123).cuda(), torch.tensor(3.5e-4).cuda()
        bias = (torch.randn(N, generator=g) * 0.3).to(torch.bfloat16).cuda()
        for dt in (torch.bfloat16, torch.float32):
            for bb in (None, bias):
                want = G._add_bias(acc.clone().mul_(ag * bg), bb, dt)
                assert torch.equal(G.scale_cast(acc, ag, bg, dt, bb), want), (M, N, dt, bb is None)
    args = operands(768, 3072, 16384, seed=9, device="cuda", scale_a=100.0, scale_b=1e-3)
    a16, b16 = G.dequantize_bf16(args[0], args[1]), G.dequantize_bf16(args[3], args[4])
    bias = (torch.randn(3072, generator=g) * 0.3).to(torch.bfloat16).cuda()
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(G, "SCALE_CAST", on)
        outs[on] = [G.gemm_dequantized(a16, args[2], b16, args[5], dt, bb, impl="dequant_cublas")
                    for dt in (torch.bfloat16, torch.float32) for bb in (None, bias)]
    assert all(torch.equal(x, y) for x, y in zip(outs[False], outs[True]))


@pytest.mark.gpu
@cuda
def test_gpu_op_autotuned_and_opcheck():
    args = operands(512, 384, 1024, seed=5, device="cuda")
    ref = reference64(args)
    for dt in (torch.float32, torch.bfloat16):
        check_close(torch.ops.fp4compile.gemm(*args, out_dtype=dt), ref, dt)
    torch.library.opcheck(torch.ops.fp4compile.gemm.default, operands(64, 32, 64, device="cuda"),
                          {"out_dtype": torch.bfloat16})


@pytest.mark.gpu
@cuda
def test_gpu_decode_exhaustive():
    """Every code byte with every finite E4M3 scale byte decodes exactly (incl. the 0.5 code -> subnormal)."""
    from fp4compile.kernels import gemm as G

    codes = torch.arange(256, dtype=torch.uint8).repeat(127, 1).cuda()
    scales = torch.arange(127, dtype=torch.uint8)[:, None].expand(127, 32).contiguous().cuda()
    want = decode64(codes, scales)
    for dq in ("asm", "fp32"):
        got = G.dequantize_bf16(codes, scales, dequant=dq).double().cpu().numpy()
        np.testing.assert_array_equal(got, want)


@pytest.mark.gpu
@cuda
def test_gpu_hgmma_in_sass():
    """The kernels use wgmma on sm_90: HGMMA in the SASS of both kernels."""
    from fp4compile.kernels import gemm as G

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm_90 only")
    args = operands(256, 256, 256, device="cuda")
    out = torch.empty(256, 256, device="cuda", dtype=torch.bfloat16)
    k = G._nvfp4_gemm_kernel[(4,)](*args, out, 256, 256, 256, 128, 16, 128, 16, 256, BLOCK_M=128, BLOCK_N=128,
                                   BLOCK_K=64, GROUP_M=8, EVEN_K=True, DEQUANT_ASM=True, OUT_FP32=False,
                                   num_warps=8, num_stages=3)
    assert "HGMMA" in k.asm["sass"]
    y16 = G.dequantize_bf16(args[3], args[4])
    k2 = G._nvfp4_bf16_gemm_kernel[(4,)](args[0], args[1], args[2], y16, args[5], out, 256, 256, 256, 128, 16,
                                         256, 256, 1, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8,
                                         EVEN_K=True, DEQUANT_ASM=True, OUT_FP32=False, num_warps=8, num_stages=3)
    assert "HGMMA" in k2.asm["sass"]
    check_close(out, reference64(args), torch.bfloat16)
    k3 = G._bf16_nvfp4_gemm_kernel[(4,)](y16, args[5], args[0], args[1], args[2], out, 256, 256, 256, 256, 128,
                                         16, 256, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, EVEN_K=True,
                                         DEQUANT_ASM=True, OUT_FP32=False, TRANS_OUT=True, PREFETCH_S=True,
                                         num_warps=8, num_stages=3)
    assert "HGMMA" in k3.asm["sass"]
    check_close(out, reference64(args), torch.bfloat16)


# ------------------------------------------------------------------------------------ impl="auto"
# (M, N, K, full, dequant_cublas, dq_triton, dq_splitk) in microseconds on the H200 (docs/BENCHMARKS.md ## GEMM):
# the GPT-124M shapes in GPU time (bench/gemm.py --lower --cudagraph, 2026-11-29 window 2), the 1B and square
# shapes per call incl. launch cost (bench/gemm.py --lower, window 1; GPU time dominates at these sizes)
H200_TABLE = [
    (16384, 2304, 768, 186, 272, 105, 333),
    (16384, 768, 2304, 173, 169, 110, 217),
    (2304, 768, 16384, 312, 121, 127, 201),
    (16384, 768, 768, 64, 107, 46, 127),
    (768, 768, 16384, 323, 60, 103, 93),
    (16384, 3072, 768, 245, 354, 137, 437),
    (16384, 768, 3072, 235, 201, 146, 265),
    (3072, 768, 16384, 417, 165, 200, 320),
    (768, 3072, 16384, 403, 156, 202, 322),
    (16384, 6144, 2048, 1193, 993, 613, 1422),
    (16384, 2048, 6144, 1214, 750, 643, 1190),
    (6144, 2048, 16384, 1219, 656, 663, 1061),
    (16384, 2048, 2048, 420, 366, 275, 491),
    (2048, 2048, 16384, 414, 242, 228, 364),
    (16384, 8192, 2048, 1574, 1333, 871, 1991),
    (16384, 2048, 8192, 1585, 973, 893, 1593),
    (8192, 2048, 16384, 1626, 879, 869, 1416),
    (2048, 8192, 16384, 1705, 908, 857, 1459),
    (4096, 4096, 4096, 403, 283, 214, 429),
    (8192, 8192, 8192, 3190, 1758, 1715, 3010),
]


def test_choose_impl_is_near_best_on_the_measured_table():
    """The "auto" rule picks, on every measured shape, an implementation within 20% of the fastest of the
    four (so a rule edit that contradicts the recorded measurements fails here)."""
    pytest.importorskip("triton")
    from fp4compile.kernels.gemm import choose_impl

    col = {"full": 3, "dequant_cublas": 4, "dq_triton": 5, "dq_splitk": 6}
    for row in H200_TABLE:
        M, N, K = row[:3]
        got = row[col[choose_impl(M, N, K)]]
        assert got <= 1.2 * min(row[3:]), (row, choose_impl(M, N, K))


def test_tma_autotune_choice_round_trips_through_the_disk_cache(tmp_path, monkeypatch):
    """The TMA GEMM's autotune choice, stored in Triton's cache dir by one process, is found by the next one for
    the same shape only; a corrupt entry, a config that is not a candidate, or the cache switched off give None."""
    from fp4compile.kernels import gemm as G

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H200")
    monkeypatch.setattr(G, "AUTOTUNE_CACHE", True)
    key = (4096, 768, 3072, torch.bfloat16, 0, False, False)
    assert G._load_tuned(key) is None
    choice = dict(G.TMA_CONFIGS[2])
    G._store_tuned(key, choice)
    assert G._load_tuned(key) == choice
    assert G._load_tuned((4096, 768, 3072, torch.float32, 0, False, False)) is None  # another out dtype
    assert G._load_tuned((4096, 768, 2048, torch.bfloat16, 0, False, False)) is None  # another shape
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H100")
    assert G._load_tuned(key) is None  # another GPU
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H200")
    path = G._tuned_cache(key).get_file(G._TUNED_FILE)
    with open(path, "w") as f:
        json.dump({"config": dict(choice, BLOCK_M=96)}, f)  # not one of TMA_CONFIGS
    assert G._load_tuned(key) is None
    with open(path, "w") as f:
        f.write("{corrupt")
    assert G._load_tuned(key) is None
    G._store_tuned(key, choice)
    assert G._load_tuned(key) == choice  # a new choice replaces the corrupt entry
    monkeypatch.setattr(G, "AUTOTUNE_CACHE", False)
    assert G._load_tuned(key) is None


def test_tma_autotune_cache_read_mode_loads_but_stores_nothing(tmp_path, monkeypatch):
    """With the disk cache read-only (``FP4COMPILE_AUTOTUNE_CACHE=read``, what bench/ncu_kernels.py sets: a choice
    tuned under a profiler must not outlive it), a stored choice is still found, a new one is not written."""
    from fp4compile.kernels import gemm as G

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H200")
    monkeypatch.setattr(G, "AUTOTUNE_CACHE", True)
    stored, other = (4096, 768, 3072, torch.bfloat16, 0, False, False), (4096, 2304, 768, torch.bfloat16, 0, False,
                                                                          False)
    G._store_tuned(stored, dict(G.TMA_CONFIGS[1]))
    monkeypatch.setattr(G, "AUTOTUNE_STORE", False)
    G._store_tuned(other, dict(G.TMA_CONFIGS[0]))
    G._store_tuned(stored, dict(G.TMA_CONFIGS[0]))            # not overwritten either
    assert G._load_tuned(other) is None
    assert G._load_tuned(stored) == G.TMA_CONFIGS[1]


@pytest.mark.parametrize("value, load, store, warned", [("1", True, True, False), ("read", True, False, False),
                                                        (" READ ", True, False, False), ("0", False, False, False),
                                                        ("yes", True, True, True)])
def test_autotune_cache_environment_variable(value, load, store, warned):
    """``FP4COMPILE_AUTOTUNE_CACHE`` as read at import (a fresh interpreter): 1 / read / 0, anything else warns
    once and means 1."""
    code = ("import warnings; warnings.simplefilter('always')\n"
            "import fp4compile.kernels.gemm as G; print(G.AUTOTUNE_CACHE, G.AUTOTUNE_STORE)")
    env = dict(os.environ, FP4COMPILE_AUTOTUNE_CACHE=value)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(load), str(store)]
    assert ("FP4COMPILE_AUTOTUNE_CACHE" in r.stderr) == warned, r.stderr


def test_tma_autotune_space_has_one_flattened_tile_and_its_choice_round_trips(tmp_path, monkeypatch):
    """The autotuner's space is TMA_CONFIGS with FLATTEN set on each config (True on exactly one entry); with
    ``flatten=True`` every config is flattened and the duplicates dropped. Every config the autotuner can choose maps
    back to a TMA_CONFIGS entry (``_tma_choice``), so the choice round-trips through the disk cache, the flattened
    entry included, while a flattened copy of another tile is not a candidate."""
    from fp4compile.kernels import gemm as G

    plain = G._get_tma_kernel(False).configs
    assert len(plain) == len(G.TMA_CONFIGS)
    assert [c.kwargs["FLATTEN"] for c in plain].count(True) == 1
    flat = G._get_tma_kernel(True).configs
    assert all(c.kwargs["FLATTEN"] for c in flat)
    assert len(flat) == len({str(c) for c in flat}) == len(G.TMA_CONFIGS) - 1
    for configs, flatten in ((plain, False), (flat, True)):
        for c in configs:
            assert G._tma_choice(c, flatten) in G.TMA_CONFIGS, (c, flatten)
    flattened = G._tma_choice(next(c for c in plain if c.kwargs["FLATTEN"]), False)
    assert flattened["FLATTEN"] is True

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA H200")
    monkeypatch.setattr(G, "AUTOTUNE_CACHE", True)
    key = (16384, 2304, 768, torch.bfloat16, 0, False, False)
    G._store_tuned(key, flattened)
    assert G._load_tuned(key) == flattened
    G._store_tuned(key, dict(G.TMA_CONFIGS[2], FLATTEN=True))  # a flattened copy of another tile
    assert G._load_tuned(key) is None


def test_auto_picks_the_mixed_gemm_only_where_it_was_measured_faster(monkeypatch):
    """``choose_impl``'s ``"mixed"`` rule: many rows, an output at most 1,024 wide, K of 768-4,096 in whole 64-wide
    tiles, and only where the kernel can run (sm_90 + Gluon: :func:`_mixed_runs`) and ``MIXED_AUTO`` is on."""
    from fp4compile.kernels import gemm as G

    monkeypatch.setattr(G, "_mixed_runs", lambda: True)
    for M, N, K in [(16384, 768, 768), (16384, 768, 2304), (16384, 768, 3072), (8192, 1024, 4096)]:
        assert G.mixed_wins(M, N, K) and G.choose_impl(M, N, K) == "mixed", (M, N, K)
    for M, N, K in [(16384, 2304, 768), (16384, 3072, 768), (4096, 4096, 4096), (768, 768, 16384),
                    (4096, 768, 768), (16384, 768, 512), (16384, 768, 8192), (16384, 768, 800)]:
        assert not G.mixed_wins(M, N, K), (M, N, K)
        assert G.choose_impl(M, N, K) != "mixed", (M, N, K)
    assert G.choose_impl(16384, 200, 768) == "full"                # skinny problems keep their rule
    monkeypatch.setattr(G, "MIXED_AUTO", False)
    assert G.choose_impl(16384, 768, 3072) == "dq_triton"
    monkeypatch.setattr(G, "MIXED_AUTO", True)
    monkeypatch.setattr(G, "_mixed_runs", lambda: False)         # no sm_90 GPU or no Gluon: never
    assert G.choose_impl(16384, 768, 3072) == "dq_triton"
