"""Random numbers for DTensors that equal a single device's, shard by shard, in one of two modes.

``"torch"`` (the default): every rank keeps its own generator, seeded alike (the seed of mesh
coordinate 0, shared on first use) and advanced alike, and every random op draws the *global*
tensor and keeps its own piece. A sharded ``rand`` holds exactly the numbers one device draws
after ``torch.manual_seed`` with the same seed, and replicas agree; the cost is one global-sized
draw per rank, because CPU generators cannot skip ahead to a shard's offset.

``"counter"`` (opt-in, ``set_rng_mode("counter")``): a counter-based stream cuts each op's global
tensor into fixed tiles (n-d boxes of at most ``TILE_ELEMENTS`` elements, a pure function of the
global shape) and fills tile ``i`` from a fresh generator seeded with a hash of (seed, offset, i),
where ``offset`` advances by the global numel per op. A rank draws only the tiles its shard
touches: O(local shard) per rank, rounded up to whole tiles. The numbers equal what one device
draws from the same stream (``CounterStream``), not what it draws after ``torch.manual_seed``.
"""

from __future__ import annotations

import itertools
import math
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch

from spmd.tensor.device_mesh.mesh import DeviceMesh
from spmd.tensor.placement import Partial, Placement, Replicate
from spmd.tensor.redistribute.collectives import agree
from spmd.tensor.spec import DTensorSpec, TensorMeta, contiguous_strides, local_shape_and_offset

__all__ = [
    "TILE_ELEMENTS",
    "CounterStream",
    "RngMode",
    "draw_global",
    "draw_local",
    "drawn_elements",
    "get_rng_mode",
    "is_rng_supported_mesh",
    "local_piece_of",
    "manual_seed",
    "rank_generator",
    "rng_mode",
    "set_rng_mode",
    "tile_shape",
]

RngMode = Literal["torch", "counter"]
_MODES = ("torch", "counter")

TILE_ELEMENTS = 1 << 14
"""Most elements in one tile of the counter stream (part of the stream's definition)."""

_lock = threading.Lock()
_default_mode: RngMode = "torch"


@dataclass
class _RankRNG:
    seed: int
    generator: torch.Generator
    offset: int = 0
    """Position of the counter stream: the global numel of every counter-mode op so far."""
    mode: RngMode | None = None
    """This rank's mode; None follows the process default."""
    drawn: int = 0
    """Elements this rank has drawn, in either mode (what O(local) is measured by)."""


# One generator per rank of a world (threads of one threaded world must not share state), held
# weakly by the world: a later world must not inherit a finished one's seed, offset or mode.
_generators: weakref.WeakKeyDictionary[Any, dict[int, _RankRNG]] = weakref.WeakKeyDictionary()


def _entry(mesh: DeviceMesh) -> _RankRNG | None:
    return _generators.get(mesh._world, {}).get(mesh.get_rank())


def _coordinate_zero_seed(mesh: DeviceMesh, seed: int) -> int:
    """The seed held at mesh coordinate 0, passed along each mesh dim in turn."""
    return int(agree(mesh, range(mesh.ndim), seed)[0])


def _rank_state(mesh: DeviceMesh) -> _RankRNG:
    entry = _entry(mesh)
    if entry is None:
        manual_seed(torch.initial_seed(), mesh)
        entry = _entry(mesh)
        assert entry is not None
    return entry


def manual_seed(seed: int, device_mesh: DeviceMesh) -> None:
    """Seed the DTensor generator of every rank of ``device_mesh`` (call it on every rank).

    Restarts both streams: the torch-mode generator and the counter stream's offset."""
    seed = _coordinate_zero_seed(device_mesh, int(seed))
    with _lock:
        old = _entry(device_mesh)
        mode = old.mode if old is not None else None
        drawn = old.drawn if old is not None else 0
        _generators.setdefault(device_mesh._world, {})[device_mesh.get_rank()] = _RankRNG(
            seed, torch.Generator().manual_seed(seed), mode=mode, drawn=drawn
        )


def is_rng_supported_mesh(device_mesh: DeviceMesh) -> bool:
    """Whether random ops on DTensors of ``device_mesh`` draw a single device's numbers: always here.

    torch's private name; torch answers False (with a warning) for meshes whose device has no RNG
    state it can set, e.g. CPU, and there falls back to each rank's own generator. spmd's
    generators are per rank of a world on every device type, so code that branches on this takes
    the supported path.
    """
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"is_rng_supported_mesh takes a DeviceMesh, got {type(device_mesh).__name__}")
    return True


