"""The small interface every collective backend implements, and the one place that records traffic.

A ``Communicator`` is the group of ranks along one mesh dimension. Public methods take and return
plain local tensors; "stacked" tensors carry one equal-sized block per group member on dim 0, the
way NCCL lays out all_gather/reduce_scatter buffers. Padding for uneven shards is the caller's
job (the redistribute executor), so both backends run the same data path.

Each public collective runs the collective check here, then calls its ``spmd::`` op
(library_ops.py), which records the traffic and runs the backend's private method. So
``torch.compile`` graphs hold the collectives as ops, and a compiled graph records its collectives
when it runs, as eager code does.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

from spmd.comm.handles import communicator_for, group_handle
from spmd.comm.library_ops import COLLECTIVE_OPS
from spmd.compile.compiling import compiling_here
from spmd.compile.properties import traceable_property
from spmd.hooks import HOOKS

__all__ = [
    "Communicator",
    "World",
    "CollectiveRecord",
    "CollectiveError",
    "CollectiveTimeoutError",
    "CollectiveAbortedError",
    "CollectiveMismatchError",
    "add_comm_observer",
    "remove_comm_observer",
    "full_check_here",
    "CheckTicket",
    "mismatch_side",
    "mismatch_error",
    "active_world",
    "use_world",
]

REDUCE_OPS = ("sum", "avg", "max", "min", "product")


class CollectiveError(RuntimeError):
    """A collective could not complete on this rank; the message names it, its mesh dim and its ranks."""


class CollectiveTimeoutError(CollectiveError):
    """A collective waited longer than its group's timeout for the other ranks to join."""


class CollectiveAbortedError(CollectiveError):
    """Another rank failed (raised, or its process died), so this rank's collective was cancelled."""


class CollectiveMismatchError(CollectiveError):
    """Ranks were about to issue different collectives (raised on every rank, by the collective check)."""


def collective_name(kind: str, ranks: tuple[int, ...], mesh_dim: str | None) -> str:
    """``all_reduce on mesh dim 'tp' (ranks [0, 1])``: how errors name a collective."""
    if mesh_dim is None:
        return f"{kind} (ranks {list(ranks)})"
    label = mesh_dim if mesh_dim.isdigit() else repr(mesh_dim)  # an unnamed dim is its index
    return f"{kind} on mesh dim {label} (ranks {list(ranks)})"


@dataclass(slots=True)
class CheckTicket:
    """What the collective check knows of one collective a rank is about to issue.

    The threaded world carries it in the collective's own round (no extra exchange): once every
    member has deposited, the members compare the ``key`` of each ticket if any of them is
    ``checked``. Over c10d, ``Communicator._verify`` exchanges digests before the collective.
    """

    comm: Communicator
    """The communicator as the caller holds it (with the redistribute step attached)."""
    kind: str
    shape: tuple[int, ...] | None
    dtype: torch.dtype | None
    detail: str
    key: tuple[Any, ...]
    """What ranks must agree on, as values equal across ranks (not strings: building one is cheap)."""
    checked: bool
    """True for the collectives the check compares (the warm-up's first runs, every one under the full check)."""


def full_check_here() -> bool:
    """Whether the calling rank runs the full collective check (and with it the replica checks)."""
    check = HOOKS.collective_check
    return check is not None and check.full_check_here()


def mismatch_side(ticket: CheckTicket | None, kind: str) -> Any:
    """This rank's side of a disagreement: its fingerprint, or just the kind when no check saw it."""
    check = HOOKS.collective_check
    if ticket is None or check is None:
        return f"{kind} (not fingerprinted: issued with the checks off, from compiled code, or by spmd itself)"
    return check.side_of(ticket)


def mismatch_error(comm: Communicator, seq: int, sides: list[Any]) -> CollectiveMismatchError:
    """The error each member raises when ``sides`` (one per member, in group order) disagree."""
    check = HOOKS.collective_check
    if check is not None:
        error = check.mismatch_error(comm, seq, sides)
        assert isinstance(error, CollectiveMismatchError)
        return error
    lines = "\n".join(f"  rank {rank}: {side}" for rank, side in zip(comm.ranks, sides))
    return CollectiveMismatchError(f"collective #{seq} {comm.describe('')}: the ranks disagree:\n{lines}")


