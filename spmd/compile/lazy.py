"""Entry points into compile modules that import ``torch._dynamo`` (about 1.5 s), loaded on first use."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from spmd.tensor.device_mesh.mesh import DeviceMesh
from spmd.tensor.placement import Placement

__all__ = ["from_local_in_graph"]


def from_local_in_graph(
    local_tensor: torch.Tensor,
    device_mesh: DeviceMesh,
    placements: Sequence[Placement] | None,
    run_check: bool,
    shape: Sequence[int] | None,
    stride: Sequence[int] | None,
    *,
    rank: int | None,
    grad_placements: Sequence[Placement] | None = None,
) -> Any:
    """``spmd.compile.from_local.from_local_in_graph``, imported at the first call (while Dynamo traces,
    which runs the import eagerly)."""
    from spmd.compile.from_local import from_local_in_graph as in_graph

    return in_graph(
        local_tensor, device_mesh, placements, run_check, shape, stride, rank=rank, grad_placements=grad_placements
    )
