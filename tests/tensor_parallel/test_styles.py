"""Each parallel style on its own: forward and backward equal one device, on (4,) and the tp dim of (2, 2)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from spmd.tensor import DeviceMesh, DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.tensor_parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    UnsupportedModuleError,
    parallelize_module,
)
from spmd.testing import DTensorTestBase, assert_same_grads, seeded_module, seeded_randint, with_comms
from spmd.testing import seeded_randn as randn


def tp_meshes() -> list[tuple[DeviceMesh, int]]:
    """(tp mesh, data-parallel index): the whole (4,) mesh, and the tp dim of a (2, 2) mesh.

    Inputs are seeded by the data-parallel index, so the two tp groups of (2, 2) see different data.
    """
    mesh_2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    coordinate = mesh_2d.get_coordinate()
    assert coordinate is not None
    return [(init_device_mesh("cpu", (4,)), 0), (mesh_2d["tp"], coordinate[0])]


def piece(full: torch.Tensor, mesh: DeviceMesh, dim: int) -> torch.Tensor:
    """This rank's torch.chunk piece of ``full`` along ``dim`` over the 1-d ``mesh``."""
    pieces = full.chunk(mesh.size(), dim)
    index = mesh.get_local_rank()
    return pieces[index] if index < len(pieces) else full.narrow(dim, 0, 0)


