"""Pickling, ``torch.save``/``torch.load`` and ``copy.deepcopy`` of DTensors and DeviceMeshes.

A DeviceMesh is saved as its description (device type, rank grid, dim names), never its world or
communicators; loading rebuilds an equal mesh on the world the loader runs in. A DTensor is saved
as this rank's local shard, its ``DTensorSpec``, ``requires_grad`` and its Python attributes (the
``_is_param`` flag that makes ``nn.Parameter(dtensor)`` a Parameter). So each rank saves and loads
its own file, inside a running world that already holds an equal mesh, as with torch's DTensor:

    torch.save(model.state_dict(), f"ckpt.rank{rank}.pt")
    model.load_state_dict(torch.load(f"ckpt.rank{rank}.pt", weights_only=True))

A file loaded where no world runs (a script inspecting a checkpoint) gives DTensors on a mesh of a
``DetachedWorld``, in which the process is the rank that saved the file: they read as they did
there (``to_local()``, placements, shape) and raise on their first collective.

Importing ``spmd.tensor`` registers both reductions with ``copyreg`` (which pickle consults before
``__reduce_ex__``) and allowlists the rebuild functions and value classes for
``torch.load(weights_only=True)``. ``copy.deepcopy`` of a DTensor is ``DTensor.__deepcopy__``.
"""

from __future__ import annotations

import copyreg
from typing import Any

import torch
import torch.distributed as dist

from spmd.comm import World, active_world, current_world
from spmd.comm.detached import DetachedWorld
from spmd.tensor.device_mesh.mesh import DeviceMesh
from spmd.tensor.dtensor import DTensor
from spmd.tensor.placement import Partial, Replicate, Shard, _rebuild_strided_shard, _StridedShard, format_placements
from spmd.tensor.spec import DTensorSpec, TensorMeta

__all__ = ["rebuild_device_mesh", "reduce_device_mesh", "rebuild_dtensor", "reduce_dtensor", "register_safe_globals"]

NO_WORLD_MESSAGE = (
    "unpickling a DTensor or DeviceMesh needs the world it was saved in, and the caller is not a rank "
    "of one: call torch.load / pickle.loads inside spmd.testing.run_threaded or after "
    "torch.distributed.init_process_group, with an equal DeviceMesh created on every rank first"
)


def _running_world() -> World | None:
    """The world the caller is a rank of, without starting one (that would be a collective)."""
    world = active_world()
    if world is not None:
        return world
    if dist.is_available() and dist.is_initialized():
        return current_world()
    return None


def rebuild_device_mesh(
    device_type: str, ranks: list[Any], mesh_dim_names: tuple[str, ...] | None, saved_by: int | None = None
) -> DeviceMesh:
    """An equal mesh on the caller's world, reusing the communicators that world already has.

    Where no world runs, the mesh is rebuilt on a ``DetachedWorld`` in which the caller is the rank
    that saved it (``saved_by``): its DTensors read as they did there, and cannot communicate.
    """
    world = _running_world()
    flat = torch.tensor(ranks).flatten().tolist()
    if world is None:
        if saved_by is None:
            raise RuntimeError(NO_WORLD_MESSAGE)
        world = DetachedWorld(max(*flat, saved_by) + 1, saved_by)
    if max(flat) >= world.size:
        raise RuntimeError(
            f"a DeviceMesh over ranks {ranks} was saved, but the world loading it has {world.size} ranks; "
            "load it in a world of the size that saved it"
        )
    mesh = DeviceMesh(device_type, ranks, mesh_dim_names=mesh_dim_names, _world=world, _create_groups=False)
    missing = world.missing_groups(mesh._groups())
    if missing:
        raise RuntimeError(
            f"unpickling {mesh!r} needs its process groups, and the group of ranks {list(missing[0])} does "
            "not exist yet; create an equal DeviceMesh (e.g. with init_device_mesh) on every rank before "
            "loading: groups are made by all ranks together, which unpickling cannot do"
        )
    return mesh


def reduce_device_mesh(mesh: DeviceMesh) -> tuple[Any, ...]:
    """How a DeviceMesh pickles: its description and the saving rank (the world and communicators
    belong to the job; the rank lets a process with no world read the saved DTensors as that rank)."""
    try:
        saved_by: int | None = mesh._world.current_rank()
    except Exception:  # pickled outside its world (e.g. returned from run_threaded)
        saved_by = None
    return rebuild_device_mesh, (mesh.device_type, mesh.mesh.tolist(), mesh.mesh_dim_names, saved_by)


def reduce_dtensor(dtensor: DTensor) -> tuple[Any, ...]:
    """How a DTensor pickles: the rebuild function and what it needs, all picklable."""
    spec = dtensor._spec
    try:
        coordinate = spec.mesh.get_coordinate()
    except RuntimeError:  # pickled outside its world (e.g. returned from run_threaded): nothing to check
        coordinate = None
    return rebuild_dtensor, (dtensor._local_tensor.detach(), spec, dtensor.requires_grad, coordinate, dict(dtensor.__dict__))


def rebuild_dtensor(
    local_tensor: torch.Tensor,
    spec: DTensorSpec,
    requires_grad: bool,
    saved_coordinate: tuple[int, ...] | None,
    attributes: dict[str, Any],
) -> DTensor:
    """The DTensor ``reduce_dtensor`` described, as a leaf (a Parameter again if it was one)."""
    _check_loaded_by_its_rank(spec, saved_coordinate)
    dtensor = DTensor(local_tensor, spec, requires_grad=requires_grad)
    for name, value in attributes.items():
        setattr(dtensor, name, value)
    return dtensor


def _check_loaded_by_its_rank(spec: DTensorSpec, saved_coordinate: tuple[int, ...] | None) -> None:
    """Refuse a shard loaded on a rank that should hold different data (another rank's file)."""
    here = spec.mesh.get_coordinate()
    if saved_coordinate is None or here is None:
        return
    for d, p in enumerate(spec.placements):
        if not isinstance(p, Replicate) and saved_coordinate[d] != here[d]:
            raise ValueError(
                f"a DTensor {spec} saved by the rank at mesh coordinate {saved_coordinate} is loaded by the "
                f"rank at {here}; with placements {format_placements(spec.placements)} their shards differ, "
                "so load on each rank the file that rank saved"
            )


def register_safe_globals() -> None:
    """Let ``torch.load(weights_only=True)`` call our rebuild functions and build our values."""
    add_safe_globals = getattr(torch.serialization, "add_safe_globals", None)
    if add_safe_globals is None:  # torch releases before 2.4 have no weights-only allowlist
        return
    add_safe_globals([
        rebuild_dtensor, rebuild_device_mesh, DTensorSpec, TensorMeta, Shard, Replicate, Partial,
        _StridedShard, _rebuild_strided_shard,
    ])


copyreg.pickle(DTensor, reduce_dtensor)
copyreg.pickle(DeviceMesh, reduce_device_mesh)
copyreg.pickle(DTensor, reduce_dtensor)
copyreg.pickle(DeviceMesh, reduce_device_mesh)
register_safe_globals()
