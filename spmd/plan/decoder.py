"""What the search needs of a model: ``PlanModel``; and ``ModuleDecoder``, any decoder-shaped nn.Module.

The built-in models are ``LlamaConfig`` (spmd/plan/llama.py: Llama and GPT shapes, whose closed-form
bounds know their blocks). Any other model is planned through ``ModuleDecoder``: a factory that
builds it with a given number of blocks, its sizes, and optionally its tensor-parallel plan.

>>> def factory(layers):  # doctest: +SKIP
...     return MyDecoder(layers=layers, dim=1024, vocab=32000)
>>> model = ModuleDecoder(name="mine", factory=factory, layers=24, dim=1024, vocab=32000)  # doctest: +SKIP
>>> spmd.plan.search(model, Cluster(world=64), Workload(global_batch=64, seq=2048))  # doctest: +SKIP

The module's contract, as the planner runs it:

* ``model.layers`` is the ``nn.ModuleList`` of its identical blocks; ``model(tokens)`` maps
  ``[batch, seq]`` token ids to ``[batch, seq, vocab]`` logits;
* it builds on the meta device (``with torch.device("meta")``);
* with a ``tp_plan(sp)`` the logits come out as a DTensor sharded on the vocabulary
  (``Shard(-1)``, for ``loss_parallel``), and ``allows_tp`` says which degrees the model's shapes
  take; without one, tp is not searched;
* context parallelism shards the tokens along the sequence and runs ``F.scaled_dot_product_attention``
  on this rank's rows (``spmd.tensor.experimental.context_parallel``).

Its closed-form bounds are only the ones that hold for any such module (the training state, the
data-parallel traffic of its parameters), so the search simulates more of its layouts than of a
built-in model's. A layout the module cannot run is reported with its error, never estimated.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from spmd.tensor_parallel import ParallelStyle

__all__ = ["PlanModel", "ModuleDecoder"]


class PlanModel(Protocol):
    """What the search reads of a model (``LlamaConfig`` and ``ModuleDecoder`` have it)."""

    @property
    def layers(self) -> int: ...
    @property
    def dim(self) -> int: ...
    @property
    def vocab(self) -> int: ...

    def build(self, layers: int) -> nn.Module: ...
    def tp_plan(self, sp: bool) -> dict[str, ParallelStyle] | None: ...
    def allows_tp(self, tp: int) -> bool: ...
    def layer_params(self) -> int: ...
    def params(self) -> int: ...


@dataclass(frozen=True, kw_only=True)
class ModuleDecoder:
    """Any decoder-shaped module (see the module docstring for its contract)."""

    name: str
    factory: Callable[[int], nn.Module]
    """Builds the model with the given number of blocks."""
    layers: int
    dim: int
    """Width of the activations between blocks (what pipeline stages send)."""
    vocab: int
    plan: Callable[[bool], dict[str, ParallelStyle]] | None = None
    """``plan(sequence_parallel)``: the tensor-parallel plan, or None to search without tp."""
    tp_divides: int = 1
    """tp degrees must divide this (the key/value heads, say); 1 with no plan."""

    def build(self, layers: int) -> nn.Module:
        return self.factory(layers)

    def tp_plan(self, sp: bool) -> dict[str, ParallelStyle] | None:
        return None if self.plan is None else self.plan(sp)

    def allows_tp(self, tp: int) -> bool:
        return tp == 1 or (self.plan is not None and self.tp_divides % tp == 0)

    def layer_params(self) -> int:
        return _counted(self)[0]

    def params(self) -> int:
        block, rest = _counted(self)
        return self.layers * block + rest

    def __str__(self) -> str:
        return self.name


@functools.lru_cache(maxsize=64)
def _counted(model: ModuleDecoder) -> tuple[int, int]:
    """(parameters of one block, parameters outside the blocks), from a two-block build on meta."""
    with torch.device("meta"):
        built = model.build(2)
    blocks = getattr(built, "layers", None)
    if not isinstance(blocks, nn.ModuleList) or len(blocks) != 2:
        raise ValueError(
            f"{model.name}: factory(2) built {type(built).__name__} without a .layers ModuleList of 2 blocks; "
            "the planner repeats and stages the blocks it finds there"
        )
    block = sum(p.numel() for p in blocks[0].parameters())
    return block, sum(p.numel() for p in built.parameters()) - 2 * block
