"""Point-to-point messages between the rank threads of one threaded world, matched as c10d matches them.

A send and a receive meet on a *channel*: the group, the sending rank, the receiving rank and the tag.
Within a channel the n-th send posted meets the n-th receive posted, whichever comes first, as
gloo and NCCL order messages between one pair of ranks. A send never waits for its receiver: it
leaves a copy of its tensors in the channel (so the sender may write to them at once, as it may once
a wire has carried them) and is complete. A receive reserves its place in the channel's order when
it is posted (``irecv``) and waits for its message when its ``Work`` is waited on; a wait longer than
the group's timeout raises ``CollectiveTimeoutError`` naming the rank that never sent, and a rank
that fails elsewhere in the world releases every waiting receive with ``CollectiveAbortedError``.

A receive from any source takes the first message no specific receive has reserved, looking when it
is waited on rather than when it is posted, which is all torch's ``recv(src=None)`` promises.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from spmd.comm.base import CollectiveAbortedError, CollectiveTimeoutError

__all__ = ["Mailbox", "Receipt"]

_Channel = tuple[tuple[int, ...], int, int, int]
"""(the group's global ranks, the sender's global rank, the receiver's global rank, the tag)."""


@dataclass
class _Queue:
    """One channel's messages by their send number, and how many sends and receives it has seen."""

    sent: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    sends_posted: int = 0
    receives_posted: int = 0


@dataclass(frozen=True)
class Receipt:
    """A posted receive: its channel and its place in that channel's order (``None``: any source)."""

    ranks: tuple[int, ...]
    receiver: int
    tag: int
    sender: int | None
    number: int | None


class Mailbox:
    """Every channel of one world; ``failure`` reports the world's first failed rank, if any."""

    def __init__(self, failure: Callable[[], tuple[int, BaseException] | None]) -> None:
        self._failure = failure
        self._changed = threading.Condition()
        self._queues: dict[_Channel, _Queue] = {}

    def send(self, ranks: tuple[int, ...], sender: int, receiver: int, tag: int, tensors: list[torch.Tensor]) -> None:
        """Leave copies of ``tensors`` for ``receiver``'s matching receive; returns at once."""
        message = [t.detach().clone() for t in tensors]
        with self._changed:
            queue = self._queues.setdefault((ranks, sender, receiver, tag), _Queue())
            queue.sent[queue.sends_posted] = message
            queue.sends_posted += 1
            self._changed.notify_all()

    def post_receive(self, ranks: tuple[int, ...], sender: int | None, receiver: int, tag: int) -> Receipt:
        """Reserve the next message from ``sender`` (``None``: whichever comes) on the channel."""
        if sender is None:
            return Receipt(ranks, receiver, tag, None, None)
        with self._changed:
            queue = self._queues.setdefault((ranks, sender, receiver, tag), _Queue())
            number = queue.receives_posted
            queue.receives_posted += 1
        return Receipt(ranks, receiver, tag, sender, number)

    def ready(self, receipt: Receipt) -> bool:
        """Whether ``receipt``'s message has arrived (a receive from any source: whether any has)."""
        with self._changed:
            return self._find(receipt, claim=False) is not None

    def take(self, receipt: Receipt, timeout_s: float) -> tuple[int, list[torch.Tensor]]:
        """Wait for ``receipt``'s message; the sender's global rank and its tensors.

        Raises ``CollectiveTimeoutError`` after ``timeout_s`` and ``CollectiveAbortedError`` as soon as
        a rank of the world fails, so a receive whose sender never sends cannot hang.
        """
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                found = self._find(receipt, claim=True)
                if found is not None:
                    return found
                failure = self._failure()
                if failure is not None:
                    failed_rank, cause = failure
                    raise CollectiveAbortedError(
                        f"rank {receipt.receiver}: {_describe(receipt)} cancelled because rank {failed_rank} "
                        f"failed: {type(cause).__name__}: {cause}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    peer = "no rank" if receipt.sender is None else f"rank {receipt.sender}"
                    raise CollectiveTimeoutError(
                        f"rank {receipt.receiver}: {_describe(receipt)} timed out after {timeout_s:g}s: {peer} "
                        "never sent a matching tensor; check that every recv has a send on the same group "
                        "with the same tag"
                    )
                self._changed.wait(left)

    def wake(self) -> None:
        """Release every waiting receive so it looks at the world's failure (the world aborts)."""
        with self._changed:
            self._changed.notify_all()

    def _find(self, receipt: Receipt, *, claim: bool) -> tuple[int, list[torch.Tensor]] | None:
        """The receipt's message if it is there, removed from its channel when ``claim``; the lock is held."""
        if receipt.sender is not None:
            queue = self._queues[(receipt.ranks, receipt.sender, receipt.receiver, receipt.tag)]
            assert receipt.number is not None
            if receipt.number not in queue.sent:
                return None
            message = queue.sent.pop(receipt.number) if claim else queue.sent[receipt.number]
            return receipt.sender, message
        for (ranks, sender, receiver, tag), queue in self._queues.items():
            if (ranks, receiver, tag) != (receipt.ranks, receipt.receiver, receipt.tag):
                continue
            unreserved = queue.receives_posted
            if unreserved in queue.sent:
                if not claim:
                    return sender, queue.sent[unreserved]
                queue.receives_posted += 1
                return sender, queue.sent.pop(unreserved)
        return None


def _describe(receipt: Receipt) -> str:
    source = "any source" if receipt.sender is None else f"rank {receipt.sender}"
    return f"recv from {source} (tag {receipt.tag}) on group {list(receipt.ranks)}"
