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
* each on the link its group gets in the layout's mesh order, latency included; the bound is the
  least over the orders.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from spmd.plan.cluster import Cluster
from spmd.plan.compose import stage_blocks
from spmd.plan.decoder import PlanModel
from spmd.plan.layout import Layout, groups_share_node, mesh_orders
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


def lower_bounds(cfg: PlanModel, layout: Layout, cluster: Cluster, global_batch: int, seq: int,
                 dtype: torch.dtype) -> Bounds:  # fmt: skip
    """The bounds of the module docstring for ``layout`` (a valid one: degrees divide the sizes).

    For a model that is not a built-in ``LlamaConfig`` only the training state and the
    data-parallel traffic are bounded: nothing is known of its blocks' FLOPs or activations.
    """
    item = dtype.itemsize
    tp, cp, pp, m = layout.tp, layout.cp, layout.pp, layout.microbatches
    micro_batch = global_batch // layout.dp // m
    blocks = stage_blocks(cfg.layers, pp)
    outside = cfg.params() - cfg.layers * cfg.layer_params()  # embedding and head: split between the end stages
    ends = {0, pp - 1}
    stage_params = [
        b * cfg.layer_params() + (outside if pp == 1 else outside / 2) * (s in ends) for s, b in enumerate(blocks)
    ]
    state = max(stage_params) * item * 4 / (tp * layout.dp_shard * cp)  # parameter, gradient, AdamW's two
    llama = cfg if isinstance(cfg, LlamaConfig) else None
    in_flight = 1 if pp == 1 else m if layout.schedule == "GPipe" else min(pp, m)
    saved = 0.0 if llama is None else micro_batch * seq // cp * saved_per_token(llama, layout) * item
    memory = state + blocks[0] * in_flight * saved
    compute = 0.0 if llama is None else _compute_bound(llama, layout, cluster, micro_batch, seq, item, blocks[-1])
    critical, data_parallel = _traffic_needs(cfg, layout, micro_batch, seq, item)
    fewest = min(blocks)
    step = min(
        _step_bound(layout, cluster, intra, compute, critical, data_parallel, blocks[-1], fewest)
        for intra in _link_patterns(layout, cluster.ranks_per_node)
    )
    return Bounds(memory=SAFETY * memory, state=SAFETY * state, step_s=SAFETY * step)


def _compute_bound(cfg: LlamaConfig, layout: Layout, cluster: Cluster, micro_batch: int, seq: int, item: int,
                   blocks: int) -> float:  # fmt: skip
    """Seconds one micro-batch of the last stage (``blocks`` blocks and the head) computes, at least."""
    tp, cp = layout.tp, layout.cp
    tokens = micro_batch * seq // cp
    linear = cfg.layer_params() - 2 * cfg.dim
    # full checkpointing recomputes the forward but its last product (no saved tensor needs it);
    # selective keeps the products' outputs, so it recomputes none of them
    recomputed = (linear - cfg.dim * cfg.ffn_dim) / linear if layout.ac == "full" else 0.0
    block_flops = 2 * tokens * linear / tp * (3 + recomputed)
    # causal attention: this rank's query rows against the keys before them, half the square on average
    attention = 4 * micro_batch * cfg.heads / tp * (seq / cp) * seq * cfg.head_dim / 2
    block_flops += attention * (1 + BACKWARD_ATTENTION_FACTOR + (layout.ac == "full"))
    seconds = (blocks * block_flops + 6 * tokens * cfg.vocab * cfg.dim / tp) / cluster.flops
    if cluster.memory_bandwidth is not None:
        seconds += blocks * tokens * _traffic_per_token(cfg, layout) * item / cluster.memory_bandwidth
    return seconds


Need = tuple[tuple[str, ...], str, int, float, int]
"""(mesh dims of the group, collective, group size, buffer bytes, how many) that one block's
micro-batch must issue at least."""


