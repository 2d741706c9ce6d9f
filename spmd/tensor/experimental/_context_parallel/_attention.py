"""torch's context-parallel API (``torch.distributed.tensor.experimental._context_parallel._attention``) on spmd.

The attention itself is a decision of spmd's engine: ``scaled_dot_product_attention`` on query, key
and value DTensors sharded along the sequence is exact context-parallel attention whenever it is
called (spmd/tensor/attention/ring.py). What this module adds is torch's way in:

- ``_context_parallel_shard`` / ``context_parallel_unshard``: cut buffers into the ranks' sequence
  pieces (head-tail with a load balancer) and gather them back;
- ``_enable_context_parallel_dispatcher``: sequence-sharded DTensors' rows are read as head-tail
  (torch's default with load balancing on) until ``_disable_context_parallel_dispatcher``;
- ``context_parallel(mesh, buffers=...)``: shards the buffers in place, and while open makes
  ``F.scaled_dot_product_attention`` on plain tensors (a module that knows nothing of DTensor)
  context-parallel: q, k, v are read as this rank's rows of a ``Shard(2)`` DTensor;
- ``set_rotate_method`` and ``flex_cp_allgather`` under torch's names.

The dispatcher switch and the function mode are per thread, so rank threads each open their own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from spmd.tensor.attention.layout import load_balanced, set_load_balanced, set_rotate_method_name
from spmd.tensor.device_mesh.mesh import DeviceMesh
from spmd.tensor.dtensor import DTensor
from spmd.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer, _LoadBalancer
from spmd.tensor.placement import Shard, shard_offsets, shard_sizes
from spmd.tensor.redistribute.collectives import agree, all_gather_dim

__all__ = [
    "context_parallel",
    "context_parallel_unshard",
    "set_rotate_method",
    "_context_parallel_shard",
    "_enable_context_parallel_dispatcher",
    "_disable_context_parallel_dispatcher",
    "flex_cp_allgather",
]

_SEQ_DIM = 2
"""The sequence dim of SDPA's (batch, heads, seq, head_dim) operands."""


def _cp_mesh_check(mesh: DeviceMesh) -> None:
    if mesh.ndim != 1:
        raise ValueError(f"context parallel takes a 1-d mesh (the cp dim, e.g. mesh['cp']); got {mesh!r}")


def _rearranged(buffer: torch.Tensor, seq_dim: int, indices: torch.Tensor) -> torch.Tensor:
    """``buffer`` with its sequence rows taken in ``indices``' order (one row of indices per batch entry, or one for all)."""
    if indices.size(0) == 1:
        return buffer.index_select(seq_dim, indices[0].to(buffer.device))
    if seq_dim == 0 or indices.size(0) != buffer.size(0):
        raise ValueError(
            f"per-batch load-balance indices {tuple(indices.shape)} need the batch on dim 0 of a buffer "
            f"of shape {tuple(buffer.shape)} and a sequence dim after it"
        )
    return torch.stack([b.index_select(seq_dim - 1, i.to(b.device)) for b, i in zip(buffer, indices)])


def _context_parallel_shard(
    mesh: DeviceMesh, buffers: Sequence[torch.Tensor], seq_dims: Sequence[int], load_balancer: _LoadBalancer | None = None
) -> list[torch.Tensor]:
    """This rank's piece of each buffer along its sequence dim, rearranged by ``load_balancer`` first.

    Pieces follow ``torch.chunk``'s cut of the (rearranged) sequence, so a length not divisible by
    the cp size gives uneven pieces, as ``Shard`` does.
    """
    _cp_mesh_check(mesh)
    if len(buffers) != len(seq_dims):
        raise ValueError(f"{len(buffers)} buffers but {len(seq_dims)} seq_dims; give one seq dim per buffer")
    indices = load_balancer._generate_indices() if load_balancer is not None else None
    n, rank = mesh.size(), mesh.get_local_rank()
    pieces = []
    for buffer, dim in zip(buffers, seq_dims):
        if not isinstance(buffer, torch.Tensor):
            raise NotImplementedError(f"spmd's context parallel shards tensors only, not {type(buffer).__name__}")
        whole = buffer if indices is None else _rearranged(buffer, dim, indices)
        size = whole.size(dim)
        pieces.append(whole.narrow(dim, shard_offsets(size, n)[rank], shard_sizes(size, n)[rank]))
    return pieces


