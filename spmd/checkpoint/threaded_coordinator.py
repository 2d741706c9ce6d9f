"""DCP's save and load protocol driven over one of our communicators, for the threaded world.

``dcp.save`` and ``dcp.load`` coordinate ranks with c10d object collectives on a process group.
On ``spmd.testing.run_threaded`` they work through the threaded world's c10d default group, but only
while the process has no default group of its own. ``spmd.checkpoint.save``/``load`` must work on
threads in any process, so on threads they coordinate over spmd's own communicator instead.

So this module runs the same steps ``dcp.save``/``dcp.load`` run, calling DCP's real planner and
storage objects (``DefaultSavePlanner``, ``FileSystemWriter``, ...) and moving their plans with
``Communicator.all_gather_object`` over the whole world. The files are DCP's format, and the two
worlds read each other's checkpoints.

Save: every rank plans its writes -> rank 0 merges the plans into the global plan and metadata ->
every rank writes its data files -> rank 0 writes ``.metadata`` last, so a failed save leaves no
loadable checkpoint. Load: every rank reads the metadata and plans its reads -> rank 0 merges ->
every rank reads. As in DCP, an error on any rank in a step is gathered and raised on every rank
(as ``CheckpointError``), so no rank waits forever and every rank may catch it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter

from spmd.checkpoint.errors import CheckpointError
from spmd.comm import Communicator

__all__ = ["save_over", "load_over"]

COORDINATOR = 0
"""Index, in the communicator's ranks, of the rank that merges plans and writes the metadata."""

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class _Outcome:
    """What one rank contributes to a step: its value, or the error it raised."""

    value: Any = None
    error: BaseException | None = None


def _run_step(comm: Communicator, step: str, fn: Callable[[], T]) -> list[T]:
    """Run ``fn`` on every rank and exchange the results; if any rank failed, raise on all of them."""
    try:
        outcome = _Outcome(value=fn())
    except Exception as error:
        outcome = _Outcome(error=error)
    outcomes: list[_Outcome] = comm.all_gather_object(outcome)
    failures = {comm.ranks[i]: o.error for i, o in enumerate(outcomes) if o.error is not None}
    if failures:
        raise CheckpointError(step, failures)
    return [o.value for o in outcomes]


def _on_coordinator(comm: Communicator, step: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` on the coordinator only; every rank gets its result (or raises its error)."""
    is_coordinator = comm.local_rank == COORDINATOR
    return _run_step(comm, step, fn if is_coordinator else lambda: None)[COORDINATOR]  # type: ignore[return-value]


def save_over(comm: Communicator, state_dict: dict[str, Any], writer: StorageWriter, planner: SavePlanner) -> Metadata:
    """Save ``state_dict`` as ``dcp.save`` would, coordinating the ranks of ``comm``.

    Every rank of ``comm`` calls this with its own ``writer`` and ``planner`` instances.
    """
    me, is_coordinator = comm.local_rank, comm.local_rank == COORDINATOR

    def plan_locally() -> Any:
        planner.set_up_planner(state_dict, storage_meta=writer.storage_meta(), is_coordinator=is_coordinator)
        writer.set_up_storage_writer(is_coordinator, rank=me)
        return writer.prepare_local_plan(planner.create_local_plan())

    local_plans = _run_step(comm, "save plan", plan_locally)

    def plan_globally() -> tuple[list[Any], Metadata]:
        plans, metadata = planner.create_global_plan(local_plans)
        return writer.prepare_global_plan(plans), metadata

    global_plans, metadata = _on_coordinator(comm, "save global plan", plan_globally)

    def write() -> Any:
        future = writer.write_data(planner.finish_plan(global_plans[me]), planner)
        future.wait()
        return future.value()

    write_results = _run_step(comm, "save write", write)
    # The metadata is written last, and only once every rank has written its data.
    _on_coordinator(comm, "save finish", lambda: writer.finish(metadata=metadata, results=write_results))
    return metadata


def load_over(comm: Communicator, state_dict: dict[str, Any], reader: StorageReader, planner: LoadPlanner) -> None:
    """Load into ``state_dict`` in place as ``dcp.load`` would, coordinating the ranks of ``comm``."""
    me, is_coordinator = comm.local_rank, comm.local_rank == COORDINATOR

    def plan_locally() -> Any:
        metadata = reader.read_metadata()
        planner.set_up_planner(state_dict, metadata, is_coordinator)
        reader.set_up_storage_reader(metadata, is_coordinator, rank=me)
        return reader.prepare_local_plan(planner.create_local_plan())

    local_plans = _run_step(comm, "load plan", plan_locally)
    global_plans = _on_coordinator(
        comm, "load global plan", lambda: reader.prepare_global_plan(planner.create_global_plan(local_plans))
    )

    def read() -> None:
        reader.read_data(planner.finish_plan(global_plans[me]), planner).wait()

    _run_step(comm, "load read", read)
