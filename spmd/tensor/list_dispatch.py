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
from typing import TYPE_CHECKING, Any

import torch

from spmd.tensor.call_layout import (
    AMBIGUOUS_KEYS,
    DECISION_CACHE_LIMIT,
    flatten_call,
    mesh_mismatch_error,
    unflatten_call,
    unwrap_call,
)
from spmd.tensor.dtensor import DTensor
from spmd.tensor.list_by_mesh import meshes_of_positions, run_per_mesh
from spmd.tensor.ops.foreach import ListRule
from spmd.tensor.ops.registry import REGISTRY, OpCall, OpEntry
from spmd.tensor.placement import Placement, format_placements
from spmd.tensor.propagation import Decision, ShardingError
from spmd.tensor.redistribute import moves_data, redistribute_local
from spmd.tensor.spec import DTensorSpec, TensorMeta, has_strided
from spmd.tensor.trace import STATE, log_decision, log_decomposition, op_scope

if TYPE_CHECKING:
    from spmd.tensor.dispatch import Dispatcher

__all__ = ["dispatch_list"]

_LIST_SCALARS = (bool, int, float, complex)
_PLAIN_TENSOR = "plain-tensor"


@dataclasses.dataclass(frozen=True, slots=True)
class _Leaf:
    """Stands for tensor leaf ``index`` of a flattened call, so a list position's element call maps back to it."""

    index: int


def _list_entries(shape: tuple[Any, ...], count: int) -> list[bool]:
    """For each flattened leaf, whether it is an entry of a list argument."""
    if not shape:
        return [False] * count
    mask: list[bool] = []
    for entry in shape:
        if isinstance(entry, int):
            mask.extend([True] * entry if entry >= 0 else [False])
        elif isinstance(entry, tuple):
            mask.extend([True] * entry[1])
        else:
            mask.append(False)
    return mask


def _leaf_arguments(op: Any, shape: tuple[Any, ...], kwarg_names: list[str], count: int) -> list[str]:
    """The schema argument each flattened leaf belongs to."""
    arguments = op._schema.arguments
    if not shape:
        return [arguments[k].name for k in range(count)]
    names: list[str] = []
    positional = 0
    for entry in shape:
        if isinstance(entry, int):
            names.extend([arguments[positional].name] * (1 if entry < 0 else entry))
            positional += 1
        elif isinstance(entry, tuple):
            names.extend([entry[0]] * entry[1])
        else:
            names.append(entry)
    return names


def _check_lists(op: Any, leaves: list[Any], names: list[str], shape: tuple[Any, ...]) -> None:
    """A list argument holds DTensors only or plain tensors only."""
    in_list = _list_entries(shape, len(leaves))
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
            raise RuntimeError(
                f"{op}: list argument {name!r} mixes DTensors (positions {dtensors}) and plain tensors "
                f"(positions {plain}); make every tensor of the list a DTensor (distribute_tensor(t, mesh, "
                "[Replicate()]), or distribute the whole module) or none of them"
            )


