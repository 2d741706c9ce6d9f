"""spmd on one GPU (or on CPU) in one table: the demo, FSDP, compile, torchrun, AdamW, the op sweep, overheads.

Run from a checkout, nothing installed (the script puts the checkout on ``sys.path``)::

    python benchmarks/cuda_check.py                     # --device cuda when torch sees a GPU, else cpu
    python benchmarks/cuda_check.py --device cpu        # 4 steps, 30 sweep ops: about a minute on 2 cores
    python benchmarks/cuda_check.py --rows demo,sweep   # some checks only (``--list`` names them)

It prints the torch, CUDA and Python versions and one table, a line per check, each ``ok`` or
``FAILED`` with its figure, and exits 1 if any check failed:

* ``demo``, ``demo-fsdp``, ``demo-compile``: the demo GPT of ``examples/train_transformer.py``
  (dp=2 x tp=2, sequence parallel) on the threaded world, 4 rank threads sharing the one device,
  against the same steps on one device: the losses agree (rtol 1e-4 on CPU, 1e-3 on CUDA), and the
  4-rank step time over one device's (rank 0's median; the one-device step is eager in all three).
  ``--fsdp`` shards over dp with ``fully_shard``; ``--compile`` compiles forward + loss and the
  AdamW step (``--compile-backend``: inductor by default on cuda, aot_eager on cpu).
* ``torchrun``: the same step in a world of 1 under ``torchrun --nproc-per-node 1`` (NCCL on
  cuda, gloo on cpu) on a (1, 1) mesh, against one device.
* ``adamw``: ``torch.optim.AdamW(fused=True)`` and ``(foreach=True)`` on
  DTensor parameters (4 rank threads, a (2, 2) mesh, even, uneven and replicated layouts) against
  the same optimizer on the plain whole tensors: values agree; rank 0's step over the plain step.
* ``sweep`` (float32 and bfloat16): the CI slice of the OpInfo sweep
  (``spmd.testing.op_sweep.SLICE_OPS``, the ops ``tests/tensor/test_dtensor_ops.py`` runs), rules
  alone (no replicate fallback), 4 rank threads; ok when no value is wrong and only the ops the CI
  test expects to fail fail. bfloat16 compares with bfloat16 tolerances (plain torch in bfloat16 is
  the oracle, and a sharded reduction adds in another order). ``--sweep-ops N`` takes N ops spread
  over the slice (default all on cuda, 30 on cpu). On cuda the samples are made on CPU (as the CI test makes them) and distributed
  to the GPU.
* ``dispatch``: eager overhead per op, ours over ``torch.distributed.tensor``'s
  (``benchmarks/dispatch_overhead.py``'s ops and timing, rank 0 of a 4-rank fake process group).
* ``tp-step``: the demo's training step under tp=2 on 2 threads sharing the device, ours over
  torch's (``benchmarks/tp_step.py``'s plan; torch's DTensor on its threaded test process group):
  step time ratio and the two libraries' loss difference.

The time ratios are figures, not pass/fail criteria: a check fails when it raises, times out or
gives a wrong value. Each check runs in its own process (``--row-timeout`` seconds at most), so
one that hangs or crashes leaves the rest of the table standing.

Rank threads and CUDA autograd: for a CUDA tensor, ``backward()`` does not run on the calling
thread but on autograd's one engine thread for that GPU, which every rank thread's backward then
shares, and on which no rank of the threaded world is current. torch's own threaded test group
turns those threads off while it runs (``torch.autograd.set_multithreading_enabled(False)``).
``--autograd-device-threads off`` does the same around every check here, to see the rest of the
table while spmd's ``run_threaded`` does not do it itself; the default leaves autograd as is.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "examples"), ROOT):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch  # noqa: E402

RESULT_TAG = "CUDA_CHECK_ROW "
"""A worker prints each of its table rows as this tag followed by one JSON object."""

SWEEP_TEST = os.path.join(ROOT, "tests", "tensor", "test_dtensor_ops.py")


def expected_sweep_failures() -> frozenset[str]:
    """The slice ops the CI sweep test expects to fail on the rules alone: the keys of its ``XFAIL``.

    Read from the test's source (importing it would need pytest); empty if it cannot be read.
    """
    import ast

    try:
        with open(SWEEP_TEST) as file:
            tree = ast.parse(file.read())
    except OSError:
        return frozenset()
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(target, ast.Name) and target.id == "XFAIL" and isinstance(node.value, ast.Dict):
            return frozenset(key.value for key in node.value.keys if isinstance(key, ast.Constant))
    return frozenset()


BF16_RTOL, BF16_ATOL = 1.6e-2, 6.4e-2
"""The sweep's bfloat16 tolerances: torch's default rtol for bfloat16, and an atol (scaled by the
largest expected magnitude, as the sweep scales it) of about 8 bfloat16 epsilons (2**-7). One device's bfloat16
dot product rounds once, after adding in float32; a sharded one rounds each rank's partial sum and
then every addition of the all_reduce, and with cancellation a partial can exceed the result: the
CI slice's ``dot`` of 5 elements over 4 ranks lands 0.11 (4%) from one device's 2.58 on CPU."""


@dataclass(frozen=True, kw_only=True)
class Row:
    """One line of the table."""

    name: str
    ok: bool
    figure: str
    seconds: float | None = None
    """The check's time (its worker process), on the first of its rows."""
    details: str = ""
    """Why it failed (the end of the worker's output), printed after the table."""


