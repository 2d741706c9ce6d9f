"""Tensor, indexing and view ops whose behaviour PyTorch's own DTensor tests pin (test_tensor_ops.py,
test_view_ops.py): values equal plain torch, placements are torch's, and no more traffic than torch."""

from __future__ import annotations

import torch

from spmd.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.testing import DTensorTestBase, seeded_randint, seeded_randn, with_comms
from spmd.testing.layouts import make_dtensor

R, S0, S1 = Replicate(), Shard(0), Shard(1)
SUM, AVG, MAX, MIN = Partial("sum"), Partial("avg"), Partial("max"), Partial("min")


class GatherFromAShardedDimTest(DTensorTestBase):
    @with_comms
    def test_gather_along_the_sharded_dim_is_a_masked_local_gather_without_traffic(self) -> None:
        """Input S(dim), index replicated and 1 long on dim: each rank gathers what it holds -> P(sum)."""
        mesh = init_device_mesh("cpu", (4,))
        x = seeded_randn(12, 8, 16)
        cases = [((4, 1, 8), 8), ((12, 1, 16), 8), ((4, 1, 8), 3)]  # the last reads only rank 0 and 1
        for seed, (index_shape, high) in enumerate(cases):
            index = seeded_randint(high, *index_shape, seed=seed)
            x_dt = distribute_tensor(x, mesh, [S1])
            index_dt = distribute_tensor(index, mesh, [R])
            with CommDebugMode() as comm:
                out = torch.gather(x_dt, 1, index_dt)
            self.assertEqual((comm.get_total_counts(), out.placements), (0, (SUM,)))
            torch.testing.assert_close(out.full_tensor(), torch.gather(x, 1, index))

    @with_comms
    def test_masked_gather_with_uneven_and_empty_shards_and_its_gradient(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x = seeded_randn(5, 3)  # dim 1 of 3 over 4 ranks: the last rank holds nothing
        index = seeded_randint(3, 5, 1)
        x_dt = distribute_tensor(x, mesh, [S1]).requires_grad_()
        out = torch.gather(x_dt, 1, distribute_tensor(index, mesh, [R]))
        self.assertEqual(out.placements, (SUM,))
        torch.testing.assert_close(out.full_tensor(), torch.gather(x, 1, index))
        weight = seeded_randn(5, 1, seed=3)
        (out * distribute_tensor(weight, mesh, [R])).sum().backward()
        x_ref = x.clone().requires_grad_()
        (torch.gather(x_ref, 1, index) * weight).sum().backward()
        assert x_dt.grad is not None
        torch.testing.assert_close(x_dt.grad.full_tensor(), x_ref.grad)

    @with_comms
    def test_masked_gather_on_a_2d_mesh(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        x = seeded_randn(12, 8, 16)
        index = seeded_randint(8, 12, 1, 16, seed=4)
        index_dt = distribute_tensor(index, mesh, [R, R])
        for layout, expected in (([S1, S0], (SUM, S0)), ([S1, S1], (SUM, SUM)), ([S0, S1], (S0, SUM))):
            x_dt = distribute_tensor(x, mesh, layout)
            with CommDebugMode() as comm:
                out = torch.gather(x_dt, 1, index_dt)
            self.assertEqual((comm.get_total_counts(), out.placements), (0, expected))
            torch.testing.assert_close(out.full_tensor(), torch.gather(x, 1, index))

    @with_comms
    def test_masked_gather_raises_like_torch_for_an_index_out_of_range(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x_dt = distribute_tensor(seeded_randn(4, 8), mesh, [S1])
        bad = distribute_tensor(torch.full((4, 1), 8), mesh, [R])
        with self.assertRaisesRegex(RuntimeError, "index 8 is out of bounds for dimension 1 with size 8"):
            torch.gather(x_dt, 1, bad)

    @with_comms
    def test_gather_with_a_longer_index_still_gathers_the_input(self) -> None:
        """An index longer than 1 on the sharded dim: the input is made whole, as in torch."""
        mesh = init_device_mesh("cpu", (4,))
        x, index = seeded_randn(12, 8, 16), seeded_randint(8, 4, 3, 8)
        x_dt, index_dt = distribute_tensor(x, mesh, [S1]), distribute_tensor(index, mesh, [R])
        with CommDebugMode() as comm:
            out = torch.gather(x_dt, 1, index_dt)
        self.assertEqual((comm.get_comm_counts(), out.placements), ({"all_gather": 1}, (R,)))
        torch.testing.assert_close(out.full_tensor(), torch.gather(x, 1, index))


class IndexPutOfPartialsTest(DTensorTestBase):
    @with_comms
    def test_index_put_of_partials_stays_partial_written_or_added(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        values, position = seeded_randn(4, 8), [torch.tensor(1)]
        new_row = seeded_randn(8, seed=1)
        for partial in (SUM, AVG):
            self_dt, row_dt = make_dtensor(values, mesh, [partial]), make_dtensor(new_row, mesh, [partial])
            for accumulate in (True, False):
                with CommDebugMode() as comm:
                    out = torch.index_put(self_dt, position, row_dt, accumulate)
                self.assertEqual((comm.get_total_counts(), out.placements), (0, (partial,)))
                torch.testing.assert_close(out.full_tensor(), torch.index_put(values, position, new_row, accumulate))

    @with_comms
    def test_index_put_of_a_partial_with_replicated_values(self) -> None:
        """Replicated values become a partial piece without traffic; the sum is still right."""
        mesh = init_device_mesh("cpu", (4,))
        values, new_row, position = seeded_randn(4, 8), seeded_randn(8, seed=1), [torch.tensor(2)]
        for accumulate in (True, False):
            out = torch.index_put(make_dtensor(values, mesh, [SUM]), position, distribute_tensor(new_row, mesh, [R]), accumulate)
            torch.testing.assert_close(out.full_tensor(), torch.index_put(values, position, new_row, accumulate))


class NewTensorsKeepTheLayoutTest(DTensorTestBase):
    @with_comms
    def test_empty_like_and_new_empty_keep_a_partial_but_filled_ones_do_not(self) -> None:
        """Nothing is reduced from an unfilled tensor, so it keeps P for the write that fills it."""
        mesh = init_device_mesh("cpu", (4,))
        x = make_dtensor(seeded_randn(4, 8), mesh, [SUM])
        with CommDebugMode() as comm:
            unfilled = [torch.empty_like(x), x.new_empty((4, 8)), x.new_empty_strided((4, 8), (8, 1))]
            filled = [x.new_ones((4, 8)), x.new_zeros((4, 8)), x.new_full((4, 8), 2.0), torch.ones_like(x)]
            other_shape = x.new_empty((2, 8))
        self.assertEqual(comm.get_total_counts(), 0)
        self.assertEqual([t.placements for t in unfilled], [(SUM,)] * 3)
        self.assertEqual([t.placements for t in [*filled, other_shape]], [(R,)] * 5)
        torch.testing.assert_close(filled[2].full_tensor(), torch.full((4, 8), 2.0))
        filled_later = torch.empty_like(x).fill_(1.5)
        torch.testing.assert_close(filled_later.full_tensor(), torch.full((4, 8), 1.5))

    @with_comms
    def test_new_empty_strided_then_copy_of_a_partial_grad_moves_nothing(self) -> None:
        """Autograd's clone_obey_contract: new_empty_strided(param layout).copy_(grad)."""
        mesh = init_device_mesh("cpu", (4,))
        grad = seeded_randn(4, 8)
        grad_dt = make_dtensor(grad, mesh, [SUM])
        with CommDebugMode() as comm:
            copy = grad_dt.new_empty_strided((4, 8), (1, 4)).copy_(grad_dt)
        self.assertEqual((comm.get_total_counts(), copy.placements, copy.stride()), (0, (SUM,), (1, 4)))
        torch.testing.assert_close(copy.full_tensor(), grad)

    @with_comms
    def test_new_empty_strided_pieces_follow_the_requested_dim_order(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        cases = [
            ((12, 8), (8, 1), lambda rows, cols: (cols, 1)),  # even: torch's (12, 8 // 4) piece
            ((12, 8), (1, 12), lambda rows, cols: (1, rows)),  # column-major stays column-major on every rank
            ((12, 7), (7, 1), lambda rows, cols: (cols, 1)),  # uneven (2, 2, 2, 1 columns): S(1) kept, as in torch 2.13
        ]
        for shape, stride, local_stride in cases:
            x = distribute_tensor(seeded_randn(*shape), mesh, [S1])
            with CommDebugMode() as comm:
                out = x.new_empty_strided(shape, stride)
            self.assertEqual((comm.get_total_counts(), out.placements, out.stride()), (0, (S1,), stride))
            self.assertEqual(out.to_local().shape, x.to_local().shape)
            self.assertEqual(out.to_local().stride(), local_stride(*x.to_local().shape))
        other = distribute_tensor(seeded_randn(12, 8), mesh, [S1]).new_empty_strided((12, 4), (4, 1))
        self.assertEqual((other.placements, other.to_local().shape), ((R,), (12, 4)))

    @with_comms
    def test_copy_into_a_max_or_min_partial_keeps_it(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        src, dst = seeded_randn(64, 1), seeded_randn(4, 64, 8, seed=1)
        for partial in (MAX, MIN):
            dst_dt = make_dtensor(dst, mesh, [partial])
            with CommDebugMode() as comm:
                dst_dt.copy_(make_dtensor(src, mesh, [partial]))
            self.assertEqual((comm.get_total_counts(), dst_dt.placements), (0, (partial,)))
            torch.testing.assert_close(dst_dt.full_tensor(), dst.clone().copy_(src))


class UnbindTest(DTensorTestBase):
    @with_comms
    def test_unbind_keeps_the_other_shards_and_refuses_a_sharded_dim(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x = seeded_randn(4, 8)
        for shard_dim in (0, 1):
            x_dt = distribute_tensor(x, mesh, [Shard(shard_dim)])
            with self.assertRaisesRegex(RuntimeError, "Sharding propagation failed"):
                x_dt.unbind(shard_dim)
            other = 1 - shard_dim
            with CommDebugMode() as comm:
                pieces = x_dt.unbind(other)
            self.assertEqual(comm.get_total_counts(), 0)
            self.assertEqual({p.placements for p in pieces}, {(Shard(0),)})
            for piece, expected in zip(pieces, x.unbind(other)):
                torch.testing.assert_close(piece.full_tensor(), expected)
        with self.assertRaisesRegex(RuntimeError, "redistribute dim 0 to Replicate"):
            list(distribute_tensor(x, mesh, [S0]))  # iterating is unbind(0)
        copies = torch.unbind_copy(distribute_tensor(x, mesh, [S0]), 0)  # the copy moves the shard instead
        for piece, expected in zip(copies, x.unbind(0)):
            torch.testing.assert_close(piece.full_tensor(), expected)


class MetaInitTest(DTensorTestBase):
    @with_comms
    def test_to_empty_keeps_a_partial_buffer_made_on_meta(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        with torch.device("meta"):
            module = torch.nn.Module()
            module.register_buffer("scalar", torch.tensor(0.0))
            module._buffers["scalar"] = DTensor.from_local(module.scalar, mesh, [SUM])
        module.to_empty(device=None)  # stays on meta, as plain torch does
        self.assertEqual((module.scalar.placements, module.scalar.shape), ((SUM,), torch.Size([])))
        module.to_empty(device="cpu")
        self.assertEqual(module.scalar.placements, (SUM,))
        self.assertEqual(module.scalar.to_local().device, torch.device("cpu"))


class ViewOfAOneLongShardedDimTest(DTensorTestBase):
    @with_comms
    def test_view_keeps_a_sharded_one_long_dim_without_traffic(self) -> None:
        """A shard of a 1-long dim is everything on the first rank: it stays where it is, aliased."""
        mesh = init_device_mesh("cpu", (4,))
        for dim0 in (1, 5):
            x = seeded_randn(dim0, 2, 2, 2)
            x_dt = distribute_tensor(x, mesh, [S0])
            for shape in ((dim0, 2, 4), (dim0, 4, 2), (dim0, 8), (dim0, 2, 2, 2)):
                with CommDebugMode() as comm:
                    view = x_dt.view(shape)
                self.assertEqual((comm.get_total_counts(), view.placements), (0, (S0,)))
                self.assertEqual(view.to_local().data_ptr(), x_dt.to_local().data_ptr())
                torch.testing.assert_close(view.full_tensor(), x.view(shape))

    @with_comms
    def test_one_long_shard_moves_to_another_one_long_dim(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        x = seeded_randn(1, 4, 1, 6)
        for layout, shape, expected in (
            ([S0, Shard(2)], (4, 1, 6, 1), (S1, S1)),
            ([S0, S1], (1, 4, 6), (S0, S1)),
            ([Shard(2), Shard(3)], (4, 1, 6, 1), (S1, Shard(2))),
        ):
            x_dt = distribute_tensor(x, mesh, layout)
            with CommDebugMode() as comm:
                view = x_dt.view(shape)
            self.assertEqual((comm.get_total_counts(), view.placements), (0, expected))
            torch.testing.assert_close(view.full_tensor(), x.view(shape))
