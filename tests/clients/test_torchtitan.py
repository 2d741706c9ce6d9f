"""torchtitan 0.3.0's llama3, built and parallelised by torchtitan's own code on spmd, equals one device.

``torchtitan_setup`` redirects torchtitan's ``torch.distributed.tensor`` imports to spmd (so it is
imported before torchtitan). Each scenario trains the llama3 debug model, shrunk for CPU, for two
steps the way torchtitan's Trainer does (sum loss over the global token count, gradient clipping,
its AdamW container) on a world of 4 ranks, and every rank compares the losses and gradient norms
of both steps, the gradients after step 1 and the parameters after step 2 with one device (with
pipeline parallelism, those of its own stage, by name).
The same scenario functions run on rank threads and on gloo processes.
"""

from __future__ import annotations

# First: torchtitan must be imported through the redirect (in pytest and in each gloo process).
import torchtitan_setup  # noqa: F401

# isort: split

import dataclasses
import threading
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.pipelining.schedules import _PipelineSchedule
from torchtitan.components.checkpointer.base import ModelWrapper
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.distributed.context_parallel import prepare_context_parallel_input
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import Llama3Model, llama3_configs, parallelize_llama

import spmd.checkpoint
from spmd.tensor import DTensor
from spmd.testing import run_multiprocess, run_threaded

WORLD = 4
N_LAYERS = 2
VOCAB = 512
BATCH = 4
SEQ = 16
MAX_NORM = 1.0
LR = 1e-3
EPS = 1e-5
"""Adam divides by sqrt(v) + eps: with torch's 1e-8, gradients that are rounding noise around zero
take steps of ~lr whose sign is the noise's; 1e-5 keeps them small."""
TOLERANCE = 1e-5
"""Largest difference from one device, relative to the largest magnitude of the value compared."""


# ----- the model and one training run, as torchtitan's Trainer does them -----------------------
def model_config(parallelism: ParallelismConfig) -> Llama3Model.Config:
    """torchtitan's llama3 "debugmodel", shrunk for CPU: fewer layers, a smaller vocabulary, short RoPE,
    and causal SDPA for the inner attention (FlexAttention has no backward on CPU)."""
    config = llama3_configs["debugmodel"](attn_backend="flex")
    config.layers = config.layers[:N_LAYERS]
    config.vocab_size = config.tok_embeddings.num_embeddings = config.lm_head.out_features = VOCAB
    for layer in config.layers:
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=SEQ)
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))  # its sharding config
    return config


_GLOBAL_RNG = threading.Lock()
"""Rank threads share torch's global generator, which torchtitan's init draws from: one rank at a time."""


def build_model(parallelism: ParallelismConfig) -> Llama3Model:
    """The model with torchtitan's own initialisation, from seed 0: the same weights on every rank."""
    with _GLOBAL_RNG:
        torch.manual_seed(0)
        model = model_config(parallelism).build()
        model.init_states(buffer_device=None)
    return model


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a scenario parallelises the model, in torchtitan's terms."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    pp_schedule: str = "1F1B"
    """torchtitan's name of the pipeline schedule, with pp > 1."""
    pp_microbatch: int = 2
    """Rows of a pipeline microbatch: the batch of 4 runs as 2 microbatches."""
    sequence_parallel: bool = True
    """With tp: sequence parallel, Shard(1) activations between blocks; else Replicate ones."""
    selective_ac: bool = False
    compile: str | None = None
    """torchtitan's per-block compile with this backend, or none."""

    def parallelism(self) -> ParallelismConfig:
        return ParallelismConfig(
            data_parallel_replicate_degree=self.dp_replicate,
            data_parallel_shard_degree=self.dp_shard,
            context_parallel_degree=self.cp,
            tensor_parallel_degree=self.tp,
            pipeline_parallel_degree=self.pp,
            pipeline_parallel_schedule=self.pp_schedule,
            pipeline_parallel_microbatch_size=self.pp_microbatch,
            enable_sequence_parallel=self.sequence_parallel,  # with tp, and the loss is vocab-parallel
            spmd_backend="partial_dtensor",  # torchtitan's DTensor backend (TP and FSDP2 DTensors)
        )

    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp


