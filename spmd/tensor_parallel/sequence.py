"""SequenceParallel: run token-wise modules (norms, dropout) on activations sharded on the sequence dim.

Parameters are replicated; the input is laid out as Shard(sequence_dim) and the output keeps that
layout. Norm weights get Partial(sum) gradients (every rank saw only its tokens); they are summed
when the optimizer or ``full_tensor()`` reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from spmd.tensor import DeviceMesh, DTensor, Replicate, Shard, distribute_module
from spmd.tensor_parallel.layouts import (
    as_dtensor,
    distribute_parameters,
    first_tensor_input,
    relayout,
    resolve_tp_mesh_dim,
)
from spmd.tensor_parallel.style import ParallelStyle

__all__ = ["SequenceParallel"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SequenceParallel(ParallelStyle):
    """Replicate a token-wise module's parameters and run it on sequence-sharded input.

    A plain-tensor input is read as this rank's sequence shard; a DTensor input is redistributed
    to ``Shard(sequence_dim)`` on the tp mesh dim (other mesh dims keep their placements).
    """

    sequence_dim: int = 1
    """The input dim that holds the sequence (tokens)."""
    use_local_output: bool = False
    """Return this rank's local piece of the output instead of the DTensor."""

    def __post_init__(self) -> None:
        if not isinstance(self.sequence_dim, int) or isinstance(self.sequence_dim, bool):
            raise TypeError(f"SequenceParallel(sequence_dim=...) takes an int, got {self.sequence_dim!r}")

    def apply(
        self,
        module: nn.Module,
        device_mesh: DeviceMesh,
        *,
        src_data_rank: int | None = 0,
        tp_mesh_dim: int | str | None = None,
    ) -> nn.Module:
        layout = Shard(self.sequence_dim)
        tp = resolve_tp_mesh_dim(device_mesh, tp_mesh_dim)

        def partition(name: str, submodule: nn.Module, mesh: DeviceMesh) -> None:
            replicated = {param_name: Replicate() for param_name in submodule._parameters}
            distribute_parameters(submodule, mesh, replicated, src_data_rank, tp)

        def prepare_input(mod: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
            x = as_dtensor(first_tensor_input(mod, inputs, self), mesh, layout, tp)
            return (relayout(x, layout, use_local=False, tp_dim=tp), *inputs[1:])

        def prepare_output(mod: nn.Module, outputs: Any, mesh: DeviceMesh) -> torch.Tensor:
            if self.use_local_output and isinstance(outputs, DTensor):
                return outputs.to_local()
            return outputs

        return distribute_module(module, device_mesh, partition, prepare_input, prepare_output)
