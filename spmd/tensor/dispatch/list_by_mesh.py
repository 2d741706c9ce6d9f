"""List ops (``_foreach_*``, fused optimizers) whose positions live on different meshes.

An optimizer over a model with FSDP-sharded and TP-sharded parameters hands one ``_foreach_*`` or
``_fused_adamw_`` call tensors on several meshes. Each list position is independent, so the call is
split into one call per mesh (the positions in their order, every list argument cut to them, the
other arguments shared) and the outputs are put back in the original order.
"""

from __future__ import annotations

from typing import Any

import torch

from spmd.tensor.device_mesh.mesh import DeviceMesh
from spmd.tensor.dtensor import DTensor

__all__ = ["meshes_of_positions", "run_per_mesh"]


def _list_arguments(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[int | str, list[Any]]:
    """The op's list arguments as passed, keyed by position (positional) or name (keyword)."""
    found: dict[int | str, list[Any]] = {}
    for index, argument in enumerate(op._schema.arguments):
        if not isinstance(argument.type, torch.ListType):
            continue
        if index < len(args) and not argument.kwarg_only:
            value, key = args[index], index
        elif argument.name in kwargs:
            value, key = kwargs[argument.name], argument.name
        else:
            continue
        if isinstance(value, (list, tuple)):
            found[key] = list(value)
    return found


def meshes_of_positions(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[DeviceMesh] | None:
    """The mesh of each list position, when every DTensor at a position is on that position's mesh,
    every position has one and the DTensors outside the lists are on none of them (else None)."""
    lists = list(_list_arguments(op, args, kwargs).values())
    length = max((len(v) for v in lists), default=0)
    if length == 0:
        return None
    meshes: list[DeviceMesh | None] = [None] * length
    in_lists: set[int] = set()
    for values in lists:
        if len(values) != length:
            continue  # an empty optional list (``max_exp_avg_sqs`` without amsgrad)
        for i, value in enumerate(values):
            if isinstance(value, DTensor):
                in_lists.add(id(value))
                if meshes[i] is None:
                    meshes[i] = value.device_mesh
                elif value.device_mesh != meshes[i]:
                    return None
    if any(m is None for m in meshes):
        return None
    leaves = [*args, *kwargs.values()]
    if any(isinstance(a, DTensor) and id(a) not in in_lists for a in leaves):
        return None  # a shared DTensor argument (``_foreach_add.Tensor``'s other) belongs to one mesh only
    return [m for m in meshes if m is not None]


def run_per_mesh(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], meshes: list[DeviceMesh]) -> Any:
    """``op`` called once per mesh on the positions living there; list outputs back in position order."""
    groups: dict[DeviceMesh, list[int]] = {}
    for i, mesh in enumerate(meshes):
        groups.setdefault(mesh, []).append(i)
    lists = _list_arguments(op, args, kwargs)
    length = len(meshes)
    outputs: list[Any] = [None] * length
    returns_list = bool(op._schema.returns) and isinstance(op._schema.returns[0].type, torch.ListType)
    result: Any = None
    for positions in groups.values():
        group_args, group_kwargs = list(args), dict(kwargs)
        for key, values in lists.items():
            if len(values) != length:
                continue
            cut = [values[i] for i in positions]
            if isinstance(key, int):
                group_args[key] = cut
            else:
                group_kwargs[key] = cut
        result = op(*group_args, **group_kwargs)
        if returns_list:
            for i, value in zip(positions, result):
                outputs[i] = value
    if returns_list:
        return outputs
    if op._schema.returns:
        raise NotImplementedError(
            f"{op} returns {op._schema.returns[0].type}, which cannot be put back together from one call per mesh; "
            "call it on DTensors of one mesh at a time"
        )
    return result
