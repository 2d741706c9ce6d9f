"""Recompiles and errors under torch.compile: a steady loop compiles once, a new placement once more,
and an op without a sharding rule raises the eager ShardingError."""

from __future__ import annotations

import logging

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters, guard_failures

from spmd.tensor import Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.dispatch.dispatcher import replicate_fallback
from spmd.tensor.dtensor import DataDependentShapeError
from spmd.tensor.sharding.registry import REGISTRY
from spmd.tensor.sharding.vocabulary import ShardingError
from spmd.testing import run_threaded


def scaled_sine(x):
    return (x * 2).sin()


def graphs_compiled() -> int:
    return counters["stats"]["unique_graphs"]


def test_a_steady_loop_compiles_once_and_a_new_placement_once_more(caplog: pytest.LogCaptureFixture) -> None:
    torch._dynamo.reset()
    full = torch.arange(8.0).reshape(4, 2)

    def rank():
        mesh = init_device_mesh("cpu", (1,))
        step = torch.compile(scaled_sine, backend="aot_eager", fullgraph=True)
        start = graphs_compiled()
        sharded = distribute_tensor(full, mesh, [Shard(0)])
        for _ in range(5):
            step(sharded)
        after_loop = graphs_compiled() - start
        replicated = distribute_tensor(full, mesh, [Replicate()])
        for _ in range(5):
            out = step(replicated)
        return after_loop, graphs_compiled() - start, out.placements, out.full_tensor()

    guard_failures.clear()
    with caplog.at_level(logging.INFO, logger="spmd.compile"):
        after_loop, after_change, placements, full_out = run_threaded(rank, 1)[0]
    assert (after_loop, after_change) == (1, 2)
    assert placements == (Replicate(),)
    torch.testing.assert_close(full_out, scaled_sine(full))
    # Dynamo's own recompile reason (what TORCH_LOGS=recompiles prints) says what changed, and so
    # does the spmd.compile logger.
    change = "spec f32[4,2] (S(0)) on mesh(d0=1) -> f32[4,2] (R) on mesh(d0=1)"
    reasons = [str(reason) for failures in guard_failures.values() for reason in failures]
    assert any(f"DTensor input differs from the compiled graph's: {change}" in r for r in reasons), reasons
    assert change in caplog.text


def test_an_op_without_a_rule_raises_the_eager_sharding_error() -> None:
    """With graph breaks allowed the op runs eagerly and raises exactly as eager code does; with
    fullgraph=True Dynamo reports it, with the ShardingError as the cause."""

    def rank():
        mesh = init_device_mesh("cpu", (1,))  # one rank: the rule override is process-wide
        x = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
        errors = []
        with REGISTRY.override(torch.ops.aten.sin.default, None), replicate_fallback(False):
            for fullgraph in (None, False, True):
                torch._dynamo.reset()  # each compile starts from an empty cache
                step = (
                    scaled_sine
                    if fullgraph is None
                    else torch.compile(scaled_sine, backend="aot_eager", fullgraph=fullgraph)
                )
                with pytest.raises(Exception) as raised:
                    step(x)
                errors.append(raised.value)
        return errors

    eager, compiled, fullgraph = run_threaded(rank, 1)[0]
    assert type(eager) is ShardingError and "aten.sin.default has no sharding rule" in str(eager)
    assert type(compiled) is ShardingError and str(compiled) == str(eager)
    assert isinstance(fullgraph.__cause__, ShardingError) and str(eager) in str(fullgraph)


def test_a_data_dependent_shape_names_its_op() -> None:
    """nonzero's output shape depends on values: fullgraph=True says so, naming the op; without it,
    torch.compile breaks the graph there and the result is eager's."""

    def positive_positions(x):
        return torch.nonzero(x > 0)

    def rank():
        mesh = init_device_mesh("cpu", (1,))
        x = distribute_tensor(torch.tensor([[1.0, -1.0], [-2.0, 3.0]]), mesh, [Replicate()])
        torch._dynamo.reset()
        with pytest.raises(Exception) as raised:
            torch.compile(positive_positions, backend="aot_eager", fullgraph=True)(x)
        torch._dynamo.reset()
        with_break = torch.compile(positive_positions, backend="aot_eager")(x)
        return raised.value, with_break.full_tensor()

    error, positions = run_threaded(rank, 1)[0]
    assert isinstance(error.__cause__, DataDependentShapeError)
    assert "aten.nonzero.default gives an output whose shape depends on the values" in str(error)
    torch.testing.assert_close(positions, torch.tensor([[0, 0], [1, 1]]))
