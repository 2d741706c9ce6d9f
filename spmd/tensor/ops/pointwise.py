"""Elementwise ops: any matching shard of broadcast operands; partials only where the op is linear.

Algebra (per mesh dim, broadcasting aligned from the right):
  unary f:    S(d) -> S(d); R -> R; P must be reduced first (relu, exp, ...)
  neg, x*c:   additionally P(sum|avg) -> P
  add, sub, rsub:  S(d) x S(d) -> S(d); P x P -> P (sum with a scalar operand only for avg)
  log_sigmoid_forward -> (out, buffer), log_sigmoid_backward (grad, x, buffer): pointwise (the backward
              linear in grad); a buffer that is not x-shaped (CUDA leaves it empty) is R
  fill(x, v): S(d) -> S(d); R -> R; P(avg|max|min) -> same P (every rank holds v); v a DTensor must be R
  mul:        P x R -> P; R x P -> P
  div:        P x R -> P
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spmd.tensor.ops.common import LINEAR_PARTIALS, R, pointwise_candidates
from spmd.tensor.ops.registry import OpCall, OpStrategy, register_rule
from spmd.tensor.placement import Partial, Placement, Shard

aten = torch.ops.aten

UNARY_OPS = [
    "abs", "acos", "asin", "atan", "ceil", "cos", "cosh", "erf", "exp", "expm1", "floor", "log", "log1p",
    "log2", "reciprocal", "relu", "round", "rsqrt", "sigmoid", "sign", "sin", "sinh", "sqrt", "square",
    "tan", "tanh", "trunc", "gelu", "silu", "bitwise_not", "logical_not", "isnan", "isinf", "isfinite",
    "sgn", "signbit", "nan_to_num", "clamp", "clamp_min", "clamp_max", "hardtanh", "leaky_relu", "elu",
    "softplus", "mish", "hardswish", "hardsigmoid", "logit", "erfinv", "digamma", "lgamma", "frac", "deg2rad", "rad2deg",
]
BINARY_NONLINEAR_OPS = [
    "maximum", "minimum", "pow", "eq", "ne", "lt", "le", "gt", "ge", "atan2", "logical_and", "logical_or",
    "remainder", "fmod", "bitwise_and", "bitwise_or", "bitwise_xor", "floor_divide", "addcmul", "addcdiv",
    "lerp", "hypot", "copysign", "xlogy", "fmax", "fmin", "heaviside", "logaddexp", "nextafter",
    "hardtanh_backward", "leaky_relu_backward", "elu_backward", "softplus_backward", "mish_backward",
    "hardswish_backward", "hardsigmoid_backward", "logit_backward",
]


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


@register_rule(
    *_packets(UNARY_OPS + BINARY_NONLINEAR_OPS + ["threshold", "gelu_backward", "sigmoid_backward", "tanh_backward"]),
    aten.div.Tensor_mode,
    aten.div.Scalar_mode,
    aten.div_.Tensor_mode,
    aten.div_.Scalar_mode,
)
def nonlinear_rule(call: OpCall) -> Sequence[OpStrategy]:
    """f(S(d), ...) -> S(d): partial inputs are reduced before the op."""
    return pointwise_candidates(call)


@register_rule(*_packets(["add", "sub", "rsub"]))
def additive_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) x S(d) -> S(d); P(sum) x P(sum) -> P(sum)."""
    return pointwise_candidates(call, linearity="additive")


@register_rule(*_packets(["mul"]))
def mul_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) x S(d) -> S(d); P x R -> P; R x P -> P; P x scalar -> P."""
    candidates = pointwise_candidates(call, linearity="multiplicative")
    if len(call.input_specs) == 2 and not _is_inplace_name(call):
        candidates += [OpStrategy((R, p), (p,)) for p in LINEAR_PARTIALS]
    return candidates


@register_rule(*_packets(["div", "threshold_backward", "silu_backward"], modes=False))
def linear_in_first_rule(call: OpCall) -> Sequence[OpStrategy]:
    """P x R -> P: linear in the first operand (the numerator, or the incoming gradient)."""
    return pointwise_candidates(call, linearity="multiplicative")


@register_rule(*_packets(["neg"]))
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


@register_rule(*_packets(["fill"]))
def fill_rule(call: OpCall) -> Sequence[OpStrategy]:
    """fill(x, v): S(d) -> S(d); R -> R; P(avg|max|min) -> P (v on every rank); a DTensor v is R."""
    ndim = call.input_specs[0].ndim
    value = (R,) * (len(call.input_specs) - 1)  # fill.Tensor's 0-d value, when it is a DTensor
    # Not P(sum): v on every rank would add up to n * v.
    options: list[Placement] = [R, *(Shard(d) for d in range(ndim)), *(Partial(op) for op in ("avg", "max", "min"))]
    return [OpStrategy((p, *value), (p,)) for p in options]


def _is_inplace_name(call: OpCall) -> bool:
    return call.op._schema.name.endswith("_")
