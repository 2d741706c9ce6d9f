"""Let a program written for CPU tensors run unchanged when the local shards are meta tensors.

Two things differ on the meta device, and both are patched here for the simulated program only:

* Reading a value (``.item()``, ``bool(t)``, ``int(t)``, ``float(t)``) raises on meta. Programs
  read values for checks (a target out of range) and logs (the loss); a simulation has no values,
  so the read returns zero, which passes every such check.
* ``F.scaled_dot_product_attention`` picks its kernel by the query's device. On meta it falls back
  to the math decomposition (a different op sequence, the L x L attention matrix in memory); on CPU
  it picks the flash kernel, which is what the real run executes. Here the choice is asked of the
  CPU (on one-element stand-ins) and the flash op is called when the CPU would call it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from spmd.tensor import DTensor

__all__ = ["MetaAsCpu"]

_FLASH_BACKEND = 1
"""``torch.nn.attention.SDPBackend.FLASH_ATTENTION``: the value ``torch._fused_sdp_choice`` returns for it."""

_VALUE_READS: dict[Callable[..., Any], Any] = {
    torch.Tensor.item: 0,
    torch.Tensor.__bool__: False,
    torch.Tensor.__int__: 0,
    torch.Tensor.__float__: 0.0,
    torch.Tensor.__index__: 0,
}


def _is_meta(tensor: Any) -> bool:
    if isinstance(tensor, DTensor):
        return bool(tensor._local_tensor.is_meta)
    return isinstance(tensor, torch.Tensor) and tensor.is_meta


class MetaAsCpu(TorchFunctionMode):
    """Inside this mode, meta tensors answer value reads with zero and attention runs the CPU's kernel."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _VALUE_READS and args and _is_meta(args[0]):
            return _VALUE_READS[func]
        if func is F.scaled_dot_product_attention and args and _is_meta(args[0]):
            flash = _cpu_flash_attention(*args, **kwargs)
            if flash is not None:
                return flash
        return func(*args, **kwargs)


def _cpu_flash_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor | None:
    """The CPU flash kernel's output when the CPU would choose it for these inputs, else None."""
    if attn_mask is not None or enable_gqa:
        return None  # the CPU's choice then depends on the mask's values and layout; keep torch's path

    def stand_in(t: torch.Tensor) -> torch.Tensor:
        shape = (1,) * (t.ndim - 1) + (t.shape[-1],)
        return torch.empty(shape, dtype=t.dtype, device="cpu", requires_grad=t.requires_grad)

    choice = torch._fused_sdp_choice(
        stand_in(query), stand_in(key), stand_in(value), None, dropout_p, is_causal, scale=scale
    )
    if choice != _FLASH_BACKEND:
        return None
    output: torch.Tensor = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, scale=scale
    )[0]
    return output
