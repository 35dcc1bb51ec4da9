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


@pytest.mark.parametrize("how", ["smooth_k+hadamard", "hadamard", "smooth_k"])
@pytest.mark.parametrize("causal,gqa", [(True, False), (False, True)])
def test_qattn_sdpa_fused_is_the_op(how, causal, gqa):
    """qk_impl="fused" (the transform inside fp4compile::qattn, bits QK_ROT / K_SMOOTH) against "op" on the CPU: the
    same forward bytes and the same gradients bit for bit (the op's CPU implementation applies the same reference
    transform before quantizing, and its autograd the same transposed op), with GQA and with and without causality."""
    from fp4compile.passes.attention import qattn_sdpa

    q, k = _split_qkv(T=48, H=4, seed=2)
    if gqa:
        k = k[:, :2].contiguous()
    v = torch.randn(k.shape, generator=torch.Generator().manual_seed(5)).bfloat16()
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(6)).bfloat16()
    res = {}
    for impl in ("op", "fused"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = qattn_sdpa(*leaves, is_causal=causal, qk_transform=how, qk_impl=impl, enable_gqa=gqa)
        res[impl] = (out, *torch.autograd.grad(out, leaves, do))
    for a, b in zip(res["op"], res["fused"]):
        assert torch.equal(a, b)


def test_qattn_in_op_transform_needs_the_qk_readers_in_nvfp4():
    """The op refuses the in-op transform bits unless attn.qk, attn.dsk and attn.dsq are all NVFP4 (a BF16 reader
    would need Q', K' in BF16); qattn_sdpa's "fused" then does what "op" does (the transform outside the op)."""
    from fp4compile.passes.attention import qattn_sdpa

    q, k = _split_qkv(T=32, H=2, seed=3)
    v = torch.randn(k.shape).bfloat16()
    bits = R.in_op_transform_bits("smooth_k+hadamard")
    assert bits == R.QK_ROT | R.K_SMOOTH and R.in_op_transform_bits("none") == 0
    with pytest.raises(RuntimeError, match="attn.qk, attn.dsk and attn.dsq"):
        torch.ops.fp4compile.qattn(q, k, v, None, True, 0.125, R.QK | R.DSK | bits)
    roles = R.QK | R.PV
    a = qattn_sdpa(q, k, v, is_causal=True, qk_transform="smooth_k+hadamard", qk_impl="fused", fp4_roles=roles)
    b = qattn_sdpa(q, k, v, is_causal=True, qk_transform="smooth_k+hadamard", qk_impl="op", fp4_roles=roles)
    assert torch.equal(a, b)


def test_the_op_is_the_default_impl():
    """QK_TRANSFORM_IMPL defaults to "op" (session 39), and so does qattn_sdpa's qk_impl."""
    import inspect

    import fp4compile.passes.attention as A

    if "FP4COMPILE_QK_TRANSFORM_IMPL" not in os.environ:
        assert A.qk_transform_impl() == "op"
    assert inspect.signature(A.qattn_sdpa).parameters["qk_impl"].default == "op"


@pytest.mark.parametrize("impl", ["op", "torch", "fused"])
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
    (fwd,) = [n for n in be.fw.graph.nodes if n.target is torch.ops.fp4compile.qattn.default]
    if impl == "fused":   # the forward's transform is inside the op: no smooth_rotate, the op's mask says what
        assert rot["fw"] == [] and fwd.args[6] & R.IN_OP_TRANSFORM == R.in_op_transform_bits(A.qk_transform_mode())
    else:
        assert not fwd.args[6] & R.IN_OP_TRANSFORM
        # forward: K centred and rotated, Q rotated
        assert sorted((n.args[1], n.args[3]) for n in rot["fw"]) == [(False, False), (True, False)]
    # backward: both rotated back (Sᵀ), nothing of Q, K saved but the FP4 copies that qattn_bwd reads
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


def _interpreter_report(tmp_path, source: str) -> dict:
    """Run ``source`` under TRITON_INTERPRET=1 in a fresh process (tests/ on its path); its REPORT line's JSON."""
    pytest.importorskip("triton")
    import json

    script = tmp_path / "interp.py"
    script.write_text(source)
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests"), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("REPORT")]
    assert r.returncode == 0 and line, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(line[0][len("REPORT"):])


def test_triton_kernel_under_the_interpreter(tmp_path):
    """The Triton kernel (TRITON_INTERPRET=1, fresh process) against the reference on split-QKV strided inputs:
    ragged T, with and without centring, S and Sᵀ, blocks 64 / 16 / 128, FP16, K's mean by torch.mean and by the
    partial-sums kernel (one and several tiles per chunk): within one output step and the FP32 summation-order
    bound everywhere, equal for >= 99 % of values, stored in Q-Attn's layout."""
    report = _interpreter_report(tmp_path, _INTERP)
    assert len(report) == 7 + 2 * 5                   # the five centring cases again per partial-sums setting
    for case, res in report.items():
        assert res, case
        for layout_ok, max_ulp, exact in res:
            assert layout_ok and max_ulp <= 1 and exact >= 0.99, (case, res)


_FOLD_INTERP = textwrap.dedent("""
    import json, torch
    import triton.runtime.interpreter as I
    _orig = I._patch_lang_tensor
    def _patched(tensor, scope):  # Triton 3.6's interpreter calls int() on 1-element arrays; numpy >= 2.4 refuses
        _orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    I._patch_lang_tensor = _patched
    from fp4compile.kernels import attention as A, attention_ref as R, rotate as K
    from test_rotate import _split_qkv
    out = {}
    for D, T, H, Hkv, tiles, dtype in ((64, 40, 4, 2, True, torch.bfloat16), (64, 70, 2, 2, False, torch.bfloat16),
                                       (128, 33, 2, 1, True, torch.bfloat16), (64, 40, 2, 2, True, torch.float16)):
        q, k = _split_qkv(T=T, H=H, D=D, dtype=dtype)
        k = k[:, :Hkv]
        v = torch.randn(k.shape, dtype=dtype)
        for smooth, block in ((True, D), (False, D), (True, 0)):
            fused = A.quantize_many([q, k, v], [True, True, False], [tiles, tiles, True],
                                    [(False, block), (smooth, block), (False, 0)])
            qt = K.smooth_rotate(q, False, block, False) if block else q
            kt = K.smooth_rotate(k, smooth, block, False)
            plain = A.quantize_many([qt, kt, v], [True, True, False], [tiles, tiles, True])
            ref = [R.quantize_2d(x, tiles=t) for x, t in ((qt, tiles), (kt, tiles), (v, True))]
            out[f"{D}-{T}-{Hkv}-{tiles}-{dtype}-{smooth}-{block}"] = [
                [all(torch.equal(a, b) for a, b in zip(f, p)), all(torch.equal(a, b) for a, b in zip(p[:3], r))]
                for f, p, r in zip(fused, plain, ref)]
    try:
        A.quantize_many([q, k, v], [True] * 3, None, [(False, 0), (False, 0), (True, 0)])
    except ValueError as e:
        out["third"] = "Q, K" in str(e)
    print("REPORT" + json.dumps(out))
""")


_QK_FOLD_BENCH = _FOLD_INTERP[:_FOLD_INTERP.index("from fp4compile.kernels")] + textwrap.dedent("""
    from bench import qk_fold
    out = {}
    for D in (64, 128):
        q, k = qk_fold.split_qk(1, 2, 40, D, device="cpu")
        res = {kind: qk_fold.run_kind(kind, q, k) for kind in ("plain", "op", "fused")}
        out[D] = [q.stride(2) == 3 * 2 * D, [len(o) for o in res["fused"]],
                  all(torch.equal(a, b) for f, o in zip(res["fused"], res["op"]) for a, b in zip(f, o)),
                  any(not torch.equal(p[0], o[0]) for p, o in zip(res["plain"], res["op"]))]
    print("REPORT" + json.dumps(out))
""")


def test_bench_qk_fold_kinds_under_the_interpreter(tmp_path):
    """bench/qk_fold.py's three kinds on the CPU under TRITON_INTERPRET=1: Q, K strided as from one QKV projection;
    per tensor codes, scales, global and bf16 copy; fused equal to op bit for bit (the same transform), plain not."""
    report = _interpreter_report(tmp_path, _QK_FOLD_BENCH)
    assert report == {"64": [True, [4, 4], True, True], "128": [True, [4, 4], True, True]}


def test_quantize_many_folds_the_transform_under_the_interpreter(tmp_path):
    """Q-Attn's quantize launches with the Q, K transform folded in (``quantize_many(..., transforms)``, what
    ``fp4compile::qattn`` runs on CUDA under QK_ROT / K_SMOOTH), TRITON_INTERPRET=1 in a fresh process: codes,
    scales, globals and the bf16 code x scale equal, bit for bit, those of the unfused path (the smooth_rotate kernel,
    then quantize_many), which equals the reference; ragged T (the padded rows of a 16x16 tile stay zero after
    centring), 1x16 blocks, GQA, head dim 128, FP16, rotation and centring alone. A third tensor is not transformed."""
    report = _interpreter_report(tmp_path, _FOLD_INTERP)
    assert report.pop("third") is True
    assert len(report) == 12
    for case, res in report.items():
        assert res == [[True, True]] * 3, (case, res)


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


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_fused_transform_is_the_op(D):
    """On CUDA, qk_impl="fused" (the transform in Q-Attn's quantize launches) against "op" (the smooth_rotate kernel,
    then the launches): the saved FP4 copies equal but for values whose rotation's FP32 sum rounds one BF16 step
    apart in the two kernels' tile shapes (>= 99.9 % of codes equal), and the output and gradients as close as such
    differences allow (relative norm <= 1e-3; Q-Attn's own error against float64 is ~8e-2)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from fp4compile.kernels import attention as A
    from fp4compile.passes.attention import qattn_sdpa

    q, k = (t.cuda() for t in _split_qkv(B=4, T=1000, H=6, D=D, seed=4))
    v, do = (torch.randn(q.shape, generator=torch.Generator().manual_seed(s)).bfloat16().cuda() for s in (7, 8))
    res = {}
    for impl in ("op", "fused"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = qattn_sdpa(*leaves, is_causal=True, qk_transform="smooth_k+hadamard", qk_impl=impl)
        res[impl] = (out, *torch.autograd.grad(out, leaves, do))
    for a, b in zip(res["op"], res["fused"]):
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() <= 1e-3
    fused = A.quantize_many([q, k], [True, True], None, [(False, D), (True, D)])
    plain = A.quantize_many([OP(q, False, D, False), OP(k, True, D, False)], [True, True])
    for f, p in zip(fused, plain):
        assert (f[0] == p[0]).float().mean().item() >= 0.999 and (f[1] == p[1]).float().mean().item() >= 0.999
        assert torch.equal(f[2], p[2]) or abs(f[2].item() / p[2].item() - 1) < 1e-2


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


@pytest.mark.parametrize("kernel", ["amax", "quant2d"])
@pytest.mark.parametrize("D", [64, 128])
def test_folded_transform_compiles_for_sm90(kernel, D):
    """Q-Attn's quantize launches with the Q, K transform folded in (Q rotated, K centred and rotated) through
    Triton's sm_90 stages on this CPU: the rotation is a tensor-core product (an MMA in the SASS, none without the
    transform), registers within 4 warps' share of an SM."""
    pytest.importorskip("triton")
    from fp4compile.kernels import attention as KA
    from fp4compile.kernels.offline import compile_offline, disassemble, sass_stats

    fn = KA._amax_kernel if kernel == "amax" else KA._quant2d_kernel
    ptr = {"X": "*bf16", "C": "*u8", "S": "*u8", "Y": "*bf16", "G": "*fp32", "M": "*fp32"}

    def typ(n):
        return "*fp32" if n == "PART" else ptr[n[0]] if len(n) == 2 and n[0] in ptr and n[1].isdigit() else "i32"

    regs = {}
    for fold in (False, True):
        const = dict(BT=32, D=D, SM0=False, RO0=D if fold else 0, SM1=fold, RO1=D if fold else 0,
                     LOGR=D.bit_length() - 1 if fold else 0)
        if kernel == "quant2d":
            const.update(NP2=256, WD0=True, WD1=True, WD2=False, RW0=False, RW1=False, RW2=False)
        cubin = compile_offline(fn, {n: typ(n) for n in fn.arg_names if n not in const}, const, 4, upto="cubin")
        assert bool(re.search(r"\bHGMMA|\bHMMA", disassemble(cubin))) == fold
        regs[fold] = sass_stats(cubin)[2]
        assert 0 < regs[fold] <= 255, (fold, regs)


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
