"""Neural-network ops: softmax, normalisation, losses, convolution and embedding.

  _softmax / _log_softmax / _safe_softmax(dim):  S(d) -> S(d) for d != dim; R -> R
  their backward (grad, out):     S(d) x S(d) -> S(d), d != dim; P x R -> P (linear in grad)
  native_layer_norm, _fused_rms_norm (x, w, b):  S(d) x R x R -> S(d) for the leading dims d
  their backward:                 S(d) for the leading dims -> grad_x S(d), grad_w, grad_b P(sum);
                                  grad P with the rest R -> every grad P
  nll_loss (self, target, w):     batch/spatial S -> S for 'none', P(sum) for 'sum', R for 'mean'
                                  (a mean of shards is no shard of the mean); self P -> P
  nll_loss_backward:              batch/spatial S -> S (total_weight is the global one); grad P -> P
  convolution (x, w, b):          S(0) x R -> S(0); groups=1: R x S(out) -> S(1) (b S(0)),
                                  S(1) x S(in) -> P(sum) (b P), where no rank is left without
                                  channels; x or w P, b P -> P
  convolution_backward:           S(0) -> dx S(0), dw, db P(sum); channel shards as in forward
  reflection_pad, replication_pad (x, pad):  S(d) -> S(d) for a dim d the pad leaves alone; P -> P
  constant_pad_nd (x, pad, v):    the same; P(sum) only for v == 0 (v on every rank would add up)
  their backward (grad, x):       S(d) x S(d) -> S(d) for d not padded; grad P x R -> P
  a padded (or cropped) dim must be whole; reflection and replication kernels reject an empty
  channel dim, so a non-batch dim is sharded only where no piece is empty
  embedding (w, idx):             R x S(d) -> S(d); S(1) x R -> S(last) (colwise); P x R -> P
  embedding_dense_backward:       S(d) grad and idx -> P(sum) (not with scale_grad_by_freq);
                                  grad S(last), idx R -> S(1); grad P -> P
Row-wise embedding (w S(0)) runs a masked local lookup (a ``local_impl``) and yields P(sum).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from spmd.compile.compiling import compiling_here
from spmd.tensor.ops.common import LINEAR_PARTIALS, PARTIALS, R, normalize_dim
from spmd.tensor.ops.matrix import no_empty_shards
from spmd.tensor.placement import Partial, Placement, Shard
from spmd.tensor.sharding.registry import register_rule
from spmd.tensor.sharding.vocabulary import OpCall, OpStrategy
from spmd.tensor.spec import DTensorSpec, local_shape_and_offset

aten = torch.ops.aten
SUM = Partial("sum")
REDUCTION_NONE, REDUCTION_MEAN, REDUCTION_SUM = 0, 1, 2


# ----- softmax -------------------------------------------------------------------------------------
@register_rule(aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default)
def softmax_rule(call: OpCall) -> Sequence[OpStrategy]:
    """softmax(dim): S(d) -> S(d) for d != dim; R -> R; the softmax dim must be whole."""
    ndim = call.input_specs[0].ndim
    dim = normalize_dim(call.arg(1, "dim"), ndim)
    return [OpStrategy((R,), (R,)), *(OpStrategy((Shard(d),), (Shard(d),)) for d in range(ndim) if d != dim)]


@register_rule(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
def softmax_backward_rule(call: OpCall) -> Sequence[OpStrategy]:
    """(grad, out): S(d) x S(d) -> S(d) for d != dim; P x R -> P (linear in grad)."""
    ndim = call.input_specs[0].ndim
    dim = normalize_dim(call.arg(2, "dim"), ndim)
    candidates = [OpStrategy((R, R), (R,))]
    candidates += [OpStrategy((Shard(d), Shard(d)), (Shard(d),)) for d in range(ndim) if d != dim]
    candidates += [OpStrategy((p, R), (p,)) for p in LINEAR_PARTIALS]
    return candidates


# ----- normalisation -------------------------------------------------------------------------------
def _leading_dims(call: OpCall, x: DTensorSpec, shape_index: int) -> range:
    """The dims a norm does not normalise over (the ones left of ``normalized_shape``)."""
    normalized = call.arg(shape_index, "normalized_shape")
    return range(x.ndim - len(normalized))


@register_rule(aten.native_layer_norm.default, aten._fused_rms_norm.default)
def norm_rule(call: OpCall) -> Sequence[OpStrategy]:
    """(x, w, b) -> (out, stat...): S(d) x R x R -> S(d) for leading dims d; R -> R."""
    x = call.input_specs[0]
    params = (R,) * (len(call.input_specs) - 1)
    n_out = len(call.output_metas)
    candidates = [OpStrategy((R, *params), (R,) * n_out)]
    candidates += [OpStrategy((Shard(d), *params), (Shard(d),) * n_out) for d in _leading_dims(call, x, 1)]
    return candidates


@register_rule(aten.native_layer_norm_backward.default, aten._fused_rms_norm_backward.default)
def norm_backward_rule(call: OpCall) -> Sequence[OpStrategy]:
    """(grad, x, stats..., w, b): S(d) on grad, x, stats -> grad_x S(d), grad_w, grad_b P(sum)."""
    x = call.input_specs[1]
    # grad, x and the saved statistics are laid out alike; weight and bias come after them.
    n_stats = 2 if call.op == aten.native_layer_norm_backward.default else 1
    n_like_x = 2 + n_stats
    params = (R,) * (len(call.input_specs) - n_like_x)
    n_out = len(call.output_metas)
    candidates = [OpStrategy((R,) * n_like_x + params, (R,) * n_out)]
    candidates += [
        OpStrategy((Shard(d),) * n_like_x + params, (Shard(d),) + (SUM,) * (n_out - 1))
        for d in _leading_dims(call, x, 2)
    ]
    candidates += [OpStrategy((p,) + (R,) * (n_like_x - 1) + params, (p,) * n_out) for p in LINEAR_PARTIALS]
    return candidates


# ----- losses --------------------------------------------------------------------------------------
def _loss_dims(self_ndim: int) -> list[tuple[int, int]]:
    """(self dim, target dim) pairs that index samples: the batch dim and any spatial dims."""
    if self_ndim < 2:
        return []
    return [(0, 0)] + [(d, d - 1) for d in range(2, self_ndim)]


@register_rule(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def nll_loss_rule(call: OpCall) -> Sequence[OpStrategy]:
    """(self, target, w) -> (loss, total_weight): sample dims S -> S ('none'), P(sum) ('sum'); self P -> P."""
    self_spec = call.input_specs[0]
    reduction = int(call.arg(3, "reduction"))
    weight = (R,) * (len(call.input_specs) - 2)
    candidates = [OpStrategy((R, R, *weight), (R, R))]
    if reduction != REDUCTION_MEAN:
        for self_dim, target_dim in _loss_dims(self_spec.ndim):
            # 'none' leaves total_weight at 0 on every rank; 'sum' counts each rank's samples.
            outs: tuple[Placement, Placement] = (
                (Shard(target_dim), R) if reduction == REDUCTION_NONE else (SUM, SUM)
            )
            candidates.append(OpStrategy((Shard(self_dim), Shard(target_dim), *weight), outs))
    # The loss is linear in self; total_weight depends only on target and weight.
    candidates += [OpStrategy((p, R, *weight), (p, R)) for p in LINEAR_PARTIALS]
    return candidates


@register_rule(aten.nll_loss_backward.default, aten.nll_loss2d_backward.default)
def nll_loss_backward_rule(call: OpCall) -> Sequence[OpStrategy]:
    """(grad, self, target, w, total_weight): sample dims S -> S; grad P -> P."""
    self_spec = call.input_specs[1]
    reduction = int(call.arg(4, "reduction"))
    weight = (R,) * (len(call.input_specs) - 4)
    # Only 'mean' reads total_weight; otherwise any placement of it will do, so it never moves.
    totals: list[Placement] = [R] if reduction == REDUCTION_MEAN else [R, *LINEAR_PARTIALS]
    candidates = []
    for total in totals:
        candidates.append(OpStrategy((R, R, R, *weight, total), (R,)))
        for self_dim, target_dim in _loss_dims(self_spec.ndim):
            grad = Shard(target_dim) if reduction == REDUCTION_NONE else R
            inputs = (grad, Shard(self_dim), Shard(target_dim), *weight, total)
            candidates.append(OpStrategy(inputs, (Shard(self_dim),)))
        candidates += [OpStrategy((p, R, R, *weight, total), (p,)) for p in LINEAR_PARTIALS]
    return candidates


# ----- convolution ---------------------------------------------------------------------------------
def _weight_channel_dims(call: OpCall, transposed_index: int) -> tuple[int, int] | None:
    """(out-channel dim, in-channel dim) of the weight, or None when channels cannot be sharded.

    Callers also skip a channel dim that would leave a rank no channels: aten's convolution
    rejects an empty weight, and with zero input channels it even returns a wrongly shaped output.
    """
    transposed = bool(call.arg(transposed_index, "transposed"))
    if int(call.arg(transposed_index + 2, "groups")) != 1:
        return None
    return (1, 0) if transposed else (0, 1)


@register_rule(aten.convolution.default)
def convolution_rule(call: OpCall) -> Sequence[OpStrategy]:
    """(x, w, b): S(0) x R x R -> S(0); R x S(out) x S(0) -> S(1); S(1) x S(in) x P -> P(sum)."""
    has_bias = len(call.input_specs) == 3

    def strategy(x: Placement, w: Placement, b: Placement, out: Placement) -> OpStrategy:
        return OpStrategy((x, w, b) if has_bias else (x, w), (out,))

    candidates = [strategy(R, R, R, R), strategy(Shard(0), R, R, Shard(0))]
    weight = call.input_specs[1]
    channels = _weight_channel_dims(call, 6)
    if channels is not None:
        out_dim, in_dim = channels
        if no_empty_shards(weight.shape[out_dim], weight.mesh.shape):
            candidates.append(strategy(R, Shard(out_dim), Shard(0), Shard(1)))
        if no_empty_shards(weight.shape[in_dim], weight.mesh.shape):
            candidates.append(strategy(Shard(1), Shard(in_dim), SUM, SUM))
    for p in LINEAR_PARTIALS:
        candidates += [strategy(p, R, p, p), strategy(R, p, p, p)]
    return candidates


@register_rule(aten.convolution_backward.default)
def convolution_backward_rule(call: OpCall) -> Sequence[OpStrategy]:
    """(grad, x, w) -> (dx, dw, db): S(0) x S(0) x R -> S(0), P(sum), P(sum); channel shards; grad P -> P."""
    candidates = [
        OpStrategy((R, R, R), (R, R, R)),
        OpStrategy((Shard(0), Shard(0), R), (Shard(0), SUM, SUM)),
    ]
    weight = call.input_specs[2]
    channels = _weight_channel_dims(call, 7)
    if channels is not None:
        out_dim, in_dim = channels
        if no_empty_shards(weight.shape[out_dim], weight.mesh.shape):
            candidates.append(OpStrategy((Shard(1), R, Shard(out_dim)), (SUM, Shard(out_dim), Shard(0))))
        if no_empty_shards(weight.shape[in_dim], weight.mesh.shape):
            candidates.append(OpStrategy((R, Shard(1), Shard(in_dim)), (Shard(1), Shard(in_dim), R)))
    candidates += [OpStrategy((p, R, R), (p, p, p)) for p in LINEAR_PARTIALS]
    return candidates


# ----- padding -------------------------------------------------------------------------------------
REFLECT_AND_REPLICATE_PADS = [
    getattr(aten, f"{mode}_pad{n}d").default for mode in ("reflection", "replication") for n in (1, 2, 3)
]
REFLECT_AND_REPLICATE_PAD_BACKWARDS = [
    getattr(aten, f"{mode}_pad{n}d_backward").default for mode in ("reflection", "replication") for n in (1, 2, 3)
]


def unpadded_dims(ndim: int, pad: Sequence[int]) -> list[int]:
    """Dims that ``pad`` (last dim first: left, right, then the dim before it...) leaves as they are."""
    padded = {ndim - 1 - k for k in range(len(pad) // 2) if pad[2 * k] != 0 or pad[2 * k + 1] != 0}
    return [d for d in range(ndim) if d not in padded]


def _shardable_pad_dims(call: OpCall, x: DTensorSpec, pad: Sequence[int]) -> list[int]:
    """The unpadded dims that may stay sharded: reflection and replication kernels reject an empty
    channel (or other non-batch) dim, so those dims are sharded only where no rank's piece is empty."""
    dims = unpadded_dims(x.ndim, pad)
    if call.op in (aten.constant_pad_nd.default,):
        return dims
    batched = x.ndim == len(pad) // 2 + 2  # (N, C, *spatial); otherwise (C, *spatial)
    return [d for d in dims if (batched and d == 0) or no_empty_shards(x.shape[d], x.mesh.shape)]


