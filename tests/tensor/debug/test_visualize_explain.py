"""visualize_sharding tables (even and uneven) and explain's candidate list."""

from __future__ import annotations

import io

import torch

from spmd.tensor import Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import explain, sharding_table, visualize_sharding
from spmd.testing import DTensorTestBase, with_comms

aten = torch.ops.aten


class VisualizeTest(DTensorTestBase):
    @with_comms
    def test_2d_mesh_even_blocks(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        d = distribute_tensor(torch.zeros(8, 6), mesh, [Shard(0), Shard(1)])
        self.assertEqual(
            sharding_table(d).splitlines(),
            [
                "f32[8,6] (S(0), S(1)) on mesh(d0=2, d1=2)",
                "         | cols 0:3       | cols 3:6",
                "rows 0:4 | ranks 0 (0, 0) | ranks 1 (0, 1)",
                "rows 4:8 | ranks 2 (1, 0) | ranks 3 (1, 1)",
            ],
        )

    @with_comms
    def test_uneven_shards_show_real_sizes(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        d = distribute_tensor(torch.zeros(7, 3), mesh, [Shard(0)])
        lines = sharding_table(d).splitlines()
        self.assertEqual([line.split("|")[0].strip() for line in lines[2:]], ["rows 0:2", "rows 2:4", "rows 4:6", "rows 6:7"])
        self.assertIn("ranks 3", lines[-1])
        five = distribute_tensor(torch.zeros(5), mesh, [Shard(0)])
        self.assertEqual(sharding_table(five).splitlines()[-1], "empty shards on ranks 3")

    @with_comms
    def test_replicas_and_partials_share_a_cell(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        d = distribute_tensor(torch.zeros(4, 4), mesh, [Partial(), Shard(1)])
        text = sharding_table(d)
        self.assertIn("ranks 0 (0, 0), 2 (1, 0)", text)
        self.assertIn("partial over mesh dim 0 (P(sum))", text)
        r = distribute_tensor(torch.zeros(4), init_device_mesh("cpu", (4,)), [Replicate()])
        self.assertIn("ranks 0, 1, 2, 3", sharding_table(r))

    @with_comms
    def test_prints_on_rank_zero_only(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        out = io.StringIO()
        text = visualize_sharding(distribute_tensor(torch.zeros(4, 4), mesh, [Shard(1)]), "weights", file=out)
        self.assertTrue(text.startswith("weights\n"))
        self.assertEqual(out.getvalue(), text + "\n" if self.rank == 0 else "")


class ExplainTest(DTensorTestBase):
    @with_comms
    def test_explain_lists_candidates_with_costs(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        a = distribute_tensor(torch.zeros(8, 6), mesh, [Shard(1)])
        b = distribute_tensor(torch.zeros(6, 4), mesh, [Replicate()])
        text = str(explain(aten.mm.default, a, b))
        lines = text.splitlines()
        self.assertEqual(lines[0], "aten.mm.default")
        self.assertIn("input 0: f32[8,6] (S(1)) on mesh(d0=4)", text)
        chosen = [line for line in lines if line.strip().startswith("->")]
        self.assertEqual(len(chosen), 1)
        self.assertIn("S(1), S(0) -> P(sum)", chosen[0])
        self.assertIn("no communication", chosen[0])
        self.assertIn("R, R -> R             moves 144 B", text)
        self.assertIn("chosen: S(1), S(0) -> P(sum): no communication", text)

    @with_comms
    def test_explain_in_place_marks_disallowed(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)])
        y = distribute_tensor(torch.zeros(8, 4), mesh, [Replicate()])
        text = str(explain(aten.add_.Tensor, x, y))
        self.assertIn("not allowed", text)
        self.assertIn("chosen: S(0), S(0) -> S(0)", text)

    @with_comms
    def test_explain_says_when_the_op_runs_as_other_ops(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)])
        explanation = explain(aten.linalg_vector_norm.default, x, 2)  # power sums, then one all_reduce
        self.assertIsNotNone(explanation.decomposition)
        self.assertIn("runs as other DTensor ops", str(explanation))
        y = distribute_tensor(torch.ones(8, 4), mesh, [Replicate()])
        self.assertIsNone(explain(aten.linalg_vector_norm.default, y, 2).decomposition)
