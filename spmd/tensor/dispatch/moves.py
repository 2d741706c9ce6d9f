"""Moving a call's inputs to the placements its decision chose (the op path and the list path alike)."""

from __future__ import annotations

from typing import Any

from spmd.tensor.placement import format_placements
from spmd.tensor.redistribute.run import redistribute_local
from spmd.tensor.sharding.vocabulary import Decision
from spmd.tensor.trace import log_line, replication_note

__all__ = ["redistribute_moved"]


def redistribute_moved(
    leaves: Any, local: list[Any], positions: list[int], decision: Decision, *, verbose: bool
) -> None:
    """Redistribute the inputs the decision moves, in place in ``local``; one passed twice
    (``addcmul_(g, g)``) is moved once."""
    done: dict[tuple[int, tuple[Any, ...]], Any] = {}
    for n in decision.moves:
        dt = leaves[positions[n]]
        want = decision.input_placements[n]
        key = (id(dt), want)
        if key not in done:
            if verbose:
                log_line(
                    "  input %d: %s -> %s%s",
                    n,
                    format_placements(dt._spec.placements),
                    format_placements(want),
                    replication_note(dt._spec, want),
                )
            done[key] = redistribute_local(dt._local_tensor, dt._spec, want)
        local[positions[n]] = done[key]
