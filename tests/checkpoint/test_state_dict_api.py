"""spmd.checkpoint.state_dict: torch.distributed.checkpoint.state_dict's API on spmd DTensors.

A small MLP, tensor-parallel with ``parallelize_module`` on rank threads, against the same MLP on
one device: torch's own ``get_*_state_dict`` on the one-device model is the oracle for keys and
values, and its forward and AdamW steps for what a loaded model computes.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint.state_dict as torch_dsd
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import spmd.checkpoint as checkpoint
import spmd.checkpoint.state_dict as dsd
from spmd.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from spmd.tensor import DeviceMesh, DTensor, Shard, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.tensor_parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from spmd.testing import run_threaded
from spmd.testing import seeded_randn as randn

FULL = StateDictOptions(full_state_dict=True)
NAMES = ["up.weight", "up.bias", "down.weight", "down.bias"]


class MLP(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.up = nn.Linear(6, 8)
        self.down = nn.Linear(8, 3)
        with torch.no_grad():
            for i, param in enumerate(self.parameters()):
                param.copy_(randn(*param.shape, seed=seed * 10 + i) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(x)))


def tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    return parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, foreach=False)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss = F.mse_loss(model(randn(4, 6, seed=100 + step)), randn(4, 3, seed=200 + step))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def one_device_after(steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = MLP(seed=0)
    optimizer = adamw(model)
    train(model, optimizer, range(steps))
    return model, optimizer


def assert_same_tensors(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert list(actual) == list(expected)
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert not isinstance(actual[key], DTensor), key
            torch.testing.assert_close(actual[key], value, msg=key)
        else:
            assert actual[key] == value, key


# ----- same names and signatures as torch -----------------------------------------------------------
def test_every_public_name_of_torchs_module_with_its_signature() -> None:
    assert dsd.__all__ == torch_dsd.__all__
    for name in torch_dsd.__all__:
        theirs, ours = getattr(torch_dsd, name), getattr(dsd, name)
        if inspect.isfunction(theirs):
            expected = [(p.name, p.kind, p.default) for p in inspect.signature(theirs).parameters.values()]
            actual = [(p.name, p.kind, p.default) for p in inspect.signature(ours).parameters.values()]
            assert actual == expected, name
    fields = [(f.name, f.default) for f in dataclasses.fields(StateDictOptions)]
    assert fields == [(f.name, f.default) for f in dataclasses.fields(torch_dsd.StateDictOptions)]


# ----- model state_dict ---------------------------------------------------------------------------
def test_sharded_and_full_model_state_dict() -> None:
    expected = torch_dsd.get_model_state_dict(MLP(seed=0))

    def state_dicts() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        model = tensor_parallel(MLP(seed=0), init_device_mesh("cpu", (2,)))
        sharded = get_model_state_dict(model)
        assert sharded["up.weight"].placements == (Shard(0),)  # the parameter itself, as DCP saves it
        assert sharded["up.weight"].to_local().shape == (4, 6)
        gathered = {name: value.full_tensor() for name, value in sharded.items()}
        offloaded = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        on_cpu = get_model_state_dict(model, options=StateDictOptions(cpu_offload=True))
        assert on_cpu["up.weight"].placements == (Shard(0),) and on_cpu["up.weight"].device.type == "cpu"
        return gathered, get_model_state_dict(model, options=FULL), offloaded

    (gathered, full, offloaded_0), (_, _, offloaded_1) = run_threaded(state_dicts, 2)
    assert_same_tensors(gathered, expected)
    assert_same_tensors(full, expected)
    assert_same_tensors(offloaded_0, expected)
    assert offloaded_1 == {}  # full + cpu_offload: only rank 0 holds the model, as in torch


def test_full_state_dict_loads_into_the_parallel_model_locally() -> None:
    """A one-device state_dict goes into the DTensor parameters with no collective: each rank cuts
    its own blocks; the model then computes what the one-device model computes."""
    one_device = MLP(seed=0)
    full = one_device.state_dict()
    x = randn(5, 6, seed=7)

    def load_then_forward() -> tuple[Any, int, torch.Tensor]:
        model = tensor_parallel(MLP(seed=1), init_device_mesh("cpu", (2,)))
        with CommDebugMode() as comm:
            result = set_model_state_dict(model, full, options=FULL)
        return result, comm.get_total_counts(), model(x)

    for result, collectives, out in run_threaded(load_then_forward, 2):
        assert result.missing_keys == [] and result.unexpected_keys == []
        assert collectives == 0
        torch.testing.assert_close(out, one_device(x))


def test_broadcast_from_rank0_needs_the_state_on_rank_0_only() -> None:
    one_device = MLP(seed=0)
    x = randn(5, 6, seed=7)

    def load_then_forward() -> torch.Tensor:
        mesh = init_device_mesh("cpu", (2,))
        model = tensor_parallel(MLP(seed=1), mesh)
        given = one_device.state_dict() if mesh.get_rank() == 0 else {}
        set_model_state_dict(model, given, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        return model(x)

    for out in run_threaded(load_then_forward, 2):
        torch.testing.assert_close(out, one_device(x))


def test_strict_reports_missing_and_unexpected_keys_like_torch() -> None:
    def damaged(state: dict[str, Any]) -> dict[str, Any]:
        state = dict(state)
        del state["down.bias"]
        state["head.weight"] = torch.zeros(2)
        return state

    plain = MLP(seed=0)
    expected = torch_dsd.set_model_state_dict(
        plain, damaged(plain.state_dict()), options=StateDictOptions(strict=False)
    )

    def load_damaged() -> tuple[str, Any, str]:
        model = tensor_parallel(MLP(seed=0), init_device_mesh("cpu", (2,)))
        with pytest.raises(RuntimeError) as strict_error:
            set_model_state_dict(model, damaged(get_model_state_dict(model)))
        loose = set_model_state_dict(
            model, damaged(get_model_state_dict(model)), options=StateDictOptions(strict=False)
        )
        optimizer = adamw(model)
        optim_state = get_optimizer_state_dict(model, optimizer)
        del optim_state["state"]["up.bias"]
        with pytest.raises(RuntimeError, match=r"up\.bias") as optim_error:
            set_optimizer_state_dict(model, optimizer, optim_state)
        return str(strict_error.value), loose, str(optim_error.value)

    strict_message, loose, optim_message = run_threaded(load_damaged, 2)[0]
    assert 'Missing key(s) in state_dict: "down.bias"' in strict_message
    assert 'Unexpected key(s) in state_dict: "head.weight"' in strict_message
    assert loose == expected
    assert (loose.missing_keys, loose.unexpected_keys) == (["down.bias"], ["head.weight"])
    assert "strict=False" in optim_message


# ----- optimizer state_dict -----------------------------------------------------------------------
def test_optimizer_state_after_two_adamw_steps_equals_one_device() -> None:
    one_device, one_device_optimizer = one_device_after(steps=2)
    expected = torch_dsd.get_optimizer_state_dict(one_device, one_device_optimizer)
    expected_flat = torch_dsd.get_optimizer_state_dict(
        one_device, one_device_optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )

    def train_and_get() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        model = tensor_parallel(MLP(seed=0), init_device_mesh("cpu", (2,)))
        optimizer = adamw(model)
        train(model, optimizer, range(2))
        sharded = get_optimizer_state_dict(model, optimizer)
        assert isinstance(sharded["state"]["up.weight"]["exp_avg"], DTensor)
        flat = get_optimizer_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
        )
        return get_optimizer_state_dict(model, optimizer, options=FULL), flat, sharded["param_groups"][0]

    full, flat, sharded_group = run_threaded(train_and_get, 2)[0]
    assert list(full["state"]) == NAMES
    for name in NAMES:
        assert_same_tensors(full["state"][name], expected["state"][name])
    assert full["param_groups"] == expected["param_groups"] == [sharded_group]
    assert_same_tensors(flat, expected_flat)


@pytest.mark.parametrize("form", ["nested", "flattened", "broadcast_from_rank0"])
def test_full_optimizer_state_resumes_training_like_one_device(form: str) -> None:
    """Model and AdamW state of a one-device run after 2 steps, loaded full into a parallel model
    and fresh optimizer (other weights, other lr): steps 3 and 4 give the one-device losses."""
    one_device, one_device_optimizer = one_device_after(steps=2)
    # a copy: the state_dicts hold the live tensors, which the next steps update
    model_state, optim_state = copy.deepcopy(torch_dsd.get_state_dict(one_device, one_device_optimizer))
    expected_losses = train(one_device, one_device_optimizer, range(2, 4))
    flatten, broadcast = form == "flattened", form == "broadcast_from_rank0"
    if flatten:
        optim_state = torch_dsd._flatten_optim_state_dict(optim_state)

    def resume() -> list[float]:
        mesh = init_device_mesh("cpu", (2,))
        model = tensor_parallel(MLP(seed=1), mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.5, foreach=False)
        options = StateDictOptions(
            full_state_dict=True, flatten_optimizer_state_dict=flatten, broadcast_from_rank0=broadcast
        )
        holds_state = not broadcast or mesh.get_rank() == 0
        set_state_dict(
            model,
            optimizer,
            model_state_dict=model_state if holds_state else {},
            optim_state_dict=optim_state if holds_state else {},
            options=options,
        )
        assert isinstance(optimizer.state[model.up.weight]["exp_avg"], DTensor)
        assert optimizer.param_groups[0]["lr"] == 0.01
        return train(model, optimizer, range(2, 4))

    for losses in run_threaded(resume, 2):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses))


def test_optimizers_of_two_stages_share_one_flattened_state_dict() -> None:
    """As torchtitan saves pipeline stages: one optimizer per part, their flattened state_dicts
    merged into one; each optimizer then loads its own entries back from the merged one."""
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    full_flat = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)

    def save_then_load() -> tuple[dict[str, Any], dict[str, Any]]:
        model = tensor_parallel(MLP(seed=0), init_device_mesh("cpu", (2,)))
        stages = [torch.optim.AdamW(model.up.parameters(), lr=0.01), torch.optim.SGD(model.down.parameters(), lr=0.1)]
        train(model, stages[0], range(2))
        merged = {
            key: value
            for stage in stages
            for key, value in get_optimizer_state_dict(model, stage, options=flat).items()
        }
        fresh = [torch.optim.AdamW(model.up.parameters(), lr=0.5), torch.optim.SGD(model.down.parameters(), lr=0.5)]
        for stage in fresh:
            set_optimizer_state_dict(model, stage, merged, options=flat)
        return get_optimizer_state_dict(model, stages, options=full_flat), get_optimizer_state_dict(
            model, fresh, options=full_flat
        )

    saved, loaded = run_threaded(save_then_load, 2)[0]
    assert saved["param_groups.up.weight.lr"] == 0.01 and saved["param_groups.down.weight.lr"] == 0.1
    assert "state.up.weight.exp_avg" in saved
    assert_same_tensors(loaded, saved)


# ----- DCP ----------------------------------------------------------------------------------------
def test_dcp_round_trip_onto_another_mesh(tmp_path: Path) -> None:
    """Saved tensor-parallel over 4 ranks (optimizer flattened, as torchtitan saves it), loaded over
    2 ranks into a model and optimizer of other weights: the full states match."""
    path = str(tmp_path / "step-2")
    flat = StateDictOptions(flatten_optimizer_state_dict=True)

    def full_states(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        full = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
        return {**get_model_state_dict(model, options=full), **get_optimizer_state_dict(model, optimizer, options=full)}

    def save() -> dict[str, Any]:
        model = tensor_parallel(MLP(seed=0), init_device_mesh("cpu", (4,)))
        optimizer = adamw(model)
        train(model, optimizer, range(2))
        state = {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, optimizer, options=flat),
        }
        checkpoint.save(state, path)
        return full_states(model, optimizer)

    def load() -> dict[str, Any]:
        model = tensor_parallel(MLP(seed=1), init_device_mesh("cpu", (2,)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.5, foreach=False)
        state = {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, optimizer, options=flat),
        }
        checkpoint.load(state, path)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"], options=flat)
        return full_states(model, optimizer)

    saved = run_threaded(save, 4)[0]
    for loaded in run_threaded(load, 2):
        assert_same_tensors(loaded, saved)


# ----- wrapper prefixes ---------------------------------------------------------------------------
def wrapped(model: MLP) -> nn.Module:
    """Activation checkpointing on ``up`` and torch.compile around the whole (never run here)."""
    model.up = checkpoint_wrapper(model.up)  # type: ignore[assignment]
    return torch.compile(model)  # type: ignore[return-value]


def test_compile_and_checkpoint_wrapper_prefixes_are_removed() -> None:
    plain_wrapped = wrapped(MLP(seed=0))
    expected_model = torch_dsd.get_model_state_dict(plain_wrapped)
    expected_optim = torch_dsd.get_optimizer_state_dict(plain_wrapped, adamw(plain_wrapped))
    assert list(expected_model) == NAMES

    def keys_then_reload() -> tuple[list[str], list[str], list[str], Any]:
        model = wrapped(tensor_parallel(MLP(seed=0), init_device_mesh("cpu", (2,))))  # type: ignore[arg-type]
        optimizer = adamw(model)
        model_state, optim_state = get_state_dict(model, optimizer)
        full = get_model_state_dict(model, options=FULL)
        loaded = set_state_dict(model, optimizer, model_state_dict=full, optim_state_dict=optim_state, options=FULL)
        return list(model_state), list(optim_state["state"]), optim_state["param_groups"][0]["params"], loaded

    model_keys, state_keys, group_params, loaded = run_threaded(keys_then_reload, 2)[0]
    assert model_keys == state_keys == group_params == NAMES
    assert list(expected_optim["state"]) == NAMES
    assert loaded.missing_keys == [] and loaded.unexpected_keys == []


class FSDP1Style(nn.Module):
    """Holds the module it wraps as ``_fsdp_wrapped_module``, as FSDP1's wrapper does."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self._fsdp_wrapped_module = inner


