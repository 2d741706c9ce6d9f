"""Sharding propagation: ask the op's rule for candidates and pick the cheapest, mesh dim by mesh dim.

For every mesh dim the propagator costs each candidate as the bytes it would take to move every
input from its current placement to the one the candidate needs (``redistribute_cost``) and keeps
the cheapest; ties go to the rule's earlier candidate, so the choice is deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from spmd.tensor.ops.registry import REGISTRY, Expansion, OpCall, OpRegistry, OpStrategy
from spmd.tensor.placement import Placement, Shard, format_placements
from spmd.tensor.redistribute import redistribute_cost
from spmd.tensor.spec import DTensorSpec, TensorMeta

__all__ = ["Decision", "ShardingPropagator", "ShardingError"]


class ShardingError(NotImplementedError):
    """No way to run an op on these placements; the message names the op, inputs and the fix."""


@dataclass(frozen=True, slots=True)
class Decision:
    """What the dispatcher does for one (op, input specs, args) key."""

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
    """Indices of the inputs whose placements must change (filled in by the dispatcher)."""
    output_specs: tuple[DTensorSpec | None, ...] = ()
    """Ready-made output specs (filled in by the dispatcher; the mesh compares by value)."""
    view_of_copy: bool = False
    """A view op whose input is redistributed first: its output aliases a copy, not the input."""
    decomposition: Expansion | None = None
    """The ``Expansion`` that runs the call as other DTensor ops (the op's decomposition applies);
    then nothing else here is used."""
    reshapes_self: bool = False
    """An in-place view (``squeeze_``, ``t_``): self's spec becomes the output's after the call."""


def _local_bytes(spec: DTensorSpec) -> int:
    shards = 1
    for size, p in zip(spec.mesh.shape, spec.placements):
        if isinstance(p, Shard):
            shards *= size
    return spec.tensor_meta.nbytes // shards


def is_inplace(op: Any) -> bool:
    """Aten in-place overloads (``add_``, ``copy_``) mutate and return their first argument."""
    name: str = op._schema.name
    return name.endswith("_") and not name.endswith("__")


def fallback_refusal(op: Any) -> str | None:
    """Why the replicate fallback would be wrong for ``op``, or None when it is safe.

    Random ops would draw different numbers on every rank; ``out=`` ops would write into a
    temporary copy instead of the caller's tensor; views (``diagonal``, ``_conj``) would alias the
    gathered copy, so writes through them would be lost; in-place views (``squeeze_``) would
    change the copy's shape, not the DTensor's.
    """
    if torch.Tag.nondeterministic_seeded in op.tags:
        return "it is random, so replicas would disagree"
    if torch.Tag.inplace_view in op.tags:
        return "it changes the tensor's shape in place; use the out-of-place op (x = x.squeeze(d))"
    if any(r.alias_info is not None and not r.alias_info.is_write for r in op._schema.returns):
        return "it returns a view of its input, which must alias the DTensor itself"
    arguments = op._schema.arguments
    writes = [a.name for a in arguments[1 if is_inplace(op) else 0 :] if a.alias_info is not None and a.alias_info.is_write]
    if writes:
        return f"it writes into its {', '.join(writes)} argument"
    return None


class ShardingPropagator:
    """Chooses input and output placements for each op call; results are cached by the dispatcher."""

    def __init__(self, registry: OpRegistry = REGISTRY) -> None:
        self.registry = registry

    def candidates(self, call: OpCall) -> list[OpStrategy]:
        """The rule's candidates for ``call`` (raises ``ShardingError`` when the op has no rule)."""
        rule = self.registry.rule_for(call.op)
        if rule is None:
            raise ShardingError(
                f"{call.op} has no sharding rule (inputs {_describe_inputs(call.input_specs)}); "
                f"redistribute the inputs to Replicate() and call the op on .to_local() tensors, "
                f"or register a rule in spmd/tensor/ops/"
            )
        candidates = list(rule(call))
        for candidate in candidates:
            if len(candidate.inputs) != len(call.input_specs):
                raise AssertionError(
                    f"rule for {call.op} gave {len(candidate.inputs)} inputs for {len(call.input_specs)}"
                )
        return candidates

    def score(self, call: OpCall, candidates: list[OpStrategy], mesh_dim: int) -> list[tuple[OpStrategy, float | None]]:
        """Each candidate's cost on ``mesh_dim`` (bytes to move the inputs), None where not allowed."""
        specs = call.input_specs
        mesh = specs[0].mesh
        inplace = is_inplace(call.op)
        # An in-place view keeps self's data where it is but may rename its dims (S(2) -> S(1)).
        keeps_output = inplace and torch.Tag.inplace_view not in call.op.tags
        scored: list[tuple[OpStrategy, float | None]] = []
        for candidate in candidates:
            current = specs[0].placements[mesh_dim]
            if inplace and (candidate.inputs[0] != current or (keeps_output and candidate.outputs[0] != current)):
                scored.append((candidate, None))
                continue
            cost = sum(
                redistribute_cost(s.placements[mesh_dim], want, _local_bytes(s), mesh.shape[mesh_dim])
                for s, want in zip(specs, candidate.inputs)
            )
            scored.append((candidate, cost))
        return scored

    def decompose(self, call: OpCall) -> Decision | None:
        """The decision to run ``call`` as other DTensor ops, when the op's decomposition applies to it.

        Asked before ``decide``: nothing moves, and the other ops are decided when they run.
        """
        decomposition = self.registry.decomposition_for(call.op)
        expansion = None if decomposition is None else decomposition(call)
        if expansion is None:
            return None
        placements = tuple(s.placements for s in call.input_specs)
        return Decision(placements, (), (), (), 0.0, is_inplace(call.op), decomposition=expansion)

    def decide(self, call: OpCall) -> Decision:
        candidates = self.candidates(call)
        inplace = is_inplace(call.op)
        specs = call.input_specs
        chosen: list[OpStrategy] = []
        total = 0.0
        for d in range(specs[0].mesh.ndim):
            allowed = [(c, cost) for c, cost in self.score(call, candidates, d) if cost is not None]
            if not allowed:
                what = "in-place " if inplace else ""
                raise ShardingError(
                    f"{what}{call.op} cannot run on inputs {_describe_inputs(specs)}: no strategy on mesh dim {d} "
                    f"(candidates: {'; '.join(str(c) for c in candidates) or 'none'}); "
                    + (
                        "an in-place op keeps its self placement, so redistribute self first"
                        if inplace
                        else "redistribute the inputs to a layout the op supports"
                    )
                )
            # min() keeps the first of equal costs: the rule's order breaks ties.
            best, best_cost = min(allowed, key=lambda item: item[1] or 0.0)
            chosen.append(best)
            total += best_cost or 0.0
        input_placements = tuple(tuple(c.inputs[i] for c in chosen) for i in range(len(specs)))
        outputs: list[tuple[Placement, ...] | None] = []
        for j, meta in enumerate(call.output_metas):
            if meta is None:
                outputs.append(None)
                continue
            outputs.append(tuple(_output_placement(c, j, call) for c in chosen))
        return Decision(
            input_placements,
            tuple(outputs),
            call.output_metas,
            tuple(chosen),
            total,
            inplace,
            self.registry.local_args_for(call.op),
            local_impl=self.registry.local_impl_for(call.op),
            reshapes_self=inplace and torch.Tag.inplace_view in call.op.tags,
        )


def _output_placement(candidate: OpStrategy, index: int, call: OpCall) -> Placement:
    placement = candidate.outputs[index] if index < len(candidate.outputs) else None
    if placement is None:
        raise AssertionError(f"rule for {call.op} gave no placement for output {index}")
    return placement


def _describe_inputs(specs: Sequence[DTensorSpec]) -> str:
    return ", ".join(f"{format_placements(s.placements)} {list(s.shape)}" for s in specs) or "none"


def meta_of(value: Any) -> TensorMeta | None:
    return TensorMeta.of(value) if isinstance(value, torch.Tensor) else None
