"""spmd.compat.audit: before redirecting a package, see which torch DTensor names it uses and what the
redirect would do with each; the package is read, never imported."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed.fsdp as torch_fsdp

import spmd.compat
from spmd.compat.audit_report import Audit, NameReport, main
from spmd.compat.sources import SourceNotFoundError


def names_of(report: Audit) -> dict[str, NameReport]:
    (package,) = report.packages
    return {n.name: n for n in package.names}


# (a module's source, the torch name it uses, what the redirect gives for it)
FORMS = [
    ("from torch.distributed.tensor import DTensor", "torch.distributed.tensor.DTensor", "spmd.tensor.DTensor"),
    ("from torch.distributed.tensor import Shard as S", "torch.distributed.tensor.Shard", "spmd.tensor.Shard"),
    ("from torch.distributed.tensor import *", "torch.distributed.tensor.*", "spmd.tensor.*"),
    ("import torch.distributed.tensor", "torch.distributed.tensor", "spmd.tensor"),
    ("import torch\nx = torch.distributed.tensor.DTensor.from_local", "torch.distributed.tensor.DTensor", "spmd.tensor.DTensor"),
    ("import torch.distributed as dist\nx = dist.tensor.Replicate", "torch.distributed.tensor.Replicate", "spmd.tensor.Replicate"),
    ("import torch.distributed as dist\nx = dist.init_device_mesh", "torch.distributed.init_device_mesh", "spmd.tensor.device_mesh.init_device_mesh"),
    ("from torch import distributed as dist\nx = dist.DeviceMesh", "torch.distributed.DeviceMesh", "spmd.tensor.device_mesh.DeviceMesh"),
    ("from torch.distributed import init_device_mesh", "torch.distributed.init_device_mesh", "spmd.tensor.device_mesh.init_device_mesh"),
    ("import torch.distributed.tensor.parallel as tp\nx = tp.ColwiseParallel", "torch.distributed.tensor.parallel.ColwiseParallel", "spmd.tensor_parallel.ColwiseParallel"),
    ("from torch.distributed import tensor as dt\nx = dt.Partial", "torch.distributed.tensor.Partial", "spmd.tensor.Partial"),
    ("from torch.distributed.tensor import debug\nx = debug.CommDebugMode", "torch.distributed.tensor.debug.CommDebugMode", "spmd.tensor.debug.CommDebugMode"),
    ("from torch.distributed._tensor import distribute_tensor", "torch.distributed._tensor.distribute_tensor", "spmd.tensor.distribute_tensor"),
    ("from torch.distributed.device_mesh import DeviceMesh", "torch.distributed.device_mesh.DeviceMesh", "spmd.tensor.device_mesh.DeviceMesh"),
    ("import torch\nx = torch.distributed.fsdp.fully_shard", "torch.distributed.fsdp.fully_shard", "spmd.fsdp.fully_shard"),
    ("from torch.distributed.fsdp import FSDPModule", "torch.distributed.fsdp.FSDPModule", "spmd.fsdp.FSDPModule"),
    ("from torch.distributed._composable.fsdp import fully_shard", "torch.distributed._composable.fsdp.fully_shard", "spmd.fsdp.fully_shard"),
    ("import torch\nx = torch.distributed._composable.fsdp.fully_shard", "torch.distributed._composable.fsdp.fully_shard", "spmd.fsdp.fully_shard"),
    ("from torch.distributed.fsdp._fully_shard import MixedPrecisionPolicy", "torch.distributed.fsdp._fully_shard.MixedPrecisionPolicy", "spmd.fsdp.MixedPrecisionPolicy"),
    ("from torch.distributed.checkpoint.state_dict import get_model_state_dict", "torch.distributed.checkpoint.state_dict.get_model_state_dict", "spmd.checkpoint.state_dict.get_model_state_dict"),
    ("import torch.distributed.checkpoint as dcp\nx = dcp.state_dict.StateDictOptions", "torch.distributed.checkpoint.state_dict.StateDictOptions", "spmd.checkpoint.state_dict.StateDictOptions"),
    ("import torch.distributed._functional_collectives as funcol\nx = funcol.all_reduce", "torch.distributed._functional_collectives.all_reduce", "spmd.compat.functional_collectives.all_reduce"),
    ("from torch.distributed.tensor._dtensor_spec import DTensorSpec", "torch.distributed.tensor._dtensor_spec.DTensorSpec", "spmd.tensor.spec.DTensorSpec"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("source", "name", "target"), FORMS, ids=[getattr(form, "id", None) or form[0] for form in FORMS]
)
def test_every_import_form_and_attribute_chain_is_found(third_party, source, name, target):
    package = third_party({"__init__.py": source}, redirect=False)
    used = names_of(spmd.compat.audit(package))
    assert name in used, f"{name} not among {sorted(used)}"
    assert (used[name].outcome, used[name].target) == ("spmd", target)
    assert used[name].places[0].file == f"{package}/__init__.py"


def test_a_chain_through_an_alias_of_a_torch_object_stays_torch(third_party):
    package = third_party(
        {
            "__init__.py": """
            from torch.distributed.fsdp.fully_sharded_data_parallel import FullyShardedDataParallel as FSDP
            def modules(model):
                return FSDP.fsdp_modules(model)
            """
        },
        redirect=False,
    )
    assert not spmd.compat.audit(package).fails


def test_the_package_is_read_not_imported(third_party):
    package = third_party(
        {"__init__.py": "raise RuntimeError('imported')\nfrom torch.distributed.tensor import DTensor"}, redirect=False
    )
    assert set(names_of(spmd.compat.audit(package))) == {"torch.distributed.tensor.DTensor"}
    assert package not in sys.modules


def test_verdicts_spmd_torch_on_purpose_and_missing(third_party):
    # The names spmd lacks are made up (``_torch_only``) in these tests, so that mapping more of torch's
    # internals in module_map does not change them.
    package = third_party(
        {
            "__init__.py": """
            import torch
            from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
            from torch.distributed.tensor._random import manual_seed, _torch_only_name
            from torch.distributed.tensor._torch_only.utils import prod
            from torch.distributed.tensor.experimental import _torch_only
            CP = torch.distributed.tensor.experimental._torch_only_too
            """
        },
        redirect=False,
    )
    report = spmd.compat.audit(package)
    used = names_of(report)
    assert (used["torch.distributed.fsdp.fully_shard"].outcome, used["torch.distributed.fsdp.fully_shard"].target) == (
        "spmd",
        "spmd.fsdp.fully_shard",
    )
    assert used["torch.distributed.fsdp.FullyShardedDataParallel"].outcome == "torch"  # FSDP1 stays torch's
    assert used["torch.distributed.tensor._random.manual_seed"].target == "spmd.tensor.random.manual_seed"
    expected_failures = {
        "torch.distributed.tensor._random._torch_only_name": "NoSpmdEquivalentError",  # not listed in NAMES
        "torch.distributed.tensor._torch_only.utils.prod": "NoSpmdEquivalentError",  # a module under SPMD_ROOTS
        "torch.distributed.tensor.experimental._torch_only": "NoSpmdEquivalentError",  # spmd's module lacks it
        "torch.distributed.tensor.experimental._torch_only_too": "AttributeError",  # a chain past spmd's module
    }
    assert {n.name: n.error.partition(":")[0] for n in report.packages[0].failing} == expected_failures
    assert report.fails
    prod = used["torch.distributed.tensor._torch_only.utils.prod"]
    assert "spmd has no equivalent of torch.distributed.tensor._torch_only.utils" in prod.error


def test_keep_torch_as_the_redirect_takes_it(third_party):
    package = third_party(
        {"__init__.py": "from torch.distributed.tensor.experimental._torch_only import context_parallel"},
        redirect=False,
    )
    name = "torch.distributed.tensor.experimental._torch_only.context_parallel"
    assert names_of(spmd.compat.audit(package))[name].outcome == "missing"
    kept = spmd.compat.audit(package, keep_torch=["torch.distributed.tensor.experimental._torch_only"])
    assert names_of(kept)[name].outcome == "kept"
    assert not kept.fails
    with pytest.raises(ValueError, match="not a torch DTensor module"):
        spmd.compat.audit(package, keep_torch=["torch.nn"])


GUARDED = '''
"""Each use of a name spmd lacks, guarded or not."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

