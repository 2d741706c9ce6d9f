"""The correct paths raise no false alarm: the demo (dp x tp, with --fsdp, with --compile) trains
like one device under the full collective check (SPMD_DEBUG=check) as under the default warm-up check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from spmd.tensor.debug import set_check_collectives
from spmd.testing import load_script, run_threaded

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "train_transformer.py"

demo = load_script(EXAMPLE)
TINY = demo.Config(steps=3, n_layers=2, d_model=32, seq_len=8, batch_size=4)


@pytest.fixture
def full_check() -> Any:
    set_check_collectives(True)
    try:
        yield
    finally:
        set_check_collectives(False)


def losses(cfg: Any) -> list[float]:
    return run_threaded(demo.train, cfg.dp * cfg.tp, cfg, timeout=600)[0]


@pytest.mark.parametrize(
    "options",
    [{}, {"sequence_parallel": True}, {"fsdp": True}, {"fsdp": True, "compile": "aot_eager"}],
    ids=["tp", "tp+sp", "fsdp", "fsdp+compile"],
)
def test_the_demo_trains_like_one_device_under_the_full_check(full_check: None, options: dict[str, Any]) -> None:
    cfg = demo.replace(TINY, **options)
    checked = losses(cfg)
    single = demo.train_single_device(demo.replace(TINY, dp=1, tp=1))
    torch.testing.assert_close(torch.tensor(checked), torch.tensor(single), rtol=1e-4, atol=1e-6)
