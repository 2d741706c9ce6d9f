"""Pools, upsampling, grid sampling and shuffles keep batch and channel shards, forward and backward,
without moving data, and equal plain torch."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from spmd.tensor import Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.testing import DTensorTestBase, check_against_torch, seeded_randn, with_comms
from spmd.testing.layouts import make_dtensor

R, S0, S1, S2 = Replicate(), Shard(0), Shard(1), Shard(2)
SUM, AVG = Partial("sum"), Partial("avg")
randn = functools.partial(seeded_randn, dtype=torch.float64)


IMAGE = (6, 4, 6, 6)  # over 4 ranks: 6 images -> 2, 2, 2, 0 (pools accept an empty batch); 4 channels -> 1 each
POOLS: dict[str, Callable[[torch.Tensor], Any]] = {
    "avg_pool2d": lambda x: F.avg_pool2d(x, 3, stride=2, padding=1),
    "avg_pool1d": lambda x: F.avg_pool1d(x.flatten(2), 4),
    "max_pool2d": lambda x: F.max_pool2d(x, 2, return_indices=True),
    "max_pool3d": lambda x: F.max_pool3d(x.unsqueeze(2).expand(-1, -1, 2, -1, -1), 2),
    "adaptive_avg_pool2d": lambda x: F.adaptive_avg_pool2d(x, 4),
    "adaptive_max_pool2d": lambda x: F.adaptive_max_pool2d(x, (3, 2), return_indices=True),
    "interpolate nearest": lambda x: F.interpolate(x, scale_factor=2),
    "interpolate bilinear": lambda x: F.interpolate(x, size=(9, 7), mode="bilinear", align_corners=True),
    "interpolate bicubic": lambda x: F.interpolate(x, scale_factor=1.5, mode="bicubic"),
    "interpolate antialias": lambda x: F.interpolate(x, scale_factor=0.5, mode="bilinear", antialias=True),
    "interpolate linear": lambda x: F.interpolate(x.flatten(2), scale_factor=2, mode="linear"),
    "local_response_norm": lambda x: F.local_response_norm(x, 2),
    "pixel_unshuffle": lambda x: F.pixel_unshuffle(x, 2),
    "channel_shuffle": lambda x: F.channel_shuffle(x, 2),
    "unfold": lambda x: F.unfold(x, 2, stride=2),
    "fold(unfold)": lambda x: F.fold(F.unfold(x, 3, padding=1), (6, 6), 3, padding=1),
}


class PoolingTest(DTensorTestBase):
    @with_comms
    def test_batch_and_channel_shards_stay(self) -> None:
        """A batch shard, a channel shard and both on a 2-d mesh: no data moves."""
        mesh, mesh_2d = init_device_mesh("cpu", (4,)), init_device_mesh("cpu", (2, 2))
        x = randn(*IMAGE).requires_grad_()
        for name, fn in POOLS.items():
            cases = [(mesh_2d, [S0, S0])]
            if name != "pixel_unshuffle":  # torch's pixel_unshuffle mishandles an empty batch
                cases.append((mesh, [S0]))
            if name not in ("unfold", "fold(unfold)", "channel_shuffle", "pixel_unshuffle", "local_response_norm"):
                cases += [(mesh, [S1]), (mesh_2d, [S0, S1])]  # the others mix channels
            for m, layout in cases:
                with self.subTest(op=name, layout=layout):
                    check_against_torch(fn, x, placements=[layout], mesh=m, collectives=0)

    @with_comms
    def test_an_empty_batch_piece(self) -> None:
        """3 images over 4 ranks: the last rank pools an empty batch."""
        mesh = init_device_mesh("cpu", (4,))
        x = randn(3, 2, 6, 6).requires_grad_()  # 3 -> 1, 1, 1, 0
        for name in ["avg_pool2d", "max_pool2d", "adaptive_max_pool2d", "interpolate bilinear", "unfold"]:
            with self.subTest(op=name):
                check_against_torch(POOLS[name], x, placements=[[S0]], mesh=mesh, collectives=0)

    @with_comms
    def test_a_spatial_shard_is_gathered_and_the_result_is_right(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x = randn(*IMAGE).requires_grad_()
        for name in ["avg_pool2d", "max_pool2d", "interpolate bicubic"]:
            with self.subTest(op=name):
                with CommDebugMode() as comm:
                    POOLS[name](distribute_tensor(x.detach(), mesh, [Shard(2)]))
                self.assertGreater(comm.get_total_counts(), 0)
                check_against_torch(POOLS[name], x, placements=[[Shard(2)]], mesh=mesh)

    @with_comms
    def test_linear_ops_keep_a_pending_sum(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x = randn(*IMAGE)
        for name in ["avg_pool2d", "adaptive_avg_pool2d", "interpolate bilinear", "unfold"]:
            for partial in (SUM, AVG):
                with self.subTest(op=name, partial=partial):
                    with CommDebugMode() as comm:
                        out = POOLS[name](make_dtensor(x, mesh, [partial]))
                    self.assertEqual((comm.get_total_counts(), out.placements), (0, (partial,)))
                    torch.testing.assert_close(out.full_tensor(), POOLS[name](x))
        # max pooling is not linear: the sum is reduced first
        check_against_torch(POOLS["max_pool2d"], x.requires_grad_(), placements=[[SUM]], mesh=mesh)

    @with_comms
    def test_grid_sample_batch_and_channel(self) -> None:
        """Batch shards on input and grid; a channel shard samples with the whole grid (whose
        gradient is then a pending sum over the channel pieces); a shard of the grid's output
        points samples the whole input (whose gradient is then a pending sum)."""
        mesh = init_device_mesh("cpu", (4,))
        x, grid = randn(5, 4, 6, 6).requires_grad_(), torch.tanh(randn(5, 3, 4, 2, seed=1)).requires_grad_()
        for layouts in [[[S0], [S0]], [[S1], [R]], [[R], [S1]], [[R], [S2]]]:
            with self.subTest(layouts=layouts):
                grid_sample = lambda a, g: F.grid_sample(a, g, align_corners=False)  # noqa: E731
                check_against_torch(grid_sample, x, grid, placements=layouts, mesh=mesh, collectives=0)
