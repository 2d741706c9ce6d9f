"""The threaded world as a c10d backend, so code that calls ``torch.distributed`` runs on rank threads.

Third-party model code talks to c10d directly on a mesh's groups: ``dist.get_world_size(group)``,
``dist.get_rank(group)``, ``dist.all_reduce(t, group=group)`` and the functional collectives
(``torch.distributed._functional_collectives``). Under torchrun those are gloo or NCCL groups; on
``run_threaded`` they are ``ThreadedProcessGroup`` objects, real ``torch.distributed.ProcessGroup``
subclasses whose collectives hand tensors between the rank threads through the world's communicators.

One process group object serves every rank thread of its group: c10d asks it for ``rank()`` and it
answers with the calling thread's index in the group, so nothing in c10d needs a per-thread copy.
While ``run_threaded`` runs (and no other default group exists), the world's default group is one of
these, started with ``init_process_group`` under the registered backend name ``"spmd_threads"``, so
``dist.get_rank()``, ``dist.is_initialized()`` and DCP's own coordination see the rank thread's world.
Mesh groups are made with ``dist.new_group``, so c10d knows their ranks and name and the functional
collectives find them. Point-to-point calls (``send``/``recv``, ``isend``/``irecv``,
``batch_isend_irecv``) go through the world's mailbox (``threaded_p2p``): c10d hands the group the
peer's rank in the group, and the message is matched by group, pair of ranks and tag. A send is
complete when it returns; a receive's ``Work`` waits for its message on ``wait()``.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from spmd.comm.base import active_world, reduce_stack
from spmd.comm.threaded_p2p import Mailbox, Receipt

__all__ = ["BACKEND_NAME", "ThreadedProcessGroup", "default_group_of", "new_process_group"]


class RankThreads(Protocol):
    """What a threaded process group needs of its world (``spmd.comm.threaded.ThreadedWorld``)."""

    size: int
    backend_name: str
    timeout: float
    mailbox: Mailbox

    def rank_or_none(self) -> int | None: ...

    def communicator(self, ranks: tuple[int, ...]) -> GroupExchange: ...


class GroupExchange(Protocol):
    """What it needs of one group's communicator (``spmd.comm.threaded.ThreadedCommunicator``)."""

    ranks: tuple[int, ...]
    size: int
    timeout_s: float | None

    @property
    def world(self) -> RankThreads: ...

    def exchange(self, kind: str, value: Any, *, ticket: Any = None) -> list[Any]: ...

BACKEND_NAME = "spmd_threads"

_BITWISE: dict[Any, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    dist.ReduceOp.BAND: torch.bitwise_and,
    dist.ReduceOp.BOR: torch.bitwise_or,
    dist.ReduceOp.BXOR: torch.bitwise_xor,
}
_ARITHMETIC = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.AVG: "avg",
    dist.ReduceOp.MAX: "max",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.PRODUCT: "product",
}


def _reduce(values: Sequence[torch.Tensor], op: Any) -> torch.Tensor:
    """Combine one tensor per rank with a c10d ``ReduceOp``."""
    for known, name in _ARITHMETIC.items():
        if op == known:
            return reduce_stack(torch.stack(list(values)), name)
    for known, fn in _BITWISE.items():
        if op == known:
            return functools.reduce(fn, values)
    raise ValueError(f"the threaded world's process groups do not reduce with {op}; use SUM, AVG, MAX, MIN or PRODUCT")


class _Done(dist.Work):
    """A collective that already finished (the threaded world's collectives complete before returning)."""

    def __init__(self, result: list[torch.Tensor] | None = None) -> None:
        super().__init__()
        self._result = result or []

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def result(self) -> list[torch.Tensor]:
        return self._result

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        future.set_result(self._result)
        return future


