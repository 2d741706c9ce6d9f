"""Matrix products, attention, and the transposes their backward passes use.

Products are written as einsum signatures; each index letter gives one candidate per mesh dim:
  a letter the output keeps:   shard it wherever it occurs -> S(its output dim)
  a contracted letter:         shard it on every operand   -> P(sum)
  plus R x ... x R -> R, and one operand P(sum|avg) with the others R -> the same P.
  mm "mk,kn->mn":  S(0) x R -> S(0);  R x S(1) -> S(1);  S(1) x S(0) -> P(sum)
  bmm "bmk,bkn->bmn", mv "mk,k->m", dot "k,k->"
  linear "...k,nk->...n" (inference mode reaches it whole): the product's candidates, bias as addmm's
  addmm / addmv / baddbmm:  the product's candidates; bias follows the output (broadcast dims R,
       P output -> P bias, so the bias is added once)
  attention (q, k, v):  batch/heads S(d) on all -> S(d) (grouped kv heads only if they split
       evenly);  q S(L), k, v R -> S(L) without a causal mask;  v P -> out P;  each shard only
       where no rank's piece would be empty;  backward: the same, dk and dv P(sum) for q S(L);
       q, k, v S(L) -> out, lse S(L), causal too (context parallel: spmd/tensor/attention/ring.py)
  t / transpose(a, b):  S(a) -> S(b), S(b) -> S(a), other placements unchanged
  linalg (det, slogdet, inv, solve, lu_factor, lu_solve, svd, eigh, cholesky, qr), A (*, m, n):
       S(b) for a batch dim b on every operand -> S(b) on every output (pivots, info and singular
       values keep the leading batch dims too); the two matrix dims must be whole; solve and lu_solve
       are linear in B: A R, B P -> result P; the error check gathers the small info tensor so
       every rank raises together.  Matrix norms reach us as vector norms (frobenius: both
       dims, which the vector norm rule keeps sharded), sums and amax (ord 1, inf) or svd (nuc, 2).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch

from spmd.tensor.attention.ring import ring_backward_local, ring_forward_local
from spmd.tensor.ops.common import LINEAR_PARTIALS, PARTIALS, R, normalize_dim, surviving_shards
from spmd.tensor.placement import Partial, Placement, Shard, shard_sizes
from spmd.tensor.sharding.registry import register_rule
from spmd.tensor.sharding.vocabulary import OpCall, OpStrategy
from spmd.tensor.spec import DTensorSpec

aten = torch.ops.aten
SUM = Partial("sum")


def contraction_candidates(inputs: Sequence[str], output: str) -> list[OpStrategy]:
    """Candidates of a product given as einsum letters, e.g. ``(("bmk", "bkn"), "bmn")`` for bmm."""
    letters = list(dict.fromkeys(output + "".join(inputs)))
    candidates = [OpStrategy((R,) * len(inputs), (R,))]
    for letter in letters:
        placements = tuple(Shard(s.index(letter)) if letter in s else R for s in inputs)
        out: Placement = Shard(output.index(letter)) if letter in output else SUM
        candidates.append(OpStrategy(placements, (out,)))
    candidates += [
        OpStrategy(tuple(p if j == i else R for j in range(len(inputs))), (p,))
        for i in range(len(inputs))
        for p in LINEAR_PARTIALS
    ]
    return candidates


def broadcast_placement(shape: Sequence[int], out_shape: Sequence[int], out: Placement) -> Placement:
    """The placement an operand broadcast to ``out_shape`` needs so the op matches output ``out``.

    Shard(d) of the output becomes Shard of the matching operand dim, or R where the operand is
    broadcast along d; a partial output needs the operand partial too (added once, not per rank).
    """
    if isinstance(out, Shard):
        in_dim = out.dim - (len(out_shape) - len(shape))
        if in_dim < 0 or (shape[in_dim] == 1 and out_shape[out.dim] != 1):
            return R
        return Shard(in_dim)
    return out


def with_bias(call: OpCall, product: list[OpStrategy]) -> list[OpStrategy]:
    """``bias + product``: prefix each product candidate with the bias placement it needs."""
    bias = call.args[0]
    meta = call.output_metas[0]
    assert meta is not None
    if not isinstance(bias, DTensorSpec):  # a scalar bias cannot follow a partial output
        return [c for c in product if not isinstance(c.outputs[0], Partial)]
    out_shape = meta.shape
    candidates = []
    for c in product:
        out = c.outputs[0]
        assert out is not None
        candidates.append(OpStrategy((broadcast_placement(bias.shape, out_shape, out), *c.inputs), c.outputs))
    return candidates


@register_rule(aten.mm.default)
def mm_rule(call: OpCall) -> Sequence[OpStrategy]:
    """mm: S(0) x R -> S(0); R x S(1) -> S(1); S(1) x S(0) -> P(sum); P x R -> P; R x P -> P."""
    return contraction_candidates(("mk", "kn"), "mn")


@register_rule(aten.bmm.default)
def bmm_rule(call: OpCall) -> Sequence[OpStrategy]:
    """bmm: S(0) x S(0) -> S(0); S(1) x R -> S(1); R x S(2) -> S(2); S(2) x S(1) -> P(sum); P x R -> P."""
    return contraction_candidates(("bmk", "bkn"), "bmn")


@register_rule(aten.mv.default)
def mv_rule(call: OpCall) -> Sequence[OpStrategy]:
    """mv: S(0) x R -> S(0); S(1) x S(0) -> P(sum); P x R -> P; R x P -> P."""
    return contraction_candidates(("mk", "k"), "m")


@register_rule(aten.dot.default)
def dot_rule(call: OpCall) -> Sequence[OpStrategy]:
    """dot: S(0) x S(0) -> P(sum); P x R -> P; R x P -> P."""
    return contraction_candidates(("k", "k"), "")


@register_rule(aten.addmm.default, aten.addmm_.default)
def addmm_rule(call: OpCall) -> Sequence[OpStrategy]:
    """addmm: mm's candidates; bias S(0) for output S(1) (1-d bias), R where broadcast, P for P."""
    return with_bias(call, contraction_candidates(("mk", "kn"), "mn"))


