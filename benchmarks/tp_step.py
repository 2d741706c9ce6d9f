"""Training-step time of the demo GPT under tensor parallelism: ours vs ``torch.distributed.tensor.parallel``.

Run ``python benchmarks/tp_step.py`` (``--quick`` for fewer steps, ``--steps N`` to choose,
``--profile`` for a cProfile of as many more of our steps, after the timed ones, on gloo rank 0).

Both libraries parallelise the same model (``examples/train_transformer.py``'s ``build_model``,
same seed, same sizes) over a 1-d tp mesh of 2 with the same standard Megatron plan: q, k, v and
MLP up column-wise, attention out and MLP down row-wise, lm_head column-wise with vocab-sharded
DTensor logits and the loss computed under each library's ``loss_parallel``. Embeddings and norms
stay plain replicated tensors, and each rank's attention runs its own heads (``n_heads / tp``),
as torchtitan does. A step is forward, backward and ``AdamW.step`` + ``zero_grad``; its time is
rank 0's wall clock, median over the timed steps after the warm-up ones.

Two worlds, each timing both libraries in the same run:

* gloo: 2 spawned processes over loopback; ours and torch's share the default group, and their
  steps alternate (a barrier before each) so that load from other jobs hits both alike.
* threaded: 2 ranks as threads of this process; ours on ``spmd.testing.run_threaded``, torch's on
  its in-process threaded process group (``torch.testing._internal.distributed.multi_threaded_pg``,
  as ``spawn_threads_and_init_comms`` uses it).

Losses of the two libraries must agree on every timed step; the table prints the largest difference.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import logging
import os
import pstats
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from train_transformer import Config, batch_at, build_model

from spmd.testing import run_multiprocess
from spmd.testing.models import Block

TP = 2
TIMEOUT_S = 120.0
"""Longest one world (processes or threads) may take."""
PROFILE_TOP = 25


@dataclass(frozen=True, kw_only=True, slots=True)
class Timing:
    """One library's steps on rank 0: the step times (seconds) and the losses of the timed steps."""

    step_s: tuple[float, ...]
    losses: tuple[float, ...]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.step_s) * 1e3


@dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    """One setting of the table: both libraries' timings, or why one of them has none."""

    setting: str
    ours: Timing | str
    torch: Timing | str


# ----- one library's model and step --------------------------------------------------------------
class _Library:
    """The names a TP run needs from one library: ours (``spmd``) or torch's."""

    def __init__(self, name: str, *, loss_parallel_held: bool = False) -> None:
        """``loss_parallel_held``: the caller keeps torch's ``loss_parallel`` open around all rank threads."""
        self.name = name
        if name == "ours":
            from spmd.tensor import init_device_mesh
            from spmd.tensor_parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module
        else:
            from torch.distributed.device_mesh import init_device_mesh  # type: ignore[assignment]
            from torch.distributed.tensor.parallel import (  # type: ignore[assignment]
                ColwiseParallel,
                RowwiseParallel,
                loss_parallel,
                parallelize_module,
            )
        self.init_device_mesh, self.parallelize_module = init_device_mesh, parallelize_module
        self.loss_parallel: Callable[[], contextlib.AbstractContextManager[Any]] = loss_parallel
        self.colwise, self.rowwise = ColwiseParallel, RowwiseParallel
        if loss_parallel_held:
            self.loss_parallel = contextlib.nullcontext

    def tp_plan(self) -> dict[str, Any]:
        col, row = self.colwise, self.rowwise
        return {
            "layers.*.attn.q": col(),
            "layers.*.attn.k": col(),
            "layers.*.attn.v": col(),
            "layers.*.attn.out": row(),
            "layers.*.mlp.up": col(),
            "layers.*.mlp.down": row(),
            "lm_head": col(use_local_output=False),  # vocab-sharded logits for loss_parallel
        }


class _Trainer:
    """The demo model parallelised by one library, its optimizer, and one timed training step."""

    def __init__(self, library: _Library, cfg: Config) -> None:
        self.library, self.cfg = library, cfg
        mesh = library.init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
        model = build_model(cfg)
        library.parallelize_module(model, mesh, library.tp_plan())  # in place
        for block in model.layers:
            assert isinstance(block, Block)
            block.attn.n_heads //= TP  # each rank's q/k/v output holds its own heads
        self.model: nn.Module = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)

    def step(self, step: int) -> tuple[float, float]:
        """One training step on the global batch of ``step``: (seconds, loss)."""
        inputs, targets = batch_at(self.cfg, step)
        start = time.perf_counter()
        logits = self.model(inputs)
        with self.library.loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
            loss.backward()  # type: ignore[no-untyped-call]
        self.optimizer.step()
        self.optimizer.zero_grad()
        value = float(loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item())
        return time.perf_counter() - start, value


