"""Time and peak memory of simulating a 7B-shaped GPT's training step on 4,096 ranks, on one CPU core.

    python benchmarks/simulate_plan.py            # the plans below, each in its own process
    python benchmarks/simulate_plan.py --batch 8  # sequences per data-parallel rank (default 1)

Each plan runs ``spmd.simulate.simulate`` in a fresh subprocess pinned to one core with one torch
thread; the child reports its wall time and its peak resident set size (``ru_maxrss``, the whole
process: Python, torch and the simulation). The issue's budget is < 60 s and < 2 GiB per plan;
the last columns are the ratios to it. The model: 32 layers, dim 4096, 32 heads, vocab 32000,
sequence 4096, float32, AdamW, as ``python -m spmd.simulate --layers 32 --dim 4096 --heads 32
--vocab 32000 --seq 4096 --mesh PLAN``. There is no torch.distributed.tensor counterpart to
compare with: torch has no simulated world.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

PLANS = ("dp=4096", "dp=512,tp=8", "dp=512,tp=8,fsdp", "dp=256,tp=16,fsdp,sp")
BUDGET_S = 60.0
BUDGET_BYTES = 2 * 2**30


def child(plan_text: str, batch: int) -> None:
    """Simulate one plan and print a JSON line: seconds, peak RSS and the report's totals."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    import torch

    torch.set_num_threads(1)
    from spmd.simulate import GPTConfig, model_workload, parse_plan, simulate

    started = time.perf_counter()
    plan = parse_plan(plan_text)
    cfg = GPTConfig(layers=32, dim=4096, heads=32, vocab=32000, seq=4096, batch=batch)
    report = simulate(model_workload("gpt", cfg, plan), plan)
    seconds = time.perf_counter() - started
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    print(
        json.dumps(
            {
                "plan": report.plan,
                "ranks": report.world_size,
                "seconds": seconds,
                "rss": rss,
                "state": report.state.params + report.state.grads + report.state.optimizer,
                "peak": report.peak,
                "comm_bytes": report.comm_bytes,
                "comm_seconds": report.comm_seconds,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1, help="sequences per data-parallel rank")
    parser.add_argument("--plans", nargs="+", default=list(PLANS))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.batch)
        return
    gib = 2.0**30
    print(f"7B-shaped GPT, batch {args.batch} per dp rank; one process per plan, one core, one thread")
    print(
        f"{'plan':<22}{'ranks':>6}{'time':>9}{'peak RSS':>11}{'time/60s':>10}{'RSS/2GiB':>10}"
        f"{'state/rank':>12}{'peak/rank':>12}{'comm/step':>12}{'ring time':>11}"
    )
    for plan in args.plans:
        out = subprocess.run(
            [sys.executable, __file__, "--child", plan, "--batch", str(args.batch)],
            capture_output=True,
            text=True,
            check=False,
        )
        if out.returncode != 0:
            print(f"{plan:<22} failed:\n{out.stderr}")
            continue
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"{r['plan']:<22}{r['ranks']:>6}{r['seconds']:>8.1f}s{r['rss'] / gib:>9.2f}Gi"
            f"{r['seconds'] / BUDGET_S:>10.2f}{r['rss'] / BUDGET_BYTES:>10.2f}"
            f"{r['state'] / gib:>10.2f}Gi{r['peak'] / gib:>10.1f}Gi{r['comm_bytes'] / gib:>10.1f}Gi"
            f"{r['comm_seconds']:>10.2f}s"
        )


if __name__ == "__main__":
    main()
