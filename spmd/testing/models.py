"""The one demo GPT and its parallelisation plans, shared by the example, the simulator and the benchmarks.

A GPT-style decoder at any size: token and position embeddings, pre-norm blocks (RMSNorm, causal
attention with q/k/v/out projections, a 4x GELU MLP), a final norm and an untied head. It is plain
torch, so the same code runs on one device, on DTensors and on meta tensors. ``tp_plan`` is Megatron
tensor parallelism as torchtitan writes it for Llama; ``apply_tp_and_dp`` adds data parallelism over
``dp``, replicated or fully sharded. ``pipeline_stage`` cuts it into pipeline stages and
``stage_tp_plan`` is ``tp_plan`` for one stage, whose boundary activations are plain local pieces, so
torch's pipeline schedules carry them unchanged. One copy, so the demo and the simulator cannot drift apart.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from spmd.fsdp import fully_shard
from spmd.tensor import DeviceMesh, DTensor, Placement, Replicate, Shard, distribute_tensor
from spmd.tensor_parallel.linear import ColwiseParallel, RowwiseParallel
from spmd.tensor_parallel.parallelize import parallelize_module
from spmd.tensor_parallel.prepare import PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput
from spmd.tensor_parallel.sequence import SequenceParallel
from spmd.tensor_parallel.style import ParallelStyle

__all__ = [
    "GPTSizes",
    "Attention",
    "MLP",
    "Block",
    "GPT",
    "GPTStage",
    "pipeline_stage",
    "tp_plan",
    "stage_tp_plan",
    "replicate_over_dp",
    "apply_fsdp",
    "apply_tp_and_dp",
]


class GPTSizes(Protocol):
    """The sizes a GPT is built from: the demo's ``Config`` and the simulator's ``GPTConfig`` both have them."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def d_model(self) -> int: ...
    @property
    def n_layers(self) -> int: ...
    @property
    def n_heads(self) -> int: ...
    @property
    def seq_len(self) -> int: ...
    @property
    def dtype(self) -> torch.dtype: ...


# ----- the model: plain torch, the same code runs on one device and on DTensors ------------------
class Attention(nn.Module):
    """Causal self-attention; ``n_heads`` is the heads this module's q/k/v outputs hold (all, for DTensors)."""

    def __init__(self, cfg: GPTSizes) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.d_model // cfg.n_heads
        self.q, self.k, self.v, self.out = (nn.Linear(cfg.d_model, cfg.d_model, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape  # the global shape, also for a DTensor

        def heads(t: torch.Tensor) -> torch.Tensor:  # [B, S, D] -> [B, heads, S, head_dim]
            return t.view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, seq, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """Up to 4x the width, GELU, back down."""

    def __init__(self, cfg: GPTSizes) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=False)
        self.down = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """A pre-norm decoder block: attention and MLP, each on an RMSNorm'd residual stream."""

    def __init__(self, cfg: GPTSizes) -> None:
        super().__init__()
        self.attn_norm, self.attn = nn.RMSNorm(cfg.d_model), Attention(cfg)
        self.mlp_norm, self.mlp = nn.RMSNorm(cfg.d_model), MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """The decoder; built under ``torch.device("meta")`` it holds no data, whatever its size."""

    def __init__(self, cfg: GPTSizes) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype)
        self.pos_emb = nn.Parameter(torch.zeros(cfg.seq_len, cfg.d_model, dtype=cfg.dtype))
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.to(cfg.dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens) + self.pos_emb
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


class GPTStage(nn.Module):
    """One pipeline stage of a GPT: the embeddings (first stage), a run of blocks, the norm and head (last).

    Parameter names are the whole model's (``layers.2.attn.q.weight`` on the stage that holds block 2),
    so a stage's parameters and gradients compare with one device's by name.
    """

    def __init__(self, model: GPT, layer_ids: range, *, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.tok_emb = copy.deepcopy(model.tok_emb)
            self.pos_emb = nn.Parameter(model.pos_emb.detach().clone())
        self.layers = nn.ModuleDict({str(i): copy.deepcopy(model.layers[i]) for i in layer_ids})
        if last:
            self.norm, self.lm_head = copy.deepcopy(model.norm), copy.deepcopy(model.lm_head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Tokens to activations (first stage), activations to activations, or to logits (last stage)."""
        if self.first:
            x = self.tok_emb(x) + self.pos_emb
        for layer in self.layers.values():
            x = layer(x)
        return self.lm_head(self.norm(x)) if self.last else x


def pipeline_stage(model: GPT, stage: int, n_stages: int) -> GPTStage:
    """Stage ``stage`` of ``n_stages``, holding copies of its share of ``model``'s blocks (earlier stages
    take the extra ones when they do not divide evenly), as torchtitan cuts Llama for pipelining."""
    if not 0 <= stage < n_stages <= len(model.layers):
        raise ValueError(f"stage {stage} of {n_stages} does not fit a GPT of {len(model.layers)} blocks")
    per_stage, extra = divmod(len(model.layers), n_stages)
    start = stage * per_stage + min(stage, extra)
    layer_ids = range(start, start + per_stage + (stage < extra))
    return GPTStage(model, layer_ids, first=stage == 0, last=stage == n_stages - 1)


# ----- 2-d parallelism: tensor parallel over "tp", data parallel over "dp" -----------------------
def tp_plan(*, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Megatron tensor parallelism for the GPT, as torchtitan writes it for Llama.

    Column-wise q/k/v and MLP up shard the heads and the hidden features; row-wise attention out and
    MLP down reduce their partial sums (all_reduce, or reduce_scatter to sequence shards with
    ``sequence_parallel``, which then runs the norms on Shard(1) activations). The embedding is
    row-wise (vocab rows split over tp) and the head column-wise, so the logits stay vocab-sharded
    for ``loss_parallel``. On the (dp, tp) mesh the styles act on tp; the batch stays Shard(0) over dp.
    """
    activations: Placement = Shard(1) if sequence_parallel else Replicate()
    gather_input = PrepareModuleInput(input_layouts=activations, desired_input_layouts=Replicate())
    plan: dict[str, ParallelStyle] = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=activations),
        "layers.*.attn": gather_input,
        "layers.*.attn.q": ColwiseParallel(),
        "layers.*.attn.k": ColwiseParallel(),
        "layers.*.attn.v": ColwiseParallel(),
        "layers.*.attn.out": RowwiseParallel(output_layouts=activations),
        "layers.*.mlp": gather_input,
        "layers.*.mlp.up": ColwiseParallel(),
        "layers.*.mlp.down": RowwiseParallel(output_layouts=activations),
        "lm_head": ColwiseParallel(input_layouts=activations),
    }
    if sequence_parallel:
        plan.update({name: SequenceParallel() for name in ("layers.*.attn_norm", "layers.*.mlp_norm", "norm")})
    return plan


