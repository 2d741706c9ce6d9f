"""Indexing: slice, select, index_select, advanced indexing, gather, scatter, where, masked_fill,
and the backward ops autograd emits for them (slice_backward, select_backward, index_add,
index_put, scatter_add).

Index tensors carry positions, so they are never partial. A dim that is looked up by position
must be whole on the rank (replicated); the other dims keep their shards when every tensor that
shares the dim is sharded on it the same way:
  slice(dim), select(dim),
  narrow_copy(dim):             S(d) -> S(d') for d != dim (select drops dim: d' = d - (d > dim));
                                a full slice (step 1, nothing cut) keeps S(dim); P -> P
  slice_backward, select_backward: the same, read from the gradient's side; P -> P (zero padding)
  index_select(dim, i):         S(d) x R -> S(d) for d != dim;  R x S(0) -> S(dim);  P x R -> P
  index_add(dim, i, src):       S(d) x R x S(d) -> S(d);  P x R x P -> P;
                                P(sum) x S(0) x S(dim) -> P(sum) (each rank adds its part)
  index(self, [i, ...]):        S(d) x R -> S(d') for d not indexed;  R x S(k) -> S(k') when the
                                index tensors need no broadcasting;  P x R -> P
  index_put(self, [i], v):      S(d) x R x S(d') -> S(d);  P x R x P -> P (written or added, the
                                result is linear in self and v together);  accumulate:
                                P(sum) x S(k) x S(k') -> P(sum)
  gather(dim, i):               S(d) x S(d) -> S(d) for d != dim (equal sizes);  R x S(dim) -> S(dim);
                                P x R -> P;  S(dim) x R -> P(sum) when i is 1 long on dim (each rank
                                gathers the positions it holds, zeros elsewhere)
  scatter(dim, i, src|value):   S(d) x S(d) [x S(d)] -> S(d) for d != dim (equal sizes);
                                value: P x R -> P (sum only for value 0)
  scatter_add(dim, i, src):     as scatter, and P x R x P -> P, P(sum) x S(dim) x S(dim) -> P(sum)
  where(c, a, b), masked_fill:  pointwise with broadcasting; where: R x P x P -> P (sum only when
                                both branches are DTensors); masked_fill: P x R -> P (sum only for
                                a fill value of 0)
  item (_local_scalar_dense):   R -> a Python number (the element is gathered or reduced first)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from spmd.compile.compiling import compiling_here
from spmd.tensor.ops.common import LINEAR_PARTIALS, PARTIALS, R, normalize_dim, pointwise_candidates
from spmd.tensor.ops.views import local_view_size  # slice/select_backward: input_sizes is global
from spmd.tensor.placement import Partial, Placement, Shard
from spmd.tensor.sharding.registry import register_rule
from spmd.tensor.sharding.vocabulary import OpCall, OpStrategy
from spmd.tensor.spec import DTensorSpec, local_shape_and_offset

aten = torch.ops.aten
SUM = Partial("sum")


def _constant_fill_partials(value: Any) -> tuple[Partial, ...]:
    """Partials a constant written on every rank survives: n copies of c add to c only when c == 0."""
    zero = isinstance(value, (bool, int, float)) and value == 0
    return PARTIALS if zero else tuple(p for p in PARTIALS if p.reduce_op != "sum")


# ----- slice and select ------------------------------------------------------------------------------
def _slice_keeps_dim(size_in: int, size_out: int, step: Any) -> bool:
    """A slice that keeps every element (step 1, nothing cut) is the identity on that dim."""
    return size_in == size_out and (step is None or step == 1)


@register_rule(aten.slice.Tensor)
def slice_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) -> S(d) for d != dim, and for dim itself when nothing is cut; R -> R; P -> P."""
    spec = call.input_specs[0]
    meta = call.output_metas[0]
    assert meta is not None
    dim = normalize_dim(call.arg(1, "dim", 0), spec.ndim)
    keep = [d for d in range(spec.ndim) if d != dim]
    if _slice_keeps_dim(spec.shape[dim], meta.shape[dim], call.arg(4, "step", 1)):
        keep.append(dim)
    candidates = [OpStrategy((R,), (R,))]
    candidates += [OpStrategy((Shard(d),), (Shard(d),)) for d in keep]
    return candidates + [OpStrategy((p,), (p,)) for p in PARTIALS]


