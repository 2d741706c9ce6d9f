"""The cluster a plan is for: world size, ranks per node, links, peak FLOP/s and memory per rank."""

from __future__ import annotations

from dataclasses import dataclass, field

from spmd.simulate.plan import Link, Links

__all__ = ["Cluster", "Workload"]


@dataclass(frozen=True, slots=True)
class Cluster:
    """What the search plans for. The defaults are an H100 node: 8 ranks on NVLink, 50 GB/s between nodes."""

    world: int
    memory: int = 80 * 2**30
    """Bytes each rank may hold at its peak."""
    ranks_per_node: int = 8
    peak_flops: float = 989e12
    """Dense FLOP/s of one rank at the model's dtype (an H100's bf16)."""
    memory_bandwidth: float | None = None
    """Bytes per second one rank's memory-bound ops (norms, activations, adds, the optimizer's updates)
    read and write; None leaves them unpriced (the step is FLOP-bound: on GPUs fused kernels keep
    them small next to the products). The validation on CPU gives the measured figure."""
    links: Links = field(default_factory=Links)
    compute_efficiency: float = 1.0
    """The share of ``peak_flops`` the kernels reach (1.0: the FLOP bound itself)."""
    overlap: bool = True
    """Data-parallel collectives run beside compute (GPU streams). False where a collective blocks
    the rank until it ends (gloo on CPU): every collective's time then adds to the step."""

    @property
    def flops(self) -> float:
        return self.peak_flops * self.compute_efficiency

    def link(self, intra_node: bool) -> Link:
        return self.links.intra if intra_node else self.links.inter


@dataclass(frozen=True, slots=True)
class Workload:
    """The training step being planned: sequences per step (the global batch) of ``seq`` tokens."""

    global_batch: int
    seq: int
