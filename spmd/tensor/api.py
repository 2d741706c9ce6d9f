"""Making DTensors: distribute_tensor, distribute_module and the factory functions."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from spmd.tensor.device_mesh.mesh import DeviceMesh, current_mesh
from spmd.tensor.dtensor import DTensor
from spmd.tensor.placement import Partial, Placement, Replicate, Shard, _StridedShard
from spmd.tensor.redistribute.collectives import (
    broadcast_from,
    local_chunk,
    partition_value,
    scatter_from,
    scatter_pieces_from,
)
from spmd.tensor.spec import DTensorSpec, TensorMeta, contiguous_strides, local_shape, normalize_placements
from spmd.tensor.torch_objects import refuse_torch_object, torch_object_error

PlacementList = Sequence[Placement]
"""One placement per mesh dim."""

__all__ = ["distribute_tensor", "distribute_module", "zeros", "ones", "empty", "full", "rand", "randn"]


def _resolve_placements(
    mesh: DeviceMesh, placements: Sequence[Placement] | None, ndim: int, where: str
) -> tuple[Placement, ...]:
    if placements is None:
        placements = [Replicate()] * mesh.ndim
    return normalize_placements(placements, mesh, ndim, where=where)


def _require_mesh(mesh: object, where: str) -> None:
    """A TypeError unless ``mesh`` is spmd's DeviceMesh (torch's gets its own error)."""
    if not isinstance(mesh, DeviceMesh):
        raise torch_object_error(mesh, f"{where} (device_mesh)") or TypeError(
            f"{where} takes a DeviceMesh as device_mesh, got {type(mesh).__name__}; "
            'build one with init_device_mesh("cpu", (world_size,))'
        )


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh | None = None,
    placements: PlacementList | None = None,
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """Lay ``tensor`` out on ``device_mesh``: every rank keeps only its shard.

    The data of the rank at coordinate ``src_data_rank`` on every mesh dim (default 0; on a 1-d
    mesh, that group rank) is what ends up in the DTensor (scattered for Shard, broadcast for
    Replicate), so only that rank's tensor needs to be meaningful.
    With ``src_data_rank=None`` each rank keeps its own copy's pieces and nothing is sent, as for
    a meta tensor (whose DTensor stays on meta until e.g. ``module.to_empty(device=...)``).
    Without ``device_mesh``, the mesh entered with ``with mesh:`` is used.
    """
    device_mesh = device_mesh if device_mesh is not None else current_mesh()
    _require_mesh(device_mesh, "distribute_tensor")
    if isinstance(tensor, DTensor):
        return _already_distributed(tensor, device_mesh, placements)
    if type(tensor) is not torch.Tensor and type(tensor) is not nn.Parameter:
        refuse_torch_object(tensor, "distribute_tensor (tensor)")
    if not tensor.is_leaf:
        raise RuntimeError(
            "distribute_tensor can only distribute leaf tensors (the result is a new leaf, so gradients would "
            f"not reach this tensor's graph, grad_fn={type(tensor.grad_fn).__name__}); distribute the leaf, or "
            "pass tensor.detach() to cut the graph on purpose"
        )
    placements = _resolve_placements(device_mesh, placements, tensor.ndim, "distribute_tensor (placements)")
    local = tensor.detach()
    if device_mesh.device_type != local.device.type and not local.is_meta:
        local = local.to(device_mesh.device_type)
    if device_mesh.get_coordinate() is None:  # a rank outside the mesh holds nothing and sends nothing
        meta = TensorMeta(tuple(tensor.shape), contiguous_strides(tensor.shape), tensor.dtype)
        return DTensor(local.new_empty(0), DTensorSpec(device_mesh, placements, meta), requires_grad=tensor.requires_grad)
    # A meta tensor has no data to send: each rank cuts its piece's shape out locally.
    source = None if src_data_rank is None or local.is_meta else _source_coordinate(device_mesh, src_data_rank)
    local = _local_piece(local, device_mesh, placements, source)
    if local is tensor:
        local = local.clone()
    meta = TensorMeta(tuple(tensor.shape), contiguous_strides(tensor.shape), tensor.dtype)
    return DTensor(local, DTensorSpec(device_mesh, placements, meta), requires_grad=tensor.requires_grad)


def _shard_tensor(
    full_tensor: torch.Tensor,
    placements: Sequence[Shard],
    device_mesh: DeviceMesh | None = None,
) -> DTensor:
    """This rank's pieces of ``full_tensor`` as a DTensor, cut locally: nothing is sent.

    torch's private name for ``distribute_tensor(full_tensor, device_mesh, placements,
    src_data_rank=None)`` (note the argument order), for code where every rank already holds the
    same whole tensor, e.g. each loaded the same checkpoint. Nothing checks that the copies agree.
    """
    return distribute_tensor(full_tensor, device_mesh, placements, src_data_rank=None)


def _already_distributed(tensor: DTensor, device_mesh: DeviceMesh, placements: PlacementList | None) -> DTensor:
    """``tensor`` itself when it already has the mesh and placements asked for; else a ValueError."""
    if tensor.device_mesh != device_mesh:
        raise ValueError(
            f"distribute_tensor got a DTensor on {tensor.device_mesh!r}; it cannot move it to a different "
            f"device mesh ({device_mesh!r}): redistribute on its own mesh, or build it on the other one"
        )
    wanted = _resolve_placements(device_mesh, placements, tensor.ndim, "distribute_tensor (placements)")
    if tensor.placements != wanted:
        raise ValueError(
            f"distribute_tensor got a DTensor laid out as {tensor._spec}; it does not change it to a different "
            f"placements {list(wanted)}: use .redistribute(placements=...) for that"
        )
    return tensor


def _local_piece(
    local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], source: tuple[int, ...] | None
) -> torch.Tensor:
    """This rank's piece of the whole tensor ``local``, mesh dim by mesh dim.

    From the rank at mesh coordinate ``source`` (scattered or broadcast), or, with ``source=None``,
    cut out of this rank's own copy without sending anything.
    """
    coordinate = mesh._require_coordinate()
    for d, p in enumerate(placements):
        if isinstance(p, _StridedShard):
            if source is None:
                local = p._select_split_tensor(local, mesh.size(d), coordinate[d])
            else:
                pieces, _ = p._split_tensor(local, mesh.size(d), with_padding=False, contiguous=False)
                local = scatter_pieces_from(mesh, d, pieces, p.dim, src=source[d])
            continue
        if isinstance(p, Shard):
            if source is None:
                local = local_chunk(local, mesh.size(d), coordinate[d], p.dim)
            else:
                local = scatter_from(mesh, d, local, p.dim, src=source[d])
            continue
        if source is not None:
            local = broadcast_from(mesh, d, local, src=source[d])
        if isinstance(p, Partial):
            local = partition_value(local, p.reduce_op, coordinate[d])
    return local


def _source_coordinate(mesh: DeviceMesh, src_data_rank: int) -> tuple[int, ...]:
    """The mesh coordinate whose data ``distribute_tensor`` keeps: ``src_data_rank`` on every mesh dim.

    As in torch, ``src_data_rank`` is a rank within each mesh dim's group (on a 1-d mesh over the
    whole world, the global rank). Scattering (or broadcasting) along each mesh dim from that
    entry hands every rank a piece that started on the rank at that coordinate.
    """
    if not 0 <= src_data_rank < min(mesh.shape):
        raise ValueError(
            f"src_data_rank={src_data_rank} is not a rank of every mesh dim of {mesh!r} (sizes {list(mesh.shape)}); "
            "pass a group rank below the smallest dim size, or None to keep each rank's own data"
        )
    return (src_data_rank,) * mesh.ndim


def distribute_module(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    partition_fn: Callable[[str, nn.Module, DeviceMesh], None] | None = None,
    input_fn: Callable[[nn.Module, Any, DeviceMesh], Any] | None = None,
    output_fn: Callable[[nn.Module, Any, DeviceMesh], Any] | None = None,
) -> nn.Module:
    """Turn a module's parameters and buffers into DTensors and hook its inputs and outputs.

    ``partition_fn(name, submodule, mesh)`` runs on every submodule and may replace parameters with
    sharded DTensors; whatever it leaves as a plain tensor is replicated. ``input_fn`` /
    ``output_fn`` run before / after ``module.forward`` to convert inputs and outputs.

    The hooks hold ``input_fn`` / ``output_fn`` and the mesh, nothing else, so the module pickles
    (``pickle``, ``torch.save``) when those two do: module-level functions, ``functools.partial``
    of them, or instances of module-level classes, not lambdas or nested functions.
    Without ``device_mesh``, the mesh entered with ``with mesh:`` is used.
    """
    device_mesh = device_mesh if device_mesh is not None else current_mesh()
    _require_mesh(device_mesh, "distribute_module")
    if getattr(module, "_spmd_distributed", False):
        raise RuntimeError("distribute_module was already called on this module; call it once")
    for name, submodule in module.named_modules():
        if partition_fn is not None:
            partition_fn(name, submodule, device_mesh)
        _replicate_leftovers(submodule, device_mesh)
    if input_fn is not None:
        module.register_forward_pre_hook(_InputFnHook(input_fn, device_mesh, _takes_module(input_fn, "input_fn")))
    if output_fn is not None:
        module.register_forward_hook(_OutputFnHook(output_fn, device_mesh, _takes_module(output_fn, "output_fn")))
    module._spmd_distributed = True  # type: ignore[assignment]
    return module


@dataclass(frozen=True, slots=True)
class _InputFnHook:
    """The forward pre-hook ``distribute_module`` registers: ``input_fn(module, inputs, mesh)``.

    A value rather than a closure, so that the module pickles and deep-copies.
    """

    input_fn: Callable[..., Any]
    mesh: DeviceMesh
    with_module: bool = True

    def __call__(self, module: nn.Module, inputs: tuple[Any, ...]) -> Any:
        if self.with_module:
            return self.input_fn(module, inputs, self.mesh)
        return self.input_fn(inputs, self.mesh)


@dataclass(frozen=True, slots=True)
class _OutputFnHook:
    """The forward hook ``distribute_module`` registers: ``output_fn(module, outputs, mesh)``."""

    output_fn: Callable[..., Any]
    mesh: DeviceMesh
    with_module: bool = True

    def __call__(self, module: nn.Module, inputs: tuple[Any, ...], outputs: Any) -> Any:
        if self.with_module:
            return self.output_fn(module, outputs, self.mesh)
        return self.output_fn(outputs, self.mesh)


def _takes_module(fn: Callable[..., Any], role: str) -> bool:
    """Whether ``fn`` has the ``(module, value, mesh)`` form; the older ``(value, mesh)`` one still
    works, with a FutureWarning, as in torch."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: assume the current form
        return True
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) == 2 and not any(p.kind is p.VAR_POSITIONAL for p in parameters):
        warnings.warn(
            f"Deprecating {role} that takes two arguments ({role.split('_')[0]}s, device_mesh): "
            f"give distribute_module a {role}(module, {role.split('_')[0]}s, device_mesh) instead",
            FutureWarning,
            stacklevel=3,
        )
        return False
    return True


