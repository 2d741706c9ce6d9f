"""CommDebugMode: counts per collective, per op and per module, forward and backward."""

from __future__ import annotations

import os
import tempfile

import torch
from torch import nn

from spmd.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.testing import DTensorTestBase, with_comms
from spmd.testing import seeded_randn as seeded
from spmd.testing.layouts import make_dtensor


class ColumnThenRow(nn.Module):
    """A two-layer MLP in Megatron layout: up is column-sharded, down is row-sharded."""

    def __init__(self, mesh) -> None:
        super().__init__()
        self.up = nn.Parameter(distribute_tensor(seeded(8, 16, seed=1), mesh, [Shard(1)]))
        self.down = nn.Parameter(distribute_tensor(seeded(16, 8, seed=2), mesh, [Shard(0)]))

    def forward(self, x: DTensor) -> DTensor:
        hidden = torch.relu(x @ self.up)  # R x S(1) -> S(1): no communication
        out = hidden @ self.down  # S(1) x S(0) -> P(sum)
        return out.redistribute(placements=[Replicate()])  # one all_reduce


class Wrapper(nn.Module):
    def __init__(self, mesh) -> None:
        super().__init__()
        self.mlp = ColumnThenRow(mesh)

    def forward(self, x: DTensor) -> DTensor:
        return self.mlp(x)


