"""Softmax, norms, losses, convolution and embedding on DTensors: values and gradients equal plain torch."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from spmd.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.testing import DTensorTestBase, check_against_torch, run_threaded, seeded_randint, seeded_randn, with_comms
from spmd.testing.layouts import make_dtensor

aten = torch.ops.aten
R, S0, S1, S2, S3 = Replicate(), Shard(0), Shard(1), Shard(2), Shard(3)
SUM = Partial("sum")


randn = functools.partial(seeded_randn, dtype=torch.float64)


def grads_without_comms(test: DTensorTestBase, out: DTensor, inputs: Sequence[DTensor]) -> tuple[DTensor, ...]:
    """Backward from a gradient laid out like ``out``; asserts that no collective runs."""
    grad = distribute_tensor(randn(*out.shape, seed=98), out.device_mesh, out.placements)
    with CommDebugMode() as comm:
        grads = torch.autograd.grad(out, tuple(inputs), grad)
    test.assertEqual(comm.get_total_counts(), 0)
    return grads


class SoftmaxTest(DTensorTestBase):
    @with_comms
    def test_softmax_and_log_softmax(self) -> None:
        x = randn(7, 5, 6).requires_grad_()
        layouts_1d = [[R], [S0], [S1], [S2], [SUM]]
        layouts_2d = [[S0, S1], [S2, S0], [S1, S1]]
        for mesh_shape, layouts in [((4,), layouts_1d), ((2, 2), layouts_2d)]:
            mesh = init_device_mesh("cpu", mesh_shape)
            self.run_subtests(
                {"fn": [torch.softmax, torch.log_softmax], "dim": [0, 1, -1], "layout": layouts},
                lambda m, fn, dim, layout: check_against_torch(lambda t: fn(t, dim), x, placements=[layout], mesh=m),
                mesh,
            )

    @with_comms
    def test_softmax_on_unsharded_dim_moves_no_data(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        for fn in [torch.softmax, torch.log_softmax]:
            x = distribute_tensor(randn(7, 5, 6), mesh, [S0, S1]).requires_grad_()
            with CommDebugMode() as comm:
                out = fn(x, -1)
            self.assertEqual(comm.get_total_counts(), 0)
            self.assertEqual(out.placements, (S0, S1))
            (grad,) = grads_without_comms(self, out, [x])
            self.assertEqual(grad.placements, (S0, S1))
        # the softmax dim itself is gathered first
        x = distribute_tensor(randn(7, 5, 6), mesh, [S0, S2])
        out = torch.softmax(x, -1)
        self.assertEqual(out.placements[0], S0)
        torch.testing.assert_close(out.full_tensor(), torch.softmax(randn(7, 5, 6), -1))

    @with_comms
    def test_softmax_backward_takes_partial_gradient(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        out_full = torch.softmax(randn(7, 6), -1)
        grad_full = randn(7, 6, seed=1)
        for op, y in [(aten._softmax_backward_data.default, out_full),
                      (aten._log_softmax_backward_data.default, out_full.log())]:
            grad, out = make_dtensor(grad_full, mesh, [SUM]), distribute_tensor(y, mesh, [R])
            with CommDebugMode() as comm:
                result = op(grad, out, -1, torch.float64)
            self.assertEqual(comm.get_total_counts(), 0)
            self.assertEqual(result.placements, (SUM,))
            torch.testing.assert_close(result.full_tensor(), op(grad_full, y, -1, torch.float64))


class NormTest(DTensorTestBase):
    @with_comms
    def test_layer_norm(self) -> None:
        x, w, b = (randn(7, 3, 8).requires_grad_(), randn(8, seed=1).requires_grad_(),
                   randn(8, seed=2).requires_grad_())
        w2, b2 = randn(3, 8, seed=3).requires_grad_(), randn(3, 8, seed=4).requires_grad_()
        mesh = init_device_mesh("cpu", (4,))
        self.run_subtests(
            {"layout": [[R], [S0], [S1], [S2], [SUM]]},
            lambda layout: (
                check_against_torch(lambda t, ww, bb: F.layer_norm(t, (8,), ww, bb), x, w, b, mesh=mesh,
                                    placements=[layout, [R], [R]]),
                check_against_torch(lambda t, ww, bb: F.layer_norm(t, (3, 8), ww, bb), x, w2, b2, mesh=mesh,
                                    placements=[layout, [R], [S0]]),
                check_against_torch(lambda t: F.layer_norm(t, (8,)), x, placements=[layout], mesh=mesh),
            ),
        )
        mesh2 = init_device_mesh("cpu", (2, 2))
        self.run_subtests(
            {"layout": [[S0, S1], [S1, S0], [S0, S2]]},
            lambda layout: check_against_torch(lambda t, ww, bb: F.layer_norm(t, (8,), ww, bb), x, w, b, mesh=mesh2,
                                               placements=[layout, [R, R], [R, R]]),
        )

    @with_comms
    def test_layer_norm_batch_sharded_weight_grads_are_partial(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        x = distribute_tensor(randn(7, 3, 8), mesh, [S0, S1]).requires_grad_()
        w = distribute_tensor(randn(8, seed=1), mesh, [R, R]).requires_grad_()
        b = distribute_tensor(randn(8, seed=2), mesh, [R, R]).requires_grad_()
        with CommDebugMode() as comm:
            out, mean, rstd = aten.native_layer_norm(x, [8], w, b, 1e-5)
        self.assertEqual(comm.get_total_counts(), 0)
        self.assertEqual((out.placements, mean.placements, rstd.placements), ((S0, S1),) * 3)
        grad = distribute_tensor(randn(7, 3, 8, seed=3), mesh, [S0, S1])
        with CommDebugMode() as comm:
            gx, gw, gb = aten.native_layer_norm_backward(grad, x, [8], mean, rstd, w, b, [True, True, True])
        self.assertEqual(comm.get_total_counts(), 0)
        self.assertEqual((gx.placements, gw.placements, gb.placements), ((S0, S1), (SUM, SUM), (SUM, SUM)))
        xs = [randn(7, 3, 8).requires_grad_(), randn(8, seed=1).requires_grad_(), randn(8, seed=2).requires_grad_()]
        F.layer_norm(xs[0], (8,), xs[1], xs[2]).backward(randn(7, 3, 8, seed=3))
        for got, t in zip([gx, gw, gb], xs):
            torch.testing.assert_close(got.full_tensor(), t.grad)

    @with_comms
    def test_rms_norm(self) -> None:
        """F.rms_norm reaches us decomposed (pow, mean, add_, rsqrt, mul) in torch's CPU build."""
        x, w = randn(7, 3, 8).requires_grad_(), randn(8, seed=1).requires_grad_()
        mesh = init_device_mesh("cpu", (4,))
        self.run_subtests(
            {"layout": [[R], [S0], [S1], [S2]]},
            lambda layout: check_against_torch(lambda t, ww: F.rms_norm(t, (8,), ww, eps=1e-6), x, w, mesh=mesh,
                                               placements=[layout, [R]]),
        )
        xd, wd = distribute_tensor(x, mesh, [S0]), distribute_tensor(w, mesh, [R])
        with CommDebugMode() as comm:
            out = F.rms_norm(xd, (8,), wd)
        self.assertEqual(comm.get_total_counts(), 0)
        self.assertEqual(out.placements, (S0,))

    @with_comms
    def test_gelu_and_silu(self) -> None:
        x = randn(7, 6).requires_grad_()
        mesh = init_device_mesh("cpu", (2, 2))
        fns = [F.gelu, lambda t: F.gelu(t, approximate="tanh"), F.silu]
        self.run_subtests(
            {"fn": fns, "layout": [[R, R], [S0, S1], [S1, S0], [S0, S0]]},
            lambda fn, layout: check_against_torch(fn, x, placements=[layout], mesh=mesh),
        )
        for fn in fns:
            xd = distribute_tensor(x, mesh, [S0, S1]).requires_grad_()
            out = fn(xd)
            (grad,) = grads_without_comms(self, out, [xd])
            self.assertEqual(grad.placements, (S0, S1))


