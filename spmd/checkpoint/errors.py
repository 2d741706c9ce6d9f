"""CheckpointError: one error type for a failed save or load, raised on every rank alike."""

from __future__ import annotations

from typing import Any

__all__ = ["CheckpointError"]


class CheckpointError(RuntimeError):
    """A save or load failed on one or more ranks; every rank raises it, with every rank's cause.

    ``failures`` maps each failing global rank to its exception; the message quotes them all, and
    ``__cause__`` is the lowest failing rank's. (DCP itself raises ``CheckpointException``, a
    ``BaseException`` that ``except Exception`` does not catch; ``spmd.checkpoint`` converts it.)
    """

    def __init__(self, step: str, failures: dict[int, BaseException]) -> None:
        self.step = step
        self.failures = dict(sorted(failures.items()))
        # Ranks usually fail alike: one line per distinct error, naming the ranks that raised it.
        ranks_by_error: dict[str, list[int]] = {}
        for rank, error in self.failures.items():
            ranks_by_error.setdefault(_describe(error), []).append(rank)
        lines = [f"checkpoint {step} failed on rank(s) {list(self.failures)}:"]
        lines += [f"  rank(s) {ranks}: {error}" for error, ranks in ranks_by_error.items()]
        super().__init__("\n".join(lines))
        self.__cause__ = next(iter(self.failures.values()))

    def __reduce__(self) -> tuple[Any, ...]:
        # Picklable, so a gloo rank can return it to a test harness.
        return (type(self), (self.step, self.failures))


def _describe(error: BaseException) -> str:
    """``Type: message``, followed by the error it was raised from (DCP rewraps some errors)."""
    text = f"{type(error).__name__}: {error}"
    if error.__cause__ is not None:
        text += f" (from {type(error.__cause__).__name__}: {error.__cause__})"
    return text
