"""Elementwise losses on DTensors equal plain torch, forward and backward, for every reduction and layout."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from spmd.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.testing import DTensorTestBase, check_against_torch, seeded_randint, seeded_randn, with_comms
from spmd.testing.layouts import make_dtensor

aten = torch.ops.aten
R, S0, S1, S2 = Replicate(), Shard(0), Shard(1), Shard(2)
SUM, AVG = Partial("sum"), Partial("avg")
EVEN, UNEVEN = (8, 4), (7, 5)  # over 4 ranks: 7 -> 2, 2, 2, 1; 5 -> 2, 2, 1, 0 (an empty shard)
REDUCTIONS = ["none", "sum", "mean"]
# kl_div warns that 'mean' will mean 'batchmean' one day; today's meaning is the one compared.
pytestmark = pytest.mark.filterwarnings("ignore:reduction. .mean. divides the total loss:UserWarning")


randn = functools.partial(seeded_randn, dtype=torch.float64)


@dataclass(frozen=True)
class Loss:
    """A loss call ``fn(input, target, *extras, reduction=...)`` and how to make its operands."""

    name: str
    fn: Callable[..., torch.Tensor]
    make: Callable[[tuple[int, ...]], list[torch.Tensor]]
    target_grad: bool = True
    """Whether torch differentiates the loss with respect to the target."""

    def __repr__(self) -> str:
        return self.name


def regression(shape: tuple[int, ...]) -> list[torch.Tensor]:
    return [randn(*shape), randn(*shape, seed=1)]


def probabilities(shape: tuple[int, ...]) -> list[torch.Tensor]:
    return [torch.sigmoid(randn(*shape)), torch.sigmoid(randn(*shape, seed=1))]


def signs(shape: tuple[int, ...]) -> list[torch.Tensor]:
    return [randn(*shape), randn(*shape, seed=1).sign()]


def with_weight(make: Callable[[tuple[int, ...]], list[torch.Tensor]]) -> Callable[[tuple[int, ...]], list[torch.Tensor]]:
    return lambda shape: [*make(shape), randn(*shape, seed=2).abs()]


def logits_with_pos_weight(shape: tuple[int, ...]) -> list[torch.Tensor]:
    """pos_weight has one entry per class (the last dim), broadcast over the rest."""
    return [randn(*shape), torch.sigmoid(randn(*shape, seed=1)), randn(*shape, seed=2).abs(), randn(shape[-1], seed=3).abs()]


def class_targets(shape: tuple[int, ...]) -> list[torch.Tensor]:
    """Scores (N, C), one class per sample, and a class weight."""
    target = seeded_randint(shape[-1], *shape[:-1], seed=1)
    return [randn(*shape), target, randn(shape[-1], seed=2).abs()]


def multilabel_targets(shape: tuple[int, ...]) -> list[torch.Tensor]:
    """Scores (N, C) and each sample's classes, ended by -1 (where there are fewer than C)."""
    generator = torch.Generator().manual_seed(1)
    target = torch.randint(0, shape[-1], shape, generator=generator)
    target[torch.rand(shape, generator=generator) < 0.3] = -1
    return [randn(*shape), target]


def log_probabilities(shape: tuple[int, ...]) -> list[torch.Tensor]:
    return [torch.log_softmax(randn(*shape), -1), torch.log_softmax(randn(*shape, seed=1), -1)]


LOSSES = [
    Loss("mse", F.mse_loss, regression),
    Loss("l1", F.l1_loss, regression),
    Loss("smooth_l1", lambda x, t, reduction: F.smooth_l1_loss(x, t, reduction=reduction, beta=0.5), regression),
    Loss("huber", lambda x, t, reduction: F.huber_loss(x, t, reduction=reduction, delta=0.7), regression),
    Loss("soft_margin", F.soft_margin_loss, signs, target_grad=False),
    Loss("bce", F.binary_cross_entropy, probabilities, target_grad=False),
    Loss("bce(weight)", lambda x, t, w, reduction: F.binary_cross_entropy(x, t, w, reduction=reduction),
         with_weight(probabilities), target_grad=False),
    Loss("bce_with_logits", F.binary_cross_entropy_with_logits, probabilities),
    Loss("bce_with_logits(weight, pos_weight)",
         lambda x, t, w, pw, reduction: F.binary_cross_entropy_with_logits(x, t, w, pos_weight=pw, reduction=reduction),
         logits_with_pos_weight),
    Loss("multilabel_soft_margin (log_sigmoid)", F.multilabel_soft_margin_loss, probabilities, target_grad=False),
    Loss("multi_margin(p=2, weight)",
         lambda x, t, w, reduction: F.multi_margin_loss(x, t, p=2, margin=0.8, weight=w, reduction=reduction),
         class_targets, target_grad=False),
    Loss("multilabel_margin", F.multilabel_margin_loss, multilabel_targets, target_grad=False),
    Loss("kl_div(log_target)", lambda x, t, reduction: F.kl_div(x, t, reduction=reduction, log_target=True),
         log_probabilities),
]


