"""Ops that rearrange whole dims: permute, split, unbind, cat, stack, flip, roll, repeat, tril, triu.

None of them combines values, so every partial passes through (a zero written on every rank is
zero under each reduction). A shard survives on a dim the op does not cut, reverse, shift or copy:
  permute(p):           S(p[o]) -> S(o)
  split, chunk:         S(d) -> S(d) on every piece for d != split dim; the split dim is replicated
  unbind(dim):          S(d) -> S(d) before dim, S(d - 1) after it; S(dim) is refused (as torch does);
                        unbind_copy moves the shard off dim first
  cat(dim):             S(d) x ... x S(d) -> S(d) for d != dim;  P x ... x P -> P
  stack(dim):           S(d) x ... x S(d) -> S(d) before dim, S(d + 1) from it on
  unfold(dim, size, step): S(d) -> S(d) for d != dim (the window dim is new and whole); the
                        backward likewise (its input_sizes are made local)
  rot90(k, (a, b)):     S(d) -> S(d) off the plane; k = 1: S(a) -> S(b); k = 3: S(b) -> S(a); k = 0: same
  flip, roll(dims):     S(d) -> S(d) for d not flipped / rolled (roll without dims replicates all)
  repeat(r):            S(d) -> S(d + new leading dims) where r[d] == 1
  diagonal(d1, d2):     S(d) -> S(d') for the dims kept (the diagonal dims are replicated);
                        diagonal_backward the other way round (its zero fill keeps partials)
  tril, triu(k):        S(d) -> S(d) for every d, the last two included: the local call shifts the
                        diagonal by the shard's row offset minus its column offset
  _chunk_cat(tensors, dim, n): S(d) x ... -> S(d) for d < dim where no piece is empty (each row is
                        chunked and packed on its own; the zero padding keeps partials)
  repeat_interleave(counts): R -> R (the int form runs as unsqueeze/expand/reshape, which keep shards)
expand lives in reductions.py (it is the backward of every reduction).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from spmd.tensor.ops.common import PARTIALS, R, normalize_dim
from spmd.tensor.ops.matrix import no_empty_shards
from spmd.tensor.ops.views import local_view_size
from spmd.tensor.placement import Placement, Shard, format_placements
from spmd.tensor.sharding.registry import register_rule
from spmd.tensor.sharding.vocabulary import OpCall, OpStrategy
from spmd.tensor.spec import DTensorSpec, local_shape_and_offset

aten = torch.ops.aten


def _keep_dims(ndim: int, out_dim: dict[int, int], num_outputs: int = 1) -> list[OpStrategy]:
    """R -> R; S(d) -> S(out_dim[d]) for the dims in ``out_dim``; P -> P; the same on every output."""
    candidates = [OpStrategy((R,), (R,) * num_outputs)]
    candidates += [OpStrategy((Shard(d),), (Shard(o),) * num_outputs) for d, o in out_dim.items()]
    candidates += [OpStrategy((p,), (p,) * num_outputs) for p in PARTIALS]
    return candidates


def _dims_list(value: Any, ndim: int) -> list[int]:
    items = value if isinstance(value, (list, tuple)) else [value]
    return [normalize_dim(int(d), ndim) for d in items]


@register_rule(aten.permute.default, aten.permute_copy.default)
def permute_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(p[o]) -> S(o); R -> R; P -> P."""
    ndim = call.input_specs[0].ndim
    order = _dims_list(call.arg(1, "dims"), ndim)
    return _keep_dims(ndim, {d: o for o, d in enumerate(order)})


@register_rule(aten.split.Tensor, aten.split_with_sizes.default, aten.unsafe_split.Tensor,
               aten.unsafe_split_with_sizes.default, aten.split_copy.Tensor, aten.split_with_sizes_copy.default)
