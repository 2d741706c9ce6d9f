"""Pooling, upsampling, grid sampling and pixel/channel shuffles: windows run over the trailing
spatial dims, so those stay whole; the leading (batch, channel) dims keep their shards.

Input (N, C, *spatial) or (C, *spatial), one candidate per mesh dim:
  avg_pool, max_pool (values, indices), adaptive pools, max_unpool, upsample_* (every mode):
      S(d) -> S(d) for a leading dim d;  R -> R.  The kernels reject an empty channel (or other
      non-batch) dim, so those are sharded only where no rank's piece is empty; N may be empty.
  avg and adaptive avg pools, upsampling, max_unpool are linear: P(sum|avg) -> same P
  backwards (grad, x, [indices]): the same shard on every tensor -> S(d); grad P, the rest R -> P.
      upsample_*_backward takes the global input_size: the local call gets this rank's.
  grid_sampler(input (N, C, *), grid (N, *out, k)): S(0) x S(0) -> S(0); S(1) x R -> S(1);
      R x S(j) -> S(j + 1) for an output-point dim j of the grid; P x R -> P (linear in input);
      backward: S(0) on all -> S(0), S(0); channel S(1) on grad and input, grid R -> S(1), P(sum)
      (grad_grid sums over channels); grid S(j) -> P(sum) (grad_input sums over points), S(j);
      grad P -> P, P
  pixel_shuffle, pixel_unshuffle:  S(d) -> S(d) for the dims before (C, H, W) where no piece is empty; P -> P
  channel_shuffle:  S(d) -> S(d) for every dim but the channel dim 1; P -> P
  im2col (N, C, H, W) -> (N, C*k, L), col2im back:  S(0) -> S(0) (batched input only); P -> P
      (col2im only P(sum|avg): it adds overlapping patches)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from spmd.tensor.ops.common import LINEAR_PARTIALS, PARTIALS, R
from spmd.tensor.ops.matrix import no_empty_shards
from spmd.tensor.placement import Partial, Placement, Shard
from spmd.tensor.sharding.registry import register_rule
from spmd.tensor.sharding.vocabulary import OpCall, OpStrategy
from spmd.tensor.spec import DTensorSpec, local_shape_and_offset

aten = torch.ops.aten
SUM = Partial("sum")


def _ops(names: Sequence[str]) -> list[Any]:
    """Every overload but ``out=`` / ``grad_input=`` of the named aten ops that this torch has."""
    found = []
    for name in names:
        packet = getattr(aten, name, None)
        if packet is None:
            continue
        found += [getattr(packet, o) for o in packet.overloads() if "out" not in o and "grad_input" not in o]
    return found


def leading_dims(x: DTensorSpec, spatial: int) -> list[int]:
    """The dims before the ``spatial`` ones that may stay sharded: N always (of a batched input),
    the others (C) only where no rank's piece is empty, as the kernels reject an empty channel dim."""
    lead = x.ndim - spatial
    batched = lead >= 2
    return [d for d in range(lead) if (batched and d == 0) or no_empty_shards(x.shape[d], x.mesh.shape)]


def _same_shard_candidates(
    num_inputs: int, num_outputs: int, dims: Sequence[int], *, linear: bool, grad_first: bool = False
) -> list[OpStrategy]:
    """R -> R; S(d) on every input -> S(d) on every output; linear: P -> P (or, ``grad_first``, the
    first input P and the rest R -> P)."""
    candidates = [OpStrategy((R,) * num_inputs, (R,) * num_outputs)]
    candidates += [OpStrategy((Shard(d),) * num_inputs, (Shard(d),) * num_outputs) for d in dims]
    if linear:
        rest = (R,) * (num_inputs - 1) if grad_first else None
        for p in LINEAR_PARTIALS:
            inputs = (p, *rest) if rest is not None else (p,) * num_inputs
            candidates.append(OpStrategy(inputs, (p,) * num_outputs))
    return candidates


