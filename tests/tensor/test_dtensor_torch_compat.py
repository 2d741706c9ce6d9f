"""DTensor creation and redistribution behave as torch.distributed.tensor's do (found by PyTorch's own tests).

Each test is a regression test for a case where spmd used to differ: a wrong value
(``src_data_rank``), a missing argument (``forward_dtype``, ``grad_placements``) or metadata
(``stride()``) that did not follow torch.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

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
from spmd.tensor.debug import CommDebugMode
from spmd.testing import DTensorTestBase, run_threaded, with_comms


class DistributeTensorSourceTest(DTensorTestBase):
    @with_comms
    def test_src_data_rank_picks_whose_data_is_kept(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        mine = torch.full((8, 2), float(self.rank))
        for placements in ([Shard(0)], [Replicate()]):
            kept = distribute_tensor(mine, mesh, placements, src_data_rank=1).full_tensor()
            torch.testing.assert_close(kept, torch.full((8, 2), 1.0))

    @with_comms
    def test_src_data_rank_on_a_2d_mesh_is_a_coordinate_on_every_dim(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        mine = torch.full((4, 4), float(self.rank))
        kept = distribute_tensor(mine, mesh, [Shard(0), Shard(1)], src_data_rank=1).full_tensor()
        torch.testing.assert_close(kept, torch.full((4, 4), 3.0))  # coordinate (1, 1) is rank 3

    @with_comms
    def test_src_data_rank_none_moves_nothing(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        with CommDebugMode() as comm:
            d = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)], src_data_rank=None)
        self.assertEqual(comm.get_total_counts(), 0)
        torch.testing.assert_close(d.to_local(), torch.arange(8.0)[2 * self.rank : 2 * self.rank + 2])

    @with_comms
    def test_src_data_rank_outside_the_mesh_dims_is_refused(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        with self.assertRaisesRegex(ValueError, "src_data_rank=4"):
            distribute_tensor(torch.ones(4), mesh, [Shard(0)], src_data_rank=4)

    @with_comms
    def test_meta_tensors_distribute_without_data(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        meta = distribute_tensor(torch.empty(8, 3, device="meta"), mesh, [Shard(0)])
        self.assertTrue(meta.is_meta)
        self.assertEqual(meta.to_local().shape, torch.Size([2, 3]))
        real = torch.empty_like(meta, device="cpu")
        torch.nn.init.constant_(real, 1.5)
        torch.testing.assert_close(real.full_tensor(), torch.full((8, 3), 1.5))


class PlainScalarTensorTest(DTensorTestBase):
    @with_comms
    def test_one_element_plain_tensors_act_as_scalars(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh, [Shard(0)])
        for scalar in (torch.tensor(2.0), torch.tensor([2.0]), torch.tensor([[2.0]])):
            torch.testing.assert_close((x + scalar).full_tensor(), torch.arange(12.0).reshape(4, 3) + scalar)
        with self.assertRaisesRegex(RuntimeError, "plain torch.Tensor of shape \\[3\\]"):
            x + torch.ones(3)


class FromLocalTest(DTensorTestBase):
    @with_comms
    def test_mesh_comes_from_the_entered_mesh(self) -> None:
        with init_device_mesh("cpu", (4,)) as mesh:
            d = DTensor.from_local(torch.ones(2, 3), placements=[Shard(0)])
        self.assertIs(d.device_mesh, mesh)
        self.assertEqual(d.shape, torch.Size([8, 3]))

    @with_comms
    def test_stride_keeps_the_local_dim_order(self) -> None:
        mesh = DeviceMesh("cpu", list(range(4)))
        local = torch.randn(8, 4, 8).permute(1, 2, 0)  # strides (8, 1, 32)
        d = DTensor.from_local(local, mesh, [Shard(1)])
        self.assertEqual(d.shape, torch.Size([4, 32, 8]))
        self.assertEqual(d.stride(), (32, 1, 128))
        self.assertEqual(DTensor.from_local(torch.randn(8, 4), mesh, [Shard(1)]).stride(), (16, 1))

    @with_comms
    def test_run_check_refuses_ranks_that_disagree_on_requires_grad(self) -> None:
        mesh = DeviceMesh("cpu", list(range(4)))
        local = torch.randn(3, 3, requires_grad=self.rank != 0)
        with self.assertRaisesRegex(ValueError, "require grad"):
            DTensor.from_local(local, mesh, [Shard(0)], run_check=True)

    @with_comms
    def test_run_check_refuses_ranks_that_disagree_on_layout(self) -> None:
        mesh = DeviceMesh("cpu", list(range(4)))
        local = torch.randn(4, 4)
        local = local.t() if self.rank == 0 else local
        with self.assertRaisesRegex(ValueError, "memory layouts"):
            DTensor.from_local(local, mesh, [Shard(0)], run_check=True)

    @with_comms
    def test_grad_placements_say_how_the_local_gradient_is_laid_out(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        local = torch.ones(2, 3, requires_grad=True)
        d = DTensor.from_local(local, mesh, [Replicate()], grad_placements=[Partial()])
        (d * 2).sum().backward()
        # one unreduced contribution per rank (the whole gradient on coordinate 0, zeros elsewhere),
        # summing over ranks to the gradient of the replicated tensor
        expected = 2.0 if self.rank == 0 else 0.0
        torch.testing.assert_close(local.grad, torch.full((2, 3), expected))


class RedistributeTorchCompatTest(DTensorTestBase):
    @with_comms
    def test_forward_dtype_casts_before_the_collective_and_the_gradient_comes_back_in_fp32(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        full = torch.arange(24.0).reshape(8, 3) / 7
        d = distribute_tensor(full, mesh, [Shard(0)]).requires_grad_()
        gathered = d.redistribute(mesh, [Replicate()], forward_dtype=torch.bfloat16, backward_dtype=torch.bfloat16)
        self.assertEqual(gathered.dtype, torch.bfloat16)
        torch.testing.assert_close(gathered.to_local(), full.to(torch.bfloat16))
        gathered.to_local().float().sum().backward()
        self.assertEqual(d.grad.dtype, torch.float32)
        self.assertEqual(d.grad.placements, (Shard(0),))
        torch.testing.assert_close(d.grad.full_tensor(), torch.ones(8, 3))

    @with_comms
    def test_a_partial_gradient_of_a_partial_input_stays_partial(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x = DTensor.from_local(torch.ones(4, 3), mesh, [Partial()]).requires_grad_()
        y = x.redistribute(mesh, [Partial()], backward_dtype=torch.float64)
        grad = DTensor.from_local(torch.ones(4, 3), mesh, [Partial()])
        with CommDebugMode() as comm:
            y.backward(grad)
        self.assertEqual(comm.get_total_counts(), 0)
        torch.testing.assert_close(x.grad.full_tensor(), torch.full((4, 3), 4.0))


class TorchErrorAndWarningKindsTest(DTensorTestBase):
    @with_comms
    def test_distribute_tensor_errors_name_what_is_wrong(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        with self.assertRaisesRegex(ValueError, "must have the same length"):
            distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
        with self.assertRaisesRegex(RuntimeError, "distribute leaf tensor"):
            distribute_tensor(torch.ones(4, 4, requires_grad=True) + 2, mesh, [Shard(0), Shard(1)])
        d = distribute_tensor(torch.ones(4, 4), mesh, [Shard(0), Shard(1)])
        with self.assertRaisesRegex(ValueError, "to a different device mesh"):
            distribute_tensor(d, init_device_mesh("cpu", (4,)), [Shard(0)])
        with self.assertRaisesRegex(ValueError, "to a different placements"):
            distribute_tensor(d, mesh, [Shard(0), Replicate()])

    def test_two_argument_input_fn_still_works_with_a_future_warning(self) -> None:
        # one rank: warnings are process-wide state that rank threads would race on
        def distribute_with_old_hooks() -> torch.Tensor:
            mesh = init_device_mesh("cpu", (1,))
            with self.assertWarnsRegex(FutureWarning, "Deprecating input_fn"):
                module = distribute_module(
                    torch.nn.Linear(4, 2),
                    mesh,
                    input_fn=lambda inputs, mesh: DTensor.from_local(inputs[0], mesh, [Replicate()]),
                    output_fn=lambda outputs, mesh: outputs.to_local(),
                )
            return module(torch.ones(3, 4))

        (out,) = run_threaded(distribute_with_old_hooks, 1)
        self.assertNotIsInstance(out, DTensor)
        self.assertEqual(out.shape, torch.Size([3, 2]))


class SpecVocabularyTest(DTensorTestBase):
    @with_comms
    def test_dtensor_spec_reads_as_torchs(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        spec = DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0), Partial()])._spec
        self.assertIs(spec.device_mesh, mesh)
        self.assertEqual((spec.shape, spec.stride, spec.ndim), ((4, 3), (3, 1), 2))
        self.assertEqual((spec.num_shards, spec.num_shards_map, spec.dim_map, spec.sums), (2, [2, 1], [0, -1], [1]))
        self.assertEqual((spec.is_sharded(), spec.is_partial(), spec.is_replicated()), (True, True, False))


class AsStridedStorageOffsetTest(DTensorTestBase):
    @with_comms
    def test_an_explicit_storage_offset_on_a_sharded_input_is_refused_not_guessed(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        full = torch.arange(32.0).reshape(8, 4)
        window = distribute_tensor(full, mesh, [Shard(0)])[:, 1:]  # a sharded view of the sharded base
        self.assertEqual(window.placements, (Shard(0),))
        # on one device these read the base's memory through the view's strides and offset
        with self.assertRaisesRegex(NotImplementedError, "explicit storage_offset.*Replicate"):
            window.as_strided((2, 2), (1, 2), storage_offset=1)
        with self.assertRaisesRegex(NotImplementedError, "non-contiguous strides"):
            window.as_strided((2, 2), (1, 2))
        # a contiguous sharded DTensor, or a replicated one (whose views share memory as on one device), runs
        contiguous = window.contiguous()
        torch.testing.assert_close(
            contiguous.as_strided((2, 2), (1, 2)).full_tensor(), full[:, 1:].contiguous().as_strided((2, 2), (1, 2))
        )
        replicated = distribute_tensor(full, mesh, [Replicate()])[:, 1:]
        torch.testing.assert_close(
            replicated.as_strided((2, 2), (1, 2), storage_offset=1).full_tensor(),
            full[:, 1:].as_strided((2, 2), (1, 2), storage_offset=1),
        )


def test_a_saved_dtensor_loads_outside_a_running_world_as_the_rank_that_saved_it(tmp_path: Path) -> None:
    def save() -> None:
        mesh = init_device_mesh("cpu", (2,))
        x = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
        torch.save(x, tmp_path / f"rank{mesh.get_rank()}.pt")

    run_threaded(save, 2)
    script = f"""
import torch, spmd.tensor
from spmd.comm.detached import DetachedWorldError
x = torch.load(r"{tmp_path / 'rank1.pt'}", weights_only=True)
assert x.placements == (spmd.tensor.Shard(0),) and x.shape == (4, 2), x
assert x.to_local().tolist() == [[4.0, 5.0], [6.0, 7.0]], x.to_local()
assert x.device_mesh.get_coordinate() == (1,)
try:
    x.full_tensor()
except DetachedWorldError as error:
    assert "outside a running world" in str(error)
else:
    raise AssertionError("a detached DTensor communicated")
"""
    # a fresh process: no world, no process group
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True, timeout=120)
