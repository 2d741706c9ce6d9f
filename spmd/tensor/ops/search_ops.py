"""Searching and counting against a second tensor: each element of the searched tensor is looked up
on its own, so its shards stay; the tensor searched in must be whole.

  isin(elements, test_elements):           S(d) x R -> S(d); R x R -> R
  bucketize(x, boundaries):                S(d) x R -> S(d)
  searchsorted(sorted, x):                 1-d sorted: R x S(d) -> S(d); n-d sorted (one sorted row
                                           per leading index): S(d) x S(d) -> S(d) for a leading dim d
  histc(x, bins, min, max):                S(d) -> P(sum) with an explicit range (each rank counts its
                                           elements); with min == max the range is the data's, so R
  partial inputs are reduced first: a lookup of a sum is no sum of lookups.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spmd.tensor.ops.common import R
from spmd.tensor.ops.reductions import schema_arg
from spmd.tensor.placement import Partial, Placement, Shard
from spmd.tensor.sharding.registry import register_rule
from spmd.tensor.sharding.vocabulary import OpCall, OpStrategy
from spmd.tensor.spec import DTensorSpec

aten = torch.ops.aten
SUM = Partial("sum")


def _lookups(searched: DTensorSpec | None, n_specs: int, searched_index: int) -> list[OpStrategy]:
    """The searched tensor S(d) (or R), every other tensor R -> the result S(d) (or R)."""

    def inputs(p: Placement) -> tuple[Placement, ...]:
        return tuple(p if i == searched_index else R for i in range(n_specs))

    candidates = [OpStrategy(inputs(R), (R,))]
    if searched is not None:
        candidates += [OpStrategy(inputs(Shard(d)), (Shard(d),)) for d in range(searched.ndim)]
    return candidates


def _searched(call: OpCall, name: str) -> tuple[DTensorSpec | None, int]:
    """The spec of argument ``name`` and its index among the call's DTensors (None when it is a scalar)."""
    value = schema_arg(call, name)
    if not isinstance(value, DTensorSpec):
        return None, -1
    return value, call.input_specs.index(value)


@register_rule(aten.isin.Tensor_Tensor, aten.isin.Tensor_Scalar, aten.isin.Scalar_Tensor)
def isin_rule(call: OpCall) -> Sequence[OpStrategy]:
    """isin: elements S(d), test_elements R -> S(d)."""
    searched, index = _searched(call, "elements")
    return _lookups(searched, len(call.input_specs), index)


@register_rule(aten.bucketize.Tensor, aten.bucketize.Scalar)
def bucketize_rule(call: OpCall) -> Sequence[OpStrategy]:
    """bucketize: x S(d), boundaries R -> S(d)."""
    searched, index = _searched(call, "self")
    return _lookups(searched, len(call.input_specs), index)


@register_rule(aten.searchsorted.Tensor, aten.searchsorted.Scalar)
def searchsorted_rule(call: OpCall) -> Sequence[OpStrategy]:
    """searchsorted(sorted, x): 1-d sorted R, x S(d) -> S(d); n-d: both S(d) for a leading dim d."""
    sorted_spec = call.input_specs[0]
    x, index = _searched(call, "self")
    n = len(call.input_specs)  # a sorter, when given, is laid out like sorted
    if sorted_spec.ndim == 1:
        candidates = _lookups(x, n, index)
        return [c for c in candidates if all(p == R for i, p in enumerate(c.inputs) if i != index)]
    candidates = [OpStrategy((R,) * n, (R,))]
    if x is not None:
        candidates += [OpStrategy((Shard(d),) * n, (Shard(d),)) for d in range(sorted_spec.ndim - 1)]
    return candidates


@register_rule(aten.histc.default)
def histc_rule(call: OpCall) -> Sequence[OpStrategy]:
    """histc: S(d) -> P(sum) when the range is given (min != max); R -> R."""
    x = call.input_specs[0]
    low, high = schema_arg(call, "min", 0), schema_arg(call, "max", 0)
    candidates = [OpStrategy((R,), (R,))]
    if low != high:  # otherwise the range is the data's own min and max, which no piece knows
        candidates += [OpStrategy((Shard(d),), (SUM,)) for d in range(x.ndim)]
    return candidates