@register_rule(aten.narrow_copy.default)
def narrow_copy_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) -> S(d) for d != dim (start and length are global, so dim itself is whole); R -> R; P -> P."""
    ndim = call.input_specs[0].ndim
    dim = normalize_dim(call.arg(1, "dim"), ndim)
    candidates = [OpStrategy((R,), (R,))]
    candidates += [OpStrategy((Shard(d),), (Shard(d),)) for d in range(ndim) if d != dim]
    return candidates + [OpStrategy((p,), (p,)) for p in PARTIALS]


@register_rule(aten.slice_backward.default, local_args=local_view_size)
def slice_backward_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) -> S(d) for d != dim (and dim when nothing was cut); P -> P (the padding is zero)."""
    spec = call.input_specs[0]
    input_sizes = list(call.arg(1, "input_sizes"))
    dim = normalize_dim(call.arg(2, "dim"), spec.ndim)
    keep = [d for d in range(spec.ndim) if d != dim]
    if _slice_keeps_dim(input_sizes[dim], spec.shape[dim], call.arg(5, "step", 1)):
        keep.append(dim)
    candidates = [OpStrategy((R,), (R,))]
    candidates += [OpStrategy((Shard(d),), (Shard(d),)) for d in keep]
    return candidates + [OpStrategy((p,), (p,)) for p in PARTIALS]


@register_rule(aten.select.int)
def select_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) -> S(d) for d < dim, S(d - 1) for d > dim; the selected dim is replicated first; P -> P."""
    ndim = call.input_specs[0].ndim
    dim = normalize_dim(call.arg(1, "dim"), ndim)
    candidates = [OpStrategy((R,), (R,))]
    candidates += [OpStrategy((Shard(d),), (Shard(d if d < dim else d - 1),)) for d in range(ndim) if d != dim]
    return candidates + [OpStrategy((p,), (p,)) for p in PARTIALS]


@register_rule(aten.select_backward.default, local_args=local_view_size)
def select_backward_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) -> S(d) for d < dim, S(d + 1) from dim on; R -> R; P -> P (the padding is zero)."""
    ndim = call.input_specs[0].ndim
    dim = normalize_dim(call.arg(2, "dim"), ndim + 1)
    candidates = [OpStrategy((R,), (R,))]
    candidates += [OpStrategy((Shard(d),), (Shard(d if d < dim else d + 1),)) for d in range(ndim)]
    return candidates + [OpStrategy((p,), (p,)) for p in PARTIALS]


# ----- index_select and index_add --------------------------------------------------------------------
def _pick(args: Sequence[Any], placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """The placements of those ``args`` that are DTensors (a plain 0-d tensor takes none)."""
    return tuple(p for a, p in zip(args, placements) if isinstance(a, DTensorSpec))


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(value.shape) if isinstance(value, (DTensorSpec, torch.Tensor)) else ()


def _dtype(value: Any) -> torch.dtype:
    return value.tensor_meta.dtype if isinstance(value, DTensorSpec) else value.dtype


def _replicate_all(call: OpCall) -> list[OpStrategy]:
    return [OpStrategy((R,) * len(call.input_specs), (R,))]


@register_rule(aten.index_select.default)
def index_select_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) x R -> S(d) for d != dim;  R x S(0) -> S(dim);  P x R -> P."""
    args = (call.arg(0, "self"), call.arg(2, "index"))
    if not isinstance(args[0], DTensorSpec):
        return _replicate_all(call)
    ndim = args[0].ndim
    dim = normalize_dim(call.arg(1, "dim"), ndim)
    candidates = [OpStrategy(_pick(args, (R, R)), (R,))]
    candidates += [OpStrategy(_pick(args, (Shard(d), R)), (Shard(d),)) for d in range(ndim) if d != dim]
    if len(_shape(args[1])) == 1 and ndim > 0 and isinstance(args[1], DTensorSpec):
        candidates.append(OpStrategy((R, Shard(0)), (Shard(dim),)))
    return candidates + [OpStrategy(_pick(args, (p, R)), (p,)) for p in PARTIALS]


@register_rule(aten.index_add.default, aten.index_add_.default)
def index_add_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) x R x S(d) -> S(d) for d != dim;  P x R x P -> P;  P(sum) x S(0) x S(dim) -> P(sum)."""
    args = (call.arg(0, "self"), call.arg(2, "index"), call.arg(3, "source"))
    if not isinstance(args[0], DTensorSpec) or not isinstance(args[2], DTensorSpec) or args[0].ndim == 0:
        return _replicate_all(call)
    ndim = args[0].ndim
    dim = normalize_dim(call.arg(1, "dim"), ndim)
    candidates = [OpStrategy(_pick(args, (R, R, R)), (R,))]
    candidates += [OpStrategy(_pick(args, (Shard(d), R, Shard(d))), (Shard(d),)) for d in range(ndim) if d != dim]
    candidates += [OpStrategy(_pick(args, (p, R, p)), (p,)) for p in LINEAR_PARTIALS]
    if isinstance(args[1], DTensorSpec) and args[1].ndim == 1:
        candidates.append(OpStrategy((SUM, Shard(0), Shard(dim)), (SUM,)))
    return candidates


