"""torch's placement API that real code calls: product partials, Shard._split_tensor and friends.

Each test compares with plain torch: a product partial's global value is the product of the
ranks' local tensors, and ``Shard._split_tensor`` cuts the way ``torch.chunk`` does.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from spmd.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.testing import DTensorTestBase, run_subtests, seeded_randn, with_comms

PRODUCT = Partial("product")


def factor(rank: int, *shape: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Rank ``rank``'s factor of a product partial: values near 1 (floats) or in 1..3 (integers)."""
    if dtype.is_floating_point:
        return 1 + 0.2 * seeded_randn(*shape, seed=rank, dtype=dtype)
    return (torch.arange(torch.Size(shape).numel()).reshape(shape) + rank) % 3 + 1


def product_of_factors(world_size: int, *shape: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The plain-torch value of a product partial whose rank ``r`` holds ``factor(r, ...)``."""
    return torch.stack([factor(r, *shape, dtype=dtype) for r in range(world_size)]).prod(0, dtype=dtype)


# ----- the placement values --------------------------------------------------------------------------
def test_prod_is_read_as_product() -> None:
    assert Partial("prod") == PRODUCT
    assert Partial("prod").reduce_op == "product"
    assert repr(Partial("prod")) == "Partial(reduce_op='product')" and str(PRODUCT) == "P(product)"
    assert "product" in Partial.ALL_REDUCE_OPS and not PRODUCT.is_linear
    assert PRODUCT.is_partial("prod") and PRODUCT.is_partial("product") and not PRODUCT.is_partial("sum")
    assert pickle.loads(pickle.dumps(Partial("prod"))) == PRODUCT
    assert copy.deepcopy(PRODUCT) == PRODUCT


def test_unknown_reduce_op_names_the_accepted_ones() -> None:
    with pytest.raises(ValueError, match="use one of sum, avg, min, max, product"):
        Partial("mul")


# ----- Shard._split_tensor / _select_split_tensor ------------------------------------------------
@pytest.mark.parametrize("size,n", [(16, 4), (17, 4), (7, 4), (5, 4), (3, 4), (1, 4), (0, 3), (8, 1), (8, 16)])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_split_tensor_cuts_like_torch_chunk(size: int, n: int, dim: int) -> None:
    tensor = torch.arange(3 * size).reshape(3, size) if dim != 0 else torch.arange(size * 3).reshape(size, 3)
    along = dim % 2
    chunks = list(torch.chunk(tensor, n, along)) if size else []
    empty = tensor.narrow(along, size, 0)
    expected = chunks + [empty] * (n - len(chunks))

    pieces, pads = Shard(dim)._split_tensor(tensor, n, with_padding=False)
    assert pads == []
    assert [p.shape for p in pieces] == [e.shape for e in expected]
    assert all(torch.equal(p, e) and p.is_contiguous() for p, e in zip(pieces, expected))

    padded, pads = Shard(dim)._split_tensor(tensor, n)  # torch's default pads
    longest = expected[0].size(along)
    assert pads == [longest - e.size(along) for e in expected]
    for piece, unpadded, pad in zip(padded, expected, pads):
        assert piece.size(along) == longest
        assert torch.equal(piece.narrow(along, 0, longest - pad), unpadded)
        assert not piece.narrow(along, longest - pad, pad).any()

    for index in range(n):
        for with_padding in (False, True):
            whole, _ = Shard(dim)._split_tensor(tensor, n, with_padding=with_padding, contiguous=False)
            selected = Shard(dim)._select_split_tensor(tensor, n, index, with_padding=with_padding)
            assert torch.equal(selected, whole[index])


@pytest.mark.parametrize("size,n", [(16, 4), (17, 4), (6, 4), (5, 4), (1, 4), (0, 3), (8, 16)])
def test_split_tensor_matches_torchs(size: int, n: int) -> None:
    # The reference implementation, by name: an export of these tests must not import it.
    torch_shard = pytest.importorskip("torch.distributed.tensor").Shard
    tensor = torch.arange(2 * size).reshape(2, size)
    for with_padding, contiguous in [(False, False), (False, True), (True, True)]:
        options = {"with_padding": with_padding, "contiguous": contiguous}
        want, want_pads = torch_shard(1)._split_tensor(tensor, n, **options)
        got, got_pads = Shard(1)._split_tensor(tensor, n, **options)
        assert got_pads == want_pads
        assert [g.shape for g in got] == [w.shape for w in want]
        assert all(torch.equal(g, w) and g.is_contiguous() == w.is_contiguous() for g, w in zip(got, want))
        for index in range(n):
            want_one = torch_shard(1)._select_split_tensor(tensor, n, index, **options)
            assert torch.equal(Shard(1)._select_split_tensor(tensor, n, index, **options), want_one)


def test_split_tensor_views_and_copies() -> None:
    tensor = torch.arange(24).reshape(4, 6)

    def shares_memory(piece: torch.Tensor) -> bool:
        return piece.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()

    views, _ = Shard(1)._split_tensor(tensor, 2, with_padding=False, contiguous=False)
    assert shares_memory(views[1]) and not views[1].is_contiguous()
    view = Shard(1)._select_split_tensor(tensor, 2, 1, with_padding=False, contiguous=False, clone=False)
    assert shares_memory(view) and torch.equal(view, tensor[:, 3:])
    contiguous = Shard(1)._select_split_tensor(tensor, 2, 1, with_padding=False, clone=False)
    assert contiguous.is_contiguous() and torch.equal(contiguous, tensor[:, 3:])
    assert not shares_memory(Shard(1)._select_split_tensor(tensor, 2, 1))  # clone=True: a copy
    assert shares_memory(Shard(0)._select_split_tensor(tensor, 2, 1, clone=False))  # already contiguous
    assert torch.equal(Shard(0)._select_split_tensor(tensor, 4, -1), tensor[3:])


def test_split_tensor_rejects_what_it_cannot_cut() -> None:
    with pytest.raises(ValueError, match="S\\(2\\) is out of range for a 2-d tensor"):
        Shard(2)._split_tensor(torch.zeros(2, 2), 2)
    with pytest.raises(IndexError, match="piece 4 is out of range for 4 pieces"):
        Shard(0)._select_split_tensor(torch.zeros(8), 4, 4)
    with pytest.raises(ValueError, match="mesh dimension must be >= 1"):
        Shard(0)._split_tensor(torch.zeros(8), 0)


def test_local_shard_size_and_offset_on_an_instance() -> None:
    assert [Shard(0)._local_shard_size_and_offset(5, 4, r) for r in range(4)] == [(2, 0), (2, 2), (1, 4), (0, 5)]


# ----- on a threaded world ---------------------------------------------------------------------------
class ProductPartialTest(DTensorTestBase):
    world_size = 4

    @with_comms
    def test_product_partial_reduces_by_multiplying(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        run_subtests(
            {
                "dtype": [torch.float64, torch.int64],
                "target": [Replicate(), Shard(0), Shard(1)],
                "shape": [(8, 4), (7, 5)],
            },
            self._reduce_product,
            mesh,
        )

    def _reduce_product(self, mesh, dtype, target, shape) -> None:
        x = DTensor.from_local(factor(self.rank, *shape, dtype=dtype), mesh, [PRODUCT])
        expected = product_of_factors(4, *shape, dtype=dtype)
        with CommDebugMode() as comm:
            y = x.redistribute(mesh, [target])
        self.assertEqual(comm.get_comm_counts(), {"all_reduce" if target == Replicate() else "reduce_scatter": 1})
        self.assertEqual(y.placements, (target,))
        self.assertEqual(y.dtype, dtype)
        torch.testing.assert_close(y.full_tensor(), expected)

    @with_comms
    def test_product_partial_on_a_2d_mesh(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        coordinate = mesh.get_coordinate()
        local = factor(coordinate[1], 4, 6)  # varies along the product dim only
        x = DTensor.from_local(local, mesh, [Shard(0), PRODUCT])
        # [S(0), P(product)]: rows stacked over mesh dim 0, multiplied over mesh dim 1
        expected = torch.cat([product_of_factors(2, 4, 6)] * 2)
        torch.testing.assert_close(x.full_tensor(), expected)
        torch.testing.assert_close(x.redistribute(mesh, [Replicate(), Shard(1)]).full_tensor(), expected)
        # S -> R on mesh dim 0 keeps the pending product ("prod" is the same placement)
        kept = x.redistribute(mesh, [Replicate(), Partial("prod")])
        self.assertEqual(kept.placements, (Replicate(), PRODUCT))
        torch.testing.assert_close(kept.full_tensor(), expected)

    @with_comms
    def test_laying_out_as_a_product_partial_moves_no_data(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        full = seeded_randn(7, 3, dtype=torch.float64)
        for src in ([Replicate()], [Shard(0)], [Shard(1)]):
            x = distribute_tensor(full, mesh, src)
            with CommDebugMode() as comm:
                partial = x.redistribute(mesh, [PRODUCT])
            self.assertEqual(comm.get_total_counts(), 0, f"{src} -> P(product)")
            # the value sits on one rank (or one block per rank) and ones fill the rest: exact
            self.assertTrue(torch.equal(partial.full_tensor(), full), f"{src} -> P(product)")
        self.assertTrue(torch.equal(distribute_tensor(full, mesh, [PRODUCT]).full_tensor(), full))

    @with_comms
    def test_split_of_a_product_partial(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x = DTensor.from_local(factor(self.rank, 8, 8), mesh, [PRODUCT])
        expected = torch.split(product_of_factors(4, 8, 8), 3, dim=1)
        got = torch.split(x, 3, dim=1)
        self.assertEqual(len(got), len(expected))
        for piece, want in zip(got, expected):
            torch.testing.assert_close(piece.full_tensor(), want)

    @with_comms
    def test_from_local_of_split_tensor_pieces(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        full = seeded_randn(5, 2)  # 5 rows over 4 ranks: 2, 2, 1, 0
        pieces, _ = Shard(0)._split_tensor(full, mesh.size(0), with_padding=False)
        x = DTensor.from_local(pieces[self.rank], mesh, [Shard(0)], shape=full.shape, stride=full.stride())
        self.assertEqual((x.shape, x.stride()), (full.shape, full.stride()))
        self.assertTrue(torch.equal(x.full_tensor(), full))


# ----- on gloo processes -----------------------------------------------------------------------------
def product_on_2_ranks() -> None:
    mesh = init_device_mesh("cpu", (2,))
    assert isinstance(mesh.get_group(), dist.ProcessGroup)  # a c10d group on rank threads too
    for dtype in (torch.float64, torch.int64):
        x = DTensor.from_local(factor(dist.get_rank(), 5, 3, dtype=dtype), mesh, [PRODUCT])
        expected = product_of_factors(2, 5, 3, dtype=dtype)
        for target in (Replicate(), Shard(0), Shard(1)):
            torch.testing.assert_close(x.redistribute(mesh, [target]).full_tensor(), expected)


def test_product_partial_redistributes_to_every_placement(world: Callable[..., list[Any]]) -> None:
    world(product_on_2_ranks, 2)  # each rank asserts its values
