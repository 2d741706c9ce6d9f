"""Random ops: each rank draws its piece of the global tensor (``spmd.tensor.random.draw_local``).

In "torch" mode a rank draws the whole global tensor and keeps its piece; in "counter" mode it
draws only the counter stream's tiles its piece touches (see spmd/tensor/random.py).

  uniform_, normal_, bernoulli_, ... (in place):  self keeps its placement (a partial gets the
                                                  value on coordinate 0, as distribute_tensor does)
  rand_like, randn_like, randint_like:            S(d) -> S(d); R -> R; P -> R
  native_dropout(x):                              S(d) -> S(d), mask S(d); R -> R; P -> P, mask R
  native_dropout_backward(grad, mask):            elementwise, linear in grad
  multinomial(p (rows, k)):                       S(0) -> S(0) where p is already row-sharded (rows
                                                  are independent); otherwise R -> R (categories whole)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from spmd.tensor.ops.common import LINEAR_PARTIALS, PARTIALS, R, identity_candidates, pointwise_candidates
from spmd.tensor.placement import Placement, Shard
from spmd.tensor.random import draw_local
from spmd.tensor.sharding.registry import register_rule
from spmd.tensor.sharding.vocabulary import OpCall, OpStrategy
from spmd.tensor.spec import DTensorSpec

aten = torch.ops.aten

_IN_PLACE_FILLS = {
    aten.uniform_.default: "uniform_",
    aten.normal_.default: "normal_",
    aten.bernoulli_.float: "bernoulli_",
    aten.exponential_.default: "exponential_",
    aten.log_normal_.default: "log_normal_",
    aten.cauchy_.default: "cauchy_",
    aten.geometric_.default: "geometric_",
    aten.random_.default: "random_",
    aten.random_.to: "random_",
    getattr(aten.random_, "from"): "random_",
}
_LIKE_FILLS = {
    aten.rand_like.default: "uniform_",
    aten.randn_like.default: "normal_",
    aten.randint_like.default: "random_",  # randint_like(x, high) is random_(0, high)
    aten.randint_like.low_dtype: "random_",  # randint_like(x, low, high) is random_(low, high)
}


def _fill_in_place(
    op: Any, args: list[Any], kwargs: dict[str, Any], inputs: tuple[DTensorSpec, ...], outputs: tuple[Any, ...]
) -> torch.Tensor:
    spec = inputs[0]
    rest = {k: v for k, v in kwargs.items() if k != "generator"}
    fill = _IN_PLACE_FILLS[op]
    fresh = draw_local(spec.mesh, spec.shape, spec.tensor_meta.dtype, spec.placements, fill, *args[1:], **rest)
    local: torch.Tensor = args[0]
    return local.copy_(fresh)


@register_rule(*_IN_PLACE_FILLS, local_impl=_fill_in_place)
def in_place_fill_rule(call: OpCall) -> Sequence[OpStrategy]:
    """p -> p: the new values replace the old ones wherever they are."""
    return identity_candidates(call.input_specs[0].ndim)


def _like(
    op: Any, args: list[Any], kwargs: dict[str, Any], inputs: tuple[DTensorSpec, ...], outputs: tuple[Any, ...]
) -> torch.Tensor:
    out: DTensorSpec = outputs[0]
    bounds = [int(b) for b in args[1:3]]
    if op is aten.randint_like.default:
        bounds = [0, *bounds]
    return draw_local(out.mesh, out.shape, out.tensor_meta.dtype, out.placements, _LIKE_FILLS[op], *bounds)


@register_rule(*_LIKE_FILLS, local_impl=_like)
def like_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) -> S(d); R -> R; P -> R (only the shape of the input matters)."""
    ndim = call.input_specs[0].ndim
    options: list[Placement] = [R, *(Shard(d) for d in range(ndim))]
    return [OpStrategy((p,), (p,)) for p in options] + [OpStrategy((p,), (R,)) for p in PARTIALS]


