"""fully_shard's options as torch's FSDP2 spells them: mixed precision, offloading, data-parallel mesh dims."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CPUOffloadPolicy", "DataParallelMeshDims", "MixedPrecisionPolicy", "OffloadPolicy"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Which dtypes a fully_shard'ed module computes and reduces in; the sharded parameters keep theirs.

    >>> policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    """

    param_dtype: torch.dtype | None = None
    """The gathered copies' dtype (the shards are cast before the all_gather); None: the parameters'."""
    reduce_dtype: torch.dtype | None = None
    """The gradient reduce_scatter's dtype; None: ``param_dtype`` (or the parameters' dtype)."""
    output_dtype: torch.dtype | None = None
    """Floating-point outputs of the module's forward are cast to it; None: left as they are."""
    cast_forward_inputs: bool = True
    """Cast floating-point forward inputs to ``param_dtype`` (when it is set)."""


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: the shards stay on the mesh's device (FSDP2's default)."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep the shards, their gradients and the optimizer state on the CPU.

    Accepted for torch compatibility. Parameters on the CPU are already there, so on a CPU mesh it
    changes nothing; on an accelerator mesh fully_shard raises rather than silently not offload.
    """

    pin_memory: bool = True
    """Pin the CPU shards (meaningful only with an accelerator)."""


@dataclass(frozen=True)
class DataParallelMeshDims:
    """Which dims of the n-d mesh passed to fully_shard are data parallel (torch 2.13's SPMD-mesh form).

    ``fully_shard(block, mesh=world_mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))`` shards
    over the ``"dp"`` dim of a mesh whose other dims the parameters are already laid out on.
    """

    shard: str | tuple[str, ...] | None = None
    """The dim fully_shard shards over (one name; spmd does not flatten several)."""
    replicate: str | tuple[str, ...] | None = None
    """HSDP's replicate dim: not supported by spmd (fully_shard raises)."""
