"""fully_shard as torch's FSDP2 calls it (torchtitan's layout), and what FSDP2 adds.

torchtitan tensor-parallelises on ``world["tp"]`` and fully-shards on the sibling ``world["dp"]``;
each rank feeds its own part of the batch as a plain tensor and its loss is the local mean. Every
test trains two AdamW steps and compares losses and parameters with the same steps on one device.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_fully_shard import DIM, TP_PLAN, VOCAB, TinyGPT, batch, build_model, make_optimizer
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from spmd.fsdp import (
    DataParallelMeshDims,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
    shard_first_free_dim,
)
from spmd.tensor import DeviceMesh, DTensor, Replicate, Shard, distribute_module, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.tensor.placement import _StridedShard
from spmd.tensor_parallel import ColwiseParallel, loss_parallel, parallelize_module
from spmd.testing import run_threaded

STEPS = 2
DP = 2
# as torchtitan's: q, k and v stay DTensors (each rank its heads), which attention's reshape keeps
FSDP2_TP_PLAN = {
    **TP_PLAN,
    **{f"layers.*.attn.{name}": ColwiseParallel(use_local_output=False) for name in ("q", "k", "v")},
    "lm_head": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),  # for loss_parallel
}
TOL = {"rtol": 1e-4, "atol": 1e-5}


# ----- one device ---------------------------------------------------------------------------------
def one_device(model: nn.Module) -> tuple[list[float], dict[str, torch.Tensor]]:
    optimizer = make_optimizer(model)
    losses = []
    for step in range(STEPS):
        tokens, targets = batch(step)
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(0, 1))
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.detach() for name, p in model.named_parameters()}


def check(per_rank: list[dict[str, Any]], reference: nn.Module, dp: int, **tol: float) -> None:
    """Each dp rank's local losses average to one device's; every rank's parameters equal one device's."""
    losses, params = one_device(reference)
    tol = tol or TOL
    per_dp = [per_rank[r]["losses"] for r in range(0, len(per_rank), len(per_rank) // dp)]
    torch.testing.assert_close(torch.tensor(per_dp).mean(0), torch.tensor(losses), **tol)  # type: ignore[arg-type]
    for result in per_rank:
        for name, value in result["params"].items():
            torch.testing.assert_close(value, params[name], msg=name, **tol)  # type: ignore[arg-type]


# ----- FSDP2's layout -----------------------------------------------------------------------------
def train_fsdp2(
    model: nn.Module,
    world: DeviceMesh,
    *,
    blocks: Callable[[nn.Module], list[nn.Module]] = lambda m: list(m.layers),  # type: ignore[arg-type,union-attr]
    root_options: dict[str, Any] | None = None,
    dp_mesh: DeviceMesh | None = None,
    **options: Any,
) -> dict[str, Any]:
    """torchtitan's order: fully_shard each block on the dp mesh, then the root; each dp rank its own batch."""
    dp_mesh = dp_mesh or (world["dp"] if world.ndim > 1 else world)
    for block in blocks(model):
        fully_shard(block, mesh=dp_mesh, **options)
    fully_shard(model, mesh=dp_mesh, **(root_options or options))
    optimizer = make_optimizer(model)
    rank, size = dp_mesh.get_local_rank(), dp_mesh.size()
    losses = []
    for step in range(STEPS):
        tokens, targets = (t.chunk(size)[rank] for t in batch(step))
        with loss_parallel():
            loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(0, 1))
            loss.backward()  # type: ignore[no-untyped-call]
        grads_like_params = all(p.grad.placements == p.placements for p in model.parameters())
        if step == 0:
            first_grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e6)  # torchtitan clips here
            first_norm = (norm.full_tensor() if isinstance(norm, DTensor) else norm).item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append((loss.full_tensor() if isinstance(loss, DTensor) else loss).item())
    return {
        "losses": losses,
        "params": {name: p.full_tensor() for name, p in model.named_parameters()},
        "placements": {name: p.placements for name, p in model.named_parameters()},
        "meshes": {name: p.device_mesh.mesh_dim_names for name, p in model.named_parameters()},
        "grads_like_params": grads_like_params,
        "first_grads": first_grads,
        "first_norm": first_norm,
        "is_fsdp_module": isinstance(model, FSDPModule) and isinstance(model, TinyGPT),
    }