def run_steps(
    trainers: Sequence[_Trainer], *, warmup: int, steps: int, barrier: Callable[[], None] | None = None
) -> list[Timing]:
    """Alternate the trainers' steps (all of step i, then step i + 1); the timings of the timed ones."""
    times: list[list[float]] = [[] for _ in trainers]
    losses: list[list[float]] = [[] for _ in trainers]
    for step in range(warmup + steps):
        for i, trainer in enumerate(trainers):
            if barrier is not None:
                barrier()
            seconds, loss = trainer.step(step)
            if step >= warmup:
                times[i].append(seconds)
                losses[i].append(loss)
    return [Timing(step_s=tuple(t), losses=tuple(ls)) for t, ls in zip(times, losses)]


def profile_steps(trainer: _Trainer, *, first: int, steps: int, enabled: bool) -> str:
    """cProfile (top by own time) of ``steps`` more steps, run after the timed ones so it slows none of them."""
    profiler = cProfile.Profile()
    for step in range(first, first + steps):
        dist.barrier()
        if enabled:
            profiler.enable()
        trainer.step(step)
        if enabled:
            profiler.disable()
    text = io.StringIO()
    if enabled:
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(PROFILE_TOP)
    return text.getvalue()


def _quiet_torch() -> None:
    """torch's one-time notes (deprecated names, loss_parallel's) would bury the table."""
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)


# ----- world 1: gloo processes -------------------------------------------------------------------
def _gloo_rank(cfg: Config, warmup: int, steps: int, profile: bool) -> tuple[Timing, Timing, str] | None:
    """One gloo rank (under ``run_multiprocess``): both libraries on the default group, steps alternating.

    Rank 0 returns both timings and its cProfile report; the other ranks return None.
    """
    _quiet_torch()
    trainers = [_Trainer(_Library("ours"), cfg), _Trainer(_Library("torch"), cfg)]
    ours, theirs = run_steps(trainers, warmup=warmup, steps=steps, barrier=dist.barrier)
    rank = dist.get_rank()
    report = profile_steps(trainers[0], first=warmup + steps, steps=steps, enabled=rank == 0) if profile else ""
    return (ours, theirs, report) if rank == 0 else None


def measure_gloo(cfg: Config, *, warmup: int, steps: int, profile: bool) -> tuple[Row, str]:
    """Both libraries on 2 spawned gloo processes over loopback; the row and our cProfile report."""
    # run_multiprocess gives each rank one intra-op thread: two ranks share the machine's cores.
    ours, theirs, report = run_multiprocess(_gloo_rank, TP, cfg, warmup, steps, profile, timeout=TIMEOUT_S)[0]
    return Row(setting=f"gloo, {TP} processes", ours=ours, torch=theirs), report


# ----- world 2: threads of this process ----------------------------------------------------------
def _threaded_rank(library: _Library, cfg: Config, warmup: int, steps: int) -> Timing:
    return run_steps([_Trainer(library, cfg)], warmup=warmup, steps=steps)[0]


