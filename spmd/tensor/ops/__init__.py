"""Op families; importing this package registers every rule in the one registry."""

from spmd.tensor.ops import matrix, pointwise, reductions, tensor_ops, views  # noqa: F401  (registration side effect)
from spmd.tensor.ops.registry import REGISTRY, OpCall, OpStrategy, register_rule

__all__ = ["REGISTRY", "OpCall", "OpStrategy", "register_rule"]
