"""What the collective checks cost per training step of the demo: the default warm-up check and the full one.

Run ``python benchmarks/check_collectives_cost.py`` (``--steps N`` timed steps per mode, ``--gloo``
to run the ranks as 4 gloo processes instead of 4 threads).

The step is the demo's (``examples/train_transformer.py``: the GPT on a dp=2 x tp=2 mesh with
sequence parallelism, forward, backward and AdamW), built with the demo's own functions. First a
few steps with every check off (``warmup_check(False)``) fill the decision caches; then the first
two steps with the default warm-up check on, which check every collective once more each (their
extra time over an unchecked step is printed); then steps with no check, with the warm-up check
past its first runs (the default steady state) and with the full check (``check_collectives()``,
what ``SPMD_DEBUG=check`` turns on), in turn, so load from other jobs on the machine hits all
alike. A step's time is rank 0's wall clock; the table prints the median per mode and its ratio to
the unchecked step, and how many collectives a step issues.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from train_transformer import Config, apply_tp_and_dp, batch_at, build_model, make_optimizer, train_step

from spmd.tensor import Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode, check_collectives, warmup_check
from spmd.testing import run_multiprocess, run_threaded

WARMUP_STEPS = 4


MODES = ("off", "warm-up", "full")


def measure(cfg: Config, steps: int) -> dict[str, Any]:
    """On every rank: the first checked steps, then the three modes in turn; rank 0's step times."""
    mesh = init_device_mesh("cpu", (cfg.dp, cfg.tp), mesh_dim_names=("dp", "tp"))
    model = apply_tp_and_dp(build_model(cfg), mesh, sequence_parallel=cfg.sequence_parallel)
    optimizer = make_optimizer(model, cfg)
    everyone = mesh.get_communicator("dp"), mesh.get_communicator("tp")

    def timed_step(step: int, mode: str) -> float:
        inputs, targets = (
            distribute_tensor(t, mesh, [Shard(0), Replicate()], src_data_rank=None) for t in batch_at(cfg, step)
        )
        with warmup_check(False):
            for comm in everyone:  # start the step together
                comm.all_gather_object(None)
        start = time.perf_counter()
        if mode == "off":
            context: Any = warmup_check(False)
        elif mode == "full":
            context = check_collectives()
        else:
            context = contextlib.nullcontext()  # the default: the warm-up check
        with context:
            train_step(model, optimizer, inputs, targets)
        return time.perf_counter() - start

    step = 0
    for step in range(WARMUP_STEPS):  # caches filled, nothing checked (the warm-up counts stay at zero)
        timed_step(step, "off")
    first = [timed_step(WARMUP_STEPS + i, "warm-up") for i in range(2)]  # each collective checked once more each
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for i in range(len(MODES) * steps):
        mode = MODES[i % len(MODES)]
        times[mode].append(timed_step(WARMUP_STEPS + 2 + i, mode))
    inputs, targets = (
        distribute_tensor(t, mesh, [Shard(0), Replicate()], src_data_rank=None) for t in batch_at(cfg, 0)
    )
    with CommDebugMode() as comm_mode, warmup_check(False):
        train_step(model, optimizer, inputs, targets)
    return {"times": times, "first": first, "collectives": comm_mode.get_total_counts()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per mode (default 20)")
    parser.add_argument("--gloo", action="store_true", help="4 gloo processes instead of 4 threads")
    args = parser.parse_args()
    cfg = Config()
    if args.gloo:
        result = run_multiprocess(measure, cfg.dp * cfg.tp, cfg, args.steps, timeout=600.0)[0]
        world = "4 gloo processes"
    else:
        torch.set_num_threads(1)
        result = run_threaded(measure, cfg.dp * cfg.tp, cfg, args.steps, timeout=120.0)[0]
        world = "4 threads"
    medians = {mode: statistics.median(result["times"][mode]) for mode in MODES}
    off = medians["off"]
    print(f"demo step (dp=2 x tp=2, sequence parallel) on {world}, {args.steps} steps per mode, rank 0")
    print(f"collectives per step: {result['collectives']}")
    print(f"{'check':<28}{'median step':>14}{'vs off':>10}")
    labels = {
        "off": "off (SPMD_DEBUG=nocheck)",
        "warm-up": "warm-up, steady (default)",
        "full": "full (SPMD_DEBUG=check)",
    }
    for mode in MODES:
        print(f"{labels[mode]:<28}{medians[mode] * 1e3:>11.1f} ms{medians[mode] / off:>9.3f}x")
    for i, first in enumerate(result["first"]):
        print(
            f"{f'warm-up, checked step {i + 1}':<28}{first * 1e3:>11.1f} ms{first / off:>9.3f}x  "
            f"(+{(first - off) * 1e3:.1f} ms)"
        )
    full = medians["full"]
    print(
        f"full check: +{(full - off) * 1e3:.1f} ms per step, "
        f"{(full - off) / max(result['collectives'], 1) * 1e6:.0f} us per collective"
    )


if __name__ == "__main__":
    main()
