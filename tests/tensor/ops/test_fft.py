"""torch.fft on DTensors keeps the shards of the dims it does not transform, forward and backward,
moves nothing to do so, and equals plain torch; a pending sum passes through (the DFT is linear)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from spmd.tensor import Partial, Replicate, Shard, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.testing import DTensorTestBase, check_against_torch, seeded_randn, with_comms
from spmd.testing.layouts import make_dtensor

R, S0, S1, S2 = Replicate(), Shard(0), Shard(1), Shard(2)
SUM = Partial("sum")
SHAPE = (7, 5, 8)  # over 4 ranks: 7 -> 2, 2, 2, 1; 5 -> 2, 2, 1, 0 (an empty piece)

TRANSFORMS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], list[Any]]] = {
    # name: (transform, layouts that keep their shard)
    "fft(dim=-1)": (lambda x: torch.fft.fft(x), [S0]),
    "rfft(dim=1)": (lambda x: torch.fft.rfft(x, dim=1), [S0, S2]),
    "irfft(n=10)": (lambda x: torch.fft.irfft(x, n=10), [S0]),
    "fft2": (lambda x: torch.fft.fft2(x), [S0]),
    "ihfft2(dims 1, 2)": (lambda x: torch.fft.ihfft2(x, dim=(1, 2)), [S0]),
    "hfft(dim=0)": (lambda x: torch.fft.hfft(x, dim=0), [S2]),
    "fftn(norm=ortho)": (lambda x: torch.fft.fftn(x, dim=(1, 2), norm="ortho"), [S0]),
}


class FFTTest(DTensorTestBase):
    @with_comms
    def test_untransformed_dims_keep_their_shards(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        full = seeded_randn(*SHAPE, dtype=torch.float64).requires_grad_()
        for name, (transform, layouts) in TRANSFORMS.items():
            for layout in layouts:
                with self.subTest(op=name, layout=layout):
                    out = check_against_torch(transform, full, placements=[[layout]], mesh=mesh, collectives=0)
                    self.assertEqual(out.placements, (layout,))

    @with_comms
    def test_a_dim_with_an_empty_piece_is_gathered_first(self) -> None:
        """The CPU FFT kernels reject an empty batch: dim 1 (5 over 4 ranks leaves one empty) is
        gathered, and the values are still right."""
        mesh = init_device_mesh("cpu", (4,))
        full = seeded_randn(*SHAPE, dtype=torch.float64)
        out = torch.fft.fft(make_dtensor(full, mesh, [S1]))
        torch.testing.assert_close(out.full_tensor(), torch.fft.fft(full))

    @with_comms
    def test_a_transformed_shard_is_gathered_first(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        full = seeded_randn(*SHAPE, dtype=torch.float64)
        x = make_dtensor(full, mesh, [S0, S2])
        out = torch.fft.rfft(x)
        self.assertEqual(out.placements[0], S0)
        torch.testing.assert_close(out.full_tensor(), torch.fft.rfft(full))

    @with_comms
    def test_a_pending_sum_passes_through(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        full = seeded_randn(*SHAPE, dtype=torch.float64)
        with CommDebugMode() as comm:
            out = torch.fft.fft(make_dtensor(full, mesh, [SUM]))
        self.assertEqual((comm.get_total_counts(), out.placements), (0, (SUM,)))
        torch.testing.assert_close(out.full_tensor(), torch.fft.fft(full))
