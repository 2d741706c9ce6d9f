"""The dispatch loop: propagate -> redistribute -> run local -> wrap.

Decisions are cached by (op, input specs, non-tensor args). A repeated call pays one dict lookup
plus the local kernel; nothing is formatted for logging unless the debug logger is on.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from spmd.tensor.ops.registry import REGISTRY, OpCall
from spmd.tensor.propagation import Decision, ShardingPropagator
from spmd.tensor.redistribute import redistribute_local
from spmd.tensor.spec import DTensorSpec, TensorMeta

__all__ = ["dispatch", "Dispatcher", "DISPATCHER"]

logger = logging.getLogger("spmd.tensor.dispatch")

_SCALAR_TENSOR = "scalar-tensor"


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

    def clear_cache(self) -> None:
        self._cache.clear()

    def dispatch(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        from spmd.tensor.dtensor import DTensor

        leaves, shape = _flatten(args, kwargs)
        key_parts: list[Any] = [op, tuple(shape)]
        dtensor_positions: list[int] = []
        for i, a in enumerate(leaves):
            if isinstance(a, DTensor):
                dtensor_positions.append(i)
                key_parts.append(a._spec)
            elif isinstance(a, torch.Tensor):
                if a.ndim != 0:
                    # Not TypeError: Python would turn that into "unsupported operand" for `x + t`.
                    raise RuntimeError(
                        f"{op} got a plain torch.Tensor of shape {list(a.shape)} mixed with DTensors; "
                        "convert it with distribute_tensor(t, mesh, placements) or DTensor.from_local first"
                    )
                key_parts.append((_SCALAR_TENSOR, a.dtype))
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
        if logger.isEnabledFor(logging.INFO):
            _log_decision(op, [leaves[i]._spec for i in dtensor_positions], decision, hit)

        local_leaves = list(leaves)
        mesh = leaves[dtensor_positions[0]]._spec.mesh
        for n, i in enumerate(dtensor_positions):
            dt = leaves[i]
            if dt._spec.mesh != mesh:
                raise ValueError(
                    f"{op} got DTensors on different meshes ({mesh} and {dt._spec.mesh}); "
                    "redistribute or create them on one DeviceMesh"
                )
            want = decision.input_placements[n]
            local = dt._local_tensor
            if want != dt._spec.placements:
                local = redistribute_local(local, dt._spec, want)
            local_leaves[i] = local
        local_args, local_kwargs = _unflatten(local_leaves, shape, list(kwargs))
        if decision.local_args is not None:
            placements, meta = decision.output_placements[0], decision.output_metas[0]
            assert placements is not None and meta is not None  # ops with a local_args hook return a tensor
            out_spec = DTensorSpec(mesh, placements, meta)
            local_args, local_kwargs = decision.local_args(local_args, local_kwargs, decision, out_spec)
        result = op(*local_args, **local_kwargs)
        if decision.inplace:
            return args[0]
        return _wrap(result, decision, mesh)

    def _decide(
        self, op: Any, leaves: list[Any], shape: list[Any], kwarg_names: list[str], positions: list[int]
    ) -> Decision:
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
        call = OpCall(
            op, tuple(spec_args), spec_kwargs, tuple(leaves[i]._spec for i in positions), output_metas
        )
        return self.propagator.decide(call)


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
    from spmd.tensor.placement import format_placements

    inputs = ", ".join(format_placements(s.placements) for s in specs)
    chosen = " | ".join(str(s) for s in decision.strategies)
    logger.info("%-32s %-24s -> %-28s [%s]", op, inputs, chosen, "HIT" if hit else "MISS")


DISPATCHER = Dispatcher()


def dispatch(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return DISPATCHER.dispatch(op, args, kwargs)
