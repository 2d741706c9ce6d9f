"""Exact attention on query, key and value sharded along the sequence (context parallel), forward and backward.

The ``local_impl`` of the CPU flash-attention ops (``_scaled_dot_product_flash_attention_for_cpu``
and its backward) when the sharding rule chose ``q, k, v S(seq) -> out, lse S(seq)`` on a mesh dim:

- forward: every rank gathers the other ranks' key and value rows over that mesh dim (one
  all-gather of ``k`` and ``v`` laid side by side), puts them in global order, and attends its own
  query rows block by block: for a block of query rows starting at global row ``a``, keys
  ``[0, a)`` without a mask and keys ``[a, a + len)`` with the causal mask (one call over all keys
  when not causal). The blocks' partial results merge by log-sum-exp:
  ``lse = logaddexp(lse1, lse2)``, ``out = out1 * exp(lse1 - lse) + out2 * exp(lse2 - lse)``;
- backward: the same blocks, each through the flash backward kernel given the merged ``out`` and
  ``lse`` (so each block's probabilities are the global ones and the block's gradients are exact
  contributions); ``dq`` sums over blocks, and ``dk``/``dv`` for the whole sequence are summed back
  to the ranks that own their rows (one reduce-scatter).

Why gather instead of passing blocks around a ring: spmd's collectives have no point-to-point
step, and a ring moves the same bytes. Every rank must see every key/value row it does not hold
once, ``(n-1)/n`` of ``k`` and ``v``, which is what the all-gather receives (uneven pieces travel
padded to the longest); the backward adds the same for ``dk``/``dv``. The ring's gain is memory
(one block of keys at a time instead of the whole sequence, transiently), and on GPUs the overlap
of each step with compute, which a CPU world does not have.

Each query row's global position comes from the sequence layout (``layout.py``): contiguous
``Shard`` pieces, or head-tail while context parallel is on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from spmd.comm import Communicator
from spmd.tensor.attention.layout import RowBlock, gather_order, load_balanced, rank_rows, rotate_method
from spmd.tensor.placement import Shard, shard_sizes
from spmd.tensor.redistribute.collectives import all_gather_dim, reduce_scatter_dim
from spmd.tensor.sharding.vocabulary import ShardingError
from spmd.tensor.spec import DTensorSpec
from spmd.tensor.trace import STATE, human_bytes, log_line

__all__ = ["sequence_mesh_dim", "ring_forward_local", "ring_backward_local", "attention_bytes"]

aten = torch.ops.aten
KeyRange = tuple[int, int, bool]
"""Global key rows ``[start, start + length)`` and whether the causal mask applies within them."""


def sequence_mesh_dim(q: DTensorSpec, k: DTensorSpec) -> int | None:
    """The mesh dim on which both query and key are ``Shard(seq)``: context-parallel attention runs over it."""
    seq = q.ndim - 2
    dims = [
        d
        for d, (pq, pk) in enumerate(zip(q.placements, k.placements))
        if pq == Shard(seq) and pk == Shard(seq) and q.mesh.shape[d] > 1
    ]
    if len(dims) > 1:
        raise ShardingError(
            f"attention with the sequence sharded on mesh dims {dims} at once ({q.placements}); shard the "
            "sequence on one mesh dim (e.g. a flattened one) and redistribute the others"
        )
    return dims[0] if dims else None


def _key_ranges(block: RowBlock, keys: int, causal: bool) -> list[KeyRange]:
    """The key blocks one block of query rows attends: all keys, or the rows before it plus its diagonal."""
    if not causal:
        return [(0, keys, False)]
    ranges = [(0, block.start, False), (block.start, block.length, True)]
    return [r for r in ranges if r[1] > 0]


def _query_blocks(size: int, n: int, rank: int, causal: bool, local_len: int) -> tuple[tuple[RowBlock, ...], bool]:
    """This rank's query blocks (global start, length, local start), and whether the layout is head-tail."""
    if not causal:  # rows are independent and keys unordered: the whole piece is one block
        return (RowBlock(0, local_len, 0),), False
    balanced = load_balanced()
    return tuple(b for b in rank_rows(size, n, balanced)[rank] if b.length > 0), balanced


