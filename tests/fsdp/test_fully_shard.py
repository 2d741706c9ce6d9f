"""fully_shard (ZeRO-3): alone on a mesh of 4, and composed with tensor parallelism on (dp, tp) = (2, 2).

A small transformer-like model trains three AdamW steps on a dp-sharded batch and must match the
same steps on one device; the tests also check where the shards live, how much each rank holds,
which collectives run in forward and backward, and that gathered parameters are freed after forward.
"""

from __future__ import annotations

import copy
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spmd.fsdp import fully_shard, shard_first_free_dim
from spmd.tensor import DeviceMesh, DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.tensor.placement import _StridedShard
from spmd.tensor_parallel import (
    ColwiseParallel,
    loss_parallel,
    parallelize_module,
)
from spmd.testing import run_threaded, seeded_randn
from spmd.testing.models import tp_plan

VOCAB, DIM, LAYERS, BATCH, SEQ = 32, 16, 2, 8, 6
STEPS = 3


# ----- the model: plain torch ---------------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, dim: int, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq, self.heads, dim // self.heads).transpose(1, 2)

        y = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)), is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, seq, dim))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attn_norm, self.attn = nn.RMSNorm(dim), Attention(dim)
        self.mlp_norm, self.mlp = nn.RMSNorm(dim), MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(DIM) for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def build_model() -> TinyGPT:
    model = TinyGPT()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return model


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randint(VOCAB, (BATCH, SEQ), generator=gen), torch.randint(VOCAB, (BATCH, SEQ), generator=gen)


TP_PLAN = tp_plan(sequence_parallel=True)  # the demo GPT's plan; TinyGPT's modules have the same names


def shard_model(model: TinyGPT, mesh: DeviceMesh, **options: Any) -> TinyGPT:
    """torchtitan's order: fully_shard each block, then the root (which takes the rest)."""
    for block in model.layers:
        fully_shard(block, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    return model


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, targets: torch.Tensor
) -> float:
    with loss_parallel():
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(0, 1))
        loss.backward()  # type: ignore[no-untyped-call]
    optimizer.step()
    optimizer.zero_grad()
    return float((loss.full_tensor() if isinstance(loss, DTensor) else loss).item())


def make_optimizer(model: nn.Module, *, foreach: bool = False) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=foreach)


def single_device_run() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build_model()
    optimizer = make_optimizer(model)
    losses = [train_step(model, optimizer, *batch(step)) for step in range(STEPS)]
    return losses, {name: p.detach() for name, p in model.named_parameters()}


def local_bytes(tensor: torch.Tensor) -> int:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).nbytes


def distributed_run(
    mesh_shape: tuple[int, ...], tp: bool, foreach: bool = False, first_free_dim: bool = False
) -> dict[str, object]:
    """Train on the current world (threads or gloo processes); what the tests compare.

    ``first_free_dim``: spmd's former layout (``shard_first_free_dim``) instead of FSDP2's default."""
    names = ("dp", "tp") if len(mesh_shape) == 2 else ("dp",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    model = build_model()
    if tp:
        parallelize_module(model, mesh, TP_PLAN)
    options = (
        {"shard_placement_fn": shard_first_free_dim(mesh["dp"] if len(names) > 1 else mesh)} if first_free_dim else {}
    )
    shard_model(model, mesh, **options)
    optimizer = make_optimizer(model, foreach=foreach)
    placements = tuple(Shard(0) if name == "dp" else Replicate() for name in names)
    losses = []
    for step in range(STEPS):
        tokens, targets = (distribute_tensor(t, mesh, placements, src_data_rank=None) for t in batch(step))
        with loss_parallel():
            loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(0, 1))
            loss.backward()  # type: ignore[no-untyped-call]
        if step == STEPS - 1:  # gradients are laid out like their (sharded) parameters
            grads_like_params = all(p.grad.placements == p.placements for p in model.parameters())
            grad_bytes = sum(local_bytes(p.grad) for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.full_tensor().item())
    state_bytes = sum(local_bytes(v) for s in optimizer.state.values() for v in s.values() if v.ndim > 0)
    param_bytes = sum(local_bytes(p) for p in model.parameters())
    return {
        "losses": losses,
        "params": {name: p.full_tensor() for name, p in model.named_parameters()},
        "placements": {name: p.placements for name, p in model.named_parameters()},
        "grads_like_params": grads_like_params,
        "bytes": param_bytes + grad_bytes + state_bytes,
    }