try:
    from torch.distributed.tensor._torch_only import in_try
except ImportError:
    in_try = None

try:
    from torch.distributed.tensor._torch_only import in_try_too_narrow  # NoSpmdEquivalentError is not this
except ModuleNotFoundError:
    pass

try:
    from torch.distributed.tensor._torch_only import in_try_everything
except Exception:
    pass

if TYPE_CHECKING:
    from torch.distributed.tensor._torch_only import for_type_checkers

from torch.distributed.tensor._torch_only import at_import


def later():
    from torch.distributed.tensor._torch_only import in_function
    try:
        from torch.distributed.tensor._torch_only import in_function_and_try
    except ImportError:
        pass


def annotated(x: torch.distributed.tensor._torch_only.in_annotation) -> None: ...


class Model:
    in_class_body = torch.distributed.tensor._torch_only.in_class_body
    deferred = lambda self: torch.distributed.tensor._torch_only.in_lambda  # noqa: E731

try:
    chained = torch.distributed.tensor._torch_only.chain_in_try_import_error  # fails with AttributeError
except ImportError:
    pass
'''


def test_guarded_and_unguarded_uses(third_party):
    package = third_party({"__init__.py": GUARDED}, redirect=False)
    paths = {
        n.name.removeprefix("torch.distributed.tensor._torch_only."): n.paths
        for n in spmd.compat.audit(package).packages[0].names
    }
    assert (
        paths
        == {
            "in_try": "try 1",
            "in_try_too_narrow": "default 1",
            "in_try_everything": "try 1",
            "for_type_checkers": "TYPE_CHECKING 1",
            "at_import": "default 1",
            "in_function": "function 1",
            "in_function_and_try": "function+try 1",
            "torch.distributed.tensor._torch_only": "default 2, annotation 1, function 1",  # chains: spmd.tensor has no _torch_only
        }
    )


def test_a_name_used_in_many_places_is_counted_once_with_its_first_places(third_party):
    package = third_party(
        {
            "a.py": "from torch.distributed.tensor import DTensor\n",
            "b.py": "def f():\n    from torch.distributed.tensor import DTensor\n",
            "c.py": "import torch\n" + "x = torch.distributed.tensor.DTensor\n" * 4,
        },
        redirect=False,
    )
    dtensor = names_of(spmd.compat.audit(package))["torch.distributed.tensor.DTensor"]
    assert len(dtensor.places) == 6
    assert (dtensor.paths, dtensor.on_default_path) == ("default 5, function 1", True)
    assert dtensor.where() == f"{package}/a.py:1, {package}/c.py:2, {package}/c.py:3 (+3)"


def test_audit_and_redirect_agree(third_party):
    """Every verdict is what the redirected package then gets: spmd's object, torch's, or the error."""
    imports = [
        "from torch.distributed.tensor import DTensor as value",
        "from torch.distributed.tensor.parallel import RowwiseParallel as value",
        "from torch.distributed.fsdp import fully_shard as value",
        "from torch.distributed.fsdp import FullyShardedDataParallel as value",
        "from torch.distributed.tensor._random import manual_seed as value",
        "from torch.distributed.tensor._random import _torch_only_name as value",
        "from torch.distributed.tensor._torch_only import helper as value",
        "from torch.distributed import init_device_mesh as value",
        "value = torch.distributed.tensor.experimental.local_map",
        "value = torch.distributed.tensor.experimental._torch_only",
        "value = torch.distributed.device_mesh._torch_only",
    ]
    probes = [
        f"try:\n    {line}\nexcept (ImportError, AttributeError) as error:\n    value = error\nVALUES.append(value)\n"
        for line in imports
    ]
    package = third_party({"__init__.py": "import torch\nVALUES = []\n" + "".join(probes)}, redirect=False)
    verdicts = list(spmd.compat.audit(package).packages[0].names)
    line_of = {place.line: n for n in verdicts for place in n.places}
    spmd.compat.redirect(package)
    values = importlib.import_module(package).VALUES
    assert len(line_of) == len(values) == len(imports)
    for (_, verdict), value in zip(sorted(line_of.items()), values):
        if verdict.outcome == "missing":
            assert isinstance(value, Exception), verdict.name
            assert verdict.error == f"{type(value).__name__}: {value}"
        elif verdict.outcome == "spmd":
            module, _, attribute = verdict.target.rpartition(".")
            assert value is getattr(importlib.import_module(module), attribute), verdict.name
        else:
            assert value is getattr(torch_fsdp, verdict.name.rpartition(".")[2]), verdict.name
    outcomes = sorted(n.outcome for n in verdicts)
    assert outcomes == ["missing"] * 4 + ["spmd"] * 6 + ["torch"]


def test_a_folder_a_dotted_name_and_an_unknown_target(third_party, tmp_path):
    package = third_party(
        {"__init__.py": "", "sub/__init__.py": "", "sub/model.py": "from torch.distributed.tensor import Shard"},
        redirect=False,
    )
    by_folder = spmd.compat.audit(tmp_path / package).packages[0]
    by_name = spmd.compat.audit(f"{package}.sub").packages[0]
    assert by_folder.package == by_name.package.partition(".")[0] == package
    assert by_folder.names == by_name.names
    assert by_name.names[0].places[0].file == f"{package}/sub/model.py"
    with pytest.raises(SourceNotFoundError, match="neither a directory nor an installed package"):
        spmd.compat.audit("no_such_package_anywhere")


def test_an_unpacked_wheel_gives_its_version(tmp_path):
    (tmp_path / "wheel" / "client").mkdir(parents=True)
    (tmp_path / "wheel" / "client" / "__init__.py").write_text("from torch.distributed.tensor import DTensor\n")
    (tmp_path / "wheel" / "client-1.2.3.dist-info").mkdir()
    (tmp_path / "wheel" / "client-1.2.3.dist-info" / "METADATA").write_text("Name: client\nVersion: 1.2.3\n")
    (audited,) = spmd.compat.audit(tmp_path / "wheel").packages
    assert (audited.package, audited.version, audited.files) == ("wheel", "1.2.3", 1)
    assert audited.names[0].places[0].file == "client/__init__.py"


def test_files_that_do_not_parse_are_listed_not_audited(third_party):
    package = third_party(
        {"__init__.py": "from torch.distributed import tensor\n", "old.py": "print 'distributed'\n"}, redirect=False
    )
    (audited,) = spmd.compat.audit(package).packages
    assert [line.partition(":")[0] for line in audited.unreadable] == [f"{package}/old.py"]
    assert [n.name for n in audited.names] == ["torch.distributed.tensor"]


def test_command_exit_status_and_formats(third_party, capsys):
    fine = third_party({"__init__.py": "from torch.distributed.tensor import DTensor"}, redirect=False)
    broken = third_party(
        {"__init__.py": "def f():\n    from torch.distributed.tensor._torch_only import x"}, redirect=False
    )

    assert main([fine]) == 0
    table = capsys.readouterr().out
    assert "torch.distributed.tensor.DTensor  spmd.tensor.DTensor  1     default 1  " in table

    assert main([fine, broken]) == 1  # a failure anywhere, even off the default path
    assert "FAILS: no spmd equivalent (NoSpmdEquivalentError)" in capsys.readouterr().out

    assert main(["--json", broken]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["fails"] is True and data["keep_torch"] == []
    (package,) = data["packages"]
    assert set(package) == {"package", "version", "root", "files", "unreadable", "names"}
    assert package["names"] == [
        {
            "name": "torch.distributed.tensor._torch_only.x",
            "outcome": "missing",
            "target": "no spmd equivalent",
            "error": package["names"][0]["error"],
            "fails": True,
            "default_path": False,
            "uses": [{"file": f"{broken}/__init__.py", "line": 2, "guards": ["function"]}],
        }
    ]

    assert main(["--markdown", fine, broken]) == 1
    markdown = capsys.readouterr().out
    assert f"| `torch.distributed.tensor.DTensor` | spmd.tensor.DTensor | {fine} 1 (default 1) |" in markdown
    assert f"| `torch.distributed.tensor._torch_only.x` | {broken} | function 1 | {broken}/__init__.py:2 |" in markdown

    with pytest.raises(SystemExit) as exit_:
        main(["no_such_package_anywhere"])
    assert exit_.value.code == 2


def test_python_m_runs_the_command_and_spmd_compat_audit_stays_the_function(third_party, tmp_path, monkeypatch):
    package = third_party({"__init__.py": "from torch.distributed.tensor import DTensor"}, redirect=False)
    command = [sys.executable, "-W", "error::RuntimeWarning", "-m", "spmd.compat.audit", str(tmp_path / package)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=Path(spmd.__file__).parent.parent)
    assert (done.returncode, done.stderr) == (0, "")
    assert "spmd.tensor.DTensor" in done.stdout

    # importing the command module rebinds spmd.compat.audit to it; it is callable all the same
    monkeypatch.setattr(spmd.compat, "audit", spmd.compat.audit)
    monkeypatch.delitem(sys.modules, "spmd.compat.audit", raising=False)
    command_module = importlib.import_module("spmd.compat.audit")
    assert spmd.compat.audit is command_module
    assert names_of(spmd.compat.audit(package))["torch.distributed.tensor.DTensor"].target == "spmd.tensor.DTensor"
