"""The torch.distributed backend: gloo on CPU, NCCL on CUDA, under torchrun or any launcher.

Sub-groups are created once per mesh dimension (every rank creates every group, in the same order,
as c10d requires) and reused by every later collective. They use the timeout the user gave
(``init_device_mesh(timeout=...)``, else ``init_process_group(timeout=...)``), not c10d's 30-minute
default for new groups, so a stuck or dead rank ends the job within that timeout.

A collective that fails in the backend is re-raised as ``CollectiveTimeoutError`` (the group's
timeout passed) or ``CollectiveAbortedError`` (a peer's connection closed: it died or tore down),
naming the collective, the mesh dim and the group's ranks. c10d itself does not tell which rank did
not arrive, so on a timeout each rank leaves a note in the job's key-value store (what it was
waiting in) and reads its peers' notes for up to ``PEER_REPORT_WAIT_S``: a peer with no note is
named as stuck outside any collective (or dead), a peer with one is shown waiting where it waits.
This costs nothing until a collective times out.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from spmd.comm.base import (
    CheckTicket,
    CollectiveAbortedError,
    CollectiveTimeoutError,
    Communicator,
    World,
    full_check_here,
)
from spmd.comm.store_check import check_through_store, done_unchecked, issue_unchecked, verdict_for
from spmd.compile.properties import traceable_property

__all__ = ["C10dWorld", "C10dCommunicator"]

_C10D_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}
_functional = torch.ops._c10d_functional


def _issue_and_wait(collective: Any, *args: Any) -> torch.Tensor:
    """One of c10d's functional collectives (C++ from the call to the wait), waited for at once.

    They cost less per call than ``dist.all_reduce`` and friends, whose Python wrappers check and
    log on every call; the backend and the groups are the same.
    """
    return _functional.wait_tensor(collective(*args))


def _reduce_op(reduce_op: str, backend: str) -> tuple[Any, bool]:
    """The c10d op for ``reduce_op`` and whether the result must still be divided (avg on gloo)."""
    if reduce_op == "avg":
        if backend == "nccl":
            return dist.ReduceOp.AVG, False
        return dist.ReduceOp.SUM, True
    return _C10D_OPS[reduce_op], False


_TIMEOUT_WORDS = ("timed out", "timeout")
_PEER_LOST_WORDS = (
    "connection closed",
    "connection reset",
    "connection refused",
    "broken pipe",
    "socket closed",
    "read error",
    "write error",
)


PEER_REPORT_WAIT_S = 2.0
"""After a timeout, how long a rank waits for its peers' notes before raising."""


def _peer_report(me: int, peers: list[int], waiting_in: str) -> str:
    """Leave a note that ``me`` timed out in ``waiting_in``; say what each of ``peers`` noted.

    Uses the default group's store (c10d's private getter); any failure there gives an empty report.
    """
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"dtensor/timed_out/{me}", waiting_in)
        keys = {peer: f"dtensor/timed_out/{peer}" for peer in peers}
        deadline = time.monotonic() + PEER_REPORT_WAIT_S
        while time.monotonic() < deadline and not all(store.check([key]) for key in keys.values()):
            time.sleep(0.05)
        lines = []
        for peer, key in keys.items():
            if store.check([key]):
                lines.append(f"rank {peer} is itself waiting in {store.get(key).decode()}")
            else:
                lines.append(
                    f"rank {peer} did not arrive and waits in no collective of the mesh: stuck in its own code "
                    "(or a c10d call of its own), or dead"
                )
        return "; ".join(lines)
    except Exception:  # the store may be gone with the rank that hosted it
        return ""


def _default_group_timeout_s(device_type: str) -> float | None:
    """The timeout the default group was created with (the user's ``init_process_group(timeout=)``).

    c10d has no public getter; the backend's options hold it. None if this torch hides it, in
    which case new groups get c10d's own default.
    """
    try:
        backend = dist.group.WORLD._get_backend(torch.device(device_type))  # type: ignore[union-attr]
        return float(backend.options._timeout.total_seconds())
    except (AttributeError, RuntimeError, TypeError):
        return None


