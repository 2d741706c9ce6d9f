"""parallelize_module: apply a plan of parallel styles to a module and its submodules.

A plan is one style (for the module itself) or a dict from submodule names to styles. A name is
a dotted path whose segments may be fnmatch patterns, matched one segment per module level:
``layers.*.attn.q_proj`` names the ``q_proj`` of every layer's ``attn``; ``""`` is the module itself.

On an n-d mesh (``("dp", "tp")``) the styles act on the tp dim only: parameters are replicated on
the other dims, and DTensor activations keep their placements there (the batch stays sharded over
dp), so data parallelism (``spmd.fsdp.fully_shard``, or replicated parameters with a dp-sharded
batch) composes with the plan on the same mesh.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Mapping
from fnmatch import fnmatchcase

from torch import nn

from spmd.tensor import DeviceMesh
from spmd.tensor.device_mesh.mesh import current_mesh
from spmd.tensor.torch_objects import torch_object_error
from spmd.tensor_parallel.layouts import resolve_tp_mesh_dim
from spmd.tensor_parallel.style import ParallelStyle, UnsupportedModuleError

__all__ = ["parallelize_module", "resolve_plan_key"]

Plan = ParallelStyle | Mapping[str, ParallelStyle]


def parallelize_module(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    parallelize_plan: Plan | None = None,
    *,
    src_data_rank: int | None = 0,
    tp_mesh_dim: int | str | None = None,
) -> nn.Module:
    """Parallelise ``module`` in place over the tp dim of ``device_mesh`` as ``parallelize_plan`` says.

    ``tp_mesh_dim`` (name or index) picks the tp dim of an n-d mesh; None: the only dim of a 1-d
    mesh, else the dim named ``"tp"``. Without ``device_mesh`` the mesh entered with ``with mesh:``
    is used; without a plan nothing is parallelised (a warning says so).

    >>> plan = {"layers.*.mlp.up": ColwiseParallel(), "layers.*.mlp.down": RowwiseParallel()}
    >>> parallelize_module(model, mesh["tp"], plan)  # doctest: +SKIP
    >>> parallelize_module(model, mesh, plan)  # the (dp, tp) mesh: batch-sharded DTensor inputs  # doctest: +SKIP
    """
    device_mesh = device_mesh if device_mesh is not None else current_mesh()
    if parallelize_plan is None:
        warnings.warn("parallelize_module got no parallelize_plan; the module is left as it is", stacklevel=2)
        return module
    _check_mesh(device_mesh)
    tp = resolve_tp_mesh_dim(device_mesh, tp_mesh_dim)
    if isinstance(parallelize_plan, ParallelStyle):
        _apply_style(parallelize_plan, module, "", "", device_mesh, src_data_rank, tp)
        return module
    if not isinstance(parallelize_plan, Mapping):
        raise torch_object_error(parallelize_plan, "parallelize_module (parallelize_plan)") or TypeError(
            "parallelize_plan must be a ParallelStyle or a dict of submodule names to ParallelStyles, "
            f"got {type(parallelize_plan).__name__}"
        )
    for key, style in parallelize_plan.items():
        if not isinstance(style, ParallelStyle):
            raise torch_object_error(style, f"parallelize_module (parallelize_plan[{key!r}])") or TypeError(
                f"parallelize_plan[{key!r}] must be a ParallelStyle such as ColwiseParallel(), got {style!r}"
            )
        matches = resolve_plan_key(module, key)
        if not matches:  # a warning, as in torch: a plan shared by model variants may name optional modules
            warnings.warn(_no_match_message(module, key), UserWarning, stacklevel=2)
            continue
        for name, submodule in matches:
            _apply_style(style, submodule, name, key, device_mesh, src_data_rank, tp)
    return module


def resolve_plan_key(module: nn.Module, key: str) -> list[tuple[str, nn.Module]]:
    """The ``(name, submodule)`` pairs a plan key names, in module order (``""`` is ``module``)."""
    level: list[tuple[str, nn.Module]] = [("", module)]
    if key == "":
        return level
    for pattern in key.split("."):
        level = _matching_children(level, pattern)
    return level


def _matching_children(level: list[tuple[str, nn.Module]], pattern: str) -> list[tuple[str, nn.Module]]:
    return [
        (f"{prefix}.{name}" if prefix else name, child)
        for prefix, parent in level
        for name, child in parent.named_children()
        if fnmatchcase(name, pattern)
    ]


def _check_mesh(mesh: DeviceMesh) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise torch_object_error(mesh, "parallelize_module (device_mesh)") or TypeError(
            f"parallelize_module needs a DeviceMesh, got {type(mesh).__name__}"
        )


def _apply_style(
    style: ParallelStyle,
    module: nn.Module,
    name: str,
    key: str,
    mesh: DeviceMesh,
    src_data_rank: int | None,
    tp_mesh_dim: int,
) -> None:
    try:
        style.apply(module, mesh, src_data_rank=src_data_rank, tp_mesh_dim=tp_mesh_dim)
    except UnsupportedModuleError as error:
        where = f"submodule {name!r} (plan key {key!r})" if name else "the root module"
        raise UnsupportedModuleError(f"{where}: {error}") from None


def _no_match_message(module: nn.Module, key: str) -> str:
    """Which part of ``key`` matched nothing, what was there instead, and similar names."""
    patterns = key.split(".")
    level: list[tuple[str, nn.Module]] = [("", module)]
    failed = patterns[0]
    for pattern in patterns:
        following = _matching_children(level, pattern)
        if not following:
            failed = pattern
            break
        level = following
    children = sorted({child for _, parent in level for child, _ in parent.named_children()})
    parents = ", ".join(name or "<root>" for name, _ in level[:4]) + (", ..." if len(level) > 4 else "")
    shown = ", ".join(children[:12]) + (", ..." if len(children) > 12 else "") if children else "none"
    names = [name for name, _ in module.named_modules() if name]
    close = difflib.get_close_matches(key, names, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return (
        f"parallelize_plan key {key!r} matches no submodule of {type(module).__name__}: no child of "
        f"{parents} matches {failed!r} (their children: {shown}){hint}"
    )
