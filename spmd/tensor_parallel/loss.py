"""loss_parallel: inside it, ``F.cross_entropy`` on vocab-sharded DTensor logits runs vocab-parallel.

The context pushes a torch-function mode on the calling thread (so each rank of a threaded world
has its own). The mode sees ``F.cross_entropy`` before it decomposes into aten ops; when the input
is a DTensor sharded on the class dim and the target holds class indices, it calls
``vocab_parallel_cross_entropy``; every other call runs as usual.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from spmd.tensor import DTensor
from spmd.tensor_parallel.cross_entropy import vocab_layout, vocab_parallel_cross_entropy

__all__ = ["loss_parallel"]

_CROSS_ENTROPY_SIGNATURE = inspect.signature(F.cross_entropy)


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """Compute ``F.cross_entropy`` / ``nn.CrossEntropyLoss`` on class-sharded logits without gathering them.

    >>> with loss_parallel():  # doctest: +SKIP
    ...     loss = F.cross_entropy(logits, target)  # logits: DTensor sharded on the class dim
    ...     loss.backward()
    """
    with _LossParallelMode():
        yield


class _LossParallelMode(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.cross_entropy:
            call = _vocab_parallel_arguments(args, kwargs)
            if call is not None:
                return vocab_parallel_cross_entropy(**call)
        return func(*args, **kwargs)


def _vocab_parallel_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """``vocab_parallel_cross_entropy`` keyword arguments for this call, or None to run it as usual."""
    bound = _CROSS_ENTROPY_SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    call = bound.arguments
    logits, target = call["input"], call["target"]
    if not isinstance(logits, DTensor) or vocab_layout(logits) is None:
        return None
    if not isinstance(target, torch.Tensor) or target.dtype.is_floating_point:
        return None
    if call["size_average"] is not None or call["reduce"] is not None:
        raise ValueError("loss_parallel: size_average= and reduce= are deprecated; pass reduction= instead")
    return {
        "logits": logits,
        "target": target,
        "weight": call["weight"],
        "ignore_index": call["ignore_index"],
        "reduction": call["reduction"],
        "label_smoothing": call["label_smoothing"],
    }
