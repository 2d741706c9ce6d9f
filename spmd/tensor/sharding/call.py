"""How an aten call's arguments become a flat list of leaves and back.

Aten schemas nest at most one level of lists (``cat([a, b])``, ``_foreach_add(xs, ys)``), so a call
flattens to its leaves plus a small layout tuple. A positional call whose lists hold no tensors
(``sum(x, [1])``, ``view(x, [4, 2])``), the common case, is not flattened at all: its arguments are
its leaves and its layout is ``()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["flatten_call", "unflatten_call", "list_entries", "leaf_arguments"]


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


def list_entries(shape: tuple[Any, ...], count: int) -> list[bool]:
    """For each flattened leaf, whether it is an entry of a list argument."""
    if not shape:
        return [False] * count
    mask: list[bool] = []
    for entry in shape:
        if isinstance(entry, int):
            mask.extend([True] * entry if entry >= 0 else [False])
        elif isinstance(entry, tuple):
            mask.extend([True] * entry[1])
        else:
            mask.append(False)
    return mask


def leaf_arguments(op: Any, shape: tuple[Any, ...], kwarg_names: list[str], count: int) -> list[str]:
    """The schema argument each flattened leaf belongs to."""
    arguments = op._schema.arguments
    if not shape:
        return [arguments[k].name for k in range(count)]
    names: list[str] = []
    positional = 0
    for entry in shape:
        if isinstance(entry, int):
            names.extend([arguments[positional].name] * (1 if entry < 0 else entry))
            positional += 1
        elif isinstance(entry, tuple):
            names.extend([entry[0]] * entry[1])
        else:
            names.append(entry)
    return names