def dispatch_list(dispatcher: Dispatcher, entry: OpEntry, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A list op (``_foreach_*``, fused optimizers): decide each position like its element op,
    move the inputs that need it, run the list kernel once on the local tensors, wrap each output."""
    op, rule = entry.op, entry.rule
    if not isinstance(rule, ListRule):
        raise ShardingError(
            f"{op} has no list rule; run the optimizer or clip_grad_norm_ with foreach=False, or "
            "register a ListRule in spmd/tensor/ops/foreach.py"
        )
    leaves, shape = flatten_call(args, kwargs)
    key_parts: list[Any] = [entry, shape]
    positions: list[int] = []
    mesh: Any = None
    for i, a in enumerate(leaves):
        if isinstance(a, DTensor):
            spec = a._spec
            if mesh is None:
                mesh = spec.mesh
            elif spec.mesh is not mesh and spec.mesh != mesh:
                meshes = meshes_of_positions(op, args, kwargs)
                if meshes is None:  # meshes mixed within a list position (or outside the lists)
                    raise mesh_mismatch_error(op, mesh, spec.mesh)
                return run_per_mesh(op, args, kwargs, meshes)
            positions.append(i)
            key_parts.append(spec)
        elif isinstance(a, torch.Tensor):
            key_parts.append((_PLAIN_TENSOR, a.dtype, a.ndim))
        elif type(a) in _LIST_SCALARS and not rule.values_decide:  # lr, bias corrections: see ListRule
            key_parts.append(type(a))
        elif type(a) in AMBIGUOUS_KEYS:
            key_parts.append((type(a), a))
        else:
            key_parts.append(a)
    if any(has_strided(leaves[i]._spec.placements) for i in positions):  # rules never see one
        return dispatcher.run_gathered(entry, leaves, shape, list(kwargs), positions)
    key = tuple(key_parts)
    cached = dispatcher.list_cache.get(key)
    hit = cached is not None
    if cached is None:
        dispatcher.misses += 1
        cached = decide_list(dispatcher, entry, rule, leaves, shape, list(kwargs), positions)
        if len(dispatcher.list_cache) >= DECISION_CACHE_LIMIT:
            dispatcher.list_cache.clear()
        dispatcher.list_cache[key] = cached
    decision, write_back = cached
    if decision.decomposition is not None:  # the list op runs as other list ops (each dispatched here)
        if STATE.verbose:
            log_decomposition(op, [leaves[i]._spec for i in positions], decision, hit)
        return decision.decomposition(op, args, kwargs)

    if decision.moves and dispatcher.refuse_implicit is not None:
        dispatcher.refuse_implicit(op, leaves, shape, list(kwargs), positions, decision)
    local_leaves = list(leaves)
    for i in positions:
        local_leaves[i] = leaves[i]._local_tensor
    with op_scope(str(op)) if STATE.listening else contextlib.nullcontext():
        if STATE.verbose:
            log_decision(op, [leaves[i]._spec for i in positions], decision, hit)
        if decision.moves:
            dispatcher.redistribute_moved(leaves, local_leaves, positions, decision, verbose=STATE.verbose)
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

def decide_list(
    dispatcher: Dispatcher,
    entry: OpEntry,
    rule: ListRule,
    leaves: list[Any],
    shape: tuple[Any, ...],
    kwarg_names: list[str],
    positions: list[int],
) -> tuple[Decision, tuple[int, ...]]:
    """Decide every list position like its element op; returns the decision and the written-back inputs."""
    op = entry.op
    names = _leaf_arguments(op, shape, kwarg_names, len(leaves))
    _check_lists(op, leaves, names, shape)
    if entry.decompose is not None:
        spec_leaves = [a._spec if isinstance(a, DTensor) else a for a in leaves]
        spec_args, spec_kwargs = unflatten_call(spec_leaves, shape, kwarg_names)
        specs = tuple(leaves[i]._spec for i in positions)
        decomposed = dispatcher.propagator.decompose(OpCall(op, tuple(spec_args), spec_kwargs, specs, ()), entry)
        if decomposed is not None:
            return decomposed, ()
    # Tensors are marked so each element call maps back to the leaves; scalars stay for the rule to read.
    marks = [_Leaf(i) if isinstance(a, torch.Tensor) else a for i, a in enumerate(leaves)]
    marked_args, marked_kwargs = unflatten_call(marks, shape, kwarg_names)
    wanted: dict[int, tuple[Placement, ...]] = {}
    output_placements: list[tuple[Placement, ...] | None] = []
    output_metas: list[TensorMeta | None] = []
    strategies: list[Any] = []
    cost = 0.0
    for index, (element_op, element_args, element_kwargs) in enumerate(
        rule.element_calls(op, marked_args, marked_kwargs)
    ):
        marked, element_shape = flatten_call(tuple(element_args), element_kwargs)
        element_leaves = [leaves[m.index] if isinstance(m, _Leaf) else m for m in marked]
        element_positions: list[int] = []
        for k, a in enumerate(element_leaves):
            if isinstance(a, DTensor):
                element_positions.append(k)
            elif isinstance(a, torch.Tensor) and a.ndim != 0:
                raise RuntimeError(
                    f"{op} got a plain torch.Tensor of shape {list(a.shape)} in its {names[marked[k].index]!r} "
                    f"argument at list position {index}, next to DTensors; convert it with "
                    "distribute_tensor(t, mesh, placements) or DTensor.from_local first"
                )
        if not element_positions:
            raise RuntimeError(
                f"{op} has no DTensor at list position {index} while other positions hold DTensors; "
                "make the tensors at every position DTensors"
            )
        try:
            decision = _element_decision(dispatcher, element_op, element_leaves, element_shape, list(element_kwargs))
        except ShardingError as error:
            raise ShardingError(f"{op} at list position {index} (decided like {element_op}): {error}") from error
        if decision.decomposition is not None:
            raise ShardingError(
                f"{op} at list position {index} is decided like {element_op}, which runs as other ops on "
                f"these inputs; register a decomposition for {op} too (see spmd/tensor/ops/foreach.py)"
            )
        for n, k in enumerate(element_positions):
            leaf = marked[k].index
            want = decision.input_placements[n]
            if wanted.setdefault(leaf, want) != want:
                raise ShardingError(
                    f"{op}: its {names[leaf]!r} argument is shared by every list position, and position "
                    f"{index} needs it as {format_placements(want)} where an earlier one needs "
                    f"{format_placements(wanted[leaf])}; redistribute it to Replicate() first"
                )
        if op._schema.returns:
            output_placements.append(decision.output_placements[0])
            output_metas.append(decision.output_metas[0])
        strategies.extend(decision.strategies)
        cost += decision.cost
    mesh = leaves[positions[0]]._spec.mesh
    input_placements = tuple(wanted[i] for i in positions)
    moves = tuple(
        n for n, i in enumerate(positions) if moves_data(leaves[i]._spec.placements, input_placements[n], mesh.shape)
    )
    written = {a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    written -= set(rule.scratch)
    write_back = tuple(n for n in moves if names[positions[n]] in written)
    decision = Decision(
        input_placements=input_placements,
        output_placements=tuple(output_placements),
        output_metas=tuple(output_metas),
        strategies=tuple(strategies),
        cost=cost,
        inplace=entry.inplace,
        moves=moves,
        output_specs=tuple(
            None if p is None or m is None else DTensorSpec(mesh, p, m) for p, m in zip(output_placements, output_metas)
        ),
    )
    return decision, write_back


def _element_decision(
    dispatcher: Dispatcher, element_op: Any, leaves: list[Any], shape: tuple[Any, ...], kwarg_names: list[str]
) -> Decision:
    """The element call's decision, through the dispatcher's cache (keyed as a direct call of it is)."""
    element = REGISTRY.entry(element_op)
    args, kwargs = unflatten_call(leaves, shape, kwarg_names)
    call = unwrap_call(element, tuple(args), kwargs)
    assert call is not None  # plain tensors were refused above
    decision = dispatcher.cache.get(call.key)
    if decision is None:
        decision = dispatcher.propagator.decide_call(
            element, call.leaves, call.shape, call.kwarg_names(), call.positions, fallback=False
        )
        dispatcher.cache[call.key] = decision
    return decision
