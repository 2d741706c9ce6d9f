"""Reductions. Reducing a sharded dim leaves a pending partial where the local results combine into
the global one; where they do not, the dim is replicated first. Kept dims keep their shards.

  every reduction:     S(d), d kept -> S(d') (d' = d less the dropped dims before it);  R -> R
  sum, nansum:         S(d), d reduced -> P(sum)
  count_nonzero:       S(d), d reduced -> P(sum) (an empty shard counts 0); a partial is reduced first
  mean:                S(d), d reduced -> P(avg), only when d's size divides by the mesh size
  amax, max():         S(d), d reduced -> P(max) (no shard empty);  amin, min() -> P(min)
  aminmax:             S(d), d reduced -> P(min), P(max)
  all, any:            S(d), d reduced -> P(min), P(max) (and / or on bools; an empty shard is neutral)
  vector norm:         ord 1 and 0 -> P(sum); inf -> P(max); -inf -> P(min); any other finite ord p
                       runs as other ops: sum(|x|^p) -> P(sum) -> reduced -> pow(1/p) (the local power
                       sums add up; only the small result is all-reduced, as _foreach_norm does)
  prod, var, std, logsumexp, max.dim, min.dim, argmax, argmin: a reduced dim is replicated first
  partial inputs:      sum and mean are linear: P(sum|avg) -> same P; the others reduce a partial first
  expand (the backward of every reduction): S(d) -> S(d + new leading dims) unless d is broadcast; P -> P
"""

from __future__ import annotations

import functools
import math
from collections.abc import Collection, Sequence
from typing import Any

import torch

from spmd.tensor.ops.common import LINEAR_PARTIALS, PARTIALS, R, normalize_dim, pointwise_candidates
from spmd.tensor.ops.views import local_view_size
from spmd.tensor.placement import Partial, Shard, shard_sizes
from spmd.tensor.sharding.registry import register_rule
from spmd.tensor.sharding.vocabulary import Expansion, OpCall, OpStrategy
from spmd.tensor.spec import DTensorSpec

aten = torch.ops.aten
SUM, AVG, MAX, MIN = Partial("sum"), Partial("avg"), Partial("max"), Partial("min")


def reduced_dims(call: OpCall, dims_arg: Any, ndim: int) -> list[int]:
    """The dims a reduction removes: all of them when ``dims_arg`` is None or empty."""
    if dims_arg is None or (isinstance(dims_arg, (list, tuple)) and len(dims_arg) == 0):
        return list(range(ndim))
    dims = dims_arg if isinstance(dims_arg, (list, tuple)) else [dims_arg]
    checked = sorted({normalize_dim(int(d), ndim) for d in dims})
    return checked if ndim else []  # a 0-d tensor accepts dim 0 or -1 but has no dim to reduce


def reduction_candidates(
    ndim: int,
    dims: list[int],
    keepdim: bool,
    partial: Partial | None,
    *,
    partial_dims: Collection[int] | None = None,
    num_outputs: int = 1,
) -> list[OpStrategy]:
    """R -> R; S(d) kept -> S(d'); S(d) reduced -> ``partial`` (None: the reduced dim must be whole).

    ``partial_dims`` limits the reduced dims that may stay sharded (default: all of them); every
    output of a multi-output reduction (values and indices) gets the same placement.
    """
    allowed = dims if partial_dims is None else partial_dims
    candidates = [OpStrategy((R,), (R,) * num_outputs)]
    for d in range(ndim):
        if d in dims:
            if partial is not None and d in allowed:
                candidates.append(OpStrategy((Shard(d),), (partial,) * num_outputs))
        else:
            out_dim = d if keepdim else d - sum(1 for r in dims if r < d)
            candidates.append(OpStrategy((Shard(d),), (Shard(out_dim),) * num_outputs))
    return candidates


def schema_arg(call: OpCall, name: str, default: Any = None) -> Any:
    """Argument ``name`` of the call, wherever the op's schema puts it (positional or keyword-only)."""
    for index, argument in enumerate(call.op._schema.arguments):
        if argument.name == name:
            return call.arg(index, name, default)
    return default


def reduction_args(call: OpCall) -> tuple[int, list[int], bool]:
    """(input ndim, reduced dims, keepdim) of a reduction call; overloads without ``dim`` reduce all."""
    ndim = call.input_specs[0].ndim
    dims = reduced_dims(call, schema_arg(call, "dim"), ndim)
    return ndim, dims, bool(schema_arg(call, "keepdim", False))


def shards_never_empty(spec: DTensorSpec, dim: int) -> bool:
    """True when no rank's piece of ``dim`` can be empty, whichever mesh dims end up sharding it.

    max/min of an empty shard is an error, not the reduction's identity, so P(max) needs this.
    """
    sizes = {spec.shape[dim]}
    for n in spec.mesh.shape:
        sizes |= {piece for size in sizes for piece in shard_sizes(size, n)}
    return min(sizes) > 0


