"""Reductions and scans on DTensors equal plain torch, forward and backward, on every layout."""

from __future__ import annotations

import functools
import itertools
import math
import unittest
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from spmd.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.tensor.ops import REGISTRY
from spmd.testing import DTensorTestBase, seeded_randn, with_comms
from spmd.testing.layouts import expected_local_grad, local_piece

aten = torch.ops.aten
# var/std of a rank's empty piece of a kept dim warns about degrees of freedom; the result is right.
pytestmark = pytest.mark.filterwarnings("ignore:.*degrees of freedom is <= 0:UserWarning")
R, S0, S1 = Replicate(), Shard(0), Shard(1)
INF = math.inf


seeded = functools.partial(seeded_randn, dtype=torch.float64)


def missing_rules(ops: Sequence[Any]) -> list[str]:
    return [str(op) for op in ops if REGISTRY.rule_for(op) is None]


@dataclass(frozen=True)
class Case:
    """One reduction call; ``needs`` are ops of other families that its backward emits."""

    name: str
    fn: Callable[[torch.Tensor], Any]
    differentiable: bool = True
    needs: tuple[Any, ...] = ()
    backward_blocked: str = ""
    """Why the backward cannot run on DTensors yet, whatever rules exist."""

    def __repr__(self) -> str:
        return self.name

    @property
    def backward_ready(self) -> bool:
        return self.differentiable and not self.backward_blocked and not missing_rules(self.needs)


