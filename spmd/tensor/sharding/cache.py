"""The decision cache: one decision per key, made once, shared by the op path and the list path.

A key is the op's entry, its DTensors' specs and its other arguments (spmd/tensor/dispatch/keys.py).
Decisions pin their meshes (and so their worlds), so the cache is cleared when it reaches ``limit``
entries; ``misses`` counts decisions made, which a steady training loop stops adding to. Safe to share
between rank threads: a race makes the same decision twice, and either copy is right.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["DecisionCache", "DECISION_CACHE_LIMIT"]

DECISION_CACHE_LIMIT = 50_000
"""Entries past which a cache starts again empty."""

V = TypeVar("V")


class DecisionCache(Generic[V]):
    """Values by key, made on a miss by the caller's ``decide``; cleared past ``limit`` entries."""

    def __init__(self, limit: int = DECISION_CACHE_LIMIT) -> None:
        self.limit = limit
        self.misses = 0
        """Values made so far (a key that cannot be hashed counts each time)."""
        self._entries: dict[Hashable, V] = {}
        self.get: Callable[[Hashable], V | None] = self._entries.get
        """The cached value, or None; raises ``TypeError`` for a key that cannot be hashed. The dict's own
        ``get``, bound once: the dispatcher's common path looks up every op through it."""

    def __len__(self) -> int:
        return len(self._entries)

    def get_or_decide(self, key: Hashable, decide: Callable[[], V]) -> tuple[V, bool]:
        """The value for ``key`` and whether it was cached; ``decide()`` makes it on a miss.

        A key holding an unhashable argument is decided every time (and never stored).
        """
        try:
            value = self._entries.get(key)
        except TypeError:
            self.misses += 1
            return decide(), False
        if value is not None:
            return value, True
        self.misses += 1
        value = decide()
        if len(self._entries) >= self.limit:
            self._entries.clear()
        self._entries[key] = value
        return value, False

    def clear(self) -> None:
        self._entries.clear()