def run_torch_threaded(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """``fn(*args)`` on ``world_size`` threads of torch's in-process threaded process group; results by rank.

    The same steps as ``spawn_threads_and_init_comms`` in torch's test suite: swap in the
    thread-local c10d world, start one thread per rank that joins a ``threaded`` group on a shared
    store, and isolate functional collectives per thread.
    """
    from torch.testing._internal.distributed.multi_threaded_pg import (
        ProcessLocalGroup,
        _install_threaded_pg,
        _uninstall_threaded_pg,
    )

    results: list[Any] = [None] * world_size
    errors: list[BaseException] = []
    store = dist.HashStore()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()  # also turns autograd's device threads off, as its backward needs

    def rank_main(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
        try:
            results[rank] = fn(*args)
        except BaseException as error:
            errors.append(error)
            ProcessLocalGroup.exception_handle(error)  # wake the ranks waiting in a collective
        finally:
            dist.destroy_process_group()

    threads = [threading.Thread(target=rank_main, args=(rank,), daemon=True) for rank in range(world_size)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT_S)
        if any(thread.is_alive() for thread in threads):
            raise TimeoutError(f"torch's threaded world did not finish in {TIMEOUT_S:g}s")
        if errors:
            raise errors[0]
    finally:
        _uninstall_threaded_pg()
        ProcessLocalGroup.reset()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    return results


def measure_threaded(cfg: Config, *, warmup: int, steps: int) -> Row:
    """Ours on ``run_threaded`` and torch's on its threaded process group, 2 ranks each, one after the other."""
    from spmd.testing import run_threaded

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the rank threads already keep the cores busy
    try:
        ours: Timing | str = run_threaded(_threaded_rank, TP, _Library("ours"), cfg, warmup, steps)[0]
        # torch's loss_parallel installs its loss ops in one process-wide table on entry and pops
        # them on exit, so rank threads entering and leaving it race (KeyError); hold it open once
        # around all of them instead. The ops that run are the same.
        from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel

        held = _Library("torch", loss_parallel_held=True)
        try:
            with torch_loss_parallel():
                theirs: Timing | str = run_torch_threaded(_threaded_rank, TP, held, cfg, warmup, steps)[0]
        except Exception as error:  # torch's test-only group is not a supported API; report, don't fail
            theirs = f"n/a ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
    finally:
        torch.set_num_threads(threads)
    return Row(setting=f"threaded, {TP} ranks", ours=ours, torch=theirs)


# ----- report ------------------------------------------------------------------------------------
def print_table(rows: Sequence[Row], cfg: Config, *, warmup: int, steps: int) -> None:
    print(
        f"demo GPT (d_model={cfg.d_model}, layers={cfg.n_layers}, heads={cfg.n_heads}, vocab={cfg.vocab_size}, "
        f"batch={cfg.batch_size}x{cfg.seq_len}), tp={TP}; median of {steps} steps after {warmup} warm-up"
    )
    print(f"{'setting':<22}{'ours ms/step':>14}{'torch ms/step':>15}{'ours/torch':>12}{'max |loss diff|':>17}")
    ratios: list[tuple[float, str]] = []
    for row in rows:
        ours = f"{row.ours.median_ms:.2f}" if isinstance(row.ours, Timing) else "n/a"
        theirs = f"{row.torch.median_ms:.2f}" if isinstance(row.torch, Timing) else "n/a"
        ratio = diff = "-"
        if isinstance(row.ours, Timing) and isinstance(row.torch, Timing):
            value = row.ours.median_ms / row.torch.median_ms
            ratios.append((value, row.setting))
            ratio = f"{value:.2f}"
            diff = f"{max(abs(a - b) for a, b in zip(row.ours.losses, row.torch.losses)):.2e}"
        print(f"{row.setting:<22}{ours:>14}{theirs:>15}{ratio:>12}{diff:>17}")
    for row in rows:
        for name, timing in (("ours", row.ours), ("torch", row.torch)):
            if isinstance(timing, str):
                print(f"  {row.setting}, {name}: {timing}")
    if ratios:
        worst = max(ratios)
        print(f"worst ours/torch: {worst[0]:.2f} ({worst[1]}); goal <= 1.00")


def main(argv: Sequence[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per library and setting")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--quick", action="store_true", help="2 warm-up and 6 timed steps")
    parser.add_argument(
        "--profile",
        action="store_true",
        help=f"then top {PROFILE_TOP} of cProfile over as many more of our steps (gloo rank 0)",
    )
    args = parser.parse_args(argv)
    warmup, steps = (2, 6) if args.quick else (args.warmup, args.steps)
    if steps < 1:
        raise ValueError(f"--steps must be at least 1, got {steps}")
    cfg = replace(Config(), dp=1, tp=TP, steps=warmup + steps)
    _quiet_torch()
    start = time.perf_counter()
    gloo_row, profile_report = measure_gloo(cfg, warmup=warmup, steps=steps, profile=args.profile)
    rows = [gloo_row, measure_threaded(cfg, warmup=warmup, steps=steps)]
    print_table(rows, cfg, warmup=warmup, steps=steps)
    print(f"ran in {time.perf_counter() - start:.1f} s")
    if profile_report:
        print(f"\ncProfile of {steps} more of our steps on gloo rank 0, after the timed ones (by own time):")
        print(profile_report)
    return rows


if __name__ == "__main__":
    main()
