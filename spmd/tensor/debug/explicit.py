"""Explicit redistribution: every collective that moves a tensor is one the program wrote.

Inside ``with explicit_redistribution():`` (or for the whole process with ``SPMD_DEBUG=explicit``)
an op whose inputs the dispatcher would have to move between ranks raises
``ExplicitRedistributionError`` instead, naming the op, the inputs' placements, the collectives the
move would run and the ``redistribute`` line that makes it explicit::

    with explicit_redistribution():
        y = x @ w                                  # raises if x or w would have to move
        y = x.redistribute(mesh, [Replicate()]) @ w  # written out: runs

Moves the program asks for stay allowed: ``redistribute``, ``full_tensor``, ``from_local`` /
``to_local`` (forward and backward), and the input and output layouts of the tensor-parallel
styles, which call ``redistribute`` themselves. Implicit moves are those the dispatcher decides:
an input moved to fit the op's chosen strategy (on the op path and the list path of ``_foreach_*``
ops and fused optimizers), the gathers of the replicate fallback for an op without a rule, and the
same for the ops autograd runs in backward. A move that only cuts a replicated tensor locally
(``R -> S``) sends nothing and stays allowed; communication that is part of an op's own algorithm
(a norm's all-reduce, a cumsum's carry along a sharded dim) is the op, not a move of its inputs.

The switch is process-wide (every rank thread of ``run_threaded`` and autograd's threads see it).
When it is off the dispatcher pays nothing more than before: the check sits on the path that has
already decided to move an input.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from spmd.hooks import HOOKS
from spmd.tensor.placement import Partial, Placement, Replicate, Shard, format_placements
from spmd.tensor.redistribute.plan import TransformStep, steps_for_spec
from spmd.tensor.sharding.call import leaf_arguments, list_entries
from spmd.tensor.sharding.vocabulary import Decision

__all__ = [
    "ExplicitRedistributionError",
    "explicit_redistribution",
    "set_explicit_redistribution",
    "is_explicit_redistribution",
]

_lock = threading.Lock()
_blocks = 0
"""``explicit_redistribution()`` blocks open now, over all threads."""
_process_wide = False
"""Set by ``set_explicit_redistribution`` (``SPMD_DEBUG=explicit``)."""


class ExplicitRedistributionError(RuntimeError):
    """An op would have moved an input between ranks while explicit redistribution is on."""


def set_explicit_redistribution(enabled: bool = True) -> None:
    """Forbid (or allow again) implicit redistribution for the whole process."""
    global _process_wide
    with _lock:
        _process_wide = enabled
        _install()


def is_explicit_redistribution() -> bool:
    """Whether implicit redistribution raises now."""
    return HOOKS.refuse_implicit is not None


@contextlib.contextmanager
def explicit_redistribution() -> Iterator[None]:
    """Inside the block, an op that would move an input between ranks raises ``ExplicitRedistributionError``.

    Process-wide while open: enter it on every rank (SPMD programs do) or around ``run_threaded``.
    """
    global _blocks
    with _lock:
        _blocks += 1
        _install()
    try:
        yield
    finally:
        with _lock:
            _blocks -= 1
            _install()


def _install() -> None:
    """Put the check on the hook board while any switch is on (called with ``_lock`` held)."""
    HOOKS.refuse_implicit = refuse_implicit_moves if (_process_wide or _blocks > 0) else None


def refuse_implicit_moves(
    op: Any,
    leaves: Sequence[Any],
    shape: tuple[Any, ...],
    kwarg_names: list[str],
    positions: Sequence[int],
    decision: Decision,
) -> None:
    """Raise ``ExplicitRedistributionError`` if a move of ``decision`` sends data between ranks.

    Called by the dispatcher (op path and list path) only for decisions that move an input.
    """
    moved: list[tuple[int, Any, tuple[Placement, ...], list[TransformStep]]] = []
    for n in dict.fromkeys(decision.moves):
        dt = leaves[positions[n]]
        spec, want = dt._spec, decision.input_placements[n]
        steps = [step for step in steps_for_spec(spec, want) if step.collective != "local"]
        if steps:
            moved.append((n, dt, want, steps))
    if not moved:
        return
    names = _input_names(op, len(leaves), shape, kwarg_names)
    details = [(names[positions[n]], n, dt, want, steps) for n, dt, want, steps in moved]
    raise ExplicitRedistributionError(_message(op, decision, details))


def _input_names(op: Any, count: int, shape: tuple[Any, ...], kwarg_names: list[str]) -> list[str]:
    """The schema name of each flattened leaf, with its index for an entry of a list (``other[2]``)."""
    names = leaf_arguments(op, shape, kwarg_names, count)
    seen: dict[str, int] = {}
    for i, listed in enumerate(list_entries(shape, count)):
        if listed:
            index = seen.get(names[i], 0)
            seen[names[i]] = index + 1
            names[i] = f"{names[i]}[{index}]"
    return names


_Moved = tuple[str, int, Any, tuple[Placement, ...], list[TransformStep]]
"""One refused move: the input's name, its index among the op's DTensor inputs, the DTensor, the
placements the op wants it in, and the collective steps that would get it there."""


def _message(op: Any, decision: Decision, moved: list[_Moved]) -> str:
    if decision.fallback:
        head = (
            f"{op} has no sharding rule, and the replicate fallback would gather its inputs implicitly, "
            "which explicit_redistribution() forbids:"
        )
    else:
        head = f"{op} would redistribute its inputs implicitly, which explicit_redistribution() forbids:"
    lines = [head]
    for name, n, dt, want, steps in moved:
        lines.append(f"  input {n} ({name}): {dt._spec} -> {format_placements(want)}")
        lines.extend(f"      {step.describe()}" for step in steps)
    lines.append("Make the move explicit before the call:")
    for name, _, _, want, _ in moved:
        lines.append(f"  {name} = {name}.redistribute(mesh, [{', '.join(_constructor(p) for p in want)}])")
    if decision.fallback:
        lines.append(f"(the op then runs on the replicated tensors), or register a rule for {op} in spmd/tensor/ops/.")
    else:
        lines.append(
            "or give the inputs placements the op takes as they are "
            "(spmd.tensor.debug.explain(op, *args) lists its strategies)."
        )
    if torch._C._current_graph_task_id() != -1:
        lines.append(
            "This op runs in backward, for a gradient, so there is no line of the forward to add it to: lay "
            "out the forward's tensors so that their gradients need no move, or call backward() outside "
            "explicit_redistribution()."
        )
        if any(
            isinstance(dt._spec.placements[step.mesh_dim], Partial) for _, _, dt, _, steps in moved for step in steps
        ):
            lines.append(
                "The gradient is Partial (the sum a replicated forward input owes its shards' consumers), "
                "reduced where an op first needs it; a forward redistribute that changes that input's "
                "placement (as sequence parallelism's Shard(1) -> Replicate gather does) reduces it in its own "
                "backward instead, explicitly."
            )
    return "\n".join(lines)


def _constructor(p: Placement) -> str:
    """The placement as the user would write it: ``Shard(0)``, ``Replicate()``, ``Partial("max")``."""
    if isinstance(p, Shard):
        return f"Shard({p.dim})"
    if isinstance(p, Replicate):
        return "Replicate()"
    if isinstance(p, Partial):
        return "Partial()" if p.reduce_op == "sum" else f'Partial("{p.reduce_op}")'
    return repr(p)
