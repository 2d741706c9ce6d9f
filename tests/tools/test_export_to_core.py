"""export_to_core mirrors the repo into PyTorch's layout; the exported copy runs under the new names."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from spmd.tools import export_to_core as etc

REPO = Path(__file__).resolve().parents[2]
ROOT = "coretorch"
MAPPING = etc.load_module_map(ROOT)
EXPORTED_TESTS = [
    "test/distributed/_tensor/test_placement.py",
    "test/distributed/_tensor/device_mesh/test_device_mesh.py",
    "test/distributed/_tensor/test_dtensor_api.py",
    "test/distributed/tensor_parallel/test_legacy_import.py",
]
NAMESPACE_INITS = ["", "distributed", "testing", "testing/_internal", "testing/_internal/distributed"]

# Runs pytest with every import of the original package refused and recorded.
BOOTSTRAP = """
import importlib.abc, sys
attempts = []
class RefuseSpmd(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "spmd" or name.startswith("spmd."):
            attempts.append(name)
            raise ImportError(f"the exported tree imported the original package: {name}")
sys.meta_path.insert(0, RefuseSpmd())
import pytest
rc = pytest.main(sys.argv[1:])
leaked = sorted(m for m in sys.modules if m == "spmd" or m.startswith("spmd."))
if attempts or leaked:
    print("ORIGINAL SPMD IMPORTED:", attempts, leaked)
    rc = rc or 3
sys.exit(rc)
"""


def rewrite(code: str, module: str = "spmd.tensor.api", is_package: bool = False) -> str:
    known = frozenset({"spmd.tensor", "spmd.tensor_parallel", "spmd.tensor.api", "spmd.tensor.comm", "spmd.testing", "spmd.testing.common_dtensor"})
    return etc.rewrite_source(textwrap.dedent(code), module=module, mapping=MAPPING, is_package=is_package, known_modules=known)


def export(dest: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(REPO / "tools" / "export_to_core.py"), str(dest), "--root", ROOT, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


# ----- the rewriter, on small code strings ----------------------------------------------------


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ("from spmd.tensor import DTensor\n", "from coretorch.distributed._tensor import DTensor\n"),
        ("import spmd.tensor.comm as c\n", "import coretorch.distributed._tensor.comm as c\n"),
        ("import spmd.tensor_parallel\n", "import coretorch.distributed.tensor_parallel\n"),
        ("from spmd.testing.common_dtensor import with_comms\n", "from coretorch.testing._internal.common_dtensor import with_comms\n"),
        ("from spmd.testing import run_threaded\n", "from coretorch.testing._internal.distributed._dtensor_testing import run_threaded\n"),
        ("from spmd.tensor import (\n    Shard,  # keep me\n    Replicate,\n)\n", "from coretorch.distributed._tensor import (\n    Shard,  # keep me\n    Replicate,\n)\n"),
        ("def f():\n    from spmd.tensor.comm import x\n", "def f():\n    from coretorch.distributed._tensor.comm import x\n"),
        ("import torch\nimport os.path\n", "import torch\nimport os.path\n"),
        ('log = getLogger("spmd.tensor.dispatch")\n', 'log = getLogger("coretorch.distributed._tensor.dispatch")\n'),
        ('"""Uses ``spmd.tensor_parallel``."""\n', '"""Uses ``coretorch.distributed.tensor_parallel``."""\n'),
        ('__module__ = "spmd.tensor"\n', '__module__ = "coretorch.distributed._tensor"\n'),
        ('msg = "add a rule in spmd/tensor/ops/"  # see spmd.tensor.ops\n', 'msg = "add a rule in coretorch/distributed/_tensor/ops/"  # see coretorch.distributed._tensor.ops\n'),
        ('name = "spmd"; s = "spmd\'s mesh"\n', 'name = "spmd"; s = "spmd\'s mesh"\n'),
        ("import spmd.tensor\nx = spmd.tensor.DTensor\n", "import coretorch.distributed._tensor\nx = coretorch.distributed._tensor.DTensor\n"),
        ('"""Example:\n    from spmd import checkpoint\n"""\n', '"""Example:\n    from coretorch.distributed import _checkpoint\n"""\n'),
        ("# from spmd.tensor import DTensor\n", "# from coretorch.distributed._tensor import DTensor\n"),
    ],
)
def test_rewrites_absolute_imports_and_names(before: str, after: str) -> None:
    assert rewrite(before) == after


def test_relative_import_inside_a_moved_package_stays_relative() -> None:
    code = "from .comm import x\nfrom . import api\n"
    assert rewrite(code, module="spmd.tensor.dispatch") == code


def test_relative_import_across_a_boundary_becomes_absolute() -> None:
    out = rewrite("from ..tensor.comm import x\nfrom .. import tensor_parallel\n", module="spmd.testing.common_dtensor")
    assert out == "from coretorch.distributed._tensor.comm import x\nfrom coretorch.distributed import tensor_parallel\n"
    with pytest.raises(etc.ExportError, match="renamed"):
        rewrite("from .. import tensor\n", module="spmd.testing.common_dtensor")
    # common_dtensor moves away from the rest of spmd.testing: the sibling import must become absolute
    assert rewrite("from .layouts import y\n", module="spmd.testing.common_dtensor") == (
        "from coretorch.testing._internal.distributed._dtensor_testing.layouts import y\n"
    )


def test_from_import_of_a_split_submodule_is_split() -> None:
    out = rewrite("from spmd.testing import common_dtensor, run_threaded\n")
    assert out == (
        "from coretorch.testing._internal import common_dtensor; "
        "from coretorch.testing._internal.distributed._dtensor_testing import run_threaded\n"
    )
    ast.parse(out)


def test_long_import_is_wrapped_like_isort() -> None:
    names = ", ".join(f"name_{i}" for i in range(12))
    out = rewrite(f"from spmd.tensor.api import {names}\n")
    assert out.startswith("from coretorch.distributed._tensor.api import (\n    name_0,\n")
    assert max(len(line) for line in out.splitlines()) <= etc.LINE_LENGTH


def test_unmapped_module_of_the_package_is_an_error() -> None:
    with pytest.raises(etc.ExportError, match=r"spmd\.nowhere.*core_paths\.json"):
        rewrite("import spmd.nowhere\n")


# ----- the command ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("core")
    result = export(dest)
    assert result.returncode == 0, result.stderr
    for pkg in NAMESPACE_INITS:
        (dest / ROOT / pkg / "__init__.py").touch()
    return dest


def test_layout_and_no_original_imports_left(exported: Path) -> None:
    assert (exported / "coretorch/distributed/_tensor/dtensor.py").is_file()
    assert (exported / "coretorch/distributed/tensor_parallel/parallelize.py").is_file()
    assert (exported / "coretorch/testing/_internal/common_dtensor.py").is_file()
    assert (exported / "test/distributed/_tensor/test_placement.py").is_file()
    assert (exported / "test/distributed/tensor_parallel/test_styles.py").is_file()
    for path in exported.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                assert all(a.name.split(".")[0] != "spmd" for a in node.names), path
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                assert (node.module or "").split(".")[0] != "spmd", path
        # nor in text: docstrings, comments and messages name the new modules only
        named = re.search(r"(?<![\w.])spmd(?:[./]\w)|\b(?:from|import)\s+spmd\b", path.read_text())
        assert named is None, f"{path} still names {named.group(0)!r}"


def test_exported_tests_pass_without_the_original_package(exported: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PYTEST"))}
    env["PYTHONPATH"] = str(exported)
    args = [*EXPORTED_TESTS, "-q", "-p", "no:cacheprovider", "-m", "not slow", "-W", "ignore::pytest.PytestUnknownMarkWarning"]
    # -I: ignore the user site and PYTHON* vars, and do not put the CWD on sys.path; PYTHONPATH via -c below
    code = f"import sys; sys.path.insert(0, {str(exported)!r}); exec(compile({BOOTSTRAP!r}, 'bootstrap', 'exec'))"
    result = subprocess.run(
        [sys.executable, "-I", "-c", code, *args], cwd=exported, env=env, capture_output=True, text=True, timeout=180, check=False
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "ORIGINAL SPMD IMPORTED" not in result.stdout


def test_exported_tree_passes_ruff(exported: Path) -> None:
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed")
    # the same config; its first party is the new root, and per-file ignores follow their files
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    ignores = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]["per-file-ignores"]
    moved = {MAPPING.map_path(path): codes for path, codes in ignores.items() if MAPPING.map_path(path)}
    overrides = [f"lint.isort.known-first-party=['{ROOT}']"]
    # one override for the whole table: ruff keeps only the last of several per-file-ignores overrides
    table = ", ".join(f'"{path}" = {codes!r}' for path, codes in moved.items())
    overrides.append(f"lint.per-file-ignores = {{ {table} }}")
    cmd = [ruff, "check", "--no-cache", "--config", str(REPO / "pyproject.toml")]
    cmd += [arg for override in overrides for arg in ("--config", override)] + ["."]
    result = subprocess.run(cmd, cwd=exported, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout[-4000:]


def test_second_run_is_a_noop_and_check_is_clean(exported: Path) -> None:
    before = {p: p.stat().st_mtime_ns for p in exported.rglob("*") if p.is_file()}
    again = export(exported)
    assert again.returncode == 0 and again.stdout.strip() == "up to date", again.stdout
    assert {p: p.stat().st_mtime_ns for p in exported.rglob("*") if p.is_file()} == before
    check = export(exported, "--check")
    assert check.returncode == 0, check.stdout


def test_dry_run_check_and_deletion_on_a_fake_repo(tmp_path: Path) -> None:
    repo, dest = tmp_path / "repo", tmp_path / "dest"
    (repo / "spmd/tensor").mkdir(parents=True)
    (repo / "spmd/tensor/__init__.py").write_text("from spmd.tensor.a import x\n")
    (repo / "spmd/tensor/a.py").write_text("x = 1\n")
    (repo / "spmd/tensor/b.py").write_text("from .a import x\n")
    (dest / "coretorch/distributed/_tensor").mkdir(parents=True)
    stranger = dest / "coretorch/distributed/_tensor/not_ours.py"
    stranger.write_text("# written by someone else\n")

    plan = etc.plan_export(dest, mapping=MAPPING, repo=repo)
    assert set(plan.added) == {
        "coretorch/distributed/_tensor/__init__.py",
        "coretorch/distributed/_tensor/a.py",
        "coretorch/distributed/_tensor/b.py",
        etc.MANIFEST_NAME,
    }
    assert not (dest / etc.MANIFEST_NAME).exists()  # planning (the --dry-run path) writes nothing
    etc.apply_plan(plan)
    assert (dest / "coretorch/distributed/_tensor/__init__.py").read_text() == "from coretorch.distributed._tensor.a import x\n"
    assert etc.plan_export(dest, mapping=MAPPING, repo=repo).is_noop

    (repo / "spmd/tensor/a.py").write_text("x = 2\n")
    (repo / "spmd/tensor/b.py").unlink()
    drifted = etc.plan_export(dest, mapping=MAPPING, repo=repo)
    assert set(drifted.changed) == {"coretorch/distributed/_tensor/a.py", etc.MANIFEST_NAME}
    assert drifted.deleted == ("coretorch/distributed/_tensor/b.py",)
    assert "deleted coretorch/distributed/_tensor/b.py" in drifted.summary()
    etc.apply_plan(drifted)
    assert not (dest / "coretorch/distributed/_tensor/b.py").exists()
    assert stranger.read_text() == "# written by someone else\n"  # never in the manifest: left alone


def test_cli_dry_run_and_check_report_drift(exported: Path, tmp_path: Path) -> None:
    dest = tmp_path / "copy"
    shutil.copytree(exported, dest)
    victim = dest / "coretorch/distributed/_tensor/placement.py"
    victim.write_text(victim.read_text() + "# local edit\n")
    dry = export(dest, "--dry-run")
    assert dry.returncode == 0 and "changed coretorch/distributed/_tensor/placement.py" in dry.stdout
    assert victim.read_text().endswith("# local edit\n")  # --dry-run wrote nothing
    check = export(dest, "--check")
    assert check.returncode == 1
    assert "drifted" in check.stdout and "changed coretorch/distributed/_tensor/placement.py" in check.stdout
    assert export(dest).returncode == 0
    assert export(dest, "--check").returncode == 0