def tp_then_fsdp2(variant: str) -> dict[str, Any]:
    world = init_device_mesh("cpu", (DP, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(build_model(), world["tp"], FSDP2_TP_PLAN)
    seen: list[torch.Tensor] = []
    model.layers[0].attn.q.register_forward_hook(lambda mod, args, out: seen.append(mod.weight))
    # torchtitan names its dp mesh by flattening (dp_shard_cp), even when it spans one dim,
    # and asks for torch's default dim by name: Shard(0) (a _StridedShard where tp cuts dim 0 too)
    dp_mesh = world["dp"]._flatten("dp_shard_cp") if variant == "flattened-dp" else world["dp"]
    options: dict[str, Any] = {
        "dp": {},
        "flattened-dp": {"shard_placement_fn": lambda param: Shard(0)},
        "first-free-dim": {"shard_placement_fn": shard_first_free_dim(dp_mesh)},
    }[variant]
    result = train_fsdp2(model, world, dp_mesh=dp_mesh, **options)
    result["gathered"] = (seen[0].device_mesh.mesh_dim_names, seen[0].placements)
    return result


@pytest.mark.parametrize("variant", ["dp", "flattened-dp", "first-free-dim"])
def test_tp_on_the_tp_sub_mesh_and_fully_shard_on_the_dp_sub_mesh(variant: str) -> None:
    """The sharded parameter lives on the 2-d world mesh; forward computes with the tp sub-mesh's DTensor."""
    per_rank = run_threaded(tp_then_fsdp2, 4, variant)
    check(per_rank, build_model(), DP)
    result = per_rank[0]
    assert result["is_fsdp_module"] and result["grads_like_params"]
    assert result["meshes"]["layers.0.attn.q.weight"] == ("dp", "tp")
    if variant != "first-free-dim":  # dp cuts dim 0, which tp (a later mesh dim) cuts too: right to left, as torch
        assert result["placements"]["layers.0.attn.q.weight"] == (_StridedShard(0, split_factor=2), Shard(0))
        assert result["placements"]["layers.0.mlp.up.bias"] == (_StridedShard(0, split_factor=2), Shard(0))
    else:  # spmd's former default: the first dim tp does not cut, else whole over dp (no _StridedShard)
        assert result["placements"]["layers.0.attn.q.weight"] == (Shard(1), Shard(0))
        assert result["placements"]["layers.0.mlp.up.bias"] == (Replicate(), Shard(0))  # nothing left to cut
    assert result["placements"]["layers.0.attn.out.weight"] == (Shard(0), Shard(1))
    assert result["placements"]["layers.0.attn_norm.weight"] == (Shard(0), Replicate())
    assert result["gathered"] == (("tp",), (Shard(0),))
    reference = build_model()
    tokens, targets = batch(0)
    F.cross_entropy(reference(tokens).flatten(0, 1), targets.flatten(0, 1)).backward()  # type: ignore[no-untyped-call]
    expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm=1e6).item()
    assert result["first_norm"] == pytest.approx(expected_norm, rel=1e-5)


def unflattened_meshes_run(dp: int) -> dict[str, Any]:
    """torchtitan's meshes: tp and fsdp from two _unflatten calls on a 1-d world mesh (fsdp may be 1 wide)."""
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    tp_mesh = world._unflatten(0, (4 // 2, 2), ("batch", "tp"))["tp"]
    fsdp_mesh = world._unflatten(0, (4 // 2 // dp, dp, 2), ("dp_replicate", "fsdp", "tp"))["fsdp"]
    model = parallelize_module(build_model(), tp_mesh, FSDP2_TP_PLAN)
    return train_fsdp2(model, world, dp_mesh=fsdp_mesh)


@pytest.mark.parametrize("dp", [2, 1])
def test_tp_and_fully_shard_on_meshes_unflattened_from_a_1d_world(dp: int) -> None:
    """The sharded parameter lives on the two sub-meshes' dims of the world, dp major (its ranks' order)."""
    per_rank = run_threaded(unflattened_meshes_run, 4, dp)
    check(per_rank, build_model(), dp)
    assert per_rank[0]["meshes"]["layers.0.attn.q.weight"] == ("fsdp", "tp")
    # dim 0, inside tp's cut of it: FSDP2's placement even over one dp rank
    assert per_rank[0]["placements"]["layers.0.attn.q.weight"] == (_StridedShard(0, split_factor=2), Shard(0))


def compiled_module_run(compile_blocks: bool) -> dict[str, Any]:
    model = build_model()
    if compile_blocks:
        for block in model.layers:
            block.compile(backend="aot_eager", fullgraph=True)  # torchtitan's per-block compile: the module
    return train_fsdp2(model, init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)))


def test_blocks_compiled_as_modules_run_the_fully_shard_hooks_eagerly() -> None:
    """Compiling the module compiles its hooks' frames too; fully_shard's run eagerly, as FSDP2's."""
    compiled, eager = run_threaded(compiled_module_run, 2, True), run_threaded(compiled_module_run, 2, False)
    for got, want in zip(compiled, eager):
        assert got["losses"] == pytest.approx(want["losses"], rel=1e-6)
        for name, value in want["params"].items():
            torch.testing.assert_close(got["params"][name], value, msg=name, **TOL)  # type: ignore[arg-type]


def default_mesh_run() -> dict[str, Any]:
    seen: list[torch.Tensor] = []
    model = build_model()
    model.layers[0].mlp.up.register_forward_hook(lambda mod, args, out: seen.append(mod.weight))
    result = _train_default_mesh(model)
    result["gathered_is_plain"] = type(seen[0]) is torch.Tensor
    return result


def _train_default_mesh(model: TinyGPT) -> dict[str, Any]:
    for block in model.layers:
        fully_shard(block)  # mesh=None: a 1-d mesh over the world, as torch's default
    fully_shard(model)
    return _train_local_batches(model, 4)


def _train_local_batches(model: nn.Module, dp: int) -> dict[str, Any]:
    optimizer = make_optimizer(model)
    rank = init_device_mesh("cpu", (4,)).get_rank()
    losses = []
    for step in range(STEPS):
        tokens, targets = (t.chunk(dp)[rank % dp] for t in batch(step))
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(0, 1))
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {name: p.full_tensor() for name, p in model.named_parameters()}}


def test_plain_parameters_on_the_default_mesh_gather_as_plain_tensors() -> None:
    per_rank = run_threaded(default_mesh_run, 4)
    check(per_rank, build_model(), 4)
    assert per_rank[0]["gathered_is_plain"]


# ----- HSDP: FSDP2's 2-d dp mesh (replicate, shard) -------------------------------------------------
def hsdp_run() -> dict[str, Any]:
    """Sharded over dp_shard, replicated over dp_replicate; each of the 4 ranks its own quarter of the batch."""
    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    model = build_model()
    for block in model.layers:
        fully_shard(block, mesh=world)
    fully_shard(model, mesh=world)
    rank = world.get_rank()
    with CommDebugMode() as comm:
        tokens, targets = (t.chunk(4)[rank] for t in batch(0))
        F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(0, 1)).backward()  # type: ignore[no-untyped-call]
    model.zero_grad()
    result = _train_local_batches(model, 4)
    result["counts"] = dict(comm.get_comm_counts())
    result["placements"] = {p.placements for p in model.parameters()}
    return result