# ----- advanced indexing -----------------------------------------------------------------------------
def _broadcast_shape(shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    """The shape the index tensors broadcast to (the meta run has already checked they do)."""
    width = max(len(s) for s in shapes)
    result = []
    for k in range(width):
        sizes = {s[k - width + len(s)] for s in shapes if k - width + len(s) >= 0} - {1}
        result.append(sizes.pop() if sizes else 1)
    return tuple(result)


def _index_layout(ndim: int, indices: Sequence[Any]) -> tuple[dict[int, int], int, tuple[int, ...]] | None:
    """Where advanced indexing puts things: ``({self dim not indexed: result dim}, first index
    result dim, broadcast index shape)``; None when an index is a mask (its shape depends on data)."""
    given = [ix for ix in indices if ix is not None]
    if not given or any(_dtype(ix) in (torch.bool, torch.uint8) for ix in given):
        return None
    indexed = [k for k, ix in enumerate(indices) if ix is not None]
    shape = _broadcast_shape([_shape(ix) for ix in given])
    width = len(shape)
    adjacent = indexed == list(range(indexed[0], indexed[-1] + 1))
    others = [d for d in range(ndim) if d not in indexed]
    if adjacent:
        start = indexed[0]
        out_dim = {d: d if d < start else d - len(indexed) + width for d in others}
    else:
        start = 0
        out_dim = {d: width + i for i, d in enumerate(others)}
    return out_dim, start, shape


def _index_args(indices: Sequence[Any], index_placement: Placement) -> tuple[Placement, ...]:
    """One placement per index tensor that is a DTensor."""
    return tuple(index_placement for ix in indices if isinstance(ix, DTensorSpec))


def _indices_fill_shape(indices: Sequence[Any], shape: tuple[int, ...]) -> bool:
    """Every DTensor index has the broadcast shape, so sharding them alike lines them up."""
    return all(_shape(ix) == shape for ix in indices if isinstance(ix, DTensorSpec))


@register_rule(aten.index.Tensor)
def index_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) x R -> S(d') for a dim not indexed;  R x S(k) -> S(start + k) (no broadcasting);  P x R -> P."""
    spec = call.arg(0, "self")
    indices = list(call.arg(1, "indices"))
    if not isinstance(spec, DTensorSpec):
        return _replicate_all(call)
    rest = _index_args(indices, R)
    candidates = [OpStrategy((R, *rest), (R,))]
    layout = _index_layout(spec.ndim, indices)
    if layout is None:
        return candidates
    out_dim, start, shape = layout
    candidates += [OpStrategy((Shard(d), *rest), (Shard(o),)) for d, o in out_dim.items()]
    if rest and _indices_fill_shape(indices, shape):
        candidates += [
            OpStrategy((R, *_index_args(indices, Shard(k))), (Shard(start + k),)) for k in range(len(shape))
        ]
    return candidates + [OpStrategy((p, *rest), (p,)) for p in PARTIALS]


def _values_dim(values_shape: Sequence[int], result_shape: Sequence[int], result_dim: int) -> int | None:
    """The dim of ``values`` that fills ``result_dim`` of the indexing result, None if broadcast."""
    v = result_dim - (len(result_shape) - len(values_shape))
    if v < 0 or (values_shape[v] == 1 and result_shape[result_dim] != 1):
        return None
    return v


@register_rule(aten.index_put.default, aten.index_put_.default)
def index_put_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) x R x S(d') -> S(d) for d not indexed; P x R x P -> P; accumulate: P(sum) x S(k) x S(k') -> P(sum)."""
    spec = call.arg(0, "self")
    indices = list(call.arg(1, "indices"))
    values = call.arg(2, "values")
    if not isinstance(spec, DTensorSpec):
        return _replicate_all(call)
    values_is_dtensor = isinstance(values, DTensorSpec)
    values_shape = _shape(values)

    def inputs(self_p: Placement, index_p: Placement, values_p: Placement) -> tuple[Placement, ...]:
        return (self_p, *_index_args(indices, index_p), *((values_p,) if values_is_dtensor else ()))

    candidates = [OpStrategy(inputs(R, R, R), (R,))]
    layout = _index_layout(spec.ndim, indices)
    if layout is None:
        return candidates
    out_dim, start, shape = layout
    result_shape = [0] * (len(out_dim) + len(shape))
    for d, o in out_dim.items():
        result_shape[o] = spec.shape[d]
    result_shape[start : start + len(shape)] = shape

    def values_placement(result_dim: int) -> Placement:
        v = _values_dim(values_shape, result_shape, result_dim)
        return R if v is None else Shard(v)

    candidates += [OpStrategy(inputs(Shard(d), R, values_placement(o)), (Shard(d),)) for d, o in out_dim.items()]
    if not values_is_dtensor:
        return candidates
    # Linear in (self, values) together, written or added: the ranks' results add up to the whole one.
    candidates += [OpStrategy(inputs(p, R, p), (p,)) for p in LINEAR_PARTIALS]
    # Added (not written): each rank adds the values of its index positions; the sums make the whole.
    if bool(call.arg(3, "accumulate", False)) and _index_args(indices, R) and _indices_fill_shape(indices, shape):
        candidates += [
            OpStrategy(inputs(SUM, Shard(k), values_placement(start + k)), (SUM,)) for k in range(len(shape))
        ]
    return candidates


# ----- gather and scatter ----------------------------------------------------------------------------
def _aligned_dims(dim: int, *shapes: tuple[int, ...]) -> list[int]:
    """Dims other than ``dim`` on which all ``shapes`` agree (so their shards line up)."""
    return [d for d in range(len(shapes[0])) if d != dim and len({s[d] for s in shapes}) == 1]


def _gather_scatter_args(call: OpCall, *names: tuple[int, str]) -> tuple[Any, ...] | None:
    """The tensor arguments, or None when one is not a DTensor or is 0-d (then only R is offered)."""
    args = tuple(call.arg(i, name) for i, name in names)
    if not all(isinstance(a, DTensorSpec) and a.ndim > 0 for a in args):
        return None
    return args


def _masked_gather(
    op: Any, args: list[Any], kwargs: dict[str, Any], inputs: tuple[DTensorSpec, ...], outputs: tuple[Any, ...]
) -> torch.Tensor:
    """gather from a shard of the gathered dim: each rank answers the positions its rows hold and
    writes zeros elsewhere, so the ranks' results add up to the whole gather (P(sum))."""
    spec = inputs[0]
    local, index = args[0], args[2]
    dim = normalize_dim(args[1], spec.ndim)
    if not any(isinstance(p, Shard) and p.dim == dim for p in spec.placements):
        return op(*args, **kwargs)
    size = spec.shape[dim]
    # Plain torch raises for a position outside the dim; the masked lookup would give zeros. Every
    # rank holds the same (replicated) index, so all of them raise and none waits in a collective.
    if index.numel() and not index.is_meta and not compiling_here():
        low, high = torch.stack(torch.aminmax(index)).tolist()
        if low < 0 or high >= size:
            raise RuntimeError(
                f"gather: index {low if low < 0 else high} is out of bounds for dimension {dim} with size {size}"
            )
    _, offset = local_shape_and_offset(spec.shape, spec.mesh, spec.placements)
    start, rows = offset[dim], local.shape[dim]
    if rows == 0:
        return local.new_zeros(index.shape)
    held = (index >= start) & (index < start + rows)
    found = op(local, dim, torch.where(held, index - start, 0), *args[3:], **kwargs)
    return found.masked_fill(~held, 0)


