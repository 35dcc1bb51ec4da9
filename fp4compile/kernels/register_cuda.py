"""Register the Triton kernels as the CUDA implementations of fp4compile's custom ops.

Imported by ``fp4compile.ops`` when Triton is available. Each kernel module registers its ops on import;
keep this file a plain list of imports (importing Triton is fine on CPU-only machines, launching is not).
"""
from . import quantize  # noqa: F401  fp4compile::quantize, fp4compile::dequantize
