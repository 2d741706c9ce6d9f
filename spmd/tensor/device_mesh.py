"""DeviceMesh: an n-d grid of ranks with one communicator per mesh dimension."""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Sequence
from contextvars import ContextVar
from datetime import timedelta
from typing import Any

import torch
from typing_extensions import Self

from spmd.tensor.comm import Communicator, World, current_world

__all__ = ["DeviceMesh", "init_device_mesh", "current_mesh"]

# The meshes entered with ``with mesh:``, innermost last. A context variable, so that each rank
# thread of a threaded world has its own stack.
_ENTERED_MESHES: ContextVar[tuple[DeviceMesh, ...]] = ContextVar("spmd_entered_meshes", default=())

MeshKey = tuple[Any, ...]
"""A mesh's value without its world: (device type, shape, ranks, dim names)."""

# The dims each rank has flattened on each root mesh: world -> (rank, root's MeshKey) -> {name: root
# dims}. Keyed by the mesh's value, because equal meshes are interchangeable (a decision cached by one
# rank thread may hand another rank a spec holding the first rank's mesh object), and by rank, because
# rank threads reach their own `_flatten` calls at different times.
_FLATTENED: weakref.WeakKeyDictionary[World, dict[tuple[int, MeshKey], dict[str, tuple[int, ...]]]] = (
    weakref.WeakKeyDictionary()
)
_FLATTENED_LOCK = threading.Lock()


def current_mesh() -> DeviceMesh:
    """The innermost mesh entered with ``with mesh:``; what ``distribute_tensor`` and the factories
    use when no ``device_mesh`` is given."""
    entered = _ENTERED_MESHES.get()
    if not entered:
        raise RuntimeError("no DeviceMesh is active: pass device_mesh=..., or enter one with `with mesh:`")
    return entered[-1]


