"""Ops whose every output element may depend on any input element, or whose arguments hold global
positions no shard can interpret: their rules ask for whole (replicated) inputs. A rule, unlike the
fallback, names the op's needs, and the verbose log shows the bytes gathered.

  equal, allclose -> a Python bool:          R x R -> nothing (equal of sharded operands: eq().all())
  is_same_size -> a Python bool:             global shapes compared; nothing read or moved
  block_diag, linspace/logspace (tensor ends), nonzero_static, segment_reduce,
  _unsafe_masked_index (+ put), _embedding_bag (+ backwards), _ctc_loss (+ backward),
  as_strided (+ copy, scatter), linear_cross_entropy's chunked custom ops:  R ... -> R ...
  hash_tensor(dim):                          S(d) -> S(d') for a dim it keeps (each hash is of one
                                             row); a hashed dim is whole
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

try:  # defines the torch_nn custom ops that F.linear_cross_entropy dispatches to
    import torch.nn.modules.linear_cross_entropy
except ImportError:  # an older torch without them
    pass

from spmd.tensor.ops.common import R
from spmd.tensor.ops.reductions import reduction_args, reduction_candidates
from spmd.tensor.sharding.registry import register_rule
from spmd.tensor.sharding.vocabulary import Expansion, OpCall, OpStrategy

aten = torch.ops.aten


def _custom_ops(namespace: str, names: Sequence[str]) -> list[Any]:
    """The default overloads of those custom ops this torch defines."""
    ops = getattr(torch.ops, namespace)
    return [getattr(ops, name).default for name in names if hasattr(ops, name)]


# linear_cross_entropy's chunked forms: their losses divide by global counts and their backward
# re-runs the whole chunked computation, so they need whole inputs.
CHUNKED_LINEAR_CROSS_ENTROPY = _custom_ops(
    "torch_nn", ["_linear_cross_entropy_batch_chunked", "_linear_cross_entropy_batch_chunked_no_reduction"]
)


def _same_size(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return tuple(args[0].shape) == tuple(args[1].shape)


@register_rule(aten.is_same_size.default, answer=_same_size)
def same_size_rule(call: OpCall) -> Sequence[OpStrategy]:
    """is_same_size compares global shapes (a plain tensor's own shape) in its ``answer``: no data
    is read or moved, so this rule (R x R -> a bool) is never asked."""
    return [OpStrategy((R,) * len(call.input_specs), ())]


def _equal_shard_by_shard(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    # eq lays the operands out alike (a replicated one is cut locally), all() reduces to one flag
    flag: Any = torch.eq(args[0], args[1]).all()  # a DTensor
    return bool(flag.full_tensor().item())


def _equal_decomposition(call: OpCall) -> Expansion | None:
    """Different shapes are unequal with nothing read; sharded operands are compared where they lie."""
    if len(call.input_specs) != 2:
        return None
    a, b = call.input_specs
    if tuple(a.shape) != tuple(b.shape):
        return lambda op, args, kwargs: False
    if all(p == R for s in (a, b) for p in s.placements):
        return None  # compared locally by the rule
    return _equal_shard_by_shard


@register_rule(aten.equal.default, decompose=_equal_decomposition)
def equal_rule(call: OpCall) -> Sequence[OpStrategy]:
    """equal: R x R -> a bool; sharded operands run as eq(a, b).all(): one small all_reduce, as in torch."""
    return [OpStrategy((R,) * len(call.input_specs), ())]


@register_rule(aten.allclose.default)
def allclose_rule(call: OpCall) -> Sequence[OpStrategy]:
    """allclose: R x R -> a bool (every rank compares the whole tensors, so all agree)."""
    return [OpStrategy((R,) * len(call.input_specs), ())]


@register_rule(
    aten.block_diag.default,
    aten.linspace.Tensor_Tensor,
    aten.linspace.Tensor_Scalar,
    aten.linspace.Scalar_Tensor,
    aten.logspace.Tensor_Tensor,
    aten.logspace.Tensor_Scalar,
    aten.logspace.Scalar_Tensor,
    aten.nonzero_static.default,
    aten.segment_reduce.default,
    aten._segment_reduce_backward.default,
    aten._unsafe_masked_index.default,
    aten._unsafe_masked_index_put_accumulate.default,
    aten._embedding_bag.default,
    aten._embedding_bag_forward_only.default,
    aten._embedding_bag_backward.default,
    aten._embedding_bag_dense_backward.default,
    aten._embedding_bag_per_sample_weights_backward.default,
    aten._ctc_loss.default,
    aten._ctc_loss.Tensor,
    aten._ctc_loss_backward.default,
    aten._ctc_loss_backward.Tensor,
    *CHUNKED_LINEAR_CROSS_ENTROPY,
)
def replicated_rule(call: OpCall) -> Sequence[OpStrategy]:
    """R ... -> R ...: the op needs whole inputs."""
    return [OpStrategy((R,) * len(call.input_specs), (R,) * len(call.output_metas))]


@register_rule(aten.as_strided.default, aten.as_strided_copy.default, aten.as_strided_scatter.default)
def as_strided_rule(call: OpCall) -> Sequence[OpStrategy]:
    """R -> R, reading memory as one device would, or refused.

    as_strided addresses memory: the storage offset counts from the base the tensor shares memory
    with, and the strides walk that memory's layout. A replicated input's local tensor shares memory
    as one device's tensor would (a view of a replicated DTensor is a view of its local tensor). A
    sharded or partial input is gathered into a fresh contiguous buffer first, which matches only
    when the DTensor is laid out contiguously and no offset is given; otherwise the call is refused
    rather than silently reading other values (except the offset 0 autograd passes back in
    as_strided's backward: the DTensor's own start).
    """
    offset_index = 4 if call.op is aten.as_strided_scatter.default else 3
    offset = call.arg(offset_index, "storage_offset")
    in_backward = torch._C._current_graph_task_id() != -1
    spec = call.input_specs[0]
    explicit_offset = offset is not None and not (offset == 0 and in_backward)
    if not spec.is_replicated() and (explicit_offset or not spec.tensor_meta.contiguous):
        what = "an explicit storage_offset" if explicit_offset else f"the non-contiguous strides {spec.stride}"
        raise NotImplementedError(
            f"{call.op} on a DTensor laid out as {spec}, with {what}: as_strided reads memory (the offset "
            "counts from the tensor's base, the strides walk its layout), and gathering the shards would make "
            "a fresh contiguous buffer where it reads other values. Call x.redistribute(mesh, [Replicate()] * "
            "mesh.ndim) first (it then reads that replicated tensor's memory), or index/narrow/.contiguous() "
            "instead"
        )
    return replicated_rule(call)


@register_rule(aten.hash_tensor.default)
def hash_tensor_rule(call: OpCall) -> Sequence[OpStrategy]:
    """hash_tensor(dim): S(d) -> S(d') for a kept dim d; R -> R; a hashed dim is whole."""
    ndim, dims, keepdim = reduction_args(call)
    return reduction_candidates(ndim, dims, keepdim, None)
