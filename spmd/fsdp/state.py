"""The forward/backward life of one fully_shard call's parameters, one ``TrainingState`` per phase.

  FORWARD        before forward: all-gather the group's sharded parameters over dp, one all_gather
                 per dtype (``spmd.fsdp.flat``, autograd-tracked), and let each gathered copy shadow
                 the registered shard, so the module's unchanged code computes with it
  IDLE           after forward: un-shadow; with ``reshard_after_forward`` free the gathered storage
                 (``untyped_storage().resize_(0)``: autograd's saved copies share it), except on the
                 root (no fully_shard'ed ancestor), whose backward starts right away
  PRE_BACKWARD   an identity autograd node on the module's outputs runs first in backward: it
                 all-gathers again into the same storage and shadows the parameters again until the
                 group's backward has run, so that activation checkpointing's recompute computes with
                 the gathered copies (not the shards); a recompute that comes first gathers without
                 freeing and enters this phase itself
  POST_BACKWARD  the group's backward: the gathered copies' gradients (each dp rank's contribution)
                 are reduce-scattered in one collective per dtype back to the shards (under HSDP then
                 all-reduced over the replicate dim), so ``.grad`` is laid out like the parameter, and
                 the shards are registered again; IDLE once the backward pass has ended

The hooks on the module are bound methods of this state, which holds only the mesh, the parameters
and their modules, so a fully_shard'ed module pickles and deep-copies (outside forward).

Every collective goes through ``redistribute``, so CommDebugMode and the verbose log see them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any

import torch
from torch import nn
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from spmd.fsdp.flat import GradSync, ReduceOptions, flat_groups, local_shard
from spmd.fsdp.layout import GatheredLayout, ShardedParameter
from spmd.fsdp.policy import MixedPrecisionPolicy
from spmd.tensor import DeviceMesh, DTensor, Partial, Placement
from spmd.tensor.redistribute.run import grad_placements_for, redistribute_traced
from spmd.tensor.spec import DTensorSpec, TensorMeta

__all__ = ["FullyShardState", "TrainingState", "add_storage_resize_observer"]


class TrainingState(Enum):
    """Which phase of a training step one fully_shard group is in (FSDP2's names)."""

    IDLE = auto()
    """Outside forward and the group's backward: the shards are registered (or ``unshard()``'s copies shadow them)."""
    FORWARD = auto()
    """Between the forward hooks: forward's gathered copies shadow the shards."""
    PRE_BACKWARD = auto()
    """Backward has reached the module's outputs (or recomputes its forward): copies gathered for backward
    shadow the shards until the group's backward has run."""
    POST_BACKWARD = auto()
    """The group's backward has run: the shards are registered again, until the backward pass ends."""


class FullyShardState:
    """The parameters one ``fully_shard`` call manages, and their gathered copies during forward."""

    def __init__(
        self,
        mesh: DeviceMesh,
        dp_mesh: DeviceMesh,
        params: Sequence[ShardedParameter],
        *,
        replicate_mesh: DeviceMesh | None = None,
        reshard_after_forward: bool | None,
        mp_policy: MixedPrecisionPolicy,
    ) -> None:
        self.mesh = mesh
        self.dp_mesh = dp_mesh
        """The mesh parameters are sharded over (1-d)."""
        self.replicate_mesh = replicate_mesh
        """HSDP's replicate dim (1-d), over which gradients are all-reduced; None: FSDP."""
        self.params = tuple(params)
        self.groups = tuple(flat_groups(self.params, dp_mesh, mp_policy.param_dtype, replicate_mesh))
        self.reshard_after_forward = reshard_after_forward
        """None: True except on the root, as in FSDP2."""
        self.mp_policy = mp_policy
        self.is_root = True
        """False once a fully_shard'ed ancestor claims this module (fully_shard is applied bottom-up)."""
        self.sync = GradSync()
        self.divide_factor: float | None = None
        """None: dp size for per-rank losses, 1 for the global loss of DTensor inputs."""
        self._gathered: dict[int, torch.Tensor] = {}
        self._views: dict[int, torch.Tensor] = {}
        self._training_state = TrainingState.IDLE
        self._specs: _SpecCache = {}
        """The gathered copies' specs, built once rather than every forward."""

    # ----- forward ------------------------------------------------------------------------------
    def before_forward(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any] | None:
        if self.mp_policy.param_dtype is not None and self.mp_policy.cast_forward_inputs:
            args, kwargs = _cast_floats((args, kwargs), self.mp_policy.param_dtype)
        if self._training_state is TrainingState.PRE_BACKWARD:
            return args, kwargs  # a recompute in backward: the copies shadowed for backward serve it
        self._gathered, views = self.gather(global_loss=self._global_loss(args, kwargs))
        if _in_backward():  # a recompute ahead of the module's backward: its copies serve that backward
            self._pre_backward(views)
        else:
            self._views = views
            self._shadow(views)
            self._training_state = TrainingState.FORWARD
        return args, kwargs

    def after_forward(self, module: nn.Module, args: Any, kwargs: Any, outputs: Any) -> Any:
        if self.mp_policy.output_dtype is not None:
            outputs = _cast_floats(outputs, self.mp_policy.output_dtype)
        if self._training_state is TrainingState.PRE_BACKWARD:
            return outputs  # a recompute: the shadows belong to the backward that runs it
        self._unshadow()
        gathered, views = self._gathered, self._views
        self._gathered, self._views = {}, {}
        self._training_state = TrainingState.IDLE
        leaves, spec = tree_flatten(outputs)
        needs_grad = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not needs_grad:
            return outputs
        reshard = self.reshard_after_forward if self.reshard_after_forward is not None else not self.is_root
        copies = {key: (full, _free(full) if reshard else 0) for key, full in gathered.items()}
        for_backward = _ForBackward(self, copies, views)
        wrapped = _BeforeBackward.apply(for_backward, *(leaves[i] for i in needs_grad))  # type: ignore[no-untyped-call]
        for i, tensor in zip(needs_grad, wrapped):
            leaves[i] = tensor
        return tree_unflatten(leaves, spec)

    # ----- gathering ----------------------------------------------------------------------------
    def gather(self, *, global_loss: bool) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """Every sharded parameter's gathered local tensor and the view forward computes with, by ``id``."""
        factor = (
            self.divide_factor
            if self.divide_factor is not None
            else (1.0 if global_loss else float(self.dp_mesh.size() * self._replicas()))
        )
        options = ReduceOptions(self.mp_policy.reduce_dtype, factor, self.sync, self._post_backward)
        gathered: dict[int, torch.Tensor] = {}
        views: dict[int, torch.Tensor] = {}
        for group in self.groups:
            for param, local in zip(group.params, group.gather(options)):
                key = id(param.parameter)
                if param.is_sharded:
                    gathered[key] = local
                views[key] = _as_gathered(local, param, global_loss, self._specs)
        return gathered, views

    def _replicas(self) -> int:
        return 1 if self.replicate_mesh is None else self.replicate_mesh.size()

    def unshard(self) -> None:
        """Gather now and shadow the shards until ``reshard`` (no autograd: for inspection or a no-grad pass)."""
        with torch.no_grad():
            _, views = self.gather(global_loss=self._global_loss((), {}))
        self._views = views
        self._shadow(views)

    def reshard(self) -> None:
        """Drop the shadows ``unshard`` set; the registered parameters are the shards again.

        Inside forward or before the group's backward has run the shadows are theirs, and stay."""
        if self._training_state not in (TrainingState.FORWARD, TrainingState.PRE_BACKWARD):
            self._unshadow()
            self._views = {}

    def abort_forward(self) -> None:
        """Forward raised: the registered parameters are the shards again."""
        self._unshadow()
        if self._training_state is TrainingState.FORWARD:
            self._gathered, self._views = {}, {}
            self._training_state = TrainingState.IDLE

    def _global_loss(self, args: Any, kwargs: Any) -> bool:
        """Whether forward sees the global loss: a layout that says so, or DTensor inputs on the mesh."""
        fixed = {p.global_loss for p in self.params if p.global_loss is not None}
        if fixed:
            return True in fixed
        leaves, _ = tree_flatten((args, kwargs))
        return any(isinstance(t, DTensor) and t.device_mesh == self.mesh for t in leaves)

    def _shadow(self, views: dict[int, torch.Tensor]) -> None:
        for p in self.params:
            view = views.get(id(p.parameter))
            if view is not None:
                p.module.__dict__[p.name] = view

    def _unshadow(self) -> None:
        for p in self.params:
            p.module.__dict__.pop(p.name, None)

    # ----- backward -----------------------------------------------------------------------------
    def _pre_backward(self, views: dict[int, torch.Tensor]) -> None:
        """Shadow the shards with copies gathered for backward until the group's backward has run."""
        self._views = views
        self._shadow(views)
        self._training_state = TrainingState.PRE_BACKWARD
        # the group's backward un-shadows; this catches a group whose backward never runs
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _post_backward(self) -> None:
        """The group's backward has run: the registered parameters are the shards again."""
        if self._training_state is TrainingState.PRE_BACKWARD:
            self._unshadow()
            self._views = {}
            self._training_state = TrainingState.POST_BACKWARD

    def _finish_backward(self) -> None:
        """The backward pass has ended, whether or not the group's backward ran in it."""
        self._post_backward()
        self._training_state = TrainingState.IDLE


def _in_backward() -> bool:
    """Whether autograd is running a backward on this thread (activation checkpointing's recompute)."""
    return bool(torch._C._current_graph_task_id() != -1)


class EagerHook:
    """One of a state's forward hooks, run outside any compiled graph.

    Compiling the module itself (torchtitan's per-block ``block.compile()``) compiles its hooks as
    well; fully_shard's gather and free parameters eagerly, as FSDP2's do. An object rather than a
    disabled closure, so that a fully_shard'ed module still pickles.
    """

    def __init__(self, state: FullyShardState, method: str) -> None:
        self.state = state
        self.method = method

    @torch.compiler.disable(recursive=True)  # type: ignore[untyped-decorator, no-untyped-call]
    def __call__(self, *args: Any) -> Any:
        return getattr(self.state, self.method)(*args)


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


_SpecCache = dict[tuple[GatheredLayout, torch.dtype], tuple[DTensorSpec, tuple[Placement, ...]]]


def _as_gathered(local: torch.Tensor, param: ShardedParameter, global_loss: bool, specs: _SpecCache) -> torch.Tensor:
    """The gathered local tensor as forward sees it: plain, a DTensor on the tp sub-mesh, or over dp too."""
    layout = param.gathered
    if layout is None or (layout.dp is not None and not global_loss):
        return local
    key = (layout, local.dtype)
    cached = specs.get(key)
    if cached is None:
        cached = specs[key] = _gathered_spec(layout, local.dtype)
    spec, grad_placements = cached
    copy: DTensor = _AsGathered.apply(local, spec, grad_placements)  # type: ignore[no-untyped-call]
    if layout.dp is not None:
        # The global loss: each dp rank's gradient is its part of the sum, whether it reaches the copy
        # as a DTensor or through the copy's to_local() (torchtitan's local embedding lookup, re-wrapped).
        copy._local_grad_placements = grad_placements
    return copy


def _gathered_spec(layout: GatheredLayout, dtype: torch.dtype) -> tuple[DTensorSpec, tuple[Placement, ...]]:
    """A gathered copy's spec, and the layout its gradient goes back to the local tensor in."""
    spec = DTensorSpec(layout.mesh, layout.placements, TensorMeta(layout.shape, layout.stride, dtype))
    if layout.dp is None:  # FSDP2's layout: the tp sub-mesh's gradient, laid out as the copy
        return spec, grad_placements_for(layout.placements)
    return spec, tuple(Partial() if d == layout.dp else p for d, p in enumerate(grad_placements_for(layout.placements)))


class _AsGathered(torch.autograd.Function):
    """This rank's gathered local tensor as the copy's DTensor; backward: the local gradient, laid out as asked."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, spec: DTensorSpec, grad_placements: tuple[Placement, ...]) -> DTensor:
        ctx.grad_placements = grad_placements
        return DTensor(local, spec, requires_grad=False)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[torch.Tensor, None, None]:
        return (
            redistribute_traced(grad._local_tensor, grad._spec, ctx.grad_placements, "fully_shard (backward)"),
            None,
            None,
        )


@dataclass(frozen=True, slots=True)
class _ForBackward:
    """One forward's gathered copies (maybe freed), to refill and shadow again when its backward starts."""

    state: FullyShardState
    copies: dict[int, tuple[torch.Tensor, int]]
    """By ``id`` of the parameter: the gathered local tensor and its freed storage size (0: not freed)."""
    views: dict[int, torch.Tensor]

    def regather(self) -> None:
        """Refill the freed copies in place with a fresh all_gather over dp."""
        if not any(nbytes for _, nbytes in self.copies.values()):
            return
        with torch.no_grad():
            fresh: dict[int, torch.Tensor] = {}
            for group in self.state.groups:
                shards = [local_shard(p.parameter) for p in group.params]
                fresh.update(zip((id(p.parameter) for p in group.params), group.gather_values(shards)))
            for key, (local, nbytes) in self.copies.items():
                if nbytes:
                    _resize(local.untyped_storage(), nbytes)
                    # The same values as before the free: a compiled backward saved this very tensor
                    # and checks that its version did not move.
                    with _unsafe_preserve_version_counter(local):
                        local.copy_(fresh[key])


def _free(local: torch.Tensor) -> int:
    """Free a gathered copy's storage (its own: cut out of the all_gather's result); its size."""
    storage = local.untyped_storage()
    nbytes = storage.nbytes()
    _resize(storage, 0)
    return nbytes


_resize_observers: list[Callable[[torch.UntypedStorage], None]] = []


def add_storage_resize_observer(observer: Callable[[torch.UntypedStorage], None]) -> None:
    """Call ``observer(storage)`` after fully_shard frees or refills a gathered copy's storage.

    Resizing a storage is not an aten op, so dispatch modes do not see it; memory trackers
    (the N-rank simulator) follow these calls instead.
    """
    _resize_observers.append(observer)


def _resize(storage: torch.UntypedStorage, nbytes: int) -> None:
    storage.resize_(nbytes)
    for observer in _resize_observers:
        observer(storage)


class _BeforeBackward(torch.autograd.Function):
    """Identity on the module's outputs whose backward, the first of the module's, re-gathers and re-shadows."""

    @staticmethod
    def forward(ctx: Any, for_backward: _ForBackward, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.for_backward = for_backward
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        for_backward: _ForBackward | None = ctx.for_backward
        if for_backward is not None:
            for_backward.regather()
            for_backward.state._pre_backward(for_backward.views)
        ctx.for_backward = None  # from here autograd's saved copies are the only holders: freed as backward goes
        return (None, *grads)