@register_rule(*REFLECT_AND_REPLICATE_PADS, aten.constant_pad_nd.default)
def pad_rule(call: OpCall) -> Sequence[OpStrategy]:
    """pad: S(d) -> S(d) for d not padded; R -> R; P -> P (P(sum) for constant pads only with value 0)."""
    pad = [int(p) for p in call.arg(1, "pad" if call.op == aten.constant_pad_nd.default else "padding")]
    candidates = [OpStrategy((R,), (R,))]
    candidates += [OpStrategy((Shard(d),), (Shard(d),)) for d in _shardable_pad_dims(call, call.input_specs[0], pad)]
    value = call.arg(2, "value", 0) if call.op == aten.constant_pad_nd.default else 0
    partials = [p for p in PARTIALS if p != SUM or value in (0, None)]
    return candidates + [OpStrategy((p,), (p,)) for p in partials]


@register_rule(*REFLECT_AND_REPLICATE_PAD_BACKWARDS)
def pad_backward_rule(call: OpCall) -> Sequence[OpStrategy]:
    """(grad, x, pad): S(d) x S(d) -> S(d) for d not padded; grad P x R -> P (x only gives the shape)."""
    x = call.input_specs[1]
    pad = [int(p) for p in call.arg(2, "padding")]
    candidates = [OpStrategy((R, R), (R,))]
    candidates += [OpStrategy((Shard(d), Shard(d)), (Shard(d),)) for d in _shardable_pad_dims(call, x, pad)]
    return candidates + [OpStrategy((p, R), (p,)) for p in LINEAR_PARTIALS]


