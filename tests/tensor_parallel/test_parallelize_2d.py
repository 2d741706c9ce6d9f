"""parallelize_module on a (dp, tp) = (2, 2) mesh: the styles act on tp, the batch stays sharded over dp.

Each test builds a model, parallelises a copy over the 2-d mesh, feeds it the global batch as a
DTensor sharded over dp, and compares forward and backward with the plain model on one device.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from spmd.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.tensor_parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from spmd.testing import assert_same_grads, run_threaded, seeded_module, seeded_randint
from spmd.testing import seeded_randn as randn

BATCH = (Shard(0), Replicate())  # the global batch: sharded over dp, whole on every tp rank


class MLP(nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.q, self.out = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.mlp = MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.out(torch.tanh(self.q(self.attn_norm(x))))
        return x + self.mlp(self.mlp_norm(x))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 16, dim: int = 8) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.block = Block(dim)
        self.norm = nn.RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(self.block(self.tok_emb(tokens))))


def tiny_lm_plan() -> dict[str, object]:
    """The torchtitan plan with sequence parallelism: activations between blocks are Shard(1) over tp."""
    return {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "block.attn_norm": SequenceParallel(),
        "block.q": ColwiseParallel(input_layouts=Shard(1)),
        "block.out": RowwiseParallel(output_layouts=Shard(1)),
        "block.mlp_norm": SequenceParallel(),
        "block.mlp": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
        "block.mlp.up": ColwiseParallel(),
        "block.mlp.down": RowwiseParallel(output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1)),
    }


def test_mlp_forward_backward_match_one_device() -> None:
    reference = seeded_module(MLP(), seed=1, scale=0.5)
    x_full = randn(4, 3, 8, seed=2)
    out_ref = reference(x_full)
    out_ref.sum().backward()

    def run() -> dict[str, int]:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = parallelize_module(copy.deepcopy(reference), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        assert model.up.weight.placements == (Replicate(), Shard(0))
        assert model.down.weight.placements == (Replicate(), Shard(1))
        assert model.down.bias.placements == (Replicate(), Replicate())
        x = distribute_tensor(x_full, mesh, BATCH)
        with CommDebugMode() as comm:
            out = model(x)
        # on an n-d mesh the output stays a DTensor: a local piece would lose the dp layout
        assert isinstance(out, DTensor) and out.placements == BATCH
        torch.testing.assert_close(out.full_tensor(), out_ref)
        out.sum().backward()
        # each dp rank saw half of the batch: weight gradients are partial sums over dp
        assert model.up.weight.grad.placements == (Partial(), Shard(0))
        assert_same_grads(model, reference)
        return comm.get_comm_counts()

    assert run_threaded(run, 4)[0] == {"all_reduce": 1}  # the row-wise output, over tp only


def test_tp_dim_by_keyword_and_explicit_local_output() -> None:
    """tp_mesh_dim= picks the tp dim by name or index; use_local_output=True still hands back the local piece."""
    reference = seeded_module(nn.Linear(8, 8), seed=3, scale=0.5)
    x_full = randn(4, 8, seed=4)

    def run() -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("model", "data"))
        by_index = parallelize_module(copy.deepcopy(reference), mesh, ColwiseParallel(), tp_mesh_dim=0)
        assert by_index.weight.placements == (Shard(0), Replicate())
        local = parallelize_module(
            copy.deepcopy(reference), mesh, ColwiseParallel(use_local_output=True), tp_mesh_dim="model"
        )
        out = local(distribute_tensor(x_full, mesh, (Replicate(), Shard(0))))
        assert not isinstance(out, DTensor)
        coordinate = mesh.get_coordinate()
        assert coordinate is not None
        expected = reference(x_full).chunk(2, 0)[coordinate[1]].chunk(2, 1)[coordinate[0]]
        torch.testing.assert_close(out, expected)

    run_threaded(run, 4)


def test_prepare_module_output_keeps_the_dp_shard() -> None:
    x_full = randn(4, 6, 8, seed=5)

    def run() -> tuple[tuple[object, ...], int]:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        module = PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate())
        identity = parallelize_module(nn.Identity(), mesh, module)
        x = distribute_tensor(x_full, mesh, [Shard(0), Shard(1)])
        with CommDebugMode() as comm:
            out = identity(x)
        torch.testing.assert_close(out.full_tensor(), x_full)
        return out.placements, comm.get_total_counts()

    placements, collectives = run_threaded(run, 4)[0]
    assert placements == BATCH and collectives == 1  # one all_gather over tp; dp untouched


def test_sequence_parallel_lm_with_loss_parallel_matches_one_device() -> None:
    """Row-wise embedding, sequence-parallel norms, a Megatron block and a vocab-sharded head on (2, 2)."""
    reference = seeded_module(TinyLM(), seed=6, scale=0.5)
    tokens = seeded_randint(16, 4, 6, seed=7)
    targets = seeded_randint(16, 4, 6, seed=8)
    loss_ref = F.cross_entropy(reference(tokens).flatten(0, 1), targets.flatten())
    loss_ref.backward()

    def run() -> tuple[float, dict[str, int], dict[str, int]]:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = parallelize_module(copy.deepcopy(reference), mesh, tiny_lm_plan())
        inputs, labels = distribute_tensor(tokens, mesh, BATCH), distribute_tensor(targets, mesh, BATCH)
        with CommDebugMode() as forward:
            logits = model(inputs)
        assert logits.placements == (Shard(0), Shard(2))  # batch over dp, vocab over tp
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))
            with CommDebugMode() as backward:
                loss.backward()
        assert_same_grads(model, reference)
        return loss.full_tensor().item(), forward.get_comm_counts(), backward.get_comm_counts()

    loss, forward, backward = run_threaded(run, 4)[0]
    assert abs(loss - loss_ref.item()) < 1e-5
    # forward: embedding, attention out and MLP down reduce-scatter to sequence shards; q, MLP and head gather
    assert forward == {"reduce_scatter": 3, "all_gather": 3}
    assert backward == {"all_gather": 3, "reduce_scatter": 3}
