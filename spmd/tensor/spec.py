"""DTensorSpec and TensorMeta: the frozen description of a global tensor laid out on a mesh."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from spmd.tensor.device_mesh.mesh import DeviceMesh
from spmd.tensor.placement import (
    Partial,
    Placement,
    Replicate,
    Shard,
    _is_shard_like,
    _StridedShard,
    format_placements,
    shard_offsets,
    shard_sizes,
)
from spmd.tensor.torch_objects import refuse_torch_object, refuse_torch_objects, torch_object_error

__all__ = [
    "TensorMeta",
    "DTensorSpec",
    "local_shape",
    "local_shape_and_offset",
    "compute_local_shape_and_global_offset",
    "contiguous_strides",
    "normalize_placements",
    "has_strided",
    "unstrided_placements",
]

DTENSOR_DTYPE_SHORT = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
    torch.bool: "bool", torch.complex64: "c64", torch.complex128: "c128",
}


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Global shape, stride and dtype of a logical tensor."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    contiguous: bool = field(init=False, repr=False, compare=False)
    """``stride`` is the default (row-major) one, so a wrapper tensor need not be given it."""

    def __post_init__(self) -> None:
        if callable(self.stride):
            raise TypeError(
                "TensorMeta takes the stride as a tuple of ints, got a method; pass tensor.stride(), "
                "not tensor.stride"
            )
        # Sizes may be symbols while torch.compile traces (a value-dependent shape): no comparing then.
        plain = all(type(size) is int for size in self.shape)
        object.__setattr__(self, "contiguous", plain and tuple(self.stride) == contiguous_strides(self.shape))

    def __reduce__(self) -> tuple[Any, ...]:
        return TensorMeta, (self.shape, self.stride, self.dtype)

    @staticmethod
    def of(tensor: torch.Tensor) -> TensorMeta:
        return TensorMeta(tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)

    @property
    def nbytes(self) -> int:
        numel = 1
        for s in self.shape:
            numel *= s
        return numel * self.dtype.itemsize


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True, slots=True)
class DTensorSpec:
    """Mesh + one placement per mesh dim + global tensor meta; hashable, so it keys caches."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    tensor_meta: TensorMeta
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Callers may pass a list; the frozen value always holds a tuple.
        object.__setattr__(self, "placements", tuple(self.placements))
        if len(self.placements) != self.mesh.ndim:
            raise ValueError(
                f"{len(self.placements)} placements given for a {self.mesh.ndim}-d mesh; "
                f"give exactly one placement per mesh dim"
            )
        object.__setattr__(self, "_hash", hash((self.mesh, self.placements, self.tensor_meta)))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if type(other) is not DTensorSpec:
            return NotImplemented
        return (
            self._hash == other._hash
            and self.placements == other.placements
            and self.tensor_meta == other.tensor_meta
            and self.mesh == other.mesh
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # Through the constructor: the hash depends on the mesh's world, which is the loader's.
        return DTensorSpec, (self.mesh, self.placements, self.tensor_meta)

    # An immutable value: copies are the value itself. torch.compile deep-copies a DTensor's spec into
    # its guard, so the guard on a steady loop's input compares one object with itself.
    def __copy__(self) -> DTensorSpec:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> DTensorSpec:
        return self

    @property
    def shape(self) -> tuple[int, ...]:
        return self.tensor_meta.shape

    @property
    def ndim(self) -> int:
        return len(self.tensor_meta.shape)

    def with_placements(self, placements: Sequence[Placement]) -> DTensorSpec:
        return DTensorSpec(self.mesh, tuple(placements), self.tensor_meta)

    def with_dtype(self, dtype: torch.dtype) -> DTensorSpec:
        """The same layout of a tensor of ``dtype``."""
        if dtype == self.tensor_meta.dtype:
            return self
        meta = self.tensor_meta
        return DTensorSpec(self.mesh, self.placements, TensorMeta(meta.shape, meta.stride, dtype))

    # ----- torch's DTensorSpec vocabulary (code written against torch reads these) ---------------
    @property
    def device_mesh(self) -> DeviceMesh:
        return self.mesh

    @property
    def stride(self) -> tuple[int, ...]:
        return self.tensor_meta.stride

    @property
    def num_shards(self) -> int:
        """How many distinct pieces the tensor is cut into across the whole mesh."""
        count = 1
        for size, p in zip(self.mesh.shape, self.placements):
            if _is_shard_like(p):
                count *= size
        return count

    @property
    def num_shards_map(self) -> list[int]:
        """For each tensor dim, how many pieces it is cut into."""
        counts = [1] * self.ndim
        for size, p in zip(self.mesh.shape, self.placements):
            if _is_shard_like(p):
                counts[p.dim] *= size
        return counts

    @property
    def dim_map(self) -> list[int]:
        """For each tensor dim, the mesh dim sharding it, or -1 (one mesh dim per tensor dim at most)."""
        owners = [-1] * self.ndim
        for mesh_dim, p in enumerate(self.placements):
            if _is_shard_like(p):
                if owners[p.dim] != -1:
                    raise ValueError(
                        f"{self}: tensor dim {p.dim} is sharded by mesh dims {owners[p.dim]} and {mesh_dim}; "
                        "dim_map holds one mesh dim per tensor dim (read .placements instead)"
                    )
                owners[p.dim] = mesh_dim
        return owners

    @property
    def sums(self) -> list[int]:
        """The mesh dims holding a pending reduction (Partial)."""
        return [d for d, p in enumerate(self.placements) if isinstance(p, Partial)]

    def is_replicated(self) -> bool:
        return all(isinstance(p, Replicate) for p in self.placements)

    def is_sharded(self) -> bool:
        return any(_is_shard_like(p) for p in self.placements)

    def is_partial(self) -> bool:
        return self.has_partial

    @property
    def has_partial(self) -> bool:
        return any(isinstance(p, Partial) for p in self.placements)

    def __str__(self) -> str:
        dtype = DTENSOR_DTYPE_SHORT.get(self.tensor_meta.dtype, str(self.tensor_meta.dtype).replace("torch.", ""))
        shape = ",".join(str(s) for s in self.shape)
        return f"{dtype}[{shape}] {format_placements(self.placements)} on {self.mesh}"


def local_shape_and_offset(
    global_shape: Sequence[int],
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    coordinate: Sequence[int] | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape of the caller's shard and its offset in the global tensor.

    Mesh dims shard in order: a tensor dim sharded by mesh dims 0 and 1 is first cut by mesh dim 0,
    then each piece again by mesh dim 1 (uneven pieces follow ``shard_sizes``).
    """
    if coordinate is None:
        coordinate = mesh._require_coordinate()
    if has_strided(placements):
        raise ValueError(
            f"placements {format_placements(placements)} hold a _StridedShard, whose piece is several separate "
            "blocks of the dim, not one block at an offset; use local_shape() for the piece's shape, "
            "_StridedShard.local_shard_indices() for the entries it holds, or redistribute to Shard/Replicate first"
        )
    shape, offset = list(global_shape), [0] * len(global_shape)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard):
            n, i = mesh.shape[mesh_dim], coordinate[mesh_dim]
            offset[p.dim] += shard_offsets(shape[p.dim], n)[i]
            shape[p.dim] = shard_sizes(shape[p.dim], n)[i]
    return tuple(shape), tuple(offset)


def compute_local_shape_and_global_offset(
    global_shape: Sequence[int],
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    skip_offset: bool = False,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The caller's piece under torch's name (``torch.distributed.tensor._utils``): its shape, and the
    global index of its first entry in each dim (the dim's length for an empty piece).

    Unlike ``local_shape_and_offset`` it takes ``_StridedShard`` too, whose piece is several blocks:
    the offset is then the first entry it holds. A rank outside ``mesh`` gets ``((0,), ())``, and
    ``skip_offset=True`` gives ``()`` for the offset.
    """
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return (0,), ()
    held: dict[int, Sequence[int]] = {}  # tensor dim -> the global indices of that dim the piece holds
    for mesh_dim, p in enumerate(placements):
        if not _is_shard_like(p):
            continue
        n, i = mesh.shape[mesh_dim], coordinate[mesh_dim]
        indices = held.get(p.dim, range(global_shape[p.dim]))
        if isinstance(p, _StridedShard):
            held[p.dim] = [indices[k] for k in p.local_shard_indices(len(indices), n, i)]
        else:
            start = shard_offsets(len(indices), n)[i]
            held[p.dim] = indices[start : start + shard_sizes(len(indices), n)[i]]
    shape = tuple(len(held[d]) if d in held else size for d, size in enumerate(global_shape))
    if skip_offset:
        return shape, ()
    offset = tuple(
        0 if d not in held else (held[d][0] if len(held[d]) else size) for d, size in enumerate(global_shape)
    )
    return shape, offset


def local_shape(
    global_shape: Sequence[int],
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    coordinate: Sequence[int] | None = None,
) -> tuple[int, ...]:
    """Shape of the caller's (or ``coordinate``'s) shard; unlike ``local_shape_and_offset``, for any
    placements, ``_StridedShard`` included (mesh dims cut in order, each its own way)."""
    if coordinate is None:
        coordinate = mesh._require_coordinate()
    shape = list(global_shape)
    for mesh_dim, p in enumerate(placements):
        n, i = mesh.shape[mesh_dim], coordinate[mesh_dim]
        if isinstance(p, Shard):
            shape[p.dim] = shard_sizes(shape[p.dim], n)[i]
        elif isinstance(p, _StridedShard):
            shape[p.dim] = p.local_shard_size(shape[p.dim], n, i)
    return tuple(shape)


def has_strided(placements: Sequence[Placement]) -> bool:
    """True when some mesh dim is a ``_StridedShard`` (code reading ``Shard`` offsets must not see it)."""
    return any(type(p) is _StridedShard for p in placements)


def unstrided_placements(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """``placements`` with every ``_StridedShard`` made ``Replicate``, and so is every later mesh dim
    that shards the same tensor dim (its cut nests inside the strided one's).

    The layout a strided tensor is gathered to before anything else reads it: what is left is
    plain (``Shard``, ``Replicate``, ``Partial``), and each kept shard is cut exactly as before.
    """
    plain = list(placements)
    nested: set[int] = set()
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, _StridedShard) or (isinstance(p, Shard) and p.dim in nested):
            nested.add(p.dim)
            plain[mesh_dim] = REPLICATE
    return tuple(plain)


def normalize_placements(
    placements: Sequence[Placement], mesh: DeviceMesh, tensor_ndim: int, *, where: str = "spmd.tensor"
) -> tuple[Placement, ...]:
    """Check a user's placements against the mesh and tensor; make negative shard dims positive.

    ``where`` names the entry point (and argument) for the error about torch's placements.
    """
    if isinstance(placements, Placement):
        raise TypeError(f"placements must be a sequence, e.g. [{placements}], not a single placement")
    try:
        placements = tuple(placements)
    except TypeError:  # a single placement of torch's is not iterable either
        refuse_torch_object(placements, where)
        raise
    if len(placements) != mesh.ndim:
        refuse_torch_objects(placements, where)
        raise ValueError(
            f"{len(placements)} placements {format_placements(placements)} given for a {mesh.ndim}-d mesh "
            f"{mesh}; placements and the mesh's dims must have the same length: give exactly one "
            "placement per mesh dim"
        )
    result: list[Placement] = []
    for p in placements:
        if not isinstance(p, Placement):
            raise torch_object_error(p, where) or TypeError(
                f"{p!r} is not a Placement; use Shard(dim), Replicate() or Partial()"
            )
        if isinstance(p, Shard):
            if not -tensor_ndim <= p.dim < tensor_ndim or tensor_ndim == 0:
                hint = f"use a dim in [{-tensor_ndim}, {tensor_ndim - 1}]" if tensor_ndim else "a 0-d tensor can only be replicated or partial"
                raise ValueError(f"{p} is out of range for a {tensor_ndim}-d tensor; {hint}")
            p = Shard(p.dim % tensor_ndim)
        elif isinstance(p, _StridedShard):
            if not -tensor_ndim <= p.dim < tensor_ndim or tensor_ndim == 0:
                hint = f"use a dim in [{-tensor_ndim}, {tensor_ndim - 1}]" if tensor_ndim else "a 0-d tensor can only be replicated or partial"
                raise ValueError(f"{p!r} is out of range for a {tensor_ndim}-d tensor; {hint}")
            p = _StridedShard(p.dim % tensor_ndim, split_factor=p.split_factor)
        result.append(p)
    return tuple(result)


REPLICATE = Replicate()
