"""Redistribute, the run half: execute a plan on this rank's shard, and the autograd Function around it.

Each step runs through the executor's collectives (spmd/tensor/redistribute/collectives.py); with
verbose logging on, every step prints one line with the bytes it moved.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from spmd.tensor.placement import (
    Partial,
    Placement,
    Replicate,
    Shard,
    _StridedShard,
    format_placements,
    shard_sizes,
)
from spmd.tensor.redistribute.collectives import (
    all_gather_dim,
    all_gather_strided,
    all_to_all_dims,
    local_chunk,
    pad_into_partial,
    partition_value,
    reduce_scatter_dim,
)
from spmd.tensor.redistribute.plan import plan_for_spec
from spmd.tensor.redistribute.steps import FlattenedStep, TransformStep
from spmd.tensor.spec import DTensorSpec
from spmd.tensor.trace import STATE, capture_collectives, human_bytes, log_line, op_scope

__all__ = [
    "redistribute_local",
    "redistribute_local_tensor",
    "redistribute_traced",
    "grad_placements_for",
    "backward_placements",
    "Redistribute",
]

REPLICATE = Replicate()


def _level_size(spec: DTensorSpec, cur: Sequence[Placement], coord: Sequence[int], dim: int, upto: int) -> int:
    """Size of tensor ``dim`` on this rank after the cuts of mesh dims before ``upto``."""
    size = spec.shape[dim]
    for e in range(upto):
        p = cur[e]
        if isinstance(p, Shard) and p.dim == dim:
            size = shard_sizes(size, spec.mesh.shape[e])[coord[e]]
        elif isinstance(p, _StridedShard) and p.dim == dim:
            size = p.local_shard_size(size, spec.mesh.shape[e], coord[e])
    return size


def redistribute_local(local: torch.Tensor, spec: DTensorSpec, dst: tuple[Placement, ...]) -> torch.Tensor:
    """The caller's shard of ``spec``'s tensor laid out as ``dst`` instead (collective on all ranks)."""
    src = spec.placements
    if src == dst:
        return local
    mesh = spec.mesh
    coord = mesh.get_coordinate()
    if coord is None:  # not a rank of the mesh: it holds an empty piece, and takes part in nothing
        return local
    # A one-rank mesh dim already holds its target placement (see plan.py's docstring).
    cur = [t if n == 1 else s for s, t, n in zip(src, dst, mesh.shape)]
    steps = plan_for_spec(spec, dst)
    for step in steps:
        if STATE.verbose:
            with capture_collectives() as records:
                local = _run_any_step(local, step, spec, cur, coord)
            moved = sum(r.moved_bytes for r in records)
            log_line("    %-52s %s", step.describe(), human_bytes(moved) if records else "")
        else:
            local = _run_any_step(local, step, spec, cur, coord)
        for d in step.mesh_dims if isinstance(step, FlattenedStep) else (step.mesh_dim,):
            cur[d] = step.dst
    return local


def _run_any_step(
    local: torch.Tensor,
    step: TransformStep | FlattenedStep,
    spec: DTensorSpec,
    cur: Sequence[Placement],
    coord: Sequence[int],
) -> torch.Tensor:
    if isinstance(step, TransformStep):
        return _run_step(local, step, spec, cur, coord)
    comm = spec.mesh._flattened_communicator(step.mesh_dims)
    assert comm is not None  # merge_flattened_steps found it
    comm = comm.with_context(spec, step)
    src_p, dst_p = step.src, step.dst
    if isinstance(src_p, Shard):  # all_gather, inner dims first: the gathered size is the outermost's
        return all_gather_dim(local, comm, src_p.dim, _level_size(spec, cur, coord, src_p.dim, step.mesh_dims[0]))
    assert isinstance(src_p, Partial)
    if isinstance(dst_p, Shard):
        return reduce_scatter_dim(local, comm, dst_p.dim, src_p.reduce_op)
    return comm.all_reduce(local, src_p.reduce_op)


def _run_step(
    local: torch.Tensor, step: TransformStep, spec: DTensorSpec, cur: Sequence[Placement], coord: Sequence[int]
) -> torch.Tensor:
    mesh, d, src_p, dst_p = spec.mesh, step.mesh_dim, step.src, step.dst
    if isinstance(src_p, _StridedShard):  # strided_route only gathers a strided dim to Replicate
        comm = mesh.get_communicator(d).with_context(spec, step)
        return all_gather_strided(local, comm, src_p, _level_size(spec, cur, coord, src_p.dim, d))
    if isinstance(dst_p, _StridedShard):  # from Replicate: this rank's strided piece, no traffic
        return dst_p._select_split_tensor(local, mesh.shape[d], coord[d], clone=True)
    if isinstance(src_p, Shard):
        comm = mesh.get_communicator(d).with_context(spec, step)  # the check names the step
        full = _level_size(spec, cur, coord, src_p.dim, d)
        if isinstance(dst_p, Shard):
            return all_to_all_dims(local, comm, src_p.dim, dst_p.dim, full)
        if isinstance(dst_p, Partial):
            return pad_into_partial(local, comm.size, coord[d], src_p.dim, full, dst_p.reduce_op)
        return all_gather_dim(local, comm, src_p.dim, full)
    if isinstance(src_p, Partial):
        comm = mesh.get_communicator(d).with_context(spec, step)
        if isinstance(dst_p, Shard):
            return reduce_scatter_dim(local, comm, dst_p.dim, src_p.reduce_op)
        return comm.all_reduce(local, src_p.reduce_op)
    if isinstance(dst_p, Shard):
        return local_chunk(local, mesh.shape[d], coord[d], dst_p.dim)
    if isinstance(dst_p, Partial):
        return partition_value(local, dst_p.reduce_op, coord[d])
    return local


def redistribute_traced(local: torch.Tensor, spec: DTensorSpec, dst: tuple[Placement, ...], label: str) -> torch.Tensor:
    """``redistribute_local`` that names itself to the debug tools (verbose lines, CommDebugMode)."""
    if not STATE.listening:
        return redistribute_local(local, spec, dst)
    if STATE.verbose:
        log_line("%-28s %s -> %s", label, spec, format_placements(dst))
    with op_scope(label):
        return redistribute_local(local, spec, dst)


def redistribute_local_tensor(
    local_tensor: torch.Tensor, current_spec: DTensorSpec, target_spec: DTensorSpec, *,
    async_op: bool = False, use_graph_based_transform: bool | None = None, is_explicit: bool = False,
) -> torch.Tensor:  # fmt: skip
    """This rank's shard of ``current_spec``'s tensor laid out as ``target_spec`` (collective on all ranks).

    torch's private name (``_redistribute``), which code that runs its own ops on local shards
    calls; the work is ``redistribute_local``'s, named to the debug tools. spmd has one planner and
    completes its collectives before returning, so ``use_graph_based_transform`` and ``async_op``
    change nothing (the result is the same tensor either way); ``is_explicit`` is true of every
    direct call already.
    """
    if current_spec.mesh != target_spec.mesh:
        raise ValueError(
            f"redistribute_local_tensor moves a shard between placements on one mesh, got {current_spec.mesh} "
            f"and {target_spec.mesh}; redistribute on the mesh the tensor lives on"
        )
    return redistribute_traced(local_tensor, current_spec, target_spec.placements, "redistribute_local_tensor")


def grad_placements_for(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """Where a gradient goes back to: the forward's placements, with Partial read as Replicate.

    The gradient of a partial tensor's global value is the same value on every contribution.
    """
    return tuple(REPLICATE if isinstance(p, Partial) else p for p in placements)


def backward_placements(src: Sequence[Placement], grad: Sequence[Placement]) -> tuple[Placement, ...]:
    """Where a redistribute's gradient goes back to: ``grad_placements_for(src)``, except that a
    gradient already Partial where the input was Partial stays so (the same global value, no collective)."""
    return tuple(
        g if isinstance(s, Partial) and isinstance(g, Partial) else (REPLICATE if isinstance(s, Partial) else s)
        for s, g in zip(src, grad)
    )


class Redistribute(torch.autograd.Function):
    """``DTensor.redistribute`` with autograd: the gradient is redistributed back to the input layout.

    ``forward_dtype`` casts the local tensor before the collectives (the result keeps it);
    ``backward_dtype`` is the dtype the gradient's collectives run in, and the gradient comes back
    in the input's dtype.
    """

    @staticmethod
    def forward(
        ctx: Any,
        input: Any,
        placements: tuple[Placement, ...],
        forward_dtype: torch.dtype | None = None,
        backward_dtype: torch.dtype | None = None,
    ) -> Any:
        spec = input._spec
        local = input._local_tensor
        ctx.src_placements = spec.placements
        ctx.input_dtype = local.dtype
        ctx.backward_dtype = backward_dtype
        if forward_dtype is not None and forward_dtype != local.dtype:
            local = local.to(forward_dtype)
            spec = spec.with_dtype(forward_dtype)
        if placements != spec.placements:
            local = redistribute_traced(local, spec, placements, "redistribute")
        elif local is input._local_tensor:
            local = local.view_as(local)
        return type(input)(local, spec.with_placements(placements), requires_grad=False)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None, None, None]:
        local, spec = grad._local_tensor, grad._spec
        if ctx.backward_dtype is not None and ctx.backward_dtype != local.dtype:
            local, spec = local.to(ctx.backward_dtype), spec.with_dtype(ctx.backward_dtype)
        target = backward_placements(ctx.src_placements, spec.placements)
        if target != spec.placements:
            local = redistribute_traced(local, spec, target, "redistribute (backward)")
        if local.dtype != ctx.input_dtype:
            local = local.to(ctx.input_dtype)
        result = spec.with_placements(target).with_dtype(ctx.input_dtype)
        return type(grad)(local, result, requires_grad=False), None, None, None
