"""Entry points into compile modules that import ``torch._dynamo`` (about 1.5 s), loaded on first use."""

from __future__ import annotations

from typing import Any

__all__ = ["from_local_in_graph"]


def from_local_in_graph(*args: Any, **kwargs: Any) -> Any:
    """``spmd.compile.from_local.from_local_in_graph``, imported at the first call (while Dynamo traces,
    which runs the import eagerly)."""
    from spmd.compile.from_local import from_local_in_graph as in_graph

    return in_graph(*args, **kwargs)
