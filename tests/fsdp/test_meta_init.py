"""torchtitan's meta-device init: build on meta, parallelize, ``to_empty``, ``init_weights``, train.

The model is built under ``torch.device("meta")`` (no memory), tensor-parallelised and/or
fully-sharded, materialised with ``model.to_empty(device="cpu")`` and initialised in place with
``nn.init`` functions on the DTensor parameters. With every rank seeded alike
(``spmd.tensor.random.manual_seed``), each sharded parameter holds the numbers one device draws
after ``torch.manual_seed`` with the same seed (as torch's DTensor does on CUDA, where its
offset-based RNG gives each shard its part of one device's stream), and two training steps then
match one device: gradients and SGD steps in float32, AdamW steps in float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_fsdp2 import FSDP2_TP_PLAN, STEPS, TOL
from test_fully_shard import DIM, TinyGPT, batch, make_optimizer
from torch import nn

from spmd.fsdp import fully_shard, fully_shard_state
from spmd.tensor import DeviceMesh, DTensor, init_device_mesh
from spmd.tensor.random import manual_seed
from spmd.tensor_parallel import loss_parallel, parallelize_module
from spmd.testing import run_threaded

SEED = 7
OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "sgd": lambda model: torch.optim.SGD(model.parameters(), lr=0.1),
    "adamw": make_optimizer,
}


def init_weights(model: TinyGPT) -> None:
    """torchtitan's shape of init: normal embeddings, truncated-normal linears, zero biases, unit norms."""
    with torch.no_grad():
        nn.init.normal_(model.tok_emb.weight)
        for layer in model.layers:
            for linear in (*(getattr(layer.attn, n) for n in ("q", "k", "v", "out")), layer.mlp.up, layer.mlp.down):
                nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.2, a=-0.4, b=0.4)
                if linear.bias is not None:
                    nn.init.zeros_(linear.bias)
            nn.init.ones_(layer.attn_norm.weight)
            nn.init.ones_(layer.mlp_norm.weight)
        nn.init.ones_(model.norm.weight)
        bound = 1 / math.sqrt(DIM)
        nn.init.uniform_(model.lm_head.weight, -bound, bound)


def one_device_model(dtype: torch.dtype = torch.float32) -> TinyGPT:
    """The reference: built on CPU and initialised with the same seed."""
    model = TinyGPT().to(dtype)
    torch.manual_seed(SEED)
    init_weights(model)
    return model


def materialise(model: TinyGPT, *, seed_with: str = "spmd") -> dict[str, Any]:
    """to_empty + init_weights on every rank; what survives of the parallel layout.

    ``seed_with="torch"`` seeds as torchtitan does, ``torch.manual_seed`` alone: the world's DTensor
    generator takes ``torch.initial_seed()`` at its first random op (later reseeds need
    ``spmd.tensor.random.manual_seed``)."""
    before = {name: (p.device_mesh, p.placements) for name, p in model.named_parameters() if isinstance(p, DTensor)}
    ids = {name: id(p) for name, p in model.named_parameters()}
    on_meta = all(isinstance(p, DTensor) and p.is_meta and p.to_local().is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    mesh = next(p.device_mesh for p in model.parameters() if isinstance(p, DTensor))
    if seed_with == "spmd":
        manual_seed(SEED, mesh)
    else:
        torch.manual_seed(SEED)
    init_weights(model)
    after = {name: (p.device_mesh, p.placements) for name, p in model.named_parameters() if isinstance(p, DTensor)}
    return {
        "built_on_meta": on_meta,
        "layout_kept": before == after and all(not p.is_meta for p in model.parameters()),
        "same_objects": ids == {name: id(p) for name, p in model.named_parameters()},
        "init": {
            name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()
        },
    }


def check_init(per_rank: list[dict[str, Any]], dtype: torch.dtype = torch.float32) -> None:
    expected = dict(one_device_model(dtype).named_parameters())
    for result in per_rank:
        assert result["built_on_meta"] and result["layout_kept"] and result["same_objects"]
        for name, value in result["init"].items():
            torch.testing.assert_close(value, expected[name].detach(), rtol=0, atol=0, msg=name)


# ----- the three layouts, as torchtitan applies them ---------------------------------------------
def build_on_meta(*, tp: bool, dp: bool, dtype: torch.dtype = torch.float32) -> tuple[TinyGPT, DeviceMesh | None]:
    """Build on meta, tensor-parallelise on the tp (sub-)mesh, fully_shard on the dp (sub-)mesh."""
    if tp and dp:
        world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    else:  # tp alone on 2 ranks: the sequence (6) splits evenly for SequenceParallel
        world = init_device_mesh("cpu", (4 if dp else 2,), mesh_dim_names=("dp" if dp else "tp",))
    with torch.device("meta"):
        model = TinyGPT().to(dtype)
    if tp:
        parallelize_module(model, world["tp"] if dp else world, FSDP2_TP_PLAN)
    dp_mesh = (world["dp"] if tp else world) if dp else None
    if dp_mesh is not None:
        for block in model.layers:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    return model, dp_mesh


def train(model: nn.Module, dp_mesh: DeviceMesh | None, optimizer_name: str) -> dict[str, Any]:
    """Two steps, each dp rank on its own part of the batch; the losses, each step's gradients, the parameters."""
    optimizer = OPTIMIZERS[optimizer_name](model)
    rank, size = (dp_mesh.get_local_rank(), dp_mesh.size()) if dp_mesh is not None else (0, 1)
    losses, grads = [], []
    for step in range(STEPS):
        tokens, targets = (t.chunk(size)[rank] for t in batch(step))
        with loss_parallel():
            loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(0, 1))
            loss.backward()  # type: ignore[no-untyped-call]
        grads.append({name: p.grad.full_tensor() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        losses.append((loss.full_tensor() if isinstance(loss, DTensor) else loss).item())
    return {"losses": losses, "grads": grads, "params": {name: p.full_tensor() for name, p in model.named_parameters()}}


def meta_init_and_train(tp: bool, dp: bool, dtype: torch.dtype, optimizer_name: str) -> dict[str, Any]:
    model, dp_mesh = build_on_meta(tp=tp, dp=dp, dtype=dtype)
    result = materialise(model)
    result["registered"] = not dp or all(fully_shard_state(m) is not None for m in (model, *model.layers))
    return {**result, **train(model, dp_mesh, optimizer_name)}


def one_device_training(dtype: torch.dtype, optimizer_name: str) -> dict[str, Any]:
    """The same steps on one device, on the whole batch."""
    model = one_device_model(dtype)
    optimizer = OPTIMIZERS[optimizer_name](model)
    losses, grads = [], []
    for step in range(STEPS):
        tokens, targets = batch(step)
        loss = F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(0, 1))
        loss.backward()  # type: ignore[no-untyped-call]
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "params": {name: p.detach() for name, p in model.named_parameters()}}


