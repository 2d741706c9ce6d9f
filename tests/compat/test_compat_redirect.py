"""spmd.compat.redirect: a package written against torch.distributed.tensor runs on spmd, unedited."""

from __future__ import annotations

import copy
import importlib
import inspect
import pickle
import sys
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.fsdp as torch_fsdp
import torch.distributed.tensor as torch_dtensor

import spmd.compat
import spmd.fsdp
import spmd.tensor
import spmd.tensor.random
import spmd.tensor_parallel
from spmd.compat import NoSpmdEquivalentError, RedirectError
from spmd.compat.module_map import MODULES, NAMES, REEXPORTS
from spmd.tensor.debug import CommDebugMode
from spmd.tensor.placement import _StridedShard
from spmd.testing import run_threaded

# Every way third-party code spells an import of torch's DTensor modules.
EVERY_IMPORT_FORM = '''
"""Written against torch.distributed.tensor, as third-party code is."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.tensor
import torch.distributed.tensor.parallel as tp
import torch.distributed.checkpoint as dcp
from torch.distributed import ProcessGroup, tensor as dt
from torch.distributed._tensor import distribute_tensor
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
from torch.distributed.tensor import DTensor, Shard as S
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.experimental import local_map
from torch.distributed.tensor.placement_types import Replicate, _StridedShard

if TYPE_CHECKING:
    from torch.distributed.tensor import Placement

try:
    from torch.distributed.tensor.experimental._attention import context_parallel
except ImportError:
    context_parallel = None

DTENSOR_BY_CHAIN = torch.distributed.tensor.DTensor
COLWISE_BY_ALIAS_CHAIN = dist.tensor.parallel.ColwiseParallel


def manual_seed_by_chain():
    return torch.distributed.tensor._random.manual_seed


class Layer:
    placement_type = torch.distributed.tensor.Shard  # resolved in a class body too
'''

OUTSIDE = """
from torch.distributed.tensor import DTensor
"""

MODEL = """
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def sharded_matmul(a, b):
    mesh = init_device_mesh("cpu", (2,))
    product = distribute_tensor(a, mesh, [Shard(0)]) @ distribute_tensor(b, mesh, [Replicate()])
    return product.full_tensor()


def tensor_parallel_mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    parallelize_module(mlp, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return mlp(x)
"""


def test_every_import_form_gets_spmd_objects(third_party):
    pkg = third_party({"__init__.py": "", "forms.py": EVERY_IMPORT_FORM})
    forms = importlib.import_module(f"{pkg}.forms")

    assert forms.DTensor is spmd.tensor.DTensor
    assert forms.S is spmd.tensor.Shard and forms.Replicate is spmd.tensor.Replicate
    assert forms._StridedShard is _StridedShard
    assert forms.dt is spmd.tensor and forms.tp is spmd.tensor_parallel
    assert forms.distribute_tensor is spmd.tensor.distribute_tensor
    assert forms.DeviceMesh is spmd.tensor.DeviceMesh and forms.init_device_mesh is spmd.tensor.init_device_mesh
    assert forms.CommDebugMode is CommDebugMode
    assert forms.local_map is spmd.tensor.experimental.local_map
    assert forms.DTENSOR_BY_CHAIN is spmd.tensor.DTensor
    assert forms.COLWISE_BY_ALIAS_CHAIN is spmd.tensor_parallel.ColwiseParallel
    assert forms.manual_seed_by_chain() is spmd.tensor.random.manual_seed
    assert forms.Layer.placement_type is spmd.tensor.Shard
    assert forms.__doc__ == "Written against torch.distributed.tensor, as third-party code is."
    # FSDP2 is spmd's; FSDP1, DCP and c10d are not DTensor code and stay torch's.
    assert forms.fully_shard is spmd.fsdp.fully_shard
    assert forms.FullyShardedDataParallel is torch_fsdp.FullyShardedDataParallel
    assert forms.dcp is dcp and forms.ProcessGroup is dist.ProcessGroup
    assert forms.context_parallel is spmd.tensor.experimental.context_parallel  # torch's path, spmd's ring attention
    assert torch_dtensor.DTensor is not spmd.tensor.DTensor  # torch itself is untouched


