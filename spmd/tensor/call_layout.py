"""How an aten call's arguments become a flat list of leaves and back, and how leaves key decisions.

Aten schemas nest at most one level of lists (``cat([a, b])``, ``_foreach_add(xs, ys)``), so a call
flattens to its leaves plus a small layout tuple; the layout is ``()`` for plain positional calls,
the common case, which the dispatcher's fast path relies on.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SCALAR_TENSOR", "AMBIGUOUS_KEYS", "DECISION_CACHE_LIMIT", "flatten_call", "unflatten_call", "mesh_mismatch_error"]

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


def unflatten_call(leaves: list[Any], shape: tuple[Any, ...], kwarg_names: list[str]) -> tuple[list[Any], dict[str, Any]]:
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