@dataclass(frozen=True, slots=True)
class CollectiveRecord:
    """One collective as one rank issued it: kind, group size and the payload bytes it moved."""

    kind: str
    group_size: int
    tensor_bytes: int
    """Bytes of the full (unsplit) buffer the collective works on, per rank."""
    ranks: tuple[int, ...]
    rank: int
    """Global rank that issued it."""

    @property
    def moved_bytes(self) -> int:
        """Bytes a rank receives under the usual ring algorithms: the cost model's unit (0 for a
        collective the ring model does not price)."""
        # Imported here: spmd.comm sits below spmd.tensor, whose package import needs spmd.comm;
        # the cost module itself imports nothing of the library.
        from spmd.tensor.redistribute.cost import RING_KINDS, received_bytes

        if self.kind not in RING_KINDS:
            return 0
        return received_bytes(self.kind, self.group_size, self.tensor_bytes)


_observers_lock = threading.Lock()
_observers: list[Callable[[CollectiveRecord], None]] = []


def add_comm_observer(observer: Callable[[CollectiveRecord], None]) -> None:
    """Call ``observer(record)`` for every collective issued from now on (debug tools use this)."""
    with _observers_lock:
        _observers.append(observer)


def remove_comm_observer(observer: Callable[[CollectiveRecord], None]) -> None:
    with _observers_lock:
        if observer in _observers:
            _observers.remove(observer)


