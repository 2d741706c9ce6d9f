"""Sorting and order statistics on DTensors equal plain torch, forward and backward, on every layout."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from spmd.tensor import Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.testing import DTensorTestBase, check_against_torch, seeded_randn, with_comms

R, S0, S1, S2 = Replicate(), Shard(0), Shard(1), Shard(2)
SHAPE = (7, 6, 3)  # over 4 ranks: 7 rows -> 2, 2, 2, 1; 6 -> 2, 2, 2, 0 (an empty shard); 3 -> 1, 1, 1, 0


def values(seed: int = 0) -> torch.Tensor:
    return seeded_randn(*SHAPE, seed=seed, dtype=torch.float64)


def with_ties() -> torch.Tensor:
    """Small integers as floats: many ties, so mode and stable sorts have something to decide."""
    return (values() * 2).round().clamp(-2, 2)


def with_nans() -> torch.Tensor:
    x = values()
    x[1, 2, 0] = x[4, 0, 1] = x[6, 5, 2] = float("nan")
    return x


def outputs_of(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (tuple, list)) else [value]


CASES: dict[str, Callable[[torch.Tensor], Any]] = {
    "sort(0)": lambda x: torch.sort(x, 0),
    "sort(-1, descending)": lambda x: torch.sort(x, -1, descending=True),
    "sort(stable, dim=1)": lambda x: torch.sort(x, dim=1, stable=True),
    "argsort(1)": lambda x: torch.argsort(x, 1),
    "msort": torch.msort,
    "topk(2, 1)": lambda x: torch.topk(x, 2, 1),
    "topk(3, 0, smallest, unsorted)": lambda x: torch.topk(x, 3, 0, largest=False, sorted=False),
    "kthvalue(2, 0)": lambda x: torch.kthvalue(x, 2, 0),
    "kthvalue(3, -1, keepdim)": lambda x: torch.kthvalue(x, 3, -1, keepdim=True),
    "median(1)": lambda x: torch.median(x, 1),
    "median(0, keepdim)": lambda x: torch.median(x, 0, keepdim=True),
    "median()": torch.median,
    "nanmedian(2)": lambda x: torch.nanmedian(x, 2),
    "nanmedian()": torch.nanmedian,
    "mode(1)": lambda x: torch.mode(x, 1),
    "mode(-1, keepdim)": lambda x: torch.mode(x, -1, keepdim=True),
}
INPUTS = {"random": values, "ties": with_ties, "nans": with_nans}


class SortTest(DTensorTestBase):
    def check(self, mesh: Any, name: str, data: str, placements: Sequence[Any]) -> None:
        """Values, indices and the gradient equal torch's; values and indices share one layout."""
        out = check_against_torch(
            CASES[name], INPUTS[data]().requires_grad_(), placements=[placements], mesh=mesh, equal_nan=True
        )
        outs = outputs_of(out)
        for o in outs:
            self.assertEqual(o.placements, outs[0].placements)

    @with_comms
    def test_every_op_on_a_1d_mesh(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        self.run_subtests(
            {"name": list(CASES), "data": list(INPUTS), "placements": [(R,), (S0,), (S1,), (S2,)]}, self.check, mesh
        )

    @with_comms
    def test_every_op_on_a_2d_mesh(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        layouts = [(S0, S1), (S1, S2), (S2, S0), (S0, S0), (R, S1)]
        self.run_subtests({"name": list(CASES), "data": ["random"], "placements": layouts}, self.check, mesh)

    @with_comms
    def test_partial_inputs_are_reduced_first(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        names = ["sort(0)", "topk(2, 1)", "median(1)", "kthvalue(2, 0)"]
        layouts = [(Partial("sum"),), (Partial("avg"),)]
        self.run_subtests({"name": names, "data": ["random"], "placements": layouts}, self.check, mesh)

    @with_comms
    def test_ordering_an_unsharded_dim_moves_no_data(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        full = values()
        for fn, layout, expected in [
            (lambda x: torch.sort(x, 2), [S0, S1], (S0, S1)),
            (lambda x: torch.topk(x, 2, -1), [S0, S1], (S0, S1)),
            (lambda x: torch.argsort(x, 2, descending=True), [S0, S1], (S0, S1)),
            (lambda x: torch.kthvalue(x, 2, 2), [S0, S1], (S0, S1)),
            (lambda x: torch.median(x, 2, keepdim=True), [S0, S1], (S0, S1)),
            (lambda x: torch.mode(x, 0), [S1, S2], (S0, S1)),  # dim 0 is dropped: dims 1, 2 become 0, 1
        ]:
            x = distribute_tensor(full, mesh, layout).requires_grad_()
            with CommDebugMode() as comm:
                out = outputs_of(fn(x))
            self.assertEqual(comm.get_total_counts(), 0)
            for o, e in zip(out, outputs_of(fn(full))):
                self.assertEqual(o.placements, expected)
                torch.testing.assert_close(o.full_tensor(), e)

    @with_comms
    def test_a_sharded_ordered_dim_is_gathered_and_other_shards_stay(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        full = values()
        x = distribute_tensor(full, mesh, [S0, S1])
        with CommDebugMode() as comm:
            sorted_values, indices = torch.sort(x, 1)
        self.assertGreater(comm.get_total_counts(), 0)
        self.assertEqual(sorted_values.placements[0], S0)
        self.assertEqual(indices.placements, sorted_values.placements)
        self.assertNotIn(S1, sorted_values.placements)
        torch.testing.assert_close(indices.full_tensor(), torch.sort(full, 1).indices)
        for layout in itertools.product([R, S0, S1], repeat=2):
            out = torch.median(distribute_tensor(full, mesh, list(layout)))
            self.assertEqual(out.placements, (R, R))
            torch.testing.assert_close(out.full_tensor(), torch.median(full))
