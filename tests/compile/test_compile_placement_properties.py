"""torch.compile(fullgraph=True) of code that reads ``Partial.is_linear`` and ``Communicator.local_rank``
on values from outside the compiled function, as DTensor-aware model code and hooks do."""

from __future__ import annotations

import torch

from spmd.comm import Communicator
from spmd.tensor import Partial, init_device_mesh
from spmd.testing import run_threaded


def scale_if_linear(x: torch.Tensor, placement: Partial) -> torch.Tensor:
    """Average-able partials divide by 2; max/min ones pass through."""
    return x / 2 if placement.is_linear else x


def offset_by_rank(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    return x + comm.local_rank * 10 + comm.size


def test_partial_is_linear_reads_in_compiled_code() -> None:
    x = torch.ones(3)
    compiled = torch.compile(scale_if_linear, backend="eager", fullgraph=True)
    for placement in (Partial("sum"), Partial("avg"), Partial("max")):
        torch.testing.assert_close(compiled(x, placement), scale_if_linear(x, placement))
    assert Partial("sum").is_linear and not Partial("max").is_linear


def test_communicator_local_rank_reads_in_compiled_code_on_each_rank_thread() -> None:
    def rank() -> tuple[torch.Tensor, torch.Tensor]:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        comm = mesh.get_communicator("tp")
        x = torch.zeros(2)
        return torch.compile(offset_by_rank, backend="eager", fullgraph=True)(x, comm), offset_by_rank(x, comm)

    for r, (compiled, eager) in enumerate(run_threaded(rank, 4)):
        torch.testing.assert_close(compiled, eager)
        assert eager[0].item() == (r % 2) * 10 + 2
