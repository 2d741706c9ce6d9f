"""CommDebugMode: count the collectives (and bytes) a program issues, in total, per op and per module.

It counts the collectives DTensor issues and those the program calls through torch itself
(``funcol.all_reduce``, ``torch.distributed.all_gather_into_tensor`` ...). Per-module counts use the
modules' fully qualified names (``Transformer.layers.0.attn``), in the forward and the backward
pass; a collective counts for every module that is running around it.
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any
from weakref import WeakKeyDictionary

import torch
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.nn.modules.module import register_module_forward_pre_hook
from typing_extensions import Self

from spmd.comm import CollectiveRecord, add_comm_observer, remove_comm_observer
from spmd.compile.compiling import compiling_here
from spmd.tensor.debug.torch_collectives import (
    TorchCollectiveWatch,
    collective_kind,
    collective_kind_or_none,
    torch_collective_record,
)
from spmd.tensor.trace import STATE, current_op, current_rank_or_none, human_bytes

__all__ = ["CommDebugMode", "CommEvent", "CommCounts", "collective_kind"]

GLOBAL = "Global"


class CommCounts(dict[str, int]):
    """Counts by collective kind, keyed by our names but readable with torch's ops as keys too.

    They also compare equal to a dict keyed by torch's ops (``{funcol.all_reduce: 1}``).

    A collective that did not happen reads as 0, as in torch's ``CommDebugMode``.
    """

    def __missing__(self, key: object) -> int:
        kind = collective_kind(key)
        return super().get(kind, 0) if kind != key else 0

    def __contains__(self, key: object) -> bool:
        try:
            return super().__contains__(collective_kind(key))
        except KeyError:
            return False

    def get(self, key: object, default: Any = None) -> Any:
        try:
            return super().get(collective_kind(key), default)
        except KeyError:
            return default

    def __eq__(self, other: object) -> bool:
        """Equal to any mapping with the same nonzero counts, whichever names its keys use.

        ``{funcol.all_reduce: 1}``, ``{torch.ops.c10d_functional.all_reduce: 1}`` and ``{"all_reduce": 1}``
        all equal the counts of one all_reduce.
        """
        if not isinstance(other, Mapping):
            return NotImplemented
        theirs = _nonzero_by_kind(other)
        return theirs is not None and theirs == _nonzero_by_kind(self)

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = None  # counts change; as for any dict


def _nonzero_by_kind(counts: Mapping[Any, int]) -> dict[str, int] | None:
    """``counts`` summed by our kind names, zeros left out; None if a key names no collective."""
    totals: Counter[str] = Counter()
    for key, count in counts.items():
        kind = collective_kind_or_none(key)
        if kind is None:
            return None
        totals[kind] += count
    return {kind: count for kind, count in totals.items() if count}


@dataclass(frozen=True, slots=True)
class CommEvent:
    """One collective seen by a CommDebugMode: what, issued by which op, inside which modules."""

    record: CollectiveRecord
    op: str
    modules: tuple[str, ...]
    backward: bool

    @property
    def kind(self) -> str:
        return self.record.kind


class _ModuleStack:
    """The modules running on one thread, forward and backward, named by fully qualified name."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.backward_depth = 0
        self.backward_base: int | None = None
        """Length of the stack when the running backward pass pushed its first module; None outside one."""
        self.names: WeakKeyDictionary[nn.Module, str] = WeakKeyDictionary()

    def reset(self) -> None:
        """Forget the running modules (a pass that ended without a trace, a mode entered again)."""
        self.stack.clear()
        self.backward_depth = 0
        self.backward_base = None

    def name_of(self, module: nn.Module) -> str:
        name = self.names.get(module)
        if name is None:
            name = type(module).__name__
            self.names[module] = name
            for child_name, child in module.named_modules():
                if child_name:
                    self.names.setdefault(child, f"{name}.{child_name}")
        return name


