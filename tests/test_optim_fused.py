"""The fused multi-tensor Q-AdamW / AdamW Triton kernels (fp4compile/optim/fused.py) against the per-parameter
torch reference step: bit for bit, parameters and every state tensor, over several steps, for FP32 and BF16
parameters (SR / Kahan / RTN masters), Hadamard sizes, SR/RTN and 4/6 variants, tail runs, extreme
gradients, and QRoot's AdamW part. On CPU through the Triton interpreter, on CUDA with the compiled kernels
(``-m gpu``, one test per case); both in a fresh process."""
import copy
import json
import os
import subprocess
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from _optim_fused_worker import CASES  # noqa: E402  (its interpreter switch runs only as a script)


def _interp(cases, steps, device="cpu", kernel=None):
    """The worker in a fresh process: on CPU it selects the Triton interpreter before importing triton (an
    in-process import cannot switch an already imported triton), on CUDA it runs the compiled kernels.
    ``kernel``: ``FP4COMPILE_QADAMW_KERNEL`` for the worker (default: the module's default kernel)."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    if kernel is not None:
        env["FP4COMPILE_QADAMW_KERNEL"] = str(kernel)
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, os.path.join(ROOT, "tests", "_optim_fused_worker.py"), "--device", device, "--steps",
           str(steps)] + (["--cases", ",".join(cases)] if cases else [])
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("REPORT")]
    assert p.returncode == 0 and line, f"{device} worker failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return json.loads(line[0][len("REPORT"):])


def _assert_exact(rep):
    for case, r in rep.items():
        assert isinstance(r, dict), f"{case}: {r}"
        bad = {k: v for k, v in r.items() if v != 0}
        assert not bad, f"{case}: fused kernel differs from the torch reference: {bad}"


@pytest.mark.skipif(HAS_CUDA, reason="interpreter tests run on CPU-only machines; the gpu test covers CUDA")
def test_interpreter_bit_exact_default():
    _assert_exact(_interp(["fp32-default"], 2))


@pytest.mark.skipif(HAS_CUDA, reason="interpreter tests run on CPU-only machines; the gpu test covers CUDA")
def test_interpreter_bit_exact_first_kernel():
    """The first kernel version (kept for comparison, ``FP4COMPILE_QADAMW_KERNEL=1``) stays exact too."""
    _assert_exact(_interp(["fp32-default"], 2, kernel=1))


@pytest.mark.slow
@pytest.mark.skipif(HAS_CUDA, reason="interpreter tests run on CPU-only machines; the gpu test covers CUDA")
def test_interpreter_bit_exact_variants():
    _assert_exact(_interp(["fp32-variant", "fp32-had128-rtn", "bf16-sr", "bf16-kahan", "bf16-rtn", "qroot-adamw"], 2))


# one worker process per case and kernel, so that pytest-xdist spreads them (as one test the eight cases plus the
# first kernel's two took 256 s on the H200, the longest test of the GPU suite, session 40)
GPU_CASES = [(c, None) for c in CASES] + [("fp32-default", 1), ("bf16-sr", 1)]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("case,kernel", GPU_CASES, ids=[f"{c}-k{k or 'default'}" for c, k in GPU_CASES])
def test_gpu_bit_exact(case, kernel):
    rep = _interp([case], 3 if kernel is None else 2, device="cuda", kernel=kernel)
    assert list(rep) == [case]
    _assert_exact(rep)


def test_legacy_per_tensor_global_scale_loads():
    """A checkpoint from before per-chunk scales (0-dim ``*_gbits``) loads, decodes identically and resumes."""
    from fp4compile.optim import QAdamW

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(32, 32))
    opt = QAdamW([p], lr=1e-3, fused=False, compile=False, min_numel=64)
    for i in range(2):
        p.grad = torch.randn(32, 32)
        opt.step()
    sd = copy.deepcopy(opt.state_dict())  # state_dict() shares the live tensors
    legacy = {"param_groups": sd["param_groups"], "state": {0: dict(sd["state"][0])}}
    for k in ("m_gbits", "v_gbits"):
        assert legacy["state"][0][k].shape == (1,)  # 1024 elements: one run
        legacy["state"][0][k] = legacy["state"][0][k][0].clone()
    p2 = torch.nn.Parameter(p.detach().clone())
    opt2 = QAdamW([p2], lr=1e-3, fused=False, compile=False, min_numel=64)
    opt2.load_state_dict(legacy)
    for k, v in opt.state[p].items():
        assert torch.equal(opt2.state[p2][k], v), k
    g = torch.randn(32, 32)
    p.grad, p2.grad = g.clone(), g.clone()
    opt.step()
    opt2.step()
    assert torch.equal(p, p2)


def test_fused_true_without_triton_device_raises():
    from fp4compile.optim import QAdamW

    if HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("a fused-capable device is present")
    p = torch.nn.Parameter(torch.randn(64, 64))
    p.grad = torch.randn(64, 64)
    with pytest.raises(RuntimeError, match="fused=True"):
        QAdamW([p], fused=True).step()


def test_sm90_sass_reads_signs_without_conversions():
    """bench/qadamw_sass.py (kernel 2, default options, compiled for sm_90 here): the Hadamard signs come from the
    float sign tables (``fused._sign_table``) as 16-byte vector loads. The only int -> float conversions left are
    the two SR uniforms per element (the int8 signs cost 4 more per element and one load per element and
    transform), and the whole kernel stays under 250 instructions per element (241.5; 253.5 with int8 signs)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("qadamw_sass", os.path.join(ROOT, "bench", "qadamw_sass.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from fp4compile.kernels.offline import sass_stats

    blob, warps = mod.cubin(2)
    n, ops, regs, local = sass_stats(blob)
    per_thread = 1024 // (32 * warps)
    assert ops["I2F"] == 2 * per_thread, ops
    assert ops["LDG"] < 4 * per_thread, ops
    assert n < 250 * per_thread and ops["LDL"] + ops["STL"] == 0, (n, regs, local)  # and no spill
