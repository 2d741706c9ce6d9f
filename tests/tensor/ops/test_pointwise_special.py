"""Special functions and other pointwise ops with extra arguments keep their shards, forward and
backward, and equal plain torch: acosh, erfc, polygamma, mvlgamma, the special_* family, frexp,
shrinks, glu and prelu."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from spmd.tensor import Partial, Replicate, Shard, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.testing import DTensorTestBase, check_against_torch, seeded_randn, with_comms
from spmd.testing.layouts import make_dtensor

R, S0, S1 = Replicate(), Shard(0), Shard(1)
SUM = Partial("sum")
SHAPE = (7, 6)  # over 4 ranks: 7 -> 2, 2, 2, 1; 6 -> 2, 2, 2, 0 (an empty shard)


randn = functools.partial(seeded_randn, dtype=torch.float64)


def positive(seed: int = 0) -> torch.Tensor:
    return randn(*SHAPE, seed=seed).abs() + 1.5


UNARY: dict[str, tuple[Callable[[torch.Tensor], Any], Callable[[], torch.Tensor]]] = {
    "acosh": (torch.acosh, positive),
    "asinh": (torch.asinh, lambda: randn(*SHAPE)),
    "erfc": (torch.erfc, lambda: randn(*SHAPE)),
    "exp2": (torch.exp2, lambda: randn(*SHAPE)),
    "log10": (torch.log10, positive),
    "sinc": (torch.sinc, lambda: randn(*SHAPE)),
    "i0": (torch.i0, lambda: randn(*SHAPE)),
    "polygamma(2)": (lambda x: torch.polygamma(2, x), positive),
    "digamma": (torch.digamma, positive),
    "mvlgamma(p=3)": (lambda x: torch.mvlgamma(x, 3), positive),
    "special.bessel_j0": (torch.special.bessel_j0, lambda: randn(*SHAPE)),
    "special.i1e": (torch.special.i1e, lambda: randn(*SHAPE)),
    "special.log_ndtr": (torch.special.log_ndtr, lambda: randn(*SHAPE)),
    "special.erfcx": (torch.special.erfcx, lambda: randn(*SHAPE)),
    "celu": (lambda x: F.celu(x, alpha=0.5), lambda: randn(*SHAPE)),
    "hardshrink": (lambda x: F.hardshrink(x, 0.3), lambda: randn(*SHAPE)),
    "softshrink": (lambda x: F.softshrink(x, 0.3), lambda: randn(*SHAPE)),
    "frexp": (torch.frexp, lambda: randn(*SHAPE)),
    "isposinf": (torch.isposinf, lambda: randn(*SHAPE) / 0),
}
BINARY: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    "igamma": lambda a, x: torch.igamma(a.detach(), x),  # torch has no derivative in a
    "logaddexp2": torch.logaddexp2,
    "logical_xor": lambda a, b: torch.logical_xor(a > 2, b > 2),
    "special.xlog1py": torch.special.xlog1py,
    "special.zeta": lambda x, q: torch.special.zeta(x.detach(), q.detach()),  # nor any for zeta
    "special.chebyshev_polynomial_t": lambda x, n: torch.special.chebyshev_polynomial_t(x - 2, n.round()),
}


def outputs_of(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (tuple, list)) else [value]


class SpecialPointwiseTest(DTensorTestBase):
    def check(
        self,
        fn: Callable[..., Any],
        inputs: Sequence[torch.Tensor],
        mesh: Any,
        layouts: Sequence[Sequence[Any]],
        *,
        moves_nothing: bool = True,
    ) -> None:
        """The shared oracle; with ``moves_nothing`` (and no partial input) the forward also moves no
        data and the first output keeps the first input's layout."""
        moves_nothing = moves_nothing and not any(isinstance(p, Partial) for layout in layouts for p in layout)
        out = check_against_torch(fn, *inputs, placements=layouts, mesh=mesh, collectives=0 if moves_nothing else None)
        if moves_nothing:
            self.assertEqual(outputs_of(out)[0].placements, tuple(layouts[0]))

    @with_comms
    def test_unary_ops_keep_shards(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        mesh_2d = init_device_mesh("cpu", (2, 2))
        for name, (fn, make) in UNARY.items():
            with self.subTest(op=name):
                for m, layout in [(mesh, [S0]), (mesh, [S1]), (mesh, [R]), (mesh_2d, [S1, S0])]:
                    self.check(fn, [make().requires_grad_()], m, [layout])

    @with_comms
    def test_binary_ops_keep_matching_shards(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        for name, fn in BINARY.items():
            with self.subTest(op=name):
                for layouts in [([S0], [S0]), ([S1], [S1]), ([S0], [R])]:
                    self.check(fn, [positive().requires_grad_(), positive(seed=1).requires_grad_()], mesh, layouts)

    @with_comms
    def test_a_pending_sum_is_reduced_before_a_nonlinear_op(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        self.check(torch.special.bessel_j0, [randn(*SHAPE).requires_grad_()], mesh, [[SUM]])

    @with_comms
    def test_glu_keeps_shards_off_the_halved_dim(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x = randn(8, 6).requires_grad_()  # glu halves its dim, so that dim must be even
        for dim, layout, moves in [(-1, S0, False), (0, S1, False), (-1, S1, True)]:
            x_dt = make_dtensor(x, mesh, [layout])
            with CommDebugMode() as comm:
                out = F.glu(x_dt, dim)
            self.assertEqual(comm.get_total_counts() > 0, moves)
            if not moves:
                self.assertEqual(out.placements, (layout,))
            self.check(lambda t, dim=dim: F.glu(t, dim), [x], mesh, [[layout]], moves_nothing=not moves)

    @with_comms
    def test_prelu_per_channel_weight(self) -> None:
        """prelu's weight broadcasts over the batch: a batch shard gives the weight's gradient as a
        pending sum, a channel shard shards the weight too."""
        mesh = init_device_mesh("cpu", (4,))
        x, weight = randn(5, 6, 3).requires_grad_(), (randn(6, seed=1).abs() * 0.3).requires_grad_()
        for layouts in [([S0], [R]), ([S1], [S0]), ([Shard(2)], [R]), ([R], [R])]:
            self.check(F.prelu, [x, weight], mesh, layouts)
