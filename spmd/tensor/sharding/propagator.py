"""Sharding propagation: from one call's specs to a complete ``Decision`` the dispatcher executes.

The propagator asks the op's rule for candidates and picks the cheapest, mesh dim by mesh dim;
an op without a rule takes the replicate fallback (when on and safe) or raises ``ShardingError``.

For every mesh dim the propagator costs each candidate as the bytes it would take to move every
input from its current placement to the one the candidate needs (``redistribute_cost``) and keeps
the cheapest; among equally cheap ones, the one that needs the fewest collectives, then the rule's
earlier candidate, so the choice is deterministic.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from spmd.tensor.placement import Placement, Replicate, Shard, format_placements
from spmd.tensor.redistribute.plan import moves_data, redistribute_cost
from spmd.tensor.sharding.call import unflatten_call
from spmd.tensor.sharding.registry import REGISTRY, OpEntry, OpRegistry
from spmd.tensor.sharding.vocabulary import Decision, OpCall, OpStrategy, ShardingError
from spmd.tensor.spec import DTensorSpec, TensorMeta
from spmd.tensor.trace import FALLBACKS

__all__ = ["ShardingPropagator", "is_inplace", "fallback_refusal", "inferring_shapes"]

_shape_inference = threading.local()


def inferring_shapes() -> bool:
    """True while the calling thread runs an op on meta tensors of the global shapes to learn its
    outputs' shapes: not part of the program, so tools watching local ops (the simulator's memory
    tracker, FLOP counts) skip what runs then."""
    return bool(getattr(_shape_inference, "depth", 0))


@contextlib.contextmanager
def _inferring_shapes() -> Iterator[None]:
    _shape_inference.depth = getattr(_shape_inference, "depth", 0) + 1
    try:
        yield
    finally:
        _shape_inference.depth -= 1


fallback_logger = logging.getLogger("spmd.tensor.dispatch")


def _local_bytes(spec: DTensorSpec) -> int:
    shards = 1
    for size, p in zip(spec.mesh.shape, spec.placements):
        if isinstance(p, Shard):
            shards *= size
    return spec.tensor_meta.nbytes // shards


def is_inplace(op: Any) -> bool:
    """Aten in-place overloads (``add_``, ``copy_``) mutate and return their first argument."""
    return REGISTRY.entry(op).inplace


def fallback_refusal(op: Any) -> str | None:
    """Why the replicate fallback would be wrong for ``op``, or None when it is safe (see ``OpEntry``)."""
    return REGISTRY.entry(op).no_fallback


class ShardingPropagator:
    """Chooses input and output placements for each op call; results are cached by the dispatcher."""

    def __init__(self, registry: OpRegistry = REGISTRY) -> None:
        self.registry = registry

    # ----- the whole decision for one call -------------------------------------------------------
    def decide_call(
        self,
        entry: OpEntry,
        leaves: Sequence[Any],
        shape: tuple[Any, ...],
        kwarg_names: Sequence[str],
        positions: Sequence[int],
        *,
        fallback: bool,
    ) -> Decision:
        """The complete decision for a call, given as flattened leaves (see call.py).

        ``fallback``: an op without a rule runs on replicated inputs, where that is safe, instead
        of raising. An in-place op whose rule cannot keep self's placement raises, as in torch:
        self cannot change its placement, and running it on gathered copies would hide that.
        """
        if fallback and entry.rule is None:
            if entry.no_fallback is None:
                return self.fallback_decision(entry, leaves, positions, why="has no sharding rule")
            specs = ", ".join(
                f"{format_placements(leaves[i]._spec.placements)} {list(leaves[i]._spec.shape)}" for i in positions
            )
            raise ShardingError(
                f"{entry.op} has no sharding rule (inputs {specs}) and the replicate fallback does not apply: "
                f"{entry.no_fallback}; register a rule in spmd/tensor/ops/ or run the op on .to_local() tensors"
            )
        call = self.make_call(entry.op, leaves, shape, kwarg_names, positions)
        return self.decompose(call, entry) or self.decide(call, entry, plain_call=not shape)

    def fallback_decision(
        self, entry: OpEntry, leaves: Sequence[Any], positions: Sequence[int], *, why: str
    ) -> Decision:
        """Every input replicated, the op run on whole tensors, outputs Replicate (warned once per op)."""
        mesh = leaves[positions[0]]._spec.mesh
        replicate = (Replicate(),) * mesh.ndim
        if FALLBACKS.warn_once(entry.op):
            fallback_logger.warning(
                "%s %s; it runs on replicated inputs (every input is gathered). "
                "Register a rule in spmd/tensor/ops/ to keep it sharded. Warned once per op and process; "
                "spmd.tensor.debug.fallback_report() lists every op that fell back, with calls and bytes gathered.",
                entry.op,
                why,
            )
        return Decision(
            moves=tuple(
                n for n, i in enumerate(positions) if moves_data(leaves[i]._spec.placements, replicate, mesh.shape)
            ),
            input_placements=(replicate,) * len(positions),
            output_placements=(),
            output_metas=(),
            strategies=(),
            cost=float("inf"),
            inplace=entry.inplace,
            fallback=True,
        )

    def make_call(
        self,
        op: Any,
        leaves: Sequence[Any],
        shape: tuple[Any, ...],
        kwarg_names: Sequence[str],
        positions: Sequence[int],
    ) -> OpCall:
        """What the rule sees of a call: specs in place of DTensors, and the outputs' global metas
        (from running the op on meta tensors of the global shapes)."""
        spec_leaves = list(leaves)
        for i in positions:
            spec_leaves[i] = leaves[i]._spec
        with _inferring_shapes():  # the meta tensors and the op on them are not the program's
            meta_args, meta_kwargs = unflatten_call(_meta_leaves(leaves, positions), shape, kwarg_names)
            try:
                # an op that returns no tensor (fused optimizers, item()) has no output shape to find
                meta_out = op(*meta_args, **meta_kwargs) if self.registry.entry(op).returns_tensors else ()
            except Exception as error:
                message = f"cannot compute the output shape of {op} on the meta device: {error}"
                raise NotImplementedError(message) from error
        outputs = meta_out if isinstance(meta_out, (tuple, list)) else (meta_out,)
        output_metas = tuple(TensorMeta.of(o) if isinstance(o, torch.Tensor) else None for o in outputs)
        spec_args, spec_kwargs = unflatten_call(spec_leaves, shape, kwarg_names)
        return OpCall(op, tuple(spec_args), spec_kwargs, tuple(leaves[i]._spec for i in positions), output_metas)

    # ----- the rule's candidates ---------------------------------------------------------------
    def candidates(self, call: OpCall) -> list[OpStrategy]:
        """The rule's candidates for ``call`` (raises ``ShardingError`` when the op has no rule)."""
        rule = self.registry.entry(call.op).rule
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
        entry = self.registry.entry(call.op)
        # An in-place view keeps self's data where it is but may rename its dims (S(2) -> S(1)).
        keeps_output = entry.inplace and not entry.inplace_view
        scored: list[tuple[OpStrategy, float | None]] = []
        for candidate in candidates:
            current = specs[0].placements[mesh_dim]
            if entry.inplace and (candidate.inputs[0] != current or (keeps_output and candidate.outputs[0] != current)):
                scored.append((candidate, None))
                continue
            cost = sum(
                redistribute_cost(s.placements[mesh_dim], want, _local_bytes(s), mesh.shape[mesh_dim])
                for s, want in zip(specs, candidate.inputs)
            )
            scored.append((candidate, cost))
        return scored

    def decompose(self, call: OpCall, entry: OpEntry | None = None) -> Decision | None:
        """The decision to run ``call`` as other DTensor ops, when the op's decomposition applies to it.

        Asked before ``decide``: nothing moves, and the other ops are decided when they run.
        """
        entry = entry or self.registry.entry(call.op)
        expansion = None if entry.decompose is None else entry.decompose(call)
        if expansion is None:
            return None
        placements = tuple(s.placements for s in call.input_specs)
        return Decision(placements, (), (), (), 0.0, entry.inplace, decomposition=expansion)

    def cheapest_on(
        self, call: OpCall, entry: OpEntry, candidates: list[OpStrategy], d: int
    ) -> tuple[OpStrategy, float]:
        """The candidate chosen on mesh dim ``d`` and what its moves cost there.

        Of the candidates that move the fewest bytes, the one with the fewest collectives (one
        all_reduce, not two reduce_scatters); ``min`` keeps the first of equals: the rule's order.
        """
        allowed = [(c, cost) for c, cost in self.score(call, candidates, d) if cost is not None]
        if not allowed:
            raise _no_strategy(call, entry, candidates, d)
        least = min(cost or 0.0 for _, cost in allowed)
        cheapest = [item for item in allowed if (item[1] or 0.0) <= least * (1 + 1e-9) + 1e-12]
        best, best_cost = min(cheapest, key=lambda item: _collectives(call.input_specs, item[0], d))
        return best, best_cost or 0.0

    def decide(self, call: OpCall, entry: OpEntry | None = None, *, plain_call: bool = False) -> Decision:
        """The cheapest candidate on every mesh dim, with the moves and output specs it implies.

        ``plain_call``: the call was not flattened (see spmd/tensor/sharding/call.py), so it may be ``simple``.
        """
        entry = entry or self.registry.entry(call.op)
        candidates = self.candidates(call)
        specs = call.input_specs
        mesh = specs[0].mesh
        chosen: list[OpStrategy] = []
        total = 0.0
        for d in range(mesh.ndim):
            best, best_cost = self.cheapest_on(call, entry, candidates, d)
            chosen.append(best)
            total += best_cost
        input_placements = tuple(tuple(c.inputs[i] for c in chosen) for i in range(len(specs)))
        outputs = tuple(
            None if meta is None else tuple(_output_placement(c, j, call) for c in chosen)
            for j, meta in enumerate(call.output_metas)
        )
        # A placement that changes only on one-rank mesh dims is a relabel: the shard is used as it
        # is (not copied), so a view of it still aliases the input.
        moves = tuple(n for n, s in enumerate(specs) if moves_data(s.placements, input_placements[n], mesh.shape))
        view_of_copy = entry.returns_view and (bool(moves) or entry.local_impl is not None)
        simple = (
            plain_call
            and not moves
            and not entry.inplace
            and entry.local_args is None
            and entry.local_impl is None
            and not view_of_copy
            and len(outputs) == 1
            and outputs[0] is not None
            and not isinstance(call.op._schema.returns[0].type, torch.ListType)
        )
        return Decision(
            input_placements,
            outputs,
            call.output_metas,
            tuple(chosen),
            total,
            entry.inplace,
            entry.local_args,
            local_impl=entry.local_impl,
            moves=moves,
            output_specs=tuple(
                None if p is None or m is None else DTensorSpec(mesh, p, m) for p, m in zip(outputs, call.output_metas)
            ),
            # a view computed by a local_impl (``_conj``) holds new values, so it aliases nothing either
            view_of_copy=view_of_copy,
            reshapes_self=entry.inplace and entry.inplace_view,
            simple=simple,
        )