# ----- pools ---------------------------------------------------------------------------------------
AVG_POOLS = {"avg_pool2d": 2, "avg_pool3d": 3, "_adaptive_avg_pool2d": 2, "_adaptive_avg_pool3d": 3}
MAX_POOLS = {
    "max_pool2d_with_indices": 2,
    "max_pool3d_with_indices": 3,
    "adaptive_max_pool2d": 2,
    "adaptive_max_pool3d": 3,
}
MAX_UNPOOLS = {"max_unpool2d": 2, "max_unpool3d": 3}
POOL_BACKWARDS = {
    "avg_pool2d_backward": (2, False),
    "avg_pool3d_backward": (3, False),
    "_adaptive_avg_pool2d_backward": (2, False),
    "_adaptive_avg_pool3d_backward": (3, False),
    "max_pool2d_with_indices_backward": (2, True),
    "max_pool3d_with_indices_backward": (3, True),
    "adaptive_max_pool2d_backward": (2, True),
    "adaptive_max_pool3d_backward": (3, True),
}
SPATIAL = {
    **AVG_POOLS,
    **MAX_POOLS,
    **MAX_UNPOOLS,
    **{name: dims for name, (dims, _) in POOL_BACKWARDS.items()},
}


def _spatial_dims(call: OpCall) -> int:
    return SPATIAL[call.op._schema.name.split("::")[-1]]


@register_rule(*_ops(list(AVG_POOLS)))
def avg_pool_rule(call: OpCall) -> Sequence[OpStrategy]:
    """avg pools: S(d) -> S(d) for leading dims; R -> R; P(sum|avg) -> P (a mean of a sum is a sum of means)."""
    x = call.input_specs[0]
    return _same_shard_candidates(1, 1, leading_dims(x, _spatial_dims(call)), linear=True)


@register_rule(*_ops(list(MAX_POOLS)))
def max_pool_rule(call: OpCall) -> Sequence[OpStrategy]:
    """max pools -> (values, indices): S(d) -> S(d), S(d) for leading dims (indices are within a
    plane, so the same locally); R -> R; a partial is reduced first."""
    x = call.input_specs[0]
    return _same_shard_candidates(1, 2, leading_dims(x, _spatial_dims(call)), linear=False)


@register_rule(*_ops(list(MAX_UNPOOLS)))
def max_unpool_rule(call: OpCall) -> Sequence[OpStrategy]:
    """max_unpool(x, indices): S(d) x S(d) -> S(d) for leading dims; x P, indices R -> P (a scatter)."""
    x = call.input_specs[0]
    return _same_shard_candidates(2, 1, leading_dims(x, _spatial_dims(call)), linear=True, grad_first=True)


@register_rule(*_ops(list(POOL_BACKWARDS)))
def pool_backward_rule(call: OpCall) -> Sequence[OpStrategy]:
    """(grad, x, [indices]): S(d) on all -> S(d) for leading dims; grad P, the rest R -> P."""
    x = call.input_specs[1]
    n = len(call.input_specs)
    return _same_shard_candidates(n, 1, leading_dims(x, _spatial_dims(call)), linear=True, grad_first=True)


# ----- upsampling ----------------------------------------------------------------------------------
UPSAMPLES = {
    "upsample_nearest1d": 1,
    "upsample_nearest2d": 2,
    "upsample_nearest3d": 3,
    "_upsample_nearest_exact1d": 1,
    "_upsample_nearest_exact2d": 2,
    "_upsample_nearest_exact3d": 3,
    "upsample_linear1d": 1,
    "upsample_bilinear2d": 2,
    "upsample_bicubic2d": 2,
    "upsample_trilinear3d": 3,
    "_upsample_bilinear2d_aa": 2,
    "_upsample_bicubic2d_aa": 2,
}


@register_rule(*_ops(list(UPSAMPLES)))
def upsample_rule(call: OpCall) -> Sequence[OpStrategy]:
    """upsample (every mode): S(d) -> S(d) for leading dims; R -> R; P(sum|avg) -> P (interpolation is linear)."""
    x = call.input_specs[0]
    spatial = UPSAMPLES[call.op._schema.name.split("::")[-1]]
    return _same_shard_candidates(1, 1, leading_dims(x, spatial), linear=True)


def local_input_size(
    args: list[Any], kwargs: dict[str, Any], decision: Any, out_spec: DTensorSpec
) -> tuple[list[Any], dict[str, Any]]:
    """upsample backwards take the global ``input_size``; the local call makes this rank's piece."""
    local_shape, _ = local_shape_and_offset(out_spec.shape, out_spec.mesh, out_spec.placements)
    if len(args) > 2:
        return [*args[:2], list(local_shape), *args[3:]], kwargs
    return args, {**kwargs, "input_size": list(local_shape)}


