"""fp4compile: a torch.compile backend for pretraining LLMs with NVFP4 across the whole stack.

    model = torch.compile(model, backend="fullstack_fp4")      # no import needed (entry point)

Run from a source tree without ``pip install`` (``PYTHONPATH=.``) there is no entry point: ``import fp4compile``
first, which then registers the backend itself (``_register_without_entry_point``).

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


def _fullstack_fp4(gm, example_inputs, **kwargs):
    """``fp4compile.backend.fullstack_fp4``, imported on the first compile (registered by
    ``_register_without_entry_point``)."""
    from .backend import fullstack_fp4

    return fullstack_fp4(gm, example_inputs, **kwargs)


def _register_without_entry_point():
    """Make ``backend="fullstack_fp4"`` work when the package is used from a source tree (``PYTHONPATH=.``, no
    ``pip install``). Dynamo finds backends through the installed ``torch_dynamo_backends`` entry point; a source tree
    has none, and ``torch.compile`` would raise ``InvalidBackend``. Installed, this does nothing: the entry point
    registers the backend on first use, and registering it here as well would trip Dynamo's duplicate-name assertion
    when the entry point loads (``../shared/notes/torch-compile.md``)."""
    from importlib import metadata

    try:
        eps = metadata.distribution("fp4compile").entry_points
        if "fullstack_fp4" in eps.select(group="torch_dynamo_backends").names:
            return
    except metadata.PackageNotFoundError:
        pass
    from torch._dynamo import register_backend

    try:
        register_backend(compiler_fn=_fullstack_fp4, name="fullstack_fp4")
    except AssertionError:  # already registered in this process (e.g. importlib.reload)
        pass


_register_without_entry_point()
