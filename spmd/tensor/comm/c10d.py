"""The torch.distributed backend: gloo on CPU, NCCL on CUDA, under torchrun or any launcher.

Sub-groups are created once per mesh dimension (every rank creates every group, in the same order,
as c10d requires) and reused by every later collective.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from spmd.tensor.comm.base import Communicator, World

__all__ = ["C10dWorld", "C10dCommunicator"]

# torch 2.13 renamed the tensor collectives; older releases only have the first names.
_all_gather_tensor = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)

_C10D_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _reduce_op(reduce_op: str, backend: str) -> tuple[Any, bool]:
    """The c10d op for ``reduce_op`` and whether the result must still be divided (avg on gloo)."""
    if reduce_op == "avg":
        if backend == "nccl":
            return dist.ReduceOp.AVG, False
        return dist.ReduceOp.SUM, True
    return _C10D_OPS[reduce_op], False


class C10dCommunicator(Communicator):
    """Collectives over a c10d process group holding ``ranks``."""

    def __init__(self, ranks: tuple[int, ...], group: Any) -> None:
        super().__init__(ranks)
        self.group = group
        self.backend = dist.get_backend(group)
        self._local_rank = ranks.index(dist.get_rank()) if dist.get_rank() in ranks else -1
        self._native_reduce_scatter = True

    @property
    def local_rank(self) -> int:
        return self._local_rank

    def _finish_avg(self, tensor: torch.Tensor, divide: bool) -> torch.Tensor:
        if not divide:
            return tensor
        if tensor.is_floating_point() or tensor.is_complex():
            return tensor.div_(self.size)
        return torch.div(tensor, self.size, rounding_mode="floor")

    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        # gloo checks each output chunk against the input's shape, so gather flat and view.
        out = tensor.new_empty((self.size * tensor.numel(),))
        _all_gather_tensor(out, tensor.reshape(-1), group=self.group)
        return out.view(self.size, *tensor.shape)

    def _all_reduce(self, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
        op, divide = _reduce_op(reduce_op, self.backend)
        out = tensor.clone()
        dist.all_reduce(out, op=op, group=self.group)
        return self._finish_avg(out, divide)

    def _reduce_scatter(self, stacked: torch.Tensor, reduce_op: str) -> torch.Tensor:
        op, divide = _reduce_op(reduce_op, self.backend)
        if not self._native_reduce_scatter:
            # Older gloo has no reduce_scatter; an all_reduce then a local slice gives the same values.
            reduced = stacked.clone()
            dist.all_reduce(reduced, op=op, group=self.group)
            return self._finish_avg(reduced[self.local_rank].clone(), divide)
        block = stacked.shape[1:]
        out = stacked.new_empty((stacked[0].numel(),))
        try:
            _reduce_scatter_tensor(out, stacked.reshape(-1), op=op, group=self.group)
        except RuntimeError as error:
            # The backend refuses before sending anything, on every rank alike, so falling back is safe.
            if "support" not in str(error).lower():
                raise
            self._native_reduce_scatter = False
            return self._reduce_scatter(stacked, reduce_op)
        return self._finish_avg(out.view(block), divide)

    def _all_to_all(self, stacked: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(stacked)
        dist.all_to_all_single(out, stacked, group=self.group)
        return out

    def _broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        out = tensor.clone()
        dist.broadcast(out, src=self.ranks[src], group=self.group)
        return out

    def _scatter(self, stacked: torch.Tensor, src: int) -> torch.Tensor:
        out = stacked.new_empty(stacked.shape[1:])
        blocks = list(stacked.unbind(0)) if self.local_rank == src else None
        dist.scatter(out, blocks, src=self.ranks[src], group=self.group)
        return out

    def _all_gather_object(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, obj, group=self.group)
        return gathered


class C10dWorld(World):
    """The default c10d process group; ``ensure_initialized`` starts it from torchrun's environment."""

    backend_name = "c10d"

    def __init__(self) -> None:
        self.size = dist.get_world_size()
        self._communicators: dict[tuple[int, ...], C10dCommunicator] = {}
        self._created: set[tuple[int, ...]] = set()

    @staticmethod
    def ensure_initialized(device_type: str) -> None:
        if dist.is_initialized():
            return
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise RuntimeError(
                "no distributed world: run under torchrun (or call torch.distributed.init_process_group), "
                "or inside spmd.testing.run_threaded for an in-process world"
            )
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend)

    def current_rank(self) -> int:
        return dist.get_rank()

    def communicator(self, ranks: tuple[int, ...]) -> C10dCommunicator:
        comm = self._communicators.get(ranks)
        if comm is None:
            raise RuntimeError(f"no process group for ranks {list(ranks)}; create the DeviceMesh on every rank")
        return comm

    def missing_groups(self, groups: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        return [ranks for ranks in groups if ranks not in self._created]

    def create_groups(self, groups: list[tuple[int, ...]]) -> None:
        for ranks in groups:
            # Non-members must still join new_group, so track creation apart from membership.
            if ranks in self._created:
                continue
            self._created.add(ranks)
            if len(ranks) == self.size and ranks == tuple(range(self.size)):
                group = dist.group.WORLD
            else:
                group = dist.new_group(list(ranks))
            if dist.get_rank() in ranks:
                self._communicators[ranks] = C10dCommunicator(ranks, group)
