"""Replica checks under SPMD_DEBUG=check: a Replicate claim that enters from local code is compared across ranks."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from spmd.comm.replicas import ReplicaMismatchError
from spmd.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CollectiveMismatchError, check_collectives
from spmd.testing import run_threaded


def _error_of(fn: Any) -> str:
    try:
        fn()
    except ReplicaMismatchError as error:
        return str(error)
    return "no error"


def _same_on_every_rank(messages: list[str]) -> str:
    assert [m.split(": ", 1)[0] for m in messages] == [f"rank {r}" for r in range(len(messages))], messages
    assert len({m.split(": ", 1)[1] for m in messages}) == 1, "every rank raises the same error"
    return messages[0]


def test_a_replica_mismatch_is_a_collective_mismatch() -> None:
    assert issubclass(ReplicaMismatchError, CollectiveMismatchError)


# ----- forward: from_local(..., Replicate) -------------------------------------------------------
def from_local_differing_on_rank_3() -> tuple[str, float]:
    """The error, and the seconds it took to come (the world's timeout is 30 s)."""
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    bias = torch.ones(3) * (2.0 if mesh.get_rank() == 3 else 1.0)
    start = time.monotonic()
    with check_collectives():
        message = _error_of(lambda: DTensor.from_local(bias, mesh, [Replicate()]))
    return message, time.monotonic() - start


def test_from_local_with_values_that_differ_raises_on_every_rank(world: Callable[..., list[Any]]) -> None:
    messages, seconds = zip(*world(from_local_differing_on_rank_3, 4, timeout=30), strict=True)
    message = _same_on_every_rank(list(messages))
    assert max(seconds) < 10
    assert (
        "replica check: the local tensor passed to DTensor.from_local of bias at tests/tensor/debug/test_replica_check.py:"
        in message
    )
    assert "claims Replicate on mesh dim 'tp' (ranks [0, 1, 2, 3])" in message
    assert "ranks [3] differ from ranks [0, 1, 2]" in message
    assert "run_check=True" in message and "Partial()" in message and "all_reduce" in message


def test_from_local_compares_only_the_replicated_mesh_dims() -> None:
    def build() -> str:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp, tp = mesh.get_coordinate()
        # rows differ along dp (Shard(0) there), equal along tp (Replicate there)
        local = torch.full((2, 4), float(dp))
        with check_collectives():
            x = DTensor.from_local(local, mesh, [Shard(0), Replicate()])
            ok = x.full_tensor()
            wrong = _error_of(lambda: DTensor.from_local(local + tp, mesh, [Shard(0), Replicate()]))
        assert torch.equal(ok, torch.tensor([[0.0] * 4] * 2 + [[1.0] * 4] * 2))
        return wrong

    messages = run_threaded(build, 4, timeout=30)
    # each tp group raises on its own: ranks [0, 1] and ranks [2, 3]
    assert "claims Replicate on mesh dim 'tp' (ranks [0, 1])" in messages[0]
    assert "claims Replicate on mesh dim 'tp' (ranks [2, 3])" in messages[2]
    assert "ranks [1] differ from ranks [0]" in messages[0]


def test_a_permutation_of_the_same_values_is_caught() -> None:
    def permuted() -> str:
        mesh = init_device_mesh("cpu", (2,))
        values = torch.arange(6.0)
        if mesh.get_rank() == 1:
            values = values.flip(0)
        with check_collectives():
            return _error_of(lambda: DTensor.from_local(values, mesh, [Replicate()]))

    assert "ranks [1] differ from ranks [0]" in run_threaded(permuted, 2)[0]


def test_equal_values_pass_and_cost_nothing_without_the_check() -> None:
    def build(checked: bool) -> torch.Tensor:
        mesh = init_device_mesh("cpu", (2,))
        local = torch.arange(4.0) * 1.5
        if checked:
            with check_collectives():
                return DTensor.from_local(local, mesh, [Replicate()]).full_tensor()
        # unchecked, different values are accepted silently: that is what the check is for
        return DTensor.from_local(local + mesh.get_rank(), mesh, [Replicate()]).to_local()

    assert all(torch.equal(r, torch.arange(4.0) * 1.5) for r in run_threaded(build, 2, True))
    unchecked = run_threaded(build, 2, False)
    assert not torch.equal(unchecked[0], unchecked[1])


# ----- backward: the gradient arriving at to_local() / from_local ---------------------------------
class LocalLinear(nn.Module):
    """A replicated weight used through to_local() with the rank's own inputs."""

    def __init__(self, mesh: Any, grad_placements: Any = None) -> None:
        super().__init__()
        weight = torch.arange(12.0).reshape(3, 4) / 10
        self.weight = nn.Parameter(distribute_tensor(weight, mesh, [Replicate()]))
        self.grad_placements = grad_placements

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.to_local(grad_placements=self.grad_placements).t()


def local_linear_backward(grad_placements: Any, world_size: int = 2) -> str | torch.Tensor:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    model = LocalLinear(mesh, grad_placements)
    x = torch.ones(2, 4) * (mesh.get_rank() + 1)  # each rank its own batch
    with check_collectives():
        loss = model(x).sum()
        message = _error_of(loss.backward)
    if message != "no error":
        return message
    grad = model.weight.grad
    assert isinstance(grad, DTensor)
    return grad.full_tensor()


def test_a_rank_dependent_gradient_of_a_replicated_weight_raises(world: Callable[..., list[Any]]) -> None:
    message = _same_on_every_rank(world(local_linear_backward, 4, None, 4, timeout=30))
    assert (
        "replica check: the gradient arriving at the backward of to_local() of LocalLinear.weight at "
        "tests/tensor/debug/test_replica_check.py:"
    ) in message
    assert "claims Replicate on mesh dim 'tp' (ranks [0, 1, 2, 3])" in message
    assert "ranks [1, 2, 3] differ from ranks [0]" in message
    assert "grad_placements=[Partial()]" in message


def test_grad_placements_partial_sums_the_gradients_and_passes() -> None:
    grads = run_threaded(local_linear_backward, 2, [Partial()], timeout=30)
    # d(sum(x @ W.t()))/dW = sum over rows of x, per output row: (2 * 1 + 2 * 2) * ones
    for grad in grads:
        torch.testing.assert_close(grad, torch.full((3, 4), 6.0))


def test_the_gradient_arriving_at_from_local_is_compared() -> None:
    def backward() -> str:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        x = torch.ones(3, requires_grad=True)
        y = DTensor.from_local(x, mesh, [Replicate()])
        # a factor that differs per rank but claims Replicate, made without the check looking
        scale = DTensor.from_local(torch.full((3,), mesh.get_rank() + 1.0), mesh, [Replicate()])
        loss = (y * scale).sum()
        with check_collectives():
            return _error_of(loss.backward)

    message = _same_on_every_rank(run_threaded(backward, 2, timeout=30))
    assert "the gradient arriving at the backward of DTensor.from_local claims Replicate on mesh dim 'tp'" in message
