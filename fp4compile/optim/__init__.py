"""Quantized optimizers: :class:`QAdamW` (NVFP4 moment states) and :class:`QRoot` (ROOT with NVFP4
Newton–Schulz). See docs/OPTIM.md for the formats, defaults and measured numerics."""
from .qadamw import QAdamW  # noqa: F401
from .root import QRoot, newton_schulz, ns_coefficients  # noqa: F401
from .serialization import load_safetensors_state, save_safetensors_state  # noqa: F401

__all__ = ["QAdamW", "QRoot", "newton_schulz", "ns_coefficients", "save_safetensors_state",
           "load_safetensors_state"]
