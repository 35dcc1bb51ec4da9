"""Register the Triton kernels as the CUDA implementations of fp4compile's custom ops."""

from . import gemm  # noqa: F401,E402  fp4compile::gemm (NVFP4 x NVFP4 -> bf16/fp32, sm_90 dequant + wgmma)
