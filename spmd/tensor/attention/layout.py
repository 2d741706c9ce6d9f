"""Which global sequence rows each rank holds when a DTensor says ``Shard(seq)``, and the switch that says so.

A ``Shard(seq)`` piece is normally one contiguous run of rows (``torch.chunk``'s cut). Context
parallel lays causal attention's rows out head-tail instead, so that every rank does the same work:
the sequence is cut into ``2n`` chunks and rank ``i`` holds chunk ``i`` and chunk ``2n-1-i``, in
that order. The DTensor still says ``Shard(seq)`` (as on torch), so the layout is a switch that the
context-parallel API turns on (``_enable_context_parallel_dispatcher``, ``context_parallel``) and
that ring attention reads to find each row's global position, which the causal mask needs.

Uneven lengths: rank ``r`` holds ``shard_sizes(S, n)[r]`` rows either way (so ``Shard``'s local
sizes stay right); head-tail splits them into a head of ``ceil(s/2)`` and a tail of the rest, the
heads in rank order at the front of the sequence, the tails in reverse rank order behind them.
For ``S`` divisible by ``2n`` this is torch's head-tail layout exactly.

The switch is per thread: rank threads of one process each turn it on and off for themselves, and
autograd runs a CPU backward on the thread that called it.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import torch

from spmd.tensor.placement import shard_offsets, shard_sizes

__all__ = [
    "RowBlock",
    "rank_rows",
    "gather_order",
    "load_balanced",
    "set_load_balanced",
    "rotate_method",
    "set_rotate_method_name",
]


@dataclass(frozen=True, slots=True)
class RowBlock:
    """A run of global rows ``[start, start + length)`` held contiguously at ``local_start`` of a piece."""

    start: int
    length: int
    local_start: int


@functools.lru_cache(maxsize=256)
def rank_rows(size: int, n: int, balanced: bool) -> tuple[tuple[RowBlock, ...], ...]:
    """The row blocks each of ``n`` ranks holds of a ``size``-long sequence, in local order.

    >>> [[(b.start, b.length) for b in r] for r in rank_rows(8, 2, True)]
    [[(0, 2), (6, 2)], [(2, 2), (4, 2)]]
    """
    sizes = shard_sizes(size, n)
    if not balanced:
        return tuple((RowBlock(o, s, 0),) for o, s in zip(shard_offsets(size, n), sizes))
    heads = [(s + 1) // 2 for s in sizes]
    tails = [s - h for s, h in zip(sizes, heads)]
    head_end = sum(heads)
    per_rank = []
    for r in range(n):
        head_start = sum(heads[:r])
        tail_start = head_end + sum(tails[r + 1 :])
        per_rank.append((RowBlock(head_start, heads[r], 0), RowBlock(tail_start, tails[r], heads[r])))
    return tuple(per_rank)


@functools.lru_cache(maxsize=256)
def gather_order(size: int, n: int, balanced: bool) -> torch.Tensor:
    """Global row index of each row of the ranks' pieces laid end to end in rank order.

    ``full.index_select(seq, gather_order(...))`` lays a whole sequence out as the ranks hold it;
    ``argsort`` of it puts gathered pieces back in global order.
    """
    rows = [torch.arange(b.start, b.start + b.length) for blocks in rank_rows(size, n, balanced) for b in blocks]
    return torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)


class _LayoutState(threading.local):
    """Per-thread: whether ``Shard(seq)`` pieces are head-tail, and torch's rotate method name."""

    def __init__(self) -> None:
        self.balanced = False
        self.rotate = "allgather"


_STATE = _LayoutState()


def load_balanced() -> bool:
    """Whether sequence-sharded attention reads ``Shard(seq)`` pieces as head-tail on this thread."""
    return _STATE.balanced


def set_load_balanced(balanced: bool) -> None:
    _STATE.balanced = balanced


def rotate_method() -> str:
    """The rotate method named with ``set_rotate_method`` ("allgather" or "alltoall") on this thread."""
    return _STATE.rotate


def set_rotate_method_name(method: str) -> None:
    _STATE.rotate = method
