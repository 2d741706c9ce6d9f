"""StepRecorder: one simulated step's memory events, collectives and FLOPs, cut at named marks.

It is ``spmd.simulate``'s ``MemoryTracker`` (storage lifetimes on the simulated rank) that also
keeps the collectives (``CommDebugMode``'s records) and counts the FLOPs of the local matrix
products and attention kernels. ``mark(name)`` starts a new piece; ``pieces()`` returns each
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


class StepRecorder(MemoryTracker):  # type: ignore[no-untyped-call]
    """Memory events (``MemoryTracker``), collectives and FLOPs of the local ops, between marks."""

    def __init__(self, known: Any = ()) -> None:
        super().__init__(known)
        self.flops = 0
        self.comm = CommDebugMode()
        self._marks: list[tuple[str, int, int, int]] = []  # (name, events, records, flops) at the mark

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is not NotImplemented and not inferring_shapes() and not any(issubclass(t, DTensor) for t in types):
            self.flops += _op_flops(func, args, kwargs or {}, out)
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
            self._marks.append((name, len(self.events), len(self.comm.events), self.flops))

    def pieces(self) -> dict[str, Segment]:
        """Each mark's piece: the events, collectives and FLOPs from it to the next mark (or the end)."""
        ends = [*self._marks[1:], ("", len(self.events), len(self.comm.events), self.flops)]
        events = self.comm.events
        return {
            name: Segment(
                self.events[e0:e1],
                [e.record for e in events[r0:r1]],
                f1 - f0,
                [(e.op, e.modules[-1] if e.modules else "", e.backward) for e in events[r0:r1]],
            )
            for (name, e0, r0, f0), (_, e1, r1, f1) in zip(self._marks, ends)
        }
