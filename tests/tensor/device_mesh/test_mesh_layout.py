"""Mesh dims as strided axes over the root mesh's row-major rank list (spmd/tensor/device_mesh/layout.py)."""

from __future__ import annotations

from spmd.tensor.device_mesh.layout import canonical, offsets, overlaps, root_layout, split, without_axes


def test_a_root_mesh_steps_each_dim_by_the_sizes_below_it() -> None:
    dp, tp = root_layout((2, 4))
    assert (dp, tp) == (((2, 4),), ((4, 1),))
    assert offsets(dp) == [0, 4]
    assert offsets(tp) == [0, 1, 2, 3]
    assert without_axes(6, tp) == 4  # rank 6's tp group starts at 4


def test_split_cuts_a_dim_major_first_and_flattening_merges_it_back() -> None:
    (world,) = root_layout((8,))
    pp, dp, tp = split(world, (2, 2, 2)) or ()
    assert (pp, dp, tp) == (((2, 4),), ((2, 2),), ((2, 1),))
    assert canonical(pp + dp + tp) == world
    assert canonical(pp + tp) == ((2, 4), (2, 1))  # a dim skipped in between stays apart
    assert offsets(pp + tp) == [0, 1, 4, 5]
    assert canonical(((1, 8), *dp)) == dp  # size-1 dims hold no ranks


def test_split_falls_on_axis_boundaries_only() -> None:
    a, _, c = root_layout((3, 2, 2))  # a flattened (a, c) dim: axes of sizes 3 and 2, apart
    assert split(a + c, (3, 2)) == (a, c)
    assert split(a + c, (2, 3)) is None
    assert split(a + c, (6, 1)) == (a + c, ((1, 1),))


def test_overlapping_dims_share_an_axis_or_part_of_one() -> None:
    (world,) = root_layout((8,))
    major, minor = split(world, (2, 4)) or ()
    assert not overlaps(major, minor)
    assert overlaps(world, minor)
    assert not overlaps(((1, 8),), world)