def check_against_one_device(per_rank: list[dict[str, object]], world: int) -> None:
    losses, params = single_device_run()
    full_bytes = 4 * sum(p.nbytes for p in params.values())  # params + grads + AdamW's two moments
    for result in per_rank:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(losses), rtol=1e-4, atol=1e-5)
        for name, value in result["params"].items():  # type: ignore[attr-defined]
            torch.testing.assert_close(value, params[name], rtol=1e-4, atol=1e-5, msg=name)
        assert result["grads_like_params"]
    total = sum(r["bytes"] for r in per_rank)  # type: ignore[misc]
    assert total == pytest.approx(full_bytes, rel=0.15), "the shards add up to about one model"
    for result in per_rank:  # every rank holds about 1/world of params + grads + optimizer state
        assert result["bytes"] / full_bytes < 1.25 / world, (result["bytes"], full_bytes)


# ----- tests --------------------------------------------------------------------------------------
def test_fsdp_on_a_mesh_of_4_trains_like_one_device() -> None:
    per_rank = run_threaded(distributed_run, 4, (4,), tp=False)
    check_against_one_device(per_rank, 4)
    placements = per_rank[0]["placements"]
    assert placements["layers.0.attn.q.weight"] == (Shard(0),)  # type: ignore[index]


@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
def test_fsdp_x_tp_on_2x2_trains_like_one_device(world: Callable[..., list[Any]], foreach: bool) -> None:
    """AdamW's per-parameter and multi-tensor implementations both step on the shards."""
    per_rank = world(distributed_run, 4, (2, 2), True, foreach, timeout=240)
    check_against_one_device(per_rank, 4)
    placements = per_rank[0]["placements"]
    # FSDP2's: dp cuts dim 0; where tp (the later mesh dim) cuts it too, dp cuts each tp piece
    strided = (_StridedShard(0, split_factor=2), Shard(0))
    assert placements["layers.0.attn.q.weight"] == strided  # type: ignore[index]
    assert placements["layers.0.attn.out.weight"] == (Shard(0), Shard(1))  # type: ignore[index]
    assert placements["layers.0.mlp.up.bias"] == strided  # type: ignore[index]
    assert placements["layers.0.attn_norm.weight"] == (Shard(0), Replicate())  # type: ignore[index]
    assert placements["tok_emb.weight"] == strided  # type: ignore[index]


def test_first_free_dim_keeps_spmds_former_layout() -> None:
    """``shard_placement_fn=shard_first_free_dim(mesh["dp"])``: dp cuts the first dim tp does not, else nothing."""
    per_rank = run_threaded(distributed_run, 4, (2, 2), True, False, True)
    check_against_one_device(per_rank, 4)
    placements = per_rank[0]["placements"]
    assert placements["layers.0.attn.q.weight"] == (Shard(1), Shard(0))  # type: ignore[index]
    assert placements["layers.0.attn.out.weight"] == (Shard(0), Shard(1))  # type: ignore[index]
    assert placements["layers.0.mlp.up.bias"] == (Replicate(), Shard(0))  # type: ignore[index]  # nothing left to cut
    assert placements["layers.0.attn_norm.weight"] == (Shard(0), Replicate())  # type: ignore[index]
    assert placements["tok_emb.weight"] == (Shard(1), Shard(0))  # type: ignore[index]


def test_dp_of_one_rank_trains_unchanged() -> None:
    """On a (1, 4) mesh dp has nothing to cut; the placements are still FSDP2's (a one-rank _StridedShard)."""
    per_rank = run_threaded(distributed_run, 4, (1, 4), tp=True)
    check_against_one_device(per_rank, 4)
    placements = per_rank[0]["placements"]
    assert placements["layers.0.attn.q.weight"] == (_StridedShard(0, split_factor=4), Shard(0))  # type: ignore[index]


