"""fully_shard's default layout is torch's FSDP2's: the same placements and local shapes, parameter by parameter.

Each of 4 gloo processes builds one model twice, tensor-parallelises it on ``world["tp"]`` and
fully-shards it on ``world["dp"]`` (a 2 x 2 world), once with torch's ``parallelize_module`` and
``fully_shard`` and once with spmd's, and reports every parameter's placements, local shape and
checkpoint chunks. The model has a column-wise layer (tp cuts dim 0 of weight and bias: FSDP2 puts a
``_StridedShard`` over dp), a row-wise one (tp cuts dim 1), a row-wise embedding, a plain
parameter, and dims that split unevenly or leave a rank an empty shard.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from spmd.testing import run_multiprocess

DP, TP = 2, 2


class Model(nn.Module):
    """Uneven on purpose: 10 rows over tp then dp (3 + 2 per tp piece), 7 rows over dp (4 + 3), 5 embedding
    rows over tp (3 | 2, then 2 + 1 | 1 + 1), a [1, 7] head (one dp rank gets an empty shard)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 6)
        self.up = nn.Linear(6, 10)
        self.down = nn.Linear(10, 7)
        self.head = nn.Linear(7, 1)


def _plan(library: str) -> dict[str, Any]:
    if library == "torch":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    else:
        from spmd.tensor_parallel import ColwiseParallel, RowwiseParallel  # type: ignore[assignment]
    return {"emb": RowwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}


def _sharded(library: str, *, first_free_dim: bool = False) -> nn.Module:
    """The model, tp on the tp sub-mesh and fully_shard on the dp sub-mesh, by ``library``."""
    options: dict[str, Any] = {}
    if library == "torch":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import parallelize_module
    else:
        from spmd.fsdp import fully_shard, shard_first_free_dim  # type: ignore[assignment]
        from spmd.tensor import init_device_mesh  # type: ignore[assignment]
        from spmd.tensor_parallel import parallelize_module  # type: ignore[assignment]
    world = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    if first_free_dim:
        options["shard_placement_fn"] = shard_first_free_dim(world["dp"])
    torch.manual_seed(0)
    model = parallelize_module(Model(), world["tp"], _plan(library))
    fully_shard(model, mesh=world["dp"], **options)
    return model


def _layout(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Per parameter: its placements (torch's reprs), mesh dim names, global and local shape, checkpoint chunks."""
    out = {}
    for name, p in model.named_parameters():
        chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in p.__create_chunk_list__()]
        out[name] = {
            "placements": [repr(x) for x in p.placements],
            "mesh": tuple(p.device_mesh.mesh_dim_names),
            "shape": tuple(p.shape),
            "local": tuple(p.to_local().shape),
            "chunks": chunks,
            "full": p.full_tensor(),
        }
    return out


def both_layouts() -> dict[str, Any]:
    """On one rank: torch's layout, spmd's default and spmd's ``shard_first_free_dim``."""
    return {
        "torch": _layout(_sharded("torch")),
        "spmd": _layout(_sharded("spmd")),
        "first_free_dim": _layout(_sharded("spmd", first_free_dim=True)),
    }


@pytest.fixture(scope="module")
def per_rank() -> list[dict[str, Any]]:
    """``both_layouts`` on each of the 4 gloo processes (one world for both tests)."""
    return run_multiprocess(both_layouts, DP * TP, timeout=240)


@pytest.mark.multiprocess
def test_default_layout_equals_torchs_fsdp2_on_dp_x_tp(per_rank: list[dict[str, Any]]) -> None:
    torch.manual_seed(0)
    full = dict(Model().named_parameters())
    for rank, result in enumerate(per_rank):
        theirs, ours = result["torch"], result["spmd"]
        assert ours.keys() == theirs.keys()
        for name, want in theirs.items():
            got = ours[name]
            for key in ("placements", "mesh", "shape", "local", "chunks"):
                assert got[key] == want[key], (rank, name, key)
            torch.testing.assert_close(got["full"], full[name].detach(), msg=name)
            torch.testing.assert_close(want["full"], full[name].detach(), msg=name)
    placements = {name: r["placements"] for name, r in per_rank[0]["torch"].items()}
    strided = ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"]
    assert placements["up.weight"] == placements["up.bias"] == placements["emb.weight"] == strided
    assert placements["down.weight"] == ["Shard(dim=0)", "Shard(dim=1)"]
    assert placements["head.weight"] == ["Shard(dim=0)"]  # a plain parameter: on the dp mesh alone
    locals_up = [r["torch"]["up.weight"]["local"][0] for r in per_rank]
    locals_emb = [r["torch"]["emb.weight"]["local"][0] for r in per_rank]
    locals_head = [r["torch"]["head.weight"]["local"][0] for r in per_rank]
    # ranks (dp, tp) = (0,0), (0,1), (1,0), (1,1): dp cuts each tp piece
    assert (locals_up, locals_emb, locals_head) == ([3, 3, 2, 2], [2, 1, 1, 1], [1, 1, 0, 0])


@pytest.mark.multiprocess
def test_first_free_dim_is_spmds_former_layout(per_rank: list[dict[str, Any]]) -> None:
    torch.manual_seed(0)
    full = dict(Model().named_parameters())
    old = per_rank[0]["first_free_dim"]
    assert old["up.weight"]["placements"] == ["Shard(dim=1)", "Shard(dim=0)"]
    assert old["up.bias"]["placements"] == ["Replicate()", "Shard(dim=0)"]  # tp cut its only dim
    assert old["emb.weight"]["placements"] == ["Shard(dim=1)", "Shard(dim=0)"]
    assert old["down.weight"]["placements"] == ["Shard(dim=0)", "Shard(dim=1)"]
    assert old["head.weight"]["placements"] == ["Shard(dim=1)"]  # dim 0 is shorter than dp
    for result in per_rank:
        for name, got in result["first_free_dim"].items():
            torch.testing.assert_close(got["full"], full[name].detach(), msg=name)
