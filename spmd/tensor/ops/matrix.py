"""Matrix products and the transposes their backward passes use.

  mm:  R x R -> R;  S(0) x R -> S(0);  R x S(1) -> S(1);  S(1) x S(0) -> P(sum);
       P x R -> P;  R x P -> P
  t / transpose(a, b):  S(a) -> S(b), S(b) -> S(a), other placements unchanged
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spmd.tensor.ops.common import LINEAR_PARTIALS, PARTIALS, R, normalize_dim
from spmd.tensor.ops.registry import OpCall, OpStrategy, register_rule
from spmd.tensor.placement import Partial, Placement, Shard

aten = torch.ops.aten
SUM = Partial("sum")


@register_rule(aten.mm.default)
def mm_rule(call: OpCall) -> Sequence[OpStrategy]:
    """R x R -> R; S(0) x R -> S(0); R x S(1) -> S(1); S(1) x S(0) -> P(sum); P x R -> P; R x P -> P."""
    return [
        OpStrategy((R, R), (R,)),
        OpStrategy((Shard(0), R), (Shard(0),)),
        OpStrategy((R, Shard(1)), (Shard(1),)),
        OpStrategy((Shard(1), Shard(0)), (SUM,)),
        *(OpStrategy((p, R), (p,)) for p in LINEAR_PARTIALS),
        *(OpStrategy((R, p), (p,)) for p in LINEAR_PARTIALS),
    ]


def _swap(p: Placement, a: int, b: int) -> Placement:
    if isinstance(p, Shard) and p.dim in (a, b):
        return Shard(b if p.dim == a else a)
    return p


def _transpose_candidates(ndim: int, a: int, b: int) -> list[OpStrategy]:
    options: list[Placement] = [R, *(Shard(d) for d in range(ndim)), *PARTIALS]
    return [OpStrategy((p,), (_swap(p, a, b),)) for p in options]


@register_rule(aten.t.default)
def t_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(0) <-> S(1); R and P unchanged (1-d tensors are returned as they are)."""
    ndim = call.input_specs[0].ndim
    return _transpose_candidates(ndim, 0, 1) if ndim == 2 else _transpose_candidates(ndim, 0, 0)


@register_rule(aten.transpose.int)
def transpose_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(dim0) <-> S(dim1); other placements unchanged."""
    ndim = call.input_specs[0].ndim
    a = normalize_dim(call.arg(1, "dim0"), ndim)
    b = normalize_dim(call.arg(2, "dim1"), ndim)
    return _transpose_candidates(ndim, a, b)
