"""torch.compile's "is compiling" flag is one per process; spmd asks whether the calling thread traces.

In the threaded world one rank compiling must not change what its peers, running eager code, do:
they keep their checks and their collectives, or the group's sequences drift apart.
"""

from __future__ import annotations

import threading

import torch

from spmd.compile.compiling import compiling_here


def test_a_peer_thread_is_not_compiling_while_another_thread_compiles() -> None:
    entered, seen = threading.Event(), threading.Event()

    def compiling_rank() -> None:
        with torch.compiler._compile_session_context():  # what torch.compile holds while it compiles
            entered.set()
            seen.wait(10)

    thread = threading.Thread(target=compiling_rank)
    thread.start()
    try:
        assert entered.wait(10)
        assert torch.compiler.is_compiling()  # the process-wide flag is up ...
        assert not compiling_here()  # ... but this thread runs eager code
    finally:
        seen.set()
        thread.join()


def test_traced_code_sees_itself_compiling() -> None:

    def probe(x: torch.Tensor) -> torch.Tensor:
        return x + 1 if compiling_here() else x - 1

    assert torch.equal(probe(torch.zeros(2)), -torch.ones(2))
    compiled = torch.compile(probe, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(torch.zeros(2)), torch.ones(2))
