"""fp4compile::smooth_rotate (Q-Attn's Q, K transform as one op; kernels/rotate.py) against attention_ref's torch
reference, float64 attention and autograd through the reference's aten ops."""
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import fp4compile.ops  # noqa: F401  (registers the ops)
from fp4compile.kernels import attention_ref as R

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OP = torch.ops.fp4compile.smooth_rotate


def _split_qkv(B=2, T=40, H=3, D=64, dtype=torch.bfloat16, seed=0):
    """Q, K as nanoGPT splits them from one fused projection: [B, H, T, D] views with rows 3C apart."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(B, T, 3 * H * D, generator=g) + 2.0 * torch.randn(3 * H * D, generator=g)).to(dtype)
    q, k, _ = (t.view(B, T, H, D).transpose(1, 2) for t in qkv.split(H * D, dim=2))
    return q, k


def _kernel_vs_reference(got, x, smooth, block, trans):
    """(max error, fraction equal) of the kernel's ``got`` against ``R.smooth_rotate``: the error in units of one
    output step plus the worst-case FP32 summation error of a row's D terms (D 2^-24 sum|x_i|: the two sums may
    run in different orders, which matters where they cancel). At most 1 means the kernel is the reference up to
    summation order and one rounding step."""
    want = R.smooth_rotate(x, smooth, block, trans)
    pre = R.smooth_rotate(x, smooth, 0) if smooth else x
    l1 = pre.float().abs().sum(-1, keepdim=True) * x.shape[-1] * 2.0 ** -24 if block else 0.0
    mant = 7 if want.dtype == torch.bfloat16 else 10
    _, e = torch.frexp(want.float().abs().clamp_min(torch.finfo(want.dtype).tiny))
    unit = torch.ldexp(torch.ones_like(want.float()), e - 1 - mant) + l1
    err = (got.float() - want.float()).abs() / unit
    return float(err.max()), float((got == want).float().mean())


@pytest.mark.parametrize("smooth,block,transpose", [(True, 64, False), (False, 64, False), (True, 0, False),
                                                    (True, 64, True), (False, 16, True)])
def test_op_is_the_reference_in_qattn_layout(smooth, block, transpose):
    q, k = _split_qkv()
    y = OP(k, smooth, block, transpose)
    assert y.shape == k.shape and y.dtype == k.dtype
    assert y.transpose(1, 2).is_contiguous()                          # stored [B, T, H, D], as Q-Attn's tensors
    assert torch.equal(y, R.smooth_rotate(k, smooth, block, transpose))


def test_op_gradient_is_the_op_transposed_and_autograds():
    """Autograd through the op (its registered backward: the same op with Sᵀ) equals autograd through the
    reference's aten ops, in float64 (exact linear maps: to float64 accuracy)."""
    q, k = _split_qkv(dtype=torch.float64)
    g = torch.randn(k.shape, dtype=torch.float64)
    for smooth, block in ((True, 64), (False, 32), (True, 0)):
        a = k.clone().requires_grad_()
        b = k.clone().requires_grad_()
        (ga,) = torch.autograd.grad(OP(a, smooth, block, False), a, g)
        (gb,) = torch.autograd.grad(R.smooth_rotate(b, smooth, block), b, g)
        torch.testing.assert_close(ga, gb, rtol=1e-12, atol=1e-12)
        if smooth:   # the gradient is centred over T, as the forward's output
            assert ga.mean(-2).abs().max() < 1e-12


@pytest.mark.parametrize("args", [(True, 64, False), (False, 64, True), (True, 0, False)])
def test_opcheck(args):
    x = torch.randn(2, 3, 24, 64, dtype=torch.float64, requires_grad=True)
    torch.library.opcheck(OP.default, (x, *args))


def test_op_checks_its_arguments():
    x = torch.randn(2, 3, 24, 64)
    with pytest.raises(RuntimeError, match="nothing to do"):
        OP(x, False, 0, False)
    with pytest.raises(RuntimeError, match="power of two"):
        OP(x, True, 48, False)
    with pytest.raises(RuntimeError, match=r"\[B, H, T, D\]"):
        OP(x[0], True, 64, False)
    with pytest.raises(RuntimeError, match="float"):
        OP(x.to(torch.int32), True, 64, False)


