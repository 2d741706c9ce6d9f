"""Placements are small frozen values with torch.chunk's uneven-shard arithmetic."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from spmd.tensor import Partial, Placement, Replicate, Shard
from spmd.tensor.placement import format_placements, shard_offsets, shard_sizes


@pytest.mark.parametrize("size,n", [(7, 4), (5, 4), (8, 4), (0, 3), (1, 4), (13, 5)])
def test_shard_sizes_match_torch_chunk(size: int, n: int) -> None:
    chunks = [c.shape[0] for c in torch.arange(size).chunk(n)] if size else []
    expected = chunks + [0] * (n - len(chunks))
    assert shard_sizes(size, n) == expected
    assert sum(shard_sizes(size, n)) == size
    assert shard_offsets(size, n) == [sum(expected[:i]) for i in range(n)]


def test_seven_rows_over_four_ranks() -> None:
    assert shard_sizes(7, 4) == [2, 2, 2, 1]


def test_placements_are_hashable_and_compare_by_value() -> None:
    assert Shard(0) == Shard(0) and Shard(0) != Shard(1)
    assert Replicate() == Replicate()
    assert Partial() == Partial("sum") != Partial("max")
    assert len({Shard(0), Shard(0), Replicate(), Partial(), Partial("avg")}) == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        Shard(0).dim = 1  # type: ignore[misc]


def test_short_and_constructible_forms() -> None:
    assert [str(p) for p in (Shard(1), Replicate(), Partial(), Partial("max"))] == ["S(1)", "R", "P(sum)", "P(max)"]
    assert repr(Shard(1)) == "Shard(dim=1)"
    assert eval(repr(Partial("avg"))) == Partial("avg")
    assert format_placements([Shard(0), Replicate()]) == "(S(0), R)"


def test_queries() -> None:
    assert Shard(2).is_shard() and Shard(2).is_shard(2) and not Shard(2).is_shard(1)
    assert Replicate().is_replicate() and not Replicate().is_shard()
    assert Partial("min").is_partial() and Partial("min").is_partial("min") and not Partial("min").is_partial("sum")
    assert all(isinstance(p, Placement) for p in (Shard(0), Replicate(), Partial()))


def test_bad_placements_say_what_is_allowed() -> None:
    with pytest.raises(ValueError, match="use one of sum, avg, min, max, product"):
        Partial("mean")
    with pytest.raises(TypeError, match="int dim"):
        Shard("0")  # type: ignore[arg-type]


@pytest.mark.parametrize("size,n", [(10, 4), (7, 4), (2, 4), (0, 3), (13, 5)])
def test_local_shard_size_and_offset_match_torchs(size: int, n: int) -> None:
    # The reference implementation, by name: an export of these tests must not import it.
    torch_shard = pytest.importorskip("torch.distributed.tensor").Shard

    for rank in range(n):
        expected = torch_shard.local_shard_size_and_offset(size, n, rank)
        assert Shard.local_shard_size_and_offset(size, n, rank) == expected
        assert Shard(0).local_shard_size_and_offset(size, n, rank) == expected


def test_reduce_op_lists_under_torchs_names() -> None:
    assert Partial.LINEAR_REDUCE_OPS == ("sum", "avg")
    assert Partial.ALL_REDUCE_OPS == ("sum", "avg", "min", "max", "product")
    assert [Partial(op).is_linear for op in Partial.ALL_REDUCE_OPS] == [op in ("sum", "avg") for op in Partial.ALL_REDUCE_OPS]