@torch.no_grad()
def context_parallel_unshard(
    mesh: DeviceMesh, buffers: list[torch.Tensor], seq_dims: list[int], load_balancer: _LoadBalancer | None = None
) -> list[torch.Tensor]:
    """The whole of each buffer sharded by context parallel, in the original order.

    Without ``load_balancer`` the buffers are read as laid out by the context's default: head-tail
    while load balancing is on (torch's default), else contiguous.
    """
    _cp_mesh_check(mesh)
    comm = mesh.get_communicator(0)
    lengths = agree(mesh, [0], [b.size(d) for b, d in zip(buffers, seq_dims)])
    whole = []
    for i, (buffer, dim) in enumerate(zip(buffers, seq_dims)):
        size = sum(rank_lengths[i] for rank_lengths in lengths)
        gathered = all_gather_dim(buffer.contiguous(), comm, dim, size)
        balancer = load_balancer if load_balancer is not None else _HeadTailLoadBalancer(size, mesh.size(), buffer.device)
        restore = balancer._generate_indices(restore=True)
        whole.append(gathered if restore is None else _rearranged(gathered, dim, restore))
    return whole


def _enable_context_parallel_dispatcher() -> None:
    """From now on (on this thread) sequence-sharded DTensors' rows are read as head-tail by attention.

    Attention on ``Shard(seq)`` query, key and value is context-parallel with or without this; the
    switch says which rows each rank holds, as torch's load balancing does.
    """
    set_load_balanced(True)


def _disable_context_parallel_dispatcher() -> None:
    """Sequence-sharded DTensors' rows are contiguous pieces again (on this thread)."""
    set_load_balanced(False)


def set_rotate_method(rotate_method: str) -> None:
    """torch's choice of how key/value blocks travel: ``"allgather"`` or ``"alltoall"``.

    spmd gathers them in both cases: a ring moves the same bytes, and spmd's collectives have no
    point-to-point step; ``SPMD_DEBUG=verbose`` names the method asked and what ran.
    """
    if rotate_method not in ("allgather", "alltoall"):
        raise NotImplementedError(
            f"set_rotate_method({rotate_method!r}): key/value blocks travel by 'allgather' or 'alltoall' only"
        )
    set_rotate_method_name(rotate_method)


class _ShardedAttention(TorchFunctionMode):
    """While ``context_parallel`` is open: ``F.scaled_dot_product_attention`` on plain tensors reads
    them as this rank's rows of ``Shard(2)`` DTensors on the cp mesh and returns this rank's rows."""

    def __init__(self, mesh: DeviceMesh, seq_length: int) -> None:
        super().__init__()
        self.mesh = mesh
        self.seq_length = seq_length
        """The buffers' global sequence length (the global length of an uneven piece)."""

    def _as_dtensor(self, local: torch.Tensor) -> DTensor:
        n, rank = self.mesh.size(), self.mesh.get_local_rank()
        shape = list(local.shape)
        # a piece of the buffers' length is read as theirs (uneven too); any other as an even piece
        of_buffers = shard_sizes(self.seq_length, n)[rank] == local.size(_SEQ_DIM)
        shape[_SEQ_DIM] = self.seq_length if of_buffers else local.size(_SEQ_DIM) * n
        return DTensor.from_local(local, self.mesh, [Shard(_SEQ_DIM)], run_check=False, shape=shape)

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        if any(isinstance(t, DTensor) for t in (q, k, v)):
            return func(*args, **kwargs)
        out = func(*(self._as_dtensor(t) for t in (q, k, v)), *args[3:], **kwargs)
        return out.to_local()


