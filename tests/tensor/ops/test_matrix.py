"""Matrix products and attention on DTensors: values and gradients equal plain torch."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from spmd.tensor import Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.tensor.ops import REGISTRY
from spmd.testing import DTensorTestBase, check_against_torch, seeded_randn, with_comms
from spmd.testing.layouts import make_dtensor

aten = torch.ops.aten
R, S0, S1, S2, S3 = Replicate(), Shard(0), Shard(1), Shard(2), Shard(3)
SUM = Partial("sum")


randn = functools.partial(seeded_randn, dtype=torch.float64)


class MatrixOpsTest(DTensorTestBase):
    @with_comms
    def test_mm_uneven(self) -> None:
        a, b = randn(7, 5), randn(5, 6, seed=1)
        for mesh_shape in [(4,), (2, 2)]:
            mesh = init_device_mesh("cpu", mesh_shape)
            layouts = [[R], [S0], [S1]] if mesh.ndim == 1 else [[S0, S1], [R, S0], [S1, R]]
            self.run_subtests({"la": layouts, "lb": layouts},
                              lambda m, la, lb: check_against_torch(torch.mm, a.requires_grad_(), b.requires_grad_(), placements=[la, lb], mesh=m), mesh)

    @with_comms
    def test_bmm_layouts(self) -> None:
        a, b = randn(5, 7, 6), randn(5, 6, 3, seed=1)
        mesh = init_device_mesh("cpu", (4,))
        layouts = [[R], [S0], [S1], [S2]]
        self.run_subtests({"la": layouts, "lb": layouts},
                          lambda la, lb: check_against_torch(torch.bmm, a.requires_grad_(), b.requires_grad_(), placements=[la, lb], mesh=mesh))
        mesh2 = init_device_mesh("cpu", (2, 2))
        self.run_subtests(
            {"la": [[S0, S1], [S2, S0], [S1, S2]], "lb": [[S0, R], [S1, S2], [S0, S0]]},
            lambda la, lb: check_against_torch(torch.bmm, a.requires_grad_(), b.requires_grad_(), placements=[la, lb], mesh=mesh2),
        )

    @with_comms
    def test_bmm_moves_no_data_on_its_strategies(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        a, b = randn(8, 7, 6), randn(8, 6, 3, seed=1)
        cases = [([S0], [S0], (S0,)), ([S1], [R], (S1,)), ([R], [S2], (S2,)), ([S2], [S1], (SUM,))]
        for la, lb, expected in cases:
            x, y = distribute_tensor(a, mesh, la), distribute_tensor(b, mesh, lb)
            with CommDebugMode() as comm:
                out = torch.bmm(x, y)
            self.assertEqual(comm.get_total_counts(), 0)
            self.assertEqual(out.placements, expected)
            torch.testing.assert_close(out.full_tensor(), a @ b)
        # Backward of batch-sharded bmm stays batch-sharded: no collective either.
        x = distribute_tensor(a, mesh, [S0]).requires_grad_()
        y = distribute_tensor(b, mesh, [S0]).requires_grad_()
        out = torch.bmm(x, y)
        grad = distribute_tensor(randn(8, 7, 3, seed=2), mesh, [S0])
        with CommDebugMode() as comm:
            gx, gy = torch.autograd.grad(out, (x, y), grad)
        self.assertEqual(comm.get_total_counts(), 0)
        self.assertEqual((gx.placements, gy.placements), ((S0,), (S0,)))

    @with_comms
    def test_partial_operands(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        a, b = randn(5, 7, 6), randn(5, 6, 3, seed=1)
        for la, lb in [([SUM], [R]), ([R], [Partial("avg")]), ([SUM], [S0])]:
            x, y = make_dtensor(a, mesh, la), make_dtensor(b, mesh, lb)
            torch.testing.assert_close(torch.bmm(x, y).full_tensor(), a @ b)
        p, r = make_dtensor(randn(7, 5), mesh, [SUM]), distribute_tensor(randn(5, 6, seed=1), mesh, [R])
        with CommDebugMode() as comm:
            out = torch.mm(p, r)
        self.assertEqual(comm.get_total_counts(), 0)
        self.assertEqual(out.placements, (SUM,))
        # a product of two partial sums is not a partial sum: one side is reduced first
        q = make_dtensor(randn(5, 6, seed=1), mesh, [SUM])
        torch.testing.assert_close(torch.mm(p, q).full_tensor(), randn(7, 5) @ randn(5, 6, seed=1))

    @with_comms
    def test_addmm_bias_follows_output(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        m1, m2 = randn(7, 5), randn(5, 6, seed=1)
        bias_1d, bias_2d, bias_col = randn(6, seed=2), randn(7, 6, seed=3), randn(7, 1, seed=4)
        layouts = [[R], [S0], [S1]]

        def check(bias: torch.Tensor, lb: Any, l1: Any, l2: Any) -> None:
            fn = lambda b, x, y: torch.addmm(b, x, y, beta=0.5, alpha=2.0)  # noqa: E731
            check_against_torch(fn, bias.requires_grad_(), m1.requires_grad_(), m2.requires_grad_(), placements=[lb, l1, l2], mesh=mesh)

        self.run_subtests({"bias": [bias_1d, bias_2d, bias_col], "lb": [[R], [S0]], "l1": layouts, "l2": layouts},
                          check)
        # a partial operand: the bias becomes partial too, so the reduction counts it once
        self.run_subtests({"bias": [bias_1d, bias_2d], "lb": [[R], [SUM]], "l1": [[SUM], [Partial("avg")]],
                           "l2": [[R]]}, check)
        # Output S(1): a 1-d bias is cut as S(0) locally; output P(sum): the bias is added once.
        x1, x2 = distribute_tensor(m1, mesh, [R]), distribute_tensor(m2, mesh, [S1])
        b = distribute_tensor(bias_1d, mesh, [R])
        with CommDebugMode() as comm:
            out = torch.addmm(b, x1, x2)
        self.assertEqual(comm.get_total_counts(), 0)
        self.assertEqual(out.placements, (S1,))
        x1, x2 = distribute_tensor(m1, mesh, [S1]), distribute_tensor(m2, mesh, [S0])
        with CommDebugMode() as comm:
            out = torch.addmm(b, x1, x2)
        self.assertEqual(comm.get_total_counts(), 0)
        self.assertEqual(out.placements, (SUM,))
        torch.testing.assert_close(out.full_tensor(), torch.addmm(bias_1d, m1, m2))

    @with_comms
    def test_addmm_on_2d_mesh_and_in_place(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        m1, m2, bias = randn(7, 5), randn(5, 6, seed=1), randn(6, seed=2)
        self.run_subtests(
            {"l1": [[S0, S1], [S1, S1], [R, S0]], "l2": [[R, S0], [S0, S1], [S1, R]]},
            lambda l1, l2: check_against_torch(torch.addmm, bias.requires_grad_(), m1.requires_grad_(), m2.requires_grad_(), placements=[[R, R], l1, l2], mesh=mesh),
        )
        target = randn(7, 6, seed=3)
        for layout in [[S0, S1], [R, R], [S1, S0]]:
            self_ = distribute_tensor(target, mesh, layout)
            self_.addmm_(distribute_tensor(m1, mesh, [S0, R]), distribute_tensor(m2, mesh, [R, S1]))
            self.assertEqual(self_.placements, tuple(layout))
            torch.testing.assert_close(self_.full_tensor(), torch.addmm(target, m1, m2))

    @with_comms
    def test_baddbmm_broadcast_bias(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        b1, b2 = randn(5, 7, 6), randn(5, 6, 3, seed=1)
        layouts = [[R], [S0], [S1], [S2]]

        def check(bias: torch.Tensor, l1: Any, l2: Any) -> None:
            fn = lambda b, x, y: torch.baddbmm(b, x, y, beta=0.5, alpha=2.0)  # noqa: E731
            check_against_torch(fn, bias.requires_grad_(), b1.requires_grad_(), b2.requires_grad_(), placements=[[R], l1, l2], mesh=mesh)

        self.run_subtests({"bias": [randn(5, 7, 3, seed=2), randn(3, seed=3), randn(7, 1, seed=4)],
                           "l1": layouts, "l2": layouts}, check)
        bias = distribute_tensor(randn(3, seed=3), mesh, [R])
        x, y = distribute_tensor(b1, mesh, [S2]), distribute_tensor(b2, mesh, [S1])
        with CommDebugMode() as comm:
            out = torch.baddbmm(bias, x, y)
        self.assertEqual(comm.get_total_counts(), 0)
        self.assertEqual(out.placements, (SUM,))
        torch.testing.assert_close(out.full_tensor(), torch.baddbmm(randn(3, seed=3), b1, b2))

    @with_comms
    def test_dot_mv_addmv(self) -> None:
        a, v, u, bias = randn(7, 5), randn(5, seed=1), randn(5, seed=2), randn(7, seed=3)
        for mesh_shape in [(4,), (2, 2)]:
            mesh = init_device_mesh("cpu", mesh_shape)
            vec = [[R], [S0]] if mesh.ndim == 1 else [[S0, S0], [R, S0]]
            mat = [[R], [S0], [S1]] if mesh.ndim == 1 else [[S0, S1], [S1, R], [S0, S0]]
            self.run_subtests({"lv": vec, "lu": vec},
                              lambda m, lv, lu: check_against_torch(torch.dot, v.requires_grad_(), u.requires_grad_(), placements=[lv, lu], mesh=m), mesh)
            self.run_subtests({"la": mat, "lv": vec},
                              lambda m, la, lv: check_against_torch(torch.mv, a.requires_grad_(), v.requires_grad_(), placements=[la, lv], mesh=m), mesh)
            self.run_subtests(
                {"la": mat, "lv": vec},
                lambda m, la, lv: check_against_torch(torch.addmv, bias.requires_grad_(), a.requires_grad_(), v.requires_grad_(), placements=[[R] * m.ndim, la, lv], mesh=m),
                mesh,
            )
        mesh = init_device_mesh("cpu", (4,))
        x, y = distribute_tensor(v, mesh, [S0]), distribute_tensor(u, mesh, [S0])
        with CommDebugMode() as comm:
            out = torch.dot(x, y)
        self.assertEqual(comm.get_total_counts(), 0)
        self.assertEqual(out.placements, (SUM,))
        torch.testing.assert_close(out.full_tensor(), torch.dot(v, u))

    @with_comms
    def test_matmul_and_linear_decompositions(self) -> None:
        """matmul and linear are CompositeImplicit: they reach us as view/expand/mm/bmm/addmm."""
        mesh = init_device_mesh("cpu", (4,))
        cases = [
            ((7, 3, 5), (5, 6), [[S0], [R]]),
            ((7, 3, 5), (5, 6), [[S2], [S0]]),
            ((7, 3, 5), (7, 5, 6), [[S0], [S0]]),
            ((2, 3, 4, 5), (2, 3, 5, 6), [[S1], [S1]]),
            ((7, 5), (5,), [[S0], [R]]),
            ((5,), (5,), [[S0], [S0]]),
        ]
        self.run_subtests(
            {"case": cases},
            lambda case: check_against_torch(torch.matmul, randn(*case[0]).requires_grad_(), randn(*case[1], seed=1).requires_grad_(), placements=case[2], mesh=mesh),
        )
        x3, w, b = randn(7, 3, 5), randn(6, 5, seed=1), randn(6, seed=2)
        self.run_subtests(
            {"lx": [[R], [S0], [S2]], "lw": [[R], [S0], [S1]]},
            lambda lx, lw: check_against_torch(F.linear, x3.requires_grad_(), w.requires_grad_(), b.requires_grad_(), placements=[lx, lw, [R]], mesh=mesh),
        )
        mesh2 = init_device_mesh("cpu", (2, 2))
        check_against_torch(F.linear, randn(7, 5).requires_grad_(), w.requires_grad_(), b.requires_grad_(), placements=[[S0, R], [R, S0], [R, R]], mesh=mesh2)
        # Column-parallel linear: weight rows sharded -> output columns sharded, no communication.
        x, weight = distribute_tensor(randn(7, 5), mesh, [R]), distribute_tensor(w, mesh, [S0])
        bias = distribute_tensor(b, mesh, [S0])
        with CommDebugMode() as comm:
            out = F.linear(x, weight, bias)
        self.assertEqual(comm.get_total_counts(), 0)
        self.assertEqual(out.placements, (S1,))

    @with_comms
    def test_einsum(self) -> None:
        if REGISTRY.rule_for(aten.permute.default) is None:
            self.skipTest("einsum decomposes through aten.permute, which has no rule yet")
        mesh = init_device_mesh("cpu", (4,))
        cases = [
            ("bij,bjk->bik", (5, 3, 4), (5, 4, 6), [[S0], [S0]]),
            ("bhqd,bhkd->bhqk", (2, 5, 3, 4), (2, 5, 6, 4), [[S1], [S1]]),
            ("ij,jk->ik", (7, 5), (5, 6), [[S1], [S0]]),
        ]
        self.run_subtests(
            {"case": cases},
            lambda case: check_against_torch(lambda a, b: torch.einsum(case[0], a, b), randn(*case[1]).requires_grad_(), randn(*case[2], seed=1).requires_grad_(), placements=case[3], mesh=mesh),
        )


class AttentionTest(DTensorTestBase):
    @with_comms
    def test_sdpa_layouts(self) -> None:
        q, k, v = randn(2, 5, 6, 8), randn(2, 5, 7, 8, seed=1), randn(2, 5, 7, 8, seed=2)
        mesh = init_device_mesh("cpu", (4,))
        layouts = [
            [[S1], [S1], [S1]],  # heads (5 over 4: uneven)
            [[S0], [S0], [S0]],  # batch
            [[S2], [R], [R]],  # query rows
            [[R], [R], [SUM]],  # v partial
            [[S3], [S2], [R]],  # nothing matches: redistributed
        ]
        self.run_subtests(
            {"layout": layouts, "is_causal": [False, True]},
            lambda layout, is_causal: check_against_torch(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=is_causal), q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), placements=layout, mesh=mesh),
        )
        mesh2 = init_device_mesh("cpu", (2, 2))
        self.run_subtests(
            {"layout": [[[S0, S1]] * 3, [[S1, S2], [S1, R], [S1, R]]], "is_causal": [False, True]},
            lambda layout, is_causal: check_against_torch(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=is_causal), q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), placements=layout, mesh=mesh2),
        )

    @with_comms
    def test_sdpa_grouped_query_heads(self) -> None:
        q, k, v = randn(2, 8, 6, 8), randn(2, 4, 7, 8, seed=1), randn(2, 4, 7, 8, seed=2)
        fn = lambda a, b, c: F.scaled_dot_product_attention(a, b, c, enable_gqa=True)  # noqa: E731
        mesh = init_device_mesh("cpu", (4,))
        out = check_against_torch(fn, q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), placements=[[S1], [S1], [S1]], mesh=mesh)
        self.assertEqual(out.placements, (S1,))
        # 2 kv heads over 4 ranks cannot keep whole groups together: the heads are gathered
        check_against_torch(fn, q.requires_grad_(), k[:, :2].requires_grad_(), v[:, :2].requires_grad_(), placements=[[S1], [S1], [S1]], mesh=mesh)
        check_against_torch(fn, q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), placements=[[S0, S1], [S0, S1], [S0, S1]], mesh=init_device_mesh("cpu", (2, 2)))

    @with_comms
    def test_sdpa_with_mask(self) -> None:
        q, k, v = randn(2, 4, 6, 8), randn(2, 4, 7, 8, seed=1), randn(2, 4, 7, 8, seed=2)
        mask = randn(6, 7, seed=3)
        mesh = init_device_mesh("cpu", (4,))
        fn = lambda a, b, c, m: F.scaled_dot_product_attention(a, b, c, attn_mask=m)  # noqa: E731
        self.run_subtests(
            {"layout": [[[S1], [S1], [S1], [R]], [[S2], [R], [R], [S0]], [[S0], [S0], [S0], [S1]]]},
            lambda layout: check_against_torch(fn, q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), mask.requires_grad_(), placements=layout, mesh=mesh),
        )

    @with_comms
    def test_sdpa_heads_sharded_moves_no_data(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        q, k, v = (distribute_tensor(randn(2, 8, 6, 8, seed=s), mesh, [S1]).requires_grad_() for s in range(3))
        with CommDebugMode() as comm:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        self.assertEqual(comm.get_total_counts(), 0)
        self.assertEqual(out.placements, (S1,))
        grad = distribute_tensor(randn(2, 8, 6, 8, seed=4), mesh, [S1])
        with CommDebugMode() as comm:
            grads = torch.autograd.grad(out, (q, k, v), grad)
        self.assertEqual(comm.get_total_counts(), 0)
        self.assertEqual([g.placements for g in grads], [(S1,)] * 3)
        # query rows sharded: dq stays sharded, dk and dv are partial sums over the rows
        q, k, v = (distribute_tensor(randn(2, 3, 8, 8, seed=s), mesh, [S2 if s == 0 else R]).requires_grad_()
                   for s in range(3))
        out = F.scaled_dot_product_attention(q, k, v)
        self.assertEqual(out.placements, (S2,))
        grads = torch.autograd.grad(out, (q, k, v), distribute_tensor(randn(2, 3, 8, 8, seed=4), mesh, [S2]))
        self.assertEqual([g.placements for g in grads], [(S2,), (SUM,), (SUM,)])


def well_conditioned(*shape: int, seed: int = 0) -> torch.Tensor:
    """Batches of square matrices far from singular: noise plus 4 on the diagonal."""
    return randn(*shape, seed=seed) + 4 * torch.eye(shape[-1], dtype=torch.float64)


def positive_definite(*shape: int, seed: int = 0) -> torch.Tensor:
    a = randn(*shape, seed=seed)
    return a @ a.mT + shape[-1] * torch.eye(shape[-1], dtype=torch.float64)


def symmetric_part(fn: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
    """eigh and cholesky read one triangle; symmetrising first makes the gradient torch's in both."""
    return lambda a: fn((a + a.mT) / 2)


