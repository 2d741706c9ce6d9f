"""Train a small GPT-style decoder with tensor + data parallelism on a 2-d mesh (dp=2, tp=2).

Every parameter is a DTensor on the mesh. ``parallelize_module(model, mesh, tp_plan(...))`` shards
it Megatron-style over ``tp`` (column-wise q/k/v and MLP up, row-wise attention out and MLP down,
so heads split across tp). The batch is a DTensor sharded over ``dp``, so each data-parallel rank
trains on its own slice. Over ``dp`` parameters are either replicated (their gradients come back
``Partial(sum)`` over dp and a gradient hook reduces them to the parameter's layout) or, with
``--fsdp``, fully sharded (ZeRO-3: ``fully_shard`` per block and on the root gathers them for
forward and backward only and reduce-scatters the gradients). The loss is computed vocab-parallel
(``loss_parallel``) on the tp-sharded logits. The model and its plans are ``spmd/testing/models.py``'s,
the same ones ``python -m spmd.simulate --model gpt`` simulates at any size.

    python examples/train_transformer.py                        # 4 ranks as threads of one process
    python examples/train_transformer.py --check                # also compare with one device
    python examples/train_transformer.py --fsdp --check         # parameters, grads, AdamW state / (dp*tp)
    python examples/train_transformer.py --no-sequence-parallel # norms on whole (replicated) activations
    python examples/train_transformer.py --steps 10 --save ckpt/step-10          # a DCP checkpoint
    python examples/train_transformer.py --steps 20 --resume ckpt/step-10 --dp 1 --tp 4 --check  # any mesh
    python examples/train_transformer.py --compile inductor --check  # forward, backward, AdamW compiled
    python examples/train_transformer.py --compile --fsdp --check    # each block compiled, fully_shard's hooks eager
    torchrun --nproc-per-node 4 --master-addr 127.0.0.1 --master-port 29541 examples/train_transformer.py

Under torchrun (detected by the RANK env var) the ranks are processes talking over gloo;
``--dp``/``--tp`` choose the mesh, whose size must equal the world size.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from spmd import checkpoint
from spmd.tensor import DeviceMesh, DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.tensor_parallel import loss_parallel
from spmd.testing import run_threaded
from spmd.testing.models import GPT, apply_tp_and_dp

try:
    from tqdm import tqdm  # type: ignore[import-untyped, unused-ignore]
except ImportError:  # tqdm is optional: without it, one line per step
    tqdm = None


@dataclass(frozen=True, kw_only=True)
class Config:
    """Model, data and mesh sizes of one run."""

    vocab_size: int = 128
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    seq_len: int = 32
    dtype: torch.dtype = torch.float32
    """Parameter dtype."""
    batch_size: int = 8
    """Global batch: each dp rank gets batch_size / dp sequences."""
    steps: int = 20
    lr: float = 1e-2
    seed: int = 0
    dp: int = 2
    tp: int = 2
    sequence_parallel: bool = True
    """Run the norms on activations sharded over tp on the sequence dim."""
    fsdp: bool = False
    """Shard parameters, gradients and optimizer state over dp too (ZeRO-3) instead of replicating them."""
    save: str | None = None
    """Directory to write a distributed checkpoint (DCP's format) to after the last step."""
    resume: str | None = None
    """Checkpoint directory to continue from: its step, weights and AdamW state, on this run's mesh."""
    compile: str | None = None
    """torch.compile backend ("inductor", "aot_eager") for forward + loss (+ their backward) and the
    optimizer step, or None."""


# ----- the model (GPT) and its plans (tp_plan, apply_tp_and_dp) are spmd/testing/models.py's ----
def build_model(cfg: Config) -> GPT:
    """The model with weights drawn from a generator of its own (rank threads share torch's global RNG)."""
    model = GPT(cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                std = 0.02 / math.sqrt(2 * cfg.n_layers) if name.endswith(("out.weight", "down.weight")) else 0.02
                param.normal_(0.0, std, generator=gen)
    return model


def batch_at(cfg: Config, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets of one global batch from a synthetic corpus.

    Each sequence walks a fixed random permutation of the vocabulary from a random start, so the
    next token is a function of the current one and the loss visibly falls.
    """
    successor = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(1234))
    gen = torch.Generator().manual_seed(cfg.seed * 100_003 + step)
    tokens = torch.empty(cfg.batch_size, cfg.seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(cfg.vocab_size, (cfg.batch_size,), generator=gen)
    for i in range(cfg.seq_len):
        tokens[:, i + 1] = successor[tokens[:, i]]
    return tokens[:, :-1], tokens[:, 1:]


# ----- training ----------------------------------------------------------------------------------
def next_token_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Forward and the cross entropy of every position (vocab-parallel inside ``loss_parallel``)."""
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    loss_fn: Any = next_token_loss,
    optimizer_step: Any = None,
) -> float:
    """One step of next-token prediction; returns the loss (the mean over the global batch).

    The gradients are cleared at the start, so after the step they are there to be looked at.
    ``loss_fn`` may be ``next_token_loss`` compiled, ``optimizer_step`` the optimizer's step compiled
    (``--compile``).
    """
    optimizer.zero_grad()
    with loss_parallel():
        loss = loss_fn(model, inputs, targets)
        loss.backward()  # type: ignore[no-untyped-call]
    (optimizer_step or optimizer.step)()
    return float(loss.full_tensor().item() if isinstance(loss, DTensor) else loss.item())


def compile_model(model: GPT, cfg: Config, world_size: int) -> Any:
    """Compile with ``cfg.compile``'s backend; the loss function to train with.

    Without fully_shard: forward + loss in one graph (and their backward). With it, each block's
    forward is compiled and fully_shard's hooks (which gather and free parameters around it) run
    eagerly outside, as torchtitan does; embeddings, final norm, head and loss stay eager.
    """
    # Each rank thread compiles its own graphs (they bake in its shard): allow that many per
    # function (torch's default limit is 8); the blocks share one code object.
    limit = 2 * world_size * (cfg.n_layers if cfg.fsdp else 1)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
    if not cfg.fsdp:
        return torch.compile(next_token_loss, backend=cfg.compile, fullgraph=True)
    for block in model.layers:
        block.forward = torch.compile(block.forward, backend=cfg.compile, fullgraph=True)  # type: ignore[method-assign]
    return next_token_loss


def make_optimizer(model: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    # foreach=False: torch's default on CPU, spelled out so that every run takes the same per-parameter path
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01, foreach=False)


def train(cfg: Config) -> list[float]:
    """Train on the (dp, tp) mesh of the current world (threads or torchrun processes); the loss per step."""
    mesh = init_device_mesh("cpu", (cfg.dp, cfg.tp), mesh_dim_names=("dp", "tp"))
    is_rank_0 = mesh.get_rank() == 0
    model = apply_tp_and_dp(build_model(cfg), mesh, sequence_parallel=cfg.sequence_parallel, fsdp=cfg.fsdp)
    optimizer = make_optimizer(model, cfg)
    loss_fn = compile_model(model, cfg, mesh.size()) if cfg.compile else next_token_loss
    # torch's "compiled optimizer": one graph for the AdamW update of every parameter
    optimizer_step = torch.compile(optimizer.step, backend=cfg.compile) if cfg.compile else optimizer.step

    def place(batch: torch.Tensor) -> DTensor:
        # Every rank can build the global batch here; src_data_rank=None keeps its own dp slice, no traffic.
        return distribute_tensor(batch, mesh, [Shard(0), Replicate()], src_data_rank=None)

    start = load_checkpoint(model, optimizer, cfg.resume) if cfg.resume else 0
    losses: list[float] = []
    progress = _Progress(cfg, start=start, enabled=is_rank_0)
    comm = CommDebugMode()
    for step in range(start, cfg.steps):
        inputs, targets = batch_at(cfg, step)
        # Count the collectives of a warm step (the first step also creates the optimizer state).
        # Not under --compile: CommDebugMode's module hooks are process-wide, and rank threads
        # compiling while others add and remove them would trace (and guard on) each other's hooks.
        counted = step == min(start + 1, cfg.steps - 1) and not cfg.compile
        with comm if counted else contextlib.nullcontext():
            losses.append(train_step(model, optimizer, place(inputs), place(targets), loss_fn, optimizer_step))
        progress.update(step, losses[-1])
    progress.close()
    if cfg.save:
        save_checkpoint(model, optimizer, cfg.save, step=max(start, cfg.steps))
        if is_rank_0:
            print(f"saved step {max(start, cfg.steps)} to {cfg.save} (dp={cfg.dp}, tp={cfg.tp})")
    rows = _memory_rows(model, optimizer, mesh)  # after the last step: parameters, gradients, AdamW state
    if is_rank_0:
        _print_summary(cfg, rows, comm)
    return losses


def save_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str, *, step: int) -> None:
    """Write the model, its AdamW state and the step count as a DCP checkpoint (each rank its own blocks)."""
    model_state, optim_state = checkpoint.get_state_dict(model, optimizer)
    checkpoint.save({"model": model_state, "optim": optim_state, "step": step}, directory)


def load_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str) -> int:
    """Fill the model and optimizer from a checkpoint saved on any mesh; the step to continue from."""
    model_state, optim_state = checkpoint.get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "step": 0}
    checkpoint.load(state, directory)
    checkpoint.set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["step"])


def train_single_device(cfg: Config) -> list[float]:
    """The same steps in plain torch on one device: the oracle for the distributed run."""
    model = build_model(cfg)
    optimizer = make_optimizer(model, cfg)
    return [train_step(model, optimizer, *batch_at(cfg, step)) for step in range(cfg.steps)]


# ----- output: progress, memory and collectives --------------------------------------------------
class _Progress:
    """A tqdm bar with loss and tokens/s when tqdm is installed, else one line per step (rank 0 only)."""

    def __init__(self, cfg: Config, *, start: int = 0, enabled: bool) -> None:
        self.enabled, self.tokens_per_step = enabled, cfg.batch_size * cfg.seq_len
        self.first, self.steps = start, cfg.steps
        self.clock = time.perf_counter()
        self.bar = (
            tqdm(total=cfg.steps, initial=start, desc="train", unit="step") if enabled and tqdm is not None else None
        )

    def update(self, step: int, loss: float) -> None:
        if not self.enabled:
            return
        tokens_per_s = (step + 1 - self.first) * self.tokens_per_step / (time.perf_counter() - self.clock)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}")
            self.bar.update(1)
        else:
            print(f"step {step + 1:>3}/{self.steps}  loss {loss:.4f}  {tokens_per_s:,.0f} tokens/s", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.enabled:
            ran = max(self.steps - self.first, 0)
            print(f"trained {ran} steps in {time.perf_counter() - self.clock:.1f} s")


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


@dataclass(frozen=True)
class MemoryRow:
    """Bytes one rank holds of the training state: its local shards."""

    rank: int
    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer


def _local_bytes(tensor: torch.Tensor | None) -> int:
    if tensor is None:
        return 0
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).nbytes


