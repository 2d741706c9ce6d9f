"""Where a parameter's shards live under fully_shard, and what forward computes with once gathered.

Which tensor dim dp cuts is torch's FSDP2's choice by default: dim 0 (``shard_placement_fn`` may
pick another). When a later mesh dim (tp) cuts that dim too, dp cuts each tp piece, so its
placement is ``_StridedShard(0, split_factor=<tp ranks cutting dim 0>)``, as FSDP2 lays it out: the
same placements, local shapes and checkpoint chunks as on torch. ``shard_first_free_dim`` is the
former spmd default (the first dim no other mesh dim cuts, or whole over dp), for whoever wants
no ``_StridedShard``.

Two layouts, told apart by the mesh the parameter already lives on:

  same mesh (spmd's)   ``parallelize_module(model, mesh, plan)`` on the n-d mesh, then
                       ``fully_shard(block, mesh=mesh)``: the parameter stays on that mesh,
                       Replicate() over dp becomes the dp cut (torch's SPMD-mesh placement). The
                       gathered copy is that DTensor with Replicate() over dp, inputs are DTensors
                       sharded over dp and the loss is the global one, so gradients are summed over dp.
  sibling sub-meshes   torchtitan's: ``parallelize_module(model, world["tp"], plan)`` then
  (FSDP2's)            ``fully_shard(block, mesh=world["dp"])``. The sharded parameter is a DTensor on
                       the root mesh over both dims, dp's cut and tp's placements. The gathered copy
                       is the DTensor on the tp sub-mesh; each rank's batch is its own plain tensor,
                       so each dp rank's gradient is its contribution: summed, then divided by the
                       gradient divide factor (dp size: the mean, as FSDP2 does).

In both, this rank's shard is its dp piece (``torch.chunk`` semantics: uneven, maybe empty) of its
local (tp) tensor, so un-sharding is one plain all_gather of the local pieces whatever the placement.

HSDP (FSDP2's 2-d dp mesh, replicate dim first): a plain parameter becomes a DTensor on that mesh,
``(Replicate(), Shard(0))``; its gathered copy is a plain tensor and each rank's batch its own, as in
FSDP2's layout. With tensor parallelism (torchtitan's ``dp_replicate x dp_shard x tp``: the tp
sub-mesh a sibling of the dp mesh's dims) the sibling layout above gains the replicate dim: on the
root mesh, ``(Replicate(), <dp's cut>, <tp's placements>)``, gathered as the DTensor on the tp
sub-mesh. A shard dim of one rank (DDP over the replicate dim) keeps FSDP2's placement there.

A plain parameter on a 1-d mesh is cut the same way; its gathered copy is a plain tensor, or a
DTensor Replicate() over the mesh when the module's inputs are DTensors on it (the global loss).
A 0-d parameter stays whole over dp (FSDP2 refuses one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from spmd.tensor import DeviceMesh, DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from spmd.tensor.device_mesh.layout import DimLayout, canonical, overlaps
from spmd.tensor.placement import _is_shard_like, _StridedShard, shard_sizes

__all__ = [
    "DP_MESH_DIM_NAME",
    "GatheredLayout",
    "ShardPlacementFn",
    "ShardedParameter",
    "dp_shard_dim",
    "resolve_dp_mesh_dim",
    "shard_first_free_dim",
    "shard_parameter",
]

DP_MESH_DIM_NAME = "dp"
"""The mesh dim name fully_shard shards over on an n-d mesh, by default."""
_MANAGED_ATTR = "_spmd_fully_shard_managed"
"""Set on the parameters fully_shard made, so that a second call on a submodule is caught."""

ShardPlacementFn = Callable[[nn.Parameter], Shard | Replicate | None]
"""``shard_placement_fn``: ``Shard(k)`` for dp to cut dim k, None for FSDP2's default (dim 0), and
(spmd's, not torch's) ``Replicate()`` to keep the parameter whole over dp."""


@dataclass(frozen=True, slots=True)
class GatheredLayout:
    """The DTensor a gathered copy is: its mesh, placements and global shape and stride."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dp: int | None
    """The dp dim's index in ``mesh`` (same-mesh layout), None when dp is not one of its dims."""


