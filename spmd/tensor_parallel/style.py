"""ParallelStyle: the contract every tensor-parallel style follows, and the error for misuse."""

from __future__ import annotations

from abc import ABC, abstractmethod

from torch import nn

from spmd.tensor import DeviceMesh

__all__ = ["ParallelStyle", "UnsupportedModuleError"]


class UnsupportedModuleError(NotImplementedError):
    """A style was applied to a module it cannot parallelise (e.g. ColwiseParallel on a LayerNorm)."""


class ParallelStyle(ABC):
    """How one module is parallelised over a 1-d mesh: its parameters' layout and its inputs'/outputs'.

    A style is a frozen config; ``apply`` does the work, so one style object may be used for many
    modules (``parallelize_module`` applies it to every module a wildcard key matches).
    """

    __slots__ = ()

    @abstractmethod
    def apply(self, module: nn.Module, device_mesh: DeviceMesh, *, src_data_rank: int | None = 0) -> nn.Module:
        """Parallelise ``module`` in place over ``device_mesh`` and return it.

        ``src_data_rank`` is the mesh coordinate whose parameter values every rank ends up with
        (see ``distribute_tensor``); None keeps each rank's own values and sends nothing.
        """
