"""spmd.checkpoint on torch.distributed.checkpoint: save DTensors on one layout, load on another.

Every test saves real DCP checkpoints (FileSystemWriter files plus ``.metadata``) and compares the
loaded tensors' ``full_tensor()`` bitwise with the plain tensors they were made from. Rank threads
(``run_threaded``) run most of it; gloo processes (``run_multiprocess``) run ``dcp.save``/``dcp.load``
themselves and read the threads' checkpoint, and the threads read theirs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

import spmd.checkpoint as checkpoint
from spmd.checkpoint import CheckpointError
from spmd.fsdp import fully_shard
from spmd.tensor import DeviceMesh, DTensor, Partial, Placement, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.checkpoint_protocol import PartialPlacementError, create_write_items
from spmd.tensor_parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from spmd.testing import run_threaded, seeded_randint
from spmd.testing import seeded_randn as randn
from spmd.testing.multiprocess import run_multiprocess

S0, S1, R = Shard(0), Shard(1), Replicate()

# name -> (mesh shape, placements) each tensor is saved with, on a world of 4 ranks
SAVE_LAYOUTS: dict[str, tuple[tuple[int, ...], list[Placement]]] = {
    "uneven": ((4,), [S0]),  # 7 rows over 4 ranks: 2, 2, 2, 1
    "tiny": ((4,), [S0]),  # 3 rows over 4 ranks: rank 3 holds none
    "replicated": ((4,), [R]),
    "grid": ((2, 2), [S0, S1]),
    "rows_twice": ((2, 2), [S0, S0]),  # rows cut by mesh dim 0, then each piece again by dim 1
    "partial": ((2, 2), [Partial(), S1]),
    "ints": ((4,), [S1]),
    "empty": ((4,), [S0]),  # no elements: only the shape is recorded
}
# how many chunks each tensor is saved as, and which ranks write them: one copy of each block
EXPECTED_WRITERS = {
    "uneven": [0, 1, 2, 3],
    "tiny": [0, 1, 2],
    "replicated": [0],
    "grid": [0, 1, 2, 3],
    "rows_twice": [0, 1, 2, 3],
    "partial": [0, 1],
    "ints": [0, 1, 2, 3],
    "empty": [0],
}


def partial_addends() -> torch.Tensor:
    """Two integer-valued addends, so their sum (the Partial tensor) is exact in any order."""
    return seeded_randint(8, 2, 4, 5, seed=6, low=-8).float()


def full_tensors() -> dict[str, torch.Tensor]:
    """The plain tensors every test distributes and compares against."""
    return {
        "uneven": randn(7, 5, seed=1),
        "tiny": randn(3, 2, seed=2),
        "replicated": randn(6, 4, seed=3),
        "grid": randn(7, 6, seed=4),
        "rows_twice": randn(9, 3, seed=5),
        "partial": partial_addends().sum(0),
        "ints": torch.arange(30).reshape(3, 10),
        "empty": torch.zeros(0, 5),
    }


def saved_state_dict() -> dict[str, Any]:
    """Each full tensor laid out as SAVE_LAYOUTS says, plus plain values (call on a world of 4)."""
    state: dict[str, Any] = {}
    meshes: dict[tuple[int, ...], DeviceMesh] = {}
    for name, full in full_tensors().items():
        mesh_shape, placements = SAVE_LAYOUTS[name]
        mesh = meshes.setdefault(mesh_shape, init_device_mesh("cpu", mesh_shape))
        if name == "partial":
            coordinate = mesh.get_coordinate()
            assert coordinate is not None
            addend = partial_addends()[coordinate[0]]
            local = addend.tensor_split(2, dim=1)[coordinate[1]]
            state[name] = DTensor.from_local(local, mesh, placements, shape=full.shape)
        else:
            state[name] = distribute_tensor(full, mesh, placements)
    state["extras"] = {"step": 7, "scale": torch.tensor(2.5), "names": ["a", "b"]}
    return state


def save_tensors(path: str) -> None:
    checkpoint.save(saved_state_dict(), path)


def load_tensors(path: str, mesh_shape: tuple[int, ...], placements: list[Placement]) -> dict[str, Any]:
    """Load every saved tensor into ``placements`` on a fresh mesh; return the full tensors and extras."""
    mesh = init_device_mesh("cpu", mesh_shape)
    state: dict[str, Any] = {
        name: distribute_tensor(torch.zeros_like(full), mesh, placements) for name, full in full_tensors().items()
    }
    state["extras"] = {"step": 0, "scale": torch.tensor(0.0), "names": []}
    checkpoint.load(state, path)
    loaded = {name: state[name].full_tensor() for name in full_tensors()}
    return {**loaded, "extras": state["extras"], "placements": state["uneven"].placements}


def assert_loaded_bitwise(per_rank: list[dict[str, Any]]) -> None:
    for loaded in per_rank:
        for name, full in full_tensors().items():
            assert loaded[name].dtype == full.dtype, name
            assert torch.equal(loaded[name], full), name
        assert loaded["extras"]["step"] == 7
        assert loaded["extras"]["names"] == ["a", "b"]
        assert torch.equal(loaded["extras"]["scale"], torch.tensor(2.5))


@pytest.fixture(scope="module")
def threads_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One checkpoint saved by 4 rank threads, shared by the tests that only read it."""
    path = str(tmp_path_factory.mktemp("threads") / "ckpt")
    run_threaded(save_tensors, 4, path)
    return path


