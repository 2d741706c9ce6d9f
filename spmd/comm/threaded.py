"""An in-process world: each rank is a thread and collectives hand tensors between threads.

Every collective is built on one primitive, ``exchange``: each member deposits a value for its n-th
call on the group, waits until all members have deposited, and reads all of them. A rank that
raises aborts the world, so the others stop waiting at once; a wait longer than ``timeout``
raises ``CollectiveTimeoutError`` naming the ranks that never arrived. Point-to-point messages
(c10d's ``send``/``recv``) go through the world's ``Mailbox`` (``threaded_p2p``), which the same
failure releases and the same timeout bounds.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from spmd.comm.base import (
    CheckTicket,
    CollectiveAbortedError,
    CollectiveTimeoutError,
    Communicator,
    World,
    active_world,
    collective_name,
    mismatch_error,
    mismatch_side,
    reduce_stack,
)
from spmd.comm.threaded_c10d import ThreadedProcessGroup, new_process_group
from spmd.comm.threaded_p2p import Mailbox
from spmd.compile.properties import traceable_property

__all__ = [
    "ThreadedWorld",
    "CollectiveTimeoutError",
    "CollectiveAbortedError",
    "DEFAULT_TIMEOUT_S",
]

DEFAULT_TIMEOUT_S = 60.0


class _RankThread(threading.local):
    """The threaded world and rank of the calling thread (None outside ``run_threaded``)."""

    world: ThreadedWorld | None = None
    rank: int | None = None


_current = _RankThread()
_pending = threading.local()
"""The check ticket of the collective the calling thread is about to issue (see ``_verify``)."""


def thread_rank() -> int | None:
    """The calling thread's rank in a threaded world, else None.

    torch.compile guards on this value wherever spmd reads it in a traced region (``from_local``),
    so the rank threads of one process, which share the compiled-code cache, each get their own graph.
    """
    return _current.rank


def current_threaded_world() -> ThreadedWorld | None:
    """The threaded world the calling thread is a rank of, if any."""
    world = active_world()
    return world if isinstance(world, ThreadedWorld) else None


@dataclass
class _Round:
    kind: str
    values: list[Any]
    tickets: list[CheckTicket | None]
    arrived: set[int] = field(default_factory=set)
    left: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    sides: dict[int, Any] | None = None
    """Set when the members disagree (different kinds, or checked tickets that differ): each one's side."""
    sides_done: threading.Event = field(default_factory=threading.Event)