def check_training(per_rank: list[dict[str, Any]], dp: int, dtype: torch.dtype, optimizer_name: str) -> None:
    """The dp ranks' losses average to one device's; every rank's gradients and parameters equal one device's."""
    expected = one_device_training(dtype, optimizer_name)
    # float32: TOL, as for FSDP2's training; float64: assert_close's defaults (rtol 1e-7, atol 1e-7)
    tol = TOL if dtype == torch.float32 else {}
    per_dp = [per_rank[r]["losses"] for r in range(0, len(per_rank), len(per_rank) // dp)]
    torch.testing.assert_close(torch.tensor(per_dp).mean(0), torch.tensor(expected["losses"]), **tol)
    for result in per_rank:
        for step, (grads, expected_grads) in enumerate(zip(result["grads"], expected["grads"], strict=True)):
            for name, grad in grads.items():
                torch.testing.assert_close(grad, expected_grads[name], msg=f"step {step} grad {name}", **tol)
        for name, value in result["params"].items():
            torch.testing.assert_close(value, expected["params"][name], msg=name, **tol)


# Sums run in another order on each layout and, on one device, with another kernel width (AVX2 or
# AVX-512), so float32 results differ at rounding size. SGD's step is linear in the gradient and keeps
# them there. Adam's m/sqrt(v) does not: a near-zero gradient's rounding becomes a visible step (2e-4
# on one element of layers.1.attn.k under tp on an AVX2-only CPU), so AdamW is compared in float64,
# whose rounding lies far below Adam's eps (1e-8).
@pytest.mark.parametrize(
    ("dtype", "optimizer_name"),
    [(torch.float32, "sgd"), (torch.float64, "adamw")],
    ids=["float32-sgd", "float64-adamw"],
)
@pytest.mark.parametrize(
    ("tp", "dp"), [(True, False), (False, True), (True, True)], ids=["tp", "fsdp", "tp-on-tp-fsdp-on-dp"]
)
def test_meta_init_then_train_equals_one_device(tp: bool, dp: bool, dtype: torch.dtype, optimizer_name: str) -> None:
    """to_empty keeps each DTensor parameter (same object, mesh and placements, still fully_shard's);
    init_weights gives one device's values exactly; two steps give one device's losses, gradients and
    parameters."""
    per_rank = run_threaded(meta_init_and_train, 4 if dp else 2, tp, dp, dtype, optimizer_name)
    check_init(per_rank, dtype)
    assert all(result["registered"] for result in per_rank)
    check_training(per_rank, 2 if tp and dp else (4 if dp else 1), dtype, optimizer_name)


def test_meshes_made_under_the_meta_device_hold_real_ranks() -> None:
    """A mesh and its sub-meshes made inside ``with torch.device("meta")`` keep CPU rank tensors."""

    def rank() -> tuple[list[int], list[int], str]:
        with torch.device("meta"):
            world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            dp, tp = world["dp"], world["tp"]
        return dp.mesh.tolist(), tp.mesh.tolist(), str(world.mesh.device)

    for r, (dp, tp, device) in enumerate(run_threaded(rank, 4)):
        assert (dp, tp, device) == ([r % 2, r % 2 + 2], [r // 2 * 2, r // 2 * 2 + 1], "cpu")


def test_torch_manual_seed_alone_seeds_a_fresh_world_like_one_device() -> None:
    def rank() -> dict[str, Any]:
        model, _ = build_on_meta(tp=True, dp=True)
        return materialise(model, seed_with="torch")

    check_init(run_threaded(rank, 4))


def reset_all(model: nn.Module) -> None:
    """FSDP2's documented alternative to init_weights: each module's own ``reset_parameters``."""
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()


def test_reset_parameters_after_to_empty_equals_one_device() -> None:
    """Linear's kaiming_uniform_ (fan-in from the global shape), Embedding's normal_, RMSNorm's ones_."""

    def rank() -> dict[str, torch.Tensor]:
        model, _ = build_on_meta(tp=True, dp=True)
        model.to_empty(device="cpu")
        manual_seed(SEED, next(p for p in model.parameters() if isinstance(p, DTensor)).device_mesh)
        reset_all(model)
        return {name: p.full_tensor() for name, p in model.named_parameters()}

    expected = TinyGPT()
    torch.manual_seed(SEED)
    reset_all(expected)
    for result in run_threaded(rank, 4):
        for name, param in expected.named_parameters():
            torch.testing.assert_close(result[name], param.detach(), rtol=0, atol=0, msg=name)