def _replicate_leftovers(module: nn.Module, mesh: DeviceMesh) -> None:
    replicate = [Replicate()] * mesh.ndim
    for name, param in list(module._parameters.items()):
        if param is not None and not isinstance(param, DTensor):
            module.register_parameter(
                name, nn.Parameter(distribute_tensor(param.data, mesh, replicate), param.requires_grad)
            )
    for name, buffer in list(module._buffers.items()):
        if buffer is not None and not isinstance(buffer, DTensor):
            module._buffers[name] = distribute_tensor(buffer, mesh, replicate)


# ----- factories -----------------------------------------------------------------------------------
def _size_arg(size: tuple[Any, ...]) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (list, tuple, torch.Size)):
        return tuple(int(s) for s in size[0])
    return tuple(int(s) for s in size)


def _factory_mesh(device_mesh: DeviceMesh | None, layout: torch.layout, where: str) -> DeviceMesh:
    """The factories' mesh (the current one when not given); only strided tensors are offered."""
    if layout != torch.strided:
        raise NotImplementedError(f"DTensor factories make strided tensors only; got layout={layout}")
    device_mesh = device_mesh if device_mesh is not None else current_mesh()
    _require_mesh(device_mesh, where)
    return device_mesh


def _factory(
    fill: Callable[[tuple[int, ...], torch.dtype], torch.Tensor],
    size: tuple[Any, ...],
    *,
    device_mesh: DeviceMesh | None,
    placements: Sequence[Placement] | None,
    dtype: torch.dtype | None,
    layout: torch.layout,
    requires_grad: bool,
    zero_partials: bool,
    name: str,
) -> DTensor:
    device_mesh = _factory_mesh(device_mesh, layout, name)
    shape = _size_arg(size)
    dtype = dtype or torch.get_default_dtype()
    placements = _resolve_placements(device_mesh, placements, len(shape), f"{name} (placements)")
    coordinate = device_mesh.get_coordinate()
    # A rank outside the mesh holds an empty piece.
    piece_shape = (0,) if coordinate is None else local_shape(shape, device_mesh, placements, coordinate)
    local = fill(piece_shape, dtype).to(device_mesh.device_type)
    for d, p in enumerate(placements):
        if zero_partials and isinstance(p, Partial) and coordinate is not None:
            local = partition_value(local, p.reduce_op, coordinate[d])
    meta = TensorMeta(shape, contiguous_strides(shape), dtype)
    return DTensor(local, DTensorSpec(device_mesh, placements, meta), requires_grad=requires_grad)


