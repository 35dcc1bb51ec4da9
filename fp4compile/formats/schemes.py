"""Rounding schemes of the NVFP4 reference: RTN (+4/6), SR, MS-EDEN. FP32 math, any device."""
from __future__ import annotations

from typing import Optional

import torch

from .hadamard import random_signs, rht
from .nvfp4 import NVFP4Tensor, quantize_rtn_


def quantize_fp32(x: torch.Tensor, *, rounding: str, block, four_over_six: bool, hadamard: Optional[int],
                  generator: Optional[torch.Generator], signs: Optional[torch.Tensor]) -> NVFP4Tensor:
    shape = x.shape
    x32 = x.to(torch.float32)
    if hadamard is not None:
        if signs is None:
            signs = random_signs(hadamard, generator, device=x.device)
        elif signs.numel() != hadamard:
            raise ValueError(f"signs has {signs.numel()} entries, expected {hadamard}")
        x32 = rht(x32, signs)
    block2d = block == (16, 16)
    if rounding == "rtn":
        codes, scales, g = quantize_rtn_(x32, block2d, four_over_six)
    else:
        raise NotImplementedError(f"rounding={rounding!r} is not implemented yet")
    return NVFP4Tensor(codes=codes, scales=scales, global_scale=g, shape=shape, block=block,
                       rounding=rounding, four_over_six=four_over_six, hadamard=hadamard,
                       signs=signs if hadamard is not None else None)
