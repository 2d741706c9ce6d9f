"""The forward/backward life of one fully_shard'ed module's parameters.

  before forward   all-gather the module's sharded parameters over dp, one all_gather per dtype
                   (``spmd.fsdp.flat``, autograd-tracked), and let each gathered DTensor shadow the
                   registered shard, so the module's unchanged code computes with it
  after forward    un-shadow; with ``reshard_after_forward`` free the gathered storage
                   (``untyped_storage().resize_(0)``: autograd's saved copies share it), except on
                   the root (no fully_shard'ed ancestor), whose backward starts right away
  before backward  all-gather again into the same storage (an identity autograd node on the
                   module's outputs runs first in backward), then drop our references so that
                   autograd frees each copy once the last node that saved it has run
  backward         the gathered copies' gradients, Partial(sum) over dp, are reduce-scattered in
                   one collective per dtype back to the shards, so ``.grad`` is laid out like the
                   parameter
  kept whole       a parameter kept Replicate() over dp (no dim to cut) is shadowed in forward
                   by an identity whose backward all-reduces its gradient over dp. Not a tensor
                   hook on the parameter: pickle and deepcopy drop those, and a copied module
                   would leave the gradient Partial(sum)

The hooks on the module are bound methods of this state, which holds only the mesh, the parameters
and their modules, so a fully_shard'ed module pickles and deep-copies (outside forward).

Every collective goes through ``redistribute``, so CommDebugMode and the verbose log see them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.utils._pytree import tree_flatten, tree_unflatten

from spmd.fsdp.flat import FlatGroup, flat_groups
from spmd.fsdp.layout import ShardedParameter
from spmd.tensor import DeviceMesh, DTensor

__all__ = ["FullyShardState", "add_storage_resize_observer"]


class FullyShardState:
    """The parameters one ``fully_shard`` call manages, and their gathered copies during forward."""

    def __init__(
        self, mesh: DeviceMesh, dp: int, params: Sequence[ShardedParameter], *, reshard_after_forward: bool
    ) -> None:
        self.mesh = mesh
        self.params = tuple(params)
        self.groups = tuple(flat_groups(self.params, mesh, dp))
        self.reshard_after_forward = reshard_after_forward
        self.is_root = True
        """False once a fully_shard'ed ancestor claims this module (fully_shard is applied bottom-up)."""
        self._gathered: dict[int, DTensor] = {}

    def before_forward(self, module: nn.Module, args: Any) -> None:
        self._gathered = _gather(self.groups)
        whole = _reduce_grads_over_dp(self.params) if torch.is_grad_enabled() else {}
        for p in self.params:
            # the gathered copy (or the reducing identity) shadows the registered shard until after forward
            key = id(p.parameter)
            p.module.__dict__[p.name] = self._gathered.get(key, whole.get(key, p.parameter))

    def after_forward(self, module: nn.Module, args: Any, outputs: Any) -> Any:
        for p in self.params:
            p.module.__dict__.pop(p.name, None)
        gathered, self._gathered = self._gathered, {}
        leaves, spec = tree_flatten(outputs)
        needs_grad = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not needs_grad or not self.reshard_after_forward or self.is_root:
            return outputs  # no backward, or the copies stay for it: autograd's saved ones are the only holders
        freed = _Freed(self.groups, {key: (full, _free(full)) for key, full in gathered.items()})
        wrapped = _RegatherBeforeBackward.apply(freed, *(leaves[i] for i in needs_grad))  # type: ignore[no-untyped-call]
        for i, tensor in zip(needs_grad, wrapped):
            leaves[i] = tensor
        return tree_unflatten(leaves, spec)


def _gather(groups: Sequence[FlatGroup]) -> dict[int, DTensor]:
    """Each sharded parameter's gathered copy, by ``id`` of the parameter."""
    return {
        id(piece.param.parameter): full for group in groups for piece, full in zip(group.pieces, group.gather())
    }


def _reduce_grads_over_dp(params: Sequence[ShardedParameter]) -> dict[int, DTensor]:
    """For each parameter kept whole over dp that needs a gradient, its identity that reduces the gradient."""
    whole: dict[int, DTensor] = {}
    for p in params:
        if not p.is_sharded and p.parameter.requires_grad and id(p.parameter) not in whole:
            whole[id(p.parameter)] = _ReduceGradOverDp.apply(p.parameter)  # type: ignore[no-untyped-call]
    return whole


class _ReduceGradOverDp(torch.autograd.Function):
    """Identity on a parameter kept whole over dp; backward reduces its gradient to the parameter's layout.

    Each dp rank saw its part of the batch, so the gradient arrives Partial(sum) over dp.
    """

    @staticmethod
    def forward(ctx: Any, param: DTensor) -> DTensor:
        ctx.placements = param.placements
        return DTensor(param._local_tensor, param._spec, requires_grad=False)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> DTensor:
        return grad.redistribute(placements=ctx.placements)


@dataclass(frozen=True, slots=True)
class _Freed:
    """The gathered copies freed after forward, with their storage sizes, to be refilled before backward."""

    groups: tuple[FlatGroup, ...]
    copies: dict[int, tuple[DTensor, int]]
    """By ``id`` of the parameter: the copy and its storage size (0: not freed)."""

    def regather(self) -> None:
        """Refill the freed copies in place with a fresh all_gather over dp."""
        if not any(nbytes for _, nbytes in self.copies.values()):
            return
        with torch.no_grad():
            fresh = _gather(self.groups)
            for key, (full, nbytes) in self.copies.items():
                if nbytes:
                    local = full.to_local()
                    _resize(local.untyped_storage(), nbytes)
                    # The same values as before the free: a compiled backward saved this very tensor
                    # (not its DTensor) and checks that its version did not move.
                    with _unsafe_preserve_version_counter(local):
                        local.copy_(fresh[key].to_local())


def _free(full: DTensor) -> int:
    """Free a gathered copy's storage (its own: cut out of the all_gather's result); its size."""
    with torch.no_grad():
        storage = full.to_local().untyped_storage()
    nbytes = storage.nbytes()
    _resize(storage, 0)
    return nbytes


_resize_observers: list[Callable[[torch.UntypedStorage], None]] = []


def add_storage_resize_observer(observer: Callable[[torch.UntypedStorage], None]) -> None:
    """Call ``observer(storage)`` after fully_shard frees or refills a gathered copy's storage.

    Resizing a storage is not an aten op, so dispatch modes do not see it; memory trackers
    (the N-rank simulator) follow these calls instead.
    """
    _resize_observers.append(observer)


def _resize(storage: torch.UntypedStorage, nbytes: int) -> None:
    storage.resize_(nbytes)
    for observer in _resize_observers:
        observer(storage)


class _RegatherBeforeBackward(torch.autograd.Function):
    """Identity on the module's outputs whose backward, the first of the module's, re-gathers its parameters."""

    @staticmethod
    def forward(ctx: Any, freed: _Freed, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.freed = freed
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.freed.regather()
        ctx.freed = None  # from here autograd's saved copies are the only holders: freed as backward goes
        return (None, *grads)