class ThreadedWorld(World):
    """``size`` ranks as threads of this process; communicators are made on first use."""

    backend_name = "threaded"

    def __init__(self, size: int, *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        if size < 1:
            raise ValueError(f"a world needs at least one rank, got world_size={size}")
        self.size = size
        self.timeout = timeout
        self._lock = threading.Lock()
        self._lock_groups = threading.Lock()
        self._rounds: dict[tuple[tuple[int, ...], int], _Round] = {}
        self._next_seq: dict[tuple[tuple[int, ...], int], int] = {}
        self._communicators: dict[tuple[int, ...], ThreadedCommunicator] = {}
        self._process_groups: dict[tuple[int, ...], ThreadedProcessGroup] = {}
        self._failure: tuple[int, BaseException] | None = None
        self.mailbox = Mailbox(lambda: self._failure)
        """Point-to-point messages between the ranks (c10d's ``send``/``recv`` on this world's groups)."""
        self.is_default_group = False
        """Whether this world is c10d's default group (``run_threaded`` makes it so when it can)."""

    @contextmanager
    def as_rank(self, rank: int) -> Iterator[None]:
        """Make the calling thread rank ``rank`` of this world for the block (``run_threaded``'s threads)."""
        _current.world, _current.rank = self, rank
        try:
            yield
        finally:
            _current.world = _current.rank = None

    def current_rank(self) -> int:
        rank = getattr(_current, "rank", None)
        if rank is None or getattr(_current, "world", None) is not self:
            raise RuntimeError("this thread is not a rank of the threaded world; call it from run_threaded")
        return int(rank)

    def rank_or_none(self) -> int | None:
        """The calling thread's rank if it is a rank of this world, else None."""
        return _current.rank if getattr(_current, "world", None) is self else None

    def communicator(self, ranks: tuple[int, ...]) -> ThreadedCommunicator:
        comm = self._communicators.get(ranks)
        if comm is None:
            with self._lock:
                comm = self._communicators.setdefault(ranks, ThreadedCommunicator(self, ranks))
        return comm

    def process_group(self, ranks: tuple[int, ...]) -> ThreadedProcessGroup:
        """The c10d process group over ``ranks`` (the calling rank among them), made on first use."""
        group = self._process_groups.get(ranks)
        if group is None:
            with self._lock_groups:
                group = self._process_groups.get(ranks)
                if group is None:
                    group = self._process_groups[ranks] = new_process_group(self, ranks, self.is_default_group)
        return group

    def adopt_group(self, group: Any) -> tuple[int, ...]:
        if isinstance(group, ThreadedProcessGroup):
            return self.communicator(group.communicator.ranks).ranks
        return super().adopt_group(group)

    def create_groups(self, groups: list[tuple[int, ...]], *, timeout_s: float | None = None) -> None:
        for ranks in groups:
            comm = self.communicator(ranks)
            if timeout_s is not None and comm.timeout_s != timeout_s:
                comm.set_timeout(timeout_s)

    @property
    def failure(self) -> tuple[int, BaseException] | None:
        """(rank, error) of the first rank that failed, if any."""
        return self._failure

    def abort(self, rank: int, error: BaseException) -> None:
        """Record the first failure and wake every waiting rank so it raises instead of hanging."""
        with self._lock:
            if self._failure is None:
                self._failure = (rank, error)
            for rnd in self._rounds.values():
                rnd.done.set()
                rnd.sides_done.set()
        self.mailbox.wake()

    def exchange(
        self,
        ranks: tuple[int, ...],
        kind: str,
        value: Any,
        *,
        mesh_dim: str | None = None,
        timeout_s: float | None = None,
        ticket: CheckTicket | None = None,
        comm: Communicator | None = None,
    ) -> list[Any]:
        """Deposit ``value`` for the caller's next ``kind`` collective on ``ranks``; return everyone's.

        ``mesh_dim`` names the group in errors; ``timeout_s`` overrides the world's timeout.
        ``ticket`` is the collective check's view of this call: once all members have deposited,
        if any ticket is ``checked``, the tickets' keys are compared. If the members called
        different kinds or their keys differ, each describes its own side (on its own thread) and
        every member raises the same ``CollectiveMismatchError`` (``comm`` words it).
        """
        me = self.current_rank()
        timeout = self.timeout if timeout_s is None else timeout_s
        rnd, seq = self._deposit(ranks, me, kind, value, ticket)
        name = collective_name(kind, ranks, mesh_dim)
        if rnd.sides is None and not rnd.done.wait(timeout):
            missing = sorted(set(ranks) - rnd.arrived)
            raise CollectiveTimeoutError(
                f"rank {me}: {name} timed out after {timeout:g}s waiting for ranks "
                f"{missing}, which never arrived; check that every rank issues the same collectives "
                "(SPMD_DEBUG=check compares them)"
            )
        if rnd.sides is None and len(rnd.arrived) == len(ranks) and _tickets_disagree(rnd.tickets):
            with self._lock:  # every member sees the same tickets, so every member gets here
                if rnd.sides is None:
                    rnd.sides = {}
        if rnd.sides is not None:
            self._raise_mismatch(rnd, ranks, seq, kind, ticket, comm, timeout)
        if len(rnd.arrived) < len(ranks):
            failed_rank, cause = self._failure or (-1, RuntimeError("unknown"))
            raise CollectiveAbortedError(
                f"rank {me}: {name} cancelled because rank {failed_rank} failed: {type(cause).__name__}: {cause}"
            )
        with self._lock:
            rnd.left += 1
            if rnd.left == len(ranks):
                del self._rounds[(ranks, seq)]
        return list(rnd.values)

    def _deposit(
        self, ranks: tuple[int, ...], me: int, kind: str, value: Any, ticket: CheckTicket | None
    ) -> tuple[_Round, int]:
        """Put the caller's value into the round of its next collective on ``ranks``; the round and its number.

        A member that brings another kind of collective than the round's marks the round as
        disagreeing (``sides``) and wakes the members already waiting, so they describe themselves too.
        """
        index = ranks.index(me)
        with self._lock:
            seq = self._next_seq.get((ranks, me), 0)
            self._next_seq[(ranks, me)] = seq + 1
            rnd = self._rounds.get((ranks, seq))
            if rnd is None:
                rnd = self._rounds[(ranks, seq)] = _Round(kind, [None] * len(ranks), [None] * len(ranks))
                if self._failure is not None:
                    rnd.done.set()
            if rnd.kind != kind and rnd.sides is None:
                rnd.sides = {}
                rnd.done.set()
            if rnd.sides is None:
                rnd.values[index] = value
                rnd.tickets[index] = ticket
                rnd.arrived.add(me)
                if len(rnd.arrived) == len(ranks):
                    rnd.done.set()
        return rnd, seq

    def _raise_mismatch(
        self,
        rnd: _Round,
        ranks: tuple[int, ...],
        seq: int,
        kind: str,
        ticket: CheckTicket | None,
        comm: Communicator | None,
        timeout: float,
    ) -> None:
        """The members of one round disagree: gather each one's side, then raise the same error."""
        me = self.current_rank()
        mine = mismatch_side(ticket, kind)
        with self._lock:
            assert rnd.sides is not None
            rnd.sides[me] = mine
            if len(rnd.sides) == len(ranks):
                rnd.sides_done.set()
        rnd.sides_done.wait(timeout)  # released early if the world aborts
        with self._lock:
            sides = [rnd.sides.get(rank, "never arrived") for rank in ranks]
        if comm is None:
            comm = self.communicator(ranks)
        raise mismatch_error(comm, seq, sides)


def _tickets_disagree(tickets: list[CheckTicket | None]) -> bool:
    """Whether a checked ticket is among ``tickets`` and two fingerprinted members' keys differ."""
    if not any(t is not None and t.checked for t in tickets):
        return False
    keys = [t.key for t in tickets if t is not None]  # compiled code carries none: nothing to compare
    return any(k != keys[0] for k in keys[1:])


class ThreadedCommunicator(Communicator):
    """Collectives among threads of one ``ThreadedWorld``; results never alias another rank's data."""

    def __init__(self, world: ThreadedWorld, ranks: tuple[int, ...], *, timeout_s: float | None = None) -> None:
        super().__init__(ranks, timeout_s=world.timeout if timeout_s is None else timeout_s)
        self.world = world

    @traceable_property
    def local_rank(self) -> int:
        return self.ranks.index(self.world.current_rank())

    @property
    def group(self) -> ThreadedProcessGroup:
        """This group as a c10d ``ProcessGroup`` (what ``mesh.get_group()`` returns on threads)."""
        return self.world.process_group(self.ranks)

    def exchange(self, kind: str, value: Any, *, ticket: CheckTicket | None = None) -> list[Any]:
        """Every member's ``value`` for this ``kind`` of round, in group order (the c10d groups' primitive).

        Values are passed as they are: a member that later writes to what it sent must send a copy.
        ``ticket`` is the collective check's view of the call (see ``ThreadedWorld.exchange``).
        """
        return self.world.exchange(
            self.ranks,
            kind,
            value,
            mesh_dim=self.mesh_dim,
            timeout_s=self.timeout_s,
            ticket=ticket,
            comm=self if ticket is None else ticket.comm,
        )

    def _exchange(self, kind: str, value: Any) -> list[Any]:
        # Send a snapshot, as a wire would: a fast rank may overwrite its input right after the
        # collective returns, while a slower one is still reading it.
        if isinstance(value, torch.Tensor):
            value = value.clone()
        ticket: CheckTicket | None = getattr(_pending, "ticket", None)
        if ticket is not None:
            _pending.ticket = None
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else None
            if ticket.kind != kind or ticket.comm.ranks != self.ranks or ticket.shape != shape:
                ticket = None  # left over from a call that never got here
        return self.exchange(kind, value, ticket=ticket)

    def _verify(self, ticket: CheckTicket) -> None:
        """Threads compare in the collective's own round: the ticket rides with the data."""
        _pending.ticket = ticket

    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.stack(self._exchange("all_gather", tensor))

    def _all_reduce(self, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
        return reduce_stack(torch.stack(self._exchange("all_reduce", tensor)), reduce_op)

    def _reduce_scatter(self, stacked: torch.Tensor, reduce_op: str) -> torch.Tensor:
        me = self.local_rank
        blocks = [s[me] for s in self._exchange("reduce_scatter", stacked)]
        return reduce_stack(torch.stack(blocks), reduce_op)

    def _all_to_all(self, stacked: torch.Tensor) -> torch.Tensor:
        me = self.local_rank
        return torch.stack([s[me] for s in self._exchange("all_to_all", stacked)])

    def _broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return self._exchange("broadcast", tensor)[src].clone()  # every receiver gets its own copy

    def _scatter(self, stacked: torch.Tensor, src: int) -> torch.Tensor:
        return self._exchange("scatter", stacked)[src][self.local_rank].clone()

    def _all_gather_object(self, obj: Any) -> list[Any]:
        return self._exchange("all_gather_object", obj)
