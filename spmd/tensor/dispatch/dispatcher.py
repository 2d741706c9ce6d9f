"""The dispatch loop, in five steps: unwrap and key -> look up or decide -> move inputs -> run local -> wrap.

Decisions are cached by (op entry, input specs, non-tensor args). A repeated call pays one dict
lookup plus the local kernel; nothing is formatted for logging unless a debug tool listens.
``out=`` overloads and list ops (``_foreach_*``, fused optimizers) take their own short paths.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

from spmd.hooks import HOOKS
from spmd.tensor.device_mesh.mesh import DeviceMesh
from spmd.tensor.dispatch.elementwise_local import NOT_LOCAL, run_elementwise_local
from spmd.tensor.dispatch.keys import UnwrappedCall, scan_leaves, unwrap_call
from spmd.tensor.dispatch.list_ops import ListOps
from spmd.tensor.dispatch.moves import redistribute_moved
from spmd.tensor.dispatch.special_calls import (
    LAYOUT_NEUTRAL_OPS,
    dispatch_out,
    finish_fallback,
    refuse_write_into_copied_view,
    replicate_plain_tensors,
    reshape_self,
    result_outside_mesh,
    returns_tensors,
    run_layout_neutral,
)
from spmd.tensor.dtensor import DTensor, implicit_replication, wrap_result
from spmd.tensor.placement import format_placements
from spmd.tensor.redistribute.run import redistribute_local
from spmd.tensor.sharding.cache import DecisionCache
from spmd.tensor.sharding.call import flatten_call, leaf_arguments, unflatten_call
from spmd.tensor.sharding.propagator import ShardingPropagator
from spmd.tensor.sharding.registry import REGISTRY, OpEntry
from spmd.tensor.sharding.vocabulary import Decision, OpCall, ShardingError
from spmd.tensor.spec import has_strided, unstrided_placements
from spmd.tensor.trace import FALLBACKS, STATE, log_decision, log_decomposition, log_line, op_scope

__all__ = ["dispatch", "Dispatcher", "DISPATCHER", "implicit_replication", "replicate_fallback"]

aten = torch.ops.aten


class Dispatcher:
    """Owns the propagator, the decision cache and the list path (safe to share between rank threads)."""

    def __init__(self) -> None:
        self.registry = REGISTRY
        self.propagator = ShardingPropagator(REGISTRY)
        self.decisions: DecisionCache[Decision] = DecisionCache()
        self.lists = ListOps(self.propagator, self.decisions, self.run_strided)
        self._fallback = os.environ.get("SPMD_FALLBACK", "1").strip() not in ("0", "false", "off")
        REGISTRY.add_listener(self.clear_cache)

    @property
    def fallback(self) -> bool:
        """Whether ops without a rule run on replicated inputs (logged) instead of raising.

        From ``SPMD_FALLBACK`` (on unless "0"); change it with ``replicate_fallback(enabled)``.
        """
        return self._fallback

    def set_fallback(self, enabled: bool) -> None:
        self._fallback = enabled
        self.clear_cache()  # decisions made under the other setting no longer apply

    @property
    def misses(self) -> int:
        """Decisions made so far (cache misses): a steady training loop stops adding to it."""
        return self.decisions.misses + self.lists.decisions.misses

    def clear_cache(self) -> None:
        self.decisions.clear()
        self.lists.decisions.clear()

    # ----- the five steps ------------------------------------------------------------------------
    def dispatch(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run aten ``op`` on DTensor arguments: the common case in-line, else the five steps."""
        entry = self.registry.entry(op)
        if not kwargs and not STATE.listening and not entry.inplace:
            # A plain positional call whose cached decision is simple: key, look up, run, wrap.
            key: list[Any] = [entry]
            positions: list[int] = []
            mesh = scan_leaves(entry, args, key, positions)
            if isinstance(mesh, DeviceMesh) and (mesh._callers_in_mesh or mesh.get_coordinate() is not None):
                try:
                    decision = self.decisions.get(tuple(key))
                except TypeError:  # an unhashable argument: the steps decide it
                    decision = None
                if decision is not None and decision.simple:
                    local = list(args)
                    for i in positions:
                        local[i] = local[i]._local_tensor
                    return wrap_result(entry.kernel(*local), decision.output_specs[0])  # type: ignore[arg-type]
        return self.run_steps(entry, args, kwargs)

    def run_steps(self, entry: OpEntry, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The five steps: unwrap and key, look up or decide, move inputs, run local, wrap."""
        if entry.answer is not None:  # read from global metadata (is_same_size): nothing to decide
            return entry.answer(entry.op, args, kwargs)
        if entry.out_variant is not None:
            return dispatch_out(entry, args, kwargs)
        if entry.list_op:
            return self.lists.dispatch(entry, args, kwargs)
        op = entry.op
        call = unwrap_call(entry, args, kwargs) or self.unwrap_mixed(entry, args, kwargs)
        if any(has_strided(call.leaves[i]._spec.placements) for i in call.positions):
            return self.run_strided(entry, call.leaves, call.shape, call.kwarg_names(), call.positions)
        if entry.inplace:
            refuse_write_into_copied_view(entry, call)
        decision, hit = self.decision_for(entry, call)
        outside = not call.mesh._callers_in_mesh and call.mesh.get_coordinate() is None
        # Outside the mesh a decomposition's DTensor ops give empty pieces, fine for tensor results;
        # a bool (equal) would come out of them False, so such ops answer at once.
        if decision.decomposition is not None and not (outside and not returns_tensors(entry)):
            if STATE.verbose:
                log_decomposition(op, call.specs(), decision, hit)
            return decision.decomposition(op, call.args, call.kwargs)
        if outside:
            return result_outside_mesh(entry, decision, call)
        local_args, local_kwargs = self.move_inputs(entry, decision, call, hit)
        result = self.run_local(entry, decision, call, local_args, local_kwargs)
        return self.wrap(entry, decision, call, result, local_args)

    def run_strided(
        self, entry: OpEntry, leaves: list[Any], shape: tuple[Any, ...], kwarg_names: list[str], positions: list[int]
    ) -> Any:
        """A call with ``_StridedShard`` inputs, which op rules never see (read as a plain Shard, a
        strided layout would give wrong values): an elementwise op whose operands share one layout
        runs on the local pieces (``elementwise_local``); any other runs again gathered."""
        local = run_elementwise_local(entry, leaves, shape, kwarg_names)  # no gather: each piece on its own
        if local is not NOT_LOCAL:
            return local
        return self.run_gathered(entry, leaves, shape, kwarg_names, positions)

    def run_gathered(
        self, entry: OpEntry, leaves: list[Any], shape: tuple[Any, ...], kwarg_names: list[str], positions: list[int]
    ) -> Any:
        """The call again, its ``_StridedShard`` inputs gathered to ``unstrided_placements`` first.

        The gather is an implicit move: logged, counted by CommDebugMode, refused under explicit
        redistribution. A strided argument the op writes into (``x.add_(y)``, a ``_foreach`` step)
        is written through its gathered copy, whose new values are then cut back into its pieces
        (locally: the copy holds every entry).
        """
        op = entry.op
        names = leaf_arguments(op, shape, kwarg_names, len(leaves))
        written = {a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        strided = [n for n, i in enumerate(positions) if has_strided(leaves[i]._spec.placements)]
        written_back = [leaves[positions[n]] for n in strided if names[positions[n]] in written]
        if written_back and entry.inplace_view:
            raise ShardingError(
                f"{op} would change the shape of {written_back[0]._spec} in place, and a _StridedShard layout "
                "cannot follow it; redistribute it to Shard/Replicate placements first, or use the out-of-place op"
            )
        if op in LAYOUT_NEUTRAL_OPS and len(positions) == 1 and not written_back:
            kept = run_layout_neutral(op, leaves, shape, kwarg_names, positions[0])
            if kept is not None:
                return kept
        wanted = [unstrided_placements(leaves[positions[n]]._spec.placements) for n in strided]
        if HOOKS.refuse_implicit is not None:
            placements = [leaves[i]._spec.placements for i in positions]
            for n, want in zip(strided, wanted):
                placements[n] = want
            move = Decision(tuple(placements), (), (), (), 0.0, entry.inplace, moves=tuple(strided))
            HOOKS.refuse_implicit(op, leaves, shape, kwarg_names, positions, move)
        gathered = list(leaves)
        copies: dict[int, DTensor] = {}  # an input passed twice (x + x) is gathered once
        with op_scope(str(op)) if STATE.listening else contextlib.nullcontext():
            for n, want in zip(strided, wanted):
                dt = leaves[positions[n]]
                if id(dt) not in copies:
                    if STATE.verbose:
                        log_line(
                            "%-30s input %d: %s -> %s  (gathered before the op's rule: _StridedShard)",
                            op, n, format_placements(dt._spec.placements), format_placements(want),
                        )  # fmt: skip
                    local = redistribute_local(dt._local_tensor, dt._spec, want)
                    copies[id(dt)] = DTensor(local, dt._spec.with_placements(want), requires_grad=False)
                gathered[positions[n]] = copies[id(dt)]
        new_args, new_kwargs = unflatten_call(gathered, shape, kwarg_names)
        result = self.dispatch(op, tuple(new_args), new_kwargs)
        if entry.returns_view and not entry.inplace:  # a view of the copy: writing into it must raise
            for piece in result if isinstance(result, (list, tuple)) else (result,):
                if isinstance(piece, DTensor):
                    piece._copied_view = True
        originals = {id(copies[id(dt)]): dt for dt in written_back}
        for dt in {id(dt): dt for dt in written_back}.values():
            copy = copies[id(dt)]  # still laid out as gathered: an in-place op keeps self's placements
            dt._local_tensor.copy_(redistribute_local(copy._local_tensor, copy._spec, dt._spec.placements))
        if isinstance(result, (list, tuple)):
            return type(result)(originals.get(id(r), r) for r in result)
        return originals.get(id(result), result)

    @staticmethod
    def unwrap_mixed(entry: OpEntry, args: tuple[Any, ...], kwargs: dict[str, Any]) -> UnwrappedCall:
        """Step 1 for a call with plain (not 0-d) tensors among its DTensors: they are replicated first."""
        leaves, shape = flatten_call(args, kwargs)
        new_args, new_kwargs = replicate_plain_tensors(entry, leaves, shape, list(kwargs))
        call = unwrap_call(entry, new_args, new_kwargs)
        assert call is not None
        return call

    def decision_for(self, entry: OpEntry, call: UnwrappedCall) -> tuple[Decision, bool]:
        """Step 2: the cached decision for the call's key, else a new one (and whether it was cached)."""
        return self.decisions.get_or_decide(call.key, lambda: self._decide(entry, call))

    def _decide(self, entry: OpEntry, call: UnwrappedCall) -> Decision:
        return self.propagator.decide_call(
            entry, call.leaves, call.shape, call.kwarg_names(), call.positions, fallback=self._fallback
        )

    def move_inputs(
        self, entry: OpEntry, decision: Decision, call: UnwrappedCall, hit: bool
    ) -> tuple[list[Any], dict[str, Any]]:
        """Step 3: the local arguments, with the inputs the decision moves redistributed."""
        leaves, positions = call.leaves, call.positions
        if decision.moves and HOOKS.refuse_implicit is not None:
            HOOKS.refuse_implicit(entry.op, leaves, call.shape, call.kwarg_names(), positions, decision)
        local = list(leaves)
        for i in positions:
            local[i] = leaves[i]._local_tensor
        if STATE.listening:
            with op_scope(str(entry.op)):
                if STATE.verbose:
                    log_decision(entry.op, call.specs(), decision, hit)
                redistribute_moved(leaves, local, positions, decision, verbose=STATE.verbose)
        elif decision.moves:
            redistribute_moved(leaves, local, positions, decision, verbose=False)
        if call.shape:
            local_args, local_kwargs = unflatten_call(local, call.shape, list(call.kwargs))
        else:
            local_args, local_kwargs = local, {}
        if decision.local_args is not None:
            return decision.local_args(local_args, local_kwargs, decision, decision.output_specs[0])
        return local_args, local_kwargs

    @staticmethod
    def run_local(
        entry: OpEntry, decision: Decision, call: UnwrappedCall, local_args: list[Any], local_kwargs: dict[str, Any]
    ) -> Any:
        """Step 4: the op on the local tensors (or the op's own local implementation)."""
        if decision.local_impl is not None:
            specs = tuple(
                call.leaves[i]._spec.with_placements(p) for i, p in zip(call.positions, decision.input_placements)
            )
            return decision.local_impl(entry.op, local_args, local_kwargs, specs, decision.output_specs)
        return entry.op(*local_args, **local_kwargs)

    @staticmethod
    def wrap(entry: OpEntry, decision: Decision, call: UnwrappedCall, result: Any, local_args: list[Any]) -> Any:
        """Step 5: the local results as DTensors of the decided specs (in-place ops return self)."""
        if decision.fallback:
            FALLBACKS.record(entry.op, [call.leaves[call.positions[n]] for n in decision.moves])
            return finish_fallback(result, decision, call.args, local_args, call.mesh)
        if decision.inplace:
            if decision.reshapes_self:
                reshape_self(entry.op, call.args, call.kwargs, decision.output_specs[0])
            return call.args[0]
        output_specs = decision.output_specs
        if isinstance(result, torch.Tensor):  # FakeTensor or FunctionalTensor while compiling
            spec = output_specs[0]
            if spec is None:
                return result
            wrapped = DTensor(result, spec, requires_grad=False)
            if decision.view_of_copy:
                wrapped._copied_view = True
            return wrapped
        if isinstance(result, (tuple, list)):
            pieces = [
                r if out is None or not isinstance(r, torch.Tensor) else DTensor(r, out, requires_grad=False)
                for r, out in zip(result, output_specs)
            ]
            if decision.view_of_copy:
                for piece in pieces:
                    if isinstance(piece, DTensor):
                        piece._copied_view = True
            return type(result)(pieces)
        return result

    # ----- for explain() -------------------------------------------------------------------------
    def make_call(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> OpCall:
        """What the rule for ``op`` sees of this call (a ``_StridedShard`` input as the gathered
        layout ``run_gathered`` hands the rule; nothing is gathered here)."""
        leaves, shape = flatten_call(args, kwargs)
        positions = [i for i, a in enumerate(leaves) if isinstance(a, DTensor)]
        if not positions:
            raise ValueError(f"{op} was given no DTensor argument")
        for i in positions:
            spec = leaves[i]._spec
            if has_strided(spec.placements):  # only the spec is read: the local tensor stays as it is
                plain = spec.with_placements(unstrided_placements(spec.placements))
                leaves[i] = DTensor(leaves[i]._local_tensor, plain, requires_grad=False)
        return self.propagator.make_call(op, leaves, shape, list(kwargs), positions)


DISPATCHER = Dispatcher()


def dispatch(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return DISPATCHER.dispatch(op, args, kwargs)


@contextlib.contextmanager
def replicate_fallback(enabled: bool) -> Iterator[None]:
    """Turn the replicate fallback on or off (process-wide: every rank thread) inside the block.

    Off, an op without a sharding rule raises ``ShardingError`` naming the op and its inputs; tests
    use this to prove that rules, not the fallback, ran.
    """
    was = DISPATCHER.fallback
    DISPATCHER.set_fallback(enabled)
    try:
        yield
    finally:
        DISPATCHER.set_fallback(was)