def _dropout(
    op: Any, args: list[Any], kwargs: dict[str, Any], inputs: tuple[DTensorSpec, ...], outputs: tuple[Any, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    local: torch.Tensor = args[0]
    p = float(args[1] if len(args) > 1 else kwargs["p"])
    train = args[2] if len(args) > 2 else kwargs.get("train")
    mask_spec: DTensorSpec = outputs[1]
    if train is False:
        return local.clone(), torch.ones_like(local, dtype=torch.bool)
    keep = 1.0 - p
    mask = draw_local(mask_spec.mesh, mask_spec.shape, local.dtype, mask_spec.placements, "bernoulli_", keep)
    scale = 1.0 / keep if keep > 0 else 0.0
    return local * mask * scale, mask.bool()


@register_rule(aten.native_dropout.default, local_impl=_dropout)
def dropout_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) -> S(d) with mask S(d); R -> R; P(sum|avg) -> P with a replicated mask (linear in x)."""
    ndim = call.input_specs[0].ndim
    options: list[Placement] = [R, *(Shard(d) for d in range(ndim))]
    return [OpStrategy((p,), (p, p)) for p in options] + [OpStrategy((p,), (p, R)) for p in LINEAR_PARTIALS]


@register_rule(aten.native_dropout_backward.default)
def dropout_backward_rule(call: OpCall) -> Sequence[OpStrategy]:
    """grad x mask: S(d) x S(d) -> S(d); P x R -> P (linear in the gradient)."""
    return pointwise_candidates(call, linearity="multiplicative")


def _multinomial(
    op: Any, args: list[Any], kwargs: dict[str, Any], inputs: tuple[DTensorSpec, ...], outputs: tuple[Any, ...]
) -> torch.Tensor:
    """This rank's rows of the samples one device draws: the same random stream, used the same way.

    torch samples without replacement (or one sample) as ``argmax``/``topk`` of ``p / q`` for
    ``q ~ Exp(1)`` of p's shape; with replacement it draws one float64 uniform per sample, row by row,
    and takes the first category whose normalised cumulative probability reaches it. Drawing those
    global tensors with ``draw_local`` and keeping this rank's rows gives one device's samples.
    """
    local: torch.Tensor = args[0]
    num_samples = int(args[1] if len(args) > 1 else kwargs["num_samples"])
    replacement = bool(args[2] if len(args) > 2 else kwargs.get("replacement", False))
    spec, out = inputs[0], outputs[0]
    if local.numel() and (not bool(torch.isfinite(local).all()) or bool((local < 0).any())):
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
    if local.numel() and bool((local.sum(-1) <= 0).any()):
        raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
    if not replacement or num_samples == 1:
        q = draw_local(spec.mesh, spec.shape, spec.tensor_meta.dtype, spec.placements, "exponential_", 1.0)
        scores = local / q
        if num_samples == 1:
            return scores.argmax(-1, keepdim=True)
        return scores.topk(num_samples).indices
    uniforms = draw_local(out.mesh, out.shape, torch.float64, out.placements, "uniform_", 0.0, 1.0)
    accumulate = torch.float64 if local.dtype == torch.float64 else torch.float32
    cumulative = local.to(accumulate).cumsum(-1)
    cumulative = cumulative / cumulative[..., -1:]
    cumulative[..., -1] = 1.0  # the last category takes whatever rounding left above the total
    return torch.searchsorted(cumulative.to(torch.float64), uniforms, side="left")


@register_rule(aten.multinomial.default, local_impl=_multinomial)
def multinomial_rule(call: OpCall) -> Sequence[OpStrategy]:
    """p (rows, k): S(0) -> S(0) when p is row-sharded already; R -> R; a category shard or a
    partial is gathered to R (not moved onto the rows), as torch does."""
    spec = call.input_specs[0]
    candidates = [OpStrategy((R,), (R,))]
    if spec.ndim == 2 and Shard(0) in spec.placements:
        candidates.append(OpStrategy((Shard(0),), (Shard(0),)))
    return candidates