def _snapshot(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """What a rank sends: copies, so a peer reading later never sees the sender's next write."""
    return [t.detach().clone() for t in tensors]


_ProcessGroup: Any = dist.ProcessGroup
"""c10d's stubs type each collective as the C++ overloads; a Python group overrides the form c10d calls."""


class ThreadedProcessGroup(_ProcessGroup):  # type: ignore[misc]
    """A c10d process group over the ranks of one ``ThreadedCommunicator``, shared by its rank threads.

    ``rank()`` is the calling thread's index in the group. Every collective completes before it
    returns (its ``Work`` is already done) and writes its results into the caller's output tensors.
    """

    def __init__(self, communicator: GroupExchange, name: str) -> None:
        super().__init__(0, communicator.size)
        self.communicator = communicator
        self._name = name

    def __repr__(self) -> str:
        return f"ThreadedProcessGroup(ranks={list(self.communicator.ranks)}, name={self._name!r})"

    # ----- what c10d asks of a group ---------------------------------------------------------------
    def getRank(self) -> int:
        """The calling rank thread's index in the group; -1 (c10d's "not a member") for other threads."""
        rank = self.communicator.world.rank_or_none()
        ranks = self.communicator.ranks
        return ranks.index(rank) if rank in ranks else -1

    def getSize(self) -> int:
        return self.communicator.size

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    @property
    def group_name(self) -> str:
        return self._name

    def _exchange(self, kind: str, value: Any) -> list[Any]:
        return self.communicator.exchange(f"c10d.{kind}", value)

    # ----- collectives ------------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
        sent = self._exchange("allreduce", _snapshot(tensors))
        with torch.no_grad():
            for i, tensor in enumerate(tensors):
                tensor.copy_(_reduce([theirs[i] for theirs in sent], op))
        return _Done(tensors)

    allreduce_coalesced = allreduce

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        sent = self._exchange("reduce", _snapshot(tensors))
        if self.getRank() == opts.rootRank:
            with torch.no_grad():
                tensors[opts.rootTensor].copy_(_reduce([theirs[opts.rootTensor] for theirs in sent], opts.reduceOp))
        return _Done(tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        mine = self.getRank() == opts.rootRank
        sent = self._exchange("broadcast", _snapshot(tensors) if mine else None)
        if not mine:
            with torch.no_grad():
                for tensor, root in zip(tensors, sent[opts.rootRank]):
                    tensor.copy_(root)
        return _Done(tensors)

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        sent = self._exchange("allgather", _snapshot(inputs))
        with torch.no_grad():
            for i, outputs in enumerate(output_lists):
                for output, theirs in zip(outputs, sent):
                    output.copy_(theirs[i])
        return _Done([t for outputs in output_lists for t in outputs])

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        sent = self._exchange("all_gather_single", _snapshot(inputs))
        with torch.no_grad():
            for i, output in enumerate(outputs):
                torch.cat([theirs[i] for theirs in sent], dim=0, out=output.view(-1, *inputs[i].shape[1:]))
        return _Done(outputs)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        return self.all_gather_single_coalesced([output], [input], opts)

    all_gather_single = _allgather_base
    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None
    ) -> dist.Work:
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
        me = self.getRank()
        sent = self._exchange("reduce_scatter", [_snapshot(inputs) for inputs in input_lists])
        with torch.no_grad():
            for i, output in enumerate(outputs):
                output.copy_(_reduce([theirs[i][me] for theirs in sent], op))
        return _Done(outputs)

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> dist.Work:
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
        me, size = self.getRank(), self.getSize()
        sent = self._exchange("reduce_scatter_single", _snapshot(inputs))
        with torch.no_grad():
            for i, output in enumerate(outputs):
                blocks = [theirs[i].reshape(size, -1)[me] for theirs in sent]
                output.view(-1).copy_(_reduce(blocks, op))
        return _Done(outputs)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> dist.Work:
        return self.reduce_scatter_single_coalesced([output], [input], opts)

    reduce_scatter_single = _reduce_scatter_base
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> dist.Work:
        me, size = self.getRank(), self.getSize()
        splits = list(input_split_sizes) or [input.shape[0] // size] * size
        sent = self._exchange("all_to_all_single", (input.detach().clone(), splits))
        with torch.no_grad():
            pieces = [theirs.split(their_splits, dim=0)[me] for theirs, their_splits in sent]
            torch.cat(pieces, dim=0, out=output)
        return _Done([output])

    alltoall_base = all_to_all_single

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        me = self.getRank()
        sent = self._exchange("alltoall", _snapshot(inputs))
        with torch.no_grad():
            for output, theirs in zip(outputs, sent):
                output.copy_(theirs[me])
        return _Done(outputs)

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any) -> dist.Work:
        me = self.getRank()
        mine = me == opts.rootRank
        sent = self._exchange("scatter", [_snapshot(inputs) for inputs in input_lists] if mine else None)
        with torch.no_grad():
            for i, output in enumerate(outputs):
                output.copy_(sent[opts.rootRank][i][me])
        return _Done(outputs)

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> dist.Work:
        sent = self._exchange("gather", _snapshot(inputs))
        if self.getRank() == opts.rootRank:
            with torch.no_grad():
                for i, outputs in enumerate(output_lists):
                    for output, theirs in zip(outputs, sent):
                        output.copy_(theirs[i])
        return _Done([t for outputs in output_lists for t in outputs])

    def barrier(self, opts: Any = None) -> dist.Work:
        self._exchange("barrier", None)
        return _Done()

    # ----- point-to-point ---------------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> dist.Work:
        """Leave a copy of ``tensors`` for group rank ``dstRank``; complete at once (the receiver need not wait)."""
        ranks = self.communicator.ranks
        self.communicator.world.mailbox.send(ranks, self._my_global_rank(), self._peer(dstRank, "dst"), tag, tensors)
        return _Done(tensors)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> dist.Work:
        """Reserve the next message from group rank ``srcRank``; the ``Work``'s ``wait()`` fills ``tensors``."""
        return self._post_receive(tensors, self._peer(srcRank, "src"), tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        """Receive the first message any rank of the group sends with ``tag``."""
        return self._post_receive(tensors, None, tag)

    def _post_receive(self, tensors: list[torch.Tensor], sender: int | None, tag: int) -> dist.Work:
        mailbox = self.communicator.world.mailbox
        receipt = mailbox.post_receive(self.communicator.ranks, sender, self._my_global_rank(), tag)
        return _Receive(self, receipt, tensors)

    def _my_global_rank(self) -> int:
        rank = self.communicator.world.rank_or_none()
        if rank is None or rank not in self.communicator.ranks:
            raise RuntimeError(f"{self!r}: point-to-point calls come from the rank threads of its group")
        return rank

    def _peer(self, group_rank: int, role: str) -> int:
        """The global rank of group rank ``group_rank`` (c10d passes peers as ranks in the group)."""
        ranks = self.communicator.ranks
        if not 0 <= group_rank < len(ranks):
            raise ValueError(f"{role} rank {group_rank} is not in {self!r}; use a rank in [0, {len(ranks) - 1}]")
        return ranks[group_rank]


class _Receive(dist.Work):
    """A posted receive: ``wait()`` blocks until its message arrives (bounded by the group's timeout)."""

    def __init__(self, group: ThreadedProcessGroup, receipt: Receipt, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self._group, self._receipt, self._tensors = group, receipt, tensors
        self._sender: int | None = None

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._sender is not None:
            return True
        communicator = self._group.communicator
        limit = timeout.total_seconds() if timeout else communicator.timeout_s or communicator.world.timeout
        sender, message = communicator.world.mailbox.take(self._receipt, limit)
        if len(message) != len(self._tensors):
            raise ValueError(
                f"rank {self._receipt.receiver}: rank {sender} sent {len(message)} tensors into {len(self._tensors)} buffers"
            )
        with torch.no_grad():
            for buffer, sent in zip(self._tensors, message):
                if buffer.dtype != sent.dtype or buffer.numel() != sent.numel():
                    raise ValueError(
                        f"rank {self._receipt.receiver}: rank {sender} sent {sent.dtype}{list(sent.shape)} (tag "
                        f"{self._receipt.tag}) into a {buffer.dtype}{list(buffer.shape)} receive buffer; the "
                        "buffer must have the sent tensor's dtype and number of elements"
                    )
                buffer.copy_(sent.reshape(buffer.shape))
        self._sender = sender
        return True

    def is_completed(self) -> bool:
        return self._sender is not None or self._group.communicator.world.mailbox.ready(self._receipt)

    def is_success(self) -> bool:
        return self.is_completed()

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._tensors

    def _source_rank(self) -> int:
        """The sender's rank in the group (what ``dist.recv(src=None)`` asks after waiting)."""
        self.wait()
        assert self._sender is not None
        return self._group.communicator.ranks.index(self._sender)

    source_rank = _source_rank


# ----- the backend and the default group -----------------------------------------------------------
_lock = threading.Lock()
_installing: RankThreads | None = None
"""The world whose default group ``init_process_group`` is creating (set by ``default_group_of``)."""


def _create(options: Any, backend_options: Any) -> ThreadedProcessGroup:
    """c10d's backend factory: the group over ``options.global_ranks_in_group`` of the caller's world."""
    world = _installing or active_world()
    if world is None or world.backend_name != "threaded":
        raise RuntimeError(
            f"the {BACKEND_NAME!r} backend serves spmd's threaded world: create its groups on the rank "
            "threads of spmd.testing.run_threaded"
        )
    ranks = tuple(options.global_ranks_in_group) or tuple(range(world.size))
    return ThreadedProcessGroup(world.communicator(ranks), str(options.group_id))  # type: ignore[arg-type]


def _register_backend() -> None:
    if not hasattr(dist.Backend, BACKEND_NAME.upper()):
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])


@contextmanager
def default_group_of(world: RankThreads) -> Iterator[bool]:
    """Make ``world`` c10d's default group for the block, if the process has no default group yet.

    Yields whether it did: under torchrun (a real default group) the world's groups are still process
    groups, but c10d's global ranks are the processes', so ``dist.get_rank(group)`` is not offered.
    """
    global _installing
    # TORCH_DIST_INIT_BARRIER=1 makes init_process_group wait in the store for every rank, and only
    # this thread would ever arrive: the world then runs without a default group rather than hang.
    if not dist.is_available() or dist.is_initialized() or os.environ.get("TORCH_DIST_INIT_BARRIER", "0") == "1":
        yield False
        return
    _register_backend()
    with _lock:
        _installing = world
        try:
            store = dist.HashStore()  # type: ignore[attr-defined]
            dist.init_process_group(BACKEND_NAME, store=store, rank=0, world_size=world.size)
        finally:
            _installing = None
    try:
        yield True
    finally:
        if dist.is_initialized() and isinstance(dist.distributed_c10d._get_default_group(), ThreadedProcessGroup):
            dist.destroy_process_group()


def new_process_group(world: RankThreads, ranks: tuple[int, ...], owns_default: bool) -> ThreadedProcessGroup:
    """The process group over ``ranks`` (the caller among them): made through ``dist.new_group`` when
    ``world`` is c10d's default group, so c10d knows its ranks and name; else a group of its own."""
    if owns_default:
        group = dist.new_group(list(ranks), backend=BACKEND_NAME)
        assert isinstance(group, ThreadedProcessGroup)
        return group
    return ThreadedProcessGroup(world.communicator(ranks), f"{BACKEND_NAME}:{','.join(map(str, ranks))}")
