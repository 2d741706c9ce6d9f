"""Indexing ops on DTensors: slice, select, index_select, advanced indexing, gather, scatter, where,
masked_fill; results and gradients equal plain torch, and lookups keep shards where they can."""

from __future__ import annotations

import functools
import itertools

import torch

from spmd.tensor import Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.tensor.placement import Placement
from spmd.testing import DTensorTestBase, check_against_torch, seeded_randint, seeded_randn, with_comms
from spmd.testing.layouts import make_dtensor

R = Replicate()
MESHES = [(4,), (2, 2)]


randn = functools.partial(seeded_randn, dtype=torch.float64)


def layouts_for(mesh_ndim: int, tensor_ndim: int, *, partial: bool = False) -> list[tuple[Placement, ...]]:
    options = [R, *(Shard(d) for d in range(tensor_ndim)), *((Partial(),) if partial else ())]
    return list(itertools.product(options, repeat=mesh_ndim))


def layout_tuples(mesh_ndim: int, tensor_ndim: int, count: int) -> list[tuple[tuple[Placement, ...], ...]]:
    """Layouts for ``count`` inputs: every input laid out alike, plus a fixed spread of mixed ones."""
    layouts = layouts_for(mesh_ndim, tensor_ndim)
    alike = [(layout,) * count for layout in layouts]
    mixed = list(itertools.product(layouts, repeat=count))
    return alike + mixed[:: max(1, len(mixed) // 24)]


class SliceSelectTest(DTensorTestBase):
    @with_comms
    def test_slice_narrow_select_forward_and_backward(self) -> None:
        ops = [
            lambda x: x[1:4],
            lambda x: x[:, 1:5:2],
            lambda x: x[:, -2:],
            lambda x: x[:],
            lambda x: x.narrow(1, 2, 3),
            lambda x: x[2],
            lambda x: x[:, -1],
            lambda x: x.select(1, 0),
            lambda x: x[..., None, 1:3],
        ]

        def one(mesh_shape, op) -> None:
            mesh = init_device_mesh("cpu", mesh_shape)
            for layout in layouts_for(mesh.ndim, 2, partial=True):
                check_against_torch(op, randn(7, 6).requires_grad_(), placements=[layout], mesh=mesh)

        self.run_subtests({"mesh_shape": MESHES, "op": ops}, one)

    @with_comms
    def test_slicing_another_dim_keeps_the_shard(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        full = randn(7, 6, 5)
        x = distribute_tensor(full, mesh, [Shard(0)])
        with CommDebugMode() as comm:
            sliced, picked, whole = x[:, 1:4], x[:, :, 2], x[0:7]
        self.assertEqual(comm.get_total_counts(), 0)
        self.assertEqual([t.placements for t in (sliced, picked, whole)], [(Shard(0),)] * 3)
        y = distribute_tensor(full, mesh, [Shard(2)])
        self.assertEqual(y[1].placements, (Shard(1),))  # select drops dim 0: the shard moves down
        torch.testing.assert_close(y[1].full_tensor(), full[1])
        torch.testing.assert_close(x[3].full_tensor(), full[3])


class LookupTest(DTensorTestBase):
    @with_comms
    def test_index_select_and_its_backward(self) -> None:
        def one(mesh_shape, dim) -> None:
            mesh = init_device_mesh("cpu", mesh_shape)
            index = torch.tensor([4, 0, 2, 2, 6, 1])
            full = randn(7, 6) if dim == 0 else randn(6, 7)
            for layout, index_layout in itertools.product(layouts_for(mesh.ndim, 2, partial=True),
                                                          layouts_for(mesh.ndim, 1)):
                check_against_torch(lambda x, i: x.index_select(dim, i), full.requires_grad_(), index, placements=[layout, index_layout], mesh=mesh)

        self.run_subtests({"mesh_shape": MESHES, "dim": [0, 1]}, one)

    @with_comms
    def test_sharded_index_gives_a_sharded_lookup_without_gathering_the_table(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        table_full, index_full = randn(10, 6), seeded_randint(10, 9)
        table = distribute_tensor(table_full, mesh, [R]).requires_grad_()
        index = distribute_tensor(index_full, mesh, [Shard(0)])
        with CommDebugMode() as comm:
            rows = table.index_select(0, index)
            embedded = table[index]
        self.assertEqual(comm.get_total_counts(), 0)
        self.assertEqual((rows.placements, embedded.placements), ((Shard(0),), (Shard(0),)))
        torch.testing.assert_close(rows.full_tensor(), table_full[index_full])
        torch.testing.assert_close(embedded.full_tensor(), table_full[index_full])
        with CommDebugMode() as comm:
            (rows.sum() + embedded.sum()).backward()
        # each rank adds its rows' gradient into a zero table: a pending sum, nothing moved yet
        self.assertEqual(comm.get_total_counts(), 0)
        self.assertEqual(table.grad.placements, (Partial(),))
        expected = torch.zeros(10, 6, dtype=torch.float64).index_add_(0, index_full, torch.ones(9, 6, dtype=torch.float64)) * 2
        torch.testing.assert_close(table.grad.full_tensor(), expected)

    @with_comms
    def test_advanced_indexing_forward_and_backward(self) -> None:
        i, j = torch.tensor([3, 0, 3, 1]), torch.tensor([2, 2, 0, 1])
        ops = [
            (lambda x, a: x[a], [i]),
            (lambda x, a: x[:, a], [j]),
            (lambda x, a, b: x[a, b], [i, j]),
            (lambda x, a, b: x[a, :, b], [i, j]),  # not adjacent: the index dims come first
            (lambda x, a: x[..., a], [j]),
            (lambda x, a: x[1:, a], [j]),
        ]

        def one(mesh_shape, case) -> None:
            mesh = init_device_mesh("cpu", mesh_shape)
            op, indices = case
            index_layouts = [(R,) * mesh.ndim, (Shard(0),) * mesh.ndim]
            for k, layout in enumerate(layouts_for(mesh.ndim, 3, partial=True)):
                index_layout = index_layouts[k % 2]  # alternate: both index layouts meet every kind of self
                check_against_torch(op, randn(5, 4, 3).requires_grad_(), *indices, placements=[layout, *([index_layout] * len(indices))], mesh=mesh)

        self.run_subtests({"mesh_shape": MESHES, "case": ops}, one)

    @with_comms
    def test_index_put_and_index_add(self) -> None:
        def one(mesh_shape, accumulate) -> None:
            mesh = init_device_mesh("cpu", mesh_shape)
            # duplicates only where they add up: which write wins a plain index_put is unspecified
            index = torch.tensor([4, 0, 2, 0]) if accumulate else torch.tensor([4, 0, 2, 5])
            for a, b in layout_tuples(mesh.ndim, 2, 2):
                for index_layout in [(R,) * mesh.ndim, (Shard(0),) * mesh.ndim]:
                    check_against_torch(lambda x, i, v: x.index_put((i,), v, accumulate=accumulate), randn(7, 6).requires_grad_(), index, randn(4, 6, seed=1).requires_grad_(), placements=[a, index_layout, b], mesh=mesh, backward=accumulate)
                    check_against_torch(lambda x, i, v: x.index_add(0, i, v, alpha=2), randn(7, 6).requires_grad_(), index, randn(4, 6, seed=1).requires_grad_(), placements=[a, index_layout, b], mesh=mesh)

        self.run_subtests({"mesh_shape": MESHES, "accumulate": [True, False]}, one)
        mesh = init_device_mesh("cpu", (4,))
        full = randn(7, 6)
        x = distribute_tensor(full.clone(), mesh, [Shard(1)])
        idx = distribute_tensor(torch.tensor([1, 5]), mesh, [R])
        x[idx] = distribute_tensor(torch.ones(2, 6, dtype=torch.float64), mesh, [Shard(1)])
        full[torch.tensor([1, 5])] = 1.0
        self.assertEqual(x.placements, (Shard(1),))
        torch.testing.assert_close(x.full_tensor(), full)

    @with_comms
    def test_gather_and_scatter(self) -> None:
        index_full = seeded_randint(6, 7, 4, seed=3)  # along dim 1 of a (7, 6) tensor
        unique = torch.stack([torch.randperm(6, generator=torch.Generator().manual_seed(r))[:4] for r in range(7)])

        def one(mesh_shape) -> None:
            mesh = init_device_mesh("cpu", mesh_shape)
            partial = (Partial(),) * mesh.ndim
            for a, i in [*layout_tuples(mesh.ndim, 2, 2), *((partial, i) for i in layouts_for(mesh.ndim, 2))]:
                check_against_torch(lambda x, ix: x.gather(1, ix), randn(7, 6).requires_grad_(), index_full, placements=[a, i], mesh=mesh)
                check_against_torch(lambda x, ix: x.scatter(1, ix, 0.0), randn(7, 6).requires_grad_(), unique, placements=[a, i], mesh=mesh)
            for a, i, s in layout_tuples(mesh.ndim, 2, 3):
                check_against_torch(lambda x, ix, src: x.scatter(1, ix, src), randn(7, 6).requires_grad_(), unique, randn(7, 4, seed=1).requires_grad_(), placements=[a, i, s], mesh=mesh)
                check_against_torch(lambda x, ix, src: x.scatter_add(1, ix, src), randn(7, 6).requires_grad_(), index_full, randn(7, 4, seed=1).requires_grad_(), placements=[a, i, s], mesh=mesh)

        self.run_subtests({"mesh_shape": MESHES}, one)

    @with_comms
    def test_gather_backward_with_a_sharded_index_leaves_a_partial_sum(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        full, index_full = randn(5, 6), seeded_randint(6, 5, 8, seed=2)
        x = distribute_tensor(full, mesh, [R]).requires_grad_()
        index = distribute_tensor(index_full, mesh, [Shard(1)])
        with CommDebugMode() as comm:
            out = x.gather(1, index)
        self.assertEqual(comm.get_total_counts(), 0)
        self.assertEqual(out.placements, (Shard(1),))
        out.sum().backward()
        ref = full.clone().requires_grad_()
        ref.gather(1, index_full).sum().backward()
        torch.testing.assert_close(x.grad.full_tensor(), ref.grad)


class SelectPointwiseTest(DTensorTestBase):
    @with_comms
    def test_where_and_masked_fill(self) -> None:
        ops = [
            lambda x, y: torch.where(x > 0, x, y),
            lambda x, y: torch.where(y > 0, x * 2, y),
            lambda x, y: torch.where(x > 0, x, 0.5),
            lambda x, y: x.masked_fill(y > 0, 0.0),
            lambda x, y: x.masked_fill(y > 0, -3.0),
        ]

        def one(mesh_shape, op) -> None:
            mesh = init_device_mesh("cpu", mesh_shape)
            for a, b in layout_tuples(mesh.ndim, 2, 2):
                check_against_torch(op, randn(7, 6).requires_grad_(), randn(7, 6, seed=1).requires_grad_(), placements=[a, b], mesh=mesh)
            check_against_torch(lambda x, m: x.masked_fill(m > 0, 1.0), randn(7, 6).requires_grad_(), randn(6, seed=2).requires_grad_(), placements=[(Shard(0),) * mesh.ndim, (R,) * mesh.ndim], mesh=mesh)  # the mask broadcasts

        self.run_subtests({"mesh_shape": MESHES, "op": ops}, one)

    @with_comms
    def test_partials_survive_only_where_the_fill_keeps_the_sum(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        full, other = randn(7, 6), randn(7, 6, seed=1)
        mask = distribute_tensor(other > 0, mesh, [R])

        def one(reduce_op) -> None:
            x = make_dtensor(full, mesh, [Partial(reduce_op)])
            y = make_dtensor(other, mesh, [Partial(reduce_op)])
            with CommDebugMode() as comm:
                zero_filled = x.masked_fill(mask, 0.0)
                chosen = torch.where(mask, x, y)
            self.assertEqual(comm.get_total_counts(), 0)
            self.assertEqual((zero_filled.placements, chosen.placements), ((Partial(reduce_op),),) * 2)
            filled = x.masked_fill(mask, 2.0)
            if reduce_op == "sum":  # 2.0 on every rank would add up to 8.0
                self.assertNotEqual(filled.placements, (Partial("sum"),))
            torch.testing.assert_close(zero_filled.full_tensor(), full.masked_fill(other > 0, 0.0))
            torch.testing.assert_close(filled.full_tensor(), full.masked_fill(other > 0, 2.0))
            torch.testing.assert_close(chosen.full_tensor(), torch.where(other > 0, full, other))

        self.run_subtests({"reduce_op": ["sum", "avg", "max", "min"]}, one)


class ThreeDMeshTest(DTensorTestBase):
    world_size = 8


    @with_comms
    def test_lookups_on_a_2x2x2_mesh(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2, 2))
        index = torch.tensor([4, 0, 2, 2, 6, 1, 3, 3])
        gather_index = seeded_randint(6, 7, 8, seed=4)
        layouts = [(Shard(0), Shard(1), R), (Shard(1), Shard(1), Partial()), (R, Shard(0), Shard(1))]
        index_layouts = [(R, R, R), (Shard(0), R, Shard(0))]

        def one(layout, index_layout) -> None:
            check_against_torch(lambda x, i: x.index_select(0, i), randn(7, 6).requires_grad_(), index, placements=[layout, index_layout], mesh=mesh)
            check_against_torch(lambda x, i: x[i], randn(7, 6).requires_grad_(), index, placements=[layout, index_layout], mesh=mesh)
            check_against_torch(lambda x, i: x.gather(1, i), randn(7, 6).requires_grad_(), gather_index, placements=[layout, index_layout], mesh=mesh)
            check_against_torch(lambda x: x[2:6, 1], randn(7, 6).requires_grad_(), placements=[layout], mesh=mesh)

        self.run_subtests({"layout": layouts, "index_layout": index_layouts}, one)


class PositionalWriteTest(DTensorTestBase):
    """select_scatter, slice_scatter, index_copy, index_fill, index_reduce, scatter_reduce, take, put,
    masked_scatter and rot90: results and gradients equal torch on every layout."""

    @staticmethod
    def pairs(mesh_ndim: int, ndim_a: int, ndim_b: int) -> list[tuple[tuple[Placement, ...], ...]]:
        layouts = list(itertools.product(layouts_for(mesh_ndim, ndim_a), layouts_for(mesh_ndim, ndim_b)))
        return layouts[:: max(1, len(layouts) // 16)]

    @with_comms
    def test_scatter_family_forward_and_backward(self) -> None:
        unique = torch.tensor([4, 0, 2])
        index_full = seeded_randint(6, 7, 4, seed=3)
        cases = [
            # (fn, inputs, differentiable)
            (lambda x, s: x.select_scatter(s, 1, 2), [randn(7, 6, 4), randn(7, 4, seed=1)], True),
            (lambda x, s: x.slice_scatter(s, 1, 1, 5, 2), [randn(7, 6), randn(7, 2, seed=1)], True),
            (lambda x, i, s: x.index_copy(1, i, s), [randn(7, 6), unique, randn(7, 3, seed=1)], True),
            (lambda x, i: x.index_fill(1, i, -1.5), [randn(7, 6), unique], True),
            (lambda x, i, s: x.index_reduce(0, i, s, "amax"), [randn(7, 6), torch.tensor([1, 1, 5]),
                                                               randn(3, 6, seed=1)], False),
            (lambda x, i, s: x.index_reduce(0, i, s, "mean", include_self=False),
             [randn(7, 6), torch.tensor([1, 1, 5]), randn(3, 6, seed=1)], False),
            (lambda x, i, s: x.scatter_reduce(1, i, s, "sum"), [randn(7, 6), index_full, randn(7, 4, seed=1)], True),
            (lambda x, i, s: x.scatter_reduce(1, i, s, "amax", include_self=False),
             [randn(7, 6), index_full, randn(7, 4, seed=1)], True),
            (lambda x, i, s: x.scatter_reduce(1, i, s, "prod"), [randn(7, 6), index_full, randn(7, 4, seed=1)], True),
            (lambda x, i: x.take(i), [randn(7, 6), seeded_randint(42, 3, 4, seed=4)], True),
            (lambda x, i, s: x.put(i, s), [randn(7, 6), torch.tensor([40, 3, 17, 8]), randn(4, seed=1)], True),
            (lambda x, i, s: x.put(i, s, accumulate=True), [randn(7, 6), seeded_randint(42, 8, seed=5), randn(8, seed=1)],
             True),
            (lambda x, m, s: x.masked_scatter(m, s), [randn(7, 6), randn(7, 6, seed=2) > 0, randn(42, seed=1)], True),
        ]

        def one(mesh_shape, case) -> None:
            mesh = init_device_mesh("cpu", mesh_shape)
            fn, fulls, differentiable = case
            fulls = [f.requires_grad_() if f.is_floating_point() else f for f in fulls]  # the values take gradients
            ndims = [f.ndim for f in fulls]
            for layouts in self.pairs(mesh.ndim, ndims[0], ndims[-1]):
                per_input = [layouts[0], *([(R,) * mesh.ndim] * (len(fulls) - 2)), layouts[1]]
                if len(fulls) == 3 and fulls[1].ndim == fulls[2].ndim:
                    per_input[1] = layouts[1]  # an index shaped like src shards with it
                check_against_torch(fn, *fulls, placements=per_input, mesh=mesh, backward=differentiable)

        self.run_subtests({"mesh_shape": MESHES, "case": cases}, one)

    @with_comms
    def test_writes_keep_shards_and_partials_without_communication(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        full, src_full = randn(8, 6), randn(8, 3, seed=1)
        unique = torch.tensor([4, 0, 2])
        cases = [
            # (fn(x, src, index), self placement, src placement, output placement)
            (lambda x, s, i: x.index_copy(1, i, s), Shard(0), Shard(0), Shard(0)),
            (lambda x, s, i: x.index_copy(1, i, s), Partial("max"), Partial("max"), Partial("max")),
            (lambda x, s, i: x.index_reduce(1, i, s, "amin"), Partial("min"), Partial("min"), Partial("min")),
            (lambda x, s, i: x.scatter_reduce(1, i.expand(8, 3), s, "sum"), Partial("sum"), Partial("sum"),
             Partial("sum")),
            (lambda x, s, i: x.select_scatter(s[:, 0], 1, 3), Shard(0), Shard(0), Shard(0)),
            (lambda x, s, i: x.slice_scatter(s, 1, 0, 3), Partial("avg"), Partial("avg"), Partial("avg")),
        ]
        index = distribute_tensor(unique, mesh, [R])
        for fn, self_p, src_p, out_p in cases:
            x, src = make_dtensor(full, mesh, [self_p]), make_dtensor(src_full, mesh, [src_p])
            with CommDebugMode() as comm:
                out = fn(x, src, index)
            self.assertEqual(comm.get_total_counts(), 0, (self_p, src_p))
            self.assertEqual(out.placements, (out_p,))
            torch.testing.assert_close(out.full_tensor(), fn(full, src_full, unique))
        # put(accumulate) with a sharded index: each rank adds its part into a sum-partial
        x = make_dtensor(full, mesh, [Partial("sum")])
        positions, values = seeded_randint(48, 12, seed=6), randn(12, seed=2)
        sharded_positions = distribute_tensor(positions, mesh, [Shard(0)])
        sharded_values = distribute_tensor(values, mesh, [Shard(0)])
        with CommDebugMode() as comm:
            out = x.put(sharded_positions, sharded_values, accumulate=True)
        self.assertEqual((comm.get_total_counts(), out.placements), (0, (Partial("sum"),)))
        torch.testing.assert_close(out.full_tensor(), full.put(positions, values, accumulate=True))

    @with_comms
    def test_scatter_reduce_with_a_sharded_index_reduces_each_part_into_a_partial(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        full, index_full, src_full = randn(5, 6), seeded_randint(6, 5, 8, seed=1), randn(5, 8, seed=2)
        expected_placement = {"sum": Partial("sum"), "amax": Partial("max"), "amin": Partial("min")}

        def one(reduce, include_self) -> None:
            x = distribute_tensor(full, mesh, [R])
            index, src = (distribute_tensor(t, mesh, [Shard(1)]) for t in (index_full, src_full))
            with CommDebugMode() as comm:
                out = x.scatter_reduce(1, index, src, reduce, include_self=include_self)
            if include_self and reduce in expected_placement:
                self.assertEqual((comm.get_total_counts(), out.placements), (0, (expected_placement[reduce],)))
            torch.testing.assert_close(
                out.full_tensor(), full.scatter_reduce(1, index_full, src_full, reduce, include_self=include_self)
            )

        self.run_subtests({"reduce": ["sum", "amax", "amin", "mean", "prod"], "include_self": [True, False]}, one)

    @with_comms
    def test_rot90_moves_the_shard_with_the_plane(self) -> None:
        def one(mesh_shape, k) -> None:
            mesh = init_device_mesh("cpu", mesh_shape)
            for layout in layouts_for(mesh.ndim, 3):
                check_against_torch(lambda x: x.rot90(k, (0, 1)), randn(5, 6, 4).requires_grad_(), placements=[layout], mesh=mesh)
                check_against_torch(lambda x: x.rot90(k, (2, 0)), randn(5, 6, 4).requires_grad_(), placements=[layout], mesh=mesh)

        self.run_subtests({"mesh_shape": MESHES, "k": [0, 1, 2, 3, -1]}, one)
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(randn(8, 6), mesh, [Shard(0)])
        with CommDebugMode() as comm:
            turned = x.rot90(1)
        self.assertEqual((comm.get_total_counts(), turned.placements), (0, (Shard(1),)))
