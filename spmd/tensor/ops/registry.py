"""The one registry of sharding rules: aten overload -> rule function.

A rule is a pure function of an ``OpCall`` (the op, its arguments with DTensors replaced by their
specs, and the global metas of its outputs). It returns the candidate ``OpStrategy`` values for
*one* mesh dim: the placements each DTensor input must have and the placements of each output.
The propagator expands candidates to n-d meshes and picks the cheapest. Rules never communicate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from spmd.tensor.placement import Placement
from spmd.tensor.spec import DTensorSpec, TensorMeta

__all__ = [
    "OpStrategy",
    "OpCall",
    "Rule",
    "LocalArgs",
    "LocalImpl",
    "Decomposition",
    "Expansion",
    "OpRegistry",
    "REGISTRY",
    "register_rule",
]


@dataclass(frozen=True, slots=True)
class OpStrategy:
    """Inputs' required placements -> outputs' placements, on one mesh dim."""

    inputs: tuple[Placement, ...]
    outputs: tuple[Placement | None, ...]

    def __str__(self) -> str:
        ins = ", ".join(str(p) for p in self.inputs)
        outs = ", ".join(str(p) for p in self.outputs)
        return f"{ins} -> {outs}"


@dataclass(frozen=True, slots=True)
class OpCall:
    """What a rule sees of one call: specs in place of DTensors, plus the outputs' global metas."""

    op: torch._ops.OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    input_specs: tuple[DTensorSpec, ...]
    output_metas: tuple[TensorMeta | None, ...]

    def arg(self, index: int, name: str, default: Any = None) -> Any:
        """Positional ``index`` or keyword ``name`` of the call, else ``default``."""
        if index < len(self.args):
            return self.args[index]
        return self.kwargs.get(name, default)

    @property
    def mesh_ndim(self) -> int:
        return self.input_specs[0].mesh.ndim


Rule = Callable[[OpCall], Sequence[OpStrategy]]
LocalArgs = Callable[[list[Any], dict[str, Any], Any, DTensorSpec], tuple[list[Any], dict[str, Any]]]
"""Rewrites the local call's arguments (e.g. a view's global sizes to this rank's local sizes):
``(args, kwargs, decision, output spec) -> (args, kwargs)``; runs on every call, after the decision."""
LocalImpl = Callable[[Any, list[Any], dict[str, Any], tuple[DTensorSpec, ...], tuple[Any, ...]], Any]
"""Computes the local result itself instead of calling the op on the shards (random ops draw the
global tensor and keep their piece): ``(op, args, kwargs, input specs as redistributed, output
specs) -> local result``. Output specs are None for non-tensor outputs."""
Expansion = Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]
"""Runs a call as other DTensor ops: ``(op, args, kwargs) -> result``, the arguments as the caller gave them."""
Decomposition = Callable[[OpCall], Expansion | None]
"""Says, from a call's specs and arguments, whether the op runs as other DTensor ops instead of
through its rule (the p-norm of a sharded dim: power sums -> P(sum) -> pow(1/p)): the ``Expansion``
that runs it, or None to use the rule. Decided once per cache key, like a rule's candidates."""


def _overloads(op: Any) -> list[torch._ops.OpOverload]:
    if isinstance(op, torch._ops.OpOverloadPacket):
        return [getattr(op, name) for name in op.overloads()]  # type: ignore[no-untyped-call]
    return [op]


class OpRegistry:
    """Maps aten overloads to rules; ``override`` swaps one rule for the length of a ``with``."""

    def __init__(self) -> None:
        self._rules: dict[Any, Rule] = {}
        self._local_args: dict[Any, LocalArgs] = {}
        self._local_impls: dict[Any, LocalImpl] = {}
        self._decompositions: dict[Any, Decomposition] = {}
        self.version = 0
        """Bumped on every change so decision caches know to drop their entries."""

    def register(
        self,
        *ops: Any,
        local_args: LocalArgs | None = None,
        local_impl: LocalImpl | None = None,
        decompose: Decomposition | None = None,
    ) -> Callable[[Rule], Rule]:
        """Decorator: ``@register_rule(aten.mm.default, aten.mm.out)``; a packet means every overload.

        ``local_args`` is for ops whose non-tensor arguments are global sizes (view, expand);
        ``local_impl`` for ops whose local result is not the op applied to the shards (random ops);
        ``decompose`` for ops that, on some layouts, are better run as other DTensor ops.
        """

        def decorate(rule: Rule) -> Rule:
            for op in ops:
                for overload in _overloads(op):
                    self._rules[overload] = rule
                    if local_args is not None:
                        self._local_args[overload] = local_args
                    if local_impl is not None:
                        self._local_impls[overload] = local_impl
                    if decompose is not None:
                        self._decompositions[overload] = decompose
            self.version += 1
            return rule

        return decorate

    def rule_for(self, op: Any) -> Rule | None:
        return self._rules.get(op)

    def local_args_for(self, op: Any) -> LocalArgs | None:
        return self._local_args.get(op)

    def local_impl_for(self, op: Any) -> LocalImpl | None:
        return self._local_impls.get(op)

    def decomposition_for(self, op: Any) -> Decomposition | None:
        return self._decompositions.get(op)

    def registered_ops(self) -> list[Any]:
        return list(self._rules)

    @contextlib.contextmanager
    def override(self, op: Any, rule: Rule | None) -> Iterator[None]:
        """Use ``rule`` for ``op`` (None removes it) inside the block; tests use this, not patching.

        The op's decomposition is set aside too, so the block's rule decides every call.
        """
        saved = {o: self._rules.get(o) for o in _overloads(op)}
        saved_decompositions = {o: self._decompositions.pop(o) for o in saved if o in self._decompositions}
        for o in saved:
            if rule is None:
                self._rules.pop(o, None)
            else:
                self._rules[o] = rule
        self.version += 1
        try:
            yield
        finally:
            for o, old in saved.items():
                if old is None:
                    self._rules.pop(o, None)
                else:
                    self._rules[o] = old
            self._decompositions.update(saved_decompositions)
            self.version += 1


REGISTRY = OpRegistry()
register_rule = REGISTRY.register