def _gather_keys_values(
    k: torch.Tensor, v: torch.Tensor, comm: Communicator, seq: int, keys: int, balanced: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's key and value rows in one all-gather, in global order when the layout is head-tail."""
    kv = torch.cat([k, v], dim=-1)
    full = all_gather_dim(kv, comm, seq, keys)
    if balanced:
        full = full.index_select(seq, torch.argsort(gather_order(keys, comm.size, True)).to(full.device))
    head = k.size(-1)
    return full.narrow(-1, 0, head), full.narrow(-1, head, full.size(-1) - head)


def attention_bytes(k: DTensorSpec, v: DTensorSpec, n: int, backward: bool) -> tuple[int, int]:
    """Bytes one rank receives per call (all-gather of padded pieces) and what a ring moves at the
    least (every key/value row held elsewhere once; in backward, those rows again and as many of dk, dv)."""
    seq = k.ndim - 2
    keys = k.shape[seq]
    row = (math.prod(k.shape) // max(keys, 1)) * k.tensor_meta.dtype.itemsize
    row += (math.prod(v.shape) // max(keys, 1)) * v.tensor_meta.dtype.itemsize
    sizes = shard_sizes(keys, n)
    gathered = (n - 1) * sizes[0] * row
    bound = (keys - sizes[-1]) * row  # the rank holding the fewest rows must receive the rest
    times = 2 if backward else 1
    return times * gathered, times * bound


def _log_choice(op: Any, q: DTensorSpec, k: DTensorSpec, v: DTensorSpec, mesh_dim: int, balanced: bool,
                backward: bool) -> None:  # fmt: skip
    n = q.mesh.shape[mesh_dim]
    received, bound = attention_bytes(k, v, n, backward)
    names = q.mesh.mesh_dim_names
    name = names[mesh_dim] if names else str(mesh_dim)
    moves = "all-gather k, v + reduce-scatter dk, dv" if backward else "all-gather k, v"
    rotate = rotate_method()
    note = "" if rotate == "allgather" else f" (rotate method {rotate!r} asked: same bytes, gathered instead)"
    log_line(
        "%-30s context parallel over mesh dim %s (n=%d, %s rows): %s, receives %s per rank; ring lower bound "
        "%s; gathered because a ring moves the same bytes, in n-1 steps%s",
        op, name, n, "head-tail" if balanced else "contiguous", moves, human_bytes(received), human_bytes(bound), note,
    )  # fmt: skip


def _merge(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over key blocks merged from each block's (out, lse), stable at any magnitude."""
    out, lse = parts[0]
    if len(parts) == 1:
        return out, lse
    acc = torch.promote_types(out.dtype, torch.float32)
    lses = torch.stack([p[1].to(acc) for p in parts])
    total = torch.logsumexp(lses, dim=0)
    merged = sum(p[0].to(acc) * torch.exp(part_lse - total).unsqueeze(-1) for p, part_lse in zip(parts, lses))
    assert isinstance(merged, torch.Tensor)
    return merged.to(out.dtype), total.to(lse.dtype)


def _options(args: Sequence[Any], kwargs: dict[str, Any], first: int) -> tuple[float, bool, float | None]:
    """(dropout_p, is_causal, scale) of a call whose dropout_p is positional argument ``first``."""
    dropout = float(args[first]) if len(args) > first else float(kwargs.get("dropout_p", 0.0))
    causal = bool(args[first + 1]) if len(args) > first + 1 else bool(kwargs.get("is_causal", False))
    if dropout != 0.0:
        raise NotImplementedError("context-parallel attention needs dropout_p=0.0")
    return dropout, causal, kwargs.get("scale")


@dataclass(frozen=True)
class _SequenceCall:
    """What forward and backward share for a call whose sequence is sharded on a mesh dim: the
    communicator over it and this rank's query blocks."""

    comm: Communicator
    seq: int
    """The sequence dim of q, k, v (and of out, lse, grad)."""
    blocks: tuple[RowBlock, ...]
    balanced: bool
    causal: bool
    scale: float | None
    keys_length: int
    """The whole sequence's key rows."""


def _sequence_call(
    op: Any, args: Sequence[Any], kwargs: dict[str, Any], qkv: Sequence[DTensorSpec], *, backward: bool
) -> tuple[_SequenceCall, torch.Tensor, torch.Tensor] | None:
    """None when the sequence is not sharded on any mesh dim; else the call's shared facts (logged in
    verbose mode) and the whole sequence's keys and values, gathered. ``qkv`` are the specs of q, k, v.
    The keys and values come apart from the facts, so that the caller alone decides when they are freed."""
    q_spec, k_spec, v_spec = qkv
    mesh_dim = sequence_mesh_dim(q_spec, k_spec)
    if mesh_dim is None:
        return None
    first = 1 if backward else 0  # backward's arguments start with the incoming gradient
    q, k, v = args[first : first + 3]
    _, causal, scale = _options(args, kwargs, 6 if backward else 3)
    comm = q_spec.mesh.get_communicator(mesh_dim)
    seq = q.ndim - 2
    blocks, balanced = _query_blocks(q_spec.shape[seq], comm.size, comm.local_rank, causal, q.size(seq))
    if STATE.verbose:
        _log_choice(op, q_spec, k_spec, v_spec, mesh_dim, balanced, backward=backward)
    keys, values = _gather_keys_values(k, v, comm, seq, k_spec.shape[seq], balanced)
    return _SequenceCall(comm, seq, blocks, balanced, causal, scale, k_spec.shape[seq]), keys, values


def ring_forward_local(
    op: Any, args: list[Any], kwargs: dict[str, Any], specs: tuple[DTensorSpec, ...], output_specs: tuple[Any, ...]
) -> Any:
    """``(out, lse)`` of this rank's query rows over the whole sequence's keys (or the op on the pieces
    when the sequence is not sharded on any mesh dim)."""
    gathered = _sequence_call(op, args, kwargs, specs[:3], backward=False)
    if gathered is None:
        return op(*args, **kwargs)
    call, keys, values = gathered
    q, seq, causal, scale = args[0], call.seq, call.causal, call.scale
    outs, lses = [], []
    for block in call.blocks:
        rows = q.narrow(seq, block.local_start, block.length)
        parts = [
            aten._scaled_dot_product_flash_attention_for_cpu(
                rows, keys.narrow(seq, start, length), values.narrow(seq, start, length), 0.0, masked, scale=scale
            )
            for start, length, masked in _key_ranges(block, keys.size(seq), causal)
        ]
        out, lse = _merge(parts)
        outs.append(out)
        lses.append(lse)
    if len(outs) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, dim=seq), torch.cat(lses, dim=seq)


def ring_backward_local(
    op: Any, args: list[Any], kwargs: dict[str, Any], specs: tuple[DTensorSpec, ...], output_specs: tuple[Any, ...]
) -> Any:
    """``(dq, dk, dv)`` of context-parallel attention: each block's exact contribution, dk and dv
    summed back to their owners (or the op on the pieces when the sequence is not sharded)."""
    gathered = _sequence_call(op, args, kwargs, specs[1:4], backward=True)
    if gathered is None:
        return op(*args, **kwargs)
    call, keys, values = gathered
    del gathered  # so that ``del keys, values`` below frees them
    grad, q, k, v, out, lse = args[:6]
    comm, seq, causal, scale = call.comm, call.seq, call.causal, call.scale
    acc = torch.promote_types(q.dtype, torch.float32)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dkv = torch.zeros((*keys.shape[:-1], keys.size(-1) + values.size(-1)), dtype=acc, device=q.device)
    dk_full, dv_full = dkv.narrow(-1, 0, keys.size(-1)), dkv.narrow(-1, keys.size(-1), values.size(-1))
    for block in call.blocks:
        local = block.local_start, block.length
        grad_rows, q_rows, out_rows, lse_rows = (t.narrow(seq, *local) for t in (grad, q, out, lse))
        for start, length, masked in _key_ranges(block, keys.size(seq), causal):
            dq_part, dk_part, dv_part = aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_rows, q_rows, keys.narrow(seq, start, length), values.narrow(seq, start, length),
                out_rows, lse_rows, 0.0, masked, scale=scale,
            )  # fmt: skip
            dq.narrow(seq, *local).add_(dq_part)
            dk_full.narrow(seq, start, length).add_(dk_part)
            dv_full.narrow(seq, start, length).add_(dv_part)
    del keys, values, dk_full, dv_full  # the gathered rows, and views that would keep the unordered sum alive
    if call.balanced:  # back to the ranks' pieces laid end to end, so each owner's rows are one block
        dkv = dkv.index_select(seq, gather_order(call.keys_length, comm.size, True).to(dkv.device))
    dkv_local = reduce_scatter_dim(dkv, comm, seq, "sum")
    dk, dv = dkv_local.narrow(-1, 0, k.size(-1)), dkv_local.narrow(-1, k.size(-1), v.size(-1))
    return dq.to(q.dtype), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous()
