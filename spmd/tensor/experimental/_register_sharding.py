"""register_sharding: a user's sharding strategies for an op become that op's rule in the registry.

The user's function has torch's form: it takes the op's arguments, with each DTensor replaced by
its ``DTensorSpec`` (``.ndim``, ``.shape``, ``.placements``, ``.mesh``), and returns the acceptable
``(output placements, input placements)`` pairs for one mesh dim. That is exactly what an spmd rule
is (``OpStrategy`` candidates for one mesh dim), so the function is adapted into a rule and
registered in the one registry: the propagator expands it to every mesh dim and picks the cheapest
candidate, as for a built-in rule. Registering replaces the op's rule from then on; decisions
already cached for the op are dropped (every registry change clears the decision caches).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from spmd.tensor.placement import Placement, Shard
from spmd.tensor.sharding.registry import REGISTRY
from spmd.tensor.sharding.vocabulary import OpCall, OpStrategy
from spmd.tensor.spec import DTensorSpec

__all__ = ["register_sharding"]

PlacementList = Sequence[Placement | None]
ShardingFunction = Callable[..., Sequence[tuple[Any, Any]]]


def register_sharding(op: Any) -> Callable[[ShardingFunction], ShardingFunction]:
    """Decorator: ``fn`` gives the sharding strategies of ``op`` (an overload, or a list of them).

    ``fn`` takes ``op``'s arguments with DTensors replaced by their ``DTensorSpec`` and returns a
    list of ``(output_placements, input_placements)`` pairs, each for one mesh dim: one placement
    per output of the op (None for outputs that are not tensors) and one per argument in call
    order (None for arguments that are not tensors). The dispatcher then chooses among exactly
    these pairs on every mesh dim, by redistribution cost, and overrides the op's built-in rule
    (if any). For example, softmax kept sharded on any dim but the one it normalises::

        @register_sharding(aten._softmax.default)
        def softmax_sharding(x, dim, half_to_float):
            dim = dim % x.ndim
            strategies = [([Replicate()], [Replicate(), None, None])]
            for d in range(x.ndim):
                if d != dim:
                    strategies.append(([Shard(d)], [Shard(d), None, None]))
            return strategies

    An op whose local result is not the op applied to the shards keeps the hook that computes it
    (views rewrite their global sizes, random ops draw their piece of the global tensor); an op
    that some layouts ran as other DTensor ops (a decomposition) now always runs through ``fn``.
    ``out=`` overloads and list ops (``_foreach_*``) cannot take a user rule: register the
    functional or element op instead.
    """
    overloads = list(op) if isinstance(op, (list, tuple)) else [op]
    for overload in overloads:
        _check_registrable(overload)

    def register(fn: ShardingFunction) -> ShardingFunction:
        for overload in overloads:
            kept = REGISTRY.entry(overload)
            REGISTRY.register(overload, local_args=kept.local_args, local_impl=kept.local_impl)(
                UserShardingRule(overload, fn)
            )
        return fn

    return register


class UserShardingRule:
    """A ``register_sharding`` function seen as an spmd rule: ``OpCall`` -> one-mesh-dim candidates."""

    def __init__(self, op: Any, fn: ShardingFunction) -> None:
        self.op = op
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)
        self.__doc__ = getattr(fn, "__doc__", None)

    def __repr__(self) -> str:
        return f"UserShardingRule({self.op}, {self.__name__})"

    def __call__(self, call: OpCall) -> list[OpStrategy]:
        strategies = self.fn(*call.args, **call.kwargs)
        if not isinstance(strategies, (list, tuple)):
            raise TypeError(
                f"{self.__name__} (registered for {self.op}) returned {type(strategies).__name__}; "
                "return a list of (output_placements, input_placements) pairs"
            )
        kinds = list(_tensor_leaves(call))
        return [self._candidate(call, kinds, n, pair) for n, pair in enumerate(strategies)]

    def _candidate(self, call: OpCall, kinds: list[bool], n: int, pair: Any) -> OpStrategy:
        where = f"{self.__name__} (registered for {self.op}), strategy {n}"
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise TypeError(f"{where} is {pair!r}; each strategy is a pair (output_placements, input_placements)")
        outputs, inputs = pair
        return OpStrategy(self._inputs(call, kinds, inputs, where), self._outputs(call, outputs, where))

    def _inputs(self, call: OpCall, kinds: list[bool], given: Any, where: str) -> tuple[Placement, ...]:
        """One placement per DTensor input, in call order, from the user's per-argument list."""
        named = [p for p in _flat(given, where, "input") if p is not None]
        specs = call.input_specs
        if len(named) == len(kinds) and len(kinds) != len(specs):
            # placements for plain tensors too (0-d ones stay plain here): keep the DTensors'
            named = [p for p, is_dtensor in zip(named, kinds) if is_dtensor]
        if len(named) != len(specs):
            raise ValueError(
                f"{where} gives {len(named)} input placements but the call has {len(specs)} DTensor inputs "
                f"({', '.join(str(s) for s in specs)}); give one placement per tensor argument in call order, "
                "None for the other arguments"
            )
        return tuple(_checked(p, spec.ndim, where, f"input {i}") for i, (p, spec) in enumerate(zip(named, specs)))

    def _outputs(self, call: OpCall, given: Any, where: str) -> tuple[Placement | None, ...]:
        """One placement per output meta (a ``Tensor[]`` return's one placement goes to each element)."""
        placements = _flat(given, where, "output")
        metas = call.output_metas
        returns = self.op._schema.returns
        if len(returns) == 1 and isinstance(returns[0].type, torch.ListType):
            if len(placements) != 1:
                raise ValueError(f"{where}: {self.op} returns one list of tensors; give one output placement for it")
            placements = placements * len(metas)
        elif len(placements) != len(returns):
            raise ValueError(
                f"{where} gives {len(placements)} output placements but {self.op} returns {len(returns)} values; "
                "give one per return value, None for those that are not tensors"
            )
        result: list[Placement | None] = []
        for j, (meta, placement) in enumerate(zip(metas, placements)):
            if meta is None:  # not a tensor (or an absent optional one): nothing to place
                result.append(None)
            elif placement is None:
                raise ValueError(f"{where} gives None for output {j}, a tensor; give its placement")
            else:
                result.append(_checked(placement, len(meta.shape), where, f"output {j}"))
        return tuple(result)