def parallelized(layout: Layout) -> tuple[Llama3Model, ParallelDims]:
    """The model built and parallelised by torchtitan: its ParallelDims and meshes, its parallelize_llama."""
    parallelism = layout.parallelism()
    parallel_dims = ParallelDims.from_config(parallelism, layout.world())
    parallel_dims.build_mesh()
    model = build_model(parallelism)
    parallelize_llama(
        model,
        parallel_dims=parallel_dims,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=parallelism,
        compile_config=CompileConfig(enable=layout.compile is not None, backend=layout.compile or "aot_eager"),
        ac_config=SelectiveAC.Config() if layout.selective_ac else None,  # type: ignore[arg-type]
        dump_folder="",
    )
    return model, parallel_dims


def pipelined(layout: Layout) -> tuple[torch.nn.Module, ParallelDims, _PipelineSchedule, tuple[bool, bool]]:
    """The model split into stages, each parallelised, and scheduled by torchtitan's pipeline_llm: this rank's
    stage, the ParallelDims, the schedule, and whether this rank has the first and the last stage."""
    parallelism = layout.parallelism()
    parallel_dims = ParallelDims.from_config(parallelism, layout.world())
    parallel_dims.build_mesh()
    model = build_model(parallelism)
    schedule, parts, first, last = pipeline_llm(
        model,
        parallel_dims=parallel_dims,
        training=TrainingConfig(mixed_precision_param="float32", local_batch_size=BATCH),
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,  # type: ignore[arg-type]
        dump_folder="",
        device=torch.device("cpu"),
        model_config=model_config(parallelism),
        parallelize_fn=parallelize_llama,
        loss_fn=CrossEntropyLoss(CrossEntropyLoss.Config()),
    )
    assert len(parts) == 1, "one stage a rank"
    return parts[0], parallel_dims, schedule, (first, last)


def optimizer_for(model: torch.nn.Module) -> OptimizersContainer:
    """torchtitan's optimizer container: one AdamW over every parameter."""
    group = ParamGroupConfig(
        pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": LR, "eps": EPS, "weight_decay": 0.1}
    )
    config = OptimizersContainer.Config(param_groups=[group], implementation="for-loop")
    return OptimizersContainer(config, model_parts=[model])


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: (tokens, labels), each [BATCH, SEQ]."""
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


def train_step(
    model: torch.nn.Module, optimizer: OptimizersContainer, step: int, parallel_dims: ParallelDims | None
) -> dict[str, float]:
    """Step ``step`` (1 or 2) of torchtitan's Trainer.train_step; returns the global loss and the gradient norm."""
    tokens, labels = batch(step)
    dp = parallel_dims is not None and parallel_dims.dp_enabled
    if dp:  # each dp rank its own rows of the global batch
        batch_mesh = parallel_dims.get_mesh("batch")
        tokens = tokens.chunk(batch_mesh.size())[batch_mesh.get_local_rank()]
        labels = labels.chunk(batch_mesh.size())[batch_mesh.get_local_rank()]
    local_tokens = torch.tensor(labels.numel())
    global_tokens = dist_utils.dist_sum_tensor(local_tokens, batch_mesh) if dp else local_tokens
    positions = torch.arange(SEQ).repeat(tokens.shape[0], 1)
    cp = parallel_dims is not None and parallel_dims.cp_enabled
    if cp:  # each cp rank its chunks of the sequence, head-tail balanced (the Trainer's post_dataloading_process)
        cp_mesh = parallel_dims.get_mesh("cp")
        tokens, labels, extra = prepare_context_parallel_input(
            tokens, labels, {"positions": positions}, cp_mesh, torch.device("cpu"), "headtail"
        )
        positions = extra["positions"]
    optimizer.zero_grad()
    loss, _ = CrossEntropyLoss(CrossEntropyLoss.Config())(model(tokens, positions), labels, global_tokens)
    loss.backward()
    grad_norm = dist_utils.clip_grad_norm_(list(model.parameters()), MAX_NORM, foreach=True)
    optimizer.step()
    global_loss = dist_utils.dist_sum(loss.detach(), parallel_dims.get_mesh("loss")) if dp or cp else loss.item()
    return {f"loss of step {step}": global_loss, f"gradient norm of step {step}": full(grad_norm).item()}


