"""View and shape ops on DTensors: results and gradients equal plain torch; shards survive where they can."""

from __future__ import annotations

import functools
import itertools

import torch

from spmd.tensor import Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.tensor.placement import Placement
from spmd.testing import DTensorTestBase, check_against_torch, run_threaded, seeded_randn, with_comms
from spmd.testing.layouts import make_dtensor

R = Replicate()


randn = functools.partial(seeded_randn, dtype=torch.float64)


def layouts_for(mesh_ndim: int, tensor_ndim: int) -> list[tuple[Placement, ...]]:
    options = [R, *(Shard(d) for d in range(tensor_ndim))]
    return list(itertools.product(options, repeat=mesh_ndim))


MESHES = [(4,), (2, 2)]


class ViewTest(DTensorTestBase):
    @with_comms
    def test_view_reshape_flatten_unflatten_match_torch(self) -> None:
        cases = [
            ((8, 6), lambda x: x.view(4, 2, 6)),
            ((8, 6), lambda x: x.reshape(-1)),
            ((8, 3, 2), lambda x: x.flatten(0, 1)),
            ((8, 3, 2), lambda x: x.flatten(1)),
            ((8, 6), lambda x: x.unflatten(1, (2, 3))),
            ((7, 6), lambda x: x.view(7, 3, 2)),
            ((7, 6), lambda x: x.reshape(42)),
            ((6, 4), lambda x: x.view(4, 6)),
            ((5, 1, 4), lambda x: x.view(5, 4, 1)),
            ((4, 6), lambda x: x.t().reshape(-1)),  # not contiguous: clone + _unsafe_view
        ]

        def one(mesh_shape, case) -> None:
            mesh = init_device_mesh("cpu", mesh_shape)
            shape, fn = case
            for layout in layouts_for(mesh.ndim, len(shape)):
                check_against_torch(fn, randn(*shape).requires_grad_(), placements=[layout], mesh=mesh)

        self.run_subtests({"mesh_shape": MESHES, "case": cases}, one)

    @with_comms
    def test_view_keeps_shards_only_where_blocks_stay_contiguous(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        cases = [
            # (shape, input layout, view, output layout kept without communication; None: data must move)
            ((8, 6), Shard(0), (48,), Shard(0)),  # first of a merged group, 8 % 4 == 0
            ((7, 6), Shard(0), (42,), None),  # uneven pieces are not contiguous chunks of 42
            ((8, 6), Shard(1), (48,), None),  # inner dim of a merged group
            ((16,), Shard(0), (4, 4), Shard(0)),  # split: the outer piece keeps the shard
            ((16,), Shard(0), (2, 8), None),  # outer piece 2 does not divide by 4
            ((8, 12), Shard(1), (8, 4, 3), Shard(1)),
            ((7, 6), Shard(0), (7, 2, 3), Shard(0)),  # surviving dim, uneven is fine
            ((6, 8), Shard(1), (3, 2, 8), Shard(2)),
            ((8, 6), Shard(0), (4, 12), Shard(0)),  # regroup: 8 and 4 both divide by 4
        ]
        for shape, placement, size, expected in cases:
            full = randn(*shape)
            x = distribute_tensor(full, mesh, [placement])
            with CommDebugMode() as comm:
                out = x.view(size)
            what = f"{shape} {placement} -> {size}"
            if expected is None:
                self.assertGreater(comm.get_total_counts(), 0, what)
            else:
                self.assertEqual(comm.get_total_counts(), 0, what)
                self.assertEqual(out.placements, (expected,), what)
                torch.testing.assert_close(out.to_local(), full.view(size).chunk(4, expected.dim)[self.rank])
            torch.testing.assert_close(out.full_tensor(), full.view(size))

    @with_comms
    def test_partials_pass_through_views_without_communication(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        ops = [
            lambda x: x.view(4, 2, 6),
            lambda x: x.flatten(),
            lambda x: x.permute(1, 0),
            lambda x: x.unsqueeze(0).squeeze(0),
            lambda x: x.t(),
            lambda x: x[:, 2:5],
        ]

        def one(op, reduce_op, other) -> None:
            full = randn(8, 6)
            layout = (Partial(reduce_op), other)
            x = make_dtensor(full, mesh, layout)
            with CommDebugMode() as comm:
                out = op(x)
            self.assertEqual(comm.get_total_counts(), 0)
            self.assertEqual(out.placements[0], Partial(reduce_op))
            torch.testing.assert_close(out.full_tensor(), op(full))
            check_against_torch(op, full.requires_grad_(), placements=[layout], mesh=mesh)

        self.run_subtests({"op": ops, "reduce_op": ["sum", "avg", "max"], "other": [R, Shard(0)]}, one)

    @with_comms
    def test_squeeze_never_drops_a_one_long_local_piece(self) -> None:
        cases = [
            ((5, 1, 3), lambda x: x.squeeze()),  # 5 rows over 4: one rank holds a single row
            ((5, 1, 3), lambda x: x.squeeze(1)),
            ((8, 1, 3), lambda x: x.squeeze()),
            ((5, 1, 3), lambda x: x.squeeze(0)),  # size 5: a no-op globally
            ((2, 1, 3), lambda x: x.squeeze((0, 1))),
            ((5, 3), lambda x: x.unsqueeze(1)),
            ((5, 3), lambda x: x.unsqueeze(-1)),
        ]

        def one(mesh_shape, case) -> None:
            mesh = init_device_mesh("cpu", mesh_shape)
            shape, fn = case
            for layout in layouts_for(mesh.ndim, len(shape)):
                check_against_torch(fn, randn(*shape).requires_grad_(), placements=[layout], mesh=mesh)

        self.run_subtests({"mesh_shape": MESHES, "case": cases}, one)
        mesh = init_device_mesh("cpu", (4,))
        kept = distribute_tensor(randn(5, 1, 3), mesh, [Shard(0)]).squeeze(1)
        self.assertEqual(kept.placements, (Shard(0),))
        self.assertEqual(distribute_tensor(randn(8, 1, 3), mesh, [Shard(0)]).squeeze().placements, (Shard(0),))


class ShapeOpsTest(DTensorTestBase):
    def sweep(self, cases) -> None:
        def one(mesh_shape, case) -> None:
            mesh = init_device_mesh("cpu", mesh_shape)
            shapes, fn = case
            for layout in layouts_for(mesh.ndim, len(shapes[0])):
                check_against_torch(fn, *[randn(*s, seed=i).requires_grad_() for i, s in enumerate(shapes)], placements=[layout] * len(shapes), mesh=mesh)

        self.run_subtests({"mesh_shape": MESHES, "case": cases}, one)

    @with_comms
    def test_permute_flip_roll_repeat_expand(self) -> None:
        self.sweep([
            ([(5, 3, 2)], lambda x: x.permute(2, 0, 1)),
            ([(5, 3, 2)], lambda x: x.movedim(0, -1)),
            ([(5, 6)], lambda x: x.flip(0)),
            ([(5, 6)], lambda x: x.flip(0, 1)),
            ([(5, 6)], lambda x: x.roll(2, 1)),
            ([(5, 6)], lambda x: x.roll((1, -2), (0, 1))),
            ([(5, 6)], lambda x: x.roll(3)),  # no dims: the flattened tensor rolls
            ([(5, 6)], lambda x: x.repeat(1, 2)),
            ([(5, 6)], lambda x: x.repeat(2, 1, 3)),
            ([(5, 1)], lambda x: x.expand(2, 5, 3)),
        ])

    @with_comms
    def test_split_chunk_unbind(self) -> None:
        self.sweep([
            ([(7, 6)], lambda x: x.split(2, 1)),
            ([(7, 6)], lambda x: x.split([3, 4], 0)),
            ([(7, 6)], lambda x: x.chunk(3, 0)),
            # unbind refuses a sharded unbind dim (as torch does; test_torch_peer_tensor_ops.py), so the
            # layout sweep runs unbind_copy, which moves the shard off the dim instead
            ([(7, 6)], lambda x: torch.unbind_copy(x, 0)),
            ([(7, 3)], lambda x: x.tensor_split(2, 1)),
        ])

    @with_comms
    def test_copy_variants_follow_their_views(self) -> None:
        self.sweep([
            ([(4, 6)], lambda x: torch.view_copy(x, (2, 2, 6))),
            ([(5, 1, 6)], lambda x: torch.squeeze_copy(x, 1)),
            ([(5, 6)], lambda x: torch.unsqueeze_copy(x, 1)),
            ([(5, 6, 2)], lambda x: torch.permute_copy(x, (2, 0, 1))),
            ([(7, 6)], lambda x: torch.split_with_sizes_copy(x, [2, 4], 1)),
            ([(7, 3)], lambda x: torch.unbind_copy(x, 1)),
            ([(7, 6)], lambda x: torch.narrow_copy(x, 1, 2, 3)),
            ([(7, 6)], lambda x: torch.narrow_copy(x, 1, 0, 6)),
            ([(7, 6)], lambda x: torch.t_copy(x)),
            ([(7, 6, 2)], lambda x: torch.transpose_copy(x, 0, 2)),
            ([(7, 6)], lambda x: torch.alias_copy(x)),
            ([(7, 1)], lambda x: torch.expand_copy(x, (2, 7, 3))),
        ])

    @with_comms
    def test_unfold_keeps_the_other_dims_sharded(self) -> None:
        self.sweep([
            ([(7, 6)], lambda x: x.unfold(1, 2, 2)),
            ([(7, 6)], lambda x: x.unfold(0, 3, 1)),
            ([(5, 6, 4)], lambda x: torch.unfold_copy(x, 2, 3, 1)),
        ])

    @with_comms
    def test_diagonal_and_its_backward(self) -> None:
        self.sweep([
            ([(5, 6, 4)], lambda x: x.diagonal()),
            ([(5, 6, 4)], lambda x: torch.diagonal_copy(x, 1, 0, 2)),
            ([(5, 6, 4)], lambda x: x.diagonal(-1, 2, 1)),
        ])
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(randn(5, 6, 8), mesh, [Shard(2)]).requires_grad_()
        with CommDebugMode() as comm:
            out = x.diagonal(0, 0, 1)  # [8, 5]: the kept dim 2 leads and keeps its shard
            out.to_local().sum().backward()
        self.assertEqual(comm.get_total_counts(), 0)
        self.assertEqual((out.placements, x.grad.placements), ((Shard(0),), (Shard(2),)))

    @with_comms
    def test_cat_and_stack(self) -> None:
        self.sweep([
            ([(5, 3), (5, 3)], lambda x, y: torch.cat([x, y], 0)),
            ([(5, 3), (5, 3)], lambda x, y: torch.cat([x, y * 2], 1)),
            ([(5, 3), (5, 3)], lambda x, y: torch.stack([x, y], 0)),
            ([(5, 3), (5, 3)], lambda x, y: torch.stack([x, y], -1)),
        ])

        def mixed(mesh_shape) -> None:  # inputs laid out differently
            mesh = init_device_mesh("cpu", mesh_shape)
            for a, b in itertools.product(layouts_for(mesh.ndim, 2), repeat=2):
                check_against_torch(lambda x, y: torch.cat([x, y], 1), randn(5, 3).requires_grad_(), randn(5, 2, seed=1).requires_grad_(), placements=[a, b], mesh=mesh)

        self.run_subtests({"mesh_shape": MESHES}, mixed)

    @with_comms
    def test_tril_triu_keep_shards_on_the_last_two_dims(self) -> None:
        cases = [
            ([(7, 6)], lambda x: x.tril()),
            ([(7, 6)], lambda x: x.tril(2)),
            ([(7, 6)], lambda x: x.triu(-1)),
            ([(2, 5, 6)], lambda x: x.triu(1)),
        ]
        self.sweep(cases)
        mesh = init_device_mesh("cpu", (2, 2))
        full = randn(7, 6)
        for layout in layouts_for(2, 2):
            x = distribute_tensor(full, mesh, layout)
            with CommDebugMode() as comm:
                lower, upper = x.tril(1), x.triu(-2)
            self.assertEqual(comm.get_total_counts(), 0)
            self.assertEqual((lower.placements, upper.placements), (layout, layout))
            torch.testing.assert_close(lower.full_tensor(), full.tril(1))
            torch.testing.assert_close(upper.full_tensor(), full.triu(-2))
        x = distribute_tensor(full.clone(), mesh, [Shard(0), Shard(1)])
        x.tril_(-1)
        torch.testing.assert_close(x.full_tensor(), full.tril(-1))

    @with_comms
    def test_split_along_another_dim_moves_no_data(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(randn(8, 6), mesh, [Shard(0)])
        with CommDebugMode() as comm:
            pieces = x.split(2, 1)
            joined = torch.cat(pieces, 1)
            stacked = torch.stack(pieces, 0)
        self.assertEqual(comm.get_total_counts(), 0)
        self.assertEqual(joined.placements, (Shard(0),))
        self.assertEqual(stacked.placements, (Shard(1),))
        torch.testing.assert_close(joined.full_tensor(), x.full_tensor())


class ThreeDMeshTest(DTensorTestBase):
    world_size = 8

    @with_comms
    def test_views_and_triangles_on_a_2x2x2_mesh(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2, 2))
        layouts = [(Shard(0), Shard(0), Shard(1)), (Shard(1), Shard(0), R), (Shard(0), Partial(), Shard(0))]
        ops = [
            lambda x: x.flatten(),
            lambda x: x.view(4, 2, 6),
            lambda x: x.tril(-1),
            lambda x: x.permute(1, 0).triu(),
            lambda x: torch.cat(x.split(4, 0)[::-1], 0),
        ]
        self.run_subtests(
            {"layout": layouts, "op": ops}, lambda layout, op: check_against_torch(op, randn(8, 6).requires_grad_(), placements=[layout], mesh=mesh)
        )
        x = distribute_tensor(randn(8, 6), mesh, [Shard(0), Shard(0), R])
        self.assertEqual(x.flatten().placements, (Shard(0), Shard(0), R))


def test_diagonal_keeps_shards_off_the_diagonal_dims_and_is_a_view() -> None:
    full = seeded_randn(4, 6, 5)

    def diagonals() -> tuple:
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(full, mesh, [Shard(0)])
        d = torch.diagonal(x, 0, 1, 2)
        assert d.placements == (Shard(0),)
        values = d.full_tensor()
        x.diagonal(dim1=1, dim2=2).fill_(7.0)  # writes land in x itself
        return values, x.full_tensor()

    expected_after = full.clone()
    expected_after.diagonal(dim1=1, dim2=2).fill_(7.0)
    for values, after in run_threaded(diagonals, 4):
        torch.testing.assert_close(values, torch.diagonal(full, 0, 1, 2))
        torch.testing.assert_close(after, expected_after)
