"""What torch.compile's guards on DTensor inputs say when they fail, and the error for value-dependent shapes."""

from __future__ import annotations

import logging
from typing import Any

from spmd.tensor.placement import Placement
from spmd.tensor.spec import DTensorSpec

__all__ = ["FlatContext", "DataDependentShapeError", "CompiledInputMismatch", "describe_change", "COMPILE_LOGGER"]

FlatContext = tuple[DTensorSpec, bool, int | None, tuple[Placement, ...] | None]
"""What ``__tensor_flatten__`` hands torch.compile: spec, requires_grad, rank thread, to_local()'s mark."""


class DataDependentShapeError(NotImplementedError):
    """An op whose output shape depends on its inputs' values ran on DTensors inside torch.compile.

    A ``NotImplementedError``, so that Dynamo without ``fullgraph=True`` breaks the graph there and
    runs the op eagerly.
    """

    def __init__(self, op: Any) -> None:
        super().__init__(
            f"{op} gives an output whose shape depends on the values of its inputs; under torch.compile that "
            "shape is a symbol, which a DTensor's spec (static shapes) cannot hold. Call it outside the compiled "
            "function, or let torch.compile break the graph there (no fullgraph=True)"
        )


COMPILE_LOGGER = logging.getLogger("spmd.compile")


class CompiledInputMismatch(Exception):
    """A DTensor input's flatten context differs from the one a compiled graph was traced for."""

    def __init__(self, expected: FlatContext, actual: FlatContext):
        super().__init__()
        self.expected, self.actual = expected, actual

    def __str__(self) -> str:
        return f"DTensor input differs from the compiled graph's: {describe_change(self.expected, self.actual)}"


def describe_change(
    expected: FlatContext, actual: FlatContext
) -> str:
    """``spec f32[4,2] (S(0)) on mesh(d0=2) -> f32[4,2] (R) on mesh(d0=2)``: what a failed guard saw."""
    names = ("spec", "requires_grad", "rank", "to_local()'s gradient placements")
    return "; ".join(f"{name} {old} -> {new}" for name, old, new in zip(names, expected, actual) if old != new)