# ----- embedding -----------------------------------------------------------------------------------
def _check_ids_in_range(indices: torch.Tensor, num_embeddings: int) -> None:
    """Raise IndexError as plain torch does for an id outside the table (the masked lookup would
    return a zero row). Every rank holding these ids raises, so no rank is left in a collective."""
    # Meta ids (the N-rank simulator) hold no values to check; a compiled graph cannot branch on values.
    if indices.numel() == 0 or indices.is_meta or compiling_here():
        return
    low, high = torch.stack(torch.aminmax(indices)).tolist()  # one read of the ids' range
    if low < 0 or high >= num_embeddings:
        bad = low if low < 0 else high
        raise IndexError(
            f"embedding: index {bad} is out of range for a table of {num_embeddings} rows (row-wise "
            f"sharded); use ids in [0, {num_embeddings - 1}]"
        )


def _masked_lookup(
    op: Any, args: list[Any], kwargs: dict[str, Any], inputs: tuple[DTensorSpec, ...], outputs: tuple[Any, ...]
) -> torch.Tensor:
    """Row-wise tables: look up the indices this rank's rows hold, zeros for the rest (P(sum))."""
    weight_spec = inputs[0]
    weight, indices = args[0], args[1]
    if Shard(0) not in weight_spec.placements:
        return op(*args, **kwargs)
    _check_ids_in_range(indices, weight_spec.shape[0])
    _, offset = local_shape_and_offset(weight_spec.shape, weight_spec.mesh, weight_spec.placements)
    start, rows = offset[0], weight.shape[0]
    held = (indices >= start) & (indices < start + rows)
    if rows == 0:
        return weight.new_zeros((*indices.shape, weight.shape[1]))
    found = op(weight, torch.where(held, indices - start, 0), *args[2:], **kwargs)
    return found.masked_fill(~held.unsqueeze(-1), 0)


