"""Elementwise ops whose operands share one layout run on the local pieces, ``_StridedShard`` included.

An elementwise op computes entry by entry, so when every tensor operand is laid out alike (one
mesh, the same placements and global shape; 0-d operands replicated) each rank's piece of the
result is the op on its own pieces, whatever the layout, a ``_StridedShard`` one too, and the
result keeps that layout. torch's DTensor carries a ``_StridedShard`` through pointwise ops the
same way. Without this the dispatcher gathers every strided operand first: an optimizer step on
FSDP2-over-TP parameters (``(_StridedShard(0), Shard(0))``) would all-gather each parameter,
gradient and moment, and ``zeros_like`` would create the optimizer state whole over dp.

Only calls with a ``_StridedShard`` operand come here (``Dispatcher.run_strided``); the others keep
the rules' path.
"""

from __future__ import annotations

from typing import Any

import torch

from spmd.tensor.dtensor import DTensor
from spmd.tensor.placement import Partial, Replicate
from spmd.tensor.sharding.call import list_entries, unflatten_call
from spmd.tensor.sharding.entry import OpEntry
from spmd.tensor.spec import DTensorSpec
from spmd.tensor.trace import STATE, log_line

__all__ = ["NOT_LOCAL", "is_elementwise", "run_elementwise_local"]

aten = torch.ops.aten

NOT_LOCAL = object()
"""``run_elementwise_local``'s answer when the call does not qualify (the caller gathers instead)."""

_ALSO_ELEMENTWISE = frozenset({
    aten.copy_.default, aten.zero_.default, aten.fill_.Scalar, aten.fill_.Tensor,
    # their result is laid out as their input and holds no values that depend on the position
    aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default,
})  # fmt: skip
"""Elementwise ops that aten does not tag ``pointwise``."""

_LIST_ELEMENTWISE = frozenset({"_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_", "_foreach_copy_"})
"""List ops that work entry by entry though their element op's packet says nothing (or more)."""

_elementwise_cache: dict[Any, bool] = {}


def _is_elementwise_op(op: Any) -> bool:
    """Pointwise by aten's tag (or listed above), and not drawing random numbers (those follow spmd's RNG)."""
    if op in _ALSO_ELEMENTWISE:
        return True
    tags = op.tags
    return torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags


def is_elementwise(op: Any) -> bool:
    """Whether ``op`` (an aten overload, a ``_foreach_*`` or fused optimizer list op too) works entry by entry."""
    known = _elementwise_cache.get(op)
    if known is not None:
        return known
    name = op._schema.name.removeprefix("aten::")
    if name in _LIST_ELEMENTWISE:
        answer = True
    elif name.startswith("_foreach_"):
        # elementwise when every tensor overload of its element op is (``_foreach_max`` is a reduction,
        # though ``max.other`` is pointwise); Python-number and ``out=`` overloads say nothing
        packet = getattr(aten, name.removeprefix("_foreach_"), None)
        overloads = [getattr(packet, o) for o in packet.overloads() if "out" not in o] if packet is not None else []
        overloads = [o for o in overloads if any(isinstance(a.type, torch.TensorType) for a in o._schema.arguments)]
        answer = bool(overloads) and all(_is_elementwise_op(o) for o in overloads)
    else:
        answer = _is_elementwise_op(op)
    _elementwise_cache[op] = answer
    return answer


def _same_layout(a: DTensorSpec, b: DTensorSpec) -> bool:
    return a.mesh == b.mesh and a.placements == b.placements and a.shape == b.shape


def _groups(leaves: list[Any], shape: tuple[Any, ...]) -> list[list[int]] | None:
    """The leaves that one element call combines: all of them, or for a list op each list position's
    entries; a lone argument (not a list) joins none. None: lists of different lengths."""
    if not shape or not any(list_entries(shape, len(leaves))):
        return [list(range(len(leaves)))]
    lists: list[range] = []
    start = 0
    for entry in shape:
        length = entry if isinstance(entry, int) else entry[1] if isinstance(entry, tuple) else -1
        if length >= 0:
            lists.append(range(start, start + length))
        start += length if length >= 0 else 1  # a list: its entries; else one leaf
    lengths = {len(r) for r in lists if len(r)}
    if len(lengths) > 1:
        return None
    count = lengths.pop() if lengths else 0
    return [[r[i] for r in lists if len(r)] for i in range(count)]


def _common_specs(leaves: list[Any], shape: tuple[Any, ...]) -> list[DTensorSpec] | None:
    """Each group's shared spec, or None when some group's operands are not laid out alike."""
    groups = _groups(leaves, shape)
    if groups is None:
        return None
    grouped = {i for g in groups for i in g}
    mesh = None
    specs: list[DTensorSpec] = []
    for group in groups:
        common: DTensorSpec | None = None
        for i in group:
            a = leaves[i]
            if not isinstance(a, torch.Tensor):
                continue
            if a.ndim == 0:
                if not _is_scalar(a, None):
                    return None
                continue
            if not isinstance(a, DTensor):
                return None  # a plain tensor next to DTensors: the regular path decides (or refuses)
            spec = a._spec
            if common is None:
                common = spec
            elif not _same_layout(common, spec):
                return None
        if common is None or any(isinstance(p, Partial) for p in common.placements):
            return None
        if mesh is None:
            mesh = common.mesh
        elif common.mesh != mesh:
            return None
        specs.append(common)
    # an argument outside the groups (a fused optimizer's grad_scale) must be a scalar
    if any(i not in grouped and isinstance(a, torch.Tensor) and not _is_scalar(a, mesh) for i, a in enumerate(leaves)):
        return None
    return specs


def _is_scalar(a: torch.Tensor, mesh: Any) -> bool:
    """A 0-d plain tensor, or a 0-d DTensor replicated (on ``mesh`` unless None): every rank holds its value."""
    if a.ndim != 0:
        return False
    if not isinstance(a, DTensor):
        return True
    return (mesh is None or a._spec.mesh == mesh) and all(isinstance(p, Replicate) for p in a._spec.placements)


def run_elementwise_local(entry: OpEntry, leaves: list[Any], shape: tuple[Any, ...], kwarg_names: list[str]) -> Any:
    """The elementwise call run on the local pieces, its results in the operands' layout; ``NOT_LOCAL``
    when the op is not elementwise or its operands are not laid out alike."""
    op = entry.op
    if not is_elementwise(op):
        return NOT_LOCAL
    specs = _common_specs(leaves, shape)
    if specs is None:
        return NOT_LOCAL
    if entry.inplace and isinstance(leaves[0], DTensor) and leaves[0]._copied_view:
        return NOT_LOCAL  # the regular path explains why writing into it fails
    if STATE.verbose:
        log_line("%-30s on the local pieces (elementwise, operands laid out alike: %s)", op, specs[0])
    local = [a._local_tensor if isinstance(a, DTensor) else a for a in leaves]
    owners = {id(loc): a for loc, a in zip(local, leaves) if isinstance(a, DTensor)}
    local_args, local_kwargs = unflatten_call(local, shape, kwarg_names)
    result = op(*local_args, **local_kwargs)

    def wrapped(value: Any, spec: DTensorSpec) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        owner = owners.get(id(value))  # an in-place op returns its self
        if owner is not None:
            return owner
        return DTensor(value, spec.with_dtype(value.dtype), requires_grad=False)

    if isinstance(result, (list, tuple)):
        if len(specs) == len(result):  # a list op: output i is position i's
            return type(result)(wrapped(v, s) for v, s in zip(result, specs))
        return type(result)(wrapped(v, specs[0]) for v in result)
    return wrapped(result, specs[0])
