"""Whether torch.compile is tracing on the calling thread.

``torch.compiler.is_compiling()`` is one flag for the whole process. In the threaded world each rank
is a thread, so while one rank compiles the flag is also up on its peers, which are running eager
code: a peer reading it would skip a check, take a compile-only branch or issue a different
sequence of collectives than its group. The tracing context torch.compile installs (for Dynamo and
for AOTAutograd after it) is per thread, so it tells the compiling thread from its peers.
"""

from __future__ import annotations

import torch
from torch._guards import TracingContext

__all__ = ["compiling_here"]


def compiling_here() -> bool:
    """True while torch.compile (or export) traces the code running on the calling thread.

    Dynamo folds ``is_dynamo_compiling()`` to True in what it traces, so it never looks further;
    AOTAutograd runs the Python code for real under the process-wide flag, with its thread's context.
    """
    return torch.compiler.is_dynamo_compiling() or (
        torch.compiler.is_compiling() and TracingContext.try_get() is not None
    )
