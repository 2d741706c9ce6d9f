"""The one map from torch's DTensor module names to spmd's, read by the import redirect and the API parity test.

Three kinds of torch module appear here:

* whole modules (``MODULES``): every name the torch module offers comes from one spmd module;
* modules taken name by name (``NAMES``): only the listed names are spmd's; the rest stay torch's
  (``torch.distributed.fsdp``: FSDP1 is not DTensor code) or have no spmd equivalent (torch's
  private DTensor modules, of which spmd offers a few names);
* every other module at or under a root in ``SPMD_ROOTS``: torch's DTensor internals, which spmd
  has no equivalent for. Importing one through the redirect raises ``NoSpmdEquivalentError``.

Everything else (``torch.distributed.checkpoint``'s save and load, c10d, autograd, compile) is not
DTensor code and always stays torch's; the functional collectives are torch's behind a stand-in
that also takes spmd meshes as groups.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal

__all__ = [
    "MODULES",
    "PUBLIC_API_MODULES",
    "NAMES",
    "REEXPORTS",
    "SHADOWED",
    "SPMD_ROOTS",
    "TORCH_FALLBACK",
    "ModuleKind",
    "classify",
    "reexport",
]

MODULES: dict[str, str] = {
    "torch.distributed.tensor": "spmd.tensor",
    "torch.distributed.tensor._api": "spmd.tensor",
    "torch.distributed.tensor.placement_types": "spmd.tensor.placement",
    "torch.distributed.tensor.device_mesh": "spmd.tensor.device_mesh",
    "torch.distributed.tensor.parallel": "spmd.tensor_parallel",
    "torch.distributed.tensor.parallel.api": "spmd.tensor_parallel",
    "torch.distributed.tensor.parallel.style": "spmd.tensor_parallel",
    "torch.distributed.tensor.parallel.loss": "spmd.tensor_parallel",
    "torch.distributed.tensor.experimental": "spmd.tensor.experimental",
    "torch.distributed.tensor.experimental._func_map": "spmd.tensor.experimental._local_map",
    "torch.distributed.tensor.experimental._register_sharding": "spmd.tensor.experimental._register_sharding",
    "torch.distributed.tensor.experimental._attention": "spmd.tensor.experimental._attention",
    "torch.distributed.tensor.experimental._context_parallel._attention": (
        "spmd.tensor.experimental._context_parallel._attention"
    ),
    "torch.distributed.tensor.experimental._context_parallel._load_balancer": (
        "spmd.tensor.experimental._context_parallel._load_balancer"
    ),
    "torch.distributed.tensor.debug": "spmd.tensor.debug",
    "torch.distributed.tensor.debug._comm_mode": "spmd.tensor.debug.comm_mode",
    "torch.distributed.tensor.debug._visualize_sharding": "spmd.tensor.debug.visualize",
    # torch's old package path, kept by torch as an alias of torch.distributed.tensor
    "torch.distributed._tensor": "spmd.tensor",
    "torch.distributed._tensor.api": "spmd.tensor",
    "torch.distributed._tensor.placement_types": "spmd.compat.old_placement_types",
    "torch.distributed._tensor.device_mesh": "spmd.tensor.device_mesh",
    "torch.distributed._tensor.experimental": "spmd.tensor.experimental",
    "torch.distributed.device_mesh": "spmd.tensor.device_mesh",
    "torch.distributed.checkpoint.state_dict": "spmd.checkpoint.state_dict",
    # torch's own functional collectives, taking spmd meshes as groups too
    "torch.distributed._functional_collectives": "spmd.compat.functional_collectives",
    # FSDP2's old path: every name there is FSDP2's
    "torch.distributed._composable.fsdp": "spmd.fsdp",
    "torch.distributed._composable.fsdp.fully_shard": "spmd.fsdp",
}
"""torch module -> the spmd module every one of its names comes from."""

PUBLIC_API_MODULES = (
    "torch.distributed.tensor",
    "torch.distributed.tensor.placement_types",
    "torch.distributed.tensor.parallel",
    "torch.distributed.tensor.debug",
    "torch.distributed.device_mesh",
    "torch.distributed.tensor.experimental",
)
"""Keys of ``MODULES`` that are torch's public DTensor API: spmd's module offers every public name with
the same parameters and defaults, or a listed reason (``tests/test_api_parity.py`` compares them)."""

_FSDP2 = dict.fromkeys(
    (
        "fully_shard",
        "FSDPModule",
        "MixedPrecisionPolicy",
        "OffloadPolicy",
        "CPUOffloadPolicy",
        "DataParallelMeshDims",
        "UnshardHandle",
        "register_fsdp_forward_method",
        "share_comm_ctx",
    ),
    "spmd.fsdp",
)
"""FSDP2's public names (torch.distributed.fsdp's ``__all__`` after the FSDP1 ones)."""

NAMES: dict[str, dict[str, str]] = {
    "torch.distributed.fsdp": _FSDP2,
    "torch.distributed.fsdp._fully_shard": _FSDP2,
    "torch.distributed.tensor._dtensor_spec": {"DTensorSpec": "spmd.tensor.spec", "TensorMeta": "spmd.tensor.spec"},
    "torch.distributed.tensor._random": {"manual_seed": "spmd.tensor.random", "is_rng_supported_mesh": "spmd.tensor.random"},
    "torch.distributed.tensor._collective_utils": {
        "pad_tensor": "spmd.tensor.placement",
        "unpad_tensor": "spmd.tensor.placement",
        "shard_dim_alltoall": "spmd.tensor.redistribute.collectives",
    },
    "torch.distributed.tensor._redistribute": {"redistribute_local_tensor": "spmd.tensor.redistribute.run"},
    "torch.distributed.tensor._utils": {"compute_local_shape_and_global_offset": "spmd.tensor.spec"},
    # torch's stage carries only torch's DTensor between stages; spmd's is torch's with DTensor edges made local
    "torch.distributed.pipelining": {"PipelineStage": "spmd.pipelining"},
}
"""torch module -> {name: the spmd module that has the same name with the same meaning}."""

REEXPORTS: dict[str, dict[str, str]] = {
    "torch.distributed": {"DeviceMesh": "spmd.tensor.device_mesh", "init_device_mesh": "spmd.tensor.device_mesh"},
}
"""torch packages that stay torch's but re-export DTensor names: {package: {name: spmd module}}. Inside a
redirected package those names are spmd's however they are reached (``from torch.distributed import
DeviceMesh``, ``dist.init_device_mesh(...)``); the package's other names stay torch's."""

SHADOWED = frozenset({"torch.distributed._composable.fsdp.fully_shard"})
"""Modules of ``MODULES`` that torch's parent package shadows with a same-named attribute: in torch,
``torch.distributed._composable.fsdp.fully_shard`` (an attribute chain, or ``from ... import fully_shard``)
is the function, not the module. There the redirect gives the spmd module's attribute too."""