@register_rule(aten.addmv.default, aten.addmv_.default)
def addmv_rule(call: OpCall) -> Sequence[OpStrategy]:
    """addmv: mv's candidates; bias S(0) for output S(0), P for P."""
    return with_bias(call, contraction_candidates(("mk", "k"), "m"))


@register_rule(aten.baddbmm.default, aten.baddbmm_.default)
def baddbmm_rule(call: OpCall) -> Sequence[OpStrategy]:
    """baddbmm: bmm's candidates; bias follows the output (R where broadcast, P for P)."""
    return with_bias(call, contraction_candidates(("bmk", "bkn"), "bmn"))


@register_rule(aten.linear.default)
def linear_rule(call: OpCall) -> Sequence[OpStrategy]:
    """linear(x (*, k), w (n, k), b (n)): x S(batch) -> S(batch); w S(0) -> S(last); x S(-1) x w S(1)
    -> P(sum); a P operand with the others R -> P; the bias follows the output (P for P: added once)."""
    x, w = call.input_specs[:2]
    batch = "abcdefghij"[: x.ndim - 1]
    out_letter = "n" if w.ndim == 2 else ""
    product = contraction_candidates((batch + "k", out_letter + "k"), batch + out_letter)
    if len(call.input_specs) == 2:  # no bias, or a plain 0-d one every rank adds (not to a partial)
        bias = call.arg(2, "bias")
        return product if bias is None else [c for c in product if not isinstance(c.outputs[0], Partial)]
    meta = call.output_metas[0]
    assert meta is not None
    bias_shape = call.input_specs[2].shape
    candidates = []
    for c in product:
        out = c.outputs[0]
        assert out is not None
        candidates.append(OpStrategy((*c.inputs, broadcast_placement(bias_shape, meta.shape, out)), c.outputs))
    return candidates


# ----- attention -----------------------------------------------------------------------------------
def no_empty_shards(size: int, mesh_shape: Sequence[int]) -> bool:
    """True if cutting ``size`` by any subset of the mesh dims (in order) leaves every rank a piece.

    The CPU flash-attention kernels crash (SIGFPE) on a zero-length heads or sequence dim, and
    torch.chunk leaves trailing ranks empty (6 over 4 -> 2, 2, 2, 0).
    """
    for subset in itertools.product([False, True], repeat=len(mesh_shape)):
        pieces = [size]
        for used, n in zip(subset, mesh_shape):
            if used:
                pieces = [s for piece in pieces for s in shard_sizes(piece, n)]
        if min(pieces) == 0:
            return False
    return True


