"""Optimizer state keyed by parameter name, in torch's nested and flattened forms.

``Optimizer.state_dict()`` keys each parameter's state by its position in the optimizer, which
says nothing about which tensor it belongs to once the model is rebuilt, split into pipeline
stages or given a second optimizer. Here it is keyed by the parameter's canonical name, as
``torch.distributed.checkpoint.state_dict`` does::

    nested:    {"state": {"up.weight": {"step": t, "exp_avg": t, ...}},
                "param_groups": [{"lr": 0.01, ..., "params": ["up.weight", ...]}]}
    flattened: {"state.up.weight.exp_avg": t, ..., "param_groups.up.weight.lr": 0.01, ...}

The flattened form gives every value its own key, so optimizers of different pipeline stages
save into one checkpoint without colliding.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from spmd.checkpoint.fqn import parameter_names

__all__ = [
    "init_optimizer_state",
    "optimizer_state_by_name",
    "state_for_optimizer",
    "flatten_optimizer_state",
    "live_state_of",
]

STATE, PARAM_GROUPS, PARAMS = "state", "param_groups", "params"


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state tensors without changing any parameter.

    A load needs tensors of the right layout to fill, but an optimizer creates its state on its
    first step. So, when it has no state and no gradients yet, step once on zero gradients with a
    zero learning rate (AdamW's decay is scaled by the learning rate too), then drop the gradients.
    """
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group[PARAMS]]
    if any(p.grad is not None for p in params):
        return  # mid-step: stepping here would apply those gradients
    learning_rates = [group.get("lr") for group in optimizer.param_groups]
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    for group in optimizer.param_groups:
        if "lr" in group:
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    try:
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, learning_rates):
            if lr is not None:
                group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)


def optimizer_state_by_name(
    model: nn.Module, optimizers: Iterable[torch.optim.Optimizer], fqn_modifiers: str
) -> dict[str, Any]:
    """The nested form for all ``optimizers`` together; state tensors are the optimizers' own."""
    names = parameter_names(model, fqn_modifiers)
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for optimizer in optimizers:
        init_optimizer_state(optimizer)
        name_at = [_name_of(names, p) for group in optimizer.param_groups for p in group[PARAMS]]
        saved = optimizer.state_dict()
        state.update({name_at[index]: values for index, values in saved[STATE].items()})
        groups += [{**group, PARAMS: [name_at[i] for i in group[PARAMS]]} for group in saved[PARAM_GROUPS]]
    return {STATE: state, PARAM_GROUPS: groups}


def state_for_optimizer(
    model: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any], *, strict: bool, fqn_modifiers: str
) -> dict[str, Any]:
    """The part of ``saved`` (nested or flattened, for any set of optimizers) that is ``optimizer``'s,
    in the nested form, its groups listing the parameter names in the optimizer's own order.

    ``Optimizer.load_state_dict`` accepts names there: it pairs saved and current parameters by
    position. With ``strict``, a trainable parameter without saved state is an error.
    """
    if STATE in saved and all(isinstance(key, int) for key in saved[STATE]):
        return saved  # already keyed by position: an Optimizer.state_dict() of this optimizer
    names = parameter_names(model, fqn_modifiers)
    flattened = STATE not in saved
    state_keys = [key for key in saved if key.startswith(f"{STATE}.")] if flattened else []
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for group in optimizer.param_groups:
        group_names = [_name_of(names, p) for p in group[PARAMS]]
        for param, name in zip(group[PARAMS], group_names):
            if flattened:
                values = _flat_param_state(saved, state_keys, name, optimizer.state.get(param, {}))
            else:
                values = saved[STATE].get(name)
            if values is not None:
                state[name] = values
            elif param.requires_grad and strict:
                raise RuntimeError(
                    f"no saved optimizer state for parameter {name!r}, which requires grad; load a checkpoint "
                    "saved from this model, or pass StateDictOptions(strict=False) to keep its current state"
                )
        hyperparameters = _saved_group(saved, group, group_names, flattened)
        groups.append({**hyperparameters, PARAMS: group_names})
    return {STATE: state, PARAM_GROUPS: groups}