@dataclass(frozen=True, kw_only=True)
class Options:
    """What the workers need of the command line."""

    device: str
    steps: int
    compile_backend: str
    sweep_ops: int
    autograd_device_threads: bool


# ----- the demo GPT on one device, on the threaded world and under torchrun ------------------------
def _demo_config(opts: Options, **changes: Any) -> Any:
    import train_transformer as demo

    return replace(demo.Config(), **{"steps": opts.steps, **changes})


def _loss_tolerance(device: str) -> float:
    return 1e-4 if device == "cpu" else 1e-3


def _timed_median_ms(step_s: Sequence[float]) -> float:
    """Median of the second half of the steps (the first ones compile, warm caches, create AdamW state)."""
    tail = step_s[len(step_s) // 2 :] or step_s
    return statistics.median(tail) * 1e3


def _train_on_mesh(cfg: Any, device: str) -> tuple[list[float], list[float]]:
    """The demo's ``train`` on ``device``, timed per step: (losses, seconds per step), this rank's."""
    import train_transformer as demo

    from spmd.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh(device, (cfg.dp, cfg.tp), mesh_dim_names=("dp", "tp"))
    model = demo.apply_tp_and_dp(
        demo.build_model(cfg).to(device), mesh, sequence_parallel=cfg.sequence_parallel, fsdp=cfg.fsdp
    )
    optimizer = demo.make_optimizer(model, cfg)
    loss_fn = demo.compile_model(model, cfg, mesh.size()) if cfg.compile else demo.next_token_loss
    optimizer_step = torch.compile(optimizer.step, backend=cfg.compile) if cfg.compile else optimizer.step
    losses: list[float] = []
    seconds: list[float] = []
    for step in range(cfg.steps):
        inputs, targets = (
            distribute_tensor(t, mesh, [Shard(0), Replicate()], src_data_rank=None) for t in demo.batch_at(cfg, step)
        )
        start = time.perf_counter()
        losses.append(demo.train_step(model, optimizer, inputs, targets, loss_fn, optimizer_step))  # .item() syncs
        seconds.append(time.perf_counter() - start)
    return losses, seconds


def _train_one_device(cfg: Any, device: str) -> tuple[list[float], list[float]]:
    """The same steps on plain tensors on one device (eager): (losses, seconds per step)."""
    import train_transformer as demo

    model = demo.build_model(cfg).to(device)
    optimizer = demo.make_optimizer(model, cfg)
    losses: list[float] = []
    seconds: list[float] = []
    for step in range(cfg.steps):
        inputs, targets = (t.to(device) for t in demo.batch_at(cfg, step))
        start = time.perf_counter()
        losses.append(demo.train_step(model, optimizer, inputs, targets))
        seconds.append(time.perf_counter() - start)
    return losses, seconds


def _compare_losses(
    name: str, got: tuple[list[float], list[float]], want: tuple[list[float], list[float]], device: str, world: str
) -> Row:
    losses, step_s = got
    expected, one_step_s = want
    rtol = _loss_tolerance(device)
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, expected))
    agree = len(losses) == len(expected) and all(abs(a - b) <= 1e-6 + rtol * abs(b) for a, b in zip(losses, expected))
    ours_ms, one_ms = _timed_median_ms(step_s), _timed_median_ms(one_step_s)
    figure = (
        f"loss max rel diff {worst:.1e} over {len(losses)} steps ({expected[0]:.3f} -> {expected[-1]:.3f}); "
        f"{world} {ours_ms:.1f} ms/step = {ours_ms / one_ms:.2f}x one device's {one_ms:.1f}"
    )
    return Row(name=name, ok=agree, figure=figure if agree else f"losses differ (rtol {rtol:g}): {figure}")