def stage_tp_plan(
    stage: GPTStage, *, sequence_parallel: bool, vocab_parallel_logits: bool = False
) -> dict[str, ParallelStyle]:
    """``tp_plan`` for one pipeline stage on its own 1-d tp mesh, its boundary activations plain local pieces.

    Inside the stage the residual stream stays DTensors (every style's ``use_local_output=False``, as
    on the demo's 2-d mesh), since the model's attention reads the global shape. At the stage's edges,
    styles on the stage itself hand the output on as this rank's local piece (``to_local``) and read
    the input received as this rank's piece of the same layout (``from_local``): torch's pipeline
    schedules send, receive and rebuild plain tensors only, and the gradient that travels back is the
    local piece of the activation's gradient in that layout. The last stage's head gathers its logits
    (``Replicate()``, handed out local), so the loss is plain cross-entropy on every rank; with
    ``vocab_parallel_logits`` they stay a vocab-sharded DTensor, for a loss under ``loss_parallel()``.
    Call ``replicate_over_dp(stage, tp_mesh)`` after it, so the norms and the position embedding are
    replicated DTensors too.
    """
    activations: Placement = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        key: dataclasses.replace(style, use_local_output=False)  # type: ignore[type-var]
        for key, style in tp_plan(sequence_parallel=sequence_parallel).items()
    }
    if not stage.first:
        del plan["tok_emb"]
    if stage.last:
        logits: Placement = Shard(-1) if vocab_parallel_logits else Replicate()
        plan["lm_head"] = ColwiseParallel(
            input_layouts=activations, output_layouts=logits, use_local_output=not vocab_parallel_logits
        )
    else:
        plan.pop("lm_head")
        plan.pop("norm", None)
    if not stage.first and not stage.last:
        plan[""] = PrepareModuleInputOutput(
            input_layouts=activations,
            desired_input_layouts=activations,
            output_layouts=activations,
            desired_output_layouts=activations,
            use_local_output=True,
        )
    elif not stage.first:
        plan[""] = PrepareModuleInput(input_layouts=activations, desired_input_layouts=activations)
    elif not stage.last:
        plan[""] = PrepareModuleOutput(
            output_layouts=activations, desired_output_layouts=activations, use_local_output=True
        )
    return plan


def replicate_over_dp(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Plain data parallelism: every parameter whole on each dp rank, its gradient reduced over dp.

    Parameters the tp plan left plain (position embedding, norms without sequence parallelism) become
    replicated DTensors. A dp-sharded batch makes each gradient Partial(sum) over dp; a hook lays it
    out like its parameter, so the reduction runs once, in backward, instead of once per optimizer
    op that reads it (AdamW reads each gradient three times).
    """
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if not isinstance(param, DTensor):
                param = nn.Parameter(distribute_tensor(param.detach(), mesh, [Replicate()] * mesh.ndim))
                module.register_parameter(name, param)
            placements = param.placements  # type: ignore[attr-defined]
            param.register_hook(lambda grad, placements=placements: grad.redistribute(mesh, placements))  # type: ignore[no-untyped-call]
    return model


def apply_fsdp(model: GPT, mesh: DeviceMesh) -> GPT:
    """ZeRO-3 over dp: each block, then the root (embeddings, final norm, head), as torchtitan does."""
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def apply_tp_and_dp(
    model: GPT,
    mesh: DeviceMesh,
    *,
    tensor_parallel: bool = True,
    sequence_parallel: bool = False,
    fsdp: bool = False,
) -> GPT:
    """Tensor parallelism over tp, then data parallelism over dp: replicated, or fully sharded with ``fsdp``.

    ``tensor_parallel=False`` skips the tp plan (a mesh without a tp dim, or one of size 1).
    """
    if tensor_parallel:
        parallelize_module(model, mesh, tp_plan(sequence_parallel=sequence_parallel))
    if fsdp:
        return apply_fsdp(model, mesh)
    replicate_over_dp(model, mesh)
    return model
