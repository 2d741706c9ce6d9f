"""torch.distributed.checkpoint.state_dict's API for models whose parameters are spmd DTensors.

Same names, signatures and meaning as torch's module, so a training script (torchtitan's
checkpointer, say) runs unchanged on spmd:

- keys are canonical names, without the prefixes ``torch.compile``, activation checkpointing,
  FSDP1 or DDP insert (``spmd.checkpoint.fqn``);
- optimizer state is keyed by parameter name, nested or flattened (``optimizer_state``);
- by default values are the model's own DTensors (each rank its blocks, ready for DCP), and with
  ``StateDictOptions(full_state_dict=True)`` plain full tensors (``full_state``).

Save and resume with DCP (every rank runs this)::

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    # later, into a model and optimizer parallelized as that run wants:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)

Load a one-device checkpoint into a tensor-parallel model (each rank keeps its own blocks)::

    set_model_state_dict(model, torch.load("model.pt"), options=StateDictOptions(full_state_dict=True))
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from spmd.checkpoint.fqn import canonical_keys
from spmd.checkpoint.full_state import broadcast_from_rank0, distribute_tree, gather_full, offload_to_cpu
from spmd.checkpoint.optimizer_state import (
    flatten_optimizer_state,
    init_optimizer_state,
    live_state_of,
    optimizer_state_by_name,
    state_for_optimizer,
)
from spmd.tensor.dtensor import DTensor
from spmd.tensor.torch_objects import refuse_torch_object

__all__ = [
    "FQNS_T",
    "PrimitiveType",
    "ValueType",
    "DictValueType",
    "ListDictValueType",
    "OptimizerStateType",
    "StateDictOptions",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
]

FQNS_T = set[str]
PrimitiveType = DTensor | torch.Tensor | int | float | str
ValueType = PrimitiveType | list[PrimitiveType] | tuple[PrimitiveType] | dict[str, "ValueType"]
DictValueType = dict[str, ValueType]
ListDictValueType = list[DictValueType]
OptimizerStateType = dict[str, DictValueType | ListDictValueType]

_init_optim_state = init_optimizer_state
"""torch's private name for ``init_optimizer_state``, which torchtune calls before loading an
optimizer's state."""

_PLAIN_TENSORS = (torch.Tensor, nn.Parameter)
"""Tensor types that are never torch's DTensor (no need to look further)."""


@dataclass(frozen=True)
class StateDictOptions:
    """How the functions of this module get and set state_dicts (torch's fields and defaults)."""

    full_state_dict: bool = False
    """Plain full tensors instead of DTensors: gathered on get, cut into each rank's blocks on set."""
    cpu_offload: bool = False
    """Tensors on CPU. With ``full_state_dict`` only rank 0 keeps the values; the others get ``{}``."""
    ignore_frozen_params: bool = False
    """Leave out parameters with ``requires_grad=False`` (get)."""
    keep_submodule_prefixes: bool = True
    """With ``submodules`` (deprecated), keep the submodule's own name in the keys."""
    strict: bool = True
    """``load_state_dict``'s strict: missing or unexpected keys raise (set)."""
    broadcast_from_rank0: bool = False
    """Set from rank 0's full state_dict: the other ranks receive each tensor's blocks. Needs
    ``full_state_dict``."""
    flatten_optimizer_state_dict: bool = False
    """One key per optimizer value (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``): optimizers
    of different pipeline stages save into one checkpoint without colliding."""
    dsd_fqn_modifiers: str = "_fqn_modifiers"
    """Name of the method by which a module lists children its state_dict keys leave out."""


def get_model_state_dict(
    model: nn.Module, *, submodules: set[nn.Module] | None = None, options: StateDictOptions | None = None
) -> dict[str, ValueType]:
    """``model``'s state_dict keyed by canonical names: its own DTensors, or (``full_state_dict``) full tensors."""
    options = _checked(options, submodules)
    state = _model_state(model, submodules, options)
    if not state and options.strict and not submodules and not options.ignore_frozen_params:
        raise RuntimeError(f"{type(model).__name__} has an empty state_dict; is it the model you meant to save?")
    return _full_or_offloaded(state, options)


def get_optimizer_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> OptimizerStateType:
    """The state of ``optimizers`` (all together) keyed by parameter name; see ``optimizer_state``."""
    options = _checked(options, submodules)
    return _optimizer_state(model, _as_tuple(optimizers), options)


def get_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    submodules: set[nn.Module] | None = None,
    options: StateDictOptions | None = None,
) -> tuple[dict[str, ValueType], OptimizerStateType]:
    """``(get_model_state_dict(model), get_optimizer_state_dict(model, optimizers))``.

    A fresh optimizer gets its state here (one step on zero gradients with a zero learning rate;
    parameters do not change), so that a load into the result has tensors to fill.
    """
    options = _checked(options, submodules)
    model_state = _full_or_offloaded(_model_state(model, submodules, options), options)
    return model_state, _optimizer_state(model, _as_tuple(optimizers), options)