def test_star_imports_and_module_aliases_of_fsdp_take_fsdp2_from_spmd_and_fsdp1_from_torch(third_party):
    pkg = third_party(
        {
            "__init__.py": """
                import torch.distributed.fsdp as fsdp
                from torch.distributed.tensor import *
                """
        }
    )
    module = importlib.import_module(pkg)
    assert module.fsdp.fully_shard is spmd.fsdp.fully_shard
    assert module.fsdp.FullyShardedDataParallel is torch_fsdp.FullyShardedDataParallel
    assert module.DTensor is spmd.tensor.DTensor and module.distribute_tensor is spmd.tensor.distribute_tensor
    assert "__spmd_compat__" not in spmd.tensor.__all__


REEXPORTING = """
import torch
import torch.distributed as dist
from torch import distributed
from torch.distributed import DeviceMesh, ProcessGroup, init_device_mesh as make_mesh


def meshes_by_chain():
    return dist.init_device_mesh, torch.distributed.DeviceMesh, distributed.init_device_mesh


def torch_names_by_chain():
    return dist.all_reduce, dist.tensor.DTensor
"""


def test_torch_distributed_reexports_of_the_mesh_are_spmds_inside_and_torchs_outside(third_party):
    # Hugging Face transformers builds its meshes with torch.distributed.init_device_mesh(...).
    inside = importlib.import_module(third_party({"__init__.py": REEXPORTING}))
    assert inside.DeviceMesh is spmd.tensor.DeviceMesh and inside.make_mesh is spmd.tensor.init_device_mesh
    mesh_names = (spmd.tensor.init_device_mesh, spmd.tensor.DeviceMesh, spmd.tensor.init_device_mesh)
    assert inside.meshes_by_chain() == mesh_names
    assert inside.torch_names_by_chain() == (dist.all_reduce, spmd.tensor.DTensor)
    assert inside.ProcessGroup is dist.ProcessGroup and inside.dist is dist  # the package itself stays torch's

    outside = importlib.import_module(third_party({"__init__.py": REEXPORTING}, redirect=False))
    assert outside.DeviceMesh is dist.DeviceMesh and outside.meshes_by_chain()[0] is dist.init_device_mesh


def test_a_module_of_a_package_can_be_redirected_alone(third_party):
    # torchtitan's sharding layouts become placements in one module of spmd_types: spmd_types._dtensor.
    pkg = third_party({"__init__.py": OUTSIDE + "from . import placements\n", "placements.py": OUTSIDE}, redirect=False)
    with spmd.compat.redirecting(f"{pkg}.placements"):
        package = importlib.import_module(pkg)
        assert package.DTensor is torch_dtensor.DTensor
        assert package.placements.DTensor is spmd.tensor.DTensor


def test_code_outside_the_package_keeps_torch(third_party):
    inside = third_party({"__init__.py": OUTSIDE})
    outside = third_party({"__init__.py": OUTSIDE}, redirect=False)
    assert importlib.import_module(inside).DTensor is spmd.tensor.DTensor
    assert importlib.import_module(outside).DTensor is torch_dtensor.DTensor
    assert _redirected_here() == (inside,)


def test_package_code_computes_what_plain_torch_does(third_party):
    model = importlib.import_module(third_party({"__init__.py": "", "model.py": MODEL}) + ".model")
    a, b = torch.randn(8, 6), torch.randn(6, 4)
    for product in run_threaded(model.sharded_matmul, 2, a, b):
        torch.testing.assert_close(product, a @ b)

    mlp = torch.nn.Sequential()
    mlp.add_module("up", torch.nn.Linear(6, 8))
    mlp.add_module("down", torch.nn.Linear(8, 6))
    x = torch.randn(4, 6)
    for y in run_threaded(lambda: model.tensor_parallel_mlp(copy.deepcopy(mlp), x), 2):
        torch.testing.assert_close(y, mlp(x))


