"""Context parallel: attention on query, key and value sharded along the sequence equals one device.

Each test computes attention (and its gradients) on one device, then on DTensors sharded along the
sequence, and compares. Tolerance: every output entry is a sum of at most ``S * D`` products of at
most four inputs (grad, v, q, k), which the sharded run adds in another order; in float64 each such
sum is off by at most ``S * D * eps * M**4`` where ``M`` bounds the inputs' magnitudes (the
softmax weights are at most 1, the scale at most 1). No timing is involved.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from spmd.tensor import DTensor, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.attention.layout import gather_order, set_load_balanced
from spmd.testing import run_threaded

DTYPE = torch.float64


def reorder_tolerance(seq: int, head_dim: int, *tensors: torch.Tensor) -> float:
    """The bound on a sum of ``seq * head_dim`` products of four inputs taken in another order."""
    magnitude = max(1.0, *(float(t.abs().max()) for t in tensors))
    return seq * head_dim * torch.finfo(DTYPE).eps * magnitude**4


def one_device(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, causal: bool) -> list[torch.Tensor]:
    """out, dq, dk, dv of attention on whole tensors."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=q.size(1) != k.size(1))
    out.backward(grad)
    return [out.detach()] + [t.grad for t in leaves]  # type: ignore[misc]


def inputs(seq: int, q_heads: int, kv_heads: int, head_dim: int = 8) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seq * 100 + q_heads * 10 + kv_heads)
    shapes = [(2, q_heads, seq, head_dim), (2, kv_heads, seq, head_dim), (2, kv_heads, seq, head_dim)]
    q, k, v = (torch.randn(s, generator=generator, dtype=DTYPE) for s in shapes)
    grad = torch.randn(2, q_heads, seq, head_dim, generator=generator, dtype=DTYPE)
    return [q, k, v, grad]


def sharded_attention(cp: int, seq: int, q_heads: int, kv_heads: int, causal: bool, balanced: bool) -> list[float]:
    """Rank body: attention on sequence-sharded DTensors (laid out head-tail when ``balanced``), each
    result's largest difference from one device, in units of the tolerance."""
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    q, k, v, grad = inputs(seq, q_heads, kv_heads)
    expected = one_device(q, k, v, grad, causal)
    order = gather_order(seq, cp, balanced)  # the rows in the order the ranks hold them

    def shard(t: torch.Tensor) -> DTensor:
        return distribute_tensor(t.index_select(2, order), mesh, [Shard(2)])

    dq, dk, dv = (shard(t).requires_grad_(True) for t in (q, k, v))
    set_load_balanced(balanced)
    try:
        out = F.scaled_dot_product_attention(dq, dk, dv, is_causal=causal, enable_gqa=q_heads != kv_heads)
        out.backward(shard(grad))
    finally:
        set_load_balanced(False)
    assert out.placements == (Shard(2),)
    restore = torch.argsort(order)
    got = [out, dq.grad, dk.grad, dv.grad]
    tolerance = reorder_tolerance(seq, q.size(-1), q, k, v, grad)
    return [float((g.detach().full_tensor().index_select(2, restore) - e).abs().max()) / tolerance for g, e in zip(got, expected)]


CASES = {
    "noncausal-cp2": (2, 16, 4, 4, False, False),
    "causal-cp2": (2, 16, 4, 4, True, False),
    "causal-headtail-cp2": (2, 16, 4, 4, True, True),
    "causal-gqa-headtail-cp4": (4, 16, 4, 2, True, True),
    "noncausal-gqa-cp4": (4, 16, 4, 2, False, False),
    "causal-uneven-cp4": (4, 13, 2, 2, True, False),
    "causal-uneven-headtail-cp4": (4, 13, 4, 2, True, True),
    "causal-uneven-headtail-cp2": (2, 11, 2, 2, True, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sequence_sharded_attention_equals_one_device(case: str) -> None:
    cp, *rest = CASES[case]
    for rank_errors in run_threaded(sharded_attention, cp, cp, *rest):
        assert max(rank_errors) <= 1.0, rank_errors


@pytest.mark.multiprocess
def test_sequence_sharded_attention_on_gloo(world: Any) -> None:
    if world.name != "gloo":
        pytest.skip("the thread runs are the parametrised test above")
    for rank_errors in world(sharded_attention, 2, 2, 11, 4, 2, True, True):
        assert max(rank_errors) <= 1.0, rank_errors


def test_tolerance_is_tight_enough_to_catch_a_wrong_mask() -> None:
    """The bound is far below the error of attending one key too many (the test can fail)."""
    q, k, v, grad = inputs(16, 2, 2)
    right = one_device(q, k, v, grad, causal=True)[0]
    wrong = one_device(q, k, v, grad, causal=False)[0]
    assert float((right - wrong).abs().max()) > 1e6 * reorder_tolerance(16, 8, q, k, v, grad)
    assert math.isfinite(reorder_tolerance(16, 8, q, k, v, grad))
