"""get_state_dict / set_state_dict: a model and its optimizer as state_dicts keyed by parameter name.

``Optimizer.state_dict()`` keys its state by the parameter's position in the optimizer, which says
nothing about which tensor it belongs to once the model is rebuilt. Here the optimizer state is
keyed by the parameter's name in the model (``"0.weight"``), as DCP users expect, so it loads into
a model laid out differently. (torch's ``torch.distributed.checkpoint.state_dict`` does the same
for its own DTensor and FSDP types; these few functions need none of that machinery.)

Optimizer state of the returned dicts aliases the live state, so ``spmd.checkpoint.load`` into
them fills the optimizer in place; ``set_state_dict`` then installs everything through the public
``load_state_dict`` methods (which also restores plain values such as ``lr`` and ``step``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["get_state_dict", "set_state_dict"]


def get_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(model_state_dict, optimizer_state_dict)``, the optimizer's keyed by parameter name.

    A fresh optimizer has no state yet; it is created here with a zero-learning-rate step on zero
    gradients (parameters do not change), so that a load has tensors of the right layout to fill.
    """
    model_state = model.state_dict()
    if optimizer is None:
        return model_state, {}
    _init_optimizer_state(optimizer)
    names = _parameter_names(model, optimizer)
    saved = optimizer.state_dict()
    state = {names[index]: dict(values) for index, values in saved["state"].items()}
    groups = [{**group, "params": [names[index] for index in group["params"]]} for group in saved["param_groups"]]
    return model_state, {"state": state, "param_groups": groups}


def set_state_dict(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    model_state_dict: dict[str, Any],
    optim_state_dict: dict[str, Any] | None = None,
) -> None:
    """Install state_dicts from ``get_state_dict`` (typically after ``spmd.checkpoint.load``)."""
    model.load_state_dict(model_state_dict)
    if optimizer is None or not optim_state_dict:
        return
    names = _parameter_names(model, optimizer)
    index_of = {name: index for index, name in enumerate(names)}
    saved_groups = optim_state_dict["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"the optimizer state has {len(saved_groups)} param groups but the optimizer has "
            f"{len(optimizer.param_groups)}; build the optimizer with the same groups as the saved one"
        )
    param_groups = []
    for g, saved in enumerate(saved_groups):
        indices = _group_indices(optimizer, g)
        if sorted(saved["params"]) != sorted(names[i] for i in indices):
            raise ValueError(
                f"saved param group {g} holds {saved['params']} but the optimizer's holds "
                f"{[names[i] for i in indices]}; build the optimizer over the same parameters, grouped the same way"
            )
        param_groups.append({**saved, "params": list(indices)})
    unknown = sorted(set(optim_state_dict["state"]) - set(index_of))
    if unknown:
        raise KeyError(f"optimizer state for {unknown}, which are not parameters of the optimizer {names}")
    state = {index_of[name]: values for name, values in optim_state_dict["state"].items()}
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})


def _parameter_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The model name of each optimizer parameter, in the optimizer's index order."""
    name_of = {id(p): name for name, p in model.named_parameters()}
    names: list[str] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in name_of:
                raise ValueError(
                    f"optimizer parameter #{len(names)} (shape {list(p.shape)}) is not a parameter of the model; "
                    "pass the model whose parameters the optimizer was built over"
                )
            names.append(name_of[id(p)])
    return names


def _group_indices(optimizer: torch.optim.Optimizer, group_index: int) -> range:
    start = sum(len(g["params"]) for g in optimizer.param_groups[:group_index])
    return range(start, start + len(optimizer.param_groups[group_index]["params"]))


def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter its optimizer state, without changing any parameter."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if all(p in optimizer.state for p in params):
        return
    zeroed = [p for p in params if p.grad is None]
    learning_rates = [group["lr"] for group in optimizer.param_groups]
    try:
        for p in zeroed:
            p.grad = torch.zeros_like(p)
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, learning_rates):
            group["lr"] = lr
        for p in zeroed:
            p.grad = None