def split_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) -> S(d) on every piece for d != dim; the split dim is replicated first; P -> P."""
    ndim = call.input_specs[0].ndim
    dim = normalize_dim(call.arg(2, "dim", 0), ndim)
    return _keep_dims(ndim, {d: d for d in range(ndim) if d != dim}, len(call.output_metas))


@register_rule(aten.unbind.int, aten.unbind_copy.int)
def unbind_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) -> S(d) for d < dim, S(d - 1) for d > dim; P -> P. unbind_copy moves a shard off dim first;
    unbind (a view, and what iterating a DTensor calls) refuses to, as torch does."""
    spec = call.input_specs[0]
    ndim = spec.ndim
    dim = normalize_dim(call.arg(1, "dim", 0), ndim)
    if call.op == aten.unbind.int and any(isinstance(p, Shard) and p.dim == dim for p in spec.placements):
        raise NotImplementedError(
            f"unbind along dim {dim} of a tensor sharded on it {format_placements(spec.placements)} "
            f"of shape {list(spec.shape)} would have to gather that dim first, which unbind does not do "
            f"(torch.distributed.tensor refuses it too); redistribute dim {dim} to Replicate() first, "
            f"or use torch.unbind_copy. Sharding propagation failed for {call.op}"
        )
    out_dim = {d: d if d < dim else d - 1 for d in range(ndim) if d != dim}
    return _keep_dims(ndim, out_dim, len(call.output_metas))


def _joined(specs: Sequence[DTensorSpec], ndim: int, dims: dict[int, int]) -> list[OpStrategy]:
    """cat / stack: every input takes one placement; legacy empty 1-d inputs of cat stay replicated."""

    def each(p: Placement) -> tuple[Placement, ...]:
        return tuple(R if isinstance(p, Shard) and s.ndim != ndim else p for s in specs)

    candidates = [OpStrategy((R,) * len(specs), (R,))]
    candidates += [OpStrategy(each(Shard(d)), (Shard(o),)) for d, o in dims.items()]
    candidates += [OpStrategy(each(p), (p,)) for p in PARTIALS]
    return candidates


@register_rule(aten.cat.default)
def cat_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) x ... x S(d) -> S(d) for d != dim; the cat dim is replicated first; P x ... x P -> P."""
    meta = call.output_metas[0]
    assert meta is not None
    ndim = len(meta.shape)
    dim = normalize_dim(call.arg(1, "dim", 0), ndim)
    return _joined(call.input_specs, ndim, {d: d for d in range(ndim) if d != dim})


@register_rule(aten._chunk_cat.default)
def chunk_cat_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) x ... x S(d) -> S(d) for the dims before dim (the chunked and packed ones are whole) where
    no piece is empty (the kernel rejects empty tensors); P -> P."""
    first = call.input_specs[0]
    dim = normalize_dim(call.arg(1, "dim"), first.ndim)
    kept = [d for d in range(dim) if no_empty_shards(first.shape[d], first.mesh.shape)]
    return _joined(call.input_specs, first.ndim, {d: d for d in kept})


@register_rule(aten.stack.default)
def stack_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) x ... x S(d) -> S(d) for d < dim, S(d + 1) from dim on; P x ... x P -> P."""
    ndim = call.input_specs[0].ndim
    dim = normalize_dim(call.arg(1, "dim", 0), ndim + 1)
    return _joined(call.input_specs, ndim, {d: d if d < dim else d + 1 for d in range(ndim)})


@register_rule(aten.diagonal.default, aten.diagonal_copy.default)
def diagonal_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) -> S(d') for d not one of the two diagonal dims (d' counts the dims left); P -> P."""
    ndim = call.input_specs[0].ndim
    pair = {normalize_dim(call.arg(2, "dim1", 0), ndim), normalize_dim(call.arg(3, "dim2", 1), ndim)}
    kept = [d for d in range(ndim) if d not in pair]
    return _keep_dims(ndim, {d: i for i, d in enumerate(kept)})


@register_rule(aten.diagonal_backward.default, local_args=local_view_size)
def diagonal_backward_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(i) -> S(kept[i]) for the grad's dims before its last (the diagonal, replicated); P -> P (zero fill)."""
    ndim = len(call.arg(1, "input_sizes"))
    pair = {normalize_dim(call.arg(3, "dim1"), ndim), normalize_dim(call.arg(4, "dim2"), ndim)}
    kept = [d for d in range(ndim) if d not in pair]
    return _keep_dims(ndim - 1, dict(enumerate(kept)))