def set_model_state_dict(
    model: nn.Module, model_state_dict: dict[str, ValueType], *, options: StateDictOptions | None = None
) -> _IncompatibleKeys:
    """Load ``model_state_dict`` (canonical or wrapped keys) into ``model``; returns the missing and
    unexpected keys as ``load_state_dict`` does, by canonical name.

    DTensor values are copied into the parameters (redistributed if laid out differently). With
    ``full_state_dict``, plain full tensors are cut into each parameter's layout locally (nothing is
    sent), and, as in torch, keys the state_dict lacks keep their value and are not reported
    missing; with ``broadcast_from_rank0`` only rank 0's ``model_state_dict`` is read.
    """
    options = _checked(options, None)
    if not model_state_dict and options.strict and not options.broadcast_from_rank0:
        raise RuntimeError(
            "set_model_state_dict got an empty model_state_dict; pass the state to load, or "
            "StateDictOptions(strict=False) to load nothing"
        )
    return _load_model_state(model, model_state_dict, options)


def set_optimizer_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    optim_state_dict: OptimizerStateType,
    *,
    options: StateDictOptions | None = None,
) -> None:
    """Load ``optim_state_dict`` (keyed by parameter name, nested or flattened) into ``optimizers``.

    Each optimizer takes the state of its own parameters (and the saved hyperparameters of their
    groups), so one state_dict serves several optimizers. Call it before ``backward()`` or after
    ``step()``, as in torch: a fresh optimizer's state is made here with one zero step.
    """
    options = _checked(options, None)
    if not optim_state_dict and not options.broadcast_from_rank0:
        raise RuntimeError("set_optimizer_state_dict got an empty optim_state_dict; pass the state to load")
    for optimizer in _as_tuple(optimizers):
        _load_optimizer_state(model, optimizer, optim_state_dict, options)


def set_state_dict(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    *,
    model_state_dict: dict[str, ValueType],
    optim_state_dict: OptimizerStateType,
    options: StateDictOptions | None = None,
) -> _IncompatibleKeys:
    """``set_optimizer_state_dict`` then ``set_model_state_dict``; an empty ``model_state_dict``
    loads the optimizers only. Returns the model's missing and unexpected keys."""
    options = _checked(options, None)
    optimizers = _as_tuple(optimizers)
    if optimizers:
        set_optimizer_state_dict(model, optimizers, optim_state_dict, options=options)
    if not model_state_dict and not options.broadcast_from_rank0:
        return _IncompatibleKeys([], [])
    return _load_model_state(model, model_state_dict, options)


def _checked(options: StateDictOptions | None, submodules: set[nn.Module] | None) -> StateDictOptions:
    options = options if options is not None else StateDictOptions()
    if options.broadcast_from_rank0 and not options.full_state_dict:
        raise ValueError(
            "StateDictOptions(broadcast_from_rank0=True) needs full_state_dict=True: rank 0 holds the full "
            "state_dict the others receive their blocks from"
        )
    if submodules:
        warnings.warn(
            "get_*_state_dict(submodules=...) is deprecated (as in torch); filter the returned state_dict's keys instead",
            FutureWarning,
            stacklevel=3,
        )
    return options


def _as_tuple(
    optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
) -> tuple[torch.optim.Optimizer, ...]:
    return (optimizers,) if isinstance(optimizers, torch.optim.Optimizer) else tuple(optimizers)


def _full_or_offloaded(state: Any, options: StateDictOptions) -> Any:
    if options.full_state_dict:  # gather_full would leave torch's DTensors sharded
        _refuse_torch_dtensors(state, "a full state_dict (StateDictOptions(full_state_dict=True))", ())
        return gather_full(state, cpu_offload=options.cpu_offload)
    return offload_to_cpu(state) if options.cpu_offload else state


@torch.no_grad()
def _model_state(model: nn.Module, submodules: set[nn.Module] | None, options: StateDictOptions) -> dict[str, Any]:
    """``model.state_dict()`` under canonical names, filtered as ``options`` and ``submodules`` ask."""
    raw = model.state_dict()
    keys = canonical_keys(model, raw, options.dsd_fqn_modifiers)
    state = {name: raw[key] for name, key in keys.items()}
    if options.ignore_frozen_params:
        frozen = canonical_keys(
            model,
            (key for key, param in model.named_parameters() if not param.requires_grad),
            options.dsd_fqn_modifiers,
        )
        state = {name: value for name, value in state.items() if name not in frozen}
    if submodules:
        prefixes = [
            f"{name}." for name in canonical_keys(model, (n for n, m in model.named_modules() if m in submodules))
        ]
        kept: dict[str, Any] = {}
        for name, value in state.items():
            for prefix in (p for p in prefixes if name.startswith(p)):
                kept[name if options.keep_submodule_prefixes else name[len(prefix) :]] = value
        state = kept
    return state


