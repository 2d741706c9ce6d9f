"""Building test DTensors in any layout, with partial values that really differ between ranks.

``distribute_tensor`` makes a sum-partial by putting the value on coordinate 0 and zeros
elsewhere. That hides bugs, so tests build partials whose pieces are all non-trivial: for the first
partial mesh dim, each rank holds the value plus a rank-dependent offset that the reduction
cancels (sum, avg) or that loses to the true value (max, min).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import torch

from spmd.tensor.device_mesh.mesh import DeviceMesh
from spmd.tensor.dtensor import DTensor
from spmd.tensor.placement import Partial, Placement, Replicate, Shard
from spmd.tensor.spec import local_shape_and_offset
from spmd.testing.seeded import seeded_randn

__all__ = ["seeded_randn", "placement_options", "placement_combinations", "local_piece", "make_dtensor", "expected_local_grad"]


def placement_options(ndim: int, *, partials: Sequence[str] = Partial.REDUCE_OPS) -> list[Placement]:
    """R, S(d) for every dim, and the given partials: every placement of one mesh dim."""
    return [Replicate(), *(Shard(d) for d in range(ndim)), *(Partial(op) for op in partials)]


def placement_combinations(mesh_ndim: int, tensor_ndim: int, **kwargs: Sequence[str]) -> Iterator[tuple[Placement, ...]]:
    """Every tuple of placements for a mesh of ``mesh_ndim`` dims."""
    return itertools.product(placement_options(tensor_ndim, **kwargs), repeat=mesh_ndim)


def _noise(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    numel = 1
    for s in shape:
        numel *= s
    values = (torch.arange(numel) % 5 + 1).reshape(tuple(shape))
    return values.to(dtype)


def local_piece(full: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> torch.Tensor:
    """This rank's local tensor of ``full`` laid out as ``placements`` (non-trivial partials)."""
    coordinate = mesh._require_coordinate()
    shape, offset = local_shape_and_offset(full.shape, mesh, placements, coordinate)
    local = full
    for dim, (size, start) in enumerate(zip(shape, offset)):
        local = local.narrow(dim, start, size)
    local = local.clone()
    noisy_done = False
    for d, p in enumerate(placements):
        if not isinstance(p, Partial):
            continue
        n, index = mesh.shape[d], coordinate[d]
        noise = _noise(local.shape, local.dtype)
        if noisy_done:
            # Later partial dims stay trivial, so mixed reductions agree in any order.
            if p.reduce_op == "sum" and index != 0:
                local = torch.zeros_like(local)
            continue
        noisy_done = True
        if p.reduce_op == "sum":
            local = local - (n - 1) * noise if index == 0 else noise
        elif p.reduce_op == "avg":
            local = local + (2 * index - (n - 1)) * noise
        elif p.reduce_op == "max":
            local = local if index == 0 else local - noise
        elif p.reduce_op == "min":
            local = local if index == 0 else local + noise
    return local


def make_dtensor(
    full: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], *, requires_grad: bool = False
) -> DTensor:
    """A DTensor whose global value is ``full``, laid out as ``placements``."""
    local = local_piece(full, mesh, placements)
    if requires_grad:
        local.requires_grad_()
    return DTensor.from_local(local, mesh, placements, shape=full.shape, stride=full.stride())


def expected_local_grad(grad: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> torch.Tensor:
    """The gradient a rank's local tensor gets when the global gradient is ``grad``."""
    shape, offset = local_shape_and_offset(grad.shape, mesh, placements)
    local = grad
    for dim, (size, start) in enumerate(zip(shape, offset)):
        local = local.narrow(dim, start, size)
    for d, p in enumerate(placements):
        if isinstance(p, Partial) and p.reduce_op == "avg":
            local = local / mesh.shape[d]
    return local
