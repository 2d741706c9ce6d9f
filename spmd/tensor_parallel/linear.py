"""ColwiseParallel and RowwiseParallel: the two halves of a Megatron-style sharded Linear pair.

  ColwiseParallel  Linear     weight [out, in] S(0), bias S(0)   input R      -> output S(-1)
                   Embedding  weight [num, dim] S(1)             indices R    -> output S(-1)
  RowwiseParallel  Linear     weight [out, in] S(1), bias R      input S(-1)  -> output P(sum) -> R
                   Embedding  weight [num, dim] S(0)             indices R    -> output P(sum) -> R
A Colwise Linear followed by a Rowwise one needs no communication between them and one
all_reduce (or reduce_scatter, for ``output_layouts=Shard(d)``) at the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from spmd.tensor import DeviceMesh, Placement, Replicate, Shard, distribute_module
from spmd.tensor.torch_objects import refuse_torch_object
from spmd.tensor_parallel.layouts import (
    FirstInputLayout,
    distribute_parameters,
    module_output,
    relayout,
    resolve_tp_mesh_dim,
    resolve_use_local,
)
from spmd.tensor_parallel.style import ParallelStyle, UnsupportedModuleError

__all__ = ["ColwiseParallel", "RowwiseParallel"]


def _check_layout(style: ParallelStyle, name: str, value: object) -> None:
    if value is not None and not isinstance(value, Placement):
        refuse_torch_object(value, f"{type(style).__name__}({name}=...)")
        raise TypeError(
            f"{type(style).__name__}({name}=...) takes one Placement such as Shard(-1) or Replicate(), got {value!r}"
        )


def _apply_linear_style(
    style: ParallelStyle,
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    parameter_layouts: dict[str, Placement],
    input_layout: Placement,
    desired_input_layout: Placement,
    output_layout: Placement,
    use_local_output: bool | None,
    src_data_rank: int | None,
    tp_mesh_dim: int | str | None,
) -> nn.Module:
    """Shard the parameters, lay the first input out as the kernel needs, and the output as asked.

    All layouts are on the tp mesh dim; other mesh dims of the activations are kept as they come.
    """
    tp = resolve_tp_mesh_dim(mesh, tp_mesh_dim)
    use_local = resolve_use_local(use_local_output, mesh)

    def partition(name: str, submodule: nn.Module, _mesh: DeviceMesh) -> None:
        if submodule is module:
            distribute_parameters(module, mesh, parameter_layouts, src_data_rank, tp)

    prepare_input = FirstInputLayout(style, input_layout, desired_input_layout, tp)
    prepare_output = _OutputLayout(style, output_layout, use_local, tp)
    return distribute_module(module, mesh, partition, prepare_input, prepare_output)


@dataclass(frozen=True, slots=True)
class _OutputLayout:
    """The linear styles' ``distribute_module`` output_fn: the output redistributed to ``layout`` on the tp dim."""

    style: ParallelStyle
    layout: Placement
    use_local: bool
    tp_dim: int

    def __call__(self, module: nn.Module, outputs: Any, mesh: DeviceMesh) -> torch.Tensor:
        output = module_output(module, outputs, self.style)
        return relayout(output, self.layout, use_local=self.use_local, tp_dim=self.tp_dim)