def test_hsdp_shards_over_dim_1_and_sums_gradients_over_both() -> None:
    per_rank = run_threaded(hsdp_run, 4)
    check(per_rank, build_model(), 4)
    assert per_rank[0]["placements"] == {(Replicate(), Shard(0))}
    # per group (two blocks, the root): one all_gather in forward, again in each block's backward,
    # one reduce_scatter over dp_shard and one all_reduce over dp_replicate
    assert per_rank[0]["counts"] == {"all_gather": 3 + 2, "reduce_scatter": 3, "all_reduce": 3}


# ----- torchtitan's local embedding lookup (to_local inside forward) --------------------------------
class LocalLookupEmbedding(nn.Embedding):
    """torchtitan's pattern: look up on this rank's piece of the weight, wrap the result back as a DTensor."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if not isinstance(weight, DTensor):
            return F.embedding(tokens, weight)
        mesh = weight.device_mesh
        token_placements = tokens.placements if isinstance(tokens, DTensor) else (Replicate(),) * mesh.ndim
        local_tokens = tokens.to_local() if isinstance(tokens, DTensor) else tokens
        local = F.embedding(local_tokens, weight.to_local())  # weight Shard(1) over tp: this rank's columns
        placements = [Shard(2) if w == Shard(1) else t for w, t in zip(weight.placements, token_placements)]
        return DTensor.from_local(local, mesh, placements, shape=(*tokens.shape, DIM))


class EmbedAndHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = LocalLookupEmbedding(VOCAB, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh())
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        if isinstance(x, DTensor):
            x = x.redistribute(
                placements=[p if isinstance(p, Shard) and p.dim == 0 else Replicate() for p in x.placements]
            )
        return self.head(self.mlp(x))


def _shard_embedding_columns(model: EmbedAndHead, tp_mesh: DeviceMesh) -> None:
    placements = [Shard(1) if name == "tp" else Replicate() for name in tp_mesh.mesh_dim_names or ()]
    model.emb.weight = nn.Parameter(distribute_tensor(model.emb.weight.detach(), tp_mesh, placements))
    distribute_module(model.mlp, tp_mesh)  # replicated over tp
    parallelize_module(model, tp_mesh, {"head": ColwiseParallel(use_local_output=False)})


def local_lookup_fsdp2() -> dict[str, Any]:
    world = init_device_mesh("cpu", (DP, 2), mesh_dim_names=("dp", "tp"))
    model = EmbedAndHead()
    _shard_embedding_columns(model, world["tp"])
    return train_fsdp2(model, world, blocks=lambda m: [m.emb, m.mlp])  # type: ignore[list-item]


def local_lookup_same_mesh(compile_embedding: bool = False) -> dict[str, Any]:
    """spmd's layout: TP and FSDP on the one 2-d mesh, the batch a DTensor sharded over dp, the global loss."""
    world = init_device_mesh("cpu", (DP, 2), mesh_dim_names=("dp", "tp"))
    model = EmbedAndHead()
    _shard_embedding_columns(model, world)
    fully_shard(model.emb, mesh=world)
    fully_shard(model.mlp, mesh=world)
    fully_shard(model, mesh=world)
    if compile_embedding:
        model.emb.compile(backend="aot_eager")
    return train_same_mesh(model, world)


