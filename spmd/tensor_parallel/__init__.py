"""Tensor parallelism: parallelize_module and the parallel styles (``torch.distributed.tensor.parallel``).

>>> mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))  # doctest: +SKIP
>>> parallelize_module(model, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})  # doctest: +SKIP
"""

from spmd.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from spmd.tensor_parallel.linear import ColwiseParallel, RowwiseParallel
from spmd.tensor_parallel.loss import loss_parallel
from spmd.tensor_parallel.parallelize import parallelize_module
from spmd.tensor_parallel.prepare import PrepareModuleInput, PrepareModuleInputOutput, PrepareModuleOutput
from spmd.tensor_parallel.sequence import SequenceParallel
from spmd.tensor_parallel.style import ParallelStyle, UnsupportedModuleError

__all__ = [
    "parallelize_module",
    "ParallelStyle",
    "ColwiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "PrepareModuleInputOutput",
    "loss_parallel",
    "vocab_parallel_cross_entropy",
    "UnsupportedModuleError",
]
