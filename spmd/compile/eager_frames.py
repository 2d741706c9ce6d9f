"""Keep Dynamo out of spmd's dispatcher when it runs eagerly inside a compiled function.

Where torch.compile breaks the graph (no ``fullgraph=True``), the op there runs eagerly with
Dynamo still watching new Python frames, so it would try to compile the dispatcher itself (locks,
caches, logging: not code to trace). Marking ``DTensor.__torch_dispatch__`` as skipped, with every
frame it calls, lets the op run as plain eager code. Tracing is unaffected: Dynamo never traces
``__torch_dispatch__`` (it runs it on fake tensors, and AOTAutograd traces through it).
Called once ``torch._dynamo`` is loaded (the first compile that meets a DTensor).
"""

from __future__ import annotations

from types import CodeType

__all__ = ["keep_dynamo_out_of_dispatch"]


def keep_dynamo_out_of_dispatch(dispatch_code: CodeType) -> None:
    """Have Dynamo skip ``dispatch_code`` (``DTensor.__torch_dispatch__``'s code) and every frame it calls."""
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

    set_code_exec_strategy(dispatch_code, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP))
