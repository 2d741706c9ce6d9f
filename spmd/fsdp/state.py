"""The forward/backward life of one fully_shard'ed module's parameters.

  before forward   all-gather every sharded parameter over dp (``redistribute`` to Replicate on dp,
                   autograd-tracked) and let the gathered DTensor shadow the registered shard, so
                   the module's unchanged code computes with it
  after forward    un-shadow; with ``reshard_after_forward`` free the gathered storage
                   (``untyped_storage().resize_(0)``: autograd's saved copies share it), except on
                   the root (no fully_shard'ed ancestor), whose backward starts right away
  before backward  all-gather again into the same storage (an identity autograd node on the
                   module's outputs runs first in backward), then drop our references so that
                   autograd frees each copy once the last node that saved it has run
  backward         the redistribute's backward reduce-scatters each gradient (Partial(sum) over dp)
                   to the sharded layout, so ``.grad`` is laid out like the parameter

Every collective goes through ``redistribute``, so CommDebugMode and the verbose log see them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from spmd.fsdp.layout import ShardedParameter
from spmd.tensor import DeviceMesh, DTensor

__all__ = ["FullyShardState"]


class FullyShardState:
    """The parameters one ``fully_shard`` call manages, and their gathered copies during forward."""

    def __init__(
        self, mesh: DeviceMesh, params: Sequence[ShardedParameter], *, reshard_after_forward: bool
    ) -> None:
        self.mesh = mesh
        self.params = tuple(params)
        self.reshard_after_forward = reshard_after_forward
        self.is_root = True
        """False once a fully_shard'ed ancestor claims this module (fully_shard is applied bottom-up)."""
        self._gathered: list[tuple[ShardedParameter, DTensor]] = []

    def before_forward(self, module: nn.Module, args: Any) -> None:
        self._gathered = []
        for p in self.params:
            full = _gather(p)
            p.module.__dict__[p.name] = full  # shadows the registered shard until after forward
            if p.is_sharded:
                self._gathered.append((p, full))

    def after_forward(self, module: nn.Module, args: Any, outputs: Any) -> Any:
        for p in self.params:
            p.module.__dict__.pop(p.name, None)
        gathered, self._gathered = self._gathered, []
        leaves, spec = tree_flatten(outputs)
        needs_grad = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not needs_grad or not self.reshard_after_forward or self.is_root:
            return outputs  # no backward, or the copies stay for it: autograd's saved ones are the only holders
        freed = [_FreedCopy(p, full, _free(full, p.parameter)) for p, full in gathered]
        wrapped = _RegatherBeforeBackward.apply(freed, *(leaves[i] for i in needs_grad))  # type: ignore[no-untyped-call]
        for i, tensor in zip(needs_grad, wrapped):
            leaves[i] = tensor
        return tree_unflatten(leaves, spec)


@dataclass(frozen=True, slots=True)
class _FreedCopy:
    """A gathered copy whose storage was freed after forward, to be refilled before backward."""

    param: ShardedParameter
    full: DTensor
    nbytes: int
    """The storage size to restore; 0 when it was not freed (it shares the shard's storage)."""


def _gather(p: ShardedParameter) -> DTensor:
    param: DTensor = p.parameter  # type: ignore[assignment]
    if not p.is_sharded:
        return param
    return param.redistribute(param.device_mesh, p.gathered_placements)


def _regather(freed: list[_FreedCopy]) -> None:
    """Refill the freed copies in place with a fresh all_gather over dp."""
    with torch.no_grad():
        for copy in freed:
            if copy.nbytes == 0:
                continue
            fresh = _gather(copy.param).to_local()
            local = copy.full.to_local()
            local.untyped_storage().resize_(copy.nbytes)
            local.copy_(fresh)


def _free(full: DTensor, shard: nn.Parameter) -> int:
    """Free the gathered copy's storage; its size, or 0 when it shares the shard's and must stay."""
    with torch.no_grad():
        local, shard_local = full.to_local(), shard.to_local()  # type: ignore[attr-defined]
    storage = local.untyped_storage()
    if storage.data_ptr() == shard_local.untyped_storage().data_ptr() or storage.nbytes() == 0:
        return 0
    nbytes = storage.nbytes()
    storage.resize_(0)
    return nbytes


class _RegatherBeforeBackward(torch.autograd.Function):
    """Identity on the module's outputs whose backward, the first of the module's, re-gathers its parameters."""

    @staticmethod
    def forward(ctx: Any, freed: list[_FreedCopy], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.freed = freed
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        _regather(ctx.freed)
        ctx.freed = []  # from here autograd's saved copies are the only holders: freed as backward goes
        return (None, *grads)
