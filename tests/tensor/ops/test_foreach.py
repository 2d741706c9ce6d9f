"""List ops (``torch._foreach_*``) on lists of DTensors of mixed placements equal plain torch."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from spmd.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.tensor.ops.foreach import ListRule
from spmd.tensor.sharding.registry import REGISTRY
from spmd.testing import DTensorTestBase, check_against_torch, run_threaded, seeded_randn, with_comms
from spmd.testing.layouts import make_dtensor

R, S0, S1 = Replicate(), Shard(0), Shard(1)
SUM = Partial("sum")
SHAPES = [(8, 6), (6, 5), (5,), (4, 3), (7, 3)]
"""One list of tensors; 7 rows over 4 ranks split unevenly (2, 2, 2, 1)."""
LAYOUTS = {
    (4,): {
        "self": [[S0], [S1], [R], [SUM], [S0]],
        "other": [[R], [S0], [S0], [R], [S0]],
        "third": [[S1], [S1], [R], [S1], [R]],
    },
    (2, 2): {
        "self": [[S0, S1], [R, S0], [S0, R], [SUM, S1], [S1, S0]],
        "other": [[R, R], [S0, S0], [R, S0], [S0, R], [S1, S0]],
        "third": [[S1, S0], [S1, R], [R, R], [R, S1], [S0, S0]],
    },
}


def positive_list(seed: int) -> list[torch.Tensor]:
    """Values in [0.5, 2.5): safe for sqrt, reciprocal, pow and division."""
    return [seeded_randn(*shape, seed=seed + i).abs() + 0.5 for i, shape in enumerate(SHAPES)]


def without_partials(layouts: list[list[Any]]) -> list[list[Any]]:
    """Nonlinear in-place ops cannot keep a partial self: the same layouts with partials replicated."""
    return [[R if isinstance(p, Partial) else p for p in layout] for layout in layouts]


def distribute_list(fulls: Sequence[torch.Tensor], mesh: Any, layouts: Sequence[Sequence[Any]]) -> list[DTensor]:
    return [make_dtensor(f, mesh, p) for f, p in zip(fulls, layouts)]


def plain_scalar() -> torch.Tensor:
    return torch.tensor(0.75)


OUT_OF_PLACE: dict[str, tuple[int, Callable[..., Any]]] = {
    # name: (number of tensor lists, fn)
    "abs": (1, torch._foreach_abs),
    "neg": (1, torch._foreach_neg),
    "exp": (1, torch._foreach_exp),
    "sqrt": (1, torch._foreach_sqrt),
    "reciprocal": (1, torch._foreach_reciprocal),
    "sign": (1, torch._foreach_sign),
    "sigmoid": (1, torch._foreach_sigmoid),
    "add.List": (2, lambda xs, ys: torch._foreach_add(xs, ys, alpha=2.0)),
    "add.Scalar": (1, lambda xs: torch._foreach_add(xs, 1.5)),
    "add.ScalarList": (1, lambda xs: torch._foreach_add(xs, [float(i) for i in range(len(xs))])),
    "add.Tensor": (1, lambda xs: torch._foreach_add(xs, plain_scalar(), alpha=2.0)),
    "sub.List": (2, torch._foreach_sub),
    "mul.List": (2, torch._foreach_mul),
    "mul.Scalar": (1, lambda xs: torch._foreach_mul(xs, -3.0)),
    "mul.ScalarList": (1, lambda xs: torch._foreach_mul(xs, [0.5 * i for i in range(len(xs))])),
    "mul.Tensor": (1, lambda xs: torch._foreach_mul(xs, plain_scalar())),
    "div.List": (2, torch._foreach_div),
    "div.Scalar": (1, lambda xs: torch._foreach_div(xs, 4.0)),
    "maximum.List": (2, torch._foreach_maximum),
    "minimum.List": (2, torch._foreach_minimum),
    "maximum.Scalar": (1, lambda xs: torch._foreach_maximum(xs, 1.0)),
    "clamp_min.Scalar": (1, lambda xs: torch._foreach_clamp_min(xs, 1.0)),
    "clamp_max.ScalarList": (1, lambda xs: torch._foreach_clamp_max(xs, [1.0 + i for i in range(len(xs))])),
    "pow.Scalar": (1, lambda xs: torch._foreach_pow(xs, 2.0)),
    "pow.List": (2, torch._foreach_pow),
    "pow.ScalarAndTensor": (1, lambda xs: torch._foreach_pow(2.0, xs)),
    "addcmul.Scalar": (3, lambda xs, ys, zs: torch._foreach_addcmul(xs, ys, zs, value=0.5)),
    "addcdiv.ScalarList": (3, lambda xs, ys, zs: torch._foreach_addcdiv(xs, ys, zs, [0.1 * i for i in range(len(xs))])),
    "addcmul.Tensor": (3, lambda xs, ys, zs: torch._foreach_addcmul(xs, ys, zs, torch.arange(len(xs)) * 0.5)),
    "lerp.List": (3, torch._foreach_lerp),
    "lerp.Scalar": (2, lambda xs, ys: torch._foreach_lerp(xs, ys, 0.25)),
    "norm.2": (1, torch._foreach_norm),
    "norm.1": (1, lambda xs: torch._foreach_norm(xs, 1)),
    "norm.inf": (1, lambda xs: torch._foreach_norm(xs, math.inf)),
    "norm.3": (1, lambda xs: torch._foreach_norm(xs, 3)),
    "max": (1, torch._foreach_max),
    "clone": (1, torch._foreach_clone),
    "zero": (1, lambda xs: torch.ops.aten._foreach_zero.default(xs)),
}

IN_PLACE: dict[str, tuple[int, bool, Callable[..., Any]]] = {
    # name: (number of tensor lists, keeps partials, fn)
    "add_.List": (2, True, lambda xs, ys: torch._foreach_add_(xs, ys, alpha=-0.5)),
    "sub_.List": (2, True, torch._foreach_sub_),
    "mul_.Scalar": (1, True, lambda xs: torch._foreach_mul_(xs, 0.9)),
    "mul_.Tensor": (1, True, lambda xs: torch._foreach_mul_(xs, plain_scalar())),
    "div_.ScalarList": (1, True, lambda xs: torch._foreach_div_(xs, [1.0 + i for i in range(len(xs))])),
    "zero_": (1, True, torch._foreach_zero_),
    "copy_": (2, True, torch._foreach_copy_),
    "lerp_.Scalar": (2, False, lambda xs, ys: torch._foreach_lerp_(xs, ys, 0.1)),
    "neg_": (1, True, torch._foreach_neg_),
    "sqrt_": (1, False, torch._foreach_sqrt_),
    "reciprocal_": (1, False, torch._foreach_reciprocal_),
    "exp_": (1, False, torch._foreach_exp_),
    "mul_.List": (2, False, torch._foreach_mul_),
    "div_.List": (2, False, torch._foreach_div_),
    "maximum_.List": (2, False, torch._foreach_maximum_),
    "clamp_min_.Scalar": (1, False, lambda xs: torch._foreach_clamp_min_(xs, 1.2)),
    "clamp_max_.List": (2, False, torch._foreach_clamp_max_),
    "pow_.Scalar": (1, False, lambda xs: torch._foreach_pow_(xs, 0.5)),
    "addcmul_.Scalar": (3, False, lambda xs, ys, zs: torch._foreach_addcmul_(xs, ys, zs, value=0.1)),
    "addcdiv_.ScalarList": (3, False, lambda xs, ys, zs: torch._foreach_addcdiv_(xs, ys, zs, [0.1] * len(xs))),
    "addcdiv_.Tensor": (3, False, lambda xs, ys, zs: torch._foreach_addcdiv_(xs, ys, zs, torch.full((len(xs),), -0.2))),
}


class ForeachTest(DTensorTestBase):
    def check_out_of_place(self, mesh: Any, name: str) -> None:
        count, fn = OUT_OF_PLACE[name]
        layouts = LAYOUTS[tuple(mesh.shape)]
        roles = ["self", "other", "third"][:count]
        tensors = [t for k in range(count) for t in positive_list(10 * k)]
        placements = [layout for role in roles for layout in layouts[role]]
        size = len(SHAPES)

        def on_lists(*flat: torch.Tensor) -> Any:
            """``fn`` with its tensor lists regrouped from the oracle's flat inputs."""
            return fn(*(list(flat[k * size : (k + 1) * size]) for k in range(count)))

        on_lists.__name__ = f"_foreach_{name}"
        check_against_torch(on_lists, *tensors, placements=placements, mesh=mesh, backward=False)

    def check_in_place(self, mesh: Any, name: str) -> None:
        count, keeps_partials, fn = IN_PLACE[name]
        layouts = dict(LAYOUTS[tuple(mesh.shape)])
        if not keeps_partials:
            layouts["self"] = without_partials(layouts["self"])
        fulls = [positive_list(10 * k) for k in range(count)]
        lists = [distribute_list(f, mesh, layouts[role]) for f, role in zip(fulls, ["self", "other", "third"])]
        selves = list(lists[0])
        expected = [[f.clone() for f in full] for full in fulls]
        fn(*lists)
        fn(*expected)
        for i, (x, e, layout) in enumerate(zip(selves, expected[0], layouts["self"])):
            self.assertIs(x, lists[0][i])
            self.assertEqual(x.placements, tuple(layout), f"{name} changed the placement of self {i}")
            torch.testing.assert_close(x.full_tensor(), e, msg=lambda m, i=i: f"{name} self {i}: {m}")

    @with_comms
    def test_out_of_place_list_ops(self) -> None:
        for mesh_shape in LAYOUTS:
            mesh = init_device_mesh("cpu", mesh_shape)
            self.run_subtests({"name": list(OUT_OF_PLACE)}, self.check_out_of_place, mesh)

    @with_comms
    def test_in_place_list_ops_keep_each_placement(self) -> None:
        for mesh_shape in LAYOUTS:
            mesh = init_device_mesh("cpu", mesh_shape)
            self.run_subtests({"name": list(IN_PLACE)}, self.check_in_place, mesh)

    @with_comms
    def test_output_placements_follow_each_element_op(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        xs = distribute_list(positive_list(0)[:4], mesh, [[S0], [S1], [R], [SUM]])
        self.assertEqual([o.placements for o in torch._foreach_neg(xs)], [(S0,), (S1,), (R,), (SUM,)])
        exps = torch._foreach_exp(xs)  # a partial is reduced first (to whichever layout is cheapest)
        self.assertEqual([o.placements for o in exps[:3]], [(S0,), (S1,), (R,)])
        self.assertFalse(exps[3].placements[0].is_partial())
        # norms of shards: partial results where the local norms combine, replicated otherwise
        # (a partial is reduce-scattered, then its local 1-norms add up too)
        self.assertEqual([o.placements for o in torch._foreach_norm(xs, 1)], [(SUM,), (SUM,), (R,), (SUM,)])
        # P(max) needs every shard non-empty: 5 columns over 4 ranks leave one empty, so that one gathers
        self.assertEqual(
            [o.placements for o in torch._foreach_norm(xs, math.inf)],
            [(Partial("max"),), (R,), (R,), (Partial("max"),)],
        )

    @with_comms
    def test_lists_laid_out_alike_move_nothing(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        layouts = LAYOUTS[(2, 2)]["self"]
        xs = distribute_list(positive_list(0), mesh, layouts)
        ys = distribute_list(positive_list(10), mesh, layouts)
        coefficient = distribute_tensor(torch.tensor(0.5), mesh, [R, R])
        with CommDebugMode() as comm:
            torch._foreach_add_(xs, ys, alpha=0.1)
            torch._foreach_mul_(xs, coefficient)
            torch._foreach_sub_(xs, ys)
            torch._foreach_mul_(xs, [2.0] * len(xs))
        self.assertEqual(comm.get_total_counts(), 0)

    @with_comms
    def test_norm_of_shards_reduces_scalars_only(self) -> None:
        """A 2-norm of a sharded tensor adds up squares shard by shard: one scalar all_reduce each."""
        mesh = init_device_mesh("cpu", (4,))
        fulls = positive_list(0)
        xs = distribute_list(fulls, mesh, [[S0], [S1], [R], [S0], [S0]])
        with CommDebugMode() as comm:
            norms = torch._foreach_norm(xs, 2)
        self.assertEqual({str(k): v for k, v in comm.get_comm_counts().items()}, {"all_reduce": 4})
        for norm, full in zip(norms, fulls):
            self.assertEqual(norm.placements, (R,))
            torch.testing.assert_close(norm.full_tensor(), torch.linalg.vector_norm(full))

    @with_comms
    def test_plain_zero_dim_tensors_in_lists(self) -> None:
        """Lists of plain 0-d tensors (optimizer step counts) beside DTensor lists are scalars."""
        mesh = init_device_mesh("cpu", (4,))
        fulls = positive_list(0)
        xs = distribute_list(fulls, mesh, LAYOUTS[(4,)]["self"])
        steps = [torch.tensor(float(i + 1)) for i in range(len(xs))]
        out = torch._foreach_div(xs, torch._foreach_add(steps, 1.0))
        for o, full, step in zip(out, fulls, steps):
            torch.testing.assert_close(o.full_tensor(), full / (step + 1.0))

    @with_comms
    def test_shared_dtensor_operand_needing_two_layouts_is_refused(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        # x * P would stay partial for the replicated x, but must be reduced for the sharded one
        xs = distribute_list(positive_list(0)[:2], mesh, [[S0], [R]])
        scale = make_dtensor(torch.tensor(2.0), mesh, [SUM])
        with pytest.raises(NotImplementedError, match="redistribute it to Replicate"):
            torch._foreach_mul(xs, scale)

    @with_comms
    def test_mixed_lists_are_refused(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        fulls = positive_list(0)[:3]
        xs: list[torch.Tensor] = [*distribute_list(fulls[:2], mesh, [[S0], [R]]), fulls[2]]
        with pytest.raises(RuntimeError, match=r"'self' mixes DTensors \(positions \[0, 1\]\) and plain tensors \(positions \[2\]\)"):
            torch._foreach_add_(xs, 1.0)
        ys = distribute_list(fulls, mesh, [[S0], [R], [R]])
        with pytest.raises(RuntimeError, match="'other' argument at list position 0"):
            torch._foreach_add_(ys, fulls)

    @with_comms
    def test_list_op_without_a_rule_says_what_to_do(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        xs = distribute_list(positive_list(0)[:2], mesh, [[S0], [R]])
        with pytest.raises(NotImplementedError, match=r"_foreach_erfc\.default has no list rule; .*foreach=False"):
            torch._foreach_erfc(xs)

    @with_comms
    def test_in_place_nonlinear_op_on_a_partial_self_is_refused(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        xs = distribute_list(positive_list(0)[:2], mesh, [[S0], [SUM]])
        with pytest.raises(NotImplementedError, match="at list position 1"):
            torch._foreach_sqrt_(xs)


def test_every_list_rule_decides_like_an_op_with_a_rule() -> None:
    for op in REGISTRY.registered_ops():
        rule = REGISTRY.rule_for(op)
        if isinstance(rule, ListRule) and rule.element_op is not None:
            assert REGISTRY.rule_for(rule.element_op) is not None, f"{op} is decided like {rule.element_op}, which has no rule"


def test_one_list_passed_as_several_arguments() -> None:
    """addcmul(xs, xs, xs): each DTensor is an input three times, its partial moved once."""

    def run() -> list[torch.Tensor]:
        mesh = init_device_mesh("cpu", (4,))
        xs = distribute_list(positive_list(0), mesh, LAYOUTS[(4,)]["self"])
        return [o.full_tensor() for o in torch._foreach_addcmul(xs, xs, xs, value=2.0)]

    expected = torch._foreach_addcmul(positive_list(0), positive_list(0), positive_list(0), value=2.0)
    for result in run_threaded(run, 4):
        for got, want in zip(result, expected):
            torch.testing.assert_close(got, want)
