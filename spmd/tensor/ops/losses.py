"""Elementwise losses: mse, smooth_l1, huber, soft_margin, binary_cross_entropy (with logits), forward
and backward. (l1_loss and kl_div reach the dispatcher already decomposed into pointwise ops.)

Each loss is an elementwise term over the broadcast of its operands (self, target, weight,
pos_weight), then reduced as ``reduction`` says. Per mesh dim, broadcasting aligned from the right:
  'none':   S(d) x ... -> S(d) (operands broadcast along d are R);  R -> R
  'sum':    S(d) x ... -> P(sum)
  'mean':   S(d) x ... -> P(avg) when d divides evenly over the mesh; an uneven sharded dim runs as
            other ops instead: loss(reduction='sum') -> P(sum), divided by the global element count
  backward (grad, self, target, ...):  'none' is pointwise (S(d) -> S(d)) and linear in grad
            (P x R... -> P); 'sum' takes the 0-d grad R and self's shards -> S(d); 'mean' over sharded
            operands runs as the 'sum' backward of grad / (global element count), since the local
            kernel would divide by the local count
The terms are not linear in self or target, so partial operands are reduced first.

Margin losses over classes (multi_margin, multilabel_margin) have one term per sample of self (N, C):
  the class dim must be whole; the batch dim, where no piece is empty (torch's kernels return
  garbage for an empty batch), S(0) (on self, target; the class weight R) -> S(0)
  for 'none', P(sum) for 'sum', P(avg) for 'mean' when N divides evenly, else the 'sum' loss / N.
  Their backward ops have no meta kernel in torch, so no rule can be asked about them (the output
  shape is found on the meta device first): they run through the replicate fallback.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch

from spmd.tensor.ops.common import LINEAR_PARTIALS, R, pointwise_candidates
from spmd.tensor.ops.matrix import no_empty_shards
from spmd.tensor.ops.reductions import schema_arg
from spmd.tensor.placement import Partial, Placement, Shard
from spmd.tensor.sharding.registry import register_rule
from spmd.tensor.sharding.vocabulary import Expansion, OpCall, OpStrategy
from spmd.tensor.spec import DTensorSpec

aten = torch.ops.aten
SUM, AVG = Partial("sum"), Partial("avg")
REDUCTION_NONE, REDUCTION_MEAN, REDUCTION_SUM = 0, 1, 2

LOSSES = [
    aten.mse_loss.default,
    aten.smooth_l1_loss.default,
    aten.huber_loss.default,
    aten.soft_margin_loss.default,
    aten.binary_cross_entropy.default,
    aten.binary_cross_entropy_with_logits.default,
]
LOSS_BACKWARDS = [
    aten.mse_loss_backward.default,
    aten.smooth_l1_loss_backward.default,
    aten.huber_loss_backward.default,
    aten.soft_margin_loss_backward.default,
    aten.binary_cross_entropy_backward.default,
]


def aligned_placement(shape: Sequence[int], out_shape: Sequence[int], out_dim: int) -> Placement:
    """Shard of the operand dim that broadcasts to ``out_dim`` of ``out_shape``, or R where it is broadcast."""
    in_dim = out_dim - (len(out_shape) - len(shape))
    if in_dim < 0 or (shape[in_dim] == 1 and out_shape[out_dim] != 1):
        return R
    return Shard(in_dim)


def elementwise_shape(specs: Sequence[DTensorSpec]) -> tuple[int, ...]:
    """The shape of the loss's elementwise term: the broadcast of its operands (already checked by torch)."""
    ndim = max(s.ndim for s in specs)
    shape = []
    for back in range(ndim, 0, -1):
        sizes = {s.shape[-back] for s in specs if s.ndim >= back} - {1}
        shape.append(sizes.pop() if sizes else 1)
    return tuple(shape)


def sharded_dims(specs: Sequence[DTensorSpec], shape: Sequence[int]) -> set[int]:
    """The dims of ``shape`` that a mesh dim of more than one rank shards on some operand."""
    found = set()
    for spec in specs:
        for p, size in zip(spec.placements, spec.mesh.shape):
            if isinstance(p, Shard) and size > 1:
                found.add(p.dim + len(shape) - spec.ndim)
    return found


