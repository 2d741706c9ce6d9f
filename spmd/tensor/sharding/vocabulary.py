"""The words sharding is decided in: what a rule sees and returns, and what the propagator decides.

- ``OpCall``: one call as a rule sees it (specs in place of DTensors, the outputs' global metas);
- ``OpStrategy``: one candidate on one mesh dim (inputs' required placements -> outputs' placements);
- ``Rule``: ``OpCall -> candidates``, registered per aten overload (registry.py), never communicating;
- the hooks an op may register beside its rule (``LocalArgs``, ``LocalImpl``, ``Decomposition``, ``Answer``);
- ``Decision``: everything the dispatcher does for one cache key, and ``ShardingError`` when there is none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
    "Answer",
    "Decision",
    "ShardingError",
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
Answer = Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]
"""Answers a call from its arguments' global metadata: ``(op, args, kwargs) -> result``, the
arguments as the caller gave them (plain tensors may be among them); nothing is decided or moved."""
Decomposition = Callable[[OpCall], Expansion | None]
"""Says, from a call's specs and arguments, whether the op runs as other DTensor ops instead of
through its rule (the p-norm of a sharded dim: power sums -> P(sum) -> pow(1/p)): the ``Expansion``
that runs it, or None to use the rule. Decided once per cache key, like a rule's candidates."""


class ShardingError(NotImplementedError):
    """No way to run an op on these placements; the message names the op, inputs and the fix."""


@dataclass(frozen=True, slots=True)
class Decision:
    """What the dispatcher does for one (op, input specs, args) key; complete when made."""

    input_placements: tuple[tuple[Placement, ...], ...]
    output_placements: tuple[tuple[Placement, ...] | None, ...]
    output_metas: tuple[TensorMeta | None, ...]
    strategies: tuple[OpStrategy, ...]
    """The candidate chosen on each mesh dim (for debug output)."""
    cost: float
    inplace: bool
    local_args: Any = None
    """The op's ``LocalArgs`` hook, if its arguments must be made local on every call."""
    fallback: bool = False
    """No rule: inputs were replicated and the op ran on whole tensors (outputs are Replicate)."""
    local_impl: Any = None
    """The op's ``LocalImpl`` hook, if it computes its local result itself."""
    moves: tuple[int, ...] = ()
    """Indices of the inputs whose local tensors must change (a one-rank mesh dim only relabels)."""
    output_specs: tuple[DTensorSpec | None, ...] = ()
    """Ready-made output specs (None for non-tensor outputs)."""
    view_of_copy: bool = False
    """A view op whose input is redistributed first: its output aliases a copy, not the input."""
    decomposition: Expansion | None = None
    """The ``Expansion`` that runs the call as other DTensor ops (the op's decomposition applies);
    then nothing else here is used."""
    reshapes_self: bool = False
    """An in-place view (``squeeze_``, ``t_``): self's spec becomes the output's after the call."""
    simple: bool = False
    """The common case, run in-line by the dispatcher: a plain positional call (not flattened)
    whose inputs stay where they are and whose one tensor output is a fresh DTensor (no hooks,
    not in-place, not a view of a copy)."""