class CommDebugModeTest(DTensorTestBase):
    @with_comms
    def test_counts_of_each_transition(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        full = seeded(8, 8)
        expected = [
            ([Shard(0), Shard(1)], [Replicate(), Replicate()], {"all_gather": 2}),
            ([Partial(), Partial()], [Replicate(), Replicate()], {"all_reduce": 2}),  # small: one per dim
            ([Partial(), Shard(0)], [Shard(1), Shard(0)], {"reduce_scatter": 1}),
            ([Shard(0), Replicate()], [Shard(1), Replicate()], {"all_to_all": 1}),
            ([Replicate(), Replicate()], [Shard(0), Partial()], {}),
        ]
        for src, dst, counts in expected:
            x = make_dtensor(full, mesh, src)
            with CommDebugMode() as comm:
                x.redistribute(mesh, dst)
            self.assertEqual(comm.get_comm_counts(), counts, f"{src} -> {dst}")
            self.assertEqual(comm.get_total_counts(), sum(counts.values()))

    @with_comms
    def test_bytes_follow_ring_accounting(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(seeded(8, 4), mesh, [Shard(0)])
        with CommDebugMode() as comm:
            x.full_tensor()
        # each rank receives the three shards it lacks: 3 * 2 * 4 floats
        self.assertEqual(comm.get_comm_bytes(), {"all_gather": 3 * 2 * 4 * 4})

    @with_comms
    def test_per_op_attribution(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        a = make_dtensor(seeded(8, 4), mesh, [Partial()])
        with CommDebugMode() as comm:
            torch.relu(a)
            a.redistribute(mesh, [Replicate()])
        self.assertEqual(
            comm.get_per_op_comm_counts(),
            {"aten.relu.default": {"all_reduce": 1}, "redistribute": {"all_reduce": 1}},
        )

    @with_comms
    def test_tensor_parallel_mlp_forward_and_backward(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        model = Wrapper(mesh)
        x = distribute_tensor(seeded(4, 8, seed=3), mesh, [Replicate()])
        with CommDebugMode() as comm:
            out = model(x)
            out.to_local().sum().backward()
        forward = comm.get_per_module_comm_counts(backward=False)
        self.assertEqual(forward["Global"], {"all_reduce": 1})
        self.assertEqual(forward["Wrapper.mlp"], {"all_reduce": 1})
        # backward of the all_reduce is free (the grad is replicated); grads of up/down stay sharded
        backward = comm.get_per_module_comm_counts(backward=True)
        self.assertEqual(backward, {})
        self.assertEqual(model.mlp.up.grad.placements, (Shard(1),))
        self.assertEqual(model.mlp.down.grad.placements, (Shard(0),))
        table = comm.generate_comm_debug_tracing_table(noise_level=1)
        self.assertIn("Wrapper.mlp", table)
        self.assertIn("all_reduce  [redistribute]", table)

    @with_comms
    def test_backward_collectives_are_marked(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(seeded(8, 4), mesh, [Shard(0)]).requires_grad_()
        gathered = x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        with CommDebugMode() as comm:
            gathered.sum().backward()
        self.assertEqual(comm.get_per_module_comm_counts(backward=True), {"Global": {"reduce_scatter": 1}})
        self.assertEqual(comm.get_per_module_comm_counts(backward=False), {})

    @with_comms
    def test_each_rank_sees_only_its_own_collectives(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        row = mesh["tp"]  # the two rows talk in separate groups, so they may do different work
        x = distribute_tensor(seeded(8, 4), row, [Shard(0)])
        repeats = 1 if mesh.get_local_rank("dp") == 0 else 2
        with CommDebugMode() as comm:
            for _ in range(repeats):
                x.redistribute(row, [Replicate()])
        self.assertEqual(comm.get_total_counts(), repeats)

    @with_comms
    def test_comm_module_counts_has_torchs_layout(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        model = Wrapper(mesh)
        x = distribute_tensor(seeded(4, 8, seed=3), mesh, [Replicate()])
        gathered = distribute_tensor(seeded(8, 4), mesh, [Shard(0)]).requires_grad_()
        with CommDebugMode() as comm:
            model(x)
            replicated = gathered.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
            replicated.sum().backward()
        counts = comm.comm_module_counts
        self.assertEqual(set(counts), {"Global", "Wrapper", "Wrapper.mlp"})
        self.assertEqual(counts["Wrapper.mlp"], {"forward": {"all_reduce": 1}, "backward": {}})
        self.assertEqual(counts["Global"], {"forward": {"all_reduce": 1, "all_gather": 1}, "backward": {"reduce_scatter": 1}})
        self.assertEqual(comm.comm_counts, comm.get_comm_counts())

    @with_comms
    def test_counts_read_with_torchs_collective_ops_as_keys(self) -> None:
        import torch.distributed._functional_collectives as funcol

        mesh = init_device_mesh("cpu", (4,))
        x = make_dtensor(seeded(8, 4), mesh, [Partial()])
        with CommDebugMode() as comm:
            x.redistribute(mesh, [Replicate()])
        counts = comm.get_comm_counts()
        self.assertEqual(counts, {"all_reduce": 1})
        for key in ("all_reduce", funcol.all_reduce, torch.ops.c10d_functional.all_reduce,
                    torch.ops._c10d_functional.all_reduce.default, torch.ops.c10d.allreduce_):
            self.assertEqual(counts[key], 1, key)
            self.assertIn(key, counts)
        # as in torch (a defaultdict), a collective that did not happen counts 0
        self.assertEqual(counts[funcol.all_gather_tensor], 0)
        self.assertEqual(counts[torch.ops.c10d_functional.all_gather_into_tensor], 0)
        self.assertNotIn("all_gather", counts)
        with self.assertRaisesRegex(KeyError, "not a collective CommDebugMode counts"):
            counts["all_gahter"]
        self.assertEqual(comm.comm_module_counts["Global"]["forward"][funcol.all_reduce], 1)

    @with_comms
    def test_parameter_and_sharding_info_of_the_modules_that_ran(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        model = Wrapper(mesh)
        with CommDebugMode() as comm:
            model(distribute_tensor(seeded(4, 8, seed=3), mesh, [Replicate()]))
        self.assertEqual({k: set(v) for k, v in comm.get_parameter_info().items()}, {"Wrapper.mlp": {"up", "down"}})
        up = comm.get_parameter_info()["Wrapper.mlp"]["up"]
        self.assertEqual(up.to_local().data_ptr(), model.mlp.up.to_local().data_ptr())  # the parameter's own data
        self.assertEqual(comm.get_sharding_info(), {"Wrapper.mlp.up": (Shard(1),), "Wrapper.mlp.down": (Shard(0),)})

    def test_the_table_goes_to_a_file_like_torchs(self) -> None:
        comm = CommDebugMode()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "comm.txt")
            comm.log_comm_debug_tracing_table_to_file(path)
            with open(path) as file:
                self.assertEqual(file.read(), comm.generate_comm_debug_tracing_table() + "\n")