@dataclass(frozen=True, eq=False, slots=True)
class ShardedParameter:
    """One parameter that fully_shard manages: where it is registered and how it is gathered."""

    module: nn.Module
    """The module that registers the parameter (the owner or one of its descendants)."""
    name: str
    """Its attribute name on ``module``."""
    parameter: nn.Parameter
    """The sharded DTensor parameter: what the optimizer steps on."""
    dp: int
    """The dp dim's index in the parameter's mesh."""
    dim: int | None
    """The dim of this rank's local tensor that dp cuts; None: the parameter is whole over dp."""
    gathered_shape: tuple[int, ...]
    """This rank's local shape once gathered over dp."""
    gathered: GatheredLayout | None
    """The gathered copy's DTensor layout; None: a plain tensor (1-d FSDP of a plain parameter)."""
    global_loss: bool | None
    """True: the gathered copy is a DTensor over dp (same-mesh layout), and gradients are sums of each dp
    rank's part of the global loss; False: each rank's own loss (FSDP2's); None: decided per call, by
    whether the module's inputs are DTensors on the mesh (a plain parameter on a 1-d mesh)."""

    @property
    def is_sharded(self) -> bool:
        """False for a parameter kept whole over dp (nothing to gather; its gradient is all-reduced)."""
        return self.dim is not None

    def alias(self, module: nn.Module, name: str) -> ShardedParameter:
        """The same parameter registered a second time (a tied weight)."""
        return ShardedParameter(
            module, name, self.parameter, self.dp, self.dim, self.gathered_shape, self.gathered, self.global_loss
        )


def resolve_dp_mesh_dim(mesh: DeviceMesh, dp_mesh_dim: int | str | None) -> int:
    """The index of the data-parallel mesh dim: the only one of a 1-d mesh, else the one named "dp"."""
    return mesh.dim_for(
        dp_mesh_dim,
        default_name=DP_MESH_DIM_NAME,
        purpose="fully_shard",
        argument="dp_mesh_dim",
        hint=' (for HSDP name both dims of a 2-d mesh, none of them "dp": replicate first, then shard)',
    )


def dp_shard_dim(shape: torch.Size, placements: tuple[Placement, ...], dp: int, dp_size: int) -> int | None:
    """The first tensor dim that no mesh dim but ``dp`` cuts and that has a row for every dp rank; None if none.

    spmd's former default (``shard_first_free_dim``); ``dp`` -1 counts every mesh dim's cut.
    """
    if dp_size == 1:
        return None  # nothing to shard; a Shard over a mesh dim of one rank only costs copies
    taken = {p.dim for d, p in enumerate(placements) if d != dp and _is_shard_like(p)}  # _StridedShard too
    for k, size in enumerate(shape):
        if k not in taken and size >= dp_size:
            return k
    return None


def shard_first_free_dim(dp_mesh: DeviceMesh | int) -> ShardPlacementFn:
    """A ``shard_placement_fn``: dp cuts the first dim no other mesh dim cuts, else the parameter stays whole.

    spmd's default before it took FSDP2's: a column-wise weight (tp cuts dim 0) becomes
    ``(Shard(1), Shard(0))`` instead of ``(_StridedShard(0, sf=tp), Shard(0))``, and a tp-sharded bias
    stays whole over dp (its gradient all-reduced). No ``_StridedShard`` appears, so no op ever sees
    one; placements, local shapes and checkpoint chunks then differ from torch's. ``dp_mesh`` (the
    1-d dp mesh, or its size) decides which dims are long enough: one row for every dp rank.

    >>> fully_shard(block, mesh=world["dp"], shard_placement_fn=shard_first_free_dim(world["dp"]))  # doctest: +SKIP
    """
    if isinstance(dp_mesh, DeviceMesh):
        if dp_mesh.ndim != 1:
            raise ValueError(
                f"shard_first_free_dim takes the 1-d dp mesh or its size, got the {dp_mesh.ndim}-d {dp_mesh}; "
                'pass world["dp"] (or world["dp"].size())'
            )
        dp_size = dp_mesh.size()
    else:
        dp_size = dp_mesh
    if not isinstance(dp_size, int) or isinstance(dp_size, bool) or dp_size < 1:
        raise ValueError(f"shard_first_free_dim takes a dp mesh or a positive dp size, got {dp_mesh!r}")

    def placement(param: nn.Parameter) -> Shard | Replicate:
        placements = tuple(param.placements) if isinstance(param, DTensor) else ()
        k = dp_shard_dim(param.shape, placements, -1, dp_size)
        return Replicate() if k is None else Shard(k)

    return placement


