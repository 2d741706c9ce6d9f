"""Scans: every output element depends on the elements before it along the scanned dim.

  cumsum, cumprod, logcumsumexp, cummax, cummin (dim d):
      S(e), e != d -> S(e);  R -> R;  S(d) must be replicated first (a shard does not see its prefix)
  cumsum: also P(sum|avg) -> same P (a prefix sum of partial sums is a partial prefix sum)
  cumsum, cumprod, logcumsumexp over a sharded d run as other ops instead, keeping d sharded:
      each rank scans its piece, the pieces' totals (one number per piece and row: a small tensor)
      are gathered by a redistribute, and each rank continues its scan from the pieces before it.
      cummax/cummin (their indices) still replicate d.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from spmd.tensor.dtensor import DTensor
from spmd.tensor.ops.common import LINEAR_PARTIALS, R, normalize_dim
from spmd.tensor.placement import Partial, Shard
from spmd.tensor.sharding.registry import register_rule
from spmd.tensor.sharding.vocabulary import Expansion, OpCall, OpStrategy
from spmd.tensor.spec import local_shape_and_offset

aten = torch.ops.aten


def scan_candidates(call: OpCall, *, num_outputs: int = 1) -> list[OpStrategy]:
    """R -> R; S(e) -> S(e) for every dim but the scanned one (values and indices alike)."""
    ndim = call.input_specs[0].ndim
    scanned = normalize_dim(int(call.arg(1, "dim")), ndim)
    candidates = [OpStrategy((R,), (R,) * num_outputs)]
    candidates += [OpStrategy((Shard(e),), (Shard(e),) * num_outputs) for e in range(ndim) if e != scanned]
    return candidates


# op -> (the functional op that scans one piece, how a scan continues from a prefix, the empty prefix)
_Combine = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
SCANS: dict[Any, tuple[Any, _Combine, float]] = {
    aten.cumsum.default: (aten.cumsum.default, torch.add, 0.0),
    aten.cumsum_.default: (aten.cumsum.default, torch.add, 0.0),
    aten.cumprod.default: (aten.cumprod.default, torch.mul, 1.0),
    aten.cumprod_.default: (aten.cumprod.default, torch.mul, 1.0),
    aten.logcumsumexp.default: (aten.logcumsumexp.default, torch.logaddexp, -math.inf),
}


def sharded_scan_decomposition(call: OpCall) -> Expansion | None:
    """A scan over a sharded dim runs shard by shard plus the prefix of the pieces before each rank."""
    spec = call.input_specs[0]
    dim = normalize_dim(int(call.arg(1, "dim")), spec.ndim)
    linear = call.op in (aten.cumsum.default, aten.cumsum_.default)
    for p in spec.placements:
        if isinstance(p, Partial) and not (linear and p in LINEAR_PARTIALS):
            return None  # the rule reduces it first
    if not any(p == Shard(dim) and size > 1 for p, size in zip(spec.placements, spec.mesh.shape)):
        return None
    return functools.partial(_scan_by_pieces, dim=dim)


def _scan_by_pieces(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, dim: int) -> Any:
    """Scan each piece locally; gather the pieces' totals (small); continue each scan from its prefix."""
    scan_piece, combine, empty = SCANS[op]
    x: DTensor = args[0]
    mesh, placements = x.device_mesh, x.placements
    scanned = scan_piece(x.to_local(), *args[1:], **kwargs)
    # A piece's total is its scan's last entry (the empty prefix for an empty piece).
    piece_size = scanned.shape[dim]
    if piece_size:
        total = scanned.narrow(dim, piece_size - 1, 1)
    else:
        total = scanned.new_full((*scanned.shape[:dim], 1, *scanned.shape[dim + 1 :]), empty)
    pieces = math.prod(size for p, size in zip(placements, mesh.shape) if p == Shard(dim))
    totals_shape = (*x.shape[:dim], pieces, *x.shape[dim + 1 :])
    totals = DTensor.from_local(total.contiguous(), mesh, placements, shape=totals_shape)
    whole_dim = [R if p == Shard(dim) else p for p in placements]
    all_totals = totals.redistribute(mesh, whole_dim).to_local()
    index = local_shape_and_offset(totals_shape, mesh, placements)[1][dim]
    if index > 0:
        prefix = scan_piece(all_totals.narrow(dim, 0, index), dim).narrow(dim, index - 1, 1)
        scanned = combine(scanned, prefix)
    if op in (aten.cumsum_.default, aten.cumprod_.default):
        x.to_local().copy_(scanned)
        return x
    return DTensor.from_local(scanned, mesh, placements, shape=x.shape, stride=x.stride())


@register_rule(aten.cumsum.default, aten.cumsum_.default, decompose=sharded_scan_decomposition)
def cumsum_rule(call: OpCall) -> Sequence[OpStrategy]:
    """cumsum(d): S(e) -> S(e) for e != d; R -> R; P(sum|avg) -> P (linear)."""
    return scan_candidates(call) + [OpStrategy((p,), (p,)) for p in LINEAR_PARTIALS]


@register_rule(
    aten.cumprod.default, aten.cumprod_.default, aten.logcumsumexp.default, decompose=sharded_scan_decomposition
)
def nonlinear_scan_rule(call: OpCall) -> Sequence[OpStrategy]:
    """cumprod, logcumsumexp (d): S(e) -> S(e) for e != d; R -> R; a partial is reduced first."""
    return scan_candidates(call)


@register_rule(aten.cummax.default, aten.cummin.default)
def indexed_scan_rule(call: OpCall) -> Sequence[OpStrategy]:
    """cummax, cummin (d) -> (values, indices): S(e) -> S(e) for e != d; R -> R."""
    return scan_candidates(call, num_outputs=2)