def shards_even(spec: DTensorSpec, dim: int) -> bool:
    """True when every rank's piece of ``dim`` has the same size however the mesh shards it."""
    return spec.shape[dim] % spec.mesh.size() == 0


@register_rule(aten.sum.default, aten.sum.dim_IntList)
def sum_rule(call: OpCall) -> Sequence[OpStrategy]:
    """sum: S(d) reduced -> P(sum); S(d) kept -> S(d'); R -> R; P(sum|avg) -> P."""
    ndim, dims, keepdim = reduction_args(call)
    candidates = reduction_candidates(ndim, dims, keepdim, SUM)
    return candidates + [OpStrategy((p,), (p,)) for p in LINEAR_PARTIALS]


@register_rule(aten.nansum.default)
def nansum_rule(call: OpCall) -> Sequence[OpStrategy]:
    """nansum: S(d) reduced -> P(sum); a partial is reduced first (NaN in one piece is not NaN in all)."""
    ndim, dims, keepdim = reduction_args(call)
    return reduction_candidates(ndim, dims, keepdim, SUM)


@register_rule(aten.count_nonzero.default, aten.count_nonzero.dim_IntList)
def count_nonzero_rule(call: OpCall) -> Sequence[OpStrategy]:
    """count_nonzero: S(d) reduced -> P(sum); S(d) kept -> S(d'); R -> R (a sum's zeros are no piece's zeros)."""
    ndim, dims, keepdim = reduction_args(call)
    return reduction_candidates(ndim, dims, keepdim, SUM)


@register_rule(aten.mean.default, aten.mean.dim)
def mean_rule(call: OpCall) -> Sequence[OpStrategy]:
    """mean: S(d) reduced -> P(avg) if the shards are even; S(d) kept -> S(d'); R -> R; P(sum|avg) -> P."""
    ndim, dims, keepdim = reduction_args(call)
    spec = call.input_specs[0]
    even = [d for d in dims if shards_even(spec, d)]
    candidates = reduction_candidates(ndim, dims, keepdim, AVG, partial_dims=even)
    return candidates + [OpStrategy((p,), (p,)) for p in LINEAR_PARTIALS]


@register_rule(aten.amax.default, aten.max.default)
def amax_rule(call: OpCall) -> Sequence[OpStrategy]:
    """amax, max(): S(d) reduced -> P(max) when no shard is empty; S(d) kept -> S(d'); R -> R."""
    return _extremum_candidates(call, MAX)


@register_rule(aten.amin.default, aten.min.default)
def amin_rule(call: OpCall) -> Sequence[OpStrategy]:
    """amin, min(): S(d) reduced -> P(min) when no shard is empty; S(d) kept -> S(d'); R -> R."""
    return _extremum_candidates(call, MIN)


def _extremum_candidates(call: OpCall, partial: Partial) -> list[OpStrategy]:
    ndim, dims, keepdim = reduction_args(call)
    spec = call.input_specs[0]
    nonempty = [d for d in dims if shards_never_empty(spec, d)]
    return reduction_candidates(ndim, dims, keepdim, partial, partial_dims=nonempty)


@register_rule(aten.aminmax.default)
def aminmax_rule(call: OpCall) -> Sequence[OpStrategy]:
    """aminmax: S(d) reduced -> (P(min), P(max)) when no shard is empty; S(d) kept -> S(d'); R -> R."""
    ndim, dims, keepdim = reduction_args(call)
    spec = call.input_specs[0]
    candidates = reduction_candidates(ndim, dims, keepdim, None, num_outputs=2)
    candidates += [
        OpStrategy((Shard(d),), (MIN, MAX)) for d in dims if shards_never_empty(spec, d)
    ]
    return candidates


@register_rule(aten.all.default, aten.all.dim, aten.all.dims)
def all_rule(call: OpCall) -> Sequence[OpStrategy]:
    """all: S(d) reduced -> P(min) (the and of the pieces); S(d) kept -> S(d'); R -> R."""
    ndim, dims, keepdim = reduction_args(call)
    return reduction_candidates(ndim, dims, keepdim, MIN)


@register_rule(aten.any.default, aten.any.dim, aten.any.dims)
def any_rule(call: OpCall) -> Sequence[OpStrategy]:
    """any: S(d) reduced -> P(max) (the or of the pieces); S(d) kept -> S(d'); R -> R."""
    ndim, dims, keepdim = reduction_args(call)
    return reduction_candidates(ndim, dims, keepdim, MAX)


@register_rule(
    aten.prod.default,
    aten.prod.dim_int,
    aten.logsumexp.default,
    aten.var.correction,
    aten.std.correction,
    aten.argmax.default,
    aten.argmin.default,
)
def whole_dim_reduction_rule(call: OpCall) -> Sequence[OpStrategy]:
    """prod, logsumexp, var, std, argmax, argmin: S(d) reduced -> replicate d first; S(d) kept -> S(d')."""
    ndim, dims, keepdim = reduction_args(call)
    return reduction_candidates(ndim, dims, keepdim, None)


