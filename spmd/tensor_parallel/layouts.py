"""Turning a module's inputs and outputs into DTensors of the layout a style wants, and back.

A style's layout is one placement on the tensor-parallel mesh dim (``tp_dim``). On an n-d mesh the
other dims are left as they come: a DTensor keeps its placements there (e.g. ``Shard(0)`` over
``dp`` for the batch), and a parameter or a plain-tensor input is ``Replicate()`` there.

The hooks a style registers on a module are frozen dataclasses with ``__call__`` (never lambdas or
closures) holding only the style, the mesh, placements and plain values, so that a parallelised
module pickles, saves with ``torch.save`` and deep-copies.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from spmd.tensor import DeviceMesh, DTensor, Placement, Replicate, distribute_tensor

__all__ = [
    "TP_MESH_DIM_NAME",
    "resolve_tp_mesh_dim",
    "resolve_use_local",
    "tp_placements",
    "as_dtensor",
    "relayout",
    "first_tensor_input",
    "FirstInputLayout",
    "module_output",
    "distribute_parameters",
]

TP_MESH_DIM_NAME = "tp"
"""The mesh dim name the styles act on by default on an n-d mesh."""


def resolve_tp_mesh_dim(mesh: DeviceMesh, tp_mesh_dim: int | str | None) -> int:
    """The index of the tensor-parallel mesh dim: the only one of a 1-d mesh, else the one named "tp"."""
    return mesh.dim_for(
        tp_mesh_dim,
        default_name=TP_MESH_DIM_NAME,
        purpose="tensor parallelism",
        argument="tp_mesh_dim",
        hint=', or pass the 1-d sub-mesh mesh["tp"]',
    )


def resolve_use_local(use_local: bool | None, mesh: DeviceMesh) -> bool:
    """``use_local_output=None``: local tensors on a 1-d mesh, DTensors on an n-d one.

    On an n-d mesh a local piece would lose how the other dims lay it out (the batch over dp).
    """
    return mesh.ndim == 1 if use_local is None else use_local


def tp_placements(mesh: DeviceMesh, tp_dim: int, layout: Placement) -> tuple[Placement, ...]:
    """``layout`` on the tp dim and ``Replicate()`` on every other mesh dim."""
    # mesh.dim_index(-1) + 1 is mesh.ndim through a method: torch.compile (torch 2.13) cannot read a
    # property of a mesh a hook holds (a Dynamo limitation of opaque objects), but can call methods.
    return tuple(layout if d == tp_dim else Replicate() for d in range(mesh.dim_index(-1) + 1))


def as_dtensor(value: torch.Tensor, mesh: DeviceMesh, layout: Placement, tp_dim: int = 0) -> DTensor:
    """A DTensor as it is; a plain tensor read as this rank's piece laid out as ``layout`` on the tp dim.

    A plain tensor is ``Replicate()`` on the other mesh dims and its global shape assumes even
    shards; pass a DTensor for uneven ones, or for a batch sharded over another dim.
    """
    if isinstance(value, DTensor):
        if value.device_mesh != mesh:
            raise ValueError(
                f"got a DTensor on {value.device_mesh}, but the module is parallelised over {mesh}; pass a "
                "DTensor on that mesh, or this rank's local tensor"
            )
        return value
    return DTensor.from_local(value, mesh, tp_placements(mesh, tp_dim, layout), run_check=False)


def relayout(value: DTensor, layout: Placement | None, *, use_local: bool, tp_dim: int = 0) -> torch.Tensor:
    """``value`` with its tp dim redistributed to ``layout`` (None: as it is), as a local tensor if ``use_local``.

    The other mesh dims keep their placements.
    """
    if layout is not None:
        target = tuple(layout if d == tp_dim else p for d, p in enumerate(value.placements))
        value = value.redistribute(placements=target)
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


@dataclass(frozen=True, slots=True)
class FirstInputLayout:
    """A ``distribute_module`` input_fn: the first positional input, read as ``given`` and redistributed to ``desired``.

    Both layouts are on mesh dim ``tp_dim``; the other inputs pass through as they are.
    """

    style: object
    """The style that registered it, named in errors."""
    given: Placement
    """How a plain-tensor input is laid out on each rank."""
    desired: Placement
    """The layout the module's forward computes with."""
    tp_dim: int

    def __call__(self, module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        x = as_dtensor(first_tensor_input(module, inputs, self.style), mesh, self.given, self.tp_dim)
        return (relayout(x, self.desired, use_local=False, tp_dim=self.tp_dim), *inputs[1:])


def module_output(module: nn.Module, outputs: Any, style: object) -> DTensor:
    """The module's output, which must be one DTensor for a style that shards the module's parameters."""
    if not isinstance(outputs, DTensor):
        raise TypeError(
            f"{style!r} expects {type(module).__name__} to return one DTensor, got {type(outputs).__name__}; "
            "use PrepareModuleOutput for modules with other outputs"
        )
    return outputs


def distribute_parameters(
    module: nn.Module,
    mesh: DeviceMesh,
    layouts: Mapping[str, Placement],
    src_data_rank: int | None,
    tp_dim: int = 0,
) -> None:
    """Replace the module's own parameters named in ``layouts`` by DTensor parameters of that layout.

    The layout is on the tp dim; every other mesh dim replicates the parameter.
    """
    for name, layout in layouts.items():
        param = module._parameters.get(name)
        if param is None or isinstance(param, DTensor):
            continue
        placements = tp_placements(mesh, tp_dim, layout)
        sharded = distribute_tensor(param.detach(), mesh, placements, src_data_rank=src_data_rank)
        module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