def shard_parameter(
    module: nn.Module,
    name: str,
    param: nn.Parameter,
    mesh: DeviceMesh,
    dp: int,
    shard_placement_fn: ShardPlacementFn | None = None,
    *,
    hsdp: bool = False,
) -> ShardedParameter:
    """Replace ``module.<name>`` by a DTensor parameter sharded over dp, in the layout its mesh calls for.

    ``hsdp``: ``mesh`` is FSDP2's 2-d (replicate, shard) dp mesh, ``dp`` its shard dim.
    """
    where = f"{type(module).__name__}.{name}"
    if getattr(param, _MANAGED_ATTR, False):
        raise ValueError(
            f"fully_shard: parameter {where} is already sharded by a fully_shard call (on a parent, or on a "
            "list holding this module); call fully_shard once per module, on the submodules (blocks) "
            "before their parent, or leave it out with ignored_params="
        )
    dim = _dp_dim(shard_placement_fn, param, where)
    if hsdp and isinstance(param, DTensor) and param.device_mesh == mesh:
        raise ValueError(
            f"fully_shard: {where} is a DTensor on the HSDP mesh {mesh} itself; tensor-parallelise on a sibling "
            'sub-mesh (parallelize_module(model, world["tp"], plan)) and pass the (replicate, shard) mesh'
        )
    if isinstance(param, DTensor) and param.device_mesh != mesh:
        sharded = _shard_on_sibling_mesh(module, name, param, mesh, dp, where, dim, hsdp)
    else:
        sharded = _shard_on_same_mesh(module, name, param, mesh, dp, where, dim)
        if hsdp:  # FSDP2's: each rank's own batch, a plain gathered copy
            sharded = replace(sharded, gathered=None, global_loss=False)
    setattr(sharded.parameter, _MANAGED_ATTR, True)
    module.register_parameter(name, sharded.parameter)
    return sharded


def _dp_dim(fn: ShardPlacementFn | None, param: nn.Parameter, where: str) -> int | None:
    """The tensor dim dp cuts, None for whole over dp: ``fn``'s answer, else FSDP2's dim 0 (a 0-d one: whole)."""
    placement = fn(param) if fn is not None else None
    if placement is None:
        return 0 if param.ndim else None
    if type(placement) is Replicate:
        return None
    if type(placement) is not Shard:
        raise ValueError(
            f"fully_shard: shard_placement_fn returned {placement!r} for {where}; return a Shard, None (FSDP2's "
            "default, dim 0) or Replicate() (whole over dp)"
        )
    ndim = param.ndim
    if not -ndim <= placement.dim < ndim:
        raise ValueError(f"fully_shard: shard_placement_fn returned {placement} for the {ndim}-d {where}")
    return placement.dim % ndim


def _check_placements(placements: tuple[Placement, ...], where: str) -> None:
    if any(isinstance(p, Partial) for p in placements):
        raise ValueError(f"fully_shard: parameter {where} is laid out {placements}; a parameter cannot be Partial")


def _dp_placement(k: int | None, split: int) -> Placement:
    """dp's placement when it cuts dim ``k`` (None: none) inside ``split`` pieces that later mesh dims cut it into."""
    if k is None:
        return Replicate()
    return _StridedShard(k, split_factor=split) if split > 1 else Shard(k)


