"""Random DTensors hold the numbers a single device draws, shard by shard, and replicas agree."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import spmd.tensor as st
from spmd.tensor import Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.tensor.random import manual_seed
from spmd.testing import run_threaded, seeded_randn


def single_device(seed: int, fill: str, shape: tuple[int, ...], *args: float) -> torch.Tensor:
    full = torch.empty(shape)
    getattr(full, fill)(*args, generator=torch.Generator().manual_seed(seed))
    return full


def test_factories_match_a_single_device_after_manual_seed() -> None:
    torch.manual_seed(11)  # before the world starts: every rank takes coordinate 0's seed

    def draws() -> list[torch.Tensor]:
        mesh = init_device_mesh("cpu", (2, 2))
        a = st.rand(7, 6, device_mesh=mesh, placements=[Shard(0), Shard(1)])
        b = st.randn(7, 6, device_mesh=mesh, placements=[Replicate(), Shard(0)])
        with CommDebugMode() as comm:
            c = st.randn(4, device_mesh=mesh, placements=[Replicate(), Replicate()])
        assert comm.get_total_counts() == 0, "drawing needs no communication"
        return [a.full_tensor(), b.full_tensor(), c.to_local()]

    results = run_threaded(draws, 4)
    generator = torch.Generator().manual_seed(11)
    expected = [torch.empty(7, 6).uniform_(generator=generator), torch.empty(7, 6).normal_(generator=generator)]
    expected.append(torch.empty(4).normal_(generator=generator))
    for per_rank in results:
        for got, want in zip(per_rank, expected):
            torch.testing.assert_close(got, want)


def test_in_place_fills_and_like_ops() -> None:
    def draws() -> list[torch.Tensor]:
        mesh = init_device_mesh("cpu", (4,))
        manual_seed(3, mesh)
        x = distribute_tensor(torch.zeros(9, 5), mesh, [Shard(0)])
        x.uniform_(-2, 2)
        y = torch.randn_like(x)
        p = distribute_tensor(torch.zeros(4, 4), mesh, [Partial()])
        p.normal_()
        assert x.placements == (Shard(0),) and y.placements == (Shard(0),) and p.placements == (Partial(),)
        return [x.full_tensor(), y.full_tensor(), p.full_tensor()]

    generator = torch.Generator().manual_seed(3)
    expected = [
        torch.empty(9, 5).uniform_(-2, 2, generator=generator),
        torch.empty(9, 5).normal_(generator=generator),
        torch.empty(4, 4).normal_(generator=generator),
    ]
    for per_rank in run_threaded(draws, 4):
        for got, want in zip(per_rank, expected):
            torch.testing.assert_close(got, want)


def test_randint_like_matches_a_single_device() -> None:
    def draws() -> list[torch.Tensor]:
        mesh = init_device_mesh("cpu", (2, 2))
        manual_seed(4, mesh)
        x = distribute_tensor(torch.zeros(7, 6), mesh, [Shard(1), Shard(0)])
        a = torch.randint_like(x, 10)
        b = torch.randint_like(x, -3, 3, dtype=torch.int64)
        assert a.placements == x.placements and b.dtype == torch.int64
        return [a.full_tensor(), b.full_tensor()]

    generator = torch.Generator().manual_seed(4)
    expected = [
        torch.empty(7, 6).random_(0, 10, generator=generator),
        torch.empty(7, 6, dtype=torch.int64).random_(-3, 3, generator=generator),
    ]
    for per_rank in run_threaded(draws, 4):
        for got, want in zip(per_rank, expected):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_dropout_on_shards_matches_single_device_and_backprops() -> None:
    full = seeded_randn(8, 6)

    def dropped() -> tuple[torch.Tensor, torch.Tensor]:
        mesh = init_device_mesh("cpu", (2, 2))
        manual_seed(5, mesh)
        x = distribute_tensor(full, mesh, [Shard(0), Shard(1)]).requires_grad_()
        out = F.dropout(x, p=0.4, training=True)
        assert out.placements == (Shard(0), Shard(1))
        out.full_tensor().sum().backward()
        return out.full_tensor(), x.grad.full_tensor()

    mask = torch.empty(8, 6).bernoulli_(0.6, generator=torch.Generator().manual_seed(5))
    for out, grad in run_threaded(dropped, 4):
        torch.testing.assert_close(out, full * mask / 0.6)
        torch.testing.assert_close(grad, mask / 0.6)


def test_dropout_of_a_partial_stays_partial() -> None:
    full = seeded_randn(4, 4, seed=1)

    def dropped() -> torch.Tensor:
        mesh = init_device_mesh("cpu", (4,))
        manual_seed(2, mesh)
        x = distribute_tensor(full, mesh, [Partial()])
        out = F.dropout(x, p=0.5, training=True)
        assert out.placements == (Partial(),)
        return out.full_tensor()

    mask = torch.empty(4, 4).bernoulli_(0.5, generator=torch.Generator().manual_seed(2))
    for out in run_threaded(dropped, 4):
        torch.testing.assert_close(out, full * mask * 2)


def test_eval_mode_dropout_is_the_identity() -> None:
    full = seeded_randn(4, 4, seed=1)

    def dropped() -> torch.Tensor:
        mesh = init_device_mesh("cpu", (4,))
        return F.dropout(distribute_tensor(full, mesh, [Shard(1)]), p=0.5, training=False).full_tensor()

    for out in run_threaded(dropped, 4):
        torch.testing.assert_close(out, full)
