"""check_against_torch: plain torch is the oracle, forward and backward, with messages that say what differs."""

from __future__ import annotations

import torch

from spmd.tensor import DTensor, Partial, Replicate, Shard, init_device_mesh
from spmd.testing import DTensorTestBase, check_against_torch, seeded_randint, seeded_randn, with_comms

R, S0, S1 = Replicate(), Shard(0), Shard(1)


def doubled_on_dtensors(t: torch.Tensor) -> torch.Tensor:
    """A deliberately wrong "op": right on plain tensors, twice the value on DTensors."""
    return t * 2 if isinstance(t, DTensor) else t


def wrong_gradient_on_dtensors(t: torch.Tensor) -> torch.Tensor:
    """Right values everywhere, but on DTensors the gradient is 3x instead of 1x."""
    return t * 3 - 2 * t.detach() if isinstance(t, DTensor) else t


class CheckAgainstTorchTest(DTensorTestBase):
    @with_comms
    def test_a_correct_op_passes_on_every_layout_and_returns_the_dtensor(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        a, b = seeded_randn(7, 5, seed=1).requires_grad_(), seeded_randn(5, 6, seed=2).requires_grad_()
        for layouts in ([[S0, R], [R, S1]], [[R, S1], [S0, R]], [[Partial(), R], [R, R]]):
            out = check_against_torch(torch.mm, a, b, placements=layouts, mesh=mesh)
            self.assertIsInstance(out, DTensor)

    @with_comms
    def test_non_tensor_arguments_tuples_and_integer_inputs(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x = seeded_randn(8, 6).requires_grad_()
        check_against_torch(torch.softmax, x, -1, placements=[[S0], None], mesh=mesh)
        _, indices = check_against_torch(torch.sort, x, 1, placements=[[S0], None], mesh=mesh)
        self.assertEqual(indices.dtype, torch.int64)
        table, ids = seeded_randn(10, 4).requires_grad_(), seeded_randint(10, 3, 5)
        check_against_torch(torch.nn.functional.embedding, ids, table, placements=[[R], [R]], mesh=mesh)

    @with_comms
    def test_the_entered_mesh_is_the_default_and_collectives_can_be_counted(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x = seeded_randn(8, 6).requires_grad_()
        with mesh:
            check_against_torch(torch.sum, x, placements=[[S0]], collectives=0)
            with self.assertRaisesRegex(AssertionError, "expected 0 collectives in the forward, got 1"):
                check_against_torch(
                    lambda t: t.redistribute(placements=[R]) if isinstance(t, DTensor) else t,
                    x,
                    placements=[[S0]],
                    collectives=0,
                )

    @with_comms
    def test_a_wrong_value_names_the_output_and_the_layout(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        with self.assertRaisesRegex(
            AssertionError, r"doubled_on_dtensors on inputs laid out as \(\[S\(0\)\]\) .*output 0 differs"
        ):
            check_against_torch(doubled_on_dtensors, seeded_randn(8, 2), placements=[[S0]], mesh=mesh)

    @with_comms
    def test_a_wrong_gradient_names_the_input(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x = seeded_randn(8, 2).requires_grad_()
        with self.assertRaisesRegex(AssertionError, "gradient of input 0 differs"):
            check_against_torch(wrong_gradient_on_dtensors, x, placements=[[S1]], mesh=mesh)
        # without requires_grad only the values are compared, and they agree
        check_against_torch(wrong_gradient_on_dtensors, x.detach(), placements=[[S1]], mesh=mesh)

    @with_comms
    def test_placements_must_match_the_inputs(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        with self.assertRaisesRegex(ValueError, "got 2 inputs but 1 placements"):
            check_against_torch(torch.add, seeded_randn(4), seeded_randn(4), placements=[[R]], mesh=mesh)
        with self.assertRaisesRegex(ValueError, "input 1 is a int, not a plain tensor; give it None"):
            check_against_torch(torch.softmax, seeded_randn(4), 0, placements=[[R], [R]], mesh=mesh)


def test_seeded_helpers_give_the_same_values_for_the_same_seed() -> None:
    torch.testing.assert_close(seeded_randn(3, 4, seed=5), seeded_randn(3, 4, seed=5))
    assert not torch.equal(seeded_randn(3, 4, seed=5), seeded_randn(3, 4, seed=6))
    ids = seeded_randint(10, 200, seed=1, low=3)
    assert ids.dtype == torch.int64 and ids.shape == (200,)
    assert int(ids.min()) >= 3 and int(ids.max()) < 10
    assert torch.equal(ids, seeded_randint(10, 200, seed=1, low=3))


class WorldSizeAttributeTest(DTensorTestBase):
    world_size = 2

    @with_comms
    def test_a_class_attribute_sets_the_world(self) -> None:
        self.assertEqual(init_device_mesh("cpu", (2,)).size(), 2)
        self.assertIn(self.rank, (0, 1))
        self.assertEqual(DTensorTestBase.world_size, 4)  # the base keeps its default