def _grouped_heads_split_evenly(q_heads: int, k_heads: int, v_heads: int, mesh_shape: Sequence[int]) -> bool:
    """Grouped-query attention (q head h reads kv head h // group) survives a heads split that is
    even for the kv heads: every rank then holds whole groups, in order.
    """
    return k_heads == v_heads and q_heads % k_heads == 0 and k_heads % math.prod(mesh_shape) == 0


def _attention_candidates(
    call: OpCall, specs: Sequence[DTensorSpec], mask: DTensorSpec | None, *, backward: bool
) -> list[OpStrategy]:
    """Shared by the forward ``(q, k, v[, mask]) -> (out, lse)`` and the backward
    ``(grad, q, k, v, out, lse[, mask]) -> (grad_q, grad_k, grad_v)``.
    """
    dropout_p = float(call.arg(6 if backward else 3, "dropout_p", 0.0))
    if dropout_p != 0.0:
        raise NotImplementedError(
            f"{call.op} with dropout_p={dropout_p} draws random numbers, which DTensor does not support "
            "yet; use dropout_p=0.0 (e.g. call the model in eval mode)"
        )
    is_causal = bool(call.arg(7 if backward else 4, "is_causal", False))
    q, k, v = specs[1:4] if backward else specs[:3]
    ndim = q.ndim
    n_out = 3 if backward else 2
    score_shape = (*q.shape[:-1], k.shape[-2])

    def one(per_input: Sequence[Placement], outs: Sequence[Placement], mask_as: Placement) -> OpStrategy:
        ins = tuple(per_input) + ((broadcast_placement(mask.shape, score_shape, mask_as),) if mask else ())
        return OpStrategy(ins, tuple(outs))

    n_in = 6 if backward else 3
    candidates = [one((R,) * n_in, (R,) * n_out, R)]
    mesh_shape = q.mesh.shape
    # Batch dims (batch, heads): every tensor has them at the same index, and nothing mixes across them.
    # Context parallel: q, k, v all S(L); the local_impl gathers k, v and places each row by its
    # global position (attention/ring.py), so a causal mask is exact too. Only the mesh dims that may
    # end up sharding a dim are checked (``surviving_shards``); a kept sequence shard frees none.
    tensors = specs[1:4] if backward else specs[:3]
    seq = ndim - 2
    context_parallel = mask is None and (q.shape[seq] == k.shape[seq] or not is_causal)

    def keeps(d: int, cuts: tuple[int, ...]) -> bool:
        if d == seq:
            return context_parallel and no_empty_shards(q.shape[seq], cuts) and no_empty_shards(k.shape[seq], cuts)
        if q.shape[d] == k.shape[d] == v.shape[d] and no_empty_shards(q.shape[d], cuts):
            return True
        return d == ndim - 3 and _grouped_heads_split_evenly(q.shape[d], k.shape[d], v.shape[d], cuts)

    candidates += [  # a sequence shard keeps the mask whole
        one((Shard(d),) * n_in, (Shard(d),) * n_out, R if d == seq else Shard(d))
        for d in sorted(surviving_shards(tensors, range(ndim - 1), keeps))
    ]
    # Query rows are independent unless a causal mask ties row i to key positions (global indices).
    if not is_causal and no_empty_shards(q.shape[seq], mesh_shape):
        if backward:  # grad, q, k, v, out, lse: lse has the query rows at the same index too
            ins = (Shard(seq), Shard(seq), R, R, Shard(seq), Shard(seq))
            candidates.append(one(ins, (Shard(seq), SUM, SUM), Shard(seq)))
        else:
            candidates.append(one((Shard(seq), R, R), (Shard(seq), Shard(seq)), Shard(seq)))
    # Linear in v (forward) and in the incoming gradient (backward); the mask stays replicated.
    for p in LINEAR_PARTIALS:
        if backward:
            candidates.append(one((p, R, R, R, R, R), (p, p, p), R))
        else:
            candidates.append(one((R, R, p), (p, R), R))
    return candidates


