"""How long ``python -m spmd.plan`` takes to rank the layouts of Llama 3 8B on 1,024 ranks and 70B on 4,096, on one core.

    python benchmarks/plan_search.py           # both searches, each in a fresh process pinned to one core
    python benchmarks/plan_search.py --quick   # the 8B search only

Each search runs as the README writes it, in a fresh process pinned to one CPU core with one torch
thread; the wall time counts everything a user waits for: starting Python, importing torch and spmd,
enumerating, bounding, simulating, composing, and the why lines of the top five. The issue's budgets
are 10 s (8B) and 60 s (70B); the last column is the ratio to it. The search counts come from the
printed report. There is no torch.distributed.tensor counterpart: torch has no plan search (Meta's
autoparallel, an integer program over DTensor strategies, reports 35 s for a 1B and 47 s for an 8B
Llama on 2-d meshes of 64-128 GPUs, on its own hardware).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

CASES = (
    (
        "llama 8b, 1,024 ranks",
        ["--preset", "8b", "--world", "1024", "--ranks-per-node", "8", "--memory", "80GiB"],
        10.0,
    ),
    (
        "llama 70b, 4,096 ranks",
        ["--preset", "70b", "--world", "4096", "--ranks-per-node", "8", "--memory", "80GiB", "--global-batch", "2048"],
        60.0,
    ),
)


def _pin() -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def run_case(argv: list[str]) -> tuple[float, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-m", "spmd.plan", "--model", "llama", *argv],
        capture_output=True, text=True, env=env, preexec_fn=_pin, check=False,
    )  # fmt: skip
    seconds = time.perf_counter() - started
    if out.returncode:
        raise SystemExit(f"python -m spmd.plan {' '.join(argv)} failed:\n{out.stderr}")
    return seconds, out.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the 8B search only")
    args = parser.parse_args()
    cases = CASES[:1] if args.quick else CASES
    print("python -m spmd.plan, fresh process pinned to one core, wall time including start-up and imports")
    print(
        f"{'case':<24}{'layouts':>9}{'simulated':>11}{'programs':>10}{'best plan':>36}{'step':>11}{'time':>8}{'/budget':>9}"
    )
    for name, argv, budget in cases:
        seconds, report = run_case(argv)
        searched = re.search(r"searched (\d+) layouts .*?, (\d+) simulated \((\d+) distinct", report)
        best = re.search(r"^ 1  (\S+)\s+(\S+ \S+)", report, re.MULTILINE)
        layouts, simulated, programs = searched.groups() if searched else ("?", "?", "?")
        plan, step = best.groups() if best else ("?", "?")
        print(
            f"{name:<24}{layouts:>9}{simulated:>11}{programs:>10}{plan:>36}{step:>11}{seconds:>7.1f}s{seconds / budget:>9.2f}"
        )


if __name__ == "__main__":
    main()