ISNAN, MASKED_FILL_, SCATTER = aten.isnan.default, aten.masked_fill_.Scalar, aten.scatter.src
# These backward formulas make plain tensors (aten.ones, aten.zeros) and mix them with DTensors.
PLAIN_TENSORS = "the backward mixes plain tensors from aten.ones/zeros with DTensors"
CASES = [
    Case("sum()", lambda x: x.sum()),
    Case("sum(0)", lambda x: x.sum(0)),
    Case("sum(-1, keepdim)", lambda x: x.sum(-1, keepdim=True)),
    Case("mean()", lambda x: x.mean()),
    Case("mean(0)", lambda x: x.mean(0)),
    Case("mean([0, -1], keepdim)", lambda x: x.mean([0, -1], keepdim=True)),
    Case("nansum(1)", lambda x: x.nansum(1), needs=(ISNAN,)),
    Case("prod()", lambda x: x.prod(), backward_blocked=PLAIN_TENSORS),
    Case("prod(1)", lambda x: x.prod(1), backward_blocked=PLAIN_TENSORS),
    Case("max()", lambda x: x.max(), needs=(ISNAN,)),
    Case("min()", lambda x: x.min(), needs=(ISNAN,)),
    Case("max(1)", lambda x: x.max(1), needs=(SCATTER,)),
    Case("min(0, keepdim)", lambda x: x.min(0, keepdim=True), needs=(SCATTER,)),
    Case("amax()", lambda x: x.amax()),
    Case("amax(1)", lambda x: x.amax(1)),
    Case("amin((0, 1))", lambda x: x.amin((0, 1))),
    Case("amin(-1, keepdim)", lambda x: x.amin(-1, keepdim=True)),
    Case("aminmax()", lambda x: torch.aminmax(x)),
    Case("aminmax(0, keepdim)", lambda x: torch.aminmax(x, dim=0, keepdim=True)),
    Case("argmax()", lambda x: x.argmax(), differentiable=False),
    Case("argmax(0)", lambda x: x.argmax(0), differentiable=False),
    Case("argmin(-1, keepdim)", lambda x: x.argmin(-1, keepdim=True), differentiable=False),
    Case("norm()", lambda x: x.norm(), needs=(MASKED_FILL_,)),
    Case("vector_norm(2, 1)", lambda x: torch.linalg.vector_norm(x, 2, dim=1), needs=(MASKED_FILL_,)),
    Case("vector_norm(1, 0)", lambda x: torch.linalg.vector_norm(x, 1, dim=0), needs=(aten.sgn.default,)),
    Case("vector_norm(inf)", lambda x: torch.linalg.vector_norm(x, INF), needs=(ISNAN,)),
    Case("vector_norm(-inf, 1)", lambda x: torch.linalg.vector_norm(x, -INF, dim=1), needs=(ISNAN,)),
    Case("vector_norm(0, 0)", lambda x: torch.linalg.vector_norm(x, 0, dim=0), differentiable=False),
    Case("norm(p=3, dim=0)", lambda x: x.norm(p=3, dim=0), needs=(MASKED_FILL_,)),
    Case("aten.norm(1, [1])", lambda x: aten.norm.ScalarOpt_dim(x, 1, [1]), needs=(aten.sgn.default,)),
    Case("vector_norm(0.5, 1, keepdim)", lambda x: torch.linalg.vector_norm(x, 0.5, dim=1, keepdim=True),
         needs=(MASKED_FILL_,)),
    Case("vector_norm(3, (0, 1), keepdim)", lambda x: torch.linalg.vector_norm(x, 3, dim=(0, 1), keepdim=True),
         needs=(MASKED_FILL_,)),
    Case("var(1)", lambda x: x.var(1)),
    Case("var(0, correction=0)", lambda x: x.var(0, correction=0)),
    Case("std()", lambda x: x.std(), needs=(MASKED_FILL_,)),
    Case("std(1, keepdim)", lambda x: x.std(1, keepdim=True), needs=(MASKED_FILL_,)),
    Case("var_mean(0)", lambda x: torch.var_mean(x, 0)),
    Case("std_mean(1, correction=0)", lambda x: torch.std_mean(x, 1, correction=0), needs=(MASKED_FILL_,)),
    Case("all()", lambda x: (x > -1).all(), differentiable=False),
    Case("all(0, keepdim)", lambda x: (x > -1).all(0, keepdim=True), differentiable=False),
    Case("any(1)", lambda x: (x > 1).any(1), differentiable=False),
    Case("any((0, 1))", lambda x: torch.any(x > 1, dim=(0, 1)), differentiable=False),
    Case("count_nonzero()", lambda x: torch.count_nonzero(x.round()), differentiable=False),
    Case("count_nonzero(0)", lambda x: torch.count_nonzero(x.round(), 0), differentiable=False),
    Case("count_nonzero((0, 1))", lambda x: torch.count_nonzero(x.round(), (0, 1)), differentiable=False),
    Case("logsumexp(1)", lambda x: x.logsumexp(1)),
    Case("logsumexp((0, 1))", lambda x: x.logsumexp((0, 1))),
    Case("logsumexp(-1, keepdim)", lambda x: x.logsumexp(-1, keepdim=True)),
    Case("cumsum(0)", lambda x: x.cumsum(0), needs=(aten.flip.default,)),
    Case("cumsum(-1)", lambda x: x.cumsum(-1), needs=(aten.flip.default,)),
    Case("cumprod(1)", lambda x: x.cumprod(1), backward_blocked=PLAIN_TENSORS),
    Case("logcumsumexp(0)", lambda x: x.logcumsumexp(0), needs=(aten.where.self, aten.flip.default)),
    Case("cummax(1)", lambda x: x.cummax(1), backward_blocked=PLAIN_TENSORS),
    Case("cummin(0)", lambda x: x.cummin(0), backward_blocked=PLAIN_TENSORS),
]
NEEDS_OTHER_FAMILIES = [c for c in CASES if c.needs and not c.backward_blocked]
MISSING = sorted({op for c in NEEDS_OTHER_FAMILIES for op in missing_rules(c.needs)})
LAYOUTS_1D = [(R,), (S0,), (S1,)]
LAYOUTS_2D = list(itertools.product([R, S0, S1], repeat=2))
EVEN, UNEVEN = (8, 12), (7, 5)  # 7 rows over 4 ranks: 2, 2, 2, 1; 5 columns: 2, 2, 1, 0


def outputs_of(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (tuple, list)) else [value]


def leaf_dtensor(full: torch.Tensor, mesh: Any, placements: Sequence[Any]) -> tuple[torch.Tensor, DTensor]:
    """A local leaf (its ``.grad`` is this rank's gradient) and the DTensor built on it."""
    local = local_piece(full, mesh, placements).requires_grad_()
    return local, DTensor.from_local(local, mesh, placements, shape=full.shape, stride=full.stride())


