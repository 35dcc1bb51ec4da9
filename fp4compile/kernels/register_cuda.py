"""Register the Triton kernels as the CUDA implementations of fp4compile's custom ops."""
