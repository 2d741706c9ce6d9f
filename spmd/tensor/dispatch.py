"""The dispatch loop: propagate -> redistribute -> run local -> wrap.

Decisions are cached by (op, input specs, non-tensor args). A repeated call pays one dict lookup
plus the local kernel; nothing is formatted for logging unless the debug logger is on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import return_and_correct_aliasing

from spmd.tensor.call_layout import (
    AMBIGUOUS_KEYS,
    DECISION_CACHE_LIMIT,
    SCALAR_TENSOR,
    flatten_call,
    mesh_mismatch_error,
    unflatten_call,
)
from spmd.tensor.dtensor import DTensor
from spmd.tensor.list_dispatch import LIST_OP, dispatch_list, is_list_op
from spmd.tensor.ops.registry import REGISTRY, OpCall
from spmd.tensor.placement import Replicate, format_placements
from spmd.tensor.propagation import Decision, ShardingError, ShardingPropagator, fallback_refusal, is_inplace
from spmd.tensor.redistribute import moves_data, redistribute_local
from spmd.tensor.spec import DTensorSpec, TensorMeta
from spmd.tensor.trace import FALLBACKS, STATE, log_decision, log_decomposition, log_line, op_scope, replication_note

__all__ = ["dispatch", "Dispatcher", "DISPATCHER", "implicit_replication"]

fallback_logger = logging.getLogger("spmd.tensor.dispatch")


class Dispatcher:
    """Owns the propagator and the decision cache (safe to share between rank threads)."""

    def __init__(self) -> None:
        self.propagator = ShardingPropagator(REGISTRY)
        self._cache: dict[Any, Decision] = {}
        self._list_cache: dict[Any, tuple[Decision, tuple[int, ...]]] = {}
        """List-op decisions, with the inputs each writes back after the kernel."""
        self._registry_version = REGISTRY.version
        self.hits = 0
        self.misses = 0
        self.fallback = os.environ.get("SPMD_FALLBACK", "1").strip() not in ("0", "false", "off")
        """Run ops that have no rule on replicated inputs (logged) instead of raising."""
        self._functional: dict[Any, Any] = {}
        """``out=`` overload -> (functional overload, out argument names); list op -> ``_LIST_OP``; else None."""

    def clear_cache(self) -> None:
        self._cache.clear()
        self._list_cache.clear()

    def dispatch(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run aten ``op`` on DTensor arguments: propagate -> redistribute -> run local -> wrap."""
        variant = self._functional.get(op, _UNKNOWN)
        if variant is _UNKNOWN:
            variant = self._functional[op] = LIST_OP if is_list_op(op) else functional_variant(op)
        if variant is not None:
            if variant is LIST_OP:
                return dispatch_list(self, op, args, kwargs)
            return _dispatch_out(op, variant, args, kwargs)
        leaves, shape = flatten_call(args, kwargs)
        key_parts: list[Any] = [op, shape]
        positions: list[int] = []
        mesh: Any = None
        for i, a in enumerate(leaves):
            if isinstance(a, DTensor):
                spec = a._spec
                if mesh is None:
                    mesh = spec.mesh
                elif spec.mesh is not mesh and spec.mesh != mesh:
                    raise mesh_mismatch_error(op, mesh, spec.mesh)
                positions.append(i)
                key_parts.append(spec)
            elif isinstance(a, torch.Tensor):
                if a.ndim != 0:  # rare: autograd formulas, implicit_replication()
                    return self.dispatch(op, *self._replicate_plain_tensors(op, args, kwargs))
                key_parts.append((SCALAR_TENSOR, a.dtype))
            elif type(a) in AMBIGUOUS_KEYS:  # 1, 1.0 and True hash alike but promote differently
                key_parts.append((type(a), a))
            else:
                key_parts.append(a)
        if mesh is None:
            raise AssertionError(f"{op} reached the DTensor dispatcher without a DTensor argument")
        first = leaves[positions[0]]
        if first._copied_view and positions[0] == 0 and is_inplace(op):
            raise RuntimeError(
                f"{op} writes into a view of a DTensor that had to be redistributed (or conjugated) to make the view, "
                f"so the write would not reach the original ({first._spec}); write into the original "
                "tensor, or call .clone() on the view first if it is meant to be a copy"
            )
        if REGISTRY.version != self._registry_version:
            self._cache.clear()
            self._registry_version = REGISTRY.version
        key: tuple[Any, ...] | None = tuple(key_parts)
        try:
            decision = self._cache.get(key)
        except TypeError:  # an unhashable argument: decide every time
            decision, key = None, None
        hit = decision is not None
        if decision is None:
            self.misses += 1
            decision = self._decide(op, leaves, shape, list(kwargs), positions)
            if key is not None:
                if len(self._cache) >= DECISION_CACHE_LIMIT:  # decisions pin their meshes (and worlds)
                    self._cache.clear()
                self._cache[key] = decision
        else:
            self.hits += 1
        if decision.decomposition is not None:  # the op runs as other DTensor ops (each dispatched here)
            if STATE.verbose:
                log_decomposition(op, [leaves[i]._spec for i in positions], decision, hit)
            return decision.decomposition(op, args, kwargs)

        local_leaves = list(leaves)
        for i in positions:
            local_leaves[i] = leaves[i]._local_tensor
        if decision.moves:
            if STATE.listening:
                with op_scope(str(op)):
                    if STATE.verbose:
                        log_decision(op, [leaves[i]._spec for i in positions], decision, hit)
                    self._move_inputs(leaves, local_leaves, positions, decision, verbose=STATE.verbose)
            else:
                self._move_inputs(leaves, local_leaves, positions, decision, verbose=False)
        elif STATE.verbose:
            log_decision(op, [leaves[i]._spec for i in positions], decision, hit)
        if shape:
            local_args, local_kwargs = unflatten_call(local_leaves, shape, list(kwargs))
        else:
            local_args, local_kwargs = local_leaves, {}
        if decision.local_args is not None:
            local_args, local_kwargs = decision.local_args(local_args, local_kwargs, decision, decision.output_specs[0])
        if decision.local_impl is not None:
            input_specs = tuple(leaves[i]._spec.with_placements(p) for i, p in zip(positions, decision.input_placements))
            result = decision.local_impl(op, local_args, local_kwargs, input_specs, decision.output_specs)
        else:
            result = op(*local_args, **local_kwargs)
        if decision.fallback:
            FALLBACKS.record(op, [leaves[positions[n]] for n in decision.moves])
            return _finish_fallback(result, decision, args, local_args, mesh)
        if decision.inplace:
            if decision.reshapes_self:
                _reshape_self(op, args, kwargs, decision.output_specs[0])
            return args[0]
        output_specs = decision.output_specs
        if type(result) is torch.Tensor:
            first = output_specs[0]
            if first is None:
                return result
            wrapped = DTensor(result, first, requires_grad=False)
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

    @staticmethod
    def _move_inputs(
        leaves: list[Any], local_leaves: list[Any], positions: list[int], decision: Decision, *, verbose: bool
    ) -> None:
        """Redistribute the inputs the decision moves, in place in ``local_leaves``.

        A DTensor passed twice (``addcmul_(g, g)``) is moved once.
        """
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
            local_leaves[positions[n]] = done[key]

    @staticmethod
    def _replicate_plain_tensors(
        op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Plain (non 0-d) tensors become replicated DTensors where that is known to be safe.

        Inside backward they come from autograd's own formulas (``zeros``, ``ones``), which are
        the same on every rank; elsewhere only inside ``implicit_replication()``.
        """
        leaves, shape = flatten_call(args, kwargs)
        mesh = next(a._spec.mesh for a in leaves if isinstance(a, DTensor))
        allowed = _implicit.enabled or torch._C._current_graph_task_id() != -1
        replicate = (Replicate(),) * mesh.ndim
        for i, a in enumerate(leaves):
            if isinstance(a, torch.Tensor) and not isinstance(a, DTensor) and a.ndim != 0:
                if not allowed:
                    # Not TypeError: Python would turn that into "unsupported operand" for `x + t`.
                    raise RuntimeError(
                        f"{op} got a plain torch.Tensor of shape {list(a.shape)} mixed with DTensors; "
                        "convert it with distribute_tensor(t, mesh, placements) or DTensor.from_local first, "
                        "or wrap the call in spmd.tensor.dispatch.implicit_replication() if every rank holds "
                        "the same tensor"
                    )
                leaves[i] = DTensor(a, DTensorSpec(mesh, replicate, TensorMeta.of(a)), requires_grad=False)
        new_args, new_kwargs = unflatten_call(leaves, shape, list(kwargs))
        return tuple(new_args), new_kwargs

    def _decide(
        self, op: Any, leaves: list[Any], shape: tuple[Any, ...], kwarg_names: list[str], positions: list[int]
    ) -> Decision:
        if self.fallback and self.propagator.registry.rule_for(op) is None:
            refusal = fallback_refusal(op)
            if refusal is None:
                return self._fallback_decision(op, leaves, positions, why="has no sharding rule")
            specs = ", ".join(
                f"{format_placements(leaves[i]._spec.placements)} {list(leaves[i]._spec.shape)}" for i in positions
            )
            raise ShardingError(
                f"{op} has no sharding rule (inputs {specs}) and the replicate fallback does not apply: "
                f"{refusal}; register a rule in spmd/tensor/ops/ or run the op on .to_local() tensors"
            )
        try:
            return self._propagate(op, leaves, shape, kwarg_names, positions)
        except ShardingError:
            # An in-place op whose rule cannot keep self's layout still runs: on whole tensors,
            # written back into self's shard.
            if self.fallback and is_inplace(op) and fallback_refusal(op) is None:
                return self._fallback_decision(op, leaves, positions, why="cannot keep self's placement")
            raise

    def _propagate(
        self, op: Any, leaves: list[Any], shape: tuple[Any, ...], kwarg_names: list[str], positions: list[int]
    ) -> Decision:
        """The propagator's decision for one call, with the moves and output specs filled in."""
        call = self._make_call(op, leaves, shape, kwarg_names, positions)
        decomposed = self.propagator.decompose(call)
        if decomposed is not None:
            return decomposed
        decision = self.propagator.decide(call)
        input_specs: list[DTensorSpec] = [leaves[i]._spec for i in positions]
        mesh = input_specs[0].mesh
        # A placement that changes only on one-rank mesh dims is a relabel: the shard is used as it
        # is (not copied), so a view of it still aliases the input.
        moves = tuple(
            n for n, s in enumerate(input_specs) if moves_data(s.placements, decision.input_placements[n], mesh.shape)
        )
        returns_view = any(r.alias_info is not None and not r.alias_info.is_write for r in op._schema.returns)
        return dataclasses.replace(
            decision,
            # a view computed by a local_impl (``_conj``) holds new values, so it aliases nothing either
            view_of_copy=returns_view and (bool(moves) or decision.local_impl is not None),
            moves=moves,
            output_specs=tuple(
                None if p is None or m is None else DTensorSpec(mesh, p, m)
                for p, m in zip(decision.output_placements, decision.output_metas)
            ),
        )

    def _fallback_decision(self, op: Any, leaves: list[Any], positions: list[int], *, why: str) -> Decision:
        mesh = leaves[positions[0]]._spec.mesh
        replicate = (Replicate(),) * mesh.ndim
        if FALLBACKS.warn_once(op):
            fallback_logger.warning(
                "%s %s; it runs on replicated inputs (every input is gathered). "
                "Register a rule in spmd/tensor/ops/ to keep it sharded. Warned once per op and process; "
                "spmd.tensor.debug.fallback_report() lists every op that fell back, with calls and bytes gathered.",
                op,
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
            inplace=is_inplace(op),
            fallback=True,
        )

    def _make_call(
        self, op: Any, leaves: list[Any], shape: tuple[Any, ...], kwarg_names: list[str], positions: list[int]
    ) -> OpCall:
        meta_leaves = list(leaves)
        spec_leaves = list(leaves)
        for i in positions:
            spec: DTensorSpec = leaves[i]._spec
            meta = spec.tensor_meta
            meta_leaves[i] = torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device="meta")
            spec_leaves[i] = spec
        for i, a in enumerate(leaves):
            if isinstance(a, torch.Tensor) and i not in positions:
                meta_leaves[i] = a.to("meta")
            elif isinstance(a, torch.device):
                # ``x.to(dtype, device="cpu")`` would copy the meta tensor out; shapes are all we need
                meta_leaves[i] = torch.device("meta")
        meta_args, meta_kwargs = unflatten_call(meta_leaves, shape, kwarg_names)
        try:
            # an op that returns no tensor (fused optimizers, item()) has no output shape to find
            meta_out = op(*meta_args, **meta_kwargs) if _returns_tensors(op) else ()
        except Exception as error:
            raise NotImplementedError(f"cannot compute the output shape of {op} on the meta device: {error}") from error
        outputs = meta_out if isinstance(meta_out, (tuple, list)) else (meta_out,)
        output_metas = tuple(TensorMeta.of(o) if isinstance(o, torch.Tensor) else None for o in outputs)
        spec_args, spec_kwargs = unflatten_call(spec_leaves, shape, kwarg_names)
        return OpCall(op, tuple(spec_args), spec_kwargs, tuple(leaves[i]._spec for i in positions), output_metas)

    def make_call(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> OpCall:
        """What the rule for ``op`` sees of this call (used by ``explain``)."""
        leaves, shape = flatten_call(args, kwargs)
        positions = [i for i, a in enumerate(leaves) if isinstance(a, DTensor)]
        if not positions:
            raise ValueError(f"{op} was given no DTensor argument")
        return self._make_call(op, leaves, shape, list(kwargs), positions)


_UNKNOWN = object()


def _returns_tensors(op: Any) -> bool:
    return any("Tensor" in str(r.type) for r in op._schema.returns)


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


def _dispatch_out(op: Any, variant: tuple[Any, tuple[str, ...]], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``op(..., out=o)``: run the functional op on DTensors, then copy into ``o`` in its own layout."""
    functional, out_names = variant
    outs = [kwargs[name] for name in out_names]
    rest = {k: v for k, v in kwargs.items() if k not in out_names}
    result = functional(*args, **rest)
    results = result if isinstance(result, (tuple, list)) else (result,)
    for out, value in zip(outs, results):
        if not isinstance(out, DTensor):
            raise RuntimeError(f"{op}: out= must be a DTensor when the inputs are DTensors")
        if tuple(out.shape) != tuple(value.shape) or out.dtype != value.dtype:
            raise RuntimeError(
                f"{op}: out= has shape {list(out.shape)} and dtype {out.dtype}, the result {list(value.shape)} "
                f"and {value.dtype}; DTensor out= tensors are not resized, so pass one of the result's shape"
            )
        out.copy_(value)  # the result is laid out as ``out`` (copy_ keeps self's placement)
    return outs[0] if len(outs) == 1 else tuple(outs)


class _ImplicitReplication(threading.local):
    enabled = False


_implicit = _ImplicitReplication()


@contextlib.contextmanager
def implicit_replication() -> Iterator[None]:
    """Treat plain tensors mixed with DTensors as replicated (every rank must hold the same values)."""
    was = _implicit.enabled
    _implicit.enabled = True
    try:
        yield
    finally:
        _implicit.enabled = was


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


def dispatch(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return DISPATCHER.dispatch(op, args, kwargs)