def row_demo(opts: Options, *, fsdp: bool = False, compile_backend: str | None = None) -> list[Row]:
    from spmd.testing import run_threaded

    cfg = _demo_config(opts, fsdp=fsdp, compile=compile_backend)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the 4 rank threads already keep the cores busy
    try:
        timeout = 600.0 if compile_backend else 120.0
        ours = run_threaded(_train_on_mesh, cfg.dp * cfg.tp, cfg, opts.device, timeout=timeout)[0]
    finally:
        torch.set_num_threads(threads)
    one = _train_one_device(replace(cfg, dp=1, tp=1, fsdp=False, compile=None), opts.device)
    name = (
        "demo GPT, 2x2 threads"
        + (" --fsdp" if fsdp else "")
        + (f" --compile {compile_backend}" if compile_backend else "")
    )
    return [_compare_losses(name, ours, one, opts.device, "4 threads")]


def row_torchrun(opts: Options) -> list[Row]:
    """Under torchrun (RANK set): the demo step on a (1, 1) mesh of the default group, then one device."""
    import torch.distributed as dist

    cfg = _demo_config(opts, dp=1, tp=1)
    try:
        ours = _train_on_mesh(cfg, opts.device)
        backend = dist.get_backend()
        one = _train_one_device(cfg, opts.device)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return [_compare_losses(f"demo GPT, torchrun world of 1 ({backend})", ours, one, opts.device, "(1, 1) mesh")]


# ----- AdamW, fused and foreach, on DTensors -------------------------------------------------------
ADAMW_PARAMS: tuple[tuple[tuple[int, ...], tuple[int | None, int | None]], ...] = (
    # (global shape, (mesh dim 0, mesh dim 1)): None is Replicate, d is Shard(d)
    ((64, 48), (0, 1)),
    ((48, 16), (1, None)),
    ((7, 5), (0, 0)),  # uneven: 4 + 3 rows, then 2 + 2 and 2 + 1
    ((32,), (None, None)),
    ((3, 33), (None, 1)),
)


