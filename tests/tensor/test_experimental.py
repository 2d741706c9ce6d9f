"""spmd.tensor.experimental: local_map and register_sharding, checked against plain torch."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from spmd.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.tensor.dispatch.dispatcher import replicate_fallback
from spmd.tensor.experimental import implicit_replication, local_map, register_sharding
from spmd.tensor.ops import REGISTRY
from spmd.testing import DTensorTestBase, with_comms
from spmd.testing import seeded_randn as randn

aten = torch.ops.aten


# A custom op spmd has no rule for: without register_sharding it takes the replicate fallback.
@torch.library.custom_op("spmd_experimental_test::scale", mutates_args=())
def scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor


@scale.register_fake
def _(x: torch.Tensor, factor: float) -> torch.Tensor:
    return torch.empty_like(x)


# torch's regression case: the first argument is not a tensor.
@torch.library.custom_op("spmd_experimental_test::named_copy", mutates_args=())
def named_copy(name: str, x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@named_copy.register_fake
def _(name: str, x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@contextlib.contextmanager
def rules_restored(*ops: Any) -> Iterator[None]:
    """Give ``ops`` back the registry entries they had before the block (register_sharding is permanent)."""
    saved = [REGISTRY.entry(op) for op in ops]
    try:
        yield
    finally:
        for entry in saved:
            REGISTRY.register(
                entry.op,
                local_args=entry.local_args,
                local_impl=entry.local_impl,
                decompose=entry.decompose,
                float_values_matter=entry.float_values_matter,
            )(entry.rule)  # type: ignore[arg-type]


class LocalMapTest(DTensorTestBase):
    @with_comms
    def test_row_parallel_matmul_on_local_shards(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        w, x = randn(6, 8, seed=0), randn(8, 5, seed=1)
        w_dt, x_dt = distribute_tensor(w, mesh, [Shard(1)]), distribute_tensor(x, mesh, [Shard(0)])

        # each rank multiplies its column block of w by its row block of x: a partial sum of w @ x
        partial_mm = local_map(torch.mm, out_placements=[Partial()], in_placements=([Shard(1)], [Shard(0)]))
        with CommDebugMode() as comm:
            y = partial_mm(w_dt, x_dt)
        self.assertEqual(comm.get_total_counts(), 0)
        self.assertIsInstance(y, DTensor)
        self.assertEqual(y.placements, (Partial(),))
        torch.testing.assert_close(y.full_tensor(), w @ x)

        # the function may finish the sum itself: its result is then the same on every rank
        def reduced_mm(w_local: torch.Tensor, x_local: torch.Tensor) -> torch.Tensor:
            return mesh.get_communicator(0).all_reduce(w_local @ x_local, "sum")

        with CommDebugMode() as comm:
            y = local_map(reduced_mm, [Replicate()], ([Shard(1)], [Shard(0)]), device_mesh=mesh)(w_dt, x_dt)
        self.assertEqual(comm.get_comm_counts(), {"all_reduce": 1})
        self.assertEqual(y.placements, (Replicate(),))
        torch.testing.assert_close(y.to_local(), w @ x)

    @with_comms
    def test_decorator_with_several_outputs_and_non_tensor_arguments(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        x = randn(8, 6, seed=2)
        x_dt = distribute_tensor(x, mesh, [Shard(0), Shard(1)])

        @local_map(out_placements=([Shard(0), Shard(1)], None), in_placements=([Shard(0), Shard(1)], None))
        def scaled_with_local_rows(x_local: torch.Tensor, factor: float) -> tuple[torch.Tensor, int]:
            return x_local * factor, x_local.shape[0]

        y, local_rows = scaled_with_local_rows(x_dt, 3.0)
        self.assertEqual(y.placements, (Shard(0), Shard(1)))
        torch.testing.assert_close(y.full_tensor(), x * 3.0)
        self.assertEqual(local_rows, 4)  # a value that is not a tensor comes back as the function gave it

        # a pytree of inputs flattens to one in_placements entry per leaf
        pair_sum = local_map(lambda pair: pair[0] + pair[1], [Shard(0), Shard(1)], ([Shard(0), Shard(1)],) * 2)
        torch.testing.assert_close(pair_sum((x_dt, x_dt)).full_tensor(), 2 * x)

    @with_comms
    def test_inputs_in_other_placements_raise_or_are_redistributed(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x = randn(8, 4, seed=3)
        x_dt = distribute_tensor(x, mesh, [Shard(0)])
        row_sums = local_map(lambda t: t.sum(dim=1), out_placements=[Shard(0)], in_placements=([Replicate()],))
        with pytest.raises(ValueError, match=r"argument 0 .* placed \(S\(0\)\), but in_placements asks for \(R\)"):
            row_sums(x_dt)

        gathered_sums = local_map(
            lambda t: t.sum(dim=1), out_placements=[Replicate()], in_placements=([Replicate()],), redistribute_inputs=True
        )
        with CommDebugMode() as comm:
            y = gathered_sums(x_dt)
        self.assertEqual(comm.get_comm_counts(), {"all_gather": 1})
        torch.testing.assert_close(y.full_tensor(), x.sum(dim=1))
        # negative shard dims name the same placement
        same = local_map(torch.neg, [Shard(1)], ([Shard(-1)],))(distribute_tensor(x, mesh, [Shard(1)]))
        torch.testing.assert_close(same.full_tensor(), -x)

    @with_comms
    def test_plain_tensors_pass_through(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x, bias = randn(8, 4, seed=4), randn(4, seed=5)
        add_bias = local_map(torch.add, out_placements=[Shard(0)], in_placements=([Shard(0)], [Replicate()]))
        # a plain tensor is given to the function as it is, whatever its in_placements entry
        y = add_bias(distribute_tensor(x, mesh, [Shard(0)]), bias)
        torch.testing.assert_close(y.full_tensor(), x + bias)
        # with no DTensor at all, the function runs unchanged and out_placements is ignored
        plain = add_bias(x, bias)
        self.assertNotIsInstance(plain, DTensor)
        torch.testing.assert_close(plain, x + bias)

    @with_comms
    def test_gradients_flow_through_local_map(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        w, x = randn(6, 8, seed=6), randn(8, 5, seed=7)
        w_dt = distribute_tensor(w, mesh, [Shard(1)]).requires_grad_()
        x_dt = distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
        partial_mm = local_map(torch.mm, out_placements=[Partial()], in_placements=([Shard(1)], [Shard(0)]))
        loss = torch.tanh(partial_mm(w_dt, x_dt)).sum()
        loss.backward()

        w_ref, x_ref = w.clone().requires_grad_(), x.clone().requires_grad_()
        torch.tanh(w_ref @ x_ref).sum().backward()
        torch.testing.assert_close(loss.full_tensor(), torch.tanh(w @ x).sum())
        assert w_dt.grad is not None and x_dt.grad is not None
        self.assertEqual((w_dt.grad.placements, x_dt.grad.placements), ((Shard(1),), (Shard(0),)))
        torch.testing.assert_close(w_dt.grad.full_tensor(), w_ref.grad)
        torch.testing.assert_close(x_dt.grad.full_tensor(), x_ref.grad)

    @with_comms
    def test_in_grad_placements_declares_partial_local_gradients(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        w, x = randn(8, 4, seed=8), randn(4, seed=9)
        w_dt = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
        x_dt = distribute_tensor(x, mesh, [Replicate()]).requires_grad_()
        # x is replicated, but each rank's local gradient of x only sums over its own rows of w:
        # declaring it Partial() makes the sum over ranks part of x's gradient
        matvec = local_map(
            torch.mv,
            out_placements=[Shard(0)],
            in_placements=([Shard(0)], [Replicate()]),
            in_grad_placements=([Shard(0)], [Partial()]),
        )
        matvec(w_dt, x_dt).sum().backward()

        w_ref, x_ref = w.clone().requires_grad_(), x.clone().requires_grad_()
        (w_ref @ x_ref).sum().backward()
        assert w_dt.grad is not None and x_dt.grad is not None
        torch.testing.assert_close(x_dt.grad.full_tensor(), x_ref.grad)
        torch.testing.assert_close(w_dt.grad.full_tensor(), w_ref.grad)

    @with_comms
    def test_misuse_is_reported(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x_dt = distribute_tensor(randn(8, 4, seed=10), mesh, [Shard(0)])
        with pytest.raises(AssertionError, match="in_placements has 1 entries but the call has 2"):
            local_map(torch.mul, [Shard(0)], ([Shard(0)],))(x_dt, 2.0)
        with pytest.raises(AssertionError, match="argument 1 is a float, not a tensor"):
            local_map(torch.mul, [Shard(0)], ([Shard(0)], [Replicate()]))(x_dt, 2.0)
        with pytest.raises(AssertionError, match=r"returned 2 values .* out_placements gives 1"):
            local_map(lambda t: (t, t), [Shard(0)])(x_dt)
        with pytest.raises(AssertionError, match="output 0 is a int, not a tensor"):
            local_map(lambda t: t.shape[0], [Shard(0)])(x_dt)
        with pytest.raises(AssertionError, match="must return plain tensors"):
            local_map(lambda t: x_dt, [Shard(0)])(x_dt)


class RegisterShardingTest(DTensorTestBase):
    # Registration happens before the threaded world starts and is undone after it ends, so every
    # rank decides with the same rule.

    def test_softmax_strategies_from_torchs_docstring(self) -> None:
        with rules_restored(aten._softmax.default):

            @register_sharding(aten._softmax.default)
            def softmax_sharding(x: Any, dim: int, half_to_float: bool) -> list[Any]:
                softmax_dim = dim % x.ndim
                strategies = [([Replicate()], [Replicate(), None, None])]
                strategies += [([Shard(d)], [Shard(d), None, None]) for d in range(x.ndim) if d != softmax_dim]
                return strategies

            self.assertIs(REGISTRY.rule_for(aten._softmax.default).fn, softmax_sharding)  # type: ignore[union-attr]
            self._check_softmax()

    @with_comms
    def _check_softmax(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x = randn(8, 12, 16, seed=11)
        for softmax_dim in (-1, 0, 1):
            for shard_dim in range(3):
                y = torch.softmax(distribute_tensor(x, mesh, [Shard(shard_dim)]), dim=softmax_dim)
                if shard_dim != softmax_dim % 3:
                    self.assertEqual(y.placements, (Shard(shard_dim),))
                else:  # the softmax dim must be whole: moved to another dim (all_to_all, cheapest) or gathered
                    self.assertFalse(y.placements[0].is_shard(softmax_dim % 3))
                torch.testing.assert_close(y.full_tensor(), torch.softmax(x, dim=softmax_dim))

    def test_user_strategies_override_the_builtin_mm_rule(self) -> None:
        self._mm_keeps_row_shards()  # the built-in rule: S(0) x R -> S(0), no collective
        with rules_restored(aten.mm.default):

            @register_sharding(aten.mm.default)
            def replicated_mm(a: Any, b: Any) -> list[Any]:
                return [([Replicate()], [Replicate(), Replicate()])]

            self._mm_gathers_first()
        self._mm_keeps_row_shards()  # the built-in rule is back

    @with_comms
    def _mm_keeps_row_shards(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        a, b = randn(8, 6, seed=12), randn(6, 4, seed=13)
        a_dt, b_dt = distribute_tensor(a, mesh, [Shard(0)]), distribute_tensor(b, mesh, [Replicate()])
        with CommDebugMode() as comm:
            y = a_dt @ b_dt
        self.assertEqual((y.placements, comm.get_total_counts()), ((Shard(0),), 0))
        torch.testing.assert_close(y.full_tensor(), a @ b)

    @with_comms
    def _mm_gathers_first(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        a, b = randn(8, 6, seed=12), randn(6, 4, seed=13)
        a_dt, b_dt = distribute_tensor(a, mesh, [Shard(0)]), distribute_tensor(b, mesh, [Replicate()])
        with CommDebugMode() as comm:
            y = a_dt @ b_dt
        self.assertEqual((y.placements, comm.get_comm_counts()), ((Replicate(),), {"all_gather": 1}))
        torch.testing.assert_close(y.to_local(), a @ b)

    def test_a_custom_op_stays_sharded_on_a_2d_mesh(self) -> None:
        with rules_restored(torch.ops.spmd_experimental_test.scale.default):

            @register_sharding(torch.ops.spmd_experimental_test.scale.default)
            def elementwise(x: Any, factor: float) -> list[Any]:
                return [([Replicate()], [Replicate(), None])] + [([Shard(d)], [Shard(d), None]) for d in range(x.ndim)]

            self._check_scale()

    @with_comms
    def _check_scale(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        x = randn(8, 6, seed=14)
        sharded = distribute_tensor(x, mesh, [Shard(0), Shard(1)])
        pending = distribute_tensor(x, mesh, [Replicate(), Shard(1)]).redistribute(placements=[Partial(), Shard(1)])
        with replicate_fallback(False), CommDebugMode() as comm:  # the user's rule, not the fallback, decides
            y = scale(sharded, 2.0)
        # each mesh dim picks its cheapest strategy: both shards stay where they are
        self.assertEqual((y.placements, comm.get_total_counts()), ((Shard(0), Shard(1)), 0))
        with replicate_fallback(False), CommDebugMode() as comm:
            z = scale(pending, 0.5)
        # no strategy takes a pending sum: it is reduced (to R or scattered) on mesh dim 0 only
        self.assertFalse(any(p.is_partial() for p in z.placements))
        self.assertEqual(z.placements[1], Shard(1))
        self.assertEqual(comm.get_total_counts(), 1)
        torch.testing.assert_close(y.full_tensor(), x * 2.0)
        torch.testing.assert_close(z.full_tensor(), x * 0.5)

    def test_the_function_sees_specs_and_non_tensor_arguments(self) -> None:
        seen: list[tuple[Any, ...]] = []
        with rules_restored(torch.ops.spmd_experimental_test.named_copy.default):

            @register_sharding(torch.ops.spmd_experimental_test.named_copy.default)
            def copy_sharding(name: str, x: Any) -> list[Any]:
                seen.append((name, tuple(x.shape), x.placements))
                return [([x.placements[0]], [None, x.placements[0]])]

            self._check_named_copy()
        self.assertIn(("w", (8, 6), (Shard(1),)), seen)

    @with_comms
    def _check_named_copy(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x = randn(8, 6, seed=15)
        x_dt = distribute_tensor(x, mesh, [Shard(1)])
        with CommDebugMode() as comm:
            y = torch.ops.spmd_experimental_test.named_copy("w", x_dt)
        self.assertEqual((y.placements, comm.get_total_counts()), ((Shard(1),), 0))
        torch.testing.assert_close(y.full_tensor(), x)

    def test_list_arguments_and_list_results(self) -> None:
        asked: list[str] = []
        with rules_restored(aten.cat.default, aten.split.Tensor):

            @register_sharding(aten.cat.default)
            def cat_sharding(tensors: list[Any], dim: int) -> list[Any]:
                # one placement per tensor of the list, nested as the argument is
                asked.append("cat")
                kept = [([Shard(d)], [[Shard(d)] * len(tensors), None]) for d in range(tensors[0].ndim) if d != dim]
                return [([Replicate()], [[Replicate()] * len(tensors), None]), *kept]

            @register_sharding(aten.split.Tensor)
            def split_sharding(x: Any, split_size: int, dim: int = 0) -> list[Any]:
                # a Tensor[] result takes one placement, which every piece gets
                asked.append("split")
                kept = [([Shard(d)], [Shard(d), None, None]) for d in range(x.ndim) if d != dim % x.ndim]
                return [([Replicate()], [Replicate(), None, None]), *kept]

            self._check_cat_and_split()
        self.assertEqual(set(asked), {"cat", "split"})

    @with_comms
    def _check_cat_and_split(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        a, b = randn(8, 3, seed=19), randn(8, 5, seed=20)
        a_dt, b_dt = distribute_tensor(a, mesh, [Shard(0)]), distribute_tensor(b, mesh, [Shard(0)])
        with replicate_fallback(False), CommDebugMode() as comm:
            joined = torch.cat([a_dt, b_dt], dim=1)
            pieces = torch.split(joined, 2, dim=1)
        self.assertEqual(comm.get_total_counts(), 0)
        self.assertEqual(joined.placements, (Shard(0),))
        self.assertEqual([p.placements for p in pieces], [(Shard(0),)] * 4)
        for piece, expected in zip(pieces, torch.split(torch.cat([a, b], dim=1), 2, dim=1)):
            torch.testing.assert_close(piece.full_tensor(), expected)

    def test_ops_with_their_own_local_computation_keep_it(self) -> None:
        # a vocab-sharded embedding looks up only the rows a rank holds (its built-in local step);
        # the user's rule decides the placements, the op's local step still masks the other rows
        with rules_restored(aten.embedding.default):

            @register_sharding(aten.embedding.default)
            def vocab_parallel(weight: Any, indices: Any, *flags: Any) -> list[Any]:
                no_flags = [None] * len(flags)
                return [
                    ([Partial()], [Shard(0), Replicate(), *no_flags]),
                    ([Replicate()], [Replicate(), Replicate(), *no_flags]),
                ]

            self._check_vocab_parallel_embedding()

    @with_comms
    def _check_vocab_parallel_embedding(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        weight, indices = randn(10, 4, seed=21), torch.tensor([[0, 9, 3], [5, 5, 1]])
        w_dt, i_dt = distribute_tensor(weight, mesh, [Shard(0)]), distribute_tensor(indices, mesh, [Replicate()])
        with CommDebugMode() as comm:
            rows = torch.nn.functional.embedding(i_dt, w_dt)
        self.assertEqual((rows.placements, comm.get_total_counts()), ((Partial(),), 0))
        torch.testing.assert_close(rows.full_tensor(), torch.nn.functional.embedding(indices, weight))

    def test_a_wrong_strategy_is_an_error_not_a_wrong_answer(self) -> None:
        op = torch.ops.spmd_experimental_test.scale.default
        with rules_restored(op):

            @register_sharding(op)
            def forgets_the_input(x: Any, factor: float) -> list[Any]:
                return [([Replicate()], [None, None])]

            self._expect_error(ValueError, "gives 0 input placements but the call has 1 DTensor inputs")

            @register_sharding(op)
            def shards_a_missing_dim(x: Any, factor: float) -> list[Any]:
                return [([Shard(2)], [Shard(2), None])]

            self._expect_error(ValueError, r"S\(2\) for input 0 is out of range for a 2-d tensor")

    @with_comms
    def _expect_error(self, kind: type[Exception], message: str) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x_dt = distribute_tensor(randn(8, 6, seed=16), mesh, [Shard(0)])
        with pytest.raises(kind, match=message):
            scale(x_dt, 2.0)

    def test_ops_a_rule_would_never_decide_are_refused_or_warned(self) -> None:
        with pytest.raises(NotImplementedError, match=r"register aten\.add\.Tensor instead"):
            register_sharding(aten.add.out)
        with pytest.raises(NotImplementedError, match="list ops"):
            register_sharding(aten._foreach_add.List)
        with rules_restored(aten.softmax.int), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            register_sharding(aten.softmax.int)(lambda x, dim, dtype=None: [([Replicate()], [Replicate()])])
        self.assertTrue(any("CompositeImplicitAutograd" in str(w.message) for w in caught))


class ImplicitReplicationTest(DTensorTestBase):
    @with_comms
    def test_plain_tensor_counts_as_replicated(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x, bias = randn(8, 4, seed=17), randn(8, 4, seed=18)
        x_dt = distribute_tensor(x, mesh, [Shard(0)])
        with pytest.raises(RuntimeError, match=r"plain torch\.Tensor"):
            x_dt + bias
        with implicit_replication():
            y = x_dt + bias
        self.assertEqual(y.placements, (Shard(0),))
        torch.testing.assert_close(y.full_tensor(), x + bias)
