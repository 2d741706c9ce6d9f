"""Ops that keep the layout: aliases, copies, casts, and ``*_like`` factories.

  detach, alias, clone, _to_copy:  p -> p for every placement
  zeros_like, empty_like:           p -> p (zero is zero under every reduction)
  ones_like, full_like:             S(d) -> S(d); R -> R; P -> R (the value must not be reduced again)
  copy_(self, src):                 src follows self's placement (broadcasting like add)
"""

from __future__ import annotations

from typing import Sequence

import torch

from spmd.tensor.ops.common import PARTIALS, R, identity_candidates, pointwise_candidates
from spmd.tensor.ops.registry import OpCall, OpStrategy, register_rule

aten = torch.ops.aten


@register_rule(aten.detach.default, aten.alias.default, aten.clone.default, aten._to_copy.default,
               aten.zeros_like.default, aten.empty_like.default)
def identity_rule(call: OpCall) -> Sequence[OpStrategy]:
    """p -> p: the op touches each element on its own rank and nothing else."""
    return identity_candidates(call.input_specs[0].ndim)


@register_rule(aten.ones_like.default, aten.full_like.default)
def fill_like_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) -> S(d); R -> R; P -> R: a constant fill is already the whole value."""
    candidates = identity_candidates(call.input_specs[0].ndim, partials=())
    return candidates + [OpStrategy((p,), (R,)) for p in PARTIALS]


@register_rule(aten.copy_.default)
def copy_rule(call: OpCall) -> Sequence[OpStrategy]:
    """self keeps its placement; src is laid out to match it."""
    return pointwise_candidates(call, linearity="additive")
