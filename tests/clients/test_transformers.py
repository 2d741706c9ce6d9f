"""Hugging Face transformers' own tensor parallelism (``from_pretrained(dir, tp_plan="auto")``) on spmd
equals one device, and equals the same program on torch's DTensor.

``transformers_setup`` redirects transformers' ``torch.distributed.tensor`` imports (and its
``torch.distributed.init_device_mesh`` calls) to spmd, so it is imported before transformers.
``transformers_program`` is the user's program, written against transformers alone: a tiny Llama
written with ``save_pretrained``, loaded with ``tp_plan="auto"``, then its weights, logits, greedy
``generate``, one training step (loss, gradients, AdamW) and ``save_pretrained`` output.
"""

from __future__ import annotations

# First: transformers must be imported through the redirect (in pytest and in each spmd gloo process).
import transformers_setup

# isort: split

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers_program as program
from transformers_program import EPS, LR, Case

from spmd.testing import run_multiprocess

CASES = [Case(even=True), Case(even=False)]
TOLERANCE = 1e-5
"""Largest difference from one device, relative to the largest magnitude of the value compared: the
ranks sum float32 partial products in another order than one device does."""

TIED = {"lm_head.weight": "model.embed_tokens.weight"}
"""The uneven case's output layer is its input embedding."""

Results = dict[str, Any]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Each case's checkpoint directory, all written before any model is loaded."""
    root = tmp_path_factory.mktemp("tiny_llama")
    for case in CASES:
        program.save_tiny_llama(case, str(root / case.name))
    return {case.name: str(root / case.name) for case in CASES}


@pytest.fixture(scope="module")
def one_device(checkpoints: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Results]:
    out = tmp_path_factory.mktemp("one_device")
    return {case.name: program.run(case, checkpoints[case.name], str(out / case.name), False) for case in CASES}


def _close(got: torch.Tensor, expected: torch.Tensor, atol: float, what: str) -> None:
    torch.testing.assert_close(got, expected, rtol=0, atol=atol, msg=lambda m: f"{what}: {m}")


def _tolerance(value: torch.Tensor) -> float:
    return TOLERANCE * float(value.abs().max()) + 1e-12


def assert_equal_to(expected: Results, got: Results) -> None:
    """Every value ``program.run`` returns, within what the order of float32 sums explains."""
    for key in ("logits", "loss"):
        _close(got[key], expected[key], _tolerance(expected[key]), key)
    assert torch.equal(got["generated"], expected["generated"]), "greedy generation differs"
    loaded, gradients, stepped = (got[k] for k in ("loaded", "gradients", "stepped"))
    assert loaded.keys() == expected["loaded"].keys()
    for name, weight in expected["loaded"].items():
        assert torch.equal(loaded[name], weight), f"loaded {name} differs"
    # AdamW's first step moves a weight by lr * g / (|g| + eps): a gradient error d moves it by at
    # most lr * d / eps more.
    step_tolerance = {}
    for name, gradient in expected["gradients"].items():
        atol = _tolerance(gradient)
        _close(gradients[name], gradient, atol, f"gradient of {name}")
        step_tolerance[name] = _tolerance(expected["stepped"][name]) + LR * atol / EPS
        _close(stepped[name], expected["stepped"][name], step_tolerance[name], f"{name} after AdamW")
    saved = got["saved"]
    if not saved:  # transformers writes the checkpoint from rank 0 alone
        return
    for name, tensor in expected["saved"].items():
        _close(saved[name], tensor, step_tolerance.get(name, max(step_tolerance.values())), f"saved {name}")
    for name in saved.keys() - expected["saved"].keys():
        # With tensor parallelism transformers also writes the output layer tied to the embedding
        # (on torch's DTensor too): it must hold the embedding.
        assert torch.equal(saved[name], saved[TIED[name]]), f"saved {name} is not {TIED[name]}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4: 8 processes, ~1 min on 2 cores
def test_tp_plan_auto_equals_one_device_and_torchs_dtensor(
    world: int, checkpoints: dict[str, str], one_device: dict[str, Results], tmp_path: Path
) -> None:
    # Ranks are gloo processes: transformers' from_pretrained swaps process-wide functions while it
    # loads (torch.nn.init's, PreTrainedModel.tie_weights), so rank threads loading at once race.
    jobs = [(case, checkpoints[case.name]) for case in CASES]
    # transformers_program alone: those processes import transformers as written, on torch's DTensor.
    torchs = run_multiprocess(program.run_on_rank, world, jobs, str(tmp_path / "torch"), timeout=300)
    ours = run_multiprocess(transformers_setup.run_on_rank, world, jobs, str(tmp_path / "spmd"), timeout=300)
    assert all(results["saved"] for results in ours[0]), "rank 0 wrote each checkpoint"
    for torch_rank, our_rank in zip(torchs, ours):
        for case, on_torch, on_spmd in zip(CASES, torch_rank, our_rank):
            assert on_torch["library"] == ["torch"] and on_spmd["library"] == ["spmd"]
            assert on_spmd["placements"] == on_torch["placements"], "the same layout, parameter by parameter"
            assert on_spmd["saved"].keys() == on_torch["saved"].keys()
            assert_equal_to(one_device[case.name], on_spmd)
            assert_equal_to(on_torch, on_spmd)
