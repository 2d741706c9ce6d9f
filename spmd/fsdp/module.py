"""FSDPModule: the class a fully_shard'ed module becomes, and the methods torchtitan calls on it.

``fully_shard`` swaps the module's class for ``FSDP<Name>``, a subclass of ``(FSDPModule, Name)``
made once per class, so ``isinstance(m, FSDPModule)`` holds and the module's own methods still run.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any, cast

from torch import nn

from spmd.fsdp.state import FullyShardState

__all__ = [
    "FSDPModule",
    "UnshardHandle",
    "as_fsdp_module",
    "fully_shard_state",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]

_STATE_ATTR = "_spmd_fully_shard_state"


def fully_shard_state(module: nn.Module) -> FullyShardState | None:
    """The state ``fully_shard`` attached to ``module`` (its managed parameters), or None."""
    state = module.__dict__.get(_STATE_ATTR)
    return state if isinstance(state, FullyShardState) else None


class UnshardHandle:
    """What ``unshard(async_op=True)`` returns: the gather already ran, so ``wait`` returns at once."""

    def wait(self) -> None:
        """Nothing left to wait for (spmd's collectives are synchronous)."""


class FSDPModule:
    """Mixed into a fully_shard'ed module's class: the FSDP2 methods, on the module and its subtree."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # A container rebuilding itself (``nn.Sequential[1:]`` calls ``self.__class__(...)``) gets the
        # original class: the new module is not sharded.
        original: Any = cls.__mro__[2]
        return original(*args, **kwargs)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # the made class cannot be found by name: pickle and deepcopy rebuild it from the original one
        state = cast(nn.Module, self).__getstate__()  # type: ignore[no-untyped-call]
        return (_new_fsdp_instance, (type(self).__mro__[2],), state)

    def _fsdp_states(self, recurse: bool) -> Iterator[FullyShardState]:
        modules = cast(nn.Module, self).modules() if recurse else iter([cast(nn.Module, self)])
        seen: set[int] = set()
        for module in modules:
            state = fully_shard_state(module)
            if state is not None and id(state) not in seen:
                seen.add(id(state))
                yield state

    def _own_state(self) -> FullyShardState:
        state = fully_shard_state(cast(nn.Module, self))
        if state is None:
            raise RuntimeError("this FSDPModule has no fully_shard state (was it copied outside fully_shard?)")
        return state

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather the parameters now; they shadow the shards until ``reshard()`` (or the next forward's end)."""
        self._own_state().unshard()
        return UnshardHandle() if async_op else None

    def reshard(self) -> None:
        """Make the registered parameters the shards again (after ``unshard``)."""
        self._own_state().reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: backward keeps the unreduced gradients and adds them into the next synced backward's
        reduce_scatter (gradient accumulation without communication)."""
        for state in self._fsdp_states(recurse):
            state.sync.requires_sync = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        """Whether forward frees the gathered parameters (gathered again for backward)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"set_reshard_after_forward takes a bool, got {reshard_after_forward!r}")
        for state in self._fsdp_states(recurse):
            state.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """A no-op, for torch compatibility: the gathered copies are always released after backward."""

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by ``factor`` (default: dp size for per-rank losses, 1 for a global loss)."""
        if factor <= 0:
            raise ValueError(f"set_gradient_divide_factor takes a positive factor, got {factor}")
        for state in self._fsdp_states(recurse=True):
            state.divide_factor = float(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """A no-op, for torch compatibility: spmd always reduces with a sum and divides afterwards."""

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """A no-op, for torch compatibility: nothing waits for a last backward here."""

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """A no-op: collectives are synchronous, so there is no prefetch to order."""
        _check_fsdp_modules(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """A no-op: collectives are synchronous, so there is no prefetch to order."""
        _check_fsdp_modules(modules, "set_modules_to_backward_prefetch")


def _check_fsdp_modules(modules: list[FSDPModule], method: str) -> None:
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"{method} takes fully_shard'ed modules, got a {type(module).__name__}")


_fsdp_classes: dict[type, type] = {}


def _fsdp_class(original: type) -> type:
    made = _fsdp_classes.get(original)
    if made is None:  # setdefault: rank threads racing here all get the one class stored
        made = _fsdp_classes.setdefault(
            original, type(f"FSDP{original.__name__}", (FSDPModule, original), {"__module__": original.__module__})
        )
    return made


def _new_fsdp_instance(original: type) -> Any:
    made = _fsdp_class(original)
    return object.__new__(made)


def as_fsdp_module(module: nn.Module) -> None:
    """Turn ``module``'s class into ``FSDP<Name>`` (a subclass of FSDPModule and its own class)."""
    if not isinstance(module, FSDPModule):
        module.__class__ = _fsdp_class(type(module))


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run fully_shard's forward hooks around ``module.<method_name>`` too (e.g. a ``generate``), not only ``forward``."""
    state = fully_shard_state(module)
    if state is None:
        raise ValueError(f"register_fsdp_forward_method needs a fully_shard'ed module, got a {type(module).__name__}")
    method = getattr(module, method_name)

    @functools.wraps(method)
    def with_gathered_parameters(*args: Any, **kwargs: Any) -> Any:
        cast_args = state.before_forward(module, args, kwargs)
        if cast_args is not None:
            args, kwargs = cast_args
        try:
            outputs = method(*args, **kwargs)
        except BaseException:
            state.abort_forward()
            raise
        return state.after_forward(module, args, kwargs, outputs)

    setattr(module, method_name, with_gathered_parameters)


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """A no-op: torch shares CUDA streams between roots; spmd's collectives run on the caller's stream."""
    _check_fsdp_modules(modules, "share_comm_ctx")
