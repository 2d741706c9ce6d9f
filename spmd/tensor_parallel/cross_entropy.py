"""Cross-entropy on logits sharded on the class (vocab) dim, without gathering them.

Each rank holds a slice of the classes. Forward: the row max is all-reduced (max), then the sum of
exp and the target's logit (found only on the rank that holds it) in one all_reduce (sum); that is
two collectives, however large the vocabulary. Backward needs none: each rank's gradient is
``softmax - one_hot`` on its own classes.

Semantics are those of ``F.cross_entropy`` with class-index targets: ``weight``, ``ignore_index``,
``reduction`` and ``label_smoothing``. Other mesh dims may shard the batch (and spatial) dims; the
loss then comes back sharded ('none') or Partial(sum) ('sum', 'mean', the mean over the global batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from spmd.compile.compiling import compiling_here
from spmd.tensor import DeviceMesh, DTensor, Partial, Placement, Replicate, Shard
from spmd.tensor.redistribute.collectives import reduce_over
from spmd.tensor.spec import local_shape_and_offset

__all__ = ["vocab_parallel_cross_entropy", "VocabLayout", "vocab_layout"]

REDUCTIONS = ("none", "mean", "sum")


@dataclass(frozen=True, slots=True)
class VocabLayout:
    """Where the classes of a logits DTensor live: which mesh dim splits them, and this rank's slice."""

    class_dim: int
    """The logits dim holding the classes (1, or 0 for unbatched logits)."""
    vocab_mesh_dim: int
    """The mesh dim that shards the classes."""
    class_offset: int
    """Index of this rank's first class."""
    num_classes: int
    sample_placements: tuple[Placement, ...]
    """Placements of a per-sample tensor (target, loss with 'none'): the logits' without the class dim."""


def vocab_layout(logits: DTensor) -> VocabLayout | None:
    """The vocab layout of ``logits``, or None when no single mesh dim shards the class dim."""
    class_dim = 1 if logits.ndim >= 2 else 0
    vocab_dims = [d for d, p in enumerate(logits.placements) if p.is_shard(class_dim)]
    if len(vocab_dims) != 1:
        return None
    sample: list[Placement] = []
    for d, p in enumerate(logits.placements):
        if d == vocab_dims[0] or not isinstance(p, Shard):
            sample.append(Replicate())
        else:
            sample.append(Shard(p.dim - 1 if p.dim > class_dim else p.dim))
    _, offset = local_shape_and_offset(logits.shape, logits.device_mesh, logits.placements)
    return VocabLayout(class_dim, vocab_dims[0], offset[class_dim], logits.shape[class_dim], tuple(sample))


