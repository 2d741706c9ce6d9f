"""Elementwise ops: any matching shard of broadcast operands; partials only where the op is linear.

Algebra (per mesh dim, broadcasting aligned from the right):
  unary f:    S(d) -> S(d); R -> R; P must be reduced first (relu, exp, ...)
  neg, x*c:   additionally P(sum|avg) -> P
  add, sub, rsub:  S(d) x S(d) -> S(d); P x P -> P (sum with a scalar operand only for avg)
  log_sigmoid_forward -> (out, buffer), log_sigmoid_backward (grad, x, buffer): pointwise (the backward
              linear in grad); a buffer that is not x-shaped (CUDA leaves it empty) is R
  fill(x, v): S(d) -> S(d); R -> R; P(avg|max|min) -> same P (every rank holds v); P(sum) -> R;
              v a DTensor must be R
  fill_(x, v): p -> p, a sum-partial holding v on coordinate 0 (x's values are never read: no traffic)
  maximum:    P(max) x P(max) -> P(max); P(max|min) x R -> same P; R x P alike (monotone in each operand);
              minimum alike with P(min) x P(min) -> P(min); clamp_min/clamp_max with a tensor bound alike
  mul:        P x R -> P; R x P -> P
  div:        P x R -> P
  frexp:      S(d) -> S(d), S(d) (mantissa, exponent)
  glu(dim):   S(d) -> S(d) for d != dim (dim is cut in halves that pair up); backward alike, P(grad) -> P
  prelu(x, w): pointwise with w broadcast; backward: a dim w is broadcast along -> grad_w P(sum)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from spmd.tensor.ops.common import LINEAR_PARTIALS, PARTIALS, R, normalize_dim, pointwise_candidates
from spmd.tensor.placement import Partial, Placement, Shard
from spmd.tensor.sharding.registry import register_rule
from spmd.tensor.sharding.vocabulary import OpCall, OpStrategy
from spmd.tensor.spec import DTensorSpec

aten = torch.ops.aten
SUM = Partial("sum")

# fmt: off
UNARY_OPS = [
    "abs", "acos", "asin", "atan", "ceil", "cos", "cosh", "erf", "exp", "expm1", "floor", "log", "log1p",
    "log2", "reciprocal", "relu", "round", "rsqrt", "sigmoid", "sign", "sin", "sinh", "sqrt", "square", "tan",
    "tanh", "trunc", "gelu", "silu", "bitwise_not", "logical_not", "isnan", "isinf", "isfinite", "sgn",
    "signbit", "nan_to_num", "clamp", "clamp_min", "clamp_max", "hardtanh", "leaky_relu", "elu", "softplus",
    "mish", "hardswish", "hardsigmoid", "logit", "erfinv", "digamma", "lgamma", "frac", "deg2rad", "rad2deg",
    "acosh", "asinh", "atanh", "erfc", "exp2", "log10", "sinc", "i0", "isposinf", "isneginf", "celu",
    "hardshrink", "softshrink", "polygamma", "mvlgamma", "special_i0e", "special_i1", "special_i1e",
    "special_airy_ai", "special_bessel_j0", "special_bessel_j1", "special_bessel_y0", "special_bessel_y1",
    "special_modified_bessel_i0", "special_modified_bessel_i1", "special_modified_bessel_k0",
    "special_modified_bessel_k1", "special_scaled_modified_bessel_k0", "special_scaled_modified_bessel_k1",
    "special_spherical_bessel_j0", "special_entr", "special_erfcx", "special_log_ndtr", "special_ndtri",
    "special_ndtr",
]
BINARY_NONLINEAR_OPS = [
    "pow", "eq", "ne", "lt", "le", "gt", "ge", "atan2", "logical_and", "logical_or",
    "remainder", "fmod", "bitwise_and", "bitwise_or", "bitwise_xor", "floor_divide", "addcmul", "addcdiv",
    "lerp", "hypot", "copysign", "xlogy", "fmax", "fmin", "heaviside", "logaddexp", "nextafter",
    "hardtanh_backward", "leaky_relu_backward", "elu_backward", "softplus_backward", "mish_backward",
    "hardswish_backward", "hardsigmoid_backward", "logit_backward", "igamma", "igammac", "ldexp", "logical_xor",
    "logaddexp2", "special_xlog1py", "special_zeta", "special_chebyshev_polynomial_t",
    "special_chebyshev_polynomial_u", "special_chebyshev_polynomial_v", "special_chebyshev_polynomial_w",
    "special_shifted_chebyshev_polynomial_t", "special_shifted_chebyshev_polynomial_u",
    "special_shifted_chebyshev_polynomial_v", "special_shifted_chebyshev_polynomial_w",
    "special_hermite_polynomial_h", "special_hermite_polynomial_he", "special_laguerre_polynomial_l",
    "special_legendre_polynomial_p",
]
# fmt: on


def _packets(names: Sequence[str], *, modes: bool = True) -> list[object]:
    """Functional and in-place overloads of each aten op (``out=`` overloads are not handled yet).

    With ``modes=False`` the rounding-mode overloads (``div.Tensor_mode``) are left out: they are
    not linear, so they must not share the linear rule.
    """
    found = []
    for name in names:
        for variant in (name, name + "_"):
            packet = getattr(aten, variant, None)
            if packet is None:
                continue
            for overload in packet.overloads():
                if "out" in overload or (not modes and "mode" in overload):
                    continue
                found.append(getattr(packet, overload))
    return found


# clamp_min/clamp_max with a tensor bound are maximum/minimum (see their rules below)
_TENSOR_BOUND_CLAMPS = {aten.clamp_min.Tensor, aten.clamp_min_.Tensor, aten.clamp_max.Tensor, aten.clamp_max_.Tensor}


@register_rule(
    *(
        op
        for op in _packets(UNARY_OPS + BINARY_NONLINEAR_OPS + ["threshold", "gelu_backward", "sigmoid_backward", "tanh_backward"])
        if op not in _TENSOR_BOUND_CLAMPS
    ),
    aten.div.Tensor_mode,
    aten.div.Scalar_mode,
    aten.div_.Tensor_mode,
    aten.div_.Scalar_mode,
    "prims::fma.default",  # inductor's decomposition of lerp (a compiled AdamW)
    float_values_matter=False,
)
def nonlinear_rule(call: OpCall) -> Sequence[OpStrategy]:
    """f(S(d), ...) -> S(d): partial inputs are reduced before the op."""
    return pointwise_candidates(call)


def _extremum_candidates(call: OpCall, keeps: str) -> list[OpStrategy]:
    """maximum/minimum are monotone in each operand, so a max- or min-partial passes through when
    the other operand is replicated, and ``keeps`` (max for maximum) passes when both are partial."""
    candidates = pointwise_candidates(call)
    n = len(call.input_specs)
    for op in ("max", "min"):
        p = Partial(op)
        candidates += [OpStrategy(tuple(p if j == i else R for j in range(n)), (p,)) for i in range(n)]
    if n == 2:
        candidates.append(OpStrategy((Partial(keeps),) * 2, (Partial(keeps),)))
    return candidates


@register_rule(*_packets(["maximum"]), aten.clamp_min.Tensor, aten.clamp_min_.Tensor, float_values_matter=False)
def maximum_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) x S(d) -> S(d); P(max) x P(max) -> P(max); P(max|min) x R -> same P (and R x P)."""
    return _extremum_candidates(call, "max")


