"""What the collective check (``SPMD_DEBUG=check``) costs per training step of the demo.

Run ``python benchmarks/check_collectives_cost.py`` (``--steps N`` timed steps per mode, ``--gloo``
to run the ranks as 4 gloo processes instead of 4 threads).

The step is the demo's (``examples/train_transformer.py``: the GPT on a dp=2 x tp=2 mesh with
sequence parallelism, forward, backward and AdamW), built with the demo's own functions. Steps with
the check on (``check_collectives()``, which is what ``SPMD_DEBUG=check`` turns on for the whole
process) and off alternate in one run, so load from other jobs on the machine hits both alike. A
step's time is rank 0's wall clock; the table prints the median per mode and their ratio, and how
many collectives a step issues (each one is preceded by one fingerprint exchange under the check).
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
from spmd.tensor.debug import CommDebugMode, check_collectives
from spmd.testing import run_multiprocess, run_threaded

WARMUP_STEPS = 4


def measure(cfg: Config, steps: int) -> dict[str, Any]:
    """On every rank: alternate steps with the check off and on; rank 0's step times per mode."""
    mesh = init_device_mesh("cpu", (cfg.dp, cfg.tp), mesh_dim_names=("dp", "tp"))
    model = apply_tp_and_dp(build_model(cfg), mesh, sequence_parallel=cfg.sequence_parallel)
    optimizer = make_optimizer(model, cfg)
    everyone = mesh.get_communicator("dp"), mesh.get_communicator("tp")
    times: dict[str, list[float]] = {"off": [], "on": []}
    for step in range(WARMUP_STEPS + 2 * steps):
        mode = "on" if step % 2 else "off"
        inputs, targets = (
            distribute_tensor(t, mesh, [Shard(0), Replicate()], src_data_rank=None) for t in batch_at(cfg, step)
        )
        for comm in everyone:  # start the step together
            comm.all_gather_object(None)
        start = time.perf_counter()
        with check_collectives() if mode == "on" else contextlib.nullcontext():
            train_step(model, optimizer, inputs, targets)
        if step >= WARMUP_STEPS:
            times[mode].append(time.perf_counter() - start)
    inputs, targets = (distribute_tensor(t, mesh, [Shard(0), Replicate()], src_data_rank=None) for t in batch_at(cfg, 0))
    with CommDebugMode() as comm_mode:
        train_step(model, optimizer, inputs, targets)
    return {"times": times, "collectives": comm_mode.get_total_counts()}


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
    off = statistics.median(result["times"]["off"])
    on = statistics.median(result["times"]["on"])
    print(f"demo step (dp=2 x tp=2, sequence parallel) on {world}, {args.steps} steps per mode, rank 0")
    print(f"collectives per step: {result['collectives']}")
    print(f"{'check':<8}{'median step':>14}")
    print(f"{'off':<8}{off * 1e3:>11.1f} ms")
    print(f"{'on':<8}{on * 1e3:>11.1f} ms")
    print(f"on/off  {on / off:.2f}x  (+{(on - off) * 1e3:.1f} ms per step, "
          f"{(on - off) / max(result['collectives'], 1) * 1e6:.0f} us per collective)")


if __name__ == "__main__":
    main()
