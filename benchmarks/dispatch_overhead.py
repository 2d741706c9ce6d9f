"""Per-op eager overhead of DTensor dispatch: ours vs ``torch.distributed.tensor``, same process.

Overhead is the time of the op on a DTensor minus the time of the same op on the plain local
tensor, for small tensors and a warm decision cache, so it measures the library, not the kernel.
Both libraries run on one process that is rank 0 of a 4-rank "fake" process group (torch's test
backend whose collectives do nothing): every row uses placements that need no communication, so
the fake group is never asked to move data. Each figure is the fastest of many batches, and the
four timings of a row (ours and torch's, on DTensors and on local tensors) are taken in turns, so a
busy machine slows both sides alike. Run: ``python benchmarks/dispatch_overhead.py``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing._internal.distributed.fake_pg import FakeStore

WORLD = 4


def timed_batch_us(fn: Callable[[], Any], iters: int) -> float:
    """Mean time of one call over a batch of ``iters`` calls, in microseconds."""
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e6


def cases(lib: Any, mesh: Any) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    """Row name -> (op on DTensors, same op on the local tensors)."""
    Shard, Replicate = lib.Shard, lib.Replicate
    g = torch.Generator().manual_seed(0)
    x_full, w_full = torch.randn(16, 8, generator=g), torch.randn(8, 8, generator=g)
    x = lib.distribute_tensor(x_full, mesh, [Shard(0)])
    w = lib.distribute_tensor(w_full, mesh, [Replicate()])
    bias = lib.distribute_tensor(torch.randn(8, generator=g), mesh, [Replicate()])
    xl, wl, bl = x.to_local(), w.to_local(), bias.to_local()
    return {
        "add": (lambda: x + x, lambda: xl + xl),
        "mul by scalar": (lambda: x * 2.0, lambda: xl * 2.0),
        "mm": (lambda: x @ w, lambda: xl @ wl),
        "sum(dim=1)": (lambda: x.sum(1), lambda: xl.sum(1)),
        "view": (lambda: x.view(16, 2, 4), lambda: xl.view(4, 2, 4)),
        "t": (lambda: w.t(), lambda: wl.t()),
        "softmax(dim=-1)": (lambda: torch.softmax(x, -1), lambda: torch.softmax(xl, -1)),
        "Linear forward": (lambda: F.linear(x, w, bias), lambda: F.linear(xl, wl, bl)),
    }


def _error_of(on_dtensor: Callable[[], Any]) -> str | None:
    """A row whose op fails (a missing rule) is reported, not fatal."""
    try:
        on_dtensor()
    except Exception as error:
        return f"error: {type(error).__name__}"
    return None


def measure(
    ours: tuple[Any, Any], theirs: tuple[Any, Any], *, iters: int, repeats: int
) -> dict[str, tuple[float | str, float | str]]:
    """Per row, (our overhead, torch's): the fastest of ``repeats`` batches of each of the four
    callables, taken in turns, so load on a shared machine hits both libraries alike."""
    results: dict[str, tuple[float | str, float | str]] = {}
    our_cases, their_cases = cases(*ours), cases(*theirs)
    with torch.no_grad():
        for name in our_cases:
            fns = [*our_cases[name], *their_cases[name]]
            errors = [_error_of(fns[0]), _error_of(fns[2])]
            for fn in fns:
                for _ in range(max(10, iters // 10)):
                    fn()
            best = [float("inf")] * 4
            for _ in range(repeats):
                for k, fn in enumerate(fns):
                    if errors[k // 2] is None:
                        best[k] = min(best[k], timed_batch_us(fn, iters))
            results[name] = (
                errors[0] or best[0] - best[1],
                errors[1] or best[2] - best[3],
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    import torch.distributed.tensor as theirs
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    import spmd.tensor as ours

    our_mesh = ours.init_device_mesh("cpu", (WORLD,))
    their_mesh = torch_mesh("cpu", (WORLD,))
    measured = measure((ours, our_mesh), (theirs, their_mesh), iters=args.iters, repeats=args.repeats)
    print(f"eager dispatch overhead per op (us, DTensor op minus local op), world of {WORLD}, 16x8 float32")
    print(f"{'op':<18}{'ours':>10}{'torch':>10}{'ours/torch':>12}")
    ratios = []
    for name, (a, b) in measured.items():
        if isinstance(a, float) and isinstance(b, float):
            ratio = a / b if b > 0 else float("inf")
            ratios.append((ratio, name))
            print(f"{name:<18}{a:>10.1f}{b:>10.1f}{ratio:>12.2f}")
        else:
            print(f"{name:<18}{a!s:>10}{b!s:>10}{'-':>12}")
    if ratios:
        worst = max(ratios)
        print(f"worst ours/torch: {worst[0]:.2f} ({worst[1]}); goal <= 1.00")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
