"""Lookups (isin, bucketize, searchsorted, histc), renorm, _chunk_cat, bilinear, zero_ and the ops
that need whole inputs (equal, allclose, block_diag) on DTensors equal plain torch, and keep
shards where each element is looked up or computed on its own."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from spmd.tensor import DTensor, Partial, Replicate, Shard, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.testing import DTensorTestBase, check_against_torch, seeded_randn, with_comms
from spmd.testing.layouts import make_dtensor

R, S0, S1 = Replicate(), Shard(0), Shard(1)
SUM, MAX = Partial("sum"), Partial("max")


randn = functools.partial(seeded_randn, dtype=torch.float64)


class SearchTest(DTensorTestBase):
    @with_comms
    def test_lookups_keep_the_searched_tensors_shards(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x = (randn(7, 5) * 3).round()  # 7 -> 2, 2, 2, 1; 5 -> 2, 2, 1, 0 (an empty piece)
        boundaries = torch.tensor([-2.0, 0.0, 1.5, 3.0], dtype=torch.float64)
        rows = torch.sort(randn(7, 6, seed=1), dim=-1).values
        bounds = make_dtensor(boundaries, mesh, [R])
        for layout in (S0, S1):
            d = make_dtensor(x, mesh, [layout])
            cases = {
                "isin": (lambda d=d: torch.isin(d, bounds), torch.isin(x, boundaries)),
                "bucketize": (
                    lambda d=d: torch.bucketize(d, bounds, right=True),
                    torch.bucketize(x, boundaries, right=True),
                ),
                "searchsorted 1-d": (lambda d=d: torch.searchsorted(bounds, d), torch.searchsorted(boundaries, x)),
            }
            for name, (run, expected) in cases.items():
                with self.subTest(op=name, layout=layout), CommDebugMode() as comm:
                    out = run()
                self.assertEqual((comm.get_total_counts(), out.placements), (0, (layout,)))
                torch.testing.assert_close(out.full_tensor(), expected)
        # one sorted row per leading index: rows and queries share the row shard
        with CommDebugMode() as comm:
            out = torch.searchsorted(make_dtensor(rows, mesh, [S0]), make_dtensor(x, mesh, [S0]))
        self.assertEqual((comm.get_total_counts(), out.placements), (0, (S0,)))
        torch.testing.assert_close(out.full_tensor(), torch.searchsorted(rows, x))

    @with_comms
    def test_histc_counts_each_piece_and_sums(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x = randn(7, 5)
        d = make_dtensor(x, mesh, [S1])
        with CommDebugMode() as comm:
            out = torch.histc(d, bins=6, min=-2, max=2)
        self.assertEqual((comm.get_total_counts(), out.placements), (0, (SUM,)))
        torch.testing.assert_close(out.full_tensor(), torch.histc(x, bins=6, min=-2, max=2))
        # without a range, the data's own min and max set the bins: the tensor is gathered
        torch.testing.assert_close(torch.histc(d, bins=4).full_tensor(), torch.histc(x, bins=4))


class ShardedRowsTest(DTensorTestBase):
    @with_comms
    def test_renorm_keeps_the_shard_of_its_dim(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x = randn(7, 5, 3).requires_grad_()
        out = check_against_torch(
            lambda t: torch.renorm(t, 2, 1, 1.0), x, placements=[[S1]], mesh=mesh, collectives=0
        )
        self.assertEqual(out.placements, (S1,))

    @with_comms
    def test_chunk_cat_keeps_leading_shards(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        a, b = randn(8, 3, 5), randn(8, 4, 5, seed=1)  # the kernel rejects an empty piece: 8 rows, 2 each
        with CommDebugMode() as comm:
            out = torch.ops.aten._chunk_cat([make_dtensor(a, mesh, [S0]), make_dtensor(b, mesh, [S0])], 1, 2)
        self.assertEqual((comm.get_total_counts(), out.placements), (0, (S0,)))
        torch.testing.assert_close(out.full_tensor(), torch.ops.aten._chunk_cat([a, b], 1, 2))

    @with_comms
    def test_bilinear_as_an_einsum(self) -> None:
        """Batch shards on both inputs -> S(0); the weight's output features S(0) -> S(1)."""
        mesh = init_device_mesh("cpu", (4,))
        x1, x2, weight, bias = randn(7, 3), randn(7, 4, seed=1), randn(5, 3, 4, seed=2), randn(5, seed=3)
        for layouts, placement in [(([S0], [S0], [R], [R]), S0), (([R], [R], [S0], [S0]), S1)]:
            with self.subTest(layouts=layouts):
                tensors = [make_dtensor(t, mesh, p) for t, p in zip((x1, x2, weight, bias), layouts)]
                with CommDebugMode() as comm:
                    out = F.bilinear(*tensors)
                self.assertEqual((comm.get_total_counts(), out.placements), (0, (placement,)))
                torch.testing.assert_close(out.full_tensor(), F.bilinear(x1, x2, weight, bias))

    @with_comms
    def test_zero_keeps_every_placement(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        for layout in (S0, S1, SUM, MAX):
            d = make_dtensor(randn(7, 5), mesh, [layout])
            with CommDebugMode() as comm:
                d.zero_()
            self.assertEqual((comm.get_total_counts(), d.placements), (0, (layout,)))
            torch.testing.assert_close(d.full_tensor(), torch.zeros(7, 5, dtype=torch.float64))


class WholeInputsTest(DTensorTestBase):
    @with_comms
    def test_equal_and_allclose_agree_on_every_rank(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x = randn(7, 5)
        y = x.clone()
        y[6, 4] += 1e-3  # a difference only the last rank's piece holds
        a, b = make_dtensor(x, mesh, [S0]), make_dtensor(y, mesh, [S0])
        self.assertFalse(torch.equal(a, b))
        self.assertTrue(torch.equal(a, make_dtensor(x, mesh, [S1])))
        self.assertFalse(torch.allclose(a, b))
        self.assertTrue(torch.allclose(a, b, atol=1e-2))

    @with_comms
    def test_block_diag(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        parts = [randn(2, 3), randn(3, 1, seed=1), randn(1, 4, seed=2)]
        out = torch.block_diag(*(make_dtensor(p, mesh, [S0]) for p in parts))
        self.assertIsInstance(out, DTensor)
        torch.testing.assert_close(out.full_tensor(), torch.block_diag(*parts))
