"""torch's context-parallel load balancers: which global sequence rows go to which rank.

A balancer's ``_generate_indices()`` is a ``(1, seq_length)`` index: ``buffer.index_select(seq,
idx[0])`` lays the sequence out as the ranks' pieces end to end (rank 0's rows first), so cutting
it into ``shard_sizes(seq_length, n)`` pieces gives each rank its rows; ``restore=True`` is the
inverse, putting gathered pieces back in order. The head-tail layout is the one spmd's ring
attention reads while context parallel is on (spmd/tensor/attention/layout.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from spmd.tensor.attention.layout import gather_order

__all__ = ["_LoadBalancer", "_HeadTailLoadBalancer", "_PTRRLoadBalancer"]


class _LoadBalancer(ABC):
    """Rearranges a sequence before it is cut into the ranks' pieces (and back after gathering)."""

    @abstractmethod
    def _generate_indices(self, restore: bool = False) -> torch.Tensor | None:
        """``(1, seq_length)`` indices that lay the sequence out for sharding, or with ``restore`` back in order."""


class _HeadTailLoadBalancer(_LoadBalancer):
    """Rank ``i`` of ``world_size`` holds chunk ``i`` and chunk ``2 * world_size - 1 - i`` of the
    sequence, so that under a causal mask every rank attends about as many keys.

    Beyond torch's, a ``seq_length`` not divisible by ``2 * world_size`` is accepted: each rank
    keeps ``torch.chunk``'s share of rows, split into a head of ``ceil(share / 2)`` and a tail.
    """

    def __init__(self, seq_length: int, world_size: int, device: str | torch.device) -> None:
        self.seq_length = seq_length
        self.world_size = world_size
        self.device = device

    def _generate_indices(self, restore: bool = False) -> torch.Tensor:
        order = gather_order(self.seq_length, self.world_size, True)
        if restore:
            order = torch.argsort(order)
        return order.to(self.device).unsqueeze(0)


class _PTRRLoadBalancer(_LoadBalancer):
    """torch's balancer for FlexAttention block masks; not offered by spmd (construction raises).

    It schedules a ``BlockMask``'s blocks by their cost, and spmd's context parallel covers
    scaled-dot-product attention only (FlexAttention's context parallel in torchtitan all-gathers
    k and v with ``flex_cp_allgather``, which spmd does offer). The name exists so that code
    importing it (torchtitan) loads; use ``_HeadTailLoadBalancer`` with SDPA.
    """

    def __init__(self, block_mask: Any, world_size: int) -> None:
        raise NotImplementedError(
            "spmd does not offer _PTRRLoadBalancer (FlexAttention block-mask scheduling); use "
            "_HeadTailLoadBalancer with scaled_dot_product_attention, or no load balancer"
        )

    def _generate_indices(self, restore: bool = False) -> torch.Tensor | None:
        raise NotImplementedError("spmd does not offer _PTRRLoadBalancer")
