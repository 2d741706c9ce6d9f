"""fully_shard: ZeRO-3 data parallelism for one module, applied per block and then to the root."""

from __future__ import annotations

from torch import nn

from spmd.fsdp.layout import ShardedParameter, resolve_dp_mesh_dim, shard_parameter
from spmd.fsdp.state import FullyShardState
from spmd.tensor import DeviceMesh

__all__ = ["fully_shard", "fully_shard_state"]

_STATE_ATTR = "_spmd_fully_shard_state"


def fully_shard(
    module: nn.Module,
    mesh: DeviceMesh,
    *,
    reshard_after_forward: bool = True,
    dp_mesh_dim: int | str | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters over the dp mesh dim; gather them for its forward and backward only.

    The module owns every parameter under it that no fully_shard'ed submodule owns, so apply it to
    the blocks first and then to the root, which takes what is left (embeddings, final norm, head):

    >>> for block in model.layers:  # doctest: +SKIP
    ...     fully_shard(block, mesh)
    >>> fully_shard(model, mesh)  # doctest: +SKIP

    Each parameter becomes an ``nn.Parameter`` DTensor, ``Shard(k)`` over dp (see
    ``spmd.fsdp.layout`` for ``k``) and laid out as before on the other mesh dims: a plain tensor is
    Replicate() there, a DTensor from ``parallelize_module(model, mesh, plan)`` on the same n-d mesh
    keeps its tp layout. Gradients come back laid out like the parameters, so the optimizer (built
    after fully_shard) steps on shards. Inputs carry the batch as DTensors sharded over dp
    (``distribute_tensor(batch, mesh, [Shard(0), ...])``); the loss is then the global one.

    ``dp_mesh_dim`` (name or index) is the data-parallel dim; None: the only dim of a 1-d mesh, else
    the dim named ``"dp"``. With ``reshard_after_forward=False`` the gathered parameters stay from
    forward to backward (one all_gather fewer per step, more memory); the root (the module no
    fully_shard'ed ancestor owns) always keeps them, as backward starts with its last layers.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard takes an nn.Module, got {type(module).__name__}")
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard needs a DeviceMesh, got {type(mesh).__name__}")
    if fully_shard_state(module) is not None:
        raise RuntimeError(f"fully_shard was already called on this {type(module).__name__}; call it once per module")
    dp = resolve_dp_mesh_dim(mesh, dp_mesh_dim)
    params = _shard_owned_parameters(module, mesh, dp)
    state = FullyShardState(mesh, dp, params, reshard_after_forward=reshard_after_forward)
    module.register_forward_pre_hook(state.before_forward)
    module.register_forward_hook(state.after_forward, always_call=True)  # un-shadow even if forward raises
    setattr(module, _STATE_ATTR, state)
    return module


def fully_shard_state(module: nn.Module) -> FullyShardState | None:
    """The state ``fully_shard`` attached to ``module`` (its managed parameters), or None."""
    state = module.__dict__.get(_STATE_ATTR)
    return state if isinstance(state, FullyShardState) else None


def _shard_owned_parameters(module: nn.Module, mesh: DeviceMesh, dp: int) -> list[ShardedParameter]:
    """Shard the parameters of ``module``'s subtree outside fully_shard'ed submodules, in module order."""
    owned: list[ShardedParameter] = []
    by_id: dict[int, ShardedParameter] = {}  # a parameter shared by two submodules (tied) is sharded once
    pending: list[nn.Module] = [module]
    while pending:
        current = pending.pop(0)
        for name, param in list(current._parameters.items()):
            if param is None:
                continue
            first = by_id.get(id(param))
            if first is not None:  # gathered for each place that uses it
                current.register_parameter(name, first.parameter)
                owned.append(ShardedParameter(current, name, first.parameter, first.gathered_placements))
                continue
            sharded = shard_parameter(current, name, param, mesh, dp)
            by_id[id(param)] = sharded
            owned.append(sharded)
        for child in current.children():
            child_state = fully_shard_state(child)
            if child_state is None:
                pending.append(child)
            else:
                child_state.is_root = False
    return owned
