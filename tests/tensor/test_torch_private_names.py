"""torch's private DTensor names that spmd offers with the same meaning, used as client code uses them.

Code written against torch imports a few names from torch's private modules (``_api._shard_tensor``,
``_collective_utils.unpad_tensor``, ``_redistribute.redistribute_local_tensor`` ...);
the redirect's module map sends each to the spmd function tested here (tests/compat checks the map).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from spmd.tensor import DTensor, Partial, Replicate, Shard, _shard_tensor, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode, _clear_sharding_prop_cache
from spmd.tensor.dispatch import DISPATCHER
from spmd.tensor.placement import pad_tensor, unpad_tensor
from spmd.tensor.random import is_rng_supported_mesh
from spmd.tensor.redistribute.collectives import shard_dim_alltoall
from spmd.tensor.redistribute.run import redistribute_local_tensor
from spmd.tensor.spec import DTensorSpec, TensorMeta
from spmd.testing import DTensorTestBase, run_threaded, with_comms


class ShardTensorTest(DTensorTestBase):
    @with_comms
    def test_every_rank_cuts_its_piece_without_communication(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        whole = torch.arange(16.0).view(4, 4)  # every rank loaded the same checkpoint
        with CommDebugMode() as comm:
            rows = _shard_tensor(whole, [Shard(0)], mesh)
            cols = _shard_tensor(whole, [Shard(1)], mesh)
        self.assertEqual(comm.get_total_counts(), 0)
        self.assertEqual(rows.placements, (Shard(0),))
        torch.testing.assert_close(rows.to_local(), whole[self.rank : self.rank + 1])
        torch.testing.assert_close(cols.to_local(), whole[:, self.rank : self.rank + 1])
        torch.testing.assert_close(rows.full_tensor(), whole)

    @with_comms
    def test_on_a_2d_mesh(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        whole = torch.arange(4.0).view(2, 2)
        piece = _shard_tensor(whole, [Shard(0), Shard(1)], mesh)
        self.assertEqual(piece.to_local().item(), float(self.rank))


def test_unpad_tensor_undoes_the_padding_of_split_tensor() -> None:
    whole = torch.arange(10.0).view(5, 2)
    pieces, pads = Shard(0)._split_tensor(whole, 4, with_padding=True)
    assert pads == [0, 0, 1, 2]  # torch.chunk cuts 5 rows as 2, 2, 1, 0: each padded to 2
    unpadded = [unpad_tensor(p, 0, pad) for p, pad in zip(pieces, pads)]
    torch.testing.assert_close(torch.cat(unpadded), whole)
    assert unpadded[3].shape == (0, 2)
    assert unpad_tensor(pieces[0], 0, 0) is pieces[0]


def test_pad_tensor_appends_zeros() -> None:
    padded = pad_tensor(torch.ones(2, 3), 1, 2)
    torch.testing.assert_close(padded, torch.tensor([[1.0, 1, 1, 0, 0], [1, 1, 1, 0, 0]]))
    torch.testing.assert_close(unpad_tensor(padded, 1, 2), torch.ones(2, 3))


class ShardDimAlltoallTest(DTensorTestBase):
    @with_comms
    def test_reshards_one_mesh_dim_as_redistribute_does(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        even = distribute_tensor(torch.arange(48.0).view(12, 4), mesh, [Replicate(), Shard(0)])
        uneven = distribute_tensor(torch.arange(28.0).view(4, 7), mesh, [Shard(0), Replicate()])
        for dt, mesh_dim in ((even, 1), (uneven, 0)):
            with CommDebugMode() as comm:
                local = shard_dim_alltoall(dt.to_local(), 0, 1, mesh, mesh_dim)
            self.assertEqual(comm.get_total_counts(), 1)  # one all_to_all
            target = [Shard(1) if d == mesh_dim else p for d, p in enumerate(dt.placements)]
            torch.testing.assert_close(local, dt.redistribute(mesh, target).to_local())

    @with_comms
    def test_meta_input_gives_the_shape(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        out = shard_dim_alltoall(torch.empty(3, 8, device="meta"), 0, 1, mesh, 0)
        self.assertEqual((out.shape, out.stride()), ((12, 2), (2, 1)))


class RedistributeLocalTensorTest(DTensorTestBase):
    @with_comms
    def test_moves_a_shard_between_specs(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        dt = distribute_tensor(torch.arange(32.0).view(8, 4), mesh, [Shard(0)])
        target = DTensorSpec(mesh, (Shard(1),), dt._spec.tensor_meta)
        with CommDebugMode() as comm:
            local = redistribute_local_tensor(dt.to_local(), dt._spec, target)
        self.assertEqual(comm.get_total_counts(), 1)
        torch.testing.assert_close(local, torch.arange(32.0).view(8, 4)[:, self.rank : self.rank + 1])

    @with_comms
    def test_partial_to_replicate_sums(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        meta = TensorMeta((2,), (1,), torch.float32)
        local = redistribute_local_tensor(
            torch.ones(2), DTensorSpec(mesh, (Partial(),), meta), DTensorSpec(mesh, (Replicate(),), meta)
        )
        torch.testing.assert_close(local, torch.full((2,), 4.0))


def test_every_mesh_supports_dtensor_random_ops() -> None:
    def rank() -> bool:
        return is_rng_supported_mesh(init_device_mesh("cpu", (2,)))

    assert run_threaded(rank, 2) == [True, True]
    with pytest.raises(TypeError, match="takes a DeviceMesh"):
        is_rng_supported_mesh("cpu")  # type: ignore[arg-type]


def test_clear_sharding_prop_cache_makes_the_next_op_decide_afresh() -> None:
    def rank() -> tuple[int, int]:
        dt = distribute_tensor(torch.ones(4, 4), init_device_mesh("cpu", (1,)), [Shard(0)])
        dt + dt
        before = DISPATCHER.misses
        dt + dt  # decided already
        cached = DISPATCHER.misses - before
        _clear_sharding_prop_cache()
        dt + dt
        return cached, DISPATCHER.misses - before

    assert run_threaded(rank, 1) == [(0, 1)]


def test_detaching_a_local_tensor_that_requires_grad_warns() -> None:
    """One rank: Python's warning filters are process-wide, so rank threads checking warnings at
    once would see each other's filters come and go."""

    def rank() -> None:
        mesh = init_device_mesh("cpu", (1,))
        local = torch.randn(3, 3, requires_grad=True)
        spec = DTensorSpec(mesh, (Shard(0),), TensorMeta((3, 3), (3, 1), torch.float32))
        assert DTensor(local, spec, requires_grad=True).shape == (3, 3)
        with pytest.warns(UserWarning, match="DTensor.from_local"):
            dropped = DTensor(local, spec, requires_grad=False)
        assert not dropped.requires_grad
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with torch.no_grad():  # no graph is recorded here: nothing to warn about
                DTensor(local, spec, requires_grad=False)
            DTensor.from_local(local, mesh, [Shard(0)])

    run_threaded(rank, 1)


def test_tensor_meta_names_a_stride_method_passed_by_mistake() -> None:
    t = torch.ones(2, 3)
    with pytest.raises(TypeError, match=r"pass tensor.stride\(\)"):
        TensorMeta(t.shape, t.stride, t.dtype)  # type: ignore[arg-type]
