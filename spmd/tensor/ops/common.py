"""Helpers shared by op families: broadcasting alignment and the standard candidate lists."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from spmd.tensor.placement import Partial, Placement, Replicate, Shard
from spmd.tensor.sharding.vocabulary import OpCall, OpStrategy
from spmd.tensor.spec import DTensorSpec

__all__ = [
    "R",
    "PARTIALS",
    "LINEAR_PARTIALS",
    "normalize_dim",
    "identity_candidates",
    "pointwise_candidates",
    "surviving_shards",
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


def identity_candidates(
    ndim: int, num_inputs: int = 1, *, partials: tuple[Partial, ...] = PARTIALS
) -> list[OpStrategy]:
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
    # The output follows its inputs' layout: with no input sharded, a pending reduction the op
    # cannot pass through is completed to R (as torch does), not reduce-scattered onto a new shard.
    sharded_inputs = any(isinstance(p, Shard) for spec in specs for p in spec.placements)
    for out_dim in range(out_ndim if sharded_inputs else 0):
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


def surviving_shards(
    specs: Sequence[DTensorSpec],
    dims: Iterable[int],
    keeps: Callable[[int, tuple[int, ...]], bool],
    *,
    partials_stay: bool = False,
) -> set[int]:
    """The dims among ``dims`` whose shard an op can keep, given ``keeps(dim, cuts)``.

    ``cuts`` are the sizes of the mesh dims (in mesh order) that may end up sharding ``dim``, so a
    rule checks divisibility or empty pieces against them rather than against the whole mesh
    (which would drop the shard of a batch of 64 over dp=64 on a dp x tp mesh). A mesh dim may
    shard ``dim`` when an input is sharded on ``dim`` there, or when it is *free*: an input there
    is sharded on a dim that does not survive, or partial (unless ``partials_stay``: the rule offers
    P -> P for every partial input), so the propagator may move it onto any surviving dim. A mesh
    dim where the inputs are replicated, or sharded on surviving dims only, keeps that (it costs
    nothing). Dims that lose their shard free more mesh dims, so this repeats until nothing
    changes.
    """
    n = specs[0].mesh.ndim
    sizes = specs[0].mesh.shape
    owners = [{p.dim for s in specs if isinstance(p := s.placements[e], Shard)} for e in range(n)]
    partial = [not partials_stay and any(isinstance(s.placements[e], Partial) for s in specs) for e in range(n)]
    survivors = set(dims)
    while True:
        free = [partial[e] or bool(owners[e] - survivors) for e in range(n)]
        kept = {d for d in survivors if keeps(d, tuple(sizes[e] for e in range(n) if free[e] or d in owners[e]))}
        if kept == survivors:
            return survivors
        survivors = kept