def test_fsdp1_wrapper_prefix_is_removed() -> None:
    model = MLP(seed=0)
    model.down = FSDP1Style(model.down)  # type: ignore[assignment]
    assert "down._fsdp_wrapped_module.weight" in model.state_dict()
    assert list(get_model_state_dict(model)) == NAMES
    other = MLP(seed=1)
    result = set_model_state_dict(model, other.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == []
    torch.testing.assert_close(model.down._fsdp_wrapped_module.weight, other.down.weight)


# ----- against torch's DTensor, on gloo processes -------------------------------------------------
def torch_and_spmd_side_by_side() -> dict[str, Any]:
    """The MLP tensor-parallel twice in one gloo process group: with torch's DTensor (torch's own
    functions) and with spmd's (ours); trained 2 steps each, then each loads a one-device state
    broadcast from rank 0."""
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
    from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize

    torch_model = torch_parallelize(
        MLP(seed=0), torch_init_device_mesh("cpu", (2,)), {"up": TorchColwise(), "down": TorchRowwise()}
    )
    spmd_model = tensor_parallel(MLP(seed=0), init_device_mesh("cpu", (2,)))
    torch_optimizer, spmd_optimizer = adamw(torch_model), adamw(spmd_model)
    for model, optimizer in ((torch_model, torch_optimizer), (spmd_model, spmd_optimizer)):
        train(model, optimizer, range(2))
    full = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    offload = StateDictOptions(full_state_dict=True, cpu_offload=True)
    result = {
        "torch": torch_dsd.get_state_dict(torch_model, torch_optimizer, options=full),
        "spmd": get_state_dict(spmd_model, spmd_optimizer, options=full),
        "torch_offloaded": torch_dsd.get_model_state_dict(torch_model, options=offload),
        "spmd_offloaded": get_model_state_dict(spmd_model, options=offload),
    }
    broadcast = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    for model, set_model in ((torch_model, torch_dsd.set_model_state_dict), (spmd_model, set_model_state_dict)):
        # a state_dict each: torch's set_model_state_dict puts its DTensors into the one it is given
        source = MLP(seed=3).state_dict() if torch.distributed.get_rank() == 0 else {}
        set_model(model, source, options=broadcast)
    result["torch_blocks"] = {name: value.to_local() for name, value in torch_model.state_dict().items()}
    result["spmd_blocks"] = {name: value.to_local() for name, value in spmd_model.state_dict().items()}
    return result


@pytest.mark.multiprocess
def test_same_state_dicts_as_torchs_dtensor_on_gloo() -> None:
    from spmd.testing.multiprocess import run_multiprocess

    for rank in run_multiprocess(torch_and_spmd_side_by_side, 2, timeout=240):
        (torch_model_state, torch_optim_state), (spmd_model_state, spmd_optim_state) = rank["torch"], rank["spmd"]
        assert_same_tensors(spmd_model_state, torch_model_state)
        assert_same_tensors(spmd_optim_state, torch_optim_state)
        assert_same_tensors(rank["spmd_blocks"], rank["torch_blocks"])
        assert_same_tensors(rank["spmd_offloaded"], rank["torch_offloaded"])  # rank 1: {} for both
