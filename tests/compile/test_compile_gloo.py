"""torch.compile on real gloo process groups: compiled graphs hold c10d's functional collectives."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd

from spmd.tensor import Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.testing.multiprocess import run_multiprocess

pytestmark = pytest.mark.multiprocess


def compiled_matmul_and_step_on_gloo() -> tuple[bool, list[float], list[float]]:
    full_x, full_w = torch.arange(48.0).reshape(8, 6) / 10, torch.arange(24.0).reshape(6, 4) / 10

    def fn(x, w):
        return torch.relu((x @ w).redistribute(placements=[Replicate()])).sum(0)

    codes: list[str] = []

    def keep(gm, example_inputs):
        codes.append(gm.code)
        return gm

    mesh = init_device_mesh("cpu", (2,))
    x, w = distribute_tensor(full_x, mesh, [Replicate()]), distribute_tensor(full_w, mesh, [Shard(0)])
    step = torch.compile(fn, backend=aot_autograd(fw_compiler=keep), fullgraph=True)
    matmul_ok = torch.allclose(step(x, w).full_tensor(), torch.relu(full_x @ full_w).sum(0))
    # torch's own collectives, which inductor knows how to schedule; not a Python-kernel custom op
    matmul_ok &= "_c10d_functional.all_reduce" in codes[0] and "spmd.all_reduce" not in codes[0]

    from test_compile_train import TINY, demo  # the demo, loaded as the threaded test loads it

    cfg = demo.replace(TINY, dp=1, tp=2, steps=3)
    return matmul_ok, demo.train(demo.replace(cfg, compile="aot_eager")), demo.train(cfg)


def test_compiled_functions_match_eager_on_gloo() -> None:
    for matmul_ok, compiled, eager in run_multiprocess(compiled_matmul_and_step_on_gloo, 2, timeout=300.0):
        assert matmul_ok
        torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-5, atol=1e-6)


def compiled_code_takes_the_mesh_group_on_gloo() -> tuple[bool, list[float]]:
    """torchtitan's vocab-parallel loss, compiled: ``mesh.get_group("tp")`` in the traced code, the
    c10d group then given to the functional collectives and ``dist.get_world_size``."""
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as funcol

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))

    def fn(x):
        group = mesh.get_group("tp")
        return funcol.all_reduce(x, "sum", group) * dist.get_world_size(group)

    x = torch.full((2,), float(dist.get_rank() + 1))
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    eager = fn(x)
    return torch.equal(compiled(x), eager), eager.tolist()


def test_compiled_code_takes_the_mesh_group_on_gloo() -> None:
    for same, values in run_multiprocess(compiled_code_takes_the_mesh_group_on_gloo, 2, timeout=300.0):
        assert same and values == [6.0, 6.0]  # (1 + 2) * 2
