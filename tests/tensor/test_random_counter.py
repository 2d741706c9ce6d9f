"""Counter mode: each rank draws only the tiles of its shard, and every layout holds the global
tensor a single device draws from the same stream (``CounterStream``)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import spmd.tensor as st
from spmd.tensor import DeviceMesh, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.tensor.placement import Placement
from spmd.tensor.random import (
    CounterStream,
    drawn_elements,
    get_rng_mode,
    manual_seed,
    rng_mode,
    set_rng_mode,
    tile_shape,
)
from spmd.tensor.spec import local_shape_and_offset
from spmd.testing import run_subtests, run_threaded
from spmd.testing.layouts import seeded_randn

ONE_D: list[tuple[Placement, ...]] = [(Replicate(),), (Shard(0),), (Shard(1),)]
TWO_D: list[tuple[Placement, ...]] = [
    (a, b) for a in (Replicate(), Shard(0), Shard(1)) for b in (Replicate(), Shard(0), Shard(1))
]


def counter_mesh(shape: tuple[int, ...], seed: int) -> DeviceMesh:
    """A mesh whose ranks draw in counter mode from ``seed`` (call on every rank)."""
    mesh = init_device_mesh("cpu", shape)
    manual_seed(seed, mesh)
    set_rng_mode("counter", mesh)
    return mesh


def test_factories_equal_the_single_device_stream_on_every_layout() -> None:
    # (260, 300): 3 x 3 tiles of 128 x 128, uneven edges; (3, 300): an empty shard on 4 ranks.
    shapes = [(260, 300), (3, 300)]

    def check(mesh_shape: tuple[int, ...], shape: tuple[int, ...], placements: tuple[Placement, ...]) -> None:
        if len(placements) != len(mesh_shape):
            return
        mesh = counter_mesh(mesh_shape, seed=7)
        x = st.randn(*shape, device_mesh=mesh, placements=placements)
        u = st.rand(*shape, device_mesh=mesh, placements=placements, dtype=torch.float64)
        stream = CounterStream(7)
        torch.testing.assert_close(x.full_tensor(), stream.randn(*shape), rtol=0, atol=0)
        torch.testing.assert_close(u.full_tensor(), stream.rand(*shape, dtype=torch.float64), rtol=0, atol=0)

    def ranks() -> None:
        run_subtests({"mesh_shape": [(4,)], "shape": shapes, "placements": ONE_D}, check)
        run_subtests({"mesh_shape": [(2, 2)], "shape": shapes, "placements": TWO_D}, check)
        # 3-d: (6, 40, 90) is 1 x 2 x 2 tiles of (6, 32, 64)
        three_d = [(Shard(2),), (Shard(1),), (Shard(0), Shard(2)), (Shard(2), Shard(1)), (Shard(2), Shard(2))]
        run_subtests({"mesh_shape": [(4,), (2, 2)], "shape": [(6, 40, 90)], "placements": three_d}, check)

    run_threaded(ranks, 4)


def test_replicas_agree_and_drawing_needs_no_communication() -> None:
    def ranks() -> torch.Tensor:
        mesh = counter_mesh((2, 2), seed=3)
        with CommDebugMode() as comm:
            x = st.rand(200, 100, device_mesh=mesh, placements=[Replicate(), Replicate()])
            y = st.rand(200, 100, device_mesh=mesh, placements=[Shard(1), Replicate()])
        assert comm.get_total_counts() == 0, "drawing needs no communication"
        return torch.cat([x.to_local().flatten(), y.to_local().flatten()])

    results = run_threaded(ranks, 4)
    stream = CounterStream(3)
    x, y = stream.rand(200, 100), stream.rand(200, 100)
    for rank, local in enumerate(results):
        # mesh [[0, 1], [2, 3]]: ranks 0, 1 hold columns 0-49 of y, ranks 2, 3 columns 50-99
        half = y[:, :50] if rank < 2 else y[:, 50:]
        torch.testing.assert_close(local, torch.cat([x.flatten(), half.flatten()]), rtol=0, atol=0)


def test_successive_draws_differ_and_reseeding_reproduces() -> None:
    def ranks() -> list[torch.Tensor]:
        mesh = counter_mesh((4,), seed=11)
        a = st.randn(64, 64, device_mesh=mesh, placements=[Shard(0)]).full_tensor()
        b = st.randn(64, 64, device_mesh=mesh, placements=[Shard(0)]).full_tensor()
        manual_seed(11, mesh)
        c = st.randn(64, 64, device_mesh=mesh, placements=[Shard(1)]).full_tensor()
        manual_seed(12, mesh)
        d = st.randn(64, 64, device_mesh=mesh, placements=[Shard(0)]).full_tensor()
        return [a, b, c, d]

    for a, b, c, d in run_threaded(ranks, 4):
        assert not torch.equal(a, b), "the stream moves on after each op"
        torch.testing.assert_close(c, a, rtol=0, atol=0)
        assert not torch.equal(d, a), "another seed, another stream"


def test_each_rank_draws_its_shard_not_the_global_tensor() -> None:
    # (1024, 512) is 8 x 4 tiles of 128 x 128: an even shard draws exactly its own elements.
    even, uneven = (1024, 512), (1000, 500)
    assert tile_shape(even) == (128, 128)

    def drawn(mesh: DeviceMesh, shape: tuple[int, int], placements: list[Placement]) -> tuple[int, int]:
        before = drawn_elements(mesh)
        st.randn(*shape, device_mesh=mesh, placements=placements)
        local, _ = local_shape_and_offset(shape, mesh, placements)
        return drawn_elements(mesh) - before, math.prod(local)

    def ranks() -> None:
        mesh = counter_mesh((4,), seed=0)
        mesh_2d = init_device_mesh("cpu", (2, 2))
        set_rng_mode("counter", mesh_2d)  # same world: the same stream and counter
        for placements, m in [([Shard(0)], mesh), ([Shard(1)], mesh), ([Shard(0), Shard(1)], mesh_2d)]:
            count, local = drawn(m, even, placements)
            assert count == local, (placements, count, local)
        for placements in ([Shard(0)], [Shard(1)]):
            count, local = drawn(mesh, uneven, placements)
            # whole tiles of 128 along the sharded dim: a shard of 125 or 250 draws at most 3x
            assert local <= count <= 3 * local < math.prod(uneven), (placements, count, local)
        with rng_mode("torch", mesh):
            count, local = drawn(mesh, even, [Shard(0)])
            assert count == math.prod(even), "torch mode draws the global tensor on every rank"
        x = distribute_tensor(torch.zeros(even), mesh, [Shard(1)])
        before = drawn_elements(mesh)
        F.dropout(x, p=0.3, training=True)
        x.normal_()
        assert drawn_elements(mesh) - before == 2 * x.to_local().numel()

    run_threaded(ranks, 4)


def test_in_place_fills_like_ops_and_partials() -> None:
    def ranks() -> list[torch.Tensor]:
        mesh = counter_mesh((4,), seed=3)
        x = distribute_tensor(torch.zeros(9, 5), mesh, [Shard(0)])
        x.uniform_(-2, 2)
        y = torch.randn_like(x)
        z = torch.rand_like(distribute_tensor(torch.zeros(6, 10), mesh, [Shard(1)]))
        p = distribute_tensor(torch.zeros(4, 4), mesh, [Partial()])
        p.normal_()
        k = torch.randint_like(x, -3, 3, dtype=torch.int64)
        assert x.placements == (Shard(0),) and y.placements == (Shard(0),) and p.placements == (Partial(),)
        return [x.full_tensor(), y.full_tensor(), z.full_tensor(), p.full_tensor(), k.full_tensor()]

    stream = CounterStream(3)
    expected = [
        stream.draw((9, 5), "uniform_", -2, 2),
        stream.randn(9, 5),
        stream.rand(6, 10),
        stream.randn(4, 4),
        stream.draw((9, 5), "random_", -3, 3, dtype=torch.int64),
    ]
    for per_rank in run_threaded(ranks, 4):
        for got, want in zip(per_rank, expected):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_dropout_matches_the_stream_forward_and_backward() -> None:
    full = seeded_randn(40, 36, seed=1)
    layouts: list[tuple[tuple[int, ...], list[Placement]]] = [
        ((4,), [Shard(0)]),
        ((4,), [Shard(1)]),
        ((4,), [Replicate()]),
        ((2, 2), [Shard(0), Shard(1)]),
        ((2, 2), [Shard(1), Shard(1)]),
    ]

    def ranks() -> list[tuple[torch.Tensor, torch.Tensor]]:
        results = []
        for mesh_shape, placements in layouts:
            mesh = counter_mesh(mesh_shape, seed=5)
            x = distribute_tensor(full, mesh, placements).requires_grad_()
            out = F.dropout(x, p=0.4, training=True)
            assert out.placements == tuple(placements)
            out.full_tensor().sum().backward()
            results.append((out.full_tensor(), x.grad.full_tensor()))
        return results

    mask = CounterStream(5).draw((40, 36), "bernoulli_", 0.6)
    for per_rank in run_threaded(ranks, 4):
        for out, grad in per_rank:
            torch.testing.assert_close(out, full * mask / 0.6)
            torch.testing.assert_close(grad, mask / 0.6)


def test_dropout_of_a_partial_stays_partial_with_a_replicated_mask() -> None:
    full = seeded_randn(40, 36, seed=2)

    def ranks() -> torch.Tensor:
        mesh = counter_mesh((4,), seed=6)
        out = F.dropout(distribute_tensor(full, mesh, [Partial()]), p=0.5, training=True)
        assert out.placements == (Partial(),)
        return out.full_tensor()

    mask = CounterStream(6).draw((40, 36), "bernoulli_", 0.5)
    for out in run_threaded(ranks, 4):
        torch.testing.assert_close(out, full * mask * 2)


def test_process_default_mode_applies_to_every_rank() -> None:
    def ranks() -> torch.Tensor:
        mesh = init_device_mesh("cpu", (4,))
        manual_seed(2, mesh)
        assert get_rng_mode(mesh) == "counter"
        return st.rand(70, 50, device_mesh=mesh, placements=[Shard(1)]).full_tensor()

    assert get_rng_mode() == "torch", "torch mode is the default"
    with rng_mode("counter"):
        results = run_threaded(ranks, 4)
    assert get_rng_mode() == "torch"
    expected = CounterStream(2).rand(70, 50)
    for got in results:
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_the_stream_is_a_fixed_function_of_seed_and_position() -> None:
    stream = CounterStream(0)
    first = stream.rand(3)
    assert torch.equal(CounterStream(0).rand(3), first)
    assert stream.offset == 3 and not torch.equal(stream.rand(3), first)
    assert tile_shape((4096, 4096)) == (128, 128) and tile_shape((7, 6)) == (7, 6)
    assert tile_shape((8, 2048, 4096)) == (8, 32, 64) and tile_shape((6, 40, 90)) == (6, 32, 64)


def test_an_unknown_mode_says_which_exist() -> None:
    with pytest.raises(ValueError, match=r"'torch'.*'counter'"):
        set_rng_mode("philox")  # type: ignore[arg-type]
