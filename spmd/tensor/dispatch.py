"""The dispatch loop: propagate -> redistribute -> run local -> wrap.

Decisions are cached by (op, input specs, non-tensor args). A repeated call pays one dict lookup
plus the local kernel; nothing is formatted for logging unless the debug logger is on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch

from spmd.tensor.debug.state import STATE, op_scope
from spmd.tensor.debug.verbose import log_line
from spmd.tensor.ops.registry import REGISTRY, OpCall
from spmd.tensor.placement import Replicate, format_placements
from spmd.tensor.propagation import Decision, ShardingError, ShardingPropagator, fallback_refusal, is_inplace
from spmd.tensor.redistribute import redistribute_local
from spmd.tensor.spec import DTENSOR_DTYPE_SHORT, DTensorSpec, TensorMeta

__all__ = ["dispatch", "Dispatcher", "DISPATCHER", "implicit_replication"]

_SCALAR_TENSOR = "scalar-tensor"
fallback_logger = logging.getLogger("spmd.tensor.dispatch")


def _flatten(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """Leaves of ``args``/``kwargs`` (one level of lists, as aten schemas have) and their keys."""
    leaves: list[Any] = []
    shape: list[Any] = []
    for a in args:
        if isinstance(a, (list, tuple)):
            shape.append(len(a))
            leaves.extend(a)
        else:
            shape.append(-1)
            leaves.append(a)
    for name, a in kwargs.items():
        if isinstance(a, (list, tuple)):
            shape.append((name, len(a)))
            leaves.extend(a)
        else:
            shape.append(name)
            leaves.append(a)
    return leaves, shape


def _unflatten(leaves: list[Any], shape: list[Any], kwarg_names: list[str]) -> tuple[list[Any], dict[str, Any]]:
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    pos = 0
    for entry in shape:
        if isinstance(entry, int):
            if entry < 0:
                args.append(leaves[pos])
                pos += 1
            else:
                args.append(leaves[pos : pos + entry])
                pos += entry
        elif isinstance(entry, tuple):
            name, length = entry
            kwargs[name] = leaves[pos : pos + length]
            pos += length
        else:
            kwargs[entry] = leaves[pos]
            pos += 1
    return args, kwargs


class Dispatcher:
    """Owns the propagator and the decision cache (safe to share between rank threads)."""

    def __init__(self) -> None:
        self.propagator = ShardingPropagator(REGISTRY)
        self._cache: dict[Any, Decision] = {}
        self._registry_version = REGISTRY.version
        self.hits = 0
        self.misses = 0
        self.fallback = os.environ.get("SPMD_FALLBACK", "1").strip() not in ("0", "false", "off")
        """Run ops that have no rule on replicated inputs (logged) instead of raising."""
        self._warned: set[Any] = set()

    def clear_cache(self) -> None:
        self._cache.clear()

    def dispatch(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        from spmd.tensor.dtensor import DTensor

        leaves, shape = _flatten(args, kwargs)
        if _has_plain_tensor(leaves):
            leaves = self._replicate_plain_tensors(op, leaves)
        key_parts: list[Any] = [op, tuple(shape)]
        dtensor_positions: list[int] = []
        for i, a in enumerate(leaves):
            if isinstance(a, DTensor):
                if dtensor_positions and a._spec.mesh != leaves[dtensor_positions[0]]._spec.mesh:
                    raise ValueError(
                        f"{op} got DTensors on different meshes ({leaves[dtensor_positions[0]]._spec.mesh} and "
                        f"{a._spec.mesh}); redistribute or create them on one DeviceMesh"
                    )
                dtensor_positions.append(i)
                key_parts.append(a._spec)
            elif isinstance(a, torch.Tensor):
                key_parts.append((_SCALAR_TENSOR, a.dtype))  # only 0-d ones are left here
            else:
                key_parts.append((type(a), a))
        if not dtensor_positions:
            raise AssertionError(f"{op} reached the DTensor dispatcher without a DTensor argument")
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
            decision = self._decide(op, leaves, shape, list(kwargs), dtensor_positions)
            if key is not None:
                self._cache[key] = decision
        else:
            self.hits += 1
        specs = [leaves[i]._spec for i in dtensor_positions]
        if STATE.listening:
            with op_scope(str(op)):
                if STATE.verbose:
                    _log_decision(op, specs, decision, hit)
                local_leaves = self._localize(leaves, dtensor_positions, decision, verbose=STATE.verbose)
        else:
            local_leaves = self._localize(leaves, dtensor_positions, decision, verbose=False)
        mesh = specs[0].mesh
        local_args, local_kwargs = _unflatten(local_leaves, shape, list(kwargs))
        if decision.local_args is not None:
            placements, meta = decision.output_placements[0], decision.output_metas[0]
            assert placements is not None and meta is not None  # ops with a local_args hook return a tensor
            out_spec = DTensorSpec(mesh, placements, meta)
            local_args, local_kwargs = decision.local_args(local_args, local_kwargs, decision, out_spec)
        if decision.local_impl is not None:
            input_specs = tuple(s.with_placements(p) for s, p in zip(specs, decision.input_placements))
            output_specs = tuple(
                None if p is None or m is None else DTensorSpec(mesh, p, m)
                for p, m in zip(decision.output_placements, decision.output_metas)
            )
            result = decision.local_impl(op, local_args, local_kwargs, input_specs, output_specs)
        else:
            result = op(*local_args, **local_kwargs)
        if decision.fallback:
            return _finish_fallback(result, decision, args, local_args, mesh)
        if decision.inplace:
            return args[0]
        return _wrap(result, decision, mesh)

    @staticmethod
    def _replicate_plain_tensors(op: Any, leaves: list[Any]) -> list[Any]:
        """Plain (non 0-d) tensors become replicated DTensors where that is known to be safe.

        Inside backward they come from autograd's own formulas (``zeros``, ``ones``), which are
        the same on every rank; elsewhere only inside ``implicit_replication()``.
        """
        from spmd.tensor.dtensor import DTensor

        mesh = next(a._spec.mesh for a in leaves if isinstance(a, DTensor))
        allowed = _implicit.enabled or torch._C._current_graph_task_id() != -1
        replicate = (Replicate(),) * mesh.ndim
        converted = list(leaves)
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
                converted[i] = DTensor(a, DTensorSpec(mesh, replicate, TensorMeta.of(a)), requires_grad=False)
        return converted

    @staticmethod
    def _localize(leaves: list[Any], positions: list[int], decision: Decision, *, verbose: bool) -> list[Any]:
        """Leaves with every DTensor replaced by its local shard in the placements the op needs."""
        local_leaves = list(leaves)
        for n, i in enumerate(positions):
            dt = leaves[i]
            want = decision.input_placements[n]
            local = dt._local_tensor
            if want != dt._spec.placements:
                if verbose:
                    log_line("  input %d: %s -> %s", n, format_placements(dt._spec.placements), format_placements(want))
                local = redistribute_local(local, dt._spec, want)
            local_leaves[i] = local
        return local_leaves

    def _decide(
        self, op: Any, leaves: list[Any], shape: list[Any], kwarg_names: list[str], positions: list[int]
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
            return self.propagator.decide(self._make_call(op, leaves, shape, kwarg_names, positions))
        except ShardingError:
            # An in-place op whose rule cannot keep self's layout still runs: on whole tensors,
            # written back into self's shard.
            if self.fallback and is_inplace(op) and fallback_refusal(op) is None:
                return self._fallback_decision(op, leaves, positions, why="cannot keep self's placement")
            raise

    def _fallback_decision(self, op: Any, leaves: list[Any], positions: list[int], *, why: str) -> Decision:
        mesh = leaves[positions[0]]._spec.mesh
        replicate = (Replicate(),) * mesh.ndim
        if op not in self._warned:
            self._warned.add(op)
            fallback_logger.warning(
                "%s %s; it runs on replicated inputs (every input is gathered). "
                "Register a rule in spmd/tensor/ops/ to keep it sharded.",
                op,
                why,
            )
        return Decision(
            input_placements=(replicate,) * len(positions),
            output_placements=(),
            output_metas=(),
            strategies=(),
            cost=float("inf"),
            inplace=is_inplace(op),
            fallback=True,
        )

    def _make_call(
        self, op: Any, leaves: list[Any], shape: list[Any], kwarg_names: list[str], positions: list[int]
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
        meta_args, meta_kwargs = _unflatten(meta_leaves, shape, kwarg_names)
        try:
            meta_out = op(*meta_args, **meta_kwargs)
        except Exception as error:
            raise NotImplementedError(f"cannot compute the output shape of {op} on the meta device: {error}") from error
        outputs = meta_out if isinstance(meta_out, (tuple, list)) else (meta_out,)
        output_metas = tuple(TensorMeta.of(o) if isinstance(o, torch.Tensor) else None for o in outputs)
        spec_args, spec_kwargs = _unflatten(spec_leaves, shape, kwarg_names)
        return OpCall(op, tuple(spec_args), spec_kwargs, tuple(leaves[i]._spec for i in positions), output_metas)

    def make_call(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> OpCall:
        """What the rule for ``op`` sees of this call (used by ``explain``)."""
        from spmd.tensor.dtensor import DTensor

        leaves, shape = _flatten(args, kwargs)
        positions = [i for i, a in enumerate(leaves) if isinstance(a, DTensor)]
        if not positions:
            raise ValueError(f"{op} was given no DTensor argument")
        return self._make_call(op, leaves, shape, list(kwargs), positions)


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


def _has_plain_tensor(leaves: list[Any]) -> bool:
    from spmd.tensor.dtensor import DTensor

    return any(isinstance(a, torch.Tensor) and not isinstance(a, DTensor) and a.ndim != 0 for a in leaves)


def _finish_fallback(result: Any, decision: Decision, args: tuple[Any, ...], local_args: list[Any], mesh: Any) -> Any:
    """Wrap a fallback's whole-tensor results as Replicate; an in-place op writes back into self."""
    from spmd.tensor.dtensor import DTensor

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


