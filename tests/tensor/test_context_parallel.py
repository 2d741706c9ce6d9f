"""Context parallel: attention on query, key and value sharded along the sequence equals one device.

Each test computes attention (and its gradients) on one device, then on DTensors sharded along the
sequence, and compares. Tolerance: every output entry is a sum of at most ``S * D`` products of at
most four inputs (grad, v, q, k), which the sharded run adds in another order; in float64 each such
sum is off by at most ``S * D * eps * M**4`` where ``M`` bounds the inputs' magnitudes (the
softmax weights are at most 1, the scale at most 1). No timing is involved.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spmd.tensor import DTensor, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.attention.layout import gather_order, set_load_balanced
from spmd.tensor.debug import CommDebugMode, explicit_redistribution, set_verbose
from spmd.tensor.experimental import context_parallel
from spmd.tensor.experimental._attention import (
    _context_parallel_shard,
    _disable_context_parallel_dispatcher,
    _enable_context_parallel_dispatcher,
    _HeadTailLoadBalancer,
    _PTRRLoadBalancer,
    context_parallel_unshard,
    set_rotate_method,
)
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


# ----- torch's API: context_parallel on a module that knows nothing of DTensor -----------------------
class Attention(nn.Module):
    """Causal self-attention with grouped key/value heads, on plain tensors (batch, seq, dim)."""

    def __init__(self, dim: int = 16, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, dim, dtype=DTYPE)
        self.wkv = nn.Linear(dim, 2 * kv_heads * self.head_dim, dtype=DTYPE)
        self.wo = nn.Linear(dim, dim, dtype=DTYPE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.wkv(x).view(batch, seq, 2 * self.kv_heads, self.head_dim).transpose(1, 2).chunk(2, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


def module_under_context_parallel(
    cp: int, state: dict[str, torch.Tensor], whole_x: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """Rank body: the module's output (unsharded), this rank's parameter gradients, and the restored input."""
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    model = Attention()
    model.load_state_dict(state)
    x = whole_x.clone()
    with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):
        assert x.size(1) < whole_x.size(1)  # sharded in place
        out = model(x)
        out.pow(2).sum().backward()
        (whole,) = context_parallel_unshard(mesh, [out.detach()], [1])
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return whole, grads, x


@pytest.mark.parametrize("cp,seq", [(2, 16), (4, 16), (2, 13)])
def test_context_parallel_module_equals_one_device(cp: int, seq: int) -> None:
    torch.manual_seed(0)
    model = Attention()
    x = torch.randn(2, seq, 16, dtype=DTYPE)
    out = model(x)
    out.pow(2).sum().backward()
    results = run_threaded(module_under_context_parallel, cp, cp, model.state_dict(), x)
    # each rank's parameter gradients come from its rows; their sum is the one-device gradient. The
    # bound: sums of seq * dim products, through three linear maps and attention, in another order.
    tolerance = seq * 16 * torch.finfo(DTYPE).eps * max(1.0, float(out.detach().abs().max())) ** 4
    for whole, _, restored in results:
        assert torch.equal(restored, x)  # the buffer is whole again after the context
        torch.testing.assert_close(whole, out.detach(), atol=tolerance, rtol=0)
    for name, p in model.named_parameters():
        summed = sum(grads[name] for _, grads, _ in results)
        torch.testing.assert_close(summed, p.grad, atol=tolerance, rtol=0)


def shard_and_unshard(cp: int, seq: int) -> bool:
    mesh = init_device_mesh("cpu", (cp,))
    whole = torch.arange(3 * seq, dtype=DTYPE).view(3, seq)
    balancer = _HeadTailLoadBalancer(seq, cp, "cpu")
    (piece,) = _context_parallel_shard(mesh, [whole], [1], balancer)
    expected = torch.cat([whole[:, b.start : b.start + b.length] for b in _rows(seq, cp, mesh.get_local_rank())], 1)
    (back,) = context_parallel_unshard(mesh, [piece], [1], balancer)
    return torch.equal(piece, expected) and torch.equal(back, whole)


def _rows(seq: int, cp: int, rank: int) -> Any:
    from spmd.tensor.attention.layout import rank_rows

    return rank_rows(seq, cp, True)[rank]


@pytest.mark.parametrize("cp,seq", [(2, 8), (4, 16), (4, 13), (2, 5)])
def test_shard_is_head_tail_and_unshard_restores(cp: int, seq: int) -> None:
    assert all(run_threaded(shard_and_unshard, cp, cp, seq))


def test_head_tail_indices_are_torch_s_for_even_lengths() -> None:
    """rank i holds chunks i and 2cp-1-i of 2cp equal chunks."""
    indices = _HeadTailLoadBalancer(8, 2, "cpu")._generate_indices()
    assert indices.tolist() == [[0, 1, 6, 7, 2, 3, 4, 5]]
    restore = _HeadTailLoadBalancer(8, 2, "cpu")._generate_indices(restore=True)
    assert indices[0][restore[0]].tolist() == list(range(8))
    with pytest.raises(NotImplementedError, match="_PTRRLoadBalancer"):
        _PTRRLoadBalancer(None, 2)
    with pytest.raises(NotImplementedError, match="'allgather' or 'alltoall'"):
        set_rotate_method("ring")


def torchtitan_style(cp: int, seq: int) -> list[float]:
    """Rank body: torchtitan's SDPA path (shard with a head-tail balancer, turn on the dispatcher,
    wrap (batch, seq, heads, dim) pieces as Shard(1) DTensors around SDPA), in tolerance units."""
    mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
    q, k, v, grad = inputs(seq, 4, 2)
    expected = one_device(q, k, v, grad, causal=True)
    balancer = _HeadTailLoadBalancer(seq, cp, "cpu")
    pieces = _context_parallel_shard(mesh, [t.transpose(1, 2) for t in (q, k, v, grad)], [1] * 4, balancer)
    leaves = [p.clone().requires_grad_(True) for p in pieces[:3]]
    _enable_context_parallel_dispatcher()
    try:
        q_d, k_d, v_d = (DTensor.from_local(t, mesh, [Shard(1)], run_check=False).transpose(1, 2) for t in leaves)
        out = F.scaled_dot_product_attention(q_d, k_d, v_d, is_causal=True, enable_gqa=True).transpose(1, 2).to_local()
        out.backward(pieces[3])
    finally:
        _disable_context_parallel_dispatcher()
    got = [out.detach(), *(t.grad for t in leaves)]
    whole = context_parallel_unshard(mesh, got, [1] * 4, balancer)  # type: ignore[arg-type]
    tolerance = reorder_tolerance(seq, 8, q, k, v, grad)
    return [float((w.transpose(1, 2) - e).abs().max()) / tolerance for w, e in zip(whole, expected)]


@pytest.mark.parametrize("cp", [2, 4])
def test_torchtitan_sdpa_path_equals_one_device(cp: int) -> None:
    for rank_errors in run_threaded(torchtitan_style, cp, cp, 16):
        assert max(rank_errors) <= 1.0, rank_errors


# ----- composition and debugging ----------------------------------------------------------------------
def dp_cp_tp(seq: int) -> list[float]:
    """Rank body on a (dp=2, cp=2, tp=2) mesh: batch over dp, head-tail sequence over cp, heads over tp."""
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
    q, k, v, grad = inputs(seq, 4, 2)
    expected = one_device(q, k, v, grad, causal=True)
    order = gather_order(seq, 2, True)

    def shard(t: torch.Tensor) -> DTensor:
        return distribute_tensor(t.index_select(2, order), mesh, [Shard(0), Shard(2), Shard(1)])

    dq, dk, dv = (shard(t).requires_grad_(True) for t in (q, k, v))
    _enable_context_parallel_dispatcher()
    try:
        out = F.scaled_dot_product_attention(dq, dk, dv, is_causal=True, enable_gqa=True)
        out.backward(shard(grad))
    finally:
        _disable_context_parallel_dispatcher()
    assert out.placements == (Shard(0), Shard(2), Shard(1))
    restore = torch.argsort(order)
    tolerance = reorder_tolerance(seq, 8, q, k, v, grad)
    got = [out.detach(), dq.grad, dk.grad, dv.grad]
    return [float((g.full_tensor().index_select(2, restore) - e).abs().max()) / tolerance for g, e in zip(got, expected)]


def test_dp_cp_tp_mesh_equals_one_device() -> None:
    for rank_errors in run_threaded(dp_cp_tp, 8, 12):
        assert max(rank_errors) <= 1.0, rank_errors


def explicit_step(cp: int) -> tuple[dict[str, int], dict[str, int]]:
    """Rank body: a CP attention step inside explicit_redistribution(); the collectives of forward and backward."""
    mesh = init_device_mesh("cpu", (cp,))
    q, k, v, grad = (distribute_tensor(t, mesh, [Shard(2)]) for t in inputs(16, 4, 2))
    for t in (q, k, v):
        t.requires_grad_(True)
    with explicit_redistribution():
        with CommDebugMode() as forward:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        with CommDebugMode() as backward:
            out.backward(grad)
    return dict(forward.get_comm_counts()), dict(backward.get_comm_counts())


def test_explicit_redistribution_accepts_a_cp_step() -> None:
    """No implicit move: one all-gather of k, v forward; one more and a reduce-scatter of dk, dv backward."""
    for forward, backward in run_threaded(explicit_step, 2, 2):
        assert {str(k): n for k, n in forward.items() if n} == {"all_gather": 1}
        assert {str(k): n for k, n in backward.items() if n} == {"all_gather": 1, "reduce_scatter": 1}


def test_verbose_says_what_moves_and_why(caplog: pytest.LogCaptureFixture) -> None:
    set_verbose(True)
    try:
        with caplog.at_level(logging.INFO, logger="spmd.tensor"):
            run_threaded(sharded_attention, 2, 2, 16, 4, 2, True, True)
    finally:
        set_verbose(False)
    lines = [r.getMessage() for r in caplog.records if "context parallel over mesh dim" in r.getMessage()]
    assert len(lines) == 2  # rank 0's forward and backward
    assert "head-tail" in lines[0] and "ring lower bound" in lines[0] and "all-gather k, v" in lines[0]
    assert "reduce-scatter dk, dv" in lines[1]
