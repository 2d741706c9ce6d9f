"""Context parallel per rank, cp = 1, 2, 4 over growing sequences: activation memory, step time, bytes received.

Run ``python benchmarks/context_parallel.py`` (``--quick`` for sequences of 1k and 2k and fewer
repeats, under a minute; ``--seqs`` and ``--repeats`` to choose).

The model is one causal attention block on plain tensors, as a model that knows nothing of DTensor
is written: ``tokens`` (batch 1, ``seq``) -> embedding (256, float32) -> q, k, v projections ->
``(1, 4, seq, 64)`` -> ``F.scaled_dot_product_attention(is_causal=True)`` -> output projection; the
loss is the sum of squares of the output. cp=1 is plain torch on one process (one device). For cp = 2 and 4 each rank
runs the same module under ``spmd.tensor.experimental.context_parallel(mesh, buffers=[tokens],
buffer_seq_dims=[1])``: ``tokens`` is cut head-tail into the rank's ``seq / cp`` rows and attention is
exact over the whole sequence (one all-gather of k and v forward; an all-gather and a
reduce-scatter of dk, dv backward). Every cp runs on gloo processes over loopback, one intra-op
thread each (as one device per rank): the threaded world would put the ranks' Python dispatch
under one GIL.

Per rank, the largest over the ranks:

* saved: bytes saved for backward during one forward, from ``torch.autograd.graph.saved_tensors_hooks``:
  the unique storages (of the local tensors, for DTensors) of every tensor autograd packs, less the
  parameters'. The done-when: at cp=4, at most 1.3 x 1/4 of cp=1's.
* peak: the most bytes live at once among the storages allocated during one forward + backward
  (``spmd.simulate.memory.MemoryTracker``, a dispatch mode following each storage from allocation to
  free): saved activations, the transient whole-sequence k and v each rank gathers, activation
  gradients; parameters' gradients left out (a constant of the model, not of cp).
* step: forward + backward, median over the repeats of the slowest rank's time (a barrier before
  each step), after one warm-up step; the context is entered once, outside the timed steps.
* received: bytes a rank receives per attention call (forward, and forward + backward), from
  ``CommDebugMode.get_total_bytes()`` (ring accounting of each recorded collective:
  ``(n-1)/n`` of an all-gather's result or a reduce-scatter's input), against the ring's lower
  bound: ``(cp-1)/cp`` of the k and v bytes forward, the same again for dk, dv backward.

The sum over ranks of the loss is checked against cp=1's (``loss rel diff``). torch's DTensor runs
the same module under ``torch.distributed.tensor.experimental.context_parallel`` once, on the cp=2
world at the first sequence length; where it fails (on CPU it does), the table says why, with
torch's own error.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
import warnings
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from spmd.simulate.memory import MemoryTracker
from spmd.tensor import DTensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.tensor.experimental import context_parallel
from spmd.tensor.trace import human_bytes
from spmd.testing import run_multiprocess

DIM, HEADS, VOCAB = 256, 4, 1024
HEAD_DIM = DIM // HEADS
CPS = (1, 2, 4)
TIMEOUT_S = 900.0
"""Longest one world (all sequence lengths of one cp) may take."""


class AttentionBlock(nn.Module):
    """Token embedding, q/k/v projections, causal SDPA, output projection, on plain (batch, seq) tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        batch, seq, _ = x.shape
        q, k, v = (w(x).view(batch, seq, HEADS, HEAD_DIM).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, DIM))


@dataclass(frozen=True, kw_only=True, slots=True)
class Measure:
    """One rank's figures for one (cp, seq)."""

    saved: int
    peak: int
    step_s: tuple[float, ...]
    forward_bytes: int
    backward_bytes: int
    collectives: str
    loss: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    """One (cp, seq): the figures of the worst rank, and the ranks' summed loss."""

    cp: int
    seq: int
    saved: int
    peak: int
    step_ms: float
    forward_bytes: int
    total_bytes: int
    collectives: str
    loss: float

    @property
    def forward_bound(self) -> int:
        """The ring's lower bound per attention call, forward: (cp-1)/cp of the k and v bytes."""
        kv_bytes = 2 * self.seq * DIM * 4
        return (self.cp - 1) * kv_bytes // self.cp


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class SavedBytes:
    """``saved_tensors_hooks`` that add up the unique storages autograd saves, less the ``excluded`` ones."""

    def __init__(self, excluded: Sequence[torch.Tensor]) -> None:
        self.excluded = {t.untyped_storage().data_ptr() for t in excluded}
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = _local(t).untyped_storage()
        if storage.data_ptr() not in self.excluded:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    def hooks(self) -> AbstractContextManager[None]:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def _step(model: nn.Module, x: torch.Tensor) -> float:
    loss = model(x).square().sum()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return float(loss.detach())


