"""Per-rank cost of a large sharded ``randn``: our two RNG modes vs local draws and ``torch.distributed.tensor``.

Both libraries run on one process that is rank 0 of a ``--world``-rank "fake" process group
(torch's test backend whose collectives do nothing): drawing needs no communication, so the time
is what one rank spends. Rows: ``randn`` of a float32 global tensor sharded on dim 0 and on dim 1,
and dropout of the same tensor sharded on dim 1. Columns: ours in "torch" mode (the default:
exactly the numbers of ``torch.manual_seed``, a global-sized draw per rank), ours in "counter" mode
(the tiles of the shard only), plain ``torch.randn`` / ``F.dropout`` of the local shard (the
floor any O(local) scheme aims at), and ``torch.distributed.tensor`` where it runs on a CPU mesh
(its DTensor RNG supports CUDA-like devices only: on CPU its ``randn`` factory raises and its
dropout draws each shard from the process's default generator, so replicas differ and the values
are not a single device's). Ratios are to the local floor and to torch's DTensor. It also prints
how many elements rank 0 drew in each mode (``spmd.tensor.random.drawn_elements``).
Run: ``python benchmarks/random_ops.py`` (``--size 2048`` for a quick run).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing._internal.distributed.fake_pg import FakeStore


def median_ms(fn: Callable[[], Any], *, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def median_ms_or_nan(fn: Callable[[], Any], *, repeats: int) -> float:
    """``median_ms``, or NaN where the op raises (torch's DTensor randn on a CPU mesh)."""
    try:
        return median_ms(fn, repeats=repeats)
    except Exception:
        return math.nan


def cases(lib: Any, mesh: Any, size: int) -> dict[str, Callable[[], Any]]:
    Shard = lib.Shard
    x = lib.distribute_tensor(torch.zeros(size, size), mesh, [Shard(1)])
    return {
        "randn S(0)": lambda: lib.randn(size, size, device_mesh=mesh, placements=[Shard(0)]),
        "randn S(1)": lambda: lib.randn(size, size, device_mesh=mesh, placements=[Shard(1)]),
        "dropout S(1)": lambda: F.dropout(x, p=0.1, training=True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096, help="global tensor is size x size float32")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)
    import torch.distributed.tensor as theirs
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    import spmd.tensor as ours
    from spmd.tensor.random import drawn_elements, manual_seed, rng_mode

    our_mesh = ours.init_device_mesh("cpu", (args.world,))
    their_mesh = torch_mesh("cpu", (args.world,))
    manual_seed(0, our_mesh)
    times: dict[str, dict[str, float]] = {}
    drawn: dict[str, int] = {}
    for mode in ("torch", "counter"):
        with rng_mode(mode, our_mesh):
            for name, fn in cases(ours, our_mesh, args.size).items():
                times.setdefault(name, {})[mode] = median_ms(fn, repeats=args.repeats)
            before = drawn_elements(our_mesh)
            cases(ours, our_mesh, args.size)["randn S(1)"]()
            drawn[mode] = drawn_elements(our_mesh) - before
    for name, fn in cases(theirs, their_mesh, args.size).items():
        times[name]["theirs"] = median_ms_or_nan(fn, repeats=args.repeats)
    local = math.ceil(args.size / args.world) * args.size
    local_x = torch.zeros(args.size, local // args.size)
    floor = {
        "randn S(0)": lambda: torch.randn(local // args.size, args.size),
        "randn S(1)": lambda: torch.randn(args.size, local // args.size),
        "dropout S(1)": lambda: F.dropout(local_x, p=0.1, training=True),
    }
    for name, fn in floor.items():
        times[name]["local"] = median_ms(fn, repeats=args.repeats)

    numel = args.size * args.size
    print(f"per-rank draw time (ms, median of {args.repeats}), rank 0 of {args.world}, "
          f"{args.size}x{args.size} float32 ({numel * 4 / 2**20:.0f} MiB global), one thread")
    print(f"{'op':<14}{'torch mode':>12}{'counter':>10}{'local':>8}{'torch DT':>12}"
          f"{'torch mode/local':>18}{'counter/local':>15}{'torch mode/DT':>15}{'counter/DT':>12}")
    for name, row in times.items():
        a, b, f, c = row["torch"], row["counter"], row["local"], row["theirs"]
        their = "unsupported" if math.isnan(c) else f"{c:.1f}"
        vs_theirs = f"{'-':>15}{'-':>12}" if math.isnan(c) else f"{a / c:>15.2f}{b / c:>12.2f}"
        print(f"{name:<14}{a:>12.1f}{b:>10.1f}{f:>8.1f}{their:>12}{a / f:>18.2f}{b / f:>15.2f}{vs_theirs}")
    print(f"elements rank 0 drew for randn S(1): torch mode {drawn['torch']} ({drawn['torch'] / local:.2f}x its shard), "
          f"counter mode {drawn['counter']} ({drawn['counter'] / local:.2f}x its shard)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