def test_tracebacks_and_module_attributes_are_the_real_files(third_party):
    pkg = third_party(
        {
            "__init__.py": "from .layers import fail\n",
            "layers.py": """
                from torch.distributed.tensor import (
                    DTensor,
                    Shard,
                )
                import importlib.resources


                def fail():
                    raise ValueError("raised on line 9")


                def readme():
                    return importlib.resources.files(__package__).joinpath("README.txt").read_text()


                class Layout:
                    def __init__(self, placements):
                        self.placements = placements

                    def __eq__(self, other):
                        return self.placements == other.placements
                """,
            "README.txt": "data shipped with the package",
        }
    )
    layers = importlib.import_module(f"{pkg}.layers")
    with pytest.raises(ValueError, match="line 9") as info:
        layers.fail()
    frame = traceback.extract_tb(info.value.__traceback__)[-1]
    assert (frame.filename, frame.lineno, frame.line) == (layers.__file__, 9, 'raise ValueError("raised on line 9")')
    assert inspect.getsource(layers.fail).startswith("def fail():")

    package = sys.modules[pkg]
    assert layers.__spec__.name == f"{pkg}.layers" and layers.__file__.endswith("layers.py")
    assert package.__path__ == [str(package.__file__).rsplit("/", 1)[0]]
    assert layers.readme() == "data shipped with the package"
    layout = layers.Layout((layers.Shard(0),))
    assert pickle.loads(pickle.dumps(layout)) == layout  # pickled by module name, loaded back through the hook


def _redirected_here() -> tuple[str, ...]:
    """The packages these tests redirected (another test module may keep a real package redirected)."""
    return tuple(pkg for pkg in spmd.compat.redirected() if pkg.startswith("thirdparty"))


def test_an_imported_package_is_refused_with_the_fix(third_party):
    pkg = third_party({"__init__.py": OUTSIDE}, redirect=False)
    importlib.import_module(pkg)
    with pytest.raises(RedirectError, match=rf"already imported.*spmd.compat.redirect\('{pkg}'\) before.*spmd.run"):
        spmd.compat.redirect(pkg)
    assert _redirected_here() == ()


def test_redirect_is_idempotent_and_undo_restores_torch(third_party):
    pkg = third_party({"__init__.py": OUTSIDE})
    assert importlib.import_module(pkg).DTensor is spmd.tensor.DTensor
    spmd.compat.redirect(pkg)  # imported now, but already redirected: nothing to do
    assert _redirected_here() == (pkg,)

    spmd.compat.undo(pkg)
    assert _redirected_here() == ()
    assert importlib.import_module(pkg).DTensor is torch_dtensor.DTensor
    with spmd.compat.redirecting(f"{pkg}_later"):
        assert _redirected_here() == (f"{pkg}_later",)
    assert _redirected_here() == ()


@pytest.mark.parametrize("bad", ["torch", "spmd.tensor", "not a name", ""])
def test_torch_spmd_and_non_names_are_refused(bad):
    with pytest.raises(RedirectError):
        spmd.compat.redirect(bad)


def test_torch_internals_spmd_lacks_fail_on_import_naming_module_and_importer(third_party):
    pkg = third_party({"__init__.py": "", "uses_internals.py": "import torch.distributed.tensor._ops._view_ops\n"})
    with pytest.raises(NoSpmdEquivalentError) as info:
        importlib.import_module(f"{pkg}.uses_internals")
    message = str(info.value)
    assert "spmd has no equivalent of torch.distributed.tensor._ops._view_ops" in message
    assert f"imported by {pkg}.uses_internals" in message
    assert isinstance(info.value, ImportError)


def test_a_name_spmd_lacks_fails_naming_it_and_where_it_was_looked_for(third_party):
    pkg = third_party({"__init__.py": "from torch.distributed.tensor.placement_types import Shard, _MaskPartial\n"})
    with pytest.raises(
        NoSpmdEquivalentError,
        match=r"of torch.distributed.tensor.placement_types._MaskPartial "
        r"\(spmd.tensor.placement has no '_MaskPartial'\), imported by thirdparty",
    ):
        importlib.import_module(pkg)


