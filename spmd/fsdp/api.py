"""fully_shard: ZeRO-3 data parallelism for a module (or a group of modules), applied per block then to the root."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, overload

import torch
from torch import nn

from spmd.comm import current_world
from spmd.fsdp.layout import (
    DP_MESH_DIM_NAME,
    ShardedParameter,
    ShardPlacementFn,
    resolve_dp_mesh_dim,
    shard_parameter,
)
from spmd.fsdp.module import _STATE_ATTR, FSDPModule, as_fsdp_module, fully_shard_state
from spmd.fsdp.policy import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy
from spmd.fsdp.state import EagerHook, FullyShardState
from spmd.tensor import DeviceMesh, init_device_mesh
from spmd.tensor.torch_objects import refuse_torch_object, torch_object_error

__all__ = ["fully_shard", "fully_shard_state"]

_FULL_PRECISION = MixedPrecisionPolicy()
_NO_OFFLOAD = OffloadPolicy()


@overload
def fully_shard(module: nn.Module, *args: Any, **kwargs: Any) -> FSDPModule: ...
@overload
def fully_shard(module: list[nn.Module], *args: Any, **kwargs: Any) -> list[FSDPModule]: ...
def fully_shard(
    module: nn.Module | list[nn.Module],
    *args: Any,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: ShardPlacementFn | None = None,
    mp_policy: MixedPrecisionPolicy = _FULL_PRECISION,
    offload_policy: OffloadPolicy = _NO_OFFLOAD,
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
    dp_mesh_dim: int | str | None = None,
) -> Any:
    """Shard the parameters of ``module`` over the data-parallel mesh; gather them for its forward and backward.

    torch's ``torch.distributed.fsdp.fully_shard``, same arguments. The module owns every parameter
    under it that no fully_shard'ed submodule owns, so apply it to the blocks first and then to the
    root, which takes what is left (embeddings, final norm, head). Two layouts (``spmd.fsdp.layout``):

    >>> parallelize_module(model, world["tp"], plan)  # FSDP2's (torchtitan's)  # doctest: +SKIP
    >>> for block in model.layers:  # doctest: +SKIP
    ...     fully_shard(block, mesh=world["dp"])  # each rank feeds its own plain batch
    >>> fully_shard(model, mesh=world["dp"])  # doctest: +SKIP

    or, spmd's, tensor parallelism on the n-d mesh itself and the batch a DTensor sharded over dp
    (``fully_shard(block, mesh=world)``; the global loss). The module's class becomes a subclass of
    ``FSDPModule`` (``unshard``, ``set_requires_gradient_sync``, ...). A list of modules is sharded
    as one group: each of their forwards gathers all of the group's parameters in one all_gather.

    ``mesh`` (None: a 1-d mesh over the world) is the dp mesh, or an n-d mesh whose dp dim
    ``dp_mesh_dims=DataParallelMeshDims(shard=name)`` or ``dp_mesh_dim`` (name or index; spmd's)
    names, by default the dim called ``"dp"``. A named 2-d mesh with no dim called ``"dp"`` (and
    neither option) is FSDP2's HSDP: parameters sharded over dim 1 and replicated over dim 0,
    gradients reduce-scattered over dim 1, then all-reduced over dim 0; parameters already
    tensor-parallel on a sibling sub-mesh (``world["tp"]`` beside ``world["dp_replicate",
    "dp_shard"]``) live on the 3-d mesh, as in FSDP2's HSDP x TP. ``reshard_after_forward``
    (None: True except on the root) frees the gathered parameters after forward (gathered again
    for backward).
    ``shard_placement_fn(param)`` may return ``Shard(k)`` to cut dim ``k``. ``mp_policy`` sets the
    gathered and reduce dtypes. ``ignored_params`` stay as they are, unmanaged.
    """
    if args:
        raise TypeError(
            f"fully_shard takes the module and keyword arguments only, as torch's FSDP2 does; got "
            f"{len(args)} positional argument(s) after it: pass the mesh as fully_shard(module, mesh=mesh)"
        )
    modules = _as_module_list(module)
    mesh, dp, hsdp = _resolve_mesh(mesh, dp_mesh_dims, dp_mesh_dim)
    _check_policies(reshard_after_forward, mp_policy, offload_policy, mesh)
    params = _shard_or_restore(modules, mesh, dp, ignored_params, shard_placement_fn, hsdp)
    state = FullyShardState(
        mesh,
        mesh if mesh.ndim == 1 else _dp_sub_mesh(mesh, dp),
        params,
        replicate_mesh=_dp_sub_mesh(mesh, 0) if hsdp else None,
        reshard_after_forward=None if reshard_after_forward is None else bool(reshard_after_forward),
        mp_policy=mp_policy,
    )
    _attach(state, modules)
    return module


def _as_module_list(module: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    if isinstance(module, nn.Module):
        return [module]
    if isinstance(module, (list, tuple)) and module and all(isinstance(m, nn.Module) for m in module):
        if len({id(m) for m in module}) != len(module):
            raise ValueError("fully_shard got the same module twice in its list; list each module once")
        return list(module)
    raise TypeError(f"fully_shard takes an nn.Module or a non-empty list of them, got {type(module).__name__}")


def _default_mesh() -> DeviceMesh:
    """FSDP2's default: a 1-d mesh over every rank of the world."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device, (current_world(device).size,))


def _is_hsdp_mesh(mesh: DeviceMesh) -> bool:
    """FSDP2's rule for a 2-d mesh: (replicate, shard); spmd's dim called "dp" takes precedence."""
    names = mesh.mesh_dim_names
    return mesh.ndim == 2 and names is not None and DP_MESH_DIM_NAME not in names


def _resolve_mesh(
    mesh: DeviceMesh | None, dp_mesh_dims: DataParallelMeshDims | None, dp_mesh_dim: int | str | None
) -> tuple[DeviceMesh, int, bool]:
    """The mesh (None: a 1-d mesh over the world), its dp dim, and whether it is FSDP2's HSDP mesh."""
    mesh = _default_mesh() if mesh is None else mesh
    if not isinstance(mesh, DeviceMesh):
        raise torch_object_error(mesh, "fully_shard (mesh)") or TypeError(
            f"fully_shard needs a DeviceMesh for mesh=, got {type(mesh).__name__}"
        )
    hsdp = dp_mesh_dims is None and dp_mesh_dim is None and _is_hsdp_mesh(mesh)
    dp = 1 if hsdp else resolve_dp_mesh_dim(mesh, _dp_dim_name(dp_mesh_dims, dp_mesh_dim))
    return mesh, dp, hsdp


def _dp_dim_name(dims: DataParallelMeshDims | None, dp_mesh_dim: int | str | None) -> int | str | None:
    if dims is None:
        return dp_mesh_dim
    if dp_mesh_dim is not None:
        raise ValueError("fully_shard takes dp_mesh_dims= or spmd's dp_mesh_dim=, not both")
    if dims.replicate is not None:
        raise NotImplementedError(
            "fully_shard: HSDP by DataParallelMeshDims(replicate=...) is not supported by spmd; pass the 2-d "
            'dp mesh itself, replicate dim first (fully_shard(module, mesh=world["dp_replicate", "dp_shard"]))'
        )
    if not isinstance(dims.shard, str):
        raise NotImplementedError(
            f"fully_shard: DataParallelMeshDims(shard={dims.shard!r}) names several dims; spmd shards over one "
            'named dim (flatten them first: mesh[names]._flatten("dp"))'
        )
    return dims.shard


def _check_policies(
    reshard_after_forward: bool | int | None, mp_policy: object, offload_policy: object, mesh: DeviceMesh
) -> None:
    if not isinstance(reshard_after_forward, (bool, type(None))):
        raise NotImplementedError(
            f"fully_shard: reshard_after_forward={reshard_after_forward!r} (resharding to a smaller mesh) is not "
            "supported by spmd; pass True, False or None"
        )
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"fully_shard: mp_policy takes a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"fully_shard: offload_policy takes an OffloadPolicy, got {type(offload_policy).__name__}")
    if isinstance(offload_policy, CPUOffloadPolicy) and mesh.device_type != "cpu":
        raise NotImplementedError(
            "fully_shard: CPUOffloadPolicy on an accelerator mesh is not supported by spmd; drop offload_policy="
        )


def _dp_sub_mesh(mesh: DeviceMesh, dp: int) -> DeviceMesh:
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(f"fully_shard on the {mesh.ndim}-d {mesh} needs named mesh dims (mesh_dim_names=...)")
    return mesh[names[dp]]


def _shard_or_restore(
    modules: Sequence[nn.Module],
    mesh: DeviceMesh,
    dp: int,
    ignored_params: set[nn.Parameter] | None,
    placement_fn: ShardPlacementFn | None,
    hsdp: bool,
) -> list[ShardedParameter]:
    """Shard the modules' owned parameters; on bad input raise, leaving the modules as they were."""
    for m in modules:
        if fully_shard_state(m) is not None:
            raise RuntimeError(f"fully_shard was already called on this {type(m).__name__}; call it once per module")
    ignored = {id(p) for p in ignored_params or ()}
    originals = {
        (id(m), name): (m, name, p) for root in modules for m in root.modules() for name, p in m._parameters.items()
    }
    try:
        return _shard_owned_parameters(modules, mesh, dp, ignored, placement_fn, hsdp)
    except Exception:
        for m, name, param in originals.values():
            m._parameters[name] = param
        raise


def _attach(state: FullyShardState, modules: Sequence[nn.Module]) -> None:
    """Install the state's forward hooks on each module and make it an FSDPModule."""
    before_forward, after_forward = EagerHook(state, "before_forward"), EagerHook(state, "after_forward")
    for m in modules:
        m.register_forward_pre_hook(before_forward, with_kwargs=True)
        # with_kwargs and always_call: un-shadow even if forward raises
        m.register_forward_hook(after_forward, with_kwargs=True, always_call=True)
        setattr(m, _STATE_ATTR, state)
        as_fsdp_module(m)


def _shard_owned_parameters(
    modules: Sequence[nn.Module],
    mesh: DeviceMesh,
    dp: int,
    ignored: set[int],
    placement_fn: ShardPlacementFn | None,
    hsdp: bool,
) -> list[ShardedParameter]:
    """Shard the parameters of the modules' subtrees outside fully_shard'ed submodules, in module order."""
    owned: list[ShardedParameter] = []
    by_id: dict[int, ShardedParameter] = {}  # a parameter shared by two submodules (tied) is sharded once
    pending: list[nn.Module] = list(modules)
    visited: set[int] = set()
    while pending:
        current = pending.pop(0)
        if id(current) in visited:
            continue
        visited.add(id(current))
        for name, param in list(current._parameters.items()):
            if param is None or id(param) in ignored:
                continue
            if type(param) is not nn.Parameter:  # spmd's DTensor, or torch's, which would pass for a plain one
                refuse_torch_object(param, f"fully_shard (parameter {name!r} of {type(current).__name__})")
            first = by_id.get(id(param))
            if first is not None:  # gathered for each place that uses it
                current.register_parameter(name, first.parameter)
                owned.append(first.alias(current, name))
                continue
            sharded = shard_parameter(current, name, param, mesh, dp, placement_fn, hsdp=hsdp)
            by_id[id(param)] = sharded
            owned.append(sharded)
        for child in current.children():
            child_state = fully_shard_state(child)
            if child_state is None:
                pending.append(child)
            else:
                child_state.is_root = False
    return owned
