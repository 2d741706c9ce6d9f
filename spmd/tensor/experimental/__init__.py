"""spmd.tensor.experimental: torch.distributed.tensor.experimental's API.

* ``local_map(func, out_placements, in_placements, ...)`` -- run a plain-tensor function on each
  rank's shards and wrap its results as DTensors.
* ``register_sharding(op)`` -- a decorator giving an op the sharding strategies a user chooses.
* ``implicit_replication()`` -- plain tensors mixed with DTensors count as replicated.

torch's ``context_parallel`` (ring attention over a sharded sequence dim) is not offered.
"""

from spmd.tensor.dtensor import implicit_replication
from spmd.tensor.experimental._local_map import local_map
from spmd.tensor.experimental._register_sharding import register_sharding

__all__ = ["implicit_replication", "local_map", "register_sharding"]
