"""Randomized Hadamard transforms (RHT), applied chunkwise along the last dimension.

R = diag(s) @ H_d / sqrt(d): signs are applied to the *input* first, then the Sylvester Hadamard mixes
(signs after the Hadamard would leave magnitudes unchanged and the randomization would do nothing).
Rotating both GEMM operands along K with the same R leaves the product unchanged: (A R)(B R)^T = A B^T.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch


@functools.lru_cache(maxsize=None)
def _hadamard_cpu(d: int) -> torch.Tensor:
    if d < 1 or d & (d - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {d}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def hadamard_matrix(d: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix H_d / sqrt(d) (symmetric and orthonormal)."""
    return (_hadamard_cpu(d) / d ** 0.5).to(dtype=dtype, device=device)


def random_signs(d: int, generator: Optional[torch.Generator] = None, device=None) -> torch.Tensor:
    """A Rademacher vector of length d (float32 +-1)."""
    gen_device = generator.device if generator is not None else device
    bits = torch.randint(0, 2, (d,), generator=generator, device=gen_device)
    return (bits * 2 - 1).to(torch.float32).to(device)


def rht(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """(x * s) @ H_d / sqrt(d), chunkwise along the last dim, in FP32."""
    d = signs.numel()
    h = hadamard_matrix(d, device=x.device)
    xs = x.to(torch.float32).unflatten(-1, (x.shape[-1] // d, d)) * signs.to(x.device, torch.float32)
    return (xs @ h).flatten(-2)


def inverse_rht(y: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`rht`: (y @ H_d / sqrt(d)) * s (H is symmetric and orthonormal)."""
    d = signs.numel()
    h = hadamard_matrix(d, device=y.device)
    return ((y.to(torch.float32).unflatten(-1, (y.shape[-1] // d, d)) @ h) * signs.to(y.device, torch.float32)).flatten(-2)