def vocab_parallel_cross_entropy(
    logits: DTensor,
    target: torch.Tensor,
    *,
    weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> DTensor:
    """``F.cross_entropy(logits, target)`` for logits sharded on the class dim (e.g. a Colwise lm head).

    ``logits`` is ``[N, C]``, ``[N, C, d1, ...]`` or ``[C]``, sharded on C by exactly one mesh dim.
    ``target`` holds class indices: a DTensor, or a plain tensor holding the whole target when no
    mesh dim shards the batch. ``weight`` (``[C]``) is the whole per-class weight on every rank.
    """
    if not isinstance(logits, DTensor):
        raise TypeError(f"vocab_parallel_cross_entropy takes DTensor logits, got {type(logits).__name__}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not one of {REDUCTIONS}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if any(p.is_partial() for p in logits.placements):
        logits = logits.redistribute(placements=[Replicate() if p.is_partial() else p for p in logits.placements])
    layout = vocab_layout(logits)
    if layout is None:
        raise ValueError(
            f"vocab_parallel_cross_entropy needs logits sharded on the class dim by exactly one mesh dim, "
            f"got placements {logits.placements} for shape {list(logits.shape)}; e.g. a ColwiseParallel "
            "output with use_local_output=False, or logits.redistribute(placements=[Shard(1)])"
        )
    mesh = logits.device_mesh
    sample_shape = tuple(s for d, s in enumerate(logits.shape) if d != layout.class_dim)
    local_target = _local_target(target, mesh, layout, sample_shape)
    full_weight = _full_weight(weight, layout.num_classes)
    scores = logits.to_local().movedim(layout.class_dim, -1)
    if local_target.shape != scores.shape[:-1]:
        raise ValueError(
            f"target of shape {list(target.shape)} does not match logits of shape {list(logits.shape)}; "
            f"it must be the logits' shape without the class dim {layout.class_dim}"
        )
    _check_target_range(local_target, layout.num_classes, ignore_index)
    per_sample = _LocalCrossEntropy.apply(  # type: ignore[no-untyped-call]
        scores, local_target, full_weight, mesh, layout, ignore_index,
        label_smoothing,
    )
    if reduction == "none":
        return DTensor.from_local(per_sample.to(logits.dtype), mesh, layout.sample_placements, shape=sample_shape)
    total = per_sample.sum()
    if reduction == "mean":
        total = total / _global_weight_sum(local_target, full_weight, ignore_index, mesh, layout)
    placements = [Partial("sum") if isinstance(p, Shard) else Replicate() for p in layout.sample_placements]
    return DTensor.from_local(total.to(logits.dtype), mesh, placements, shape=())


def _local_target(target: torch.Tensor, mesh: DeviceMesh, layout: VocabLayout, sample_shape: tuple[int, ...]) -> torch.Tensor:
    if target.dtype.is_floating_point or target.dtype.is_complex:
        raise TypeError(
            "vocab_parallel_cross_entropy takes class-index targets (an integer tensor); class probabilities "
            "are not supported"
        )
    if isinstance(target, DTensor):
        if target.device_mesh != mesh:
            raise ValueError(f"target is on {target.device_mesh} but the logits are on {mesh}")
        return target.redistribute(placements=layout.sample_placements).to_local()
    if any(isinstance(p, Shard) for p in layout.sample_placements):
        raise ValueError(
            f"the logits' batch is sharded ({layout.sample_placements} per sample), so a plain-tensor target is "
            "ambiguous; pass it as a DTensor, e.g. DTensor.from_local(local_target, mesh, "
            f"{list(layout.sample_placements)})"
        )
    if tuple(target.shape) != sample_shape:
        raise ValueError(f"target of shape {list(target.shape)} does not match logits samples of shape {list(sample_shape)}")
    return target


def _full_weight(weight: torch.Tensor | None, num_classes: int) -> torch.Tensor | None:
    if weight is None:
        return None
    full = weight.full_tensor() if isinstance(weight, DTensor) else weight
    if full.shape != (num_classes,):
        raise ValueError(f"weight must have one entry per class ({num_classes}), got shape {list(full.shape)}")
    return full.detach()


def _check_target_range(target: torch.Tensor, num_classes: int, ignore_index: int) -> None:
    if compiling_here():  # a compiled graph cannot branch on the targets' values
        return
    bad = ((target < 0) | (target >= num_classes)) & (target != ignore_index)
    if bool(bad.any()):
        value = int(target[bad][0])
        raise IndexError(f"cross_entropy target {value} is out of range for {num_classes} classes")


def _global_weight_sum(
    target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int, mesh: DeviceMesh, layout: VocabLayout
) -> torch.Tensor:
    """The mean's divisor: the summed weights of the non-ignored targets of the whole batch."""
    valid = target != ignore_index
    if weight is None:
        local = valid.sum().to(torch.get_default_dtype())
    else:
        local = torch.where(valid, weight[torch.where(valid, target, 0)], 0).sum()
    sharded = [d for d, p in enumerate(layout.sample_placements) if isinstance(p, Shard)]
    return reduce_over(mesh, sharded, local, "sum")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


class _LocalCrossEntropy(torch.autograd.Function):
    """Per-sample loss from this rank's class slice ``scores`` (classes last); 0 where ignored."""

    @staticmethod
    def forward(
        ctx: Any,
        scores: torch.Tensor,
        target: torch.Tensor,
        weight: torch.Tensor | None,
        mesh: DeviceMesh,
        layout: VocabLayout,
        ignore_index: int,
        smoothing: float,
    ) -> torch.Tensor:
        x = scores.to(_compute_dtype(scores.dtype))
        width = x.size(-1)
        local_max = x.amax(-1) if width else x.new_full(x.shape[:-1], float("-inf"))
        shifted = x - reduce_over(mesh, [layout.vocab_mesh_dim], local_max, "max").unsqueeze(-1)
        valid = target != ignore_index
        local_index = target - layout.class_offset
        here = valid & (local_index >= 0) & (local_index < width)
        local_index = torch.where(here, local_index, 0)
        picked = shifted.gather(-1, local_index.unsqueeze(-1)).squeeze(-1) if width else x.new_zeros(x.shape[:-1])
        sums = [shifted.exp().sum(-1), torch.where(here, picked, 0)]
        class_weight = None
        if weight is not None:
            class_weight = weight.to(x.dtype).narrow(0, layout.class_offset, width)
        if smoothing:
            sums.append((shifted * class_weight).sum(-1) if class_weight is not None else shifted.sum(-1))
        reduced = reduce_over(mesh, [layout.vocab_mesh_dim], torch.stack(sums), "sum")
        log_sum_exp = reduced[0].log()
        target_weight = x.new_ones(()) if weight is None else weight.to(x.dtype)[torch.where(valid, target, 0)]
        target_weight = torch.where(valid, target_weight, 0)
        loss = -target_weight * (reduced[1] - log_sum_exp)
        all_weight = float(layout.num_classes) if weight is None else float(weight.sum())
        if smoothing:
            # -sum_c w_c log p_c, with log p_c = shifted_c - log_sum_exp
            smooth = torch.where(valid, all_weight * log_sum_exp - reduced[2], 0)
            loss = (1 - smoothing) * loss + smoothing / layout.num_classes * smooth
        ctx.save_for_backward(shifted, log_sum_exp, local_index, here, valid, target_weight)
        ctx.class_weight = class_weight
        ctx.all_weight = all_weight
        ctx.smoothing = smoothing
        ctx.num_classes = layout.num_classes
        ctx.scores_dtype = scores.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        shifted, log_sum_exp, local_index, here, valid, target_weight = ctx.saved_tensors
        probs = (shifted - log_sum_exp.unsqueeze(-1)).exp()
        nll_coef = (1 - ctx.smoothing) * target_weight * grad
        d_scores = probs * nll_coef.unsqueeze(-1)
        if d_scores.size(-1):
            d_scores.scatter_add_(-1, local_index.unsqueeze(-1), torch.where(here, -nll_coef, 0).unsqueeze(-1))
        if ctx.smoothing:
            smooth_coef = torch.where(valid, grad * (ctx.smoothing / ctx.num_classes), 0).unsqueeze(-1)
            weights = ctx.class_weight if ctx.class_weight is not None else 1.0
            d_scores = d_scores + smooth_coef * (probs * ctx.all_weight - weights)
        return d_scores.to(ctx.scores_dtype), None, None, None, None, None, None
