"""spmd.simulate as a user meets it: a world of thousands of ranks, plans, reports, the command line, errors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from spmd.comm import CollectiveRecord, use_world
from spmd.simulate import (
    GPTConfig,
    Link,
    Links,
    MemoryTracker,
    SimulatedWorld,
    model_workload,
    parse_links,
    parse_plan,
    simulate,
)
from spmd.simulate.cli import main
from spmd.simulate.models import GPT
from spmd.simulate.report import ring_seconds
from spmd.tensor import Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.tensor.placement import shard_sizes

SMALL = GPTConfig(layers=2, dim=64, heads=4, vocab=128, seq=32, batch=2)


def test_a_world_of_65536_ranks_runs_one_rank_and_records_its_collectives() -> None:
    world = SimulatedWorld(65_536, rank=65_535)
    with use_world(world):
        mesh = init_device_mesh("meta", (8192, 8), mesh_dim_names=("dp", "tp"))
        x = distribute_tensor(torch.empty(8192 * 4, 64, device="meta"), mesh, [Shard(0), Shard(1)], src_data_rank=None)
        assert x.to_local().shape == (4, 8) and x.to_local().is_meta
        assert mesh.get_coordinate() == (8191, 7)
        with CommDebugMode() as comm:
            y = x.redistribute(mesh, [Shard(0), Replicate()])
        assert y.to_local().shape == (4, 64)
    assert comm.get_comm_counts() == {"all_gather": 1}
    assert comm.get_comm_bytes() == {"all_gather": 7 * 4 * 8 * 4}  # 7 peers' 4x8 fp32 blocks
    assert world.communicator_count <= 3  # the world group and this rank's two mesh groups, not 8,200


def test_memory_tracker_peak_follows_lifetimes() -> None:
    resize = torch.UntypedStorage.resize_
    with MemoryTracker() as tracker:
        a = torch.empty(1024, device="meta")  # 4 KiB
        b = a * 2  # 4 KiB more: 8 KiB live
        del a, b
        c = torch.empty(512, device="meta")  # 2 KiB
        c.untyped_storage().resize_(0)  # freed in place, as fully_shard frees a gathered copy
        c.untyped_storage().resize_(2048)
    assert tracker.peak() == 8192
    assert tracker.live_bytes == 2048
    assert torch.UntypedStorage.resize_ is resize  # followed only while a tracker runs


def _report(plan_text: str, cfg: GPTConfig = SMALL, **kwargs: object) -> object:
    plan = parse_plan(plan_text)
    return simulate(model_workload("gpt", cfg, plan), plan, **kwargs)  # type: ignore[arg-type]


def test_training_state_per_rank_matches_the_layout() -> None:
    full = sum(p.numel() for p in GPT(SMALL).parameters()) * 4  # fp32 bytes on one device
    replicated = _report("dp=4")
    assert replicated.state.params == full and replicated.state.grads == full  # type: ignore[attr-defined]
    assert replicated.state.optimizer == 2 * full  # type: ignore[attr-defined]  # AdamW's two moments
    sharded = _report("dp=4,fsdp")
    assert sharded.state.params == full // 4 and sharded.state.optimizer == 2 * full // 4  # type: ignore[attr-defined]
    assert sharded.peak < replicated.peak  # type: ignore[attr-defined]


def test_a_note_when_fsdp_cannot_shard_over_so_many_ranks() -> None:
    """dp=128 and dim 64: FSDP2 cuts dim 0 of the 64-row weights and norms anyway, so some dp ranks hold nothing."""
    assert _report("dp=4,fsdp").notes == ()  # type: ignore[attr-defined]
    (note,) = _report("dp=128,fsdp", GPTConfig(layers=1, dim=64, batch=1)).notes  # type: ignore[attr-defined]
    assert note.startswith("fully_shard cut 9 of 12 parameters on a dim with fewer rows than dp=128 ranks")


def test_fsdp_collectives_per_mesh_dim_and_the_ring_time() -> None:
    report = _report("dp=2,tp=2,fsdp", links=parse_links("intra=100GB/s@1us,inter=10GB/s@5us", ranks_per_node=2))
    by_key = {(c.mesh_dim, c.kind): c for c in report.collectives}  # type: ignore[attr-defined]
    assert {"all_gather", "reduce_scatter"} <= {kind for dim, kind in by_key if dim == "dp"}
    # tp groups ({0, 1}) share a node of 2 ranks, dp groups ({0, 2}) do not
    tp = by_key[("tp", "all_reduce")]
    dp = by_key[("dp", "reduce_scatter")]
    assert tp.seconds == pytest.approx(tp.count * 2 * 1e-6 + tp.bytes / 100e9)
    assert dp.seconds == pytest.approx(dp.count * 5e-6 + dp.bytes / 10e9)


def test_ring_model_for_one_all_reduce() -> None:
    record = CollectiveRecord("all_reduce", 8, 1_000_000, tuple(range(8)), 0)
    assert ring_seconds(record, Link(100e9, 1e-6)) == pytest.approx(14e-6 + 2 * 7 / 8 * 1e6 / 100e9)


def test_uneven_shards_are_simulated_by_rank() -> None:
    cfg = GPTConfig(vocab=130, heads=4, batch=1)
    first, last = _report("tp=4", cfg, rank=0), _report("tp=4", cfg, rank=3)
    rows = shard_sizes(130, 4)  # vocab rows of tok_emb and lm_head per tp rank: 33, 33, 33, 31
    extra = 2 * (rows[0] - rows[3]) * 64 * 4
    assert first.state.params - last.state.params == extra  # type: ignore[attr-defined]


def test_cli_prints_one_table_and_a_comparison(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--layers", "1", "--mesh", "dp=2,tp=2", "--sequence-parallel"]) == 0
    table = capsys.readouterr().out
    assert "plan dp=2,tp=2,sp on 4 ranks" in table and "memory per rank" in table
    assert "tp        reduce_scatter" in table
    assert main(["--layers", "1", "--batch", "2", "--compare", "dp=4", "dp=2,tp=2", "dp=2,tp=2,fsdp"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert [row.split()[0] for row in rows[1:]] == ["dp=4", "dp=2,tp=2", "dp=2,tp=2,fsdp"]


def test_cli_simulates_chosen_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    """Uneven vocab rows over tp: ranks 0 and 3 of tp=4 hold different parameter bytes, one row each."""
    assert main(["--layers", "1", "--vocab", "130", "--mesh", "tp=4", "--rank", "0", "3"]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    assert [row.split()[:3] for row in rows] == [["tp=4", "rank", "0"], ["tp=4", "rank", "3"]]
    assert rows[0].split()[4:6] != rows[1].split()[4:6]  # params differ
    assert main(["--mesh", "tp=4", "--rank", "4"]) == 2
    assert "rank 4 is outside a world of 4 ranks" in capsys.readouterr().err


def test_cli_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "plans.png"
    assert main(["--layers", "1", "--compare", "dp=4", "dp=2,tp=2,fsdp", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_without_matplotlib_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    assert main(["--mesh", "dp=2", "--plot", "x.png"]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--mesh", "dp=2,tp=2", "--world", "6"], "holds 4 ranks but the world has 6"),
        (["--model", "llama", "--mesh", "dp=2"], "unknown model 'llama'"),
        (["--heads", "6", "--dim", "60", "--mesh", "dp=2,tp=4"], "--heads 6 is not divisible by tp=4"),
        (["--dim", "65", "--mesh", "dp=2"], "--dim 65 is not divisible by --heads 4"),
        (["--seq", "30", "--mesh", "tp=4", "--sequence-parallel"], "--seq 30 is not divisible by tp=4"),
        (["--mesh", "dp=2,pp=2"], "cannot read 'pp=2'"),
        (["--mesh", "dp=two"], "must be a positive integer, got 'two'"),
        (["--mesh", "dp=2", "--link", "intra=fast"], "cannot read the bandwidth 'fast'"),
        (["--layers", "0", "--mesh", "dp=2"], "--layers must be a positive integer, got 0"),
        ([], "give a plan with --mesh"),
    ],
)
def test_bad_input_names_the_value(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_links_map_groups_to_nodes() -> None:
    links = Links(intra=Link(1.0), inter=Link(2.0), ranks_per_node=8)
    assert links.link_for(tuple(range(8, 16))) is links.intra
    assert links.link_for(tuple(range(0, 4096, 8))) is links.inter
    assert math.isclose(parse_links("inter=25GiB/s").inter.bandwidth, 25 * 2**30)