def local_lookup_same_mesh_compiled() -> dict[str, Any]:
    """The same, with the embedding compiled (AOTAutograd): its gathered weight reaches the graph as a
    non-leaf input, which the compiler fakes through a detach; the gradient is still summed over dp."""
    return local_lookup_same_mesh(compile_embedding=True)


def train_same_mesh(model: nn.Module, world: DeviceMesh) -> dict[str, Any]:
    """Two AdamW steps in spmd's layout: the batch a DTensor sharded over dp, the global loss."""
    optimizer = make_optimizer(model)
    losses = []
    for step in range(STEPS):
        tokens, targets = (
            distribute_tensor(t, world, [Shard(0), Replicate()], src_data_rank=None) for t in batch(step)
        )
        with loss_parallel():
            loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(0, 1))
            loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.full_tensor().item())
    return {"losses": losses, "params": {name: p.full_tensor() for name, p in model.named_parameters()}}


@pytest.mark.parametrize(
    "layout",
    [local_lookup_fsdp2, local_lookup_same_mesh, local_lookup_same_mesh_compiled],
    ids=["sibling-sub-meshes", "same-mesh", "same-mesh-compiled"],
)
def test_gradients_through_to_local_inside_forward_are_summed_over_dp(layout: Callable[[], dict[str, Any]]) -> None:
    """The embedding's gradient reaches its gathered copy through ``to_local()``: as each dp rank's
    contribution, it must still be summed over dp (it once came back as if already whole)."""
    per_rank = run_threaded(layout, 4)
    dp = DP if layout is local_lookup_fsdp2 else 1  # the same-mesh losses are already global
    check(per_rank, EmbedAndHead(), dp)


