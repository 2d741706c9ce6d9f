"""Closed-form lower bounds on a layout's peak memory and step time, to prune before simulating.

Each bound counts only what every layout of that shape must do, so it never exceeds what the
simulation finds (tests check it on every layout of small searches):

* memory: the parameters, gradients and AdamW state of the fullest stage, sharded over tp and
  FSDP's dp_shard x cp as if nothing were replicated, plus what each block must keep for backward
  under its checkpointing (``saved_per_token``) for every micro-batch in flight on stage 0;
* compute: the matrix products of the blocks and the head (forward, backward, and the forward
  again but its last product for fully checkpointed blocks) and causal attention, over the FLOP/s,
  and, when memory-bound work is priced, one read and write of each norm, residual add and MLP
  activation forward and backward;
* tensor parallel: two all-reduces' worth (or reduce-scatter plus all-gather) of the block's
  activation per block and micro-batch, forward and backward; context parallel: each block's
  keys and values (repeated to every query head, as the model hands them to attention) gathered
  forward, gathered and reduce-scattered backward; data parallel, per
  block and micro-batch: FSDP's two gathers and one reduce-scatter of the block's parameters, the
  replicas' all-reduce; and the bubble of the pipeline;
* each at the fastest link its group could get from any mesh order (inside a node when it fits),
  latency included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spmd.plan.cluster import Cluster
from spmd.plan.compose import stage_blocks
from spmd.plan.layout import Layout
from spmd.plan.llama import LlamaConfig
from spmd.plan.recorder import BACKWARD_ATTENTION_FACTOR
from spmd.tensor.redistribute.cost import collective_bytes, collective_rounds

__all__ = ["Bounds", "lower_bounds", "SAFETY"]

SAFETY = 0.98
"""Bounds are scaled by this, so rounding and uneven shards never lift a bound over the simulated value."""


@dataclass(frozen=True, slots=True)
class Bounds:
    memory: float
    """Bytes the fullest rank holds at least."""
    state: float
    """Of ``memory``: parameters, gradients and optimizer state."""
    step_s: float
    """Seconds the step takes at least."""


def _bandwidth(cluster: Cluster, group: int) -> float:
    return cluster.link(group <= cluster.ranks_per_node).bandwidth


def lower_bounds(cfg: LlamaConfig, layout: Layout, cluster: Cluster, global_batch: int, seq: int,
                 dtype: torch.dtype) -> Bounds:  # fmt: skip
    """The bounds of the module docstring for ``layout`` (a valid one: degrees divide the sizes)."""
    item = torch.empty((), dtype=dtype, device="meta").element_size()
    tp, cp, pp, m = layout.tp, layout.cp, layout.pp, layout.microbatches
    shard = layout.dp_shard * cp
    micro_batch = global_batch // layout.dp // m
    blocks = stage_blocks(cfg.layers, pp)
    head_params = cfg.vocab * cfg.dim
    stage_params = [b * cfg.layer_params() + head_params * (s == 0 or s == pp - 1) for s, b in enumerate(blocks)]
    state = max(stage_params) * item * 4 / (tp * shard)  # parameter, gradient, two AdamW moments
    in_flight = m if layout.schedule == "GPipe" or pp == 1 else min(pp, m)
    if pp == 1:
        in_flight = 1
    saved = micro_batch * seq // cp * saved_per_token(cfg, layout) * item
    memory = state + blocks[0] * in_flight * saved

    tokens = micro_batch * seq // cp
    linear = cfg.layer_params() - 2 * cfg.dim
    # full checkpointing recomputes the forward but its last product (no saved tensor needs it);
    # selective keeps the products' outputs, so it recomputes none of them
    recomputed = (linear - cfg.dim * cfg.ffn_dim) / linear if layout.ac == "full" else 0.0
    block_flops = 2 * tokens * linear / tp * (3 + recomputed)
    # causal attention: this rank's query rows against the keys before them, half the square on average
    attention = 4 * micro_batch * cfg.heads / tp * (seq / cp) * seq * cfg.head_dim / 2
    block_flops += attention * (1 + BACKWARD_ATTENTION_FACTOR + (layout.ac == "full"))
    last_flops = blocks[-1] * block_flops + 6 * tokens * head_params / tp
    compute = last_flops / cluster.flops
    if cluster.memory_bandwidth is not None:
        compute += blocks[-1] * tokens * _traffic_per_token(cfg, layout) * item / cluster.memory_bandwidth

    per_block = _critical_comm_per_block(cfg, layout, cluster, micro_batch, seq, item)
    dp_per_block = _data_parallel_comm_per_block(cfg, layout, cluster, item)
    fewest = min(blocks)
    bubble_steps = m + pp - 1
    # the step is at least the slowest stage's micro-batches through the bubble, and at least the
    # data-parallel traffic of any stage plus its own critical path (see compose's model)
    step = max(
        bubble_steps * (compute + blocks[-1] * per_block),
        m * fewest * dp_per_block + bubble_steps * fewest * per_block,
    )
    if not cluster.overlap:  # nothing hides: every collective adds
        step = max(step, bubble_steps * (compute + blocks[-1] * per_block) + m * fewest * dp_per_block)
    return Bounds(memory=SAFETY * memory, state=SAFETY * state, step_s=SAFETY * step)


def _ring(kind: str, n: int, buffer: float, cluster: Cluster) -> float:
    """A collective's ring time on the fastest link its group could get."""
    if n <= 1:
        return 0.0
    link = cluster.link(n <= cluster.ranks_per_node)
    return collective_rounds(kind, n) * link.latency + collective_bytes(kind, n, int(buffer)) / link.bandwidth


