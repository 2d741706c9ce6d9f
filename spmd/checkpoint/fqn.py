"""Canonical names: a parameter's name in the model as written, without what wrappers insert.

``torch.compile`` puts a model under ``_orig_mod``, activation checkpointing under
``_checkpoint_wrapped_module``, FSDP1 under ``_fsdp_wrapped_module`` and DDP under ``module``; a
checkpoint keyed by those names would only load into a model wrapped the same way. As in
``torch.distributed.checkpoint.state_dict``, state_dicts are keyed by the name the parameter has
in the unwrapped model (``layers.0.attn.wq.weight``), and a module may list further hidden
children in a method named by ``StateDictOptions.dsd_fqn_modifiers`` (``{"visible": "hidden"}``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

from torch import nn

__all__ = ["canonical_name", "canonical_keys", "parameter_names"]

WRAPPER_ATTRIBUTES = frozenset({"_checkpoint_wrapped_module", "_fsdp_wrapped_module"})
"""Attributes under which a wrapper module keeps the module it wraps, whatever the wrapper's class."""


def canonical_name(model: nn.Module, name: str, fqn_modifiers: str = "_fqn_modifiers") -> str:
    """``name`` (a state_dict key or ``named_parameters`` name of ``model``) without wrapper parts.

    ``canonical_name(torch.compile(model), "_orig_mod.0.weight") == "0.weight"``.
    """
    kept: list[str] = []
    current: object = model
    for part in name.split("."):
        if isinstance(current, nn.Module):
            if _is_wrapper_step(current, part, fqn_modifiers):
                current = getattr(current, part, None)
                continue
            # A visible name whose module sits under a hidden child: step through the hidden one.
            hidden = _modifiers(current, fqn_modifiers).get(part)
            if hidden is not None and hasattr(current, hidden):
                current = getattr(current, hidden)
        kept.append(part)
        current = getattr(current, part, None) if isinstance(current, nn.Module) else None
    return ".".join(kept)


def canonical_keys(model: nn.Module, keys: Iterable[str], fqn_modifiers: str = "_fqn_modifiers") -> dict[str, str]:
    """Each key's canonical name -> the key itself (two keys that clean to one name are an error)."""
    originals: dict[str, str] = {}
    for key in keys:
        name = canonical_name(model, key, fqn_modifiers)
        if originals.setdefault(name, key) != key:
            raise ValueError(
                f"state_dict keys {originals[name]!r} and {key!r} both name {name!r} once wrapper prefixes are "
                "removed; rename one of the modules"
            )
    return originals


def parameter_names(model: nn.Module, fqn_modifiers: str = "_fqn_modifiers") -> dict[nn.Parameter, str]:
    """Each parameter of ``model`` -> its canonical name (a tied parameter: its first name)."""
    return {param: canonical_name(model, name, fqn_modifiers) for name, param in model.named_parameters()}


def _is_wrapper_step(parent: nn.Module, part: str, fqn_modifiers: str) -> bool:
    if part in WRAPPER_ATTRIBUTES or part in _modifiers(parent, fqn_modifiers).values():
        return True
    if part == "module":
        return _is_instance(parent, "torch.nn.parallel.distributed", "DistributedDataParallel")
    return part == "_orig_mod" and _is_instance(parent, "torch._dynamo.eval_frame", "OptimizedModule")


def _is_instance(module: nn.Module, defined_in: str, class_name: str) -> bool:
    """``isinstance`` against a torch wrapper class, looked up only if its module is loaded (a model
    wrapped by it implies it is), so that importing this module imports neither DDP nor dynamo."""
    home = sys.modules.get(defined_in)
    return home is not None and isinstance(module, getattr(home, class_name))


def _modifiers(module: nn.Module, fqn_modifiers: str) -> dict[str, str]:
    method = getattr(module, fqn_modifiers, None)
    return dict(method()) if callable(method) else {}
