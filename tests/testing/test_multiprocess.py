"""run_multiprocess: gloo ranks as processes, results back in rank order, every failure's traceback shown."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from spmd.testing import RankFailed, run_multiprocess

pytestmark = pytest.mark.multiprocess


def rank_and_sum_of_ranks() -> tuple[int, float]:
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    return dist.get_rank(), total.item()


def every_rank_fails() -> None:
    # Past the barrier every rank has joined the group: none fails in gloo's connect because a peer
    # raised and tore down first.
    dist.barrier()
    raise ValueError(f"rank {dist.get_rank()} fails on purpose")


def test_runs_started_at_once_get_their_own_ports_and_results() -> None:
    results: list[object] = [None, None]

    def run(index: int) -> None:
        results[index] = run_multiprocess(rank_and_sum_of_ranks, 2)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert results == [[(0, 1.0), (1, 1.0)]] * 2


def test_the_report_holds_every_failing_ranks_traceback() -> None:
    with pytest.raises(RankFailed) as failure:
        run_multiprocess(every_rank_fails, 2, timeout=60.0)
    message = str(failure.value)
    # both ranks fail right after the rendezvous, well inside the grace period the others get
    assert "ValueError: rank 0 fails on purpose" in message and "ValueError: rank 1 fails on purpose" in message
    assert "also failed" in message and "every_rank_fails" in message
