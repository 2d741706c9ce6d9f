"""DeviceMesh: an n-d grid of ranks with one communicator per mesh dimension."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from typing import Any

import torch
from typing_extensions import Self

from spmd.comm import Communicator, World, current_world, handles
from spmd.comm.threaded import thread_rank
from spmd.compile.compiling import compiling_here
from spmd.compile.properties import traceable_property
from spmd.tensor.device_mesh.args import (
    check_caller_group,
    check_group_count,
    check_single_group_mesh,
    coordinates,
    dim_groups,
    dim_names,
    group_list_args,
    ranks_tensor,
    unflatten_args,
)
from spmd.tensor.device_mesh.flattened import Flattened, MeshKey, flattened_dims, next_root_ordinal
from spmd.tensor.device_mesh.layout import DimLayout, canonical, offsets, overlaps, root_layout, split, without_axes

__all__ = ["DeviceMesh", "current_mesh"]

# The meshes entered with ``with mesh:``, innermost last. A context variable, so that each rank
# thread of a threaded world has its own stack.
_ENTERED_MESHES: ContextVar[tuple[DeviceMesh, ...]] = ContextVar("spmd_entered_meshes", default=())


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
        _layout: tuple[DimLayout, ...] | None = None,
    ) -> None:
        ranks = ranks_tensor(mesh)
        self._device_type = device_type
        self._mesh = ranks
        self._shape = tuple(ranks.shape)
        self._flat = tuple(int(r) for r in ranks.flatten().tolist())
        if len(set(self._flat)) != len(self._flat):
            raise ValueError(f"a DeviceMesh lists each rank once; got {ranks.tolist()}")
        self._mesh_dim_names = dim_names(mesh_dim_names, ranks.ndim)
        self._world = _world if _world is not None else current_world(device_type)
        if max(self._flat) >= self._world.size or min(self._flat) < 0:
            raise ValueError(f"mesh ranks {sorted(self._flat)} do not fit a world of {self._world.size} ranks")
        self._coordinates = coordinates(self._flat, self._shape)
        # _dim_groups[d][rank] is the tuple of ranks sharing every coordinate but d with rank.
        self._dim_groups = dim_groups(ranks)
        if _create_groups:
            self._world.create_groups(self._groups())
        # Whether every rank that can call into this object is in the mesh, so that the dispatcher may
        # skip asking (a lookup of the caller's rank, ~1us under c10d): true when the mesh holds the
        # whole world, and under c10d (one rank per process) when it holds this process's rank.
        self._callers_in_mesh = len(self._flat) == self._world.size or (
            self._world.backend_name == "c10d" and self._world.current_rank() in self._coordinates
        )
        # A mesh derived from another (``mesh["tp"]``, ``_flatten``, ``_unflatten``) remembers the root
        # mesh it came from, and where each of its dims lies in the root's rank list (layout.py).
        self._root = _root
        self._layout = _layout if _layout is not None else root_layout(self._shape)
        self._key: MeshKey = (device_type, self._shape, self._flat, self.mesh_dim_names)
        self._ordinal: int = next_root_ordinal(self._world) if _root is None else _root._ordinal
        # Meshes of different worlds (two run_threaded calls) are not interchangeable: their
        # communicators belong to different ranks.
        self._hash = hash((*self._key, id(self._world)))

    @staticmethod
    def from_group(
        group: Any | list[Any],
        device_type: str,
        mesh: torch.Tensor | Sequence[Any] | None = None,
        *,
        mesh_dim_names: Sequence[str] | None = None,
    ) -> DeviceMesh:
        """A mesh over groups that already exist, as torch's: one group makes a 1-d mesh over its ranks;
        a list of groups, the caller's group along each mesh dim in order, needs the whole ``mesh`` of
        global ranks and its ``mesh_dim_names``.

        A group is a c10d ProcessGroup (under torchrun) or what ``mesh.get_group()`` returns on any
        world; the mesh communicates over it. Each rank passes its own groups; no rank talks.

        >>> tp = DeviceMesh.from_group(dist.new_group([0, 1]), "cpu", mesh_dim_names=("tp",))  # doctest: +SKIP
        """
        world = current_world(device_type)
        if not isinstance(group, (list, tuple)):
            ranks = world.adopt_group(group)
            check_single_group_mesh(mesh, ranks)
            return DeviceMesh(
                device_type, list(ranks), mesh_dim_names=mesh_dim_names, _world=world, _create_groups=False
            )
        groups = list(group)
        mesh, mesh_dim_names = group_list_args(groups, mesh, mesh_dim_names)
        built = DeviceMesh(device_type, mesh, mesh_dim_names=mesh_dim_names, _world=world, _create_groups=False)
        check_group_count(len(groups), built.mesh)
        me, names = world.current_rank(), built.mesh_dim_names or ()
        for d, one in enumerate(groups):
            check_caller_group(d, names[d], world.adopt_group(one), built._dim_groups[d].get(me), me)
        return built

    # ----- shape -----------------------------------------------------------------------------------
    # traceable_property, not property: torch.compile reads these on a mesh from outside the region.
    @traceable_property
    def device_type(self) -> str:
        """``"cpu"`` or ``"cuda"``: where the ranks' tensors live."""
        return self._device_type

    @traceable_property
    def mesh(self) -> torch.Tensor:
        """The ranks as an int64 tensor of the mesh's shape."""
        return self._mesh

    @traceable_property
    def mesh_dim_names(self) -> tuple[str, ...] | None:
        """One name per mesh dim, or None for an unnamed mesh."""
        return self._mesh_dim_names

    @traceable_property
    def shape(self) -> tuple[int, ...]:
        """Ranks along each mesh dim."""
        return self._shape

    @traceable_property
    def ndim(self) -> int:
        """Number of mesh dims."""
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

    def dim_for(
        self, mesh_dim: int | str | None, *, default_name: str, purpose: str, argument: str, hint: str = ""
    ) -> int:
        """The index of the mesh dim a parallelism runs over: ``mesh_dim`` (an index or a name) when
        given, else the only dim of a 1-d mesh, else the dim named ``default_name``.

        The errors name ``purpose`` (who asks, e.g. ``"fully_shard"``) and ``argument`` (the keyword
        that passes ``mesh_dim``), and end with ``hint``, the caller's own way out.

        >>> mesh.dim_for(None, default_name="tp", purpose="tensor parallelism", argument="tp_mesh_dim")  # doctest: +SKIP
        """
        if mesh_dim is not None:
            try:
                return self.dim_index(mesh_dim)
            except (KeyError, IndexError) as error:
                raise ValueError(f"{argument}={mesh_dim!r} is not a dim of {self}: {error}") from None
        if self.ndim == 1:
            return 0
        names = self.mesh_dim_names
        if names is not None and default_name in names:
            return names.index(default_name)
        fix = (
            f"its dims are named {names}; pass {argument}=<name or index> or name one of them {default_name!r}"
            if names
            else f'name the mesh dims, one of them "{default_name}" (init_device_mesh(..., '
            f'mesh_dim_names=("dp", "tp"))), or pass {argument}=<index>'
        )
        raise ValueError(f"{purpose} on the {self.ndim}-d {self} needs to know its {default_name!r} dim: {fix}{hint}")

    # ----- ranks -----------------------------------------------------------------------------------
    def get_rank(self) -> int:
        """The caller's global rank."""
        return self._rank_on(thread_rank())

    def _rank_on(self, thread: int | None) -> int:
        """The caller's global rank. torch.compile runs this on the real mesh but traces ``get_rank``,
        so passing the rank thread's own rank (None outside a threaded world) guards each compiled
        graph on the thread that traced it: the rank threads of one process share one cache."""
        return self._world.current_rank()

    def get_coordinate(self) -> tuple[int, ...] | None:
        """The caller's coordinate in the mesh, or None if it is not part of it."""
        return self._coordinate_of(self.get_rank())

    def _coordinate_of(self, rank: int) -> tuple[int, ...] | None:
        return self._coordinates.get(rank)

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
        return self._communicator_on(self.get_rank(), mesh_dim)

    def _communicator_on(self, rank: int, mesh_dim: int | str) -> Communicator:
        dim = self.dim_index(mesh_dim)
        comm = self._world.communicator(self._dim_groups[dim][rank])
        return comm.on_mesh_dim(self.mesh_dim_names[dim] if self.mesh_dim_names else str(dim))

    def get_group(self, mesh_dim: int | str | None = None) -> Any:
        """The process group along ``mesh_dim``: a c10d ProcessGroup under torchrun and on rank threads
        (the threaded world's), the communicator on a simulated world."""
        if compiling_here():
            # torch.compile evaluates ``_group_on`` on the real mesh, and refuses a c10d ProcessGroup
            # (a reference opaque type) from it; one read from a module global it takes as an input.
            return handles.PROCESS_GROUPS[self._group_key_on(self.get_rank(), mesh_dim)]
        return self._group_on(self.get_rank(), mesh_dim)

    def _group_key_on(self, rank: int, mesh_dim: int | str | None) -> int:
        """Enter ``_group_on(rank, mesh_dim)`` in ``handles.PROCESS_GROUPS``; its key there."""
        return handles.process_group_key(self._group_on(rank, mesh_dim))

    def _group_on(self, rank: int, mesh_dim: int | str | None) -> Any:
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(f"get_group needs a mesh_dim on a {self.ndim}-d mesh")
            mesh_dim = 0
        flattened = isinstance(mesh_dim, str) and mesh_dim not in (self.mesh_dim_names or ())
        if flattened and self._root is None and mesh_dim in self._flattened_dims():
            return self[mesh_dim].get_group()  # a dim made by ``_flatten`` on this mesh
        comm = self._communicator_on(rank, mesh_dim)
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
        layouts: list[DimLayout] = []
        for name in wanted:
            if name in own:
                layout = self._layout[own.index(name)]
            elif name in flattened:
                layout = flattened[name][0]
            else:
                made = f" and the flattened dims {tuple(flattened)}" if flattened else ""
                where = "" if self._root is None else " (flattened dims are sliced from the mesh they were made on)"
                raise KeyError(f"mesh has no dim named {name!r}; its dims are {self.mesh_dim_names}{made}{where}")
            if any(overlaps(layout, taken) for taken in layouts):
                raise ValueError(
                    f"mesh[{names!r}] names mesh dim {name!r} more than once (or a flattened dim and one of "
                    "its parts); name each dim at most once"
                )
            layouts.append(layout)
        return self._get_root_mesh()._slice(tuple(layouts), wanted)

    def _get_root_mesh(self) -> DeviceMesh:
        """The mesh this one was derived from by slicing, ``_flatten`` or ``_unflatten`` (itself when
        it was built directly); a slice of a slice knows the same root."""
        return self if self._root is None else self._root

    @property
    def _flatten_mapping(self) -> dict[str, DeviceMesh]:
        """The dims ``_flatten`` made on this root mesh, by name (torch's attribute, which Megatron-FSDP
        reads to list a mesh's dim names); empty on a mesh cut from another, as on torch."""
        if self._root is not None:
            return {}
        return {name: self[name] for name in self._flattened_dims()}

    def _slice(self, layouts: tuple[DimLayout, ...], names: tuple[str, ...]) -> DeviceMesh:
        """The caller's mesh whose dim ``i`` lies at ``layouts[i]`` in this root mesh's rank list."""
        axes = [axis for layout in layouts for axis in layout]
        start = without_axes(self._caller_position(), axes)
        # on the CPU even under `with torch.device("meta")` (a model built there slices its mesh too)
        ranks = torch.tensor([self._flat[start + offset] for offset in offsets(axes)], dtype=torch.int64, device="cpu")
        shape = [math.prod(size for size, _ in layout) for layout in layouts]
        # Every group of the sub-mesh was made with this mesh or with the call that derived the dims.
        return DeviceMesh(
            self.device_type,
            ranks.reshape(shape),
            mesh_dim_names=names,
            _world=self._world,
            _create_groups=False,
            _root=self,
            _layout=layouts,
        )

    def _caller_position(self) -> int:
        """Where the caller's rank sits in this mesh's row-major rank list."""
        coordinate = self._require_coordinate()
        return sum(c * math.prod(self._shape[d + 1 :]) for d, c in enumerate(coordinate))

    def _flatten(self, mesh_dim_name: str | None = None, backend_override: Any = None) -> DeviceMesh:
        """This mesh as a 1-d mesh over all of its ranks (row-major), named on the root mesh.

        Every rank calls it (it creates a communicator per flattened group). The name defaults to
        the dim names joined by ``_``; afterwards ``root[name]`` returns the flattened mesh, and a
        redistribute that runs the same collective on each of the flattened dims in a row runs it
        once over the flattened group instead. ``backend_override`` is accepted for torch's
        signature and changes nothing: a world has one backend (see ``_unflatten``).

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
        layout = canonical([axis for dim in self._layout for axis in dim])
        registry = root._flattened_dims(create=True)
        known = registry.get(name)
        if known is None:
            root._world.create_groups(root._groups_along(layout))
            registry[name] = (layout, self.mesh_dim_names)
        elif known[0] != layout:
            raise ValueError(
                f"a flattened dim {name!r} was already made from mesh dims {known[1]}; pass another mesh_dim_name"
            )
        return root._slice((layout,), (name,))

    def _unflatten(
        self,
        dim: int | str,
        mesh_sizes: Sequence[int],
        mesh_dim_names: Sequence[str],
        backend_override: Mapping[int | str, Any] | None = None,
    ) -> DeviceMesh:
        """This mesh with dim ``dim`` split into dims of ``mesh_sizes`` named ``mesh_dim_names`` (row-major).

        Every rank calls it (it creates a communicator per group of each new dim, unless one over the
        same ranks exists). The result shares this mesh's root, so its slices and ``_flatten`` work as
        on any sub-mesh: ``world._unflatten(0, (2, 4), ("dp", "tp"))["tp"]``. ``backend_override``
        (new dim name or index -> backend) is checked as torch checks it, and changes nothing: a
        world has one backend, and a dim given ``"fake"`` gets real groups, cheap to make (groups
        over the same ranks are shared) and safe to use.

        >>> world = init_device_mesh("cpu", (8,), mesh_dim_names=("world",))  # doctest: +SKIP
        >>> world._unflatten(0, (2, 2, 2), ("pp", "dp", "tp")).shape  # doctest: +SKIP
        (2, 2, 2)
        """
        if not self.mesh_dim_names:
            raise RuntimeError(
                "cannot unflatten a DeviceMesh without mesh_dim_names; pass mesh_dim_names=... when building it"
            )
        index, sizes, names = unflatten_args(
            self.mesh_dim_names, self._shape, dim, mesh_sizes, mesh_dim_names, backend_override
        )
        others = self.mesh_dim_names[:index] + self.mesh_dim_names[index + 1 :]
        new_layouts = split(self._layout[index], sizes)
        if new_layouts is None:
            raise ValueError(
                f"mesh dim {self.mesh_dim_names[index]!r} was flattened from dims of sizes "
                f"{[size for size, _ in canonical(self._layout[index])]}; _unflatten sizes {sizes} must split "
                "at their boundaries"
            )
        root = self._get_root_mesh()
        groups = [group for layout in new_layouts for group in root._groups_along(layout)]
        root._world.create_groups(list(dict.fromkeys(groups)))
        layouts = self._layout[:index] + new_layouts + self._layout[index + 1 :]
        return root._slice(layouts, others[:index] + names + others[index:])

    def _flattened_dims(self, *, create: bool = False) -> Flattened:
        """The dims the caller has flattened on this (root) mesh: name -> (layout, dims flattened)."""
        return flattened_dims(self._world, self._key, self._ordinal, create=create)

    def _groups_along(self, layout: DimLayout) -> list[tuple[int, ...]]:
        """Every group of this root mesh's ranks that differ only along ``layout``, in one order."""
        starts = sorted({without_axes(position, layout) for position in range(len(self._flat))})
        steps = offsets(layout)
        return [tuple(self._flat[start + step] for step in steps) for start in starts]

    def _flattened_communicator(self, mesh_dims: Sequence[int]) -> Communicator | None:
        """The caller's communicator over ``mesh_dims`` of this mesh taken as one flattened dim, if a
        ``_flatten`` call made that dim (None otherwise). ``mesh_dims`` ascend: the first is the major."""
        root = self._get_root_mesh()
        registry = root._flattened_dims()
        if not registry:
            return None
        layout = canonical([axis for m in mesh_dims for axis in self._layout[m]])
        name = next((n for n, (flat, _) in registry.items() if flat == layout), None)
        if name is None:
            return None
        return self._world.communicator(root._ranks_along(layout)).on_mesh_dim(name)

    def _ranks_along(self, layout: DimLayout) -> tuple[int, ...]:
        """The caller's group along ``layout`` of this root mesh, by arithmetic on the rank list: no
        tensor op, so it also runs while torch.compile traces with fake tensors."""
        start = without_axes(self._caller_position(), layout)
        return tuple(self._flat[start + step] for step in offsets(layout))

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
