"""Reductions. Reducing a sharded dim leaves a pending partial; other dims keep their shards.

  sum(dims):  S(d), d reduced -> P(sum);  S(d), d kept -> S(d') (d' = d less the dropped dims
              before it);  R -> R;  P(sum|avg) -> same P (a sum of partial sums is a partial sum)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from spmd.tensor.ops.common import LINEAR_PARTIALS, R, normalize_dim
from spmd.tensor.ops.registry import OpCall, OpStrategy, register_rule
from spmd.tensor.placement import Partial, Placement, Shard

aten = torch.ops.aten


def reduced_dims(call: OpCall, dims_arg: Any, ndim: int) -> list[int]:
    """The dims a reduction removes: all of them when ``dims_arg`` is None or empty."""
    if dims_arg is None or (isinstance(dims_arg, (list, tuple)) and len(dims_arg) == 0):
        return list(range(ndim))
    dims = dims_arg if isinstance(dims_arg, (list, tuple)) else [dims_arg]
    return sorted({normalize_dim(int(d), ndim) for d in dims})


def reduction_candidates(ndim: int, dims: list[int], keepdim: bool, partial: Partial) -> list[OpStrategy]:
    candidates = [OpStrategy((R,), (R,))]
    for d in range(ndim):
        if d in dims:
            candidates.append(OpStrategy((Shard(d),), (partial,)))
        else:
            out_dim = d if keepdim else d - sum(1 for r in dims if r < d)
            candidates.append(OpStrategy((Shard(d),), (Shard(out_dim),)))
    return candidates


@register_rule(aten.sum.default, aten.sum.dim_IntList)
def sum_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) reduced -> P(sum); S(d) kept -> S(d'); R -> R; P(sum|avg) -> P."""
    ndim = call.input_specs[0].ndim
    dims = reduced_dims(call, call.arg(1, "dim"), ndim)
    keepdim = bool(call.arg(2, "keepdim", False))
    candidates = reduction_candidates(ndim, dims, keepdim, Partial("sum"))
    placements: list[Placement] = list(LINEAR_PARTIALS)
    return candidates + [OpStrategy((p,), (p,)) for p in placements]
