"""Turning a module's inputs and outputs into DTensors of the layout a style wants, and back."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from spmd.tensor import DeviceMesh, DTensor, Placement, distribute_tensor

__all__ = ["as_dtensor", "relayout", "first_tensor_input", "module_output", "distribute_parameters"]


def as_dtensor(value: torch.Tensor, mesh: DeviceMesh, layout: Placement) -> DTensor:
    """A DTensor as it is; a plain tensor read as this rank's piece laid out as ``layout``.

    A plain tensor's global shape assumes even shards; pass a DTensor for uneven ones.
    """
    if isinstance(value, DTensor):
        if value.device_mesh != mesh:
            raise ValueError(
                f"got a DTensor on {value.device_mesh}, but the module is parallelised over {mesh}; pass a "
                "DTensor on that mesh, or this rank's local tensor"
            )
        return value
    return DTensor.from_local(value, mesh, [layout], run_check=False)


def relayout(value: DTensor, layout: Placement | None, *, use_local: bool) -> torch.Tensor:
    """``value`` redistributed to ``layout`` (None: as it is), as a local tensor if ``use_local``."""
    if layout is not None:
        value = value.redistribute(placements=[layout])
    return value.to_local() if use_local else value


def first_tensor_input(module: nn.Module, inputs: tuple[Any, ...], style: object) -> torch.Tensor:
    """The module's first positional input, which a style lays out; a clear error when there is none."""
    if not inputs or not isinstance(inputs[0], torch.Tensor):
        got = type(inputs[0]).__name__ if inputs else "no positional input"
        raise TypeError(
            f"{style!r} lays out the first positional input of {type(module).__name__}, which must be a "
            f"tensor; got {got}. Use PrepareModuleInput for modules with other inputs"
        )
    return inputs[0]


def module_output(module: nn.Module, outputs: Any, style: object) -> DTensor:
    """The module's output, which must be one DTensor for a style that shards the module's parameters."""
    if not isinstance(outputs, DTensor):
        raise TypeError(
            f"{style!r} expects {type(module).__name__} to return one DTensor, got {type(outputs).__name__}; "
            "use PrepareModuleOutput for modules with other outputs"
        )
    return outputs


def distribute_parameters(
    module: nn.Module, mesh: DeviceMesh, layouts: Mapping[str, Placement], src_data_rank: int | None
) -> None:
    """Replace the module's own parameters named in ``layouts`` by DTensor parameters of that layout."""
    for name, layout in layouts.items():
        param = module._parameters.get(name)
        if param is None or isinstance(param, DTensor):
            continue
        sharded = distribute_tensor(param.detach(), mesh, [layout], src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
