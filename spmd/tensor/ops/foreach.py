"""List ops (``_foreach_*``): position i is decided like one element op on the i-th entries.

  _foreach_f(xs, ys, c)[i]     decided like f(xs[i], ys[i], c)   (add_.List -> add_.Tensor, ...)
  ScalarList entries           like f(xs[i], scalars[i]); the scalar's value never changes a decision
  _foreach_maximum/minimum     like clamp_min/clamp_max (the same pointwise algebra)
  _foreach_zero_               like x.mul_(0): every placement survives, sum/avg partials too
  _foreach_norm(xs, p)[i]      like linalg_vector_norm(xs[i], p): p 0, 1 -> P(sum); inf -> P(max);
                               -inf -> P(min); other finite p, a tensor sharded: the whole list runs
                               as _foreach_powsum (P(sum), no movement) then _foreach_pow(1/p) (one
                               scalar all_reduce per sharded tensor), the algebra of the element op's
                               decomposition (reductions.power_sum_order)
  _foreach_powsum(xs, p)[i]    like linalg_vector_norm(xs[i], 1): sum |x|^p over shards -> P(sum)

The dispatcher decides every position (each element decision is cached like any op's), moves the
inputs that need it, calls the foreach kernel once on all the local tensors and wraps output i with
position i's placement. In-place list ops keep each self's placement, as the element op does.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from spmd.tensor.ops.reductions import power_sum_order, sharded_on
from spmd.tensor.sharding.registry import REGISTRY, register_rule
from spmd.tensor.sharding.vocabulary import Decomposition, Expansion, OpCall, OpStrategy, Rule
from spmd.tensor.spec import DTensorSpec

__all__ = ["ListRule", "ElementCall"]

aten = torch.ops.aten
_MISSING = object()
_SCALAR_TYPES = (bool, int, float, complex)

ElementCall = tuple[Any, list[Any], dict[str, Any]]
"""(element op, positional args, keyword args) of one list position."""


def _canonical_scalar(value: Any) -> Any:
    """A Python scalar stands for its type: learning rates change every step, decisions don't."""
    return type(value)(1) if type(value) in _SCALAR_TYPES else value


@dataclass(frozen=True, slots=True)
class ListRule:
    """A list op decided position by position; also the rule of a one-position call.

    ``element_op`` None means the op itself on one-entry lists, decided by ``position_rule``
    (fused optimizers, which have no single-tensor op).
    """

    element_op: Any = None
    renames: tuple[tuple[str, str], ...] = ()
    """List-op argument -> element argument, where the schemas do not line up by position."""
    fixed: tuple[tuple[str, Any], ...] = ()
    """Element arguments set to a value regardless of the call (``zero_`` is ``mul_(0)``)."""
    position_rule: Rule | None = None
    scratch: tuple[str, ...] = ()
    """Arguments the op writes whose writes may be dropped where an entry had to be moved (fused
    optimizers unscale grads in place). Other written arguments that moved are written back."""
    values_decide: bool = False
    """The call's Python scalars change the decision (a norm's order). Otherwise they are decided
    by their type alone, so a learning rate that changes every step keeps hitting the cache."""

    def __call__(self, call: OpCall) -> Sequence[OpStrategy]:
        """Candidates of a call whose lists hold one entry: those of its element op."""
        if self.element_op is None:
            assert self.position_rule is not None
            return self.position_rule(call)
        if any(isinstance(a, (list, tuple)) and len(a) > 1 for a in [*call.args, *call.kwargs.values()]):
            raise NotImplementedError(
                f"{call.op} is decided position by position; ask about one position (one-entry lists) "
                f"or about its element op {self.element_op}"
            )
        [(op, args, kwargs)] = self.element_calls(call.op, list(call.args), call.kwargs)
        specs = [a for a in [*args, *kwargs.values()] if isinstance(a, DTensorSpec)]
        out_meta = specs[0].tensor_meta if not call.output_metas else call.output_metas[0]
        rule = REGISTRY.rule_for(op)
        if rule is None:
            raise NotImplementedError(f"{call.op} is decided like {op}, which has no sharding rule")
        return rule(OpCall(op, tuple(args), kwargs, tuple(specs), (out_meta,)))

    def element_calls(self, op: Any, args: list[Any], kwargs: dict[str, Any]) -> list[ElementCall]:
        """The element call of every list position of ``op(*args, **kwargs)``.

        Tensors pass through untouched (the dispatcher passes markers in their place), so this is
        structure only; Python scalars become canonical ones unless ``values_decide``.
        """
        bound: list[tuple[int, Any, Any]] = []
        for k, argument in enumerate(op._schema.arguments):
            value = args[k] if k < len(args) else kwargs.get(argument.name, _MISSING)
            if value is not _MISSING:
                bound.append((k, argument, value))
        lengths = {len(v) for _, a, v in bound if isinstance(a.type, torch.ListType) and len(v)}
        if len(lengths) > 1:
            raise ValueError(f"{op} got lists of different lengths {sorted(lengths)}; pass one entry per tensor")
        positions = lengths.pop() if lengths else 0
        if self.element_op is None:
            return [self._one_entry_call(op, bound, i) for i in range(positions)]
        return [self._element_call(bound, i) for i in range(positions)]

    def _scalar(self, value: Any) -> Any:
        return value if self.values_decide else _canonical_scalar(value)

    def _one_entry_call(self, op: Any, bound: list[tuple[int, Any, Any]], i: int) -> ElementCall:
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        for _, argument, value in bound:
            if isinstance(argument.type, torch.ListType):
                value = [self._scalar(value[i])] if len(value) else value
            else:
                value = self._scalar(value)
            if argument.kwarg_only:
                kwargs[argument.name] = value
            else:
                args.append(value)
        return op, args, kwargs

    def _element_call(self, bound: list[tuple[int, Any, Any]], i: int) -> ElementCall:
        element_arguments = self.element_op._schema.arguments
        renames = dict(self.renames)
        values: dict[str, Any] = {}
        for k, argument, value in bound:
            name = renames.get(argument.name) or element_arguments[k].name
            if isinstance(argument.type, torch.ListType):
                value = value[i]
            elif argument.name == "scalars":  # addcmul.Tensor: a tensor of one scalar per position
                value = 1.0
            values[name] = self._scalar(value)
        values.update(self.fixed)
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        for k, argument in enumerate(element_arguments):
            if argument.name not in values:
                continue
            if argument.kwarg_only or len(args) < k:  # positional only while no argument is skipped
                kwargs[argument.name] = values[argument.name]
            else:
                args.append(values[argument.name])
        return self.element_op, args, kwargs