def _no_strategy(call: OpCall, entry: OpEntry, candidates: Sequence[OpStrategy], d: int) -> ShardingError:
    """The error for a call no candidate can run on mesh dim ``d``."""
    specs = call.input_specs
    tried = "; ".join(str(c) for c in candidates) or "none"
    if entry.inplace:
        # torch's wording, so code that catches torch's error catches this one
        return ShardingError(
            f"{call.op}: in-place operations that require placement changes are not supported. "
            f"The input has placement {format_placements(specs[0].placements)} (inputs "
            f"{_describe_inputs(specs)}), but no strategy keeps it on mesh dim {d} (candidates: "
            f"{tried}). Use the out-of-place op (x = op(x, ...)) or redistribute self first."
        )
    return ShardingError(
        f"{call.op} cannot run on inputs {_describe_inputs(specs)}: no strategy on mesh dim {d} "
        f"(candidates: {tried}); redistribute the inputs to a layout the op supports"
    )


def _collectives(specs: Sequence[DTensorSpec], candidate: OpStrategy, mesh_dim: int) -> int:
    """How many inputs the candidate moves with a collective on ``mesh_dim`` (from R is local)."""
    if specs[0].mesh.shape[mesh_dim] == 1:
        return 0
    return sum(
        1
        for s, want in zip(specs, candidate.inputs)
        if s.placements[mesh_dim] != want and not isinstance(s.placements[mesh_dim], Replicate)
    )


