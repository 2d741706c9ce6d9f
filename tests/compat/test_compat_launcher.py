"""python -m spmd.run: run a package's module or a script with the package redirected, plain and under torchrun."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from spmd.run import Launch, parse_args
from spmd.testing import run_torchrun

# A package's entry point, written against torch: it reports what it sees.
REPORT = """
import json
import sys

from torch.distributed.tensor import DTensor

print(json.dumps({"dtensor": DTensor.__module__, "argv": sys.argv[1:], "name": __name__}))
"""

# A torch-style training entry point that torchrun starts on every rank.
SHARDED_MATMUL = """
import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

dist.init_process_group("gloo")
torch.manual_seed(0)
a, b = torch.randn(8, 6), torch.randn(6, 4)
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
product = distribute_tensor(a, mesh, [Shard(0)]) @ distribute_tensor(b, mesh, [Replicate()])
equal = torch.allclose(product.full_tensor(), a @ b)
print(json.dumps({"rank": dist.get_rank(), "dtensor": type(product).__module__, "equal": equal,
                  "local_rows": product.to_local().shape[0]}))
dist.barrier()  # torch 2.13's gloo sometimes aborts at exit when a peer tears down first (torch's DTensor too)
dist.destroy_process_group()
"""


def run(tmp_path: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env=env
    )


def reports(result: subprocess.CompletedProcess[str]) -> list[dict]:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # one flat JSON object per report; under torchrun two ranks' lines may run together on the one pipe
    return [json.loads(report) for report in re.findall(r"\{[^{}]*\}", result.stdout)]


def test_options_before_the_target_are_ours_the_rest_its() -> None:
    assert parse_args(["--redirect", "a,b", "--redirect=c", "-m", "a.train", "--redirect", "x"]) == Launch(
        ("a", "b", "c"), "a.train", True, ("--redirect", "x")
    )
    assert parse_args(["--redirect", "a", "--keep-torch=t.x,t.y", "train.py", "-m", "x"]) == Launch(
        ("a",), "train.py", False, ("-m", "x"), keep_torch=("t.x", "t.y")
    )
    with pytest.raises(SystemExit, match="no module"):
        parse_args(["--redirect", "a"])


def test_module_target_runs_redirected_as_main(third_party, tmp_path: Path) -> None:
    pkg = third_party({"__init__.py": "", "main.py": REPORT}, redirect=False)
    (report,) = reports(run(tmp_path, "-m", "spmd.run", "--redirect", pkg, "-m", f"{pkg}.main", "a", "--lr", "1"))
    assert report == {"dtensor": "spmd.tensor.dtensor", "argv": ["a", "--lr", "1"], "name": "__main__"}


def test_script_target_runs_as_written_and_its_imports_of_the_package_are_redirected(third_party, tmp_path) -> None:
    pkg = third_party({"__init__.py": "", "main.py": REPORT}, redirect=False)
    script = tmp_path / "train.py"
    script.write_text(f"import sys\nimport {pkg}.main\n" + REPORT)
    package_report, script_report = reports(
        run(tmp_path, "-m", "spmd.run", f"--redirect=other,{pkg}", str(script), "x")
    )
    assert package_report["dtensor"] == "spmd.tensor.dtensor"
    assert script_report == {"dtensor": "torch.distributed.tensor", "argv": ["x"], "name": "__main__"}


@pytest.mark.multiprocess
def test_torchrun_runs_the_package_on_spmd_over_gloo(third_party, tmp_path: Path) -> None:
    pkg = third_party({"__init__.py": "", "main.py": SHARDED_MATMUL}, redirect=False)
    launch = ["--redirect", pkg, "-m", f"{pkg}.main"]
    result = run_torchrun("spmd.run", 2, module=True, args=launch, timeout=240, env={"PYTHONPATH": str(tmp_path)})
    per_rank = sorted(reports(result), key=lambda report: report["rank"])
    assert per_rank == [
        {"rank": rank, "dtensor": "spmd.tensor.dtensor", "equal": True, "local_rows": 4} for rank in (0, 1)
    ]
