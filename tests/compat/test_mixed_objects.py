"""spmd.compat's functional collectives (torch's funcol inside redirected packages) given torch's objects.

The stand-in passes an spmd mesh on as its process group; torch's own ``DeviceMesh`` goes to torch's
functions unchanged, which take it, so code that mixes the two libraries keeps working here.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

import spmd.compat.functional_collectives as funcol
from spmd.tensor import init_device_mesh
from spmd.testing import run_threaded


def test_functional_collectives_stand_in_takes_torchs_mesh_and_spmds() -> None:
    def program() -> tuple[torch.Tensor, torch.Tensor]:
        by_torchs_mesh = funcol.all_reduce(torch.ones(3), "sum", torch_init_device_mesh("cpu", (2,)))
        by_spmds_mesh = funcol.all_reduce(torch.ones(3), "sum", init_device_mesh("cpu", (2,)))
        return funcol.wait_tensor(by_torchs_mesh), funcol.wait_tensor(by_spmds_mesh)

    for by_torchs_mesh, by_spmds_mesh in run_threaded(program, 2):
        torch.testing.assert_close(by_torchs_mesh, torch.full((3,), 2.0))
        torch.testing.assert_close(by_spmds_mesh, torch.full((3,), 2.0))
