"""torch's pipeline stage for stages whose activations are spmd DTensors.

torch's ``PipelineStage`` carries only torch's DTensor across stages: handed an spmd DTensor it sends
a plain tensor of the global shape, and the next stage receives one. ``PipelineStage`` here is torch's
class with the stage edges made plain: each DTensor output of the stage's submodule crosses as this
rank's local piece, and the next stage reads that piece back as a DTensor of the same layout on its
own mesh before its submodule runs. The layout (mesh dim names, placements, global shape and stride)
travels once, with the metadata torch's stages exchange on their first step. torch's schedules run
unchanged; the import redirect gives this class to code that imports torch's
``PipelineStage``. See ``docs/pipeline.md``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed import pipelining

from spmd.tensor import DeviceMesh, DTensor
from spmd.tensor.placement import Placement

__all__ = ["PipelineStage"]


@dataclasses.dataclass(frozen=True)
class _EdgeLayout:
    """How one activation crossing a stage edge is laid out: what ``from_local`` needs on the other side."""

    mesh_dim_names: tuple[str, ...]
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _layout_of(tensor: object) -> _EdgeLayout | None:
    if not isinstance(tensor, DTensor):
        return None
    names = tensor.device_mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            f"a pipeline stage output is a DTensor on a mesh without dim names ({tensor.device_mesh}); the next stage "
            "finds its own mesh by name: build the mesh with mesh_dim_names (init_device_mesh(..., mesh_dim_names=...))"
        )
    return _EdgeLayout(tuple(names), tuple(tensor.placements), tuple(tensor.shape), tuple(tensor.stride()))


_TORCH_STAGE_METHODS = ("forward_maybe_with_nosync", "_compute_outputs", "_send_meta", "_recv_meta")
"""The methods of torch's stage this one extends: where it runs its submodule, and its metadata exchange."""


class PipelineStage(pipelining.PipelineStage):
    """torch's ``PipelineStage`` whose submodule's DTensor activations cross to the next stage as local pieces.

    Takes torch's arguments. A stage that sends hands each DTensor output on as ``to_local()`` (its
    gradient comes back as a local piece of the same layout); a stage that receives rebuilds each
    piece with ``DTensor.from_local`` on its own mesh of the same dim names (from ``get_mesh``, else
    the mesh of its submodule's DTensor parameters). The last stage's output goes to the loss as the
    submodule returns it. Stages on one rank next to each other (V-shaped schedules) are not handled.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        missing = [name for name in _TORCH_STAGE_METHODS if not hasattr(pipelining.PipelineStage, name)]
        if missing:
            raise RuntimeError(
                f"spmd's PipelineStage extends torch {torch.__version__}'s PipelineStage at {missing}, which this "
                "torch lacks; use torch's PipelineStage with plain stage edges (docs/pipeline.md, stage_tp_plan)"
            )
        super().__init__(*args, **kwargs)
        self._get_spmd_mesh: Callable[..., DeviceMesh | None] | None = kwargs.get("get_mesh")
        self._output_layouts: tuple[_EdgeLayout | None, ...] = ()
        self._input_layouts: tuple[_EdgeLayout | None, ...] = ()

    # -- the two places torch's stage runs its submodule: each step, and metadata inference --------
    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        output = super().forward_maybe_with_nosync(*self._from_previous_stage(args), **kwargs)  # type: ignore[no-untyped-call]
        return self._to_next_stage(output)

    def _compute_outputs(self, *args: torch.Tensor, module: torch.nn.Module, **kwargs: Any) -> Any:
        return self._to_next_stage(super()._compute_outputs(*self._from_previous_stage(args), module=module, **kwargs))

    # -- the layouts travel with torch's forward metadata ------------------------------------------
    def _send_meta(self, meta: Any, dst_stage: int) -> None:
        super()._send_meta((meta, self._output_layouts) if dst_stage > self.stage_index else meta, dst_stage)

    def _recv_meta(self, src_stage: int) -> Any:
        meta = super()._recv_meta(src_stage)
        if src_stage < self.stage_index:
            meta, self._input_layouts = meta
        return meta

    # -- the edges ---------------------------------------------------------------------------------
    def _to_next_stage(self, output: Any) -> Any:
        """The submodule's output with each DTensor replaced by its local piece (none on the last stage)."""
        if self.is_last:
            return output
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        self._output_layouts = tuple(_layout_of(t) for t in outputs)
        local = [t.to_local() if isinstance(t, DTensor) else t for t in outputs]
        return type(output)(local) if isinstance(output, (tuple, list)) else local[0]

    def _from_previous_stage(self, args: Sequence[Any]) -> tuple[Any, ...]:
        """The received pieces read back as DTensors of the layouts the previous stage sent."""
        if self.is_first or not self._input_layouts:
            return tuple(args)
        return tuple(
            self._rebuilt(arg, layout) if layout is not None and type(arg) is torch.Tensor else arg
            for arg, layout in zip(args, self._input_layouts + (None,) * (len(args) - len(self._input_layouts)))
        )

    def _rebuilt(self, piece: torch.Tensor, layout: _EdgeLayout) -> DTensor:
        return DTensor.from_local(
            piece, self._mesh_named(layout.mesh_dim_names), layout.placements,
            shape=layout.shape, stride=layout.stride,
        )

    def _mesh_named(self, names: tuple[str, ...]) -> DeviceMesh:
        """This rank's mesh of dim ``names``: from ``get_mesh``, else from the submodule's DTensor parameters."""
        if self._get_spmd_mesh is not None:
            mesh = self._get_spmd_mesh(names, None)
            if mesh is not None:
                return mesh
        for param in self.submod.parameters():
            if isinstance(param, DTensor) and set(names) <= set(param.device_mesh.mesh_dim_names or ()):
                mesh = param.device_mesh
                return mesh if tuple(mesh.mesh_dim_names or ()) == names else mesh[names]
        raise ValueError(
            f"stage {self.stage_index} receives a DTensor activation on a mesh of dims {names}, and finds no such "
            "mesh on this rank: pass get_mesh=(lambda names, layout: <this rank's mesh of those dims>) to PipelineStage"
        )
