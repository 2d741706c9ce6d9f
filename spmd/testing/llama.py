"""A Llama-shaped decoder: grouped-query attention, SwiGLU MLP (or GELU, GPT-shaped), RMSNorm, untied head.

Written torchtitan's way, so its tensor-parallel plan is torchtitan's: projections hand on local
tensors, attention reshapes with ``-1`` heads (this rank's), and context parallelism runs through
``context_parallel``. Rotary position embedding is left out: it is elementwise on q and k (no FLOPs
or collectives that matter for a plan) and would need position buffers sharded with the sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from spmd.tensor import Replicate, Shard
from spmd.tensor_parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = ["LlamaConfig", "Llama", "tp_plan"]


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Sizes of a Llama-style decoder (torchtitan's llama3 field names in spirit)."""

    layers: int = 2
    dim: int = 64
    heads: int = 4
    kv_heads: int = 2
    ffn_dim: int = 160
    vocab: int = 256
    gated: bool = True
    """SwiGLU (Llama) when True; a plain GELU MLP of ``ffn_dim`` (GPT) when False."""

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    def with_layers(self, layers: int) -> LlamaConfig:
        return replace(self, layers=layers)

    def build(self, layers: int) -> Llama:
        """The model with ``layers`` blocks (on the current default device)."""
        return Llama(self.with_layers(layers))

    def tp_plan(self, sp: bool) -> dict[str, ParallelStyle]:
        return tp_plan(sp, gated=self.gated)

    def allows_tp(self, tp: int) -> bool:
        """Whether tensor parallelism of degree ``tp`` gives each rank whole heads and MLP columns."""
        return self.kv_heads % tp == 0 and self.ffn_dim % tp == 0

    def layer_params(self) -> int:
        """Parameters of one block (projections, MLP, two norm weights)."""
        kv = 2 * self.dim * self.kv_heads * self.head_dim
        mlp = (3 if self.gated else 2) * self.dim * self.ffn_dim
        return 2 * self.dim * self.dim + kv + mlp + 2 * self.dim

    def params(self) -> int:
        """All parameters: blocks, embedding, final norm and head."""
        return self.layers * self.layer_params() + 2 * self.vocab * self.dim + self.dim


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.groups = cfg.heads // cfg.kv_heads
        self.wq = nn.Linear(cfg.dim, cfg.heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape  # this rank's piece: tensor parallel hands on local tensors

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq, -1, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.wq(x)), heads(self.wk(x)), heads(self.wv(x))
        if self.groups > 1:  # grouped-query attention: each key/value head serves ``groups`` query heads
            k, v = k.repeat_interleave(self.groups, dim=1), v.repeat_interleave(self.groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False) if cfg.gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is None:
            return self.w2(F.gelu(self.w1(x)))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(cfg.dim), Attention(cfg)
        self.ffn_norm, self.feed_forward = nn.RMSNorm(cfg.dim), FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """The decoder: token embedding, ``layers`` blocks, final norm, output head (logits)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def tp_plan(sp: bool, *, gated: bool = True) -> dict[str, ParallelStyle]:
    """torchtitan's Llama plan: column-wise in, row-wise out, vocab-sharded logits for loss_parallel."""
    act = Shard(1) if sp else Replicate()
    plan: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=act),
        "output": ColwiseParallel(input_layouts=act, output_layouts=Shard(-1), use_local_output=False),
        "layers.*.attention": PrepareModuleInput(input_layouts=(act,), desired_input_layouts=(Replicate(),)),
        "layers.*.feed_forward": PrepareModuleInput(input_layouts=(act,), desired_input_layouts=(Replicate(),)),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=act),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=act),
    }
    columns = ["attention.wq", "attention.wk", "attention.wv", "feed_forward.w1"] + ["feed_forward.w3"] * gated
    for name in columns:
        plan[f"layers.*.{name}"] = ColwiseParallel()
    if sp:
        plan.update({name: SequenceParallel() for name in ("layers.*.attention_norm", "layers.*.ffn_norm", "norm")})
    return plan
