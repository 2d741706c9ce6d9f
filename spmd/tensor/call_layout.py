"""How an aten call's arguments become a flat list of leaves and back, and how leaves key decisions.

Aten schemas nest at most one level of lists (``cat([a, b])``, ``_foreach_add(xs, ys)``), so a call
flattens to its leaves plus a small layout tuple. A positional call whose lists hold no tensors
(``sum(x, [1])``, ``view(x, [4, 2])``), the common case, is not flattened at all: its arguments are
its leaves and its layout is ``()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from spmd.tensor.dtensor import DTensor
from spmd.tensor.spec import DTensorSpec

__all__ = [
    "SCALAR_TENSOR",
    "AMBIGUOUS_KEYS",
    "DECISION_CACHE_LIMIT",
    "UnwrappedCall",
    "unwrap_call",
    "scan_leaves",
    "flatten_call",
    "unflatten_call",
    "mesh_mismatch_error",
]

SCALAR_TENSOR = "scalar-tensor"
"""Key part of a plain 0-d tensor leaf (its dtype goes beside it, its value does not matter)."""
AMBIGUOUS_KEYS = (float, bool, complex)
"""Leaf types keyed with their type too: 1, 1.0 and True hash alike but promote differently."""
DECISION_CACHE_LIMIT = 50_000
"""Decision caches are cleared past this many entries (decisions pin their meshes and worlds)."""


def flatten_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], tuple[Any, ...]]:
    """Leaves of ``args``/``kwargs`` (one level of lists, as aten schemas have) and their layout.

    The layout is ``()`` when the call is plain positional leaves, the common case.
    """
    if not kwargs:
        for a in args:
            if isinstance(a, (list, tuple)):
                break
        else:
            return list(args), ()
    leaves: list[Any] = []
    shape: list[Any] = []
    for a in args:
        if isinstance(a, (list, tuple)):
            shape.append(len(a))
            leaves.extend(a)
        else:
            shape.append(-1)
            leaves.append(a)
    for name, a in kwargs.items():
        if isinstance(a, (list, tuple)):
            shape.append((name, len(a)))
            leaves.extend(a)
        else:
            shape.append(name)
            leaves.append(a)
    return leaves, tuple(shape)


def unflatten_call(leaves: Sequence[Any], shape: tuple[Any, ...], kwarg_names: Sequence[str]) -> tuple[list[Any], dict[str, Any]]:
    if not shape:
        return list(leaves), {}
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    pos = 0
    for entry in shape:
        if isinstance(entry, int):
            if entry < 0:
                args.append(leaves[pos])
                pos += 1
            else:
                args.append(leaves[pos : pos + entry])
                pos += entry
        elif isinstance(entry, tuple):
            name, length = entry
            kwargs[name] = leaves[pos : pos + length]
            pos += length
        else:
            kwargs[entry] = leaves[pos]
            pos += 1
    return args, kwargs


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


def scan_leaves(head: Any, leaves: Any, key: list[Any], positions: list[int]) -> Any:
    """Add each leaf's key part to ``key`` and each DTensor's index to ``positions``; the mesh.

    Returns the DTensors' DeviceMesh for a plain call; None when no leaf is a DTensor; another
    marker when a list leaf holds tensors (flatten first) or a plain tensor sits among DTensors.

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
