"""The dispatch path of list ops (``_foreach_*``, fused optimizers): one kernel call for a whole list.

A list op is its element op applied at every list position, so each position is decided like the
element call (``_foreach_add_.List`` at position i like ``add_.Tensor(xs[i], ys[i])``, through the
same decision cache), the inputs that need it are moved, the list kernel runs once on the local
tensors, and output i is wrapped with position i's spec. Rules live in spmd/tensor/ops/foreach.py
and spmd/tensor/ops/optim.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from spmd.hooks import HOOKS
from spmd.tensor.dispatch.keys import MIXED_MESHES, list_call_key, mesh_mismatch_error, unwrap_call
from spmd.tensor.dispatch.list_by_mesh import meshes_of_positions, run_per_mesh
from spmd.tensor.dispatch.moves import redistribute_moved
from spmd.tensor.dtensor import DTensor
from spmd.tensor.ops.foreach import ListRule
from spmd.tensor.placement import Placement, format_placements
from spmd.tensor.redistribute.plan import moves_data
from spmd.tensor.redistribute.run import redistribute_local
from spmd.tensor.sharding.cache import DecisionCache
from spmd.tensor.sharding.call import flatten_call, leaf_arguments, list_entries, unflatten_call
from spmd.tensor.sharding.propagator import ShardingPropagator
from spmd.tensor.sharding.registry import REGISTRY, OpEntry
from spmd.tensor.sharding.vocabulary import Decision, OpCall, ShardingError
from spmd.tensor.spec import DTensorSpec, has_strided
from spmd.tensor.torch_objects import refuse_torch_object, refuse_torch_objects
from spmd.tensor.trace import STATE, log_decision, log_decomposition, op_scope

__all__ = ["ListOps"]


@dataclasses.dataclass(frozen=True, slots=True)
class _Leaf:
    """Stands for tensor leaf ``index`` of a flattened call, so a list position's element call maps back to it."""

    index: int


def _check_lists(op: Any, leaves: list[Any], names: list[str], shape: tuple[Any, ...]) -> None:
    """A list argument holds DTensors only or plain tensors only."""
    in_list = list_entries(shape, len(leaves))
    by_argument: dict[str, tuple[list[int], list[int]]] = {}
    start: dict[str, int] = {}
    for i, (a, name) in enumerate(zip(leaves, names)):
        if not in_list[i] or not isinstance(a, torch.Tensor):
            continue
        start.setdefault(name, i)
        dtensors, plain = by_argument.setdefault(name, ([], []))
        (dtensors if isinstance(a, DTensor) else plain).append(i - start[name])
    for name, (dtensors, plain) in by_argument.items():
        if dtensors and plain:
            refuse_torch_objects((leaves[start[name] + i] for i in plain), f"{op} (list argument {name!r})")
            raise RuntimeError(
                f"{op}: list argument {name!r} mixes DTensors (positions {dtensors}) and plain tensors "
                f"(positions {plain}); make every tensor of the list a DTensor (distribute_tensor(t, mesh, "
                "[Replicate()]), or distribute the whole module) or none of them"
            )