@register_rule(aten.embedding.default, local_impl=_masked_lookup)
def embedding_rule(call: OpCall) -> Sequence[OpStrategy]:
    """(w, idx): R x S(d) -> S(d); S(1) x R -> S(idx.ndim); S(0) x R -> P(sum) (masked); P x R -> P."""
    indices = call.input_specs[1]
    candidates = [OpStrategy((R, R), (R,))]
    candidates += [OpStrategy((R, Shard(d)), (Shard(d),)) for d in range(indices.ndim)]
    candidates.append(OpStrategy((Shard(1), R), (Shard(indices.ndim),)))
    # Row-wise: each rank answers the indices in its rows with zeros elsewhere; summing gives the lookup.
    candidates.append(OpStrategy((Shard(0), R), (SUM,)))
    candidates += [OpStrategy((p, R), (p,)) for p in PARTIALS]
    return candidates


@register_rule(aten.embedding_dense_backward.default)
def embedding_backward_rule(call: OpCall) -> Sequence[OpStrategy]:
    """(grad, idx): S(d) x S(d) -> P(sum); S(idx.ndim) x R -> S(1); P x R -> P."""
    indices = call.input_specs[1]
    scale_by_freq = bool(call.arg(4, "scale_grad_by_freq", False))
    candidates = [OpStrategy((R, R), (R,))]
    if not scale_by_freq:  # the scale counts each index over the whole batch
        candidates += [OpStrategy((Shard(d), Shard(d)), (SUM,)) for d in range(indices.ndim)]
    candidates.append(OpStrategy((Shard(indices.ndim), R), (Shard(1),)))
    candidates += [OpStrategy((p, R), (p,)) for p in LINEAR_PARTIALS]
    return candidates
