"""ParallelStyle: the contract every tensor-parallel style follows, and the error for misuse."""

from __future__ import annotations

from abc import ABC, abstractmethod

from torch import nn

from spmd.tensor import DeviceMesh

__all__ = ["ParallelStyle", "UnsupportedModuleError"]


class UnsupportedModuleError(NotImplementedError):
    """A style was applied to a module it cannot parallelise (e.g. ColwiseParallel on a LayerNorm)."""


class ParallelStyle(ABC):
    """How one module is parallelised over the tp mesh dim: its parameters' layout and its inputs'/outputs'.

    A style is a frozen config; ``apply`` does the work, so one style object may be used for many
    modules (``parallelize_module`` applies it to every module a wildcard key matches). On an n-d
    mesh a style acts on the tp dim only: parameters are ``Replicate()`` on the other dims, and
    DTensor activations keep their placements there. The hooks ``apply`` registers are frozen
    dataclasses with ``__call__``, never lambdas or closures, so a parallelised module pickles,
    saves with ``torch.save`` and deep-copies.
    """

    __slots__ = ()

    @abstractmethod
    def apply(
        self,
        module: nn.Module,
        device_mesh: DeviceMesh,
        *,
        src_data_rank: int | None = 0,
        tp_mesh_dim: int | str | None = None,
    ) -> nn.Module:
        """Parallelise ``module`` in place over ``device_mesh`` and return it.

        ``src_data_rank`` is the mesh coordinate whose parameter values every rank ends up with
        (see ``distribute_tensor``); None keeps each rank's own values and sends nothing.
        ``tp_mesh_dim`` (index or name) is the mesh dim the style acts on; None: the only dim of a
        1-d mesh, else the dim named ``"tp"``.
        """
