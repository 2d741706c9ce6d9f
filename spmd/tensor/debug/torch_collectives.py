"""torch's names for the collectives, and the mode that sees the ones a user calls through torch.

CommDebugMode counts every collective spmd issues from its communicator's record. A program may
also call torch's collectives itself: the functional collectives (``funcol.all_reduce``, ops of the
``_c10d_functional`` namespace), or ``torch.distributed.all_reduce`` and friends (``c10d`` ops). Those
never pass through a communicator, so ``TorchCollectiveWatch`` (a dispatch mode) spots them by op.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from spmd.comm import CollectiveRecord, Communicator
from spmd.tensor.trace import current_rank_or_none

__all__ = ["KINDS", "collective_kind", "collective_kind_or_none", "torch_collective_record", "TorchCollectiveWatch"]

# torch's names for each collective: its functional collectives (python functions and the
# ``_c10d_functional`` / ``c10d_functional`` ops), the c10d ops and DTensor's own all_to_all.
_TORCH_NAMES: dict[str, tuple[str, ...]] = {
    "all_gather": (
        "all_gather_tensor", "all_gather_tensor_autograd", "all_gather_single", "all_gather_single_autograd",
        "all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced",
        "allgather_", "_allgather_base_", "allgather_coalesced_", "allgather_into_tensor_coalesced_",
    ),
    "all_reduce": (
        "all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_", "allreduce_",
        "allreduce_coalesced_",
    ),
    "reduce_scatter": (
        "reduce_scatter_tensor", "reduce_scatter_tensor_autograd", "reduce_scatter_single",
        "reduce_scatter_single_autograd", "reduce_scatter_tensor_out", "reduce_scatter_tensor_coalesced",
        "reduce_scatter_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_",
    ),
    "all_to_all": ("all_to_all_single", "all_to_all_single_autograd", "alltoall_", "alltoall_base_",
                   "shard_dim_alltoall"),
    "broadcast": ("broadcast", "broadcast_"),
    "scatter": ("scatter_",),
    "gather": ("gather_",),
    "reduce": ("reduce_",),
}
_KIND_OF_TORCH_NAME = {name: kind for kind, names in _TORCH_NAMES.items() for name in names}
KINDS = (*_TORCH_NAMES, "all_gather_object")
"""Every collective kind a CommDebugMode counts."""

# The op namespaces whose collectives the watch counts: native and legacy functional collectives,
# their autograd variants, the ops behind torch.distributed's eager API, and torch DTensor's own.
_TORCH_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "c10d", "_dtensor"})


def collective_kind(key: object) -> str:
    """Our name of a collective given by our name (``"all_gather"``) or by torch's op or function.

    ``funcol.all_gather_into_tensor``, ``torch.ops.c10d_functional.all_gather_into_tensor`` (or
    an overload of it) and ``torch.ops.c10d._allgather_base_`` all give ``"all_gather"``, so
    counts read the way torch's ``CommDebugMode`` tests read them.
    """
    kind = collective_kind_or_none(key)
    if kind is None:
        raise KeyError(f"{key!r} is not a collective CommDebugMode counts; the kinds are {', '.join(KINDS)}")
    return kind


def collective_kind_or_none(key: object) -> str | None:
    """``collective_kind(key)``, or None where ``key`` names no collective."""
    if isinstance(key, str):
        return key if key in KINDS else None
    packet = getattr(key, "_overloadpacket", key)
    qualified = getattr(packet, "_qualified_op_name", None)
    name = qualified.split("::")[-1] if isinstance(qualified, str) else getattr(packet, "__name__", None)
    return _KIND_OF_TORCH_NAME.get(name) if isinstance(name, str) else None


def _torch_collective_kind(func: Any) -> str | None:
    """The kind of ``func`` if it is one of torch's collective ops, else None."""
    if not isinstance(func, torch._ops.OpOverload) or func.namespace not in _TORCH_NAMESPACES:
        return None
    return _KIND_OF_TORCH_NAME.get(func._opname)


# Collectives spmd's own communicators issue through torch (the c10d backend) were already counted
# by the communicator's record; the watch tells them apart by who called: code of the comm package.
_COMM_PACKAGE = Communicator.__module__.rpartition(".")[0] + "."


def _issued_by_spmd() -> bool:
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith(_COMM_PACKAGE):
            return True
        frame = frame.f_back
    return False


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _group_ranks(arguments: dict[str, Any]) -> tuple[int, ...]:
    """The global ranks of the group a torch collective runs on, from its group (name or object)."""
    if isinstance(arguments.get("ranks"), (list, tuple)):  # the legacy c10d_functional ops list them
        return tuple(arguments["ranks"])
    group = arguments.get("group_name", arguments.get("process_group"))
    try:
        import torch.distributed as dist

        if isinstance(group, str):
            group = dist.distributed_c10d._resolve_process_group(group)  # type: ignore[attr-defined, arg-type]
        elif isinstance(group, torch.ScriptObject):
            group = dist.ProcessGroup.unbox(group)
        return tuple(dist.get_process_group_ranks(group))
    except (RuntimeError, ValueError, AttributeError, KeyError, TypeError):
        size = arguments.get("group_size")
        return tuple(range(size)) if isinstance(size, int) else ()


def torch_collective_record(func: torch._ops.OpOverload, kind: str, args: tuple[Any, ...],
                            kwargs: dict[str, Any]) -> CollectiveRecord:
    """The record of one torch collective op call, in the communicators' accounting.

    Its payload is the first argument that is not an output buffer (an all_gather counts the gathered
    result, as spmd's records do).
    """
    arguments = dict(zip((a.name for a in func._schema.arguments), args))
    arguments.update(kwargs)
    payload = next((v for name, v in arguments.items() if not name.startswith("output")), None)
    ranks = _group_ranks(arguments)
    size = len(ranks) or 1
    tensor_bytes = _tensor_bytes(payload) * (size if kind == "all_gather" else 1)
    rank = current_rank_or_none()
    return CollectiveRecord(kind, size, tensor_bytes, ranks, rank if rank is not None else 0)


class TorchCollectiveWatch(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """A dispatch mode calling ``on_collective(func, kind, args, kwargs)`` for each torch collective op.

    Collectives spmd's communicators issue are left out (they report themselves). An op on a tensor
    subclass (a DTensor) runs with the mode stepped aside, so the local ops it turns into are not looked
    at. The mode also steps aside while ``torch.compile`` compiles, and watches the compiled code run.
    """

    def __init__(self, on_collective: Callable[[torch._ops.OpOverload, str, tuple[Any, ...], dict[str, Any]], None]):
        super().__init__()  # type: ignore[no-untyped-call]
        self.supports_higher_order_operators = True
        self._on_collective = on_collective

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind = _torch_collective_kind(func)
        if kind is not None and not _issued_by_spmd():
            self._on_collective(func, kind, args, kwargs)
        return out
