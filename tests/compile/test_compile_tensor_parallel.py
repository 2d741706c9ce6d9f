"""Tensor-parallel modules under torch.compile(fullgraph=True): the styles' hooks (from_local on plain
inputs, redistribute, to_local) trace without graph breaks, and forward and backward match eager."""

from __future__ import annotations

import torch
from torch import nn

from spmd.tensor import init_device_mesh
from spmd.tensor_parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from spmd.testing import run_threaded, seeded_module, seeded_randn


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def test_colwise_then_rowwise_mlp_on_plain_inputs() -> None:
    inputs = seeded_randn(4, 8, seed=3)

    def run(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        out = model(inputs)
        out.sum().backward()
        return out, model.up.weight.grad.full_tensor()

    def rank():
        mesh = init_device_mesh("cpu", (2,))
        plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
        eager = parallelize_module(seeded_module(MLP(), seed=0), mesh, plan)
        compiled = parallelize_module(seeded_module(MLP(), seed=0), mesh, plan)
        return run(torch.compile(compiled, backend="aot_eager", fullgraph=True)), run(eager)

    for (out, grad), (expected_out, expected_grad) in run_threaded(rank, 2):
        assert type(out) is torch.Tensor  # RowwiseParallel hands back a plain (replicated) tensor
        torch.testing.assert_close(out, expected_out)
        torch.testing.assert_close(grad, expected_grad)