@contextlib.contextmanager
def context_parallel(
    mesh: DeviceMesh, *, buffers: list[torch.Tensor] | None = None, buffer_seq_dims: list[int] | None = None,
    no_restore_buffers: set[torch.Tensor] | None = None,
) -> Iterator[None]:  # fmt: skip
    """Shard ``buffers`` in place along their sequence dims (head-tail) and make attention context-parallel.

    While open, ``F.scaled_dot_product_attention`` on plain tensors of shape (batch, heads, seq,
    head_dim) holding this rank's rows computes exact attention over the whole sequence, and so
    does attention on ``Shard(2)`` DTensors. On exit each buffer not in ``no_restore_buffers`` gets
    its whole original value back.

    >>> with context_parallel(mesh, buffers=[tokens, labels], buffer_seq_dims=[1, 1]):  # doctest: +SKIP
    ...     loss = model(tokens, labels)
    """
    _cp_mesh_check(mesh)
    buffers = [] if buffers is None else buffers
    seq_dims = [] if buffer_seq_dims is None else buffer_seq_dims
    keep = set() if no_restore_buffers is None else no_restore_buffers
    if len(buffers) != len(seq_dims):
        raise ValueError("`seq_dims` must have the same number of elements as `buffers`.")
    if not all(any(b is buffer for b in buffers) for buffer in keep):
        raise ValueError("`no_restore_buffers` must be a subset of `buffers`.")
    originals = [None if any(b is k for k in keep) else b.clone() for b in buffers]
    seq_length = buffers[0].size(seq_dims[0]) if buffers else 0
    balancer = _HeadTailLoadBalancer(seq_length, mesh.size(), mesh.device_type)
    with torch.no_grad():
        for buffer, piece in zip(buffers, _context_parallel_shard(mesh, buffers, seq_dims, balancer)):
            piece = piece.clone()
            buffer.resize_(piece.shape)
            buffer.copy_(piece)
    was_balanced = load_balanced()
    set_load_balanced(True)
    try:
        with _ShardedAttention(mesh, seq_length):
            yield
    finally:
        set_load_balanced(was_balanced)
        with torch.no_grad():
            for buffer, original in zip(buffers, originals):
                if original is not None:
                    buffer.resize_(original.shape)
                    buffer.copy_(original)


def _waited(tensor: torch.Tensor) -> torch.Tensor:
    """A functional collective's result once it has arrived."""
    wait = getattr(tensor, "wait", None)
    return wait() if wait is not None else tensor


class _GatherKeysValues(torch.autograd.Function):
    """k, v gathered along ``seq_dim`` over a c10d group; backward sums their gradients back to the owners."""

    @staticmethod
    def forward(ctx: Any, k: torch.Tensor, v: torch.Tensor, seq_dim: int, group_name: str) -> Any:
        ctx.seq_dim, ctx.group_name = seq_dim, group_name
        group: Any = group_name  # c10d's GroupName is a str
        return tuple(_waited(funcol.all_gather_tensor(t.contiguous(), seq_dim, group)) for t in (k, v))

    @staticmethod
    def backward(ctx: Any, grad_k: torch.Tensor, grad_v: torch.Tensor) -> Any:
        grads = [_waited(funcol.reduce_scatter_tensor(g.contiguous(), "sum", ctx.seq_dim, ctx.group_name))
                 for g in (grad_k, grad_v)]  # fmt: skip
        return grads[0], grads[1], None, None


def flex_cp_allgather(
    k: torch.Tensor, v: torch.Tensor, seq_dim: int, pg_name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's k and v pieces joined along ``seq_dim`` over the process group named ``pg_name``
    (differentiable: the gradients are reduce-scattered back), as torch's custom op does for
    FlexAttention's context parallel. Pieces must be even."""
    gathered = _GatherKeysValues.apply(k, v, seq_dim, pg_name)  # type: ignore[no-untyped-call]
    return gathered[0], gathered[1]
