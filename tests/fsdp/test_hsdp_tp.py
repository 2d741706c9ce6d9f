"""HSDP with tensor parallelism (torchtitan's dp_replicate x dp_shard x tp) through fully_shard.

A Llama is tensor-parallelised on ``world["tp"]`` and fully-sharded, block by block and then the root,
on the 2-d data-parallel mesh ``world["dp_replicate", "dp_shard"]``. Each parameter becomes a DTensor
on the 3-d world: Replicate() over dp_replicate, FSDP2's cut over dp_shard (a ``_StridedShard`` where
tp cuts dim 0 too) and its tp placement. Gradients are reduce-scattered over dp_shard, then
all-reduced over dp_replicate. Each data-parallel rank feeds its own slice of the batch, so the
losses, gradients and parameters of two AdamW steps equal one device's, in float64. The world
``(2, 1, 2)`` is DDP over dp_replicate with tp: nothing is cut over dp_shard (a mesh dim of one rank).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spmd.fsdp import MixedPrecisionPolicy, fully_shard
from spmd.tensor import DeviceMesh, DTensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.tensor_parallel import loss_parallel, parallelize_module
from spmd.testing import run_threaded, seeded_module
from spmd.testing.llama import Llama, LlamaConfig, tp_plan

CFG = LlamaConfig(layers=2, dim=64, heads=4, kv_heads=2, ffn_dim=96, vocab=128)
NAMES = ("dp_replicate", "dp_shard", "tp")
BATCH, SEQ, STEPS, LR = 8, 8, 2, 1e-2

# float64 loss and gradients differ from one device's only in the order of their sums (the batch
# split over 4 dp ranks, the tp pieces, the reduce-scatter and all-reduce): each sum of n terms is
# off by at most n * 1.1e-16 of its terms' magnitudes, with n <= 10^3 here (and values of order 1).
GRAD_TOL = {"rtol": 1e-12, "atol": 1e-13}
# float32 gathered copies (mixed precision) round each op's result to 6e-8 relative; sums of ~100
# terms of order 0.3 (dim 64, ffn 96) put gradients within ~2e-6 (the float64 reduction adds nothing).
MIXED_TOL = {"rtol": 2e-5, "atol": 2e-6}


def param_tol(grad_tol: dict[str, float], adam_eps: float) -> dict[str, float]:
    """AdamW divides each gradient by its own magnitude (+ eps): a gradient off by d moves a step by at
    most LR * d / eps (the worst case: a gradient near 0), in each of the steps."""
    return {"rtol": grad_tol["rtol"], "atol": STEPS * LR * grad_tol["atol"] / adam_eps}


def llama() -> Llama:
    """The model every run starts from: float64, the same on every rank (rank threads share torch's generator)."""
    return seeded_module(Llama(CFG).to(torch.float64), 0, scale=0.2)  # type: ignore[return-value]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randint(CFG.vocab, (BATCH, SEQ), generator=gen), torch.randint(CFG.vocab, (BATCH, SEQ), generator=gen)


def optimizer_for(model: nn.Module, adam_eps: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, eps=adam_eps, weight_decay=0.01, foreach=False)


# ----- one device ---------------------------------------------------------------------------------
def one_device(adam_eps: float) -> dict[str, Any]:
    model = llama()
    optimizer = optimizer_for(model, adam_eps)
    losses, grads = [], []
    for step in range(STEPS):
        tokens, targets = batch(step)
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(0, 1))
        loss.backward()  # type: ignore[no-untyped-call]
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "params": {n: p.detach() for n, p in model.named_parameters()}}


# ----- HSDP x TP ----------------------------------------------------------------------------------
def data_parallel_mesh(world: DeviceMesh) -> DeviceMesh:
    """fully_shard's mesh: (dp_replicate, dp_shard), or torchtitan's (dp_replicate, dp_shard_cp) with a cp dim."""
    if "cp" not in (world.mesh_dim_names or ()):
        return world["dp_replicate", "dp_shard"]
    world["dp_shard", "cp"]._flatten("dp_shard_cp")
    return world["dp_replicate", "dp_shard_cp"]


def sharded_llama(world: DeviceMesh, sp: bool, *, reshard_after_forward: bool | None = None, **options: Any) -> Llama:
    """torchtitan's recipe: tp on world["tp"], then fully_shard each block and the root on the dp mesh."""
    model = parallelize_module(llama(), world["tp"], tp_plan(sp))
    dp_mesh = data_parallel_mesh(world)
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, **options)
    fully_shard(model, mesh=dp_mesh, **options)
    return model


