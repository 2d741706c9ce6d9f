"""``DTensor.from_local`` as one opaque call in Dynamo's graph (``torch._dynamo.nonstrict_trace``).

Dynamo does not trace the body (it builds a DTensor from a spec, which Dynamo cannot hold);
AOTAutograd then traces through it, down to aten ops on the local shard. Loaded
through ``spmd.compile.lazy`` only once Dynamo traces a ``from_local`` (this module imports
``torch._dynamo``); DTensor reaches it through the hook board, so the import goes one way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch._dynamo

from spmd.compile.eager_frames import keep_dynamo_out_of_dispatch
from spmd.tensor.device_mesh.mesh import DeviceMesh
from spmd.tensor.dtensor import DTensor, from_local_eager
from spmd.tensor.placement import Partial, Placement, Replicate, Shard, _StridedShard

__all__ = ["from_local_in_graph", "placement_code", "placement_from_code"]

# Imported while Dynamo traces a from_local (import statements run eagerly): from then on, an op
# that runs eagerly inside a compiled function (after a graph break) is not traced.
keep_dynamo_out_of_dispatch(DTensor.__torch_dispatch__.__func__.__code__)  # type: ignore[attr-defined]


def placement_code(p: Placement) -> tuple[str, int | str]:
    """A placement as plain values: Dynamo cannot pass a placement built inside the compiled region
    into a nonstrict call, but it can read its fields."""
    if isinstance(p, Shard):
        return ("shard", p.dim)
    if isinstance(p, _StridedShard):
        return ("strided", f"{p.dim}:{p.split_factor}")
    if isinstance(p, Partial):
        return ("partial", p.reduce_op)
    return ("replicate", 0)


def placement_from_code(code: tuple[str, int | str]) -> Placement:
    kind, detail = code
    if kind == "shard":
        return Shard(int(detail))
    if kind == "strided":
        dim, split_factor = str(detail).split(":")
        return _StridedShard(int(dim), split_factor=int(split_factor))
    if kind == "partial":
        return Partial(str(detail))
    return Replicate()


def from_local_in_graph(
    local_tensor: torch.Tensor,
    device_mesh: DeviceMesh,
    placements: Sequence[Placement] | None,
    run_check: bool,
    shape: Sequence[int] | None,
    stride: Sequence[int] | None,
    *,
    rank: int | None,
    grad_placements: Sequence[Placement] | None = None,
) -> DTensor:
    """``DTensor.from_local`` as Dynamo records it: one call, traced by AOTAutograd rather than Dynamo.

    ``rank`` is the calling thread's rank in a threaded world: passing it specializes the graph on
    it, so Dynamo guards on it (the graph bakes in the rank's coordinate and groups).
    """
    # A nonstrict call takes no None, so a missing argument travels as a (given, value) pair.
    return _from_local_call(
        local_tensor,
        device_mesh,
        (placements is not None, tuple(placement_code(p) for p in placements or ())),
        run_check,
        (shape is not None, tuple(shape or ())),
        (stride is not None, tuple(stride or ())),
        -1 if rank is None else rank,
        (grad_placements is not None, tuple(placement_code(p) for p in grad_placements or ())),
    )


@torch._dynamo.nonstrict_trace
def _from_local_call(
    local_tensor: torch.Tensor,
    device_mesh: DeviceMesh,
    placement_codes: tuple[bool, tuple[tuple[str, int | str], ...]],
    run_check: bool,
    shape: tuple[bool, tuple[int, ...]],
    stride: tuple[bool, tuple[int, ...]],
    rank: int,
    grad_codes: tuple[bool, tuple[tuple[str, int | str], ...]],
) -> DTensor:
    return from_local_eager(
        local_tensor,
        device_mesh,
        tuple(placement_from_code(code) for code in placement_codes[1]) if placement_codes[0] else None,
        run_check,
        shape[1] if shape[0] else None,
        stride[1] if stride[0] else None,
        tuple(placement_from_code(code) for code in grad_codes[1]) if grad_codes[0] else None,
    )