LINALG = {
    "det": (torch.linalg.det, [well_conditioned]),
    "slogdet": (lambda a: torch.linalg.slogdet(a).logabsdet, [well_conditioned]),
    "logdet": (torch.logdet, [positive_definite]),
    "inv": (torch.linalg.inv, [well_conditioned]),
    "solve(matrix)": (torch.linalg.solve, [well_conditioned, lambda *s, seed: randn(*s[:-1], 2, seed=seed)]),
    "solve(vector)": (torch.linalg.solve, [well_conditioned, lambda *s, seed: randn(*s[:-1], seed=seed)]),
    "lu_factor + lu_solve": (
        lambda a, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b),
        [well_conditioned, lambda *s, seed: randn(*s[:-1], 3, seed=seed)],
    ),
    "solve_triangular": (
        lambda a, b: torch.linalg.solve_triangular(a.triu(), b, upper=True),
        [well_conditioned, lambda *s, seed: randn(*s, seed=seed)],
    ),
    "svdvals": (torch.linalg.svdvals, [randn]),
    "eigvalsh": (symmetric_part(torch.linalg.eigvalsh), [positive_definite]),
    "cholesky": (symmetric_part(torch.linalg.cholesky), [positive_definite]),
    "qr.R": (lambda a: torch.linalg.qr(a).R.abs(), [well_conditioned]),
    "pinv": (torch.linalg.pinv, [well_conditioned]),
    "matrix_norm(fro)": (torch.linalg.matrix_norm, [randn]),
    "matrix_norm(nuc)": (lambda a: torch.linalg.matrix_norm(a, "nuc"), [randn]),
    "matrix_norm(2)": (lambda a: torch.linalg.matrix_norm(a, 2), [randn]),
    "matrix_norm(1)": (lambda a: torch.linalg.matrix_norm(a, 1), [randn]),
    "matrix_norm(-inf)": (lambda a: torch.linalg.matrix_norm(a, -torch.inf), [randn]),
    "linalg.norm": (torch.linalg.norm, [randn]),
}