def pipelined_train_step(
    model: torch.nn.Module,
    optimizer: OptimizersContainer,
    step: int,
    parallel_dims: ParallelDims,
    schedule: _PipelineSchedule,
    stages: tuple[bool, bool],
) -> dict[str, float]:
    """Step ``step`` of torchtitan's Trainer.pp_forward_backward_step and train_step, whole batch (no dp).

    The Trainer calls ``schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)``, which torch 2.13's
    schedules do not take; this is the same call in torch 2.13's form: the whole batch, split by the schedule.
    """
    tokens, labels = batch(step)
    has_first, has_last = stages
    positions = torch.arange(SEQ).repeat(tokens.shape[0], 1)
    loss_kwargs = {"global_valid_tokens": torch.tensor(labels.numel())}
    optimizer.zero_grad()
    losses: list[torch.Tensor] = []
    inputs = (tokens,) if has_first else ()
    schedule.step(*inputs, positions=positions, target=labels if has_last else None,
                  losses=losses if has_last else None, loss_kwargs=loss_kwargs, return_outputs=False)
    grad_norm = dist_utils.clip_grad_norm_(
        list(model.parameters()), MAX_NORM, foreach=True, pp_mesh=parallel_dims.get_optional_mesh("pp")
    )
    optimizer.step()
    stage_loss = torch.stack(losses).sum() if has_last else torch.tensor(0.0)
    global_loss = dist_utils.dist_sum(stage_loss.detach(), parallel_dims.get_mesh("pp"))  # the last stage's, on every rank
    return {f"loss of step {step}": global_loss, f"gradient norm of step {step}": full(grad_norm).item()}


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def canonical(name: str) -> str:
    """A parameter's name without the wrapper activation checkpointing adds."""
    return name.replace("_checkpoint_wrapped_module.", "")


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {canonical(name): full(p.grad) for name, p in model.named_parameters()}


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {canonical(name): full(p) for name, p in model.named_parameters()}


Trained = dict[str, Any]
"""The loss and gradient norm of each step ("metrics"), gradients after step 1, parameters after step 2."""


def train(layout: Layout | None) -> Trained:
    """Two training steps on ``layout`` (None: one device)."""
    dist_utils.set_spmd_backend("partial_dtensor")  # as torchtitan's Trainer does, from its config
    if layout is not None and layout.pp > 1:
        return train_pipelined(layout)
    model, parallel_dims = (build_model(ParallelismConfig()), None) if layout is None else parallelized(layout)
    optimizer = optimizer_for(model)
    metrics = train_step(model, optimizer, 1, parallel_dims)
    step1_grads = grads(model)
    metrics |= train_step(model, optimizer, 2, parallel_dims)
    return {"metrics": metrics, "grads": step1_grads, "params": params(model)}


def train_pipelined(layout: Layout) -> Trained:
    """Two training steps of this rank's pipeline stage; gradients and parameters of its own stage only."""
    model, parallel_dims, schedule, stages = pipelined(layout)
    optimizer = optimizer_for(model)
    metrics = pipelined_train_step(model, optimizer, 1, parallel_dims, schedule, stages)
    step1_grads = grads(model)
    metrics |= pipelined_train_step(model, optimizer, 2, parallel_dims, schedule, stages)
    return {"metrics": metrics, "grads": step1_grads, "params": params(model), "one stage": True}


# ----- the scenarios ---------------------------------------------------------------------------
def tp_sp_loss_parallel(workdir: str) -> Trained:
    """Tensor parallel over all 4 ranks, sequence parallel, vocab-parallel embedding and loss."""
    return train(Layout(tp=WORLD))


def fsdp_x_tp(workdir: str) -> Trained:
    """torchtitan's 2-d layout: TP on its tp mesh, FSDP2 (spmd.fsdp) on its fsdp mesh."""
    return train(Layout(dp_shard=2, tp=2))


def hsdp(workdir: str) -> Trained:
    """torchtitan's HSDP: its 2-d dp mesh (dp_replicate=2, fsdp=2) to fully_shard, each of the 4 ranks its own rows."""
    return train(Layout(dp_replicate=2, dp_shard=2))


