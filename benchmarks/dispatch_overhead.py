"""Per-op eager overhead of DTensor dispatch: ours vs ``torch.distributed.tensor``, same process.

Overhead is the time of the op on a DTensor minus the time of the same op on the plain local
tensor, for small tensors and a warm decision cache, so it measures the library, not the kernel.
Both libraries run on one process that is rank 0 of a 4-rank "fake" process group (torch's test
backend whose collectives do nothing): every row uses placements that need no communication, so
the fake group is never asked to move data. Run: ``python benchmarks/dispatch_overhead.py``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing._internal.distributed.fake_pg import FakeStore

WORLD = 4


def per_call_us(fn: Callable[[], Any], *, iters: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean time of one call, in microseconds."""
    for _ in range(max(10, iters // 10)):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - start) / iters * 1e6)
    return statistics.median(samples)


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


def measure(lib: Any, mesh: Any, *, iters: int, repeats: int) -> dict[str, float | str]:
    results: dict[str, float | str] = {}
    with torch.no_grad():
        for name, (on_dtensor, on_local) in cases(lib, mesh).items():
            try:
                on_dtensor()
            except Exception as error:  # a missing rule is reported, not fatal
                results[name] = f"error: {type(error).__name__}"
                continue
            results[name] = per_call_us(on_dtensor, iters=iters, repeats=repeats) - per_call_us(
                on_local, iters=iters, repeats=repeats
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    import torch.distributed.tensor as theirs
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    import spmd.tensor as ours

    our_mesh = ours.init_device_mesh("cpu", (WORLD,))
    their_mesh = torch_mesh("cpu", (WORLD,))
    mine = measure(ours, our_mesh, iters=args.iters, repeats=args.repeats)
    torch_side = measure(theirs, their_mesh, iters=args.iters, repeats=args.repeats)
    print(f"eager dispatch overhead per op (us, DTensor op minus local op), world of {WORLD}, 16x8 float32")
    print(f"{'op':<18}{'ours':>10}{'torch':>10}{'ours/torch':>12}")
    ratios = []
    for name in mine:
        a, b = mine[name], torch_side[name]
        if isinstance(a, float) and isinstance(b, float):
            ratio = a / b if b > 0 else float("inf")
            ratios.append((ratio, name))
            print(f"{name:<18}{a:>10.1f}{b:>10.1f}{ratio:>12.2f}")
        else:
            print(f"{name:<18}{a!s:>10}{b!s:>10}{'-':>12}")
    if ratios:
        worst = max(ratios)
        print(f"worst ours/torch: {worst[0]:.2f} ({worst[1]}); goal <= 0.50")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
