"""Triton quantize/dequantize kernels vs the torch reference, byte for byte.

On CPU the kernels run eagerly under the Triton interpreter (TRITON_INTERPRET=1, small sizes); on a GPU the
``gpu``-marked tests run them compiled on large inputs (``python -m pytest -m gpu tests/test_quantize_kernels.py``).
"""
import itertools
import os
import re

import pytest
import torch

pytest.importorskip("triton")

HAS_CUDA = torch.cuda.is_available()

from fp4compile import ops  # noqa: E402

DEV = "cuda" if HAS_CUDA else "cpu"
SIGNS = (torch.randint(0, 2, (128,), generator=torch.Generator().manual_seed(1)) * 2 - 1).float()
SEED = torch.tensor(-0x0FED_CBA9_8765_4321, dtype=torch.int64)


def data(kind, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if kind == "heavy":
        x = x * torch.exp(1.5 * torch.randn(shape, generator=g))
    elif kind == "wide":
        x = x * torch.exp2(torch.randint(-30, 30, shape, generator=g).float())
    elif kind == "zeros":
        x = torch.zeros(shape)
    elif kind == "tiny":  # amax below AMAX_FLUSH (2^-100): flushed to an all-zero encoding by every path
        x = torch.zeros(shape)
        x[-1, -1] = 1.401298464324817e-45
        x[0, 0] = -7e-31
    elif kind == "floor":  # MS-EDEN's per-block floor: blocks just below / at / above AMAX_FLUSH, subnormals
        x[0, :16] = 7e-31
        x[1, :16] = 2.0 ** -100
        x[2, :16] = 1e-29
        x[3, 16:32] = 1.401298464324817e-45
        x[4, :] = 0.0
    elif kind == "tinylive":  # one live block at the floor's edge sets max S': global ~2^-111, still normal
        x = torch.zeros(shape)
        x[0, :16] = 2.0 ** -99 * torch.randn(16, generator=g)
        x[0, 3] = 2.0 ** -99
        x[5, 16:32] = 1e-44
    elif kind == "special":  # zero blocks, -0.0, an underflowing block, exact E2M1 midpoints
        x[0, :16] = 0.0
        x[1, :16] = -0.0
        x[2, 16:32] = 1e-30
        x[3, :8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    return x


def run_both(x, rounding, f46, b2, h, tr):
    from fp4compile.kernels import quantize as K

    sg = SIGNS[:h] if h else None
    got = K.quantize(x.to(DEV), rounding, f46, b2, h, None if sg is None else sg.to(DEV), SEED.to(DEV), tr)
    ref = ops._quantize_reference(x.cpu(), rounding, f46, b2, h, sg, SEED, tr)
    return [g.cpu() for g in got], ref


def assert_same(got, ref, what):
    for name, a, b in zip(("codes", "scales", "global"), got, ref):
        assert a.shape == b.shape and a.dtype == b.dtype, (what, name, a.shape, b.shape)
        n = int((a != b).sum())
        assert n == 0, f"{what}: {name} differ in {n} of {a.numel()}"


# ---------------------------------------------------------------------------------------------- CPU interpreter
INTERP_CASES = [  # (data, shape, rounding, 4/6, 2D, hadamard, transpose)
    ("gauss", (32, 128), "rtn", False, False, 0, False),
    ("special", (32, 128), "rtn", False, False, 0, False),
    ("wide", (32, 128), "rtn", True, False, 0, False),
    ("heavy", (32, 128), "rtn", True, True, 0, False),
    ("bf16", (48, 256), "rtn", False, False, 16, True),
    ("zeros", (16, 64), "sr", False, False, 0, False),
    ("tiny", (16, 64), "rtn", True, False, 0, False),
    ("tiny", (16, 64), "sr", False, False, 0, False),
    ("tiny", (16, 64), "ms_eden", False, False, 16, False),
    ("gauss", (32, 128), "sr", False, False, 0, False),
    ("heavy", (32, 128), "sr", True, True, 0, False),
    ("heavy", (16, 256), "ms_eden", False, False, 128, False),
    ("special", (32, 128), "ms_eden", False, True, 32, False),
    ("gauss", (128, 48), "ms_eden", False, False, 128, True),
    # the optional 8th entry overrides kernels.quantize.CONFIG: the coalesced transposed load, other tiles
    ("heavy", (64, 256), "rtn", True, True, 16, True, {"t_impl": 1}),
    ("gauss", (128, 64), "ms_eden", False, False, 128, True, {"t_impl": 1, "t_rows": 32, "t_cols": 128}),
    ("heavy", (32, 256), "sr", False, False, 32, False, {"r_rows": 8, "ah_rows": 16}),
    ("heavy", (32, 256), "sr", True, False, 0, False, {"s_rows": 8, "s_cols": 128, "a_rows": 16}),
    # the flip butterfly (the CUDA default; slow under the interpreter, so small cases)
    ("heavy", (16, 128), "ms_eden", False, False, 16, False, {"rht_impl": 1}),
    ("heavy", (16, 256), "rtn", False, False, 128, False, {"rht_impl": 1}),
    # the first kernel version (q_impl=0), kept for comparison
    ("heavy", (32, 256), "rtn", True, True, 16, False, {"q_impl": 0}),
    ("gauss", (32, 256), "sr", True, False, 0, False, {"q_impl": 0}),
    ("heavy", (128, 32), "sr", False, False, 128, True, {"q_impl": 0, "t_impl": 1}),
    # tiles with partial edges; the transposed-path tiles
    ("wide", (40, 80), "rtn", False, False, 0, False, {"q_rows": 32, "q_cols": 128}),
    ("wide", (48, 256), "sr", False, False, 0, False, {"a_impl": 2, "a_rows": 32}),  # amax pass on halves
    ("heavy", (80, 48), "sr", False, False, 16, True, {"t_rows": 64, "t_cols": 32, "t_impl": 1}),
    # transposed: the strided in-kernel load (t_impl=0, the default) and the Triton transposing copy (2)
    ("heavy", (128, 32), "ms_eden", False, True, 128, True, {"t_impl": 0}),
    ("wide", (64, 48), "rtn", True, False, 0, True, {"t_impl": 0}),
    ("wide", (96, 80), "rtn", True, False, 0, True, {"t_impl": 2, "p_rows": 32, "p_cols": 64}),
    ("heavy", (128, 48), "ms_eden", False, False, 128, True, {"t_impl": 2, "p_rows": 64, "p_cols": 32}),
    # MS-EDEN: no RHT, 2D tiles with RHT-16 and the flip butterfly, partial tiles of both passes, and
    # blocks below the AMAX_FLUSH floor beside live ones ("special" row 2 is 1e-30: live, tiny E4M3 scales)
    ("wide", (32, 256), "ms_eden", False, False, 0, False),
    ("heavy", (32, 128), "ms_eden", False, True, 16, False, {"rht_impl": 1}),
    ("heavy", (40, 96), "ms_eden", False, False, 32, False, {"e_rows": 32, "e_cols": 64, "f_block": 64}),
    ("floor", (16, 64), "ms_eden", False, False, 0, False),
    ("tinylive", (16, 64), "ms_eden", False, False, 0, False),
    # MS-EDEN + RHT-128 pass 1: a block per thread (e_impl 0), a 128-chunk per thread (1), half a chunk per thread
    # (2) and a quarter of a chunk per thread (3; one and two quarter-chunks per thread) with partial tiles
    ("heavy", (16, 256), "ms_eden", False, False, 128, False, {"e_impl": 0}),
    ("floor", (24, 384), "ms_eden", False, False, 128, False, {"e_impl": 1, "c_rows": 8, "c_cols": 256, "c_warps": 2}),
    ("floor", (24, 384), "ms_eden", False, False, 128, False, {"e_impl": 2, "h_rows": 8, "h_cols": 256, "h_warps": 2}),
    ("heavy", (20, 640), "ms_eden", False, False, 128, False, {"e_impl": 2, "h_rows": 16, "h_cols": 512,
                                                               "h_warps": 4}),
    ("floor", (24, 384), "ms_eden", False, False, 128, False, {"e_impl": 3, "u_rows": 8, "u_cols": 256, "u_warps": 2}),
    ("heavy", (20, 640), "ms_eden", False, False, 128, False, {"e_impl": 3}),
]


#: the cases also run as ``quantize(..., dq=True)`` (``fp4compile::quantize_dq``): RTN / SR store the bf16 q * S from
#: the quantize kernel (1D and 2D blocks, 4/6, RHT, the transposed paths, partial tiles, flushed and special values,
#: the first kernel version), MS-EDEN from its pass 2 (every case: 2D blocks, the floor, transposed, both pass-1
#: kernels), with pass 2's dq tile (``g_*``) at 16 x 32 so that the small cases have several tiles and ragged edges
DQ_CASES = INTERP_CASES
DQ_CONFIG = {"g_rows": 16, "g_cols": 32}


def case_id(c):
    cfg = "".join(f"-{k}{v}" for k, v in c[7].items()) if len(c) > 7 else ""
    return "-".join(map(str, c[2:7])) + f"-{c[0]}{cfg}"


@pytest.fixture(scope="module")
def interp_report():
    """Run every interpreter case in one fresh process with TRITON_INTERPRET=1 set before Triton's import."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, os.path.join(root, "tests", "_interp_worker.py")], env=env,
                       capture_output=True, text=True, timeout=900)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("REPORT")]
    assert p.returncode == 0 and line, f"interpreter worker failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return json.loads(line[0][len("REPORT"):])


@pytest.mark.skipif(HAS_CUDA, reason="interpreter tests run on CPU-only machines; the gpu tests cover CUDA")
@pytest.mark.parametrize("case", INTERP_CASES, ids=case_id)
def test_interpreter_bit_exact(case, interp_report):
    assert interp_report[case_id(case)] == {"codes": 0, "scales": 0, "global": 0}


@pytest.mark.skipif(HAS_CUDA, reason="interpreter tests run on CPU-only machines; the gpu tests cover CUDA")
@pytest.mark.parametrize("case", DQ_CASES, ids=case_id)
def test_interpreter_quantize_dq(case, interp_report):
    """``quantize(..., dq=True)``: the same codes, scales and global as the reference, and a fourth output equal, bit
    for bit, to q * S decoded independently (ml_dtypes' float4_e2m1fn and float8_e4m3fn, float64 product)."""
    assert interp_report[case_id(case) + "-dq"] == {"codes": 0, "scales": 0, "global": 0, "dq": 0}


@pytest.mark.skipif(HAS_CUDA, reason="interpreter tests run on CPU-only machines")
def test_interpreter_e2m1_and_amax(interp_report):
    """_e2m1_mag_code (the FP-pipe code map, with the sign bit) on every FP32 of sampled binades incl. all ties; _e2m1_value (the
    kernels' E2M1 decoder) on all 16 codes against ml_dtypes, bit for bit; _mag_value_magic of both magnitude
    code maps against ml_dtypes' rounding; given-amax mode; MS-EDEN pass 2's 64-bit index path."""
    assert interp_report["e2m1"] == 0
    assert interp_report["e2m1-decode"] == 0
    assert interp_report["mag-value"] == 0
    assert interp_report["pass2-wide"] == 0     # MS-EDEN pass 2's 64-bit index path = the 32-bit one
    assert interp_report["given-amax"] == {"codes": 0, "scales": 0, "global": 0}


#: (name, quantize arguments rounding..signs, CONFIG override) of the non-finite input checks: every scheme and
#: pass-1 variant whose global comes from a different reduction
_EDEN128 = ("ms_eden", False, False, 128, SIGNS)
NONFINITE_CASES = ([("rtn", ("rtn", False, False, 0, None), None), ("rtn46", ("rtn", True, False, 0, None), None),
                    ("rtn2d", ("rtn", False, True, 0, None), None),
                    ("sr-rht16", ("sr", False, False, 16, SIGNS[:16]), None),
                    ("rtn-halves", ("rtn", False, False, 0, None), {"a_impl": 2}),
                    ("eden", ("ms_eden", False, False, 0, None), None),
                    ("eden2d", ("ms_eden", False, True, 0, None), None)]
                   + [(f"eden-rht128-e{i}", _EDEN128, {"e_impl": i}) for i in range(4)])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
def test_gpu_nonfinite_input_gives_a_nonfinite_global(bad):
    """The compiled kernels (whose max drops a NaN unless told otherwise): a NaN or Inf element gives a non-finite
    global for every case of the interpreter's check, quantize_both, quantize_dq, a transposed copy, and Q-Attn's
    quantize_many (tiles and 1x16)."""
    from fp4compile.kernels import attention as KA
    from fp4compile.kernels import quantize as K

    x = data("heavy", (256, 1024)).to(DEV)
    x[200, 700] = float(bad)
    gl = {}
    for name, args, cfg in NONFINITE_CASES:
        args = tuple(a.to(DEV) if isinstance(a, torch.Tensor) else a for a in args)
        gl[name] = K.quantize(x, *args, SEED.to(DEV), False, config=cfg)[2]
        gl[name + "-dq"] = K.quantize(x, *args, SEED.to(DEV), False, config=dict(cfg or {}, **DQ_CONFIG), dq=True)[2]
    b = K.quantize_both(x, 128, SIGNS.to(DEV), SEED.to(DEV), 16, SIGNS[:16].to(DEV), SEED.to(DEV) + 1)
    gl["both"], gl["both-t"], gl["rtn-T"] = b[2], b[5], K.quantize(x, "rtn", transpose=True)[2]
    xa = x.to(torch.bfloat16).reshape(2, 4, 32, 1024)[..., :64].contiguous()
    xa[1, 2, 30, 5] = float(bad)
    for tiles in (True, False):
        gl[f"qattn-tiles{tiles}"] = KA.quantize_many([xa], [True], [tiles])[0][2]
    finite = {k: bool(torch.isfinite(v)) for k, v in gl.items()}
    assert not any(finite.values()), finite


@pytest.mark.skipif(HAS_CUDA, reason="interpreter tests run on CPU-only machines")
def test_interpreter_nonfinite_input_gives_a_nonfinite_global(interp_report):
    """A NaN, +Inf or -Inf element: the kernels' global decode scale is non-finite, as the reference's, for RTN (4/6,
    2D, the halves amax, transposed), SR with RHT-16, MS-EDEN (1D, 2D, RHT-128 with every pass-1 variant),
    quantize_both's two copies and a given amax, so the copy decodes to non-finite values (until session 52
    MS-EDEN's was 0: a NaN or Inf gradient became an all-zero one). The interpreter runs ``quantize._amax_all``'s
    own branch (its ``tl.max`` drops a NaN, np.nanmax, as the GPU's does; a NaN flag restores it), not the GPU's
    reduction: test_tensor_maxima_keep_nan_on_sm90 checks that one in the compiled PTX."""
    report = interp_report["nonfinite"]
    assert len(report) == 3 * 14
    assert all(v == [False, False] for v in report.values()), {k: v for k, v in report.items() if v != [False, False]}


def _max_ops(ptx: str):
    """(NaN-propagating fp32 max instructions, plain ones) in PTX."""
    return len(re.findall(r"\bmax\.NaN\.f32\b", ptx)), len(re.findall(r"\bmax\.f32\b", ptx))


@pytest.mark.parametrize("kernel", ["amax", "amax-halves", "amax-rht128", "transpose-amax", "eden-pass1",
                                    "eden-pass1-rht128", "eden-pass1-half", "eden-pass1-quarter"])
def test_tensor_maxima_keep_nan_on_sm90(kernel, sass):
    """The tensor-wide maxima that make a global scale, compiled for sm_90 (CPU): ``tl.max`` lowers to ``max.f32``,
    which returns the other operand of a NaN (the interpreter tests run another branch of ``_amax_all``, so only the
    PTX shows this), so they reduce with ``max.NaN.f32`` (``quantize._max_nan``): the amax kernels only with it,
    MS-EDEN's pass 1 with it for its S' maximum (its per-block maxima may drop a NaN: the block's S' is NaN
    anyway)."""
    qs = sass
    from fp4compile.kernels import quantize as K
    from fp4compile.kernels.offline import compile_offline

    if kernel == "transpose-amax":
        sig = dict(x_ptr="*bf16", xt_ptr="*bf16", M="i32", N="i32", sxm="i32", sxn="i32", amax_ptr="*fp32")
        ptx = compile_offline(K._transpose_kernel, sig, dict(AMAX=True, BM=64, BN=64), 4)
    else:
        spec = {"amax": qs.amax_spec(), "amax-halves": qs.amax_spec(HALVES=True),
                "amax-rht128": qs.amax_spec(HAD=128, NORM=128 ** -0.5), "eden-pass1": qs.eden_pass1_spec(0),
                "eden-pass1-rht128": qs.eden_pass1_spec(128), "eden-pass1-half": qs.eden_pass1_half_spec(),
                "eden-pass1-quarter": qs.eden_pass1_quarter_spec()}[kernel]
        ptx = spec.compile("ptx")
    nan_max, plain = _max_ops(ptx)
    assert nan_max > 0, kernel
    if kernel.startswith(("amax", "transpose")):
        assert plain == 0, (kernel, plain)


@pytest.mark.skipif(HAS_CUDA, reason="interpreter tests run on CPU-only machines")
@pytest.mark.parametrize("key", ["dequantize-0-torch.bfloat16", "dequantize-16-torch.float32",
                                 "dequantize-128-torch.bfloat16", "dequantize-T-0-torch.bfloat16",
                                 "dequantize-T-16-torch.float32", "dequantize-T-128-torch.bfloat16"])
def test_interpreter_dequantize(key, interp_report):
    """The dequantize kernel equals the reference op bit for bit; ``-T-``: stored transposed ([C, R], contiguous)
    it equals the reference's transpose."""
    assert interp_report[key] == 0


def test_launcher_errors():
    from fp4compile.kernels import quantize as K  # argument checks run before any launch

    with pytest.raises(ValueError, match="multiple of 16"):
        K.quantize(torch.ones(16, 24))
    with pytest.raises(ValueError, match="2D"):
        K.quantize(torch.ones(24, 32), block2d=True)
    with pytest.raises(ValueError, match="hadamard"):
        K.quantize(torch.ones(16, 48), hadamard=32)
    with pytest.raises(TypeError):
        K.quantize(torch.ones(16, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="amax"):
        K.quantize(torch.ones(16, 32), "ms_eden", amax=torch.ones(()))
    with pytest.raises(ValueError, match="signs"):
        K.dequantize(torch.zeros(16, 8, dtype=torch.uint8), torch.zeros(16, 1, dtype=torch.uint8),
                     torch.ones(()), hadamard=16)
    with pytest.raises(ValueError, match="scales"):
        K.dequantize(torch.zeros(16, 8, dtype=torch.uint8), torch.zeros(16, 2, dtype=torch.uint8), torch.ones(()))
    with pytest.raises(ValueError, match="rows"):            # quantize_both quantizes along both dims
        K.quantize_both(torch.ones(24, 32))
    with pytest.raises(ValueError, match="hadamard=32"):
        K.quantize_both(torch.ones(48, 64), hadamard=16, hadamard_t=32)
    with pytest.raises(TypeError):
        K.quantize_both(torch.ones(16, 16, dtype=torch.int32))


#: fp4compile::quantize_both (one tensor's MS-EDEN copies in both layouts; the row-wise pass 1 writes the transpose)
#: under the interpreter: (data, shape, hadamard, hadamard_t, dtype, CONFIG override), ragged tiles included
BOTH_CASES = [("heavy", (48, 256), 128, 16, torch.bfloat16, None),
              ("wide", (128, 96), 32, 128, torch.float32, {"e_rows": 32, "e_cols": 64}),
              ("floor", (80, 48), 0, 16, torch.bfloat16, None)]


def both_id(c):
    return f"both-{c[0]}-{c[1][0]}x{c[1][1]}-{c[2]}-{c[3]}-{str(c[4])[6:]}" + ("-cfg" if c[5] else "")


@pytest.mark.skipif(HAS_CUDA, reason="interpreter tests run on CPU-only machines")
@pytest.mark.parametrize("case", BOTH_CASES, ids=both_id)
def test_interpreter_quantize_both(case, interp_report):
    """quantize_both equals the reference op (two MS-EDEN quantize references, each with its own signs and seed)
    byte for byte, all six outputs; with ``dq`` (``quantize_both_dq``) also each copy's bf16 q * S against the
    independent decode."""
    assert interp_report[both_id(case)] == {f"{n}{t}": 0 for t in ("", "_t") for n in ("codes", "scales", "global")}
    assert interp_report[both_id(case) + "-dq"] == {f"{n}{t}": 0 for t in ("", "_t")
                                                    for n in ("codes", "scales", "global", "dq")}


@pytest.fixture(scope="module")
def sass():
    """bench/quantize_sass.py: the kernels' compile specs and the static SASS proxy (compiled for sm_90 here)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("quantize_sass", os.path.join(
        os.path.dirname(__file__), "..", "bench", "quantize_sass.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _ptx_lines(spec):
    return [ln.strip() for ln in spec.compile("ptx").splitlines()]


@pytest.mark.parametrize("rounding", ["rtn", "sr"])
def test_pdl_variant_waits_after_its_tile_loads(rounding, sass):
    """CONFIG["pdl"]'s kernels, compiled for sm_90 here (no GPU; default tiles, 16-divisible arguments): the amax
    kernel lets its dependent launch before it loads anything; the quantize kernel issues every load of its x
    tile before griddepcontrol.wait and reads the amax (and the SR seed) only after it. Without PDL neither kernel
    has a griddepcontrol."""
    spec = sass.quantize_spec(rounding, PDL=True)
    ptx = _ptx_lines(spec)
    waits = [i for i, ln in enumerate(ptx) if ln.startswith("griddepcontrol")]
    assert len(waits) == 1 and ptx[waits[0]].startswith("griddepcontrol.wait"), waits
    loads = [i for i, ln in enumerate(ptx) if "ld.global" in ln]
    before = [i for i in loads if i < waits[0]]
    after = [ptx[i] for i in loads if i > waits[0]]

    def nbytes(ln):  # ld.global[.vN].bBITS
        vec = re.search(r"\.v(\d)\.", ln)
        return (int(vec.group(1)) if vec else 1) * int(re.search(r"\.b(\d+) ", ln).group(1)) // 8

    # the x tile: its bf16 bytes per thread (16 x 512 over 128 threads: eight 16-byte vector loads)
    assert sum(nbytes(ptx[i]) for i in before) == spec.elements * 2 // (32 * spec.num_warps), \
        [ptx[i] for i in before]
    # after the wait: the amax (and SR's seed) only, scalar loads
    assert sorted(nbytes(ln) for ln in after) == ([4] if rounding == "rtn" else [4, 8]), after
    assert not any("griddepcontrol" in ln for ln in _ptx_lines(sass.quantize_spec(rounding, PDL=False)))
    ptx = _ptx_lines(sass.amax_spec(PDL=True))
    dep = [i for i, ln in enumerate(ptx) if ln.startswith("griddepcontrol")]
    assert len(dep) == 1 and ptx[dep[0]].startswith("griddepcontrol.launch_dependents")
    assert dep[0] < min(i for i, ln in enumerate(ptx) if "ld.global" in ln)
    assert not any("griddepcontrol" in ln for ln in _ptx_lines(sass.amax_spec(PDL=False)))


def test_offline_sass_counts_what_the_kernel_does(sass):
    """bench/quantize_sass.py (kernels.offline.sass_stats on sm_90 cubins compiled here): the RTN quantize pass
    has no shuffles and the fewest instructions; MS-EDEN's pass 1 costs more with each larger rotation, and only
    RHT-128's cross-thread butterfly stages shuffle."""
    r = dict(sass.measure())
    names = ["RTN quantize pass", "MS-EDEN pass 1, no RHT", "MS-EDEN pass 1, RHT-16", "MS-EDEN pass 1, RHT-128"]
    counts = [r[n][0] for n in names]
    assert 5 < counts[0] and counts == sorted(counts) and len(set(counts)) == 4, r
    assert r[names[0]][1] == 0 and r[names[3]][1] > 1 > r[names[2]][1], r
    assert all(0 < regs <= 255 for _, _, regs, _ in r.values()), r
    # the register cap of pass 1 (CONFIG e_maxnreg) holds and costs no spill in any of its variants
    cap = sass.K.CONFIG["e_maxnreg"]
    assert all(v[2] <= cap and v[3] == 0 for n, v in r.items() if n.startswith("MS-EDEN pass 1")), r
    # half a 128-chunk per thread (e_impl 2): RHT-128's only cross-thread stage is h = 64, one exchange per element
    # (35.0 instructions and 1.1 SHFL per element uncapped, against the block per thread's 40.8 and 3.3)
    half = r["MS-EDEN half-chunk pass 1 (e_impl 2), RHT-128, no register cap"]
    assert 1 <= half[1] < 1.5 and half[0] < r[names[3]][0] and half[3] == 0, r
    # a quarter of a chunk per thread (e_impl 3): h = 32 and 64 cross threads, two exchanges per element; fewer
    # instructions than the block per thread (40.8 and 3.3 SHFL per element at 96 registers): two quarters per thread
    # 35.6 and 2.1 uncapped, no spill; one quarter per thread 40.0 and 2.2 at fewer registers (80), no spill
    base = r[names[3]]
    two = r["MS-EDEN quarter-chunk pass 1 (e_impl 3), RHT-128, no register cap"]
    one = r["MS-EDEN quarter-chunk pass 1 (e_impl 3), RHT-128, one per thread (8x512), no register cap"]
    assert 2 <= two[1] < 2.5 and two[0] < half[0] + 1 and two[3] == 0, r
    assert 2 <= one[1] < 2.5 and one[0] < base[0] and one[2] <= base[2] and one[3] == 0, r
    # RTN 4/6 on magnitudes under its cap (s_maxnreg, 128): no spill, and under 2.5x the plain RTN pass per element
    # (49.0 vs 20.6; the signed form it replaced took 58.0)
    n46, _, regs46, spill46 = r["RTN 4/6 quantize pass"]
    assert regs46 <= sass.K.CONFIG["s_maxnreg"] and spill46 == 0 and counts[0] < n46 < 2.5 * counts[0], r
    # quantize_dq's store of the bf16 q * S (where each variant stores it is register-sensitive): 4/6 under its cap
    # with no spill; plain RTN (uncapped) in at most 128 registers (167 when its values waited for the codes'
    # store), no spill; each costs more than its quantize alone and less than that plus the dequantize kernel
    deq = r["dequantize, row-major"][0]
    for name, base, cap in (("RTN 4/6 quantize pass", n46, sass.K.CONFIG["s_maxnreg"]),
                            ("RTN quantize pass", counts[0], 128)):
        n, _, regs, spill = r[name + " + bf16 q * S (quantize_dq)"]
        assert regs <= cap and spill == 0 and base < n < base + deq, (name, r)


@pytest.mark.parametrize("transpose", [False, True])
def test_dequantize_decode_keeps_subnormals(transpose, sass):
    """The kernels' E2M1 decoder (_e2m1_value, here in the dequantize kernel) makes code 0.5 the subnormal 2^-127
    before an exact multiply by 2^126: compiled for sm_90 here, no float op of it flushes subnormals (.ftz), and the
    bf16 result is the native RNE conversion (F2FP), not the interpreter's explicit bit rounding."""
    spec = sass.dequantize_spec(transpose)
    ptx = spec.compile("ptx")
    assert "mul.rn.f32" in ptx or "mul.f32" in ptx
    assert not re.search(r"\.ftz", ptx)
    n, ops, _, _ = sass.sass_stats(spec.compile("cubin"))
    assert ops.get("F2FP", 0) > 0 and ops.get("FSEL", 0) == 0, ops


@pytest.mark.parametrize("dq", [False, True])
def test_quantize_kernels_that_decode_keep_subnormals(dq, sass):
    """The 4/6 and SR quantize kernels decode codes by bit placement (_mag_value_magic; their block errors, the bf16
    q * S of quantize_dq): compiled for sm_90 here as launched, none of their float ops flushes subnormals."""
    assert not re.search(r"\.ftz", sass.quantize46_spec(dq=dq).compile("ptx"))
    assert not re.search(r"\.ftz", sass.quantize_sr_spec(DQ=dq).compile("ptx"))


@pytest.mark.parametrize("hadamard", [128, 0])
def test_ms_eden_pass1_keeps_subnormals(hadamard, sass):
    """MS-EDEN's pass 1 decodes its codes' magnitudes by bit placement (_mag_value_magic: code 1 is the subnormal
    2^-127 before the exact multiply by 2^126) for the EDEN correction's sum: compiled for sm_90 here, none of its
    float ops flushes subnormals."""
    assert not re.search(r"\.ftz", sass.eden_pass1_spec(hadamard).compile("ptx"))


def test_pdl_is_chosen_only_behind_our_own_amax_kernel(monkeypatch):
    """quantize() asks for PDL only on CUDA sm_90+, with CONFIG["pdl"] and the block-per-thread quantize kernel,
    and launches the quantize kernel with it only right behind the amax kernel it launched itself: not with a
    given amax= (any kernel may have written it) nor behind the transposing copy. Launches are recorded, not run."""
    from fp4compile.kernels import quantize as K

    monkeypatch.setattr(K, "_pdl_device", lambda index: index == 0)
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    on = dict(K.CONFIG, pdl=1)
    assert K._use_pdl(on, cuda0) and not K._use_pdl(on, cuda1)            # sm_90+ only
    assert not K._use_pdl(dict(on, q_impl=0), cuda0)                     # the first kernel has no PDL
    assert K._use_pdl(K.CONFIG, cuda0)                                   # on by default
    assert not K._use_pdl(dict(K.CONFIG, pdl=0), cuda0)
    assert not K._use_pdl(on, torch.device("cpu"))

    launches = []
    monkeypatch.setattr(K, "launch", lambda fn, grid, *a, **meta: launches.append((fn.fn.__name__, meta)))
    monkeypatch.setattr(K, "_use_pdl", lambda cfg, dev: bool(cfg["pdl"]))

    def pdl_flags(**kw):
        launches.clear()
        K.quantize(torch.ones(32, 64), **kw)
        return [(name, meta.get("PDL", False), meta.get("launch_pdl", False)) for name, meta in launches]

    assert pdl_flags(config={"pdl": 1}) == [("_amax_kernel", True, False), ("_quantize_kernel", True, True)]
    assert pdl_flags(rounding="sr", config={"pdl": 1}) == [("_amax_kernel", True, False),
                                                          ("_quantize_kernel", True, True)]
    assert pdl_flags(config={"pdl": 0}) == [("_amax_kernel", False, False), ("_quantize_kernel", False, False)]
    assert pdl_flags(config={"pdl": 1}, amax=torch.ones(())) == [("_quantize_kernel", False, False)]
    assert pdl_flags(config={"pdl": 1}, transpose=True) == [("_transpose_kernel", False, False),
                                                           ("_quantize_kernel", False, False)]


# ---------------------------------------------------------------------------------------------- GPU
GPU_CASES = [c for c in itertools.product(["rtn", "sr", "ms_eden"], [False, True], [False, True], [0, 16, 128],
                                          [False, True]) if not (c[0] == "ms_eden" and c[1])]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(map(str, c)))
def test_gpu_bit_exact_large(case):
    r, f46, b2, h, tr = case
    x = data("heavy", (1024, 2048), seed=GPU_CASES.index(case)).to(torch.bfloat16)
    got, ref = run_both(x, r, f46, b2, h, tr)
    assert_same(got, ref, case)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(map(str, c)))
def test_gpu_quantize_dq(case):
    """``fp4compile::quantize_dq`` on CUDA (the quantize kernel storing the bf16 q * S; MS-EDEN: pass 2 storing it):
    the reference's codes, scales and global, and a fourth output equal, bit for bit, to the dequantize kernel's
    bf16 of those codes (``dequantize_blocks``, itself checked against the reference); ragged rows."""
    r, f46, b2, h, tr = case
    shape = (1024, 2048) if b2 or tr else (1008, 2048)      # (ragged rows; a transposed copy's blocks run along them)
    x = data("heavy", shape, seed=GPU_CASES.index(case)).to(torch.bfloat16)
    sg = SIGNS[:h] if h else None
    got = torch.ops.fp4compile.quantize_dq(x.cuda(), r, f46, b2, h, None if sg is None else sg.cuda(), SEED.cuda(),
                                           tr)
    assert_same([g.cpu() for g in got[:3]], ops._quantize_reference(x, r, f46, b2, h, sg, SEED, tr), case)
    dq = torch.ops.fp4compile.dequantize_blocks(got[0], got[1])
    assert got[3].dtype == torch.bfloat16 and torch.equal(got[3].view(torch.int16), dq.view(torch.int16)), case
    assert torch.equal(dq.cpu(), ops._dequantize_blocks_op(got[0].cpu(), got[1].cpu()))
    if r == "ms_eden" and not b2 and not tr:   # and both layouts from one pass: quantize_both_dq, eight outputs
        args = (h, None if sg is None else sg.cuda(), SEED.cuda(), 16, SIGNS[:16].cuda(), (SEED + 1).cuda())
        both = torch.ops.fp4compile.quantize_both_dq(x[:1024].cuda(), *args)
        ref = ops._quantize_both_dq_op(x[:1024], *[a.cpu() if torch.is_tensor(a) else a for a in args])
        for i, (a, b) in enumerate(zip(both, ref)):
            assert torch.equal(a.cpu(), b), (case, i)


AMAX_CASES = [c for c in GPU_CASES if c[0] != "ms_eden" and not c[3]]      # RTN / SR without a rotation


def test_op_amax_argument_is_checked_on_cpu():
    """``fp4compile::quantize(_dq)``'s ``amax``: the true max|x| (as the backend's fused reduction gives it: fp32
    0-dim) gives the bytes of the op's own amax; anything else raises on CPU (the reference checks it), as do the
    wrong dtype or shape and MS-EDEN / a rotation (whose amax is not max|x| of the input)."""
    x = data("heavy", (64, 128), seed=3).to(torch.bfloat16)
    amax = x.abs().amax().float()
    for op in (torch.ops.fp4compile.quantize, torch.ops.fp4compile.quantize_dq):
        for r, f46, b2, tr in (("rtn", True, False, False), ("sr", False, True, True), ("rtn", False, False, True)):
            want = op(x, r, f46, b2, 0, None, SEED, tr)
            got = op(x, r, f46, b2, 0, None, SEED, tr, amax)
            assert all(torch.equal(a, b) for a, b in zip(want, got)), (op, r)
    q = torch.ops.fp4compile.quantize
    for bad, match in ((amax * 0.5, "not max"), (amax.bfloat16(), "float32"), (amax.reshape(1), "0-dim")):
        with pytest.raises(ValueError, match=match):
            q(x, "rtn", True, False, 0, None, None, False, bad)
    with pytest.raises(ValueError, match="amax is for rtn / sr"):
        q(x, "ms_eden", False, False, 0, None, SEED, False, amax)
    with pytest.raises(ValueError, match="amax is for rtn / sr"):
        q(x, "rtn", False, False, 16, SIGNS[:16], None, False, amax)
    xn = x.clone()
    xn[3, 5] = float("nan")                  # a diverged run: the NaN amax of a NaN tensor is its max|x|, no error
    nan = xn.abs().amax().float()
    args = (xn, "rtn", True, False, 0, None, None, False)
    for a, b in zip(q(*args), q(*args, nan)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("case", AMAX_CASES, ids=lambda c: "-".join(map(str, c)))
def test_gpu_ops_with_a_given_amax(case):
    """On CUDA the ops trust a given amax (no amax pass, one read of x): with the true max|x| in fp32, the same bytes
    as without it, for quantize and quantize_dq (the amax fusion of passes/amax.py relies on this)."""
    r, f46, b2, _, tr = case
    x = data("heavy", (1024, 2048), seed=AMAX_CASES.index(case)).to(torch.bfloat16).cuda()
    amax = x.abs().amax().float()
    for op in (torch.ops.fp4compile.quantize, torch.ops.fp4compile.quantize_dq):
        want = op(x, r, f46, b2, 0, None, SEED.cuda(), tr)
        got = op(x, r, f46, b2, 0, None, SEED.cuda(), tr, amax)
        assert all(torch.equal(a, b) for a, b in zip(want, got)), (case, op)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("cfg", [{"e_impl": 0}, {"e_impl": 1, "c_rows": 8, "c_cols": 1024, "c_warps": 2},
                                 {"e_impl": 0, "e_maxnreg": 80}, {"e_impl": 2}, {"e_impl": 2, "h_maxnreg": 128},
                                 {"e_impl": 2, "h_rows": 8, "h_cols": 1024, "h_maxnreg": 96}, {"e_impl": 3},
                                 {"e_impl": 3, "u_maxnreg": 0}, {"e_impl": 3, "u_rows": 8, "u_maxnreg": 80}], ids=str)
def test_gpu_ms_eden_pass1_variants(cfg):
    """The MS-EDEN pass-1 kernels (block per thread / 128-chunk per thread / half / a quarter of a chunk per thread)
    on ragged shapes; the first one also capped at 80 registers, the half-chunk one at 128 and 96 (96 spills: a cap
    must not change a bit), the quarter-chunk one at its default 96, uncapped, and with one quarter per thread at 80."""
    from fp4compile.kernels import quantize as K

    for shape, dt in [((1000, 1920), torch.bfloat16), ((77, 3072), torch.bfloat16)]:
        x = data("heavy", shape, seed=5).to(dt)
        got = K.quantize(x.cuda(), "ms_eden", hadamard=128, signs=SIGNS.cuda(), seed=SEED.cuda(), config=cfg)
        ref = ops._quantize_reference(x, "ms_eden", False, False, 128, SIGNS, SEED, False)
        assert_same([g.cpu() for g in got], ref, (cfg, shape, dt))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("rounding,four_six", [("rtn", True), ("sr", False), ("sr", True)])
def test_gpu_register_capped_quantize_kernel(rounding, four_six):
    """The SR / 4/6 quantize kernel capped at 80 registers (CONFIG s_maxnreg; it spills) gives the same bytes."""
    from fp4compile.kernels import quantize as K

    x = data("heavy", (1000, 1920), seed=7).to(torch.bfloat16)
    got = K.quantize(x.cuda(), rounding, four_six, False, 0, None, SEED.cuda(), False, config={"s_maxnreg": 80})
    ref = ops._quantize_reference(x, rounding, four_six, False, 0, None, SEED, False)
    assert_same([g.cpu() for g in got], ref, (rounding, four_six))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("case", [(r,) + c for r in ("rtn", "sr") for c in [
    (False, False, 0, False), (True, False, 0, False), (False, True, 0, False), (False, False, 16, False),
    (True, False, 128, True), (False, False, 0, True)]], ids=lambda c: "-".join(map(str, c)))
def test_gpu_pdl_bit_exact_and_in_cuda_graphs(case):
    """CONFIG["pdl"] = 1 (quantize kernel PDL-launched behind the amax kernel): bit-exact with the reference,
    eagerly and replayed from a CUDA graph after x changed (the graph keeps the programmatic edge)."""
    from fp4compile.kernels import quantize as K

    r, f46, b2, h, tr = case
    x = data("heavy", (1024, 2048), seed=GPU_CASES.index(case)).to(torch.bfloat16)
    sg = SIGNS[:h] if h else None
    sgc, seedc = None if sg is None else sg.cuda(), SEED.cuda()      # device inputs made outside the capture

    def run(xc):
        return K.quantize(xc, r, f46, b2, h, sgc, seedc, tr, config={"pdl": 1})

    xc = x.cuda()
    got = run(xc)
    assert_same([g.cpu() for g in got], ops._quantize_reference(x, r, f46, b2, h, sg, SEED, tr), case)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run(xc)                                                            # warm-up (compile) off the graph
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = run(xc)
    x2 = data("wide", (1024, 2048), seed=7).to(torch.bfloat16)
    xc.copy_(x2.cuda())
    g.replay()
    torch.cuda.synchronize()
    assert_same([o.cpu() for o in out], ops._quantize_reference(x2, r, f46, b2, h, sg, SEED, tr), ("graph",) + case)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("h,dtype", [(0, torch.bfloat16), (16, torch.float32), (128, torch.bfloat16)])
def test_gpu_dequantize_and_ops(h, dtype):
    x = data("wide", (512, 1024))
    sg = SIGNS[:h] if h else None
    c, s, g = ops._quantize_reference(x, "rtn", False, False, h, sg, None, False)
    got = torch.ops.fp4compile.dequantize(c.cuda(), s.cuda(), g.cuda(), h, None if sg is None else sg.cuda(), dtype)
    ref = torch.ops.fp4compile.dequantize(c, s, g, h, sg, dtype)
    assert torch.equal(got.cpu(), ref)
    # stored transposed (the backward's requantization source), incl. a ragged row tile (500 of 512 rows)
    got_t = torch.ops.fp4compile.dequantize(c[:500].cuda(), s[:500].cuda(), g.cuda(), h,
                                            None if sg is None else sg.cuda(), dtype, True)
    assert got_t.shape == (1024, 500) and got_t.is_contiguous() and torch.equal(got_t.cpu(), ref[:500].t())
    # both layouts from one row-wise pass (quantize_both): distinct signs and seeds per layout, a ragged shape
    for shape, dt in [((1024, 1920), torch.bfloat16), ((1040, 1920), torch.float32)]:
        x2 = data("heavy", shape, seed=4).to(dt)
        ht = 16 if shape[0] % 128 else 128
        sg_t = SIGNS[:ht].flip(0)
        got_b = torch.ops.fp4compile.quantize_both(x2.cuda(), h, None if sg is None else sg.cuda(), SEED.cuda(), ht,
                                                   sg_t.cuda(), (SEED + 1).cuda())
        ref_b = ops._quantize_both_op(x2, h, sg, SEED, ht, sg_t, SEED + 1)
        assert_same([t.cpu() for t in got_b[:3]], ref_b[:3], ("quantize_both", shape, h))
        assert_same([t.cpu() for t in got_b[3:]], ref_b[3:], ("quantize_both T", shape, ht))
    torch.library.opcheck(torch.ops.fp4compile.quantize.default, (x.cuda(),),
                          dict(rounding="ms_eden", hadamard=h, signs=None if sg is None else sg.cuda(),
                               seed=SEED.cuda()))
    torch.library.opcheck(torch.ops.fp4compile.dequantize.default, (c.cuda(), s.cuda(), g.cuda()),
                          dict(hadamard=h, signs=None if sg is None else sg.cuda(), dtype=dtype))


def test_register_caps_reach_only_their_kernels(monkeypatch):
    """CONFIG's e_maxnreg caps MS-EDEN's pass 1 only (96 by default) and s_maxnreg the SR / 4/6 quantize kernel
    only (Triton's ``maxnreg`` launch option, CUDA only); 0 passes no cap. Launches are recorded, not run."""
    from fp4compile.kernels import quantize as K

    assert K._launch_opts(torch.device("cpu"), 96) == {}
    assert K._launch_opts(torch.device("cuda"), 0) == {"enable_fp_fusion": False}
    assert K._launch_opts(torch.device("cuda"), 96) == {"enable_fp_fusion": False, "maxnreg": 96}
    launches = []
    monkeypatch.setattr(K, "launch", lambda fn, grid, *a, **meta: launches.append((fn.fn.__name__,
                                                                                 meta.get("maxnreg"))))
    real = K._launch_opts
    monkeypatch.setattr(K, "_launch_opts", lambda device, maxnreg=0: real(torch.device("cuda"), maxnreg))

    def caps(config=None, **kw):
        launches.clear()
        K.quantize(torch.ones(32, 256), config=config, **kw)
        return launches[:]

    cap = {"e_maxnreg": 96, "s_maxnreg": 80}
    eden = dict(rounding="ms_eden", hadamard=128, signs=SIGNS[:128], seed=SEED)
    assert caps(cap, **eden) == [("_eden_pass1_kernel", 96), ("_eden_pass2_kernel", None)]
    assert caps(**eden) == [("_eden_pass1_kernel", 96), ("_eden_pass2_kernel", None)]
    assert caps({"e_maxnreg": 0}, **eden) == [("_eden_pass1_kernel", None), ("_eden_pass2_kernel", None)]
    assert caps(cap, four_over_six=True) == [("_amax_kernel", None), ("_quantize_kernel", 80)]
    assert caps(cap, rounding="sr", seed=SEED) == [("_amax_kernel", None), ("_quantize_kernel", 80)]
    assert caps(cap) == [("_amax_kernel", None), ("_quantize_kernel", None)]  # plain RTN: the q_* tile
    assert caps(four_over_six=True) == [("_amax_kernel", None), ("_quantize_kernel", 128)]  # the default cap


# ----------------------------------------------------------------------------------------------
# stochastic rounding's E2M1 code by directed rounding (quantize._e2m1_sr_mag_magic with RP, the compiled kernels' form)
_MAGIC = 12582912


def _f32_up(x):
    """The smallest FP32 >= the rational ``x`` (round toward +inf, subnormals kept), as a Fraction."""
    from fractions import Fraction

    import numpy as np

    f = np.float32(float(x))
    while Fraction(float(f)) < x:
        f = np.nextafter(f, np.float32(np.inf))
    while Fraction(float(np.nextafter(f, np.float32(-np.inf)))) >= x:
        f = np.nextafter(f, np.float32(-np.inf))
    return Fraction(float(f))


def _sr_code_rp(a, nu):
    """The PTX form's code, each fma.rp / add.rp emulated exactly: the exact value rounded once toward +inf."""
    from fractions import Fraction

    a, nu = Fraction(float(a)), Fraction(float(nu))
    t1 = _f32_up(_f32_up(2 * a + nu) + _MAGIC)
    t2 = _f32_up(_f32_up(a + nu) + _MAGIC + 2)
    t3 = _f32_up(_f32_up(a / 2 + nu) + _MAGIC + 4)
    return int(min(t1, t2, t3, Fraction(_MAGIC + 7)) - _MAGIC)


def _sr_reference_codes(a, u):
    from fp4compile.formats.schemes import sr_codes
    from fp4compile.optim.codec import e2m1_sr_codes

    a, u = torch.tensor(a, dtype=torch.float32), torch.tensor(u, dtype=torch.float32)
    ref = sr_codes(a, u)
    assert torch.equal(ref, e2m1_sr_codes(a, u).to(ref.dtype))  # the two references agree
    return ref.tolist()


def _sr_probe_values():
    """Magnitudes where the rule can go wrong: every grid point, half-way points, their FP32 neighbours, values
    just above a grid point (frac tiny), subnormals, zero, the saturation at 6 and beyond."""
    import numpy as np

    pts = [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 100.0]
    out = set()
    for p in pts:
        f = np.float32(p)
        out.update([f, np.nextafter(f, np.float32(np.inf)), np.nextafter(f, np.float32(-np.inf))])
    out.update(np.float32(v) for v in (1e-45, 1e-40, 1.2e-38, 3e-8, 1 / 3, 5.999999, 2 ** -17, 1 + 2 ** -16))
    return sorted(float(v) for v in out if v >= 0)


def test_sr_directed_rounding_form_matches_the_reference():
    """The compiled kernels' SR code (min over E2M1's three linear pieces of ceil(piece - u), each ceil by an
    fma.rp / add.rp and an add.rp of a MAGIC constant), emulated with exact rationals, equals the torch reference's
    "lo + [u < (a - lo) / step]" on every probe magnitude for uniforms on both kernels' grids (Q-AdamW's k / 2^16,
    the quantize kernel's k / 2^24), including each probe's own rounding-up probability as u (the tie u == frac,
    which must round down) and the FP32 neighbours of it."""
    import numpy as np

    us = {0.0, 2 ** -24, 2 ** -16, 0.5, 0.25, 0.75, 1 - 2 ** -16, 1 - 2 ** -24}
    a_list, u_list = [], []
    for a in _sr_probe_values():
        t = min(a, 6.0)
        step = 0.5 if t < 2 else 1.0 if t < 4 else 2.0
        frac = (t - np.floor(t / step) * step) / step
        ties = {float(frac), float(np.nextafter(np.float32(frac), np.float32(1))),
                float(np.nextafter(np.float32(frac), np.float32(0)))}
        for u in us | {x for x in ties if 0 <= x < 1}:
            a_list.append(a)
            u_list.append(u)
    ref = _sr_reference_codes(a_list, u_list)
    got = [_sr_code_rp(a, -u) for a, u in zip(a_list, u_list)]
    bad = [(a, u, g, r) for a, u, g, r in zip(a_list, u_list, got, ref) if g != r]
    assert not bad, bad[:10]
    assert len(a_list) > 300 and len(set(ref)) == 8  # every code is reached


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=400, deadline=None)
@given(a=st.floats(0.0, 8.0, width=32, allow_subnormal=True), k=st.integers(0, 2 ** 24 - 1))
def test_sr_directed_rounding_form_property(a, k):
    """The same, on random FP32 magnitudes (subnormals included) and 24-bit uniforms."""
    u = k * 2.0 ** -24
    assert _sr_code_rp(a, -u) == _sr_reference_codes([a], [u])[0]


@pytest.mark.parametrize("rp", [True, False])
def test_sr_quantize_kernel_compiles_each_form(rp, sass):
    """The SR quantize kernel as launched (the 4/6 kernels' tile and register cap), compiled for sm_90 here: with
    ``SR_RP`` its codes come from fma.rp / add.rp (no .ftz: subnormal magnitudes are kept, which the proof needs),
    without it from no directed rounding at all (and no flushing op but the floor); the directed form takes fewer instructions, spills nothing and
    keeps the cap."""
    spec = sass.quantize_sr_spec(SR_RP=rp)
    ptx = spec.compile("ptx")
    ftz = [ln.strip() for ln in ptx.splitlines() if ".ftz" in ln]
    if rp:
        assert "fma.rp.f32" in ptx and "add.rp.f32" in ptx and not ftz
    else:
        # tl.floor is cvt.rmi.ftz: harmless here, it floors s = |v| / step >= 0, and a flushed subnormal floors to the
        # same 0 (the difference s - floor(s) is an unflushed add)
        assert ".rp." not in ptx and all(ln.startswith("cvt.rmi.ftz.f32.f32") for ln in ftz), ftz
    n, _, regs, spill = sass.per_element(spec)
    assert regs <= sass.K.CONFIG["s_maxnreg"] and spill == 0
    if rp:
        assert n < sass.per_element(sass.quantize_sr_spec(SR_RP=False))[0]
