"""parallelize_module on whole models: MLPs, optimizer steps, sequence-parallel blocks, wildcard and bad plans."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spmd.tensor import DeviceMesh, DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.tensor_parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    UnsupportedModuleError,
    parallelize_module,
)
from spmd.tensor_parallel.parallelize import resolve_plan_key
from spmd.testing import DTensorTestBase, assert_same_grads, assert_same_params, run_threaded, seeded_module, with_comms
from spmd.testing import seeded_randn as randn

MLP_PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}


def tp_meshes() -> list[tuple[DeviceMesh, int]]:
    """(tp mesh, data-parallel index): the whole (4,) mesh, and the tp dim of a (2, 2) mesh."""
    mesh_2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    coordinate = mesh_2d.get_coordinate()
    assert coordinate is not None
    return [(init_device_mesh("cpu", (4,)), 0), (mesh_2d["tp"], coordinate[0])]


class MLP(nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(x)))


class Block(nn.Module):
    """A transformer-shaped block: norm, a two-projection "attention" and an MLP."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.ModuleDict({"q_proj": nn.Linear(dim, dim), "o_proj": nn.Linear(dim, dim)})
        self.mlp = MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        h = x + self.attn["o_proj"](torch.tanh(self.attn["q_proj"](h)))
        return h + self.mlp(h)


