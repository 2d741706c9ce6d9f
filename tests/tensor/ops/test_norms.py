"""Batch and group norm on DTensors equal plain torch (outputs, gradients and the running statistics
they update in place), keeping channel and batch shards where the statistics allow."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from spmd.tensor import DTensor, Partial, Replicate, Shard, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.testing import DTensorTestBase, check_against_torch, seeded_randn, with_comms
from spmd.testing.layouts import make_dtensor

R, S0, S1, S2 = Replicate(), Shard(0), Shard(1), Shard(2)
AVG = Partial("avg")
N, C, L = 6, 4, 8  # over 4 ranks: 6 samples -> 2, 2, 2, 0 (an empty piece); 4 channels -> 1 each; 8 -> 2 each


randn = functools.partial(seeded_randn, dtype=torch.float64)


def batch_norm_inputs() -> list[torch.Tensor]:
    """x, running_mean, running_var, weight, bias."""
    return [randn(N, C, L), randn(C, seed=1), randn(C, seed=2).abs() + 0.5, randn(C, seed=3), randn(C, seed=4)]


class BatchNormTest(DTensorTestBase):
    def run_batch_norm(self, mesh: Any, layouts: Sequence[Sequence[Any]], *, training: bool) -> tuple[DTensor, int]:
        """F.batch_norm on DTensors laid out as ``layouts`` against torch: output, input and weight
        gradients, and the running statistics afterwards; returns the output and the forward's collectives."""
        x, mean, var, weight, bias = batch_norm_inputs()
        ref_x, ref_w = x.clone().requires_grad_(), weight.clone().requires_grad_()
        ref_mean, ref_var = mean.clone(), var.clone()
        d_x = make_dtensor(x, mesh, layouts[0], requires_grad=True)
        d_mean, d_var = make_dtensor(mean, mesh, layouts[1]), make_dtensor(var, mesh, layouts[2])
        d_w = make_dtensor(weight, mesh, layouts[3], requires_grad=True)
        d_b = make_dtensor(bias, mesh, layouts[4])
        for d in (d_x, d_w):
            d.retain_grad()
        with CommDebugMode() as comm:
            out = F.batch_norm(d_x, d_mean, d_var, d_w, d_b, training=training, momentum=0.3)
        expected = F.batch_norm(ref_x, ref_mean, ref_var, ref_w, bias, training=training, momentum=0.3)
        torch.testing.assert_close(out.full_tensor(), expected)
        torch.testing.assert_close(d_mean.full_tensor(), ref_mean)
        torch.testing.assert_close(d_var.full_tensor(), ref_var)
        self.assertEqual((d_mean.placements, d_var.placements), (tuple(layouts[1]), tuple(layouts[2])))
        weight_out = randn(N, C, L, seed=9)
        (out.full_tensor() * weight_out).sum().backward()
        (expected * weight_out).sum().backward()
        assert d_x.grad is not None and d_w.grad is not None and ref_x.grad is not None and ref_w.grad is not None
        torch.testing.assert_close(d_x.grad.full_tensor(), ref_x.grad)
        torch.testing.assert_close(d_w.grad.full_tensor(), ref_w.grad)
        return out, comm.get_total_counts()

    @with_comms
    def test_eval_mode_keeps_shards_off_the_channel_dim(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        out, moved = self.run_batch_norm(mesh, [[S2], [R], [R], [R], [R]], training=False)
        self.assertEqual((moved, out.placements), (0, (S2,)))
        # 6 samples over 4 ranks leave one empty, on which torch's backward kernel would divide by zero
        out, moved = self.run_batch_norm(mesh, [[S0], [R], [R], [R], [R]], training=False)
        self.assertGreater(moved, 0)

    @with_comms
    def test_channel_shards_in_training_update_their_piece_of_the_running_statistics(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        out, moved = self.run_batch_norm(mesh, [[S1], [S0], [S0], [S0], [S0]], training=True)
        self.assertEqual((moved, out.placements), (0, (S1,)))

    @with_comms
    def test_training_on_a_batch_shard_gathers_and_updates_replicated_statistics(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        self.run_batch_norm(mesh, [[S0], [R], [R], [R], [R]], training=True)

    @with_comms
    def test_running_statistics_in_mixed_layouts_are_still_updated(self) -> None:
        """No candidate leaves running_mean S(0) and running_var R both in place: the call runs on
        replicated copies and writes them back."""
        mesh, mesh_2d = init_device_mesh("cpu", (4,)), init_device_mesh("cpu", (2, 2))
        self.run_batch_norm(mesh, [[S1], [S0], [R], [R], [R]], training=True)
        self.run_batch_norm(mesh_2d, [[S0, S2], [S0, R], [R, S0], [S0, R], [R, R]], training=True)

    @with_comms
    def test_eval_mode_passes_an_average(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x, mean, var, weight, bias = batch_norm_inputs()
        with CommDebugMode() as comm:
            out = F.batch_norm(
                make_dtensor(x, mesh, [AVG]),
                *(make_dtensor(t, mesh, [R]) for t in (mean, var, weight, bias)),
                training=False,
            )
        self.assertEqual((comm.get_total_counts(), out.placements), (0, (AVG,)))
        torch.testing.assert_close(out.full_tensor(), F.batch_norm(x, mean, var, weight, bias, training=False))


class GroupNormTest(DTensorTestBase):
    @with_comms
    def test_group_norm_keeps_the_batch_shard(self) -> None:
        """Each sample's groups are whole on its rank: S(0) in, S(0) out, the weight's gradient a
        pending sum over the batch pieces; an empty piece (6 over 4) is fine."""
        mesh = init_device_mesh("cpu", (4,))
        x, weight, bias = randn(N, C, L).requires_grad_(), randn(C, seed=1).requires_grad_(), randn(C, seed=2)
        out = check_against_torch(
            lambda t, w, b: F.group_norm(t, 2, w, b), x, weight, bias, placements=[[S0], [R], [R]], mesh=mesh,
            collectives=0,
        )
        self.assertEqual(out.placements, (S0,))
