"""Op families; importing this package registers every rule in the one registry."""

from spmd.tensor.ops import (  # noqa: F401  (registration side effect)
    complex_ops,
    fft_ops,
    foreach,
    indexing,
    losses,
    matrix,
    nn,
    norms,
    optim,
    pointwise,
    pooling,
    products,
    random_ops,
    reductions,
    reductions_scan,
    scatter_ops,
    search_ops,
    shape_ops,
    sort_ops,
    tensor_ops,
    views,
    whole_ops,
)
from spmd.tensor.sharding.registry import REGISTRY, register_rule
from spmd.tensor.sharding.vocabulary import OpCall, OpStrategy

__all__ = ["REGISTRY", "OpCall", "OpStrategy", "register_rule"]
