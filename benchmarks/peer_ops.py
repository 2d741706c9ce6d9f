"""Bytes moved per op, ours vs ``torch.distributed.tensor``, for the op/placement cases PyTorch's own
DTensor tests check communication of.

Run ``python benchmarks/peer_ops.py``. Each case builds the same inputs with both libraries on the
same 4 gloo processes (torch first, then ours), runs one op (and, for the autograd cases, its
backward) and records the collectives each library issues: ours from ``CommDebugMode``, torch's
from a ``TorchDispatchMode`` that sees its ``_c10d_functional`` ops. Bytes are the ring-algorithm
bytes a rank receives (``benchmarks/redistribute.py`` defines the accounting), maximum over ranks.
A case passes when ours moves no more than torch; the script exits non-zero otherwise.

The cases follow the test that checks them (file::test in the table); shapes are the tests' or
smaller where only the pattern matters.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from redistribute import TIMEOUT_S, _torch_collective, format_ratio, human_bytes, ratio, ring_bytes

from spmd.testing import run_multiprocess

WORLD = 4


@dataclass(frozen=True)
class Case:
    """One op on DTensors: ``setup(lib, mesh, rank)`` builds the inputs, ``run(inputs)`` is counted."""

    label: str
    test: str
    setup: Callable[[Any, Any, int], Any]
    run: Callable[[Any], Any]


def _seeded(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _partial_pair(reduce_op: str) -> Callable[[Any, Any, int], Any]:
    def setup(lib: Any, mesh: Any, rank: int) -> Any:
        a = lib.DTensor.from_local(_seeded(rank, 8, 8), mesh, [lib.Partial(reduce_op)])
        b = lib.DTensor.from_local(_seeded(rank + 10, 8, 8), mesh, [lib.Partial(reduce_op)])
        return a, b

    return setup


def _gather_setup(lib: Any, mesh: Any, rank: int) -> Any:
    x = lib.distribute_tensor(_seeded(0, 12, 8, 16), mesh, [lib.Shard(1)])
    index = lib.distribute_tensor(torch.randint(8, (4, 1, 8), generator=torch.Generator().manual_seed(1)),
                                  mesh, [lib.Replicate()])
    return x, index


def _linear_setup(lib: Any, mesh: Any, rank: int) -> Any:
    x = lib.distribute_tensor(_seeded(0, 1, 47, 256), mesh, [lib.Replicate()])
    w = lib.distribute_tensor(_seeded(1, 256, 256), mesh, [lib.Shard(0)])
    return x, w


def _linear_run(inputs: Any) -> Any:
    with torch.inference_mode():  # aten.linear itself, not its decomposition
        return torch.nn.functional.linear(*inputs)


def _uneven_view_setup(lib: Any, mesh: Any, rank: int) -> Any:
    return lib.distribute_tensor(_seeded(0, WORLD + 1, 2, 2, 2), mesh, [lib.Shard(0)])


def _p_to_p_backward_setup(lib: Any, mesh: Any, rank: int) -> Any:
    x = lib.distribute_tensor(torch.ones(12, 3, requires_grad=True), mesh, [lib.Partial()])
    y = x.redistribute(mesh, [lib.Partial()], backward_dtype=torch.float64)  # a real autograd node
    grad = lib.DTensor.from_local(torch.ones(12, 3), mesh, [lib.Partial()])
    return y, grad


def _local_partial_grad_setup(lib: Any, mesh: Any, rank: int) -> Any:
    x = lib.distribute_tensor(_seeded(0, 12, 3).requires_grad_(), mesh, [lib.Replicate()])
    return x, mesh, lib


def _local_partial_grad_run(inputs: Any) -> Any:
    x, mesh, lib = inputs
    out = x.redistribute(mesh, [lib.Replicate()]).to_local(grad_placements=[lib.Partial()])
    out.backward(torch.ones_like(out))


def _fill_setup(lib: Any, mesh: Any, rank: int) -> Any:
    return lib.DTensor.from_local(torch.ones(4, 8), mesh, [lib.Partial()])


def _new_empty_strided_setup(lib: Any, mesh: Any, rank: int) -> Any:
    return lib.distribute_tensor(_seeded(0, 12, 8), mesh, [lib.Shard(1)])


def _mm_setup(lib: Any, mesh: Any, rank: int) -> Any:
    a = lib.distribute_tensor(_seeded(0, 16, 32), mesh, [lib.Shard(1)])
    b = lib.distribute_tensor(_seeded(1, 32, 8), mesh, [lib.Shard(0)])
    return a, b


def _sharded_setup(lib: Any, mesh: Any, rank: int) -> Any:
    return lib.distribute_tensor(_seeded(0, 16, 12), mesh, [lib.Shard(0)])


CASES = (
    Case("P(sum) * P(sum)", "test_pointwise_ops::test_mul_partial", _partial_pair("sum"), lambda ab: ab[0] * ab[1]),
    Case("maximum(P(max), P(max))", "test_pointwise_ops::test_partial_propagation",
         _partial_pair("max"), lambda ab: torch.maximum(*ab)),
    Case("minimum(P(min), P(min))", "test_pointwise_ops::test_partial_propagation",
         _partial_pair("min"), lambda ab: torch.minimum(*ab)),
    Case("gather(S(1) input, dim 1, R index)", "test_tensor_ops::test_gather",
         _gather_setup, lambda xi: torch.gather(xi[0], 1, xi[1])),
    Case("linear(R x, S(0) weight)", "test_matrix_ops::test_aten_linear", _linear_setup, _linear_run),
    Case("view of uneven S(0)", "test_view_ops::test_dtensor_view_op_uneven",
         _uneven_view_setup, lambda x: x.view(WORLD + 1, 2, 4)),
    Case("backward of P -> P redistribute", "test_redistribute::test_partial_to_partial_forward_backward",
         _p_to_p_backward_setup, lambda yg: yg[0].backward(yg[1])),
    Case("to_local(grad_placements=[P]) backward", "test_redistribute::test_replicate_to_local_partial_grad",
         _local_partial_grad_setup, _local_partial_grad_run),
    Case("fill_ on P(sum)", "test_tensor_ops::test_fill_inplace_partial_sum", _fill_setup, lambda x: x.fill_(2.0)),
    Case("new_empty_strided of S(1)", "test_tensor_ops::test_new_empty_strided",
         _new_empty_strided_setup, lambda x: x.new_empty_strided((12, 8), (8, 1))),
    Case("mm(S(1), S(0)) then full_tensor", "test_matrix_ops::test_mm",
         _mm_setup, lambda ab: torch.mm(*ab).full_tensor()),
    Case("sum over the sharded dim of S(0)", "test_tensor_ops (reductions)", _sharded_setup,
         lambda x: x.sum(0).full_tensor()),
    Case("softmax over the sharded dim of S(0)", "test_pointwise_ops / test_tensor_ops", _sharded_setup,
         lambda x: torch.softmax(x, 0)),
    Case("S(0) -> S(1) redistribute", "test_redistribute::test_shard_to_shard", _sharded_setup,
         lambda x: x.redistribute(x.device_mesh, [type(x.placements[0])(1)])),
)


@dataclass(frozen=True)
class Measured:
    bytes: int
    collectives: tuple[tuple[str, int, int], ...]
    error: str = ""


def _torch_lib() -> Any:
    from torch.distributed import tensor as tdt

    return SimpleNamespace(DTensor=tdt.DTensor, distribute_tensor=tdt.distribute_tensor, Shard=tdt.Shard,
                           Replicate=tdt.Replicate, Partial=tdt.Partial)


def _spmd_lib() -> Any:
    import spmd.tensor as st

    return SimpleNamespace(DTensor=st.DTensor, distribute_tensor=st.distribute_tensor, Shard=st.Shard,
                           Replicate=st.Replicate, Partial=st.Partial)


def _measure_torch(cases: Sequence[Case], rank: int) -> list[Measured]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode

    class CountCollectives(TorchCommDebugMode):
        """torch's own CommDebugMode (it sees the collectives DTensor's dispatch issues), recording sizes."""

        def __init__(self) -> None:
            super().__init__()
            self.collectives: list[tuple[str, int, int]] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if not any(t is not torch.Tensor for t in types):
                record = _torch_collective(func, args)
                if record is not None:
                    self.collectives.append(record)
            return super().__torch_dispatch__(func, types, args, kwargs)

    lib, mesh = _torch_lib(), init_device_mesh("cpu", (WORLD,))
    results = []
    for case in cases:
        inputs = case.setup(lib, mesh, rank)
        try:
            with CountCollectives() as mode:
                case.run(inputs)
        except Exception as error:  # a refusal is a result: printed in the table
            results.append(Measured(0, (), f"{type(error).__name__}: {str(error).splitlines()[0][:60]}"))
            continue
        results.append(Measured(sum(ring_bytes(*c) for c in mode.collectives), tuple(mode.collectives)))
    return results


def _measure_ours(cases: Sequence[Case], rank: int) -> list[Measured]:
    from spmd.tensor import init_device_mesh
    from spmd.tensor.debug import CommDebugMode

    lib, mesh = _spmd_lib(), init_device_mesh("cpu", (WORLD,))
    results = []
    for case in cases:
        inputs = case.setup(lib, mesh, rank)
        try:
            with CommDebugMode() as mode:
                case.run(inputs)
        except Exception as error:  # a refusal is a result: printed in the table
            results.append(Measured(0, (), f"{type(error).__name__}: {str(error).splitlines()[0][:60]}"))
            continue
        records = tuple((r.kind, r.group_size, r.tensor_bytes) for r in mode.records)
        results.append(Measured(sum(ring_bytes(*r) for r in records), records))
    return results


def _gloo_rank() -> tuple[list[Measured], list[Measured]]:
    """One gloo rank: every case with torch, then with ours (cases are module-level, not pickled)."""
    cases = CASES
    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    rank = torch.distributed.get_rank()
    return _measure_torch(cases, rank), _measure_ours(cases, rank)


def _describe(collectives: Sequence[tuple[str, int, int]]) -> str:
    return " ".join(sorted(kind for kind, _, _ in collectives)) or "-"


def report(cases: Sequence[Case], gathered: list[tuple[list[Measured], list[Measured]]]) -> bool:
    """Print the table; True when ours moves no more than torch in every case torch runs."""
    ok = True
    print(f"{'case':40} {'ours':>11} {'torch':>11} {'ours/torch':>10}  collectives (ours | torch)")
    for i, case in enumerate(cases):
        theirs = [g[0][i] for g in gathered]
        ours = [g[1][i] for g in gathered]
        if ours[0].error:
            ok = False
            print(f"{case.label:40} ours FAILED: {ours[0].error}")
            continue
        ours_bytes, torch_bytes = max(m.bytes for m in ours), max(m.bytes for m in theirs)
        torch_text = "refuses" if theirs[0].error else human_bytes(torch_bytes)
        value = None if theirs[0].error else ratio(ours_bytes, torch_bytes)
        if not theirs[0].error and ours_bytes > torch_bytes:
            ok = False
        print(f"{case.label:40} {human_bytes(ours_bytes):>11} {torch_text:>11} {format_ratio(value):>10}  "
              f"{_describe(ours[0].collectives)} | {_describe(theirs[0].collectives)}")
    print("\ncases from: " + "; ".join(dict.fromkeys(c.test for c in cases)))
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    started = time.monotonic()
    gathered = run_multiprocess(_gloo_rank, WORLD, timeout=TIMEOUT_S)
    ok = report(CASES, gathered)
    print(f"{len(CASES)} cases on {WORLD} gloo processes in {time.monotonic() - started:.0f}s: "
          + ("ours <= torch everywhere" if ok else "OURS MOVES MORE SOMEWHERE (or failed)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
