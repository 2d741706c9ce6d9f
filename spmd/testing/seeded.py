"""Seeded test data: the same values on every rank, whatever else draws random numbers.

Rank threads share torch's global generator, so a test that calls ``torch.randn`` on each rank
gets different values per rank. These helpers draw from a fresh generator seeded with ``seed``.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["seeded_randn", "seeded_randint", "seeded_module"]


def seeded_randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Standard normal values of ``shape``, the same on every rank for the same ``seed``."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def seeded_randint(high: int, *shape: int, seed: int = 0, low: int = 0) -> torch.Tensor:
    """Integers in ``[low, high)`` of ``shape`` (int64: class targets, indices), the same on every rank."""
    return torch.randint(low, high, shape, generator=torch.Generator().manual_seed(seed))


def seeded_module(module: nn.Module, seed: int, *, scale: float = 1.0) -> nn.Module:
    """``module`` with every parameter redrawn as ``scale * randn`` from one seeded generator.

    Every rank builds the same module, so a reference copy and the parallelised one start equal.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * scale)
    return module
