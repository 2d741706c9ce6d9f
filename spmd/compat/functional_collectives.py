"""torch's functional collectives, for redirected packages: they also take spmd meshes as groups.

``torch.distributed._functional_collectives`` takes a group as a ProcessGroup, a group name, ranks,
or torch's ``DeviceMesh`` (1-d, or ``(mesh, dim)``). Code written for torch's DTensor passes meshes
(torchtitan sums its loss with ``funcol.all_reduce(loss, "sum", group=mesh)``), and torch's checks
recognise only torch's mesh class. Inside a redirected package this module stands in for torch's:
every name is torch's own, except that a function's ``group`` argument may be an spmd
``DeviceMesh`` or ``(mesh, dim)``, passed on as the mesh dim's process group.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch.distributed._functional_collectives as _torch_functional

from spmd.tensor.device_mesh.mesh import DeviceMesh

__all__: list[str] = []  # every name is torch's, found by __getattr__


def as_process_group(group: Any) -> Any:
    """``group`` with an spmd mesh (1-d) or ``(mesh, dim)`` replaced by that mesh dim's process group."""
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"a functional collective got the {group.ndim}-d {group} as its group; pass (mesh, dim) or "
                "mesh[dim_name] to name one mesh dim"
            )
        return group.get_group()
    if isinstance(group, tuple) and len(group) == 2 and isinstance(group[0], DeviceMesh):
        return group[0].get_group(group[1])
    return group


def _taking_meshes(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with its ``group`` argument (by position or keyword) passed through ``as_process_group``."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        if "group" in bound.arguments:
            bound.arguments["group"] = as_process_group(bound.arguments["group"])
        return fn(*bound.args, **bound.kwargs)

    return call


@functools.cache
def __getattr__(name: str) -> Any:
    value = getattr(_torch_functional, name)
    if inspect.isfunction(value) and "group" in inspect.signature(value).parameters:
        return _taking_meshes(value)
    return value
