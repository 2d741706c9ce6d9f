"""Every redistribute transition, checked against the full tensor, with gradients and comm counts."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from spmd.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.tensor.redistribute.plan import plan_redistribute
from spmd.testing import DTensorTestBase, seeded_randn, with_comms
from spmd.testing.layouts import expected_local_grad, local_piece, make_dtensor, placement_options

SHAPES = [(8, 6), (7, 5)]  # even and uneven over 2 and 4 ranks
DTYPES = [torch.float32, torch.int64]


def layouts(mesh_ndim: int, dtype: torch.dtype) -> list[tuple]:
    # Integer averages round, so int64 covers sum/max/min partials only.
    partials = ("sum", "max", "min") if dtype == torch.int64 else ("sum", "avg", "max", "min")
    return list(itertools.product(placement_options(2, partials=partials), repeat=mesh_ndim))


def global_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    numel = shape[0] * shape[1]
    return (torch.arange(numel).reshape(shape) * 3 - 11).to(dtype)


def check_values(mesh, pairs, shape, dtype) -> None:
    full = global_tensor(shape, dtype)
    for src, dst in pairs:
        x = make_dtensor(full, mesh, src)
        y = x.redistribute(mesh, dst)
        assert y.placements == dst
        assert y.shape == full.shape
        result = y.full_tensor()
        if not torch.equal(result, full):
            raise AssertionError(f"{src} -> {dst} on {mesh} for {dtype}{list(shape)} gave a wrong value")


def check_grads(mesh, pairs, shape) -> None:
    full = global_tensor(shape, torch.float64)
    weight = seeded_randn(*shape, seed=0, dtype=torch.float64)
    for src, dst in pairs:
        if any(p.is_partial("max") or p.is_partial("min") for p in src):
            continue  # from_local has no gradient for max/min partials (it raises; tested below)
        local = local_piece(full, mesh, src).requires_grad_()
        x = DTensor.from_local(local, mesh, src, shape=full.shape)
        y = x.redistribute(mesh, dst)
        (y.full_tensor() * weight).sum().backward()
        expected = expected_local_grad(weight, mesh, src)
        torch.testing.assert_close(local.grad, expected, msg=f"grad of {src} -> {dst}")


class RedistributeTest(DTensorTestBase):
    world_size = 4

    @with_comms
    def test_every_transition_1d(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        for shape, dtype in itertools.product([*SHAPES, (3, 2)], DTYPES):
            combos = layouts(1, dtype)
            check_values(mesh, itertools.product(combos, combos), shape, dtype)

    @with_comms
    def test_every_transition_2d(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        for shape, dtype in itertools.product(SHAPES, DTYPES):
            combos = layouts(2, dtype)
            check_values(mesh, itertools.product(combos, combos), shape, dtype)

    @with_comms
    def test_gradients_1d(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        combos = layouts(1, torch.float64)
        for shape in SHAPES:
            check_grads(mesh, itertools.product(combos, combos), shape)

    @with_comms
    def test_gradients_2d_sample(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        combos = layouts(2, torch.float64)
        pairs = random.Random(2).sample(list(itertools.product(combos, combos)), 300)
        for shape in SHAPES:
            check_grads(mesh, pairs, shape)

    @with_comms
    def test_single_dim_transitions_use_one_collective(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        full = torch.randn(8, 6)
        expected = {
            (Shard(0), Replicate()): {"all_gather": 1},
            (Partial(), Replicate()): {"all_reduce": 1},
            (Partial(), Shard(1)): {"reduce_scatter": 1},
            (Shard(0), Shard(1)): {"all_to_all": 1},
            (Replicate(), Shard(0)): {},
            (Replicate(), Partial()): {},
            (Partial("max"), Replicate()): {"all_reduce": 1},
        }
        for (src, dst), counts in expected.items():
            x = make_dtensor(full, mesh, [src])
            with CommDebugMode() as comm:
                x.redistribute(mesh, [dst])
            self.assertEqual(comm.get_comm_counts(), counts, f"{src} -> {dst}")

    @with_comms
    def test_backward_of_gather_is_reduce_scatter_for_partial_grads(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        full = torch.randn(8, 6)
        x = distribute_tensor(full, mesh, [Shard(0)]).requires_grad_()
        # Each rank weighs the gathered tensor differently: the true gradient is the sum of weights.
        weights = [torch.full((8, 6), float(r + 1)) for r in range(4)]
        gathered = x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        loss = (gathered * weights[self.rank]).sum()
        with CommDebugMode() as comm:
            loss.backward()
        self.assertEqual(comm.get_comm_counts(), {"reduce_scatter": 1})
        self.assertEqual(x.grad.placements, (Shard(0),))
        torch.testing.assert_close(x.grad.full_tensor(), sum(weights))

    @with_comms
    def test_backward_of_reduce_keeps_grad_replicated(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        local = seeded_randn(4, 3, seed=self.rank).requires_grad_()
        x = DTensor.from_local(local, mesh, [Partial()])
        y = x.redistribute(mesh, [Replicate()])
        y.to_local().sum().backward()
        # d(sum_r local_r)/d local_r is one on every rank
        torch.testing.assert_close(local.grad, torch.ones(4, 3))

    @with_comms
    def test_redistribute_to_same_placements_is_free(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        x = distribute_tensor(torch.randn(4, 4), mesh, [Shard(0), Shard(1)])
        with CommDebugMode() as comm:
            y = x.redistribute(mesh, [Shard(0), Shard(1)])
        self.assertIs(y, x)
        self.assertEqual(comm.get_total_counts(), 0)


class Redistribute3dTest(DTensorTestBase):
    world_size = 8

    @with_comms
    def test_sampled_transitions_3d(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2, 2))
        for shape, dtype in itertools.product([(8, 4), (7, 3)], DTYPES):
            combos = layouts(3, dtype)
            pairs = random.Random(3).sample(list(itertools.product(combos, combos)), 150)
            check_values(mesh, pairs, shape, dtype)

    @with_comms
    def test_gradients_3d_sample(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2, 2))
        combos = layouts(3, torch.float64)
        pairs = random.Random(4).sample(list(itertools.product(combos, combos)), 60)
        check_grads(mesh, pairs, (7, 3))

    @pytest.mark.slow
    @with_comms
    def test_every_transition_3d(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2, 2))
        for shape, dtype in itertools.product([(8, 4), (7, 3)], DTYPES):
            combos = layouts(3, dtype)
            check_values(mesh, itertools.product(combos, combos), shape, dtype)


def test_plans_print_one_step_per_line() -> None:
    plan = plan_redistribute((Shard(0), Partial()), (Replicate(), Shard(1)))
    text = "\n".join(str(step) for step in plan)
    assert text == (
        "mesh dim 1: P(sum) -> S(1)  reduce_scatter(sum, dim=1)\n"
        "mesh dim 0: S(0) -> R  all_gather(dim=0)"
    )


def test_nested_shards_are_unsharded_innermost_first() -> None:
    plan = plan_redistribute((Shard(0), Shard(0)), (Replicate(), Shard(0)))
    assert [(s.mesh_dim, str(s.src), str(s.dst)) for s in plan] == [
        (1, "S(0)", "R"),
        (0, "S(0)", "R"),
        (1, "R", "S(0)"),
    ]


class RedistributeTrafficTest(DTensorTestBase):
    @with_comms
    def test_two_partials_to_replicate_move_less_than_two_all_reduces(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        full = seeded_randn(128, 128)  # 64 KiB: worth scattering
        x = make_dtensor(full, mesh, [Partial(), Partial()])
        with CommDebugMode() as comm:
            y = x.redistribute(mesh, [Replicate(), Replicate()])
        torch.testing.assert_close(y.to_local(), full)
        self.assertEqual(comm.get_comm_counts(), {"reduce_scatter": 1, "all_reduce": 1, "all_gather": 1})
        nbytes = full.numel() * 4
        # ring accounting over 2 ranks: an all_reduce of B moves B; scatter and gather move B/2 each
        self.assertEqual(comm.get_total_bytes(), nbytes // 2 + nbytes // 2 + nbytes // 2)
        self.assertLess(comm.get_total_bytes(), 2 * nbytes)