def _optimizer_state(
    model: nn.Module, optimizers: tuple[torch.optim.Optimizer, ...], options: StateDictOptions
) -> OptimizerStateType:
    if not optimizers:
        return {}
    with torch.no_grad():
        state: dict[str, Any] = optimizer_state_by_name(model, optimizers, options.dsd_fqn_modifiers)
    if options.flatten_optimizer_state_dict:
        state = flatten_optimizer_state(state)
    return _full_or_offloaded(state, options)


def _refuse_torch_dtensors(state: Any, where: str, path: tuple[Any, ...]) -> None:
    """``MixedDTensorLibrariesError`` for a DTensor of torch.distributed.tensor anywhere in ``state``.

    spmd's functions would take one for a plain tensor: copying it into an spmd DTensor fails deep in
    ``load_state_dict``, and gathering a full state_dict would leave it sharded.
    """
    if isinstance(state, dict):
        for key, value in state.items():
            _refuse_torch_dtensors(value, where, (*path, key))
    elif isinstance(state, (list, tuple)):
        for index, value in enumerate(state):
            _refuse_torch_dtensors(value, where, (*path, index))
    elif isinstance(state, torch.Tensor) and type(state) not in _PLAIN_TENSORS and not isinstance(state, DTensor):
        refuse_torch_object(state, where + "".join(f"[{key!r}]" for key in path))


@torch.no_grad()
def _load_model_state(model: nn.Module, given: dict[str, Any], options: StateDictOptions) -> _IncompatibleKeys:
    _refuse_torch_dtensors(given, "set_model_state_dict (model_state_dict)", ())
    own = model.state_dict(keep_vars=True)
    key_of = canonical_keys(model, own, options.dsd_fqn_modifiers)
    target_of = {name: own[key] for name, key in key_of.items()}
    if options.broadcast_from_rank0:
        # owned: each block is copied out of the broadcast buffer, which is then freed
        given = broadcast_from_rank0(
            lambda: _by_canonical_name(model, given, options), lambda path: target_of.get(path[0]), owned=True
        )
    else:
        given = _by_canonical_name(model, given, options)
        if options.full_state_dict:
            given = distribute_tree(given, lambda path: target_of.get(path[0]))
    if options.full_state_dict and not (options.broadcast_from_rank0 and options.strict):
        given = {**target_of, **given}  # what the state_dict lacks keeps its value (torch's behaviour)
    assign = options.full_state_dict and any(isinstance(t, torch.Tensor) and t.is_meta for t in target_of.values())
    loadable = {key_of.get(name, name): value for name, value in given.items()}
    result = model.load_state_dict(loadable, strict=options.strict, assign=assign)
    name_of = {key: name for name, key in key_of.items()}
    return _IncompatibleKeys(
        [name_of.get(key, key) for key in result.missing_keys],
        [name_of.get(key, key) for key in result.unexpected_keys],
    )


def _by_canonical_name(model: nn.Module, state: dict[str, Any], options: StateDictOptions) -> dict[str, Any]:
    """``state`` keyed by canonical names (a key saved with wrapper prefixes is cleaned too)."""
    return {name: state[key] for name, key in canonical_keys(model, state, options.dsd_fqn_modifiers).items()}


@torch.no_grad()
def _load_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any], options: StateDictOptions
) -> None:
    _refuse_torch_dtensors(saved, "set_optimizer_state_dict (optim_state_dict)", ())
    init_optimizer_state(optimizer)
    modifiers = options.dsd_fqn_modifiers

    def own_part() -> dict[str, Any]:
        return state_for_optimizer(model, optimizer, saved, strict=options.strict, fqn_modifiers=modifiers)

    if options.full_state_dict:
        live = live_state_of(model, optimizer, modifiers)

        def target_of(path: tuple[Any, ...]) -> Any:
            """The live state value at ``path`` (``("state", name, key, ...)``), which a full one is laid out like."""
            node: Any = live if path[:1] == ("state",) else None
            for key in path[1:]:
                node = node.get(key) if isinstance(node, dict) else None
            return node

        if options.broadcast_from_rank0:
            part = broadcast_from_rank0(own_part, target_of, owned=True)
        else:
            part = distribute_tree(own_part(), target_of, owned=True)
    else:
        part = own_part()
    optimizer.load_state_dict(part)
