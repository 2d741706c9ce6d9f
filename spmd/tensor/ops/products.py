"""More products and distances, and the linalg functions not in matrix.py; the same einsum algebra.

addr (self, u, v):       "m,n->mn" with a bias: S(0) x S(0) x R -> S(0); R x R x P -> P ...
addbmm (self, b1, b2):   "bmk,bkn->mn": b and k contracted -> P(sum); bias follows the output
vdot (a, b):             "k,k->": S(0) x S(0) -> P(sum) (conj(a) is linear over real weights)
linalg_cross (a, b, dim): pointwise off dim (broadcast like add); the dim itself (3) is whole;
                         bilinear: P x R -> P, R x P -> P
trace (A):               S(0) or S(1) -> P(sum): each rank adds the piece of the diagonal it
                         holds (a ``local_impl`` shifts the diagonal by its row and column offsets)
dist (a, b, p):          runs as vector_norm(a - b, p), whose rule keeps shards
_pdist_forward, _pdist_backward: R -> R (every pair of rows)
_cdist_forward (x1 (*, P, M), x2 (*, R, M)):  batch S(b) x S(b) -> S(b); S(P) x R -> S(-2);
                         R x S(R) -> S(-1); backward: grad_x1 S(b), S(-2), or P(sum) (x2 rows
                         sharded); grad P -> P
linalg: cholesky, cholesky_inverse, matrix_exp, eig, lu, ldl_factor, householder_product:
                         S(b) for a batch dim b on every operand -> S(b) on every output;
                         cholesky_solve, triangular_solve, ldl_solve, ormqr are linear in their
                         right-hand side: its P with the factors R -> P (other outputs R)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from spmd.tensor.ops.common import LINEAR_PARTIALS, R, normalize_dim, pointwise_candidates
from spmd.tensor.ops.matrix import batch_candidates, contraction_candidates, with_bias
from spmd.tensor.placement import Partial, Shard
from spmd.tensor.sharding.registry import register_rule
from spmd.tensor.sharding.vocabulary import Expansion, OpCall, OpStrategy
from spmd.tensor.spec import DTensorSpec, local_shape_and_offset

aten = torch.ops.aten
SUM = Partial("sum")


@register_rule(aten.addr.default, aten.addr_.default)
def addr_rule(call: OpCall) -> Sequence[OpStrategy]:
    """addr: outer product "m,n->mn" plus a bias that follows the output."""
    return with_bias(call, contraction_candidates(("m", "n"), "mn"))


@register_rule(aten.addbmm.default, aten.addbmm_.default)
def addbmm_rule(call: OpCall) -> Sequence[OpStrategy]:
    """addbmm: "bmk,bkn->mn" (b and k contracted -> P(sum)) plus a bias that follows the output."""
    return with_bias(call, contraction_candidates(("bmk", "bkn"), "mn"))


@register_rule(aten.vdot.default)
def vdot_rule(call: OpCall) -> Sequence[OpStrategy]:
    """vdot: S(0) x S(0) -> P(sum); P x R -> P; R x P -> P."""
    return contraction_candidates(("k", "k"), "")


@register_rule(aten.linalg_cross.default)
def cross_rule(call: OpCall) -> Sequence[OpStrategy]:
    """cross(a, b, dim): pointwise S(d) -> S(d) for d != dim; P x R -> P; R x P -> P."""
    meta = call.output_metas[0]
    assert meta is not None
    dim = normalize_dim(int(call.arg(2, "dim", -1)), len(meta.shape))
    candidates = [c for c in pointwise_candidates(call) if c.outputs[0] != Shard(dim)]
    candidates += [OpStrategy((p, R), (p,)) for p in LINEAR_PARTIALS]
    return candidates + [OpStrategy((R, p), (p,)) for p in LINEAR_PARTIALS]


@register_rule(aten._trilinear.default)
def trilinear_rule(call: OpCall) -> Sequence[OpStrategy]:
    """_trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim): the einsum it stands for."""
    expands = [{int(d) for d in call.arg(3 + k, f"expand{k + 1}")} for k in range(3)]
    summed = {int(d) for d in call.arg(6, "sumdim")}
    ndim = call.input_specs[0].ndim + len(expands[0])
    letters = "abcdefghijklmnopqrstuvwxyz"[:ndim]
    inputs = tuple("".join(c for d, c in enumerate(letters) if d not in expand) for expand in expands)
    output = "".join(c for d, c in enumerate(letters) if d not in summed)
    return contraction_candidates(inputs, output)


# ----- trace ---------------------------------------------------------------------------------------
def _local_trace(
    op: Any, args: list[Any], kwargs: dict[str, Any], inputs: tuple[DTensorSpec, ...], outputs: tuple[Any, ...]
) -> torch.Tensor:
    """The sum of the global diagonal's elements that fall in this rank's block: local (i, j) is
    global (i + row offset, j + column offset), on the diagonal where j - i = row - column offset."""
    spec = inputs[0]
    _, offset = local_shape_and_offset(spec.shape, spec.mesh, spec.placements)
    return torch.diagonal(args[0], offset[0] - offset[1]).sum()


@register_rule(aten.trace.default, local_impl=_local_trace)
def trace_rule(call: OpCall) -> Sequence[OpStrategy]:
    """trace: S(0) -> P(sum); S(1) -> P(sum) (each rank's piece of the diagonal); R -> R; P(sum|avg) -> P."""
    candidates = [OpStrategy((R,), (R,)), OpStrategy((Shard(0),), (SUM,)), OpStrategy((Shard(1),), (SUM,))]
    return candidates + [OpStrategy((p,), (p,)) for p in LINEAR_PARTIALS]


# ----- distances -----------------------------------------------------------------------------------
def _dist_as_norm(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    p = args[2] if len(args) > 2 else kwargs.get("p", 2)
    return aten.linalg_vector_norm.default(aten.sub.Tensor(args[0], args[1]), p)


def dist_decomposition(call: OpCall) -> Expansion | None:
    """dist is the vector norm of the difference; the norm's rule keeps shards (power sums for finite p)."""
    return _dist_as_norm


@register_rule(aten.dist.default, decompose=dist_decomposition)
def dist_rule(call: OpCall) -> Sequence[OpStrategy]:
    """dist(a, b, p): R x R -> R (every call runs as vector_norm(a - b, p) instead)."""
    return [OpStrategy((R, R), (R,))]


@register_rule(aten._cdist_forward.default)
def cdist_rule(call: OpCall) -> Sequence[OpStrategy]:
    """cdist(x1 (*, P, M), x2 (*, R, M)) -> (*, P, R): batch S(b) on both -> S(b); x1 rows S(-2) -> S(-2);
    x2 rows S(-2) -> S(-1); the feature dim M is whole."""
    x1, x2 = call.input_specs
    candidates = [OpStrategy((R, R), (R,))]
    candidates += [
        OpStrategy((Shard(b), Shard(b)), (Shard(b),)) for b in range(x1.ndim - 2) if x1.shape[b] == x2.shape[b]
    ]
    rows = x1.ndim - 2
    candidates += [OpStrategy((Shard(rows), R), (Shard(rows),)), OpStrategy((R, Shard(rows)), (Shard(rows + 1),))]
    return candidates


@register_rule(aten._cdist_backward.default)
def cdist_backward_rule(call: OpCall) -> Sequence[OpStrategy]:
    """(grad, x1, x2, cdist) -> grad_x1: batch S(b) on all -> S(b); x1 rows S(-2) (grad, cdist S(-2), x2 R)
    -> S(-2); x2 rows S(-2) (grad, cdist S(-1), x1 R) -> P(sum); grad P, the rest R -> P."""
    grad, x1, x2, _ = call.input_specs
    rows = x1.ndim - 2
    candidates = [OpStrategy((R, R, R, R), (R,))]
    candidates += [
        OpStrategy((Shard(b),) * 4, (Shard(b),)) for b in range(rows) if x1.shape[b] == x2.shape[b] == grad.shape[b]
    ]
    candidates.append(OpStrategy((Shard(rows), Shard(rows), R, Shard(rows)), (Shard(rows),)))
    candidates.append(OpStrategy((Shard(rows + 1), R, Shard(rows), Shard(rows + 1)), (SUM,)))
    return candidates


@register_rule(aten._pdist_forward.default, aten._pdist_backward.default)
def pdist_rule(call: OpCall) -> Sequence[OpStrategy]:
    """pdist (N, M) -> the N(N-1)/2 pairwise distances (and its backward): R -> R; every pair of rows
    is needed, and the features of a pair combine non-linearly for most p."""
    return [OpStrategy((R,) * len(call.input_specs), (R,))]


# ----- linalg: batch dims shard, matrix dims stay whole ---------------------------------------------
@register_rule(
    aten.cholesky.default,
    aten.cholesky_inverse.default,
    aten.linalg_matrix_exp.default,
    aten.linalg_eig.default,
    aten.linalg_lu.default,
    aten.linalg_ldl_factor_ex.default,
    aten.linalg_householder_product.default,
)
def batched_matrix_rule(call: OpCall) -> Sequence[OpStrategy]:
    """f(A (*, m, n), ...): S(b) on every operand -> S(b) on every output for a batch dim b."""
    return batch_candidates(call, call.input_specs[0].ndim - 2)


@register_rule(
    aten.cholesky_solve.default,
    aten.triangular_solve.default,
    aten.linalg_ldl_solve.default,
    aten.ormqr.default,
)
def batched_solve_rule(call: OpCall) -> Sequence[OpStrategy]:
    """solve-like f(..., B): S(b) on all -> S(b) for equal batch dims; B P, the factors R -> P (the
    result is linear in B; any other output, like triangular_solve's copy of A, is R)."""
    specs = call.input_specs
    rhs_index = 0 if call.op in (aten.cholesky_solve.default, aten.triangular_solve.default) else len(specs) - 1
    matrix = specs[1] if rhs_index == 0 else specs[0]
    batch_ndim = matrix.ndim - 2
    candidates = batch_candidates(call, batch_ndim, specs[rhs_index].ndim == matrix.ndim)
    n_out = len(call.output_metas)
    for p in LINEAR_PARTIALS:
        inputs = tuple(p if i == rhs_index else R for i in range(len(specs)))
        candidates.append(OpStrategy(inputs, (p,) + (R,) * (n_out - 1)))
    return candidates