def measure(model: nn.Module, x: torch.Tensor, repeats: int) -> Measure:
    """Time, memory and collectives of one rank's steps of ``model`` on its rows ``x`` (context already open)."""
    params = list(model.parameters())
    step_s = []
    for i in range(1 + repeats):
        dist.barrier()
        start = time.perf_counter()
        loss = _step(model, x)
        if i:
            step_s.append(time.perf_counter() - start)
    saved = SavedBytes(excluded=params)
    with MemoryTracker(known=[*(p.untyped_storage() for p in params), x.untyped_storage()]) as tracker:
        with saved.hooks():
            out = model(x).square().sum()
        out.backward()
        grads = [tracker.token_of(p.grad.untyped_storage()) for p in params if p.grad is not None]
    peak = tracker.peak(excluding=[g for g in grads if g is not None])
    model.zero_grad(set_to_none=True)
    with CommDebugMode() as forward:
        out = model(x).square().sum()
    with CommDebugMode() as backward:
        out.backward()
    counts = {**{f"fwd {k}": n for k, n in forward.get_comm_counts().items() if n},
              **{f"bwd {k}": n for k, n in backward.get_comm_counts().items() if n}}  # fmt: skip
    return Measure(
        saved=saved.total,
        peak=peak,
        step_s=tuple(step_s),
        forward_bytes=forward.get_total_bytes(),
        backward_bytes=backward.get_total_bytes(),
        collectives=", ".join(f"{k} x{n}" for k, n in counts.items()) or "none",
        loss=loss,
    )


def _inputs(seq: int) -> tuple[nn.Module, torch.Tensor]:
    """The same model and input on every rank and every cp."""
    torch.manual_seed(0)
    model = AttentionBlock()
    x = torch.randint(VOCAB, (1, seq), generator=torch.Generator().manual_seed(seq))
    return model, x


def _quiet_torch() -> None:
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def try_torch(cp: int, seq: int) -> str | None:
    """torch's own context parallel on the same module: None when it runs, else its error."""
    from torch.distributed.device_mesh import init_device_mesh as torch_device_mesh
    from torch.distributed.tensor.experimental import context_parallel as torch_context_parallel

    mesh = torch_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    model, x = _inputs(seq)
    try:
        with torch_context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):
            _step(model, x)
    except Exception as error:  # torch's failure is the figure to report
        return _first_line(error)
    finally:
        dist.barrier()
    return None


def _rank(cp: int, seqs: Sequence[int], repeats: int, try_torch_at: int | None) -> tuple[list[Measure], str | None]:
    """One gloo rank of a cp world: every sequence length in turn, then torch's attempt if asked."""
    _quiet_torch()
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",)) if cp > 1 else None
    results = []
    for seq in seqs:
        model, x = _inputs(seq)
        if mesh is None:
            results.append(measure(model, x, repeats))
            continue
        with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):
            results.append(measure(model, x, repeats))
    torch_note = try_torch(cp, try_torch_at) if try_torch_at is not None else None
    return results, torch_note


