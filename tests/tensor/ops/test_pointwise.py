"""rsub and fill on DTensors equal plain torch, and keep shards and the partials they can keep."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from spmd.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.testing import DTensorTestBase, check_against_torch, seeded_randn, with_comms
from spmd.testing.layouts import make_dtensor

aten = torch.ops.aten
R, S0, S1 = Replicate(), Shard(0), Shard(1)
SUM, AVG, MAX, MIN = Partial("sum"), Partial("avg"), Partial("max"), Partial("min")
SHAPE = (7, 5)  # over 4 ranks: 7 -> 2, 2, 2, 1; 5 -> 2, 2, 1, 0 (an empty shard)


randn = functools.partial(seeded_randn, dtype=torch.float64)


class RsubTest(DTensorTestBase):
    def check(self, mesh: Any, layout: Sequence[Any], other_layout: Sequence[Any] | None, alpha: float) -> None:
        """rsub(x, other, alpha) = other - alpha * x: values and x's gradient equal torch's."""
        x = randn(*SHAPE).requires_grad_()
        if other_layout is None:  # a Python scalar
            check_against_torch(lambda t: torch.rsub(t, 2.5, alpha=alpha), x, placements=[layout], mesh=mesh)
        else:
            rsub = lambda t, other: torch.rsub(t, other, alpha=alpha)  # noqa: E731
            check_against_torch(rsub, x, randn(*SHAPE, seed=1), placements=[layout, other_layout], mesh=mesh)

    @with_comms
    def test_rsub_on_every_layout(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        layouts = [[R], [S0], [S1], [SUM], [AVG]]
        self.run_subtests(
            {"layout": layouts, "other_layout": [None, [R], [S0], [S1], [SUM]], "alpha": [1.0, 3.0]}, self.check, mesh
        )
        mesh_2d = init_device_mesh("cpu", (2, 2))
        self.run_subtests(
            {"layout": [[S0, S1], [SUM, S0]], "other_layout": [None, [S0, S1], [R, R]], "alpha": [2.0]},
            self.check,
            mesh_2d,
        )

    @with_comms
    def test_rsub_keeps_shards_and_linear_partials(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x_full, other_full = randn(*SHAPE), randn(*SHAPE, seed=1)
        for x_layout, other_layout, expected in [
            ([S1], [S1], (S1,)),
            ([SUM], [SUM], (SUM,)),
            ([AVG], None, (AVG,)),  # other - x of averages is the average of other - x
        ]:
            x = make_dtensor(x_full, mesh, x_layout)
            other: Any = 2.5 if other_layout is None else make_dtensor(other_full, mesh, other_layout)
            with CommDebugMode() as comm:
                out = torch.rsub(x, other)
            self.assertEqual((comm.get_total_counts(), out.placements), (0, expected))
            torch.testing.assert_close(out.full_tensor(), torch.rsub(x_full, 2.5 if other_layout is None else other_full))
        # a scalar minus a pending sum would subtract the scalar once per rank: the sum is reduced first
        out = torch.rsub(make_dtensor(x_full, mesh, [SUM]), 2.5)
        self.assertNotIn(SUM, out.placements)
        torch.testing.assert_close(out.full_tensor(), 2.5 - x_full)


class FillTest(DTensorTestBase):
    @with_comms
    def test_fill_keeps_the_layout_without_communication(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        full = randn(*SHAPE)
        value = distribute_tensor(torch.tensor(1.5, dtype=torch.float64), mesh, [R, R])
        for layout in [[S0, S1], [S1, S0], [R, S0], [AVG, S1], [MAX, R], [S0, MIN]]:
            for fill in [
                lambda t: aten.fill.Scalar(t, 1.5),
                lambda t: t.fill_(1.5),
                lambda t: t.fill_(torch.tensor(1.5, dtype=torch.float64)),
                lambda t: aten.fill.Tensor(t, value),
            ]:
                x = make_dtensor(full, mesh, layout)
                with CommDebugMode() as comm:
                    out = fill(x)
                self.assertEqual((comm.get_total_counts(), out.placements), (0, tuple(layout)))
                self.assertIsInstance(out, DTensor)
                torch.testing.assert_close(out.full_tensor(), torch.full(SHAPE, 1.5, dtype=torch.float64))

    @with_comms
    def test_fill_of_a_pending_sum(self) -> None:
        """fill returns a new tensor from a sum-partial as R (not 4 x 1.5); fill_ must keep self's placement."""
        mesh = init_device_mesh("cpu", (4,))
        x = make_dtensor(randn(*SHAPE), mesh, [SUM])
        out = aten.fill.Scalar(x, 1.5)
        self.assertNotIn(SUM, out.placements)
        torch.testing.assert_close(out.full_tensor(), torch.full(SHAPE, 1.5, dtype=torch.float64))
        x.fill_(1.5)
        torch.testing.assert_close(x.full_tensor(), torch.full(SHAPE, 1.5, dtype=torch.float64))

    @with_comms
    def test_fill_gradient(self) -> None:
        """fill's gradient with respect to self is zero, with respect to a tensor value the sum of grad."""
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(randn(*SHAPE), mesh, [S0]).requires_grad_()
        value = distribute_tensor(torch.tensor(1.5, dtype=torch.float64), mesh, [R]).requires_grad_()
        out = x.clone().fill_(value)
        weight = randn(*SHAPE, seed=3)
        (out.full_tensor() * weight).sum().backward()
        assert x.grad is not None and value.grad is not None
        torch.testing.assert_close(x.grad.full_tensor(), torch.zeros(SHAPE, dtype=torch.float64))
        torch.testing.assert_close(value.grad.full_tensor(), weight.sum())
