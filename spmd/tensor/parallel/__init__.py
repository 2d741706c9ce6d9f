"""Legacy import path: ``spmd.tensor.parallel`` holds the same objects as ``spmd.tensor_parallel``."""

from spmd.tensor_parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    UnsupportedModuleError,
    loss_parallel,
    parallelize_module,
    vocab_parallel_cross_entropy,
)

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
