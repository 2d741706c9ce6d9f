"""One program written against Hugging Face transformers alone, as its users write it: load a tiny
Llama with tensor parallelism (``tp_plan="auto"``), run it, generate, train one step, save it.

Nothing here knows about spmd. ``test_transformers`` runs it with transformers redirected to spmd
(``transformers_setup``), and on gloo processes that import only this module, so there it runs on
torch's own DTensor: the same program on both libraries.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

PROMPT_LENGTH = 12
NEW_TOKENS = 6
LR = 1e-3
EPS = 1e-5
"""AdamW's eps: with torch's 1e-8, gradients that are rounding noise around zero take steps of about
``LR`` whose sign is the noise's; 1e-5 keeps such steps below ``LR * noise / EPS``."""


@dataclasses.dataclass(frozen=True)
class Case:
    """A tiny Llama: ``even`` shapes cut evenly over 2 and 4 ranks; otherwise an MLP and a vocabulary
    that 4 does not divide, with the input embedding tied to the output layer."""

    even: bool

    @property
    def name(self) -> str:
        return "even" if self.even else "uneven_tied"

    def config(self) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=128 if self.even else 131,
            hidden_size=64,
            intermediate_size=128 if self.even else 90,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=64,
            tie_word_embeddings=not self.even,
        )


def save_tiny_llama(case: Case, directory: str) -> None:
    """Write the case's model with seed-0 weights, as a user's checkpoint (no download)."""
    torch.manual_seed(0)
    LlamaForCausalLM(case.config()).save_pretrained(directory)


def prompt(case: Case) -> torch.Tensor:
    return torch.randint(0, case.config().vocab_size, (2, PROMPT_LENGTH), generator=torch.Generator().manual_seed(1))


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor, whichever DTensor class holds it (both offer ``full_tensor``)."""
    full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return full.detach().clone()


def _parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: _full(p) for name, p in model.named_parameters()}


def run(case: Case, directory: str, out: str, tensor_parallel: bool) -> dict[str, object]:
    """Load ``directory``'s model (with ``tp_plan="auto"`` when ``tensor_parallel``), then return its
    loaded weights, logits, greedy generation, one training step's loss and gradients, the weights
    after one AdamW step, and what ``save_pretrained`` wrote to ``out``."""
    if tensor_parallel:
        model = LlamaForCausalLM.from_pretrained(directory, tp_plan="auto")
    else:
        model = LlamaForCausalLM.from_pretrained(directory)
    ids = prompt(case)
    loaded = _parameters(model)
    with torch.no_grad():
        logits = _full(model(ids).logits)
        generated = model.generate(
            ids, attention_mask=torch.ones_like(ids), pad_token_id=0, max_new_tokens=NEW_TOKENS, do_sample=False
        ).clone()

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    loss = model(ids, labels=ids).loss
    loss.backward()
    gradients = {name: _full(p.grad) for name, p in model.named_parameters() if p.grad is not None}
    optimizer.step()
    stepped = _parameters(model)

    model.save_pretrained(out)
    saved = load_file(str(Path(out) / "model.safetensors")) if Path(out, "model.safetensors").exists() else {}
    return {
        "loaded": loaded,
        "logits": logits,
        "generated": generated,
        "loss": _full(loss),
        "gradients": gradients,
        "stepped": stepped,
        "saved": saved,
        "placements": {
            name: repr(tuple(p.placements)) for name, p in model.named_parameters() if hasattr(p, "placements")
        },
        "library": sorted({type(p).__module__.split(".")[0] for p in model.parameters() if hasattr(p, "placements")}),
    }


def run_on_rank(jobs: list[tuple[Case, str]], out_root: str) -> list[dict[str, object]]:
    """``run`` with tensor parallelism on this rank, for each (case, checkpoint directory) in turn
    (each rank and case saves to its own directory under ``out_root``)."""
    rank = torch.distributed.get_rank()
    return [run(case, directory, str(Path(out_root) / f"{case.name}_rank{rank}"), True) for case, directory in jobs]
