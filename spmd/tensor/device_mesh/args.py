"""Checks of what users pass to build or reshape a DeviceMesh, each error naming the fix."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["ranks_tensor", "unflatten_args"]


def ranks_tensor(mesh: torch.Tensor | Sequence[Any]) -> torch.Tensor:
    """``mesh`` as an int64 tensor of ranks (at least 1-d), refusing anything but integer ranks."""
    try:
        ranks = torch.as_tensor(mesh, device="cpu")
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(
            f"a DeviceMesh takes a (nested) list or tensor of integer ranks, got {mesh!r} ({error})"
        ) from None
    if ranks.numel() == 0:
        raise ValueError(f"a DeviceMesh needs at least one rank, got {mesh!r}")
    if ranks.dtype == torch.bool or ranks.is_floating_point() or ranks.is_complex() or _holds_bool(mesh):
        raise ValueError(
            f"DeviceMesh ranks must be integers, got {mesh!r}; pass ints such as "
            f"{torch.arange(ranks.numel()).reshape(ranks.shape).tolist()}"
        )
    ranks = ranks.to(torch.int64)
    return ranks.reshape(1) if ranks.ndim == 0 else ranks


def _holds_bool(mesh: object) -> bool:
    # torch.as_tensor turns [0, True] into int64, so look at the Python values themselves.
    if isinstance(mesh, bool):
        return True
    return isinstance(mesh, (list, tuple)) and any(_holds_bool(item) for item in mesh)


def unflatten_args(
    dim_names: tuple[str, ...],
    shape: tuple[int, ...],
    dim: int | str,
    mesh_sizes: Sequence[int],
    mesh_dim_names: Sequence[str],
    backend_override: Mapping[int | str, Any] | None,
) -> tuple[int, tuple[int, ...], tuple[str, ...]]:
    """``DeviceMesh._unflatten``'s arguments checked against a mesh of ``dim_names`` and ``shape``:
    (index of the dim split, the sizes, the new names). Raises what torch raises where it checks."""
    index = _dim_index(dim_names, dim)
    sizes, names = tuple(int(s) for s in mesh_sizes), tuple(mesh_dim_names)
    if len(sizes) != len(names):
        raise RuntimeError(
            f"_unflatten got {len(sizes)} mesh_sizes {sizes} but {len(names)} mesh_dim_names {names}; "
            "pass one name per size"
        )
    others = dim_names[:index] + dim_names[index + 1 :]
    clashes = sorted({n for n in names if names.count(n) > 1 or n in others})
    if clashes:
        raise ValueError(
            f"_unflatten names {clashes} twice (new dims {names}, other dims {others}); give each dim its own name"
        )
    _check_backend_override(backend_override, names)
    if math.prod(sizes) != shape[index]:
        raise ValueError(
            f"_unflatten sizes {sizes} hold {math.prod(sizes)} ranks but mesh dim {dim_names[index]!r} has "
            f"{shape[index]}; make their product {shape[index]}"
        )
    return index, sizes, names


def _dim_index(names: tuple[str, ...], dim: int | str) -> int:
    if isinstance(dim, str):
        if dim not in names:
            raise ValueError(f"_unflatten got dim {dim!r}, which is not one of the mesh's dims {names}")
        return names.index(dim)
    if not -len(names) <= dim < len(names):
        raise ValueError(f"_unflatten got dim {dim}, out of range for a {len(names)}-d mesh {names}")
    return dim % len(names)


def _check_backend_override(backend_override: Mapping[int | str, Any] | None, names: tuple[str, ...]) -> None:
    """Refuse what torch refuses: a key that is neither a new dim's name nor its index, or both for one dim."""
    if not backend_override:
        return
    unknown = [key for key in backend_override if key not in names and key not in range(len(names))]
    if unknown:
        raise RuntimeError(
            f"backend_override has keys {unknown} that name no new dim; use names in {names} "
            f"or indices in [0, {len(names)})"
        )
    twice = [name for i, name in enumerate(names) if name in backend_override and i in backend_override]
    if twice:
        raise RuntimeError(f"backend_override names dims {twice} both by name and by index; keep one")
