"""Simulate one micro-batch of a layout's per-rank program, and cut its timeline into repeatable pieces.

The program is the model with three blocks (embedding, blocks 0-2, norm and head), laid out the way
the layout says (tensor parallel on ``tp``, FSDP/HSDP over ``dp_replicate`` x ``dp_shard`` x
``cp``, context parallel on ``cp``, activation checkpointing), run for one forward and backward
of one micro-batch in the simulated world (``spmd.simulate``), then one optimizer step. Markers
at each block's forward start and backward start cut the timeline; block 1's forward and
backward are the steady-state pieces, so a model of ``L`` blocks, or a pipeline stage of ``k``
blocks, is built by repeating them: memory events, collectives and FLOPs alike. The blocks of a
decoder are identical, so the result equals simulating all of them; a test checks it.

A program depends only on what each rank computes: the degrees, sp, ac, the micro-batch shape.
It is simulated once and cached (``ProgramKey``); the pipeline degree, the number of micro-batches
and the mesh order reuse it.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import _get_current_function_mode_stack
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from spmd.checkpoint.optimizer_state import init_optimizer_state
from spmd.comm import use_world
from spmd.fsdp import fully_shard
from spmd.plan.decoder import PlanModel
from spmd.plan.llama import tp_plan
from spmd.plan.recorder import Segment, StepRecorder
from spmd.simulate.memory import local_storages
from spmd.simulate.meta_semantics import MetaAsCpu
from spmd.simulate.world import SimulatedWorld
from spmd.tensor import DeviceMesh, DTensor, init_device_mesh
from spmd.tensor.experimental import context_parallel
from spmd.tensor_parallel import loss_parallel, parallelize_module

__all__ = [
    "tp_plan",
    "ProgramKey",
    "Program",
    "Segment",
    "simulate_program",
    "simulate_whole",
    "WholeStep",
    "build",
    "train_microbatch",
    "PROGRAM_BLOCKS",
]

PROGRAM_BLOCKS = 3
"""Blocks in the simulated program: the first and last differ from the rest (prefetch, edges)."""
PROGRAM_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True, slots=True)
class ProgramKey:
    """Everything that decides one rank's micro-batch program."""

    model: PlanModel
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    sp: bool
    ac: str
    micro_batch: int
    """Sequences per micro-batch on each data-parallel rank."""
    seq: int
    dtype: torch.dtype = torch.bfloat16


@dataclass(frozen=True, slots=True)
class Program:
    """One simulated micro-batch, cut into pieces (see the module docstring).

    ``embed`` runs before block 0; ``fwd_first`` / ``fwd_block`` / ``fwd_last`` are blocks 0, 1, 2
    forward; ``head`` is the norm, head, loss and their backward; ``bwd_last`` / ``bwd_block`` /
    ``bwd_first`` are blocks 2, 1, 0 backward; ``embed_bwd`` what follows; ``optimizer`` the AdamW
    step of block 1's parameters (the others' is in proportion to their bytes).
    """

    key: ProgramKey
    pieces: dict[str, Segment]
    grad_tokens: frozenset[int]
    """Storages of gradients (accumulated across micro-batches, allocated once)."""
    param_bytes: dict[str, int]
    """Local parameter bytes: "block" (one block), "embed", "head" (norm and output)."""
    optimizer_bytes_per_param_byte: float
    seconds: float
    """How long simulating it took."""


def blocks_of(model: nn.Module) -> nn.ModuleList:
    """The model's identical blocks: its ``layers`` ModuleList (the planner repeats and stages them)."""
    blocks = getattr(model, "layers", None)
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no .layers ModuleList of blocks; the planner needs one")
    return blocks


_SAVED_BY_SELECTIVE = [
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
]
"""Selective checkpointing keeps the outputs of these (the costly ops) and recomputes the rest."""


class _Checkpointed(nn.Module):
    """A block whose activations are recomputed in backward: all of them (``full``), or all but the
    matrix products' and attention's outputs (``selective``, torchtitan's op-level policy)."""

    def __init__(self, block: nn.Module, mode: str) -> None:
        super().__init__()
        self.block = block
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        modes = _get_current_function_mode_stack()  # type: ignore[no-untyped-call]

        def run(t: torch.Tensor) -> torch.Tensor:
            # the recompute in backward runs without the torch-function modes (the simulated CPU
            # attention, context parallel's); open the ones the forward ran under again
            with contextlib.ExitStack() as stack:
                if not _get_current_function_mode_stack():  # type: ignore[no-untyped-call]
                    for mode in modes:
                        stack.enter_context(mode)
                return self.block(t)

        if self.mode == "full":
            return checkpoint(run, x, use_reentrant=False)
        contexts = functools.partial(create_selective_checkpoint_contexts, _SAVED_BY_SELECTIVE)
        return checkpoint(run, x, use_reentrant=False, context_fn=contexts)


