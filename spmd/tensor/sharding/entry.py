"""OpEntry: everything the dispatcher knows about one aten overload, computed once.

An entry holds the op's sharding rule and hooks (when registered) beside facts read from its
schema: whether it writes into self, returns a view, has an ``out=`` form, is a list op, and why
the replicate fallback would be wrong for it. The dispatcher reads these per call as attributes,
instead of re-parsing the schema.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from spmd.tensor.sharding.vocabulary import Answer, Decomposition, LocalArgs, LocalImpl, Rule

__all__ = ["OpEntry", "functional_variant"]

@dataclass(frozen=True, slots=True, eq=False)
class OpEntry:
    """One aten overload: its rule and hooks, and what its schema says (compared by identity)."""

    op: Any
    kernel: Any
    """What runs the op on local tensors: the overload's own C++ callable when torch exposes it (the
    overload object's ``__call__`` only forwards to it), else the overload."""
    rule: Rule | None
    """Candidates per mesh dim (see registry.py); None: the op has no rule."""
    local_args: LocalArgs | None
    """``LocalArgs`` hook: rewrites the local call's arguments (global sizes -> local sizes)."""
    local_impl: LocalImpl | None
    """``LocalImpl`` hook: computes the local result itself (random ops)."""
    decompose: Decomposition | None
    """``Decomposition`` hook: runs some calls as other DTensor ops."""
    inplace: bool
    """Writes into and returns its first argument (``add_``, ``copy_``)."""
    inplace_view: bool
    """Changes its first argument's shape in place (``squeeze_``, ``t_``)."""
    returns_view: bool
    """Returns a view of an input (``view``, ``diagonal``)."""
    returns_tensors: bool
    """Has a tensor among its returns (fused optimizers and ``item()`` have none)."""
    out_variant: tuple[Any, tuple[str, ...]] | None
    """For an ``out=`` overload: the functional overload and the names of its ``out`` arguments."""
    list_op: bool
    """Takes the list path (``_foreach_*``, fused optimizers)."""
    no_fallback: str | None
    """Why running on replicated inputs would be wrong for this op, or None when it is safe."""
    float_values_matter: bool = True
    """Whether a Python float argument's value can change the decision. Elementwise rules read only
    that a scalar is there, so their calls key floats by type: AdamW's ``addcdiv_(..., value=-lr / bias
    correction)`` changes its float every step and would otherwise decide again every step."""
    answer: Answer | None = None
    """``Answer`` hook: the result from the arguments' global metadata alone (``is_same_size``); the
    dispatcher returns it without deciding or moving anything, plain tensors allowed among them."""

    @staticmethod
    def of(
        op: Any,
        rule: Rule | None = None,
        *,
        local_args: LocalArgs | None = None,
        local_impl: LocalImpl | None = None,
        decompose: Decomposition | None = None,
        float_values_matter: bool = True,
        answer: Answer | None = None,
    ) -> OpEntry:
        schema = op._schema
        name: str = schema.name
        inplace = name.endswith("_") and not name.endswith("__")
        returns_view = any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
        return OpEntry(
            op=op,
            kernel=getattr(op, "_op", op),
            rule=rule,
            local_args=local_args,
            local_impl=local_impl,
            decompose=decompose,
            inplace=inplace,
            inplace_view=torch.Tag.inplace_view in op.tags,
            returns_view=returns_view,
            returns_tensors=any("Tensor" in str(r.type) for r in schema.returns),
            out_variant=functional_variant(op),
            list_op=callable(getattr(rule, "element_calls", None)) or name.startswith("aten::_foreach_"),
            no_fallback=_fallback_refusal(op, inplace, returns_view),
            float_values_matter=float_values_matter,
            answer=answer,
        )

    @property
    def name(self) -> str:
        return str(self.op)


def functional_variant(op: Any) -> tuple[Any, tuple[str, ...]] | None:
    """For an ``out=`` overload (``add.out``), the functional one with the same other arguments."""
    schema = op._schema
    outs = tuple(a.name for a in schema.arguments if a.is_out)
    if not outs:
        return None
    wanted = [(a.name, str(a.type)) for a in schema.arguments if not a.is_out]
    packet = getattr(torch.ops.aten, schema.name.split("::")[-1], None)
    for name in packet.overloads() if packet is not None else ():
        candidate = getattr(packet, name)
        arguments = candidate._schema.arguments
        if not any(a.is_out for a in arguments) and [(a.name, str(a.type)) for a in arguments] == wanted:
            return candidate, outs
    return None


def _fallback_refusal(op: Any, inplace: bool, returns_view: bool) -> str | None:
    """Why the replicate fallback would be wrong for ``op``, or None when it is safe.

    Random ops would draw different numbers on every rank; views (``diagonal``, ``_conj``) would
    alias the gathered copy, so writes through them would be lost; in-place views (``squeeze_``)
    would change the copy's shape, not the DTensor's; ops that write into an argument other than
    self would write into a temporary copy.
    """
    if torch.Tag.nondeterministic_seeded in op.tags:
        return "it is random, so replicas would disagree"
    if torch.Tag.inplace_view in op.tags:
        return "it changes the tensor's shape in place; use the out-of-place op (x = x.squeeze(d))"
    if returns_view:
        return "it returns a view of its input, which must alias the DTensor itself"
    arguments = op._schema.arguments
    writes = [a.name for a in arguments[1 if inplace else 0 :] if a.alias_info is not None and a.alias_info.is_write]
    if writes:
        return f"it writes into its {', '.join(writes)} argument"
    return None
