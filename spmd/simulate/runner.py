"""simulate(): run one rank's training step of a workload under a plan, in a simulated world, and report it.

The step runs twice: the first creates the optimizer state and fills the sharding-decision caches
(as a real job's first step does), the second is measured. Both run on meta tensors, so a 7B model
on 4,096 ranks takes seconds and no memory for data.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch
from torch import nn

from spmd.comm import use_world
from spmd.simulate.memory import MemoryTracker, local_storages, training_state_bytes
from spmd.simulate.meta_semantics import MetaAsCpu
from spmd.simulate.plan import Links, Plan
from spmd.simulate.report import PlanReport, collective_stats, human_bytes
from spmd.simulate.world import SimulatedWorld
from spmd.tensor import DeviceMesh, DTensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.tensor.placement import _is_shard_like

__all__ = ["Workload", "simulate"]


class Workload(Protocol):
    """A training program to simulate: build the (parallelised) model and optimizer, then run one step.

    ``build`` runs under ``torch.device("meta")``; both run in the simulated world, so
    ``init_device_mesh``, ``parallelize_module``, ``fully_shard`` and every DTensor op work as usual.
    """

    def build(self, mesh: DeviceMesh) -> tuple[nn.Module, torch.optim.Optimizer]: ...

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh) -> None: ...


def simulate(
    workload: Workload, plan: Plan, *, rank: int = 0, world_size: int | None = None, links: Links | None = None
) -> PlanReport:
    """Simulate ``rank`` of a ``world_size``-rank job (default: the plan's mesh size) running ``workload``.

    The mesh is the plan's, over the whole world, ranks in row-major order; ``rank`` picks the
    coordinate, which matters when shards are uneven.
    """
    size = plan.world_size if world_size is None else world_size
    if size != plan.world_size:
        raise ValueError(
            f"the mesh {plan} holds {plan.world_size} ranks but the world has {size}; make the product of the "
            "mesh dims equal the world size"
        )
    links = links or Links()
    started = time.perf_counter()
    with use_world(SimulatedWorld(size, rank=rank)), MetaAsCpu():
        mesh = init_device_mesh("meta", plan.mesh_shape, mesh_dim_names=plan.mesh_dim_names)
        with torch.device("meta"):
            model, optimizer = workload.build(mesh)
        workload.step(model, optimizer, mesh)
        with CommDebugMode() as comm, MemoryTracker(local_storages(model, optimizer)) as tracker:
            workload.step(model, optimizer, mesh)
        state = training_state_bytes(model, optimizer)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        grad_tokens = {tracker.token_of(_local(g).untyped_storage()) for g in grads} - {None}
        activations = tracker.peak(excluding=grad_tokens)  # type: ignore[arg-type]
        peak = state.params + state.optimizer + tracker.peak()
        stats = collective_stats(comm.records, mesh, links)
        notes = _fsdp_notes(model, plan) if plan.fsdp else ()
    return PlanReport(
        plan=str(plan),
        world_size=size,
        rank=rank,
        state=state,
        activations_peak=activations,
        peak=peak,
        collectives=stats,
        simulate_seconds=time.perf_counter() - started,
        notes=notes,
    )


def _fsdp_notes(model: nn.Module, plan: Plan) -> tuple[str, ...]:
    """Say so when fully_shard left some dp ranks without a share of a parameter: kept whole over dp
    (0-d), or cut on a dim with fewer rows than dp ranks (FSDP2's dim 0), so some shards are empty."""
    dp = plan.mesh_dim_names.index("dp")
    dp_size = plan.size("dp")
    params = [p for p in model.parameters() if isinstance(p, DTensor)]
    whole = [p for p in params if not _is_shard_like(p.placements[dp])]
    short = [p for p in params if _is_shard_like(p.placements[dp]) and _rows_for_dp(p, dp) < dp_size]
    notes = []
    if whole:
        nbytes = sum(p._local_tensor.nbytes for p in whole)
        notes.append(
            f"fully_shard kept {len(whole)} of {len(params)} parameters ({human_bytes(nbytes)} per rank) whole "
            f"over dp={dp_size}: their gradients are all-reduced"
        )
    if short:
        notes.append(
            f"fully_shard cut {len(short)} of {len(params)} parameters on a dim with fewer rows than dp={dp_size} "
            "ranks (FSDP2's dim 0), so some dp ranks hold empty shards of them; shard_placement_fn="
            "shard_first_free_dim(dp_mesh) picks a longer dim where there is one"
        )
    return tuple(notes)


def _rows_for_dp(param: DTensor, dp: int) -> int:
    """The rows dp cuts: the length of its tensor dim, divided among the other mesh dims cutting it too."""
    dim = param.placements[dp].dim  # type: ignore[attr-defined]
    rows = param.shape[dim]
    for d, p in enumerate(param.placements):
        if d != dp and _is_shard_like(p) and p.dim == dim:
            rows //= param.device_mesh.size(d)
    return rows


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor
