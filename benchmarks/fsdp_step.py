"""Training-step time and memory of the demo GPT under FSDP x TP: ours vs torch's ``fully_shard`` + TP.

Run ``python benchmarks/fsdp_step.py`` (``--quick`` for fewer steps, ``--steps N`` to choose).

4 gloo processes over loopback form a (dp=2, tp=2) mesh. Both libraries train the same model
(``examples/train_transformer.py``'s ``build_model``, same seed and sizes) with the same
torchtitan-shaped plan: sequence-parallel norms, q/k/v and MLP up column-wise, attention out and
MLP down row-wise to sequence shards, a column-wise head with vocab-sharded logits and
``loss_parallel``, then ``fully_shard`` on every block and on the root over dp; AdamW
(``foreach=False``) steps on the shards.

* ours: the demo's ``apply_tp_and_dp(..., fsdp=True)`` on the 2-d mesh; the batch is a DTensor
  sharded over dp, every activation a DTensor.
* ours with ``--layout fsdp2``: torch's program below, with spmd's imports (FSDP2's layout).
* ours with ``--first-free-dim``: either of the above with ``shard_placement_fn=shard_first_free_dim``
  (spmd's former default: dp cuts the first dim tp does not, no ``_StridedShard``); torch keeps its own.
* torch's: ``torch.distributed.tensor.parallel.parallelize_module`` on ``mesh["tp"]`` and
  ``torch.distributed.fsdp.fully_shard`` on ``mesh["dp"]``; each rank feeds its own slice of the
  batch as a plain tensor, and attention runs the rank's own heads (``n_heads / tp``), as
  torchtitan does. Its embedding is row-wise to a replicated output (then cut to sequence shards
  by a ``PrepareModuleInput`` on the first block): the position embedding, added at the root, is
  a whole ``[seq, dim]`` tensor there, which a local sequence shard could not be added to.

A step is ``zero_grad``, forward, backward and ``AdamW.step``; its time is rank 0's wall clock,
median over the timed steps after the warm-up ones, the two libraries' steps alternating (a barrier
before each). Memory is each rank's bytes of parameters + gradients + AdamW state after a step
(local shards), the largest over the ranks. The global losses of the two must agree on every step.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from spmd.testing import run_multiprocess
from spmd.testing.models import Block

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from train_transformer import Config, apply_tp_and_dp, batch_at, build_model

DP, TP = 2, 2
WORLD = DP * TP
TIMEOUT_S = 300.0
"""Longest the gloo world may take."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Result:
    """One library on rank 0: step times (seconds), global losses of the timed steps, peak state bytes."""

    step_s: tuple[float, ...]
    losses: tuple[float, ...]
    state_bytes: int
    """Largest over the ranks of params + grads + AdamW state (local bytes) after a step."""

    @property
    def median_ms(self) -> float:
        return statistics.median(self.step_s) * 1e3


def _local_bytes(tensor: torch.Tensor | None) -> int:
    if tensor is None:
        return 0
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return int(local.nbytes)


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """This rank's bytes of parameters, gradients and optimizer state tensors (not the step counters)."""
    params = list(model.parameters())
    total = sum(_local_bytes(p) + _local_bytes(p.grad) for p in params)
    for p in params:
        total += sum(_local_bytes(v) for v in optimizer.state.get(p, {}).values() if torch.is_tensor(v) and v.ndim)
    return total


# ----- ours ---------------------------------------------------------------------------------------
class _Ours:
    def __init__(self, cfg: Config, *, first_free_dim: bool = False) -> None:
        from spmd.fsdp import fully_shard, shard_first_free_dim
        from spmd.tensor import Replicate, Shard, distribute_tensor, init_device_mesh
        from spmd.tensor_parallel import loss_parallel, parallelize_module
        from spmd.testing.models import tp_plan

        self.cfg, self.loss_parallel = cfg, loss_parallel
        self.mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
        if first_free_dim:  # the demo's apply_tp_and_dp, spelled out to pass shard_placement_fn
            self.model = parallelize_module(build_model(cfg), self.mesh, tp_plan(sequence_parallel=True))
            fn = shard_first_free_dim(self.mesh["dp"])
            for block in self.model.layers:
                fully_shard(block, mesh=self.mesh, shard_placement_fn=fn)
            fully_shard(self.model, mesh=self.mesh, shard_placement_fn=fn)
        else:
            self.model = apply_tp_and_dp(build_model(cfg), self.mesh, sequence_parallel=True, fsdp=True)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=0.01, foreach=False)
        self.place: Callable[[torch.Tensor], Any] = lambda t: distribute_tensor(
            t, self.mesh, [Shard(0), Replicate()], src_data_rank=None
        )

    def step(self, step: int) -> tuple[float, float]:
        inputs, targets = (self.place(t) for t in batch_at(self.cfg, step))
        start = time.perf_counter()
        self.optimizer.zero_grad()
        logits = self.model(inputs)
        with self.loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
            loss.backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()
        value = float(loss.full_tensor().item())  # the global mean
        return time.perf_counter() - start, value