def hsdp_x_tp(workdir: str) -> Trained:
    """torchtitan's HSDP with tensor parallelism on 4 ranks: dp_replicate=2 x fsdp=1 x tp=2 (DDP x TP), through
    fully_shard on its (dp_replicate, fsdp) mesh; parameters on the 3-d mesh, Replicate() over dp_replicate."""
    return train(Layout(dp_replicate=2, dp_shard=1, tp=2))


def selective_ac(workdir: str) -> Trained:
    """FSDP x TP with torchtitan's per-op selective activation checkpointing of every block."""
    return train(Layout(dp_shard=2, tp=2, selective_ac=True))


def compiled(workdir: str, backend: str = "aot_eager") -> Trained:
    """FSDP x TP with torchtitan's per-block torch.compile (aot_eager: no C++ compiler needed)."""
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    trained = train(Layout(dp_shard=2, tp=2, compile=backend))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs, "no block was compiled"
    return trained


def compiled_inductor(workdir: str) -> Trained:
    """The same with inductor (C++ kernels on CPU): generated code, not only traced graphs."""
    return compiled(workdir, backend="inductor")


def cp_x_tp(workdir: str) -> Trained:
    """Context parallel x TP (dp 1 x cp 2 x tp 2): torchtitan's SDPA path, head-tail balanced sequence chunks."""
    return train(Layout(cp=2, tp=2))


def cp4(workdir: str) -> Trained:
    """Context parallel over all 4 ranks (FSDP over the cp ranks too, as torchtitan does)."""
    return train(Layout(cp=WORLD))


def pp_x_tp(workdir: str) -> Trained:
    """Pipeline x tensor parallel (pp=2 x tp=2), sequence parallel: torchtitan's pipeline_llm split, its 1F1B
    schedule over 2 microbatches; the stage edges carry Shard(1) DTensor activations (spmd's PipelineStage)."""
    return train(Layout(pp=2, tp=2))


def pp_x_tp_replicated_gpipe(workdir: str) -> Trained:
    """pp=2 x tp=2 without sequence parallel (Replicate activations, whose gradient arrives Partial), GPipe."""
    return train(Layout(pp=2, tp=2, pp_schedule="GPipe", sequence_parallel=False))


def pp4(workdir: str) -> Trained:
    """Pipeline parallel alone over 4 ranks (4 stages: embedding, one block each, norm and head), 1F1B over
    4 microbatches (1F1B needs at least one a stage)."""
    return train(Layout(pp=WORLD, pp_microbatch=1))


def checkpoint_saved(workdir: str) -> Trained:
    """Step 1 on dp=2 x tp=2, then torchtitan's model and optimizer Statefuls saved with DCP."""
    dist_utils.set_spmd_backend("partial_dtensor")
    model, parallel_dims = parallelized(Layout(dp_shard=2, tp=2))
    optimizer = optimizer_for(model)
    metrics = train_step(model, optimizer, 1, parallel_dims)
    spmd.checkpoint.save({"model": ModelWrapper(model), "optimizer": optimizer}, f"{workdir}/checkpoint")
    return {"metrics": metrics, "grads": grads(model)}


def checkpoint_resumed(workdir: str) -> Trained:
    """A later run: the model parallelised on tp=4, the checkpoint loaded into it, step 2."""
    dist_utils.set_spmd_backend("partial_dtensor")
    model, parallel_dims = parallelized(Layout(tp=WORLD))
    optimizer = optimizer_for(model)
    spmd.checkpoint.load({"model": ModelWrapper(model), "optimizer": optimizer}, f"{workdir}/checkpoint")
    return {"metrics": train_step(model, optimizer, 2, parallel_dims), "params": params(model)}


SCENARIOS: dict[str, Callable[[str], Trained]] = {
    scenario.__name__: scenario
    for scenario in (
        tp_sp_loss_parallel, fsdp_x_tp, hsdp, hsdp_x_tp, selective_ac, compiled, compiled_inductor, cp_x_tp, cp4,
        pp_x_tp, pp_x_tp_replicated_gpipe, pp4, checkpoint_saved, checkpoint_resumed,
    )
}