@register_rule(aten.rot90.default)
def rot90_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) -> S(d) off the plane; in it, k = 1 turns S(a) into S(b), k = 3 S(b) into S(a) (the dim that is
    not flipped), k = 0 keeps both, k = 2 flips both; P -> P."""
    ndim = call.input_specs[0].ndim
    a, b = _dims_list(call.arg(2, "dims", [0, 1]), ndim)
    k = int(call.arg(1, "k", 1)) % 4
    out_dim = {d: d for d in range(ndim) if d not in (a, b)}
    out_dim.update({0: {a: a, b: b}, 1: {a: b}, 2: {}, 3: {b: a}}[k])
    return _keep_dims(ndim, out_dim)


@register_rule(aten.unfold.default, aten.unfold_copy.default)
def unfold_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) -> S(d) for d != dim (windows of dim are cut across shards, so it is whole); P -> P."""
    ndim = call.input_specs[0].ndim
    dim = normalize_dim(call.arg(1, "dimension"), ndim)
    return _keep_dims(ndim, {d: d for d in range(ndim) if d != dim})


@register_rule(aten.unfold_backward.default, local_args=local_view_size)
def unfold_backward_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) -> S(d) for d != dim and not the window dim (the grad's last); P -> P (the fill is zero)."""
    ndim = len(call.arg(1, "input_sizes"))
    dim = normalize_dim(call.arg(2, "dim"), ndim)
    return _keep_dims(ndim + 1, {d: d for d in range(ndim) if d != dim})


@register_rule(aten.flip.default)
def flip_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) -> S(d) for d not flipped; a flipped dim is replicated first; P -> P."""
    ndim = call.input_specs[0].ndim
    flipped = _dims_list(call.arg(1, "dims"), ndim)
    return _keep_dims(ndim, {d: d for d in range(ndim) if d not in flipped})


@register_rule(aten.roll.default)
def roll_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) -> S(d) for d not rolled; without dims the flattened tensor rolls, so all dims replicate."""
    ndim = call.input_specs[0].ndim
    dims_arg = call.arg(2, "dims", [])
    rolled = _dims_list(dims_arg, ndim) if dims_arg not in (None, [], ()) else list(range(ndim))
    return _keep_dims(ndim, {d: d for d in range(ndim) if d not in rolled})


@register_rule(aten.repeat.default)
def repeat_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) -> S(d + new leading dims) where the repeat count of d is 1; others replicate; P -> P."""
    ndim = call.input_specs[0].ndim
    repeats = list(call.arg(1, "repeats"))
    lead = len(repeats) - ndim
    return _keep_dims(ndim, {d: lead + d for d in range(ndim) if repeats[lead + d] == 1})


def local_diagonal(
    args: list[Any], kwargs: dict[str, Any], decision: Any, out_spec: DTensorSpec
) -> tuple[list[Any], dict[str, Any]]:
    """tril/triu on a shard: global (i, j) is local (i - row offset, j - column offset), so the
    local diagonal is ``k + row offset - column offset``."""
    _, offset = local_shape_and_offset(out_spec.shape, out_spec.mesh, out_spec.placements)
    diagonal = args[1] if len(args) > 1 else kwargs.get("diagonal", 0)
    rest = {k: v for k, v in kwargs.items() if k != "diagonal"}
    return [args[0], int(diagonal) + offset[-2] - offset[-1]], rest


@register_rule(aten.tril.default, aten.triu.default, aten.tril_.default, aten.triu_.default,
               local_args=local_diagonal)
def triangle_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) -> S(d) for every dim (the diagonal moves with the shard's offset); R -> R; P -> P."""
    ndim = call.input_specs[0].ndim
    return _keep_dims(ndim, {d: d for d in range(ndim)})


@register_rule(aten.repeat_interleave.Tensor)
def repeat_interleave_counts_rule(call: OpCall) -> Sequence[OpStrategy]:
    """repeat_interleave(counts) -> positions: R -> R (each position depends on every count before it).

    ``x.repeat_interleave(n, dim)`` with an int ``n`` runs as unsqueeze -> expand -> reshape, which keep
    their shards; with a tensor of counts it is ``index_select(x, dim, repeat_interleave(counts))``.
    """
    return [OpStrategy((R,), (R,))]
