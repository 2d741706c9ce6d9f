"""Ops whose every output element may depend on any input element, or whose arguments hold global
positions no shard can interpret: their rules ask for whole (replicated) inputs. A rule, unlike the
fallback, names the op's needs, and the verbose log shows the bytes gathered.

  equal, allclose -> a Python bool:          R x R -> nothing
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
from spmd.tensor.ops.registry import OpCall, OpStrategy, register_rule

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


@register_rule(aten.equal.default, aten.allclose.default)
def comparison_rule(call: OpCall) -> Sequence[OpStrategy]:
    """equal, allclose: R x R -> a bool (every rank compares the whole tensors, so all agree)."""
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
    aten.as_strided.default,
    aten.as_strided_copy.default,
    aten.as_strided_scatter.default,
    *CHUNKED_LINEAR_CROSS_ENTROPY,
)
def replicated_rule(call: OpCall) -> Sequence[OpStrategy]:
    """R ... -> R ...: the op needs whole inputs."""
    return [OpStrategy((R,) * len(call.input_specs), (R,) * len(call.output_metas))]


@register_rule(aten.hash_tensor.default)
def hash_tensor_rule(call: OpCall) -> Sequence[OpStrategy]:
    """hash_tensor(dim): S(d) -> S(d') for a kept dim d; R -> R; a hashed dim is whole."""
    ndim, dims, keepdim = reduction_args(call)
    return reduction_candidates(ndim, dims, keepdim, None)
