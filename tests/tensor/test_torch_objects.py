"""torch.distributed.tensor's objects handed to spmd fail with one clear error, entry point by entry point.

When only part of a program is redirected (the import redirect of docs/compat.md), a mesh, DTensor, placement or
parallel style built by torch's DTensor can reach spmd. Each test builds torch's objects on the same
rank threads as spmd's (the threaded world is c10d's default group there), passes them to one spmd
entry point and reads the ``MixedDTensorLibrariesError``: it names the entry point and argument,
torch's class, the object, and the fix. The last tests show what already works across the two
libraries and so needs no error (the functional collectives' stand-in is tested in
tests/compat/test_mixed_objects.py).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
from torch.distributed.tensor import DTensor as TorchDTensor
from torch.distributed.tensor import Partial as TorchPartial
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor import distribute_tensor as torch_distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard as TorchStridedShard

import spmd.tensor
from spmd.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from spmd.fsdp import fully_shard
from spmd.tensor import (
    DTensor,
    MixedDTensorLibrariesError,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
    init_device_mesh,
)
from spmd.tensor.experimental import local_map
from spmd.tensor_parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, parallelize_module
from spmd.testing import run_threaded


def refusal(call: Callable[[], object]) -> str:
    """The message of the ``MixedDTensorLibrariesError`` that ``call`` raises."""
    with pytest.raises(MixedDTensorLibrariesError) as caught:
        call()
    return str(caught.value)


def assert_explains(message: str, where: str, torch_class: str) -> None:
    """The message names the entry point and argument, torch's class, both libraries and the fix."""
    assert message.startswith(f"{where} got torch's {torch_class} "), message
    assert "spmd.tensor and torch.distributed.tensor are separate DTensor libraries" in message
    assert '.compat.redirect("<package>") before the package is imported' in message


TORCH_MESH = "torch.distributed.device_mesh.DeviceMesh"
TORCH_DTENSOR = "torch.distributed.tensor.DTensor"
TORCH_SHARD = "torch.distributed.tensor.placement_types.Shard"


def torch_dtensor() -> TorchDTensor:
    """A (4, 4) DTensor of torch's, sharded on rows over torch's 1-d mesh of the two rank threads."""
    return torch_distribute_tensor(torch.arange(16.0).reshape(4, 4), torch_init_device_mesh("cpu", (2,)), [TorchShard(0)])


# ----- entry points that make DTensors ------------------------------------------------------------
def distribute_onto_torchs_mesh() -> str:
    return refusal(lambda: distribute_tensor(torch.ones(4, 4), torch_init_device_mesh("cpu", (2,)), [Shard(0)]))


def test_distribute_tensor_refuses_torchs_mesh(world: Callable[..., list[Any]]) -> None:
    for message in world(distribute_onto_torchs_mesh, 2):
        assert_explains(message, "distribute_tensor (device_mesh)", TORCH_MESH)
        assert "DeviceMesh((2,), 'cpu'" in message  # the object itself, shortly
        assert "spmd.tensor.init_device_mesh" in message  # spmd's way to build one


def test_distribute_tensor_refuses_torchs_placements_and_dtensors() -> None:
    def program() -> list[str]:
        mesh = init_device_mesh("cpu", (2,))
        placements = [TorchShard(0), TorchReplicate(), TorchPartial(), TorchStridedShard(0, split_factor=2)]
        messages = [refusal(lambda p=p: distribute_tensor(torch.ones(4, 4), mesh, [p])) for p in placements]
        messages.append(refusal(lambda: distribute_tensor(torch.ones(4, 4), mesh, TorchShard(0))))  # not in a list
        messages.append(refusal(lambda: distribute_tensor(torch_dtensor(), mesh, [Shard(0)])))
        return messages

    *placements, single, dtensor = run_threaded(program, 2)[0]
    for message, name in zip(placements, ["Shard", "Replicate", "Partial", "_StridedShard"]):
        assert_explains(message, "distribute_tensor (placements)", f"torch.distributed.tensor.placement_types.{name}")
    assert_explains(single, "distribute_tensor (placements)", TORCH_SHARD)
    assert_explains(dtensor, "distribute_tensor (tensor)", TORCH_DTENSOR)
    # what is known about a DTensor: its shape, dtype, placements and torch's mesh (never its data)
    assert "(shape [4, 4], torch.float32, placements (Shard(dim=0),), on torch's DeviceMesh((2,)" in dtensor


