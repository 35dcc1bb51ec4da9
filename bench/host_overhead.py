"""Host cost per call of fp4compile's op layers (issue 3: the default-mode step is host-bound).

A compiled GPT-124M training step calls the fp4compile ops ~600 times and launches ~1,300 Triton kernels, so
microseconds of Python per call decide its default-mode speed. This prints, for tiny tensors (GPU time ~ a few
us, so wall time per call ~ host time), the host microseconds per call of each layer, each against its
alternative measured in the same run:

* dispatcher entry: an op defined straight on the dispatcher (how ``fp4compile.ops`` defines its
  non-differentiable ops) vs the same op through ``torch.library.custom_op``;
* host ceiling division: ``triton.cdiv`` (a Triton constexpr function) vs ``kernels.launch.cdiv``;
* (CUDA) one Triton launch: ``fn[grid](...)`` vs ``kernels.launch.launch``;
* (CUDA) whole ops: ``torch.ops.fp4compile.quantize`` / ``gemm`` / ``dequantize`` vs their kernel functions.

Usage: ``python bench/host_overhead.py`` (CPU: the first two rows; CUDA: all).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fp4compile  # noqa: E402,F401

Tensor = torch.Tensor


def per_call_us(fn, n: int = 2000) -> float:
    for _ in range(min(100, n)):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - t0) / n


def _dummy_ops():
    """The same trivial op defined both ways (returns a preallocated pair: only the call path is timed)."""
    out = (torch.zeros(4), torch.zeros(4))

    def ref(x: Tensor, rounding: str = "rtn", hadamard: int = 0, signs: Tensor | None = None
            ) -> tuple[Tensor, Tensor]:
        return out

    def fake(x, rounding="rtn", hadamard=0, signs=None):
        return x.new_empty(4), x.new_empty(4)

    lib = torch.library.Library("fp4bench", "FRAGMENT")
    lib.define("low" + torch.library.infer_schema(ref, mutates_args=()))
    lib.impl("low", ref, "CompositeExplicitAutograd")
    torch.library.register_fake("fp4bench::low", fake, lib=lib)
    torch.library.custom_op("fp4bench::viacustom", mutates_args=())(ref)
    return lib, torch.ops.fp4bench.low.default, torch.ops.fp4bench.viacustom.default


def main():
    rows = []

    def row(what, ours, ours_us, alt, alt_us):
        rows.append((what, ours, ours_us, alt, alt_us))
        print(f"{what:<34} {ours:<34} {ours_us:8.1f} us   {alt:<30} {alt_us:8.1f} us   {alt_us / ours_us:5.1f}x",
              flush=True)

    lib, low, viacustom = _dummy_ops()
    x = torch.zeros(4)
    row("op dispatch (4 args)", "dispatcher op (fp4compile.ops)", per_call_us(lambda: low(x, "ms_eden", 128, None)),
        "torch.library.custom_op", per_call_us(lambda: viacustom(x, "ms_eden", 128, None)))
    import triton
    from fp4compile.kernels.launch import cdiv, launch
    row("host ceiling division", "kernels.launch.cdiv", per_call_us(lambda: cdiv(16384, 128), 20000),
        "triton.cdiv", per_call_us(lambda: triton.cdiv(16384, 128), 20000))
    if torch.cuda.is_available():
        from fp4compile.kernels import gemm as G
        from fp4compile.kernels import quantize as Q
        dev = "cuda"
        xs = torch.randn(256, 1024, device=dev, dtype=torch.bfloat16)
        ws = torch.randn(512, 1024, device=dev, dtype=torch.bfloat16)
        am = torch.zeros((), dtype=torch.float32, device=dev)
        sg = Q.prepare_signs(None, 128, xs.device)
        args = (xs, 1024, 1, 256, 1024, sg, am)
        kw = dict(HAD=0, NORM=1.0, RHT_IMPL=1, TLOAD=False, BR=128, BC=256, HALVES=False, num_warps=8,
                  enable_fp_fusion=False)
        row("one Triton launch (_amax_kernel)", "kernels.launch.launch",
            per_call_us(lambda: launch(Q._amax_kernel, (2, 4), *args, **kw)),
            "fn[grid](...)", per_call_us(lambda: Q._amax_kernel[(2, 4)](*args, **kw)))
        seed = torch.zeros((), dtype=torch.int64, device=dev)
        qop = torch.ops.fp4compile.quantize.default
        row("quantize rtn (op vs kernel fn)", "kernel function", per_call_us(lambda: Q.quantize(xs), 500),
            "torch.ops.fp4compile.quantize", per_call_us(lambda: qop(xs), 500))
        row("quantize ms_eden h128 transposed", "kernel function",
            per_call_us(lambda: Q.quantize(xs, "ms_eden", hadamard=128, signs=sg, seed=seed, transpose=True), 500),
            "torch.ops.fp4compile.quantize",
            per_call_us(lambda: qop(xs, "ms_eden", False, False, 128, sg, seed, True), 500))
        a, b = Q.quantize(xs), Q.quantize(ws)
        row("gemm (op vs kernel fn)", "kernel function", per_call_us(lambda: G.nvfp4_gemm(*a, *b), 500),
            "torch.ops.fp4compile.gemm", per_call_us(lambda: torch.ops.fp4compile.gemm.default(*a, *b), 500))
        row("torch allocations (reference)", "torch.empty", per_call_us(lambda: torch.empty(256, device=dev)),
            "torch.zeros", per_call_us(lambda: torch.zeros(256, device=dev)))
    del lib


if __name__ == "__main__":
    main()