@register_rule(aten.gather.default, local_impl=_masked_gather)
def gather_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) x S(d) -> S(d) for d != dim (equal sizes);  R x S(dim) -> S(dim);  P x R -> P;
    S(dim) x R -> P(sum) when the index is 1 long on dim (a masked local gather, as torch does)."""
    args = _gather_scatter_args(call, (0, "self"), (2, "index"))
    if args is None:
        return _replicate_all(call)
    spec, index = args
    dim = normalize_dim(call.arg(1, "dim"), spec.ndim)
    candidates = [OpStrategy((R, R), (R,))]
    candidates += [OpStrategy((Shard(d), Shard(d)), (Shard(d),)) for d in _aligned_dims(dim, spec.shape, index.shape)]
    candidates.append(OpStrategy((R, Shard(dim)), (Shard(dim),)))
    if index.shape[dim] == 1 and spec.tensor_meta.dtype != torch.bool:
        candidates.append(OpStrategy((Shard(dim), R), (SUM,)))
    return candidates + [OpStrategy((p, R), (p,)) for p in PARTIALS]


@register_rule(aten.scatter.src, aten.scatter_.src)
def scatter_src_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) x S(d) x S(d) -> S(d) for d != dim (equal sizes); R x R x R -> R."""
    args = _gather_scatter_args(call, (0, "self"), (2, "index"), (3, "src"))
    if args is None:
        return _replicate_all(call)
    dim = normalize_dim(call.arg(1, "dim"), args[0].ndim)
    candidates = [OpStrategy((R, R, R), (R,))]
    return candidates + [
        OpStrategy((Shard(d),) * 3, (Shard(d),)) for d in _aligned_dims(dim, *(a.shape for a in args))
    ]


