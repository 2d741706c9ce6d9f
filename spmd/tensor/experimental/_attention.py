"""torch's ``torch.distributed.tensor.experimental._attention``: context parallel's names, kept at
this path as torch keeps them (they live in ``_context_parallel``)."""

from spmd.tensor.experimental._context_parallel._attention import (
    _context_parallel_shard,
    _disable_context_parallel_dispatcher,
    _enable_context_parallel_dispatcher,
    context_parallel,
    context_parallel_unshard,
    set_rotate_method,
)
from spmd.tensor.experimental._context_parallel._load_balancer import (
    _HeadTailLoadBalancer,
    _LoadBalancer,
    _PTRRLoadBalancer,
)

__all__ = [
    "_context_parallel_shard",
    "_disable_context_parallel_dispatcher",
    "_enable_context_parallel_dispatcher",
    "context_parallel",
    "context_parallel_unshard",
    "set_rotate_method",
    "_HeadTailLoadBalancer",
    "_LoadBalancer",
    "_PTRRLoadBalancer",
]
