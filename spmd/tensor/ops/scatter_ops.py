"""Writes by position: select_scatter, slice_scatter, index_copy, index_fill, index_reduce,
scatter_reduce, put, masked_scatter; and take, put's reading twin.

Each output element is either self's or one chosen from src, never a mix of several ranks' values,
so a partial passes through when self and src are partial alike (the choice is the same on every
rank); a reduction into a position (index_reduce, scatter_reduce, put with accumulate) keeps only the
partials its reduction is linear in. Positions are looked up, so the written dim is whole:
  select_scatter(dim):         S(d) x S(d') -> S(d) for d != dim (d' drops dim);  P x P -> P
  slice_scatter(dim):          S(d) x S(d) -> S(d) for d != dim;  P x P -> P
  index_copy(dim, i, src):     S(d) x R x S(d) -> S(d) for d != dim;  P x R x P -> P
  index_fill(dim, i, value):   S(d) x R -> S(d) for d != dim;  P x R -> P (sum only for value 0)
  index_reduce, scatter_reduce(reduce): as index_copy / scatter (equal sizes on d);  P x R x P -> P for
                               mean: sum|avg, amax: max, amin: min, sum: sum|avg, prod: none;
                               scatter_reduce sum|amax|amin with include_self: P x S(dim) x S(dim) -> P
  take(i):                     R x S(d) -> S(d) (flat positions: self is whole);  P x R -> P
  put(i, src, accumulate):     R x R x R -> R;  P x R x P -> P (accumulate: sum|avg);
                               accumulate: P(sum) x S(d) x S(d) -> P(sum) (each rank adds its part)
  masked_scatter(mask, src):   R only (src is consumed in global order);  P x R x P -> P;
                               masked_scatter_backward(grad, mask, sizes): R x R -> R;  P x R -> P
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from spmd.tensor.ops.common import LINEAR_PARTIALS, PARTIALS, R, normalize_dim
from spmd.tensor.placement import Partial, Placement, Shard
from spmd.tensor.sharding.registry import register_rule
from spmd.tensor.sharding.vocabulary import OpCall, OpStrategy
from spmd.tensor.spec import DTensorSpec

aten = torch.ops.aten
SUM = Partial("sum")


def _given(args: Sequence[Any], placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """The placements of those ``args`` that are DTensors (a plain 0-d tensor or a number takes none)."""
    return tuple(p for a, p in zip(args, placements) if isinstance(a, DTensorSpec))


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(value.shape) if isinstance(value, (DTensorSpec, torch.Tensor)) else ()


def _same_size_dims(dim: int, self_shape: tuple[int, ...], *others: tuple[int, ...]) -> list[int]:
    """Dims other than ``dim`` where every tensor has self's number of dims and self's size."""
    return [
        d for d in range(len(self_shape))
        if d != dim and all(len(o) == len(self_shape) and o[d] == self_shape[d] for o in others)
    ]


def _reduce_partials(reduce: str) -> tuple[Partial, ...]:
    """Partials a per-position reduction is linear in: sum and mean add, amax/amin keep their extreme."""
    if reduce in ("sum", "mean"):
        return LINEAR_PARTIALS
    if reduce in ("amax", "amin"):
        return (Partial("max" if reduce == "amax" else "min"),)
    return ()


@register_rule(aten.select_scatter.default)
def select_scatter_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) x S(d') -> S(d) for d != dim (src lacks dim); R x R -> R; P x P -> P."""
    args = (call.arg(0, "self"), call.arg(1, "src"))
    ndim = len(_shape(args[0]))
    dim = normalize_dim(call.arg(2, "dim"), ndim)
    candidates = [OpStrategy(_given(args, (R, R)), (R,))]
    candidates += [
        OpStrategy(_given(args, (Shard(d), Shard(d - (d > dim)))), (Shard(d),)) for d in range(ndim) if d != dim
    ]
    return candidates + [OpStrategy(_given(args, (p, p)), (p,)) for p in PARTIALS]


@register_rule(aten.slice_scatter.default)
def slice_scatter_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) x S(d) -> S(d) for d != dim; R x R -> R; P x P -> P."""
    args = (call.arg(0, "self"), call.arg(1, "src"))
    shape = _shape(args[0])
    dim = normalize_dim(call.arg(2, "dim", 0), len(shape))
    candidates = [OpStrategy(_given(args, (R, R)), (R,))]
    candidates += [OpStrategy(_given(args, (Shard(d), Shard(d))), (Shard(d),)) for d in _same_size_dims(dim, shape)]
    return candidates + [OpStrategy(_given(args, (p, p)), (p,)) for p in PARTIALS]


def _index_write_candidates(call: OpCall, partials: Sequence[Partial]) -> list[OpStrategy]:
    """index_copy / index_reduce: (self, dim, index, source); the indexed dim is whole."""
    args = (call.arg(0, "self"), call.arg(2, "index"), call.arg(3, "source"))
    shape = _shape(args[0])
    dim = normalize_dim(call.arg(1, "dim"), len(shape))
    candidates = [OpStrategy(_given(args, (R, R, R)), (R,))]
    candidates += [
        OpStrategy(_given(args, (Shard(d), R, Shard(d))), (Shard(d),))
        for d in _same_size_dims(dim, shape, _shape(args[2]))
    ]
    return candidates + [OpStrategy(_given(args, (p, R, p)), (p,)) for p in partials]


@register_rule(aten.index_copy.default, aten.index_copy_.default)
def index_copy_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) x R x S(d) -> S(d) for d != dim;  P x R x P -> P (each position copies one value)."""
    return _index_write_candidates(call, PARTIALS)


