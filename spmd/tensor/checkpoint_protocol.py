"""torch.distributed.checkpoint's planner protocol for DTensor (placeholder, being written)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["create_write_items", "create_chunk_list", "get_tensor_shard"]


def create_write_items(fqn: str, dtensor: Any) -> list[Any]:
    raise NotImplementedError("DCP support is being written")


def create_chunk_list(dtensor: Any) -> list[Any]:
    raise NotImplementedError("DCP support is being written")


def get_tensor_shard(dtensor: Any, index: Any) -> torch.Tensor:
    raise NotImplementedError("DCP support is being written")