def _adamw_tensors(device: str, steps: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Initial values and one gradient per step for each parameter, the same on every rank."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, generator=gen).to(device) for shape, _ in ADAMW_PARAMS]
    grads = [[torch.randn(shape, generator=gen).to(device) for shape, _ in ADAMW_PARAMS] for _ in range(steps)]
    return params, grads


def _adamw_run(
    params: list[torch.Tensor], grads: list[list[torch.Tensor]], impl: str, to_param: Callable[[int, torch.Tensor], Any]
) -> tuple[list[Any], list[float]]:
    """AdamW(``impl``) over the steps; the final parameters and the seconds of each step."""
    weights = [torch.nn.Parameter(to_param(i, p.clone())) for i, p in enumerate(params)]
    optimizer = torch.optim.AdamW(weights, lr=1e-2, weight_decay=0.01, **{impl: True})
    seconds: list[float] = []
    for step_grads in grads:
        for i, (weight, grad) in enumerate(zip(weights, step_grads)):
            weight.grad = to_param(i, grad.clone())
        start = time.perf_counter()
        optimizer.step()
        if weights[0].device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return weights, seconds


def _adamw_rank(device: str, impl: str, steps: int) -> tuple[list[torch.Tensor], list[float]]:
    from spmd.tensor import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh(device, (2, 2))

    def to_dtensor(i: int, tensor: torch.Tensor) -> Any:
        placements = [Replicate() if d is None else Shard(d) for d in ADAMW_PARAMS[i][1]]
        return distribute_tensor(tensor, mesh, placements)

    params, grads = _adamw_tensors(device, steps)
    weights, seconds = _adamw_run(params, grads, impl, to_dtensor)
    return [w.detach().full_tensor() for w in weights], seconds


def row_adamw(opts: Options) -> list[Row]:
    from spmd.testing import run_threaded

    rows = []
    steps = max(3 * opts.steps, 10)  # cheap steps: enough for a stable median
    for impl in ("fused", "foreach"):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            ours, ours_s = run_threaded(_adamw_rank, 4, opts.device, impl, steps, timeout=120.0)[0]
        finally:
            torch.set_num_threads(threads)
        params, grads = _adamw_tensors(opts.device, steps)
        plain, plain_s = _adamw_run(params, grads, impl, lambda _, t: t)
        diff = max(float((a - b.detach()).abs().max()) for a, b in zip(ours, plain))
        agree = all(
            torch.allclose(a, b.detach(), rtol=1e-5, atol=1e-6) and a.shape == b.shape for a, b in zip(ours, plain)
        )
        ours_ms, plain_ms = _timed_median_ms(ours_s), _timed_median_ms(plain_s)
        figure = (
            f"{len(ADAMW_PARAMS)} params on a (2, 2) mesh, {steps} steps: max |diff| {diff:.1e}; "
            f"step {ours_ms:.2f} ms (rank 0 of 4) = {ours_ms / plain_ms:.2f}x plain tensors' {plain_ms:.2f}"
        )
        rows.append(
            Row(
                name=f"AdamW({impl}=True) on DTensors", ok=agree, figure=figure if agree else f"values differ: {figure}"
            )
        )
    return rows


# ----- the CI op-sweep slice -----------------------------------------------------------------------
@contextlib.contextmanager
def _sweep_tolerances(rtol: float, atol: float) -> Any:
    from spmd.testing import op_sweep as sweep

    saved = sweep.RTOL, sweep.ATOL
    sweep.RTOL, sweep.ATOL = rtol, atol
    try:
        yield
    finally:
        sweep.RTOL, sweep.ATOL = saved


def _spread(items: list[Any], count: int) -> list[Any]:
    """``count`` items spread evenly over ``items`` (all of them when count is 0 or too large)."""
    if count <= 0 or count >= len(items):
        return items
    return [items[(i * len(items)) // count] for i in range(count)]


def row_sweep(opts: Options) -> list[Row]:
    import logging

    from spmd.testing import op_sweep as sweep

    logging.getLogger("spmd.tensor.dispatch").setLevel(logging.ERROR)
    try:
        op_db = sweep.load_op_db()
    except ImportError as error:  # torch's OpInfo database needs expecttest
        return [Row(name="op sweep", ok=False, figure=f"cannot load torch's OpInfo database: {error}")]
    wanted = set(sweep.SLICE_OPS)
    ops = _spread([o for o in sorted(op_db, key=sweep.op_key) if sweep.op_key(o) in wanted], opts.sweep_ops)
    library = sweep.spmd_library()
    if opts.device != "cpu":
        spmd_mesh = library.init_device_mesh
        library = replace(library, init_device_mesh=lambda _cpu, shape, **kw: spmd_mesh(opts.device, shape, **kw))
    expected_failures = expected_sweep_failures()
    rows = []
    for dtype, tolerances in ((torch.float32, (sweep.RTOL, sweep.ATOL)), (torch.bfloat16, (BF16_RTOL, BF16_ATOL))):
        prepared = sweep.prepare_ops(ops, dtype=dtype)  # on CPU, as the CI test does
        for op in prepared:
            for sample in op.samples:  # the backward's weights meet the gathered outputs on the device
                sample.grad_weights = {j: w.to(opts.device) for j, w in sample.grad_weights.items()}
        with _sweep_tolerances(*tolerances):
            outcomes = sweep.run_threaded_sweep(prepared, lib=library, fallback=False)
        reports = sweep.summarize(prepared, outcomes)
        count = {
            status: sum(1 for r in reports if r.status == status)
            for status in (sweep.PASS, sweep.FAIL_WRONG, sweep.ERROR_OTHER, sweep.NOT_IMPLEMENTED, "SKIP")
        }
        failing = sorted(
            r.key for r in reports if r.status in (sweep.FAIL_WRONG, sweep.ERROR_OTHER, sweep.NOT_IMPLEMENTED)
        )
        unexpected = [key for key in failing if key not in expected_failures]
        figure = (
            f"{len(reports)} ops, {sum(r.cases for r in reports)} cases: {count[sweep.PASS]} ok, "
            f"{count[sweep.FAIL_WRONG]} wrong, {count[sweep.ERROR_OTHER] + count[sweep.NOT_IMPLEMENTED]} error "
            f"({count[sweep.NOT_IMPLEMENTED]} not implemented), {count['SKIP']} skipped"
        )
        if unexpected:
            figure += "; unexpected: " + ", ".join(unexpected[:8]) + (" ..." if len(unexpected) > 8 else "")
        details = "\n".join(f"{r.status:<22} {r.key:<32} {r.worst}" for r in reports if r.key in unexpected)
        name = f"op sweep slice, {str(dtype).removeprefix('torch.')}"
        rows.append(Row(name=name, ok=not unexpected, figure=figure, details=details))
    return rows


# ----- ours vs torch.distributed.tensor: dispatch overhead and the TP step -----------------------
def row_dispatch(opts: Options) -> list[Row]:
    import dispatch_overhead as bench
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import spmd.tensor as ours

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=bench.WORLD)
    try:
        import torch.distributed.tensor as theirs
        from torch.distributed.device_mesh import init_device_mesh as torch_mesh

        our_mesh = ours.init_device_mesh(opts.device, (bench.WORLD,))
        their_mesh = torch_mesh(opts.device, (bench.WORLD,))
        iters, repeats = (200, 10) if opts.device != "cpu" else (100, 3)
        measured = bench.measure((ours, our_mesh), (theirs, their_mesh), iters=iters, repeats=repeats)
    finally:
        dist.destroy_process_group()
    ratios = {
        name: a / b for name, (a, b) in measured.items() if isinstance(a, float) and isinstance(b, float) and b > 0
    }
    ours_failed = [f"{name}: {a}" for name, (a, _) in measured.items() if isinstance(a, str)]
    theirs_failed = [name for name, (_, b) in measured.items() if isinstance(b, str)]
    if not ratios:
        return [
            Row(name="dispatch overhead, ours/torch", ok=False, figure="no op ran on both: " + "; ".join(ours_failed))
        ]
    geomean = math.exp(statistics.fmean(math.log(max(r, 1e-3)) for r in ratios.values()))
    worst = max(ratios, key=lambda name: ratios[name])
    figure = f"{len(ratios)} ops, ours/torch geo-mean {geomean:.2f}, worst {ratios[worst]:.2f} ({worst}): " + ", ".join(
        f"{name} {r:.2f}" for name, r in ratios.items()
    )
    if ours_failed:
        figure += "; ours failed: " + "; ".join(ours_failed)
    if theirs_failed:
        figure += "; torch failed: " + ", ".join(theirs_failed)
    return [Row(name="dispatch overhead, ours/torch", ok=not ours_failed, figure=figure)]


def _tp_trainer_type() -> type:
    import tp_step

    class DeviceTrainer(tp_step._Trainer):  # type: ignore[misc, name-defined]
        """``tp_step``'s trainer with the mesh, model and batch on ``device``."""

        def __init__(self, library: Any, cfg: Any, device: str) -> None:
            import train_transformer as demo

            self.library, self.cfg, self.device = library, cfg, device
            mesh = library.init_device_mesh(device, (tp_step.TP,), mesh_dim_names=("tp",))
            model = demo.build_model(cfg).to(device)
            library.parallelize_module(model, mesh, library.tp_plan())
            for block in model.layers:
                block.attn.n_heads //= tp_step.TP  # each rank's q/k/v output holds its own heads
            self.model = model
            # the same implementation for both libraries: the for-loop on CPU (torch's default there),
            # foreach on CUDA (torch's default for its own DTensor there)
            self.optimizer = torch.optim.AdamW(
                model.parameters(), lr=cfg.lr, weight_decay=0.01, foreach=device != "cpu"
            )

        def step(self, step: int) -> tuple[float, float]:
            import torch.nn.functional as F
            import train_transformer as demo

            inputs, targets = (t.to(self.device) for t in demo.batch_at(self.cfg, step))
            start = time.perf_counter()
            logits = self.model(inputs)
            with self.library.loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
                loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
            value = float(loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item())
            return time.perf_counter() - start, value

    return DeviceTrainer


def _tp_rank(library: Any, cfg: Any, device: str, warmup: int, steps: int) -> Any:
    import tp_step

    return tp_step.run_steps([_tp_trainer_type()(library, cfg, device)], warmup=warmup, steps=steps)[0]


def row_tp_step(opts: Options) -> list[Row]:
    import tp_step

    from spmd.testing import run_threaded

    tp_step._quiet_torch()
    warmup, steps = 2, max(opts.steps, 2)
    cfg = _demo_config(opts, dp=1, tp=tp_step.TP, steps=warmup + steps)
    torch.set_num_threads(1)
    library = tp_step._Library("ours")
    ours = run_threaded(_tp_rank, tp_step.TP, library, cfg, opts.device, warmup, steps, timeout=120.0)[0]
    try:
        from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel

        held = tp_step._Library("torch", loss_parallel_held=True)  # see tp_step.measure_threaded
        with torch_loss_parallel():
            theirs = tp_step.run_torch_threaded(_tp_rank, tp_step.TP, held, cfg, opts.device, warmup, steps)[0]
    except Exception as error:  # torch's test-only threaded group is not a supported API: report, don't fail
        figure = f"ours {ours.median_ms:.1f} ms/step; torch n/a ({type(error).__name__}: {str(error)[:120]})"
        return [Row(name="TP step, tp=2 threads, ours/torch", ok=True, figure=figure)]
    diff = max(abs(a - b) for a, b in zip(ours.losses, theirs.losses))
    agree = all(abs(a - b) <= 1e-5 + _loss_tolerance(opts.device) * abs(b) for a, b in zip(ours.losses, theirs.losses))
    figure = (
        f"{ours.median_ms:.1f} vs {theirs.median_ms:.1f} ms/step = {ours.median_ms / theirs.median_ms:.2f}x "
        f"(median of {steps}); max |loss diff| {diff:.1e}"
    )
    return [
        Row(name="TP step, tp=2 threads, ours/torch", ok=agree, figure=figure if agree else f"losses differ: {figure}")
    ]


# ----- the table: one worker process per check -----------------------------------------------------
CHECKS: dict[str, tuple[str, Callable[[Options], list[Row]]]] = {
    "demo": ("the demo GPT on 4 rank threads vs one device", row_demo),
    "demo-fsdp": ("the same with --fsdp", lambda opts: row_demo(opts, fsdp=True)),
    "demo-compile": (
        "the same with --compile (--compile-backend)",
        lambda opts: row_demo(opts, compile_backend=opts.compile_backend),
    ),
    "torchrun": ("the step in a world of 1 under torchrun, (1, 1) mesh", row_torchrun),
    "adamw": ("fused and foreach AdamW on DTensors vs plain tensors", row_adamw),
    "sweep": ("the CI op-sweep slice in float32 and bfloat16", row_sweep),
    "dispatch": ("eager dispatch overhead per op, ours/torch", row_dispatch),
    "tp-step": ("the TP training step, ours/torch", row_tp_step),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker_command(check: str, opts: Options) -> list[str]:
    args = [
        os.path.abspath(__file__),
        "--worker", check,
        "--device", opts.device,
        "--steps", str(opts.steps),
        "--compile-backend", opts.compile_backend,
        "--sweep-ops", str(opts.sweep_ops),
        "--autograd-device-threads", "on" if opts.autograd_device_threads else "off",
    ]  # fmt: skip
    if check == "torchrun":
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1"]
        return [*launcher, "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), *args]
    return [sys.executable, *args]


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def run_check(check: str, opts: Options, timeout_s: float) -> list[Row]:
    """The check's rows from a fresh process, or one FAILED row saying why there are none."""
    start = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    process = subprocess.Popen(
        _worker_command(check, opts), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        cwd=ROOT, start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = process.communicate(timeout=timeout_s)
        failure = None if process.returncode == 0 else f"exit status {process.returncode}"
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # the worker and, under torchrun, its child
        output, _ = process.communicate()
        failure = f"timed out after {timeout_s:.0f} s"
    except BaseException:  # Ctrl-C: the worker is in a session of its own, so take it down too
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        raise
    seconds = time.perf_counter() - start
    rows = [
        Row(**{**json.loads(line[len(RESULT_TAG) :]), "seconds": None if k else seconds})
        for k, line in enumerate(line for line in output.splitlines() if line.startswith(RESULT_TAG))
    ]
    if failure is None and rows:
        return rows
    last = [line for line in output.strip().splitlines() if line.strip() and not line.startswith(RESULT_TAG)]
    reason = failure or "no result"
    if last:
        reason += f": {last[-1][:160]}"
    return [*rows, Row(name=check, ok=False, figure=reason, seconds=None if rows else seconds, details=_tail(output))]


def worker_main(check: str, opts: Options) -> None:
    """Run one check in this process and print its rows for the parent to read."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    logging.getLogger("torch.distributed").setLevel(logging.ERROR)
    if opts.device == "cpu":
        torch.set_num_threads(1)  # rank threads and one-device runs alike: the cores are shared
    threads = (
        contextlib.nullcontext() if opts.autograd_device_threads else torch.autograd.set_multithreading_enabled(False)
    )
    with threads:
        try:
            rows = CHECKS[check][1](opts)
        except Exception as error:
            import traceback

            message = str(error).strip().splitlines()
            figure = f"{type(error).__name__}: {message[0][:200] if message else ''}"
            rows = [Row(name=check, ok=False, figure=figure, details=_tail(traceback.format_exc()))]
    if int(os.environ.get("RANK", "0")) == 0:
        for row in rows:
            print(
                RESULT_TAG + json.dumps({"name": row.name, "ok": row.ok, "figure": row.figure, "details": row.details}),
                flush=True,
            )


def versions(device: str) -> list[str]:
    cuda = torch.version.cuda or "none (a CPU build of torch)"
    lines = [
        f"torch {torch.__version__}, CUDA {cuda}, Python {platform.python_version()}, {platform.machine()}",
        f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, device {device}",
    ]
    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        try:
            version = torch.cuda.nccl.version()  # a tuple on recent torch, an int on older ones
            nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception as error:
            nccl = f"unknown ({type(error).__name__})"
        lines.append(f"GPUs: {names}; NCCL {nccl}")
    else:
        lines.append("GPUs: none visible to torch")
    return lines


def print_table(rows: Sequence[Row]) -> None:
    width = max(len(row.name) for row in rows) + 2
    print(f"\n{'check':<{width}}{'result':<8}{'s':>5}  figure")
    for row in rows:
        seconds = "" if row.seconds is None else f"{row.seconds:.0f}"
        print(f"{row.name:<{width}}{'ok' if row.ok else 'FAILED':<8}{seconds:>5}  {row.figure}")
    for row in rows:
        if not row.ok and row.details:
            print(f"\n--- {row.name}: FAILED\n{row.details}")


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, Options]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", choices=("cuda", "cpu"), default=default_device)
    parser.add_argument("--rows", default="all", help="comma-separated checks to run (see --list); default all")
    parser.add_argument("--list", action="store_true", help="name the checks and exit")
    parser.add_argument("--steps", type=int, help="training steps per run (default 20 on cuda, 4 on cpu)")
    parser.add_argument(
        "--compile-backend",
        choices=("inductor", "aot_eager", "eager"),
        help="torch.compile backend of demo-compile (default inductor on cuda, aot_eager on cpu: inductor's C++ "
        "compiles take over a minute on two cores)",
    )
    parser.add_argument(
        "--sweep-ops",
        type=int,
        help="sweep this many of the slice's ops, spread over it; 0 for all (default all on cuda, 30 on cpu)",
    )
    parser.add_argument("--row-timeout", type=float, help="seconds one check may take (default 300)")
    parser.add_argument(
        "--autograd-device-threads",
        choices=("on", "off"),
        default="on",
        help="off runs every backward on its rank thread (torch.autograd.set_multithreading_enabled(False)), "
        "as torch's threaded test group does; on (default) leaves autograd as users get it",
    )
    parser.add_argument("--worker", choices=sorted(CHECKS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no GPU (torch.cuda.is_available() is False); use --device cpu")
    steps = args.steps if args.steps is not None else (20 if args.device == "cuda" else 4)
    if steps < 2:
        parser.error(f"--steps must be at least 2, got {steps}")
    opts = Options(
        device=args.device,
        steps=steps,
        compile_backend=args.compile_backend or ("inductor" if args.device == "cuda" else "aot_eager"),
        sweep_ops=args.sweep_ops if args.sweep_ops is not None else (0 if args.device == "cuda" else 30),
        autograd_device_threads=args.autograd_device_threads == "on",
    )
    return args, opts


def main(argv: Sequence[str] | None = None) -> int:
    args, opts = parse_args(argv)
    if args.worker:
        worker_main(args.worker, opts)
        return 0
    if args.list:
        for name, (what, _) in CHECKS.items():
            print(f"{name:<14}{what}")
        return 0
    checks = list(CHECKS) if args.rows == "all" else [c.strip() for c in args.rows.split(",") if c.strip()]
    unknown = [c for c in checks if c not in CHECKS]
    if unknown:
        print(f"unknown check(s) {', '.join(unknown)}; choose from {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    timeout_s = args.row_timeout or 300.0
    print("\n".join(versions(opts.device)), flush=True)
    start = time.perf_counter()
    rows: list[Row] = []
    for check in checks:
        new = run_check(check, opts, timeout_s)
        for row in new:
            print(f"  {'ok' if row.ok else 'FAILED':<7}{row.name}", flush=True)
        rows += new
    print_table(rows)
    failed = sum(not row.ok for row in rows)
    print(f"\n{len(rows) - failed} ok, {failed} FAILED, in {time.perf_counter() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
