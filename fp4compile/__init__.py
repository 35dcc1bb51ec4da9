"""fp4compile: a torch.compile backend for pretraining LLMs with NVFP4 across the whole stack.

    model = torch.compile(model, backend="fullstack_fp4")      # no import needed (entry point)

Public API (imported lazily so ``import fp4compile`` stays cheap):

    quantize, dequantize, NVFP4Tensor         the NVFP4 format (fp4compile.formats.nvfp4)
    Policy, NVFP4, BF16, ROLES               precision policies (fp4compile.policy)
    explain                                  precision-annotated graph report (fp4compile.inspect)
    prepare, merge                           LoRA-SVD reparametrization (fp4compile.nn)
    QAdamW, QRoot                            quantized optimizers (fp4compile.optim)
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "quantize": "fp4compile.formats.nvfp4",
    "dequantize": "fp4compile.formats.nvfp4",
    "NVFP4Tensor": "fp4compile.formats.nvfp4",
    "Policy": "fp4compile.policy",
    "NVFP4": "fp4compile.policy",
    "BF16": "fp4compile.policy",
    "ROLES": "fp4compile.policy",
    "explain": "fp4compile.inspect",
    "prepare": "fp4compile.nn",
    "merge": "fp4compile.nn",
    "QAdamW": "fp4compile.optim",
    "QRoot": "fp4compile.optim",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'fp4compile' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
