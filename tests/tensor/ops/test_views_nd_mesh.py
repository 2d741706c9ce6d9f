"""Views on n-d meshes: a shard survives when its dim divides by the pieces it is cut into,
not by the whole mesh (a batch of 2 over dp=2 on a dp x tp mesh stays sharded)."""

from __future__ import annotations

from spmd.tensor import Partial, Replicate, Shard, init_device_mesh
from spmd.testing import DTensorTestBase, check_against_torch, seeded_randn, with_comms


class ViewOnTwoDimMeshTest(DTensorTestBase):
    @with_comms
    def test_flatten_keeps_a_batch_shard_that_divides_by_its_own_mesh_dim(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        x = seeded_randn(2, 32, 64).requires_grad_()
        y = check_against_torch(
            lambda t: t.view(64, 64), x, placements=[[Shard(0), Replicate()]], mesh=mesh, collectives=0
        )
        self.assertEqual(y.placements, (Shard(0), Replicate()))

    @with_comms
    def test_unflatten_and_squeeze_use_the_pieces_of_each_dim(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        x = seeded_randn(2, 6, 1, 4).requires_grad_()
        y = check_against_torch(lambda t: t.squeeze(2).view(2, 24), x, placements=[[Shard(0), Replicate()]], mesh=mesh)
        self.assertEqual(y.placements, (Shard(0), Replicate()))

    @with_comms
    def test_a_dim_that_does_not_divide_still_loses_its_shard(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        x = seeded_randn(3, 4).requires_grad_()  # 3 rows over dp=2: pieces 2 and 1
        y = check_against_torch(lambda t: t.view(12), x, placements=[[Shard(0), Replicate()]], mesh=mesh)
        self.assertEqual(y.placements, (Replicate(), Replicate()))

    @with_comms
    def test_splitting_heads_keeps_both_shards(self) -> None:
        """[batch, seq, dim] as (dp: S(0), tp: S(2)) -> [batch, seq, heads, head_dim]: dim splits by tp only."""
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        x = seeded_randn(2, 3, 8).requires_grad_()
        y = check_against_torch(
            lambda t: t.view(2, 3, 2, 4), x, placements=[[Shard(0), Shard(2)]], mesh=mesh, collectives=0
        )
        self.assertEqual(y.placements, (Shard(0), Shard(2)))

    @with_comms
    def test_a_partial_mesh_dim_does_not_cut_the_shard(self) -> None:
        """(dp: S(0), tp: P(sum)): tp stays partial through the view, so only dp cuts dim 0."""
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        x = seeded_randn(4, 8).requires_grad_()
        y = check_against_torch(
            lambda t: t.view(2, 2, 8), x, placements=[[Shard(0), Partial("sum")]], mesh=mesh, collectives=0
        )
        self.assertEqual(y.placements, (Shard(0), Partial("sum")))