@register_rule(aten._scaled_dot_product_flash_attention_for_cpu.default, local_impl=ring_forward_local)
def sdpa_rule(call: OpCall) -> Sequence[OpStrategy]:
    """attention: q,k,v S(batch|heads) -> out, lse S(same); q S(L), k,v R -> S(L) unless causal;
    q,k,v S(L) -> S(L) (context parallel); v P -> P."""
    mask = call.kwargs.get("attn_mask")
    return _attention_candidates(call, call.input_specs, mask if isinstance(mask, DTensorSpec) else None,
                                 backward=False)


@register_rule(aten._scaled_dot_product_flash_attention_for_cpu_backward.default, local_impl=ring_backward_local)
def sdpa_backward_rule(call: OpCall) -> Sequence[OpStrategy]:
    """attention backward: all S(batch|heads) -> grads S(same); q rows S(L) -> dq S(L), dk, dv P(sum);
    all S(L) -> grads S(L) (context parallel)."""
    mask = call.kwargs.get("attn_mask")
    return _attention_candidates(call, call.input_specs, mask if isinstance(mask, DTensorSpec) else None,
                                 backward=True)


# ----- transposes ----------------------------------------------------------------------------------
def _swap(p: Placement, a: int, b: int) -> Placement:
    if isinstance(p, Shard) and p.dim in (a, b):
        return Shard(b if p.dim == a else a)
    return p


def _transpose_candidates(ndim: int, a: int, b: int) -> list[OpStrategy]:
    options: list[Placement] = [R, *(Shard(d) for d in range(ndim)), *PARTIALS]
    return [OpStrategy((p,), (_swap(p, a, b),)) for p in options]


@register_rule(aten.t.default, aten.t_.default, aten.t_copy.default)
def t_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(0) <-> S(1); R and P unchanged (1-d tensors are returned as they are)."""
    ndim = call.input_specs[0].ndim
    return _transpose_candidates(ndim, 0, 1) if ndim == 2 else _transpose_candidates(ndim, 0, 0)


@register_rule(aten.transpose.int, aten.transpose_.default, aten.transpose_copy.int)
def transpose_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(dim0) <-> S(dim1); other placements unchanged."""
    ndim = call.input_specs[0].ndim
    a = normalize_dim(call.arg(1, "dim0"), ndim)
    b = normalize_dim(call.arg(2, "dim1"), ndim)
    return _transpose_candidates(ndim, a, b)


# ----- linalg: batch dims shard, matrix dims stay whole ---------------------------------------------
def batch_candidates(call: OpCall, batch_ndim: int, operands_batched: bool = True) -> list[OpStrategy]:
    """R... -> R...; S(b) on every operand -> S(b) on every output, for each batch dim b of equal size.

    ``operands_batched`` False means some operand does not carry the batch dims (a broadcast
    right-hand side), so only R is offered.
    """
    specs = call.input_specs
    n_out = len(call.output_metas)
    candidates = [OpStrategy((R,) * len(specs), (R,) * n_out)]
    if not operands_batched:
        return candidates
    candidates += [
        OpStrategy((Shard(b),) * len(specs), (Shard(b),) * n_out)
        for b in range(batch_ndim)
        if len({s.shape[b] for s in specs}) == 1
    ]
    return candidates


@register_rule(
    aten._linalg_det.default,
    aten._linalg_slogdet.default,
    aten.linalg_inv_ex.default,
    aten.linalg_lu_factor_ex.default,
    aten._linalg_svd.default,
    aten._linalg_eigh.default,
    aten.linalg_cholesky_ex.default,
    aten.linalg_qr.default,
    aten.lu_unpack.default,
)
def matrix_function_rule(call: OpCall) -> Sequence[OpStrategy]:
    """f(A (*, m, n)): S(b) -> S(b) on every output for a batch dim b; the matrix dims must be whole."""
    return batch_candidates(call, call.input_specs[0].ndim - 2)


def _rhs_batch_ndim(a: DTensorSpec, b: DTensorSpec) -> int:
    """How many leading batch dims B of ``solve(A, B)`` has (torch reads B as a vector when it has
    A's shape without the last dim, or is 1-d)."""
    is_vector = b.ndim == 1 or (b.ndim == a.ndim - 1 and tuple(b.shape) == tuple(a.shape[:-1]))
    return b.ndim - (1 if is_vector else 2)


