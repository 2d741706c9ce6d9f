"""Shape ops that keep every element where it is: view, reshape, flatten, unflatten, squeeze, unsqueeze.

Input and output shapes are cut into groups: runs of dims whose sizes multiply to the same number
(size-1 dims are left out, they hold no shard). For a group whose first input dim is d and first
output dim is o:
  S(d) -> S(o)  when d and o have the same size (the dim survives the view unchanged);
  S(d) -> S(o)  when both sizes divide by the number of pieces d is cut into (flatten / unflatten:
                each rank's block is then one contiguous run of the group, exactly the block S(o)
                gives it; see ``surviving_shards``);
  S(d) -> S(o)  for a 1-long d and a 1-long o (the first rank holds everything either way);
  any other sharded dim is replicated first.  R -> R;  P -> P (a view moves no value).
  squeeze:  S(d) -> S(d') unless d is a squeezed dim some rank could hold a 1-long piece of (the
            local squeeze would drop it); d' = d less the removed dims before it.
  squeeze_, unsqueeze_: the same rules; self keeps its data and takes the output's spec.
  view(dtype): S(d) -> S(d); with another itemsize the last dim changes size and stays S only when
            both sizes divide by the mesh size; partials are reduced (reinterpreted bits do not add).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from spmd.tensor.ops.common import PARTIALS, R, normalize_dim, surviving_shards
from spmd.tensor.placement import Shard
from spmd.tensor.sharding.registry import register_rule
from spmd.tensor.sharding.vocabulary import OpCall, OpStrategy
from spmd.tensor.spec import DTensorSpec, local_shape_and_offset

__all__ = ["view_groups", "view_shard_map", "local_view_size", "local_view_args", "never_one_long"]

aten = torch.ops.aten


def view_groups(in_shape: Sequence[int], out_shape: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Smallest runs of input and output dims with equal products: ``[(input dims, output dims)]``.

    ``(2, 3, 4) -> (6, 4)`` gives ``[([0, 1], [0]), ([2], [1])]``; size-1 dims appear in no group.
    Both shapes must have the same non-zero number of elements.
    """
    ins = [d for d, s in enumerate(in_shape) if s != 1]
    outs = [o for o, s in enumerate(out_shape) if s != 1]
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(ins) and j < len(outs):
        group_in, group_out = [ins[i]], [outs[j]]
        in_product, out_product = in_shape[ins[i]], out_shape[outs[j]]
        i, j = i + 1, j + 1
        while in_product != out_product:
            if in_product < out_product:
                group_in.append(ins[i])
                in_product *= in_shape[ins[i]]
                i += 1
            else:
                group_out.append(outs[j])
                out_product *= out_shape[outs[j]]
                j += 1
        groups.append((group_in, group_out))
    return groups


def view_shard_map(spec: DTensorSpec, out_shape: Sequence[int]) -> dict[int, int]:
    """Input dims whose shard survives the view: ``{input dim: output dim}`` (see the module doc)."""
    in_shape = spec.shape
    if math.prod(in_shape) == 0:
        return {}
    leaders = {group_in[0]: group_out[0] for group_in, group_out in view_groups(in_shape, out_shape)}

    def keeps(d: int, cuts: tuple[int, ...]) -> bool:
        o, pieces = leaders[d], math.prod(cuts)
        return in_shape[d] == out_shape[o] or (in_shape[d] % pieces == 0 and out_shape[o] % pieces == 0)

    kept = {d: leaders[d] for d in sorted(surviving_shards([spec], leaders, keeps, partials_stay=True))}
    return kept | _one_long_shard_map(in_shape, out_shape)


def _one_long_shard_map(in_shape: Sequence[int], out_shape: Sequence[int]) -> dict[int, int]:
    """Input dims of size 1 -> an output dim of size 1: ``{input dim: output dim}``.

    A shard of a 1-long dim is the whole tensor on the first rank and nothing on the others, and so
    is a shard of any 1-long output dim; the one at the same flat position is preferred (the dim
    the view keeps), else the first.
    """
    ones_out = [o for o, size in enumerate(out_shape) if size == 1]
    if not ones_out:
        return {}
    out_before = {o: math.prod(out_shape[:o]) for o in ones_out}
    mapping = {}
    for d, size in enumerate(in_shape):
        if size == 1:
            before = math.prod(in_shape[:d])
            mapping[d] = next((o for o in ones_out if out_before[o] == before), ones_out[0])
    return mapping