def dp_collectives_per_module(reshard_after_forward: bool | None) -> dict[tuple[str, bool], dict[str, int]]:
    """``{(module, backward): {collective: count}}`` of one step's collectives over the dp groups."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = shard_model(
        parallelize_module(build_model(), mesh, TP_PLAN), mesh, reshard_after_forward=reshard_after_forward
    )
    tokens, targets = (distribute_tensor(t, mesh, [Shard(0), Replicate()]) for t in batch(0))
    dp_ranks = tuple(mesh["dp"].mesh.flatten().tolist())
    with CommDebugMode() as comm:
        logits = model(tokens)
        with loss_parallel():
            F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1)).backward()
    counts: dict[tuple[str, bool], Counter[str]] = defaultdict(Counter)
    for event in comm.events:
        if event.record.ranks == dp_ranks:
            for name in set(event.modules):
                counts[(name, event.backward)][event.kind] += 1
    return {key: dict(c) for key, c in counts.items()}


@pytest.mark.parametrize("reshard_after_forward", [None, True, False])
def test_all_gather_in_forward_and_backward_reduce_scatter_in_backward(reshard_after_forward: bool | None) -> None:
    """Over dp, each block gathers all its parameters with one all_gather before forward (and again
    before backward when it resharded) and reduce-scatters all their gradients with one reduce_scatter.

    The module's class name reads ``FSDP<Name>``: fully_shard made its class a subclass of FSDPModule."""
    counts = run_threaded(dp_collectives_per_module, 4, reshard_after_forward)[0]
    blocks_reshard = reshard_after_forward is not False  # None: every module but the root
    for i in range(LAYERS):
        block = f"FSDPTinyGPT.layers.{i}"
        assert counts[(block, False)] == {"all_gather": 1}
        regather = {"all_gather": 1} if blocks_reshard else {}
        assert counts[(block, True)] == {**regather, "reduce_scatter": 1}
    # the root (embedding, final norm, head) gathers once; by default it keeps its copies for backward
    assert counts[("FSDPTinyGPT", False)] == {"all_gather": LAYERS + 1}
    regathers = LAYERS * blocks_reshard + (reshard_after_forward is True)
    expected_gathers = {"all_gather": regathers} if regathers else {}
    assert counts[("FSDPTinyGPT", True)] == {**expected_gathers, "reduce_scatter": LAYERS + 1}


def test_gathered_parameters_are_freed_after_forward() -> None:
    def run() -> tuple[int, int, int]:
        mesh = init_device_mesh("cpu", (4,))
        model = shard_model(build_model(), mesh)
        seen: list[DTensor] = []
        model.layers[0].mlp.up.register_forward_hook(lambda mod, args, out: seen.append(mod.weight))
        tokens, targets = (distribute_tensor(t, mesh, [Shard(0)]) for t in batch(0))
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(0, 1))
        gathered = seen[0]
        # inside forward the module computed with the whole weight; the registered one is the shard
        assert gathered.placements == (Replicate(),) and model.layers[0].mlp.up.weight.placements == (Shard(0),)
        between = gathered.to_local().untyped_storage().nbytes()
        loss.backward()
        return between, gathered.to_local().numel(), model.layers[0].mlp.up.weight.to_local().numel()

    between, gathered_numel, shard_numel = run_threaded(run, 4)[0]
    assert between == 0, "the gathered copy is freed between forward and backward"
    assert gathered_numel == 4 * shard_numel == 4 * DIM * DIM


def test_tied_weights_and_no_grad_forward() -> None:
    """A weight shared by the embedding and the head is sharded once and gathered where each uses it;
    a forward under no_grad computes the same logits and keeps nothing."""
    reference = build_model()
    reference.lm_head.weight = reference.tok_emb.weight
    tokens, targets = batch(0)
    optimizer = make_optimizer(reference)
    expected = [train_step(reference, optimizer, tokens, targets) for _ in range(2)]
    with torch.no_grad():
        expected_logits = reference(tokens)

    def run() -> tuple[list[float], torch.Tensor, bool]:
        mesh = init_device_mesh("cpu", (4,))
        model = build_model()
        model.lm_head.weight = model.tok_emb.weight
        shard_model(model, mesh)
        optimizer = make_optimizer(model)
        placed = [distribute_tensor(t, mesh, [Shard(0)]) for t in (tokens, targets)]
        losses = [train_step(model, optimizer, *placed) for _ in range(2)]
        with torch.no_grad():
            logits = model(placed[0])
        return losses, logits.full_tensor(), model.lm_head.weight is model.tok_emb.weight

    losses, logits, still_tied = run_threaded(run, 4)[0]
    assert still_tied
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-5)


