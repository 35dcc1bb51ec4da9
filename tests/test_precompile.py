"""fp4compile.precompile: which op calls a graph sends to the workers, how a worker rebuilds and replays them,
the worker process end to end (CPU), start()'s bookkeeping, and on the GPU a compiled model's calls replayed
without a failure."""
import json
import os
import subprocess
import sys

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import fp4compile  # noqa: F401  (registers the ops)
from fp4compile import precompile as P
from fp4compile.backend import Settings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
fp4 = torch.ops.fp4compile


def _graph(tracing_mode="fake"):
    def f(x, w):
        xc, xs, xg = fp4.quantize(x, "rtn")
        wc, ws, wg = fp4.quantize(w, "rtn")
        y = fp4.gemm(xc, xs, xg, wc, ws, wg, torch.float32)
        again = fp4.quantize(x, "rtn")  # the same call twice: sent once
        tc, ts, tg = fp4.quantize(x[:, 16:48], "sr", transpose=True)  # a strided view with a storage offset
        return y, again[0], tc
    return make_fx(f, tracing_mode=tracing_mode)(torch.randn(32, 64, dtype=torch.bfloat16),
                                                 torch.randn(48, 64, dtype=torch.bfloat16)).graph


def test_op_calls_describe_each_distinct_call_with_its_layout():
    calls = P.op_calls(_graph())
    assert [c["op"] for c in calls] == ["fp4compile::quantize.default"] * 2 + ["fp4compile::gemm.default",
                                                                               "fp4compile::quantize.default"]
    x = calls[0]["args"][0]["tensor"]
    assert x == [[32, 64], [64, 1], 0, "bfloat16", "cpu"]
    assert calls[0]["device"] == "cpu"  # (arguments equal to their defaults are left out by the tracer)
    gemm = calls[2]["args"]
    assert [d["tensor"][0] for d in gemm[:6]] == [[32, 32], [32, 4], [], [48, 32], [48, 4], []]
    assert gemm[6] == {"dtype": "float32"}
    view = calls[3]["args"]
    assert view[0]["tensor"][:3] == [[32, 32], [64, 1], 16]
    assert view[1] == {"const": "sr"} and view[-1] == {"const": True} and {"const": None} in view
    json.dumps(calls)  # what goes to a worker's stdin


def test_op_calls_skip_symbolic_shapes():
    assert P.op_calls(_graph("symbolic")) == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8, torch.float8_e4m3fn, torch.bool,
                                   torch.int64])
def test_build_rebuilds_shape_stride_offset_and_dtype(dtype):
    g = torch.Generator().manual_seed(0)
    t = P._build({"tensor": [[4, 3], [1, 8], 5, str(dtype).replace("torch.", ""), "cpu"]}, g)
    assert (t.shape, t.stride(), t.storage_offset(), t.dtype) == ((4, 3), (1, 8), 5, dtype)
    scalar = P._build({"tensor": [[], [], 0, "float32", "cpu"]}, g)
    assert scalar.dim() == 0 and scalar.item() >= 0.5  # a global scale: positive
    assert P._build({"dtype": "float32"}, g) is torch.float32 and P._build({"const": 3}, g) == 3


def test_replay_runs_the_calls_and_counts_failures_without_raising():
    calls = P.op_calls(_graph())
    bad = dict(calls[0], args=[calls[0]["args"][0], {"const": "no-such-rounding"}])
    assert P.replay(calls + [bad]) == {"ok": 4, "skipped": 0, "failed": 1}


