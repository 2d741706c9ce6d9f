"""Sorting and order statistics: the dim being ordered must be whole on every rank; other dims
keep their shards, and the values and indices outputs share one placement.

  sort, topk (dim):                   S(e), e != dim -> S(e), S(e);  R -> R, R
  kthvalue, median.dim, nanmedian.dim, mode (dim, keepdim):
                                      S(e), e != dim -> S(e') (e' = e less one if e > dim and not keepdim)
  median(), nanmedian() (all dims):   R -> R only (the input is gathered first)
  partial inputs are reduced first: the order of a sum is no sum of orders.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spmd.tensor.ops.common import R, normalize_dim
from spmd.tensor.ops.reductions import reduction_candidates, schema_arg
from spmd.tensor.placement import Shard
from spmd.tensor.sharding.registry import register_rule
from spmd.tensor.sharding.vocabulary import OpCall, OpStrategy

aten = torch.ops.aten


def ordered_dim(call: OpCall) -> int:
    """The dim the op orders along (``dim`` of the schema, -1 by default), in ``[0, ndim)``."""
    return normalize_dim(int(schema_arg(call, "dim", -1)), call.input_specs[0].ndim)


@register_rule(aten.sort.default, aten.sort.stable, aten.topk.default)
def sort_rule(call: OpCall) -> Sequence[OpStrategy]:
    """sort, topk (dim): S(e) -> S(e), S(e) for e != dim; R -> R, R; the sorted dim must be whole."""
    ndim = call.input_specs[0].ndim
    dim = ordered_dim(call)
    candidates = [OpStrategy((R,), (R, R))]
    candidates += [OpStrategy((Shard(e),), (Shard(e), Shard(e))) for e in range(ndim) if e != dim]
    return candidates


@register_rule(aten.kthvalue.default, aten.median.dim, aten.nanmedian.dim, aten.mode.default)
def order_statistic_rule(call: OpCall) -> Sequence[OpStrategy]:
    """kthvalue, median, nanmedian, mode (dim): S(e) -> S(e'), S(e') for e != dim; R -> R, R."""
    ndim = call.input_specs[0].ndim
    dims = [ordered_dim(call)] if ndim else []
    keepdim = bool(schema_arg(call, "keepdim", False))
    return reduction_candidates(ndim, dims, keepdim, None, num_outputs=2)


@register_rule(aten.median.default, aten.nanmedian.default)
def whole_median_rule(call: OpCall) -> Sequence[OpStrategy]:
    """median(), nanmedian(): R -> R; the median of all elements needs them all."""
    return [OpStrategy((R,), (R,))]