def _overload(name: str) -> Any:
    packet, _, overload = name.partition(".")
    return getattr(getattr(aten, packet), overload or "default")


def _register(list_op: str, element: str, *, decompose: Decomposition | None = None, **options: Any) -> None:
    register_rule(_overload(list_op), decompose=decompose)(ListRule(_overload(element), **options))


UNARY_OPS = [
    "abs", "acos", "asin", "atan", "ceil", "cos", "cosh", "erf", "exp", "expm1", "floor", "frac", "lgamma",
    "log", "log1p", "log2", "neg", "reciprocal", "round", "rsqrt", "sigmoid", "sign", "sin", "sinh", "sqrt",
    "tan", "tanh", "trunc",
]
# list-op name -> element ops for (List and Tensor overloads, Scalar and ScalarList overloads)
BINARY_OPS = {
    "add": ("add.Tensor", "add.Scalar"),
    "sub": ("sub.Tensor", "sub.Scalar"),
    "mul": ("mul.Tensor", "mul.Scalar"),
    "div": ("div.Tensor", "div.Scalar"),
    "clamp_min": ("clamp_min.Tensor", "clamp_min"),
    "clamp_max": ("clamp_max.Tensor", "clamp_max"),
    "maximum": ("clamp_min.Tensor", "clamp_min"),
    "minimum": ("clamp_max.Tensor", "clamp_max"),
    "pow": ("pow.Tensor_Tensor", "pow.Tensor_Scalar"),
}
_INPLACE_ELEMENT = {"pow.Tensor_Tensor": "pow_.Tensor", "pow.Tensor_Scalar": "pow_.Scalar"}


def _inplace(element: str) -> str:
    if element in _INPLACE_ELEMENT:
        return _INPLACE_ELEMENT[element]
    packet, _, overload = element.partition(".")
    return f"{packet}_.{overload}" if overload else f"{packet}_"


for _name in UNARY_OPS:
    _register(f"_foreach_{_name}", _name)
    _register(f"_foreach_{_name}_", f"{_name}_")

_register("_foreach_zero_", "mul_.Scalar", fixed=(("other", 0),))
_register("_foreach_zero", "mul.Scalar", fixed=(("other", 0),))
_register("_foreach_copy_", "copy_")
_register("_foreach_clone", "clone")

for _name, (_tensors, _scalars) in BINARY_OPS.items():
    for _suffix, _element in (("", lambda e: e), ("_", _inplace)):
        _packet = getattr(aten, f"_foreach_{_name}{_suffix}")
        for _kind in _packet.overloads():
            if "out" in _kind:
                continue
            _target = {"List": _tensors, "Tensor": _tensors, "Scalar": _scalars, "ScalarList": _scalars}.get(_kind)
            if _kind == "ScalarAndTensor":
                _target = "pow.Scalar"
            assert _target is not None, f"_foreach_{_name}{_suffix}.{_kind} has no element op"
            _register(f"_foreach_{_name}{_suffix}.{_kind}", _element(_target))

for _name in ("addcmul", "addcdiv"):
    for _kind in ("Scalar", "ScalarList", "Tensor"):
        _register(f"_foreach_{_name}.{_kind}", _name)
        _register(f"_foreach_{_name}_.{_kind}", f"{_name}_")

for _kind, _element_kind in (("List", "Tensor"), ("Scalar", "Scalar"), ("ScalarList", "Scalar")):
    _register(f"_foreach_lerp.{_kind}", f"lerp.{_element_kind}")
    _register(f"_foreach_lerp_.{_kind}", f"lerp_.{_element_kind}")

_register("_foreach_max", "max")
_register("_foreach_powsum.Scalar", "linalg_vector_norm", renames=(("dtype", "dtype"),), fixed=(("ord", 1),))


def foreach_norm_decomposition(call: OpCall) -> Expansion | None:
    """Finite p-norms (p not 0 or 1) of a list holding a sharded tensor run as power sums, then pow(1/p)."""
    p = power_sum_order(call.arg(1, "ord", 2))
    if p is None or not any(sharded_on(spec, range(spec.ndim)) for spec in call.input_specs):
        return None
    return functools.partial(_norms_from_power_sums, p=p, dtype=call.arg(2, "dtype"))


def _norms_from_power_sums(
    op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, p: float, dtype: torch.dtype | None
) -> Any:
    """Each tensor's sum of |x|^p, P(sum) where it is sharded (no data moves), then pow(1/p) reduces it."""
    power_sums = aten._foreach_powsum.Scalar(args[0], p, dtype)
    return aten._foreach_pow.Scalar(power_sums, 1.0 / p)


_register(
    "_foreach_norm.Scalar",
    "linalg_vector_norm",
    renames=(("dtype", "dtype"),),
    decompose=foreach_norm_decomposition,
    values_decide=True,  # the order picks the partial: P(sum) for 1, P(max) for inf
)

