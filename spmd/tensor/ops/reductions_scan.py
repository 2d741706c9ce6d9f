"""Scans: every output element depends on the elements before it along the scanned dim.

  cumsum, cumprod, logcumsumexp, cummax, cummin (dim d):
      S(e), e != d -> S(e);  R -> R;  S(d) must be replicated first (a shard does not see its prefix)
  cumsum: also P(sum|avg) -> same P (a prefix sum of partial sums is a partial prefix sum)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spmd.tensor.ops.common import LINEAR_PARTIALS, R, normalize_dim
from spmd.tensor.ops.registry import OpCall, OpStrategy, register_rule
from spmd.tensor.placement import Shard

aten = torch.ops.aten


def scan_candidates(call: OpCall, *, num_outputs: int = 1) -> list[OpStrategy]:
    """R -> R; S(e) -> S(e) for every dim but the scanned one (values and indices alike)."""
    ndim = call.input_specs[0].ndim
    scanned = normalize_dim(int(call.arg(1, "dim")), ndim)
    candidates = [OpStrategy((R,), (R,) * num_outputs)]
    candidates += [OpStrategy((Shard(e),), (Shard(e),) * num_outputs) for e in range(ndim) if e != scanned]
    return candidates


@register_rule(aten.cumsum.default, aten.cumsum_.default)
def cumsum_rule(call: OpCall) -> Sequence[OpStrategy]:
    """cumsum(d): S(e) -> S(e) for e != d; R -> R; P(sum|avg) -> P (linear)."""
    return scan_candidates(call) + [OpStrategy((p,), (p,)) for p in LINEAR_PARTIALS]


@register_rule(aten.cumprod.default, aten.cumprod_.default, aten.logcumsumexp.default)
def nonlinear_scan_rule(call: OpCall) -> Sequence[OpStrategy]:
    """cumprod, logcumsumexp (d): S(e) -> S(e) for e != d; R -> R; a partial is reduced first."""
    return scan_candidates(call)


@register_rule(aten.cummax.default, aten.cummin.default)
def indexed_scan_rule(call: OpCall) -> Sequence[OpStrategy]:
    """cummax, cummin (d) -> (values, indices): S(e) -> S(e) for e != d; R -> R."""
    return scan_candidates(call, num_outputs=2)