# ----- mixed precision ----------------------------------------------------------------------------
def one_device_in_bf16(model: nn.Module) -> nn.Module:
    """One device computing with bf16 copies of float32 parameters (what MixedPrecisionPolicy asks)."""

    class InBf16(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            params = {n: p.to(torch.bfloat16) for n, p in self.inner.named_parameters()}
            return torch.func.functional_call(self.inner, params, (tokens,)).float()

    wrapped = InBf16()
    return wrapped


def bf16_fsdp2() -> dict[str, Any]:
    world = init_device_mesh("cpu", (DP, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(build_model(), world["tp"], FSDP2_TP_PLAN)
    dtypes: list[torch.dtype] = []
    model.layers[0].mlp.up.register_forward_hook(lambda mod, args, out: dtypes.append(mod.weight.dtype))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    root_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)  # float32 logits
    result = train_fsdp2(model, world, mp_policy=policy, root_options={"mp_policy": root_policy})
    result["first_grads"] = {f"inner.{n}": g for n, g in result["first_grads"].items()}
    result["dtypes"] = (dtypes[0], {p.dtype for p in model.parameters()})
    return result


def test_mixed_precision_computes_in_bf16_and_keeps_float32_shards() -> None:
    """Gradients, not parameters after AdamW: Adam turns bf16's rounding on tiny gradients into lr-sized steps."""
    per_rank = run_threaded(bf16_fsdp2, 4)
    reference = one_device_in_bf16(build_model())
    tokens, targets = batch(0)
    F.cross_entropy(reference(tokens).flatten(0, 1), targets.flatten(0, 1)).backward()  # type: ignore[no-untyped-call]
    for name, param in reference.named_parameters():
        grad = per_rank[0]["first_grads"][name]
        assert grad.dtype == torch.float32
        torch.testing.assert_close(grad, param.grad, rtol=0, atol=0.06 * float(param.grad.abs().max()), msg=name)
    losses = torch.tensor([per_rank[r]["losses"] for r in (0, 2)]).mean(0)
    torch.testing.assert_close(
        losses, torch.tensor(one_device(one_device_in_bf16(build_model()))[0]), rtol=1e-2, atol=1e-2
    )
    assert per_rank[0]["dtypes"] == (torch.bfloat16, {torch.float32})


# ----- a group of modules, gradient accumulation, FSDPModule's methods -------------------------------
def grouped_norm_and_head() -> dict[str, Any]:
    world = init_device_mesh("cpu", (4,))
    model = build_model()
    for block in model.layers:
        fully_shard(block, mesh=world)
    fully_shard([model.norm, model.lm_head], mesh=world)  # one group: one all_gather gathers both
    fully_shard(model, mesh=world)
    with CommDebugMode() as comm:
        model(batch(0)[0].chunk(4)[world.get_rank()])
    gathers = comm.get_comm_counts()["all_gather"]
    result = _train_local_batches(model, 4)
    result["gathers"] = gathers
    result["group_is_fsdp"] = isinstance(model.norm, FSDPModule) and isinstance(model.lm_head, FSDPModule)
    return result


def test_a_list_of_modules_is_one_group() -> None:
    per_rank = run_threaded(grouped_norm_and_head, 4)
    check(per_rank, build_model(), 4)
    # two blocks, the root (embedding), and the norm+head group: gathered once by norm, once by head
    assert per_rank[0]["gathers"] == 2 + 1 + 2
    assert per_rank[0]["group_is_fsdp"]


def accumulate_without_sync() -> dict[str, Any]:
    """Two micro-batches per step: the first backward keeps its gradients unreduced, the second reduces both."""
    world = init_device_mesh("cpu", (4,))
    model = build_model()
    for block in model.layers:
        fully_shard(block, mesh=world)
    fully_shard(model, mesh=world)
    optimizer = make_optimizer(model)
    rank = world.get_rank()
    losses = []
    with CommDebugMode() as comm:
        for step in range(STEPS):
            tokens, targets = (t.chunk(4)[rank] for t in batch(step))
            total = 0.0
            for micro, (x, y) in enumerate(zip(tokens.chunk(2), targets.chunk(2))):
                model.set_requires_gradient_sync(micro == 1)
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(0, 1)) / 2
                loss.backward()  # type: ignore[no-untyped-call]
                total += loss.item()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(total)
    scatters = comm.get_comm_counts()["reduce_scatter"]
    return {"losses": losses, "params": {n: p.full_tensor() for n, p in model.named_parameters()}, "scatters": scatters}


def test_no_gradient_sync_accumulates_until_the_synced_backward() -> None:
    per_rank = run_threaded(accumulate_without_sync, 4)
    check(per_rank, build_model(), 4)
    assert per_rank[0]["scatters"] == STEPS * (2 + 1)  # only the synced backward, one per group


def fsdp_module_methods() -> dict[str, Any]:
    world = init_device_mesh("cpu", (4,))
    model = build_model()
    block = fully_shard(model.layers[0], mesh=world, offload_policy=OffloadPolicy())
    fully_shard(model, mesh=world, reshard_after_forward=False)
    assert isinstance(block, FSDPModule) and type(block).__name__ == "FSDPBlock"
    block.unshard()
    whole = block.mlp.up.weight.shape, type(block.mlp.up.weight) is torch.Tensor
    block.reshard()
    resharded = block.mlp.up.weight.placements
    model.set_reshard_after_forward(True)
    model.set_reshard_after_backward(True)
    model.set_gradient_divide_factor(4.0)
    model.set_force_sum_reduction_for_comms(True)
    model.set_is_last_backward(True)
    model.set_modules_to_forward_prefetch([block])
    model.set_modules_to_backward_prefetch([block])
    twin = copy.deepcopy(model)
    model.embed = model.tok_emb.forward  # a method other than forward that computes with the root's parameters
    register_fsdp_forward_method(model, "embed")
    embedded = model.embed(batch(0)[0])
    return {
        "embedded": embedded.detach(),
        "whole": whole,
        "resharded": resharded,
        "twin": type(twin).__name__,
        "twin_is_fsdp": isinstance(twin, FSDPModule),
    }


def test_fsdp_module_methods() -> None:
    result = run_threaded(fsdp_module_methods, 4)[0]
    assert result["whole"] == (torch.Size([4 * DIM, DIM]), True)  # unshard: the whole (plain) weight
    assert result["resharded"] == (Shard(0),)
    assert result["twin"] == "FSDPTinyGPT" and result["twin_is_fsdp"]
    torch.testing.assert_close(result["embedded"], build_model().tok_emb(batch(0)[0]).detach())


# ----- activation checkpointing -------------------------------------------------------------------
def _every_other_matmul() -> Callable[..., Any]:
    """torchtitan's op-level SAC: keep attention and every second matmul's output, recompute the rest."""
    counts = {"forward": 0, "recompute": 0}
    keep = (torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, torch.ops.aten.max.default)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op == torch.ops.aten.mm.default:
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            return CheckpointPolicy.MUST_SAVE if counts[key] % 2 == 0 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


class Checkpointed(nn.Module):
    """A block whose forward runs under torch.utils.checkpoint (full, or op-selective)."""

    def __init__(self, block: nn.Module, selective: bool) -> None:
        super().__init__()
        self.block = block
        self.selective = selective

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.selective:
            return checkpoint(self.block, x, use_reentrant=False, context_fn=_every_other_matmul())  # type: ignore[no-any-return]
        return checkpoint(self.block, x, use_reentrant=False)  # type: ignore[no-any-return]


def with_checkpointing(model: TinyGPT, how: str) -> TinyGPT:
    for i, block in enumerate(model.layers):
        if how == "wrapper":
            model.layers[i] = checkpoint_wrapper(block)
        else:
            model.layers[i] = Checkpointed(block, selective=how == "selective")
    return model


def checkpointed_fsdp2(how: str) -> dict[str, Any]:
    world = init_device_mesh("cpu", (DP, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(build_model(), world["tp"], FSDP2_TP_PLAN)
    return train_fsdp2(with_checkpointing(model, how), world)


def checkpointed_inside_fsdp(how: str) -> dict[str, Any]:
    """fully_shard on the block itself, checkpoint around it: the recompute runs fully_shard's hooks."""
    world = init_device_mesh("cpu", (4,))
    model = build_model()
    for block in model.layers:
        fully_shard(block, mesh=world)
    fully_shard(with_checkpointing(model, how), mesh=world)
    return _train_local_batches(model, 4)


def checkpointed_same_mesh(how: str) -> dict[str, Any]:
    """spmd's layout: a recompute with the dp shards would make a Linear's output Partial over dp."""
    world = init_device_mesh("cpu", (DP, 2), mesh_dim_names=("dp", "tp"))
    model = with_checkpointing(parallelize_module(build_model(), world, TP_PLAN), how)
    for block in model.layers:
        fully_shard(block, mesh=world)
    fully_shard(model, mesh=world)
    return train_same_mesh(model, world)


@pytest.mark.parametrize("how", ["full", "wrapper", "selective"])
def test_activation_checkpointing_recomputes_with_gathered_parameters(how: str) -> None:
    reference = with_checkpointing(build_model(), how)
    check(run_threaded(checkpointed_fsdp2, 4, how), reference, DP)
    check(run_threaded(checkpointed_same_mesh, 4, how), with_checkpointing(build_model(), how), 1)
    if how != "wrapper":
        check(run_threaded(checkpointed_inside_fsdp, 4, how), with_checkpointing(build_model(), how), 4)


# ----- errors -------------------------------------------------------------------------------------
def test_errors_name_the_fix() -> None:
    def run() -> None:
        world = init_device_mesh("cpu", (DP, 2), mesh_dim_names=("dp", "tp"))
        model = build_model()
        with pytest.raises(TypeError, match=r"fully_shard\(module, mesh=mesh\)"):
            fully_shard(model, world["dp"])  # type: ignore[misc]
        fully_shard(model.layers[0], mesh=world["dp"])
        with pytest.raises(ValueError, match="already sharded by a fully_shard call"):
            fully_shard([model.layers[1], model.layers[0].mlp], mesh=world["dp"])
        with pytest.raises(NotImplementedError, match="HSDP"):
            fully_shard(model.norm, mesh=world, dp_mesh_dims=DataParallelMeshDims(shard="dp", replicate="tp"))
        hsdp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        with pytest.raises(ValueError, match=r"not on mesh\(dp_replicate=2, dp_shard=2\)"):  # another world's tp
            fully_shard(parallelize_module(build_model(), world["tp"], {"lm_head": ColwiseParallel()}), mesh=hsdp_mesh)
        with pytest.raises(ValueError, match=r"on the HSDP mesh .* itself"):
            fully_shard(distribute_module(nn.Linear(4, 4), hsdp_mesh), mesh=hsdp_mesh)
        with pytest.raises(NotImplementedError, match="True, False or None"):
            fully_shard(model.norm, mesh=world["dp"], reshard_after_forward=2)
        tp_on_dp = parallelize_module(build_model(), world["dp"], {"lm_head": ColwiseParallel()})
        with pytest.raises(ValueError, match=r"needs it Replicate\(\) there"):
            fully_shard(tp_on_dp, mesh=world["dp"])  # tp and dp on the same mesh dim
        with pytest.raises(ValueError, match=r"not on mesh\(dp=2, tp=2\)"):
            fully_shard(tp_on_dp, mesh=world)
        # torch 2.13's SPMD-mesh spelling of spmd's same-mesh layout
        same_mesh = parallelize_module(build_model(), world, {"lm_head": ColwiseParallel()})
        fully_shard(same_mesh, mesh=world, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
        assert same_mesh.lm_head.weight.placements == (_StridedShard(0, split_factor=2), Shard(0))

    run_threaded(run, 4)