def zeros(*size: Any, dtype: torch.dtype | None = None, layout: torch.layout = torch.strided,
          requires_grad: bool = False, device_mesh: DeviceMesh | None = None,
          placements: Sequence[Placement] | None = None) -> DTensor:
    """A DTensor of zeros with global shape ``size``."""
    return _factory(lambda s, dt: torch.zeros(s, dtype=dt), size, device_mesh=device_mesh,
                    placements=placements, dtype=dtype, layout=layout, requires_grad=requires_grad, zero_partials=False,
                    name="zeros")


def ones(*size: Any, dtype: torch.dtype | None = None, layout: torch.layout = torch.strided,
         requires_grad: bool = False, device_mesh: DeviceMesh | None = None,
         placements: Sequence[Placement] | None = None) -> DTensor:
    """A DTensor of ones with global shape ``size``."""
    return _factory(lambda s, dt: torch.ones(s, dtype=dt), size, device_mesh=device_mesh,
                    placements=placements, dtype=dtype, layout=layout, requires_grad=requires_grad, zero_partials=True,
                    name="ones")


def empty(*size: Any, dtype: torch.dtype | None = None, layout: torch.layout = torch.strided,
          requires_grad: bool = False, device_mesh: DeviceMesh | None = None,
          placements: Sequence[Placement] | None = None) -> DTensor:
    """An uninitialised DTensor with global shape ``size``."""
    return _factory(lambda s, dt: torch.empty(s, dtype=dt), size, device_mesh=device_mesh,
                    placements=placements, dtype=dtype, layout=layout, requires_grad=requires_grad, zero_partials=False,
                    name="empty")