def _critical_comm_per_block(cfg: LlamaConfig, layout: Layout, cluster: Cluster, micro_batch: int, seq: int,
                             item: int) -> float:  # fmt: skip
    """Tensor- and context-parallel time one block's micro-batch must spend at least."""
    tp, cp = layout.tp, layout.cp
    activation = micro_batch * seq // cp * cfg.dim * item
    seconds = 4 * _ring("all_reduce", tp, activation, cluster)  # two out, two back (or RS + AG each)
    # keys and values as attention sees them: repeated to every query head (the model repeats them first)
    keys_values = 2 * micro_batch * seq * cfg.heads * cfg.head_dim * item / tp
    seconds += 3 * _ring("all_gather", cp, keys_values, cluster)  # gathered forward; gathered, reduced back
    return seconds


def _data_parallel_comm_per_block(cfg: LlamaConfig, layout: Layout, cluster: Cluster, item: int) -> float:
    """Data-parallel time one block's micro-batch must spend at least: FSDP gathers its parameters
    forward and backward and reduce-scatters its gradient; replicas all-reduce theirs."""
    shard = layout.dp_shard * layout.cp
    block = cfg.layer_params() * item / layout.tp
    seconds = 3 * _ring("all_gather", shard, block, cluster)
    return seconds + _ring("all_reduce", layout.dp_replicate, block / shard, cluster)


def saved_per_token(cfg: LlamaConfig, layout: Layout) -> float:
    """Elements one block keeps for backward per token of its micro-batch, at least.

    ``full``: its input. ``selective``: its input and the outputs of its products (q, k, v,
    attention, the two row-wise outputs as whole partial sums, the two up projections). ``none``:
    the norms' inputs and outputs (the gathered ones whole), q and the repeated k and v, attention's
    output, the up projections' outputs and the down projection's input.
    """
    d, tp = cfg.dim, layout.tp
    sequence_sharded = tp if layout.sp else 1
    kv = cfg.kv_heads * cfg.head_dim
    if layout.ac == "full":
        return d / sequence_sharded
    if layout.ac == "selective":
        return d / sequence_sharded + (2 * d + 2 * kv + 2 * cfg.ffn_dim) / tp + 2 * d
    return 2 * d / sequence_sharded + 2 * d + (4 * d + 3 * cfg.ffn_dim) / tp


def _traffic_per_token(cfg: LlamaConfig, layout: Layout) -> float:
    """Elements one block's memory-bound ops read and write per token, at least: forward and backward
    each read and write the two norms, the two residual adds and the MLP's activation once."""
    sequence_sharded = layout.tp if layout.sp else 1
    activation = (5 if cfg.gated else 2) * cfg.ffn_dim / layout.tp  # silu and the gate's product, or gelu
    return 2 * (10 * cfg.dim / sequence_sharded + activation)
