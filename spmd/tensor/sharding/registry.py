"""The one registry of sharding rules: aten overload -> ``OpEntry`` (rule, hooks, schema facts).

A rule is a pure function of an ``OpCall`` (the op, its arguments with DTensors replaced by their
specs, and the global metas of its outputs). It returns the candidate ``OpStrategy`` values for
*one* mesh dim: the placements each DTensor input must have and the placements of each output.
The propagator expands candidates to n-d meshes and picks the cheapest. Rules never communicate.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

from spmd.tensor.sharding.entry import OpEntry
from spmd.tensor.sharding.vocabulary import Answer, Decomposition, LocalArgs, LocalImpl, Rule

__all__ = ["OpEntry", "OpRegistry", "REGISTRY", "register_rule"]


def _overloads(op: Any) -> list[torch._ops.OpOverload]:
    if isinstance(op, torch._ops.OpOverloadPacket):
        return [getattr(op, name) for name in op.overloads()]  # type: ignore[no-untyped-call]
    return [op]


class OpRegistry:
    """One ``OpEntry`` per aten overload; ``override`` swaps an entry for the length of a ``with``.

    Ops without a rule get an entry too, on first use (their schema facts), so the dispatcher asks
    one question per call: ``entry(op)``. Every change bumps ``version`` and tells the listeners
    (decision caches), which drop what they decided.
    """

    def __init__(self) -> None:
        self._entries: dict[int, OpEntry] = {}
        """id(op) -> entry: ``OpOverload.__hash__`` is Python code, an int's hash is not; the entry
        keeps its op alive, so the id stays its own."""
        self._listeners: list[Callable[[], None]] = []
        self._by_name: dict[str, Callable[[Any], OpEntry]] = {}
        """``"prims::fma.default"`` -> how to make its entry: ops of libraries that may load after
        spmd (inductor's prims appear in compiled graphs' decompositions) get their rule on first use."""
        self.version = 0

    def register(
        self,
        *ops: Any,
        local_args: LocalArgs | None = None,
        local_impl: LocalImpl | None = None,
        decompose: Decomposition | None = None,
        float_values_matter: bool = True,
        answer: Answer | None = None,
    ) -> Callable[[Rule], Rule]:
        """Decorator: ``@register_rule(aten.mm.default, aten.mm.out)``; a packet means every overload.

        An op may also be named as ``"namespace::name.overload"``, for ops whose library may not be
        loaded yet: the entry is made when the op is first dispatched.

        ``local_args`` is for ops whose non-tensor arguments are global sizes (view, expand);
        ``local_impl`` for ops whose local result is not the op applied to the shards (random ops);
        ``decompose`` for ops that, on some layouts, are better run as other DTensor ops;
        ``answer`` for ops whose result is read from metadata alone (``is_same_size``).
        ``float_values_matter=False`` for rules that never read a Python float's value (elementwise
        rules): their calls then share one decision whatever the float.
        """

        def decorate(rule: Rule) -> Rule:
            make = functools.partial(
                OpEntry.of, rule=rule, local_args=local_args, local_impl=local_impl, decompose=decompose,
                answer=answer, float_values_matter=float_values_matter,
            )  # fmt: skip

            for op in ops:
                if isinstance(op, str):
                    self._by_name[op] = make
                    continue
                for overload in _overloads(op):
                    self._entries[id(overload)] = make(overload)
            self._changed()
            return rule

        return decorate

    def entry(self, op: Any) -> OpEntry:
        """The entry of ``op``: registered, or made now from its schema (no rule)."""
        entry = self._entries.get(id(op))
        if entry is None:
            make = self._by_name.get(f"{op._schema.name}.{op._overloadname}", OpEntry.of)
            entry = self._entries.setdefault(id(op), make(op))
        return entry

    def rule_for(self, op: Any) -> Rule | None:
        return self.entry(op).rule

    def registered_ops(self) -> list[Any]:
        """Every overload that has a rule."""
        return [e.op for e in self._entries.values() if e.rule is not None]

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` after every change of an entry (decision caches clear themselves)."""
        self._listeners.append(listener)

    def _changed(self) -> None:
        self.version += 1
        for listener in self._listeners:
            listener()

    @contextlib.contextmanager
    def override(self, op: Any, rule: Rule | None) -> Iterator[None]:
        """Use ``rule`` for ``op`` (None: no rule) inside the block; tests use this, not patching.

        The whole entry is swapped: the op's hooks (its decomposition too) are set aside, so the
        block's rule decides every call.
        """
        saved = {id(o): self.entry(o) for o in _overloads(op)}
        for key, old in saved.items():
            self._entries[key] = OpEntry.of(old.op, rule)
        self._changed()
        try:
            yield
        finally:
            self._entries.update(saved)
            self._changed()


REGISTRY = OpRegistry()
register_rule = REGISTRY.register
