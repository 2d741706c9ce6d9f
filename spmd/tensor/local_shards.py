"""What ``from_local`` works out about the ranks' local tensors, without building a DTensor.

The global shape (inferred from even pieces, or gathered and checked by ``run_check``), global strides
that keep the local tensor's dim order, and the replica check (``SPMD_DEBUG=check``) of values and
gradients that claim ``Replicate``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spmd.comm.replicas import call_site, compare_replicas, tensor_label, user_frame
from spmd.tensor.device_mesh.mesh import DeviceMesh
from spmd.tensor.placement import Placement, Replicate, _is_shard_like, shard_sizes
from spmd.tensor.redistribute.collectives import agree
from spmd.tensor.spec import DTensorSpec, contiguous_strides, local_shape

__all__ = [
    "infer_global_shape",
    "check_and_gather_shape",
    "layout_strides",
    "label_local",
    "compare_replicated",
    "FROM_LOCAL_FIX",
    "GRAD_FIX",
]


def infer_global_shape(
    local_shape: Sequence[int], mesh: DeviceMesh, placements: Sequence[Placement]
) -> tuple[int, ...]:
    shape = list(local_shape)
    for size, p in zip(mesh.shape, placements):
        if _is_shard_like(p):  # Shard or _StridedShard: even pieces assumed
            shape[p.dim] *= size
    return tuple(shape)


def check_and_gather_shape(
    local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int] | None
) -> tuple[int, ...]:
    """run_check: compare every rank's local meta and return the global shape it implies."""
    # (coordinate, local shape, dtype) of every rank of the mesh
    strides = local.stride()
    order = tuple(sorted(range(local.ndim), key=lambda d: (-strides[d], d)))
    entry = (mesh._require_coordinate(), tuple(local.shape), str(local.dtype), local.requires_grad, order)
    metas: list[tuple[tuple[int, ...], tuple[int, ...], str, bool, tuple[int, ...]]] = agree(
        mesh, range(mesh.ndim), entry
    )
    dtypes = {m[2] for m in metas}
    if len(dtypes) != 1:
        raise ValueError(f"from_local: ranks passed local tensors of different dtypes {sorted(dtypes)}")
    if len({m[3] for m in metas}) != 1:
        raise ValueError(
            "from_local: some ranks passed local tensors that require grad and some that do not; "
            "set requires_grad alike on every rank"
        )
    if len({m[4] for m in metas}) != 1 and len({m[1] for m in metas}) == 1:
        raise ValueError(
            "from_local: ranks passed local tensors of different memory layouts (strides "
            f"{local.stride()} on this rank); make them alike, e.g. with .contiguous()"
        )
    ndims = {len(m[1]) for m in metas}
    if len(ndims) != 1:
        raise ValueError(f"from_local: ranks passed local tensors of different ranks (ndim) {sorted(ndims)}")
    global_shape = list(shape) if shape is not None else None
    by_coord = {m[0]: m[1] for m in metas}
    ndim = ndims.pop()
    if global_shape is None:
        global_shape = []
        for dim in range(ndim):
            mesh_dims = [d for d, p in enumerate(placements) if _is_shard_like(p) and p.dim == dim]
            if not mesh_dims:
                global_shape.append(local.shape[dim])
                continue
            # Sum the pieces along the mesh dims that shard this tensor dim, at coordinate 0 elsewhere.
            total = 0
            for coord, lshape in by_coord.items():
                if all(c == 0 for d, c in enumerate(coord) if d not in mesh_dims):
                    total += lshape[dim]
            global_shape.append(total)
    for coord, lshape in sorted(by_coord.items()):
        expected = local_shape(global_shape, mesh, placements, coord)
        if tuple(lshape) != expected:
            raise ValueError(
                f"from_local: the rank at mesh coordinate {coord} passed a local tensor of shape "
                f"{list(lshape)}, but placements {[str(p) for p in placements]} of a global tensor of "
                f"shape {global_shape} give it {list(expected)}; pass local shards of torch.chunk sizes "
                f"(uneven pieces e.g. {shard_sizes(7, 4)} for 7 over 4) or the right shape="
            )
    return tuple(global_shape)


def layout_strides(local: torch.Tensor, global_shape: Sequence[int]) -> tuple[int, ...]:
    """Dense strides of ``global_shape`` that keep ``local``'s dim order (outermost = largest stride).

    A transposed local shard stands for a transposed global tensor, as on a single device.
    """
    if local.is_contiguous():
        return contiguous_strides(global_shape)
    local_strides = local.stride()
    order = sorted(range(local.ndim), key=lambda d: (-local_strides[d], d))  # outermost first
    strides = [0] * local.ndim
    running = 1
    for d in reversed(order):
        strides[d] = running
        running *= max(global_shape[d], 1)
    return tuple(strides)


FROM_LOCAL_FIX = (
    "Replicate() promises the same values on every rank of that dim: pass the same values (the same seed, "
    "or from_local(..., run_check=True) to broadcast them), claim Partial() if each rank holds a part to be "
    "summed, or all_reduce the local tensor first."
)
GRAD_FIX = (
    "The local code after to_local() made the gradient depend on the rank (rank-dependent inputs, or a "
    "local loss): pass to_local(grad_placements=[Partial()]) (or from_local(..., grad_placements=...)) so "
    "the per-rank gradients are summed, or all_reduce them yourself."
)


def label_local(tensor: torch.Tensor, call: str) -> str:
    """``to_local() of Linear.weight at train.py:12 in forward``: how replica errors name a tensor."""
    frame = user_frame()
    name = tensor_label(tensor, frame)
    return f"{call} of {name} at {call_site(frame)}" if name else f"{call} at {call_site(frame)}"


def compare_replicated(
    local: torch.Tensor, spec: DTensorSpec, placements: Sequence[Placement], what: str, fix: str
) -> None:
    """The replica check (SPMD_DEBUG=check) on every mesh dim of ``placements`` that says Replicate."""
    for d, placement in enumerate(placements):
        if isinstance(placement, Replicate) and spec.mesh.shape[d] > 1:
            compare_replicas(local, spec.mesh.get_communicator(d), what, fix)
