"""kernels.launch: the cached fast launch path keys every compiled-kernel specialization Triton makes; Triton cache keys
do not depend on launch order."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, strategies as st

from fp4compile.kernels import launch as L


@given(st.integers(0, 2 ** 40), st.integers(1, 2 ** 20))
def test_cdiv_is_ceiling_division(a, b):
    q = L.cdiv(a, b)
    assert q * b >= a and (q - 1) * b < a


def test_arg_key_separates_what_triton_specializes_on():
    k = L._arg_key
    assert k(1) != k(17)                      # == 1
    assert k(16) != k(17) and k(32) == k(48)  # divisibility by 16
    assert k(2 ** 31 + 16) != k(16)           # int32 vs int64
    assert k(True) != k(1)
    x = torch.zeros(64, dtype=torch.uint8)
    assert k(x) != k(x[1:])                   # 16-byte alignment of the address
    assert k(x) != k(x.view(torch.int32))     # dtype
    assert k(x) == k(torch.zeros(64, dtype=torch.uint8))
    assert k(0.5) == k(2.0) and k(None) is None


def test_cpu_tensors_take_tritons_own_path(monkeypatch):
    calls = []

    class Fake:
        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append((grid, a, kw))

    L.launch(Fake(), (2, 3), torch.zeros(4), 5, BLOCK=16)
    assert calls == [((2, 3), (calls[0][1][0], 5), {"BLOCK": 16})]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fast_launch_matches_triton_launch():
    import triton
    import triton.language as tl

    @triton.jit
    def _axpb(x_ptr, y_ptr, n, a, B: tl.constexpr, ADD: tl.constexpr):
        i = tl.program_id(0) * B + tl.arange(0, B)
        m = i < n
        v = tl.load(x_ptr + i, mask=m) * a
        if ADD:
            v = v + 1.0
        tl.store(y_ptr + i, v, mask=m)

    x = torch.randn(1000, device="cuda")
    for n, add, off in [(1000, True, 0), (999, False, 1), (1, True, 0), (1000, True, 3)]:
        xs = x[off:]
        ref = torch.empty_like(xs)
        _axpb[(L.cdiv(n, 128),)](xs, ref, n, 2.5, B=128, ADD=add)
        for _ in range(3):  # the first call compiles through Triton, the next ones take the cached path
            out = torch.full_like(xs, float("nan"))
            L.launch(_axpb, (L.cdiv(n, 128),), xs, out, n, 2.5, B=128, ADD=add)
            torch.testing.assert_close(out[:n], ref[:n], rtol=0, atol=0)
    keys = [k for k in L._CACHE if k[0] is _axpb]
    assert len(keys) >= 3  # n = 1 / unaligned offset / ADD each compiled and cached separately


def test_host_overhead_bench_runs_on_cpu(capsys):
    """bench/host_overhead.py (the host-cost table of docs/BENCHMARKS.md) runs on CPU: its first two rows."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "host_overhead.py")
    spec = importlib.util.spec_from_file_location("host_overhead", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if torch.cuda.is_available():
        pytest.skip("the CUDA rows are run by the benchmark itself")
    mod.main()
    out = capsys.readouterr().out
    assert "op dispatch" in out and "host ceiling division" in out


def test_placeholder_is_cached_per_device_and_dtype():
    a = L.placeholder("cpu", torch.float32)
    assert a is L.placeholder(torch.device("cpu"), torch.float32) and a.numel() == 1
    b = L.placeholder("cpu", torch.uint8)
    assert b is not a and b.dtype == torch.uint8


def test_devcache_builds_each_entry_once():
    """``devcache.cached`` calls ``make`` once per key and hands back the same tensor afterwards."""
    from fp4compile.devcache import cached

    cache, calls = {}, []

    def make():
        calls.append(1)
        return torch.arange(3.0)

    a = cached(cache, "k", "cpu", make)
    b = cached(cache, "k", "cpu", make)
    assert a is b and len(calls) == 1 and torch.equal(a, torch.arange(3.0))


_ORDER_SRC = '''
import triton
import triton.language as tl

FLAG = tl.constexpr(True)


@triton.jit
def callee(x):
    if FLAG:
        return x + 1
    else:
        return x


@triton.jit
def caller(x_ptr):
    tl.store(x_ptr, callee(tl.load(x_ptr)))
'''


def _fresh_module(tmp_path, name):
    import importlib.util

    path = tmp_path / f"{name}.py"
    path.write_text(_ORDER_SRC)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="interpreted kernels have no cache key")
def test_stable_cache_keys_makes_a_kernels_key_independent_of_which_key_was_computed_first(tmp_path):
    """Triton 3.6 leaves a callee's global constexprs out of its caller's key unless the callee's key came first;
    stable_cache_keys computes them in definition order (callees first), the same in every process."""
    from fp4compile.kernels.launch import stable_cache_keys

    callee_first = _fresh_module(tmp_path, "order_callee_first")
    callee_first.callee.cache_key
    expected = callee_first.caller.cache_key
    fixed = _fresh_module(tmp_path, "order_fixed")
    stable_cache_keys(vars(fixed))
    assert fixed.caller.cache_key == expected
    assert any(name == "FLAG" for name, _ in fixed.caller.used_global_vals)


def test_every_kernel_modules_keys_are_computed_at_import():
    """In a fresh process (no interpreter): after import, every @triton.jit function of the kernel modules has its
    cache key, so no launch order can change it (the precompile workers' disk-cache entries must match)."""
    code = textwrap.dedent('''
        import triton
        from fp4compile.kernels import attention, dequant, gemm, gemm_wgmma, quantize, rotate
        from fp4compile.optim import fused
        for m in (attention, dequant, gemm, gemm_wgmma, quantize, rotate, fused):
            fns = [v for v in vars(m).values() if isinstance(v, triton.runtime.JITFunction)]
            assert fns, m.__name__
            missing = [f.__name__ for f in fns if f.hash is None]
            assert not missing, (m.__name__, missing)
        print("ok")
    ''')
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stdout + p.stderr
