"""Import torchtitan 0.3.0 on spmd: the redirect (context parallel included), a stand-in for its one triton module, CPU as its device.

Importing this module is the setup; import it before anything imports torchtitan (the test module
does, in pytest and in every gloo process it spawns).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

import spmd.compat

TRITON_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
"""The one module on the llama3 path that imports triton (expert-parallel kernels, unused here)."""


class _TritonKernelsStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Loads ``TRITON_KERNELS`` as a module whose kernels raise, when triton is not installed.

    CPU torch has no triton. A fake ``triton`` would make torch itself believe triton is there
    (``torch.utils._triton.has_triton_package``) for the whole test process, so the stand-in is
    torchtitan's kernels module instead.
    """

    def find_spec(self, fullname: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != TRITON_KERNELS:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)

        def __getattr__(name: str) -> object:
            if name.startswith("__"):
                raise AttributeError(name)

            def kernel(*args: object, **kwargs: object) -> None:
                raise RuntimeError(f"{TRITON_KERNELS}.{name} needs triton, which this (CPU) install lacks")

            return kernel

        module.__getattr__ = __getattr__  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _install() -> None:
    spmd.compat.redirect("torchtitan", "spmd_types._dtensor")
    if importlib.util.find_spec("triton") is None and not any(
        isinstance(finder, _TritonKernelsStandIn) for finder in sys.meta_path
    ):
        sys.meta_path.insert(0, _TritonKernelsStandIn())  # ahead of the redirect's finder


_install()

import torchtitan.distributed.parallel_dims  # noqa: E402
import torchtitan.distributed.utils  # noqa: E402
import torchtitan.tools.utils  # noqa: E402

# With no accelerator torchtitan falls back to "cuda"; these tests run on CPU.
for _module in (torchtitan.tools.utils, torchtitan.distributed.parallel_dims, torchtitan.distributed.utils):
    _module.device_type = "cpu"  # type: ignore[attr-defined]