@register_rule(aten.max.dim, aten.min.dim, aten.var_mean.correction, aten.std_mean.correction)
def two_output_reduction_rule(call: OpCall) -> Sequence[OpStrategy]:
    """max.dim, min.dim (values, indices), var_mean, std_mean: S(d) reduced -> replicate d; S(d) kept -> S(d')."""
    ndim, dims, keepdim = reduction_args(call)
    return reduction_candidates(ndim, dims, keepdim, None, num_outputs=2)


def _norm_partial(ord_value: Any) -> Partial | None:
    """The partial that combines local vector norms of order ``ord_value``, if a plain one does."""
    order = 2.0 if ord_value is None else float(ord_value)
    if order in (0.0, 1.0):  # a count of non-zeros, a sum of |x|
        return SUM
    if order == math.inf:
        return MAX
    if order == -math.inf:
        return MIN
    return None  # (sum |x|^p)^(1/p) is no reduction of the local norms


def power_sum_order(ord_value: Any) -> float | None:
    """p, when a p-norm of sharded data is ``(sum of |x|^p) ** (1/p)`` with the sums taken shard by shard.

    That holds for every finite p; None for the orders whose local norms combine as a plain partial
    (0, 1: P(sum); +-inf: P(max), P(min)) and for NaN.
    """
    order = 2.0 if ord_value is None else float(ord_value)
    if _norm_partial(order) is not None or math.isnan(order):
        return None
    return order


def sharded_on(spec: DTensorSpec, dims: Collection[int]) -> bool:
    """True when a mesh dim of more than one rank shards one of tensor ``dims``."""
    return any(
        isinstance(p, Shard) and p.dim in dims and size > 1 for p, size in zip(spec.placements, spec.mesh.shape)
    )


def _norm_order(call: OpCall) -> Any:
    return schema_arg(call, "ord", 2) if "linalg" in call.op._schema.name else schema_arg(call, "p", 2)


def vector_norm_decomposition(call: OpCall) -> Expansion | None:
    """A finite p-norm (p not 0 or 1) over a sharded dim runs as power sums (see ``power_sum_order``)."""
    p = power_sum_order(_norm_order(call))
    _, dims, keepdim = reduction_args(call)
    if p is None or not sharded_on(call.input_specs[0], dims):
        return None
    out = call.output_metas[0]
    dtype = schema_arg(call, "dtype")
    out_dtype = dtype if out is None else out.dtype
    return functools.partial(_norm_from_power_sums, p=p, dims=dims, keepdim=keepdim, dtype=dtype, out_dtype=out_dtype)


def _norm_from_power_sums(
    op: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    p: float,
    dims: list[int],
    keepdim: bool,
    dtype: torch.dtype | None,
    out_dtype: torch.dtype | None,
) -> Any:
    """sum(|x|^p) over ``dims`` (S(d) -> P(sum), no data moves), all-reduced (the small result), pow(1/p)."""
    x = args[0]
    if dtype is None and x.dtype in (torch.float16, torch.bfloat16):
        dtype = torch.float32  # |x|^p of a half would overflow where the norm does not; torch's kernel widens too
    if dtype is not None and x.dtype != dtype:
        x = aten._to_copy.default(x, dtype=dtype)
    power_sums = aten.sum.dim_IntList(aten.pow.Tensor_Scalar(aten.abs.default(x), p), dims, keepdim)
    # Reduced to Replicate, as a norm is: a kept dim of size 1 would otherwise be reduce-scattered.
    whole = [R if isinstance(placement, Partial) else placement for placement in power_sums.placements]
    norm = aten.pow.Tensor_Scalar(power_sums.redistribute(power_sums.device_mesh, whole), 1.0 / p)
    return norm if out_dtype is None or norm.dtype == out_dtype else aten._to_copy.default(norm, dtype=out_dtype)


@register_rule(
    aten.linalg_vector_norm.default,
    aten.norm.Scalar,
    aten.norm.ScalarOpt_dim,
    aten.norm.ScalarOpt_dtype,
    aten.norm.ScalarOpt_dim_dtype,
    decompose=vector_norm_decomposition,
)
def vector_norm_rule(call: OpCall) -> Sequence[OpStrategy]:
    """norm: S(d) reduced -> P(sum) for ord 0, 1; P(max) for inf; P(min) for -inf; else replicate d.

    Other finite ords on a sharded dim do not get here: ``vector_norm_decomposition`` runs them.
    """
    ndim, dims, keepdim = reduction_args(call)
    partial = _norm_partial(_norm_order(call))
    spec = call.input_specs[0]
    allowed = dims if partial is None or partial.is_linear else [d for d in dims if shards_never_empty(spec, d)]
    return reduction_candidates(ndim, dims, keepdim, partial, partial_dims=allowed)


@register_rule(aten.expand.default, aten.expand_copy.default, local_args=local_view_size)
def expand_rule(call: OpCall) -> Sequence[OpStrategy]:
    """expand: S(d) -> S(d + new leading dims) where d keeps its size; a broadcast dim must be R; P -> P."""
    return pointwise_candidates(call) + [OpStrategy((p,), (p,)) for p in PARTIALS]
