"""Running aten ops on DTensors.

- ``dispatcher``: the op loop (unwrap and key, look up or decide, move inputs, run local, wrap);
- ``keys``: unwrapping a call into its DTensor leaves and its decision-cache key;
- ``list_ops``: ops over lists of DTensors (``_foreach_*``, fused optimizers), one decision per list;
- ``list_by_mesh``: list ops whose tensors live on several meshes, run once per mesh.
"""

from spmd.tensor.dispatch.dispatcher import DISPATCHER, Dispatcher, dispatch, implicit_replication, replicate_fallback

__all__ = ["dispatch", "Dispatcher", "DISPATCHER", "implicit_replication", "replicate_fallback"]