def hsdp_tp(
    layout: tuple[int, int, int],
    *,
    sp: bool = False,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool | None = None,
    micro_batches: int = 1,
    adam_eps: float = 1e-8,
) -> dict[str, Any]:
    """Two AdamW steps on one rank, each data-parallel rank on its own slice of the batch."""
    world = init_device_mesh("cpu", layout, mesh_dim_names=NAMES)
    options: dict[str, Any] = {} if mp_policy is None else {"mp_policy": mp_policy}
    model = sharded_llama(world, sp, reshard_after_forward=reshard_after_forward, **options)
    layout_before = describe(model)
    optimizer = optimizer_for(model, adam_eps)
    replicas, shards = layout[0], layout[1]
    dp_rank = world["dp_replicate"].get_local_rank() * shards + world["dp_shard"].get_local_rank()
    losses, grads, comm_counts = [], [], []
    for step in range(STEPS):
        tokens, targets = (t.chunk(replicas * shards)[dp_rank] for t in batch(step))
        loss = 0.0
        with CommDebugMode() as comm:
            for i, (x, y) in enumerate(zip(tokens.chunk(micro_batches), targets.chunk(micro_batches))):
                model.set_requires_gradient_sync(i == micro_batches - 1)  # type: ignore[operator]
                with loss_parallel():
                    micro = F.cross_entropy(model(x).flatten(0, 1), y.flatten(0, 1)) / micro_batches
                    micro.backward()  # type: ignore[no-untyped-call]
                micro = micro.detach()
                loss += float(micro.full_tensor() if isinstance(micro, DTensor) else micro)
        comm_counts.append(fully_shard_collectives(comm, world))
        grads.append({name: p.grad.full_tensor() for name, p in model.named_parameters() if p.grad is not None})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss)
    params = {name: p.full_tensor() for name, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params, "layout": layout_before, "comms": comm_counts}


def describe(model: nn.Module) -> dict[str, tuple[Any, ...]]:
    """Per parameter: its placements (torch's reprs), mesh dim names and local shape."""
    return {
        name: (
            tuple(repr(p) for p in param.placements),
            param.device_mesh.mesh_dim_names,
            tuple(param.to_local().shape),
        )
        for name, param in model.named_parameters()
    }


def fully_shard_collectives(comm: CommDebugMode, world: DeviceMesh) -> dict[tuple[str, str], int]:
    """The collectives fully_shard issued, by kind and the mesh dim they ran over."""
    dims = {tuple(world[name].mesh.flatten().tolist()): name for name in NAMES}
    counts: dict[tuple[str, str], int] = {}
    for event in comm.events:
        if event.op.startswith("fully_shard"):
            key = (event.record.kind, dims[event.record.ranks])
            counts[key] = counts.get(key, 0) + 1
    return counts


def check_against_one_device(
    per_rank: list[dict[str, Any]],
    layout: tuple[int, int, int],
    grad_tol: dict[str, float] = GRAD_TOL,
    adam_eps: float = 1e-8,
) -> None:
    """The dp ranks' local losses average to one device's; every rank's gradients and parameters are one device's."""
    want = one_device(adam_eps)
    tp = layout[2]
    per_dp_rank = torch.tensor([r["losses"] for r in per_rank[::tp]], dtype=torch.float64)
    torch.testing.assert_close(per_dp_rank.mean(0), torch.tensor(want["losses"], dtype=torch.float64), **grad_tol)
    for rank, result in enumerate(per_rank):
        for step in range(STEPS):
            assert result["grads"][step].keys() == want["grads"][step].keys()
            for name, grad in result["grads"][step].items():
                msg = f"rank {rank}, step {step}, {name}.grad"
                torch.testing.assert_close(grad, want["grads"][step][name], msg=msg, **grad_tol)
        for name, value in result["params"].items():
            msg = f"rank {rank}, {name}"
            torch.testing.assert_close(value, want["params"][name], msg=msg, **param_tol(grad_tol, adam_eps))


