"""Fully sharded data parallelism (ZeRO-3) on DTensors: torch's FSDP2 ``fully_shard``, composable with TP.

>>> world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))  # doctest: +SKIP
>>> parallelize_module(model, world["tp"], plan)  # doctest: +SKIP
>>> for block in model.layers:  # doctest: +SKIP
...     fully_shard(block, mesh=world["dp"])
>>> fully_shard(model, mesh=world["dp"])  # doctest: +SKIP

Modules, one job each::

  policy.py  MixedPrecisionPolicy, OffloadPolicy, DataParallelMeshDims: the options, as torch spells them
  layout.py  which tensor dim dp shards (FSDP2's dim 0; shard_first_free_dim: spmd's former choice),
             and turning parameters into sharded DTensors
  flat.py    one all_gather (and, in backward, one reduce_scatter) for all of a group's shards
  state.py   gather before forward/backward, free after forward, shadow the shards meanwhile; TrainingState
  module.py  FSDPModule: the class a sharded module becomes, and its methods
  api.py     fully_shard: which parameters a module owns, and the hooks
"""

from spmd.fsdp.api import fully_shard
from spmd.fsdp.layout import ShardedParameter, dp_shard_dim, shard_first_free_dim
from spmd.fsdp.module import (
    FSDPModule,
    UnshardHandle,
    fully_shard_state,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from spmd.fsdp.policy import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy
from spmd.fsdp.state import FullyShardState

__all__ = [
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "FullyShardState",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ShardedParameter",
    "UnshardHandle",
    "dp_shard_dim",
    "fully_shard",
    "fully_shard_state",
    "register_fsdp_forward_method",
    "shard_first_free_dim",
    "share_comm_ctx",
]
