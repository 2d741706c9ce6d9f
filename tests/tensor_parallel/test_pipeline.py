"""Pipeline parallel x tensor parallel: torch's own pipeline schedules run the demo GPT cut into two
stages, each tensor-parallel over its own two ranks of a (pp=2, tp=2) mesh, and train exactly as one
device does.

Each stage's boundary activations are plain local tensors (``stage_tp_plan``): torch's
``PipelineStage`` sends and receives them as it does any tensor, and the styles on the stage turn them
back into DTensors of their layout. Two steps of SGD with GPipe and with 1F1B (two microbatches) give
the losses, gradients and parameters of one device, on rank threads and on gloo processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

import spmd.pipelining
from spmd.tensor import DTensor, init_device_mesh
from spmd.tensor_parallel import loss_parallel, parallelize_module
from spmd.testing.models import GPT, pipeline_stage, replicate_over_dp, stage_tp_plan


@dataclass(frozen=True)
class Sizes:
    """A GPT small enough to train on threads in seconds; float64, so the comparison can be tight."""

    vocab_size: int = 32
    d_model: int = 16
    n_layers: int = 4
    n_heads: int = 4
    seq_len: int = 8
    dtype: torch.dtype = torch.float64


SIZES = Sizes()
BATCH, MICROBATCHES, STEPS, LR = 4, 2, 2, 0.5
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def initial_weights() -> dict[str, torch.Tensor]:
    """Made once, by the caller: rank threads share torch's global generator, so each seeding its own
    would interleave their draws."""
    torch.manual_seed(0)
    model = GPT(SIZES)
    with torch.no_grad():
        model.pos_emb.normal_(0.0, 0.5)  # zeros would leave its gradient path untested
    return model.state_dict()


def build_gpt(weights: dict[str, torch.Tensor]) -> GPT:
    model = GPT(SIZES)
    model.load_state_dict(weights)
    return model


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, SIZES.vocab_size, (BATCH, SIZES.seq_len + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def vocab_parallel_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The same loss on vocab-sharded DTensor logits, without gathering them."""
    with loss_parallel():
        return next_token_loss(logits, targets)


def train_one_device(weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    model = build_gpt(weights)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        tokens, targets = batch(step)
        loss = next_token_loss(model(tokens), targets)
        loss.backward()  # type: ignore[no-untyped-call]
        losses.append(loss.item())
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach().clone()


def train_pipeline(
    schedule_name: str,
    sequence_parallel: bool,
    weights: dict[str, torch.Tensor],
    vocab_parallel: bool = False,
    spmd_stage: bool = False,
) -> dict[str, Any]:
    """Two steps on this rank's stage; the last step's gradients and the final parameters, whole.

    ``vocab_parallel``: the last stage returns vocab-sharded DTensor logits, the loss runs under ``loss_parallel``.
    ``spmd_stage``: no edge styles; the stage's DTensor activations cross through ``spmd.pipelining.PipelineStage``.
    """
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    stage_index = mesh.get_local_rank("pp")
    module = pipeline_stage(build_gpt(weights), stage_index, 2)
    plan = stage_tp_plan(module, sequence_parallel=sequence_parallel, vocab_parallel_logits=vocab_parallel)
    if spmd_stage:
        plan.pop("")  # the stage's own styles: to_local on the sending stage, from_local on the receiving one
    parallelize_module(module, mesh["tp"], plan)
    replicate_over_dp(module, mesh["tp"])  # the norms and the position embedding: replicated over tp
    stage_class = spmd.pipelining.PipelineStage if spmd_stage else PipelineStage
    stage = stage_class(module, stage_index, 2, torch.device("cpu"), group=mesh.get_group("pp"))
    loss_fn = vocab_parallel_loss if vocab_parallel else next_token_loss
    schedule = SCHEDULES[schedule_name](stage, n_microbatches=MICROBATCHES, loss_fn=loss_fn)
    optimizer = torch.optim.SGD(module.parameters(), lr=LR)
    losses: list[float] = []
    for step in range(STEPS):
        optimizer.zero_grad()
        tokens, targets = batch(step)
        if module.first:
            schedule.step(tokens)
        else:
            microbatch_losses: list[torch.Tensor] = []
            schedule.step(target=targets, losses=microbatch_losses)
            losses.append(torch.stack(microbatch_losses).mean().item())
        grads = {name: _full(p.grad) for name, p in module.named_parameters() if p.grad is not None}
        optimizer.step()
    params = {name: _full(p) for name, p in module.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params}


def check_equals_one_device(per_rank: list[dict[str, Any]], weights: dict[str, torch.Tensor]) -> None:
    expected = train_one_device(weights)
    # ranks 0, 1 hold stage 0 (embeddings, blocks 0-1); ranks 2, 3 stage 1 (blocks 2-3, norm, head)
    for key in ("grads", "params"):
        assert set(per_rank[0][key]) | set(per_rank[2][key]) == set(expected[key])
        for rank, result in enumerate(per_rank):
            for name, value in result[key].items():
                # float64: every difference is a reordered sum (split matmuls, all-reduces over tp,
                # microbatch means), each some 1e-16 relative; 1e-12 leaves room for two SGD steps
                where = f"{key} {name} rank {rank}"
                torch.testing.assert_close(
                    value, expected[key][name], rtol=1e-12, atol=1e-12, msg=lambda m, where=where: f"{where}: {m}"
                )
    for rank in (2, 3):
        torch.testing.assert_close(per_rank[rank]["losses"], expected["losses"], rtol=1e-12, atol=0)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("schedule_name", list(SCHEDULES))
def test_pp2_x_tp2_equals_one_device(world, schedule_name: str, sequence_parallel: bool) -> None:
    """Stage boundaries carry this rank's piece of Replicate() activations, or of Shard(1) ones with
    sequence parallelism."""
    weights = initial_weights()
    per_rank = world(train_pipeline, 4, schedule_name, sequence_parallel, weights, timeout=300)
    check_equals_one_device(per_rank, weights)


def test_the_last_stage_may_return_vocab_sharded_dtensor_logits(world) -> None:
    """Only what crosses between stages must be plain; the last stage's output goes to ``loss_fn``."""
    weights = initial_weights()
    per_rank = world(train_pipeline, 4, "1f1b", False, weights, True, timeout=300)
    check_equals_one_device(per_rank, weights)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_spmd_pipeline_stage_carries_dtensor_activations(world, sequence_parallel: bool) -> None:
    """The stages return and take DTensors (no edge styles): spmd's PipelineStage sends each as its local
    piece and rebuilds it on the next stage in the layout it had; the Replicate() activation's gradient
    arrives Partial on the receiving stage and is reduced there."""
    weights = initial_weights()
    per_rank = world(train_pipeline, 4, "1f1b", sequence_parallel, weights, False, True, timeout=300)
    check_equals_one_device(per_rank, weights)