LAYOUTS = {"hsdp_tp": (2, 2, 2), "ddp_tp": (2, 1, 2)}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_two_adamw_steps_equal_one_device(layout: tuple[int, int, int]) -> None:
    per_rank = run_threaded(hsdp_tp, math.prod(layout), layout)
    check_against_one_device(per_rank, layout)
    _, shards, tp = layout
    wq = per_rank[0]["layout"]["layers.0.attention.wq.weight"]
    # column-wise: tp cuts dim 0, dp_shard cuts each tp piece; replicated over dp_replicate
    assert wq == (("Replicate()", "_StridedShard(dim=0, sf=2)", "Shard(dim=0)"), NAMES, (64 // shards // tp, 64))
    wo = per_rank[0]["layout"]["layers.0.attention.wo.weight"]
    assert wo == (("Replicate()", "Shard(dim=0)", "Shard(dim=1)"), NAMES, (64 // shards, 64 // tp))
    norm = per_rank[0]["layout"]["norm.weight"]  # a plain parameter (no sequence parallel): HSDP's own
    assert norm == (("Replicate()", "Shard(dim=0)"), NAMES[:2], (64 // shards,))
    # per fully_shard group (2 blocks, the root): one all_gather in forward and one more in each
    # block's backward (resharded after forward), one reduce_scatter over dp_shard and one all_reduce
    # over dp_replicate; a dp_shard of one rank moves nothing
    over_shards = {("all_gather", "dp_shard"): 3 + 2, ("reduce_scatter", "dp_shard"): 3} if shards > 1 else {}
    assert per_rank[0]["comms"][0] == {**over_shards, ("all_reduce", "dp_replicate"): 3}


def test_sequence_parallel_gradient_accumulation_and_no_reshard() -> None:
    """tp with sequence parallel, two micro-batches (the first without gradient sync), blocks kept gathered."""
    options = {"sp": True, "micro_batches": 2, "reshard_after_forward": False}
    per_rank = run_threaded(hsdp_tp, 8, LAYOUTS["hsdp_tp"], **options)
    check_against_one_device(per_rank, LAYOUTS["hsdp_tp"])
    norm = per_rank[0]["layout"]["norm.weight"]  # sequence parallel: a DTensor Replicate() over tp
    assert norm == (("Replicate()", "Shard(dim=0)", "Replicate()"), NAMES, (32,))
    # nothing gathered again in backward; the reduce-scatter and all-reduce run once, in the synced
    # backward; the 5 norms' gradients (partial over tp under sequence parallel) are summed over tp
    # in each micro-batch's backward, as their gathered copies' gradients reach the shards
    assert per_rank[0]["comms"][0] == {
        ("all_gather", "dp_shard"): 2 * 3,
        ("reduce_scatter", "dp_shard"): 3,
        ("all_reduce", "dp_replicate"): 3,
        ("all_reduce", "tp"): 2 * 5,
    }


def test_a_second_world_with_an_equal_tp_mesh_shards_too() -> None:
    """Two jobs in one process, one after the other: the second world's tp sub-mesh equals the
    first's (the same ranks and name), and a parameter built through a cached sharding decision may
    carry the first world's object. fully_shard takes it as the second world's slice."""

    def two_worlds() -> list[tuple[int, ...]]:
        shapes = []
        for shape in ((1, 2, 2), (2, 1, 2)):
            world = init_device_mesh("cpu", shape, mesh_dim_names=NAMES)
            model = llama()
            parallelize_module(model, world["tp"], tp_plan(False))
            for block in model.layers:
                fully_shard(block, mesh=world["dp_replicate", "dp_shard"])
            fully_shard(model, mesh=world["dp_replicate", "dp_shard"])
            weight = model.layers[0].attention.wq.weight
            assert isinstance(weight, DTensor) and weight.device_mesh._get_root_mesh() is world
            shapes.append(tuple(weight.device_mesh.shape))
        return shapes

    assert run_threaded(two_worlds, 4)[0] == [(1, 2, 2), (2, 1, 2)]


def test_mixed_precision_gathers_float32_and_reduces_in_float64() -> None:
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float64)
    # AdamW's eps 1e-3: float32's gradient error then moves a step by at most LR * 2e-6 / 1e-3
    per_rank = run_threaded(hsdp_tp, 8, LAYOUTS["hsdp_tp"], mp_policy=policy, adam_eps=1e-3)
    check_against_one_device(per_rank, LAYOUTS["hsdp_tp"], MIXED_TOL, adam_eps=1e-3)
    assert all(p.dtype == torch.float64 for p in per_rank[0]["params"].values())  # the shards stay float64


# ----- the layout against torch's FSDP2 (on a fake process group) ------------------------------------
TORCH_LAYOUTS = {
    "hsdp_tp": ((2, 2, 2), NAMES),
    "ddp_tp": ((2, 1, 2), NAMES),
    "hsdp_cp_tp": ((2, 2, 1, 2), ("dp_replicate", "dp_shard", "cp", "tp")),  # dp_shard_cp, flattened
}


def with_checkpoint_chunks(model: nn.Module) -> dict[str, tuple[Any, ...]]:
    """``describe`` and, per parameter, the (offsets, sizes) of the chunks this rank writes to a DCP checkpoint."""
    described = describe(model)
    return {
        name: (*described[name], [(tuple(c.offsets), tuple(c.sizes)) for c in param.__create_chunk_list__()])
        for name, param in model.named_parameters()
    }


def spmd_layout(shape: tuple[int, ...], names: tuple[str, ...], sp: bool) -> dict[str, tuple[Any, ...]]:
    return with_checkpoint_chunks(sharded_llama(init_device_mesh("cpu", shape, mesh_dim_names=names), sp))


@contextlib.contextmanager
def fake_rank(rank: int, world_size: int) -> Iterator[None]:
    """torch's default process group as ``rank`` of ``world_size``, on a fake backend (no data moves)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def torch_placements(shape: tuple[int, ...], names: tuple[str, ...], sp: bool) -> dict[str, tuple[Any, ...]]:
    """Per parameter: torch's placements, mesh dim names and global shape, from torch's parallelize_module and
    fully_shard on rank 0. Only the styles' kinds decide where parameters go, so torch's plan names those only."""
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import parallel as torch_tp

    plan: dict[str, Any] = {"tok_embeddings": torch_tp.RowwiseParallel(), "output": torch_tp.ColwiseParallel()}
    for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
        plan[f"layers.*.{name}"] = torch_tp.ColwiseParallel()
    for name in ("attention.wo", "feed_forward.w2"):
        plan[f"layers.*.{name}"] = torch_tp.RowwiseParallel()
    if sp:
        norms = ("layers.*.attention_norm", "layers.*.ffn_norm", "norm")
        plan.update({name: torch_tp.SequenceParallel() for name in norms})
    with fake_rank(0, math.prod(shape)):
        world = torch_init_device_mesh("cpu", shape, mesh_dim_names=names)
        model = torch_tp.parallelize_module(llama(), world["tp"], plan)
        dp_mesh = data_parallel_mesh(world)  # type: ignore[arg-type]
        for block in model.layers:
            torch_fully_shard(block, mesh=dp_mesh)
        torch_fully_shard(model, mesh=dp_mesh)
        return {
            n: (tuple(p.placements), p.device_mesh.mesh_dim_names, tuple(p.shape)) for n, p in model.named_parameters()
        }


def torch_layouts(shape: tuple[int, ...], names: tuple[str, ...], sp: bool) -> list[dict[str, tuple[Any, ...]]]:
    """``with_checkpoint_chunks`` of torch's layout on each rank: torch's placements, and the local shape and
    offset torch's DTensor computes for them on that rank's mesh.

    Building the model again on another fake rank of the same process would not do: torch's DTensor
    caches hand back meshes made on the first rank (with its coordinate).
    """
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    params = torch_placements(shape, names, sp)
    per_rank = []
    for rank in range(math.prod(shape)):
        with fake_rank(rank, math.prod(shape)):
            world = torch_init_device_mesh("cpu", shape, mesh_dim_names=names)
            data_parallel_mesh(world)  # type: ignore[arg-type]  # makes dp_shard_cp where there is a cp dim
            described = {}
            for name, (placements, mesh_names, global_shape) in params.items():
                local, offset = compute_local_shape_and_global_offset(global_shape, world[mesh_names], placements)
                reprs = tuple(repr(p) for p in placements)
                described[name] = (reprs, mesh_names, tuple(local), [(tuple(offset), tuple(local))])
            per_rank.append(described)
    return per_rank


@pytest.mark.filterwarnings("ignore:Slicing a flattened dim from root mesh")  # torch's, on dp_shard_cp
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sequence_parallel"])
@pytest.mark.parametrize("layout", TORCH_LAYOUTS.keys())
def test_placements_local_shapes_and_checkpoint_chunks_equal_torchs_fsdp2(layout: str, sp: bool) -> None:
    shape, names = TORCH_LAYOUTS[layout]
    ours = run_threaded(spmd_layout, math.prod(shape), shape, names, sp)
    theirs = torch_layouts(shape, names, sp)
    for rank, (got, want) in enumerate(zip(ours, theirs)):
        assert got == want, f"rank {rank}"
