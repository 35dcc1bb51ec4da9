"""kernels/ns_glue.py: the NVFP4 Newton–Schulz's per-matrix scale-and-round passes against their torch forms."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fp4compile.kernels import ns_glue

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cases(device="cpu"):
    g = torch.Generator().manual_seed(0)
    t16 = torch.randn(3, 17, 40, generator=g).to(torch.bfloat16)
    t32 = torch.randn(3, 17, 40, generator=g) * 1e3
    y = torch.randn(3, 17, 40, generator=g).to(torch.bfloat16)
    scales = (torch.rand(3, 1, 1, generator=g) + 0.3, torch.rand(3, generator=g) - 0.5, torch.tensor(0.7316),
              torch.tensor(3e-39), torch.tensor([3e-39]))
    return [(t.to(device), s.to(device), y.to(device)) for t in (t16, t32) for s in scales]


def _ref_scale(t, s, dtype):
    s = s.reshape((-1,) + (1,) * (t.dim() - 1)) if s.numel() > 1 else s.reshape(())
    return (t.float() * s).to(dtype)


def _ref_axpy(t, s, y, dtype):
    s = s.reshape((-1,) + (1,) * (t.dim() - 1)) if s.numel() > 1 else s.reshape(())
    return ((t.float() * s) + y.float()).to(dtype)


def _shift_cases(device="cpu"):
    """(A, alpha, k, c, E2) for sub_diag and shift_poly: bf16 and FP32 stacks of square matrices, one of m = 1."""
    g = torch.Generator().manual_seed(2)
    out = []
    for S, m, dtype in ((3, 17, torch.bfloat16), (2, 16, torch.float32), (4, 1, torch.bfloat16)):
        A = torch.randn(S, m, m, generator=g).to(dtype)
        alpha = A.float().diagonal(dim1=-2, dim2=-1).mean(-1) + torch.randn(S, generator=g)
        k = torch.randn(S, generator=g) * 3
        E2 = torch.randn(S, m, m, generator=g).to(torch.bfloat16)
        out.append(tuple(t.to(device) for t in (A, alpha, k)) + (-4.7750, E2.to(device)))
    return out


def _ref_sub_diag(A, alpha, dtype):
    """A - alpha I by an identity matrix (alpha · 0 = 0 off the diagonal, and a - 0 = a), in FP32."""
    eye = torch.eye(A.shape[-1], device=A.device)
    return (A.float() - alpha[:, None, None] * eye).to(dtype)


def _ref_shift_poly(A, alpha, k, c, E2, dtype):
    E = A.float() - alpha[:, None, None] * torch.eye(A.shape[-1], device=A.device)
    return (k[:, None, None] * E + torch.tensor(c, dtype=torch.float32) * E2.float()).to(dtype)


def _e2_scale_cases(device="cpu"):
    """(A, alpha, k, c, E2 as an FP32 product, its scale) for shift_poly's e2_scale: a 0-dim global and one per
    matrix."""
    out = []
    for i, (A, alpha, k, c, E2) in enumerate(_shift_cases(device)):
        g = torch.Generator().manual_seed(10 + i)
        P = (torch.randn(E2.shape, generator=g) * 300).to(device)
        for scale in (torch.tensor(0.00731), torch.rand(A.shape[0], generator=g) + 0.1):
            out.append((A, alpha, k, c, P, scale.to(device)))
    return out


def test_shift_torch_path_is_the_upcast_form():
    """sub_diag and shift_poly on the CPU (no interpreter): the bits of the identity-matrix forms above, for bf16
    and FP32 stacks and outputs (c taken as FP32, as torch takes a scalar operand); with ``e2_scale``, those of the
    form with E² first scaled and rounded to bf16 (the product's own rounding)."""
    for A, alpha, k, c, E2 in _shift_cases():
        for dtype in (torch.bfloat16, torch.float32):
            out = ns_glue.sub_diag(A, alpha, dtype)
            assert out.dtype == dtype and torch.equal(out, _ref_sub_diag(A, alpha, dtype))
            out = ns_glue.shift_poly(A, alpha, k, c, E2, dtype)
            assert out.dtype == dtype and torch.equal(out, _ref_shift_poly(A, alpha, k, c, E2, dtype))
    for A, alpha, k, c, P, g in _e2_scale_cases():
        for dtype in (torch.bfloat16, torch.float32):
            out = ns_glue.shift_poly(A, alpha, k, c, P, dtype, e2_scale=g)
            want = _ref_shift_poly(A, alpha, k, c, _ref_scale(P, g, torch.bfloat16), dtype)
            assert out.dtype == dtype and torch.equal(out, want)


def test_shift_bad_inputs_raise():
    A = torch.ones(3, 4, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="square"):
        ns_glue.sub_diag(torch.ones(3, 4, 5), torch.ones(3), torch.bfloat16)
    with pytest.raises(ValueError, match="FP32"):
        ns_glue.sub_diag(A, torch.ones(3, dtype=torch.float64), torch.bfloat16)
    with pytest.raises(ValueError, match="alpha"):
        ns_glue.sub_diag(A, torch.ones(4), torch.bfloat16)
    with pytest.raises(ValueError, match="k must be"):
        ns_glue.shift_poly(A, torch.ones(3), torch.ones(1), 1.0, A, torch.bfloat16)
    with pytest.raises(ValueError, match="E2"):
        ns_glue.shift_poly(A, torch.ones(3), torch.ones(3), 1.0, A[:, :2], torch.bfloat16)


def _ys_cases(device="cpu"):
    """(t, s, y, y_scale) for axpy_rows with y_scale: y an FP32 product, its scale a 0-dim global or one per matrix."""
    g = torch.Generator().manual_seed(3)
    t = torch.randn(3, 16, 40, generator=g).to(torch.bfloat16)
    y = torch.randn(3, 16, 40, generator=g) * 300
    out = [(t, torch.rand(3, 1, 1, generator=g) + 0.5, y, ys)
           for ys in (torch.tensor(0.01234), torch.rand(3, generator=g), torch.tensor([3e-39]))]
    out.append((t, torch.tensor(0.8125), y, torch.rand(3, generator=g)))    # the factor one, y's per matrix
    return [tuple(x.to(device) for x in case) for case in out]


def _ref_axpy_ys(t, s, y, ys, dtype):
    return _ref_axpy(t, s, _ref_scale(y, ys, dtype), dtype)


def test_torch_path_is_the_upcast_form():
    """On the CPU (no interpreter) both functions are torch ops with an FP32 computation and one rounding on the
    store: the bits of the upcast expressions, for bf16 and FP32 stacks, a factor per matrix ([S, 1, 1] and [S]),
    a 0-dim and a one-element scalar (a 0-dim one would not promote a bf16 t to FP32 in a plain torch.mul), bf16 and
    FP32 outputs."""
    for t, s, y in _cases():
        for dtype in (torch.bfloat16, torch.float32):
            out = ns_glue.scale_rows(t, s, dtype)
            assert out.dtype == dtype and torch.equal(out, _ref_scale(t, s, dtype))
            out = ns_glue.axpy_rows(t, s, y, dtype)
            assert out.dtype == dtype and torch.equal(out, _ref_axpy(t, s, y, dtype))
    for t, s, y, ys in _ys_cases():       # y first rounded to dtype as y * ys, then the axpy
        for dtype in (torch.bfloat16, torch.float32):
            out = ns_glue.axpy_rows(t, s, y, dtype, y_scale=ys)
            assert out.dtype == dtype and torch.equal(out, _ref_axpy_ys(t, s, y, ys, dtype))


def test_bad_scales_and_shapes_raise():
    t = torch.ones(3, 4, 16, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="FP32"):
        ns_glue.scale_rows(t, torch.ones(3, dtype=torch.bfloat16), torch.bfloat16)
    with pytest.raises(ValueError, match="one per matrix"):
        ns_glue.scale_rows(t, torch.ones(4), torch.bfloat16)
    with pytest.raises(ValueError, match="one per matrix"):
        ns_glue.scale_rows(t, torch.ones(3, 4, 1), torch.bfloat16)
    with pytest.raises(ValueError, match="differ"):
        ns_glue.axpy_rows(t, torch.ones(3), torch.ones(3, 4, 8), torch.bfloat16)


def test_kernel_under_the_interpreter(tmp_path):
    """The Triton kernels (TRITON_INTERPRET=1, a fresh process) on every case: FP32 outputs equal to the torch forms
    bit for bit (the axpy's product and sum rounded separately, as the kernel is written), bf16 outputs within the
    interpreter's truncating cast (one bf16 ulp) where they are normal numbers."""
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {REPO!r}); sys.path.insert(0, {os.path.join(REPO, 'tests')!r})
        from fp4compile.kernels import ns_glue
        from test_ns_glue import _cases, _shift_cases, _ys_cases
        assert ns_glue._use_kernel(torch.ones(1))
        outs = [(ns_glue.scale_rows(t, s, d), ns_glue.axpy_rows(t, s, y, d)) for t, s, y in _cases()
                for d in (torch.bfloat16, torch.float32)]
        outs += [(ns_glue.sub_diag(A, al, d), ns_glue.shift_poly(A, al, k, c, E2, d))
                 for A, al, k, c, E2 in _shift_cases() for d in (torch.bfloat16, torch.float32)]
        outs += [(ns_glue.axpy_rows(t, s, y, d, y_scale=ys),) for t, s, y, ys in _ys_cases()
                 for d in (torch.bfloat16, torch.float32)]
        torch.save(outs, {str(tmp_path / 'out.pt')!r})
    """))
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    outs = torch.load(tmp_path / "out.pt")
    refs = [(_ref_scale(t, s, d), _ref_axpy(t, s, y, d)) for t, s, y in _cases() for d in (torch.bfloat16,
                                                                                         torch.float32)]
    refs += [(_ref_sub_diag(A, al, d), _ref_shift_poly(A, al, k, c, E2, d)) for A, al, k, c, E2 in _shift_cases()
             for d in (torch.bfloat16, torch.float32)]
    assert len(outs) == len(refs) + 8 == 34
    for (got,), (t, s, y, ys, d) in zip(outs[26:], [c + (d,) for c in _ys_cases() for d in (torch.bfloat16,
                                                                                         torch.float32)]):
        want = _ref_axpy_ys(t, s, y, ys, d)
        if d == torch.float32:
            assert torch.equal(got, want)
        else:   # two truncating casts (y * ys, then the sum) against two RNE ones: two bf16 ulps of the terms'
            # magnitude (the GPU test compares these bit for bit)
            mag = (t.float() * s).abs() + _ref_scale(y, ys, d).float().abs()
            normal = want.float().abs() >= 2.0 ** -126
            assert normal.sum() > 0
            assert ((got.float() - want.float()).abs()[normal] <= mag[normal] * 2.0 ** -6).all()
    for got, want in zip(outs[:26], refs):
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape
            if w.dtype == torch.float32:
                assert torch.equal(g, w)
            else:   # one bf16 ulp; subnormal results are left to the GPU test (the interpreter's bf16 cast of
                # an FP32 subnormal is not the hardware's: it returned about half the value in this test)
                normal = w.float().abs() >= 2.0 ** -126
                assert normal.sum() > 0
                assert ((g.float() - w.float()).abs()[normal] <= w.float().abs()[normal] * 2.0 ** -7).all()


def test_kernel_compiles_without_fma_for_sm90():
    """Compiled for sm_90 here (kernels.offline) as launched (no FMA contraction): the axpy's product and sum are a
    separate multiply and add, so the FP32 sum is rounded as torch's two ops round it."""
    pytest.importorskip("triton")
    from fp4compile.kernels.offline import compile_offline

    counts = {}
    for yscale in (False, True):      # with y_scale: y an FP32 product, rounded to bf16 after its scale
        sig = dict(t_ptr="*bf16", s_ptr="*fp32", y_ptr="*fp32" if yscale else "*bf16", ys_ptr="*fp32",
                   out_ptr="*bf16", amax_ptr="*i32", per="i32", s_step="i32", ys_step="i32")
        ptx = compile_offline(ns_glue._rows_kernel, sig, dict(BLOCK=ns_glue.BLOCK, ADD=True, YSCALE=yscale,
                                                              AMAX=False), 4,
                              upto="ptx", divisible_by_16=("t_ptr", "s_ptr", "y_ptr", "ys_ptr", "out_ptr"))
        assert "atom" not in ptx and "red." not in ptx
        assert "fma.rn.f32" not in ptx and "mul.f32" in ptx.replace("mul.rn.f32", "mul.f32")
        assert ".ftz" not in ptx                              # subnormal products and results are kept
        assert "div." not in ptx and "rem." not in ptx        # a program's factors are one load each
        counts[yscale] = (ptx.count("cvt.rn.bf16.f32") + ptx.count("cvt.rn.bf16x2.f32"),
                          ptx.count("mul.rn.f32") + ptx.count("mul.f32"))
    assert counts[False][0] > 0                               # the store's RNE cast
    assert counts[True] == (2 * counts[False][0], 2 * counts[False][1])   # y * ys, rounded to bf16, per element
    br, bc = ns_glue.SHIFT_TILE
    counts = {}
    for amax, e2s in ((False, False), (True, False), (True, True)):
        sig = dict(a_ptr="*bf16", alpha_ptr="*fp32", k_ptr="*fp32", e2_ptr="*fp32" if e2s else "*bf16",
                   e2s_ptr="*fp32", out_ptr="*bf16", amax_ptr="*i32", m="i32", c="fp32", e2s_step="i32")
        ptx = compile_offline(ns_glue._shift_kernel, sig, dict(BR=br, BC=bc, POLY=True, E2S=e2s, AMAX=amax), 4,
                              upto="ptx", divisible_by_16=("a_ptr", "alpha_ptr", "k_ptr", "e2_ptr", "out_ptr"))
        counts[amax, e2s] = (ptx.count("cvt.rn.bf16.f32") + 2 * ptx.count("cvt.rn.bf16x2.f32"),
                             ptx.count("mul.rn.f32") + ptx.count("mul.f32"))
        assert "fma.rn.f32" not in ptx and ".ftz" not in ptx      # k e and c e2 each rounded, then the sum
        assert "div." not in ptx and "rem." not in ptx            # the diagonal by row == col, no index division
        assert ptx.count("mul.rn.f32") + ptx.count("mul.f32") >= 2 and "sub" in ptx
        # the amax slot: one integer atomic max per program (of |out|'s FP32 bits), none without it
        assert (".max.s32" in ptx and ("atom." in ptx or "red." in ptx)) == amax
    # e2_scale: E² times its scale and rounded to bf16 per element, in the pass (bf16 roundings and products of
    # the per-element work: twice and 1.5 times those without it)
    (cvt, mul), (cvt_s, mul_s) = counts[True, False], counts[True, True]
    assert cvt > 0 and cvt_s == 2 * cvt and 2 * mul_s == 3 * mul, counts
    sig = dict(t_ptr="*bf16", s_ptr="*fp32", y_ptr="*fp32", ys_ptr="*fp32", out_ptr="*bf16", amax_ptr="*i32",
               per="i32", s_step="i32", ys_step="i32")
    ptx = compile_offline(ns_glue._rows_kernel, sig, dict(BLOCK=ns_glue.BLOCK, ADD=True, YSCALE=True, AMAX=True), 4,
                          upto="ptx", divisible_by_16=("t_ptr", "s_ptr", "y_ptr", "ys_ptr", "out_ptr"))
    assert ".max.s32" in ptx and ("atom." in ptx or "red." in ptx) and "fma.rn.f32" not in ptx