class C10dCommunicator(Communicator):
    """Collectives over a c10d process group holding ``ranks``.

    all_gather, all_reduce, reduce_scatter and all_to_all call c10d's functional collectives
    directly instead of going through the ``spmd::`` ops: torch.compile knows those ops, so a
    compiled graph holds them as it holds torch's own (inductor writes them in place and schedules
    their waits), and an eager call skips a Python kernel. Their traffic is recorded when the call
    is made: in eager code on every call, in compiled code while the graph is traced.
    broadcast and scatter (set-up time only) still go through the ``spmd::`` ops.
    """

    def __init__(self, ranks: tuple[int, ...], group: Any, *, timeout_s: float | None = None) -> None:
        super().__init__(ranks, timeout_s=timeout_s)
        self.group = group
        self.backend = dist.get_backend(group)
        self._local_rank = ranks.index(dist.get_rank()) if dist.get_rank() in ranks else -1
        self._native_reduce_scatter = True
        self.group_name = getattr(group, "group_name", "")
        self._issued = [0]
        """Collectives this rank issued on the group through the check (shared by views and copies):
        names the store slot of a warm-up check."""

    @traceable_property
    def local_rank(self) -> int:
        return self._local_rank

    def _run(self, kind: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``call(*args, **kwargs)``, with a backend timeout or lost peer re-raised as a named error."""
        try:
            return call(*args, **kwargs)
        except RuntimeError as error:
            self._raise_named(kind, error)
        finally:
            done_unchecked()

    def _verify(self, ticket: CheckTicket) -> None:
        """The full check exchanges digests over the group; the warm-up check goes through the store
        (see c10d_warmup), so a rank checking while its peer does not never waits in a collective.
        A "fake" group (torch's in-process stand-in, used to time dispatch) has no peers to compare with."""
        if self.backend == "fake":
            return
        n = self._issued[0]
        self._issued[0] = n + 1
        if not ticket.checked:
            issue_unchecked(ticket, self, n)
        elif full_check_here():
            super()._verify(ticket)
        else:
            check_through_store(self, ticket, n)

    def set_timeout(self, timeout_s: float) -> None:
        """Give the group (and every mesh-dim view of it) a new collective timeout."""
        self.group.set_timeout(timedelta(seconds=timeout_s))
        super().set_timeout(timeout_s)

    def _raise_named(self, kind: str, error: RuntimeError) -> NoReturn:
        verdict = verdict_for(done_unchecked())  # a peer's warm-up check found this collective disagreeing
        if verdict is not None:
            raise verdict from error
        text = str(error)
        lowered = text.lower()
        me = dist.get_rank()
        name = self.describe(kind)
        if any(word in lowered for word in _TIMEOUT_WORDS):
            limit = f" after {self.timeout_s:g}s" if self.timeout_s is not None else ""
            peers = [rank for rank in self.ranks if rank != me]
            report = _peer_report(me, peers, name) or f"one of ranks {peers} did not arrive"
            raise CollectiveTimeoutError(
                f"rank {me}: {name} timed out{limit}: {report}. Every rank must issue the same collectives "
                f"in the same order (SPMD_DEBUG=check compares them). Backend error: {text}"
            ) from error
        if any(word in lowered for word in _PEER_LOST_WORDS):
            raise CollectiveAbortedError(
                f"rank {me}: {name} failed because one of its peers {[r for r in self.ranks if r != me]} went "
                f"away (its process died or raised); see that rank's own error. Backend error: {text}"
            ) from error
        raise error

    def _finish_avg(self, tensor: torch.Tensor, divide: bool) -> torch.Tensor:
        if not divide:
            return tensor
        if tensor.is_floating_point() or tensor.is_complex():
            return tensor.div_(self.size)
        return torch.div(tensor, self.size, rounding_mode="floor")

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        self._check("all_gather", tensor, "")
        self._record("all_gather", tensor)
        return self._all_gather(tensor.contiguous())

    def all_reduce(self, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
        self._check("all_reduce", tensor, reduce_op)
        self._record("all_reduce", tensor)
        return self._all_reduce(tensor.contiguous(), reduce_op)

    def reduce_scatter(self, stacked: torch.Tensor, reduce_op: str) -> torch.Tensor:
        self._check("reduce_scatter", stacked, reduce_op)
        self._record("reduce_scatter", stacked)
        return self._reduce_scatter(stacked.contiguous(), reduce_op)

    def all_to_all(self, stacked: torch.Tensor) -> torch.Tensor:
        self._check("all_to_all", stacked, "")
        self._record("all_to_all", stacked)
        return self._all_to_all(stacked.contiguous())

    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        # gloo checks each output chunk against the input's shape, so gather flat and view.
        gather = _functional.all_gather_into_tensor
        out = self._run("all_gather", _issue_and_wait, gather, tensor.reshape(-1), self.size, self.group_name)
        return out.view(self.size, *tensor.shape)

    def _all_reduce(self, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
        _, divide = _reduce_op(reduce_op, self.backend)
        name = "sum" if divide else reduce_op
        out = self._run("all_reduce", _issue_and_wait, _functional.all_reduce, tensor, name, self.group_name)
        return self._finish_avg(out, divide)

    def _reduce_scatter(self, stacked: torch.Tensor, reduce_op: str) -> torch.Tensor:
        op, divide = _reduce_op(reduce_op, self.backend)
        if not self._native_reduce_scatter:
            # Older gloo has no reduce_scatter; an all_reduce then a local slice gives the same values.
            reduced = stacked.clone()
            self._run("reduce_scatter", dist.all_reduce, reduced, op=op, group=self.group)
            return self._finish_avg(reduced[self.local_rank].clone(), divide)
        block = stacked.shape[1:]
        name = "sum" if divide else reduce_op
        scatter = _functional.reduce_scatter_tensor
        try:
            out = _issue_and_wait(scatter, stacked.reshape(-1), name, self.size, self.group_name)
        except RuntimeError as error:
            # The backend refuses before sending anything, on every rank alike, so falling back is safe.
            if "support" not in str(error).lower():
                self._raise_named("reduce_scatter", error)
            self._native_reduce_scatter = False
            return self._reduce_scatter(stacked, reduce_op)
        done_unchecked()
        return self._finish_avg(out.view(block), divide)

    def _all_to_all(self, stacked: torch.Tensor) -> torch.Tensor:
        splits = [1] * self.size  # one block per member
        return self._run(
            "all_to_all", _issue_and_wait, _functional.all_to_all_single, stacked, splits, splits, self.group_name
        )

    def _broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        out = tensor.clone()
        self._run("broadcast", dist.broadcast, out, src=self.ranks[src], group=self.group)
        return out

    def _scatter(self, stacked: torch.Tensor, src: int) -> torch.Tensor:
        out = stacked.new_empty(stacked.shape[1:])
        blocks = list(stacked.unbind(0)) if self.local_rank == src else None
        self._run("scatter", dist.scatter, out, blocks, src=self.ranks[src], group=self.group)
        return out

    def _all_gather_object(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.size
        self._run("all_gather_object", dist.all_gather_object, gathered, obj, group=self.group)
        return gathered


class C10dWorld(World):
    """The default c10d process group; ``ensure_initialized`` starts it from torchrun's environment."""

    backend_name = "c10d"

    def __init__(self, device_type: str = "cpu") -> None:
        self.size = dist.get_world_size()
        self._communicators: dict[tuple[int, ...], C10dCommunicator] = {}
        self._created: set[tuple[int, ...]] = set()
        self.timeout_s = _default_group_timeout_s(device_type)
        """The default group's timeout: new groups get it unless ``create_groups`` is given another."""

    @staticmethod
    def ensure_initialized(device_type: str, timeout_s: float | None = None) -> None:
        """Start the default group from torchrun's environment, with ``timeout_s`` if given."""
        if dist.is_initialized():
            return
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise RuntimeError(
                "no distributed world: run under torchrun (or call torch.distributed.init_process_group), "
                "or inside spmd.testing.run_threaded for an in-process world"
            )
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if timeout_s is None:
            dist.init_process_group(backend=backend)
        else:
            dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))

    def current_rank(self) -> int:
        return dist.get_rank()

    def communicator(self, ranks: tuple[int, ...]) -> C10dCommunicator:
        comm = self._communicators.get(ranks)
        if comm is None:
            raise RuntimeError(f"no process group for ranks {list(ranks)}; create the DeviceMesh on every rank")
        return comm

    def missing_groups(self, groups: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        return [ranks for ranks in groups if ranks not in self._created]

    def adopt_group(self, group: Any) -> tuple[int, ...]:
        """The ranks of ``group``: a communicator of this world, or a ProcessGroup made outside spmd,
        which then serves its ranks (unless a group over the same ranks already does)."""
        if isinstance(group, Communicator):
            return super().adopt_group(group)
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"expected a torch.distributed ProcessGroup, got {type(group).__name__}")
        ranks = tuple(dist.get_process_group_ranks(group))
        if ranks not in self._created:
            self._created.add(ranks)
            if dist.get_rank() in ranks:
                self._communicators[ranks] = C10dCommunicator(ranks, group, timeout_s=self.timeout_s)
        return ranks

    def create_groups(self, groups: list[tuple[int, ...]], *, timeout_s: float | None = None) -> None:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        for ranks in groups:
            # Non-members must still join new_group, so track creation apart from membership.
            if ranks in self._created:
                if timeout_s is not None and ranks in self._communicators:
                    self._communicators[ranks].set_timeout(timeout_s)
                continue
            self._created.add(ranks)
            if ranks == tuple(range(self.size)) and timeout_s == self.timeout_s:
                group = dist.group.WORLD
            elif timeout_s is None:
                group = dist.new_group(list(ranks))
            else:
                # Without a timeout, new_group would wait c10d's 30-minute default, not the user's.
                group = dist.new_group(list(ranks), timeout=timedelta(seconds=timeout_s))
            if dist.get_rank() in ranks:
                self._communicators[ranks] = C10dCommunicator(ranks, group, timeout_s=timeout_s)