class DeviceMesh:
    """Ranks laid out as an n-d array; mesh dim ``d`` groups ranks that differ only in coordinate ``d``.

    Every rank builds the same mesh (SPMD). The mesh is a value: equal meshes compare and hash
    equal, and one object may be shared by the threads of a threaded world, because the calling
    rank is looked up at call time.

    >>> mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))  # doctest: +SKIP
    """

    def __init__(
        self,
        device_type: str,
        mesh: torch.Tensor | Sequence[Any],
        *,
        mesh_dim_names: Sequence[str] | None = None,
        _world: World | None = None,
        _create_groups: bool = True,
        _root: DeviceMesh | None = None,
        _root_dims: tuple[tuple[int, ...], ...] | None = None,
    ) -> None:
        ranks = _ranks_tensor(mesh)
        self._device_type = device_type
        self._mesh = ranks
        self._shape = tuple(ranks.shape)
        self._flat = tuple(int(r) for r in ranks.flatten().tolist())
        if len(set(self._flat)) != len(self._flat):
            raise ValueError(f"a DeviceMesh lists each rank once; got {ranks.tolist()}")
        if mesh_dim_names is not None:
            if isinstance(mesh_dim_names, str):
                raise TypeError(
                    f"mesh_dim_names takes one name per mesh dim, got the string {mesh_dim_names!r}; "
                    f"pass a tuple such as ({mesh_dim_names!r},)"
                )
            mesh_dim_names = tuple(mesh_dim_names)
            if not all(isinstance(name, str) for name in mesh_dim_names):
                raise TypeError(f"mesh_dim_names must be strings, got {mesh_dim_names!r}")
            if len(mesh_dim_names) != ranks.ndim or len(set(mesh_dim_names)) != ranks.ndim:
                raise ValueError(
                    f"mesh_dim_names {mesh_dim_names} must name each of the {ranks.ndim} mesh dims once"
                )
        self._mesh_dim_names: tuple[str, ...] | None = mesh_dim_names
        self._world = _world if _world is not None else current_world(device_type)
        if max(self._flat) >= self._world.size or min(self._flat) < 0:
            raise ValueError(
                f"mesh ranks {sorted(self._flat)} do not fit a world of {self._world.size} ranks"
            )
        strides = [math.prod(self._shape[d + 1 :]) for d in range(len(self._shape))]
        self._coordinates = {
            rank: tuple((i // strides[d]) % self._shape[d] for d in range(len(self._shape)))
            for i, rank in enumerate(self._flat)
        }
        # _dim_groups[d][rank] is the tuple of ranks sharing every coordinate but d with rank.
        self._dim_groups: list[dict[int, tuple[int, ...]]] = []
        for d in range(ranks.ndim):
            groups = [tuple(row) for row in ranks.movedim(d, -1).reshape(-1, self._shape[d]).tolist()]
            # one tuple per group, shared by its members: a 65,536-rank mesh must not copy it per rank
            self._dim_groups.append({r: group for group in groups for r in group})
        if _create_groups:
            self._world.create_groups(self._groups())
        # Whether every rank that can call into this object is in the mesh, so that the dispatcher may
        # skip asking (a lookup of the caller's rank, ~1us under c10d): true when the mesh holds the
        # whole world, and under c10d (one rank per process) when it holds this process's rank.
        self._callers_in_mesh = len(self._flat) == self._world.size or (
            self._world.backend_name == "c10d" and self._world.current_rank() in self._coordinates
        )
        # A sub-mesh (``mesh["tp"]``, ``mesh["dp", "cp"]._flatten()``) remembers the mesh it was cut
        # from, and which of that mesh's dims each of its own dims spans, to find flattened dims.
        self._root = _root
        self._root_dims = _root_dims if _root_dims is not None else tuple((d,) for d in range(ranks.ndim))
        self._key: MeshKey = (device_type, self._shape, self._flat, self.mesh_dim_names)
        # Meshes of different worlds (two run_threaded calls) are not interchangeable: their
        # communicators belong to different ranks.
        self._hash = hash((*self._key, id(self._world)))

    # ----- shape -----------------------------------------------------------------------------------
    @property
    def device_type(self) -> str:
        """``"cpu"`` or ``"cuda"``: where the ranks' tensors live."""
        return self._device_type

    @property
    def mesh(self) -> torch.Tensor:
        """The ranks as an int64 tensor of the mesh's shape."""
        return self._mesh

    @property
    def mesh_dim_names(self) -> tuple[str, ...] | None:
        return self._mesh_dim_names

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def ndim(self) -> int:
        return len(self._shape)

    def size(self, mesh_dim: int | str | None = None) -> int:
        """Number of ranks along ``mesh_dim``, or in the whole mesh when it is None."""
        if mesh_dim is None:
            return len(self._flat)
        return self._shape[self.dim_index(mesh_dim)]

    def dim_index(self, mesh_dim: int | str) -> int:
        """The integer index of a mesh dim given by index or by name."""
        if isinstance(mesh_dim, str):
            if self.mesh_dim_names is None or mesh_dim not in self.mesh_dim_names:
                raise KeyError(f"mesh has no dim named {mesh_dim!r}; its dims are {self.mesh_dim_names}")
            return self.mesh_dim_names.index(mesh_dim)
        if not -self.ndim <= mesh_dim < self.ndim:
            raise IndexError(f"mesh dim {mesh_dim} is out of range for a {self.ndim}-d mesh")
        return mesh_dim % self.ndim

    # ----- ranks -----------------------------------------------------------------------------------
    def get_rank(self) -> int:
        """The caller's global rank."""
        return self._world.current_rank()

    def get_coordinate(self) -> tuple[int, ...] | None:
        """The caller's coordinate in the mesh, or None if it is not part of it."""
        return self._coordinates.get(self._world.current_rank())

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        """The caller's coordinate along ``mesh_dim`` (may be omitted on a 1-d mesh)."""
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(f"get_local_rank needs a mesh_dim on a {self.ndim}-d mesh")
            mesh_dim = 0
        coordinate = self._require_coordinate()
        return coordinate[self.dim_index(mesh_dim)]

    def _require_coordinate(self) -> tuple[int, ...]:
        coordinate = self.get_coordinate()
        if coordinate is None:
            raise RuntimeError(f"rank {self.get_rank()} is not part of {self!r}")
        return coordinate

    def _groups(self) -> list[tuple[int, ...]]:
        """Every group of ranks this mesh communicates over, in the order all ranks create them."""
        # dedupe by identity first: tuples do not cache their hash, and each group is shared by its members
        distinct = {id(g): g for per_dim in self._dim_groups for g in per_dim.values()}
        return sorted(set(distinct.values()))

    def get_communicator(self, mesh_dim: int | str) -> Communicator:
        """The caller's communicator along ``mesh_dim``, labelled with the dim's name for errors."""
        dim = self.dim_index(mesh_dim)
        comm = self._world.communicator(self._dim_groups[dim][self._world.current_rank()])
        return comm.on_mesh_dim(self.mesh_dim_names[dim] if self.mesh_dim_names else str(dim))

    def get_group(self, mesh_dim: int | str | None = None) -> Any:
        """The process group along ``mesh_dim`` (a c10d group under torchrun, else the communicator)."""
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(f"get_group needs a mesh_dim on a {self.ndim}-d mesh")
            mesh_dim = 0
        flattened = isinstance(mesh_dim, str) and mesh_dim not in (self.mesh_dim_names or ())
        if flattened and self._root is None and mesh_dim in self._flattened_dims():
            return self[mesh_dim].get_group()  # a dim made by ``_flatten`` on this mesh
        comm = self.get_communicator(mesh_dim)
        return getattr(comm, "group", comm)

    def get_all_groups(self) -> list[Any]:
        """The caller's process group along every mesh dim, in mesh-dim order."""
        return [self.get_group(d) for d in range(self.ndim)]

    # ----- sub-meshes ------------------------------------------------------------------------------
    def __getitem__(self, names: str | Sequence[str]) -> DeviceMesh:
        """The sub-mesh over the named dims that contains the caller, e.g. ``mesh["tp"]``.

        On a root mesh (one not cut from another) the names may include dims made by ``_flatten``,
        e.g. ``mesh["dp_shard_cp"]`` or ``mesh["dp_replicate", "dp_shard_cp"]``.
        """
        wanted = (names,) if isinstance(names, str) else tuple(names)
        if wanted == self.mesh_dim_names:
            return self
        own = self.mesh_dim_names or ()
        flattened = self._flattened_dims() if self._root is None else {}
        sources: list[tuple[int, ...]] = []
        for name in wanted:
            if name in own:
                sources.append(self._root_dims[own.index(name)])
            elif name in flattened:
                sources.append(flattened[name])
            else:
                made = f" and the flattened dims {tuple(flattened)}" if flattened else ""
                where = "" if self._root is None else " (flattened dims are sliced from the mesh they were made on)"
                raise KeyError(f"mesh has no dim named {name!r}; its dims are {self.mesh_dim_names}{made}{where}")
        covered: list[int] = []
        for name, source in zip(wanted, sources):
            if any(d in covered for d in source):
                raise ValueError(
                    f"mesh[{names!r}] names mesh dim {name!r} more than once (or a flattened dim and one of "
                    "its parts); name each dim at most once"
                )
            covered.extend(source)
        return self._get_root_mesh()._slice(tuple(sources), wanted)

    def _get_root_mesh(self) -> DeviceMesh:
        """The mesh this one was cut from (itself when it was built directly)."""
        return self if self._root is None else self._root

    def _slice(self, sources: tuple[tuple[int, ...], ...], names: tuple[str, ...]) -> DeviceMesh:
        """The caller's sub-mesh of this root mesh whose dim ``i`` runs over root dims ``sources[i]``
        (several root dims make one flattened dim, row-major)."""
        coordinate = self._require_coordinate()
        picked = [d for source in sources for d in source]
        sub = self.mesh[tuple(slice(None) if d in picked else coordinate[d] for d in range(self.ndim))]
        ascending = sorted(picked)
        sub = sub.permute([ascending.index(d) for d in picked])
        sub = sub.reshape([math.prod(self._shape[d] for d in source) for source in sources])
        # Every group of the sub-mesh is a group of this mesh or of a dim flattened on it.
        return DeviceMesh(
            self.device_type,
            sub,
            mesh_dim_names=names,
            _world=self._world,
            _create_groups=False,
            _root=self,
            _root_dims=sources,
        )

    def _flatten(self, mesh_dim_name: str | None = None) -> DeviceMesh:
        """This mesh as a 1-d mesh over all of its ranks (row-major), named on the root mesh.

        Every rank calls it (it creates a communicator per flattened group). The name defaults to
        the dim names joined by ``_``; afterwards ``root[name]`` returns the flattened mesh, and a
        redistribute that runs the same collective on each of the flattened dims in a row runs it
        once over the flattened group instead.

        >>> mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))  # doctest: +SKIP
        >>> mesh["dp", "cp"]._flatten().mesh_dim_names  # doctest: +SKIP
        ('dp_cp',)
        """
        if not self.mesh_dim_names:
            raise RuntimeError(
                "cannot flatten a DeviceMesh without mesh_dim_names; pass mesh_dim_names=... when building it"
            )
        name = mesh_dim_name or "_".join(self.mesh_dim_names)
        if self.ndim == 1 and name == self.mesh_dim_names[0]:
            return self
        root = self._get_root_mesh()
        if name in (root.mesh_dim_names or ()):
            raise ValueError(
                f"cannot flatten into {name!r}: the mesh already has a dim of that name "
                f"(its dims are {root.mesh_dim_names}); pass another mesh_dim_name"
            )
        dims = tuple(d for source in self._root_dims for d in source)
        registry = root._flattened_dims(create=True)
        known = registry.get(name)
        if known is None:
            root._world.create_groups(root._groups_along(dims))
            registry[name] = dims
        elif known != dims:
            made = tuple(root.mesh_dim_names[d] for d in known) if root.mesh_dim_names else known
            raise ValueError(
                f"a flattened dim {name!r} was already made from mesh dims {made}; pass another mesh_dim_name"
            )
        return root._slice((dims,), (name,))

    def _flattened_dims(self, *, create: bool = False) -> dict[str, tuple[int, ...]]:
        """The dims the caller has flattened on this (root) mesh: name -> root dims, row-major."""
        key = (self._world.current_rank(), self._key)
        per_world = _FLATTENED.get(self._world)
        if per_world is None:
            if not create:
                return {}
            with _FLATTENED_LOCK:
                per_world = _FLATTENED.setdefault(self._world, {})
        registry = per_world.get(key)
        if registry is None:
            if not create:
                return {}
            registry = per_world.setdefault(key, {})
        return registry

    def _groups_along(self, dims: tuple[int, ...]) -> list[tuple[int, ...]]:
        """Every group of ranks that differ only along ``dims`` (row-major over them), in one order."""
        others = [d for d in range(self.ndim) if d not in dims]
        rows = self.mesh.permute(*others, *dims).reshape(-1, math.prod(self._shape[d] for d in dims))
        return [tuple(row) for row in rows.tolist()]

    def _flattened_communicator(self, mesh_dims: Sequence[int]) -> Communicator | None:
        """The caller's communicator over ``mesh_dims`` of this mesh taken as one flattened dim, if a
        ``_flatten`` call made that dim (None otherwise). ``mesh_dims`` ascend: the first is the major."""
        root = self._get_root_mesh()
        registry = root._flattened_dims()
        if not registry:
            return None
        dims = tuple(d for m in mesh_dims for d in self._root_dims[m])
        name = next((n for n, flat in registry.items() if flat == dims), None)
        if name is None:
            return None
        return self._world.communicator(root._ranks_along(dims)).on_mesh_dim(name)

    def _ranks_along(self, dims: tuple[int, ...]) -> tuple[int, ...]:
        """The caller's group along ``dims`` (row-major over them), by arithmetic on the rank list:
        no tensor op, so it also runs while torch.compile traces with fake tensors."""
        coordinate = self._require_coordinate()
        strides = [math.prod(self._shape[d + 1 :]) for d in range(self.ndim)]
        offsets = [sum(coordinate[d] * strides[d] for d in range(self.ndim) if d not in dims)]
        for d in dims:
            offsets = [o + i * strides[d] for o in offsets for i in range(self._shape[d])]
        return tuple(self._flat[o] for o in offsets)

    # ----- the current mesh ------------------------------------------------------------------------
    def __enter__(self) -> Self:
        """Make this the mesh used where none is given (``distribute_tensor(t, placements=...)``)."""
        _ENTERED_MESHES.set((*_ENTERED_MESHES.get(), self))
        return self

    def __exit__(self, *exc_info: object) -> None:
        _ENTERED_MESHES.set(_ENTERED_MESHES.get()[:-1])

    # ----- value semantics -------------------------------------------------------------------------
    def __copy__(self) -> DeviceMesh:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> DeviceMesh:
        # A mesh is an immutable value bound to the running world: copies share it.
        return self

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, DeviceMesh):
            return NotImplemented
        return (
            self._hash == other._hash
            and self._world is other._world
            and self.device_type == other.device_type
            and self._shape == other._shape
            and self._flat == other._flat
            and self.mesh_dim_names == other.mesh_dim_names
        )

    def __hash__(self) -> int:
        return self._hash

    def __fx_repr__(self) -> tuple[str, dict[str, Any]]:
        """How a torch.compile graph names this mesh should it hold it as a constant: by value, in this world."""
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh({self.device_type!r}, {self.mesh.tolist()}{names})", {"DeviceMesh": DeviceMesh}

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh({self.device_type!r}, {self.mesh.tolist()}{names})"

    def __str__(self) -> str:
        names = self.mesh_dim_names or tuple(f"d{i}" for i in range(self.ndim))
        return "mesh(" + ", ".join(f"{n}={s}" for n, s in zip(names, self._shape)) + ")"


def _ranks_tensor(mesh: torch.Tensor | Sequence[Any]) -> torch.Tensor:
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


def init_device_mesh(
    device_type: str,
    mesh_shape: Sequence[int],
    *,
    mesh_dim_names: Sequence[str] | None = None,
    timeout: timedelta | float | None = None,
) -> DeviceMesh:
    """A mesh of ``mesh_shape`` over every rank of the current world, ranks in row-major order.

    Under torchrun this uses the default c10d group (started on first use: gloo for cpu, nccl for
    cuda); inside ``spmd.testing.run_threaded`` it uses the threaded world. ``timeout`` (a
    timedelta or seconds) bounds every collective on the mesh's groups; by default they inherit
    the default group's (``init_process_group(timeout=...)``) or the threaded world's.

    Every rank must pass the same shape and names: the ranks compare them first (one small
    exchange over the world) and all raise, naming the ranks that differ, if they do not.
    """
    mesh_shape = tuple(int(s) for s in mesh_shape)
    # A plain string is refused by DeviceMesh with a hint, after the ranks have compared it.
    names = mesh_dim_names if mesh_dim_names is None or isinstance(mesh_dim_names, str) else tuple(mesh_dim_names)
    timeout_s = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if timeout_s is not None and timeout_s <= 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}; pass seconds or a timedelta")
    world = current_world(device_type, timeout_s=timeout_s)
    _check_ranks_agree(world, mesh_shape, names, timeout_s)
    if math.prod(mesh_shape) != world.size:
        raise ValueError(
            f"mesh shape {mesh_shape} holds {math.prod(mesh_shape)} ranks but the world has {world.size}; "
            "make the product of the mesh shape equal the world size"
        )
    ranks = torch.arange(world.size).reshape(mesh_shape)
    mesh = DeviceMesh(device_type, ranks, mesh_dim_names=mesh_dim_names, _world=world, _create_groups=False)
    world.create_groups(mesh._groups(), timeout_s=timeout_s)
    return mesh


def _check_ranks_agree(
    world: World, mesh_shape: tuple[int, ...], names: str | tuple[str, ...] | None, timeout_s: float | None
) -> None:
    """Raise on every rank unless all ranks passed the same mesh shape and names."""
    everyone = tuple(range(world.size))
    world.create_groups([everyone], timeout_s=timeout_s)
    mine = (mesh_shape, names)
    described = world.communicator(everyone).all_gather_object(mine)
    if all(theirs == mine for theirs in described):
        return
    by_args: dict[Any, list[int]] = {}
    for rank, args in enumerate(described):
        by_args.setdefault(args, []).append(rank)
    listed = "; ".join(
        f"ranks {ranks}: mesh_shape={shape}, mesh_dim_names={dim_names}"
        for (shape, dim_names), ranks in by_args.items()
    )
    raise ValueError(
        f"init_device_mesh was called with different arguments on different ranks ({listed}); "
        "every rank must build the same mesh"
    )
