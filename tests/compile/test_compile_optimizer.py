"""A compiled optimizer step over DTensor parameters (torch's "compiled optimizer"): one graph for
AdamW over every parameter, the same values as the eager step, nothing gathered."""

from __future__ import annotations

import torch
import torch._dynamo
from torch import nn

from spmd.tensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import fallback_report, reset_fallback_report
from spmd.testing import run_threaded, seeded_randn

LAYOUTS = {"rows": [Shard(0)], "columns": [Shard(1)], "replicated": [Replicate()]}


def adamw_steps(backend: str | None, steps: int = 3) -> dict[str, torch.Tensor]:
    """Parameters after ``steps`` AdamW steps (``backend`` None: eager) on a 2-rank mesh, gathered."""
    mesh = init_device_mesh("cpu", (2,))
    params = {
        name: nn.Parameter(distribute_tensor(seeded_randn(4, 6, seed=i), mesh, layout))
        for i, (name, layout) in enumerate(LAYOUTS.items())
    }
    optimizer = torch.optim.AdamW(params.values(), lr=0.1, weight_decay=0.01)
    step = optimizer.step if backend is None else torch.compile(optimizer.step, backend=backend)
    for n in range(steps):
        for i, param in enumerate(params.values()):
            param.grad = distribute_tensor(seeded_randn(4, 6, seed=10 * n + i), mesh, param.placements)
        step()
    assert all(isinstance(p, DTensor) and p.placements == tuple(LAYOUTS[n]) for n, p in params.items())
    return {name: param.full_tensor() for name, param in params.items()}


def test_a_compiled_adamw_step_matches_the_eager_step() -> None:
    """inductor rewrites lerp as prims.fma, whose rule is registered by name (its library loads late)."""
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 8)
    reset_fallback_report()
    eager = run_threaded(adamw_steps, 2, None)[0]
    compiled = run_threaded(adamw_steps, 2, "inductor")
    for rank_result in compiled:
        for name, value in eager.items():
            torch.testing.assert_close(rank_result[name], value)
    assert len(fallback_report()) == 0, f"the compiled step gathered:\n{fallback_report()}"