class ReductionTestBase(DTensorTestBase):
    def check(self, mesh: Any, case: Case, placements: Sequence[Any], shape: tuple[int, ...], backward: bool) -> None:
        """Forward equals torch; with ``backward``, a weighted loss gives each rank torch's gradient."""
        full = seeded(*shape)
        local, x = leaf_dtensor(full, mesh, placements)
        reference = full.clone().requires_grad_()
        got, expected = outputs_of(case.fn(x)), outputs_of(case.fn(reference))
        self.assertEqual(len(got), len(expected))
        for g, e in zip(got, expected):
            self.assertIsInstance(g, DTensor)
            torch.testing.assert_close(g.full_tensor(), e.detach())
        if not (backward and case.backward_ready):
            return
        loss, reference_loss = 0, 0
        for i, (g, e) in enumerate(zip(got, expected)):
            if e.is_floating_point():
                weight = seeded(*e.shape, seed=10 + i)
                loss = loss + (g.full_tensor() * weight).sum()
                reference_loss = reference_loss + (e * weight).sum()
        loss.backward()
        reference_loss.backward()
        assert reference.grad is not None and local.grad is not None
        torch.testing.assert_close(local.grad, expected_local_grad(reference.grad, mesh, placements))


class ReductionTest(ReductionTestBase):
    @with_comms
    def test_every_reduction_on_a_1d_mesh(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        self.run_subtests(
            {"case": CASES, "placements": LAYOUTS_1D, "shape": [EVEN, UNEVEN]}, self.check, mesh, backward=True
        )

    @with_comms
    def test_every_reduction_on_a_2d_mesh(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        self.run_subtests({"case": CASES, "placements": LAYOUTS_2D}, self.check, mesh, shape=UNEVEN, backward=True)
        self.run_subtests(
            {"case": CASES, "placements": [(S0, S1), (S1, S0), (S0, S0)]}, self.check, mesh, shape=EVEN, backward=False
        )

    @with_comms
    def test_three_d_input_with_negative_and_multiple_dims(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        cases = [
            Case("sum((0, 2))", lambda x: x.sum((0, 2))),
            Case("mean(-2, keepdim)", lambda x: x.mean(-2, keepdim=True)),
            Case("amax((-1, 0))", lambda x: x.amax((-1, 0))),
            Case("var((0, 2))", lambda x: x.var((0, 2))),
            Case("logsumexp((1, 2))", lambda x: x.logsumexp((1, 2))),
            Case("max(-1)", lambda x: x.max(-1), needs=(SCATTER,)),
            Case("argmin(1)", lambda x: x.argmin(1), differentiable=False),
            Case("cumsum(1)", lambda x: x.cumsum(1), needs=(aten.flip.default,)),
        ]
        layouts = [(Shard(0), Shard(2)), (Shard(2), Shard(1)), (Replicate(), Shard(1))]
        self.run_subtests({"case": cases, "placements": layouts}, self.check, mesh, shape=(4, 3, 6), backward=True)

    def check_partial_input(self, mesh: Any, case: Case, placements: Sequence[Any]) -> None:
        """A pending sum or average stays pending through a linear reduction; values and grads equal torch."""
        _, x = leaf_dtensor(seeded(*UNEVEN), mesh, placements)
        with CommDebugMode() as comm:
            out = case.fn(x)
        if mesh.ndim == 1:
            self.assertEqual(comm.get_total_counts(), 0)
        for mesh_dim, p in enumerate(placements):
            if p.is_partial():
                self.assertEqual(out.placements[mesh_dim], p)
        self.check(mesh, case, placements, UNEVEN, backward=True)

    @with_comms
    def test_sum_and_mean_pass_partial_inputs_through(self) -> None:
        cases = [c for c in CASES if c.name.startswith(("sum", "mean"))] + [Case("cumsum(1)", lambda x: x.cumsum(1))]
        p_sum, p_avg = Partial("sum"), Partial("avg")
        mesh = init_device_mesh("cpu", (4,))
        self.run_subtests({"case": cases, "placements": [(p_sum,), (p_avg,)]}, self.check_partial_input, mesh)
        mesh = init_device_mesh("cpu", (2, 2))
        self.run_subtests({"case": cases, "placements": [(p_sum, S0), (S1, p_avg)]}, self.check_partial_input, mesh)

    @with_comms
    def test_nonlinear_reductions_reduce_a_partial_input_first(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        cases = [c for c in CASES if c.name.startswith(("amax", "prod", "var", "max(", "all", "logsumexp", "cumprod"))]
        linear, extremes = [(Partial("sum"),), (Partial("avg"),)], [(Partial("max"),), (Partial("min"),)]
        self.run_subtests({"case": cases, "placements": linear, "shape": [EVEN, UNEVEN]}, self.check, mesh, backward=True)
        # from_local has no gradient for max/min partials, so those are checked forward only
        self.run_subtests({"case": cases, "placements": extremes, "shape": [UNEVEN]}, self.check, mesh, backward=False)

    @unittest.skipIf(bool(MISSING), f"the backward of some reductions needs rules of other families: {MISSING}")
    @with_comms
    def test_backward_through_ops_of_other_families(self) -> None:
        # Every test above runs these backwards as soon as the rules exist; this one says when they don't.
        mesh = init_device_mesh("cpu", (2, 2))
        self.run_subtests(
            {"case": NEEDS_OTHER_FAMILIES, "placements": LAYOUTS_2D}, self.check, mesh, shape=EVEN, backward=True
        )


class ReductionPlacementTest(DTensorTestBase):
    """The placements reductions produce, and the collectives they avoid."""

    def run_op(self, fn: Callable[[DTensor], Any], full: torch.Tensor, mesh: Any, placements: Sequence[Any]) -> tuple[Any, int]:
        x = distribute_tensor(full, mesh, placements)
        with CommDebugMode() as comm:
            out = fn(x)
        expected = fn(full)
        for got, want in zip(outputs_of(out), outputs_of(expected)):
            torch.testing.assert_close(got.full_tensor(), want)
        return out, comm.get_total_counts()

    @with_comms
    def test_sum_over_a_sharded_dim_is_a_pending_sum_without_communication(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        full = seeded(*UNEVEN)
        for fn, placements, expected in [
            (lambda x: x.sum(0), [S0], (Partial("sum"),)),
            (lambda x: x.sum(), [S1], (Partial("sum"),)),
            (lambda x: x.sum(1), [S0], (S0,)),
            (lambda x: x.sum(0, keepdim=True), [S1], (S1,)),
            (lambda x: x.nansum(0), [S0], (Partial("sum"),)),
        ]:
            out, collectives = self.run_op(fn, full, mesh, placements)
            self.assertEqual(collectives, 0)
            self.assertEqual(out.placements, expected)
        mesh_2d = init_device_mesh("cpu", (2, 2))
        out, collectives = self.run_op(lambda x: x.sum(), full, mesh_2d, [S0, S1])
        self.assertEqual((collectives, out.placements), (0, (Partial("sum"), Partial("sum"))))
        out, collectives = self.run_op(lambda x: x.sum(-1), full, mesh_2d, [S1, S0])
        self.assertEqual((collectives, out.placements), (0, (Partial("sum"), S0)))

    @with_comms
    def test_mean_is_a_pending_average_only_over_even_shards(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        out, collectives = self.run_op(lambda x: x.mean(0), seeded(8, 3), mesh, [S0])
        self.assertEqual((collectives, out.placements), (0, (Partial("avg"),)))
        # 7 rows over 4 ranks are 2, 2, 2, 1: an average of the local means would weigh the last row twice
        out, collectives = self.run_op(lambda x: x.mean(0), seeded(7, 3), mesh, [S0])
        self.assertGreater(collectives, 0)
        self.assertNotIn(Partial("avg"), out.placements)
        # divisible by 2 but not by the whole mesh: the conservative check replicates
        mesh_2d = init_device_mesh("cpu", (2, 2))
        out, _ = self.run_op(lambda x: x.mean(0), seeded(6, 4), mesh_2d, [S0, R])
        self.assertNotIn(Partial("avg"), out.placements)
        out, collectives = self.run_op(lambda x: x.mean(), seeded(8, 4), mesh_2d, [S0, S1])
        self.assertEqual((collectives, out.placements), (0, (Partial("avg"), Partial("avg"))))

    @with_comms
    def test_extrema_are_pending_max_and_min_unless_a_shard_is_empty(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        full = seeded(7, 5)
        for fn, placements, expected in [
            (lambda x: x.amax(), [S0], (Partial("max"),)),
            (lambda x: x.max(), [S0], (Partial("max"),)),
            (lambda x: x.amin(0), [S0], (Partial("min"),)),
            (lambda x: x.min(), [S0], (Partial("min"),)),
            (lambda x: torch.aminmax(x, dim=0), [S0], (Partial("min"),)),
        ]:
            out, collectives = self.run_op(fn, full, mesh, placements)
            self.assertEqual((collectives, outputs_of(out)[0].placements), (0, expected))
        _, maxes = torch.aminmax(distribute_tensor(full, mesh, [S0]))
        self.assertEqual(maxes.placements, (Partial("max"),))
        # 5 columns over 4 ranks are 2, 2, 1, 0: amax of an empty shard raises, so the dim moves first
        out, collectives = self.run_op(lambda x: x.amax(1), full, mesh, [S1])
        self.assertGreater(collectives, 0)
        self.assertNotIn(Partial("max"), out.placements)

    @with_comms
    def test_index_reductions_replicate_the_reduced_dim(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        full = seeded(8, 12)
        for fn in [lambda x: x.argmax(0), lambda x: x.max(0), lambda x: x.argmin()]:
            out, collectives = self.run_op(fn, full, mesh, [S0])
            self.assertGreater(collectives, 0)
            for o in outputs_of(out):
                self.assertFalse(any(p.is_partial() for p in o.placements))
        values, indices = distribute_tensor(full, mesh, [S0]).max(1)
        self.assertEqual((values.placements, indices.placements), ((S0,), (S0,)))

    @with_comms
    def test_whole_dim_reductions_keep_a_kept_dims_shard(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        full = seeded(8, 12)
        for fn in [lambda x: x.var(1), lambda x: x.std(1), lambda x: x.prod(1), lambda x: x.logsumexp(1),
                   lambda x: x.argmax(1), lambda x: torch.var_mean(x, 1)[0]]:
            out, collectives = self.run_op(fn, full, mesh, [S0])
            self.assertEqual((collectives, out.placements), (0, (S0,)))
        for fn in [lambda x: x.var(0), lambda x: x.logsumexp(0), lambda x: x.prod()]:
            out, collectives = self.run_op(fn, full, mesh, [S0])
            self.assertGreater(collectives, 0)
            self.assertFalse(any(p.is_partial() for p in out.placements))

    @with_comms
    def test_norms_that_combine_locally_are_partial(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        full = seeded(8, 12)
        for ord_value, expected in [(1, Partial("sum")), (0, Partial("sum")), (INF, Partial("max")), (-INF, Partial("min"))]:
            out, collectives = self.run_op(lambda x, o=ord_value: torch.linalg.vector_norm(x, o, dim=0), full, mesh, [S0])
            self.assertEqual((collectives, out.placements), (0, (expected,)))
        out, collectives = self.run_op(lambda x: aten.norm.Scalar(x, 1), full, mesh, [S1])
        self.assertEqual((collectives, out.placements), (0, (Partial("sum"),)))
        for fn in [lambda x: x.norm(), lambda x: torch.linalg.vector_norm(x, 3, dim=0)]:
            out, collectives = self.run_op(fn, full, mesh, [S0])
            self.assertGreater(collectives, 0)
            self.assertFalse(any(p.is_partial() for p in out.placements))

    def check_p_norm(self, mesh: Any, placements: Sequence[Any], ord_value: float, dim: Any, keepdim: bool) -> None:
        """Sums of |x|^p stay on their shards: no all_gather, one all_reduce per mesh dim sharding a reduced dim."""
        full = seeded(*UNEVEN)
        def norm(x: Any) -> Any:
            return torch.linalg.vector_norm(x, ord_value, dim=dim, keepdim=keepdim)

        out, _ = self.run_op(norm, full, mesh, placements)
        x = distribute_tensor(full, mesh, placements)
        with CommDebugMode() as comm:
            norm(x)
        reduced = range(2) if dim is None else [dim % 2]
        sharding = sum(1 for p in placements if isinstance(p, Shard) and p.dim in reduced)
        expected = {"all_reduce": sharding} if sharding else {}
        self.assertEqual({str(k): n for k, n in comm.get_comm_counts().items()}, expected)
        self.assertFalse(any(p.is_partial() for p in out.placements))

    @with_comms
    def test_p_norms_of_a_sharded_dim_add_up_powers_shard_by_shard(self) -> None:
        options = {"ord_value": [2.0, 3, 0.5], "dim": [None, 0, -1], "keepdim": [False, True]}
        mesh = init_device_mesh("cpu", (4,))
        self.run_subtests({"placements": [(S0,), (S1,)], **options}, self.check_p_norm, mesh)
        mesh = init_device_mesh("cpu", (2, 2))
        self.run_subtests({"placements": [(S0, S1), (S1, S1), (R, S0)], **options}, self.check_p_norm, mesh)

    @with_comms
    def test_p_norm_of_a_half_tensor_does_not_overflow(self) -> None:
        """|x|^2 of a half overflows at 256; the norm is summed in float32 as torch's kernel does."""
        mesh = init_device_mesh("cpu", (4,))
        full = torch.full((8, 4), 300.0, dtype=torch.float16)
        out, _ = self.run_op(lambda x: torch.linalg.vector_norm(x, dim=0), full, mesh, [S0])
        self.assertEqual(out.dtype, torch.float16)
        out, _ = self.run_op(lambda x: torch.linalg.vector_norm(x, 3, dtype=torch.float64), full, mesh, [S1])
        self.assertEqual(out.dtype, torch.float64)

    @with_comms
    def test_all_and_any_are_pending_and_or(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        full = seeded(7, 5)
        for fn, expected in [(lambda x: (x > -2).all(0), Partial("min")), (lambda x: (x > 2).any(), Partial("max"))]:
            out, collectives = self.run_op(fn, full, mesh, [S0])
            self.assertEqual((collectives, out.placements, out.dtype), (0, (expected,), torch.bool))
        # an empty shard is neutral: all of nothing is True, any of nothing is False
        out, collectives = self.run_op(lambda x: (x > 0).any(1), full, mesh, [S1])
        self.assertEqual((collectives, out.placements), (0, (Partial("max"),)))

    @with_comms
    def test_count_nonzero_is_a_pending_sum(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        full = seeded(7, 5).round()  # about a third zeros
        for fn, placements, expected in [
            (lambda x: torch.count_nonzero(x), [S0], (Partial("sum"),)),
            (lambda x: torch.count_nonzero(x, 1), [S1], (Partial("sum"),)),  # 5 columns: one rank has none
            (lambda x: torch.count_nonzero(x, 1), [S0], (S0,)),
            (lambda x: torch.count_nonzero(x, (0, 1)), [S1], (Partial("sum"),)),
        ]:
            out, collectives = self.run_op(fn, full, mesh, placements)
            self.assertEqual((collectives, out.placements, out.dtype), (0, expected, torch.int64))
        # the zeros of a pending sum are not its pieces' zeros
        x = DTensor.from_local(torch.tensor([1.0, -1.0, 0.0]) * (1 if self.rank % 2 else -1), mesh, [Partial("sum")])
        self.assertEqual(torch.count_nonzero(x).full_tensor().item(), 0)

    @with_comms
    def test_scans_keep_shards_off_the_scanned_dim(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        full = seeded(7, 5)
        for fn in [lambda x: x.cumsum(1), lambda x: x.cumprod(1), lambda x: x.logcumsumexp(1), lambda x: x.cummax(1)]:
            out, collectives = self.run_op(fn, full, mesh, [S0])
            self.assertEqual(collectives, 0)
            for o in outputs_of(out):
                self.assertEqual(o.placements, (S0,))
        # cummax's and cummin's indices still need the whole scanned dim
        for fn in [lambda x: x.cummax(0)[0], lambda x: x.cummin(0)[1]]:
            out, collectives = self.run_op(fn, full, mesh, [S0])
            self.assertGreater(collectives, 0)
            self.assertNotEqual(out.placements, (S0,))
        x = distribute_tensor(full.clone(), mesh, [S0])
        self.assertIs(x.cumsum_(1), x)
        torch.testing.assert_close(x.full_tensor(), full.cumsum(1))

    def check_scan_of_a_sharded_dim(self, mesh: Any, placements: Sequence[Any], fn: Callable[[Any], Any], dim: int) -> None:
        """The scanned dim stays sharded; the only collectives gather one total per piece and row."""
        full = seeded(*UNEVEN)
        x = distribute_tensor(full, mesh, placements)
        with CommDebugMode() as comm:
            out = fn(x, dim)
        torch.testing.assert_close(out.full_tensor(), fn(full, dim))
        self.assertEqual(out.placements, tuple(placements))
        gathers = sum(1 for p in placements if p == Shard(dim))
        self.assertEqual(dict(comm.get_comm_counts()), {"all_gather": gathers})
        other_dim_size = UNEVEN[1 - dim]
        self.assertLessEqual(comm.get_total_bytes(), gathers * mesh.size() * other_dim_size * full.element_size())

    @with_comms
    def test_sum_product_and_logsumexp_scans_keep_the_scanned_dim_sharded(self) -> None:
        fns = [lambda x, d: x.cumsum(d), lambda x, d: x.cumprod(d), lambda x, d: x.logcumsumexp(d),
               lambda x, d: x.cumsum(d, dtype=torch.float32)]
        mesh = init_device_mesh("cpu", (4,))
        self.run_subtests({"placements": [(S0,), (S1,)], "fn": fns}, lambda placements, fn: self.check_scan_of_a_sharded_dim(
            mesh, placements, fn, placements[0].dim))
        mesh_2d = init_device_mesh("cpu", (2, 2))
        for placements, dim in [((S0, S1), 0), ((S0, S1), 1), ((S1, S1), 1), ((S0, S0), 0), ((R, S0), 0)]:
            for fn in fns:
                self.check_scan_of_a_sharded_dim(mesh_2d, placements, fn, dim)

    @with_comms
    def test_cumsum_of_a_sharded_dim_in_place_and_with_partials(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        full = seeded(*UNEVEN)
        x = distribute_tensor(full.clone(), mesh, [S0, S0])
        self.assertIs(x.cumsum_(0), x)
        self.assertEqual(x.placements, (S0, S0))
        torch.testing.assert_close(x.full_tensor(), full.cumsum(0))
        # a pending sum on the other mesh dim stays pending: a prefix sum is linear
        _, y = leaf_dtensor(full, mesh, [Partial("sum"), S1])
        with CommDebugMode() as comm:
            out = y.cumsum(1)
        self.assertEqual((out.placements, dict(comm.get_comm_counts())), ((Partial("sum"), S1), {"all_gather": 1}))
        torch.testing.assert_close(out.full_tensor(), full.cumsum(1))
        # a zero in one piece zeroes the products of every later piece
        with_zero = full.clone()
        with_zero[2, 1] = 0.0
        out = distribute_tensor(with_zero, mesh, [S0, S0]).cumprod(0)
        self.assertEqual(out.placements, (S0, S0))
        torch.testing.assert_close(out.full_tensor(), with_zero.cumprod(0))

    @with_comms
    def test_expand_keeps_shards_of_dims_it_does_not_broadcast(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        column, row = seeded(7, 1), seeded(1, 5)
        for full, placements, size, expected in [
            (column, [S0], (7, 6), (S0,)),
            (row, [S1], (3, 5), (S1,)),
            (row, [S1], (2, 3, 5), (Shard(2),)),
            (column, [R], (-1, 4), (R,)),
        ]:
            out, collectives = self.run_op(lambda x, s=size: x.expand(*s), full, mesh, placements)
            self.assertEqual((collectives, out.placements), (0, expected))
        # a size-1 dim cannot stay sharded when broadcast: the lone element lives on one rank
        out, collectives = self.run_op(lambda x: x.expand(4, 5), row, mesh, [S0])
        self.assertGreater(collectives, 0)
        partial = distribute_tensor(column, mesh, [R]).redistribute(mesh, [Partial()])
        with CommDebugMode() as comm:
            expanded = partial.expand(7, 3)
        self.assertEqual((comm.get_total_counts(), expanded.placements), (0, (Partial(),)))
        torch.testing.assert_close(expanded.full_tensor(), column.expand(7, 3))


class ReductionOn3dMeshTest(ReductionTestBase):
    world_size = 8

    @with_comms
    def test_reductions_on_a_2x2x2_mesh(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2, 2))
        cases = [c for c in CASES if c.name in ("sum()", "mean(0)", "amax(1)", "var(1)", "all()", "argmax(0)")]
        layouts = [(S0, S1, S0), (R, S0, S1), (Partial("sum"), S1, R)]
        self.run_subtests({"case": cases, "placements": layouts}, self.check, mesh, shape=UNEVEN, backward=True)
