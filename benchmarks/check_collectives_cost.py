"""What the collective checks cost per training step of the demo: the default warm-up check and the full one.

Run ``python benchmarks/check_collectives_cost.py`` (``--steps N`` timed steps per mode, ``--gloo``
to run the ranks as 4 gloo processes instead of 4 threads).

The step is the demo's (``examples/train_transformer.py``: the GPT on a dp=2 x tp=2 mesh with
sequence parallelism, forward, backward and AdamW), built with the demo's own functions. First a
few steps with every check off (``warmup_check(False)``) fill the decision caches; then the first
two steps with the default warm-up check on, which check each collective's first and second run
(their extra time over an unchecked step is printed); then unchecked steps alternate with steps
under the warm-up check past its first runs (the default's steady state), and then other unchecked
steps with steps under the full check (``check_collectives()``, what ``SPMD_DEBUG=check`` turns
on), so load from other jobs on the machine hits both sides of each ratio alike. A step's time is
rank 0's wall clock; the table prints the median per mode, its ratio to the unchecked steps beside
it, and how many collectives a step issues.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
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
    """On every rank: the first checked steps, then each check beside unchecked steps; rank 0's step times."""
    mesh = init_device_mesh("cpu", (cfg.dp, cfg.tp), mesh_dim_names=("dp", "tp"))
    model = apply_tp_and_dp(build_model(cfg), mesh, sequence_parallel=cfg.sequence_parallel)
    optimizer = make_optimizer(model, cfg)
    everyone = mesh.get_communicator("dp"), mesh.get_communicator("tp")

    def timed_step(step: int, mode: str) -> float:
        inputs, targets = (
            distribute_tensor(t, mesh, [Shard(0), Replicate()], src_data_rank=None) for t in batch_at(cfg, step)
        )
        gc.collect()  # no step pays for the garbage of the one before it
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

    for step in range(WARMUP_STEPS):  # caches filled, nothing checked (the warm-up counts stay at zero)
        timed_step(step, "off")
    first = [timed_step(WARMUP_STEPS + i, "warm-up") for i in range(2)]  # each collective checked once more each
    # Each check alternates with unchecked steps of its own, so the two sides of a ratio run under the same load.
    times: dict[str, list[float]] = {mode: [] for mode in (*MODES, "off, beside full")}
    step = WARMUP_STEPS + 2
    for pair in (("off", "warm-up"), ("off, beside full", "full")):
        for i in range(2 * steps):
            mode = pair[i % 2]
            times[mode].append(timed_step(step, "off" if mode.startswith("off") else mode))
            step += 1
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
    medians = {mode: statistics.median(times) for mode, times in result["times"].items()}
    off = medians["off"]
    print(f"demo step (dp=2 x tp=2, sequence parallel) on {world}, {args.steps} steps per mode, rank 0")
    print(f"collectives per step: {result['collectives']}")
    print(f"{'check':<28}{'median step':>14}{'vs off':>10}")
    rows = [
        ("off (SPMD_DEBUG=nocheck)", medians["off"], off),
        ("warm-up, steady (default)", medians["warm-up"], off),
        ("full (SPMD_DEBUG=check)", medians["full"], medians["off, beside full"]),
    ]
    for label, median, reference in rows:
        print(f"{label:<28}{median * 1e3:>11.1f} ms{median / reference:>9.3f}x")
    for i, first in enumerate(result["first"]):
        label = f"warm-up, checked step {i + 1}"
        print(f"{label:<28}{first * 1e3:>11.1f} ms{first / off:>9.3f}x  ({(first - off) * 1e3:+.1f} ms)")
    extra = medians["full"] - medians["off, beside full"]
    print(
        f"full check: {extra * 1e3:+.1f} ms per step, {extra / max(result['collectives'], 1) * 1e6:.0f} us per collective"
    )


if __name__ == "__main__":
    main()
