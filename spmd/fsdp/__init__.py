"""Fully sharded data parallelism (ZeRO-3) on DTensors: ``fully_shard``, composable with tensor parallelism.

>>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))  # doctest: +SKIP
>>> parallelize_module(model, mesh, plan)  # tp layouts on the "tp" dim  # doctest: +SKIP
>>> for block in model.layers:  # doctest: +SKIP
...     fully_shard(block, mesh)  # shard over the "dp" dim
>>> fully_shard(model, mesh)  # doctest: +SKIP

Modules, one job each::

  layout.py  which tensor dim the dp mesh dim shards, and turning parameters into sharded DTensors
  flat.py    one all_gather (and, in backward, one reduce_scatter) for all of a module's shards
  state.py   gather before forward/backward, free after forward
  api.py     fully_shard: which parameters a module owns, and the hooks
"""

from spmd.fsdp.api import fully_shard, fully_shard_state
from spmd.fsdp.layout import ShardedParameter, dp_shard_dim
from spmd.fsdp.state import FullyShardState

__all__ = ["fully_shard", "fully_shard_state", "FullyShardState", "ShardedParameter", "dp_shard_dim"]