# ----- tensors, threads ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("world", "mesh_shape", "placements"),
    [
        (2, (2,), [R]),
        (2, (2,), [S1]),
        (3, (3,), [S0]),
        (4, (2, 2), [S1, R]),
        (4, (2, 2), [R, S0]),
        (1, (1,), [R]),
    ],
)
def test_load_into_another_mesh_and_layout(
    threads_checkpoint: str, world: int, mesh_shape: tuple[int, ...], placements: list[Placement]
) -> None:
    per_rank = run_threaded(load_tensors, world, threads_checkpoint, mesh_shape, placements)
    assert_loaded_bitwise(per_rank)
    assert per_rank[0]["placements"] == tuple(placements)


def test_each_block_is_written_once_by_its_owner(threads_checkpoint: str) -> None:
    metadata = FileSystemReader(threads_checkpoint).read_metadata()
    for name, full in full_tensors().items():
        chunks = metadata.state_dict_metadata[name].chunks  # type: ignore[union-attr]
        writers = sorted(
            int(info.relative_path.split("_")[2]) for index, info in metadata.storage_data.items() if index.fqn == name
        )
        assert writers == EXPECTED_WRITERS[name], name
        assert len(chunks) == len(writers), name
        assert sum(chunk.sizes.numel() for chunk in chunks) == full.numel(), name
        assert len({tuple(chunk.offsets) for chunk in chunks}) == len(chunks), name
    assert sorted(os.listdir(threads_checkpoint)) == [".metadata", *(f"__{r}_0.distcp" for r in range(4))]


def test_saved_partial_is_reduced(threads_checkpoint: str) -> None:
    def load_replicated(path: str) -> torch.Tensor:
        mesh = init_device_mesh("cpu", (2,))
        state = {"partial": distribute_tensor(torch.zeros(4, 5), mesh, [R])}
        checkpoint.load(state, path)
        return state["partial"].to_local()

    for local in run_threaded(load_replicated, 2, threads_checkpoint):
        assert torch.equal(local, partial_addends().sum(0))


def test_plain_torch_reads_the_checkpoint(threads_checkpoint: str) -> None:
    """The files are DCP's own: dcp.load in one process (no group) fills plain tensors."""
    state = {name: torch.zeros_like(full) for name, full in full_tensors().items()}
    checkpoint.load(state, threads_checkpoint)
    for name, full in full_tensors().items():
        assert torch.equal(state[name], full), name


# ----- model and optimizer -------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 8)
        self.down = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(x)))


