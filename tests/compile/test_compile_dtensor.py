"""torch.compile on DTensors: compiled functions give the eager results, rank by rank.

Every test compiles with ``fullgraph=True`` (no graph break allowed) on the threaded world and
compares with the same function run eagerly or on plain tensors.
"""

from __future__ import annotations

import threading

import torch
from torch._dynamo.backends.common import aot_autograd

from spmd.tensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.testing import run_threaded, seeded_randn


def compiled(fn):
    return torch.compile(fn, backend="aot_eager", fullgraph=True)


class GraphCapture:
    """An aot_eager backend that keeps the code of every forward graph it compiles."""

    def __init__(self) -> None:
        self.codes: list[str] = []

    def backend(self):
        def keep(gm, example_inputs):
            self.codes.append(gm.code)
            return gm

        return aot_autograd(fw_compiler=keep)


def test_pointwise_chain_keeps_shards_and_moves_nothing() -> None:
    full_x, full_y = seeded_randn(8, 4, seed=0), seeded_randn(8, 4, seed=1)

    def fn(x, y):
        return (x * 2 + y).relu().sin()

    def rank():
        mesh = init_device_mesh("cpu", (2,))
        x, y = distribute_tensor(full_x, mesh, [Shard(0)]), distribute_tensor(full_y, mesh, [Shard(0)])
        step = compiled(fn)
        step(x, y)
        with CommDebugMode() as comm:
            out = step(x, y)
        return type(out), out.placements, out.full_tensor(), comm.get_total_counts()

    for kind, placements, full, count in run_threaded(rank, 2):
        assert kind is DTensor and placements == (Shard(0),)
        torch.testing.assert_close(full, fn(full_x, full_y))
        assert count == 0


def test_row_sharded_matmul_all_reduces_inside_the_graph() -> None:
    """R x S(0) gives P(sum); the redistribute to R is an spmd::all_reduce op in the compiled graph."""
    full_x, full_w = seeded_randn(8, 6, seed=0), seeded_randn(6, 4, seed=1)
    capture = GraphCapture()

    def fn(x, w):
        return torch.relu((x @ w).redistribute(placements=[Replicate()]))

    def rank():
        mesh = init_device_mesh("cpu", (2,))
        x, w = distribute_tensor(full_x, mesh, [Replicate()]), distribute_tensor(full_w, mesh, [Shard(0)])
        step = torch.compile(fn, backend=capture.backend(), fullgraph=True)
        step(x, w)
        with CommDebugMode() as comm:
            out = step(x, w)  # counted when the compiled graph runs, as in eager
        return out.placements, out.to_local(), comm.get_comm_counts()

    for placements, local, counts in run_threaded(rank, 2):
        assert placements == (Replicate(),)
        torch.testing.assert_close(local, torch.relu(full_x @ full_w))
        assert dict(counts) == {"all_reduce": 1}
    assert capture.codes and all("torch.ops.spmd.all_reduce.default" in code for code in capture.codes)


def test_backward_through_a_compiled_function_gives_the_eager_gradients() -> None:
    full_x, full_w = seeded_randn(8, 6, seed=0), seeded_randn(6, 4, seed=1)

    def loss_fn(x, w):
        return (x @ w).tanh().sum()

    def grads(step, mesh):
        x = distribute_tensor(full_x, mesh, [Shard(0)]).requires_grad_()
        w = distribute_tensor(full_w, mesh, [Replicate()]).requires_grad_()
        step(x, w).backward()
        return x.grad.placements, x.grad.full_tensor(), w.grad.full_tensor()

    def rank():
        mesh = init_device_mesh("cpu", (2,))
        return grads(compiled(loss_fn), mesh), grads(loss_fn, mesh)

    for got, expected in run_threaded(rank, 2):
        assert got[0] == expected[0]
        torch.testing.assert_close(got[1], expected[1])
        torch.testing.assert_close(got[2], expected[2])


def test_from_local_redistribute_to_local_and_full_tensor_trace_without_graph_breaks() -> None:
    full = torch.arange(24.0).reshape(4, 6)

    def fn(local, mesh):
        x = DTensor.from_local(local, mesh, [Shard(0)])
        by_columns = x.redistribute(placements=[Shard(1)])
        return by_columns.to_local() * 2, x.full_tensor() + 1

    def rank():
        mesh = init_device_mesh("cpu", (2,))
        local = full.chunk(2)[mesh.get_rank()]
        return compiled(fn)(local, mesh), fn(local, mesh)

    for got, expected in run_threaded(rank, 2):
        torch.testing.assert_close(got, expected)


def test_placements_are_constants_traced_code_may_branch_on() -> None:
    def fn(x):
        if x.placements[0].is_shard(0):
            x = x * 10
        kept = [p for p in x.placements if isinstance(p, Shard)]
        return x + len(kept)

    def rank():
        mesh = init_device_mesh("cpu", (2,))
        full = torch.ones(4, 2)
        step = compiled(fn)
        return [step(distribute_tensor(full, mesh, [p])).full_tensor() for p in (Shard(0), Replicate())]

    sharded, replicated = run_threaded(rank, 2)[0]
    torch.testing.assert_close(sharded, torch.full((4, 2), 11.0))
    torch.testing.assert_close(replicated, torch.full((4, 2), 1.0))


def test_each_rank_thread_gets_its_own_graph() -> None:
    """Rank threads share torch.compile's cache, but a graph bakes in its rank's shard: a rank that
    calls later must not reuse another rank's graph (here the Replicate -> Shard(0) chunk)."""
    full = torch.arange(8.0).reshape(4, 2)

    def fn(t, mesh):
        return DTensor.from_local(t, mesh, [Replicate()]).redistribute(placements=[Shard(0)]).to_local() + 0

    step = compiled(fn)
    rank_0_done = threading.Event()

    def rank():
        mesh = init_device_mesh("cpu", (2,))
        if mesh.get_rank() == 1:
            rank_0_done.wait()  # rank 1 calls once rank 0's graph exists
        result = step(full, mesh)
        rank_0_done.set()
        return result

    first, second = run_threaded(rank, 2)
    torch.testing.assert_close(first, full[:2])
    torch.testing.assert_close(second, full[2:])


def test_the_on_disk_cache_key_holds_layout_coordinate_and_groups() -> None:
    """torch.compile's caches may hand a graph to a later process: equal keys mean the same spec,
    the same mesh coordinate, and group handles that name groups of the same ranks."""
    full = seeded_randn(4, 4)

    def keys():
        mesh = init_device_mesh("cpu", (2,))
        rows = distribute_tensor(full, mesh, [Shard(0)])
        return (
            rows._stable_hash_for_caching(),
            distribute_tensor(full, mesh, [Shard(0)])._stable_hash_for_caching(),
            distribute_tensor(full, mesh, [Replicate()])._stable_hash_for_caching(),
            distribute_tensor(full, mesh, [Shard(1)])._stable_hash_for_caching(),
        )

    (rank0, again, replicated, columns), (rank1, *_) = run_threaded(keys, 2)
    assert rank0 == again
    assert len({rank0, replicated, columns, rank1}) == 4
