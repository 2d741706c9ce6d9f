"""List ops whose tensors live on different meshes (FSDP-sharded and TP-sharded parameters in one optimizer)."""

from __future__ import annotations

import torch

from spmd.tensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.testing import DTensorTestBase, with_comms


def _values() -> list[torch.Tensor]:
    return [torch.arange(8.0) / 3, torch.arange(6.0) / 5, torch.arange(4.0) / 7]


class ListOpsAcrossMeshesTest(DTensorTestBase):
    def _dtensors(self) -> list[DTensor]:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        a, b, c = _values()
        return [
            distribute_tensor(a, mesh["dp"], [Shard(0)]),
            distribute_tensor(b, mesh["tp"], [Replicate()]),
            distribute_tensor(c, mesh, [Shard(0), Replicate()]),
        ]

    @with_comms
    def test_foreach_ops_run_once_per_mesh_and_keep_the_order(self) -> None:
        xs = self._dtensors()
        doubled = torch._foreach_mul(xs, 2.0)
        self.assertEqual([d.device_mesh for d in doubled], [x.device_mesh for x in xs])
        for got, want in zip(doubled, torch._foreach_mul(_values(), 2.0)):
            torch.testing.assert_close(got.full_tensor(), want)
        torch._foreach_add_(xs, xs, alpha=0.5)
        for got, want in zip(xs, _values()):
            torch.testing.assert_close(got.full_tensor(), want * 1.5)

    @with_comms
    def test_adamw_over_parameters_on_several_meshes_matches_plain_torch(self) -> None:
        for options in ({"foreach": True}, {"fused": True}):
            params = [torch.nn.Parameter(x) for x in self._dtensors()]
            reference = [torch.nn.Parameter(x) for x in _values()]
            for p, r in zip(params, reference):
                p.grad = p.detach() * 0 + 1
                r.grad = torch.ones_like(r)
            step = torch.optim.AdamW(params, lr=0.1, **options)
            reference_step = torch.optim.AdamW(reference, lr=0.1, **options)
            for _ in range(2):
                step.step()
                reference_step.step()
            for p, r in zip(params, reference):
                torch.testing.assert_close(p.full_tensor(), r.detach())

    @with_comms
    def test_one_position_on_two_meshes_is_still_refused(self) -> None:
        a, b, _ = self._dtensors()
        with self.assertRaisesRegex(ValueError, "different meshes"):
            torch._foreach_add([a, b], [b, a])