def _traffic_needs(cfg: PlanModel, layout: Layout, micro_batch: int, seq: int,
                   item: int) -> tuple[list[Need], list[Need]]:  # fmt: skip
    """The critical-path collectives (tp, cp) and the data-parallel ones of one block's micro-batch, at least.

    Tensor parallel: two all-reduces' worth of the activation out, two back (or reduce-scatter plus
    all-gather each). Context parallel: keys and values, repeated to every query head as the model
    hands them to attention, gathered forward, gathered and reduce-scattered back. FSDP: the block's
    parameters gathered forward and backward, its gradient reduce-scattered; replicas all-reduce
    the shard.
    """
    tp, cp, shard = layout.tp, layout.cp, layout.dp_shard * layout.cp
    critical: list[Need] = []
    if isinstance(cfg, LlamaConfig):  # of another module's blocks nothing is known
        activation = micro_batch * seq // cp * cfg.dim * item
        keys_values = 2 * micro_batch * seq * cfg.heads * cfg.head_dim * item / tp
        critical = [(("tp",), "all_reduce", tp, activation, 4), (("cp",), "all_gather", cp, keys_values, 3)]
    block = cfg.layer_params() * item / tp
    data_parallel: list[Need] = [
        (("dp_shard", "cp"), "all_gather", shard, block, 3),
        (("dp_replicate",), "all_reduce", layout.dp_replicate, block / shard, 1),
    ]
    return critical, data_parallel


NEED_GROUPS = (("tp",), ("cp",), ("dp_shard", "cp"), ("dp_replicate",))
"""The groups the bounds' collectives run over."""


@functools.lru_cache(maxsize=4096)
def _link_patterns_of(sizes: tuple[tuple[str, int], ...], ranks_per_node: int) -> frozenset[tuple[bool, ...]]:
    from spmd.plan.layout import Layout

    layout = Layout(**dict(sizes))  # type: ignore[arg-type]
    # pp outermost never lengthens another group's span, so those orders give every pattern that can win
    orders = [order for order in mesh_orders(layout) if order[0] == "pp" or layout.pp == 1]
    return frozenset(
        tuple(groups_share_node(layout.with_order(order), dims, ranks_per_node) for dims in NEED_GROUPS)
        for order in orders
    )


def _link_patterns(layout: Layout, ranks_per_node: int) -> frozenset[tuple[bool, ...]]:
    """For each mesh order, which of ``NEED_GROUPS`` share a node (the distinct patterns only)."""
    sizes = tuple((dim, layout.size(dim)) for dim in ("dp_replicate", "dp_shard", "cp", "tp", "pp"))
    return _link_patterns_of(sizes, ranks_per_node)


def _seconds(needs: list[Need], intra: tuple[bool, ...], cluster: Cluster) -> float:
    """The needs' ring time on the links ``intra`` (per ``NEED_GROUPS``) gives their groups."""
    total = 0.0
    for dims, kind, n, buffer, count in needs:
        if n > 1:
            link = cluster.link(intra[NEED_GROUPS.index(dims)])
            received = collective_bytes(kind, n, int(buffer))
            total += count * (collective_rounds(kind, n) * link.latency + received / link.bandwidth)
    return total


def _step_bound(layout: Layout, cluster: Cluster, intra: tuple[bool, ...], compute: float, critical: list[Need],
                data_parallel: list[Need], last_blocks: int, fewest_blocks: int) -> float:  # fmt: skip
    """The step's bound for one pattern of links: at least the slowest stage's micro-batches through
    the bubble, and at least the data-parallel traffic of any stage plus its own critical path
    (compose's model); with nothing overlapping, both add."""
    m, bubble_steps = layout.microbatches, layout.microbatches + layout.pp - 1
    per_block = _seconds(critical, intra, cluster)
    dp_per_block = _seconds(data_parallel, intra, cluster)
    through = bubble_steps * (compute + last_blocks * per_block)
    if not cluster.overlap:
        return through + m * fewest_blocks * dp_per_block
    return max(through, m * fewest_blocks * dp_per_block + bubble_steps * fewest_blocks * per_block)


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
