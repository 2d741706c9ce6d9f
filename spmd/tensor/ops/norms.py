"""Batch and group normalisation. Statistics are taken per channel (batch norm) or per sample and
group (group norm), so the dims they reduce over stay whole and the others keep their shards.

Batch norm, input (N, C, *), per-channel params and stats (C):
  channel:      x S(1), every per-channel tensor S(0) -> out S(1), saved stats S(0)
                (only where no rank's piece of C is empty: the kernel rejects zero channels)
  eval mode (running statistics given, not training):  x S(d) for d != 1, params R -> out S(d)
                (where no piece is empty: the CPU backward kernel divides by the local count);
                x P(avg) -> out P(avg) (the map is affine, and only an average passes an offset)
  training with running statistics: the kernel updates running_mean/var in place, so a candidate
                must leave them where they are (a moved copy would take the update): all R, or
                channel shards when they are already S(0) on every mesh dim; in any other layout
                the call runs on replicated copies of them, which are then copied back in place
  backward (grad, x, w, running..., saved...):  channel shards -> S(1), S(0), S(0); eval mode
                S(d) -> S(d), P(sum), P(sum) (weight and bias grads sum over d); grad P -> P, P, P
renorm(x, p, dim, maxnorm): each slice along dim is rescaled by its own norm: S(dim) -> S(dim); R -> R
Group norm, input (N, C, *), stats (N, group):
  x S(0), params R -> out, mean, rstd S(0) (N is global in the arguments: the local call gets its own)
  backward (grad, x, mean, rstd, w):  S(0) -> S(0), P(sum), P(sum);  grad P -> P, P, P
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from spmd.tensor.dtensor import DTensor
from spmd.tensor.ops.common import LINEAR_PARTIALS, R
from spmd.tensor.ops.matrix import no_empty_shards
from spmd.tensor.placement import Partial, Placement, Shard
from spmd.tensor.sharding.registry import register_rule
from spmd.tensor.sharding.vocabulary import Expansion, OpCall, OpStrategy
from spmd.tensor.spec import DTensorSpec

aten = torch.ops.aten
SUM, AVG = Partial("sum"), Partial("avg")
S0, S1 = Shard(0), Shard(1)

RUNNING = ("running_mean", "running_var")
PER_CHANNEL = ("weight", "bias", *RUNNING, "save_mean", "save_invstd", "save_var", "reserve")


def spec_names(call: OpCall) -> list[str]:
    """The schema name of each DTensor argument, in the order of ``call.input_specs``."""
    names = []
    for index, argument in enumerate(call.op._schema.arguments):
        value = call.arg(index, argument.name)
        if isinstance(value, DTensorSpec):
            names.append(argument.name)
        elif isinstance(value, (list, tuple)):
            names += [argument.name for v in value if isinstance(v, DTensorSpec)]
    return names


def _strategy(
    names: Sequence[str], placement: Mapping[str, Placement], default: Placement, outs: Sequence[Placement]
) -> OpStrategy:
    return OpStrategy(tuple(placement.get(n, default) for n in names), tuple(outs))


def _channel_placements(
    call: OpCall, names: Sequence[str], x: DTensorSpec, sharded: dict[str, Placement]
) -> dict[str, Placement]:
    """``sharded`` for the input-shaped tensors, S(0) for every (C,)-shaped one, R for the rest
    (eval mode's empty saved statistics, batch_norm_backward's reserve)."""
    placement = dict(sharded)
    for name, spec in zip(names, call.input_specs):
        if name not in placement:
            placement[name] = S0 if tuple(spec.shape) == (x.shape[1],) else R
    return placement


def _training(call: OpCall, names: Sequence[str]) -> bool:
    """Whether the statistics come from the batch (else the running statistics are used)."""
    op = call.op
    if op in (aten._batch_norm_with_update.default,):
        return True
    if op in (aten._native_batch_norm_legit_no_training.default, aten._batch_norm_no_update.default):
        return False
    flag = "update" if op == aten.batch_norm_backward.default else ("train" if "backward" in str(op) else "training")
    for index, argument in enumerate(op._schema.arguments):
        if argument.name == flag:
            return bool(call.arg(index, flag))
    return True


def _running_stats_stay(call: OpCall, names: Sequence[str], placement: Placement) -> bool:
    """True when every running statistic already has ``placement`` on every mesh dim (so a
    candidate that keeps them there moves neither, and the in-place update lands in them)."""
    return all(
        all(p == placement for p in spec.placements) for name, spec in zip(names, call.input_specs) if name in RUNNING
    )


def _eval_shard_dims(x: DTensorSpec) -> list[int]:
    """The dims besides C that eval mode keeps sharded: only where no piece is empty, as the CPU
    backward kernel divides by the local element count (SIGFPE on an empty piece)."""
    return [d for d in range(x.ndim) if d != 1 and no_empty_shards(x.shape[d], x.mesh.shape)]


def _channel_shardable(x: DTensorSpec) -> bool:
    return x.ndim >= 2 and no_empty_shards(x.shape[1], x.mesh.shape)


def _running_stat_indices(op: Any) -> list[int]:
    return [i for i, a in enumerate(op._schema.arguments) if a.name in RUNNING]


def _with_replicated_running_stats(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run the op on replicated copies of the running statistics, then write the updated values
    back into the originals (each rank keeps its own piece of them)."""
    call_args = list(args)
    originals = [(i, call_args[i]) for i in _running_stat_indices(op) if isinstance(call_args[i], DTensor)]
    copies = []
    for i, stat in originals:
        copy = stat.redistribute(stat.device_mesh, [R] * stat.device_mesh.ndim)
        if copy is stat:
            copy = aten.clone.default(stat)
        call_args[i] = copy
        copies.append((stat, copy))
    result = op(*call_args, **kwargs)
    for stat, copy in copies:
        aten.copy_.default(stat, copy)
    return result