def _errors(impl, how="smooth_k+hadamard"):
    from fp4compile.passes.attention import qattn_sdpa

    q, k = _split_qkv(T=64, H=2, seed=1)
    v, do = (torch.randn(2, 2, 64, 64, generator=torch.Generator().manual_seed(s)).bfloat16() for s in (2, 3))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = qattn_sdpa(*leaves, is_causal=True, qk_transform=how, qk_impl=impl)
    return (out, *torch.autograd.grad(out, leaves, do))


def test_qattn_sdpa_with_the_op_is_the_aten_transform():
    """qattn_sdpa(qk_impl="op") against "torch": the same forward bytes (the op's CPU implementation is the
    reference); gradients equal up to the order of the two BF16 roundings in the transform's backward (the op
    centres, then rotates; autograd rotates, then centres)."""
    a, b = _errors("op"), _errors("torch")
    assert torch.equal(a[0], b[0])
    for x, y in zip(a[1:], b[1:]):
        torch.testing.assert_close(x.float(), y.float(), rtol=0.02, atol=0.02 * y.float().abs().max().item())
    with pytest.raises(ValueError, match="qk_impl"):
        _errors("triton")


def test_the_op_is_the_default_impl():
    """QK_TRANSFORM_IMPL defaults to "op" (session 39), and so does qattn_sdpa's qk_impl."""
    import inspect

    import fp4compile.passes.attention as A

    if "FP4COMPILE_QK_TRANSFORM_IMPL" not in os.environ:
        assert A.qk_transform_impl() == "op"
    assert inspect.signature(A.qattn_sdpa).parameters["qk_impl"].default == "op"


@pytest.mark.parametrize("impl", ["op", "torch"])
def test_swap_writes_the_impl_and_compiles(monkeypatch, impl):
    """QK_TRANSFORM_IMPL reaches the swapped node's kwargs (cache keys); with "op" the compiled graph calls the op,
    with "torch" it does not; the compiled model equals the eager one with the same impl, gradients too. A bad
    setting raises at the swap."""
    import fp4compile.passes.attention as A
    from test_attention import PAPER, Block, _compile_run, _eager_qattn

    from fp4compile.policy import Policy

    monkeypatch.setattr(A, "QK_TRANSFORM_IMPL", impl)
    torch.manual_seed(0)
    m = Block(style="sdpa")
    x = torch.randn(2, 32, 128, requires_grad=True)
    be, out = _compile_run(m, Policy.full_stack(), x)
    (gx,) = torch.autograd.grad(out.sum(), x)
    (node,) = [n for n in be.dynamo.graph.nodes if n.target is A.qattn_sdpa]
    assert node.kwargs["qk_impl"] == impl and node.kwargs["qk_transform"] == A.qk_transform_mode()
    assert node.kwargs["fp4_roles"] & PAPER == PAPER      # (plus QK_BLOCKS' bit, whatever its default)
    ref, gx2 = _eager_qattn(m, x, fp4_roles=node.kwargs["fp4_roles"], qk_transform=A.qk_transform_mode(),
                            qk_impl=impl)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(gx, gx2)
    rot = {g: [n for n in gm.graph.nodes if n.target is OP.default] for g, gm in (("fw", be.fw), ("bw", be.bw))}
    if impl == "torch":
        assert rot == {"fw": [], "bw": []}
        return
    # forward: K centred and rotated, Q rotated; backward: both rotated back (Sᵀ), nothing of Q, K saved but the
    # FP4 copies that qattn_bwd reads
    assert sorted((n.args[1], n.args[3]) for n in rot["fw"]) == [(False, False), (True, False)]
    assert sorted((n.args[1], n.args[3]) for n in rot["bw"]) == [(False, True), (True, True)]
    (bwd,) = [n for n in be.bw.graph.nodes if n.target is torch.ops.fp4compile.qattn_bwd.default]
    assert bwd.args[1] is None and bwd.args[2] is None
    monkeypatch.setattr(A, "QK_TRANSFORM_IMPL", "cuda")
    with pytest.raises(Exception, match="FP4COMPILE_QK_TRANSFORM_IMPL"):
        _compile_run(Block(style="sdpa"), Policy.full_stack(), torch.randn(1, 32, 128))