def flatten_optimizer_state(nested: dict[str, Any]) -> dict[str, Any]:
    """The flattened form of a nested optimizer state_dict (torch's key scheme)."""
    flat: dict[str, Any] = {}
    for name, values in nested[STATE].items():
        _flatten_into(flat, f"{STATE}.{name}", values)
    for group in nested[PARAM_GROUPS]:
        for name in group[PARAMS]:
            flat.update({f"{PARAM_GROUPS}.{name}.{key}": value for key, value in group.items() if key != PARAMS})
    return flat


def live_state_of(model: nn.Module, optimizer: torch.optim.Optimizer, fqn_modifiers: str) -> dict[str, Any]:
    """Parameter name -> the optimizer's current state for it (what a full state is laid out like)."""
    names = parameter_names(model, fqn_modifiers)
    return {_name_of(names, p): optimizer.state[p] for group in optimizer.param_groups for p in group[PARAMS]}


def _flatten_into(flat: dict[str, Any], prefix: str, values: dict[Any, Any]) -> None:
    for key, value in values.items():
        if isinstance(value, dict):
            _flatten_into(flat, f"{prefix}.{key}", value)
        elif isinstance(value, (torch.Tensor, int, float)):
            flat[f"{prefix}.{key}"] = value
        else:
            raise NotImplementedError(
                f"optimizer state {prefix}.{key} is a {type(value).__name__}; the flattened form holds tensors, "
                "ints, floats and dicts of them: use flatten_optimizer_state_dict=False for this optimizer"
            )


def _flat_param_state(
    saved: dict[str, Any], state_keys: list[str], name: str, live: dict[str, Any]
) -> dict[str, Any] | None:
    """One parameter's state out of the flattened form, with the keys the optimizer has (nested
    values rebuilt from their dotted keys); None when one of them is not saved."""
    prefix = f"{STATE}.{name}."
    values: dict[str, Any] = {key: saved[prefix + key] for key in live if prefix + key in saved}
    if len(values) == len(live) and live:
        return values
    # Nested values, or an optimizer without state to name the keys: look through the saved names.
    found = {key[len(prefix) :]: saved[key] for key in state_keys if key.startswith(prefix)}
    for key in live or dict.fromkeys(k.split(".", 1)[0] for k in found):
        if key in values:
            continue
        if key in found:
            values[key] = found[key]
            continue
        inner = {k[len(key) + 1 :]: v for k, v in found.items() if k.startswith(f"{key}.")}
        if not inner:
            return None
        values[key] = _unflatten(inner)  # "state.<name>.<key>.<inner>..."
    return values


def _unflatten(flat: dict[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        *outer, last = key.split(".")
        node = nested
        for part in outer:
            node = node.setdefault(part, {})
        node[last] = value
    return nested


def _saved_group(
    saved: dict[str, Any], group: dict[str, Any], group_names: list[str], flattened: bool
) -> dict[str, Any]:
    """The saved hyperparameters (``lr``, ``betas``...) of the group holding ``group_names``; the
    group's current ones when none is saved."""
    if flattened and group_names:
        prefix = f"{PARAM_GROUPS}.{group_names[0]}."
        found = {key[len(prefix) :]: value for key, value in saved.items() if key.startswith(prefix)}
        if found:
            return found
    elif not flattened:
        for saved_group in saved[PARAM_GROUPS]:
            if set(saved_group[PARAMS]) & set(group_names) or (not group_names and not saved_group[PARAMS]):
                return {key: value for key, value in saved_group.items() if key != PARAMS}
    return {key: value for key, value in group.items() if key != PARAMS}


def _name_of(names: dict[nn.Parameter, str], param: torch.Tensor) -> str:
    name = names.get(param)  # type: ignore[call-overload]
    if name is None:
        raise ValueError(
            f"an optimizer parameter (shape {list(param.shape)}) is not a parameter of the model; pass the "
            "model (or pipeline stage) whose parameters the optimizer was built over"
        )
    return name
