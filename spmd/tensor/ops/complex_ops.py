"""Complex numbers: the views between a complex tensor and its (real, imag) pairs, and the ops that
build or conjugate complex values (what rotary embeddings use).

A complex value is the pair in the last dim of size 2 of its real view, so that dim is never cut;
every other dim keeps its shard. Real and imaginary parts add independently, so sum/avg partials
pass through; max/min have no meaning on complex values and are reduced first.
  view_as_complex:   S(d) -> S(d) for d < last (the pair dim of size 2 is whole); P(sum|avg) -> P
  view_as_real:      S(d) -> S(d) (the new last dim is whole on every rank); P(sum|avg) -> P
  _conj, conj_physical, resolve_conj:  p -> p for S, R, P(sum|avg) (conjugation is real-linear);
                     _conj and _neg_view compute their values (see ``materialized_conj_or_neg``)
  complex(re, im):   pointwise; P x P -> P (sum|avg) as for add
  polar(abs, angle), angle: pointwise; partials are reduced first
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from spmd.tensor.ops.common import LINEAR_PARTIALS, R, identity_candidates, pointwise_candidates
from spmd.tensor.placement import Shard
from spmd.tensor.sharding.registry import register_rule
from spmd.tensor.sharding.vocabulary import OpCall, OpStrategy
from spmd.tensor.spec import DTensorSpec

aten = torch.ops.aten


def local_complex_view(
    args: list[Any], kwargs: dict[str, Any], decision: Any, out_spec: DTensorSpec
) -> tuple[list[Any], dict[str, Any]]:
    """A shard laid out unlike the global tensor (odd strides after a gather) is made contiguous
    first, as ``view`` does, since view_as_complex needs even strides and a unit last stride."""
    local = args[0]
    if local.stride(-1) != 1 or any(s % 2 for s in local.stride()[:-1]) or local.storage_offset() % 2:
        args = [local.contiguous(), *args[1:]]
    return args, kwargs


@register_rule(aten.view_as_complex.default, aten.view_as_complex_copy.default, local_args=local_complex_view)
def view_as_complex_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) -> S(d) for every dim but the last (the (re, im) pair); R -> R; P(sum|avg) -> P."""
    ndim = call.input_specs[0].ndim
    candidates = [OpStrategy((R,), (R,))]
    candidates += [OpStrategy((Shard(d),), (Shard(d),)) for d in range(ndim - 1)]
    return candidates + [OpStrategy((p,), (p,)) for p in LINEAR_PARTIALS]


@register_rule(aten.view_as_real.default, aten.view_as_real_copy.default)
def view_as_real_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) -> S(d); R -> R; P(sum|avg) -> P: the new last dim is whole on every rank."""
    return identity_candidates(call.input_specs[0].ndim, partials=LINEAR_PARTIALS)


def materialized_conj_or_neg(
    op: Any, args: list[Any], kwargs: dict[str, Any], input_specs: tuple[DTensorSpec, ...], output_specs: tuple[Any, ...]
) -> torch.Tensor:
    """The conjugated (negated) values themselves, not a view with torch's lazy conj (neg) bit.

    Inside ``__torch_dispatch__`` torch skips the kernels that honour those bits, so a shard that
    carried one would be read as if it had none (``x * y.conj()`` would multiply by ``y``). The
    price: the result does not alias its input, so a write into ``x.conj()`` does not reach ``x``.
    """
    local = args[0]
    return torch.conj_physical(local) if op is aten._conj.default else torch.neg(local)


@register_rule(aten._conj.default, aten._neg_view.default, local_impl=materialized_conj_or_neg)
@register_rule(aten.conj_physical.default, aten._conj_physical.default, aten.conj_physical_.default,
               aten.resolve_conj.default,
               aten.resolve_neg.default)
def conj_rule(call: OpCall) -> Sequence[OpStrategy]:
    """p -> p for S, R and P(sum|avg): conj(a + b) = conj(a) + conj(b) (and so for negation)."""
    return identity_candidates(call.input_specs[0].ndim, partials=LINEAR_PARTIALS)


@register_rule(aten.complex.default)
def complex_rule(call: OpCall) -> Sequence[OpStrategy]:
    """complex(S(d), S(d)) -> S(d); P x P -> P (sum|avg): re and im add independently."""
    return pointwise_candidates(call, linearity="additive")


@register_rule(aten.polar.default, aten.angle.default)
def polar_rule(call: OpCall) -> Sequence[OpStrategy]:
    """polar(S(d), S(d)) -> S(d), angle(S(d)) -> S(d); partial inputs are reduced first (not linear)."""
    return pointwise_candidates(call)