class LossTest(DTensorTestBase):
    def check(self, mesh: Any, loss: Loss, reduction: str, layout: Sequence[Any], shape: tuple[int, ...]) -> None:
        """Input, target and weight laid out as ``layout`` (pos_weight, class weights R; a target of one
        class per sample follows the batch shards): values and gradients equal torch's."""
        fulls = loss.make(shape)
        layouts = [
            layout if f.shape == shape else [p if p == S0 and f.shape == shape[:1] else R for p in layout]
            for f in fulls
        ]
        grads = [True, loss.target_grad] + [False] * (len(fulls) - 2)
        inputs = [f.requires_grad_(g) for f, g in zip(fulls, grads)]
        check_against_torch(functools.partial(loss.fn, reduction=reduction), *inputs, placements=layouts, mesh=mesh)

    @with_comms
    def test_every_loss_on_a_1d_mesh(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        self.run_subtests(
            {"loss": LOSSES, "reduction": REDUCTIONS, "layout": [[R], [S0], [S1]], "shape": [EVEN, UNEVEN]},
            self.check,
            mesh,
        )

    @with_comms
    def test_every_loss_on_a_2d_mesh(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        layouts = [[S0, S1], [S1, S0], [S0, S0], [R, S1]]
        self.run_subtests(
            {"loss": LOSSES, "reduction": REDUCTIONS, "layout": layouts, "shape": [EVEN, UNEVEN]}, self.check, mesh
        )

    @with_comms
    def test_three_d_inputs(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        losses = [loss for loss in LOSSES if loss.name in ("mse", "bce(weight)", "bce_with_logits(weight, pos_weight)")]
        self.run_subtests(
            {"loss": losses, "reduction": REDUCTIONS, "layout": [[S0, S2], [S2, S1]]}, self.check, mesh, shape=(3, 4, 6)
        )

    @with_comms
    def test_partial_inputs_are_reduced_first(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        losses = [loss for loss in LOSSES if loss.name in ("mse", "huber", "bce_with_logits")]
        self.run_subtests(
            {"loss": losses, "reduction": REDUCTIONS, "layout": [[SUM], [AVG]]}, self.check, mesh, shape=UNEVEN
        )

    def run_loss(self, op: Any, mesh: Any, layout: Sequence[Any], shape: tuple[int, ...], reduction: str) -> tuple[DTensor, int]:
        x_full, t_full = randn(*shape), randn(*shape, seed=1)
        x, t = distribute_tensor(x_full, mesh, layout), distribute_tensor(t_full, mesh, layout)
        with CommDebugMode() as comm:
            out = op(x, t, reduction=reduction)
        torch.testing.assert_close(out.full_tensor(), op(x_full, t_full, reduction=reduction))
        return out, comm.get_total_counts()

    @with_comms
    def test_sharded_losses_move_no_data(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        for op in [F.mse_loss, F.smooth_l1_loss, F.huber_loss, F.soft_margin_loss]:
            for layout, shape, reduction, expected in [
                ([S0], UNEVEN, "none", S0),
                ([S1], UNEVEN, "sum", SUM),
                ([S0], EVEN, "mean", AVG),
                ([S1], EVEN, "mean", AVG),
                ([S0], UNEVEN, "mean", SUM),  # uneven: a sum of local sums, divided by 35
            ]:
                out, collectives = self.run_loss(op, mesh, layout, shape, reduction)
                self.assertEqual((collectives, out.placements), (0, (expected,)), f"{op.__name__} {reduction}")
        mesh_2d = init_device_mesh("cpu", (2, 2))
        out, collectives = self.run_loss(F.mse_loss, mesh_2d, [S0, S1], EVEN, "mean")
        self.assertEqual((collectives, out.placements), (0, (AVG, AVG)))
        out, collectives = self.run_loss(F.mse_loss, mesh_2d, [S1, S0], UNEVEN, "sum")
        self.assertEqual((collectives, out.placements), (0, (SUM, SUM)))

    @with_comms
    def test_backward_keeps_the_input_shards(self) -> None:
        """A replicated 0-d gradient flows back to the input's shards without a collective, 'mean' included."""
        mesh = init_device_mesh("cpu", (2, 2))
        cases = [
            (aten.mse_loss_backward.default, ()),
            (aten.smooth_l1_loss_backward.default, (0.5,)),
            (aten.huber_loss_backward.default, (0.7,)),
            (aten.soft_margin_loss_backward.default, ()),
        ]
        x_full, t_full = randn(*UNEVEN), randn(*UNEVEN, seed=1)
        for op, extra in cases:
            for reduction in (1, 2):  # mean, sum
                grad_full = randn(seed=3)
                x, t = distribute_tensor(x_full, mesh, [S0, S1]), distribute_tensor(t_full, mesh, [S0, S1])
                grad = distribute_tensor(grad_full, mesh, [R, R])
                with CommDebugMode() as comm:
                    got = op(grad, x, t, reduction, *extra)
                self.assertEqual((comm.get_total_counts(), got.placements), (0, (S0, S1)), f"{op} {reduction}")
                torch.testing.assert_close(got.full_tensor(), op(grad_full, x_full, t_full, reduction, *extra))
        # a pending gradient passes through the 'none' backward (linear in grad)
        grad_full = randn(*UNEVEN, seed=4)
        grad = make_dtensor(grad_full, mesh, [SUM, R])
        x, t = distribute_tensor(x_full, mesh, [R, R]), distribute_tensor(t_full, mesh, [R, R])
        with CommDebugMode() as comm:
            got = aten.mse_loss_backward.default(grad, x, t, 0)
        self.assertEqual((comm.get_total_counts(), got.placements), (0, (SUM, R)))
        torch.testing.assert_close(got.full_tensor(), aten.mse_loss_backward.default(grad_full, x_full, t_full, 0))

    @with_comms
    def test_margin_losses_over_a_batch_shard_move_no_data(self) -> None:
        """Forward only: their backward ops have no meta kernel, so they run through the fallback."""
        mesh = init_device_mesh("cpu", (4,))
        for shape, reduction, expected in [(UNEVEN, "none", S0), (UNEVEN, "sum", SUM), (EVEN, "mean", AVG),
                                           (UNEVEN, "mean", SUM)]:
            x_full, target_full, weight_full = class_targets(shape)
            x = distribute_tensor(x_full, mesh, [S0])
            target = distribute_tensor(target_full, mesh, [S0])
            weight = distribute_tensor(weight_full, mesh, [R])
            with CommDebugMode() as comm:
                out = F.multi_margin_loss(x, target, weight=weight, reduction=reduction)
            self.assertEqual((comm.get_total_counts(), out.placements), (0, (expected,)), reduction)
            torch.testing.assert_close(
                out.full_tensor(), F.multi_margin_loss(x_full, target_full, weight=weight_full, reduction=reduction)
            )

    @with_comms
    def test_margin_losses_gather_a_batch_with_an_empty_piece(self) -> None:
        """torch's kernels return uninitialised memory for an empty batch with 'sum' or 'mean'."""
        mesh = init_device_mesh("cpu", (4,))
        for make, fn in [(class_targets, lambda x, t, *w, reduction: F.multi_margin_loss(x, t, reduction=reduction)),
                         (multilabel_targets, F.multilabel_margin_loss)]:
            fulls = make((3, 5))  # 3 samples over 4 ranks: one rank has none
            for reduction in REDUCTIONS:
                x, target = distribute_tensor(fulls[0], mesh, [S0]), distribute_tensor(fulls[1], mesh, [S0])
                out = fn(x, target, reduction=reduction)
                torch.testing.assert_close(out.full_tensor(), fn(*fulls[:2], reduction=reduction))
                self.assertFalse(any(p.is_partial() for p in out.placements))

    @with_comms
    def test_log_sigmoid_keeps_shards_forward_and_backward(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        full = randn(*UNEVEN)
        x = distribute_tensor(full, mesh, [S0, S1]).requires_grad_()
        with CommDebugMode() as comm:
            out = F.logsigmoid(x)
        self.assertEqual((comm.get_total_counts(), out.placements), (0, (S0, S1)))
        grad = distribute_tensor(randn(*UNEVEN, seed=5), mesh, [S0, S1])
        with CommDebugMode() as comm:
            (got,) = torch.autograd.grad(out, [x], grad)
        self.assertEqual((comm.get_total_counts(), got.placements), (0, (S0, S1)))
        reference = full.clone().requires_grad_()
        F.logsigmoid(reference).backward(randn(*UNEVEN, seed=5))
        torch.testing.assert_close(out.full_tensor(), F.logsigmoid(full))
        torch.testing.assert_close(got.full_tensor(), reference.grad)
