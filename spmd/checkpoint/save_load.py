"""save / load: a state_dict of DTensors to and from a DCP checkpoint directory, in either world."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.stateful import Stateful

from spmd.checkpoint.errors import CheckpointError
from spmd.checkpoint.threaded_coordinator import load_over, save_over
from spmd.comm import Communicator
from spmd.comm.threaded import current_threaded_world
from spmd.tensor.dtensor import DTensor
from spmd.tensor.placement import Partial, Replicate

__all__ = ["save", "load", "reduce_partials"]


def save(state_dict: dict[str, Any], checkpoint_id: str | os.PathLike[str]) -> Metadata:
    """Save ``state_dict`` (nested dicts/lists of DTensors, tensors and plain values) to a directory.

    Every rank calls it. Top-level values with ``state_dict()``/``load_state_dict()`` (a module, an
    optimizer) are saved as their ``state_dict()``, as ``dcp.save`` does. Each DTensor block is written once, by one rank; ``Partial`` DTensors are
    reduced first (see ``reduce_partials``). ``.metadata`` is written last, after every rank's data.
    DCP overwrites a checkpoint in place, so save each checkpoint to its own directory (e.g.
    ``ckpt/step-100``). Raises ``CheckpointError`` on every rank if any rank fails.
    """
    state_dict = reduce_partials({key: _as_state_dict(value) for key, value in state_dict.items()})
    writer = FileSystemWriter(checkpoint_id)
    planner = DefaultSavePlanner()
    comm = _threaded_world_communicator()
    if comm is not None:
        return save_over(comm, state_dict, writer, planner)
    with _as_checkpoint_error():
        if dist.is_initialized():
            return dcp_save(state_dict, storage_writer=writer, planner=planner)
        with warnings.catch_warnings():  # one process, no group: DCP warns that it saves alone
            warnings.simplefilter("ignore", UserWarning)
            return dcp_save(state_dict, storage_writer=writer, planner=planner, no_dist=True)


def load(state_dict: dict[str, Any], checkpoint_id: str | os.PathLike[str]) -> None:
    """Load a checkpoint into ``state_dict`` in place, each DTensor in its own mesh and placements.

    ``state_dict`` names what to load and how to lay it out (e.g. ``get_state_dict`` of a fresh
    model and optimizer), whatever layout the checkpoint was saved from; tensors are filled in
    place, plain values are replaced, and top-level values with ``load_state_dict`` get it called.
    A key missing from the checkpoint or a shape that differs raises ``CheckpointError`` naming the
    key (and both shapes), on every rank.
    """
    reader = FileSystemReader(checkpoint_id)
    planner = DefaultLoadPlanner()
    comm = _threaded_world_communicator()
    if comm is not None:
        # dcp.load does the same for Stateful values itself.
        inner = {key: _as_state_dict(value) for key, value in state_dict.items()}
        load_over(comm, inner, reader, planner)
        for key, value in state_dict.items():
            if isinstance(value, Stateful):
                value.load_state_dict(inner[key])
            else:
                state_dict[key] = inner[key]
        return
    with _as_checkpoint_error():
        if dist.is_initialized():
            dcp_load(state_dict, storage_reader=reader, planner=planner)
            return
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp_load(state_dict, storage_reader=reader, planner=planner, no_dist=True)


def reduce_partials(state_dict: Any) -> Any:
    """A copy of the (nested) ``state_dict`` in which each ``Partial`` DTensor is reduced.

    Partial mesh dims become ``Replicate`` (one all_reduce each); Shard dims stay as they are, so a
    rank still writes only its block. Other values are the same objects. Every rank must call it
    on the same structure, as the reductions are collectives.
    """
    if isinstance(state_dict, DTensor) and state_dict._spec.has_partial:
        placements = [Replicate() if isinstance(p, Partial) else p for p in state_dict.placements]
        with torch.no_grad():
            return state_dict.redistribute(placements=placements)
    if isinstance(state_dict, dict):
        return {key: reduce_partials(value) for key, value in state_dict.items()}
    if isinstance(state_dict, list):
        return [reduce_partials(value) for value in state_dict]
    return state_dict


def _as_state_dict(value: Any) -> Any:
    return value.state_dict() if isinstance(value, Stateful) else value


def _threaded_world_communicator() -> Communicator | None:
    """The communicator over every rank of the caller's threaded world, or None outside one."""
    world = current_threaded_world()
    if world is None:
        return None
    everyone = tuple(range(world.size))
    world.create_groups([everyone])
    return world.communicator(everyone)


@contextmanager
def _as_checkpoint_error() -> Iterator[None]:
    """Turn DCP's ``CheckpointException`` (a BaseException) into our ``CheckpointError``."""
    try:
        yield
    except CheckpointException as error:
        step = str(error.args[0]) if error.args else "step"
        converted = CheckpointError(step, {rank: wrapped[0] for rank, wrapped in error.failures.items()})
        raise converted from converted.__cause__
