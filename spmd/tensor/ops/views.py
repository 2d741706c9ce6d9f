"""Shape ops that keep every element where it is: view, reshape, squeeze, unsqueeze.

  S(d) -> S(o) when input dim d survives as output dim o (same size, same elements before it);
  a sharded dim that is split or merged must be replicated first. R -> R; P -> P.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from spmd.tensor.ops.common import PARTIALS, R
from spmd.tensor.ops.registry import OpCall, OpStrategy, register_rule
from spmd.tensor.placement import Shard
from spmd.tensor.spec import DTensorSpec, local_shape_and_offset

aten = torch.ops.aten


def surviving_dims(in_shape: Sequence[int], out_shape: Sequence[int]) -> dict[int, int]:
    """Input dims that appear unchanged in the output: ``{input dim: output dim}``."""
    out_prefix: dict[tuple[int, int], int] = {}
    running = 1
    for o, size in enumerate(out_shape):
        out_prefix.setdefault((running, size), o)
        running *= size
    mapping: dict[int, int] = {}
    running = 1
    for d, size in enumerate(in_shape):
        out_dim = out_prefix.get((running, size))
        if out_dim is not None and size != 1:
            mapping[d] = out_dim
        running *= size
    return mapping


def local_view_size(
    args: list[Any], kwargs: dict[str, Any], decision: Any, out_spec: DTensorSpec
) -> tuple[list[Any], dict[str, Any]]:
    """A view's size argument is global; the local call needs this rank's output shape."""
    local_shape, _ = local_shape_and_offset(out_spec.shape, out_spec.mesh, out_spec.placements)
    return [args[0], list(local_shape), *args[2:]], kwargs


@register_rule(aten.view.default, aten._unsafe_view.default, aten.reshape.default, local_args=local_view_size)
@register_rule(aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)
def view_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) -> S(o) for dims that survive the reshape; R -> R; P -> P."""
    in_shape = call.input_specs[0].shape
    meta = call.output_metas[0]
    assert meta is not None
    if math.prod(in_shape) == 0:
        return [OpStrategy((R,), (R,))]
    mapping = surviving_dims(in_shape, meta.shape)
    candidates = [OpStrategy((R,), (R,))]
    candidates += [OpStrategy((Shard(d),), (Shard(o),)) for d, o in mapping.items()]
    candidates += [OpStrategy((p,), (p,)) for p in PARTIALS]
    return candidates
