"""DeviceMesh over the threaded world: shapes, names, coordinates, sub-meshes, errors."""

from __future__ import annotations

import pytest
import torch

from spmd.tensor import DeviceMesh, init_device_mesh
from spmd.testing import DTensorTestBase, run_threaded, with_comms


class DeviceMeshTest(DTensorTestBase):
    world_size = 8

    @with_comms
    def test_description_is_read_only_and_groups_come_per_dim(self) -> None:
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        self.assertEqual((mesh.device_type, mesh.mesh.shape, mesh.mesh_dim_names), ("cpu", (2, 4), ("dp", "tp")))
        with self.assertRaises(AttributeError):
            mesh.mesh_dim_names = ("a", "b")
        groups = mesh.get_all_groups()
        self.assertEqual(len(groups), 2)
        self.assertIs(groups[1], mesh.get_group("tp"))

    @with_comms
    def test_3d_mesh_shape_and_coordinates(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
        self.assertEqual(mesh.shape, (2, 2, 2))
        self.assertEqual(mesh.ndim, 3)
        self.assertEqual(mesh.size(), 8)
        self.assertEqual(mesh.size("tp"), 2)
        rank = self.rank
        self.assertEqual(mesh.get_rank(), rank)
        self.assertEqual(mesh.get_coordinate(), (rank // 4, (rank // 2) % 2, rank % 2))
        self.assertEqual(mesh.get_local_rank("dp"), (rank // 2) % 2)
        self.assertEqual(mesh.get_local_rank(2), rank % 2)

    @with_comms
    def test_sub_meshes_hold_the_callers_row(self) -> None:
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        tp, dp = mesh["tp"], mesh["dp"]
        row, col = divmod(self.rank, 4)
        self.assertEqual(tp.mesh.tolist(), [row * 4 + c for c in range(4)])
        self.assertEqual(dp.mesh.tolist(), [col, 4 + col])
        self.assertEqual(tp.get_local_rank(), col)
        self.assertEqual(tp.mesh_dim_names, ("tp",))
        # one communicator per mesh dim, shared by the sub-mesh
        self.assertIs(tp.get_communicator(0), mesh.get_communicator("tp"))
        total = tp.get_communicator(0).all_reduce(torch.tensor([1.0]), "sum")
        self.assertEqual(total.item(), 4.0)

    @with_comms
    def test_sub_mesh_may_reorder_dims(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("a", "b", "c"))
        sub = mesh["c", "a"]
        self.assertEqual(sub.mesh_dim_names, ("c", "a"))
        b = mesh.get_local_rank("b")
        expected = torch.arange(8).reshape(2, 2, 2)[:, b, :].t()
        self.assertEqual(sub.mesh.tolist(), expected.tolist())

    @with_comms
    def test_meshes_are_values(self) -> None:
        a = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        b = DeviceMesh("cpu", torch.arange(8).reshape(2, 4), mesh_dim_names=("dp", "tp"))
        c = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
        self.assertEqual(a, b)
        self.assertEqual(hash(a), hash(b))
        self.assertNotEqual(a, c)
        self.assertEqual(str(a), "mesh(dp=2, tp=4)")
        self.assertIn("[[0, 1, 2, 3], [4, 5, 6, 7]]", repr(a))

    @with_comms
    def test_bad_meshes_say_what_to_change(self) -> None:
        with self.assertRaisesRegex(ValueError, "holds 6 ranks but the world has 8"):
            init_device_mesh("cpu", (2, 3))
        with self.assertRaisesRegex(ValueError, "name each of the 2 mesh dims once"):
            init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp",))
        with self.assertRaisesRegex(ValueError, "lists each rank once"):
            DeviceMesh("cpu", [0, 0, 1, 2])
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        with self.assertRaisesRegex(KeyError, "no dim named 'pp'"):
            mesh["pp"]
        with self.assertRaisesRegex(ValueError, "needs a mesh_dim"):
            mesh.get_local_rank()

    @with_comms
    def test_ranks_must_be_integers(self) -> None:
        with self.assertRaisesRegex(ValueError, r"ranks must be integers, got \[0, 1.5, 2, 3\]; pass ints such as \[0, 1, 2, 3\]"):
            DeviceMesh("cpu", [0, 1.5, 2, 3])
        with self.assertRaisesRegex(ValueError, "ranks must be integers"):
            DeviceMesh("cpu", torch.tensor([[0.0, 1.0], [2.0, 3.0]]))
        with self.assertRaisesRegex(ValueError, "ranks must be integers"):
            DeviceMesh("cpu", [False, True])
        with self.assertRaisesRegex(ValueError, "ranks must be integers"):
            DeviceMesh("cpu", [0, True, 2])
        with self.assertRaisesRegex(ValueError, "at least one rank"):
            DeviceMesh("cpu", [])
        with self.assertRaisesRegex(ValueError, "a DeviceMesh takes a .*list or tensor of integer ranks"):
            DeviceMesh("cpu", [[0, 1], [2]])
        # integer tensors of any integer dtype are fine
        mesh = DeviceMesh("cpu", torch.tensor([[0, 1], [2, 3]], dtype=torch.int32))
        self.assertEqual(mesh.mesh.dtype, torch.int64)
        self.assertEqual(mesh.mesh.tolist(), [[0, 1], [2, 3]])

    @with_comms
    def test_mesh_dim_names_must_be_a_tuple_of_names(self) -> None:
        with self.assertRaisesRegex(TypeError, r"got the string 'dt'; pass a tuple such as \('dt',\)"):
            init_device_mesh("cpu", (2, 4), mesh_dim_names="dt")
        with self.assertRaisesRegex(TypeError, "mesh_dim_names must be strings"):
            init_device_mesh("cpu", (2, 4), mesh_dim_names=(0, 1))  # type: ignore[arg-type]
        self.assertEqual(init_device_mesh("cpu", (8,), mesh_dim_names=["dp"]).mesh_dim_names, ("dp",))

    @with_comms
    def test_sub_mesh_names_each_dim_once(self) -> None:
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        with self.assertRaisesRegex(ValueError, r"names mesh dim 'dp' more than once"):
            mesh["dp", "dp"]
        with self.assertRaisesRegex(ValueError, r"names mesh dim 'tp' more than once"):
            mesh[("tp", "dp", "tp")]


def test_a_mesh_over_part_of_the_world() -> None:
    def coordinates() -> tuple[int, ...] | None:
        mesh = DeviceMesh("cpu", [0, 2])
        return mesh.get_coordinate()

    assert run_threaded(coordinates, 4) == [(0,), None, (1,), None]


def test_one_dim_mesh_default_local_rank() -> None:
    assert run_threaded(lambda: init_device_mesh("cpu", (3,)).get_local_rank(), 3) == [0, 1, 2]


@pytest.mark.parametrize("shape", [(4,), (2, 2)])
def test_get_group_returns_a_communicator_per_dim(shape: tuple[int, ...]) -> None:
    def group_sizes() -> list[int]:
        mesh = init_device_mesh("cpu", shape)
        return [mesh.get_communicator(d).size for d in range(mesh.ndim)]

    assert run_threaded(group_sizes, 4)[0] == list(shape)


def test_communicators_carry_their_mesh_dim_and_the_meshs_timeout() -> None:
    def labels() -> tuple[object, ...]:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"), timeout=12.5)
        unnamed = init_device_mesh("cpu", (2, 2))  # the same groups: they keep the 12.5 s
        tp = mesh.get_communicator("tp")
        return (
            tp.mesh_dim,
            tp.describe("all_gather"),
            mesh["tp"].get_communicator(0) is tp,
            unnamed.get_communicator(1).describe("all_gather"),
            mesh.get_communicator("dp").timeout_s,
        )

    results = run_threaded(labels, 4, timeout=30)
    assert results[2] == ("tp", "all_gather on mesh dim 'tp' (ranks [2, 3])", True, "all_gather on mesh dim 1 (ranks [2, 3])", 12.5)


def test_init_device_mesh_refuses_a_timeout_that_is_not_positive() -> None:
    def bad_timeout() -> str:
        with pytest.raises(ValueError, match="timeout must be positive, got 0") as info:
            init_device_mesh("cpu", (2,), timeout=0)
        return str(info.value)

    assert run_threaded(bad_timeout, 2) == ["timeout must be positive, got 0; pass seconds or a timedelta"] * 2
