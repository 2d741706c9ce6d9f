"""benchmarks/cuda_check.py on CPU: the GPU check script keeps working where CI can run it.

The script runs every check in its own process; CI runs all of them on CPU except ``demo-compile``
(25 s with aot_eager, 70 s with inductor on two cores; ``tests/compile/test_compile_train.py``
covers the demo compiled), with 12 of the op-sweep slice's ops and 3 training steps.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiprocess  # the torchrun check starts a gloo process

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "cuda_check.py")
CI_CHECKS = ("demo", "demo-fsdp", "torchrun", "adamw", "sweep", "dispatch", "tp-step")
ROWS = (
    "demo GPT, 2x2 threads",
    "demo GPT, 2x2 threads --fsdp",
    "demo GPT, torchrun world of 1 (gloo)",
    "AdamW(fused=True) on DTensors",
    "AdamW(foreach=True) on DTensors",
    "op sweep slice, float32",
    "op sweep slice, bfloat16",
    "dispatch overhead, ours/torch",
    "TP step, tp=2 threads, ours/torch",
)


def run_script(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    # From another directory and without PYTHONPATH: the script finds the checkout itself.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, SCRIPT, "--device", "cpu", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=os.path.dirname(SCRIPT),
        env=env,
    )


def test_every_ci_check_is_ok_on_cpu_and_the_table_says_so() -> None:
    result = run_script("--rows", ",".join(CI_CHECKS), "--steps", "3", "--sweep-ops", "12", timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    out = result.stdout
    assert out.startswith("torch "), out[:200]
    table = out[out.index("\ncheck ") :]
    for name in ROWS:
        row = re.search(rf"^{re.escape(name)} +(ok|FAILED) ", table, re.MULTILINE)
        assert row is not None, f"no row {name!r} in\n{table}"
        assert row.group(1) == "ok", table
    assert "loss max rel diff" in table and "ours/torch geo-mean" in table
    assert f"\n{len(ROWS)} ok, 0 FAILED, in " in out


def test_a_check_that_fails_makes_the_script_exit_non_zero() -> None:
    # A check past its time limit is killed and reported FAILED; the table is still printed.
    result = run_script("--rows", "adamw", "--row-timeout", "0.5", timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "adamw" in result.stdout and "FAILED" in result.stdout and "timed out after" in result.stdout
    assert "0 ok, 1 FAILED" in result.stdout
    unknown = run_script("--rows", "nosuch", timeout=120)
    assert unknown.returncode == 2 and "unknown check(s) nosuch" in unknown.stderr