class Scale(nn.Module):
    """Multiplies by a learnt scalar: a 0-d parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def test_uneven_and_small_parameters() -> None:
    """dp cuts dim 0 as FSDP2 does, however short: as torch.chunk does, so some shards are empty (weight
    [3, 5] over 4 ranks: 1, 1, 1, 0 rows; [1, 3]: 1, 0, 0, 0); a 0-d parameter stays whole over dp."""
    gen = torch.Generator().manual_seed(9)
    reference = nn.Sequential(nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 1), Scale())
    with torch.no_grad():
        for param in reference.parameters():
            param.copy_(torch.randn(param.shape, generator=gen))
    x, y = torch.randn(8, 5, generator=gen), torch.randn(8, 1, generator=gen)
    model_ref = copy.deepcopy(reference)
    optimizer = make_optimizer(model_ref)
    for _ in range(2):
        optimizer.zero_grad()
        F.mse_loss(model_ref(x), y).backward()
        optimizer.step()

    def run() -> tuple[dict[str, object], dict[str, torch.Tensor]]:
        mesh = init_device_mesh("cpu", (4,))
        model = fully_shard(copy.deepcopy(reference), mesh=mesh)
        optimizer = make_optimizer(model)
        inputs, targets = distribute_tensor(x, mesh, [Shard(0)]), distribute_tensor(y, mesh, [Shard(0)])
        for _ in range(2):
            optimizer.zero_grad()
            F.mse_loss(model(inputs), targets).backward()
            optimizer.step()
        named = dict(model.named_parameters())
        shapes = {n: tuple(p.to_local().shape) for n, p in named.items()}
        return {n: p.placements for n, p in named.items()}, {n: p.full_tensor() for n, p in named.items()}, shapes

    per_rank = run_threaded(run, 4)
    placements, params, _ = per_rank[0]
    assert placements == {
        "0.weight": (Shard(0),), "0.bias": (Shard(0),), "2.weight": (Shard(0),), "2.bias": (Shard(0),),
        "3.scale": (Replicate(),),
    }  # fmt: skip
    assert [shapes["0.weight"] for _, _, shapes in per_rank] == [(1, 5), (1, 5), (1, 5), (0, 5)]
    assert [shapes["2.weight"] for _, _, shapes in per_rank] == [(1, 3), (0, 3), (0, 3), (0, 3)]
    for name, param in model_ref.named_parameters():
        torch.testing.assert_close(params[name], param, rtol=1e-4, atol=1e-5, msg=name)


class MixedDtypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(11)
        self.weight = nn.Parameter(torch.randn(8, 6, generator=gen))
        self.scale = nn.Parameter(torch.randn(8, generator=gen).to(torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.weight.t()) * self.scale.float()


def test_parameters_of_two_dtypes_gather_in_one_buffer_each() -> None:
    x_full = seeded_randn(4, 6, seed=12)
    reference = MixedDtypes()
    reference(x_full).square().sum().backward()

    def run() -> tuple[int, dict[str, torch.Tensor]]:
        mesh = init_device_mesh("cpu", (4,))
        model = fully_shard(MixedDtypes(), mesh=mesh)
        x = distribute_tensor(x_full, mesh, [Shard(0)])
        with CommDebugMode() as comm:
            model(x).square().sum().backward()
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
        return comm.get_comm_counts()["all_gather"], grads

    gathers, grads = run_threaded(run, 4)[0]
    assert gathers == 2  # one flat buffer per dtype (a root keeps its copies: no regather)
    for name, param in reference.named_parameters():
        assert grads[name].dtype == param.dtype
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-5, atol=1e-4, msg=name)  # float32 sums


def test_errors_say_what_to_do() -> None:
    def run() -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = fully_shard(build_model(), mesh=mesh)
        with pytest.raises(RuntimeError, match="already called"):
            fully_shard(model, mesh=mesh)
        with pytest.raises(ValueError, match=r"submodules \(blocks\) before their parent"):
            fully_shard(model.layers[0], mesh=mesh)
        on_sub_mesh = parallelize_module(build_model(), mesh["tp"], {"lm_head": ColwiseParallel()})
        with pytest.raises(ValueError, match=r"parallelize_module\(model, world\[\"tp\"\], plan\)"):
            fully_shard(on_sub_mesh, mesh=mesh)  # tp on the sub-mesh: pass fully_shard the sibling mesh["dp"]
        with pytest.raises(TypeError, match="mesh=mesh"):
            fully_shard(build_model(), mesh)  # type: ignore[misc]  # FSDP2 takes the mesh by keyword
        unnamed = init_device_mesh("cpu", (2, 2))
        with pytest.raises(ValueError, match="dp_mesh_dim="):
            fully_shard(build_model(), mesh=unnamed)

    run_threaded(run, 4)


def test_a_failed_forward_leaves_the_shards_registered() -> None:
    def run() -> tuple[object, ...]:
        mesh = init_device_mesh("cpu", (4,))
        model = shard_model(build_model(), mesh)
        with pytest.raises(RuntimeError):
            model.layers[0](distribute_tensor(torch.randn(4, 6, DIM + 1), mesh, [Shard(0)]))  # wrong width
        return model.layers[0].mlp.up.weight.placements

    assert run_threaded(run, 4)[0] == (Shard(0),)
