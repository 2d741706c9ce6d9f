"""Calls off the common path: ``out=`` overloads, ranks outside the op's mesh, the replicate fallback's
results, in-place views, plain tensors among DTensors, and layout-neutral ops on ``_StridedShard`` inputs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import return_and_correct_aliasing

from spmd.tensor.dispatch.keys import UnwrappedCall
from spmd.tensor.dtensor import DTensor, plain_tensors_allowed
from spmd.tensor.placement import Replicate
from spmd.tensor.redistribute.run import redistribute_local
from spmd.tensor.sharding.call import unflatten_call
from spmd.tensor.sharding.entry import OpEntry
from spmd.tensor.sharding.vocabulary import Decision
from spmd.tensor.spec import DTensorSpec, TensorMeta
from spmd.tensor.torch_objects import refuse_torch_object

__all__ = [
    "LAYOUT_NEUTRAL_OPS",
    "run_layout_neutral",
    "result_outside_mesh",
    "returns_tensors",
    "refuse_write_into_copied_view",
    "replicate_plain_tensors",
    "dispatch_out",
    "reshape_self",
    "finish_fallback",
]

aten = torch.ops.aten


LAYOUT_NEUTRAL_OPS = frozenset({aten.detach.default, aten.alias.default, aten.clone.default, aten._to_copy.default})
"""Ops whose result on the local piece is the result's piece in any layout (a copy, a cast, an
alias): run on a ``_StridedShard`` input as they are, they keep its placements (autograd's
``detach`` of a gradient, ``x.float()``)."""


def run_layout_neutral(
    op: Any, leaves: Sequence[Any], shape: tuple[Any, ...], kwarg_names: list[str], position: int
) -> DTensor | None:
    """``op`` on the one DTensor's local piece, wrapped with its spec (in the result's dtype); None
    when the result left the piece's device (``x.to("cuda")``: the regular path decides that)."""
    dt = leaves[position]
    local = list(leaves)
    local[position] = dt._local_tensor
    local_args, local_kwargs = unflatten_call(local, shape, kwarg_names)
    result = op(*local_args, **local_kwargs)
    if result.device != dt._local_tensor.device:
        return None
    return DTensor(result, dt._spec.with_dtype(result.dtype), requires_grad=False)


def result_outside_mesh(entry: OpEntry, decision: Decision, call: UnwrappedCall) -> Any:
    """The result on a rank outside the op's mesh, as torch gives it: no kernel and no collective
    runs; each tensor output is a DTensor of the decided spec holding an empty piece (a 0-d zero for
    a 0-d tensor); a bool is True (the answer of a comparison the rank takes no part in), other
    values None. An in-place op returns its (empty) self."""
    mesh = call.mesh
    if decision.fallback:
        raise NotImplementedError(
            f"{entry.op} has no sharding rule, and rank {mesh.get_rank()} is not part of {mesh!r}, so the "
            "replicate fallback cannot run there; register a rule for the op in spmd/tensor/ops/"
        )
    if decision.inplace:
        if decision.reshapes_self and decision.output_specs[0] is not None:
            call.args[0]._spec = decision.output_specs[0]
        return call.args[0]

    def empty(spec: DTensorSpec) -> DTensor:
        shape = () if spec.ndim == 0 else (0,)
        local = torch.zeros(shape, dtype=spec.tensor_meta.dtype, device=mesh.device_type)
        return DTensor(local, spec, requires_grad=False)

    returns = entry.op._schema.returns
    specs = list(decision.output_specs) + [None] * max(0, len(returns) - len(decision.output_specs))
    if len(returns) == 1 and isinstance(returns[0].type, torch.ListType):
        return [empty(spec) for spec in specs if spec is not None]
    results = [
        empty(spec) if spec is not None else (True if str(ret.type) == "bool" else None)
        for spec, ret in zip(specs, returns)
    ]
    return results[0] if len(returns) == 1 else tuple(results)


def returns_tensors(entry: OpEntry) -> bool:
    return any("Tensor" in str(ret.type) for ret in entry.op._schema.returns)


