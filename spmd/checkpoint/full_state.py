"""Full state_dicts: DTensors gathered into plain tensors, and plain tensors laid back out.

``StateDictOptions(full_state_dict=True)`` asks for state_dicts of plain, whole tensors (what a
one-device program or a Hugging Face converter reads and writes). Getting one gathers each DTensor
(``full_tensor()``); setting one cuts each rank's block out of the full tensor locally, into the
layout the model's DTensor already has, so loading sends nothing. With ``broadcast_from_rank0``
only rank 0 holds the full state_dict: each tensor is broadcast once and cut on arrival.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from spmd.comm import Communicator, current_world
from spmd.tensor.api import distribute_tensor
from spmd.tensor.dtensor import DTensor
from spmd.tensor.trace import current_rank_or_none

__all__ = ["gather_full", "offload_to_cpu", "distribute_like", "distribute_tree", "broadcast_from_rank0"]

Path = tuple[Any, ...]
"""Keys (and list indices) from the root of a state_dict down to one value."""


def gather_full(state: Any, *, cpu_offload: bool) -> Any:
    """``state`` with each DTensor replaced by its full tensor (on CPU if ``cpu_offload``).

    Every rank gathers (the gathers are collectives). With ``cpu_offload``, as in torch, only global
    rank 0 keeps the result and every other rank gets ``{}``, so a large model is held once, not
    once per rank; in a plain process there is only rank 0.
    """
    keep = not cpu_offload or current_rank_or_none() in (None, 0)

    def full(tensor: torch.Tensor) -> torch.Tensor | None:
        value = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if not keep:
            return None
        return value.cpu() if cpu_offload else value

    with torch.no_grad():
        gathered = _map_tensors(state, full)
    return gathered if keep else {}


def offload_to_cpu(state: Any) -> Any:
    """``state`` with each tensor on CPU; DTensors stay DTensors (each rank moves its own block)."""
    with torch.no_grad():
        return _map_tensors(state, lambda tensor: tensor.cpu())


def distribute_like(value: Any, target: Any, *, owned: bool = False) -> Any:
    """A plain full ``value`` laid out as ``target`` (the model's DTensor, or its plain tensor).

    Each rank keeps its own block of ``value`` (``distribute_tensor(..., src_data_rank=None)``):
    nothing is sent. The block may be a view of ``value`` unless ``owned`` (needed where it is kept,
    not copied from: optimizer state, or a parameter on the meta device that is assigned, not
    filled; rank threads share ``value`` too). Values that are not plain tensors, or have no
    target, are returned as they are.
    """
    if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
        return value
    if isinstance(target, DTensor):
        laid_out = distribute_tensor(value.detach(), target.device_mesh, target.placements, src_data_rank=None)
        if not (owned or target.is_meta):
            return laid_out
        local = laid_out.to_local().clone()
        return DTensor.from_local(
            local, target.device_mesh, target.placements, shape=laid_out.shape, stride=laid_out.stride()
        )
    if isinstance(target, torch.Tensor) and not target.is_meta:
        return value.detach().to(target.device, copy=owned)
    return value.detach().clone() if owned else value


def distribute_tree(state: Any, target_of: Callable[[Path], Any], *, owned: bool = False) -> Any:
    """``state`` with each plain tensor laid out like ``target_of(its path)`` (see ``distribute_like``)."""
    return _map_with_path(state, (), lambda tensor, path: distribute_like(tensor, target_of(path), owned=owned))


@dataclass(frozen=True, slots=True)
class _TensorInfo:
    """What rank 0 tells the others about a tensor it is about to broadcast."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device_type: str


@dataclass(frozen=True, slots=True)
class _SourceError:
    message: str


def broadcast_from_rank0(source: Callable[[], Any], target_of: Callable[[Path], Any], *, owned: bool = False) -> Any:
    """Rank 0's ``source()`` on every rank, each tensor laid out like ``target_of(its path)``.

    Only rank 0 calls ``source``; its structure and plain values reach the others in one object
    collective, then each tensor in one broadcast, cut into its target's layout as it arrives
    (with ``owned``, no rank holds more than one full tensor at a time). If ``source`` raises on rank 0, every
    rank raises ``ValueError`` with its message.
    """
    rank = current_rank_or_none()
    if rank is None:
        return distribute_tree(source(), target_of, owned=owned)
    comm = _world_communicator()
    tree: Any = None
    outline: Any = None
    if rank == 0:
        try:
            tree = source()
            outline = _outline(tree)
        except Exception as error:
            outline = _SourceError(f"{type(error).__name__}: {error}")
    outline = comm.all_gather_object(outline)[0]
    if isinstance(outline, _SourceError):
        raise ValueError(f"broadcast_from_rank0: rank 0 could not read its state_dict: {outline.message}")
    with torch.no_grad():
        return _fill(outline, tree, (), comm, target_of, owned)


def _fill(
    outline: Any, tree: Any, path: Path, comm: Communicator, target_of: Callable[[Path], Any], owned: bool
) -> Any:
    """Walk rank 0's outline (and, on rank 0, its tree), broadcasting each tensor in order."""
    if isinstance(outline, _TensorInfo):
        target = target_of(path)
        device = _device_for(target, outline.device_type)
        if tree is not None:
            buffer = tree.detach().to(device)
        else:
            buffer = torch.empty(outline.shape, dtype=outline.dtype, device=device)
        return distribute_like(comm.broadcast(buffer, 0), target, owned=owned)
    if isinstance(outline, dict):
        return {
            key: _fill(value, _child(tree, key), (*path, key), comm, target_of, owned) for key, value in outline.items()
        }
    if isinstance(outline, (list, tuple)):
        items = [_fill(value, _child(tree, i), (*path, i), comm, target_of, owned) for i, value in enumerate(outline)]
        return items if isinstance(outline, list) else tuple(items)
    return outline


def _outline(tree: Any) -> Any:
    """``tree`` with each tensor replaced by its ``_TensorInfo``: what the other ranks need to receive it."""
    if isinstance(tree, DTensor):
        raise TypeError(
            "a broadcast_from_rank0 state_dict holds plain full tensors, not DTensors; get it with "
            "StateDictOptions(full_state_dict=True), or load a sharded state_dict without broadcast_from_rank0"
        )
    if isinstance(tree, torch.Tensor):
        return _TensorInfo(tuple(tree.shape), tree.dtype, tree.device.type)
    if isinstance(tree, dict):
        return {key: _outline(value) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        items = [_outline(value) for value in tree]
        return items if isinstance(tree, list) else tuple(items)
    return tree


def _device_for(target: Any, device_type: str) -> torch.device:
    if isinstance(target, DTensor) and not target.is_meta:
        return target.to_local().device
    if isinstance(target, torch.Tensor) and not target.is_meta:
        return target.device
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def _child(tree: Any, key: Any) -> Any:
    return None if tree is None else tree[key]


def _world_communicator() -> Communicator:
    """The communicator over every rank of the caller's world (threads or the c10d default group)."""
    world = current_world()
    everyone = tuple(range(world.size))
    world.create_groups([everyone])
    return world.communicator(everyone)


def _map_tensors(state: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    return _map_with_path(state, (), lambda tensor, _path: fn(tensor))


def _map_with_path(state: Any, path: Path, fn: Callable[[torch.Tensor, Path], Any]) -> Any:
    if isinstance(state, torch.Tensor):
        return fn(state, path)
    if isinstance(state, dict):
        return {key: _map_with_path(value, (*path, key), fn) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        items = [_map_with_path(value, (*path, i), fn) for i, value in enumerate(state)]
        return items if isinstance(state, list) else tuple(items)
    return state
