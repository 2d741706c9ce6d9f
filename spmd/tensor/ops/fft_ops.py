"""Discrete Fourier transforms: each output element mixes the whole of the transformed dims, so those
stay whole; every other dim keeps its shard, and the transform is linear.

  _fft_r2c, _fft_c2c, _fft_c2r (dims):  S(d) -> S(d) for d not transformed;  R -> R;
                                        P(sum|avg) -> same P
The CPU kernels (MKL, pocketfft) raise on an empty batch, so a dim stays sharded only where no
rank's piece of it is empty.
(c2r's last_dim_size is a transformed dim's global size, which every rank holds whole.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from spmd.tensor.ops.common import LINEAR_PARTIALS, R, normalize_dim
from spmd.tensor.ops.matrix import no_empty_shards
from spmd.tensor.placement import Placement, Shard
from spmd.tensor.sharding.registry import register_rule
from spmd.tensor.sharding.vocabulary import OpCall, OpStrategy

aten = torch.ops.aten


@register_rule(aten._fft_r2c.default, aten._fft_c2c.default, aten._fft_c2r.default)
def fft_rule(call: OpCall) -> Sequence[OpStrategy]:
    """S(d) -> S(d) for d outside the transformed dims; R -> R; P(sum|avg) -> P (the DFT is linear)."""
    x = call.input_specs[0]
    transformed = {normalize_dim(int(d), x.ndim) for d in call.arg(1, "dim")}
    kept = [d for d in range(x.ndim) if d not in transformed and no_empty_shards(x.shape[d], x.mesh.shape)]
    options: list[Placement] = [R, *(Shard(d) for d in kept), *LINEAR_PARTIALS]
    return [OpStrategy((p,), (p,)) for p in options]
