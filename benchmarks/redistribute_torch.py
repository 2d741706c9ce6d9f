"""torch.distributed.tensor's side of benchmarks/redistribute.py: the collectives its redistribute
issues, per rank, on gloo processes or on the fake process group (no data moves there: its
redistribute issues the same ops on the same buffers, which is all the accounting reads).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from redistribute_bound import Case, parse_placement

from spmd.tensor.redistribute.cost import received_bytes


@dataclass(frozen=True, slots=True)
class Measured:
    """One rank's traffic for one case: bytes received and the collectives, in issue order."""

    bytes: int
    collectives: tuple[tuple[str, int, int], ...]
    values_ok: bool = True
    unsupported: str = ""
    """Why the library refused the transition (then ``bytes`` is 0 and means nothing)."""


def full_tensor_of(shape: Sequence[int]) -> torch.Tensor:
    return torch.arange(math.prod(shape), dtype=torch.float32).reshape(tuple(shape))


def torch_collective(func: Any, args: Sequence[Any]) -> tuple[str, int, int] | None:
    """(kind, group size, buffer bytes) of a c10d op torch's redistribute issued; None if not one."""
    namespace, _, name = func.name().partition("::")
    if namespace not in ("_c10d_functional", "_c10d_functional_autograd", "c10d", "_dtensor"):
        return None
    name = name.split(".")[0]
    if name in ("wait_tensor", "_wrap_tensor_autograd"):
        return None

    def nbytes(value: Any) -> int:
        tensors = value if isinstance(value, (list, tuple)) else [value]
        return sum(t.numel() * t.element_size() for t in tensors)

    def size_of(group_name: Any) -> int:
        return int(dist.distributed_c10d._resolve_process_group(group_name).size())

    if name.startswith("all_gather_into_tensor"):
        return "all_gather", int(args[1]), nbytes(args[0]) * int(args[1])
    if name.startswith("reduce_scatter_tensor"):
        return "reduce_scatter", int(args[2]), nbytes(args[0])
    if name.startswith("all_reduce"):
        return "all_reduce", size_of(args[2]), nbytes(args[0])
    if name == "all_to_all_single":
        return "all_to_all", size_of(args[3]), nbytes(args[0])
    if name == "shard_dim_alltoall":
        return "all_to_all", size_of(args[3]), nbytes(args[0])
    if name == "broadcast":
        return "broadcast", size_of(args[2]), nbytes(args[0])
    raise NotImplementedError(f"torch issued {namespace}::{name}, which this benchmark cannot account for")


def torch_rank(cases: Sequence[Case]) -> list[Measured]:
    """Every case on this rank, with torch.distributed.tensor."""
    from torch.distributed import tensor as tdt
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._redistribute import redistribute_local_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountCollectives(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.collectives: list[tuple[str, int, int]] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            record = torch_collective(func, args)
            if record is not None:
                self.collectives.append(record)
            return func(*args, **(kwargs or {}))

    meshes: dict[tuple[int, ...], Any] = {}
    results = []
    for case in cases:
        if case.mesh_shape not in meshes:
            meshes[case.mesh_shape] = torch_init_device_mesh("cpu", case.mesh_shape)
        mesh = meshes[case.mesh_shape]
        src = tuple(parse_placement(t, tdt) for t in case.src)
        dst = tuple(parse_placement(t, tdt) for t in case.dst)
        local_shape, _ = compute_local_shape_and_global_offset(case.shape, mesh, src)
        x = tdt.DTensor.from_local(
            torch.ones(local_shape),
            mesh,
            src,
            shape=torch.Size(case.shape),
            stride=full_tensor_of(case.shape).stride(),
            run_check=False,
        )
        try:
            with CountCollectives() as mode:
                if any(p.is_partial() and p != s for p, s in zip(dst, src)):
                    # torch's public redistribute refuses a new Partial; its executor takes it.
                    target = DTensorSpec(mesh, dst, tensor_meta=x._spec.tensor_meta)
                    redistribute_local_tensor(x._local_tensor, x._spec, target)
                else:
                    x.redistribute(mesh, dst)
        except (RuntimeError, NotImplementedError) as error:
            # Raised while planning, before any collective, so every rank stays in step.
            if mode.collectives:
                raise
            results.append(Measured(0, (), unsupported=str(error).splitlines()[0]))
            continue
        collectives = tuple(mode.collectives)
        results.append(Measured(sum(received_bytes(*c) for c in collectives), collectives))
    return results


def torch_on_fake_pg(cases: Sequence[Case], world_size: int) -> list[list[Measured]]:
    """``[case][rank]`` of torch's side on the fake process group, each rank in turn in this process."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    per_rank: list[list[Measured]] = []
    for rank in range(world_size):
        dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
        per_rank.append([])
        per_rank[-1] = [torch_case_on_fake_pg(case) for case in cases]
        dist.destroy_process_group()
    return [[per_rank[r][j] for r in range(world_size)] for j in range(len(cases))]


def torch_case_on_fake_pg(case: Case) -> Measured:
    try:
        return torch_rank([case])[0]
    except RuntimeError as error:  # a check of torch's that a group moving no data can fail
        return Measured(0, (), unsupported=f"fails on the fake process group ({str(error).splitlines()[0][:60]})")
