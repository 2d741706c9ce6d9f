"""A layout: how a training job is spread over the world (the thing the search chooses).

Mesh dims, named as torchtitan names them: ``pp`` (pipeline stages), ``dp_replicate`` (whole
replicas: DDP, or HSDP's outer dim), ``dp_shard`` (FSDP; it also shards over ``cp``, as torchtitan
does), ``cp`` (context parallel: the sequence), ``tp`` (tensor parallel, with ``sp`` the norms on
sequence shards). ``ac`` is activation checkpointing (``selective``: torchtitan's op-level policy, keeping matrix
products' and attention's outputs).
``microbatches`` are the pipeline's micro-batches, or gradient-accumulation steps without a pipeline.
``order`` is the mesh, outermost dim first: ranks are numbered row-major, so the innermost dims'
groups are the ones that share a node.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

__all__ = ["Layout", "MESH_DIMS", "AC_MODES", "SCHEDULES", "parse_layout", "mesh_orders", "groups_share_node"]

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""Every mesh dim a layout has, in the default order (outermost first)."""
AC_MODES = ("none", "selective", "full")
SCHEDULES = ("1F1B", "GPipe")
_SHORT = {"dp_replicate": "dp", "dp_shard": "fsdp"}


@dataclass(frozen=True, slots=True)
class Layout:
    """One parallel layout of a training step (degrees multiply to the world size)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    sp: bool = False
    ac: str = "none"
    microbatches: int = 1
    schedule: str = "1F1B"
    order: tuple[str, ...] = MESH_DIMS

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    @property
    def dp(self) -> int:
        """Ranks that split the batch: the data-parallel replicas and shards."""
        return self.dp_replicate * self.dp_shard

    def size(self, dim: str) -> int:
        return int(getattr(self, dim))

    def mesh(self) -> tuple[tuple[str, int], ...]:
        """(name, size) of the dims bigger than one, outermost first."""
        return tuple((dim, self.size(dim)) for dim in self.order if self.size(dim) > 1)

    def with_order(self, order: tuple[str, ...]) -> Layout:
        return replace(self, order=order)

    def __str__(self) -> str:
        parts = [f"{_SHORT.get(dim, dim)}={size}" for dim, size in self.mesh()] or ["dp=1"]
        if self.sp:
            parts.append("sp")
        if self.ac != "none":
            parts.append(f"ac={self.ac}")
        if self.pp > 1:
            parts.append(f"{self.schedule}x{self.microbatches}")
        elif self.microbatches > 1:
            parts.append(f"accum={self.microbatches}")
        return ",".join(parts)


_KEYS = {"dp": "dp_replicate", "fsdp": "dp_shard", "cp": "cp", "tp": "tp", "pp": "pp"}


def parse_layout(text: str) -> Layout:
    """The layout ``str(layout)`` writes: ``"fsdp=128,tp=8,sp,ac=full"``, ``"pp=4,tp=8,1F1Bx8"``.

    Mesh dims in the order written (outermost first); the dims left out have size 1.
    """
    sizes: dict[str, int] = {}
    order: list[str] = []
    fields: dict[str, object] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, value = part.partition("=")
        if part == "sp":
            fields["sp"] = True
        elif name == "ac" and value in AC_MODES:
            fields["ac"] = value
        elif name == "accum" and value.isdigit():
            fields["microbatches"] = int(value)
        elif any(part.startswith(s + "x") and part[len(s) + 1 :].isdigit() for s in SCHEDULES):
            schedule, _, count = part.partition("x")
            fields.update(schedule=schedule, microbatches=int(count))
        elif sep and name in _KEYS and value.isdigit() and int(value) >= 1:
            sizes[_KEYS[name]] = int(value)
            order.append(_KEYS[name])
        else:
            raise ValueError(
                f"layout {text!r}: cannot read {part!r}; write mesh dims as dp=, fsdp=, cp=, tp=, pp= (outermost "
                f"first) and options sp, ac=none|selective|full, accum=N, 1F1BxN or GPipexN"
            )
    rest = tuple(dim for dim in MESH_DIMS if dim not in order)
    return Layout(**sizes, **fields, order=(*order, *rest))  # type: ignore[arg-type]


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def factorizations(world: int, parts: int) -> list[tuple[int, ...]]:
    """Every way to write ``world`` as an ordered product of ``parts`` positive integers."""
    if parts == 1:
        return [(world,)]
    return [(d, *rest) for d in divisors(world) for rest in factorizations(world // d, parts - 1)]


def groups_share_node(layout: Layout, dims: tuple[str, ...], ranks_per_node: int) -> bool:
    """Whether the group of rank 0 over ``dims`` lies inside one node (ranks numbered row-major in ``order``)."""
    stride, last = 1, 0
    for dim in reversed(layout.order):
        size = layout.size(dim)
        if dim in dims:
            last += (size - 1) * stride
        stride *= size
    return last < ranks_per_node


def mesh_orders(layout: Layout) -> list[tuple[str, ...]]:
    """The mesh orders that differ for this layout: permutations of its dims bigger than one."""
    used = [dim for dim in MESH_DIMS if layout.size(dim) > 1]
    rest = tuple(dim for dim in MESH_DIMS if layout.size(dim) == 1)
    return [(*order, *rest) for order in itertools.permutations(used)] or [MESH_DIMS]
