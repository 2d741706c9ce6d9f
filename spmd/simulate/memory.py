"""Bytes the simulated rank holds over one step, from the lifetimes of its local tensors' storages.

A ``MemoryTracker`` is a dispatch mode: every op on a local (plain) tensor that returns a fresh
storage adds the storage's bytes, and a finalizer on the storage subtracts them when the last tensor
using it dies. Ops on DTensors are passed on to DTensor's own dispatch (the mode answers
``NotImplemented``), so the mode sees the local ops DTensor runs, collectives' results included.
``UntypedStorage.resize_`` (fully_shard frees a gathered copy after forward and refills it before
backward) is not an op; fully_shard tells its observers (``add_storage_resize_observer``), and the
trackers of the calling thread follow them, so such storages count only while full.

The tracker keeps the step's timeline of (storage, byte change) events, so the peak can be replayed
with or without a set of storages: the whole peak, and the peak of everything but the gradients.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from typing_extensions import Self

from spmd.fsdp.state import add_storage_resize_observer
from spmd.tensor import DTensor
from spmd.tensor.sharding.propagator import inferring_shapes

__all__ = ["MemoryTracker", "StateBytes", "training_state_bytes", "local_storages"]


@dataclass(frozen=True, slots=True)
class StateBytes:
    """Bytes of one rank's training state: the local shards of parameters, gradients, optimizer state."""

    params: int
    grads: int
    optimizer: int
    """Tensor state with at least one dim (AdamW's moments; not its 0-d step counter)."""


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _optimizer_tensors(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [
        v
        for p in module.parameters()
        for v in optimizer.state.get(p, {}).values()
        if isinstance(v, torch.Tensor) and v.ndim
    ]


def training_state_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> StateBytes:
    """Local bytes of ``module``'s parameters and gradients and ``optimizer``'s state on the calling rank.

    Works the same on a real rank and a simulated one (meta shards report their would-be size).
    """
    params = list(module.parameters())
    return StateBytes(
        params=sum(_local(p).nbytes for p in params),
        grads=sum(_local(p.grad).nbytes for p in params if p.grad is not None),
        optimizer=sum(_local(v).nbytes for v in _optimizer_tensors(module, optimizer)),
    )


def local_storages(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.UntypedStorage]:
    """The storages behind the local shards of the parameters, gradients and optimizer state."""
    tensors = [*module.parameters(), *_optimizer_tensors(module, optimizer)]
    tensors += [p.grad for p in module.parameters() if p.grad is not None]
    tensors += list(module.buffers())
    return [_local(t).untyped_storage() for t in tensors]


def _fresh_outputs(func: Any) -> tuple[bool, ...]:
    """For each return of ``func``, whether it is a new tensor (not a view or an in-place result)."""
    return tuple(ret.alias_info is None for ret in func._schema.returns)


_listeners = threading.local()


def _trackers_of_this_thread() -> list[MemoryTracker]:
    listeners: list[MemoryTracker] | None = getattr(_listeners, "trackers", None)
    if listeners is None:
        listeners = _listeners.trackers = []
    return listeners


def _tell_trackers(storage: torch.UntypedStorage) -> None:
    for tracker in _trackers_of_this_thread():
        tracker._resized(storage)


add_storage_resize_observer(_tell_trackers)


class MemoryTracker(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records when each local storage is allocated, resized and freed while the tracker is active.

    Storages alive before it starts are the baseline (``known``): they are not counted again when
    an op returns a view of them.
    """

    def __init__(self, known: Iterable[torch.UntypedStorage] = ()) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.events: list[tuple[int, int]] = []
        """(storage token, byte change), in program order."""
        self._tokens: dict[int, int] = {}  # id(storage) -> token, for the live tracked storages
        self._sizes: dict[int, int] = {}  # token -> bytes now
        self._known = {id(s) for s in known}
        self._known_refs = list(known)  # keep the ids valid while the tracker runs
        self._next_token = itertools.count()
        self._fresh: dict[Any, tuple[bool, ...]] = {}

    # ----- the mode --------------------------------------------------------------------------------
    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor's dispatch runs the local ops, which come back here
        out = func(*args, **(kwargs or {}))
        if inferring_shapes():  # the propagator learning an output's shape: not the program's memory
            return out
        fresh = self._fresh.get(func)
        if fresh is None:
            fresh = self._fresh[func] = _fresh_outputs(func)
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        for is_fresh, tensor in zip(fresh, outputs):
            if is_fresh and isinstance(tensor, torch.Tensor) and not isinstance(tensor, DTensor):
                self._track(tensor.untyped_storage())
        return out

    def __enter__(self) -> Self:
        _trackers_of_this_thread().append(self)
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)  # type: ignore[no-untyped-call]
        _trackers_of_this_thread().remove(self)
        self._known_refs = []

    # ----- bookkeeping -----------------------------------------------------------------------------
    def _track(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._tokens or key in self._known:
            return
        token = next(self._next_token)
        nbytes = storage.nbytes()
        self._tokens[key] = token
        self._sizes[token] = nbytes
        self.events.append((token, nbytes))
        weakref.finalize(storage, self._freed, key, token)

    def _freed(self, key: int, token: int) -> None:
        self._tokens.pop(key, None)
        nbytes = self._sizes.pop(token, 0)
        if nbytes:
            self.events.append((token, -nbytes))

    def _resized(self, storage: torch.UntypedStorage) -> None:
        token = self._tokens.get(id(storage))
        if token is None:
            return
        nbytes = storage.nbytes()
        change = nbytes - self._sizes[token]
        self._sizes[token] = nbytes
        if change:
            self.events.append((token, change))

    def token_of(self, storage: torch.UntypedStorage) -> int | None:
        """The token of a storage allocated while tracking and still alive (None otherwise)."""
        return self._tokens.get(id(storage))

    def peak(self, *, excluding: Iterable[int] = ()) -> int:
        """The most bytes live at once among the storages allocated while tracking, minus ``excluding``."""
        skip = set(excluding)
        live = peak = 0
        for token, change in self.events:
            if token in skip:
                continue
            live += change
            peak = max(peak, live)
        return peak

    @property
    def live_bytes(self) -> int:
        """Bytes of the tracked storages still alive."""
        return sum(self._sizes.values())