class LinalgTest(DTensorTestBase):
    def check(self, mesh: Any, name: str, shape: tuple[int, ...], layout: Sequence[Any]) -> None:
        """Every operand laid out as ``layout``; a vector right-hand side (one dim fewer) is R off its batch dims."""
        fn, makers = LINALG[name]
        fulls = [make(*shape, seed=i).requires_grad_() for i, make in enumerate(makers)]
        layouts = [
            layout if f.ndim == len(shape) else [R if isinstance(p, Shard) and p.dim >= f.ndim - 1 else p for p in layout]
            for f in fulls
        ]
        check_against_torch(fn, *fulls, placements=layouts, mesh=mesh)

    @with_comms
    def test_every_linalg_op_on_every_layout(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        self.run_subtests(
            {"name": list(LINALG), "layout": [[R], [S0], [S1], [S2]]}, self.check, mesh, shape=(5, 3, 3)
        )  # 5 matrices over 4 ranks: 2, 2, 1, 0 (an empty batch piece)
        mesh2 = init_device_mesh("cpu", (2, 2))
        self.run_subtests(
            {"name": list(LINALG), "layout": [[S0, S1], [S1, S0], [S0, S3]]}, self.check, mesh2, shape=(2, 3, 4, 4)
        )

    @with_comms
    def test_batch_sharded_linalg_keeps_the_batch_shards(self) -> None:
        """Matrices whole on each rank: nothing moves but the tiny error-check info of inv and solve."""
        mesh = init_device_mesh("cpu", (2, 2))
        a_full, b_full = well_conditioned(4, 2, 3, 3), randn(4, 2, 3, 2, seed=1)
        for fn, expected_comms in [
            (lambda a, b: torch.linalg.det(a), {}),
            (lambda a, b: torch.linalg.slogdet(a).logabsdet, {}),
            (lambda a, b: torch.linalg.svdvals(a), {}),
            (lambda a, b: torch.linalg.matrix_norm(a, "nuc"), {}),
            (lambda a, b: torch.linalg.lu_solve(*torch.linalg.lu_factor(a), b), {"all_gather": 2}),
            (lambda a, b: torch.linalg.inv(a), {"all_gather": 2}),
            (lambda a, b: torch.linalg.solve(a, b), {"all_gather": 2}),
        ]:
            a, b = distribute_tensor(a_full, mesh, [S0, S1]), distribute_tensor(b_full, mesh, [S0, S1])
            with CommDebugMode() as comm:
                out = fn(a, b)
            self.assertEqual(out.placements, (S0, S1))
            self.assertEqual({str(k): v for k, v in comm.get_comm_counts().items()}, expected_comms)
            torch.testing.assert_close(out.full_tensor(), fn(a_full, b_full))
        # a sharded matrix dim is gathered first; the batch shard stays
        out = torch.linalg.det(distribute_tensor(a_full, mesh, [S0, S2]))
        self.assertEqual(out.placements[0], S0)
        torch.testing.assert_close(out.full_tensor(), torch.linalg.det(a_full))

    @with_comms
    def test_a_singular_matrix_on_one_rank_raises_on_every_rank(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        a_full = well_conditioned(4, 3, 3)
        a_full[3] = 0.0  # only the last rank holds it
        a = distribute_tensor(a_full, mesh, [S0])
        with self.assertRaisesRegex(RuntimeError, "singular"):
            torch.linalg.inv(a)

    @with_comms
    def test_solve_is_linear_in_a_pending_right_hand_side(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        a_full, b_full = well_conditioned(3, 3), randn(3, 2, seed=1)
        a, b = distribute_tensor(a_full, mesh, [R]), make_dtensor(b_full, mesh, [SUM])
        with CommDebugMode() as comm:
            x = aten._linalg_solve_ex.default(a, b)[0]
        self.assertEqual((comm.get_total_counts(), x.placements), (0, (SUM,)))
        torch.testing.assert_close(x.full_tensor(), torch.linalg.solve(a_full, b_full))


class ThreeDimMeshTest(DTensorTestBase):
    world_size = 8


    @with_comms
    def test_products_and_attention_on_2x2x2(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2, 2))
        a, b, bias = randn(4, 7, 6), randn(4, 6, 5, seed=1), randn(5, seed=2)
        check_against_torch(torch.baddbmm, bias.requires_grad_(), a.requires_grad_(), b.requires_grad_(), placements=[[R, R, R], [S0, S2, S1], [S0, S1, R]], mesh=mesh)
        check_against_torch(torch.bmm, a.requires_grad_(), b.requires_grad_(), placements=[[S1, S0, S2], [R, S0, S1]], mesh=mesh)
        # every dim of 8 splits over any set of the mesh dims without leaving a rank empty
        q, k, v = randn(8, 8, 8, 4), randn(8, 8, 6, 4, seed=1), randn(8, 8, 6, 4, seed=2)
        out = check_against_torch(F.scaled_dot_product_attention, q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), placements=[[S0, S1, S2], [S0, S1, R], [S0, S1, R]], mesh=mesh)
        self.assertEqual(out.placements, (S0, S1, S2))
        # 2 batches and 4 heads could leave a rank empty, which the CPU kernel cannot take: gathered
        check_against_torch(F.scaled_dot_product_attention, q[:2, :4].requires_grad_(), k[:2, :4].requires_grad_(), v[:2, :4].requires_grad_(), placements=[[S0, S1, S2], [S0, S1, R], [S0, S1, R]], mesh=mesh)