def test_from_local_refuses_torchs_mesh_placements_and_dtensor() -> None:
    def program() -> list[str]:
        mesh = init_device_mesh("cpu", (2,))
        return [
            refusal(lambda: DTensor.from_local(torch.ones(2, 4), torch_init_device_mesh("cpu", (2,)), [Shard(0)])),
            refusal(lambda: DTensor.from_local(torch.ones(2, 4), mesh, [TorchShard(0)])),
            refusal(lambda: DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0)], grad_placements=[TorchShard(0)])),
            refusal(lambda: DTensor.from_local(torch_dtensor(), mesh, [Shard(0)])),
        ]

    mesh, placements, grad_placements, local = run_threaded(program, 2)[0]
    assert_explains(mesh, "DTensor.from_local (device_mesh)", TORCH_MESH)
    assert_explains(placements, "DTensor.from_local (placements)", TORCH_SHARD)
    assert_explains(grad_placements, "DTensor.from_local (grad_placements)", TORCH_SHARD)
    assert_explains(local, "DTensor.from_local (local_tensor)", TORCH_DTENSOR)


def test_redistribute_refuses_torchs_placements_and_mesh() -> None:
    def program() -> list[str]:
        d = distribute_tensor(torch.ones(4, 4), init_device_mesh("cpu", (2,)), [Shard(0)])
        return [
            refusal(lambda: d.redistribute(placements=[TorchReplicate()])),
            refusal(lambda: d.redistribute(torch_init_device_mesh("cpu", (2,)), [Replicate()])),
        ]

    placements, mesh = run_threaded(program, 2)[0]
    assert_explains(placements, "DTensor.redistribute (placements)", "torch.distributed.tensor.placement_types.Replicate")
    assert_explains(mesh, "DTensor.redistribute (device_mesh)", TORCH_MESH)


def test_distribute_module_refuses_torchs_mesh() -> None:
    def program() -> str:
        return refusal(lambda: distribute_module(nn.Linear(4, 4), torch_init_device_mesh("cpu", (2,))))

    assert_explains(run_threaded(program, 2)[0], "distribute_module (device_mesh)", TORCH_MESH)


@pytest.mark.parametrize("factory", ["zeros", "ones", "empty", "rand", "randn"])
def test_factories_refuse_torchs_mesh_and_placements(factory: str) -> None:
    make = getattr(spmd.tensor, factory)

    def program() -> list[str]:
        mesh = init_device_mesh("cpu", (2,))
        return [
            refusal(lambda: make(4, 4, device_mesh=torch_init_device_mesh("cpu", (2,)))),
            refusal(lambda: make(4, 4, device_mesh=mesh, placements=[TorchShard(0)])),
        ]

    mesh, placements = run_threaded(program, 2)[0]
    assert_explains(mesh, f"{factory} (device_mesh)", TORCH_MESH)
    assert_explains(placements, f"{factory} (placements)", TORCH_SHARD)


def test_full_refuses_torchs_mesh() -> None:
    def program() -> str:
        return refusal(lambda: spmd.tensor.full((4, 4), 1.0, device_mesh=torch_init_device_mesh("cpu", (2,))))

    assert_explains(run_threaded(program, 2)[0], "full (device_mesh)", TORCH_MESH)


# ----- ops ----------------------------------------------------------------------------------------
def test_an_op_mixing_spmd_and_torch_dtensors_names_the_op() -> None:
    def program() -> list[str]:
        ours = distribute_tensor(torch.ones(4, 4), init_device_mesh("cpu", (2,)), [Shard(0)])
        theirs = torch_dtensor()
        return [
            refusal(lambda: ours + theirs),  # not "unsupported operand": the error is not a TypeError
            refusal(lambda: torch.mm(ours, theirs)),
            refusal(lambda: ours.copy_(theirs)),
            refusal(lambda: ours * torch_distribute_tensor(torch.tensor(2.0), theirs.device_mesh, [TorchReplicate()])),
        ]

    add, mm, copy, by_scalar = run_threaded(program, 2)[0]
    assert_explains(add, "aten.add.Tensor (an operand beside spmd's DTensors)", TORCH_DTENSOR)
    assert_explains(mm, "aten.mm.default (an operand beside spmd's DTensors)", TORCH_DTENSOR)
    assert_explains(copy, "aten.copy_.default (an operand beside spmd's DTensors)", TORCH_DTENSOR)
    # a 0-d DTensor of torch's passes for a plain scalar tensor until torch's own dispatch refuses it
    assert_explains(by_scalar, "aten.mul.Tensor (an operand beside spmd's DTensors)", TORCH_DTENSOR)


def test_a_list_op_mixing_spmd_and_torch_dtensors_names_the_argument() -> None:
    def program() -> list[str]:
        ours = distribute_tensor(torch.ones(4, 4), init_device_mesh("cpu", (2,)), [Shard(0)])
        theirs = torch_dtensor()
        return [
            refusal(lambda: torch._foreach_add([ours, theirs], 1.0)),
            refusal(lambda: torch._foreach_add([ours], [theirs])),
        ]

    in_one_list, across_lists = run_threaded(program, 2)[0]
    assert_explains(in_one_list, "aten._foreach_add.Scalar (list argument 'self')", TORCH_DTENSOR)
    assert_explains(across_lists, "aten._foreach_add.List ('other' at list position 0)", TORCH_DTENSOR)


# ----- local_map ------------------------------------------------------------------------------------
def test_local_map_refuses_torchs_mesh_placements_and_dtensors() -> None:
    def double(x: torch.Tensor) -> torch.Tensor:
        return 2 * x

    def program() -> list[str]:
        torch_mesh = torch_init_device_mesh("cpu", (2,))
        return [
            refusal(lambda: local_map(double, out_placements=[Shard(0)], device_mesh=torch_mesh)),
            refusal(lambda: local_map(double, out_placements=[TorchShard(0)])),
            refusal(lambda: local_map(double, out_placements=[Shard(0)], in_placements=([TorchShard(0)],))),
            refusal(lambda: local_map(double, out_placements=[Shard(0)])(torch_dtensor())),
        ]

    mesh, out_placements, in_placements, argument = run_threaded(program, 2)[0]
    assert_explains(mesh, "local_map (device_mesh)", TORCH_MESH)
    assert_explains(out_placements, "local_map (out_placements)", TORCH_SHARD)
    assert_explains(in_placements, "local_map (in_placements)", TORCH_SHARD)
    assert_explains(argument, "local_map (argument 0)", TORCH_DTENSOR)


# ----- tensor parallelism -------------------------------------------------------------------------
def test_parallelize_module_refuses_torchs_mesh_and_styles() -> None:
    def program() -> list[str]:
        mesh = init_device_mesh("cpu", (2,))
        model = nn.Sequential(nn.Linear(4, 4))
        return [
            refusal(lambda: parallelize_module(model, torch_init_device_mesh("cpu", (2,)), {"0": ColwiseParallel()})),
            refusal(lambda: parallelize_module(model, mesh, {"0": TorchColwise()})),
            refusal(lambda: parallelize_module(model, mesh, TorchColwise())),
        ]

    mesh, style_in_plan, style_as_plan = run_threaded(program, 2)[0]
    assert_explains(mesh, "parallelize_module (device_mesh)", TORCH_MESH)
    torch_colwise = "torch.distributed.tensor.parallel.style.ColwiseParallel"
    assert_explains(style_in_plan, "parallelize_module (parallelize_plan['0'])", torch_colwise)
    assert_explains(style_as_plan, "parallelize_module (parallelize_plan)", torch_colwise)
    assert "spmd.tensor_parallel's styles" in style_in_plan