def test_keep_torch_lets_a_package_import_torch_internals_it_will_not_use(third_party):
    # torchtitan imports context parallelism's modules whether or not context parallelism is on.
    attention = "torch.distributed.tensor.experimental._attention"
    pkg = third_party(
        {
            "__init__.py": """
                import torch.distributed.tensor.experimental._attention as attention
                from torch.distributed.tensor import DTensor
                from torch.distributed.tensor.experimental import _attention, local_map
                """
        },
        redirect=False,
    )
    spmd.compat.redirect(pkg, keep_torch=[attention])
    module = importlib.import_module(pkg)
    assert module.attention is sys.modules[attention] and module._attention is sys.modules[attention]
    assert module.DTensor is spmd.tensor.DTensor
    assert module.local_map is spmd.tensor.experimental.local_map


def test_keep_torch_takes_only_modules_the_redirect_changes(third_party):
    with pytest.raises(RedirectError, match=r"'torch\.nn': not a torch DTensor module"):
        spmd.compat.redirect("anything", keep_torch=["torch.nn"])


LOSS_SUM = '''
import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh


def global_sums(value):
    """torchtitan's dist_sum: a functional all_reduce over a mesh, as the group."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = torch.tensor(float(value))
    return (
        funcol.all_reduce(x, "sum", group=mesh["dp"]).item(),
        funcol.all_reduce(x, reduceOp="sum", group=(mesh, 1)).item(),
        funcol.all_reduce(x, "sum", mesh.get_group("tp")).item(),
    )
'''


def test_functional_collectives_take_spmd_meshes_as_groups(third_party):
    pkg = third_party({"__init__.py": LOSS_SUM})
    module = importlib.import_module(pkg)
    assert run_threaded(lambda: module.global_sums(dist.get_rank()), 4) == [
        (2.0, 1.0, 1.0),
        (4.0, 1.0, 1.0),
        (2.0, 5.0, 5.0),
        (4.0, 5.0, 5.0),
    ]
    assert module.funcol.wait_tensor is torch.distributed._functional_collectives.wait_tensor  # the rest is torch's


def test_a_2d_mesh_as_a_functional_collectives_group_names_the_fix(third_party):
    pkg = third_party({"__init__.py": LOSS_SUM.replace('group=mesh["dp"]', "group=mesh")})
    module = importlib.import_module(pkg)
    with pytest.raises(ValueError, match=r"2-d .* pass \(mesh, dim\)"):
        run_threaded(lambda: module.global_sums(0), 4)


OLD_PATHS = """
from torch.distributed._tensor.placement_types import DTensorSpec, Shard, TensorMeta, _StridedShard
from torch.distributed.checkpoint.state_dict import _init_optim_state
"""


def test_names_torchtune_takes_from_torchs_old_and_private_paths(third_party):
    # torchtune 0.6: DTensorSpec and TensorMeta from the old placement_types, and DCP's private
    # _init_optim_state (a zero step that creates the optimizer's state before loading into it).
    module = importlib.import_module(third_party({"__init__.py": OLD_PATHS}))
    assert module.DTensorSpec is spmd.tensor.spec.DTensorSpec and module.TensorMeta is spmd.tensor.spec.TensorMeta
    assert module.Shard is spmd.tensor.Shard and module._StridedShard is _StridedShard
    linear = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(linear.parameters(), lr=0.1)
    before = linear.weight.detach().clone()
    module._init_optim_state(optimizer)
    assert set(optimizer.state[linear.weight]) == {"step", "exp_avg", "exp_avg_sq"}
    assert torch.equal(linear.weight, before) and linear.weight.grad is None


def test_every_name_the_map_lists_exists_in_spmd():
    for torch_module, names in {**NAMES, **REEXPORTS}.items():
        for name, spmd_module in names.items():
            assert hasattr(importlib.import_module(spmd_module), name), f"{torch_module}.{name} -> {spmd_module}"
    for spmd_module in MODULES.values():
        importlib.import_module(spmd_module)