def build(
    seed: int, mesh: DeviceMesh, lr: float, *, fully_sharded: bool = False
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A seeded MLP, tensor-parallel over ``mesh`` (its "tp" dim if 2-d) and, if ``fully_sharded``,
    also sharded over its "dp" dim; and its AdamW (per-parameter loop: foreach=False)."""
    model = MLP()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if fully_sharded:
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, foreach=False)
    return model, optimizer


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
    """One loss per step; step ``s`` always sees the same batch."""
    losses = []
    for step in steps:
        x, y = randn(4, 6, seed=100 + step), randn(4, 3, seed=200 + step)
        out = model(x)
        if isinstance(out, DTensor):
            out = out.full_tensor()
        loss = F.mse_loss(out, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """A copy of every parameter and optimizer tensor as a plain full tensor, keyed by parameter name."""
    model_sd, optim_sd = checkpoint.get_state_dict(model, optimizer)
    result = {name: value.full_tensor() for name, value in model_sd.items()}
    for name, values in optim_sd["state"].items():
        for key, value in values.items():
            result[f"{name}/{key}"] = value.full_tensor() if isinstance(value, DTensor) else value
    # A replicated DTensor's full_tensor() is its local tensor, which training goes on to update.
    return {key: value.clone() for key, value in result.items()}


def train_and_save(path: str, fully_sharded: bool = False) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Train 2 steps tensor-parallel over 4 ranks (or FSDP x TP on (2, 2)), save, then train 2 more;
    return the saved state and the losses of the last 2 steps."""
    if fully_sharded:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model, optimizer = build(seed=0, mesh=mesh, lr=0.01, fully_sharded=True)
    else:
        model, optimizer = build(seed=0, mesh=init_device_mesh("cpu", (4,)), lr=0.01)
    train(model, optimizer, range(2))
    model_sd, optim_sd = checkpoint.get_state_dict(model, optimizer)
    checkpoint.save({"model": model_sd, "optim": optim_sd, "step": 2}, path)
    return full_state(model, optimizer), train(model, optimizer, range(2, 4))


def resume(
    path: str, mesh_shape: tuple[int, ...], fully_sharded: bool = False
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """A fresh model and optimizer (other weights, other lr) on another layout, loaded, then trained on.

    On a 2-d mesh: FSDP x TP if ``fully_sharded``, else TP over the "tp" sub-mesh (dp replicas).
    """
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp")[-len(mesh_shape) :])
    if fully_sharded:
        model, optimizer = build(seed=1, mesh=mesh, lr=0.5, fully_sharded=True)
    else:
        model, optimizer = build(seed=1, mesh=mesh["tp"] if mesh.ndim == 2 else mesh, lr=0.5)
    model_sd, optim_sd = checkpoint.get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "step": 0}
    checkpoint.load(state, path)
    checkpoint.set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert state["step"] == 2
    assert optimizer.param_groups[0]["lr"] == 0.01
    return full_state(model, optimizer), train(model, optimizer, range(state["step"], 4))


def assert_resumed(saved: tuple[dict[str, torch.Tensor], list[float]], resumed: Any, *, bitwise: bool) -> None:
    saved_state, saved_losses = saved
    loaded_state, resumed_losses = resumed
    assert saved_state.keys() == loaded_state.keys()
    for key, value in saved_state.items():
        assert torch.equal(loaded_state[key], value), key
    if bitwise:
        assert resumed_losses == saved_losses
    else:  # another layout sums partial products in another order
        torch.testing.assert_close(torch.tensor(resumed_losses), torch.tensor(saved_losses), rtol=1e-5, atol=1e-7)


def test_model_and_optimizer_resume_on_another_layout(tmp_path: Path) -> None:
    path = str(tmp_path / "step-2")
    saved = run_threaded(train_and_save, 4, path)[0]
    assert_resumed(saved, run_threaded(resume, 4, path, (4,))[0], bitwise=True)
    for resumed in run_threaded(resume, 2, path, (2,)):
        assert_resumed(saved, resumed, bitwise=False)
    assert_resumed(saved, run_threaded(resume, 4, path, (2, 2))[3], bitwise=False)


def test_fully_sharded_and_tensor_parallel_round_trip(tmp_path: Path) -> None:
    """FSDP x TP on a (2, 2) mesh -> TP over 2 ranks, and back into FSDP x TP."""
    path = str(tmp_path / "fsdp")
    saved = run_threaded(train_and_save, 4, path, True)[0]
    assert_resumed(saved, run_threaded(resume, 2, path, (2,))[1], bitwise=False)
    assert_resumed(saved, run_threaded(resume, 4, path, (2, 2), True)[2], bitwise=True)


def test_replicas_on_sub_meshes_are_written_once(tmp_path: Path) -> None:
    """Tensor parallel over the "tp" sub-mesh of a (2, 2) mesh: ranks 0-1 and 2-3 hold the same
    parameters on two different meshes; DCP's plan dedup keeps one copy of each block."""
    path = str(tmp_path / "tp-submesh")

    def save_on_submesh() -> dict[str, torch.Tensor]:
        model, optimizer = build(
            seed=0, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"], lr=0.01
        )
        train(model, optimizer, range(2))
        model_sd, optim_sd = checkpoint.get_state_dict(model, optimizer)
        checkpoint.save({"model": model_sd, "optim": optim_sd, "step": 2}, path)
        return full_state(model, optimizer)

    saved = run_threaded(save_on_submesh, 4)[0]
    metadata = FileSystemReader(path).read_metadata()
    assert len(metadata.state_dict_metadata["model.up.weight"].chunks) == 2  # type: ignore[union-attr]
    assert len(metadata.state_dict_metadata["model.down.bias"].chunks) == 1  # type: ignore[union-attr]
    loaded_state, _ = run_threaded(resume, 4, path, (4,))[0]
    for key, value in saved.items():
        assert torch.equal(loaded_state[key], value), key


def test_a_module_is_saved_and_loaded_as_its_state_dict(tmp_path: Path) -> None:
    path = str(tmp_path / "module")

    def save_then_load() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        mesh = init_device_mesh("cpu", (2,))
        model, _ = build(seed=0, mesh=mesh, lr=0.01)
        checkpoint.save({"model": model, "step": 3}, path)
        fresh, _ = build(seed=1, mesh=mesh, lr=0.01)
        state = {"model": fresh, "step": 0}
        checkpoint.load(state, path)
        assert state["model"] is fresh and state["step"] == 3
        return (
            {k: v.full_tensor() for k, v in model.state_dict().items()},
            {k: v.full_tensor() for k, v in fresh.state_dict().items()},
        )

    for saved, loaded in run_threaded(save_then_load, 2):
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), key