TORCH_FALLBACK = frozenset({"torch.distributed.fsdp", "torch.distributed.pipelining"})
"""Modules of ``NAMES`` whose other names stay torch's (FSDP1, wrap policies; pipelining's schedules)."""

SPMD_ROOTS = (
    "torch.distributed.tensor",
    "torch.distributed._tensor",
    "torch.distributed.device_mesh",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed._composable.fsdp",
    "torch.distributed.fsdp._fully_shard",
)
"""Every module at or under these is DTensor code: spmd's, or an import error, never torch's."""

ModuleKind = Literal["spmd", "names", "missing"]


def _under(name: str, root: str) -> bool:
    return name == root or name.startswith(root + ".")


def classify(torch_module: str, keep_torch: Collection[str] = ()) -> ModuleKind | None:
    """How the redirect treats an import of ``torch_module``; None when it stays torch's.

    ``"spmd"``: all of it comes from ``MODULES[torch_module]``; ``"names"``: name by name
    (``NAMES``); ``"missing"``: DTensor code with no spmd equivalent. Modules at or under one of
    ``keep_torch`` stay torch's (the caller's choice, for code paths it knows it will not run).
    """
    if any(_under(torch_module, kept) for kept in keep_torch):
        return None
    if torch_module in MODULES:
        return "spmd"
    if torch_module in NAMES:
        return "names"
    if any(_under(torch_module, root) for root in SPMD_ROOTS):
        return "missing"
    return None


def reexport(torch_package: str, name: str) -> str | None:
    """The spmd module that ``torch_package.name`` comes from when it is a re-exported DTensor name
    (``REEXPORTS``); None otherwise."""
    return REEXPORTS.get(torch_package, {}).get(name)
