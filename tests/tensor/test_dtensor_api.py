"""DTensor creation and conversion: from_local, to_local, distribute_tensor, factories, modules."""

from __future__ import annotations

import torch
from torch import nn

import spmd.tensor as st
from spmd.tensor import (
    DeviceMesh,
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
    init_device_mesh,
)
from spmd.testing import DTensorTestBase, with_comms


class DTensorApiTest(DTensorTestBase):
    @with_comms
    def test_distribute_tensor_keeps_one_shard_per_rank(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        full = torch.arange(48.0).reshape(8, 6)
        d = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
        row, col = divmod(self.rank, 2)
        self.assertEqual(d.shape, torch.Size([8, 6]))
        self.assertEqual(d.placements, (Shard(0), Shard(1)))
        self.assertIs(d.device_mesh, mesh)
        torch.testing.assert_close(d.to_local(), full[row * 4 : row * 4 + 4, col * 3 : col * 3 + 3])
        torch.testing.assert_close(d.full_tensor(), full)
        self.assertEqual(str(d._spec), "f32[8,6] (S(0), S(1)) on mesh(dp=2, tp=2)")

    @with_comms
    def test_distribute_tensor_uses_rank_zeros_data(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        mine = torch.full((4, 2), float(self.rank))
        self.assertEqual(distribute_tensor(mine, mesh, [Replicate()]).to_local().unique().tolist(), [0.0])
        self.assertEqual(distribute_tensor(mine, mesh, [Shard(0)]).full_tensor().unique().tolist(), [0.0])

    @with_comms
    def test_uneven_shards_follow_torch_chunk(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        full = torch.arange(7.0)
        d = distribute_tensor(full, mesh, [Shard(0)])
        self.assertEqual(d.to_local().numel(), [2, 2, 2, 1][self.rank])
        torch.testing.assert_close(d.full_tensor(), full)

    @with_comms
    def test_negative_shard_dims_are_normalized(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        d = distribute_tensor(torch.randn(4, 8), mesh, [Shard(-1)])
        self.assertEqual(d.placements, (Shard(1),))

    @with_comms
    def test_from_local_and_to_local_round_trip_with_autograd(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        local = torch.randn(2, 3, requires_grad=True)
        d = DTensor.from_local(local, mesh, [Shard(0)])
        self.assertEqual(d.shape, torch.Size([8, 3]))
        out = d.to_local()
        torch.testing.assert_close(out, local)
        (out * 3).sum().backward()
        torch.testing.assert_close(local.grad, torch.full((2, 3), 3.0))

    @with_comms
    def test_from_local_uneven_needs_shape_or_run_check(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        rows = [2, 2, 2, 1][self.rank]
        local = torch.ones(rows, 3)
        checked = DTensor.from_local(local, mesh, [Shard(0)], run_check=True)
        self.assertEqual(checked.shape, torch.Size([7, 3]))
        given = DTensor.from_local(local, mesh, [Shard(0)], shape=(7, 3), stride=(3, 1))
        self.assertEqual(given.full_tensor().shape, torch.Size([7, 3]))

    @with_comms
    def test_from_local_run_check_rejects_inconsistent_shapes(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        local = torch.ones(3 if self.rank == 1 else 2, 4)
        with self.assertRaisesRegex(ValueError, r"coordinate \(0,\).*shape \[2, 4\].*give it \[3, 4\]"):
            DTensor.from_local(local, mesh, [Shard(0)], run_check=True)

    @with_comms
    def test_from_local_run_check_rejects_different_dtypes(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        local = torch.ones(2, dtype=torch.float64 if self.rank == 3 else torch.float32)
        with self.assertRaisesRegex(ValueError, "different dtypes"):
            DTensor.from_local(local, mesh, [Replicate()], run_check=True)

    @with_comms
    def test_from_local_run_check_broadcasts_replicas(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        d = DTensor.from_local(torch.full((2,), float(self.rank)), mesh, [Replicate()], run_check=True)
        self.assertEqual(d.to_local().tolist(), [0.0, 0.0])

    @with_comms
    def test_from_local_partial_sum_grad_is_the_global_grad(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        local = torch.full((3,), float(self.rank), requires_grad=True)
        d = DTensor.from_local(local, mesh, [Partial()])
        full = d.full_tensor()
        torch.testing.assert_close(full, torch.full((3,), 6.0))
        (full * torch.arange(3.0)).sum().backward()
        torch.testing.assert_close(local.grad, torch.arange(3.0))

    @with_comms
    def test_from_local_partial_max_has_no_gradient(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        local = torch.ones(3, requires_grad=True)
        full = DTensor.from_local(local, mesh, [Partial("max")]).full_tensor()
        with self.assertRaisesRegex(NotImplementedError, "redistribute to Replicate"):
            full.sum().backward()

    @with_comms
    def test_from_local_takes_one_plain_local_tensor(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        pieces = list(torch.arange(8.0).chunk(4))
        with self.assertRaisesRegex(TypeError, "as one torch.Tensor, got list; each rank passes only the piece it holds"):
            DTensor.from_local(pieces, mesh, [Shard(0)])  # type: ignore[arg-type]
        d = DTensor.from_local(pieces[self.rank], mesh, [Shard(0)])
        with self.assertRaisesRegex(TypeError, r"got a DTensor .*call .redistribute\(placements=...\), or pass its .to_local\(\)"):
            DTensor.from_local(d, mesh, [Replicate()])
        with self.assertRaisesRegex(TypeError, "takes a DeviceMesh, got tuple"):
            DTensor.from_local(pieces[self.rank], (4,), [Shard(0)])  # type: ignore[arg-type]
        torch.testing.assert_close(d.full_tensor(), torch.arange(8.0))

    @with_comms
    def test_wrong_number_of_placements(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        with self.assertRaisesRegex(ValueError, "1 placements .* for a 2-d mesh.*one placement per mesh dim"):
            distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
        with self.assertRaisesRegex(ValueError, "one placement per mesh dim"):
            DTensor.from_local(torch.randn(2, 2), mesh, [Shard(0), Shard(1), Replicate()])

    @with_comms
    def test_shard_dim_out_of_range(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        with self.assertRaisesRegex(ValueError, r"S\(2\) is out of range for a 2-d tensor; use a dim in \[-2, 1\]"):
            distribute_tensor(torch.randn(4, 4), mesh, [Shard(2)])
        x = distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
        with self.assertRaisesRegex(ValueError, "out of range"):
            x.redistribute(mesh, [Shard(5)])

    @with_comms
    def test_single_placement_instead_of_a_list(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        with self.assertRaisesRegex(TypeError, r"must be a sequence, e.g. \[S\(0\)\]"):
            distribute_tensor(torch.randn(4), mesh, Shard(0))  # type: ignore[arg-type]

    @with_comms
    def test_mismatched_meshes_between_operands(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        other = DeviceMesh("cpu", [3, 2, 1, 0])
        a = distribute_tensor(torch.randn(4, 4), mesh, [Replicate()])
        b = distribute_tensor(torch.randn(4, 4), other, [Replicate()])
        with self.assertRaisesRegex(ValueError, "different meshes"):
            a + b
        with self.assertRaisesRegex(ValueError, "cannot redistribute from .* to another mesh"):
            a.redistribute(other, [Replicate()])

    @with_comms
    def test_factories(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        cases = {
            "zeros": (st.zeros(7, 4, device_mesh=mesh, placements=[Shard(0), Shard(1)]), torch.zeros(7, 4)),
            "ones": (st.ones((7, 4), device_mesh=mesh, placements=[Replicate(), Shard(0)]), torch.ones(7, 4)),
            "full": (st.full((3, 5), 2.5, device_mesh=mesh, placements=[Partial(), Shard(1)]), torch.full((3, 5), 2.5)),
            "empty": (st.empty(4, 4, device_mesh=mesh, placements=[Shard(1), Replicate()]), None),
        }
        for name, (actual, expected) in cases.items():
            if expected is not None:
                torch.testing.assert_close(actual.full_tensor(), expected, msg=name)
            self.assertEqual(actual.shape, torch.Size(actual.shape), name)
        self.assertEqual(cases["empty"][0].to_local().shape, torch.Size([4, 2]))
        grad = st.ones(4, device_mesh=mesh, placements=[Shard(0), Replicate()], requires_grad=True)
        self.assertTrue(grad.requires_grad and grad.is_leaf)

    @with_comms
    def test_random_factories_match_a_single_device_draw(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        torch.manual_seed(5)  # the generator is shared by the rank threads; rank 0's draw is used
        r = st.randn(8, 3, device_mesh=mesh, placements=[Shard(0)])
        u = st.rand(8, 3, device_mesh=mesh, placements=[Replicate()])
        self.assertEqual(r.shape, torch.Size([8, 3]))
        gathered = r.full_tensor()
        # replicas agree: every rank's full tensor is the same
        everyone = mesh.get_communicator(0).all_gather(gathered)
        for other in everyone:
            torch.testing.assert_close(other, gathered)
        self.assertTrue(bool(((u.to_local() >= 0) & (u.to_local() < 1)).all()))

    @with_comms
    def test_distribute_module_replicates_parameters(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        torch.manual_seed(0)
        model = nn.Linear(4, 4)

        def shard_weight(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
            if isinstance(module, nn.Linear):
                module.weight = nn.Parameter(distribute_tensor(module.weight.data, mesh, [Shard(0)]))

        def to_dtensor(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            return tuple(DTensor.from_local(x, mesh, [Replicate()]) for x in inputs)

        distribute_module(model, mesh, shard_weight, input_fn=to_dtensor)
        self.assertIsInstance(model.weight, DTensor)
        self.assertEqual(model.weight.placements, (Shard(0),))
        self.assertEqual(model.bias.placements, (Replicate(),))
        with self.assertRaisesRegex(RuntimeError, "already called"):
            distribute_module(model, mesh)

    @with_comms
    def test_the_mesh_entered_with_with_is_used_when_none_is_given(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        full = torch.arange(16.0).reshape(8, 2)
        with mesh:
            d = distribute_tensor(full, placements=[Shard(0)])
            z = st.zeros(8, 2, placements=[Shard(1)])
            model = distribute_module(nn.Linear(2, 2))
        self.assertEqual(d.device_mesh, mesh)
        torch.testing.assert_close(d.full_tensor(), full)
        self.assertEqual((z.device_mesh, z.placements), (mesh, (Shard(1),)))
        self.assertEqual(model.weight.placements, (Replicate(),))
        with self.assertRaisesRegex(RuntimeError, "no DeviceMesh is active: pass device_mesh=.*with mesh:"):
            distribute_tensor(full, placements=[Shard(0)])

    @with_comms
    def test_inner_with_mesh_wins_and_the_outer_comes_back(self) -> None:
        outer = init_device_mesh("cpu", (4,))
        inner = init_device_mesh("cpu", (2, 2))
        with outer:
            with inner:
                self.assertEqual(st.ones(4, 4).device_mesh, inner)
            self.assertEqual(st.ones(4).device_mesh, outer)

    @with_comms
    def test_factories_take_torchs_layout_keyword(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        d = st.ones(8, layout=torch.strided, device_mesh=mesh, placements=[Shard(0)])
        torch.testing.assert_close(d.full_tensor(), torch.ones(8))
        with self.assertRaisesRegex(NotImplementedError, "strided tensors only"):
            st.randn(8, layout=torch.sparse_coo, device_mesh=mesh)

    @with_comms
    def test_repr_shows_the_spec(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        d = distribute_tensor(torch.zeros(8, 2), mesh, [Shard(0)])
        self.assertIn("spec=f32[8,2] (S(0)) on mesh(d0=4)", repr(d))
