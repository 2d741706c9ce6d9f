"""``init_device_mesh``: a mesh over every rank of the current world, the ranks agreeing first."""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import timedelta

import torch

from spmd.comm import current_world
from spmd.tensor.device_mesh.check import check_ranks_agree
from spmd.tensor.device_mesh.mesh import DeviceMesh

__all__ = ["init_device_mesh"]


def init_device_mesh(
    device_type: str,
    mesh_shape: Sequence[int],
    *,
    mesh_dim_names: Sequence[str] | None = None,
    timeout: timedelta | float | None = None,
) -> DeviceMesh:
    """A mesh of ``mesh_shape`` over every rank of the current world, ranks in row-major order.

    Under torchrun this uses the default c10d group (started on first use: gloo for cpu, nccl for
    cuda); inside ``spmd.testing.run_threaded`` it uses the threaded world. ``timeout`` (a
    timedelta or seconds) bounds every collective on the mesh's groups; by default they inherit
    the default group's (``init_process_group(timeout=...)``) or the threaded world's.

    Every rank must pass the same shape and names: the ranks compare them first (one small
    exchange over the world) and all raise, naming the ranks that differ, if they do not.
    """
    mesh_shape = tuple(int(s) for s in mesh_shape)
    # A plain string is refused by DeviceMesh with a hint, after the ranks have compared it.
    names = mesh_dim_names if mesh_dim_names is None or isinstance(mesh_dim_names, str) else tuple(mesh_dim_names)
    timeout_s = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if timeout_s is not None and timeout_s <= 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}; pass seconds or a timedelta")
    world = current_world(device_type, timeout_s=timeout_s)
    check_ranks_agree(world, mesh_shape, names, timeout_s)
    if math.prod(mesh_shape) != world.size:
        raise ValueError(
            f"mesh shape {mesh_shape} holds {math.prod(mesh_shape)} ranks but the world has {world.size}; "
            "make the product of the mesh shape equal the world size"
        )
    ranks = torch.arange(world.size, device="cpu").reshape(mesh_shape)
    mesh = DeviceMesh(device_type, ranks, mesh_dim_names=mesh_dim_names, _world=world, _create_groups=False)
    world.create_groups(mesh._groups(), timeout_s=timeout_s)
    return mesh