def running_stats_decomposition(call: OpCall) -> Expansion | None:
    """A training call whose running statistics no candidate can leave in place (mixed layouts)
    updates replicated copies and copies them back."""
    names = spec_names(call)
    if not (_training(call, names) and any(n in RUNNING for n in names)):
        return None
    if _running_stats_stay(call, names, R):
        return None
    if _channel_shardable(call.input_specs[0]) and _running_stats_stay(call, names, S0):
        return None
    return _with_replicated_running_stats


@register_rule(
    aten.native_batch_norm.default,
    aten._native_batch_norm_legit.default,
    aten._native_batch_norm_legit.no_stats,
    aten._native_batch_norm_legit_no_training.default,
    aten._batch_norm_with_update.default,
    aten._batch_norm_no_update.default,
    decompose=running_stats_decomposition,
)
def batch_norm_rule(call: OpCall) -> Sequence[OpStrategy]:
    """(x, w, b, running...) -> (out, stats...): channel shards; eval mode also S(d) and P(avg)."""
    names = spec_names(call)
    x = call.input_specs[0]
    training = _training(call, names)
    has_running = any(n in RUNNING for n in names)
    if not training and not has_running:
        return [_strategy(names, {}, R, (R,) * len(call.output_metas))]  # no statistics at all
    mutates = training and has_running
    stat_outs = [
        x.ndim >= 2 and meta is not None and tuple(meta.shape) == (x.shape[1],) for meta in call.output_metas[1:]
    ]
    candidates = []
    if not mutates or _running_stats_stay(call, names, R):
        candidates.append(_strategy(names, {}, R, (R,) * len(call.output_metas)))
    if _channel_shardable(x) and (not mutates or _running_stats_stay(call, names, S0)):
        outs = (S1, *(S0 if per_channel else R for per_channel in stat_outs))
        candidates.append(_strategy(names, _channel_placements(call, names, x, {"input": S1}), R, outs))
    if not training:
        rest = (R,) * len(stat_outs)
        candidates += [_strategy(names, {"input": Shard(d)}, R, (Shard(d), *rest)) for d in _eval_shard_dims(x)]
        candidates.append(_strategy(names, {"input": AVG}, R, (AVG, *rest)))
    return candidates


@register_rule(aten.native_batch_norm_backward.default, aten.batch_norm_backward.default)
def batch_norm_backward_rule(call: OpCall) -> Sequence[OpStrategy]:
    """(grad, x, w, running..., saved...) -> (dx, dw, db): channel shards -> S(1), S(0), S(0); eval mode
    S(d) -> S(d), P(sum), P(sum); grad P, the rest R -> P, P, P."""
    names = spec_names(call)
    x = call.input_specs[1]
    n_out = len(call.output_metas)
    candidates = [_strategy(names, {}, R, (R,) * n_out)]
    if _channel_shardable(x):
        channel = _channel_placements(call, names, x, {"grad_out": S1, "input": S1})
        candidates.append(_strategy(names, channel, R, (S1, S0, S0)[:n_out]))
    if not _training(call, names):
        for d in _eval_shard_dims(x):
            sharded = {"grad_out": Shard(d), "input": Shard(d)}
            candidates.append(_strategy(names, sharded, R, (Shard(d), SUM, SUM)[:n_out]))
    candidates += [_strategy(names, {"grad_out": p}, R, (p,) * n_out) for p in LINEAR_PARTIALS]
    return candidates


# ----- group norm ----------------------------------------------------------------------------------
def local_batch_size(
    args: list[Any], kwargs: dict[str, Any], decision: Any, out_spec: DTensorSpec
) -> tuple[list[Any], dict[str, Any]]:
    """group norm takes N (and C, HxW) as numbers: N becomes this rank's number of samples."""
    is_backward = len(args) > 9
    x = args[1] if is_backward else args[0]
    n_index = 5 if is_backward else 3
    return [*args[:n_index], x.shape[0], *args[n_index + 1 :]], kwargs


@register_rule(aten.native_group_norm.default, local_args=local_batch_size)
def group_norm_rule(call: OpCall) -> Sequence[OpStrategy]:
    """(x, w, b) -> (out, mean, rstd): x S(0), params R -> S(0), S(0), S(0); R -> R."""
    params = (R,) * (len(call.input_specs) - 1)
    return [OpStrategy((R, *params), (R, R, R)), OpStrategy((S0, *params), (S0, S0, S0))]


@register_rule(aten.native_group_norm_backward.default, local_args=local_batch_size)
def group_norm_backward_rule(call: OpCall) -> Sequence[OpStrategy]:
    """(grad, x, mean, rstd, w) -> (dx, dw, db): S(0) on the per-sample tensors -> S(0), P(sum), P(sum);
    grad P, the rest R -> P, P, P."""
    weight = (R,) * (len(call.input_specs) - 4)
    candidates = [OpStrategy((R, R, R, R, *weight), (R, R, R)), OpStrategy((S0, S0, S0, S0, *weight), (S0, SUM, SUM))]
    return candidates + [OpStrategy((p, R, R, R, *weight), (p, p, p)) for p in LINEAR_PARTIALS]


@register_rule(aten.renorm.default, aten.renorm_.default)
def renorm_rule(call: OpCall) -> Sequence[OpStrategy]:
    """renorm(x, p, dim, maxnorm): S(dim) -> S(dim) (the slices along dim are independent); R -> R."""
    x = call.input_specs[0]
    dim = int(call.arg(2, "dim")) % max(x.ndim, 1)
    return [OpStrategy((R,), (R,)), OpStrategy((Shard(dim),), (Shard(dim),))]
