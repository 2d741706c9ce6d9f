"""Saving and copying DTensors: pickle, torch.save/torch.load (weights_only on and off), deepcopy.

Each rank saves and loads its own shard inside the world that saved it; the loaded DTensor must
have the same placements, mesh and values, and a loaded or copied model must train like the original.
"""

from __future__ import annotations

import copy
import io
import os
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from spmd.fsdp import fully_shard
from spmd.tensor import (
    DeviceMesh,
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
    init_device_mesh,
)
from spmd.tensor.placement import _StridedShard
from spmd.tensor_parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from spmd.testing import DTensorTestBase, run_threaded, seeded_randn, with_comms
from spmd.testing.multiprocess import run_multiprocess


def _pickle(obj: Any) -> Any:
    return pickle.loads(pickle.dumps(obj))


def _torch_save(obj: Any, *, weights_only: bool) -> Any:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=weights_only)


ROUND_TRIPS: dict[str, Callable[[Any], Any]] = {
    "pickle": _pickle,
    "torch.load(weights_only=True)": lambda obj: _torch_save(obj, weights_only=True),
    "torch.load(weights_only=False)": lambda obj: _torch_save(obj, weights_only=False),
    "deepcopy": copy.deepcopy,
}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 8)
        self.down = nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _tensor_parallel_mlp(mesh: DeviceMesh, seed: int) -> MLP:
    torch.manual_seed(seed)
    return parallelize_module(MLP(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


def _shard_linear_weights(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    if isinstance(module, nn.Linear):
        module.weight = nn.Parameter(distribute_tensor(module.weight.detach(), mesh, [Shard(0)]))


def _sgd_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """One SGD step on the sum of the outputs; returns the loss before the step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(x).sum()
    loss.backward()
    optimizer.step()
    return loss.detach()


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.full_tensor() for name, value in model.state_dict().items()}


class SerializationTest(DTensorTestBase):
    def assert_same_dtensor(self, loaded: Any, original: DTensor) -> None:
        self.assertIsInstance(loaded, DTensor)
        self.assertEqual(loaded.placements, original.placements)
        self.assertEqual(loaded.device_mesh, original.device_mesh)
        self.assertEqual(loaded.shape, original.shape)
        self.assertEqual(loaded.stride(), original.stride())
        self.assertEqual(loaded.requires_grad, original.requires_grad)
        torch.testing.assert_close(loaded.to_local(), original.to_local(), rtol=0, atol=0)

    @with_comms
    def test_dtensors_round_trip_with_their_placements(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        mesh_2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        full = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
        cases: list[tuple[DeviceMesh, list[Placement], torch.Tensor]] = [
            (mesh, [Shard(0)], full),
            (mesh, [Replicate()], full),
            (mesh, [Shard(0)], full[:7]),  # uneven: 2, 2, 2, 1 rows
            (mesh, [Shard(1)], torch.arange(10.0).reshape(2, 5)),  # 2, 2, 1, 0 columns
            (mesh_2d, [Shard(0), Shard(1)], full),
            (mesh_2d, [Replicate(), Shard(0)], full[:5]),
            (mesh_2d["tp"], [Shard(0)], full),
        ]

        def check(how: str, case: tuple[DeviceMesh, list[Placement], torch.Tensor]) -> None:
            sub_mesh, placements, tensor = case
            d = distribute_tensor(tensor, sub_mesh, placements)
            loaded = ROUND_TRIPS[how](d)
            self.assert_same_dtensor(loaded, d)
            torch.testing.assert_close(loaded.full_tensor(), tensor)

        self.run_subtests({"how": list(ROUND_TRIPS), "case": cases}, check)

    @with_comms
    def test_partial_dtensors_keep_their_pending_sum(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        addend = torch.full((3, 2), float(self.rank))
        d = DTensor.from_local(addend, mesh, [Partial(), Shard(0)])
        expected = d.full_tensor()

        def check(how: str) -> None:
            loaded = ROUND_TRIPS[how](d)
            self.assertEqual(loaded.placements, (Partial("sum"), Shard(0)))
            torch.testing.assert_close(loaded.to_local(), addend)
            torch.testing.assert_close(loaded.full_tensor(), expected)

        self.run_subtests({"how": list(ROUND_TRIPS)}, check)

    @with_comms
    def test_parameters_stay_parameters(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        param = nn.Parameter(distribute_tensor(torch.randn(8, 2), mesh, [Shard(0)]))
        frozen = nn.Parameter(distribute_tensor(torch.randn(8, 2), mesh, [Shard(0)]), requires_grad=False)

        def check(how: str) -> None:
            loaded_param, loaded_frozen = ROUND_TRIPS[how]([param, frozen])
            self.assertIsInstance(loaded_param, nn.Parameter)
            self.assertIsInstance(loaded_frozen, nn.Parameter)
            self.assert_same_dtensor(loaded_param, param)
            self.assert_same_dtensor(loaded_frozen, frozen)
            self.assertTrue(loaded_param.is_leaf)

        self.run_subtests({"how": list(ROUND_TRIPS)}, check)

    @with_comms
    def test_deepcopy_copies_data_and_shares_the_mesh(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        d = distribute_tensor(torch.zeros(8, 2), mesh, [Shard(0)]).requires_grad_()
        d.grad = distribute_tensor(torch.ones(8, 2), mesh, [Shard(0)])
        a, b = copy.deepcopy([d, d])
        self.assertIs(a, b)  # memo: one object copied once
        self.assertIs(a.device_mesh, mesh)
        torch.testing.assert_close(a.grad.full_tensor(), torch.ones(8, 2))
        with torch.no_grad():
            a.add_(1.0)
        torch.testing.assert_close(d.full_tensor(), torch.zeros(8, 2))
        self.assertIs(copy.deepcopy(mesh), mesh)
        with self.assertRaisesRegex(RuntimeError, "only leaf DTensors"):
            copy.deepcopy(d * 2)

    @with_comms
    def test_tensor_parallel_state_dict_round_trips_and_loads_into_a_model(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        model = _tensor_parallel_mlp(mesh, seed=0)
        state = model.state_dict()

        def check(how: str) -> None:
            loaded = ROUND_TRIPS[how](state)
            self.assertEqual(list(loaded), list(state))
            for name, value in state.items():
                self.assert_same_dtensor(loaded[name], value)
            other = _tensor_parallel_mlp(mesh, seed=1)
            other.load_state_dict(loaded)
            for name, value in _full_state(other).items():
                torch.testing.assert_close(value, state[name].full_tensor())

        self.run_subtests({"how": list(ROUND_TRIPS)}, check)

    @with_comms
    def test_a_training_checkpoint_resumes_exactly(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x = seeded_randn(5, 6, seed=4)
        model = _tensor_parallel_mlp(mesh, seed=0)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1, foreach=False)
        model(x).sum().backward()
        optimizer.step()
        checkpoint = _torch_save({"model": model.state_dict(), "optim": optimizer.state_dict()}, weights_only=True)
        self.assertEqual(checkpoint["optim"]["state"][0]["exp_avg"].placements, (Shard(0),))

        resumed = _tensor_parallel_mlp(mesh, seed=1)
        resumed_optimizer = torch.optim.Adam(resumed.parameters(), lr=0.1, foreach=False)
        resumed.load_state_dict(checkpoint["model"])
        resumed_optimizer.load_state_dict(checkpoint["optim"])
        for m, opt in ((model, optimizer), (resumed, resumed_optimizer)):
            opt.zero_grad()
            m(x).sum().backward()
            opt.step()
        expected = _full_state(model)
        for name, value in _full_state(resumed).items():
            torch.testing.assert_close(value, expected[name])

    @with_comms
    def test_a_deep_copied_tensor_parallel_model_trains_on_its_own(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        model = _tensor_parallel_mlp(mesh, seed=0)
        clone = copy.deepcopy(model)
        before = _full_state(model)
        x = seeded_randn(5, 6, seed=2)
        clone_loss = _sgd_step(clone, x)
        for name, value in _full_state(model).items():  # the original did not move
            torch.testing.assert_close(value, before[name], rtol=0, atol=0)
        torch.testing.assert_close(_sgd_step(model, x), clone_loss)
        for name, value in _full_state(clone).items():
            torch.testing.assert_close(value, _full_state(model)[name])
        self.assertIsInstance(clone.up.weight, nn.Parameter)
        self.assertEqual(clone.up.weight.placements, (Shard(0),))

    @with_comms
    def test_a_pickled_module_with_dtensor_parameters_trains_like_the_original(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        torch.manual_seed(0)
        model = distribute_module(MLP(), mesh, _shard_linear_weights)
        x = seeded_randn(5, 6, seed=3)
        x = distribute_tensor(x, mesh, [Replicate()])

        def check(how: str) -> None:
            loaded = ROUND_TRIPS[how](model)
            self.assertIsInstance(loaded.down.weight, nn.Parameter)
            self.assertEqual(loaded.down.weight.placements, (Shard(0),))
            self.assertEqual(loaded.down.bias.placements, (Replicate(),))
            loaded_loss = _sgd_step(loaded, x)
            reference = copy.deepcopy(model)
            torch.testing.assert_close(loaded_loss.full_tensor(), _sgd_step(reference, x).full_tensor())
            for name, value in _full_state(loaded).items():
                torch.testing.assert_close(value, _full_state(reference)[name])

        self.run_subtests({"how": ["pickle", "torch.load(weights_only=False)"]}, check)

    @with_comms
    def test_a_mesh_round_trips_as_an_equal_mesh(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

        def check(how: str) -> None:
            loaded = ROUND_TRIPS[how](mesh)
            self.assertEqual(loaded, mesh)
            self.assertEqual(hash(loaded), hash(mesh))
            self.assertIs(loaded.get_communicator("tp"), mesh.get_communicator("tp"))
            self.assertEqual(ROUND_TRIPS[how](mesh["tp"]), mesh["tp"])

        self.run_subtests({"how": list(ROUND_TRIPS)}, check)

    @with_comms
    def test_loading_another_ranks_shard_is_refused(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        sharded = pickle.dumps(distribute_tensor(torch.arange(8.0), mesh, [Shard(0)]))
        replicated = pickle.dumps(distribute_tensor(torch.arange(8.0), mesh, [Replicate()]))
        shared = mesh.get_communicator(0).all_gather_object((sharded, replicated))
        with self.assertRaisesRegex(ValueError, "load on each rank the file that rank saved"):
            pickle.loads(shared[(self.rank + 1) % 4][0])
        # A replica is the same on every rank, so any rank's copy loads.
        torch.testing.assert_close(pickle.loads(shared[0][1]).to_local(), torch.arange(8.0))


def _save_a_dtensor(world_size: int) -> DTensor:
    return distribute_tensor(torch.arange(12.0).reshape(6, 2), init_device_mesh("cpu", (world_size,)), [Shard(0)])


def test_unpickling_outside_a_world_reads_but_does_not_communicate() -> None:
    saved = run_threaded(lambda: pickle.dumps(_save_a_dtensor(2)), 2)[0]
    detached = pickle.loads(saved)  # as rank 0, which saved it
    torch.testing.assert_close(detached.to_local(), torch.arange(6.0).reshape(3, 2))
    with pytest.raises(RuntimeError, match=r"outside a running world.*inside spmd\.testing\.run_threaded or after"):
        detached.full_tensor()
    with pytest.raises(RuntimeError, match="world of the size that saved it"):
        run_threaded(pickle.loads, 1, saved)


def _save_and_load_in_each_process(directory: str) -> tuple[list[float], list[float], bool, str]:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    d = nn.Parameter(distribute_tensor(torch.arange(10.0).reshape(5, 2), mesh, [Shard(0)]))
    path = os.path.join(directory, f"rank{mesh.get_rank()}.pt")
    torch.save({"weight": d}, path)
    loaded = torch.load(path, weights_only=True)["weight"]
    assert loaded.device_mesh == mesh and loaded.placements == (Shard(0),)
    # A mesh whose groups this job never created cannot be rebuilt: that would need every rank.
    other_mesh = run_threaded(lambda: pickle.dumps(DeviceMesh("cpu", [[0], [1]])), 2)[0]
    try:
        pickle.loads(other_mesh)
        error = ""
    except RuntimeError as e:
        error = str(e)
    local, full = loaded.to_local().flatten().tolist(), loaded.full_tensor().flatten().tolist()
    return local, full, isinstance(loaded, nn.Parameter), error


@pytest.mark.multiprocess
def test_torch_save_and_load_on_gloo_processes(tmp_path: Any) -> None:
    results = run_multiprocess(_save_and_load_in_each_process, 2, str(tmp_path), timeout=120)
    assert [local for local, _, _, _ in results] == [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], [6.0, 7.0, 8.0, 9.0]]
    for _, full, is_param, error in results:
        assert full == [float(i) for i in range(10)]
        assert is_param
        assert "create an equal DeviceMesh" in error, error


# ----- whole parallelised modules: their hooks are values, so the module pickles ----------------------
MODULE_ROUND_TRIPS = ["pickle", "torch.load(weights_only=False)", "deepcopy"]


class NormMLP(nn.Module):
    """A sequence-parallel block: a norm on sequence-sharded tokens, then the MLP on gathered ones."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(6)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor, *, shift: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.norm(x + shift))


SEQUENCE_PARALLEL_PLAN = {
    "": PrepareModuleInputOutput(
        input_layouts=Shard(1),
        desired_input_layouts=Shard(1),
        input_kwarg_layouts={"shift": Replicate()},
        output_layouts=Shard(1),
        desired_output_layouts=Replicate(),
        use_local_output=False,
    ),
    "norm": SequenceParallel(),
    "mlp": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
    "mlp.up": ColwiseParallel(),
    "mlp.down": RowwiseParallel(output_layouts=Shard(1)),
}


def _train_step(model: nn.Module, *args: Any, **kwargs: Any) -> tuple[Any, dict[str, DTensor]]:
    """One SGD step on the sum of the outputs; the outputs and the gradients it stepped with."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.zero_grad()  # a copy made after an earlier step may or may not carry that step's .grad
    outputs = model(*args, **kwargs)
    outputs.sum().backward()
    grads = {name: param.grad for name, param in model.named_parameters()}
    optimizer.step()
    return outputs.detach(), grads


def _full(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, DTensor) else value


class ParallelisedModuleSerializationTest(DTensorTestBase):
    def assert_copies_train_like_the_original(self, model: nn.Module, *args: Any, **kwargs: Any) -> None:
        """Each round trip gives a model whose hooks lay out its output as the original's, and which trains like it."""

        def check(how: str) -> None:
            loaded = ROUND_TRIPS[how](model)
            self.assertIsNot(loaded, model)
            for (name, copied), original in zip(loaded.named_modules(), model.modules()):
                self.assertEqual(len(copied._forward_pre_hooks), len(original._forward_pre_hooks), name)
                self.assertEqual(len(copied._forward_hooks), len(original._forward_hooks), name)
            loaded_out, loaded_grads = _train_step(loaded, *args, **kwargs)
            out, grads = _train_step(model, *args, **kwargs)
            self.assertEqual(type(loaded_out), type(out))
            if isinstance(out, DTensor):
                self.assertEqual(loaded_out.placements, out.placements)
            torch.testing.assert_close(_full(loaded_out), _full(out))
            for name, grad in grads.items():
                self.assertEqual(loaded_grads[name].placements, grad.placements, name)
                torch.testing.assert_close(loaded_grads[name].full_tensor(), grad.full_tensor(), msg=name)
            expected = _full_state(model)
            for name, value in _full_state(loaded).items():
                torch.testing.assert_close(value, expected[name], msg=name)

        self.run_subtests({"how": MODULE_ROUND_TRIPS}, check)

    @with_comms
    def test_colwise_rowwise_mlp_on_a_1d_mesh(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x = seeded_randn(5, 6, seed=5)
        self.assert_copies_train_like_the_original(_tensor_parallel_mlp(mesh, seed=0), x)

    @with_comms
    def test_colwise_rowwise_mlp_on_the_tp_dim_of_a_2d_mesh(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(0)
        plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
        model = parallelize_module(MLP(), mesh, plan, tp_mesh_dim="tp")
        batch = seeded_randn(4, 6, seed=6)
        x = distribute_tensor(batch, mesh, [Shard(0), Replicate()])  # sharded over dp
        self.assert_copies_train_like_the_original(model, x)

    @with_comms
    def test_sequence_parallel_block_with_prepared_inputs_and_outputs(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        torch.manual_seed(0)
        model = parallelize_module(NormMLP(), mesh, SEQUENCE_PARALLEL_PLAN)
        x = seeded_randn(2, 8, 6, seed=7)
        local_tokens = x.chunk(4, dim=1)[self.rank]  # this rank's sequence shard
        shift = seeded_randn(6, seed=8)
        self.assert_copies_train_like_the_original(model, local_tokens, shift=shift)

    @with_comms
    def test_fully_sharded_mlp(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        torch.manual_seed(0)
        model = MLP()
        fully_shard(model.up, mesh=mesh)
        fully_shard(model, mesh=mesh)
        x = distribute_tensor(seeded_randn(8, 6, seed=9), mesh, [Shard(0)])
        self.assert_copies_train_like_the_original(model, x)

    @with_comms
    def test_fully_sharded_and_tensor_parallel_mlp_on_a_2d_mesh(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = _tensor_parallel_mlp(mesh, seed=0)
        fully_shard(model.up, mesh=mesh)
        fully_shard(model, mesh=mesh)
        # tp cuts up.bias on its only dim, and dp cuts each tp piece (FSDP2's _StridedShard)
        strided = (_StridedShard(0, split_factor=2), Shard(0))
        self.assertEqual(model.up.bias.placements, strided)
        batch = seeded_randn(4, 6, seed=10)
        x = distribute_tensor(batch, mesh, [Shard(0), Replicate()])  # sharded over dp
        model(x).sum().backward()
        self.assertEqual(model.up.bias.grad.placements, strided)
        self.assert_copies_train_like_the_original(model, x)

    @with_comms
    def test_distribute_module_with_input_and_output_fns(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        torch.manual_seed(0)
        model = distribute_module(MLP(), mesh, _shard_linear_weights, _replicate_inputs, _outputs_to_local)
        x = seeded_randn(5, 6, seed=11)
        self.assert_copies_train_like_the_original(model, x)


def _replicate_inputs(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
    return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)


def _outputs_to_local(module: nn.Module, outputs: DTensor, mesh: DeviceMesh) -> torch.Tensor:
    return outputs.redistribute(mesh, [Replicate()]).to_local()