@register_rule(*_packets(["minimum"]), aten.clamp_max.Tensor, aten.clamp_max_.Tensor, float_values_matter=False)
def minimum_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) x S(d) -> S(d); P(min) x P(min) -> P(min); P(max|min) x R -> same P (and R x P)."""
    return _extremum_candidates(call, "min")


@register_rule(*_packets(["add", "sub", "rsub"]), float_values_matter=False)
def additive_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) x S(d) -> S(d); P(sum) x P(sum) -> P(sum)."""
    return pointwise_candidates(call, linearity="additive")


@register_rule(*_packets(["mul"]), float_values_matter=False)
def mul_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) x S(d) -> S(d); P x R -> P; R x P -> P; P x scalar -> P."""
    candidates = pointwise_candidates(call, linearity="multiplicative")
    if len(call.input_specs) == 2 and not _is_inplace_name(call):
        candidates += [OpStrategy((R, p), (p,)) for p in LINEAR_PARTIALS]
    return candidates


@register_rule(
    *_packets(["div", "threshold_backward", "silu_backward", "hardshrink_backward", "softshrink_backward"], modes=False),
    float_values_matter=False,
)
def linear_in_first_rule(call: OpCall) -> Sequence[OpStrategy]:
    """P x R -> P: linear in the first operand (the numerator, or the incoming gradient)."""
    return pointwise_candidates(call, linearity="multiplicative")


@register_rule(*_packets(["neg"]), float_values_matter=False)
def neg_rule(call: OpCall) -> Sequence[OpStrategy]:
    """-(P) -> P."""
    return pointwise_candidates(call, linearity="unary")


@register_rule(aten.log_sigmoid_forward.default)
def log_sigmoid_forward_rule(call: OpCall) -> Sequence[OpStrategy]:
    """log_sigmoid_forward(x) -> (out, buffer): S(d) -> S(d), S(d) (buffer R when it is not x-shaped)."""
    buffer = call.output_metas[1]
    x_shaped = buffer is not None and tuple(buffer.shape) == tuple(call.input_specs[0].shape)
    return [OpStrategy(c.inputs, (c.outputs[0], c.outputs[0] if x_shaped else R)) for c in pointwise_candidates(call)]


@register_rule(aten.log_sigmoid_backward.default)
def log_sigmoid_backward_rule(call: OpCall) -> Sequence[OpStrategy]:
    """(grad, x, buffer): S(d) x S(d) x S(d) -> S(d); P x R x R -> P (buffer R when it is not x-shaped)."""
    x, buffer = call.input_specs[1:]
    candidates = pointwise_candidates(call, linearity="multiplicative")
    if tuple(buffer.shape) == tuple(x.shape):
        return candidates
    return [OpStrategy((c.inputs[0], c.inputs[1], R), c.outputs) for c in candidates]


@register_rule(aten.fill.Scalar, aten.fill.Tensor, float_values_matter=False)
def fill_rule(call: OpCall) -> Sequence[OpStrategy]:
    """fill(x, v): S(d) -> S(d); R -> R; P(avg|max|min) -> P; P(sum) -> R (a new tensor; x's values
    are never read, so nothing moves); a DTensor v is R."""
    ndim = call.input_specs[0].ndim
    value = (R,) * (len(call.input_specs) - 1)  # fill.Tensor's 0-d value, when it is a DTensor
    options: list[Placement] = [R, *(Shard(d) for d in range(ndim)), *(Partial(op) for op in ("avg", "max", "min"))]
    return [OpStrategy((p, *value), (p,)) for p in options] + [OpStrategy((SUM, *value), (R,))]


def _fill_in_place(
    op: Any, args: list[Any], kwargs: dict[str, Any], inputs: tuple[DTensorSpec, ...], outputs: tuple[Any, ...]
) -> torch.Tensor:
    """fill_ writes v on every rank, except where self is a pending sum: there v goes to mesh
    coordinate 0 and zeros elsewhere, so the sum is v (one device's fill), not n * v."""
    local: torch.Tensor = op(*args, **kwargs)
    coordinate = inputs[0].mesh.get_coordinate()
    assert coordinate is not None
    if any(p == SUM and c != 0 for p, c in zip(inputs[0].placements, coordinate)):
        local.zero_()
    return local


@register_rule(aten.fill_.Scalar, aten.fill_.Tensor, local_impl=_fill_in_place, float_values_matter=False)
def fill_in_place_rule(call: OpCall) -> Sequence[OpStrategy]:
    """fill_(x, v): p -> p for every placement (a sum-partial gets v on coordinate 0 only); v is R."""
    value = (R,) * (len(call.input_specs) - 1)
    options: list[Placement] = [R, *(Shard(d) for d in range(call.input_specs[0].ndim)), *PARTIALS]
    return [OpStrategy((p, *value), (p,)) for p in options]


def _is_inplace_name(call: OpCall) -> bool:
    return call.op._schema.name.endswith("_")


@register_rule(aten.frexp.Tensor)
def frexp_rule(call: OpCall) -> Sequence[OpStrategy]:
    """frexp(x) -> (mantissa, exponent): S(d) -> S(d), S(d); R -> R, R; a partial is reduced first."""
    return [OpStrategy(c.inputs, c.outputs * 2) for c in pointwise_candidates(call)]


@register_rule(aten.glu.default)
def glu_rule(call: OpCall) -> Sequence[OpStrategy]:
    """glu(x, dim) = a * sigmoid(b) for the two halves of dim: S(d) -> S(d) for d != dim; dim is whole."""
    ndim = call.input_specs[0].ndim
    dim = normalize_dim(int(call.arg(1, "dim", -1)), ndim)
    return [OpStrategy((R,), (R,)), *(OpStrategy((Shard(d),), (Shard(d),)) for d in range(ndim) if d != dim)]


@register_rule(aten.glu_backward.default)
def glu_backward_rule(call: OpCall) -> Sequence[OpStrategy]:
    """(grad, x, dim): S(d) x S(d) -> S(d) for d != dim; grad P x R -> P (linear in grad)."""
    ndim = call.input_specs[1].ndim
    dim = normalize_dim(int(call.arg(2, "dim")), ndim)
    candidates = [OpStrategy((R, R), (R,))]
    candidates += [OpStrategy((Shard(d), Shard(d)), (Shard(d),)) for d in range(ndim) if d != dim]
    return candidates + [OpStrategy((p, R), (p,)) for p in LINEAR_PARTIALS]


@register_rule(aten._prelu_kernel.default)
def prelu_rule(call: OpCall) -> Sequence[OpStrategy]:
    """prelu(x, w), w broadcast (C or 1 values): S(d) x S(d') -> S(d) (w R where broadcast)."""
    return pointwise_candidates(call)


@register_rule(aten._prelu_kernel_backward.default)
def prelu_backward_rule(call: OpCall) -> Sequence[OpStrategy]:
    """(grad, x, w) -> (grad_x, grad_w): a dim w has -> S(d) on all -> S(d), S(d');
    a dim w is broadcast along -> grad, x S(d), w R -> S(d), P(sum) (grad_w sums over it)."""
    x, weight = call.input_specs[1], call.input_specs[2]
    candidates = [OpStrategy((R, R, R), (R, R))]
    lead = x.ndim - weight.ndim
    for d in range(x.ndim):
        w_dim = d - lead
        if w_dim < 0 or (weight.shape[w_dim] == 1 and x.shape[d] != 1):
            candidates.append(OpStrategy((Shard(d), Shard(d), R), (Shard(d), SUM)))
        else:
            candidates.append(OpStrategy((Shard(d), Shard(d), Shard(w_dim)), (Shard(d), Shard(w_dim))))
    return candidates