def _dp_piece(local: torch.Tensor, k: int | None, n: int, rank: int) -> torch.Tensor:
    """This dp rank's piece of its local tensor along ``k`` (``torch.chunk``'s sizes), a copy of its own."""
    if k is None:
        return local.clone()
    sizes = shard_sizes(local.size(k), n)
    return local.narrow(k, sum(sizes[:rank]), sizes[rank]).clone()


def _shard_on_same_mesh(
    module: nn.Module, name: str, param: nn.Parameter, mesh: DeviceMesh, dp: int, where: str, k: int | None
) -> ShardedParameter:
    """spmd's layout: the parameter (plain, or a DTensor on ``mesh``) stays on ``mesh``, cut over dp."""
    if isinstance(param, DTensor):
        placements = tuple(param.placements)
        _check_placements(placements, where)
        if not isinstance(placements[dp], Replicate):
            raise ValueError(
                f"fully_shard: parameter {where} is {placements[dp]} over the dp mesh dim of {mesh}; fully_shard "
                'needs it Replicate() there: tensor-parallelise over another mesh dim (the "tp" one)'
            )
    else:
        placements = tuple(Replicate() for _ in range(mesh.ndim))
    # the later mesh dims cutting dim k: dp cuts each of their pieces (right to left, torch's _StridedShard)
    split = 1
    for d in range(dp + 1, mesh.ndim):
        p = placements[d]
        if k is not None and _is_shard_like(p) and p.dim == k:
            split *= mesh.size(d)
    sharded_placements = tuple(_dp_placement(k, split) if d == dp else p for d, p in enumerate(placements))
    with torch.no_grad():
        detached = param.detach()
        if isinstance(detached, DTensor):
            gathered_shape = tuple(detached._local_tensor.shape)
            piece = _dp_piece(detached._local_tensor, k, mesh.size(dp), mesh.get_local_rank(dp))
            local = DTensor.from_local(
                piece, mesh, sharded_placements, shape=tuple(param.shape), stride=tuple(param.stride())
            )
        else:
            local = distribute_tensor(detached, mesh, sharded_placements, src_data_rank=None)
            gathered_shape = tuple(detached.shape)
    # A plain parameter on a 1-d mesh may be gathered as a plain tensor (see the module docstring).
    gathered = GatheredLayout(mesh, placements, tuple(param.shape), tuple(param.stride()), dp)
    sharded = nn.Parameter(local, requires_grad=param.requires_grad)
    global_loss = True if isinstance(param, DTensor) or mesh.ndim > 1 else None
    return ShardedParameter(module, name, sharded, dp, k, gathered_shape, gathered, global_loss)


def _root_order(layouts: list[DimLayout]) -> list[int]:
    """The dims' indices in the root's row-major order (major first), a stable sort.

    A dim of one rank cuts nothing and has no place of its own: it stays right behind the dim
    listed before it (first, if none is), so that HSDP's ``(dp_replicate=2, dp_shard=1)`` keeps
    its order, as FSDP2 keeps the dp mesh's.
    """
    keys: list[tuple[int, int]] = []
    for layout in layouts:
        axes = canonical(layout)
        keys.append((1, -max(stride for _, stride in axes)) if axes else (keys[-1] if keys else (0, 0)))
    return sorted(range(len(layouts)), key=lambda d: keys[d])


def _as_slice_of(root: DeviceMesh, sub: DeviceMesh) -> DeviceMesh:
    """``sub``, or ``root``'s slice over the same dim names when that equals it: a mesh equal to a
    slice of ``root`` (the same ranks, names and world, so the same groups) but cut from another
    root of the same dims, as a DTensor built through a cached sharding decision can carry."""
    names = sub.mesh_dim_names
    if sub._get_root_mesh() is root or not names or not set(names) <= set(root.mesh_dim_names or ()):
        return sub
    candidate = root[names]
    return candidate if candidate == sub else sub


