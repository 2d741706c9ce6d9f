"""The labeler config (actions/labeler v5) tags DTensor, tensor-parallel, FSDP and checkpoint changes with PyTorch's module labels."""

from __future__ import annotations

from fnmatch import fnmatch
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

LABELER = Path(__file__).resolve().parents[2] / ".github" / "labeler.yml"


def labels_for(path: str) -> set[str]:
    config = yaml.safe_load(LABELER.read_text())
    found = set()
    for label, rules in config.items():
        for rule in rules:
            for matcher in rule["changed-files"]:
                if any(fnmatch(path, glob.replace("**", "*")) for glob in matcher["any-glob-to-any-file"]):
                    found.add(label)
    return found


def test_labeler_is_v5_shaped() -> None:
    config = yaml.safe_load(LABELER.read_text())
    assert set(config) == {"module: dtensor", "module: tensor parallel", "module: fsdp", "module: distributed_checkpoint"}
    for rules in config.values():
        assert all(set(rule) == {"changed-files"} for rule in rules)


@pytest.mark.parametrize(
    ("path", "labels"),
    [
        ("spmd/tensor/dispatch/dispatcher.py", {"module: dtensor"}),
        ("tests/tensor/ops/test_views.py", {"module: dtensor"}),
        ("tests/comm/test_faults_gloo.py", {"module: dtensor"}),
        ("spmd/tensor_parallel/linear.py", {"module: tensor parallel"}),
        ("tests/tensor_parallel/test_styles.py", {"module: tensor parallel"}),
        ("spmd/tensor/parallel/__init__.py", {"module: dtensor", "module: tensor parallel"}),
        ("spmd/fsdp/state.py", {"module: fsdp"}),
        ("tests/checkpoint/test_dcp.py", {"module: distributed_checkpoint"}),
        ("spmd/tensor/checkpoint_protocol.py", {"module: dtensor", "module: distributed_checkpoint"}),
        ("README.md", set()),
    ],
)
def test_paths_get_module_labels(path: str, labels: set[str]) -> None:
    assert labels_for(path) == labels
