"""Register the Triton kernels as the CUDA implementations of fp4compile's custom ops.

Imported by ``fp4compile.ops`` when Triton is available. Each kernel module registers its ops on import;
keep this file a plain list of imports (importing Triton is fine on CPU-only machines, launching is not).
"""
from . import quantize  # noqa: F401  fp4compile::quantize, fp4compile::dequantize
from . import gemm  # noqa: F401  fp4compile::gemm (NVFP4 x NVFP4 -> bf16/fp32, sm_90 dequant + wgmma)