def _reduced_loss_candidates(specs: Sequence[DTensorSpec], reduction: int) -> list[OpStrategy]:
    """'sum' and 'mean': R... -> R; operands sharded along one broadcast dim -> P(sum), or P(avg) if even."""
    shape = elementwise_shape(specs)
    mesh_size = specs[0].mesh.size()
    candidates = [OpStrategy((R,) * len(specs), (R,))]
    for d in range(len(shape)):
        if reduction == REDUCTION_MEAN and shape[d] % mesh_size != 0:
            continue  # a mean of uneven pieces is no average of the local means
        inputs = tuple(aligned_placement(s.shape, shape, d) for s in specs)
        if any(isinstance(p, Shard) for p in inputs):
            candidates.append(OpStrategy(inputs, (AVG if reduction == REDUCTION_MEAN else SUM,)))
    return candidates


def with_reduction(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], reduction: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments with ``reduction`` replaced, wherever the schema puts it."""
    index = [a.name for a in op._schema.arguments].index("reduction")
    if index < len(args):
        return (*args[:index], reduction, *args[index + 1 :]), kwargs
    return args, {**kwargs, "reduction": reduction}


def _mean_as_sum(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, count: int) -> Any:
    """loss(reduction='sum') (S(d) -> P(sum), no data moves) / the global element count."""
    args, kwargs = with_reduction(op, args, kwargs, REDUCTION_SUM)
    return aten.div.Scalar(op(*args, **kwargs), count)


def loss_mean_decomposition(call: OpCall) -> Expansion | None:
    """A 'mean' over an unevenly sharded dim runs as the 'sum' loss divided by the element count."""
    if int(schema_arg(call, "reduction", REDUCTION_MEAN)) != REDUCTION_MEAN:
        return None
    shape = elementwise_shape(call.input_specs)
    mesh_size = call.input_specs[0].mesh.size()
    if all(shape[d] % mesh_size == 0 for d in sharded_dims(call.input_specs, shape)):
        return None  # even pieces: the rule's P(avg) is exact
    return functools.partial(_mean_as_sum, count=math.prod(shape))


@register_rule(*LOSSES, decompose=loss_mean_decomposition)
def loss_rule(call: OpCall) -> Sequence[OpStrategy]:
    """loss: 'none' S(d) -> S(d); 'sum' S(d) -> P(sum); 'mean' S(d) -> P(avg) over even shards; R -> R."""
    reduction = int(schema_arg(call, "reduction", REDUCTION_MEAN))
    if reduction == REDUCTION_NONE:
        return pointwise_candidates(call)
    return _reduced_loss_candidates(call.input_specs, reduction)


def _mean_backward_as_sum(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, count: int) -> Any:
    """The 'sum' backward of grad / count: the local kernel would divide by the local element count."""
    args, kwargs = with_reduction(op, args, kwargs, REDUCTION_SUM)
    grad = aten.div.Scalar(args[0], count)
    return op(grad, *args[1:], **kwargs)


def loss_backward_mean_decomposition(call: OpCall) -> Expansion | None:
    """A 'mean' backward with sharded operands runs as the 'sum' backward of the scaled gradient."""
    if int(schema_arg(call, "reduction", REDUCTION_MEAN)) != REDUCTION_MEAN:
        return None
    operands = call.input_specs[1:]
    shape = elementwise_shape(operands)
    if not sharded_dims(operands, shape):
        return None  # every operand whole: the local kernel divides by the global count
    return functools.partial(_mean_backward_as_sum, count=math.prod(shape))


@register_rule(*LOSS_BACKWARDS, decompose=loss_backward_mean_decomposition)
def loss_backward_rule(call: OpCall) -> Sequence[OpStrategy]:
    """(grad, self, target, ...): 'none' S(d) -> S(d); 'sum' R x S(d) x ... -> S(d); grad P x R... -> P.

    The shards of self become grad_input's; operands broadcast to a larger shape than self's stay R.
    """
    reduction = int(schema_arg(call, "reduction", REDUCTION_MEAN))
    if reduction == REDUCTION_NONE:
        return pointwise_candidates(call, linearity="multiplicative")
    operands = call.input_specs[1:]
    shape = operands[0].shape  # grad_input has self's shape
    candidates = [OpStrategy((R,) * (len(operands) + 1), (R,))]
    # 'mean' shards only through its decomposition: the local kernel divides by the local count.
    if reduction == REDUCTION_SUM and elementwise_shape(operands) == tuple(shape):
        for d in range(len(shape)):
            inputs = (R, *(aligned_placement(s.shape, shape, d) for s in operands))
            candidates.append(OpStrategy(inputs, (Shard(d),)))
    candidates += [OpStrategy((p,) + (R,) * len(operands), (p,)) for p in LINEAR_PARTIALS]
    return candidates


# ----- margin losses over classes: one term per sample --------------------------------------------
MARGIN_LOSSES = [aten.multi_margin_loss.default, aten.multilabel_margin_loss_forward.default]


def _per_sample(call: OpCall, first: int) -> tuple[DTensorSpec, int, tuple[Placement, ...]]:
    """(self, N, each operand's placement for a batch shard): S(0) for the per-sample operands
    from ``first`` on, R for the class weight (always the last tensor when given), R before ``first``."""
    specs = call.input_specs
    has_weight = isinstance(schema_arg(call, "weight"), DTensorSpec)
    sharded = tuple(
        R if i < first or (has_weight and i == len(specs) - 1) else Shard(0) for i in range(len(specs))
    )
    x = specs[first]
    return x, (x.shape[0] if x.ndim == 2 else 1), sharded


def _batch_shardable(x: DTensorSpec) -> bool:
    """torch's kernels return garbage (uninitialised memory) for an empty batch with 'sum' or 'mean',
    so the batch dim stays sharded only where no rank's piece is empty."""
    return x.ndim == 2 and no_empty_shards(x.shape[0], x.mesh.shape)


def _batch_sharded_unevenly(x: DTensorSpec, count: int) -> bool:
    return _batch_shardable(x) and sharded_on_batch(x) and count % x.mesh.size() != 0


def sharded_on_batch(x: DTensorSpec) -> bool:
    return any(p == Shard(0) and size > 1 for p, size in zip(x.placements, x.mesh.shape))


def _margin_mean_as_sum(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, count: int) -> Any:
    """The 'sum' loss / N; multilabel_margin's is_target output passes through."""
    args, kwargs = with_reduction(op, args, kwargs, REDUCTION_SUM)
    result = op(*args, **kwargs)
    if isinstance(result, (tuple, list)):
        return (aten.div.Scalar(result[0], count), *result[1:])
    return aten.div.Scalar(result, count)


def margin_mean_decomposition(call: OpCall) -> Expansion | None:
    """A 'mean' over an unevenly sharded batch runs as the 'sum' loss divided by N."""
    if int(schema_arg(call, "reduction", REDUCTION_MEAN)) != REDUCTION_MEAN:
        return None
    x, count, _ = _per_sample(call, 0)
    if not _batch_sharded_unevenly(x, count):
        return None
    return functools.partial(_margin_mean_as_sum, count=count)


@register_rule(*MARGIN_LOSSES, decompose=margin_mean_decomposition)
def margin_loss_rule(call: OpCall) -> Sequence[OpStrategy]:
    """(self (N, C), target...): S(0) -> S(0) 'none', P(sum) 'sum', P(avg) 'mean' (N even); R -> R."""
    x, count, sharded = _per_sample(call, 0)
    n_out = len(call.output_metas)
    candidates = [OpStrategy((R,) * len(sharded), (R,) * n_out)]
    if not _batch_shardable(x):
        return candidates
    reduction = int(schema_arg(call, "reduction", REDUCTION_MEAN))
    loss: Placement = {REDUCTION_NONE: Shard(0), REDUCTION_SUM: SUM, REDUCTION_MEAN: AVG}[reduction]
    if reduction != REDUCTION_MEAN or count % x.mesh.size() == 0:
        candidates.append(OpStrategy(sharded, (loss,) + (Shard(0),) * (n_out - 1)))  # is_target is (N, C)
    return candidates