def _amax_calls(device="cpu"):
    """(name, call(slot) -> output) of every pass that takes an amax slot, on the cases above, plus inputs with a
    NaN, an inf and only (signed) zeros."""
    calls = []
    for i, (t, s, y) in enumerate(_cases(device)):
        calls.append((f"scale{i}", lambda sl, t=t, s=s: ns_glue.scale_rows(t, s, torch.bfloat16, amax=sl)))
        calls.append((f"axpy{i}", lambda sl, t=t, s=s, y=y: ns_glue.axpy_rows(t, s, y, torch.bfloat16, amax=sl)))
    for i, (t, s, y, ys) in enumerate(_ys_cases(device)):
        calls.append((f"axpy_ys{i}", lambda sl, t=t, s=s, y=y, ys=ys: ns_glue.axpy_rows(t, s, y, torch.bfloat16,
                                                                                         y_scale=ys, amax=sl)))
    for i, (A, al, k, c, P, g) in enumerate(_e2_scale_cases(device)):
        calls.append((f"poly_e2s{i}", lambda sl, A=A, al=al, k=k, c=c, P=P, g=g: ns_glue.shift_poly(
            A, al, k, c, P, torch.bfloat16, amax=sl, e2_scale=g)))
    for i, (A, al, k, c, E2) in enumerate(_shift_cases(device)):
        calls.append((f"sub{i}", lambda sl, A=A, al=al: ns_glue.sub_diag(A, al, torch.bfloat16, amax=sl)))
        calls.append((f"poly{i}", lambda sl, A=A, al=al, k=k, c=c, E2=E2: ns_glue.shift_poly(
            A, al, k, c, E2, torch.bfloat16, amax=sl)))
    t = _cases(device)[0][0].clone()
    one = torch.ones((), device=device)
    for name, special in (("nan", float("nan")), ("inf", -float("inf"))):
        u = t.clone()
        u[1, 3, 5] = special
        calls.append((name, lambda sl, u=u: ns_glue.scale_rows(u, one, torch.bfloat16, amax=sl)))
    z = torch.zeros_like(t)
    z[0] = -0.0
    calls.append(("zeros", lambda sl, z=z: ns_glue.axpy_rows(z, one, z, amax=sl)))
    return calls