def _check_mode(mode: str) -> RngMode:
    if mode not in _MODES:
        raise ValueError(f"unknown RNG mode {mode!r}; use 'torch' (equal to torch.manual_seed) or 'counter' (O(local))")
    return "torch" if mode == "torch" else "counter"


def set_rng_mode(mode: RngMode, device_mesh: DeviceMesh | None = None) -> RngMode:
    """Choose how DTensor random ops draw; returns the mode it replaces.

    Without ``device_mesh`` it sets the process default (every rank of every world that has not
    chosen its own); with one it sets this rank's mode (call it on every rank, e.g. inside
    ``run_threaded``, where ranks are threads of one process)."""
    global _default_mode
    checked = _check_mode(mode)
    if device_mesh is None:
        previous, _default_mode = _default_mode, checked
        return previous
    entry = _rank_state(device_mesh)
    previous = entry.mode or _default_mode
    entry.mode = checked
    return previous


def get_rng_mode(device_mesh: DeviceMesh | None = None) -> RngMode:
    """The mode random ops on ``device_mesh`` use on this rank (the process default without one)."""
    if device_mesh is None:
        return _default_mode
    entry = _entry(device_mesh)
    return (entry.mode if entry is not None else None) or _default_mode


@contextmanager
def rng_mode(mode: RngMode, device_mesh: DeviceMesh | None = None) -> Iterator[None]:
    """``set_rng_mode`` for a block; the previous mode comes back on exit."""
    if device_mesh is None:
        previous = set_rng_mode(mode)
        try:
            yield
        finally:
            set_rng_mode(previous)
        return
    entry = _rank_state(device_mesh)
    saved = entry.mode
    entry.mode = _check_mode(mode)
    try:
        yield
    finally:
        entry.mode = saved


def drawn_elements(device_mesh: DeviceMesh) -> int:
    """How many random elements this rank has drawn for DTensors on ``device_mesh``'s world."""
    entry = _entry(device_mesh)
    return entry.drawn if entry is not None else 0


def rank_generator(mesh: DeviceMesh) -> torch.Generator:
    """This rank's torch-mode generator; first use takes ``torch.initial_seed()`` of coordinate 0."""
    return _rank_state(mesh).generator