@register_rule(*_ops([name + "_backward" for name in UPSAMPLES]), local_args=local_input_size)
def upsample_backward_rule(call: OpCall) -> Sequence[OpStrategy]:
    """(grad, output_size, input_size): S(d) -> S(d) for leading dims; P -> P."""
    grad = call.input_specs[0]
    spatial = UPSAMPLES[call.op._schema.name.split("::")[-1].removesuffix("_backward")]
    return _same_shard_candidates(1, 1, leading_dims(grad, spatial), linear=True)


# ----- grid sampling -------------------------------------------------------------------------------
def _grid_point_dims(call: OpCall, grid_index: int) -> range:
    """The grid's output-point dims (all but N and the last, the coordinates): grid dim k is output dim k + 1."""
    return range(1, call.input_specs[grid_index].ndim - 1)


@register_rule(aten.grid_sampler_2d.default, aten.grid_sampler_3d.default)
def grid_sampler_rule(call: OpCall) -> Sequence[OpStrategy]:
    """(input, grid): S(0) x S(0) -> S(0); S(1) x R -> S(1) (channels sample alike); R x S(k) -> S(k + 1)
    (output points sample alone); P x R -> P (linear in input)."""
    candidates = [OpStrategy((R, R), (R,)), OpStrategy((Shard(0), Shard(0)), (Shard(0),))]
    candidates.append(OpStrategy((Shard(1), R), (Shard(1),)))  # the kernel accepts an empty channel dim
    candidates += [OpStrategy((R, Shard(k)), (Shard(k + 1),)) for k in _grid_point_dims(call, 1)]
    return candidates + [OpStrategy((p, R), (p,)) for p in LINEAR_PARTIALS]


@register_rule(aten.grid_sampler_2d_backward.default, aten.grid_sampler_3d_backward.default)
def grid_sampler_backward_rule(call: OpCall) -> Sequence[OpStrategy]:
    """(grad, input, grid) -> (d_input, d_grid): S(0) on all -> S(0), S(0); S(1) x S(1) x R -> S(1),
    P(sum); S(k + 1) x R x S(k) -> P(sum), S(k); grad P x R x R -> P, P (both linear in grad)."""
    candidates = [
        OpStrategy((R, R, R), (R, R)),
        OpStrategy((Shard(0), Shard(0), Shard(0)), (Shard(0), Shard(0))),
        OpStrategy((Shard(1), Shard(1), R), (Shard(1), SUM)),
    ]
    candidates += [OpStrategy((Shard(k + 1), R, Shard(k)), (SUM, Shard(k))) for k in _grid_point_dims(call, 2)]
    return candidates + [OpStrategy((p, R, R), (p, p)) for p in LINEAR_PARTIALS]


# ----- shuffles and patches ------------------------------------------------------------------------
def _keep(dims: Sequence[int], partials: Sequence[Partial] = PARTIALS) -> list[OpStrategy]:
    """R -> R; S(d) -> S(d) for ``dims``; P -> P (the op only moves elements, or zero-fills)."""
    placements: list[Placement] = [R, *(Shard(d) for d in dims), *partials]
    return [OpStrategy((p,), (p,)) for p in placements]


@register_rule(aten.pixel_shuffle.default, aten.pixel_unshuffle.default)
def pixel_shuffle_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) -> S(d) for the batch dims before (C, H, W), which the shuffle mixes, where no piece is
    empty (torch's pixel_unshuffle returns an empty input unchanged, in the wrong shape); P -> P."""
    x = call.input_specs[0]
    return _keep([d for d in range(x.ndim - 3) if no_empty_shards(x.shape[d], x.mesh.shape)])


@register_rule(aten.channel_shuffle.default, aten.native_channel_shuffle.default)
def channel_shuffle_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) -> S(d) for every dim but the channels (dim 1); P -> P."""
    return _keep([d for d in range(call.input_specs[0].ndim) if d != 1])


@register_rule(aten.im2col.default, aten.col2im.default)
def patches_rule(call: OpCall) -> Sequence[OpStrategy]:
    """im2col (N, C, H, W) -> (N, C*k, L) and col2im back: S(0) -> S(0) for a batched input; P -> P
    (col2im adds overlapping patches up, so only P(sum|avg) pass it)."""
    x = call.input_specs[0]
    is_im2col = call.op == aten.im2col.default
    batched = x.ndim == (4 if is_im2col else 3)
    return _keep([0] if batched else [], PARTIALS if is_im2col else LINEAR_PARTIALS)
