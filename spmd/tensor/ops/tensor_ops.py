"""Ops that keep the layout: aliases, copies, casts, and ``*_like`` factories.

  detach, alias, clone, _to_copy:  p -> p for every placement
  zeros_like, zero_:                p -> p (zero is zero under every reduction)
  ones_like, full_like:             S(d) -> S(d); R -> R; P -> R (a new value is whole)
  empty_like:                       p -> p (no value to reduce: the placement is kept for the write
                                    that fills it, as torch does)
  copy_(self, src):                 src follows self's placement (broadcasting like add); P x P -> P
                                    for every reduce op
  new_zeros, new_ones, new_full:    same shape as self: S(d) -> S(d), otherwise R
  new_empty, new_empty_strided:     same shape as self: S(d) -> S(d) and P -> P, otherwise R (autograd's
                                    new_empty_strided(...).copy_(grad) then moves nothing)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from spmd.tensor.ops.common import LINEAR_PARTIALS, PARTIALS, R, identity_candidates, pointwise_candidates
from spmd.tensor.placement import Placement, Shard
from spmd.tensor.sharding.registry import register_rule
from spmd.tensor.sharding.vocabulary import OpCall, OpStrategy
from spmd.tensor.spec import DTensorSpec, local_shape_and_offset

aten = torch.ops.aten


@register_rule(aten.detach.default, aten.alias.default, aten.alias_copy.default, aten.clone.default,
               aten._to_copy.default, aten.zeros_like.default, aten.zero_.default, aten.empty_like.default)
def identity_rule(call: OpCall) -> Sequence[OpStrategy]:
    """p -> p: the op touches each element on its own rank and nothing else."""
    return identity_candidates(call.input_specs[0].ndim)


@register_rule(aten.ones_like.default, aten.full_like.default)
def fill_like_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) -> S(d); R -> R; P -> R: a new tensor's value is whole (and a fill must not be reduced)."""
    candidates = identity_candidates(call.input_specs[0].ndim, partials=())
    return candidates + [OpStrategy((p,), (R,)) for p in PARTIALS]


@register_rule(aten.copy_.default)
def copy_rule(call: OpCall) -> Sequence[OpStrategy]:
    """self keeps its placement; src is laid out to match it (P(max|min) too: self's values are
    overwritten, so the result reduces exactly as src does)."""
    n = len(call.input_specs)
    extra = [OpStrategy((p,) * n, (p,)) for p in PARTIALS if p not in LINEAR_PARTIALS]
    return pointwise_candidates(call, linearity="additive") + extra


def dense_strides_like(shape: Sequence[int], global_stride: Sequence[int]) -> tuple[int, ...]:
    """Dense strides for ``shape`` whose dims are laid out in the order ``global_stride`` gives them
    (smallest stride innermost; ties keep the later dim inner, as contiguous strides do)."""
    order = sorted(range(len(shape)), key=lambda d: (global_stride[d], -d))
    strides = [0] * len(shape)
    running = 1
    for d in order:
        strides[d] = running
        running *= max(shape[d], 1)
    return tuple(strides)


def local_new_size(
    args: list[Any], kwargs: dict[str, Any], decision: Any, out_spec: DTensorSpec
) -> tuple[list[Any], dict[str, Any]]:
    """``new_*`` factories take the global size; the local call makes this rank's piece.

    new_empty_strided's piece is dense in the dims' global order (a column-major request stays
    column-major on every rank).
    """
    local_shape, _ = local_shape_and_offset(out_spec.shape, out_spec.mesh, out_spec.placements)
    rest = list(args[2:])
    if rest and isinstance(rest[0], (list, tuple)):  # new_empty_strided's stride
        rest[0] = list(dense_strides_like(local_shape, rest[0]))
    return [args[0], list(local_shape), *rest], kwargs


_UNFILLED = (aten.new_empty.default, aten.new_empty_strided.default)


@register_rule(aten.new_empty_strided.default, aten.new_empty.default, aten.new_zeros.default,
               aten.new_ones.default, aten.new_full.default, local_args=local_new_size)
def new_factory_rule(call: OpCall) -> Sequence[OpStrategy]:
    """Same shape as self: S(d) -> S(d) (and P -> P when unfilled), else R; self is only a template
    and never moves."""
    spec = call.input_specs[0]
    meta = call.output_metas[0]
    same_shape = meta is not None and meta.shape == spec.shape
    keeps_partial = same_shape and call.op in _UNFILLED

    def output(p: Placement) -> Placement:
        if isinstance(p, Shard):
            return p if same_shape else R
        return p if keeps_partial else R

    options: list[Placement] = [R, *(Shard(d) for d in range(spec.ndim)), *PARTIALS]
    return [OpStrategy((p,), (output(p),)) for p in options]
