"""Where a parameter's shards live under fully_shard: which tensor dim the dp mesh dim cuts.

The dp mesh dim shards a parameter on ``Shard(k)`` with ``k`` the first tensor dim that no other
mesh dim shards (0 for a plain or a row-wise tp parameter; 1 for a column-wise tp weight, whose
dim 0 tp already cuts) and that has at least one row per dp rank. Un-sharding over dp is then one
plain all_gather on the dp group, never a reshuffle across the tp shards. A parameter with no such
dim (a 0-d scalar, a tp-sharded bias) stays ``Replicate()`` over dp; its gradient is all-reduced.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from spmd.tensor import DeviceMesh, DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from spmd.tensor.placement import _is_shard_like

__all__ = ["DP_MESH_DIM_NAME", "ShardedParameter", "resolve_dp_mesh_dim", "dp_shard_dim", "shard_parameter"]

DP_MESH_DIM_NAME = "dp"
"""The mesh dim name fully_shard shards over on an n-d mesh, by default."""
_MANAGED_ATTR = "_spmd_fully_shard_managed"
"""Set on the parameters fully_shard made, so that a second call on a submodule is caught."""


@dataclass(frozen=True, eq=False, slots=True)
class ShardedParameter:
    """One parameter that fully_shard manages: where it is registered and how it is gathered."""

    module: nn.Module
    """The module that registers the parameter (the owner or one of its descendants)."""
    name: str
    """Its attribute name on ``module``."""
    parameter: nn.Parameter
    """The sharded DTensor parameter: what the optimizer steps on."""
    gathered_placements: tuple[Placement, ...]
    """Its placements with the dp dim Replicate(): the layout forward and backward compute with."""

    @property
    def is_sharded(self) -> bool:
        """False for a parameter kept Replicate() over dp (nothing to gather)."""
        return self.gathered_placements != tuple(self.parameter.placements)  # type: ignore[attr-defined]


def resolve_dp_mesh_dim(mesh: DeviceMesh, dp_mesh_dim: int | str | None) -> int:
    """The index of the data-parallel mesh dim: the only one of a 1-d mesh, else the one named "dp"."""
    if dp_mesh_dim is None:
        if mesh.ndim == 1:
            return 0
        names = mesh.mesh_dim_names
        if names is None or DP_MESH_DIM_NAME not in names:
            raise ValueError(
                f"fully_shard on the {mesh.ndim}-d {mesh} needs to know its data-parallel dim: name it "
                f'"{DP_MESH_DIM_NAME}" (init_device_mesh(..., mesh_dim_names=("dp", "tp"))) or pass dp_mesh_dim='
            )
        return names.index(DP_MESH_DIM_NAME)
    try:
        return mesh.dim_index(dp_mesh_dim)
    except (KeyError, IndexError) as error:
        raise ValueError(f"dp_mesh_dim={dp_mesh_dim!r} is not a dim of {mesh}: {error}") from None


def dp_shard_dim(shape: torch.Size, placements: tuple[Placement, ...], dp: int, dp_size: int) -> int | None:
    """The tensor dim the dp mesh dim shards (see the module docstring), or None to replicate over dp."""
    if dp_size == 1:
        return None  # nothing to shard; a Shard over a mesh dim of one rank only costs copies
    taken = {p.dim for d, p in enumerate(placements) if d != dp and _is_shard_like(p)}  # _StridedShard too
    for k, size in enumerate(shape):
        if k not in taken and size >= dp_size:
            return k
    return None


def shard_parameter(
    module: nn.Module, name: str, param: nn.Parameter, mesh: DeviceMesh, dp: int
) -> ShardedParameter:
    """Replace ``module.<name>`` by a DTensor parameter sharded over dp; the other mesh dims keep their layout.

    A plain tensor is cut locally (every rank must hold the same values, as after a seeded init); a
    DTensor must already live on ``mesh`` (``parallelize_module(model, mesh, plan)`` on the same
    n-d mesh, not on its tp sub-mesh) and be Replicate() over dp.
    """
    where = f"{type(module).__name__}.{name}"
    if getattr(param, _MANAGED_ATTR, False):
        raise ValueError(
            f"fully_shard: parameter {where} is already managed by a fully_shard call on a parent; call "
            "fully_shard once per module, on the submodules (blocks) before their parent"
        )
    if isinstance(param, DTensor):
        if param.device_mesh != mesh:
            raise ValueError(
                f"fully_shard: parameter {where} is a DTensor on {param.device_mesh}, not on {mesh}; "
                "tensor-parallelise on the same mesh (parallelize_module(model, mesh, plan) with the n-d "
                'mesh, not mesh["tp"]) before fully_shard'
            )
        placements = tuple(param.placements)
        if any(isinstance(p, Partial) for p in placements):
            raise ValueError(f"fully_shard: parameter {where} is laid out {placements}; a parameter cannot be Partial")
        if not isinstance(placements[dp], Replicate):
            raise ValueError(
                f"fully_shard: parameter {where} is already {placements[dp]} over the dp mesh dim; call "
                "fully_shard once per module, on the submodules (blocks) before their parent"
            )
    else:
        placements = tuple(Replicate() for _ in range(mesh.ndim))
    k = dp_shard_dim(param.shape, placements, dp, mesh.size(dp))
    sharded_placements = tuple(Shard(k) if d == dp and k is not None else p for d, p in enumerate(placements))
    with torch.no_grad():
        detached = param.detach()
        if isinstance(detached, DTensor):
            local = detached.redistribute(mesh, sharded_placements)  # R -> S(k): a local cut, no traffic
        else:
            local = distribute_tensor(param.detach(), mesh, sharded_placements, src_data_rank=None)
    # Kept whole over dp (k is None), its gradient is reduced there by FullyShardState in backward.
    sharded = nn.Parameter(local, requires_grad=param.requires_grad)
    setattr(sharded, _MANAGED_ATTR, True)
    module.register_parameter(name, sharded)
    return ShardedParameter(module, name, sharded, placements)
