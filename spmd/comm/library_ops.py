"""The collectives as ``torch.library`` ops (``spmd::all_gather`` ...), so a compiled graph can hold them.

``torch.compile`` traces a DTensor program down to aten ops on the local shards; the collectives a
redistribute issues must appear in that graph as ops too, with a fake implementation that gives
the result's shape without talking to anyone. Custom ops take only simple arguments, so a
communicator travels as an int handle (spmd/comm/handles.py): ``group_handle(comm)`` registers it
once, and the op looks it up again when it runs. The handle names one communicator object of one world (a threaded
world's communicator serves all of its rank threads; the caller's rank is found at run time).

Each op records its traffic (what CommDebugMode counts) and runs the backend's private method
(``Communicator._all_gather`` ...), in eager code and in a compiled graph alike. Every op returns a
new tensor (never a view of its input), as a functional op must; the backends already do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from spmd.comm.handles import communicator_for

__all__ = ["COLLECTIVE_OPS"]


# FRAGMENT, not DEF: the namespace may gain other ops elsewhere without a clash.
_library = torch.library.Library("spmd", "FRAGMENT")  # type: ignore[no-untyped-call]

_SCHEMAS = {
    "all_gather": "all_gather(Tensor tensor, int group, int group_size) -> Tensor",
    "all_reduce": "all_reduce(Tensor tensor, int group, str reduce_op) -> Tensor",
    "reduce_scatter": "reduce_scatter(Tensor stacked, int group, str reduce_op) -> Tensor",
    "all_to_all": "all_to_all(Tensor stacked, int group) -> Tensor",
    "broadcast": "broadcast(Tensor tensor, int group, int src) -> Tensor",
    "scatter": "scatter(Tensor stacked, int group, int src) -> Tensor",
}
for _schema in _SCHEMAS.values():
    _library.define(_schema)  # type: ignore[no-untyped-call]


# ----- what runs: the traffic record, then the group's backend -----------------------------------
def _all_gather(tensor: torch.Tensor, group: int, group_size: int) -> torch.Tensor:
    comm = communicator_for(group)
    comm._record("all_gather", tensor)
    return comm._all_gather(tensor)


def _all_reduce(tensor: torch.Tensor, group: int, reduce_op: str) -> torch.Tensor:
    comm = communicator_for(group)
    comm._record("all_reduce", tensor)
    return comm._all_reduce(tensor, reduce_op)


def _reduce_scatter(stacked: torch.Tensor, group: int, reduce_op: str) -> torch.Tensor:
    comm = communicator_for(group)
    comm._record("reduce_scatter", stacked)
    return comm._reduce_scatter(stacked, reduce_op)


def _all_to_all(stacked: torch.Tensor, group: int) -> torch.Tensor:
    comm = communicator_for(group)
    comm._record("all_to_all", stacked)
    return comm._all_to_all(stacked)


def _broadcast(tensor: torch.Tensor, group: int, src: int) -> torch.Tensor:
    comm = communicator_for(group)
    comm._record("broadcast", tensor)
    return comm._broadcast(tensor, src)


def _scatter(stacked: torch.Tensor, group: int, src: int) -> torch.Tensor:
    comm = communicator_for(group)
    comm._record("scatter", stacked)
    return comm._scatter(stacked, src)


# ----- what the compiler sees while tracing: shapes only ------------------------------------------
def _all_gather_fake(tensor: torch.Tensor, group: int, group_size: int) -> torch.Tensor:
    return tensor.new_empty((group_size, *tensor.shape))


def _same_shape_fake(tensor: torch.Tensor, group: int, detail: str | int) -> torch.Tensor:
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


def _one_block_fake(stacked: torch.Tensor, group: int, detail: str | int) -> torch.Tensor:
    return stacked.new_empty(stacked.shape[1:])


def _all_to_all_fake(stacked: torch.Tensor, group: int) -> torch.Tensor:
    return torch.empty_like(stacked, memory_format=torch.contiguous_format)


_KERNELS: dict[str, tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]] = {
    "all_gather": (_all_gather, _all_gather_fake),
    "all_reduce": (_all_reduce, _same_shape_fake),
    "reduce_scatter": (_reduce_scatter, _one_block_fake),
    "all_to_all": (_all_to_all, _all_to_all_fake),
    "broadcast": (_broadcast, _same_shape_fake),
    "scatter": (_scatter, _one_block_fake),
}
# Real meta tensors (the N-rank simulator's worlds) run the backend too, which records the collective; only
# the compiler's fake tensors get the fake kernel. register_fake also claims the Meta key, so the
# Meta kernel is registered after it.
_meta_library = torch.library.Library("spmd", "IMPL", "Meta")  # type: ignore[no-untyped-call]
for _name, (_kernel, _fake) in _KERNELS.items():
    _library.impl(_name, _kernel, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
    torch.library.register_fake(f"spmd::{_name}", _fake, lib=_library)
    _meta_library.impl(_name, _kernel)  # type: ignore[no-untyped-call]

COLLECTIVE_OPS = {name: getattr(torch.ops.spmd, name).default for name in _SCHEMAS}
"""``{"all_gather": torch.ops.spmd.all_gather.default, ...}``: the overloads the base class calls."""
