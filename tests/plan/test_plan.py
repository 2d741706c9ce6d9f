"""spmd.plan: the search finds the plan a brute force finds, never drops one that fits, and says why."""

from __future__ import annotations

import pytest
import torch

from spmd.plan import Cluster, Layout, LlamaConfig, Workload, parse_layout, search
from spmd.plan.bounds import lower_bounds
from spmd.plan.branch_and_bound import candidate_layouts, dominated_by, evaluate, not_searched, program_key
from spmd.plan.cli import main, parse_bytes
from spmd.plan.compose import estimate_step
from spmd.plan.program import ProgramKey, simulate_whole
from spmd.plan.why import why
from spmd.tensor.redistribute.cost import received_bytes

TINY = LlamaConfig(layers=4, dim=128, heads=4, kv_heads=2, ffn_dim=344, vocab=512)
WORKLOAD = Workload(global_batch=4, seq=128)
MiB = 2**20


def fitting(cluster: Cluster) -> list[tuple[Layout, float, int]]:
    """Brute force: every runnable layout simulated, with its step time and peak."""
    out = []
    for layout in candidate_layouts(TINY, cluster, WORKLOAD):
        if not_searched(layout) is None:
            estimate = evaluate(TINY, layout, cluster, WORKLOAD)
            out.append((layout, estimate.step_s, estimate.peak))
    return out


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=lambda n: f"world{n}")
def brute_force(request: pytest.FixtureRequest) -> tuple[int, list[tuple[Layout, float, int]]]:
    """Every runnable layout of a world of 2 (CI) or 4 (slow), simulated."""
    return request.param, fitting(Cluster(world=request.param, memory=2**40, ranks_per_node=2))


def test_layouts_read_as_they_print() -> None:
    layout = parse_layout("pp=2,fsdp=2,tp=2,sp,ac=full,1F1Bx4")
    assert (layout.pp, layout.dp_shard, layout.tp, layout.sp, layout.ac, layout.microbatches) == (
        2,
        2,
        2,
        True,
        "full",
        4,
    )
    assert parse_layout(str(layout)) == layout
    with pytest.raises(ValueError, match="cannot read 'xp=2'"):
        parse_layout("xp=2")


@pytest.mark.parametrize(
    "degrees",
    [
        {"dp_shard": 4},
        {"tp": 2, "sp": True, "dp_shard": 2},
        {"cp": 2, "dp_shard": 2},
        {"dp_replicate": 2, "dp_shard": 2, "ac": "full"},
        {"tp": 2, "ac": "selective", "dp_shard": 2},
        {"dp_replicate": 4},
    ],
    ids=str,
)
def test_a_composed_step_equals_simulating_every_block(degrees: dict) -> None:
    """Three simulated blocks, repeated, give what simulating all six gives: memory, FLOPs, collectives."""
    layout = Layout(**degrees)
    key = ProgramKey(TINY, layout.dp_replicate, layout.dp_shard, layout.cp, layout.tp, layout.sp, layout.ac, 2, 128)
    stage = estimate_step(key, layout, Cluster(world=layout.world_size), layers=6).stages[0]
    whole = simulate_whole(key, layers=6)
    assert stage.microbatch.flops == whole.flops
    # the optimizer's work is taken in proportion to the parameters (per-tensor scalars aside)
    assert stage.microbatch.traffic + stage.optimizer_step.traffic == pytest.approx(whole.traffic, rel=1e-3)
    assert stage.peak == pytest.approx(whole.peak, rel=1e-3)  # context parallel's index buffers: a few bytes
    composed = sum(nbytes for _, _, nbytes in stage.step.then(stage.optimizer_step).comm)
    assert composed == sum(received_bytes(kind, n, b) for kind, n, b in whole.records if n > 1)


def test_bounds_never_exceed_what_the_simulation_finds(brute_force: tuple[int, list]) -> None:
    """So the branch and bound never stops before a layout that would rank."""
    world, layouts = brute_force
    cluster = Cluster(world=world, memory=2**40, ranks_per_node=2)
    for layout, step_s, peak in layouts:
        bounds = lower_bounds(TINY, layout, cluster, WORKLOAD.global_batch, WORKLOAD.seq, torch.bfloat16)
        assert bounds.memory <= peak, layout
        assert bounds.step_s <= step_s, layout