@register_rule(aten.scatter.value, aten.scatter_.value)
def scatter_value_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) x S(d) -> S(d) for d != dim (equal sizes); P x R -> P (sum only when the value is 0)."""
    args = _gather_scatter_args(call, (0, "self"), (2, "index"))
    if args is None:
        return _replicate_all(call)
    spec, index = args
    dim = normalize_dim(call.arg(1, "dim"), spec.ndim)
    candidates = [OpStrategy((R, R), (R,))]
    candidates += [OpStrategy((Shard(d),) * 2, (Shard(d),)) for d in _aligned_dims(dim, spec.shape, index.shape)]
    return candidates + [OpStrategy((p, R), (p,)) for p in _constant_fill_partials(call.arg(3, "value"))]


@register_rule(aten.scatter_add.default, aten.scatter_add_.default)
def scatter_add_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d)^3 -> S(d) for d != dim (equal sizes);  P x R x P -> P;  P(sum) x S(dim) x S(dim) -> P(sum)."""
    args = _gather_scatter_args(call, (0, "self"), (2, "index"), (3, "src"))
    if args is None:
        return _replicate_all(call)
    spec, index, src = args
    dim = normalize_dim(call.arg(1, "dim"), spec.ndim)
    candidates = [OpStrategy((R, R, R), (R,))]
    candidates += [
        OpStrategy((Shard(d),) * 3, (Shard(d),)) for d in _aligned_dims(dim, spec.shape, index.shape, src.shape)
    ]
    candidates += [OpStrategy((p, R, p), (p,)) for p in LINEAR_PARTIALS]
    if index.shape[dim] == src.shape[dim]:
        candidates.append(OpStrategy((SUM, Shard(dim), Shard(dim)), (SUM,)))
    return candidates


# ----- where and masked_fill -------------------------------------------------------------------------
@register_rule(aten.where.self)
def where_rule(call: OpCall) -> Sequence[OpStrategy]:
    """Pointwise over (condition, a, b);  R x P x P -> P (sum only when a and b are both DTensors)."""
    candidates = pointwise_candidates(call)
    is_dtensor = [isinstance(call.arg(i, name), DTensorSpec) for i, name in enumerate(("condition", "self", "other"))]
    if not any(is_dtensor[1:]):
        return candidates
    partials = PARTIALS if all(is_dtensor[1:]) else tuple(p for p in PARTIALS if p.reduce_op != "sum")
    for p in partials:
        inputs: list[Placement] = [p for flag in is_dtensor[1:] if flag]
        if is_dtensor[0]:
            inputs.insert(0, R)
        candidates.append(OpStrategy(tuple(inputs), (p,)))
    return candidates


@register_rule(aten.masked_fill.Scalar, aten.masked_fill_.Scalar, aten.masked_fill.Tensor, aten.masked_fill_.Tensor)
def masked_fill_rule(call: OpCall) -> Sequence[OpStrategy]:
    """Pointwise over (self, mask);  P x R -> P (sum only for a fill value of 0)."""
    candidates = pointwise_candidates(call)
    if not isinstance(call.arg(0, "self"), DTensorSpec):
        return candidates
    value = call.arg(2, "value")
    # A tensor value is not known here (the decision is cached by its dtype only), so never P(sum).
    partials = _constant_fill_partials(None if isinstance(value, (torch.Tensor, DTensorSpec)) else value)
    rest = (R,) * (len(call.input_specs) - 1)
    return candidates + [OpStrategy((p, *rest), (p,)) for p in partials]


# ----- item ------------------------------------------------------------------------------------------
@register_rule(aten._local_scalar_dense.default)
def item_rule(call: OpCall) -> Sequence[OpStrategy]:
    """item(): R -> a Python number; the one element is made whole (gathered or reduced) first."""
    return [OpStrategy((R,) * len(call.input_specs), ())]
