"""The dispatch loop, in five steps: unwrap and key -> look up or decide -> move inputs -> run local -> wrap.

Decisions are cached by (op entry, input specs, non-tensor args). A repeated call pays one dict
lookup plus the local kernel; nothing is formatted for logging unless a debug tool listens.
``out=`` overloads and list ops (``_foreach_*``, fused optimizers) take their own short paths.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import return_and_correct_aliasing

from spmd.tensor import dtensor as dtensor_module
from spmd.tensor.call_layout import (
    DECISION_CACHE_LIMIT,
    UnwrappedCall,
    flatten_call,
    scan_leaves,
    unflatten_call,
    unwrap_call,
)
from spmd.tensor.device_mesh import DeviceMesh
from spmd.tensor.dtensor import DTensor, implicit_replication, plain_tensors_allowed, wrap_result
from spmd.tensor.list_dispatch import _leaf_arguments, dispatch_list
from spmd.tensor.ops.registry import REGISTRY, OpCall, OpEntry
from spmd.tensor.placement import Replicate, format_placements
from spmd.tensor.propagation import Decision, ShardingError, ShardingPropagator
from spmd.tensor.redistribute import redistribute_local
from spmd.tensor.spec import DTensorSpec, TensorMeta, has_strided, unstrided_placements
from spmd.tensor.trace import FALLBACKS, STATE, log_decision, log_decomposition, log_line, op_scope, replication_note

__all__ = ["dispatch", "Dispatcher", "DISPATCHER", "implicit_replication", "replicate_fallback"]

aten = torch.ops.aten


class Dispatcher:
    """Owns the propagator and the decision caches (safe to share between rank threads)."""

    def __init__(self) -> None:
        self.registry = REGISTRY
        self.propagator = ShardingPropagator(REGISTRY)
        self.cache: dict[Any, Decision] = {}
        self.list_cache: dict[Any, tuple[Decision, tuple[int, ...]]] = {}
        """List-op decisions, with the inputs each writes back after the kernel."""
        self.misses = 0
        """Decisions made so far (cache misses): a steady training loop stops adding to it."""
        self.refuse_implicit: Callable[..., None] | None = None
        """While explicit redistribution is on (spmd/tensor/debug/explicit.py), the check that raises
        for a decided move that sends data; called only on the path that moves an input."""
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

    def clear_cache(self) -> None:
        self.cache.clear()
        self.list_cache.clear()

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
                    decision = self.cache.get(tuple(key))
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
            return _dispatch_out(entry, args, kwargs)
        if entry.list_op:
            return dispatch_list(self, entry, args, kwargs)
        op = entry.op
        call = unwrap_call(entry, args, kwargs) or self.unwrap_mixed(entry, args, kwargs)
        if any(has_strided(call.leaves[i]._spec.placements) for i in call.positions):
            return self.run_gathered(entry, call.leaves, call.shape, call.kwarg_names(), call.positions)
        if entry.inplace:
            _refuse_write_into_copied_view(entry, call)
        decision, hit = self.decision_for(entry, call)
        outside = not call.mesh._callers_in_mesh and call.mesh.get_coordinate() is None
        # Outside the mesh a decomposition's DTensor ops give empty pieces, fine for tensor results;
        # a bool (equal) would come out of them False, so such ops answer at once.
        if decision.decomposition is not None and not (outside and not _returns_tensors(entry)):
            if STATE.verbose:
                log_decomposition(op, call.specs(), decision, hit)
            return decision.decomposition(op, call.args, call.kwargs)
        if outside:
            return _result_outside_mesh(entry, decision, call)
        local_args, local_kwargs = self.move_inputs(entry, decision, call, hit)
        result = self.run_local(entry, decision, call, local_args, local_kwargs)
        return self.wrap(entry, decision, call, result, local_args)

    def run_gathered(
        self, entry: OpEntry, leaves: Sequence[Any], shape: tuple[Any, ...], kwarg_names: list[str], positions: Sequence[int]
    ) -> Any:
        """The call again, its ``_StridedShard`` inputs gathered to ``unstrided_placements`` first.

        Op rules know Shard, Replicate and Partial only, so none ever sees a strided layout (read as
        a plain Shard it would give wrong values). The gather is an implicit move: logged, counted
        by CommDebugMode, refused under explicit redistribution. A strided argument the op writes
        into (``x.add_(y)``, an optimizer's foreach step) is written through its gathered copy, whose
        new values are then cut back into its pieces (locally: the copy holds every entry).
        """
        op = entry.op
        names = _leaf_arguments(op, shape, kwarg_names, len(leaves))
        written = {a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        strided = [n for n, i in enumerate(positions) if has_strided(leaves[i]._spec.placements)]
        written_back = [leaves[positions[n]] for n in strided if names[positions[n]] in written]
        if written_back and entry.inplace_view:
            raise ShardingError(
                f"{op} would change the shape of {written_back[0]._spec} in place, and a _StridedShard layout "
                "cannot follow it; redistribute it to Shard/Replicate placements first, or use the out-of-place op"
            )
        if op in LAYOUT_NEUTRAL_OPS and len(positions) == 1 and not written_back:
            kept = _run_layout_neutral(op, leaves, shape, kwarg_names, positions[0])
            if kept is not None:
                return kept
        wanted = [unstrided_placements(leaves[positions[n]]._spec.placements) for n in strided]
        if self.refuse_implicit is not None:
            placements = [leaves[i]._spec.placements for i in positions]
            for n, want in zip(strided, wanted):
                placements[n] = want
            move = Decision(tuple(placements), (), (), (), 0.0, entry.inplace, moves=tuple(strided))
            self.refuse_implicit(op, leaves, shape, kwarg_names, positions, move)
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
                        )
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
        new_args, new_kwargs = _replicate_plain_tensors(entry, leaves, shape, list(kwargs))
        call = unwrap_call(entry, new_args, new_kwargs)
        assert call is not None
        return call

    def decision_for(self, entry: OpEntry, call: UnwrappedCall) -> tuple[Decision, bool]:
        """Step 2: the cached decision for the call's key, else a new one (and whether it was cached)."""
        try:
            decision = self.cache.get(call.key)
        except TypeError:  # an unhashable argument: decide every time
            self.misses += 1
            return self._decide(entry, call), False
        if decision is not None:
            return decision, True
        self.misses += 1
        decision = self._decide(entry, call)
        if len(self.cache) >= DECISION_CACHE_LIMIT:  # decisions pin their meshes (and worlds)
            self.cache.clear()
        self.cache[call.key] = decision
        return decision, False

    def _decide(self, entry: OpEntry, call: UnwrappedCall) -> Decision:
        return self.propagator.decide_call(
            entry, call.leaves, call.shape, call.kwarg_names(), call.positions, fallback=self._fallback
        )

    def move_inputs(
        self, entry: OpEntry, decision: Decision, call: UnwrappedCall, hit: bool
    ) -> tuple[list[Any], dict[str, Any]]:
        """Step 3: the local arguments, with the inputs the decision moves redistributed."""
        leaves, positions = call.leaves, call.positions
        if decision.moves and self.refuse_implicit is not None:
            self.refuse_implicit(entry.op, leaves, call.shape, call.kwarg_names(), positions, decision)
        local = list(leaves)
        for i in positions:
            local[i] = leaves[i]._local_tensor
        if STATE.listening:
            with op_scope(str(entry.op)):
                if STATE.verbose:
                    log_decision(entry.op, call.specs(), decision, hit)
                self.redistribute_moved(leaves, local, positions, decision, verbose=STATE.verbose)
        elif decision.moves:
            self.redistribute_moved(leaves, local, positions, decision, verbose=False)
        if call.shape:
            local_args, local_kwargs = unflatten_call(local, call.shape, list(call.kwargs))
        else:
            local_args, local_kwargs = local, {}
        if decision.local_args is not None:
            return decision.local_args(local_args, local_kwargs, decision, decision.output_specs[0])
        return local_args, local_kwargs

    @staticmethod
    def redistribute_moved(
        leaves: Any, local: list[Any], positions: list[int], decision: Decision, *, verbose: bool
    ) -> None:
        """Redistribute the inputs the decision moves, in place in ``local``; one passed twice
        (``addcmul_(g, g)``) is moved once."""
        done: dict[tuple[int, tuple[Any, ...]], Any] = {}
        for n in decision.moves:
            dt = leaves[positions[n]]
            want = decision.input_placements[n]
            key = (id(dt), want)
            if key not in done:
                if verbose:
                    log_line(
                        "  input %d: %s -> %s%s",
                        n,
                        format_placements(dt._spec.placements),
                        format_placements(want),
                        replication_note(dt._spec, want),
                    )
                done[key] = redistribute_local(dt._local_tensor, dt._spec, want)
            local[positions[n]] = done[key]

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
            return _finish_fallback(result, decision, call.args, local_args, call.mesh)
        if decision.inplace:
            if decision.reshapes_self:
                _reshape_self(entry.op, call.args, call.kwargs, decision.output_specs[0])
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


LAYOUT_NEUTRAL_OPS = frozenset({aten.detach.default, aten.alias.default, aten.clone.default, aten._to_copy.default})
"""Ops whose result on the local piece is the result's piece in any layout (a copy, a cast, an
alias): run on a ``_StridedShard`` input as they are, they keep its placements (autograd's
``detach`` of a gradient, ``x.float()``)."""


def _run_layout_neutral(
    op: Any, leaves: Sequence[Any], shape: tuple[Any, ...], kwarg_names: list[str], position: int
) -> DTensor | None:
    """``op`` on the one DTensor's local piece, wrapped with its spec (in the result's dtype); None
    when the result left the piece's device (``x.to("cuda")``: the regular path decides that)."""
    dt = leaves[position]
    local = list(leaves)
    local[position] = dt._local_tensor
    local_args, local_kwargs = unflatten_call(local, shape, kwarg_names)
    result = op(*local_args, **local_kwargs)
    if result.device != dt._local_tensor.device:
        return None
    return DTensor(result, dt._spec.with_dtype(result.dtype), requires_grad=False)


def _result_outside_mesh(entry: OpEntry, decision: Decision, call: UnwrappedCall) -> Any:
    """The result on a rank outside the op's mesh, as torch gives it: no kernel and no collective
    runs; each tensor output is a DTensor of the decided spec holding an empty piece (a 0-d zero for
    a 0-d tensor); a bool is True (the answer of a comparison the rank takes no part in), other
    values None. An in-place op returns its (empty) self."""
    mesh = call.mesh
    if decision.fallback:
        raise NotImplementedError(
            f"{entry.op} has no sharding rule, and rank {mesh.get_rank()} is not part of {mesh!r}, so the "
            "replicate fallback cannot run there; register a rule for the op in spmd/tensor/ops/"
        )
    if decision.inplace:
        if decision.reshapes_self and decision.output_specs[0] is not None:
            call.args[0]._spec = decision.output_specs[0]
        return call.args[0]

    def empty(spec: DTensorSpec) -> DTensor:
        shape = () if spec.ndim == 0 else (0,)
        local = torch.zeros(shape, dtype=spec.tensor_meta.dtype, device=mesh.device_type)
        return DTensor(local, spec, requires_grad=False)

    returns = entry.op._schema.returns
    specs = list(decision.output_specs) + [None] * max(0, len(returns) - len(decision.output_specs))
    if len(returns) == 1 and isinstance(returns[0].type, torch.ListType):
        return [empty(spec) for spec in specs if spec is not None]
    results = [
        empty(spec) if spec is not None else (True if str(ret.type) == "bool" else None)
        for spec, ret in zip(specs, returns)
    ]
    return results[0] if len(returns) == 1 else tuple(results)


def _returns_tensors(entry: OpEntry) -> bool:
    return any("Tensor" in str(ret.type) for ret in entry.op._schema.returns)


def _refuse_write_into_copied_view(entry: OpEntry, call: UnwrappedCall) -> None:
    if call.positions[0] == 0 and call.leaves[0]._copied_view:
        raise RuntimeError(
            f"{entry.op} writes into a view of a DTensor that had to be redistributed (or conjugated) to make "
            f"the view, so the write would not reach the original ({call.leaves[0]._spec}); write into the "
            "original tensor, or call .clone() on the view first if it is meant to be a copy"
        )


def _replicate_plain_tensors(
    entry: OpEntry, leaves: list[Any], shape: tuple[Any, ...], kwarg_names: list[str]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Plain (non 0-d) tensors become replicated DTensors where that is known to be safe.

    Inside backward they come from autograd's own formulas (``zeros``, ``ones``), which are the
    same on every rank; elsewhere only inside ``implicit_replication()``, or when they hold one
    element (``torch.tensor([1.0])``), which torch reads as a scalar just like a 0-d tensor.
    """
    mesh = next(a._spec.mesh for a in leaves if isinstance(a, DTensor))
    replicate = (Replicate(),) * mesh.ndim
    leaves = list(leaves)
    for i, a in enumerate(leaves):
        if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) and a.ndim != 0:
            if a.numel() != 1 and not plain_tensors_allowed():
                # Not TypeError: Python would turn that into "unsupported operand" for `x + t`.
                raise RuntimeError(
                    f"{entry.op} got a plain torch.Tensor of shape {list(a.shape)} mixed with DTensors; "
                    "convert it with distribute_tensor(t, mesh, placements) or DTensor.from_local first, "
                    "or wrap the call in spmd.tensor.dispatch.implicit_replication() if every rank holds "
                    "the same tensor"
                )
            leaves[i] = DTensor(a, DTensorSpec(mesh, replicate, TensorMeta.of(a)), requires_grad=False)
    args, kwargs = unflatten_call(leaves, shape, kwarg_names)
    return tuple(args), kwargs


def _dispatch_out(entry: OpEntry, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``op(..., out=o)``: run the functional op on DTensors, then copy into ``o`` in its own layout."""
    assert entry.out_variant is not None
    functional, out_names = entry.out_variant
    outs = [kwargs[name] for name in out_names]
    rest = {k: v for k, v in kwargs.items() if k not in out_names}
    result = functional(*args, **rest)
    results = result if isinstance(result, (tuple, list)) else (result,)
    for out, value in zip(outs, results):
        if not isinstance(out, DTensor):
            raise RuntimeError(f"{entry.op}: out= must be a DTensor when the inputs are DTensors")
        if tuple(out.shape) != tuple(value.shape) or out.dtype != value.dtype:
            raise RuntimeError(
                f"{entry.op}: out= has shape {list(out.shape)} and dtype {out.dtype}, the result {list(value.shape)} "
                f"and {value.dtype}; DTensor out= tensors are not resized, so pass one of the result's shape"
            )
        out.copy_(value)  # the result is laid out as ``out`` (copy_ keeps self's placement)
    return outs[0] if len(outs) == 1 else tuple(outs)


def _reshape_self(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], spec: DTensorSpec | None) -> None:
    """After an in-place view (``squeeze_``, ``t_``) of the local shard, self takes the new spec and
    its wrapper's sizes and strides follow (torch's helper reruns the op on the metadata only)."""
    target: DTensor = args[0]
    assert spec is not None
    target._spec = spec
    return_and_correct_aliasing(op, args, kwargs, target)  # type: ignore[no-untyped-call]


def _finish_fallback(result: Any, decision: Decision, args: tuple[Any, ...], local_args: list[Any], mesh: Any) -> Any:
    """Wrap a fallback's whole-tensor results as Replicate; an in-place op writes back into self."""
    replicate = (Replicate(),) * mesh.ndim
    if decision.inplace:
        target: DTensor = args[0]
        full_spec = target._spec.with_placements(replicate)
        piece = redistribute_local(local_args[0], full_spec, target._spec.placements)
        target._local_tensor.copy_(piece)
        return target

    def one(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        return DTensor(value, DTensorSpec(mesh, replicate, TensorMeta.of(value)), requires_grad=False)

    if isinstance(result, (tuple, list)):
        return type(result)(one(r) for r in result)
    return one(result)


DISPATCHER = Dispatcher()
dtensor_module.set_dispatch(DISPATCHER.dispatch)


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
