"""The simulator against real runs of the demo (examples/train_transformer.py): the same collectives and bytes.

For each rank, a simulated step of the demo's own model, plan and training step must issue exactly
the collectives CommDebugMode counts on the real run (per kind and mesh dim: count, group size,
bytes), and hold exactly the same bytes of parameters, gradients and AdamW state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from spmd.simulate import (
    Links,
    MemoryTracker,
    StateBytes,
    collective_stats,
    parse_plan,
    simulate,
    training_state_bytes,
)
from spmd.simulate.memory import local_storages
from spmd.simulate.report import CollectiveStat
from spmd.tensor import DeviceMesh, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.testing import load_script, run_threaded

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_transformer.py"


demo = load_script(EXAMPLE)
Outcome = tuple[tuple[CollectiveStat, ...], StateBytes]


def _place(mesh: DeviceMesh, batch: torch.Tensor) -> Any:
    return distribute_tensor(batch, mesh, [Shard(0), Replicate()], src_data_rank=None)


@dataclass(frozen=True)
class DemoWorkload:
    """The demo's model, parallelisation, optimizer and train_step, run by the simulator."""

    cfg: Any

    def build(self, mesh: DeviceMesh) -> tuple[nn.Module, torch.optim.Optimizer]:
        cfg = self.cfg
        model = demo.apply_tp_and_dp(demo.GPT(cfg), mesh, sequence_parallel=cfg.sequence_parallel, fsdp=cfg.fsdp)
        return model, demo.make_optimizer(model, cfg)

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh) -> None:
        tokens = torch.empty(self.cfg.batch_size, self.cfg.seq_len, dtype=torch.long, device="meta")
        demo.train_step(model, optimizer, _place(mesh, tokens), _place(mesh, tokens))


def real_step(cfg: Any) -> Outcome:
    """On a real rank: the demo's second step under CommDebugMode, summed like the simulator does."""
    mesh = init_device_mesh("cpu", (cfg.dp, cfg.tp), mesh_dim_names=("dp", "tp"))
    model = demo.apply_tp_and_dp(demo.build_model(cfg), mesh, sequence_parallel=cfg.sequence_parallel, fsdp=cfg.fsdp)
    optimizer = demo.make_optimizer(model, cfg)
    for step in range(2):
        inputs, targets = demo.batch_at(cfg, step)
        with CommDebugMode() as comm:
            demo.train_step(model, optimizer, _place(mesh, inputs), _place(mesh, targets))
    return collective_stats(comm.records, mesh, Links()), training_state_bytes(model, optimizer)


def simulated_step(cfg: Any, rank: int) -> Outcome:
    plan = parse_plan(f"dp={cfg.dp},tp={cfg.tp}", fsdp=cfg.fsdp, sequence_parallel=cfg.sequence_parallel)
    report = simulate(DemoWorkload(cfg), plan, rank=rank)
    return report.collectives, report.state


def assert_same(real: Outcome, simulated: Outcome, rank: int) -> None:
    real_stats, real_state = real
    sim_stats, sim_state = simulated
    assert real_stats, "the real step issued no collectives"
    assert sim_stats == real_stats, f"rank {rank}: simulated {sim_stats}\n real {real_stats}"
    assert sim_state == real_state, f"rank {rank}: simulated {sim_state}, real {real_state}"


