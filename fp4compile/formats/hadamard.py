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


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized fast Walsh-Hadamard transform along the last dim (its size d a power of two), FP32.

    Computes ``x @ H_d`` (Sylvester order) as log2(d) butterfly stages; stage h (h = 1, 2, 4, ...) maps each
    pair (a, b) = (x[j], x[j + h]) with j's bit h clear to (a + b, a - b). This exact order of FP32 additions
    is the definition the Triton kernels reproduce bit for bit (a dense matmul would round differently).
    """
    d = x.shape[-1]
    if d < 1 or d & (d - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {d}")
    lead = x.shape[:-1]
    y = x.to(torch.float32)
    h = 1
    while h < d:
        v = y.reshape(*lead, d // (2 * h), 2, h)
        a, b = v[..., 0, :], v[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).reshape(*lead, d)
        h *= 2
    return y


def _norm(d: int, device) -> torch.Tensor:
    return torch.tensor(1.0 / d ** 0.5, dtype=torch.float32, device=device)


def rht(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """(x * s) @ H_d / sqrt(d), chunkwise along the last dim, in FP32.

    Order of operations (the kernels match it bit for bit): signs first, the butterfly :func:`fwht`, one
    multiply by fp32(1/sqrt(d)), then ``+ 0.0`` so an exactly-cancelled output is +0 (a canonical zero: the
    sign bit of an NVFP4 zero code would otherwise depend on the addition order).
    """
    d = signs.numel()
    if x.shape[-1] % d:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the Hadamard size {d}")
    xs = x.to(torch.float32).unflatten(-1, (x.shape[-1] // d, d)) * signs.to(x.device, torch.float32)
    return (fwht(xs) * _norm(d, x.device) + 0.0).flatten(-2)


def inverse_rht(y: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`rht`: (y @ H_d / sqrt(d)) * s (H is symmetric and orthonormal)."""
    d = signs.numel()
    yc = y.to(torch.float32).unflatten(-1, (y.shape[-1] // d, d))
    return (fwht(yc) * _norm(d, y.device) * signs.to(y.device, torch.float32)).flatten(-2)
