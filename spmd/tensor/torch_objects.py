"""Recognising torch.distributed.tensor's objects where spmd's are needed, and saying how to fix it.

When only some packages are redirected (the import redirect of docs/compat.md), a mesh, DTensor, placement or parallel
style built by torch's DTensor can reach spmd (and the other way round). The two libraries' objects
do not mix, and without a check the failure is an ``AttributeError`` deep inside spmd. The entry
points look only at an argument that already failed their own type check, and an op's operands are
looked at only after the op failed (``torch_operand_error``), so a normal call pays nothing.
torch's classes are recognised by their module and name along the object's class hierarchy:
importing ``torch.distributed.tensor`` here would load torch's DTensor into every spmd program.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

__all__ = [
    "MixedDTensorLibrariesError",
    "torch_object_kind",
    "torch_object_error",
    "refuse_torch_object",
    "refuse_torch_objects",
    "torch_operand_error",
]


class MixedDTensorLibrariesError(RuntimeError):
    """An object of ``torch.distributed.tensor`` reached spmd where spmd's own object is needed.

    A RuntimeError, not a TypeError: an op such as ``x + y`` turns a TypeError raised under it into
    Python's "unsupported operand", which would hide this message.
    """


_TORCH_ROOTS = {
    ("torch.distributed.tensor", "DTensor"): "DTensor",
    ("torch.distributed.tensor._api", "DTensor"): "DTensor",
    ("torch.distributed.device_mesh", "DeviceMesh"): "DeviceMesh",
    ("torch.distributed.tensor.placement_types", "Placement"): "placement",
    ("torch.distributed.tensor.parallel.style", "ParallelStyle"): "parallel style",
}
"""torch's base classes (module, qualified name) -> what an instance of them is."""

_SPMD_WAY = {
    "DTensor": "spmd.tensor.distribute_tensor or DTensor.from_local",
    "DeviceMesh": "spmd.tensor.init_device_mesh",
    "placement": "spmd.tensor's Shard, Replicate and Partial",
    "parallel style": "spmd.tensor_parallel's styles (ColwiseParallel, RowwiseParallel, ...)",
}
"""How to build each kind of object with spmd instead."""

_REDIRECT = __name__.partition(".")[0] + ".compat.redirect"
"""The import redirect's function, by its full name for the message (docs/compat.md)."""

_REPR_LIMIT = 120


def torch_object_kind(value: object) -> str | None:
    """``"DTensor"``, ``"DeviceMesh"``, ``"placement"`` or ``"parallel style"`` when ``value`` is
    torch.distributed.tensor's; None for anything else (spmd's objects included)."""
    for cls in type(value).__mro__:
        kind = _TORCH_ROOTS.get((cls.__module__, cls.__qualname__))
        if kind is not None:
            return kind
    return None


def torch_object_error(value: object, where: str) -> MixedDTensorLibrariesError | None:
    """The error to raise when ``value`` is torch.distributed.tensor's, else None.

    ``where`` names the spmd entry point and argument that got it, e.g. ``"distribute_tensor
    (device_mesh)"``. For a failed type check: ``raise torch_object_error(x, where) or TypeError(...)``.
    """
    kind = torch_object_kind(value)
    return None if kind is None else MixedDTensorLibrariesError(_message(value, kind, where))


def refuse_torch_object(value: object, where: str) -> None:
    """Raise ``torch_object_error(value, where)`` when ``value`` is torch.distributed.tensor's."""
    error = torch_object_error(value, where)
    if error is not None:
        raise error


def refuse_torch_objects(values: Iterable[object], where: str) -> None:
    """``refuse_torch_object`` on each of ``values`` (placements, a call's arguments)."""
    for value in values:
        refuse_torch_object(value, where)


def torch_operand_error(op: object, args: Any, kwargs: Any) -> MixedDTensorLibrariesError | None:
    """The error for an op call that failed with a DTensor of torch's among its operands, else None."""
    for leaf in tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and type(leaf) is not torch.Tensor:
            error = torch_object_error(leaf, f"{op} (an operand beside spmd's DTensors)")
            if error is not None:
                return error
    return None


def _message(value: object, kind: str, where: str) -> str:
    cls = type(value)
    return (
        f"{where} got torch's {cls.__module__}.{cls.__qualname__} {_short_repr(value, kind)}; it needs spmd's "
        f"{kind}. spmd.tensor and torch.distributed.tensor are separate DTensor libraries whose objects do not "
        f"mix. The code that built this {kind} uses torch's DTensor: redirect its package with "
        f'{_REDIRECT}("<package>") before the package is imported (docs/compat.md), or build the '
        f"{kind} with {_SPMD_WAY[kind]}"
    )


def _short_repr(value: Any, kind: str) -> str:
    """A one-line description: a DTensor by its shape, dtype, placements and mesh (not its data)."""
    try:
        if kind == "DTensor":
            return (
                f"(shape {list(value.shape)}, {value.dtype}, placements {tuple(value.placements)!r}, "
                f"on torch's {_clip(repr(value.device_mesh))})"
            )
        return f"({_clip(repr(value))})"
    except Exception:  # a half-built object: its type is all there is to say
        return "(no repr)"


def _clip(text: str) -> str:
    return text if len(text) <= _REPR_LIMIT else text[: _REPR_LIMIT - 3] + "..."
