"""spmd.tensor.experimental: torch.distributed.tensor.experimental's API.

* ``local_map(func, out_placements, in_placements, ...)`` -- run a plain-tensor function on each
  rank's shards and wrap its results as DTensors.
* ``register_sharding(op)`` -- a decorator giving an op the sharding strategies a user chooses.
* ``implicit_replication()`` -- plain tensors mixed with DTensors count as replicated.
* ``context_parallel(mesh, buffers=..., buffer_seq_dims=...)`` -- shard buffers along the sequence
  and make attention context-parallel while open (docs/context_parallel.md).
"""

from spmd.tensor.dtensor import implicit_replication
from spmd.tensor.experimental._context_parallel._attention import context_parallel
from spmd.tensor.experimental._local_map import local_map
from spmd.tensor.experimental._register_sharding import register_sharding

__all__ = ["context_parallel", "implicit_replication", "local_map", "register_sharding"]
