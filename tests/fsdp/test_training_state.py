"""fully_shard names the phase each group is in, as FSDP2's ``TrainingState``: IDLE -> FORWARD -> IDLE
after forward, PRE_BACKWARD once backward reaches the group (its gathered copies shadow the shards),
IDLE again when the backward pass ends (a checkpointed block's recompute included)."""

from __future__ import annotations

import torch
from test_fully_shard import DIM, Block
from torch import nn
from torch.utils.checkpoint import checkpoint

from spmd.fsdp import fully_shard, fully_shard_state
from spmd.fsdp.state import TrainingState
from spmd.tensor import init_device_mesh
from spmd.testing import run_threaded


class Recorded(nn.Module):
    """A block that writes down its fully_shard state's phase whenever its forward runs."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.block = Block(DIM)
        self.checkpointed = checkpointed
        self.seen: list[TrainingState] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = fully_shard_state(self)
        assert state is not None
        self.seen.append(state._training_state)
        return checkpoint(self.block, x, use_reentrant=False) if self.checkpointed else self.block(x)


def phases(checkpointed: bool) -> dict[str, object]:
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = Recorded(checkpointed)
    fully_shard(model, mesh=mesh)
    state = fully_shard_state(model)
    assert state is not None
    before = state._training_state
    x = torch.randn(2, 4, DIM, requires_grad=True)
    loss = model(x).sum()
    after_forward = state._training_state
    reached: list[TrainingState] = []
    x.register_hook(lambda grad: reached.append(state._training_state))  # inside the group's backward
    loss.backward()
    return {
        "before": before,
        "in_forward": model.seen[0],
        "after_forward": after_forward,
        "in_group_backward": reached[0],
        "after_backward": state._training_state,
        "gradients": all(p.grad is not None for p in model.parameters()),
    }


def test_a_training_step_walks_the_phases_in_order() -> None:
    for checkpointed in (False, True):
        for seen in run_threaded(phases, 2, checkpointed):
            assert seen == {
                "before": TrainingState.IDLE,
                "in_forward": TrainingState.FORWARD,
                "after_forward": TrainingState.IDLE,
                "in_group_backward": TrainingState.PRE_BACKWARD,
                "after_backward": TrainingState.IDLE,
                "gradients": True,
            }, f"checkpointed={checkpointed}"