def _data_parallel_mesh(mesh: DeviceMesh, key: ProgramKey) -> DeviceMesh | None:
    """FSDP's mesh: dp_shard x cp flattened (torchtitan's), under dp_replicate for HSDP."""
    if key.dp_replicate * key.dp_shard * key.cp == 1:
        return None
    shard = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    if key.dp_replicate == 1:
        return shard
    return mesh["dp_replicate", "dp_shard_cp"]


def build(key: ProgramKey, mesh: DeviceMesh, *, layers: int = PROGRAM_BLOCKS,
          device: str = "meta") -> tuple[nn.Module, torch.optim.Optimizer]:  # fmt: skip
    """The model of ``layers`` blocks laid out as ``key`` says, and its AdamW, on ``mesh``.

    On meta in the simulated world for planning; on a real device and mesh (``device="cpu"``,
    gloo) the same code trains the layout for real, which is how the predictions are checked.
    """
    with torch.device(device):
        model = key.model.build(layers).to(key.dtype)
    if key.tp > 1:
        plan = key.model.tp_plan(key.sp)
        if plan is None:
            raise ValueError(f"{key.model} has no tensor-parallel plan; tp must be 1")
        parallelize_module(model, mesh["tp"], plan)
    if key.ac != "none":
        blocks = blocks_of(model)
        for i, block in enumerate(blocks):
            blocks[i] = _Checkpointed(block, key.ac)
    dp_mesh = _data_parallel_mesh(mesh, key)
    if dp_mesh is not None:
        for block in blocks_of(model):
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    return model, optimizer


def train_microbatch(model: nn.Module, key: ProgramKey, mesh: DeviceMesh, tokens: torch.Tensor,
                     targets: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """One micro-batch's forward and backward: this rank's ``tokens`` and ``targets`` (whole
    sequences; context parallel shards them in place). Returns the loss."""
    with _sequence_shards(mesh, key, tokens, targets):
        return _loss(model, tokens, targets, key.tp)


def _loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, tp: int) -> torch.Tensor:
    logits = model(tokens)
    if tp > 1:
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
            loss.backward()  # type: ignore[no-untyped-call]
        return loss
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
    loss.backward()  # type: ignore[no-untyped-call]
    return loss


@contextlib.contextmanager
def _sequence_shards(mesh: DeviceMesh, key: ProgramKey, tokens: torch.Tensor, targets: torch.Tensor) -> Iterator[None]:
    if key.cp == 1:
        yield
        return
    keep = {tokens, targets}
    with context_parallel(mesh["cp"], buffers=[tokens, targets], buffer_seq_dims=[1, 1], no_restore_buffers=keep):
        yield


def _mark_blocks(model: nn.Module, recorder: StepRecorder) -> list[Any]:
    """Hooks that cut the timeline at each block's forward start and backward start."""
    names = ("fwd_first", "fwd_block", "fwd_last")
    backward = ("bwd_first", "bwd_block", "bwd_last")
    handles = []
    blocks = blocks_of(model)
    for i, block in enumerate(blocks):

        def before(module: nn.Module, args: Any, i: int = i) -> None:
            recorder.mark(names[i])

        def after(module: nn.Module, args: Any, out: torch.Tensor, i: int = i) -> None:
            if i == PROGRAM_BLOCKS - 1:
                recorder.mark("head")
            if out.requires_grad:
                out.register_hook(lambda grad, i=i: recorder.mark(backward[i]))  # type: ignore[no-untyped-call]

        handles.append(block.register_forward_pre_hook(before))
        handles.append(block.register_forward_hook(after))
    first = blocks[0]

    # the end of block 0's backward: the gradient of its input
    def input_grad(module: nn.Module, args: Any) -> None:
        if args and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
            args[0].register_hook(lambda grad: recorder.mark("embed_bwd"))  # type: ignore[no-untyped-call]

    handles.append(first.register_forward_pre_hook(input_grad))
    return handles