class Stack(nn.Module):
    def __init__(self, depth: int = 2, dim: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class MLPTest(DTensorTestBase):
    def check_mlp(self, case, input_shape: tuple[int, ...]) -> None:
        mesh, dp = case
        reference = seeded_module(MLP(), seed=1, scale=0.5)
        model = parallelize_module(copy.deepcopy(reference), mesh, MLP_PLAN)
        x = randn(*input_shape, seed=10 + dp).requires_grad_()
        x_ref = x.detach().clone().requires_grad_()
        with CommDebugMode() as forward:
            out = model(x)
        assert forward.get_comm_counts() == {"all_reduce": 1}
        per_module = forward.get_per_module_comm_counts()
        assert per_module["MLP"] == {"all_reduce": 1}
        # the Rowwise output all_reduce runs in down's own forward hook, so it counts for down
        assert per_module["MLP.down"] == {"all_reduce": 1}
        expected = reference(x_ref)
        torch.testing.assert_close(out, expected)
        grad_weight = randn(*expected.shape, seed=3)
        with CommDebugMode() as backward:
            (out * grad_weight).sum().backward()
        # The only backward collective sums the replicated input's gradient over the ranks.
        assert backward.get_comm_counts() == {"all_reduce": 1}
        (expected * grad_weight).sum().backward()
        assert_same_grads(model, reference)
        torch.testing.assert_close(x.grad, x_ref.grad)

    @with_comms
    def test_mlp_forward_backward_one_all_reduce(self) -> None:
        self.run_subtests({"case": tp_meshes(), "input_shape": [(6, 8), (2, 3, 8)]}, self.check_mlp)

    def check_optimizer(self, case, make_optimizer) -> None:
        mesh, dp = case
        reference = seeded_module(MLP(), seed=1, scale=0.5)
        model = parallelize_module(copy.deepcopy(reference), mesh, MLP_PLAN)
        optimizers = [make_optimizer(model.parameters()), make_optimizer(reference.parameters())]
        for step in range(2):
            x = randn(4, 8, seed=100 * dp + step)
            for net, optimizer in zip((model, reference), optimizers):
                optimizer.zero_grad()
                (net(x) ** 2).mean().backward()
                with CommDebugMode() as comm:
                    optimizer.step()
                if isinstance(optimizer, torch.optim.SGD):
                    assert comm.get_comm_counts() == {}  # parameters and gradients share their layouts
        assert all(isinstance(p, DTensor) for p in model.parameters())
        assert model.up.weight.placements == (Shard(0),)
        assert_same_params(model, reference)

    @with_comms
    def test_optimizer_steps_match_one_device(self) -> None:
        self.run_subtests(
            {"case": tp_meshes(),
             "make_optimizer": [lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                lambda ps: torch.optim.AdamW(ps, lr=0.05, weight_decay=0.1)]},
            self.check_optimizer,
        )


class SequenceParallelBlockTest(DTensorTestBase):
    @with_comms
    def test_norm_then_mlp_sequence_parallel(self) -> None:
        """norm on S(1) -> all_gather into the Colwise Linear -> reduce_scatter out of the Rowwise one."""

        class NormMLP(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.norm = nn.LayerNorm(8)
                self.mlp = MLP()

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.mlp(self.norm(x))

        mesh = init_device_mesh("cpu", (4,))
        reference = seeded_module(NormMLP(), seed=1, scale=0.5)
        plan = {
            "norm": SequenceParallel(),
            "mlp.up": ColwiseParallel(input_layouts=Shard(1)),
            "mlp.down": RowwiseParallel(output_layouts=Shard(1)),
        }
        model = parallelize_module(copy.deepcopy(reference), mesh, plan)
        x_full = randn(2, 8, 8, seed=2)
        x = x_full.chunk(4, 1)[mesh.get_local_rank()].clone().requires_grad_()
        x_ref = x_full.clone().requires_grad_()
        with CommDebugMode() as comm:
            out = model(x)
        assert comm.get_comm_counts() == {"all_gather": 1, "reduce_scatter": 1}
        expected = reference(x_ref)
        torch.testing.assert_close(out, expected.chunk(4, 1)[mesh.get_local_rank()])
        out.sum().backward()
        expected.sum().backward()
        assert_same_grads(model, reference)
        torch.testing.assert_close(x.grad, x_ref.grad.chunk(4, 1)[mesh.get_local_rank()])


class PlanTest(DTensorTestBase):
    @with_comms
    def test_wildcard_plan(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        reference = seeded_module(Stack(), seed=1, scale=0.5)
        plan = {
            "layers.*.attn.q_proj": ColwiseParallel(),
            "layers.*.attn.o_proj": RowwiseParallel(),
            "layers.[01].mlp.up": ColwiseParallel(),
            "layers.*.mlp.down": RowwiseParallel(),
        }
        model = parallelize_module(copy.deepcopy(reference), mesh, plan)
        for i in range(2):
            layer = model.layers[i]
            assert layer.attn["q_proj"].weight.placements == (Shard(0),)
            assert layer.attn["o_proj"].weight.placements == (Shard(1),)
            assert layer.mlp.up.weight.placements == (Shard(0),)
            assert layer.mlp.down.bias.placements == (Replicate(),)
            assert not isinstance(layer.norm.weight, DTensor)
        x = randn(2, 3, 8, seed=2)
        with CommDebugMode() as comm:
            out = model(x)
        assert comm.get_comm_counts() == {"all_reduce": 4}  # one per Rowwise Linear
        torch.testing.assert_close(out, reference(x))

    @with_comms
    def test_the_entered_mesh_is_used_and_no_plan_changes_nothing(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        with mesh:
            model = parallelize_module(MLP(), parallelize_plan=MLP_PLAN)
        assert model.up.weight.placements == (Shard(0),) and model.up.weight.device_mesh == mesh
        plain = MLP()
        with pytest.warns(UserWarning, match="no parallelize_plan"):
            assert parallelize_module(plain, mesh) is plain
        assert not isinstance(plain.up.weight, DTensor)

    def test_resolve_plan_key(self) -> None:
        model = Stack(depth=3)
        assert [name for name, _ in resolve_plan_key(model, "layers.*.attn.q_proj")] == [
            "layers.0.attn.q_proj", "layers.1.attn.q_proj", "layers.2.attn.q_proj"
        ]
        assert [name for name, _ in resolve_plan_key(model, "layers.[12].mlp.*")] == [
            "layers.1.mlp.up", "layers.1.mlp.down", "layers.2.mlp.up", "layers.2.mlp.down"
        ]
        assert resolve_plan_key(model, "") == [("", model)]
        assert resolve_plan_key(model, "layers.*.attn") != resolve_plan_key(model, "layers.*.attn.*")
        assert resolve_plan_key(model, "layers.*.atn") == []

    @with_comms
    def test_root_style_and_empty_key(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        reference = seeded_module(nn.Linear(8, 8), seed=1, scale=0.5)
        for plan in (ColwiseParallel(use_local_output=False), {"": ColwiseParallel(use_local_output=False)}):
            model = parallelize_module(copy.deepcopy(reference), mesh, plan)
            x = randn(3, 8, seed=2)
            torch.testing.assert_close(model(x).full_tensor(), reference(x))

    def test_a_plan_key_matching_nothing_warns_and_is_skipped(self) -> None:
        # one rank: warnings are process-wide state that rank threads would race on
        def parallelize_with_typos() -> None:
            mesh = init_device_mesh("cpu", (1,))
            with pytest.warns(UserWarning, match=r"'layers\.\*\.atn\.q_proj' matches no submodule.*'atn'.*attn, mlp"):
                model = parallelize_module(Stack(), mesh, {"layers.*.atn.q_proj": ColwiseParallel(), "head": ColwiseParallel()})
            self.assertIsInstance(model.head.weight, DTensor)
            with pytest.warns(UserWarning, match=r"did you mean 'head'"):
                parallelize_module(Stack(), mesh, {"haed": ColwiseParallel()})

        run_threaded(parallelize_with_typos, 1)

    @with_comms
    def test_bad_plans(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        with pytest.raises(UnsupportedModuleError, match=r"'layers\.0\.norm'.*ColwiseParallel.*cannot shard LayerNorm"):
            parallelize_module(Stack(), mesh, {"layers.*.norm": ColwiseParallel()})
        with pytest.raises(UnsupportedModuleError, match=r"root module.*RowwiseParallel.*cannot shard Stack"):
            parallelize_module(Stack(), mesh, RowwiseParallel())
        with pytest.raises(TypeError, match=r"parallelize_plan\['head'\] must be a ParallelStyle"):
            parallelize_module(Stack(), mesh, {"head": "colwise"})
        with pytest.raises(TypeError, match="must be a ParallelStyle or a dict"):
            parallelize_module(Stack(), mesh, [ColwiseParallel()])
        model = parallelize_module(nn.Linear(8, 8), mesh, ColwiseParallel())
        with pytest.raises(RuntimeError, match="already"):
            parallelize_module(model, mesh, RowwiseParallel())

    @with_comms
    def test_src_data_rank(self) -> None:
        """Parameters come from mesh coordinate 0 by default; with None each rank keeps its own."""
        mesh = init_device_mesh("cpu", (4,))
        rank = mesh.get_local_rank()
        own = seeded_module(nn.Linear(8, 8), seed=rank, scale=0.5)
        broadcast = parallelize_module(copy.deepcopy(own), mesh, ColwiseParallel())
        torch.testing.assert_close(broadcast.weight.full_tensor(), seeded_module(nn.Linear(8, 8), seed=0, scale=0.5).weight)
        kept = parallelize_module(copy.deepcopy(own), mesh, ColwiseParallel(), src_data_rank=None)
        torch.testing.assert_close(kept.weight.to_local(), own.weight.chunk(4, 0)[rank])

    @with_comms
    def test_dtensor_input_on_another_mesh(self) -> None:
        mesh_2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = parallelize_module(nn.Linear(8, 8), mesh_2d["tp"], ColwiseParallel())
        x = distribute_tensor(randn(4, 8, seed=1), mesh_2d, [Shard(0), Replicate()])
        with pytest.raises(ValueError, match="parallelised over"):
            model(x)

    @with_comms
    def test_nd_mesh_needs_a_tp_dim(self) -> None:
        """An n-d mesh must say which dim is tp: by the name "tp", or tp_mesh_dim=."""
        named = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "model"))
        with pytest.raises(ValueError, match=r"named \('dp', 'model'\); pass tp_mesh_dim="):
            parallelize_module(MLP(), named, MLP_PLAN)
        with pytest.raises(ValueError, match="tp_mesh_dim='tp' is not a dim"):
            parallelize_module(MLP(), named, MLP_PLAN, tp_mesh_dim="tp")
        unnamed = init_device_mesh("cpu", (2, 2))
        with pytest.raises(ValueError, match="name the mesh dims"):
            parallelize_module(MLP(), unnamed, MLP_PLAN)
        model = parallelize_module(MLP(), named, MLP_PLAN, tp_mesh_dim="model")
        assert model.up.weight.placements == (Replicate(), Shard(0))

    @with_comms
    def test_prepare_input_before_sharded_submodules(self) -> None:
        """A block whose input arrives sequence-sharded: PrepareModuleInput gathers it once for both branches."""
        mesh = init_device_mesh("cpu", (4,))
        reference = seeded_module(Block(), seed=1, scale=0.5)
        plan = {
            "": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_output=True),
            "attn.q_proj": ColwiseParallel(),
            "attn.o_proj": RowwiseParallel(),
            "mlp.up": ColwiseParallel(),
            "mlp.down": RowwiseParallel(),
        }
        model = parallelize_module(copy.deepcopy(reference), mesh, plan)
        x_full = randn(2, 8, 8, seed=2)
        with CommDebugMode() as comm:
            out = model(x_full.chunk(4, 1)[mesh.get_local_rank()])
        assert comm.get_comm_counts() == {"all_gather": 1, "all_reduce": 2}
        torch.testing.assert_close(out, reference(x_full))