def local_view_size(
    args: list[Any], kwargs: dict[str, Any], decision: Any, out_spec: DTensorSpec
) -> tuple[list[Any], dict[str, Any]]:
    """A view's size argument is global (``-1`` allowed); the local call needs this rank's output shape."""
    local_shape, _ = local_shape_and_offset(out_spec.shape, out_spec.mesh, out_spec.placements)
    return [args[0], list(local_shape), *args[2:]], kwargs


def local_view_args(
    args: list[Any], kwargs: dict[str, Any], decision: Any, out_spec: DTensorSpec
) -> tuple[list[Any], dict[str, Any]]:
    """``local_view_size``, and a contiguous copy of the local input if it cannot be viewed so.

    A rank's piece may be laid out differently from the global tensor (a gather along a later dim
    fills its buffer in another order), so a view that is legal globally can need a copy locally.
    """
    args, kwargs = local_view_size(args, kwargs, decision, out_spec)
    local = args[0]
    try:
        local.view(args[1])
    except RuntimeError:
        args[0] = local.contiguous()
    return args, kwargs


@register_rule(
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.view_copy.default,
    local_args=local_view_args,
)
def view_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) -> S(o) for a dim that survives, or leads a flatten/unflatten group evenly; R -> R; P -> P."""
    spec = call.input_specs[0]
    meta = call.output_metas[0]
    assert meta is not None
    mapping = view_shard_map(spec, meta.shape)
    candidates = [OpStrategy((R,), (R,))]
    candidates += [OpStrategy((Shard(d),), (Shard(o),)) for d, o in mapping.items()]
    candidates += [OpStrategy((p,), (p,)) for p in PARTIALS]
    return candidates


@register_rule(aten.unsqueeze.default, aten.unsqueeze_.default, aten.unsqueeze_copy.default)
def unsqueeze_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) -> S(d) before the new dim, S(d + 1) from it on; R -> R; P -> P."""
    ndim = call.input_specs[0].ndim
    new = normalize_dim(call.arg(1, "dim"), ndim + 1)
    candidates = [OpStrategy((R,), (R,))]
    candidates += [OpStrategy((Shard(d),), (Shard(d if d < new else d + 1),)) for d in range(ndim)]
    candidates += [OpStrategy((p,), (p,)) for p in PARTIALS]
    return candidates


def never_one_long(size: int, mesh_size: int) -> bool:
    """No rank's piece of a dim of ``size`` is 1 long, however the mesh dims cut it (conservative)."""
    return size % mesh_size == 0 and size // mesh_size != 1


@register_rule(
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze_.default,
    aten.squeeze_.dim,
    aten.squeeze_.dims,
    aten.squeeze_copy.default,
    aten.squeeze_copy.dim,
    aten.squeeze_copy.dims,
)
def squeeze_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) -> S(d less removed dims before it); a named dim of size > 1 keeps S only if no piece is 1 long."""
    spec = call.input_specs[0]
    shape = spec.shape
    dims_arg = call.arg(1, "dim", None)
    if call.op in (aten.squeeze.default, aten.squeeze_.default, aten.squeeze_copy.default):
        named = set(range(len(shape)))
    elif isinstance(dims_arg, (list, tuple)):
        named = {normalize_dim(int(d), len(shape)) for d in dims_arg}
    else:
        named = {normalize_dim(int(dims_arg), len(shape))}
    removed = [d for d in named if d < len(shape) and shape[d] == 1]
    kept = surviving_shards(
        [spec],
        [d for d, size in enumerate(shape) if size != 1],
        lambda d, cuts: d not in named or never_one_long(shape[d], math.prod(cuts)),
        partials_stay=True,
    )
    candidates = [OpStrategy((R,), (R,))]
    candidates += [OpStrategy((Shard(d),), (Shard(d - sum(1 for r in removed if r < d)),)) for d in sorted(kept)]
    candidates += [OpStrategy((p,), (p,)) for p in PARTIALS]
    return candidates


@register_rule(aten.view.dtype, aten.view_copy.dtype)
def view_dtype_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) -> S(d); a last dim whose size changes (other itemsize) stays S only if both sizes divide
    by the mesh size; R -> R; partials are reduced first (reinterpreted bits do not add)."""
    spec = call.input_specs[0]
    meta = call.output_metas[0]
    assert meta is not None

    def keeps(d: int, cuts: tuple[int, ...]) -> bool:
        pieces = math.prod(cuts)
        return spec.shape[d] == meta.shape[d] or (spec.shape[d] % pieces == 0 and meta.shape[d] % pieces == 0)

    kept = surviving_shards([spec], range(spec.ndim), keeps)
    candidates = [OpStrategy((R,), (R,))]
    candidates += [OpStrategy((Shard(d),), (Shard(d),)) for d in sorted(kept)]
    return candidates
