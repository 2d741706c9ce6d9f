"""What the user asks to simulate: a plan (mesh dims, FSDP, sequence parallel) and the links between ranks.

Both parse from the command line's short strings and refuse bad input with a message naming it:

>>> parse_plan("dp=256,tp=8,fsdp")
Plan(mesh=(('dp', 256), ('tp', 8)), fsdp=True, sequence_parallel=False)
>>> parse_plan("dp=4096").mesh_shape  # a dim left out has size 1
(4096, 1)
>>> parse_links("intra=450GB/s,inter=50GB/s@10us").inter
Link(bandwidth=50000000000.0, latency=1e-05)
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

__all__ = ["Plan", "Link", "Links", "parse_plan", "parse_links", "MESH_DIMS"]

MESH_DIMS = ("dp", "tp")
"""The mesh dims the built-in models know, outermost first: data parallel, tensor parallel."""
_FLAGS = {"fsdp": "fsdp", "sp": "sequence_parallel", "sequence-parallel": "sequence_parallel"}


@dataclass(frozen=True, slots=True)
class Plan:
    """A parallelism plan: the mesh (named dims, outermost first) and the optional techniques."""

    mesh: tuple[tuple[str, int], ...]
    """(name, size) per mesh dim, outermost first, every dim of ``MESH_DIMS`` (1 when not used)."""
    fsdp: bool = False
    """Shard parameters, gradients and optimizer state over dp (ZeRO-3) instead of replicating them."""
    sequence_parallel: bool = False
    """Run the norms on activations sharded over tp on the sequence dim."""

    @property
    def world_size(self) -> int:
        return math.prod(size for _, size in self.mesh)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.mesh)

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.mesh)

    def size(self, name: str) -> int:
        """The size of mesh dim ``name``, 1 if the plan has no such dim."""
        return dict(self.mesh).get(name, 1)

    def __str__(self) -> str:
        parts = [f"{name}={size}" for name, size in self.mesh if size > 1] or [f"{MESH_DIMS[0]}=1"]
        parts += [flag for flag, on in (("fsdp", self.fsdp), ("sp", self.sequence_parallel)) if on]
        return ",".join(parts)


def parse_plan(text: str, *, fsdp: bool = False, sequence_parallel: bool = False) -> Plan:
    """``"dp=512,tp=8"``, ``"dp=256,tp=8,fsdp"`` or ``"dp=64,tp=8,sp"``; the flags add to the keywords."""
    mesh: list[tuple[str, int]] = []
    flags = {"fsdp": fsdp, "sequence_parallel": sequence_parallel}
    for part in (p.strip() for p in text.split(",")):
        if part in _FLAGS:
            flags[_FLAGS[part]] = True
            continue
        name, sep, size_text = part.partition("=")
        name = name.strip()
        if not sep or name not in MESH_DIMS:
            raise ValueError(
                f"plan {text!r}: cannot read {part!r}; write mesh dims as name=size with names from {MESH_DIMS} "
                f"(outermost first), plus optional flags {sorted(_FLAGS)}, e.g. 'dp=256,tp=8,fsdp'"
            )
        if not size_text.strip().isdigit() or int(size_text) < 1:
            raise ValueError(
                f"plan {text!r}: the size of mesh dim {name!r} must be a positive integer, got {size_text!r}"
            )
        if any(name == seen for seen, _ in mesh):
            raise ValueError(f"plan {text!r}: mesh dim {name!r} is given twice")
        mesh.append((name, int(size_text)))
    if not mesh:
        raise ValueError(f"plan {text!r} has no mesh dims; write e.g. 'dp=512,tp=8'")
    order = [MESH_DIMS.index(name) for name, _ in mesh]
    if order != sorted(order):
        raise ValueError(f"plan {text!r}: list the mesh dims outermost first, in the order {MESH_DIMS}")
    given = dict(mesh)
    plan = Plan(
        tuple((name, given.get(name, 1)) for name in MESH_DIMS),
        fsdp=flags["fsdp"],
        sequence_parallel=flags["sequence_parallel"],
    )
    if plan.fsdp and plan.size("dp") == 1:
        raise ValueError(f"plan {text!r}: fsdp shards over the dp mesh dim; add one, e.g. 'dp=8,{text}'")
    if plan.sequence_parallel and plan.size("tp") == 1:
        raise ValueError(f"plan {text!r}: sequence parallelism shards over the tp mesh dim; add one, e.g. 'tp=8'")
    return plan


@dataclass(frozen=True, slots=True)
class Link:
    """One kind of link: bytes per second each way, and the latency of one step of a ring."""

    bandwidth: float
    latency: float = 0.0


@dataclass(frozen=True, slots=True)
class Links:
    """Links inside a node (``intra``) and between nodes (``inter``); a group is intra when its ranks share a node."""

    intra: Link = field(default_factory=lambda: Link(450e9, 3e-6))
    inter: Link = field(default_factory=lambda: Link(50e9, 10e-6))
    ranks_per_node: int = 8

    def link_for(self, ranks: tuple[int, ...]) -> Link:
        """The link a collective over ``ranks`` runs on (ranks are numbered node by node)."""
        node = self.ranks_per_node
        return self.intra if min(ranks) // node == max(ranks) // node else self.inter


_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}
_TIMES = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_BANDWIDTH = re.compile(r"^([0-9]*\.?[0-9]+)\s*([kKmMgGtT]i?)?B/s$")
_LATENCY = re.compile(r"^([0-9]*\.?[0-9]+)\s*(s|ms|us|ns)$", re.IGNORECASE)


def _parse_link(text: str, where: str, default: Link) -> Link:
    bandwidth_text, _, latency_text = text.partition("@")
    match = _BANDWIDTH.match(bandwidth_text.strip())
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(
            f"--link {where}: cannot read the bandwidth {bandwidth_text!r}; write bytes per second such as "
            "'450GB/s' or '25GiB/s' (B is bytes), optionally with a latency: '50GB/s@10us'"
        )
    bandwidth = float(match.group(1)) * _UNITS[(match.group(2) or "").lower()]
    latency = default.latency
    if latency_text:
        lat = _LATENCY.match(latency_text.strip())
        if lat is None:
            raise ValueError(f"--link {where}: cannot read the latency {latency_text!r}; write e.g. '5us', '1.5ms'")
        latency = float(lat.group(1)) * _TIMES[lat.group(2).lower()]
    return Link(bandwidth, latency)


def parse_links(text: str, *, ranks_per_node: int = 8) -> Links:
    """``"intra=450GB/s,inter=50GB/s"``, each optionally ``@latency`` (``50GB/s@10us``).

    A kind left out keeps its default (intra 450GB/s@3us, inter 50GB/s@10us); a bandwidth without
    a latency keeps the default latency of its kind.
    """
    if ranks_per_node < 1:
        raise ValueError(f"ranks per node must be at least 1, got {ranks_per_node}")
    links = Links(ranks_per_node=ranks_per_node)
    given: dict[str, Link] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        kind, sep, value = part.partition("=")
        kind = kind.strip()
        if not sep or kind not in ("intra", "inter"):
            raise ValueError(f"--link {text!r}: cannot read {part!r}; write 'intra=450GB/s,inter=50GB/s'")
        given[kind] = _parse_link(value, part, getattr(links, kind))
    return Links(given.get("intra", links.intra), given.get("inter", links.inter), ranks_per_node)