@functools.lru_cache(maxsize=256)
def simulate_program(key: ProgramKey) -> Program:
    """Simulate ``key``'s micro-batch on one rank of its world (see the module docstring)."""
    started = time.perf_counter()
    world = key.dp_replicate * key.dp_shard * key.cp * key.tp
    shape = tuple(getattr(key, dim) for dim in PROGRAM_DIMS)
    with use_world(SimulatedWorld(world, rank=0)), MetaAsCpu():
        mesh = init_device_mesh("meta", shape, mesh_dim_names=PROGRAM_DIMS)
        model, _ = build(key, mesh)
        # AdamW's work and state are in proportion to the parameters: block 1's stand for all of them
        optimizer = torch.optim.AdamW(blocks_of(model)[1].parameters(), lr=1e-4, foreach=False)
        init_optimizer_state(optimizer)
        optimizer.zero_grad()
        param_bytes = _param_bytes(model)
        optimizer_bytes = sum(_local(v).nbytes for s in optimizer.state.values() for v in s.values() if v.ndim)
        tokens = torch.empty(key.micro_batch, key.seq, dtype=torch.long, device="meta")
        targets = torch.empty_like(tokens)
        with StepRecorder(local_storages(model, optimizer)) as recorder:
            handles = _mark_blocks(model, recorder)
            recorder.mark("embed")
            train_microbatch(model, key, mesh, tokens, targets)
            recorder.mark("optimizer")
            optimizer.step()
            for handle in handles:
                handle.remove()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        grad_tokens = frozenset(t for g in grads if (t := recorder.token_of(_local(g).untyped_storage())) is not None)
    return Program(
        key=key,
        pieces=recorder.pieces(),
        grad_tokens=grad_tokens,
        param_bytes=param_bytes,
        optimizer_bytes_per_param_byte=optimizer_bytes / max(param_bytes["block"], 1),
        seconds=time.perf_counter() - started,
    )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _param_bytes(model: nn.Module) -> dict[str, int]:
    """Local parameter bytes of one block, before the blocks ("embed") and after them ("head").

    For a module other than the built-in Llama, everything outside the blocks counts as "embed".
    """

    def local_bytes(module: nn.Module) -> int:
        return sum(_local(p).nbytes for p in module.parameters())

    blocks = blocks_of(model)
    block = local_bytes(blocks[1])
    names = ("tok_embeddings", "norm", "output")
    if not all(hasattr(model, name) for name in names):
        return {"block": block, "embed": local_bytes(model) - len(blocks) * block, "head": 0}
    part = model.get_submodule
    head = local_bytes(part("norm")) + local_bytes(part("output"))
    return {"block": block, "embed": local_bytes(part("tok_embeddings")), "head": head}


@dataclass(frozen=True, slots=True)
class WholeStep:
    """One micro-batch of the whole model simulated at once (no pieces): what composition must equal."""

    peak: int
    """Parameters, optimizer state and the step's peak (gradients included), as ``StageEstimate.peak``."""
    flops: int
    records: tuple[tuple[str, int, int], ...]
    """(kind, group size, buffer bytes) of every collective, in order."""
    traffic: int = 0
    """Bytes the memory-bound ops read and write."""


def simulate_whole(key: ProgramKey, layers: int) -> WholeStep:
    """Simulate one micro-batch of all ``layers`` blocks and the optimizer step, without cutting it.

    Slower than ``simulate_program`` for deep models; the tests compare the two.
    """
    world = key.dp_replicate * key.dp_shard * key.cp * key.tp
    shape = tuple(getattr(key, dim) for dim in PROGRAM_DIMS)
    with use_world(SimulatedWorld(world, rank=0)), MetaAsCpu():
        mesh = init_device_mesh("meta", shape, mesh_dim_names=PROGRAM_DIMS)
        model, optimizer = build(key, mesh, layers=layers)
        init_optimizer_state(optimizer)
        optimizer.zero_grad()
        params = sum(_local(p).nbytes for p in model.parameters())
        state = sum(_local(v).nbytes for s in optimizer.state.values() for v in s.values() if v.ndim)
        tokens = torch.empty(key.micro_batch, key.seq, dtype=torch.long, device="meta")
        targets = torch.empty_like(tokens)
        with StepRecorder(local_storages(model, optimizer)) as recorder:
            train_microbatch(model, key, mesh, tokens, targets)
            optimizer.step()
    records = tuple((r.kind, r.group_size, r.tensor_bytes) for r in recorder.comm.records)
    return WholeStep(params + state + recorder.peak(), recorder.flops, records, recorder.traffic)
