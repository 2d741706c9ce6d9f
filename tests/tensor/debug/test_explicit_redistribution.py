"""explicit_redistribution(): every collective that moves a tensor is one the program wrote.

An op that would move an input between ranks on its own raises, naming the op, the placements,
the collective and the redistribute line to write; with that line written the program runs and
equals plain torch. Moves the program asks for (redistribute, full_tensor, from_local/to_local,
the parallel styles) stay allowed, forward and backward.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from spmd.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import (
    CommDebugMode,
    ExplicitRedistributionError,
    explicit_redistribution,
    is_explicit_redistribution,
    set_explicit_redistribution,
)
from spmd.tensor.debug.environment import configure_from_environment
from spmd.tensor.sharding.registry import REGISTRY
from spmd.tensor_parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from spmd.testing import assert_same_grads, load_script, run_threaded, seeded_module
from spmd.testing import seeded_randn as randn

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def mode_off_after() -> Iterator[None]:
    yield
    set_explicit_redistribution(False)
    assert not is_explicit_redistribution()


def error_of(fn) -> str:  # type: ignore[no-untyped-def]
    """The ExplicitRedistributionError message ``fn()`` raises."""
    with pytest.raises(ExplicitRedistributionError) as info:
        fn()
    return str(info.value)


def add_sharded_bias() -> str:
    """A batch-sharded activation plus a bias sharded along its only dim: the bias must be gathered."""
    mesh = init_device_mesh("cpu", (4,))
    x = distribute_tensor(randn(8, 6, seed=1), mesh, [Shard(0)])
    bias = distribute_tensor(randn(6, seed=2), mesh, [Shard(0)])
    return error_of(lambda: x + bias)


def test_an_implicit_move_raises_naming_op_placements_collective_and_fix() -> None:
    with explicit_redistribution():
        messages = run_threaded(add_sharded_bias, 4)
    assert len(set(messages)) == 1  # every rank raises, the same error, before any collective
    message = messages[0]
    assert message.startswith("aten.add.Tensor would redistribute its inputs implicitly")
    assert "input 1 (other): f32[6] (S(0)) on mesh(d0=4) -> (R)" in message
    assert "mesh dim 0: S(0) -> R  all_gather(dim=0)" in message
    assert "other = other.redistribute(mesh, [Replicate()])" in message


def test_with_the_redistribute_written_the_program_runs_and_equals_torch() -> None:
    x_full, bias_full = randn(8, 6, seed=1), randn(6, seed=2)

    def program() -> None:
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(x_full, mesh, [Shard(0)]).requires_grad_()
        bias = distribute_tensor(bias_full, mesh, [Shard(0)]).requires_grad_()
        with CommDebugMode() as comm:
            y = x + bias.redistribute(mesh, [Replicate()])  # the line the error asked for
            loss = (y * y).sum()
            loss.backward()  # bias's gradient goes back through the user's redistribute: allowed
        x_ref, bias_ref = x_full.clone().requires_grad_(), bias_full.clone().requires_grad_()
        ((x_ref + bias_ref) ** 2).sum().backward()
        torch.testing.assert_close(loss.full_tensor(), ((x_full + bias_full) ** 2).sum())
        torch.testing.assert_close(x.grad.full_tensor(), x_ref.grad)
        torch.testing.assert_close(bias.grad.full_tensor(), bias_ref.grad)
        # the forward's all_gather of the bias and its gradient's reduce_scatter back: both written
        assert comm.get_comm_counts()["all_gather"] >= 1

    with explicit_redistribution():
        run_threaded(program, 4)


def test_without_the_mode_the_same_move_is_made_silently() -> None:
    def program() -> None:
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(randn(8, 6, seed=1), mesh, [Shard(0)])
        bias = distribute_tensor(randn(6, seed=2), mesh, [Shard(0)])
        torch.testing.assert_close((x + bias).full_tensor(), randn(8, 6, seed=1) + randn(6, seed=2))

    assert not is_explicit_redistribution()
    run_threaded(program, 4)
    with explicit_redistribution(), explicit_redistribution():  # blocks nest
        assert is_explicit_redistribution()
    assert not is_explicit_redistribution()
    run_threaded(program, 4)


def test_moves_the_program_asks_for_are_allowed() -> None:
    full = randn(8, 6, seed=3)

    def program() -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        x = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
        torch.testing.assert_close(x.full_tensor(), full)
        y = x.redistribute(mesh, [Replicate(), Shard(0)])
        torch.testing.assert_close(y.full_tensor(), full)
        partial = DTensor.from_local(torch.ones(2, 3), mesh, [Partial(), Replicate()], run_check=False)
        torch.testing.assert_close(
            partial.redistribute(mesh, [Replicate(), Replicate()]).to_local(), 2 * torch.ones(2, 3)
        )
        # an R -> S input change cuts locally and sends nothing: not a move between ranks
        replicated = distribute_tensor(full, mesh, [Replicate(), Replicate()])
        torch.testing.assert_close((x + replicated).full_tensor(), 2 * full)

    with explicit_redistribution():
        run_threaded(program, 4)


def test_list_ops_name_the_list_position_that_would_move() -> None:
    def program() -> str:
        mesh = init_device_mesh("cpu", (4,))
        params = [distribute_tensor(randn(8, 4, seed=k), mesh, [Shard(0)]) for k in range(2)]
        grads = [
            distribute_tensor(randn(8, 4, seed=5), mesh, [Shard(0)]),
            distribute_tensor(randn(8, 4, seed=6), mesh, [Shard(1)]),
        ]
        message = error_of(lambda: torch._foreach_add_(params, grads))
        torch._foreach_add_(params, [grads[0], grads[1].redistribute(mesh, [Shard(0)])])  # written: runs
        torch.testing.assert_close(params[1].full_tensor(), randn(8, 4, seed=1) + randn(8, 4, seed=6))
        return message

    with explicit_redistribution():
        message = run_threaded(program, 4)[0]
    assert message.startswith("aten._foreach_add_.List would redistribute its inputs implicitly")
    assert "(other[1]): f32[8,4] (S(1)) on mesh(d0=4) -> (S(0))" in message
    assert "all_to_all(S(1) -> S(0))" in message
    assert "other[1] = other[1].redistribute(mesh, [Shard(0)])" in message


def test_an_optimizer_step_on_matching_gradients_runs() -> None:
    def program() -> None:
        mesh = init_device_mesh("cpu", (4,))
        reference = seeded_module(nn.Linear(6, 8), seed=4)
        model = copy.deepcopy(reference)
        for name, param in list(model.named_parameters()):
            setattr(model, name, nn.Parameter(distribute_tensor(param.detach(), mesh, [Shard(0)])))
        x = randn(3, 6, seed=7)
        for module, inputs, foreach in (
            (model, distribute_tensor(x, mesh, [Replicate()]), True),
            (reference, x, False),
        ):
            optimizer = torch.optim.AdamW(module.parameters(), lr=0.1, foreach=foreach)
            module(inputs).sum().backward()
            optimizer.step()
        assert_same_grads(model, reference)
        torch.testing.assert_close(model.weight.full_tensor(), reference.weight)

    with explicit_redistribution():
        run_threaded(program, 4)


@pytest.mark.parametrize(
    ("options", "op", "argument"),
    [
        ({"foreach": True}, "aten._foreach_lerp_.Scalar", "tensors1[0]"),
        ({"fused": True}, "aten._fused_adamw_.default", "grads[0]"),
        ({"foreach": False}, "aten.lerp_.Scalar", "end"),
    ],
    ids=["foreach", "fused", "for-loop"],
)
def test_an_optimizer_step_on_a_partial_gradient_raises_until_it_is_reduced(
    options: dict[str, bool], op: str, argument: str
) -> None:
    """A Partial(sum) gradient (a dp-sharded batch's) would be all-reduced inside the optimizer's ops."""
    weight = randn(8, 4, seed=12)
    reference = nn.Parameter(weight.clone())
    reference.grad = torch.full((8, 4), 1.0)
    torch.optim.AdamW([reference], lr=0.1, foreach=False).step()

    def program() -> str:
        mesh = init_device_mesh("cpu", (4,))
        grad = DTensor.from_local(torch.full((8, 4), 0.25), mesh, [Partial()], run_check=False)
        param = nn.Parameter(distribute_tensor(weight, mesh, [Replicate()]))
        param.grad = grad
        message = error_of(torch.optim.AdamW([param], lr=0.1, **options).step)
        # (the refused step may have begun: weight decay ran before the op that raised)
        param = nn.Parameter(distribute_tensor(weight, mesh, [Replicate()]))
        param.grad = grad.redistribute(mesh, [Replicate()])  # reduced once, in the program
        torch.optim.AdamW([param], lr=0.1, **options).step()
        torch.testing.assert_close(param.full_tensor(), reference.detach())
        return message

    with explicit_redistribution():
        message = run_threaded(program, 4)[0]
    assert message.startswith(f"{op} would redistribute its inputs implicitly")
    assert f"({argument}): f32[8,4] (P(sum)) on mesh(d0=4) -> (R)" in message
    assert "mesh dim 0: P(sum) -> R  all_reduce(sum)" in message


def test_a_tensor_parallel_mlp_trains_under_the_mode() -> None:
    def program() -> None:
        mesh = init_device_mesh("cpu", (4,))
        reference = seeded_module(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 6)), seed=8)
        model = parallelize_module(copy.deepcopy(reference), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        x = randn(5, 6, seed=9)
        with explicit_redistribution():  # the styles' own input and output moves are written by them
            out = model(x)
            out.sum().backward()
        expected = reference(x)
        expected.sum().backward()
        torch.testing.assert_close(out, expected)
        assert_same_grads(model, reference)

    run_threaded(program, 4)


def test_the_demo_transformer_with_sequence_parallelism_trains_under_the_mode() -> None:
    """dp x tp with sequence parallelism: every move, forward and backward, is a style's redistribute."""
    demo = load_script(Path(__file__).resolve().parents[3] / "examples" / "train_transformer.py")
    cfg = demo.Config(steps=2, sequence_parallel=True)
    with explicit_redistribution():
        per_rank = run_threaded(demo.train, cfg.dp * cfg.tp, cfg)
    torch.testing.assert_close(
        torch.tensor(per_rank[0]), torch.tensor(demo.train_single_device(cfg)), rtol=1e-4, atol=1e-6
    )


def test_an_op_without_rule_raises_instead_of_gathering() -> None:
    full = randn(8, 6, seed=10)

    def program() -> str:
        mesh = init_device_mesh("cpu", (2, 2))
        x = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
        message = error_of(lambda: torch.sin(x))
        # written out, the fallback has nothing left to gather and runs
        whole = x.redistribute(mesh, [Replicate(), Replicate()])
        torch.testing.assert_close(torch.sin(whole).full_tensor(), torch.sin(full))
        return message

    with REGISTRY.override(aten.sin.default, None), explicit_redistribution():
        message = run_threaded(program, 4)[0]
    assert message.startswith("aten.sin.default has no sharding rule, and the replicate fallback would gather")
    assert "input 0 (self): f32[8,6] (S(0), S(1)) on mesh(d0=2, d1=2) -> (R, R)" in message
    assert "all_gather(dim=0)" in message and "all_gather(dim=1)" in message
    assert "self = self.redistribute(mesh, [Replicate(), Replicate()])" in message


def test_a_move_that_an_ops_backward_needs_raises_in_backward() -> None:
    full = randn(8, 6, seed=11)

    def program() -> str:
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(full, mesh, [Shard(0)]).requires_grad_()
        y = torch.sin(x)  # sin has its rule; its backward's cos(x) has none here and would gather x
        return error_of(lambda: y.sum().backward())

    with REGISTRY.override(aten.cos.default, None), explicit_redistribution():
        message = run_threaded(program, 4)[0]
    assert message.startswith("aten.cos.default has no sharding rule")
    assert "This op runs in backward" in message


def test_spmd_debug_explicit_turns_the_mode_on_for_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPMD_DEBUG", "explicit")
    configure_from_environment()
    assert is_explicit_redistribution()
    messages = run_threaded(add_sharded_bias, 4)
    assert "other = other.redistribute(mesh, [Replicate()])" in messages[0]