@contextlib.contextmanager
def _one_intra_op_thread() -> Iterator[None]:
    """Rank threads share this process's intra-op threads: one, as each gloo process has."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _threaded_real_with(fn: Any, cfg: Any) -> list[Any]:
    with _one_intra_op_thread():
        return run_threaded(fn, cfg.dp * cfg.tp, cfg)


def _threaded_real(cfg: Any) -> list[Outcome]:
    return _threaded_real_with(real_step, cfg)


WORLD_4 = {
    "tp": {"dp": 2, "tp": 2, "sequence_parallel": False},
    "tp+sp": {"dp": 2, "tp": 2, "sequence_parallel": True},
    "fsdp+tp+sp": {"dp": 2, "tp": 2, "sequence_parallel": True, "fsdp": True},
    "uneven": {"dp": 2, "tp": 2, "fsdp": True, "vocab_size": 130, "seq_len": 30, "batch_size": 6},  # uneven shards
}


def real_steps(configs: list[dict[str, Any]]) -> list[Outcome]:
    """The real step of each config in turn, in one world. The configs travel as plain values,
    whatever way each gloo process loaded the demo."""
    return [real_step(demo.Config(**fields)) for fields in configs]


def test_world_4_every_rank(world: Callable[..., list[Any]]) -> None:
    with _one_intra_op_thread():
        per_rank = world(real_steps, 4, list(WORLD_4.values()), timeout=240)
    for i, overrides in enumerate(WORLD_4.values()):
        cfg = demo.Config(**overrides)
        for rank, real in enumerate(per_rank):
            assert_same(real[i], simulated_step(cfg, rank), rank)


@pytest.mark.parametrize(
    "overrides",
    [{"dp": 4, "tp": 2, "fsdp": True}, {"dp": 2, "tp": 4, "sequence_parallel": True}],
    ids=["dp4xtp2-fsdp", "dp2xtp4-sp"],
)
def test_world_8_threads(overrides: dict[str, Any]) -> None:
    cfg = demo.Config(**overrides)
    per_rank = _threaded_real(cfg)
    for rank in (0, 3, 7):
        assert_same(per_rank[rank], simulated_step(cfg, rank), rank)


def test_uneven_ranks_differ_and_each_matches() -> None:
    """With 130 vocab rows over tp=4, tp ranks 0-1 hold 33 rows and 2-3 hold 32: the simulated rank decides."""
    cfg = demo.Config(dp=1, tp=4, vocab_size=130)
    per_rank = _threaded_real(cfg)
    assert per_rank[0][1].params > per_rank[3][1].params
    for rank in (0, 3):
        assert_same(per_rank[rank], simulated_step(cfg, rank), rank)


def real_peaks(cfg: Any) -> tuple[int, int]:
    """On a real rank: (peak, activation peak) of the demo's second step, tracked as the simulator tracks it."""
    mesh = init_device_mesh("cpu", (cfg.dp, cfg.tp), mesh_dim_names=("dp", "tp"))
    model = demo.apply_tp_and_dp(demo.build_model(cfg), mesh, sequence_parallel=cfg.sequence_parallel, fsdp=cfg.fsdp)
    optimizer = demo.make_optimizer(model, cfg)
    for step in range(2):
        inputs, _ = demo.batch_at(cfg, step)
        with MemoryTracker(local_storages(model, optimizer)) as tracker:
            tokens = inputs.clone()  # the batch is allocated in the step, as in DemoWorkload.step
            demo.train_step(model, optimizer, _place(mesh, tokens), _place(mesh, tokens))
    state = training_state_bytes(model, optimizer)
    grads = {tracker.token_of(p.grad.to_local().untyped_storage()) for p in model.parameters()} - {None}
    return state.params + state.optimizer + tracker.peak(), tracker.peak(excluding=grads)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "overrides",
    [{"dp": 1, "tp": 1, "sequence_parallel": False}, {"dp": 2, "tp": 2, "fsdp": True}],
    ids=["one-rank", "fsdp+tp+sp"],
)
def test_memory_peaks_equal_the_real_run(overrides: dict[str, Any]) -> None:
    """The meta kernels allocate what the CPU kernels allocate: the same peaks, byte for byte. (Where
    gradients are all-reduced, the threaded backend's own stacking buffers make its peak higher.)"""
    cfg = demo.Config(**overrides)
    real_peak, real_activations = _threaded_real_with(real_peaks, cfg)[0]
    plan = parse_plan(f"dp={cfg.dp},tp={cfg.tp}", fsdp=cfg.fsdp, sequence_parallel=cfg.sequence_parallel)
    report = simulate(DemoWorkload(cfg), plan)
    assert (report.peak, report.activations_peak) == (real_peak, real_activations)