@register_rule(aten.index_reduce.default, aten.index_reduce_.default)
def index_reduce_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) x R x S(d) -> S(d) for d != dim;  P x R x P -> P where the reduction is linear in P."""
    return _index_write_candidates(call, _reduce_partials(str(call.arg(4, "reduce"))))


@register_rule(aten.index_fill.int_Scalar, aten.index_fill_.int_Scalar, aten.index_fill.int_Tensor,
               aten.index_fill_.int_Tensor)
def index_fill_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) x R -> S(d) for d != dim;  P x R -> P (sum only for a constant 0)."""
    value = call.arg(3, "value")
    args = (call.arg(0, "self"), call.arg(2, "index"), value)
    ndim = len(_shape(args[0]))
    dim = normalize_dim(call.arg(1, "dim"), ndim)
    candidates = [OpStrategy(_given(args, (R, R, R)), (R,))]
    candidates += [OpStrategy(_given(args, (Shard(d), R, R)), (Shard(d),)) for d in range(ndim) if d != dim]
    # a tensor value is not known here (decisions are cached by its dtype), so it is never taken as 0
    zero = isinstance(value, (bool, int, float)) and value == 0
    partials = [p for p in PARTIALS if zero or p.reduce_op != "sum"]
    return candidates + [OpStrategy(_given(args, (p, R, R)), (p,)) for p in partials]


@register_rule(aten.scatter_reduce.two, aten.scatter_reduce_.two)
def scatter_reduce_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d)^3 -> S(d) for d != dim (equal sizes);  P x R x P -> P where linear;  sum|amax|amin with
    include_self: P x S(dim) x S(dim) -> P (each rank reduces its part of src into its partial)."""
    args = (call.arg(0, "self"), call.arg(2, "index"), call.arg(3, "src"))
    if not all(isinstance(a, DTensorSpec) and a.ndim > 0 for a in args):
        return [OpStrategy(_given(args, (R, R, R)), (R,))]
    shape, index_shape, src_shape = (_shape(a) for a in args)
    dim = normalize_dim(call.arg(1, "dim"), len(shape))
    reduce = str(call.arg(4, "reduce"))
    candidates = [OpStrategy((R, R, R), (R,))]
    candidates += [
        OpStrategy((Shard(d),) * 3, (Shard(d),)) for d in _same_size_dims(dim, shape, index_shape, src_shape)
    ]
    partials = _reduce_partials(reduce)
    candidates += [OpStrategy((p, R, p), (p,)) for p in partials]
    include_self = bool(call.kwargs.get("include_self", True))
    if reduce in ("sum", "amax", "amin") and include_self and index_shape[dim] == src_shape[dim]:
        candidates.append(OpStrategy((partials[0], Shard(dim), Shard(dim)), (partials[0],)))
    return candidates


@register_rule(aten.take.default)
def take_rule(call: OpCall) -> Sequence[OpStrategy]:
    """R x S(d) -> S(d) (the result has the index's shape; self is looked up flat);  P x R -> P."""
    args = (call.arg(0, "self"), call.arg(1, "index"))
    candidates = [OpStrategy(_given(args, (R, R)), (R,))]
    if isinstance(args[1], DTensorSpec):
        candidates += [OpStrategy(_given(args, (R, Shard(d))), (Shard(d),)) for d in range(args[1].ndim)]
    return candidates + [OpStrategy(_given(args, (p, R)), (p,)) for p in PARTIALS]


@register_rule(aten.put.default, aten.put_.default)
def put_rule(call: OpCall) -> Sequence[OpStrategy]:
    """R x R x R -> R;  P x R x P -> P (accumulate: sum|avg);  accumulate: P(sum) x S(d) x S(d) -> P(sum)."""
    args = (call.arg(0, "self"), call.arg(1, "index"), call.arg(2, "source"))
    accumulate = bool(call.arg(3, "accumulate", False))
    candidates = [OpStrategy(_given(args, (R, R, R)), (R,))]
    candidates += [OpStrategy(_given(args, (p, R, p)), (p,)) for p in (LINEAR_PARTIALS if accumulate else PARTIALS)]
    index, source = args[1], args[2]
    if accumulate and isinstance(index, DTensorSpec) and isinstance(source, DTensorSpec) and index.shape == source.shape:
        candidates += [OpStrategy((SUM, Shard(d), Shard(d)), (SUM,)) for d in range(index.ndim)]
    return candidates


@register_rule(aten.masked_scatter.default, aten.masked_scatter_.default, aten.masked_scatter_backward.default)
def masked_scatter_rule(call: OpCall) -> Sequence[OpStrategy]:
    """R x R x R -> R (source is read in the mask's global order);  P x R x P -> P; the backward
    (grad, mask) -> the source's gradient likewise."""
    args = (call.arg(0, "self"), call.arg(1, "mask"), call.arg(2, "source"))
    candidates = [OpStrategy(_given(args, (R, R, R)), (R,))]
    return candidates + [OpStrategy(_given(args, (p, R, p)), (p,)) for p in PARTIALS]
