"""spmd.tensor: distributed tensors over an n-d device mesh (the ``torch.distributed.tensor`` API)."""

from spmd.compile.lazy import from_local_in_graph
from spmd.hooks import install as install_hooks
from spmd.tensor import (
    api,
    debug,  # noqa: F401  (applies SPMD_DEBUG / SPMD_DEBUG_RANKS from the environment)
    ops,  # noqa: F401  (registers every sharding rule)
    serialization,  # noqa: F401  (lets torch.load(weights_only=True) rebuild DTensors)
)
from spmd.tensor.api import distribute_module, distribute_tensor, empty, full, ones, rand, randn, zeros
from spmd.tensor.debug.check import COLLECTIVE_CHECK
from spmd.tensor.device_mesh import DeviceMesh, init_device_mesh
from spmd.tensor.dispatch import DISPATCHER
from spmd.tensor.dtensor import DTensor
from spmd.tensor.placement import Partial, Placement, Replicate, Shard
from spmd.tensor.torch_objects import MixedDTensorLibrariesError

# The one place late-bound hooks are filled (spmd/hooks.py says which and why).
_shard_tensor = api._shard_tensor
"""torch's private ``_api._shard_tensor``: the redirect maps torch's ``_api`` module to this package whole."""

install_hooks(dispatch=DISPATCHER.dispatch, collective_check=COLLECTIVE_CHECK, from_local_in_graph=from_local_in_graph)

__all__ = [
    "DTensor",
    "DeviceMesh",
    "init_device_mesh",
    "Shard",
    "Replicate",
    "Partial",
    "Placement",
    "distribute_tensor",
    "distribute_module",
    "zeros",
    "ones",
    "empty",
    "full",
    "rand",
    "randn",
    "MixedDTensorLibrariesError",
]
