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

from spmd.tensor.ops.registry import REGISTRY, OpCall, OpRegistry, OpStrategy
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


class ShardingPropagator:
    """Chooses input and output placements for each op call; results are cached by the dispatcher."""

    def __init__(self, registry: OpRegistry = REGISTRY) -> None:
        self.registry = registry

    def decide(self, call: OpCall) -> Decision:
        rule = self.registry.rule_for(call.op)
        if rule is None:
            raise ShardingError(
                f"{call.op} has no sharding rule (inputs {_describe_inputs(call.input_specs)}); "
                f"redistribute the inputs to Replicate() and call the op on .to_local() tensors, "
                f"or register a rule in spmd/tensor/ops/"
            )
        candidates = list(rule(call))
        inplace = is_inplace(call.op)
        specs = call.input_specs
        mesh = specs[0].mesh
        local_bytes = [_local_bytes(s) for s in specs]
        chosen: list[OpStrategy] = []
        total = 0.0
        for d in range(mesh.ndim):
            best: OpStrategy | None = None
            best_cost = float("inf")
            for candidate in candidates:
                if len(candidate.inputs) != len(specs):
                    raise AssertionError(f"rule for {call.op} gave {len(candidate.inputs)} inputs for {len(specs)}")
                if inplace and (
                    candidate.inputs[0] != specs[0].placements[d] or candidate.outputs[0] != specs[0].placements[d]
                ):
                    continue
                cost = sum(
                    redistribute_cost(s.placements[d], want, nbytes, mesh.shape[d])
                    for s, want, nbytes in zip(specs, candidate.inputs, local_bytes)
                )
                if cost < best_cost:
                    best, best_cost = candidate, cost
            if best is None:
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
            chosen.append(best)
            total += best_cost
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