# ----- comparing with one device ---------------------------------------------------------------
def differences(trained: Trained, reference: Trained) -> dict[str, float]:
    """Each compared value's largest difference from one device, relative to its largest magnitude."""
    out = {
        name: abs(got - reference["metrics"][name]) / abs(reference["metrics"][name])
        for name, got in trained["metrics"].items()
    }
    for kind in ("grads", "params"):
        if kind not in trained:
            continue
        if trained.get("one stage"):  # a pipeline stage holds some of the parameters, named as on one device
            assert trained[kind] and trained[kind].keys() <= reference[kind].keys(), f"{kind}: other parameter names"
        else:
            assert trained[kind].keys() == reference[kind].keys(), f"{kind}: other parameter names"
        for name, got in trained[kind].items():
            want = reference[kind][name]
            assert got.shape == want.shape, f"{kind} {name}: shape {tuple(got.shape)}, one device {tuple(want.shape)}"
            out[f"{kind} {name}"] = ((got - want).abs().max() / want.abs().max()).item()
    return out


def compare(scenarios: list[str], reference: Trained, workdir: str) -> dict[str, dict[str, float]]:
    """Run ``scenarios`` in turn on this rank; each one's differences from one device."""
    return {name: differences(SCENARIOS[name](workdir), reference) for name in scenarios}


def assert_equal_to_one_device(per_rank: list[dict[str, dict[str, float]]]) -> None:
    for rank, per_scenario in enumerate(per_rank):
        for scenario, diffs in per_scenario.items():
            off = {what: d for what, d in diffs.items() if not d <= TOLERANCE}  # NaN is off too
            assert not off, f"{scenario} on rank {rank} differs from one device (relative): {off}"


@pytest.fixture(scope="module")
def reference() -> Trained:
    return train(None)


# The gloo launches: the save's run, then a later run that resumes (one world each, as on threads).
SAVE_RUN = ["fsdp_x_tp", "hsdp", "hsdp_x_tp", "selective_ac", "compiled", "checkpoint_saved"]
RESUME_RUN = ["tp_sp_loss_parallel", "cp_x_tp", "cp4", "pp_x_tp", "pp_x_tp_replicated_gpipe", "pp4", "checkpoint_resumed"]


@pytest.mark.parametrize(
    "scenario",
    [
        "tp_sp_loss_parallel", "fsdp_x_tp", "hsdp", "hsdp_x_tp", "selective_ac", "compiled", "cp_x_tp", "cp4",
        "pp_x_tp", "pp_x_tp_replicated_gpipe", "pp4",
        pytest.param("compiled_inductor", marks=pytest.mark.slow),  # C++ builds: ~30 s more on two cores
    ],
)
def test_on_threads(scenario: str, reference: Trained, tmp_path: Path) -> None:
    assert_equal_to_one_device(run_threaded(compare, WORLD, [scenario], reference, str(tmp_path)))


def test_checkpoint_saved_on_one_mesh_resumed_on_another_on_threads(reference: Trained, tmp_path: Path) -> None:
    """Saved by one run on dp=2 x tp=2, loaded by the next on tp=4."""
    assert_equal_to_one_device(run_threaded(compare, WORLD, ["checkpoint_saved"], reference, str(tmp_path)))
    assert_equal_to_one_device(run_threaded(compare, WORLD, ["checkpoint_resumed"], reference, str(tmp_path)))


@pytest.mark.multiprocess
def test_on_gloo_processes(reference: Trained, tmp_path: Path) -> None:
    """Every scenario on 4 gloo processes (torch's c10d collectives, torch's dcp.save and dcp.load), in two
    launches: the 2-d data-parallel scenarios ending with the save, then the tp=4 ones with the resume."""
    for scenarios in (SAVE_RUN, RESUME_RUN):
        assert_equal_to_one_device(run_multiprocess(compare, WORLD, scenarios, reference, str(tmp_path), timeout=600))


def build_two_layouts() -> None:
    for layout in (Layout(tp=WORLD), Layout(dp_shard=2, tp=2)):
        ParallelDims.from_config(layout.parallelism(), WORLD).build_mesh()


def test_parallel_dims_of_two_dp_degrees_in_one_world() -> None:
    """As on torch, each init_device_mesh keeps its own _flatten'ed dims (torchtitan's "loss_mesh" is
    flattened from other dims at each data-parallel degree)."""
    run_threaded(build_two_layouts, WORLD)