def draw_global(mesh: DeviceMesh, shape: tuple[int, ...], dtype: torch.dtype, fill: str, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The global tensor a single device would draw after ``torch.manual_seed``: ``torch.empty(shape).<fill>_(*args)``."""
    entry = _rank_state(mesh)
    full = torch.empty(shape, dtype=dtype)
    getattr(full, fill)(*args, generator=entry.generator, **kwargs)
    entry.drawn += full.numel()
    return full.to(mesh.device_type) if mesh.device_type != "cpu" else full


def local_piece_of(full: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]) -> torch.Tensor:
    """This rank's piece of a global tensor every rank holds (no communication)."""
    from spmd.tensor.redistribute.run import redistribute_local

    meta = TensorMeta(tuple(full.shape), contiguous_strides(full.shape), full.dtype)
    replicated = DTensorSpec(mesh, (Replicate(),) * mesh.ndim, meta)
    return redistribute_local(full, replicated, placements)


def draw_local(
    mesh: DeviceMesh,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    placements: tuple[Placement, ...],
    fill: str,
    *args: Any,
    **kwargs: Any,
) -> torch.Tensor:
    """This rank's piece of a fresh global draw ``torch.empty(shape).<fill>_(*args)``, in this rank's mode.

    A partial placement gets the value on coordinate 0 (the reduction's identity elsewhere), as
    ``distribute_tensor`` does; no mode communicates."""
    entry = _rank_state(mesh)
    if (entry.mode or _default_mode) == "torch":
        return local_piece_of(draw_global(mesh, shape, dtype, fill, *args, **kwargs), mesh, placements)
    offset = entry.offset
    entry.offset += math.prod(shape)
    whole = fresh_value_placements(placements)
    local_shape, local_offset = local_shape_and_offset(shape, mesh, whole)
    local, drawn = _draw_region(entry.seed, offset, shape, local_shape, local_offset, dtype, fill, args, kwargs)
    entry.drawn += drawn
    if mesh.device_type != "cpu":
        local = local.to(mesh.device_type)
    if whole != placements:  # replicate -> partial is local: no collective
        from spmd.tensor.redistribute.run import redistribute_local

        meta = TensorMeta(shape, contiguous_strides(shape), dtype)
        local = redistribute_local(local, DTensorSpec(mesh, whole, meta), placements)
    return local


def fresh_value_placements(placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
    """A newly drawn value is whole: shards stay shards, partials become replicas."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in placements)


# ---- the counter stream ------------------------------------------------------------------------


def tile_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The extents of the counter stream's tiles for a global ``shape``.

    Power-of-two extents, doubled round-robin from the last dim to the first (a dim stops at its
    size) while the tile stays within ``TILE_ELEMENTS``: near-cubic tiles, so a shard along any dim
    touches few tiles it does not need (flat blocks would make a last-dim shard draw whole rows)."""
    extents = [1] * len(shape)
    budget = TILE_ELEMENTS
    growing = [d for d in reversed(range(len(shape))) if shape[d] > 1]
    while growing and budget >= 2:
        for d in list(growing):
            if budget < 2:
                break
            extents[d] *= 2
            budget //= 2
            if extents[d] >= shape[d]:
                growing.remove(d)
    return tuple(min(e, s) if s > 0 else 1 for e, s in zip(extents, shape))


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """A 64-bit finaliser (splitmix64): nearby inputs give unrelated outputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def tile_seed(seed: int, offset: int, tile: int) -> int:
    """The generator seed of ``tile`` of the op at stream ``offset`` (CPU generators keep 32 bits)."""
    return _mix64(_mix64(_mix64(seed & _MASK64) ^ (offset & _MASK64)) ^ tile) & 0xFFFFFFFF


def _draw_region(
    seed: int,
    offset: int,
    shape: tuple[int, ...],
    region_shape: tuple[int, ...],
    region_offset: tuple[int, ...],
    dtype: torch.dtype,
    fill: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, int]:
    """The box ``region_offset + region_shape`` of the counter stream's global tensor, and how many
    elements it took to draw (every touched tile is drawn whole)."""
    out = torch.empty(region_shape, dtype=dtype)
    if out.numel() == 0:
        return out, 0
    extents = tile_shape(shape)
    grid = [-(-s // e) for s, e in zip(shape, extents)]
    spans = [
        range(o // e, -(-(o + n) // e)) for o, n, e in zip(region_offset, region_shape, extents)
    ]
    drawn = 0
    generator = torch.Generator()
    for coords in itertools.product(*spans):
        index = 0
        for c, g in zip(coords, grid):
            index = index * g + c
        starts = [c * e for c, e in zip(coords, extents)]
        sizes = [min(e, s - st) for e, s, st in zip(extents, shape, starts)]
        generator.manual_seed(tile_seed(seed, offset, index))
        tile = torch.empty(math.prod(sizes), dtype=dtype)
        getattr(tile, fill)(*args, generator=generator, **kwargs)
        drawn += tile.numel()
        tile = tile.view(sizes)
        src: list[slice] = []
        dst: list[slice] = []
        for st, sz, o, n in zip(starts, sizes, region_offset, region_shape):
            lo, hi = max(st, o), min(st + sz, o + n)
            src.append(slice(lo - st, hi - st))
            dst.append(slice(lo - o, hi - o))
        out[tuple(dst)] = tile[tuple(src)]
    return out, drawn


@dataclass
class CounterStream:
    """The single-device reference of ``"counter"`` mode: plain tensors from the same stream.

    After ``manual_seed(seed, mesh)`` and ``set_rng_mode("counter")``, the n-th random DTensor op
    holds the global tensor ``CounterStream(seed)``'s n-th draw returns, on every layout::

        stream = CounterStream(seed=5)
        expected_x = stream.randn(8, 6)                       # st.randn(8, 6, ...)
        expected_mask = stream.draw((8, 6), "bernoulli_", 0.9)  # F.dropout(x, p=0.1)'s keep mask
    """

    seed: int
    offset: int = 0

    def draw(self, shape: tuple[int, ...], fill: str, *args: Any, dtype: torch.dtype | None = None, **kwargs: Any) -> torch.Tensor:
        """The next op's global tensor: ``torch.empty(shape, dtype=dtype).<fill>_(*args, **kwargs)``."""
        shape = tuple(int(s) for s in shape)
        out, _ = _draw_region(
            self.seed, self.offset, shape, shape, (0,) * len(shape), dtype or torch.get_default_dtype(), fill, args, kwargs
        )
        self.offset += math.prod(shape)
        return out

    def rand(self, *size: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Uniform [0, 1) values, as ``spmd.tensor.rand`` / ``rand_like`` draw them in counter mode."""
        return self.draw(tuple(size), "uniform_", dtype=dtype)

    def randn(self, *size: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Standard normal values, as ``spmd.tensor.randn`` / ``randn_like`` draw them in counter mode."""
        return self.draw(tuple(size), "normal_", dtype=dtype)
