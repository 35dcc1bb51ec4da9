"""Number formats: the NVFP4 reference encoder/decoder and Hadamard transforms (pure torch, any device)."""
from .nvfp4 import NVFP4Tensor, dequantize, quantize  # noqa: F401