# ----- torch's ------------------------------------------------------------------------------------
class _Torch:
    """torchtitan's layout: TP on ``mesh["tp"]``, fully_shard on ``mesh["dp"]``, each rank its own plain batch."""

    def __init__(self, cfg: Config, *, library: str = "torch", first_free_dim: bool = False) -> None:
        options: dict[str, Any] = {}
        if library == "spmd":  # the same program on spmd's FSDP2-compatible fully_shard (--layout fsdp2)
            from spmd.fsdp import fully_shard, shard_first_free_dim
            from spmd.tensor import Replicate, Shard, init_device_mesh
            from spmd.tensor_parallel import (
                ColwiseParallel,
                PrepareModuleInput,
                RowwiseParallel,
                SequenceParallel,
                loss_parallel,
                parallelize_module,
            )
        else:
            from torch.distributed.device_mesh import init_device_mesh  # type: ignore[assignment]
            from torch.distributed.fsdp import fully_shard  # type: ignore[no-redef]
            from torch.distributed.tensor import Replicate, Shard  # type: ignore[assignment]
            from torch.distributed.tensor.parallel import (  # type: ignore[assignment]
                ColwiseParallel,
                PrepareModuleInput,
                RowwiseParallel,
                SequenceParallel,
                loss_parallel,
                parallelize_module,
            )

        self.cfg, self.loss_parallel = cfg, loss_parallel
        mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
        self.dp_group, self.dp_rank = mesh.get_group("dp"), mesh.get_local_rank("dp")
        model = build_model(cfg)
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan: dict[str, Any] = {
            "tok_emb": RowwiseParallel(input_layouts=Replicate()),
            "layers.0": PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
            ),
            "norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
        }
        for i in range(cfg.n_layers):
            plan.update({
                f"layers.{i}.attn_norm": SequenceParallel(),
                f"layers.{i}.attn": gather,
                f"layers.{i}.attn.q": ColwiseParallel(),
                f"layers.{i}.attn.k": ColwiseParallel(),
                f"layers.{i}.attn.v": ColwiseParallel(),
                f"layers.{i}.attn.out": RowwiseParallel(output_layouts=Shard(1)),
                f"layers.{i}.mlp_norm": SequenceParallel(),
                f"layers.{i}.mlp": gather,
                f"layers.{i}.mlp.up": ColwiseParallel(),
                f"layers.{i}.mlp.down": RowwiseParallel(output_layouts=Shard(1)),
            })  # fmt: skip
        parallelize_module(model, mesh["tp"], plan)
        if first_free_dim:
            options["shard_placement_fn"] = shard_first_free_dim(mesh["dp"])
        for block in model.layers:
            assert isinstance(block, Block)
            block.attn.n_heads //= TP  # each rank's q/k/v output holds its own heads
            fully_shard(block, mesh=mesh["dp"], **options)
        fully_shard(model, mesh=mesh["dp"], **options)
        self.model: nn.Module = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01, foreach=False)

    def step(self, step: int) -> tuple[float, float]:
        inputs, targets = (t.chunk(DP)[self.dp_rank] for t in batch_at(self.cfg, step))
        start = time.perf_counter()
        self.optimizer.zero_grad()
        logits = self.model(inputs)
        with self.loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
            loss.backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()
        local = loss.full_tensor().detach()  # the mean over this dp rank's slice
        seconds = time.perf_counter() - start
        dist.all_reduce(local, group=self.dp_group)  # outside the timing: only to compare the losses
        return seconds, float(local.item()) / DP


# ----- the gloo world -----------------------------------------------------------------------------
def _quiet_torch() -> None:
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)