def _wrap(result: Any, decision: Decision, mesh: Any) -> Any:
    from spmd.tensor.dtensor import DTensor

    def one(local: Any, index: int) -> Any:
        placements = decision.output_placements[index]
        meta = decision.output_metas[index]
        if placements is None or meta is None or not isinstance(local, torch.Tensor):
            return local
        return DTensor(local, DTensorSpec(mesh, placements, meta), requires_grad=False)

    if isinstance(result, (tuple, list)):
        return type(result)(one(r, i) for i, r in enumerate(result))
    return one(result, 0)


def _log_decision(op: Any, specs: list[DTensorSpec], decision: Decision, hit: bool) -> None:
    inputs = ", ".join(f"{format_placements(s.placements)} {_short(s.tensor_meta)}" for s in specs)
    outputs = ", ".join(
        f"{format_placements(p)} {_short(m)}"
        for p, m in zip(decision.output_placements, decision.output_metas)
        if p is not None and m is not None
    )
    if decision.fallback:
        log_line("%-30s %s  ->  FALLBACK: no rule, inputs replicated   [%s]", op, inputs, "HIT" if hit else "MISS")
        return
    chosen = " | ".join(str(s) for s in decision.strategies)
    log_line("%-30s %s  ->  %s   via %s   [%s]", op, inputs, outputs or "-", chosen, "HIT" if hit else "MISS")


def _short(meta: TensorMeta) -> str:
    dtype = DTENSOR_DTYPE_SHORT.get(meta.dtype, str(meta.dtype).replace("torch.", ""))
    return dtype + "[" + ",".join(str(s) for s in meta.shape) + "]"


DISPATCHER = Dispatcher()


def dispatch(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return DISPATCHER.dispatch(op, args, kwargs)
