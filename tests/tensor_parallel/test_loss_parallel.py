"""Vocab-parallel cross-entropy equals F.cross_entropy, forward and gradient, without gathering the logits."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spmd.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.tensor_parallel import ColwiseParallel, loss_parallel, parallelize_module, vocab_parallel_cross_entropy
from spmd.testing import DTensorTestBase, seeded_module, seeded_randint, seeded_randn, with_comms


def randn(*shape: int, seed: int) -> torch.Tensor:
    return seeded_randn(*shape, seed=seed, dtype=torch.float64) * 3


def targets(shape: tuple[int, ...], num_classes: int, *, seed: int, ignore_index: int | None) -> torch.Tensor:
    t = seeded_randint(num_classes, *shape, seed=seed)
    if ignore_index is not None:
        t.view(-1)[::3] = ignore_index
    return t


def class_weight(num_classes: int) -> torch.Tensor:
    return torch.linspace(0.5, 2.0, num_classes, dtype=torch.float64)


class VocabParallelCrossEntropyTest(DTensorTestBase):
    def check_1d(self, num_classes: int, reduction: str, weighted: bool, ignore_index, label_smoothing: float) -> None:
        mesh = init_device_mesh("cpu", (4,))
        logits_full = randn(6, num_classes, seed=num_classes)
        target = targets((6,), num_classes, seed=1, ignore_index=ignore_index)
        options = {
            "weight": class_weight(num_classes) if weighted else None,
            "reduction": reduction,
            "label_smoothing": label_smoothing,
            **({"ignore_index": ignore_index} if ignore_index is not None else {}),
        }
        logits = distribute_tensor(logits_full, mesh, [Shard(1)]).requires_grad_()
        logits_ref = logits_full.clone().requires_grad_()
        with CommDebugMode() as forward:
            loss = vocab_parallel_cross_entropy(logits, target, **options)
        # max and (sum of exp, target logit) -- never an all_gather of the logits
        assert forward.get_comm_counts() == {"all_reduce": 2}
        expected = F.cross_entropy(logits_ref, target, **options)
        assert loss.placements == (Replicate(),)
        torch.testing.assert_close(loss.full_tensor(), expected)
        grad_weight = randn(*expected.shape, seed=7)
        with CommDebugMode() as backward:
            (loss.to_local() * grad_weight).sum().backward()
        assert backward.get_comm_counts() == {}
        (expected * grad_weight).sum().backward()
        assert logits.grad.placements == (Shard(1),)
        torch.testing.assert_close(logits.grad.full_tensor(), logits_ref.grad)

    @with_comms
    def test_matches_cross_entropy(self) -> None:
        # 10 classes over 4 ranks: 3, 3, 3, 1; 3 classes: 1, 1, 1, 0 (one rank holds none)
        self.run_subtests(
            {"num_classes": [12, 10, 3], "reduction": ["mean", "sum", "none"], "weighted": [False, True],
             "ignore_index": [None, 2], "label_smoothing": [0.0, 0.2]},
            self.check_1d,
        )

    def check_batch_sharded(self, shape: tuple[int, ...], reduction: str, weighted: bool) -> None:
        """(2, 2) mesh: dp shards the batch, tp the classes; the loss is the whole batch's."""
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        num_classes = shape[1]
        logits_full = randn(*shape, seed=3)
        target_full = targets((shape[0], *shape[2:]), num_classes, seed=4, ignore_index=-100)
        options = {"weight": class_weight(num_classes) if weighted else None, "reduction": reduction,
                   "label_smoothing": 0.1}
        logits = distribute_tensor(logits_full, mesh, [Shard(0), Shard(1)]).requires_grad_()
        target = distribute_tensor(target_full, mesh, [Shard(0), Replicate()])
        logits_ref = logits_full.clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(logits, target, **options)
        expected = F.cross_entropy(logits_ref, target_full, **options)
        want = (Shard(0), Replicate()) if reduction == "none" else (Partial(), Replicate())
        assert loss.placements == want
        torch.testing.assert_close(loss.full_tensor(), expected)
        grad_weight = randn(*expected.shape, seed=7)
        (loss.full_tensor() * grad_weight).sum().backward()
        (expected * grad_weight).sum().backward()
        torch.testing.assert_close(logits.grad.full_tensor(), logits_ref.grad)

    @with_comms
    def test_batch_sharded_on_a_2d_mesh(self) -> None:
        # 5 samples over 2 dp ranks: 3 and 2; the (N, C, d) case has a spatial dim
        self.run_subtests(
            {"shape": [(5, 7), (4, 6, 3)], "reduction": ["mean", "sum", "none"], "weighted": [False, True]},
            self.check_batch_sharded,
        )

    @with_comms
    def test_errors(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        target = torch.tensor([0, 1, 2, 3])
        replicated = distribute_tensor(randn(4, 8, seed=1), mesh, [Replicate()])
        with pytest.raises(ValueError, match="sharded on the class dim"):
            vocab_parallel_cross_entropy(replicated, target)
        sharded = distribute_tensor(randn(4, 8, seed=1), mesh, [Shard(1)])
        with pytest.raises(IndexError, match="target 8 is out of range for 8 classes"):
            vocab_parallel_cross_entropy(sharded, torch.tensor([0, 1, 2, 8]))
        with pytest.raises(TypeError, match="class-index targets"):
            vocab_parallel_cross_entropy(sharded, torch.zeros(4, 8))
        with pytest.raises(ValueError, match="does not match"):
            vocab_parallel_cross_entropy(sharded, torch.tensor([0, 1]))
        mesh_2d = init_device_mesh("cpu", (2, 2))
        batch_sharded = distribute_tensor(randn(4, 8, seed=1), mesh_2d, [Shard(0), Shard(1)])
        with pytest.raises(ValueError, match="pass it as a DTensor"):
            vocab_parallel_cross_entropy(batch_sharded, target)


class LossParallelContextTest(DTensorTestBase):
    @with_comms
    def test_cross_entropy_inside_the_context(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        logits_full, target = randn(6, 10, seed=1), targets((6,), 10, seed=2, ignore_index=None)
        for loss_fn in (F.cross_entropy, nn.CrossEntropyLoss(label_smoothing=0.1)):
            logits = distribute_tensor(logits_full, mesh, [Shard(1)]).requires_grad_()
            logits_ref = logits_full.clone().requires_grad_()
            with loss_parallel(), CommDebugMode() as comm:
                loss = loss_fn(logits, target)
            assert comm.get_comm_counts() == {"all_reduce": 2}
            expected = loss_fn(logits_ref, target)
            torch.testing.assert_close(loss.full_tensor(), expected)
            loss.full_tensor().backward()  # backward need not run inside the context
            expected.backward()
            torch.testing.assert_close(logits.grad.full_tensor(), logits_ref.grad)

    @with_comms
    def test_other_calls_run_as_usual(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        logits_full, target = randn(6, 10, seed=1), targets((6,), 10, seed=2, ignore_index=None)
        with loss_parallel():
            plain = F.cross_entropy(logits_full, target)
            replicated = F.cross_entropy(
                distribute_tensor(logits_full, mesh, [Replicate()]), distribute_tensor(target, mesh, [Replicate()])
            )
        expected = F.cross_entropy(logits_full, target)
        torch.testing.assert_close(plain, expected)
        torch.testing.assert_close(replicated.full_tensor(), expected)
        outside = distribute_tensor(logits_full, mesh, [Shard(1)])
        with CommDebugMode() as comm:
            F.cross_entropy(outside, distribute_tensor(target, mesh, [Replicate()]))
        assert "all_gather" in comm.get_comm_counts()  # without the context the logits are gathered

    @with_comms
    def test_colwise_lm_head_then_loss(self) -> None:
        """The usual pairing: a Colwise head keeps the logits vocab-sharded for the loss."""
        mesh = init_device_mesh("cpu", (4,))
        reference = seeded_module(nn.Linear(8, 16), seed=1)
        head = parallelize_module(copy.deepcopy(reference), mesh, ColwiseParallel(use_local_output=False))
        hidden = seeded_randn(2, 3, 8, seed=2)
        target = seeded_randint(16, 6, seed=3)
        with loss_parallel(), CommDebugMode() as comm:
            logits = head(hidden)
            assert isinstance(logits, DTensor) and logits.placements == (Shard(2),)
            loss = F.cross_entropy(logits.view(6, 16), target)
            loss.backward()
        assert comm.get_comm_counts() == {"all_reduce": 2}  # both in the loss; the backward needs none
        expected = F.cross_entropy(reference(hidden).view(6, 16), target)
        expected.backward()
        torch.testing.assert_close(loss.full_tensor(), expected)
        torch.testing.assert_close(head.weight.grad.full_tensor(), reference.weight.grad)
        torch.testing.assert_close(head.bias.grad.full_tensor(), reference.bias.grad)
