"""Ops where PyTorch's own DTensor tests pin a behaviour: values equal plain torch, and the
placements and collectives are torch's (never more traffic)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from spmd.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.tensor.random import manual_seed
from spmd.testing import DTensorTestBase, run_threaded, seeded_randn, with_comms
from spmd.testing.layouts import make_dtensor

R, S0, S1, S2 = Replicate(), Shard(0), Shard(1), Shard(2)
SUM, AVG, MAX, MIN = Partial("sum"), Partial("avg"), Partial("max"), Partial("min")


class FillOfAPartialTest(DTensorTestBase):
    @with_comms
    def test_fill_in_place_of_a_pending_sum_equals_one_device_fill_without_traffic(self) -> None:
        """fill_ keeps self's P(sum) and the sum is the fill value (not world_size times it)."""
        mesh = init_device_mesh("cpu", (4,))
        for value in (8.0, torch.tensor(-2.5)):
            x = make_dtensor(seeded_randn(4, 8), mesh, [SUM])
            with CommDebugMode() as comm:
                returned = torch.fill_(x, value)
            self.assertIs(returned, x)
            self.assertEqual((comm.get_total_counts(), x.placements), (0, (SUM,)))
            torch.testing.assert_close(x.full_tensor(), torch.full((4, 8), float(value)))

    @with_comms
    def test_fill_in_place_on_a_2d_mesh(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        for layout in ([SUM, SUM], [SUM, S1], [MAX, SUM], [AVG, S0], [S0, MIN]):
            x = make_dtensor(seeded_randn(4, 6), mesh, layout)
            with CommDebugMode() as comm:
                x.fill_(3.0)
            self.assertEqual((comm.get_total_counts(), x.placements), (0, tuple(layout)))
            torch.testing.assert_close(x.full_tensor(), torch.full((4, 6), 3.0))

    @with_comms
    def test_fill_out_of_place_of_a_pending_sum_is_replicated_without_traffic(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x = make_dtensor(seeded_randn(4, 8), mesh, [SUM])
        with CommDebugMode() as comm:
            out = torch.ops.aten.fill.Scalar(x, 1.5)
        self.assertEqual((comm.get_total_counts(), out.placements), (0, (R,)))
        torch.testing.assert_close(out.full_tensor(), torch.full((4, 8), 1.5))


class InPlacePlacementChangeTest(DTensorTestBase):
    @with_comms
    def test_in_place_op_that_would_change_self_placement_raises_torch_error(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x = DTensor.from_local(torch.tensor(64.0), mesh, [SUM])
        with self.assertRaisesRegex(RuntimeError, "in-place operations that require placement changes are not supported"):
            x.clamp_(max=10)
        self.assertEqual(x.placements, (SUM,))
        torch.testing.assert_close(x.full_tensor(), torch.tensor(256.0))  # untouched
        torch.testing.assert_close(x.clamp(max=10).full_tensor(), torch.tensor(10.0))


class PartialPointwiseTest(DTensorTestBase):
    @with_comms
    def test_sum_partial_times_sum_partial_is_one_all_reduce(self) -> None:
        """P * P: one operand is all-reduced, the other stays partial (P x R -> P), as in torch."""
        mesh = init_device_mesh("cpu", (4,))
        a, b = seeded_randn(6, 4, seed=1), seeded_randn(6, 4, seed=2)
        x, y = make_dtensor(a, mesh, [SUM]), make_dtensor(b, mesh, [SUM])
        with CommDebugMode() as comm:
            z = x * y
        self.assertEqual(comm.get_comm_counts(), {"all_reduce": 1})
        self.assertEqual(z.placements, (SUM,))
        torch.testing.assert_close(z.full_tensor(), a * b)

    @with_comms
    def test_max_partial_times_replicate_is_reduced_to_replicate(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        a, b = seeded_randn(8, 8, seed=1), seeded_randn(8, 8, seed=2)
        x, y = make_dtensor(a, mesh, [MAX]), distribute_tensor(b, mesh, [R])
        with CommDebugMode() as comm:
            z = x * y
        self.assertEqual((comm.get_comm_counts(), z.placements), ({"all_reduce": 1}, (R,)))
        torch.testing.assert_close(z.full_tensor(), a * b)

    @with_comms
    def test_a_partial_next_to_a_shard_is_reduce_scattered(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        a, b = seeded_randn(8, 8, seed=1), seeded_randn(8, 8, seed=2)
        x, y = make_dtensor(a, mesh, [SUM]), distribute_tensor(b, mesh, [S0])
        with CommDebugMode() as comm:
            z = x * y
        self.assertEqual((comm.get_comm_counts(), z.placements), ({"reduce_scatter": 1}, (S0,)))
        torch.testing.assert_close(z.full_tensor(), a * b)

    @with_comms
    def test_maximum_and_minimum_keep_max_and_min_partials(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        a, b = seeded_randn(8, 8, seed=1), seeded_randn(8, 8, seed=2)
        for op, kept in [(torch.maximum, MAX), (torch.minimum, MIN)]:
            for left, right in [(kept, kept), (MAX, R), (R, MIN), (MIN, R)]:
                x, y = make_dtensor(a, mesh, [left]), make_dtensor(b, mesh, [right])
                with CommDebugMode() as comm:
                    z = op(x, y)
                self.assertEqual(comm.get_total_counts(), 0, (op, left, right))
                self.assertEqual(z.placements, (left if left != R else right,))
                torch.testing.assert_close(z.full_tensor(), op(a, b))
        x, y = make_dtensor(a, mesh, [MIN]), make_dtensor(b, mesh, [MIN])
        with CommDebugMode() as comm:
            z = torch.maximum(x, y)  # one operand reduced: maximum(P(min), R) is still a min-partial
        self.assertEqual((comm.get_comm_counts(), z.placements), ({"all_reduce": 1}, (MIN,)))
        torch.testing.assert_close(z.full_tensor(), torch.maximum(a, b))


class LinearTest(DTensorTestBase):
    @with_comms
    def test_aten_linear_keeps_shards_without_traffic(self) -> None:
        """Under inference mode F.linear reaches DTensor as aten.linear: it needs a rule, not a gather."""
        mesh = init_device_mesh("cpu", (4,))
        x_full, w_full, b_full = seeded_randn(2, 6, 16, seed=1), seeded_randn(8, 16, seed=2), seeded_randn(8, seed=3)
        for x_layout, w_layout, b_layout, expected in [
            (R, S0, S0, S2),  # column-wise: out features sharded
            (R, S0, None, S2),
            (S0, R, R, S0),  # batch sharded
            (S1, R, None, S1),
            (S2, S1, R, SUM),  # row-wise: the contraction is sharded, the bias is added once
        ]:
            x, w = distribute_tensor(x_full, mesh, [x_layout]), distribute_tensor(w_full, mesh, [w_layout])
            b = None if b_layout is None else distribute_tensor(b_full, mesh, [b_layout])
            with torch.inference_mode(), CommDebugMode() as comm:
                out = torch.nn.functional.linear(x, w, b)
            self.assertEqual((comm.get_total_counts(), out.placements), (0, (expected,)))
            reference = torch.nn.functional.linear(x_full, w_full, None if b is None else b_full)
            torch.testing.assert_close(out.full_tensor(), reference)

    @with_comms
    def test_aten_linear_on_a_2d_mesh(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        x_full, w_full, b_full = seeded_randn(4, 6, 8, seed=1), seeded_randn(10, 8, seed=2), seeded_randn(10, seed=3)
        x = distribute_tensor(x_full, mesh, [S0, R])
        w = distribute_tensor(w_full, mesh, [R, S0])
        b = distribute_tensor(b_full, mesh, [R, S0])
        with torch.inference_mode(), CommDebugMode() as comm:
            out = torch.nn.functional.linear(x, w, b)
        self.assertEqual((comm.get_total_counts(), out.placements), (0, (S0, S2)))
        torch.testing.assert_close(out.full_tensor(), torch.nn.functional.linear(x_full, w_full, b_full))


def _multinomial_draws(
    seed: int, probs: torch.Tensor, layouts: list[list[Placement]], num_samples: int, replacement: bool
) -> list[Any]:
    """On every rank: seed, then sample ``probs`` laid out as each layout in turn."""
    mesh = init_device_mesh("cpu", (4,) if len(layouts[0]) == 1 else (2, 2))
    manual_seed(seed, mesh)
    results = []
    for layout in layouts:
        p = distribute_tensor(probs, mesh, layout)
        with CommDebugMode() as comm:
            samples = torch.multinomial(p, num_samples, replacement=replacement)
        results.append((samples.placements, comm.get_comm_counts(), samples.full_tensor()))
    return results


def test_multinomial_equals_one_device_and_keeps_row_shards() -> None:
    """Each rank samples its rows with the random stream one device uses: the samples are one device's."""
    probs = torch.rand(9, 6, generator=torch.Generator().manual_seed(0)) + 0.01
    probs[2, :3] = 0.0
    layouts: list[list[Placement]] = [[S0], [R], [S1], [S0]]
    for num_samples, replacement in [(1, False), (3, False), (1, True), (5, True)]:
        per_rank = run_threaded(_multinomial_draws, 4, 7, probs, layouts, num_samples, replacement)
        generator = torch.Generator().manual_seed(7)
        expected = [torch.multinomial(probs, num_samples, replacement, generator=generator) for _ in layouts]
        for results in per_rank:
            placements = [r[0] for r in results]
            assert placements == [(S0,), (R,), (R,), (S0,)]
            assert [r[1] for r in results] == [{}, {}, {"all_gather": 1}, {}]
            for (_, _, got), want in zip(results, expected):
                assert torch.equal(got, want), (num_samples, replacement)


def test_multinomial_of_a_vector_and_on_a_2d_mesh() -> None:
    probs = torch.rand(8, 5, generator=torch.Generator().manual_seed(1))
    for layouts in ([[S0, R], [S0, S0], [R, S0]], [[R, R]]):
        per_rank = run_threaded(_multinomial_draws, 4, 3, probs, layouts, 2, True)
        generator = torch.Generator().manual_seed(3)
        expected = [torch.multinomial(probs, 2, True, generator=generator) for _ in layouts]
        for results in per_rank:
            for (placements, counts, got), want in zip(results, expected):
                assert counts == {}
                assert torch.equal(got, want), placements
    vector = probs[0]
    per_rank = run_threaded(_multinomial_draws, 4, 5, vector, [[S0], [R]], 3, False)
    generator = torch.Generator().manual_seed(5)
    expected = [torch.multinomial(vector, 3, False, generator=generator) for _ in range(2)]
    for results in per_rank:
        assert [r[0] for r in results] == [(R,), (R,)]
        for (_, _, got), want in zip(results, expected):
            assert torch.equal(got, want)


def test_multinomial_rejects_invalid_probabilities() -> None:
    probs = torch.rand(8, 4)
    probs[5, 1] = -1.0
    with pytest.raises(RuntimeError, match="element < 0"):
        run_threaded(_multinomial_draws, 4, 0, probs, [[S0]], 1, False)


class EqualAndSameSizeTest(DTensorTestBase):
    @with_comms
    def test_is_same_size_reads_global_shapes_even_of_a_plain_tensor(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        sharded = DTensor.from_local(torch.ones(4, 4), mesh, [S0])  # global 16 x 4
        replicated = distribute_tensor(torch.ones(16, 4), mesh, [R])
        wider = distribute_tensor(torch.ones(16, 5), mesh, [S1])
        with CommDebugMode() as comm:
            answers = [
                sharded.is_same_size(replicated),
                torch.ones(4, 4).is_same_size(sharded),
                sharded.is_same_size(torch.ones(16, 4)),
                replicated.is_same_size(wider),
            ]
        self.assertEqual(answers, [True, False, True, False])
        self.assertEqual(comm.get_total_counts(), 0)

    @with_comms
    def test_equal_compares_shards_where_they_lie(self) -> None:
        """equal of sharded operands: one all_reduce of a flag (torch's traffic), not a gather of both."""
        mesh = init_device_mesh("cpu", (4,))
        full = torch.arange(48.0).reshape(8, 6)  # whole numbers: a partial's pieces add up exactly
        other = full.clone()
        other[7, 5] += 1.0  # differs on the last rank's rows only
        for left, right in [(S0, S0), (S0, R), (R, S1), (SUM, S0)]:
            x = make_dtensor(full, mesh, [left])
            with CommDebugMode() as comm:
                same = x.equal(make_dtensor(full.clone(), mesh, [right]))
            self.assertTrue(same)
            self.assertLessEqual(comm.get_comm_counts().get("all_reduce", 0), 1 + (left == SUM))
            self.assertNotIn("all_gather", comm.get_comm_counts())
            self.assertFalse(x.equal(make_dtensor(other, mesh, [right])))
        x, shorter = make_dtensor(full, mesh, [S0]), distribute_tensor(full[:4], mesh, [S0])
        with CommDebugMode() as comm:
            same = x.equal(shorter)
        self.assertEqual((same, comm.get_total_counts()), (False, 0))
        nan = torch.full((4, 4), float("nan"))
        self.assertFalse(distribute_tensor(nan, mesh, [S0]).equal(distribute_tensor(nan, mesh, [S0])))
        self.assertTrue(distribute_tensor(full, mesh, [R]).equal(distribute_tensor(full, mesh, [R])))