def _check_amax(slot, out):
    """The slot holds max|out| exactly (NaN where out has one)."""
    want = out.float().abs().amax()
    got = ns_glue.amax_value(slot)
    assert got.dtype == torch.float32 and got.dim() == 0
    assert torch.equal(got.cpu(), want.cpu()) or (bool(got.isnan()) and bool(want.isnan())), (got, want)


def test_amax_slot_torch_path():
    """The torch forms (CPU) fill an amax slot with their output's max|·| exactly (NaN, inf, signed zeros
    included); a slot keeps the larger of two passes' maxima (the integer order of |x|'s FP32 bits is the floats'
    order); a slot that is not one int32 element on the output's device is a clear error."""
    for name, call in _amax_calls():
        slot = torch.zeros(1, dtype=torch.int32)
        _check_amax(slot, call(slot))
    t = torch.tensor([[[1.0, -3.0]], [[0.5, 2.0]]], dtype=torch.bfloat16)
    slot = torch.zeros(1, dtype=torch.int32)
    ns_glue.scale_rows(t, torch.tensor([2.0, 1.0]), torch.bfloat16, amax=slot)     # max 6
    ns_glue.scale_rows(t, torch.tensor([1.0, 1.0]), torch.bfloat16, amax=slot)     # max 3
    assert float(ns_glue.amax_value(slot)) == 6.0
    for bad in (torch.zeros(1), torch.zeros(2, dtype=torch.int32)):
        with pytest.raises(ValueError, match="amax"):
            ns_glue.scale_rows(t, torch.tensor(1.0), torch.bfloat16, amax=bad)


