"""The built-in models the simulator knows by name, and how a plan parallelises and trains them.

``gpt`` is the decoder of ``examples/train_transformer.py`` at any size: token and position
embeddings, pre-norm blocks (RMSNorm, causal attention with q/k/v/out projections, a 4x GELU MLP),
a final norm and an untied head. A plan applies, as the demo does, Megatron tensor parallelism over
``tp`` (optionally with sequence-parallel norms), then over ``dp`` either plain replication (the
gradient reduced in backward) or ``fully_shard`` per block and on the root; AdamW steps on the shards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from spmd.fsdp import fully_shard
from spmd.simulate.plan import Plan
from spmd.tensor import DeviceMesh, DTensor, Placement, Replicate, Shard, distribute_tensor
from spmd.tensor_parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

__all__ = ["GPTConfig", "GPT", "GPTWorkload", "MODELS", "model_workload"]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Sizes of a GPT-style decoder and of the batch each data-parallel rank trains on."""

    layers: int = 2
    dim: int = 64
    heads: int = 4
    vocab: int = 128
    seq: int = 32
    batch: int = 1
    """Sequences per data-parallel rank (the global batch is ``batch * dp``)."""
    dtype: torch.dtype = torch.float32

    def check(self, plan: Plan) -> None:
        """Raise ValueError naming the value if the sizes do not fit the model or the plan's styles."""
        for name in ("layers", "dim", "heads", "vocab", "seq", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be a positive integer, got {getattr(self, name)}")
        if self.dim % self.heads:
            raise ValueError(
                f"--dim {self.dim} is not divisible by --heads {self.heads}; each head needs dim/heads features"
            )
        tp = plan.size("tp")
        if self.heads % tp:
            raise ValueError(
                f"--heads {self.heads} is not divisible by tp={tp}: ColwiseParallel q/k/v give each tp rank "
                f"whole heads; pick tp among the divisors of {self.heads}"
            )
        if plan.sequence_parallel and self.seq % tp:
            raise ValueError(
                f"--seq {self.seq} is not divisible by tp={tp}: SequenceParallel splits the sequence over tp; "
                "pick a multiple of tp"
            )


class _Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.q, self.k, self.v, self.out = (nn.Linear(cfg.dim, cfg.dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape  # the global shape, for a DTensor too

        def split_heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq, self.heads, dim // self.heads).transpose(1, 2)

        y = F.scaled_dot_product_attention(
            split_heads(self.q(x)), split_heads(self.k(x)), split_heads(self.v(x)), is_causal=True
        )
        return self.out(y.transpose(1, 2).reshape(batch, seq, dim))


class _MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.dim, 4 * cfg.dim, bias=False)
        self.down = nn.Linear(4 * cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.attn_norm, self.attn = nn.RMSNorm(cfg.dim), _Attention(cfg)
        self.mlp_norm, self.mlp = nn.RMSNorm(cfg.dim), _MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """The decoder; built under ``torch.device("meta")`` it holds no data, whatever its size."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.dim, dtype=cfg.dtype)
        self.pos_emb = nn.Parameter(torch.zeros(cfg.seq, cfg.dim, dtype=cfg.dtype))
        self.layers = nn.ModuleList(_Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.to(cfg.dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens) + self.pos_emb
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def tp_plan(*, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Megatron tensor parallelism: heads and MLP features split over tp, vocab-sharded logits."""
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


def replicate_parameters(model: nn.Module, mesh: DeviceMesh) -> None:
    """Plain data parallelism: every parameter a DTensor, its gradient laid out like it in backward."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if not isinstance(param, DTensor):
                param = nn.Parameter(distribute_tensor(param.detach(), mesh, [Replicate()] * mesh.ndim))
                module.register_parameter(name, param)
            placements = param.placements  # type: ignore[attr-defined]
            param.register_hook(lambda grad, placements=placements: grad.redistribute(mesh, placements))  # type: ignore[no-untyped-call]


def parallelize_gpt(model: GPT, mesh: DeviceMesh, plan: Plan) -> GPT:
    """Tensor parallelism over tp (if the plan has it), then replicated or fully sharded over dp."""
    if plan.size("tp") > 1:
        parallelize_module(model, mesh, tp_plan(sequence_parallel=plan.sequence_parallel))
    if plan.fsdp:
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        replicate_parameters(model, mesh)
    return model


@dataclass(frozen=True)
class GPTWorkload:
    """One training step of the built-in GPT under a plan: what ``spmd.simulate.simulate`` runs."""

    cfg: GPTConfig
    plan: Plan

    def build(self, mesh: DeviceMesh) -> tuple[nn.Module, torch.optim.Optimizer]:
        model = parallelize_gpt(GPT(self.cfg), mesh, self.plan)
        # foreach=False: torch's default on CPU, so the step is the same per-parameter program everywhere
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, foreach=False)

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh) -> None:
        global_batch = self.cfg.batch * self.plan.size("dp")
        placements = [Shard(0) if name == "dp" else Replicate() for name in self.plan.mesh_dim_names]
        tokens = torch.empty(global_batch, self.cfg.seq + 1, dtype=torch.long, device=mesh.device_type)

        def place(batch: torch.Tensor) -> DTensor:
            return distribute_tensor(batch, mesh, placements, src_data_rank=None)

        optimizer.zero_grad()
        logits = model(place(tokens[:, :-1]))
        targets = place(tokens[:, 1:])
        if self.plan.size("tp") > 1:
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
                loss.backward()  # type: ignore[no-untyped-call]
        else:
            # sum / tokens, not reduction="mean": the mean rule gathers batch-sharded logits, the sum stays P(sum)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1), reduction="sum") / targets.numel()
            loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        float(loss.full_tensor().item() if isinstance(loss, DTensor) else loss.item())  # the loss a run would log


MODELS: dict[str, Callable[[GPTConfig, Plan], GPTWorkload]] = {"gpt": GPTWorkload}
"""Built-in models by name (``--model``)."""


def model_workload(name: str, cfg: GPTConfig, plan: Plan) -> GPTWorkload:
    """The named built-in model's training step under ``plan``; ValueError naming an unknown model."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; the built-in models are {sorted(MODELS)}")
    cfg.check(plan)
    return MODELS[name](cfg, plan)
