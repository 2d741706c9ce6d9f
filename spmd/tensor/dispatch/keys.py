"""How a call's leaves key decisions: its DTensors' specs and positions, its mesh, its other arguments.

The leaves come from ``spmd.tensor.sharding.call.flatten_call``, or are the arguments themselves for
a plain positional call (the common case, keyed without flattening).
"""

from __future__ import annotations

from typing import Any

import torch

from spmd.tensor.dtensor import DTensor
from spmd.tensor.sharding.call import flatten_call
from spmd.tensor.spec import DTensorSpec

__all__ = [
    "SCALAR_TENSOR",
    "AMBIGUOUS_KEYS",
    "MIXED_MESHES",
    "list_call_key",
    "UnwrappedCall",
    "unwrap_call",
    "scan_leaves",
    "mesh_mismatch_error",
]

SCALAR_TENSOR = "scalar-tensor"
"""Key part of a plain 0-d tensor leaf (its dtype goes beside it, its value does not matter)."""
AMBIGUOUS_KEYS = (float, bool, complex)
"""Leaf types keyed with their type too: 1, 1.0 and True hash alike but promote differently."""
MIXED_MESHES = object()
"""``scan_leaves``'s answer, when asked, for DTensors on different meshes (list ops run per mesh)."""
_PLAIN_TENSOR = "plain-tensor"
_LIST_SCALARS = (bool, int, float, complex)


def mesh_mismatch_error(op: Any, mesh: Any, other: Any) -> ValueError:
    """The error for a call whose DTensors live on two different meshes."""
    return ValueError(
        f"{op} got DTensors on different meshes ({mesh} and {other}); redistribute or create them on one DeviceMesh"
    )


class UnwrappedCall:
    """One call, unwrapped: its leaves, where the DTensors are, and its decision-cache key."""

    __slots__ = ("args", "key", "kwargs", "leaves", "mesh", "positions", "shape")

    def __init__(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        leaves: Any,
        shape: tuple[Any, ...],
        positions: list[int],
        key: tuple[Any, ...],
        mesh: Any,
    ) -> None:
        self.args, self.kwargs, self.leaves, self.shape = args, kwargs, leaves, shape
        self.positions, self.key, self.mesh = positions, key, mesh

    def specs(self) -> list[DTensorSpec]:
        return [self.leaves[i]._spec for i in self.positions]

    def kwarg_names(self) -> list[str]:
        return list(self.kwargs) if self.shape else []


_PLAIN_KINDS = (list, tuple, float, bool, complex, str)
"""Leaf types that are never DTensors (skips an isinstance check)."""
_FLATTEN = object()
"""``scan_leaves``'s answer when a list argument holds tensors: the call must be flattened first."""
_PLAIN = object()
"""``scan_leaves``'s answer when a plain (not 0-d) tensor sits among DTensors."""


def scan_leaves(head: Any, leaves: Any, key: list[Any], positions: list[int], mixed_meshes: bool = False) -> Any:
    """Add each leaf's key part to ``key`` and each DTensor's index to ``positions``; the mesh.

    Returns the DTensors' DeviceMesh for a plain call; None when no leaf is a DTensor; another
    marker when a list leaf holds tensors (flatten first) or a plain tensor sits among DTensors.
    DTensors on two meshes raise, or with ``mixed_meshes`` return ``MIXED_MESHES``.

    A list of ints (a reduction's dims, a view's sizes) keys as a tuple and stays one leaf.
    """
    mesh: Any = None
    for i, a in enumerate(leaves):
        kind = type(a)
        if kind is int or a is None:  # the most common leaves first
            key.append(a)
        elif kind is DTensor or (kind not in _PLAIN_KINDS and isinstance(a, DTensor)):
            spec = a._spec
            if mesh is None:
                mesh = spec.mesh
            elif spec.mesh is not mesh and spec.mesh != mesh:
                if mixed_meshes:
                    return MIXED_MESHES
                raise mesh_mismatch_error(getattr(head, "op", head), mesh, spec.mesh)
            positions.append(i)
            key.append(spec)
        elif kind is list or kind is tuple:
            for item in a:
                if isinstance(item, torch.Tensor):
                    return _FLATTEN
            key.append(tuple(a))
        elif kind is float and not head.float_values_matter:
            key.append(float)
        elif kind in AMBIGUOUS_KEYS:  # 1, 1.0 and True hash alike but promote differently
            key.append((kind, a))
        elif isinstance(a, torch.Tensor):
            if a.ndim != 0:  # rare: autograd formulas, implicit_replication()
                return _PLAIN
            key.append((SCALAR_TENSOR, a.dtype))
        else:
            key.append(a)
    return mesh


def unwrap_call(head: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> UnwrappedCall | None:
    """The call's leaves, DTensor positions, mesh and cache key (``head`` first: the op's entry).

    None when a plain (not 0-d) tensor sits among the DTensors: the caller decides what it means.
    """
    key: list[Any] = [head]
    positions: list[int] = []
    if not kwargs:
        mesh = scan_leaves(head, args, key, positions)
        if mesh is _PLAIN:
            return None
        if mesh is not _FLATTEN and mesh is not None:
            return UnwrappedCall(args, kwargs, args, (), positions, tuple(key), mesh)
        key, positions = [head], []
    leaves, shape = flatten_call(args, kwargs)
    key.append(shape)
    mesh = scan_leaves(head, leaves, key, positions)
    if mesh is _PLAIN:
        return None
    if mesh is None:
        raise AssertionError(f"{getattr(head, 'op', head)} reached the DTensor dispatcher without a DTensor argument")
    return UnwrappedCall(args, kwargs, leaves, shape, positions, tuple(key), mesh)


def list_call_key(
    head: Any, leaves: list[Any], shape: tuple[Any, ...], *, values_decide: bool
) -> tuple[tuple[Any, ...], list[int], Any]:
    """A list call's cache key, its DTensor positions and its mesh (``MIXED_MESHES`` for several).

    Keyed as ``scan_leaves`` keys a call, except: a plain tensor keys by dtype and ndim (a list op's
    rule decides what it means), and Python scalars key by type unless the rule reads their values
    (``values_decide``): an optimizer's learning rate and bias corrections change every step.
    """
    keyed: list[Any] = []
    for a in leaves:
        kind = type(a)
        if kind in _LIST_SCALARS:
            if not values_decide:
                keyed.append(kind)
            else:
                keyed.append(a if kind is int else (kind, a))  # 1, 1.0 and True hash alike
        elif isinstance(a, torch.Tensor) and not isinstance(a, DTensor):
            keyed.append((_PLAIN_TENSOR, a.dtype, a.ndim))
        else:
            keyed.append(a)
    key: list[Any] = [head, shape]
    positions: list[int] = []
    mesh = scan_leaves(head, keyed, key, positions, mixed_meshes=True)
    return tuple(key), positions, mesh
