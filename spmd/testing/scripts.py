"""Loading a script (an example, a benchmark) as a module, once per process, for tests to call into."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["load_script"]


def load_script(path: str | Path, name: str | None = None) -> ModuleType:
    """The module of the script at ``path``, registered in ``sys.modules`` as ``name`` (its stem).

    Loaded once per process: every test module gets the same module object, so its classes are
    the ones their name resolves to (dataclasses, pickling and isinstance all rely on that).
    """
    path = Path(path).resolve()
    name = name or path.stem
    loaded = sys.modules.get(name)
    if loaded is not None and Path(getattr(loaded, "__file__", "") or "").resolve() == path:
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # registered before it runs: dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module