@pytest.mark.parametrize("prestarted", [False, True])
def test_worker_process_end_to_end_on_cpu(prestarted):
    calls = P.op_calls(_graph())
    p = subprocess.run([sys.executable, "-m", "fp4compile.precompile"] + (["--device", "cpu"] if prestarted else []),
                       input=json.dumps(calls), text=True, capture_output=True, cwd=ROOT, timeout=300,
                       env=dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert p.returncode == 0, p.stderr
    assert p.stdout.count(": ok ") == 4 and "'failed': 0" in p.stdout, p.stdout
    assert ("ready in" in p.stdout) == prestarted  # a prestarted worker reports its set-up, then reads its calls


def _call(op, shape, *consts):
    return {"op": f"fp4compile::{op}.default", "device": "cuda:0", "kwargs": {},
            "args": [{"tensor": [list(shape), [shape[1], 1], 0, "bfloat16", "cuda:0"]}]
            + [{"const": c} for c in consts]}


def test_plan_groups_calls_of_one_kernel_and_puts_the_slowest_compiles_first():
    calls = [_call("quantize", (64, 32), "rtn"), _call("quantize", (128, 32), "rtn"), _call("gemm", (64, 32)),
             _call("quantize", (64, 32), "ms_eden"), _call("qattn", (64, 64)), _call("qattn_bwd", (64, 64)),
             _call("dequantize", (64, 32)), _call("rht_signs", (1, 16))]
    for n in (1, 2, 4, 8):
        queues = P.plan(calls, n)
        assert len(queues) == min(n, 7)  # 7 kernel groups: the two rtn quantizes share one
        flat = [c for q in queues for c in q]
        assert sorted(map(json.dumps, flat)) == sorted(map(json.dumps, calls))  # every call exactly once
        assert queues[0][0]["op"] == "fp4compile::qattn_bwd.default"  # the slowest compile starts first
        rtn = [i for i, q in enumerate(queues) for c in q if c["args"][1:] == [{"const": "rtn"}]]
        assert len(rtn) == 2 and rtn[0] == rtn[1]  # one worker compiles the rtn kernel, once
    q1 = P.plan(calls, 1)[0]
    costs = [P.COMPILE_COST.get(c["op"].split("::")[1].split(".")[0], 0.5) for c in q1]
    assert costs == sorted(costs, reverse=True)
    q2 = P.plan(calls, 2)
    assert [c["op"] for c in q2[1][:1]] == ["fp4compile::qattn.default"]  # the second slowest: the other worker
    assert P.plan([], 4) == []


def test_start_sends_new_cuda_calls_once_and_never_raises(monkeypatch):
    cuda_call = {"op": "fp4compile::quantize.default", "device": "cuda:0", "kwargs": {},
                 "args": [{"tensor": [[32, 64], [64, 1], 0, "bfloat16", "cuda:0"]}, {"const": "rtn"}]}
    cpu_call = dict(cuda_call, device="cpu")
    started = []

    class FakePopen:
        def __init__(self, cmd, stdin, **kw):
            assert cmd[1:] == ["-m", "fp4compile.precompile"] and kw["env"]["FP4COMPILE_PRECOMPILE"] == "0"
            self.stdin = self
            self.data = b""
            started.append(self)

        def write(self, b):
            self.data += b

        def close(self):
            pass

        def poll(self):
            return 0

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(P, "op_calls", lambda g: [cuda_call, cpu_call])
    monkeypatch.setattr(P, "_SENT", set())
    monkeypatch.setattr(P, "_WORKERS", [])
    monkeypatch.setattr(P, "_IDLE", [])
    monkeypatch.setattr(P, "_FEEDERS", [])
    monkeypatch.setattr(P.subprocess, "Popen", FakePopen)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert P.start(None) == 0 and not started  # torchrun: local rank 0's workers serve the host
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert P.start(None) == 1
    P.wait()  # (the calls are written from a thread)
    assert json.loads(started[0].data) == [cuda_call]
    assert P.start(None) == 0  # already sent

    def broken(g):
        raise KeyError("val")
    monkeypatch.setattr(P, "op_calls", broken)
    with pytest.warns(UserWarning, match="no workers started"):
        assert P.start(None) == 0
    monkeypatch.setattr(P, "op_calls", lambda g: [cuda_call, cpu_call])

    def no_fork(*a, **k):
        raise OSError("fork failed")
    monkeypatch.setattr(P, "_SENT", set())
    monkeypatch.setattr(P.subprocess, "Popen", no_fork)
    assert P.start(None) == 0


def test_prestarted_workers_get_the_calls_and_idle_ones_are_released(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    procs = []

    class FakePopen:
        def __init__(self, cmd, stdin, **kw):
            self.cmd, self.data, self.closed, self.stdin = cmd, b"", False, self
            procs.append(self)

        def write(self, b):
            self.data += b

        def close(self):
            self.closed = True

        def poll(self):
            return 0 if self.closed else None

        def wait(self, timeout=None):
            return 0

    calls = [_call("qattn_bwd", (64, 64)), _call("quantize", (64, 32), "rtn"), _call("gemm", (64, 32))]
    monkeypatch.setattr(P, "op_calls", lambda g: calls)
    for name, value in (("_SENT", set()), ("_WORKERS", []), ("_IDLE", []), ("_FEEDERS", [])):
        monkeypatch.setattr(P, name, value)
    monkeypatch.setattr(P.subprocess, "Popen", FakePopen)
    monkeypatch.setattr(P.os, "cpu_count", lambda: 16)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert P.prestart([torch.zeros(2)]) == 0 and not procs  # CPU inputs: nothing to precompile
    with FakeTensorMode():
        inputs = [torch.zeros(2), torch.empty(4, device="cuda")]
    assert P.prestart(inputs) == P.MAX_WORKERS == len(procs)
    assert all(p.cmd[-2:] == ["--device", "cuda:0"] for p in procs)
    assert P.prestart(inputs) == 0  # the idle ones are still there
    assert P.start(None) == 3 and len(procs) == P.MAX_WORKERS  # no new process: three idle ones got queues
    assert P.release() == P.MAX_WORKERS - 3
    P.wait()
    queues = [json.loads(p.data) for p in procs]
    assert sorted(len(q) for q in queues) == [0] + [1] * 3 and all(p.closed for p in procs)
    assert queues[0] == [calls[0]]  # the first idle worker got the slowest compile
    assert P.release() == 0


def test_trace_compiles_reports_each_compile_with_its_specialization(monkeypatch):
    import triton
    import triton.compiler as tc

    class Src:
        name = "_k"
        attrs, signature, constants = {(0,): [["tt.divisibility", 16]]}, {"x": "*fp32"}, {(1,): 64}

        def hash(self):
            return "0123456789abcdef"

    monkeypatch.setattr(tc, "compile", lambda src, *a, **k: "compiled")
    monkeypatch.setattr(triton, "compile", tc.compile)
    seen = []
    P.trace_compiles(lambda *r: seen.append(r))
    monkeypatch.delenv("FP4COMPILE_PRECOMPILE_SPEC", raising=False)
    assert triton.compile(Src()) == "compiled" and tc.compile is triton.compile
    monkeypatch.setenv("FP4COMPILE_PRECOMPILE_SPEC", "1")
    tc.compile(Src())
    (name, w0, dt, key, spec), second = seen
    assert (name, key, spec) == ("_k", "0123456789ab", None) and dt >= 0 and w0 > 1.7e9
    assert second[4] == "attrs {(0,): [['tt.divisibility', 16]]} sig {'x': '*fp32'} consts {(1,): 64}"


def test_enabled_and_the_backend_option(monkeypatch):
    monkeypatch.delenv("FP4COMPILE_PRECOMPILE", raising=False)
    assert P.enabled() and not P.enabled(False)
    monkeypatch.setenv("FP4COMPILE_PRECOMPILE", "0")
    assert not P.enabled() and P.enabled(True)
    assert Settings.from_options({"precompile": False}).precompile is False
    with pytest.raises(TypeError, match="precompile must be True or False"):
        Settings.from_options({"precompile": "yes"})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_workers_replay_every_call_of_a_compiled_model(tmp_path, monkeypatch):
    sys.path.insert(0, HERE)
    from nanogpt import GPT, batch

    monkeypatch.setenv("FP4COMPILE_PRECOMPILE_LOG", str(tmp_path))
    monkeypatch.setattr(P, "_WORKERS", [])
    torch._dynamo.reset()
    model = GPT(vocab=256, d=128, n_layer=2, n_head=2, block_size=128).cuda().bfloat16()
    from fp4compile.backend import fullstack_fp4
    from fp4compile.policy import Policy
    step = torch.compile(model, backend=fullstack_fp4, options={"policy": Policy.full_stack()})
    x, y = (t.cuda() for t in batch(0, B=4, T=128, vocab=256))
    step(x, y).backward()
    assert P._WORKERS and P.wait(300) == [0] * len(P._WORKERS)
    logs = "".join(p.read_text() for p in tmp_path.glob("precompile-*.log"))
    assert ": failed" not in logs and ": skipped" not in logs and logs.count(": ok ") >= 3, logs
    assert logs.count("done: ") == len(P._WORKERS) and "qattn_bwd.default: ok" in logs, logs