def test_importing_spmd_tensor_does_not_import_dcp() -> None:
    """Only spmd.checkpoint imports torch.distributed.checkpoint (which imports torch.distributed.tensor)."""
    code = (
        "import sys, torch, spmd.tensor, spmd.tensor_parallel, spmd.tensor.checkpoint_protocol\n"
        "leaked = [m for m in ('torch.distributed.checkpoint', 'torch.distributed.tensor') if m in sys.modules]\n"
        "assert not leaked, leaked"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_optimizer_state_is_keyed_by_parameter_name() -> None:
    def state_keys() -> tuple[list[str], list[str], list[str]]:
        model, optimizer = build(seed=0, mesh=init_device_mesh("cpu", (2,)), lr=0.01)
        model_sd, optim_sd = checkpoint.get_state_dict(model, optimizer)
        return list(model_sd), list(optim_sd["state"]), optim_sd["param_groups"][0]["params"]

    model_keys, state_keys_, group_params = run_threaded(state_keys, 2)[0]
    assert model_keys == state_keys_ == group_params == ["up.weight", "up.bias", "down.weight", "down.bias"]


# ----- errors --------------------------------------------------------------------------------------
def load_expecting_error(path: str, state_fn: Any) -> str:
    mesh = init_device_mesh("cpu", (2,))
    with pytest.raises(CheckpointError) as info:
        checkpoint.load(state_fn(mesh), path)
    return str(info.value)


def wrong_shape(mesh: DeviceMesh) -> dict[str, Any]:
    return {"uneven": distribute_tensor(torch.zeros(5, 7), mesh, [S0])}


def unknown_key(mesh: DeviceMesh) -> dict[str, Any]:
    return {"uneven": distribute_tensor(torch.zeros(7, 5), mesh, [S0]), "decoder.bias": torch.zeros(3)}


def every_tensor(mesh: DeviceMesh) -> dict[str, Any]:
    return {name: distribute_tensor(torch.zeros_like(full), mesh, [R]) for name, full in full_tensors().items()}


def test_shape_mismatch_names_the_key_and_both_shapes(threads_checkpoint: str) -> None:
    for message in run_threaded(load_expecting_error, 2, threads_checkpoint, wrong_shape):
        assert "uneven" in message
        assert "[7, 5]" in message
        assert "[5, 7]" in message


def test_missing_key_is_named(threads_checkpoint: str) -> None:
    for message in run_threaded(load_expecting_error, 2, threads_checkpoint, unknown_key):
        assert "decoder.bias" in message


def test_missing_shard_file_is_named(threads_checkpoint: str, tmp_path: Path) -> None:
    damaged = tmp_path / "damaged"
    shutil.copytree(threads_checkpoint, damaged)
    os.remove(damaged / "__2_0.distcp")
    for message in run_threaded(load_expecting_error, 2, str(damaged), every_tensor):
        assert "__2_0.distcp" in message


def test_failed_save_writes_no_metadata(tmp_path: Path) -> None:
    path = str(tmp_path / "failed")

    def save_unpicklable() -> str:
        state = saved_state_dict()
        state["hook"] = lambda: None  # a plain value DCP must pickle: fails while writing
        with pytest.raises(CheckpointError) as info:
            checkpoint.save(state, path)
        return str(info.value)

    for message in run_threaded(save_unpicklable, 4):
        assert "save write" in message
    assert ".metadata" not in os.listdir(path)
    message = run_threaded(load_expecting_error, 2, path, every_tensor)[0]
    assert ".metadata" in message


def test_partial_is_refused_by_the_protocol_itself(threads_checkpoint: str) -> None:
    """dcp.save called directly (without spmd.checkpoint.save, which reduces) gets told what to do;
    a load into a Partial layout too."""

    def protocol_errors(path: str) -> tuple[str, str]:
        mesh = init_device_mesh("cpu", (2,))
        partial = DTensor.from_local(torch.ones(3), mesh, [Partial()])
        with pytest.raises(PartialPlacementError, match=r"spmd\.checkpoint\.save") as on_save:
            create_write_items("bias", partial)
        with pytest.raises(CheckpointError) as on_load:
            checkpoint.load({"replicated": DTensor.from_local(torch.ones(6, 4), mesh, [Partial()])}, path)
        return str(on_save.value), str(on_load.value)

    on_save, on_load = run_threaded(protocol_errors, 2, threads_checkpoint)[0]
    assert "bias" in on_save and "P(sum)" in on_save
    assert "load into a DTensor laid out as [Replicate()], then redistribute it" in on_load


# ----- gloo processes: dcp.save / dcp.load with their own collectives ------------------------------
def gloo_save(path: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    assert torch.distributed.is_initialized()  # so spmd.checkpoint runs dcp.save itself
    save_tensors(os.path.join(path, "tensors"))
    return train_and_save(os.path.join(path, "model"))


def gloo_load(path: str, threads_path: str) -> dict[str, Any]:
    return {
        "tensors": load_tensors(os.path.join(path, "tensors"), (2,), [S1]),
        "from_threads": load_tensors(threads_path, (2,), [R]),
        "resumed": resume(os.path.join(path, "model"), (2,)),
        "wrong_shape": load_expecting_error(os.path.join(path, "tensors"), wrong_shape),
    }


@pytest.mark.multiprocess
def test_gloo_save_on_4_load_on_2(tmp_path: Path, threads_checkpoint: str) -> None:
    path = str(tmp_path / "gloo")
    saved = run_multiprocess(gloo_save, 4, path, timeout=240)[0]
    loaded = run_multiprocess(gloo_load, 2, path, threads_checkpoint, timeout=240)
    assert_loaded_bitwise([rank["tensors"] for rank in loaded] + [rank["from_threads"] for rank in loaded])
    for rank in loaded:
        assert_resumed(saved, rank["resumed"], bitwise=False)
        assert "uneven" in rank["wrong_shape"] and "[5, 7]" in rank["wrong_shape"]
    # and the threads read what the processes wrote
    assert_loaded_bitwise(run_threaded(load_tensors, 2, os.path.join(path, "tensors"), (2, 1), [S0, R]))