def test_pruning_by_the_memory_bound_never_drops_a_layout_that_fits(brute_force: tuple[int, list]) -> None:
    world, layouts = brute_force
    budget = sorted(peak for _, _, peak in layouts)[len(layouts) // 3]  # a third of the layouts fit
    cluster = Cluster(world=world, memory=budget, ranks_per_node=2)
    pruned = [
        (layout, peak)
        for layout, _, peak in layouts
        if lower_bounds(TINY, layout, cluster, WORKLOAD.global_batch, WORKLOAD.seq, torch.bfloat16).memory > budget
    ]
    assert pruned, "the bound prunes something at this budget"
    assert all(peak > budget for _, peak in pruned)


@pytest.mark.parametrize("memory_mib", [40, 14, 9])
def test_the_best_plans_equal_a_brute_force_search(brute_force: tuple[int, list], memory_mib: int) -> None:
    """The same best step; and the same top 3 once layouts that a simpler fitting one dominates
    (more checkpointing or micro-batches than needed, GPipe for 1F1B) are left out, as the search does."""
    world, layouts = brute_force
    cluster = Cluster(world=world, memory=memory_mib * MiB, ranks_per_node=2)
    fits = {layout: step_s for layout, step_s, peak in layouts if peak <= cluster.memory}
    if not fits:
        pytest.skip(f"nothing fits {memory_mib} MiB on {world} ranks")
    result = search(TINY, cluster, WORKLOAD, top_k=3)
    undominated = sorted(step_s for layout, step_s in fits.items() if not any(d in fits for d in dominated_by(layout)))
    assert result.top[0].estimate.step_s == pytest.approx(min(fits.values()))
    assert [r.estimate.step_s for r in result.top] == pytest.approx(undominated[:3])
    assert all(r.estimate.peak <= cluster.memory for r in result.top)
    assert result.simulated_layouts < len(layouts)


def test_why_names_memory_when_the_simpler_layout_does_not_fit() -> None:
    """With just enough memory for full checkpointing, the reason for it is memory, with the figure."""
    roomy = Cluster(world=4, memory=2**40, ranks_per_node=4)
    peak = evaluate(TINY, parse_layout("fsdp=2,tp=2,ac=full"), roomy, WORKLOAD).peak
    cluster = Cluster(world=4, memory=peak, ranks_per_node=4)
    plan = evaluate(TINY, parse_layout("fsdp=2,tp=2,ac=full"), cluster, WORKLOAD)
    lines, reasons = why(plan, TINY, cluster, WORKLOAD)
    assert lines[0].startswith("memory") and lines[1].startswith("step") and lines[2].startswith("mesh")
    (checkpointing,) = [r for r in reasons if r.choice == "ac=full"]
    assert checkpointing.binding == "memory"
    assert checkpointing.alternative == "fsdp=2,tp=2,ac=selective"
    assert "the peak is" in checkpointing.text and "> " in checkpointing.text


def test_why_names_time_when_the_simpler_layout_fits_but_is_slower() -> None:
    plan = evaluate(TINY, parse_layout("fsdp=2,tp=2"), Cluster(world=4, memory=2**40, ranks_per_node=4), WORKLOAD)
    _, reasons = why(plan, TINY, Cluster(world=4, memory=2**40, ranks_per_node=4), WORKLOAD)
    assert {r.binding for r in reasons} == {"time"}
    assert any(r.choice == "tp=2" for r in reasons)


def test_layouts_spmd_cannot_run_are_listed_not_estimated() -> None:
    result = search(TINY, Cluster(world=4, memory=2**40, ranks_per_node=2), WORKLOAD, top_k=1)
    assert any("context parallelism" in reason for reason in result.not_searched)
    assert not_searched(parse_layout("pp=2,cp=2,1F1Bx2")) is not None
    assert not_searched(parse_layout("dp=2,tp=2")) is None  # HSDP with tensor parallelism runs


def test_the_command_line_ranks_and_explains(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--preset", "debug", "--world", "4", "--ranks-per-node", "4", "--memory", "1GiB", "--seq", "128"]
    assert main([*argv, "--global-batch", "4", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "#  layout" in out and "why #1" in out
    assert main([*argv, "--global-batch", "4", "--explain", "fsdp=2,tp=2,sp"]) == 0
    out = capsys.readouterr().out
    assert "each block, forward" in out and "reduce_scatter" in out
    assert main([*argv, "--explain", "tp=8"]) == 2
    assert "holds 8 ranks" in capsys.readouterr().err
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("96GB") == 96 * 10**9


def test_program_key_shares_one_program_among_any_number_of_replicas() -> None:
    a = program_key(TINY, Layout(dp_replicate=2, dp_shard=2), WORKLOAD, torch.bfloat16)
    b = program_key(TINY, Layout(dp_replicate=4, dp_shard=2), Workload(8, 128), torch.bfloat16)
    assert a == b


def test_any_decoder_module_is_planned_and_what_it_cannot_run_is_reported() -> None:
    """A module the planner has no shape for: its blocks are simulated and repeated like a built-in
    model's; layouts it cannot run (its position table needs the whole sequence, so no cp) are
    reported with the error, and without a tensor-parallel plan tp is not searched."""
    from tests.plan.custom_model import MLP_DECODER, SEQ

    result = search(MLP_DECODER, Cluster(world=4, memory=2**40, ranks_per_node=4), Workload(4, SEQ), top_k=3)
    assert result.top and all(r.layout.tp == 1 and r.layout.cp == 1 for r in result.top)
    assert result.failed and all("cp=" in layout for layout in result.failed)
    assert any("module" in reason for reason in result.not_searched)  # no pipeline stages of a module
    layout = Layout(dp_shard=2)
    key = ProgramKey(MLP_DECODER, 1, 2, 1, 1, False, "none", 2, SEQ)
    stage = estimate_step(key, layout, Cluster(world=2), layers=6).stages[0]
    whole = simulate_whole(key, layers=6)
    assert (stage.microbatch.flops, stage.peak) == (whole.flops, whole.peak)


def test_the_command_line_plans_a_module_named_by_its_import_path(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "tests.plan.custom_model:MLP_DECODER", "--world", "2", "--seq", "128", "--top", "1"]
    assert main(argv) == 0
    assert "mlp decoder" in capsys.readouterr().out
    assert main(["--model", "tests.plan.custom_model:nothing", "--world", "2"]) == 2
