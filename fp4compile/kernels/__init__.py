"""Triton kernels, one file a family, each beside the torch reference it must match.

``register_cuda`` (imported by ``fp4compile.ops`` when Triton is available) attaches the CUDA
implementations of the custom ops.
"""