class LossTest(DTensorTestBase):
    @with_comms
    def test_nll_loss_and_cross_entropy(self) -> None:
        logits, target, class_weight = randn(7, 5).requires_grad_(), seeded_randint(5, 7, seed=1), randn(5, seed=2).abs()
        target_ignored = target.clone()
        target_ignored[2] = -100
        mesh = init_device_mesh("cpu", (4,))
        cases = [
            (lambda x, t: F.cross_entropy(x, t), [logits, target]),
            (lambda x, t: F.cross_entropy(x, t, reduction="sum"), [logits, target]),
            (lambda x, t: F.cross_entropy(x, t, reduction="none"), [logits, target]),
            (lambda x, t, w: F.cross_entropy(x, t, w), [logits, target_ignored, class_weight]),
            (lambda x, t, w: F.nll_loss(x, t, w, reduction="sum"), [logits, target_ignored, class_weight]),
            (lambda x, t: F.nll_loss(x, t, reduction="none"), [logits, target_ignored]),
        ]
        self.run_subtests(
            {"case": cases, "layout": [[[R], [R]], [[S0], [S0]], [[S1], [R]], [[S0], [R]], [[SUM], [R]]]},
            lambda case, layout: check_against_torch(case[0], *case[1], mesh=mesh,
                                                     placements=[*layout, [R]][: len(case[1])]),
        )
        mesh2 = init_device_mesh("cpu", (2, 2))
        self.run_subtests(
            {"case": cases, "layout": [[[S0, S0], [S0, S0]], [[S0, S1], [S0, R]]]},
            lambda case, layout: check_against_torch(case[0], *case[1], mesh=mesh2,
                                                     placements=[*layout, [R, R]][: len(case[1])]),
        )

    @with_comms
    def test_nll_loss_2d(self) -> None:
        x, target = randn(3, 4, 5, 6).requires_grad_(), seeded_randint(4, 3, 5, 6, seed=1)
        mesh = init_device_mesh("cpu", (4,))
        self.run_subtests(
            {"reduction": ["mean", "sum", "none"], "layout": [[[S0], [S0]], [[S2], [S1]], [[S3], [S2]], [[S1], [R]]]},
            lambda reduction, layout: check_against_torch(
                lambda a, t: F.cross_entropy(a, t, reduction=reduction), x, target, placements=layout, mesh=mesh
            ),
        )

    @with_comms
    def test_batch_sharded_loss_communication(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        logp_full = torch.log_softmax(randn(8, 5), -1)
        target_full = seeded_randint(5, 8, seed=1)
        target = distribute_tensor(target_full, mesh, [S0])
        # 'sum' stays local: loss and total_weight are partial sums
        logp = distribute_tensor(logp_full, mesh, [S0]).requires_grad_()
        with CommDebugMode() as comm:
            loss, total = aten.nll_loss_forward(logp, target, None, 2, -100)
        self.assertEqual(comm.get_total_counts(), 0)
        self.assertEqual((loss.placements, total.placements), ((SUM,), (SUM,)))
        torch.testing.assert_close(loss.full_tensor(), F.nll_loss(logp_full, target_full, reduction="sum"))
        # its backward neither gathers the input nor reduces total_weight
        grad = distribute_tensor(torch.tensor(1.0, dtype=torch.float64), mesh, [R])
        with CommDebugMode() as comm:
            grad_in = aten.nll_loss_backward(grad, logp, target, None, 2, -100, total)
        self.assertEqual(comm.get_total_counts(), 0)
        self.assertEqual(grad_in.placements, (S0,))
        # 'mean' gathers in the forward (a mean of local means is not the mean); the backward stays local
        loss, total = aten.nll_loss_forward(logp, target, None, 1, -100)
        self.assertEqual((loss.placements, total.placements), ((R,), (R,)))
        with CommDebugMode() as comm:
            grad_in = aten.nll_loss_backward(grad, logp, target, None, 1, -100, total)
        self.assertEqual(comm.get_total_counts(), 0)
        self.assertEqual(grad_in.placements, (S0,))
        expected = torch.autograd.grad(F.nll_loss(logp_full.requires_grad_(), target_full), logp_full)[0]
        torch.testing.assert_close(grad_in.full_tensor(), expected)


class ConvolutionTest(DTensorTestBase):
    @with_comms
    def test_conv2d_layouts(self) -> None:
        x, w, b = (randn(5, 4, 6, 6).requires_grad_(), randn(6, 4, 3, 3, seed=1).requires_grad_(),
                   randn(6, seed=2).requires_grad_())
        mesh = init_device_mesh("cpu", (4,))
        fn = lambda a, ww, bb: F.conv2d(a, ww, bb, padding=1, stride=(2, 1))  # noqa: E731
        layouts = [
            [[S0], [R], [R]],  # batch (5 over 4: uneven)
            [[R], [S0], [S0]],  # output channels
            [[S1], [S1], [R]],  # input channels: partial sum, bias added once
            [[S2], [R], [R]],  # spatial: gathered
            [[SUM], [R], [R]],
            [[R], [SUM], [R]],
        ]
        self.run_subtests(
            {"layout": layouts}, lambda layout: check_against_torch(fn, x, w, b, placements=layout, mesh=mesh)
        )
        mesh2 = init_device_mesh("cpu", (2, 2))
        self.run_subtests(
            {"layout": [[[S0, R], [R, S0], [R, S0]], [[S0, S1], [R, S1], [R, R]]]},
            lambda layout: check_against_torch(fn, x, w, b, placements=layout, mesh=mesh2),
        )

    @with_comms
    def test_conv_variants(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        cases = [
            (lambda a, ww: F.conv1d(a, ww), randn(5, 4, 9), randn(6, 4, 3, seed=1)),
            (lambda a, ww: F.conv2d(a, ww, groups=2), randn(5, 4, 6, 6), randn(6, 2, 3, 3, seed=1)),
            (lambda a, ww: F.conv_transpose2d(a, ww, stride=2), randn(5, 4, 3, 3), randn(4, 6, 3, 3, seed=1)),
        ]
        self.run_subtests(
            {"case": cases, "layout": [[[S0], [R]], [[R], [S0]], [[R], [S1]], [[S1], [S0]], [[S1], [S1]]]},
            lambda case, layout: check_against_torch(
                case[0], case[1].requires_grad_(), case[2].requires_grad_(), placements=layout, mesh=mesh
            ),
        )

    @with_comms
    def test_batch_sharded_conv_moves_no_data(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(randn(8, 4, 6, 6), mesh, [S0]).requires_grad_()
        w = distribute_tensor(randn(6, 4, 3, 3, seed=1), mesh, [R]).requires_grad_()
        b = distribute_tensor(randn(6, seed=2), mesh, [R]).requires_grad_()
        with CommDebugMode() as comm:
            out = F.conv2d(x, w, b, padding=1)
        self.assertEqual(comm.get_total_counts(), 0)
        self.assertEqual(out.placements, (S0,))
        gx, gw, gb = grads_without_comms(self, out, [x, w, b])
        self.assertEqual((gx.placements, gw.placements, gb.placements), ((S0,), (SUM,), (SUM,)))


class PaddingTest(DTensorTestBase):
    CASES = [
        # (mode, input shape, pad): reflect needs each pad smaller than its dim
        ("reflect", (5, 3, 7), (2, 1)),
        ("replicate", (5, 3, 7), (0, 3)),
        ("reflect", (5, 3, 6, 7), (1, 2, 2, 0)),
        ("replicate", (5, 3, 6, 7), (0, 0, 1, 2)),  # the last dim is left alone
        ("reflect", (3, 2, 4, 5, 6), (1, 1, 2, 0, 1, 2)),
        ("replicate", (3, 2, 4, 5, 6), (2, 1, 0, 1, 1, 0)),
        ("constant", (5, 3, 7), (1, 2, 0, 0, 2, 1)),  # pads dims 2 and 0, not 1
        ("constant", (5, 3, 6, 7), (-1, 2, 1, -2)),  # negative pads crop
        ("circular", (5, 3, 7), (2, 1)),
    ]

    @with_comms
    def test_every_pad_mode_and_layout(self) -> None:
        def check(mesh: Any, case: tuple[str, tuple[int, ...], tuple[int, ...]], layout: list[Any]) -> None:
            mode, shape, pad = case
            value = 0.5 if mode == "constant" else None
            check_against_torch(
                lambda t: F.pad(t, pad, mode=mode, value=value), randn(*shape).requires_grad_(),
                placements=[layout], mesh=mesh,
            )

        mesh = init_device_mesh("cpu", (4,))
        self.run_subtests({"case": self.CASES, "layout": [[R], [S0], [S1], [S2], [SUM]]}, check, mesh)
        mesh2 = init_device_mesh("cpu", (2, 2))
        self.run_subtests({"case": self.CASES, "layout": [[S0, S1], [S1, S2], [S2, S0]]}, check, mesh2)

    @with_comms
    def test_padding_other_dims_moves_no_data(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        for mode, pad, layout in [
            ("reflect", (2, 1, 1, 1), [S0, S1]),
            ("replicate", (2, 1, 1, 1), [S1, S0]),
            ("reflect", (1, 1, 0, 0), [S0, S2]),  # only the last dim is padded
            ("constant", (2, 1, 1, 1), [S0, S1]),
        ]:
            full = randn(5, 4, 6, 7)  # 4 channels: no rank's piece is empty (the kernels reject that)
            x = distribute_tensor(full, mesh, layout).requires_grad_()
            with CommDebugMode() as comm:
                out = F.pad(x, pad, mode=mode)
            self.assertEqual((comm.get_total_counts(), out.placements), (0, tuple(layout)), mode)
            torch.testing.assert_close(out.full_tensor(), F.pad(full, pad, mode=mode))
            (grad,) = grads_without_comms(self, out, [x])
            self.assertEqual(grad.placements, tuple(layout))
        # a padded dim is gathered first; the other shards stay
        x = distribute_tensor(randn(5, 3, 6, 7), mesh, [S0, S3])
        out = F.pad(x, (1, 1, 0, 0), mode="reflect")
        self.assertEqual(out.placements[0], S0)
        self.assertNotIn(S3, out.placements)

    @with_comms
    def test_pads_pass_partials_through(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        full = randn(5, 3, 7)
        for mode, value, partial, kept in [
            ("reflect", None, SUM, True),
            ("replicate", None, Partial("max"), True),
            ("constant", 0.0, SUM, True),
            ("constant", 0.5, Partial("avg"), True),
            ("constant", 0.5, SUM, False),  # 0.5 on every rank would add up to 2.0
        ]:
            x = make_dtensor(full, mesh, [partial])
            with CommDebugMode() as comm:
                out = F.pad(x, (2, 1), mode=mode, value=value)
            self.assertEqual(out.placements == (partial,), kept, f"{mode} {value} {partial}")
            self.assertEqual(comm.get_total_counts() == 0, kept)
            torch.testing.assert_close(out.full_tensor(), F.pad(full, (2, 1), mode=mode, value=value))

    @with_comms
    def test_conv_with_reflect_padding_on_a_batch_sharded_input_moves_no_data(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        conv = torch.nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect", dtype=torch.float64)
        with torch.no_grad():  # the same weights on every rank thread
            conv.weight.copy_(randn(4, 3, 3, 3, seed=1))
            conv.bias.copy_(randn(4, seed=2))
        x = distribute_tensor(randn(8, 3, 6, 6), mesh, [S0])
        w, b = (distribute_tensor(t.detach(), mesh, [R]) for t in (conv.weight, conv.bias))
        with CommDebugMode() as comm:
            out = F.conv2d(F.pad(x, (1, 1, 1, 1), mode="reflect"), w, b)
        self.assertEqual((comm.get_total_counts(), out.placements), (0, (S0,)))
        torch.testing.assert_close(out.full_tensor(), conv(randn(8, 3, 6, 6)).detach())


class EmbeddingTest(DTensorTestBase):
    @with_comms
    def test_embedding_layouts(self) -> None:
        weight, indices = randn(10, 6).requires_grad_(), seeded_randint(10, 7, 3, seed=1)
        for mesh_shape, layouts in [
            ((4,), [[[R], [R]], [[R], [S0]], [[R], [S1]], [[S1], [R]], [[S0], [R]], [[SUM], [R]], [[S1], [S0]]]),
            ((2, 2), [[[R, S1], [S0, R]], [[S1, S1], [R, R]], [[S0, R], [S0, S1]]]),
        ]:
            mesh = init_device_mesh("cpu", mesh_shape)
            self.run_subtests(
                {"layout": layouts, "kwargs": [{}, {"padding_idx": 2}, {"scale_grad_by_freq": True}]},
                lambda m, layout, kwargs: check_against_torch(
                    lambda w, i: F.embedding(i, w, **kwargs), weight, indices, placements=layout, mesh=m
                ),
                mesh,
            )

    @with_comms
    def test_embedding_placements(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        weight_full, indices_full = randn(10, 8), seeded_randint(10, 8, 3, seed=1)
        indices = distribute_tensor(indices_full, mesh, [S0])
        # replicated table, sharded indices: output sharded like the indices, weight grad P(sum)
        weight = distribute_tensor(weight_full, mesh, [R]).requires_grad_()
        with CommDebugMode() as comm:
            out = F.embedding(indices, weight)
        self.assertEqual(comm.get_total_counts(), 0)
        self.assertEqual(out.placements, (S0,))
        (grad,) = grads_without_comms(self, out, [weight])
        self.assertEqual(grad.placements, (SUM,))
        # column-wise table, replicated indices: output sharded on the embedding dim
        weight = distribute_tensor(weight_full, mesh, [S1]).requires_grad_()
        replicated = distribute_tensor(indices_full, mesh, [R])
        with CommDebugMode() as comm:
            out = F.embedding(replicated, weight)
        self.assertEqual(comm.get_total_counts(), 0)
        self.assertEqual(out.placements, (S2,))
        (grad,) = grads_without_comms(self, out, [weight])
        self.assertEqual(grad.placements, (S1,))
        torch.testing.assert_close(out.full_tensor(), F.embedding(indices_full, weight_full))


class ThreeDimMeshTest(DTensorTestBase):
    world_size = 8

    @with_comms
    def test_norm_loss_and_embedding_on_2x2x2(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2, 2))
        x, w, b = randn(4, 6, 8).requires_grad_(), randn(8, seed=1).requires_grad_(), randn(8, seed=2).requires_grad_()
        check_against_torch(lambda t, ww, bb: F.layer_norm(t, (8,), ww, bb), x, w, b, mesh=mesh,
                            placements=[[S0, S1, S1], [R, R, R], [R, R, R]])
        check_against_torch(lambda t: torch.softmax(t, -1), x, placements=[[S0, S1, S2]], mesh=mesh)
        logits, target = randn(8, 5).requires_grad_(), seeded_randint(5, 8, seed=1)
        check_against_torch(lambda t, y: F.cross_entropy(t, y, reduction="sum"), logits, target, mesh=mesh,
                            placements=[[S0, S0, S0], [S0, S0, S0]])
        weight, indices = randn(10, 8).requires_grad_(), seeded_randint(10, 4, 3, seed=1)
        out = check_against_torch(lambda ww, i: F.embedding(i, ww), weight, indices, mesh=mesh,
                                  placements=[[R, S1, S1], [S0, R, R]])

        self.assertEqual(out.placements, (S0, S2, S2))


def test_row_wise_embedding_is_a_masked_lookup_with_partial_output() -> None:
    table = seeded_randn(10, 4)  # 10 rows over 4 ranks: 3,3,3,1
    indices = torch.tensor([[0, 9, 3], [5, 5, 2]])

    def lookup() -> tuple:
        mesh = init_device_mesh("cpu", (4,))
        weight = distribute_tensor(table, mesh, [Shard(0)]).requires_grad_()
        idx = distribute_tensor(indices, mesh, [Replicate()])
        with CommDebugMode() as comm:
            out = torch.nn.functional.embedding(idx, weight)
        assert comm.get_total_counts() == 0
        assert out.placements == (Partial(),)
        values = out.full_tensor()
        (values * 2).sum().backward()
        return values, weight.grad.full_tensor()

    reference = table.clone().requires_grad_()
    expected = torch.nn.functional.embedding(indices, reference)
    (expected * 2).sum().backward()
    for values, grad in run_threaded(lookup, 4):
        torch.testing.assert_close(values, expected)
        torch.testing.assert_close(grad, reference.grad)


def test_row_wise_embedding_refuses_out_of_range_ids_on_every_rank() -> None:
    """Plain torch raises IndexError for an id outside the table; the masked row-wise lookup must too."""
    from spmd.tensor_parallel import RowwiseParallel, parallelize_module

    def lookup(ids: torch.Tensor) -> str:
        mesh = init_device_mesh("cpu", (4,))
        table = torch.nn.Embedding(10, 4)
        model = parallelize_module(table, mesh, RowwiseParallel())
        try:
            model(ids)
        except IndexError as error:
            return str(error)
        return "no error"

    for bad, ids in [(10, torch.tensor([[0, 9, 10], [3, 4, 5]])), (-1, torch.tensor([2, -1, 7]))]:
        with pytest.raises(IndexError):
            torch.nn.Embedding(10, 4)(ids)
        messages = run_threaded(lookup, 4, ids)
        for message in messages:  # every rank raised, so none waits in the output's all_reduce
            assert f"index {bad} is out of range for a table of 10 rows" in message, message
    in_range = run_threaded(lookup, 4, torch.tensor([0, 9, 3]))
    assert in_range == ["no error"] * 4
