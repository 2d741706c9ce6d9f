"""spmd offers torch.distributed.tensor's public API under the same names, parameters and defaults.

For every public name of torch's public DTensor modules (``PUBLIC_API_MODULES`` of
``spmd/compat/module_map.py``), the spmd counterpart must exist; functions and
methods must take the same parameters (names, kinds, defaults; keyword-only ones in any order;
torch's and our private ``_``-parameters are not compared); classes are compared by ``__init__``
and by each public member they define. Every difference is listed in ``DIFFERENCES`` with its
reason, and the test also fails when a listed difference is gone, so the list stays true.
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from collections.abc import Iterator
from typing import Any

from spmd.compat.module_map import MODULES, PUBLIC_API_MODULES

# torch's module -> ours, from the one torch <-> spmd module map (DESIGN.md: spmd.tensor_parallel is
# torch.distributed.tensor.parallel).
MODULE_PAIRS = {torch_path: MODULES[torch_path] for torch_path in PUBLIC_API_MODULES}

DIFFERENCES: dict[str, str] = {
    # parallel styles: frozen configs applied by apply(module, mesh, src_data_rank=, tp_mesh_dim=)
    "torch.distributed.tensor.parallel.ParallelStyle.src_data_rank": (
        "styles are frozen values: parallelize_module passes src_data_rank to apply() instead of setting it"
    ),
    "torch.distributed.tensor.parallel.ColwiseParallel.__init__": (
        "use_local_output=None: local tensors on a 1-d mesh (torch's True), DTensors on an n-d mesh, "
        "where our styles act on the tp dim only"
    ),
    "torch.distributed.tensor.parallel.RowwiseParallel.__init__": "use_local_output=None, as ColwiseParallel",
    "torch.distributed.tensor.parallel.PrepareModuleOutput.__init__": "use_local_output=None, as ColwiseParallel",
    "torch.distributed.tensor.parallel.PrepareModuleInputOutput.__init__": (
        "use_local_output=None, as ColwiseParallel"
    ),
    "torch.distributed.tensor.parallel.parallelize_module": (
        "extra keyword tp_mesh_dim= (which dim of an n-d mesh is tp); torch takes a 1-d tp sub-mesh only"
    ),
    # CommDebugMode (spmd/tensor/debug/comm_mode.py)
    "torch.distributed.tensor.debug.CommDebugMode.generate_json_dump": (
        "torch's JSON for its browser viewer; ours prints generate_comm_debug_tracing_table()"
    ),
    "torch.distributed.tensor.debug.visualize_sharding": (
        "file= keyword instead of use_rich= (we print plain text, never through rich)"
    ),
    # DeviceMesh (spmd/tensor/device_mesh/mesh.py)
    "torch.distributed.device_mesh.DeviceMesh.__init__": (
        "mesh is required (torch's mesh=None serves its private _layout path); no backend_override: "
        "one backend per world (gloo/nccl under torchrun, threads under run_threaded)"
    ),
    "torch.distributed.device_mesh.init_device_mesh": (
        "no backend_override (one backend per world); extra timeout= bounding every collective on the mesh"
    ),
}

# torch's Placement is a C++ class: its methods have no Python signature, so only their names are
# compared. Listed so that a method gaining a signature (or disappearing) is noticed.
NO_TORCH_SIGNATURE = {
    f"{module}.Placement.{member}"
    for module in ("torch.distributed.tensor", "torch.distributed.tensor.placement_types")
    for member in ("__init__", "is_partial", "is_replicate", "is_shard")
}


def public_names(module: Any) -> list[str]:
    names = getattr(module, "__all__", None)
    return list(names) if names is not None else [n for n in dir(module) if not n.startswith("_")]


def compared_parameters(fn: Any) -> tuple[list[tuple[str, str, Any]], dict[str, Any], bool] | None:
    """(positional params in order, keyword-only params by name, takes **kwargs); None if no signature."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if parameters and parameters[0].name in ("self", "cls"):
        parameters = parameters[1:]
    parameters = [p for p in parameters if not p.name.startswith("_")]
    positional = [(p.name, p.kind.name, p.default) for p in parameters if p.kind < inspect.Parameter.KEYWORD_ONLY]
    keyword_only = {p.name: p.default for p in parameters if p.kind == inspect.Parameter.KEYWORD_ONLY}
    return positional, keyword_only, any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters)