def full(size: Sequence[int], fill_value: Any, *, dtype: torch.dtype | None = None,
         layout: torch.layout = torch.strided, requires_grad: bool = False,
         device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None) -> DTensor:
    """A DTensor filled with ``fill_value`` with global shape ``size``."""
    return _factory(lambda s, dt: torch.full(s, fill_value, dtype=dt), (size,), device_mesh=device_mesh,
                    placements=placements, dtype=dtype, layout=layout, requires_grad=requires_grad, zero_partials=True,
                    name="full")


def _random(fill: str, size: tuple[Any, ...], device_mesh: DeviceMesh | None,
            placements: Sequence[Placement] | None, dtype: torch.dtype | None, layout: torch.layout,
            requires_grad: bool) -> DTensor:
    name = "rand" if fill == "uniform_" else "randn"
    device_mesh = _factory_mesh(device_mesh, layout, name)
    from spmd.tensor.random import draw_local

    shape = _size_arg(size)
    dtype = dtype or torch.get_default_dtype()
    placements = _resolve_placements(device_mesh, placements, len(shape), f"{name} (placements)")
    # Each rank draws its piece of the global tensor a single device would draw, with no
    # communication (the whole tensor in "torch" mode, only its tiles in "counter" mode).
    if device_mesh.get_coordinate() is None:  # a rank outside the mesh draws nothing and holds an empty piece
        local = torch.empty(0, dtype=dtype, device=device_mesh.device_type)
    else:
        local = draw_local(device_mesh, shape, dtype, placements, fill)
    meta = TensorMeta(shape, contiguous_strides(shape), dtype)
    return DTensor(local, DTensorSpec(device_mesh, placements, meta), requires_grad=requires_grad)


def rand(*size: Any, dtype: torch.dtype | None = None, layout: torch.layout = torch.strided,
         requires_grad: bool = False, device_mesh: DeviceMesh | None = None,
         placements: Sequence[Placement] | None = None) -> DTensor:
    """Uniform [0, 1) values: a single device's draw after ``torch.manual_seed`` with the same seed
    (default "torch" RNG mode), or ``CounterStream``'s draw in "counter" mode (``spmd.tensor.random``)."""
    return _random("uniform_", size, device_mesh, placements, dtype, layout, requires_grad)


def randn(*size: Any, dtype: torch.dtype | None = None, layout: torch.layout = torch.strided,
          requires_grad: bool = False, device_mesh: DeviceMesh | None = None,
          placements: Sequence[Placement] | None = None) -> DTensor:
    """Standard normal values: a single device's draw after ``torch.manual_seed`` with the same seed
    (default "torch" RNG mode), or ``CounterStream``'s draw in "counter" mode (``spmd.tensor.random``)."""
    return _random("normal_", size, device_mesh, placements, dtype, layout, requires_grad)
