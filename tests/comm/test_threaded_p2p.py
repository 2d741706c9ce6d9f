"""Point-to-point on the threaded world: ``dist.send``/``recv``, ``isend``/``irecv`` and
``batch_isend_irecv`` on a mesh's groups, as pipeline schedules call them.

The bodies that take the ``world`` fixture run on rank threads and on gloo processes, so each
value is what gloo gives too.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from spmd.comm import CollectiveAbortedError
from spmd.tensor import init_device_mesh
from spmd.testing import CollectiveTimeoutError, run_threaded


def send_then_overwrite() -> tuple[list[float], int, list[float], int] | None:
    if dist.get_rank() == 0:
        sent = torch.arange(3.0)
        dist.send(sent, dst=1)
        sent.add_(100.0)  # the receiver must see what was sent, not this write
        dist.isend(torch.ones(2), dst=1, tag=7).wait()
        return None
    first, second = torch.empty(3), torch.empty(2)
    source = dist.recv(first, src=0)
    any_source = dist.recv(second, tag=7)  # src=None: from whoever sends with tag 7
    return first.tolist(), source, second.tolist(), any_source


def test_send_and_recv_carry_a_copy_and_name_the_sender(world) -> None:
    assert world(send_then_overwrite, 2) == [None, ([0.0, 1.0, 2.0], 0, [1.0, 1.0], 0)]


def exchange_over_pp() -> tuple[list[float], list[float]]:
    """Each rank swaps with its pipeline peer twice: by global peer rank, then by rank in the group."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    pp = mesh.get_group("pp")
    me, peers = dist.get_rank(pp), dist.get_process_group_ranks(pp)
    mine = torch.full((2,), float(dist.get_rank()))
    by_global, by_group = torch.empty(2), torch.empty(2)
    ops = [
        dist.P2POp(dist.irecv, by_global, peers[1 - me], pp),  # the order of sends and receives
        dist.P2POp(dist.isend, mine, peers[1 - me], pp),  # in one batch does not matter
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    ops = [
        dist.P2POp(dist.isend, mine * 10, group=pp, group_peer=1 - me),
        dist.P2POp(dist.irecv, by_group, group=pp, group_peer=1 - me),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return by_global.tolist(), by_group.tolist()


def test_batch_isend_irecv_takes_global_or_group_peers(world) -> None:
    # pp groups are [0, 2] and [1, 3]: each rank gets its peer's rank, then ten times it
    assert world(exchange_over_pp, 4) == [
        ([2.0, 2.0], [20.0, 20.0]),
        ([3.0, 3.0], [30.0, 30.0]),
        ([0.0, 0.0], [0.0, 0.0]),
        ([1.0, 1.0], [10.0, 10.0]),
    ]


def test_receives_meet_sends_in_posting_order_per_tag() -> None:
    def main() -> list[float] | None:
        if dist.get_rank() == 0:
            for value, tag in ((1.0, 0), (2.0, 0), (3.0, 4)):
                dist.send(torch.full((1,), value), dst=1, tag=tag)
            return None
        first, second, tagged = torch.empty(1), torch.empty(1), torch.empty(1)
        works = [dist.irecv(first, src=0), dist.irecv(second, src=0), dist.irecv(tagged, src=0, tag=4)]
        for work in reversed(works):  # waiting out of order changes nothing: posting order decides
            work.wait()
        assert all(work.is_completed() for work in works)
        return [first.item(), second.item(), tagged.item()]

    assert run_threaded(main, 2) == [None, [1.0, 2.0, 3.0]]


def test_a_send_does_not_wait_for_its_receiver() -> None:
    def main() -> float:
        if dist.get_rank() == 0:
            start = time.monotonic()
            dist.send(torch.ones(1), dst=1)
            return time.monotonic() - start
        time.sleep(0.3)
        received = torch.empty(1)
        dist.recv(received, src=0)
        return received.item()

    sent_in, received = run_threaded(main, 2)
    assert sent_in < 0.3 and received == 1.0


def test_a_recv_whose_sender_never_sends_times_out_naming_it() -> None:
    def main() -> None:
        if dist.get_rank() == 1:
            dist.recv(torch.empty(1), src=0, tag=3)

    with pytest.raises(CollectiveTimeoutError, match=r"rank 1: recv from rank 0 \(tag 3\).*rank 0 never sent"):
        run_threaded(main, 2, timeout=0.5)


def test_a_failing_rank_releases_a_waiting_recv_at_once() -> None:
    released: list[BaseException] = []

    def main() -> None:
        if dist.get_rank() == 0:
            time.sleep(0.1)
            raise ValueError("rank 0 lost its input")
        try:
            dist.recv(torch.empty(1), src=0)
        except CollectiveAbortedError as error:
            released.append(error)
            raise

    start = time.monotonic()
    with pytest.raises(ValueError, match="lost its input"):
        run_threaded(main, 2, timeout=30)
    assert time.monotonic() - start < 5.0, "the 30 s timeout is not involved"
    assert "rank 0 failed" in str(released[0])


def test_a_buffer_that_cannot_hold_the_message_raises() -> None:
    def main() -> None:
        if dist.get_rank() == 0:
            dist.send(torch.ones(4), dst=1)
        else:
            dist.recv(torch.empty(3), src=0)

    with pytest.raises(ValueError, match=r"sent torch.float32\[4\] .* into a torch.float32\[3\] receive buffer"):
        run_threaded(main, 2)