@dataclass(frozen=True, kw_only=True, slots=True)
class ColwiseParallel(ParallelStyle):
    """Shard an ``nn.Linear`` on its output features or an ``nn.Embedding`` on its embedding dim.

    >>> parallelize_module(mlp, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})  # doctest: +SKIP
    """

    input_layouts: Placement | None = None
    """How a plain-tensor input is laid out on each rank; default ``Replicate()``."""
    output_layouts: Placement | None = None
    """The layout the output is redistributed to; default ``Shard(-1)`` (no communication)."""
    use_local_output: bool | None = None
    """Return this rank's local piece of the output instead of the DTensor; None: local on a 1-d mesh,
    the DTensor on an n-d one (a local piece would lose the other dims' layout)."""

    def __post_init__(self) -> None:
        _check_layout(self, "input_layouts", self.input_layouts)
        _check_layout(self, "output_layouts", self.output_layouts)

    def apply(
        self,
        module: nn.Module,
        device_mesh: DeviceMesh,
        *,
        src_data_rank: int | None = 0,
        tp_mesh_dim: int | str | None = None,
    ) -> nn.Module:
        if isinstance(module, nn.Linear):
            parameter_layouts: dict[str, Placement] = {"weight": Shard(0), "bias": Shard(0)}
        elif isinstance(module, nn.Embedding):
            parameter_layouts = {"weight": Shard(1)}
        else:
            raise UnsupportedModuleError(
                f"{self!r} cannot shard {type(module).__name__}: it shards nn.Linear (weight Shard(0)) and "
                "nn.Embedding (weight Shard(1)); use SequenceParallel() for norms and dropout, or "
                "PrepareModuleInput/PrepareModuleOutput to lay out a module's inputs and outputs only"
            )
        return _apply_linear_style(
            self,
            module,
            device_mesh,
            parameter_layouts=parameter_layouts,
            input_layout=Replicate() if self.input_layouts is None else self.input_layouts,
            desired_input_layout=Replicate(),
            output_layout=Shard(-1) if self.output_layouts is None else self.output_layouts,
            use_local_output=self.use_local_output,
            src_data_rank=src_data_rank,
            tp_mesh_dim=tp_mesh_dim,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class RowwiseParallel(ParallelStyle):
    """Shard an ``nn.Linear`` on its input features (an ``nn.Embedding`` on its rows); the partial
    results are summed at the output.

    The bias is replicated and added once, to the reduced sum (not once per rank).
    """

    input_layouts: Placement | None = None
    """How a plain-tensor input is laid out on each rank; default ``Shard(-1)``."""
    output_layouts: Placement | None = None
    """The layout the partial output is reduced to; default ``Replicate()`` (all_reduce);
    ``Shard(d)`` gives a reduce_scatter (sequence parallelism)."""
    use_local_output: bool | None = None
    """Return this rank's local piece of the output instead of the DTensor; None: local on a 1-d mesh,
    the DTensor on an n-d one (a local piece would lose the other dims' layout)."""

    def __post_init__(self) -> None:
        _check_layout(self, "input_layouts", self.input_layouts)
        _check_layout(self, "output_layouts", self.output_layouts)

    def apply(
        self,
        module: nn.Module,
        device_mesh: DeviceMesh,
        *,
        src_data_rank: int | None = 0,
        tp_mesh_dim: int | str | None = None,
    ) -> nn.Module:
        if isinstance(module, nn.Embedding):
            # Each rank looks up the indices its rows hold (zeros elsewhere): a P(sum) output.
            return _apply_linear_style(
                self,
                module,
                device_mesh,
                parameter_layouts={"weight": Shard(0)},
                input_layout=Replicate() if self.input_layouts is None else self.input_layouts,
                desired_input_layout=Replicate(),
                output_layout=Replicate() if self.output_layouts is None else self.output_layouts,
                use_local_output=self.use_local_output,
                src_data_rank=src_data_rank,
                tp_mesh_dim=tp_mesh_dim,
            )
        if not isinstance(module, nn.Linear):
            raise UnsupportedModuleError(
                f"{self!r} cannot shard {type(module).__name__}: it shards nn.Linear (weight Shard(1), bias "
                "Replicate()); use SequenceParallel() for norms and dropout, or "
                "PrepareModuleInput/PrepareModuleOutput to lay out a module's inputs and outputs only"
            )
        return _apply_linear_style(
            self,
            module,
            device_mesh,
            parameter_layouts={"weight": Shard(1), "bias": Replicate()},
            input_layout=Shard(-1) if self.input_layouts is None else self.input_layouts,
            desired_input_layout=Shard(-1),
            output_layout=Replicate() if self.output_layouts is None else self.output_layouts,
            use_local_output=self.use_local_output,
            src_data_rank=src_data_rank,
            tp_mesh_dim=tp_mesh_dim,
        )
