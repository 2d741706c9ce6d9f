"""The dispatch loop on the first op families: results equal plain torch, forward and backward."""

from __future__ import annotations

import itertools

import pytest
import torch

from spmd.tensor import Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.tensor.dispatch.dispatcher import DISPATCHER, implicit_replication, replicate_fallback
from spmd.tensor.ops import REGISTRY, OpStrategy
from spmd.testing import DTensorTestBase, check_against_torch, run_threaded, with_comms
from spmd.testing import seeded_randn as randn
from spmd.testing.layouts import make_dtensor

aten = torch.ops.aten




class DispatchTest(DTensorTestBase):
    def check_binary(self, mesh, op, placements_a, placements_b, shape_b=(8, 6)) -> None:
        a = randn(8, 6, seed=0, dtype=torch.float64).requires_grad_()
        b = randn(*shape_b, seed=1, dtype=torch.float64).requires_grad_()
        check_against_torch(op, a, b, placements=[placements_a, placements_b], mesh=mesh)

    @with_comms
    def test_pointwise_binary_ops_on_every_layout(self) -> None:
        for mesh_shape in [(4,), (2, 2)]:
            mesh = init_device_mesh("cpu", mesh_shape)
            layouts = list(itertools.product([Replicate(), Shard(0), Shard(1)], repeat=mesh.ndim))
            self.run_subtests(
                {"op": [torch.add, torch.mul, torch.sub], "placements_a": layouts, "placements_b": layouts},
                self.check_binary,
                mesh,
            )

    @with_comms
    def test_broadcasting_operand(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        self.run_subtests(
            {"placements_a": [[Shard(0)], [Shard(1)], [Replicate()]], "placements_b": [[Replicate()], [Shard(0)]]},
            self.check_binary,
            mesh,
            torch.add,
            shape_b=(6,),
        )

    @with_comms
    def test_relu_and_mm_against_plain_torch(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        x, w = randn(8, 6, seed=1).requires_grad_(), randn(6, 4, seed=2).requires_grad_()
        layouts = list(itertools.product([Replicate(), Shard(0), Shard(1)], repeat=2))
        self.run_subtests(
            {"x_layout": layouts, "w_layout": layouts},
            lambda x_layout, w_layout: check_against_torch(
                lambda a, b: torch.relu(a @ b), x, w, placements=[x_layout, w_layout], mesh=mesh
            ),
        )

    @with_comms
    def test_mm_strategies_move_no_data_when_layouts_fit(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x, w = randn(8, 8, seed=1), randn(8, 8, seed=2)
        cases = [
            ([Shard(0)], [Replicate()], (Shard(0),)),
            ([Replicate()], [Shard(1)], (Shard(1),)),
            ([Shard(1)], [Shard(0)], (Partial(),)),
        ]
        for x_layout, w_layout, expected in cases:
            a, b = distribute_tensor(x, mesh, x_layout), distribute_tensor(w, mesh, w_layout)
            with CommDebugMode() as comm:
                out = a @ b
            self.assertEqual(comm.get_total_counts(), 0)
            self.assertEqual(out.placements, expected)
            torch.testing.assert_close(out.full_tensor(), x @ w)

    @with_comms
    def test_partials_pass_through_linear_ops_and_are_reduced_before_relu(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        full = randn(8, 4)
        p, q = make_dtensor(full, mesh, [Partial()]), make_dtensor(2 * full, mesh, [Partial()])
        with CommDebugMode() as comm:
            summed, scaled, negated = p + q, p * 3, -p
        self.assertEqual(comm.get_total_counts(), 0)
        for result, expected in [(summed, 3 * full), (scaled, 3 * full), (negated, -full)]:
            self.assertEqual(result.placements, (Partial(),))
            torch.testing.assert_close(result.full_tensor(), expected)
        with CommDebugMode() as comm:
            activated = torch.relu(p)
        # as in torch, no input is sharded, so the pending sum is completed to R (not scattered onto a new shard)
        self.assertEqual((comm.get_comm_counts(), activated.placements), ({"all_reduce": 1}, (Replicate(),)))
        torch.testing.assert_close(activated.full_tensor(), torch.relu(full))

    @with_comms
    def test_partial_plus_scalar_is_reduced_first(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        full = randn(4, 4)
        result = make_dtensor(full, mesh, [Partial()]) + 1.0
        self.assertNotEqual(result.placements, (Partial(),))
        torch.testing.assert_close(result.full_tensor(), full + 1.0)
        averaged = make_dtensor(full, mesh, [Partial("avg")]) + 1.0
        torch.testing.assert_close(averaged.full_tensor(), full + 1.0)

    @with_comms
    def test_in_place_ops_keep_the_layout(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        full, other = randn(7, 4, seed=1), randn(7, 4, seed=2)
        x = distribute_tensor(full.clone(), mesh, [Shard(0)])
        y = distribute_tensor(other, mesh, [Replicate()])
        returned = x.add_(y).mul_(2)
        self.assertIs(returned, x)
        self.assertEqual(x.placements, (Shard(0),))
        torch.testing.assert_close(x.full_tensor(), (full + other) * 2)

    @with_comms
    def test_in_place_op_that_needs_another_layout_raises_as_in_torch(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        full = randn(4, 4)
        x = make_dtensor(full, mesh, [Partial()])
        with CommDebugMode() as comm, self.assertRaisesRegex(
            RuntimeError, "in-place operations that require placement changes are not supported"
        ):
            x.relu_()  # relu of a partial needs the reduced value, and self cannot change placement
        self.assertEqual((comm.get_total_counts(), x.placements), (0, (Partial(),)))
        torch.testing.assert_close(x.full_tensor(), full)  # untouched
        torch.testing.assert_close(x.relu().full_tensor(), torch.relu(full))  # the out-of-place op works

    @with_comms
    def test_plain_tensor_operands_are_rejected_with_a_fix(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
        with self.assertRaisesRegex(RuntimeError, "plain torch.Tensor .* distribute_tensor"):
            x + torch.randn(8, 4)
        torch.testing.assert_close((x * torch.tensor(2.0)).full_tensor(), x.full_tensor() * 2)

    @with_comms
    def test_repeated_ops_hit_the_cache(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
        x + x  # warm up
        x.full_tensor()  # a collective: every rank has warmed up before any counts
        misses = DISPATCHER.misses
        for _ in range(5):
            x + x
        self.assertEqual(DISPATCHER.misses, misses)

    @with_comms
    def test_a_float_operand_keys_elementwise_ops_by_type_not_value(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
        x.mul(0.5).add_(1.5)  # warm up
        x.full_tensor()
        misses = DISPATCHER.misses
        results = [x.mul(scale).add_(scale) for scale in (0.25, 2.0, -3.0)]
        self.assertEqual(DISPATCHER.misses, misses)
        for scale, result in zip((0.25, 2.0, -3.0), results):
            torch.testing.assert_close(result.full_tensor(), x.full_tensor() * scale + scale)

    @with_comms
    def test_scalar_type_is_part_of_the_cache_key(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(torch.arange(8), mesh, [Shard(0)])
        self.assertEqual((x + 1).dtype, torch.int64)
        self.assertEqual((x + 1.0).dtype, torch.float32)
        torch.testing.assert_close((x + 1.0).full_tensor(), torch.arange(8) + 1.0)


# The registry is process-wide, so a rule is swapped around the whole world, not inside one rank.
def test_without_fallback_an_op_without_rule_names_op_and_placements() -> None:
    def exp_of_shard() -> None:
        mesh = init_device_mesh("cpu", (4,))
        torch.exp(distribute_tensor(randn(8, 4), mesh, [Shard(0)]))

    expected = r"aten.exp.default has no sharding rule \(inputs \(S\(0\)\) \[8, 4\]\)"
    with (
        replicate_fallback(False),
        REGISTRY.override(aten.exp.default, None),
        pytest.raises(NotImplementedError, match=expected),
    ):
        run_threaded(exp_of_shard, 4)


def test_rules_can_be_swapped_in_a_block() -> None:
    def exp_placements() -> tuple:
        mesh = init_device_mesh("cpu", (4,))
        return torch.exp(distribute_tensor(randn(8, 4), mesh, [Shard(0)])).placements

    def replicate_only(call):
        return [OpStrategy((Replicate(),), (Replicate(),))]

    with REGISTRY.override(aten.exp.default, replicate_only):
        assert run_threaded(exp_placements, 4) == [(Replicate(),)] * 4
    assert run_threaded(exp_placements, 4) == [(Shard(0),)] * 4


def test_a_swapped_rule_also_replaces_the_ops_decomposition() -> None:
    """A 2-norm of a sharded dim runs as power sums; inside an override the block's rule decides it."""

    def norm_of_row_shards() -> tuple:
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(randn(8, 4), mesh, [Shard(0)])
        with CommDebugMode() as comm:
            norm = torch.linalg.vector_norm(x)
        torch.testing.assert_close(norm.full_tensor(), torch.linalg.vector_norm(randn(8, 4)))
        return {str(k): n for k, n in comm.get_comm_counts().items()}

    def replicate_only(call):
        return [OpStrategy((Replicate(),), (Replicate(),))]

    assert run_threaded(norm_of_row_shards, 4)[0] == {"all_reduce": 1}
    with REGISTRY.override(aten.linalg_vector_norm.default, replicate_only):
        assert run_threaded(norm_of_row_shards, 4)[0] == {"all_gather": 1}
    assert run_threaded(norm_of_row_shards, 4)[0] == {"all_reduce": 1}


def test_ops_without_rules_fall_back_to_replicated_inputs() -> None:
    def cummax_of_shards() -> tuple:
        mesh = init_device_mesh("cpu", (4,))
        full = randn(7, 5)
        x = distribute_tensor(full, mesh, [Shard(0)])
        with CommDebugMode() as comm:
            values, indices = torch.ops.aten.cummax.default(x, 0)
        expected_values, expected_indices = torch.cummax(full, 0)
        torch.testing.assert_close(values.full_tensor(), expected_values)
        torch.testing.assert_close(indices.full_tensor(), expected_indices)
        return values.placements, comm.get_comm_counts()

    with REGISTRY.override(aten.cummax.default, None):
        assert run_threaded(cummax_of_shards, 4)[0] == ((Replicate(),), {"all_gather": 1})


def test_random_ops_without_rules_raise_instead_of_falling_back() -> None:
    def bernoulli_of_shards() -> None:
        mesh = init_device_mesh("cpu", (4,))
        torch.bernoulli(distribute_tensor(torch.full((8, 4), 0.5), mesh, [Shard(0)]))

    with REGISTRY.override(aten.bernoulli.default, None), pytest.raises(NotImplementedError, match="it is random"):
        run_threaded(bernoulli_of_shards, 4)



def test_plain_tensors_join_as_replicas_only_when_asked() -> None:
    def add_plain() -> torch.Tensor:
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(randn(8, 4), mesh, [Shard(0)])
        with implicit_replication():
            return (x + randn(8, 4, seed=1)).full_tensor()

    for result in run_threaded(add_plain, 4):
        torch.testing.assert_close(result, randn(8, 4) + randn(8, 4, seed=1))


def test_backward_formulas_that_build_plain_tensors_work() -> None:
    full = randn(4, 6).abs() + 0.5

    def prod_grad() -> torch.Tensor:
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(full, mesh, [Shard(1)]).requires_grad_()
        torch.prod(x, dim=1).full_tensor().sum().backward()
        return x.grad.full_tensor()

    reference = full.clone().requires_grad_()
    torch.prod(reference, dim=1).sum().backward()
    for grad in run_threaded(prod_grad, 4):
        torch.testing.assert_close(grad, reference.grad)


def test_an_input_passed_twice_is_redistributed_once() -> None:
    def square_of_partial() -> dict:
        mesh = init_device_mesh("cpu", (4,))
        g = make_dtensor(randn(8, 4), mesh, [Partial()])
        acc = distribute_tensor(torch.zeros(8, 4), mesh, [Replicate()])
        with CommDebugMode() as comm:
            acc.addcmul_(g, g)
        torch.testing.assert_close(acc.full_tensor(), randn(8, 4) ** 2)
        return comm.get_comm_counts()

    assert run_threaded(square_of_partial, 4)[0] == {"all_reduce": 1}


def test_views_and_in_place_shape_changes_never_fall_back() -> None:
    def squeeze_in_place() -> None:
        mesh = init_device_mesh("cpu", (4,))
        distribute_tensor(randn(8, 1), mesh, [Shard(0)]).as_strided_((8,), (1,))  # squeeze_ has a rule

    with pytest.raises(NotImplementedError, match=r"as_strided_.*changes the tensor's shape in place"):
        run_threaded(squeeze_in_place, 4)

    def strided_view() -> None:
        mesh = init_device_mesh("cpu", (4,))
        distribute_tensor(randn(8, 4), mesh, [Shard(0)]).as_strided((8, 2), (4, 1))

    # as_strided has a rule (it gathers, and the view of the copy refuses writes); without one:
    with (
        REGISTRY.override(aten.as_strided.default, None),
        pytest.raises(NotImplementedError, match="returns a view of its input"),
    ):
        run_threaded(strided_view, 4)


def test_out_variants_write_into_the_out_tensor_in_its_layout() -> None:
    a_full, b_full = randn(7, 4, seed=1), randn(7, 4, seed=2)

    def add_and_max_into_out() -> tuple:
        mesh = init_device_mesh("cpu", (4,))
        a = distribute_tensor(a_full, mesh, [Shard(0)])
        b = distribute_tensor(b_full, mesh, [Replicate()])
        out = distribute_tensor(torch.zeros(7, 4), mesh, [Shard(1)])
        returned = torch.add(a, b, out=out)
        assert returned is out and out.placements == (Shard(1),)
        values = distribute_tensor(torch.zeros(7), mesh, [Replicate()])
        indices = distribute_tensor(torch.zeros(7, dtype=torch.int64), mesh, [Replicate()])
        torch.max(a, 1, out=(values, indices))
        wrong = distribute_tensor(torch.zeros(3), mesh, [Replicate()])
        try:
            torch.add(a, b, out=wrong)
        except RuntimeError as error:
            message = str(error)
        return out.full_tensor(), values.full_tensor(), indices.full_tensor(), message

    for out, values, indices, message in run_threaded(add_and_max_into_out, 4):
        torch.testing.assert_close(out, a_full + b_full)
        torch.testing.assert_close(values, a_full.max(1).values)
        torch.testing.assert_close(indices, a_full.max(1).indices)
        assert "not resized" in message


def test_writing_through_a_view_of_a_redistributed_copy_raises() -> None:
    def fill_diagonal_of_row_shards() -> torch.Tensor:
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(torch.zeros(8, 8), mesh, [Shard(0)])
        diagonal = x.diagonal()  # both diagonal dims must be whole: x is gathered first
        torch.testing.assert_close(diagonal.full_tensor(), torch.zeros(8))
        diagonal.fill_(1.0)
        return x.full_tensor()

    with pytest.raises(RuntimeError, match="writes into a view of a DTensor that had to be redistributed"):
        run_threaded(fill_diagonal_of_row_shards, 4)


def test_a_view_that_relabels_a_one_rank_mesh_dim_aliases_its_input() -> None:
    """Shard over one rank holds the whole dim, so a view that asks for Replicate there moves nothing."""

    def fill_diagonal(mesh_shape: tuple[int, int], placements: list) -> tuple:
        mesh = init_device_mesh("cpu", mesh_shape)
        x = distribute_tensor(torch.zeros(8, 8), mesh, placements)
        with CommDebugMode() as comm:
            diagonal = x.diagonal()  # both diagonal dims must be whole
            diagonal.fill_(1.0)
        return x.full_tensor(), x.placements, comm.get_total_counts()

    for mesh_shape, placements in [((4, 1), [Replicate(), Shard(0)]), ((1, 4), [Shard(1), Replicate()])]:
        for full, kept, count in run_threaded(fill_diagonal, 4, mesh_shape, placements):
            torch.testing.assert_close(full, torch.eye(8))
            assert kept == tuple(placements) and count == 0


def test_casts_with_a_device_argument() -> None:
    def cast() -> tuple:
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(randn(8, 4), mesh, [Shard(0)])
        doubled = x.to(device="cpu", dtype=torch.float64)
        soft = torch.softmax(x, dim=1, dtype=torch.float64)
        return doubled.dtype, doubled.placements, doubled.full_tensor(), soft.full_tensor()

    for dtype, placements, doubled, soft in run_threaded(cast, 4):
        assert dtype == torch.float64 and placements == (Shard(0),)
        torch.testing.assert_close(doubled, randn(8, 4).double())
        torch.testing.assert_close(soft, torch.softmax(randn(8, 4), dim=1, dtype=torch.float64))


def test_replicate_fallback_switch_is_restored_after_the_block() -> None:
    was = DISPATCHER.fallback
    with replicate_fallback(not was):
        assert DISPATCHER.fallback is (not was)
    assert DISPATCHER.fallback is was


def test_registry_holds_one_entry_per_overload_with_its_schema_facts() -> None:
    add_ = REGISTRY.entry(aten.add_.Tensor)
    assert add_.inplace and not add_.returns_view and add_.rule is not None
    view = REGISTRY.entry(aten.view.default)
    assert view.returns_view and view.local_args is not None
    assert REGISTRY.entry(aten.add.out).out_variant == (aten.add.Tensor, ("out",))
    assert REGISTRY.entry(aten._foreach_add_.List).list_op
    assert "random" in (REGISTRY.entry(aten.bernoulli.default).no_fallback or "")
    assert REGISTRY.entry(aten.add.Tensor) is REGISTRY.entry(aten.add.Tensor)  # made once


def test_a_cached_call_is_not_decided_again() -> None:
    def twice() -> int:
        mesh = init_device_mesh("cpu", (1,))  # one rank: no other thread counts misses meanwhile
        x = distribute_tensor(randn(8, 4), mesh, [Shard(0)])
        x.sum(1)  # an int-list argument keys the cache without flattening the call
        before = DISPATCHER.misses
        for _ in range(3):
            x.sum(1)
        return DISPATCHER.misses - before

    assert run_threaded(twice, 1) == [0]