def _memory_rows(model: nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh) -> list[MemoryRow]:
    """Every rank's bytes of parameters, gradients and optimizer state (tensors, not the step count)."""
    params = list(model.parameters())
    state = [v for p in params for v in optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor) and v.ndim]
    mine = MemoryRow(
        mesh.get_rank(),
        sum(_local_bytes(p) for p in params),
        sum(_local_bytes(p.grad) for p in params),
        sum(_local_bytes(v) for v in state),
    )
    value: Any = mine
    for d in reversed(range(mesh.ndim)):
        value = mesh.get_communicator(d).all_gather_object(value)
    return sorted(_flatten(value), key=lambda row: row.rank)


def _flatten(value: Any) -> list[MemoryRow]:
    return [value] if isinstance(value, MemoryRow) else [row for item in value for row in _flatten(item)]


def _print_summary(cfg: Config, rows: list[MemoryRow], comm: CommDebugMode) -> None:
    model = sum(p.nbytes for p in GPT(cfg).parameters())
    full = 4 * model  # parameters, gradients and AdamW's two moments, on one device
    dp = "fully sharded (--fsdp)" if cfg.fsdp else "replicated"
    print(f"\nmemory per rank after a step, dp={cfg.dp} {dp} x tp={cfg.tp} (one device: {_human_bytes(full)})")
    print(f"  {'rank':<6}{'params':>11}{'grads':>11}{'AdamW':>11}{'total':>11}  of one device")
    for row in rows:
        cells = "".join(f"{_human_bytes(n):>11}" for n in (row.params, row.grads, row.optimizer, row.total))
        print(f"  {row.rank:<6}{cells}  {row.total / full:6.1%} (1/{full / row.total:.2f})")
    if cfg.compile:
        print("\ncollectives per training step: not counted with --compile (see docs/compile.md)")
        return
    counts, sizes = comm.get_comm_counts(), comm.get_comm_bytes()
    print("\ncollectives per training step (the second step run, forward + backward + optimizer)")
    print(f"  {'collective':<20}{'count':>7}{'bytes':>12}")
    for kind in sorted(counts):
        print(f"  {kind:<20}{counts[kind]:>7}{_human_bytes(sizes.get(kind, 0)):>12}")
    print(f"  {'total':<20}{comm.get_total_counts():>7}{_human_bytes(comm.get_total_bytes()):>12}")
    print("\ncollectives per layer (the second step run)")
    for phase, backward in (("forward", False), ("backward", True)):
        per_module = comm.get_per_module_comm_counts(backward=backward)
        for i in range(cfg.n_layers):
            layer = f"GPT.layers.{i}"
            # under --fsdp the root's class reads FSDPGPT: fully_shard made it an FSDPModule subclass
            kinds = per_module.get(layer) or per_module.get(f"FSDP{layer}", {})
            listed = ", ".join(f"{kind} {kinds[kind]}" for kind in sorted(kinds)) or "none"
            print(f"  {layer:<14}{phase:<10}{listed}")


