"""StepRecorder: one simulated step's memory events, collectives and FLOPs, cut at named marks.

It is ``spmd.simulate``'s ``MemoryTracker`` (storage lifetimes on the simulated rank) that also
keeps the collectives (``CommDebugMode``'s records), counts the FLOPs of the local matrix products
and attention kernels, and the bytes every other local op reads and writes (memory-bound work:
norms, activations, residual adds, the optimizer's updates). ``mark(name)`` starts a new piece; ``pieces()`` returns each
piece's events, collectives and FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry
from typing_extensions import Self

from spmd.comm import CollectiveRecord
from spmd.simulate.memory import MemoryTracker
from spmd.tensor import DTensor
from spmd.tensor.debug import CommDebugMode
from spmd.tensor.sharding.propagator import inferring_shapes

__all__ = ["StepRecorder", "Segment", "attention_flops"]

_aten = torch.ops.aten
_ATTENTION_FORWARD = {_aten._scaled_dot_product_flash_attention_for_cpu.default}
_ATTENTION_BACKWARD = {_aten._scaled_dot_product_flash_attention_for_cpu_backward.default}
BACKWARD_ATTENTION_FACTOR = 2.5
"""Backward attention work over forward's: four products plus recomputing the scores."""


def attention_flops(query: torch.Tensor, key: torch.Tensor, is_causal: bool) -> int:
    """Forward FLOPs of attention on (batch, heads, seq, head_dim) blocks: scores and weighted values.

    A causal block of equal query and key lengths does half the work (kernels skip masked tiles).
    """
    batch, heads, q_len, head_dim = query.shape
    flops = 4 * batch * heads * q_len * key.shape[-2] * head_dim
    return flops // 2 if is_causal and q_len == key.shape[-2] else flops


def _op_flops(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    if func in _ATTENTION_FORWARD:
        return attention_flops(args[0], args[1], bool(args[4]) if len(args) > 4 else kwargs.get("is_causal", False))
    if func in _ATTENTION_BACKWARD:
        causal = bool(args[7]) if len(args) > 7 else kwargs.get("is_causal", False)
        return int(BACKWARD_ATTENTION_FACTOR * attention_flops(args[1], args[2], causal))
    count = flop_registry.get(func.overloadpacket)
    return int(count(*args, out_val=out, **kwargs)) if count is not None else 0


@dataclass(slots=True)
class Segment:
    """A stretch of the step's timeline: memory changes, collectives and FLOPs, in program order."""

    events: list[tuple[int, int]] = field(default_factory=list)
    """(storage token, byte change)."""
    records: list[CollectiveRecord] = field(default_factory=list)
    flops: int = 0
    causes: list[tuple[str, str, bool]] = field(default_factory=list)
    """For each of ``records``: the op that issued it, the innermost module, whether in backward."""
    traffic: int = 0
    """Bytes the memory-bound local ops read and write (norms, activations, adds, the optimizer's)."""


_NO_TRAFFIC = {
    _aten.empty.memory_format,
    _aten.empty_like.default,
    _aten.new_empty.default,
    _aten.empty_strided.default,
    _aten.new_empty_strided.default,
}
"""Ops that allocate without reading or writing the memory."""


_moves_memory: dict[Any, bool] = {}


def _is_memory_bound(func: Any) -> bool:
    """Whether ``func`` reads and writes memory (not a view, an allocation or a FLOP-priced op); cached."""
    known = _moves_memory.get(func)
    if known is None:
        returns = func._schema.returns
        view = bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
        priced = func in _ATTENTION_FORWARD or func in _ATTENTION_BACKWARD or func.overloadpacket in flop_registry
        known = _moves_memory[func] = not (view or priced or func in _NO_TRAFFIC)
    return known


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.nbytes
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _traffic_bytes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """Bytes a memory-bound op reads and writes: its tensor inputs and outputs.

    Matrix products and attention are priced by FLOPs instead; a view or an allocation moves nothing.
    """
    if not _is_memory_bound(func):
        return 0
    return _nbytes(args) + _nbytes(tuple(kwargs.values())) + _nbytes(out)


class StepRecorder(MemoryTracker):  # type: ignore[no-untyped-call]
    """Memory events (``MemoryTracker``), collectives and FLOPs of the local ops, between marks."""

    def __init__(self, known: Any = ()) -> None:
        super().__init__(known)
        self.flops = 0
        self.traffic = 0
        """Bytes the memory-bound local ops read and write."""
        self.comm = CommDebugMode()
        self._marks: list[tuple[str, int, int, int, int]] = []  # (name, events, records, flops, traffic) at the mark

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is not NotImplemented and not inferring_shapes() and not any(issubclass(t, DTensor) for t in types):
            self.flops += _op_flops(func, args, kwargs or {}, out)
            self.traffic += _traffic_bytes(func, args, kwargs or {}, out)
        return out

    def __enter__(self) -> Self:
        self.comm.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self.comm.__exit__(None, None, None)

    def mark(self, name: str) -> None:
        """Start piece ``name`` here (a name marked again, as in a recomputed forward, is ignored)."""
        if all(seen != name for seen, *_ in self._marks):
            self._marks.append((name, len(self.events), len(self.comm.events), self.flops, self.traffic))

    def pieces(self) -> dict[str, Segment]:
        """Each mark's piece: the events, collectives and FLOPs from it to the next mark (or the end)."""
        ends = [*self._marks[1:], ("", len(self.events), len(self.comm.events), self.flops, self.traffic)]
        events = self.comm.events
        return {
            name: Segment(
                self.events[e0:e1],
                [e.record for e in events[r0:r1]],
                f1 - f0,
                [(e.op, e.modules[-1] if e.modules else "", e.backward) for e in events[r0:r1]],
                t1 - t0,
            )
            for (name, e0, r0, f0, t0), (_, e1, r1, f1, t1) in zip(self._marks, ends)
        }