class ColwiseTest(DTensorTestBase):
    def check_linear(self, case, bias: bool, input_shape: tuple[int, ...], use_local_output: bool) -> None:
        mesh, dp = case
        reference = seeded_module(nn.Linear(8, 10, bias=bias), seed=1)
        model = parallelize_module(copy.deepcopy(reference), mesh, ColwiseParallel(use_local_output=use_local_output))
        assert model.weight.placements == (Shard(0),)
        if bias:
            assert model.bias.placements == (Shard(0),)
        x = randn(*input_shape, seed=10 + dp).requires_grad_()
        x_ref = x.detach().clone().requires_grad_()
        with CommDebugMode() as comm:
            out = model(x)
        assert comm.get_comm_counts() == {}
        expected = reference(x_ref)
        grad_weight = randn(*expected.shape, seed=3)
        if use_local_output:
            assert not isinstance(out, DTensor)
            torch.testing.assert_close(out, piece(expected, mesh, -1))
            (out * piece(grad_weight, mesh, -1)).sum().backward()
        else:
            assert out.placements == (Shard(expected.ndim - 1),)
            torch.testing.assert_close(out.full_tensor(), expected)
            (out.full_tensor() * grad_weight).sum().backward()
        (expected * grad_weight).sum().backward()
        assert_same_grads(model, reference)
        torch.testing.assert_close(x.grad, x_ref.grad)

    @with_comms
    def test_linear_forward_and_backward(self) -> None:
        self.run_subtests(
            {"case": tp_meshes(), "bias": [True, False], "input_shape": [(6, 8), (2, 5, 8)],
             "use_local_output": [True, False]},
            self.check_linear,
        )

    @with_comms
    def test_sharded_input_is_gathered_first(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        reference = seeded_module(nn.Linear(8, 12), seed=1)
        model = parallelize_module(copy.deepcopy(reference), mesh, ColwiseParallel(input_layouts=Shard(0)))
        x = randn(8, 8, seed=2)
        with CommDebugMode() as comm:
            out = model(piece(x, mesh, 0))
        assert comm.get_comm_counts() == {"all_gather": 1}
        torch.testing.assert_close(out, piece(reference(x), mesh, -1))

    def check_embedding(self, case) -> None:
        mesh, dp = case
        reference = seeded_module(nn.Embedding(10, 8), seed=1)
        model = parallelize_module(copy.deepcopy(reference), mesh, ColwiseParallel(use_local_output=False))
        assert model.weight.placements == (Shard(1),)
        indices = seeded_randint(10, 3, 5, seed=dp)
        with CommDebugMode() as comm:
            out = model(indices)
        assert comm.get_comm_counts() == {}
        assert out.placements == (Shard(2),)
        expected = reference(indices)
        torch.testing.assert_close(out.full_tensor(), expected)
        grad_weight = randn(*expected.shape, seed=3)
        (out.full_tensor() * grad_weight).sum().backward()
        (expected * grad_weight).sum().backward()
        assert_same_grads(model, reference)

    @with_comms
    def test_embedding_forward_and_backward(self) -> None:
        self.run_subtests({"case": tp_meshes()}, self.check_embedding)

    @with_comms
    def test_unsupported_module(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        with pytest.raises(UnsupportedModuleError, match=r"ColwiseParallel\(.*\) cannot shard LayerNorm"):
            ColwiseParallel().apply(nn.LayerNorm(4), mesh)


class RowwiseTest(DTensorTestBase):
    def check_linear(self, case, bias: bool, input_shape: tuple[int, ...], as_dtensor: bool) -> None:
        mesh, dp = case
        reference = seeded_module(nn.Linear(8, 6, bias=bias), seed=1)
        model = parallelize_module(copy.deepcopy(reference), mesh, RowwiseParallel())
        assert model.weight.placements == (Shard(1),)
        if bias:
            assert model.bias.placements == (Replicate(),)
        x_full = randn(*input_shape, seed=10 + dp)
        x_ref = x_full.clone().requires_grad_()
        if as_dtensor:
            x = distribute_tensor(x_full, mesh, [Shard(-1)]).requires_grad_()
        else:
            x = piece(x_full, mesh, -1).requires_grad_()
        with CommDebugMode() as comm:
            out = model(x)
        # One all_reduce of the partial products; the replicated bias is added once, not per rank.
        assert comm.get_comm_counts() == {"all_reduce": 1}
        expected = reference(x_ref)
        torch.testing.assert_close(out, expected)
        grad_weight = randn(*expected.shape, seed=3)
        (out * grad_weight).sum().backward()
        (expected * grad_weight).sum().backward()
        assert_same_grads(model, reference)
        x_grad = x.grad.full_tensor() if as_dtensor else x.grad
        torch.testing.assert_close(x_grad, x_ref.grad if as_dtensor else piece(x_ref.grad, mesh, -1))

    @with_comms
    def test_linear_forward_and_backward(self) -> None:
        self.run_subtests(
            {"case": tp_meshes(), "bias": [True, False], "input_shape": [(6, 8), (2, 5, 8)],
             "as_dtensor": [False, True]},
            self.check_linear,
        )

    def check_sharded_output(self, case, input_shape: tuple[int, ...]) -> None:
        mesh, dp = case
        reference = seeded_module(nn.Linear(8, 6), seed=1)
        style = RowwiseParallel(output_layouts=Shard(0), use_local_output=False)
        model = parallelize_module(copy.deepcopy(reference), mesh, style)
        x_full = randn(*input_shape, seed=10 + dp)
        x = distribute_tensor(x_full, mesh, [Shard(-1)]).requires_grad_()
        x_ref = x_full.clone().requires_grad_()
        with CommDebugMode() as comm:
            out = model(x)
        assert comm.get_comm_counts() == {"reduce_scatter": 1}
        assert out.placements == (Shard(0),)
        expected = reference(x_ref)
        torch.testing.assert_close(out.full_tensor(), expected)
        grad_weight = randn(*expected.shape, seed=3)
        (out.full_tensor() * grad_weight).sum().backward()
        (expected * grad_weight).sum().backward()
        assert_same_grads(model, reference)
        torch.testing.assert_close(x.grad.full_tensor(), x_ref.grad)

    @with_comms
    def test_output_reduce_scattered(self) -> None:
        # 7 rows: uneven pieces of the reduce_scatter (2, 2, 2, 1 over four ranks)
        self.run_subtests({"case": tp_meshes(), "input_shape": [(7, 8), (2, 4, 8)]}, self.check_sharded_output)

    def check_row_wise_embedding(self, case) -> None:
        mesh, dp = case
        reference = seeded_module(nn.Embedding(10, 8), seed=1)  # 10 rows over 4 ranks: 3, 3, 3, 1
        model = parallelize_module(copy.deepcopy(reference), mesh, RowwiseParallel())
        assert model.weight.placements == (Shard(0),)
        indices = seeded_randint(10, 3, 5, seed=dp)
        with CommDebugMode() as comm:
            out = model(indices)
        assert comm.get_comm_counts() == {"all_reduce": 1}
        expected = reference(indices)
        torch.testing.assert_close(out, expected)
        grad_out = randn(*expected.shape, seed=3)
        (out * grad_out).sum().backward()
        (expected * grad_out).sum().backward()
        assert_same_grads(model, reference)

    @with_comms
    def test_row_wise_embedding_forward_and_backward(self) -> None:
        self.run_subtests({"case": tp_meshes()}, self.check_row_wise_embedding)


class SequenceParallelTest(DTensorTestBase):
    def check_module(self, case, module: nn.Module, sequence_dim: int, as_dtensor: bool) -> None:
        mesh, dp = case
        reference = seeded_module(copy.deepcopy(module), seed=1)
        model = parallelize_module(copy.deepcopy(reference), mesh, SequenceParallel(sequence_dim=sequence_dim))
        assert all(p.placements == (Replicate(),) for p in model.parameters())
        x_full = randn(8, 8, 6, seed=10 + dp)
        x_ref = x_full.clone().requires_grad_()
        if as_dtensor:
            x = distribute_tensor(x_full, mesh, [Shard(sequence_dim)]).requires_grad_()
        else:
            x = piece(x_full, mesh, sequence_dim).requires_grad_()
        with CommDebugMode() as comm:
            out = model(x)
        assert comm.get_comm_counts() == {}
        assert isinstance(out, DTensor) and out.placements == (Shard(sequence_dim),)
        expected = reference(x_ref)
        torch.testing.assert_close(out.full_tensor(), expected)
        grad_weight = randn(*expected.shape, seed=3)
        (out.full_tensor() * grad_weight).sum().backward()
        (expected * grad_weight).sum().backward()
        assert_same_grads(model, reference)
        x_grad = x.grad.full_tensor() if as_dtensor else x.grad
        torch.testing.assert_close(x_grad, x_ref.grad if as_dtensor else piece(x_ref.grad, mesh, sequence_dim))

    @with_comms
    def test_norms_and_dropout(self) -> None:
        self.run_subtests(
            {"case": tp_meshes(), "module": [nn.LayerNorm(6), nn.RMSNorm(6), nn.Dropout(0.5).eval()],
             "sequence_dim": [1], "as_dtensor": [False, True]},
            self.check_module,
        )
        self.run_subtests(
            {"case": tp_meshes()[:1], "module": [nn.LayerNorm(6)], "sequence_dim": [0], "as_dtensor": [True]},
            self.check_module,
        )

    @with_comms
    def test_local_output_and_resharded_input(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        reference = seeded_module(nn.LayerNorm(6), seed=1)
        model = parallelize_module(copy.deepcopy(reference), mesh, SequenceParallel(use_local_output=True))
        x_full = randn(2, 8, 6, seed=2)
        x = distribute_tensor(x_full, mesh, [Shard(0)])
        with CommDebugMode() as comm:
            out = model(x)  # redistributed S(0) -> S(1) first
        assert comm.get_comm_counts() == {"all_to_all": 1}
        assert not isinstance(out, DTensor)
        torch.testing.assert_close(out, piece(reference(x_full), mesh, 1))


class Pair(nn.Module):
    """Records what it was called with and returns ``a * scale`` and ``b``."""

    def forward(self, a, b, *, scale=None):
        self.seen = (a, b, scale)
        return a if scale is None else a * scale, b


class PrepareTest(DTensorTestBase):
    @with_comms
    def test_prepare_module_input(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        a_full, scale_full = randn(8, 4, seed=1), randn(8, 4, seed=2)
        style = PrepareModuleInput(
            input_layouts=(Shard(0), None),
            desired_input_layouts=(Replicate(), None),
            input_kwarg_layouts={"scale": Shard(0)},
            desired_input_kwarg_layouts={"scale": Replicate()},
        )
        module = parallelize_module(Pair(), mesh, style)
        a = piece(a_full, mesh, 0).requires_grad_()
        with CommDebugMode() as comm:
            out, b = module(a, "untouched", scale=piece(scale_full, mesh, 0))
        assert comm.get_comm_counts() == {"all_gather": 2}
        seen_a, _, seen_scale = module.seen
        assert seen_a.placements == (Replicate(),) and seen_scale.placements == (Replicate(),)
        assert b == "untouched"
        torch.testing.assert_close(out.to_local(), a_full * scale_full)
        out.to_local().sum().backward()
        torch.testing.assert_close(a.grad, piece(scale_full, mesh, 0))

    @with_comms
    def test_prepare_module_input_local_and_dtensor_inputs(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        a_full = randn(8, 4, seed=1)
        style = PrepareModuleInput(input_layouts=Shard(0), desired_input_layouts=Shard(1), use_local_output=True)
        module = nn.Identity()
        module.register_forward_hook(lambda mod, args, out: setattr(mod, "seen", args[0]))
        parallelize_module(module, mesh, style)
        out = module(distribute_tensor(a_full, mesh, [Shard(0)]))  # a DTensor keeps its own layout
        assert not isinstance(out, DTensor)
        torch.testing.assert_close(out, piece(a_full, mesh, 1))
        with pytest.raises(ValueError, match="got 2 positional inputs"):
            module(a_full, a_full)

    @with_comms
    def test_prepare_module_output(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        a_full = randn(8, 4, seed=1)
        style = PrepareModuleOutput(output_layouts=(Shard(0), None), desired_output_layouts=(Replicate(), None))
        module = parallelize_module(Pair(), mesh, style)
        a = piece(a_full, mesh, 0).requires_grad_()
        with CommDebugMode() as comm:
            out, b = module(a, 3)
        assert comm.get_comm_counts() == {"all_gather": 1}
        assert not isinstance(out, DTensor) and b == 3
        torch.testing.assert_close(out, a_full)
        (out * a_full).sum().backward()
        torch.testing.assert_close(a.grad, piece(a_full, mesh, 0))

    @with_comms
    def test_prepare_module_input_output(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        a_full = randn(8, 4, seed=1)
        style = PrepareModuleInputOutput(
            input_layouts=Shard(0), desired_input_layouts=Replicate(),
            output_layouts=Replicate(), desired_output_layouts=Shard(1),
        )
        module = parallelize_module(nn.Identity(), mesh, style)
        torch.testing.assert_close(module(piece(a_full, mesh, 0)), piece(a_full, mesh, 1))


class TestStyleConfig:
    """Styles are frozen, keyword-only configs with a constructible repr (no world needed)."""

    @pytest.mark.parametrize(
        "style",
        [
            ColwiseParallel(),
            ColwiseParallel(input_layouts=Shard(0), output_layouts=Replicate(), use_local_output=False),
            RowwiseParallel(output_layouts=Shard(1)),
            SequenceParallel(sequence_dim=0),
            PrepareModuleInput(input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(), None)),
            PrepareModuleOutput(output_layouts=Partial(), desired_output_layouts=Replicate()),
        ],
    )
    def test_frozen_hashable_and_repr_round_trips(self, style) -> None:
        namespace = {cls.__name__: cls for cls in (type(style), Shard, Replicate, Partial)}
        assert eval(repr(style), namespace) == style
        assert hash(style) == hash(eval(repr(style), namespace))
        with pytest.raises(dataclasses.FrozenInstanceError):
            style.use_local_output = False

    def test_options_are_keyword_only_and_checked(self) -> None:
        with pytest.raises(TypeError):
            ColwiseParallel(Shard(0))  # type: ignore[misc]
        with pytest.raises(TypeError, match="takes one Placement"):
            RowwiseParallel(input_layouts=[Shard(0)])  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="one entry each"):
            PrepareModuleInput(input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(),))
        with pytest.raises(ValueError, match="without input_layouts"):
            PrepareModuleInput(desired_input_layouts=Replicate())
        with pytest.raises(ValueError, match="entry 1 has no input_layout"):
            PrepareModuleInput(input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(), Replicate()))
        with pytest.raises(ValueError, match="lacks"):
            PrepareModuleInput(input_kwarg_layouts={"a": Shard(0)}, desired_input_kwarg_layouts={"b": Shard(0)})