class Communicator(ABC):
    """Collectives over the ranks of one mesh dimension (``ranks`` in group order).

    ``mesh_dim`` names the mesh dim the caller reached it through (errors name it), and
    ``timeout_s`` is how long a collective waits for the other ranks before raising.
    """

    mesh_dim: str | None = None
    group_name: str = ""
    """The group's name in its backend (c10d's ``group_name``); empty where it has none."""
    context: tuple[Any, ...] = ()
    """What the caller is doing (a redistribute step and its spec), for the collective check."""
    _handle: int | None = None
    """The int naming this communicator inside the ``spmd::`` ops (``group_handle``)."""

    def __init__(self, ranks: tuple[int, ...], *, timeout_s: float | None = None) -> None:
        self.ranks = ranks
        self.size = len(ranks)
        self.timeout_s = timeout_s
        self._views: dict[str, Communicator] = {}
        self._warmup_counts: dict[Any, int] = {}
        """How often each rank checked each distinct collective (the warm-up check's bookkeeping,
        shared by this group's views and copies)."""

    # Identity is what a communicator is (a group of one world): torch.compile guards on it by ``==``.
    def __eq__(self, other: object) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)

    def __fx_repr__(self) -> tuple[str, dict[str, Any]]:
        """Source that finds this communicator again, should a compiled graph hold it as a constant."""
        return f"communicator_for({self.group_handle()})", {"communicator_for": communicator_for}

    @traceable_property  # not property: torch.compile reads it on communicators from outside the region
    @abstractmethod
    def local_rank(self) -> int:
        """Index of the calling rank inside ``ranks``."""

    def set_timeout(self, timeout_s: float) -> None:
        """Bound this group's collectives by ``timeout_s`` from now on (a later mesh over it asked so)."""
        self.timeout_s = timeout_s
        for view in self._views.values():
            view.timeout_s = timeout_s

    def on_mesh_dim(self, name: str) -> Communicator:
        """This communicator labelled as mesh dim ``name`` (same group, same state; cached)."""
        view = self._views.get(name)
        if view is None:
            view = copy.copy(self)
            view.mesh_dim = name
            view._handle = None  # a view names its dim in errors, so the ops must find the view
            view = self._views.setdefault(name, view)
        return view

    def with_context(self, *context: Any) -> Communicator:
        """This communicator with ``context`` attached to the fingerprints the collective check compares.

        Free when no check is installed (returns ``self``).
        """
        if HOOKS.collective_check is None:
            return self
        group_handle(self)  # the copy shares this handle, so a compiled graph never names a short-lived copy
        view = copy.copy(self)
        view.context = context
        return view

    def group_handle(self) -> int:
        """The int that names this communicator inside the ``spmd::`` ops."""
        return group_handle(self)

    def describe(self, kind: str) -> str:
        """``all_reduce on mesh dim 'tp' (ranks [0, 1])``: how errors name a collective."""
        return collective_name(kind, self.ranks, self.mesh_dim)

    def _check(self, kind: str, tensor: torch.Tensor, detail: str) -> None:
        """Run the collective check, if one is installed, before an eager collective.

        Compiled code skips it: a compiled graph holds the collective op, not this call, and while
        the compiler traces (Dynamo, then AOTAutograd on fake tensors) nothing is issued, so a check
        there would be a round no peer joins.
        """
        check = HOOKS.collective_check
        if check is not None and not compiling_here() and not is_fake(tensor):
            check.before(self, kind, tensor, detail)

    def _record(self, kind: str, tensor: torch.Tensor) -> None:
        """Tell the observers (CommDebugMode) of collective ``kind`` on ``tensor``, the input one member gives."""
        if _observers:
            tensor_bytes = tensor.numel() * tensor.element_size()
            if kind == "all_gather":  # counted as the gathered result
                tensor_bytes *= self.size
            record = CollectiveRecord(kind, self.size, tensor_bytes, self.ranks, self.ranks[self.local_rank])
            for observer in _observers:
                observer(record)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Blocks of every member stacked on a new dim 0: shape ``[size, *tensor.shape]``."""
        self._check("all_gather", tensor, "")
        return COLLECTIVE_OPS["all_gather"](tensor.contiguous(), self.group_handle(), self.size)

    def all_reduce(self, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
        self._check("all_reduce", tensor, reduce_op)
        return COLLECTIVE_OPS["all_reduce"](tensor.contiguous(), self.group_handle(), reduce_op)

    def reduce_scatter(self, stacked: torch.Tensor, reduce_op: str) -> torch.Tensor:
        """Reduce ``stacked`` (``[size, *block]``) over members; member i keeps reduced block i."""
        self._check("reduce_scatter", stacked, reduce_op)
        return COLLECTIVE_OPS["reduce_scatter"](stacked.contiguous(), self.group_handle(), reduce_op)

    def all_to_all(self, stacked: torch.Tensor) -> torch.Tensor:
        """Member i sends block j to member j; the result stacks the blocks received, by sender."""
        self._check("all_to_all", stacked, "")
        return COLLECTIVE_OPS["all_to_all"](stacked.contiguous(), self.group_handle())

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Every member gets member ``src``'s tensor (``src`` is an index into ``ranks``)."""
        self._check("broadcast", tensor, f"src={src}")
        return COLLECTIVE_OPS["broadcast"](tensor.contiguous(), self.group_handle(), src)

    def scatter(self, stacked: torch.Tensor, src: int) -> torch.Tensor:
        """Member i gets block i of member ``src``'s ``stacked``; every member passes a same-shaped buffer."""
        self._check("scatter", stacked, f"src={src}")
        return COLLECTIVE_OPS["scatter"](stacked.contiguous(), self.group_handle(), src)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Small Python values from every member, in group order (used by sanity checks only)."""
        check = HOOKS.collective_check
        if check is not None:
            check.before(self, "all_gather_object", None, "")
        return self._all_gather_object(obj)

    def _verify(self, ticket: CheckTicket) -> None:
        """Run the collective check for ``ticket`` before the collective (c10d): if it is
        ``checked``, all-gather an 8-byte digest of each member's fingerprint and, only when
        they differ, the fingerprints themselves; then every member raises the same error.

        Every member must make the same call (ranks that agree check the same collectives).
        """
        if not ticket.checked:
            return
        digests = self._all_gather(torch.tensor([mismatch_side(ticket, ticket.kind).digest()], dtype=torch.int64))
        if bool((digests == digests[0]).all()):
            return
        sides: list[Any] = self._all_gather_object(mismatch_side(ticket, ticket.kind))
        raise mismatch_error(self, -1, sides)

    @abstractmethod
    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def _all_reduce(self, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor: ...

    @abstractmethod
    def _reduce_scatter(self, stacked: torch.Tensor, reduce_op: str) -> torch.Tensor: ...

    @abstractmethod
    def _all_to_all(self, stacked: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def _broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor: ...

    @abstractmethod
    def _scatter(self, stacked: torch.Tensor, src: int) -> torch.Tensor: ...

    @abstractmethod
    def _all_gather_object(self, obj: Any) -> list[Any]: ...


class World(ABC):
    """A set of ranks that can talk: the c10d default group, or an in-process threaded world."""

    size: int
    backend_name: str

    @abstractmethod
    def current_rank(self) -> int:
        """Global rank of the caller."""

    @abstractmethod
    def communicator(self, ranks: tuple[int, ...]) -> Communicator:
        """The communicator over ``ranks``; must have been created by ``create_groups``."""

    @abstractmethod
    def create_groups(self, groups: list[tuple[int, ...]], *, timeout_s: float | None = None) -> None:
        """Create communicators for ``groups``; every rank calls this with the same list, in order.

        ``timeout_s`` bounds each collective on the groups (None: the world's own timeout); a group
        that already exists is given it too (a group is shared by every mesh over its ranks).
        """

    def adopt_group(self, group: Any) -> tuple[int, ...]:
        """The ranks of ``group``, an existing group of this world, which ``communicator`` then finds.

        What ``DeviceMesh.from_group`` builds on. Here a group is one of this world's communicators
        (what ``mesh.get_group()`` returns outside c10d); the c10d world also takes a ProcessGroup.
        """
        if not isinstance(group, Communicator):
            raise TypeError(
                f"{type(self).__name__} groups are its communicators, got {type(group).__name__}; "
                "pass a group from mesh.get_group()"
            )
        return self.communicator(group.ranks).ranks

    def missing_groups(self, groups: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """The groups among ``groups`` that only a collective ``create_groups`` call could still make.

        Lets one rank check, without talking to the others, whether a mesh can be rebuilt from its
        description (when unpickling). Backends that make communicators locally have none missing.
        """
        return []


def reduce_stack(stacked: torch.Tensor, reduce_op: str) -> torch.Tensor:
    """Reduce the blocks of ``stacked`` along dim 0 with ``reduce_op`` (the threaded backend's math)."""
    if reduce_op == "sum":
        return stacked.sum(dim=0, dtype=stacked.dtype)
    if reduce_op == "avg":
        if stacked.is_floating_point() or stacked.is_complex():
            return stacked.mean(dim=0)
        return torch.div(stacked.sum(dim=0), stacked.shape[0], rounding_mode="floor")
    if reduce_op == "max":
        return stacked.amax(dim=0)
    if reduce_op == "min":
        return stacked.amin(dim=0)
    if reduce_op == "product":
        return stacked.prod(dim=0, dtype=stacked.dtype)
    raise ValueError(f"unknown reduce op {reduce_op!r}; use one of {REDUCE_OPS}")


_active_world: contextvars.ContextVar[World | None] = contextvars.ContextVar("spmd_active_world", default=None)


def active_world() -> World | None:
    """The in-process world the caller runs in (threads, a simulation), or None (c10d or no world).

    Set by ``use_world``; ``current_world()`` falls back to the c10d default group when it is None.
    """
    return _active_world.get()


@contextlib.contextmanager
def use_world(world: World) -> Iterator[World]:
    """Make ``world`` the caller's world inside the block (``run_threaded`` does this on each rank thread).

    A new backend is a ``World`` and a ``Communicator`` subclass in one file, entered with this.
    """
    token = _active_world.set(world)
    try:
        yield world
    finally:
        _active_world.reset(token)