def _output_placement(candidate: OpStrategy, index: int, call: OpCall) -> Placement:
    placement = candidate.outputs[index] if index < len(candidate.outputs) else None
    if placement is None:
        raise AssertionError(f"rule for {call.op} gave no placement for output {index}")
    return placement


def _meta_leaves(leaves: Sequence[Any], positions: Sequence[int]) -> list[Any]:
    """``leaves`` with each DTensor and tensor as a meta tensor of its global shape (devices as meta)."""
    meta_leaves = list(leaves)
    for i in positions:
        meta = leaves[i]._spec.tensor_meta
        meta_leaves[i] = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device="meta")
    for i, a in enumerate(leaves):
        if isinstance(a, torch.Tensor) and i not in positions:
            meta_leaves[i] = a.to("meta")
        elif isinstance(a, torch.device):
            # ``x.to(dtype, device="cpu")`` would copy the meta tensor out; shapes are all we need
            meta_leaves[i] = torch.device("meta")
    return meta_leaves


def _describe_inputs(specs: Sequence[DTensorSpec]) -> str:
    return ", ".join(f"{format_placements(s.placements)} {list(s.shape)}" for s in specs) or "none"


def meta_of(value: Any) -> TensorMeta | None:
    return TensorMeta.of(value) if isinstance(value, torch.Tensor) else None
