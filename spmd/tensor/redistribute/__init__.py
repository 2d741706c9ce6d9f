"""Redistribute: any placements to any placements on any mesh.

- ``plan``: the steps from one set of placements to another, and what a move costs;
- ``run``: running a plan on this rank's shard, and the differentiable ``Redistribute``;
- ``collectives``: the executor, every collective the library issues;
- ``cost``: the ring model, the one cost model (bytes a rank receives, seconds) every part reads.
"""

from spmd.tensor.redistribute.cost import collective_bytes, collective_seconds
from spmd.tensor.redistribute.plan import FlattenedStep, TransformStep, moves_data, plan_redistribute, redistribute_cost
from spmd.tensor.redistribute.run import Redistribute, redistribute_local

__all__ = ["plan_redistribute", "redistribute_cost", "moves_data", "TransformStep", "FlattenedStep"]
__all__ += ["redistribute_local", "Redistribute", "collective_bytes", "collective_seconds"]