def _compare_on_this_rank(
    cfg: Config, warmup: int, steps: int, layout: str = "same-mesh", first_free_dim: bool = False
) -> tuple[Result, Result]:
    """One rank of the gloo world: both libraries' steps, interleaved; (ours, torch's)."""
    _quiet_torch()
    spmd_trainer = (
        _Torch(cfg, library="spmd", first_free_dim=first_free_dim)
        if layout == "fsdp2"
        else _Ours(cfg, first_free_dim=first_free_dim)
    )
    trainers: list[_Ours | _Torch] = [spmd_trainer, _Torch(cfg)]
    times: list[list[float]] = [[], []]
    losses: list[list[float]] = [[], []]
    for step in range(warmup + steps):
        for i, trainer in enumerate(trainers):
            dist.barrier()
            seconds, loss = trainer.step(step)
            if step >= warmup:
                times[i].append(seconds)
                losses[i].append(loss)
    peaks = []
    for trainer in trainers:
        mine = torch.tensor([state_bytes(trainer.model, trainer.optimizer)], dtype=torch.int64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        peaks.append(int(mine.item()))
    ours, theirs = (
        Result(step_s=tuple(t), losses=tuple(ls), state_bytes=peak) for t, ls, peak in zip(times, losses, peaks)
    )
    return ours, theirs


def measure(
    cfg: Config, *, warmup: int, steps: int, layout: str = "same-mesh", first_free_dim: bool = False
) -> tuple[Result, Result]:
    """Both libraries on 4 spawned gloo processes; (ours, torch's) as seen by rank 0."""
    ours, theirs = run_multiprocess(
        _compare_on_this_rank, WORLD, cfg, warmup, steps, layout, first_free_dim, timeout=TIMEOUT_S
    )[0]
    return ours, theirs


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB"


def print_report(cfg: Config, ours: Result, theirs: Result, *, warmup: int, steps: int) -> None:
    full = 4 * sum(p.nbytes for p in build_model(cfg).parameters())  # params, grads, 2 AdamW moments
    print(
        f"demo GPT (d_model={cfg.d_model}, layers={cfg.n_layers}, heads={cfg.n_heads}, vocab={cfg.vocab_size}, "
        f"batch={cfg.batch_size}x{cfg.seq_len}), FSDP dp={DP} x TP tp={TP} on {WORLD} gloo processes; "
        f"median of {steps} steps after {warmup} warm-up"
    )
    print(f"{'':<34}{'ours':>12}{'torch':>12}{'ours/torch':>12}")
    print(
        f"{'step time (ms)':<34}{ours.median_ms:>12.2f}{theirs.median_ms:>12.2f}{ours.median_ms / theirs.median_ms:>12.2f}"
    )
    print(
        f"{'params+grads+AdamW per rank (max)':<34}{_kib(ours.state_bytes):>12}{_kib(theirs.state_bytes):>12}"
        f"{ours.state_bytes / theirs.state_bytes:>12.2f}"
    )
    print(
        f"{'  fraction of one device':<34}{ours.state_bytes / full:>12.1%}{theirs.state_bytes / full:>12.1%}"
        f"   (one device: {_kib(full)}; 1/(dp*tp) = {1 / WORLD:.1%})"
    )
    diff = max(abs(a - b) for a, b in zip(ours.losses, theirs.losses))
    print(f"max |loss difference| over the timed steps: {diff:.2e}")


def main(argv: Sequence[str] | None = None) -> tuple[Result, Result]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per library")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--quick", action="store_true", help="2 warm-up and 5 timed steps")
    parser.add_argument(
        "--layout",
        choices=("same-mesh", "fsdp2"),
        default="same-mesh",
        help="ours on the demo's one 2-d mesh (default), or on torchtitan's layout: the very program torch runs",
    )
    parser.add_argument(
        "--first-free-dim",
        action="store_true",
        help="ours with shard_placement_fn=shard_first_free_dim (spmd's former layout, no _StridedShard)",
    )
    args = parser.parse_args(argv)
    warmup, steps = (2, 5) if args.quick else (args.warmup, args.steps)
    if steps < 1:
        raise ValueError(f"--steps must be at least 1, got {steps}")
    cfg = replace(Config(), dp=DP, tp=TP, steps=warmup + steps, fsdp=True)
    _quiet_torch()
    start = time.perf_counter()
    ours, theirs = measure(cfg, warmup=warmup, steps=steps, layout=args.layout, first_free_dim=args.first_free_dim)
    print_report(cfg, ours, theirs, warmup=warmup, steps=steps)
    print(f"ran in {time.perf_counter() - start:.1f} s")
    with contextlib.suppress(Exception):
        torch.testing.assert_close(torch.tensor(ours.losses), torch.tensor(theirs.losses), rtol=1e-4, atol=1e-5)
        print("losses agree (rtol 1e-4)")
    return ours, theirs


if __name__ == "__main__":
    main()
