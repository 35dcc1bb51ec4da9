"""Eager reference of an NVFP4 linear layer with an RTN-only policy, built by hand from the same custom ops
the backend inserts (fp4compile::quantize / dequantize / gemm), following the documented recipe:
fprop X·Wᵀ from RTN copies; dgrad dY·W with W requantized (transposed) from its forward FP4 copy;
wgrad dYᵀ·X with X requantized (transposed) from its forward FP4 copy."""
import types

import torch


def _q(x, transpose=False):
    return torch.ops.fp4compile.quantize(x, "rtn", False, False, 0, None, None, transpose)


def _deq(q, dtype):
    return torch.ops.fp4compile.dequantize(*q, 0, None, dtype)


class RefFP4Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        x2 = x.reshape(-1, x.shape[-1])
        qx, qw = _q(x2), _q(w)
        y = torch.ops.fp4compile.gemm(*qx, *qw, x.dtype)
        if b is not None:
            y = y + b
        ctx.save_for_backward(*qx, *qw)
        ctx.meta = (x.shape, x.dtype, b is not None)
        return y.reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        shape, dtype, has_b = ctx.meta
        s = ctx.saved_tensors
        qx, qw = s[:3], s[3:]
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = torch.ops.fp4compile.gemm(*_q(dy2), *_q(_deq(qw, dtype), transpose=True), dtype)
        dw = torch.ops.fp4compile.gemm(*_q(dy2, transpose=True), *_q(_deq(qx, dtype), transpose=True), dtype)
        return dx.reshape(shape), dw, dy2.sum(0) if has_b else None


def use_reference_linears(model):
    """Make every nn.Linear (and transformers' Conv1D, weight [in, out]) of ``model`` run
    :class:`RefFP4Linear` (eager)."""
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.forward = types.MethodType(lambda self, x: RefFP4Linear.apply(x, self.weight, self.bias), m)
        elif type(m).__name__ == "Conv1D":
            m.forward = types.MethodType(lambda self, x: RefFP4Linear.apply(x, self.weight.t(), self.bias), m)
    return model
