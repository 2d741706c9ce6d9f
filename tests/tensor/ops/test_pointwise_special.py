"""Special functions and other pointwise ops with extra arguments keep their shards, forward and
backward, and equal plain torch: acosh, erfc, polygamma, mvlgamma, the special_* family, frexp,
shrinks, glu and prelu."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from spmd.tensor import DTensor, Partial, Replicate, Shard, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.testing import DTensorTestBase, seeded_randn, with_comms
from spmd.testing.layouts import make_dtensor

R, S0, S1 = Replicate(), Shard(0), Shard(1)
SUM = Partial("sum")
SHAPE = (7, 6)  # over 4 ranks: 7 -> 2, 2, 2, 1; 6 -> 2, 2, 2, 0 (an empty shard)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return seeded_randn(*shape, seed=seed, dtype=torch.float64)


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
        fulls: Sequence[torch.Tensor],
        mesh: Any,
        layouts: Sequence[Sequence[Any]],
        *,
        moves_nothing: bool = True,
    ) -> None:
        """fn on DTensors in ``layouts``: values equal torch's and (``moves_nothing``, no partial
        inputs) no data moves and the output keeps the first input's layout; the gradients of the
        first output equal torch's."""
        leaves = [f.clone().requires_grad_(f.is_floating_point()) for f in fulls]
        dtensors = [
            make_dtensor(f, mesh, layout, requires_grad=f.is_floating_point()) for f, layout in zip(fulls, layouts)
        ]
        for d in dtensors:
            if d.requires_grad:
                d.retain_grad()
        with CommDebugMode() as comm:
            outs = outputs_of(fn(*dtensors))
        expected = outputs_of(fn(*leaves))
        if moves_nothing and not any(isinstance(p, Partial) for layout in layouts for p in layout):
            self.assertEqual(comm.get_total_counts(), 0)
            self.assertEqual(outs[0].placements, tuple(layouts[0]))
        for out, want in zip(outs, expected):
            self.assertIsInstance(out, DTensor)
            torch.testing.assert_close(out.full_tensor(), want, equal_nan=True)
        if not (expected[0].requires_grad and expected[0].is_floating_point()):
            return
        weight = randn(*expected[0].shape, seed=9)
        (outs[0].full_tensor() * weight).sum().backward()
        (expected[0] * weight).sum().backward()
        for d, leaf in zip(dtensors, leaves):
            if leaf.grad is not None:
                assert d.grad is not None
                torch.testing.assert_close(d.grad.full_tensor(), leaf.grad)

    @with_comms
    def test_unary_ops_keep_shards(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        mesh_2d = init_device_mesh("cpu", (2, 2))
        for name, (fn, make) in UNARY.items():
            with self.subTest(op=name):
                for m, layout in [(mesh, [S0]), (mesh, [S1]), (mesh, [R]), (mesh_2d, [S1, S0])]:
                    self.check(fn, [make()], m, [layout])

    @with_comms
    def test_binary_ops_keep_matching_shards(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        for name, fn in BINARY.items():
            with self.subTest(op=name):
                for layouts in [([S0], [S0]), ([S1], [S1]), ([S0], [R])]:
                    self.check(fn, [positive(), positive(seed=1)], mesh, layouts)

    @with_comms
    def test_a_pending_sum_is_reduced_before_a_nonlinear_op(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        self.check(torch.special.bessel_j0, [randn(*SHAPE)], mesh, [[SUM]])

    @with_comms
    def test_glu_keeps_shards_off_the_halved_dim(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x = randn(8, 6)  # glu halves its dim, so that dim must be even
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
        x, weight = randn(5, 6, 3), randn(6, seed=1).abs() * 0.3
        for layouts in [([S0], [R]), ([S1], [S0]), ([Shard(2)], [R]), ([R], [R])]:
            self.check(F.prelu, [x, weight], mesh, layouts)
