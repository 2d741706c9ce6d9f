"""Products, distances and batched linalg on DTensors equal plain torch, forward and backward, and
keep (or sum up) their shards without gathering the operands."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from spmd.tensor import Partial, Replicate, Shard, init_device_mesh
from spmd.testing import DTensorTestBase, check_against_torch, seeded_randn, with_comms

R, S0, S1, S2 = Replicate(), Shard(0), Shard(1), Shard(2)
SUM = Partial("sum")


randn = functools.partial(seeded_randn, dtype=torch.float64)


def spd(*batch: int, n: int = 4) -> torch.Tensor:
    """Symmetric positive definite matrices (*batch, n, n)."""
    a = randn(*batch, n, n, seed=5)
    return a @ a.mT + n * torch.eye(n, dtype=torch.float64)


class ProductsTest(DTensorTestBase):
    def check(
        self,
        fn: Callable[..., Any],
        inputs: Sequence[torch.Tensor],
        mesh: Any,
        layouts: Sequence[Sequence[Any]],
        expected_placements: tuple[Any, ...] | None = None,
    ) -> None:
        """The shared oracle; with ``expected_placements``, the forward also moves no data and the
        (first) output has those placements."""
        moves_nothing = expected_placements is not None
        out = check_against_torch(
            fn, *inputs, placements=layouts, mesh=mesh, collectives=0 if moves_nothing else None
        )
        if moves_nothing:
            self.assertEqual((out[0] if isinstance(out, tuple) else out).placements, expected_placements)

    @with_comms
    def test_addr_and_addbmm(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        bias, u, v = randn(7, 5).requires_grad_(), randn(7, seed=1).requires_grad_(), randn(5, seed=2).requires_grad_()
        addr = lambda b, x, y: torch.addr(b, x, y, beta=0.5, alpha=2.0)  # noqa: E731
        self.check(addr, [bias, u, v], mesh, [[S0], [S0], [R]], (S0,))
        self.check(addr, [bias, u, v], mesh, [[S1], [R], [S0]], (S1,))
        b1, b2 = randn(6, 7, 3, seed=3).requires_grad_(), randn(6, 3, 5, seed=4).requires_grad_()
        # the batch is summed over: batch shards give a pending sum, and so does the bias' share
        self.check(torch.addbmm, [bias, b1, b2], mesh, [[SUM], [S0], [S0]], (SUM,))
        self.check(torch.addbmm, [bias, b1, b2], mesh, [[S0], [S1], [R]], (S0,))

    @with_comms
    def test_vdot_and_cross(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        self.check(torch.vdot, [randn(9).requires_grad_(), randn(9, seed=1).requires_grad_()], mesh, [[S0], [S0]], (SUM,))
        a, b = randn(7, 3, 5).requires_grad_(), randn(7, 3, 5, seed=1).requires_grad_()
        cross = lambda x, y: torch.linalg.cross(x, y, dim=1)  # noqa: E731
        self.check(cross, [a, b], mesh, [[S0], [S0]], (S0,))
        self.check(cross, [a, b], mesh, [[S2], [S2]], (S2,))
        self.check(cross, [a, b], mesh, [[S1], [S1]])  # the cross dim is gathered first

    @with_comms
    def test_trace_of_every_block_layout(self) -> None:
        """Each rank adds the diagonal elements its block holds: P(sum), without moving data."""
        mesh, mesh_2d = init_device_mesh("cpu", (4,)), init_device_mesh("cpu", (2, 2))
        for shape in [(7, 7), (5, 9), (9, 5)]:
            x = randn(*shape).requires_grad_()
            for m, layout in [(mesh, [S0]), (mesh, [S1]), (mesh_2d, [S0, S1]), (mesh_2d, [S1, S1])]:
                with self.subTest(shape=shape, layout=layout):
                    self.check(torch.trace, [x], m, [layout], (SUM,) * len(layout))
        self.check(torch.trace, [randn(5, 5).requires_grad_()], mesh, [[SUM]], (SUM,))

    @with_comms
    def test_dist_and_cdist(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        a, b = randn(7, 5).requires_grad_(), randn(7, 5, seed=1).requires_grad_()
        for p in (1.0, 2.0, 3.0, float("inf")):
            with self.subTest(p=p):
                self.check(lambda x, y, p=p: torch.dist(x, y, p), [a, b], mesh, [[S0], [S0]])
        x1, x2 = randn(3, 7, 4).requires_grad_(), randn(3, 6, 4, seed=1).requires_grad_()
        self.check(torch.cdist, [x1, x2], mesh, [[S0], [S0]], (S0,))
        self.check(torch.cdist, [x1, x2], mesh, [[S1], [R]], (S1,))
        self.check(torch.cdist, [x1, x2], mesh, [[R], [S1]], (S2,))

    @with_comms
    def test_batched_linalg_keeps_the_batch_shard(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        a = spd(6).requires_grad_()  # 6 matrices -> 2, 2, 2, 0: linalg kernels accept an empty batch
        rhs = randn(6, 4, 2, seed=3).requires_grad_()
        lower = torch.linalg.cholesky(a)
        cases: dict[str, tuple[Callable[..., Any], list[torch.Tensor]]] = {
            "cholesky": (torch.cholesky, [a]),
            "cholesky_inverse": (torch.cholesky_inverse, [lower]),
            "cholesky_solve": (torch.cholesky_solve, [rhs, lower]),
            "triangular_solve": (lambda b, m: torch.triangular_solve(b, m, upper=False), [rhs, lower]),
            "matrix_exp": (torch.linalg.matrix_exp, [a / 10]),
            "lu": (lambda m: torch.linalg.lu(m)[1:], [a]),  # L, U (the permutation has no gradient)
            "eigvals": (lambda m: torch.linalg.eigvals(m).abs(), [a]),
        }
        for name, (fn, fulls) in cases.items():
            with self.subTest(op=name):
                self.check(fn, fulls, mesh, [[S0]] * len(fulls), (S0,))

    @with_comms
    def test_solves_are_linear_in_the_right_hand_side(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        lower = torch.linalg.cholesky(spd(n=5)).requires_grad_()
        rhs = randn(5, 3, seed=1).requires_grad_()
        self.check(torch.cholesky_solve, [rhs, lower], mesh, [[SUM], [R]], (SUM,))