# ----- command line ------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> tuple[Config, bool]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=Config.steps)
    parser.add_argument("--dp", type=int, default=Config.dp, help="data-parallel degree")
    parser.add_argument("--tp", type=int, default=Config.tp, help="tensor-parallel degree")
    parser.add_argument(
        "--sequence-parallel",
        action=argparse.BooleanOptionalAction,
        default=Config.sequence_parallel,
        help="shard the norms' activations over tp on the sequence dim (default on)",
    )
    parser.add_argument(
        "--fsdp", action="store_true", help="fully shard parameters, gradients and AdamW state over dp (ZeRO-3)"
    )
    parser.add_argument("--save", metavar="DIR", help="write a distributed checkpoint (DCP) after the last step")
    parser.add_argument(
        "--resume", metavar="DIR", help="continue from a checkpoint, saved on any mesh, up to --steps in all"
    )
    parser.add_argument("--check", action="store_true", help="compare the loss curve with a single-device run")
    parser.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        choices=("inductor", "aot_eager", "eager"),
        help="run forward + loss (and their backward) under torch.compile(fullgraph=True), with --fsdp each "
        "block's forward, and the optimizer step compiled; default backend inductor",
    )
    args = parser.parse_args(argv)
    cfg = Config(
        steps=args.steps,
        dp=args.dp,
        tp=args.tp,
        sequence_parallel=args.sequence_parallel,
        fsdp=args.fsdp,
        save=args.save,
        resume=args.resume,
        compile=args.compile,
    )
    return cfg, args.check


def check_against_single_device(cfg: Config, losses: Sequence[float]) -> None:
    """Raise if the distributed loss curve differs from one device's (rtol 1e-4).

    A resumed run is compared with the last steps of an uninterrupted single-device run.
    """
    if not losses:
        print("no step ran (the checkpoint is already at --steps); nothing to compare")
        return
    expected = train_single_device(replace(cfg, dp=1, tp=1, fsdp=False))[cfg.steps - len(losses) :]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=1e-6)
    print(f"loss matches single device ({len(expected)} steps, {expected[0]:.4f} -> {expected[-1]:.4f})")


def main(argv: Sequence[str] | None = None) -> list[float]:
    """Run the demo: under torchrun one rank per process, else dp * tp ranks as threads of this process."""
    cfg, check = parse_args(argv)
    if "RANK" in os.environ:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size != cfg.dp * cfg.tp:
            raise ValueError(
                f"torchrun started {world_size} processes but the mesh is dp={cfg.dp} x tp={cfg.tp}; "
                f"pass --dp and --tp whose product is {world_size}"
            )
        try:
            losses = train(cfg)
            dist.barrier()  # no rank tears the group down while a peer still has work in flight
            if check and dist.get_rank() == 0:
                check_against_single_device(cfg, losses)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        return losses
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the rank threads already keep the cores busy
    try:
        # Compiles are serialised (torch.compile holds a process-wide lock), so peers wait longer.
        timeout = 600.0 if cfg.compile else 60.0
        losses = run_threaded(train, cfg.dp * cfg.tp, cfg, timeout=timeout)[0]
    finally:
        torch.set_num_threads(threads)
    if check:
        check_against_single_device(cfg, losses)
    return losses


if __name__ == "__main__":
    main()