def _sibling_full_mesh(mesh: DeviceMesh, tp_mesh: DeviceMesh, where: str, hsdp: bool) -> tuple[DeviceMesh, list[int]]:
    """The root-mesh slice over fully_shard's dims and tp's, and which of them (dp's first) each of its dims is."""
    root = mesh._get_root_mesh()
    fix = (
        'tensor-parallelise on a sub-mesh of the same mesh as fully_shard\'s (parallelize_module(model, world["tp"], '
        'plan), fully_shard(block, mesh=world["dp"])), or on the n-d mesh itself (fully_shard(block, mesh=world))'
    )
    tp_mesh = _as_slice_of(root, tp_mesh)
    if (mesh.ndim != 1 and not hsdp) or tp_mesh._get_root_mesh() != root or root == mesh:
        raise ValueError(f"fully_shard: parameter {where} is a DTensor on {tp_mesh}, not on {mesh}; {fix}")
    # Each sub-mesh dim's place in the root's rank list (mesh_layout.py), so that dims cut from the
    # root by slicing, _flatten (torchtitan's dp_shard_cp) or _unflatten (torchtitan's fsdp and tp,
    # from one 1-d world mesh, in two calls) combine alike.
    layouts = [*mesh._layout, *tp_mesh._layout]
    names = [*(mesh.mesh_dim_names or ("",) * mesh.ndim), *(tp_mesh.mesh_dim_names or ("",) * tp_mesh.ndim)]
    overlapping = any(overlaps(a, b) for i, a in enumerate(layouts) for b in layouts[i + 1 :])
    if overlapping or len(set(names)) != len(names) or "" in names:
        raise ValueError(
            f"fully_shard: parameter {where} lives on {tp_mesh}, which overlaps fully_shard's mesh {mesh} or "
            f"shares a dim name with it; {fix}"
        )
    order = _root_order(layouts)
    full_layouts, full_names = tuple(layouts[d] for d in order), tuple(names[d] for d in order)
    same_as_root = [canonical(layout) for layout in full_layouts] == [canonical(layout) for layout in root._layout]
    return (root if same_as_root else root._slice(full_layouts, full_names)), order  # the root: under its names


def _shard_on_sibling_mesh(
    module: nn.Module, name: str, param: DTensor, mesh: DeviceMesh, dp: int, where: str, k: int | None, hsdp: bool
) -> ShardedParameter:
    """FSDP2's layout: a DTensor on the tp sub-mesh becomes a DTensor on the root mesh, cut over dp too.

    ``mesh`` is the 1-d dp mesh, or HSDP's (replicate, shard) mesh with ``dp`` its shard dim: the
    parameter is then Replicate() over the replicate dim (FSDP2's HSDP x TP).
    """
    tp_mesh = param.device_mesh
    full_mesh, order = _sibling_full_mesh(mesh, tp_mesh, where, hsdp)  # order: 0 .. mesh.ndim - 1 are dp's dims
    placements = tuple(param.placements)
    _check_placements(placements, where)
    split = 1  # the later tp dims cutting dim k: dp cuts each of their pieces (torch's _StridedShard)
    for d in order[order.index(dp) + 1 :]:
        p = placements[d - mesh.ndim] if d >= mesh.ndim else Replicate()
        if k is not None and _is_shard_like(p) and p.dim == k:
            split *= tp_mesh.size(d - mesh.ndim)
    dp_placement = _dp_placement(k, split)
    full_placements = tuple(
        placements[d - mesh.ndim] if d >= mesh.ndim else dp_placement if d == dp else Replicate() for d in order
    )
    gathered_local = param._local_tensor
    with torch.no_grad():
        piece = _dp_piece(gathered_local, k, mesh.size(dp), mesh.get_local_rank(dp))
        sharded_local = DTensor.from_local(
            piece, full_mesh, full_placements, shape=tuple(param.shape), stride=tuple(param.stride())
        )
    gathered = GatheredLayout(tp_mesh, placements, tuple(param.shape), tuple(param.stride()), None)
    sharded = nn.Parameter(sharded_local, requires_grad=param.requires_grad)
    return ShardedParameter(module, name, sharded, order.index(dp), k, tuple(gathered_local.shape), gathered, False)
