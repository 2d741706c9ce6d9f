"""Checks of what users pass to build or reshape a DeviceMesh, each error naming the fix, and the
rank arithmetic on what passes (each rank's coordinate, each mesh dim's groups)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = [
    "check_caller_group",
    "check_group_count",
    "check_single_group_mesh",
    "coordinates",
    "dim_groups",
    "dim_names",
    "group_list_args",
    "ranks_tensor",
    "unflatten_args",
]


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


def dim_names(mesh_dim_names: Sequence[str] | None, ndim: int) -> tuple[str, ...] | None:
    """``mesh_dim_names`` as a tuple naming each of the ``ndim`` mesh dims once (None: an unnamed mesh)."""
    if mesh_dim_names is None:
        return None
    if isinstance(mesh_dim_names, str):
        raise TypeError(
            f"mesh_dim_names takes one name per mesh dim, got the string {mesh_dim_names!r}; "
            f"pass a tuple such as ({mesh_dim_names!r},)"
        )
    names = tuple(mesh_dim_names)
    if not all(isinstance(name, str) for name in names):
        raise TypeError(f"mesh_dim_names must be strings, got {names!r}")
    if len(names) != ndim or len(set(names)) != ndim:
        raise ValueError(f"mesh_dim_names {names} must name each of the {ndim} mesh dims once")
    return names


def coordinates(flat: Sequence[int], shape: tuple[int, ...]) -> dict[int, tuple[int, ...]]:
    """rank -> its coordinate in a mesh of ``shape`` that lists the ranks ``flat`` row-major."""
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    return {rank: tuple((i // strides[d]) % shape[d] for d in range(len(shape))) for i, rank in enumerate(flat)}


def dim_groups(ranks: torch.Tensor) -> list[dict[int, tuple[int, ...]]]:
    """Per mesh dim ``d``: rank -> the ranks that share every coordinate but ``d`` with it.

    One tuple per group, shared by its members: a 65,536-rank mesh must not copy it per rank.
    """
    per_dim: list[dict[int, tuple[int, ...]]] = []
    for d in range(ranks.ndim):
        groups = [tuple(row) for row in ranks.movedim(d, -1).reshape(-1, ranks.shape[d]).tolist()]
        per_dim.append({r: group for group in groups for r in group})
    return per_dim


def check_single_group_mesh(mesh: torch.Tensor | Sequence[Any] | None, ranks: Sequence[int]) -> None:
    """``from_group`` with one group: ``mesh``, if given, must list the group's ranks."""
    if mesh is not None and ranks_tensor(mesh).flatten().tolist() != list(ranks):
        raise ValueError(f"from_group got mesh {mesh!r} for a group of ranks {list(ranks)}; pass mesh=None")


def group_list_args(
    groups: Sequence[Any], mesh: torch.Tensor | Sequence[Any] | None, mesh_dim_names: Sequence[str] | None
) -> tuple[torch.Tensor | Sequence[Any], Sequence[str]]:
    """``from_group`` with a list of groups: at least one group, and ``mesh`` and ``mesh_dim_names``."""
    if not groups:
        raise ValueError("from_group needs at least one group")
    if mesh is None or mesh_dim_names is None:
        raise ValueError(
            "from_group with a list of groups needs mesh= (the global ranks, one mesh dim per group) "
            "and mesh_dim_names="
        )
    return mesh, mesh_dim_names


def check_group_count(count: int, ranks: torch.Tensor) -> None:
    """``from_group`` takes one group per dim of the mesh ``ranks``."""
    if ranks.ndim != count:
        raise ValueError(
            f"from_group got {count} groups for a {ranks.ndim}-d mesh {ranks.tolist()}; pass one group per mesh dim"
        )


def check_caller_group(dim: int, name: str, group: Sequence[int], along: Sequence[int] | None, rank: int) -> None:
    """``from_group``'s group ``dim`` must be the caller's ranks ``along`` that mesh dim (None: not in it)."""
    if along is not None and group != along:
        raise ValueError(
            f"from_group's group {dim} holds ranks {list(group)}, but rank {rank}'s ranks along mesh dim "
            f"{name!r} are {list(along)}; pass the caller's groups in mesh-dim order"
        )


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
