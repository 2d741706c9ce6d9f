"""The built-in models the simulator knows by name, and how a plan parallelises and trains them.

``gpt`` is ``spmd.testing.models.GPT``, the decoder of ``examples/train_transformer.py``, at any size.
A plan applies the demo's own ``apply_tp_and_dp``: Megatron tensor parallelism over ``tp`` (optionally
with sequence-parallel norms), then over ``dp`` either plain replication (the gradient reduced in
backward) or ``fully_shard`` per block and on the root; AdamW steps on the shards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from spmd.simulate.plan import Plan
from spmd.tensor import DeviceMesh, DTensor, Replicate, Shard, distribute_tensor
from spmd.tensor_parallel import loss_parallel
from spmd.testing.models import GPT, apply_tp_and_dp

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

    # The names spmd.testing.models.GPT reads its sizes by (the demo's Config's fields).
    @property
    def vocab_size(self) -> int:
        return self.vocab

    @property
    def d_model(self) -> int:
        return self.dim

    @property
    def n_layers(self) -> int:
        return self.layers

    @property
    def n_heads(self) -> int:
        return self.heads

    @property
    def seq_len(self) -> int:
        return self.seq

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


@dataclass(frozen=True)
class GPTWorkload:
    """One training step of the built-in GPT under a plan: what ``spmd.simulate.simulate`` runs."""

    cfg: GPTConfig
    plan: Plan

    def build(self, mesh: DeviceMesh) -> tuple[nn.Module, torch.optim.Optimizer]:
        plan = self.plan
        model = apply_tp_and_dp(
            GPT(self.cfg),
            mesh,
            tensor_parallel=plan.size("tp") > 1,
            sequence_parallel=plan.sequence_parallel,
            fsdp=plan.fsdp,
        )
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
