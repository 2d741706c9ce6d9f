"""Helpers shared by op families: broadcasting alignment and the standard candidate lists."""

from __future__ import annotations

from spmd.tensor.ops.registry import OpCall, OpStrategy
from spmd.tensor.placement import Partial, Placement, Replicate, Shard

__all__ = [
    "R",
    "PARTIALS",
    "LINEAR_PARTIALS",
    "normalize_dim",
    "identity_candidates",
    "pointwise_candidates",
]

R = Replicate()
PARTIALS = tuple(Partial(op) for op in Partial.REDUCE_OPS)
LINEAR_PARTIALS = (Partial("sum"), Partial("avg"))


def normalize_dim(dim: int, ndim: int) -> int:
    """``dim`` in ``[0, ndim)``; 0-d tensors accept dims -1 and 0 as torch does."""
    bound = max(ndim, 1)
    if not -bound <= dim < bound:
        raise IndexError(f"dim {dim} is out of range for a {ndim}-d tensor; use a dim in [{-bound}, {bound - 1}]")
    return dim % bound


def identity_candidates(ndim: int, num_inputs: int = 1, *, partials: tuple[Partial, ...] = PARTIALS) -> list[OpStrategy]:
    """Every input and the output share one placement: R, S(d) for each dim, or a partial."""
    options: list[Placement] = [R, *(Shard(d) for d in range(ndim)), *partials]
    return [OpStrategy((p,) * num_inputs, (p,)) for p in options]


def _aligned_dim(out_ndim: int, in_shape: tuple[int, ...], out_shape: tuple[int, ...], out_dim: int) -> int | None:
    """The input dim matching output dim ``out_dim`` under broadcasting, or None if broadcast there."""
    in_dim = out_dim - (out_ndim - len(in_shape))
    if in_dim < 0:
        return None
    if in_shape[in_dim] == 1 and out_shape[out_dim] != 1:
        return None
    return in_dim


def pointwise_candidates(call: OpCall, *, linearity: str = "none", output_index: int = 0) -> list[OpStrategy]:
    """Candidates for an elementwise op with broadcasting.

    linearity says where a pending reduction may pass through:
      "none"           -- never (relu, exp): partial inputs are reduced first;
      "additive"       -- every tensor operand partial with the same op (add, sub, copy_);
      "multiplicative" -- the first DTensor operand partial, the others replicated (mul, div,
                          threshold_backward: linear in the first argument);
      "unary"          -- a single input passes sum/avg partials through (neg, scalar mul).
    """
    meta = call.output_metas[output_index]
    assert meta is not None
    out_shape = meta.shape
    out_ndim = len(out_shape)
    specs = call.input_specs
    n = len(specs)
    candidates = [OpStrategy((R,) * n, (R,))]
    for out_dim in range(out_ndim):
        inputs: list[Placement] = []
        sharded = False
        for spec in specs:
            in_dim = _aligned_dim(out_ndim, spec.shape, out_shape, out_dim)
            if in_dim is None:
                inputs.append(R)
            else:
                inputs.append(Shard(in_dim))
                sharded = True
        if sharded:
            candidates.append(OpStrategy(tuple(inputs), (Shard(out_dim),)))
    if linearity == "additive":
        # x + 1 on a sum-partial would add the 1 on every rank; only avg survives a scalar operand.
        has_scalar_operand = _count_tensor_operands(call) > n
        for p in LINEAR_PARTIALS:
            if p.reduce_op == "sum" and has_scalar_operand:
                continue
            candidates.append(OpStrategy((p,) * n, (p,)))
    elif linearity == "multiplicative":
        candidates.extend(OpStrategy((p,) + (R,) * (n - 1), (p,)) for p in LINEAR_PARTIALS)
    elif linearity == "unary" and n == 1:
        candidates.extend(OpStrategy((p,), (p,)) for p in LINEAR_PARTIALS)
    return candidates


def _count_tensor_operands(call: OpCall) -> int:
    """Operands of a binary op, counting Python scalars and plain 0-d tensors as operands too."""
    operands = list(call.args[:2])
    return sum(1 for a in operands if a is not None and not isinstance(a, (bool, str)))
