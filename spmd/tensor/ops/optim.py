"""Fused optimizers (``_fused_adam_``, ``_fused_adamw_``, ``_fused_sgd_``, ``_fused_adagrad_``).

They are pointwise on every shard, so each list position is decided on its own:
  (param, grad, states...):  every per-parameter tensor laid out as the param, R or S(d) per mesh dim;
                             a grad laid out otherwise is moved there (P(sum) is reduced, R is chunked)
  step counts, lr, grad_scale, found_inf (when DTensors):  R
  a partial param has no candidate (an Adam step is not linear), so it must be redistributed first.
The dispatcher then calls the fused kernel once on all the local tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spmd.tensor.ops.common import R
from spmd.tensor.ops.foreach import ListRule
from spmd.tensor.placement import Placement, Shard
from spmd.tensor.sharding.registry import register_rule
from spmd.tensor.sharding.vocabulary import OpCall, OpStrategy
from spmd.tensor.spec import DTensorSpec

aten = torch.ops.aten
PER_PARAMETER = frozenset(
    {"self", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "momentum_buffer_list", "state_sums"}
)
"""Arguments holding one tensor shaped like each parameter; the rest are scalars or step counts."""


def _input_arguments(call: OpCall) -> list[str]:
    """The argument name of each DTensor input of ``call``, in the order of ``call.input_specs``."""
    names: list[str] = []
    arguments = call.op._schema.arguments
    items = [(arguments[k].name, v) for k, v in enumerate(call.args)] + list(call.kwargs.items())
    for name, value in items:
        entries = value if isinstance(value, (list, tuple)) else [value]
        names.extend(name for entry in entries if isinstance(entry, DTensorSpec))
    return names


def fused_position_rule(call: OpCall) -> Sequence[OpStrategy]:
    """(param, grad, states..., steps): p x p x p... x R -> p for p in R, S(d) (pointwise per shard)."""
    param = call.input_specs[0]
    names = _input_arguments(call)
    options: list[Placement] = [R, *(Shard(d) for d in range(param.ndim))]
    return [OpStrategy(tuple(p if name in PER_PARAMETER else R for name in names), (p,)) for p in options]


for _name in ("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_"):
    _packet = getattr(aten, _name)
    register_rule(_packet)(ListRule(position_rule=fused_position_rule, scratch=("grads",)))
