"""The demo's training step (examples/train_transformer.py) with forward + loss and their backward
compiled (fullgraph): the same losses as eager, step by step, on a (dp=2, tp=2) mesh of threads.
With fully_shard, each block is compiled and its hooks (gather, free, re-gather) run eagerly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spmd.testing import load_script, run_threaded

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_transformer.py"


demo = load_script(EXAMPLE)
TINY = demo.Config(steps=5, n_layers=1, d_model=32, seq_len=8, batch_size=4)


def losses(cfg) -> list[float]:
    # Ranks compile one at a time (torch.compile's lock), so their peers may wait a while.
    return run_threaded(demo.train, cfg.dp * cfg.tp, cfg, timeout=600)[0]


@pytest.mark.parametrize(
    "backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)], ids=["aot_eager", "inductor"]
)
def test_compiled_step_gives_the_eager_losses(backend: str) -> None:
    eager = losses(TINY)
    compiled = losses(demo.replace(TINY, compile=backend))
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-5, atol=1e-6)
    single = demo.train_single_device(demo.replace(TINY, dp=1, tp=1))
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(single), rtol=1e-4, atol=1e-6)


def test_blocks_compiled_under_fully_shard_give_the_eager_losses() -> None:
    """The compiled backward saved the gathered parameters that fully_shard frees after forward and
    refills before backward: the refill keeps their values and their version counters."""
    fsdp = demo.replace(TINY, n_layers=2, fsdp=True)
    eager = losses(fsdp)
    compiled = losses(demo.replace(fsdp, compile="aot_eager"))
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-5, atol=1e-6)


def test_compile_flag_defaults_to_inductor() -> None:
    assert demo.parse_args(["--compile"])[0].compile == "inductor"
    assert demo.parse_args(["--compile", "aot_eager"])[0].compile == "aot_eager"
    assert demo.parse_args(["--compile", "--fsdp"])[0].fsdp
    assert demo.parse_args([])[0].compile is None