def _flat(given: Any, where: str, what: str) -> list[Placement | None]:
    """The user's list with nested lists (a ``Tensor[]`` argument's placements) spliced in."""
    if isinstance(given, Placement):
        given = [given]
    if not isinstance(given, (list, tuple)):
        raise TypeError(f"{where}: the {what} placements are {given!r}; give a list of placements (None for non-tensors)")
    flat: list[Placement | None] = []
    for p in given:
        flat.extend(p if isinstance(p, (list, tuple)) else [p])
    for p in flat:
        if p is not None and not isinstance(p, Placement):
            raise TypeError(f"{where}: {p!r} is not a Placement; use Shard(dim), Replicate(), Partial() or None")
    return flat


def _checked(p: Placement, ndim: int, where: str, what: str) -> Placement:
    """``p`` for a tensor of ``ndim`` dims, negative shard dims made positive; out of range raises."""
    if not isinstance(p, Shard):
        return p
    if not -ndim <= p.dim < ndim:
        raise ValueError(
            f"{where}: {p} for {what} is out of range for a {ndim}-d tensor; use a dim in [{-ndim}, {ndim - 1}]"
            if ndim
            else f"{where}: {p} for {what}, a 0-d tensor; a 0-d tensor can only be replicated or partial"
        )
    return Shard(p.dim % ndim)


def _tensor_leaves(call: OpCall) -> Iterator[bool]:
    """For each tensor argument in call order: True for a DTensor (a spec here), False for a plain one."""
    for value in (*call.args, *call.kwargs.values()):
        for leaf in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(leaf, DTensorSpec):
                yield True
            elif isinstance(leaf, torch.Tensor):
                yield False


def _check_registrable(op: Any) -> None:
    """Refuse ops the dispatcher never asks a plain rule about; warn for ops eager calls rarely reach."""
    if not isinstance(op, torch._ops.OpOverload):
        raise TypeError(
            f"register_sharding takes an op overload (e.g. aten._softmax.default) or a list of them, got {op!r}"
        )
    entry = REGISTRY.entry(op)
    if entry.out_variant is not None:
        functional = entry.out_variant[0]
        raise NotImplementedError(
            f"register_sharding({op}): out= calls run the functional op {functional} and copy into out, so a "
            f"rule for {op} would never be asked; register {functional} instead"
        )
    if entry.list_op:
        raise NotImplementedError(
            f"register_sharding({op}): list ops run as their element op position by position; register the "
            "element op (e.g. aten.add.Tensor for aten._foreach_add.List) instead"
        )
    if torch._C._dispatch_has_kernel_for_dispatch_key(op._schema.name + _overload_suffix(op), "CompositeImplicitAutograd"):
        warnings.warn(
            f"register_sharding({op}): {op} is CompositeImplicitAutograd, so outside torch.inference_mode() "
            "eager calls decompose it into other ops before DTensor sees it and this rule is not asked; "
            "register the ops it decomposes into to shard those calls",
            stacklevel=3,
        )


def _overload_suffix(op: Any) -> str:
    return "" if op._overloadname == "default" else f".{op._overloadname}"
