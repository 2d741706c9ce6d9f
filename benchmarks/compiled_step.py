"""Compiled vs eager DTensor: the demo's training step and a chain of small pointwise ops, ours vs torch's.

Run ``python benchmarks/compiled_step.py`` (``--quick`` for fewer steps; ``--backend aot_eager`` to
skip inductor's C++ compiles). Two measurements, one run:

1. **Training step** (examples/train_transformer.py's model, tp=2, the plan of benchmarks/tp_step.py:
   q/k/v and MLP up column-wise, attention out and MLP down row-wise, lm_head column-wise with
   vocab-sharded logits under ``loss_parallel``). Four trainers on the same 2 gloo processes, their
   steps alternating with a barrier before each: ours eager, ours compiled, torch's DTensor eager,
   torch's compiled. "Compiled" is ``torch.compile(forward + loss, fullgraph=True)`` plus
   ``torch.compile(optimizer.step)``; backward runs the compiled backward graph. On threads, ours
   eager and compiled.
   Time is rank 0's wall clock per step, median of the timed steps after the warm-up ones (which
   include the compiles); the losses of all trainers must agree.
2. **Pointwise chain**: 50 small pointwise ops on a 16x8 tensor Shard(0) over 2 gloo processes,
   compiled ours vs the same chain compiled on each rank's plain local tensor; torch's DTensor
   compiled and both libraries eager beside them.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tp_step import TP, Timing, _Library, _quiet_torch, _Trainer, run_steps
from train_transformer import Config, batch_at  # (tp_step put examples/ on the path)

from spmd.testing import run_multiprocess, run_threaded

TIMEOUT_S = 900.0
CHAIN_LENGTH = 50


def forward_loss(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))


class CompiledTrainer(_Trainer):
    """tp_step's trainer with forward + loss under ``torch.compile(fullgraph=True)``, and the optimizer
    step compiled too (torch's "compiled optimizer": one graph for AdamW over every parameter)."""

    def __init__(self, library: _Library, cfg: Config, backend: str) -> None:
        super().__init__(library, cfg)
        self.forward_loss = torch.compile(forward_loss, backend=backend, fullgraph=True)
        self.optimizer_step = torch.compile(self.optimizer.step, backend=backend)

    def step(self, step: int) -> tuple[float, float]:
        inputs, targets = batch_at(self.cfg, step)
        start = time.perf_counter()
        with self.library.loss_parallel():
            loss = self.forward_loss(self.model, inputs, targets)
            loss.backward()  # type: ignore[no-untyped-call]
        self.optimizer_step()
        self.optimizer.zero_grad()
        value = float(loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item())
        return time.perf_counter() - start, value


NAMES = ("ours eager", "ours compiled", "torch eager", "torch compiled")


def _gloo_rank(cfg: Config, warmup: int, steps: int, backend: str) -> list[Timing | str] | None:
    _quiet_torch()
    ours, theirs = _Library("ours"), _Library("torch")
    trainers: list[_Trainer] = [
        _Trainer(ours, cfg),
        CompiledTrainer(ours, cfg, backend),
        _Trainer(theirs, cfg),
        CompiledTrainer(theirs, cfg, backend),
    ]
    timings: list[Timing | str] = list(run_steps(trainers, warmup=warmup, steps=steps, barrier=dist.barrier))
    return timings if dist.get_rank() == 0 else None


def _threaded_rank(cfg: Config, warmup: int, steps: int, backend: str) -> list[Timing]:
    ours = _Library("ours")
    trainers = [_Trainer(ours, cfg), CompiledTrainer(ours, cfg, backend)]
    return run_steps(trainers, warmup=warmup, steps=steps)


def measure_steps(cfg: Config, *, warmup: int, steps: int, backend: str) -> dict[str, list[Timing | str]]:
    gloo = run_multiprocess(_gloo_rank, TP, cfg, warmup, steps, backend, timeout=TIMEOUT_S)[0]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the rank threads already keep the cores busy
    try:
        threaded: list[Timing | str] = list(
            run_threaded(_threaded_rank, TP, cfg, warmup, steps, backend, timeout=TIMEOUT_S)[0]
        )
    finally:
        torch.set_num_threads(threads)
    return {f"gloo, {TP} processes": gloo, f"threaded, {TP} ranks": [*threaded, "not run", "not run"]}


# ----- the pointwise chain ----------------------------------------------------------------------
def pointwise_chain(x: torch.Tensor) -> torch.Tensor:
    for i in range(CHAIN_LENGTH):
        x = (x * 1.01 + 0.1).sin() if i % 2 else x.relu() - 0.05
    return x


class MinimalWrapper(torch.Tensor):
    """The least a traceable wrapper subclass can be (one inner tensor, no metadata): compiled, it
    shows the per-call cost torch.compile adds to any subclass input (guards on the wrapper and its
    inner tensor, unwrapping, wrapping the output), which a DTensor pays too."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> MinimalWrapper:  # noqa: PYI034
        r = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)
        r.inner = inner
        return r  # type: ignore[no-any-return]

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: None, size: Any, stride: Any) -> MinimalWrapper:
        return MinimalWrapper(inner["inner"])

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        unwrap = torch.utils._pytree.tree_map_only(MinimalWrapper, lambda t: t.inner, (args, kwargs or {}))
        out = func(*unwrap[0], **unwrap[1])
        return torch.utils._pytree.tree_map_only(torch.Tensor, MinimalWrapper, out)

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]


def _time_in_turns(fns: dict[str, tuple[Callable[[], Any], int]], rounds: int = 15) -> dict[str, float]:
    """Microseconds per call of each ``name: (fn, calls)``: batches of ``calls`` calls, the functions
    taking turns batch by batch, and each one's fastest batch (the least disturbed by other work on
    the machine, as in dispatch_overhead.py). The garbage collector is off while a batch runs, as
    in ``timeit``: otherwise one function's garbage is collected in another's batch."""
    best = dict.fromkeys(fns, float("inf"))
    try:
        for _ in range(rounds):
            for name, (fn, calls) in fns.items():
                gc.collect()
                gc.disable()
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                best[name] = min(best[name], (time.perf_counter() - start) / calls * 1e6)
                gc.enable()
    finally:
        gc.enable()
    return best


def _chain_rank(backend: str, calls: int) -> dict[str, float] | None:
    """One gloo rank: the chain on ours and torch's DTensor (eager and compiled) and on plain tensors."""
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.tensor import Shard as TorchShard
    from torch.distributed.tensor import distribute_tensor as torch_distribute

    from spmd.tensor import Shard, distribute_tensor, init_device_mesh

    full = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    ours = distribute_tensor(full, init_device_mesh("cpu", (TP,)), [Shard(0)])
    theirs = torch_distribute(full, torch_mesh("cpu", (TP,)), [TorchShard(0)])
    local = ours.to_local().clone()
    compiled_ours = torch.compile(pointwise_chain, backend=backend, fullgraph=True)
    compiled_theirs = torch.compile(lambda t: pointwise_chain(t), backend=backend, fullgraph=True)
    compiled_local = torch.compile(lambda t: pointwise_chain(t), backend=backend, fullgraph=True)
    compiled_wrapped = torch.compile(lambda t: pointwise_chain(t), backend=backend, fullgraph=True)
    wrapped = MinimalWrapper(local.clone())
    expected = pointwise_chain(full)
    torch.testing.assert_close(compiled_ours(ours).full_tensor(), expected)
    torch.testing.assert_close(compiled_theirs(theirs).full_tensor(), expected)
    compiled_local(local)
    compiled_wrapped(wrapped)
    eager_calls = max(calls // 20, 10)
    result = _time_in_turns(
        {
            "ours eager": (lambda: pointwise_chain(ours), eager_calls),
            "torch eager": (lambda: pointwise_chain(theirs), eager_calls),
            "ours compiled": (lambda: compiled_ours(ours), calls),
            "torch compiled": (lambda: compiled_theirs(theirs), calls),
            "plain tensors compiled": (lambda: compiled_local(local), calls),
            "minimal subclass compiled": (lambda: compiled_wrapped(wrapped), calls),
        }
    )
    return result if dist.get_rank() == 0 else None


def measure_chain(backend: str, calls: int) -> dict[str, float]:
    result: dict[str, float] = run_multiprocess(_chain_rank, TP, backend, calls, timeout=TIMEOUT_S)[0]
    return result


# ----- report ------------------------------------------------------------------------------------
def print_steps(rows: dict[str, list[Timing | str]], cfg: Config, *, warmup: int, steps: int, backend: str) -> None:
    print(
        f"demo GPT (d_model={cfg.d_model}, layers={cfg.n_layers}, vocab={cfg.vocab_size}, batch={cfg.batch_size}x"
        f"{cfg.seq_len}), tp={TP}, compiled with {backend}; ms/step, median of {steps} after {warmup} warm-up"
    )
    print(f"{'setting':<22}" + "".join(f"{name:>16}" for name in NAMES) + f"{'max |loss diff|':>17}")
    for setting, timings in rows.items():
        cells = "".join(f"{t.median_ms:>16.2f}" if isinstance(t, Timing) else f"{t:>16}" for t in timings)
        measured = [t for t in timings if isinstance(t, Timing)]
        diff = max(abs(a - b) for t in measured for a, b in zip(t.losses, measured[0].losses))
        print(f"{setting:<22}{cells}{diff:>17.2e}")
        ours_eager, ours_compiled, torch_eager, torch_compiled = timings
        if isinstance(ours_compiled, Timing):
            parts = [f"compiled ours / eager ours {ours_compiled.median_ms / ours_eager.median_ms:.2f}"]  # type: ignore[union-attr]
            if isinstance(torch_eager, Timing) and isinstance(torch_compiled, Timing):
                parts.append(f"/ eager torch {ours_compiled.median_ms / torch_eager.median_ms:.2f} (goal <= 0.5)")
                parts.append(f"/ compiled torch {ours_compiled.median_ms / torch_compiled.median_ms:.2f} (goal <= 1.0)")
            print("  " + ", ".join(parts))


def print_chain(result: dict[str, float], backend: str) -> None:
    print(
        f"\n{CHAIN_LENGTH} pointwise ops on a 16x8 DTensor Shard(0) over {TP} gloo processes ({backend}); "
        "us per call, rank 0, fastest of 15 batches taken in turns"
    )
    for name, micros in result.items():
        print(f"  {name:<24}{micros:>10.1f}")
    plain = result["plain tensors compiled"]
    ratio, theirs, floor = (result[k] / plain for k in ("ours compiled", "torch compiled", "minimal subclass compiled"))
    print(
        f"  compiled ours / compiled plain tensors {ratio:.2f} (goal <= 1.2; torch's DTensor {theirs:.2f}, "
        f"a do-nothing wrapper subclass {floor:.2f})"
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per trainer")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (they include the compiles)")
    parser.add_argument("--quick", action="store_true", help="3 warm-up and 5 timed steps, fewer chain calls")
    parser.add_argument("--backend", default="inductor", choices=("inductor", "aot_eager"))
    args = parser.parse_args(argv)
    warmup, steps = (3, 5) if args.quick else (args.warmup, args.steps)
    cfg = replace(Config(), dp=1, tp=TP, steps=warmup + steps)
    _quiet_torch()
    start = time.perf_counter()
    rows = measure_steps(cfg, warmup=warmup, steps=steps, backend=args.backend)
    chain = measure_chain(args.backend, 200 if args.quick else 1000)
    print_steps(rows, cfg, warmup=warmup, steps=steps, backend=args.backend)
    print_chain(chain, args.backend)
    print(f"ran in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