def refuse_write_into_copied_view(entry: OpEntry, call: UnwrappedCall) -> None:
    if call.positions[0] == 0 and call.leaves[0]._copied_view:
        raise RuntimeError(
            f"{entry.op} writes into a view of a DTensor that had to be redistributed (or conjugated) to make "
            f"the view, so the write would not reach the original ({call.leaves[0]._spec}); write into the "
            "original tensor, or call .clone() on the view first if it is meant to be a copy"
        )


def replicate_plain_tensors(
    entry: OpEntry, leaves: list[Any], shape: tuple[Any, ...], kwarg_names: list[str]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Plain (non 0-d) tensors become replicated DTensors where that is known to be safe.

    Inside backward they come from autograd's own formulas (``zeros``, ``ones``), which are the
    same on every rank; elsewhere only inside ``implicit_replication()``, or when they hold one
    element (``torch.tensor([1.0])``), which torch reads as a scalar just like a 0-d tensor.
    """
    mesh = next(a._spec.mesh for a in leaves if isinstance(a, DTensor))
    replicate = (Replicate(),) * mesh.ndim
    leaves = list(leaves)
    for i, a in enumerate(leaves):
        if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) and a.ndim != 0:
            if type(a) is not torch.Tensor:  # torch's DTensor must not pass for a plain tensor
                refuse_torch_object(a, f"{entry.op} (an operand beside spmd's DTensors)")
            if a.numel() != 1 and not plain_tensors_allowed():
                # Not TypeError: Python would turn that into "unsupported operand" for `x + t`.
                raise RuntimeError(
                    f"{entry.op} got a plain torch.Tensor of shape {list(a.shape)} mixed with DTensors; "
                    "convert it with distribute_tensor(t, mesh, placements) or DTensor.from_local first, "
                    "or wrap the call in spmd.tensor.dispatch.implicit_replication() if every rank holds "
                    "the same tensor"
                )
            leaves[i] = DTensor(a, DTensorSpec(mesh, replicate, TensorMeta.of(a)), requires_grad=False)
    args, kwargs = unflatten_call(leaves, shape, kwarg_names)
    return tuple(args), kwargs


def dispatch_out(entry: OpEntry, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``op(..., out=o)``: run the functional op on DTensors, then copy into ``o`` in its own layout."""
    assert entry.out_variant is not None
    functional, out_names = entry.out_variant
    outs = [kwargs[name] for name in out_names]
    rest = {k: v for k, v in kwargs.items() if k not in out_names}
    result = functional(*args, **rest)
    results = result if isinstance(result, (tuple, list)) else (result,)
    for out, value in zip(outs, results):
        if not isinstance(out, DTensor):
            raise RuntimeError(f"{entry.op}: out= must be a DTensor when the inputs are DTensors")
        if tuple(out.shape) != tuple(value.shape) or out.dtype != value.dtype:
            raise RuntimeError(
                f"{entry.op}: out= has shape {list(out.shape)} and dtype {out.dtype}, the result {list(value.shape)} "
                f"and {value.dtype}; DTensor out= tensors are not resized, so pass one of the result's shape"
            )
        out.copy_(value)  # the result is laid out as ``out`` (copy_ keeps self's placement)
    return outs[0] if len(outs) == 1 else tuple(outs)


def reshape_self(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], spec: DTensorSpec | None) -> None:
    """After an in-place view (``squeeze_``, ``t_``) of the local shard, self takes the new spec and
    its wrapper's sizes and strides follow (torch's helper reruns the op on the metadata only)."""
    target: DTensor = args[0]
    assert spec is not None
    target._spec = spec
    return_and_correct_aliasing(op, args, kwargs, target)  # type: ignore[no-untyped-call]


def finish_fallback(result: Any, decision: Decision, args: tuple[Any, ...], local_args: list[Any], mesh: Any) -> Any:
    """Wrap a fallback's whole-tensor results as Replicate; an in-place op writes back into self."""
    replicate = (Replicate(),) * mesh.ndim
    if decision.inplace:
        target: DTensor = args[0]
        full_spec = target._spec.with_placements(replicate)
        piece = redistribute_local(local_args[0], full_spec, target._spec.placements)
        target._local_tensor.copy_(piece)
        return target

    def one(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        return DTensor(value, DTensorSpec(mesh, replicate, TensorMeta.of(value)), requires_grad=False)

    if isinstance(result, (tuple, list)):
        return type(result)(one(r) for r in result)
    return one(result)