def unwrap(member: Any) -> Any:
    return member.__func__ if isinstance(member, (staticmethod, classmethod)) else member


def compare_callables(theirs: Any, ours: Any) -> str | None:
    """Why ``ours`` does not take ``theirs``'s parameters, or None when it does."""
    expected, actual = compared_parameters(theirs), compared_parameters(ours)
    if expected is None:
        return "no torch signature"
    if actual is None:
        return "ours has no signature"
    return None if expected == actual else f"torch {expected}\n  ours  {actual}"


def compare_member(qualified: str, theirs: Any, ours_cls: type) -> str | None:
    name = qualified.rsplit(".", 1)[-1]
    try:
        ours = inspect.getattr_static(ours_cls, name)
    except AttributeError:
        return "missing"
    theirs, ours = unwrap(theirs), unwrap(ours)
    if isinstance(theirs, property):
        return None if isinstance(ours, property) or inspect.isdatadescriptor(ours) else "not a property"
    if callable(theirs) and not inspect.isclass(theirs):
        return compare_callables(theirs, ours) if callable(ours) else "not callable"
    return None  # a class constant: its presence is what matters


def differences() -> Iterator[tuple[str, str]]:
    """(torch's qualified name, what differs) for every public name, class member and signature."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for torch_path, spmd_path in MODULE_PAIRS.items():
            theirs_module, ours_module = importlib.import_module(torch_path), importlib.import_module(spmd_path)
            for name in public_names(theirs_module):
                qualified = f"{torch_path}.{name}"
                theirs, ours = getattr(theirs_module, name), getattr(ours_module, name, None)
                if ours is None:
                    yield qualified, f"missing from {spmd_path}"
                elif inspect.isclass(theirs):
                    for member, value in vars(theirs).items():
                        if member.startswith("_") and member != "__init__":
                            continue
                        problem = compare_member(f"{qualified}.{member}", value, ours)
                        if problem:
                            yield f"{qualified}.{member}", problem
                else:
                    problem = compare_callables(theirs, ours)
                    if problem:
                        yield qualified, problem


def test_every_public_name_has_the_same_signature_or_a_listed_reason() -> None:
    found = dict(differences())
    unexplained = {k: v for k, v in found.items() if v != "no torch signature" and k not in DIFFERENCES}
    assert not unexplained, "differences from torch without a reason in DIFFERENCES:\n" + "\n".join(
        f"{k}: {v}" for k, v in unexplained.items()
    )
    stale = sorted(set(DIFFERENCES) - set(found))
    assert not stale, f"listed in DIFFERENCES but now the same as torch (remove them): {stale}"
    unsigned = {k for k, v in found.items() if v == "no torch signature"}
    assert unsigned == NO_TORCH_SIGNATURE


def test_comm_debug_mode_has_torchs_public_attributes() -> None:
    """Attributes torch sets in __init__ (not seen on the class) that users read."""
    from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from spmd.tensor.debug import CommDebugMode

    not_offered = {
        "comm_module_operation_counts": "torch's per-op trace for its JSON viewer (see generate_json_dump)",
        "comm_registry": "the set of torch ops torch's mode intercepts; ours observes our collectives directly",
        "advanced_module_tracker": "torch's ModTracker; ours tracks modules with hooks of its own",
        "supports_higher_order_operators": "a TorchDispatchMode flag; ours is not a dispatch mode",
    }
    dispatch_mode_attributes = set(vars(TorchDispatchMode()))  # torch's mode machinery, not its API
    theirs = {n for n in vars(TorchCommDebugMode()) if not n.startswith("_")} - dispatch_mode_attributes
    ours = CommDebugMode()
    missing = {n for n in theirs if not hasattr(ours, n)}
    assert missing == set(not_offered)