def run_world(cp: int, seqs: Sequence[int], repeats: int, try_torch_at: int | None) -> tuple[list[Row], str | None]:
    per_rank = run_multiprocess(_rank, cp, cp, seqs, repeats, try_torch_at, timeout=TIMEOUT_S)
    rows = []
    for i, seq in enumerate(seqs):
        ranks = [measures[i] for measures, _ in per_rank]
        slowest = [max(steps) for steps in zip(*(m.step_s for m in ranks))]
        rows.append(
            Row(
                cp=cp,
                seq=seq,
                saved=max(m.saved for m in ranks),
                peak=max(m.peak for m in ranks),
                step_ms=statistics.median(slowest) * 1e3,
                forward_bytes=max(m.forward_bytes for m in ranks),
                total_bytes=max(m.forward_bytes + m.backward_bytes for m in ranks),
                collectives=ranks[0].collectives,
                loss=sum(m.loss for m in ranks),
            )
        )
    return rows, per_rank[0][1]


def _ratio(ours: float, base: float) -> str:
    return f"{ours / base:.2f}" if base else "-"


def print_table(rows: Sequence[Row], repeats: int) -> None:
    print(
        f"causal attention block (dim {DIM}, {HEADS} heads of {HEAD_DIM}, batch 1, float32), per rank (worst rank); "
        f"gloo processes, 1 thread each; step = median of {repeats} after 1 warm-up"
    )
    print(
        f"{'seq':>6}{'cp':>4}{'saved':>11}{'/cp1':>6}{'x cp':>6}{'peak':>11}{'/cp1':>6}{'step ms':>10}{'/cp1':>6}"
        f"{'recv fwd':>11}{'/min':>6}{'recv f+b':>11}{'/min':>6}{'loss rel diff':>15}"
    )
    base = {r.seq: r for r in rows if r.cp == 1}
    for r in rows:
        one = base[r.seq]
        forward_ratio = _ratio(r.forward_bytes, r.forward_bound) if r.cp > 1 else "-"
        total_ratio = _ratio(r.total_bytes, 2 * r.forward_bound) if r.cp > 1 else "-"
        diff = abs(r.loss - one.loss) / abs(one.loss)
        print(
            f"{r.seq:>6}{r.cp:>4}{human_bytes(r.saved):>11}{_ratio(r.saved, one.saved):>6}"
            f"{r.saved * r.cp / one.saved:>6.2f}{human_bytes(r.peak):>11}{_ratio(r.peak, one.peak):>6}"
            f"{r.step_ms:>10.1f}{_ratio(r.step_ms, one.step_ms):>6}{human_bytes(r.forward_bytes):>11}{forward_ratio:>6}"
            f"{human_bytes(r.total_bytes):>11}{total_ratio:>6}{diff:>15.1e}"
        )
    print(
        "min: the ring's lower bound, (cp-1)/cp of k and v forward; f+b adds as much for dk, dv. "
        "peak includes the whole sequence's k, v (2 x seq x dim x 4 bytes: "
        f"{human_bytes(2 * max(r.seq for r in rows) * DIM * 4)} at seq {max(r.seq for r in rows)}) that each rank gathers"
    )
    print("collectives per step:", "; ".join(sorted({f"cp={r.cp}: {r.collectives}" for r in rows})))
    at_four = [r for r in rows if r.cp == 4]
    if at_four:
        factor = max(r.saved * 4 / base[r.seq].saved for r in at_four)
        verdict = "met" if factor <= 1.3 else "NOT met"
        print(f"saved per rank at cp=4: at most {factor:.2f} x 1/4 of cp=1's (target <= 1.30: {verdict})")


def main(argv: Sequence[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="sequences 1k and 2k, 2 repeats (under a minute)")
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192], help="sequence lengths")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per (cp, seq)")
    args = parser.parse_args(argv)
    seqs, repeats = ([1024, 2048], 2) if args.quick else (args.seqs, args.repeats)
    _quiet_torch()
    start = time.perf_counter()
    rows: list[Row] = []
    torch_note: str | None = None
    for cp in CPS:
        world_rows, note = run_world(cp, seqs, repeats, seqs[0] if cp == 2 else None)
        rows += world_rows
        torch_note = note if cp == 2 else torch_note
    print_table(rows, repeats)
    if torch_note is None:
        print(f"torch: ran its context_parallel at cp=2, seq {seqs[0]} (not timed here)")
    else:
        print(f"torch: not run ({torch_note})")
    print(f"ran in {time.perf_counter() - start:.1f} s")
    return rows


if __name__ == "__main__":
    main()