_INTERP = textwrap.dedent("""
    import json, torch
    from fp4compile.kernels import attention_ref as R, rotate as K
    from test_rotate import _kernel_vs_reference, _split_qkv
    out = {}
    cases = [(64, 64, True, False, torch.bfloat16, 40),
                                              (64, 64, False, False, torch.bfloat16, 100),
                                              (64, 64, True, True, torch.bfloat16, 40),
                                              (64, 16, False, True, torch.bfloat16, 40),
                                              (128, 128, True, False, torch.bfloat16, 70),
                                              (64, 0, True, False, torch.bfloat16, 40),
                                              (32, 32, True, False, torch.float16, 40)]
    # K's mean by torch.mean, then by the partial-sums kernel: one tile per chunk (T=300: 5 chunks, NCP 8), and
    # several tiles per chunk (MEAN_PROGRAMS 12 over B*H = 6: 2 chunks of 3 tiles, the second past T's ragged end)
    for impl, programs, T2 in (("torch", 512, None), ("triton", 512, 300), ("triton", 12, 300)):
        K.MEAN_IMPL, K.MEAN_PROGRAMS = impl, programs
        if impl == "triton":
            assert K.mean_chunks(300, 6) == ((5, 1) if programs == 512 else (2, 3))
        for D, block, smooth, trans, dtype, T in cases:
            if impl != "torch" and not smooth:
                continue
            q, k = _split_qkv(T=T2 or T, D=D, dtype=dtype)
            res = []
            for x, sm in ((q, False), (k, smooth)):
                if not (sm or block):
                    continue
                got = K.smooth_rotate(x, sm, block, trans)
                res.append([got.transpose(1, 2).is_contiguous(), *_kernel_vs_reference(got, x, sm, block, trans)])
            out[f"{impl}-{programs}-{D}-{block}-{smooth}-{trans}-{dtype}-{T2 or T}"] = res
    print("REPORT" + json.dumps(out))
""")


def test_triton_kernel_under_the_interpreter(tmp_path):
    """The Triton kernel (TRITON_INTERPRET=1, fresh process) against the reference on split-QKV strided inputs:
    ragged T, with and without centring, S and Sᵀ, blocks 64 / 16 / 128, FP16, K's mean by torch.mean and by the
    partial-sums kernel (one and several tiles per chunk): within one output step and the FP32 summation-order
    bound everywhere, equal for >= 99 % of values, stored in Q-Attn's layout."""
    pytest.importorskip("triton")
    import json

    script = tmp_path / "rotate_interp.py"
    script.write_text(_INTERP)
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests"), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("REPORT")]
    assert r.returncode == 0 and line, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(line[0][len("REPORT"):])
    assert len(report) == 7 + 2 * 5                   # the five centring cases again per partial-sums setting
    for case, res in report.items():
        assert res, case
        for layout_ok, max_ulp, exact in res:
            assert layout_ok and max_ulp <= 1 and exact >= 0.99, (case, res)