def test_amax_slot_kernel_under_the_interpreter(tmp_path):
    """The kernels' amax (TRITON_INTERPRET=1, a fresh process): an integer atomic max of |out|'s bits per program
    gives exactly max|out| of the kernel's own output, NaN and inf included, in one slot however many programs and
    matrices the pass has. Also shift_poly's ``e2_scale``: one pass equal to the two (scale_rows, then shift_poly)."""
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {REPO!r}); sys.path.insert(0, {os.path.join(REPO, 'tests')!r})
        from fp4compile.kernels import ns_glue
        from test_ns_glue import _amax_calls, _check_amax, _e2_scale_cases
        assert ns_glue._use_kernel(torch.ones(1))
        n = 0
        for name, call in _amax_calls():
            slot = torch.zeros(1, dtype=torch.int32)
            _check_amax(slot, call(slot))
            n += 1
        print("checked", n)
        # shift_poly's e2_scale: the interpreter's own scale-and-round of E² (the same truncating casts) in one pass
        for A, al, k, c, P, g in _e2_scale_cases():
            for d in (torch.bfloat16, torch.float32):
                one = ns_glue.shift_poly(A, al, k, c, P, d, e2_scale=g)
                two = ns_glue.shift_poly(A, al, k, c, ns_glue.scale_rows(P, g, torch.bfloat16), d)
                assert torch.equal(one, two)
        print("e2 ok")
    """))
    r = subprocess.run([sys.executable, str(script)], env=dict(os.environ, TRITON_INTERPRET="1"),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"checked {len(_amax_calls())}" in r.stdout and "e2 ok" in r.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_kernel_is_the_torch_form_bit_for_bit(monkeypatch):
    """CUDA: the kernel (ns_glue.KERNEL) against the torch ops on the same device, bit for bit (RNE casts on both
    sides), on the cases above and on 124M-set-sized stacks; and Q-Root's NVFP4 NS with it equal to without."""
    from fp4compile.optim import newton_schulz, ns_coefficients
    from fp4compile.policy import NVFP4

    monkeypatch.setattr(ns_glue, "KERNEL", True)
    assert ns_glue._use_kernel(torch.ones(1, device="cuda"))
    cases = _cases("cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    big = torch.randn(12, 768, 3072, generator=g, device="cuda").to(torch.bfloat16)
    cases.append((big, torch.rand(12, 1, 1, generator=g, device="cuda") + 0.5, big.flip(-1)))
    for t, s, y in cases:
        for d in (torch.bfloat16, torch.float32):
            assert torch.equal(ns_glue.scale_rows(t, s, d), _ref_scale(t, s, d))
            assert torch.equal(ns_glue.axpy_rows(t, s, y, d), _ref_axpy(t, s, y, d))
    shift = _shift_cases("cuda")
    A = torch.randn(48, 768, 768, generator=g, device="cuda").to(torch.bfloat16)
    shift.append((A, torch.rand(48, generator=g, device="cuda"), torch.randn(48, generator=g, device="cuda"),
                  2.0315, A.flip(-1)))
    for t, s, y, ys in _ys_cases("cuda") + [(big, cases[-1][1], big.float().flip(0) * 7, torch.tensor(0.3, device="cuda"))]:
        for d in (torch.bfloat16, torch.float32):
            assert torch.equal(ns_glue.axpy_rows(t, s, y, d, y_scale=ys), _ref_axpy_ys(t, s, y, ys, d))
    for A, al, k, c, E2 in shift:
        for d in (torch.bfloat16, torch.float32):
            assert torch.equal(ns_glue.sub_diag(A, al, d), _ref_sub_diag(A, al, d))
            assert torch.equal(ns_glue.shift_poly(A, al, k, c, E2, d), _ref_shift_poly(A, al, k, c, E2, d))
    for A, al, k, c, P, sc in _e2_scale_cases("cuda") + [(A, shift[-1][1], shift[-1][2], 2.0315, A.float() * 5,
                                                          torch.rand(48, device="cuda"))]:
        for d in (torch.bfloat16, torch.float32):
            assert torch.equal(ns_glue.shift_poly(A, al, k, c, P, d, e2_scale=sc),
                               _ref_shift_poly(A, al, k, c, _ref_scale(P, sc, torch.bfloat16), d))
    for name, call in _amax_calls("cuda"):          # the kernels' amax slots: max|out| exactly
        slot = torch.zeros(1, dtype=torch.int32, device="cuda")
        _check_amax(slot, call(slot))
    slot = torch.zeros(1, dtype=torch.int32, device="cuda")
    _check_amax(slot, ns_glue.axpy_rows(big, cases[-1][1], big.flip(0), amax=slot))
    G = torch.randn(4, 128, 384, generator=g, device="cuda")
    coeffs = ns_coefficients((128, 384))
    kernel_matvec = ns_glue.matvec
    for shift in (False, True):
        # the guard's matvec sums in another order than cuBLAS (not the same bits by design): the torch form in both
        # arms for the bit-for-bit comparison, then the kernel's NS against it, close
        monkeypatch.setattr(ns_glue, "matvec", lambda A, v: torch.bmm(A.float(), v))
        with_kernel = newton_schulz(G, coeffs, spec=NVFP4(), shift=shift)
        monkeypatch.setattr(ns_glue, "KERNEL", False)
        assert torch.equal(with_kernel, newton_schulz(G, coeffs, spec=NVFP4(), shift=shift))
        monkeypatch.setattr(ns_glue, "KERNEL", True)
        monkeypatch.setattr(ns_glue, "matvec", kernel_matvec)
        full = newton_schulz(G, coeffs, spec=NVFP4(), shift=shift).float()
        assert ((full - with_kernel.float()).norm() / with_kernel.float().norm()) < 1e-2


def _matvec_cases(device="cpu"):
    g = torch.Generator().manual_seed(4)
    out = []
    for S, m, dtype in ((3, 17, torch.bfloat16), (2, 160, torch.bfloat16), (2, 32, torch.float32)):
        out.append((torch.randn(S, m, m, generator=g).to(dtype), torch.randn(S, m, 1, generator=g)))
    return [(A.to(device), v.to(device)) for A, v in out]


def _check_matvec(got, A, v):
    """Against float64: FP32 products and sums, within a bound on their rounding (m ulps of sum |a v|)."""
    want = A.double() @ v.double()
    bound = (A.double().abs() @ v.double().abs()) * A.shape[-1] * 2.0 ** -23
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert ((got.double() - want).abs() <= bound).all()


def test_matvec_torch_path_and_bad_inputs():
    """The CPU form is the FP32 bmm of the upcast A (what the guard computed before matvec), within FP32 rounding of
    float64; bad shapes and dtypes raise."""
    for A, v in _matvec_cases():
        got = ns_glue.matvec(A, v)
        assert torch.equal(got, torch.bmm(A.float(), v))
        _check_matvec(got, A, v)
    A = torch.ones(2, 4, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="matvec"):
        ns_glue.matvec(A, torch.ones(2, 4))
    with pytest.raises(ValueError, match="matvec"):
        ns_glue.matvec(torch.ones(2, 4, 5), torch.ones(2, 4, 1))
    with pytest.raises(TypeError, match="FP32"):
        ns_glue.matvec(A, torch.ones(2, 4, 1, dtype=torch.bfloat16))


def test_matvec_kernel_under_the_interpreter(tmp_path):
    """The Triton matvec (TRITON_INTERPRET=1, a fresh process; m = 17 and 160 cover partial row and column tiles)
    within FP32 rounding of float64."""
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {REPO!r}); sys.path.insert(0, {os.path.join(REPO, 'tests')!r})
        from fp4compile.kernels import ns_glue
        from test_ns_glue import _matvec_cases
        assert ns_glue._use_kernel(torch.ones(1))
        torch.save([ns_glue.matvec(A, v) for A, v in _matvec_cases()], {str(tmp_path / 'out.pt')!r})
    """))
    r = subprocess.run([sys.executable, str(script)], env=dict(os.environ, TRITON_INTERPRET="1"),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    outs = torch.load(tmp_path / "out.pt")
    assert len(outs) == 3
    for got, (A, v) in zip(outs, _matvec_cases()):
        _check_matvec(got, A, v)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_matvec_kernel():
    """CUDA: the kernel within FP32 rounding of float64 on the cases and a 124M-set-sized stack."""
    g = torch.Generator(device="cuda").manual_seed(5)
    cases = _matvec_cases("cuda") + [(torch.randn(12, 768, 768, generator=g, device="cuda").to(torch.bfloat16),
                                      torch.randn(12, 768, 1, generator=g, device="cuda"))]
    assert ns_glue._use_kernel(cases[0][0])
    for A, v in cases:
        _check_matvec(ns_glue.matvec(A, v), A, v)