class ListOps:
    """The list path: a list call decided position by position, cached per list key.

    Its collaborators are handed over by the dispatcher that owns it: the propagator, the op path's
    decision cache (a position is decided as the direct call of its element op would be, and shares
    that decision) and ``run_strided`` (a call with ``_StridedShard`` inputs: on the local pieces, or
    run again gathered).
    """

    def __init__(
        self,
        propagator: ShardingPropagator,
        element_decisions: DecisionCache[Decision],
        run_strided: Callable[[OpEntry, list[Any], tuple[Any, ...], list[str], list[int]], Any],
    ) -> None:
        self.propagator = propagator
        self.element_decisions = element_decisions
        self.run_strided = run_strided
        self.decisions: DecisionCache[tuple[Decision, tuple[int, ...]]] = DecisionCache()
        """List decisions, with the inputs each writes back after the kernel."""

    def dispatch(self, entry: OpEntry, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A list op (``_foreach_*``, fused optimizers): decide each position like its element op,
        move the inputs that need it, run the list kernel once on the local tensors, wrap each output."""
        op, rule = entry.op, entry.rule
        if not isinstance(rule, ListRule):
            raise ShardingError(
                f"{op} has no list rule; run the optimizer or clip_grad_norm_ with foreach=False, or "
                "register a ListRule in spmd/tensor/ops/foreach.py"
            )
        leaves, shape = flatten_call(args, kwargs)
        key, positions, mesh = list_call_key(entry, leaves, shape, values_decide=rule.values_decide)
        if mesh is MIXED_MESHES:
            meshes = meshes_of_positions(op, args, kwargs)
            if meshes is None:  # meshes mixed within a list position (or outside the lists)
                seen = [a._spec.mesh for a in leaves if isinstance(a, DTensor)]
                raise mesh_mismatch_error(op, seen[0], next(m for m in seen if m != seen[0]))
            return run_per_mesh(op, args, kwargs, meshes)
        if any(has_strided(leaves[i]._spec.placements) for i in positions):  # rules never see one
            return self.run_strided(entry, leaves, shape, list(kwargs), positions)
        (decision, write_back), hit = self.decisions.get_or_decide(
            key, lambda: self.decide(entry, rule, leaves, shape, list(kwargs), positions)
        )
        if decision.decomposition is not None:  # the list op runs as other list ops (each dispatched here)
            if STATE.verbose:
                log_decomposition(op, [leaves[i]._spec for i in positions], decision, hit)
            return decision.decomposition(op, args, kwargs)
        if decision.moves and HOOKS.refuse_implicit is not None:
            HOOKS.refuse_implicit(op, leaves, shape, list(kwargs), positions, decision)
        local_leaves = list(leaves)
        for i in positions:
            local_leaves[i] = leaves[i]._local_tensor
        with op_scope(str(op)) if STATE.listening else contextlib.nullcontext():
            if STATE.verbose:
                log_decision(op, [leaves[i]._spec for i in positions], decision, hit)
            if decision.moves:
                redistribute_moved(leaves, local_leaves, positions, decision, verbose=STATE.verbose)
                for n in decision.moves:  # fused CPU kernels read their tensors as flat arrays
                    local_leaves[positions[n]] = local_leaves[positions[n]].contiguous()
            local_args, local_kwargs = unflatten_call(local_leaves, shape, list(kwargs))
            result = op(*local_args, **local_kwargs)
            for n in write_back:  # a written argument that had to move: copy the result back to its layout
                target: DTensor = leaves[positions[n]]
                moved = target._spec.with_placements(decision.input_placements[n])
                target._local_tensor.copy_(redistribute_local(local_leaves[positions[n]], moved, target._spec.placements))
        if not op._schema.returns:
            return None
        return [
            value if spec is None else DTensor(value, spec, requires_grad=False)
            for value, spec in zip(result, decision.output_specs)
        ]

    def decide(
        self,
        entry: OpEntry,
        rule: ListRule,
        leaves: list[Any],
        shape: tuple[Any, ...],
        kwarg_names: list[str],
        positions: list[int],
    ) -> tuple[Decision, tuple[int, ...]]:
        """Decide every list position like its element op; returns the decision and the written-back inputs."""
        op = entry.op
        names = leaf_arguments(op, shape, kwarg_names, len(leaves))
        _check_lists(op, leaves, names, shape)
        decomposed = self._decomposed(entry, leaves, shape, kwarg_names, positions)
        if decomposed is not None:
            return decomposed, ()
        # Tensors are marked so each element call maps back to the leaves; scalars stay for the rule to read.
        marks = [_Leaf(i) if isinstance(a, torch.Tensor) else a for i, a in enumerate(leaves)]
        marked_args, marked_kwargs = unflatten_call(marks, shape, kwarg_names)
        wanted: dict[int, tuple[Placement, ...]] = {}
        decisions: list[Decision] = []
        for index, element_call in enumerate(rule.element_calls(op, marked_args, marked_kwargs)):
            dtensor_leaves, decision = self._decide_position(op, index, element_call, leaves, names)
            for leaf, want in zip(dtensor_leaves, decision.input_placements):
                if wanted.setdefault(leaf, want) != want:
                    raise ShardingError(
                        f"{op}: its {names[leaf]!r} argument is shared by every list position, and position "
                        f"{index} needs it as {format_placements(want)} where an earlier one needs "
                        f"{format_placements(wanted[leaf])}; redistribute it to Replicate() first"
                    )
            decisions.append(decision)
        return _combine(entry, rule, leaves, positions, names, wanted, decisions)

    def _decomposed(
        self, entry: OpEntry, leaves: list[Any], shape: tuple[Any, ...], kwarg_names: list[str], positions: list[int]
    ) -> Decision | None:
        """The decision to run the list call as other ops, when the op's decomposition applies to it."""
        if entry.decompose is None:
            return None
        spec_leaves = [a._spec if isinstance(a, DTensor) else a for a in leaves]
        spec_args, spec_kwargs = unflatten_call(spec_leaves, shape, kwarg_names)
        specs = tuple(leaves[i]._spec for i in positions)
        return self.propagator.decompose(OpCall(entry.op, tuple(spec_args), spec_kwargs, specs, ()), entry)

    def _decide_position(
        self, op: Any, index: int, element_call: tuple[Any, Any, Any], leaves: list[Any], names: list[str]
    ) -> tuple[list[int], Decision]:
        """List position ``index`` decided as its element call: the leaves of its DTensors, and the decision."""
        element_op, element_args, element_kwargs = element_call
        marked, element_shape = flatten_call(tuple(element_args), element_kwargs)
        element_leaves = [leaves[m.index] if isinstance(m, _Leaf) else m for m in marked]
        dtensor_leaves: list[int] = []
        for k, a in enumerate(element_leaves):
            if isinstance(a, DTensor):
                dtensor_leaves.append(marked[k].index)
            elif isinstance(a, torch.Tensor) and a.ndim != 0:
                refuse_torch_object(a, f"{op} ({names[marked[k].index]!r} at list position {index})")
                raise RuntimeError(
                    f"{op} got a plain torch.Tensor of shape {list(a.shape)} in its {names[marked[k].index]!r} "
                    f"argument at list position {index}, next to DTensors; convert it with "
                    "distribute_tensor(t, mesh, placements) or DTensor.from_local first"
                )
        if not dtensor_leaves:
            raise RuntimeError(
                f"{op} has no DTensor at list position {index} while other positions hold DTensors; "
                "make the tensors at every position DTensors"
            )
        try:
            decision = self.element_decision(element_op, element_leaves, element_shape, list(element_kwargs))
        except ShardingError as error:
            raise ShardingError(f"{op} at list position {index} (decided like {element_op}): {error}") from error
        if decision.decomposition is not None:
            raise ShardingError(
                f"{op} at list position {index} is decided like {element_op}, which runs as other ops on "
                f"these inputs; register a decomposition for {op} too (see spmd/tensor/ops/foreach.py)"
            )
        return dtensor_leaves, decision

    def element_decision(
        self, element_op: Any, leaves: list[Any], shape: tuple[Any, ...], kwarg_names: list[str]
    ) -> Decision:
        """The element call's decision, through the op path's cache (keyed as a direct call of it is)."""
        element = REGISTRY.entry(element_op)
        args, kwargs = unflatten_call(leaves, shape, kwarg_names)
        call = unwrap_call(element, tuple(args), kwargs)
        assert call is not None  # plain tensors were refused above
        decision, _ = self.element_decisions.get_or_decide(
            call.key,
            lambda: self.propagator.decide_call(
                element, call.leaves, call.shape, call.kwarg_names(), call.positions, fallback=False
            ),
        )
        return decision


def _combine(
    entry: OpEntry,
    rule: ListRule,
    leaves: list[Any],
    positions: list[int],
    names: list[str],
    wanted: dict[int, tuple[Placement, ...]],
    decisions: list[Decision],
) -> tuple[Decision, tuple[int, ...]]:
    """The list call's decision from its positions' (each output i is position i's), and the inputs
    it writes that must be copied back to their own layout after the kernel."""
    op = entry.op
    mesh = leaves[positions[0]]._spec.mesh
    input_placements = tuple(wanted[i] for i in positions)
    moves = tuple(
        n for n, i in enumerate(positions) if moves_data(leaves[i]._spec.placements, input_placements[n], mesh.shape)
    )
    written = {a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    written -= set(rule.scratch)
    write_back = tuple(n for n in moves if names[positions[n]] in written)
    returns = bool(op._schema.returns)
    output_placements = tuple(d.output_placements[0] for d in decisions) if returns else ()
    output_metas = tuple(d.output_metas[0] for d in decisions) if returns else ()
    decision = Decision(
        input_placements=input_placements,
        output_placements=output_placements,
        output_metas=output_metas,
        strategies=tuple(s for d in decisions for s in d.strategies),
        cost=sum(d.cost for d in decisions),
        inplace=entry.inplace,
        moves=moves,
        output_specs=tuple(
            None if p is None or m is None else DTensorSpec(mesh, p, m) for p, m in zip(output_placements, output_metas)
        ),
    )
    return decision, write_back