def test_parallel_styles_refuse_torchs_placements() -> None:
    # no world needed: a style checks its layouts when it is made
    assert_explains(
        refusal(lambda: ColwiseParallel(input_layouts=TorchShard(0))), "ColwiseParallel(input_layouts=...)", TORCH_SHARD
    )
    assert_explains(
        refusal(lambda: RowwiseParallel(output_layouts=TorchShard(1))), "RowwiseParallel(output_layouts=...)", TORCH_SHARD
    )
    assert_explains(
        refusal(lambda: PrepareModuleInput(input_layouts=(TorchShard(0), None), desired_input_layouts=(Replicate(), None))),
        "PrepareModuleInput(input_layouts=...)",
        TORCH_SHARD,
    )
    assert_explains(
        refusal(lambda: PrepareModuleInput(input_kwarg_layouts={"x": TorchShard(0)})),
        "PrepareModuleInput(input_kwarg_layouts=...)",
        TORCH_SHARD,
    )


# ----- FSDP ---------------------------------------------------------------------------------------
def test_fully_shard_refuses_torchs_mesh_and_torchs_dtensor_parameters() -> None:
    def program() -> list[str]:
        torch_mesh = torch_init_device_mesh("cpu", (2,))
        parallelized_by_torch = torch_parallelize_module(nn.Linear(4, 4), torch_mesh, TorchColwise())
        return [
            refusal(lambda: fully_shard(nn.Linear(4, 4), mesh=torch_mesh)),
            refusal(lambda: fully_shard(parallelized_by_torch, mesh=init_device_mesh("cpu", (2,)))),
        ]

    mesh, parameter = run_threaded(program, 2)[0]
    assert_explains(mesh, "fully_shard (mesh)", TORCH_MESH)
    assert_explains(parameter, "fully_shard (parameter 'weight' of Linear)", TORCH_DTENSOR)


# ----- checkpoint ---------------------------------------------------------------------------------
def test_state_dict_functions_refuse_torchs_dtensors() -> None:
    def program() -> list[str]:
        torch_model = torch_parallelize_module(nn.Linear(4, 4), torch_init_device_mesh("cpu", (2,)), TorchColwise())
        spmd_model = parallelize_module(nn.Linear(4, 4), init_device_mesh("cpu", (2,)), ColwiseParallel())
        full = StateDictOptions(full_state_dict=True)
        return [
            refusal(lambda: set_model_state_dict(spmd_model, torch_model.state_dict())),
            refusal(lambda: get_model_state_dict(torch_model, options=full)),  # would stay sharded
        ]

    loading, gathering = run_threaded(program, 2)[0]
    assert_explains(loading, "set_model_state_dict (model_state_dict)['weight']", TORCH_DTENSOR)
    assert_explains(gathering, "a full state_dict (StateDictOptions(full_state_dict=True))['weight']", TORCH_DTENSOR)


# ----- what already works across the libraries ----------------------------------------------------
def test_torchs_dcp_saves_spmd_dtensors_that_torchs_dtensors_load() -> None:
    """DCP asks each tensor for its chunks through a protocol spmd's DTensor answers too."""

    def program(path: str) -> torch.Tensor:
        ours = distribute_tensor(torch.arange(16.0).reshape(4, 4), init_device_mesh("cpu", (2,)), [Shard(0)])
        dcp.save({"w": ours}, checkpoint_id=path)
        theirs = torch_distribute_tensor(torch.zeros(4, 4), torch_init_device_mesh("cpu", (2,)), [TorchShard(1)])
        dcp.load({"w": theirs}, checkpoint_id=path)
        return theirs.full_tensor()

    with tempfile.TemporaryDirectory() as path:
        for loaded in run_threaded(program, 2, path):
            torch.testing.assert_close(loaded, torch.arange(16.0).reshape(4, 4))

