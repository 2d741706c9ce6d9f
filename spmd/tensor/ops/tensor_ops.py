"""Ops that keep the layout: aliases, copies, casts, and ``*_like`` factories.

  detach, alias, clone, _to_copy:  p -> p for every placement
  zeros_like, zero_:                p -> p (zero is zero under every reduction)
  ones_like, full_like, empty_like: S(d) -> S(d); R -> R; P -> R (a new value is whole)
  copy_(self, src):                 src follows self's placement (broadcasting like add)
  new_empty_strided, new_zeros, ...: same shape as self: S(d) -> S(d), otherwise R
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from spmd.tensor.ops.common import PARTIALS, R, identity_candidates, pointwise_candidates
from spmd.tensor.ops.registry import OpCall, OpStrategy, register_rule
from spmd.tensor.placement import Placement, Shard
from spmd.tensor.spec import DTensorSpec, contiguous_strides, local_shape_and_offset

aten = torch.ops.aten


@register_rule(aten.detach.default, aten.alias.default, aten.alias_copy.default, aten.clone.default,
               aten._to_copy.default, aten.zeros_like.default, aten.zero_.default)
def identity_rule(call: OpCall) -> Sequence[OpStrategy]:
    """p -> p: the op touches each element on its own rank and nothing else."""
    return identity_candidates(call.input_specs[0].ndim)


@register_rule(aten.ones_like.default, aten.full_like.default, aten.empty_like.default)
def fill_like_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) -> S(d); R -> R; P -> R: a new tensor's value is whole (and a fill must not be reduced)."""
    candidates = identity_candidates(call.input_specs[0].ndim, partials=())
    return candidates + [OpStrategy((p,), (R,)) for p in PARTIALS]


@register_rule(aten.copy_.default)
def copy_rule(call: OpCall) -> Sequence[OpStrategy]:
    """self keeps its placement; src is laid out to match it."""
    return pointwise_candidates(call, linearity="additive")


def local_new_size(
    args: list[Any], kwargs: dict[str, Any], decision: Any, out_spec: DTensorSpec
) -> tuple[list[Any], dict[str, Any]]:
    """``new_*`` factories take the global size; the local call makes this rank's piece."""
    local_shape, _ = local_shape_and_offset(out_spec.shape, out_spec.mesh, out_spec.placements)
    rest = list(args[2:])
    if rest and isinstance(rest[0], list):  # new_empty_strided's stride
        rest[0] = list(contiguous_strides(local_shape))
    return [args[0], list(local_shape), *rest], kwargs


@register_rule(aten.new_empty_strided.default, aten.new_empty.default, aten.new_zeros.default,
               aten.new_ones.default, aten.new_full.default, local_args=local_new_size)
def new_factory_rule(call: OpCall) -> Sequence[OpStrategy]:
    """Same shape as self: S(d) -> S(d), else R; the input is only a template and never moves."""
    spec = call.input_specs[0]
    meta = call.output_metas[0]
    same_shape = meta is not None and meta.shape == spec.shape
    options: list[Placement] = [R, *(Shard(d) for d in range(spec.ndim)), *PARTIALS]
    return [OpStrategy((p,), (p if same_shape and isinstance(p, Shard) else R,)) for p in options]