def test_mean_chunks_cover_every_tile_once():
    """The partial-sums grid: every BT-row tile of T in exactly one chunk, about MEAN_PROGRAMS programs in all (never
    fewer than one chunk, never more chunks than tiles); a bad FP4COMPILE_ROTATE_MEAN raises."""
    from fp4compile.kernels import rotate as K

    for T in (1, 63, 64, 65, 1000, 1024, 4096, 8193):
        tiles = -(-T // K.BT)
        for bh in (1, 6, 64, 192, 4096):
            nc, per = K.mean_chunks(T, bh)
            assert 1 <= nc <= tiles and (nc - 1) * per < tiles <= nc * per, (T, bh, nc, per)
            if tiles * bh >= K.MEAN_PROGRAMS:
                assert nc * bh >= min(K.MEAN_PROGRAMS, tiles * bh) // 2, (T, bh, nc)
    assert K.mean_chunks(1024, 192) == (3, 6) and K.mean_chunks(4096, 64) == (8, 8)
    assert K.mean_impl() in K.MEAN_IMPLS
    old = K.MEAN_IMPL
    try:
        K.MEAN_IMPL = "cub"
        with pytest.raises(ValueError, match="FP4COMPILE_ROTATE_MEAN"):
            K.mean_impl()
    finally:
        K.MEAN_IMPL = old


@pytest.mark.gpu
@pytest.mark.parametrize("mean", ["torch", "triton"])
def test_gpu_kernel_matches_the_reference(monkeypatch, mean):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from fp4compile.kernels import rotate as K

    monkeypatch.setattr(K, "MEAN_IMPL", mean)
    for D, block in ((64, 64), (128, 128), (64, 16)):
        q, k = (t.cuda() for t in _split_qkv(B=4, T=1000, H=6, D=D))
        for x, smooth in ((q, False), (k, True)):
            for trans in (False, True):
                got = OP(x, smooth, block, trans)
                err, exact = _kernel_vs_reference(got, x, smooth, block, trans)
                assert err <= 1 and exact >= 0.99, (D, block, smooth, trans, err, exact)
                assert got.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("D,block,smooth,trans,nc", [(64, 64, True, False, 0), (128, 128, False, True, 0),
                                                     (64, 16, True, True, 0), (64, 64, True, False, 3)])
def test_kernel_compiles_for_sm90(D, block, smooth, trans, nc):
    """The kernel through Triton's sm_90 stages to a cubin on this CPU (kernels/offline.py): what the H200 compiles,
    the tensor-core product included (an MMA in the SASS), registers within 4 warps' share of an SM."""
    pytest.importorskip("triton")
    from fp4compile.kernels import rotate as K
    from fp4compile.kernels.offline import compile_offline, disassemble, sass_stats

    sig = {"X": "*bf16", "M": "*fp32", "Y": "*bf16", "T": "i32", "H": "i32", "sxb": "i32", "sxh": "i32",
           "sxt": "i32", "syb": "i32", "syh": "i32", "syt": "i32"}
    cubin = compile_offline(K._smooth_rotate_kernel, sig, {"SMOOTH": smooth, "BLOCK": block,
                                                          "LOGB": block.bit_length() - 1, "TRANS": trans, "D": D,
                                                          "BT": K.BT, "NC": nc, "NCP": 4 if nc else 1}, upto="cubin")
    sass = disassemble(cubin)
    assert re.search(r"\bHGMMA|\bHMMA", sass)
    _, _, regs, _ = sass_stats(cubin)
    assert 0 < regs <= 255
    if nc:   # the partial-sums kernel too: FP32 adds, no tensor cores, within 4 warps' share
        sig = {"X": "*bf16", "P": "*fp32", "T": "i32", "H": "i32", "sxb": "i32", "sxh": "i32", "sxt": "i32"}
        cubin = compile_offline(K._col_sums_kernel, sig, {"TILES": 6, "D": D, "BT": K.BT}, upto="cubin")
        sass = disassemble(cubin)
        assert re.search(r"\bFADD", sass) and not re.search(r"\bHGMMA|\bHMMA", sass)
        assert 0 < sass_stats(cubin)[2] <= 255


def test_bench_qk_transform_kinds_on_cpu():
    """bench/qk_transform.py's three compiled functions on the CPU: copy returns Q, K; aten and op the same
    forward bytes (the op's CPU implementation is the reference) and gradients within one BF16 step of the
    largest (the backward's two roundings in the other order)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_qk_transform", os.path.join(REPO, "bench", "qk_transform.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    torch._dynamo.reset()
    B, T, H, D = 2, 32, 2, 64
    qkv = torch.randn(B, T, 3 * H * D, generator=torch.Generator().manual_seed(0)).bfloat16().requires_grad_()
    cot = [torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(s)).bfloat16() for s in (1, 2)]
    res = {}
    for kind in bench.KINDS:
        out = bench.make(kind, H, D)(qkv)
        torch.autograd.backward(out, cot)
        res[kind] = ([t.detach() for t in out], qkv.grad.clone())
        qkv.grad = None
    q, k = bench.split_qk(qkv.detach(), H, D)
    assert torch.equal(res["copy"][0][0], q) and torch.equal(res["copy"][0][1], k)
    assert all(torch.equal(a, b) for a, b in zip(res["op"][0], res["aten"][0]))
    assert bench.difference(res["op_tmean"][0], res["op"][0]) == (0.0, 0.0)       # on the CPU both are the reference
    assert bench.difference(res["copy"][0], res["op"][0])[1] > 0.5
    assert bench.mean_impl("op_tmean", "torch") == "triton" and bench.mean_impl("op", "torch") == "torch"
    step = res["aten"][1].float().abs().max() * 2.0 ** -7
    assert (res["op"][1].float() - res["aten"][1].float()).abs().max() <= step
