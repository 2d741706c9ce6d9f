"""SequenceParallel: run token-wise modules (norms, dropout) on activations sharded on the sequence dim.

Parameters are replicated; the input is laid out as Shard(sequence_dim) and the output keeps that
layout. Norm weights get Partial(sum) gradients (every rank saw only its tokens); they are summed
when the optimizer or ``full_tensor()`` reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from spmd.tensor import DeviceMesh, DTensor, Replicate, Shard, distribute_module
from spmd.tensor_parallel.layouts import FirstInputLayout, distribute_parameters, resolve_tp_mesh_dim
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

        prepare_input = FirstInputLayout(self, layout, layout, tp)
        return distribute_module(module, device_mesh, partition, prepare_input, _LocalOutput(self.use_local_output))


@dataclass(frozen=True, slots=True)
class _LocalOutput:
    """The ``distribute_module`` output_fn of SequenceParallel: the output as it is, or its local piece."""

    use_local: bool

    def __call__(self, module: nn.Module, outputs: Any, mesh: DeviceMesh) -> Any:
        if self.use_local and isinstance(outputs, DTensor):
            return outputs.to_local()
        return outputs