@register_rule(aten._linalg_solve_ex.default)
def solve_rule(call: OpCall) -> Sequence[OpStrategy]:
    """solve(A, B) -> (X, LU, pivots, info): S(b) x S(b) -> S(b) for equal batch dims; R x P -> P, R, R, R."""
    a = call.input_specs[0]
    batch_ndim = a.ndim - 2
    candidates = batch_candidates(call, batch_ndim, len(call.input_specs) == 2 and _rhs_batch_ndim(a, call.input_specs[1]) == batch_ndim)
    n_out = len(call.output_metas)
    candidates += [OpStrategy((R, p), (p,) + (R,) * (n_out - 1)) for p in LINEAR_PARTIALS]
    return candidates


@register_rule(aten.linalg_lu_solve.default, aten.linalg_solve_triangular.default)
def lu_solve_rule(call: OpCall) -> Sequence[OpStrategy]:
    """lu_solve(LU, pivots, B), solve_triangular(A, B): S(b) on all -> S(b) for equal batch dims; R.. x P -> P."""
    a, b = call.input_specs[0], call.input_specs[-1]
    candidates = batch_candidates(call, a.ndim - 2, b.ndim == a.ndim)
    factors = (R,) * (len(call.input_specs) - 1)
    return candidates + [OpStrategy((*factors, p), (p,)) for p in LINEAR_PARTIALS]


@register_rule(aten.linalg_pinv.atol_rtol_tensor)
def pinv_rule(call: OpCall) -> Sequence[OpStrategy]:
    """pinv(A): S(b) -> S(b) for a batch dim b; tensor tolerances (which broadcast) keep it whole."""
    return batch_candidates(call, call.input_specs[0].ndim - 2, len(call.input_specs) == 1)


def _diagonal_batch_dims(matrix_ndim: int, dim1: int, dim2: int) -> list[int]:
    """The dims of a matrix-shaped tensor other than the two that hold the diagonal, in order; the
    diagonal's own tensor has them as its leading dims, the diagonal itself last."""
    planes = {normalize_dim(dim1, matrix_ndim), normalize_dim(dim2, matrix_ndim)}
    return [d for d in range(matrix_ndim) if d not in planes]


@register_rule(aten.diag_embed.default)
def diag_embed_rule(call: OpCall) -> Sequence[OpStrategy]:
    """diag_embed(x (*, n)): S(i) -> S(the output dim of batch dim i); the last dim whole; P -> P (zeros off it)."""
    x = call.input_specs[0]
    out_dims = _diagonal_batch_dims(x.ndim + 1, int(call.arg(2, "dim1", -2)), int(call.arg(3, "dim2", -1)))
    candidates = [OpStrategy((R,), (R,))]
    candidates += [OpStrategy((Shard(i),), (Shard(out_dims[i]),)) for i in range(x.ndim - 1)]
    return candidates + [OpStrategy((p,), (p,)) for p in PARTIALS]


@register_rule(aten.diagonal_scatter.default)
def diagonal_scatter_rule(call: OpCall) -> Sequence[OpStrategy]:
    """diagonal_scatter(x, src): S(d) x S(i) -> S(d) for the i-th dim d off the diagonal plane; P x P -> P."""
    x = call.input_specs[0]
    batch = _diagonal_batch_dims(x.ndim, int(call.arg(3, "dim1", 0)), int(call.arg(4, "dim2", 1)))
    candidates = [OpStrategy((R, R), (R,))]
    candidates += [OpStrategy((Shard(d), Shard(i)), (Shard(d),)) for i, d in enumerate(batch)]
    return candidates + [OpStrategy((p, p), (p,)) for p in LINEAR_PARTIALS]


@register_rule(aten._linalg_check_errors.default)
def check_errors_rule(call: OpCall) -> Sequence[OpStrategy]:
    """check_errors(info): R -> nothing. The (small) info is gathered so that every rank raises for a
    singular matrix, not only the rank holding it, which would leave the others waiting in a collective."""
    return [OpStrategy((R,), ())]
