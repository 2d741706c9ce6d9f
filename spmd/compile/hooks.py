"""What spmd/compile's lazily loaded modules need from DTensor, handed over without importing it.

``spmd.tensor.dtensor`` fills these when it is imported; the modules that import ``torch._dynamo``
(loaded only once a compile is under way) read them. So DTensor may import those modules lazily
and they never import DTensor back: the import graph has no cycle.
"""

from __future__ import annotations

from collections.abc import Callable
from types import CodeType
from typing import Any

__all__ = ["EAGER_FROM_LOCAL", "DISPATCH_CODE"]

EAGER_FROM_LOCAL: list[Callable[..., Any]] = []
"""``DTensor.from_local``'s eager body (``from_local_eager``), once spmd.tensor.dtensor is loaded."""
DISPATCH_CODE: list[CodeType] = []
"""The code object of ``DTensor.__torch_dispatch__``, whose frames Dynamo must skip."""