class CommDebugMode:
    """Records every collective the calling rank issues while active.

    That is the collectives DTensor issues and the ones the program calls through torch (functional
    collectives, ``torch.distributed.*``). In a threaded world each rank enters its own mode and sees
    only its own collectives. Entering the mode again starts its counts and parameter info afresh.

    >>> with CommDebugMode() as comm_mode:  # doctest: +SKIP
    ...     y = x.redistribute(mesh, [Replicate()])
    >>> comm_mode.get_comm_counts()  # doctest: +SKIP
    {'all_gather': 1}
    """

    def __init__(self) -> None:
        self.events: list[CommEvent] = []
        self._rank: int | None = None
        self._thread = 0
        self._modules = _ModuleStack()
        self._handles: list[Any] = []
        self._parameters: dict[str, dict[str, torch.Tensor]] = {}
        self._torch_watch: TorchCollectiveWatch | None = None

    # ----- context manager -------------------------------------------------------------------------
    def __enter__(self) -> Self:
        # Each entry starts afresh, as torch's does: counts, and the parameters of the modules that run.
        self.events = []
        self._parameters = {}
        self._modules.reset()
        self._rank = current_rank_or_none()
        self._thread = threading.get_ident()
        add_comm_observer(self._observe)
        self._handles = [register_module_forward_pre_hook(self._enter_module)]
        self._torch_watch = TorchCollectiveWatch(self._observe_torch_collective)
        self._torch_watch.__enter__()  # type: ignore[no-untyped-call]
        STATE.comm_modes += 1
        STATE.refresh()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._torch_watch is not None:
            self._torch_watch.__exit__(exc_type, exc, tb)  # type: ignore[no-untyped-call]
            self._torch_watch = None
        remove_comm_observer(self._observe)
        for handle in self._handles:
            handle.remove()
        self._handles = []
        STATE.comm_modes -= 1
        STATE.refresh()

    def _mine(self) -> bool:
        return threading.get_ident() == self._thread

    def _enter_module(self, module: nn.Module, inputs: Any) -> None:
        # A compiled graph's collectives are still counted when it runs, but not per module: the
        # hooks below cannot be traced (and a traced hook would only run at compile time).
        if compiling_here() or not self._mine():
            return
        name = self._modules.name_of(module)
        self._modules.stack.append(name)
        if self._modules.backward_depth == 0:
            own = dict(module.named_parameters(recurse=False))
            if own:
                self._parameters[name] = {key: param.data for key, param in own.items()}
        # Leave after the module's own forward hooks (a TP style's output redistribute runs in
        # one): a hook registered now runs after those, while global hooks would run before.
        handles: list[Any] = []
        handles.append(
            module.register_forward_hook(
                lambda mod, args, outputs: self._leave_module(mod, handles[0], outputs), always_call=True
            )
        )
        tensors = [t for t in _tensors(inputs) if t.requires_grad]
        if tensors:
            # The inputs' gradients are the last thing the module's backward produces.
            register_multi_grad_hook(tensors, lambda grads: self._pop_backward(name), mode="any")

    def _leave_module(self, module: nn.Module, handle: Any, outputs: Any) -> None:
        handle.remove()
        name = self._modules.name_of(module)
        if self._modules.stack and self._modules.stack[-1] == name:
            self._modules.stack.pop()
        tensors = [t for t in _tensors(outputs) if t.requires_grad]
        if tensors:
            register_multi_grad_hook(tensors, lambda grads: self._push_backward(name), mode="any")

    def _push_backward(self, name: str) -> None:
        modules = self._modules
        if modules.backward_base is None:
            # A module whose inputs need no gradient never pops; the pass's end clears what is left.
            modules.backward_base = len(modules.stack)
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        modules.stack.append(name)
        modules.backward_depth += 1

    def _end_backward(self) -> None:
        modules = self._modules
        if modules.backward_base is not None:
            del modules.stack[modules.backward_base:]
        modules.backward_depth = 0
        modules.backward_base = None

    def _pop_backward(self, name: str) -> None:
        if name in self._modules.stack:
            index = len(self._modules.stack) - 1 - self._modules.stack[::-1].index(name)
            del self._modules.stack[index]
            self._modules.backward_depth = max(0, self._modules.backward_depth - 1)

    def _observe(self, record: CollectiveRecord) -> None:
        if self._rank is not None and record.rank != self._rank:
            return
        if self._rank is None and not self._mine():
            return
        self._add_event(record, current_op() or "other")

    def _observe_torch_collective(
        self, func: torch._ops.OpOverload, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        # The watch is a dispatch mode of this thread only: every collective it sees is ours.
        self._add_event(torch_collective_record(func, kind, args, kwargs), current_op() or str(func))

    def _add_event(self, record: CollectiveRecord, op: str) -> None:
        backward = self._modules.backward_depth > 0 or torch._C._current_graph_task_id() != -1
        self.events.append(CommEvent(record, op, tuple(self._modules.stack), backward))

    # ----- queries ---------------------------------------------------------------------------------
    @property
    def records(self) -> list[CollectiveRecord]:
        return [e.record for e in self.events]

    def get_total_counts(self) -> int:
        """Number of collectives issued."""
        return len(self.events)

    def get_comm_counts(self) -> CommCounts:
        """Collectives issued, by kind (``all_gather``, ``all_reduce``, ``reduce_scatter``, ...).

        torch's ops read as keys too: ``counts[funcol.all_gather_into_tensor]``.
        """
        return CommCounts(Counter(e.kind for e in self.events))

    @property
    def comm_counts(self) -> CommCounts:
        """torch's attribute name for ``get_comm_counts()``."""
        return self.get_comm_counts()

    def get_comm_bytes(self) -> CommCounts:
        """Bytes this rank received, by kind (ring-algorithm accounting, see ``CollectiveRecord``)."""
        totals: Counter[str] = Counter()
        for e in self.events:
            totals[e.kind] += e.record.moved_bytes
        return CommCounts(totals)

    def get_total_bytes(self) -> int:
        return sum(e.record.moved_bytes for e in self.events)

    def get_per_op_comm_counts(self) -> dict[str, CommCounts]:
        """``{op: {collective: count}}``; ops are aten overloads or ``redistribute``."""
        table: dict[str, Counter[str]] = defaultdict(Counter)
        for e in self.events:
            table[e.op][e.kind] += 1
        return {op: CommCounts(c) for op, c in table.items()}

    def get_per_module_comm_counts(self, *, backward: bool | None = None) -> dict[str, dict[str, int]]:
        """``{module FQN: {collective: count}}``, including ``Global`` for everything.

        ``backward=True`` / ``False`` keeps only the backward / forward pass; None keeps both.
        """
        table: dict[str, Counter[str]] = defaultdict(Counter)
        for e in self.events:
            if backward is not None and e.backward != backward:
                continue
            for name in (GLOBAL, *dict.fromkeys(e.modules)):
                table[name][e.kind] += 1
        return {name: CommCounts(c) for name, c in table.items()}

    @property
    def comm_module_counts(self) -> dict[str, dict[str, CommCounts]]:
        """``{module FQN: {"forward": counts, "backward": counts}}``, ``Global`` included (torch's layout).

        A collective counts for its module and every module around it.
        """
        table: dict[str, dict[str, CommCounts]] = {GLOBAL: {"forward": CommCounts(), "backward": CommCounts()}}
        for e in self.events:
            phase = "backward" if e.backward else "forward"
            for name in (GLOBAL, *dict.fromkeys(e.modules)):
                counts = table.setdefault(name, {"forward": CommCounts(), "backward": CommCounts()})[phase]
                counts[e.kind] = counts.get(e.kind, 0) + 1
        return table

    def get_parameter_info(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{module FQN: {parameter name: its data}}`` for the modules that ran forward while active."""
        return {name: dict(params) for name, params in self._parameters.items()}

    def get_sharding_info(self) -> dict[str, tuple[Any, ...]]:
        """``{"module FQN.parameter": placements}`` for the DTensor parameters of those modules."""
        return {
            f"{name}.{key}": data.placements
            for name, params in self._parameters.items()
            for key, data in params.items()
            if hasattr(data, "placements")  # a DTensor, by duck typing: the debug tools sit above dtensor
        }

    # ----- reports ---------------------------------------------------------------------------------
    def generate_comm_debug_tracing_table(self, noise_level: int = 3) -> str:
        """A readable table: per module and pass, the collectives and bytes; per op too unless ``noise_level=0``."""
        rows: list[tuple[str, str, str, int, int]] = []
        grouped: dict[tuple[str, str], dict[tuple[str, str], list[int]]] = defaultdict(dict)
        for e in self.events:
            phase = "backward" if e.backward else "forward"
            for name in (GLOBAL, *dict.fromkeys(e.modules)):
                key = (e.op if noise_level >= 1 else "", e.kind)
                cell = grouped[(name, phase)].setdefault(key, [0, 0])
                cell[0] += 1
                cell[1] += e.record.moved_bytes
        for (name, phase), cells in grouped.items():
            for (op, kind), (count, nbytes) in cells.items():
                rows.append((name, phase, f"{kind}" + (f"  [{op}]" if op else ""), count, nbytes))
        if not rows:
            return "no collectives"
        width = max(len(r[0]) for r in rows)
        kwidth = max(len(r[2]) for r in rows)
        lines = [f"{'module':<{width}}  {'pass':<8}  {'collective':<{kwidth}}  {'count':>5}  {'bytes':>10}"]
        for name, phase, kind, count, nbytes in rows:
            lines.append(f"{name:<{width}}  {phase:<8}  {kind:<{kwidth}}  {count:>5}  {human_bytes(nbytes):>10}")
        return "\n".join(lines)

    def log_comm_debug_tracing_table_to_file(self, file_name: str = "comm_mode_log.txt", noise_level: int = 3) -> None:
        """Write ``generate_comm_debug_tracing_table(noise_level)`` to ``file_name``."""
        with open(file_name, "w") as file:
            file.write(self.generate_comm_debug_tracing_table(noise_level) + "\n")

    def __str__(self) -> str:
        lines = [f"{'collective':<16}{'count':>7}{'bytes':>14}"]
        byte_counts = self.get_comm_bytes()
        for kind, count in sorted(self.get_comm_counts().items()):
            lines.append(f"{kind:<16}{count:>7}{byte_counts.get(kind, 0):>14,}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"CommDebugMode(counts={self.get_comm_counts()})"


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []
