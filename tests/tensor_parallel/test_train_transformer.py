"""The main demo, examples/train_transformer.py: a 2-d (dp x tp) run trains exactly like one device.

The threaded runs compare the loss of every step with a plain-torch run of the same model, data and
optimizer; the multi-process one runs the demo's command line under torchrun on gloo.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from spmd.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.tensor.placement import _StridedShard
from spmd.testing import load_script, run_threaded, run_torchrun

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_transformer.py"


demo = load_script(EXAMPLE)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_threaded_losses_match_single_device(sequence_parallel: bool) -> None:
    cfg = demo.Config(steps=5, sequence_parallel=sequence_parallel)
    expected = demo.train_single_device(cfg)
    per_rank = run_threaded(demo.train, cfg.dp * cfg.tp, cfg)
    for losses in per_rank:  # every rank reports the same (global) loss
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=1e-6)
    assert expected[-1] < expected[0] - 0.5, f"the loss should fall on the synthetic corpus: {expected}"


def test_main_check_prints_match(capsys: pytest.CaptureFixture[str]) -> None:
    losses = demo.main(["--steps", "3", "--check"])
    out = capsys.readouterr().out
    assert "loss matches single device" in out
    assert "all_reduce" in out and "memory per rank" in out
    assert len(losses) == 3


def test_fsdp_main_check_prints_memory_and_collectives(capsys: pytest.CaptureFixture[str]) -> None:
    """--fsdp: the same losses as one device, ~1/(dp*tp) of the training state per rank, and per-layer
    all_gathers in forward and backward and reduce_scatters in backward."""
    losses = demo.main(["--fsdp", "--steps", "3", "--check"])
    out = capsys.readouterr().out
    assert "loss matches single device (3 steps" in out and len(losses) == 3
    fractions = [float(line.split("(1/")[1].rstrip(")")) for line in out.splitlines() if "(1/" in line]
    assert len(fractions) == 4 and all(3.5 < f <= 4.0 for f in fractions), out  # 1/(2*2), a little more: tp replicates the position embedding and the norms
    per_layer = {tuple(line.split()[:2]): line.split(maxsplit=2)[2] for line in out.splitlines() if "GPT.layers." in line}
    for i in range(2):
        # over dp, one all_gather of the block's parameters before forward and again before backward, and
        # one reduce_scatter of their gradients; over tp, the sequence-parallel gathers of the attention
        # and MLP inputs and the reduce_scatters of their outputs (swapped in backward), and the
        # all_reduce of the two norms' gradients
        assert per_layer[(f"GPT.layers.{i}", "forward")] == "all_gather 3, reduce_scatter 2", out
        assert per_layer[(f"GPT.layers.{i}", "backward")] == "all_gather 3, all_reduce 2, reduce_scatter 3", out


def test_fsdp_threaded_losses_and_layouts() -> None:
    """fully_shard per block and on the root: dp shards dim 0 of every parameter (FSDP2's), inside tp's cut of it."""
    cfg = demo.Config(steps=3, fsdp=True)
    expected = demo.train_single_device(cfg)

    def run() -> tuple[list[float], dict[str, tuple[object, ...]]]:
        losses = demo.train(cfg)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = demo.apply_tp_and_dp(demo.build_model(cfg), mesh, sequence_parallel=True, fsdp=True)
        return losses, {name: p.placements for name, p in model.named_parameters()}

    losses, placements = run_threaded(run, 4)[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-4, atol=1e-6)
    strided = (_StridedShard(0, split_factor=2), Shard(0))
    assert placements["layers.0.attn.q.weight"] == strided  # column-wise: tp cuts dim 0 too
    assert placements["layers.0.mlp.down.weight"] == (Shard(0), Shard(1))  # row-wise
    assert placements["tok_emb.weight"] == strided  # vocab rows over tp
    assert placements["pos_emb"] == (Shard(0), Replicate())
    assert placements["layers.0.attn_norm.weight"] == (Shard(0), Replicate())


def test_parameters_and_gradients_follow_the_2d_layout() -> None:
    """Weights are [R, tp layout]; the dp-sharded batch gives gradients reduced back to that layout."""
    cfg = demo.Config(steps=1)

    def check() -> dict[str, int]:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = demo.apply_tp_and_dp(demo.build_model(cfg), mesh)
        layers = model.layers[0]
        assert layers.attn.q.weight.placements == (Replicate(), Shard(0))
        assert layers.mlp.down.weight.placements == (Replicate(), Shard(1))
        assert layers.attn_norm.weight.placements == (Replicate(), Replicate())
        assert model.tok_emb.weight.placements == (Replicate(), Shard(0))  # row-wise: vocab rows over tp
        inputs, targets = (distribute_tensor(t, mesh, [Shard(0), Replicate()]) for t in demo.batch_at(cfg, 0))
        with CommDebugMode() as comm:
            logits = model(inputs)
        assert isinstance(logits, DTensor) and logits.placements == (Shard(0), Shard(2))
        loss = torch.nn.functional.cross_entropy(logits.full_tensor().flatten(0, 1), targets.full_tensor().flatten())
        loss.backward()  # type: ignore[no-untyped-call]
        for name, param in model.named_parameters():
            assert isinstance(param.grad, DTensor), name
            assert param.grad.placements == param.placements, (name, param.grad.placements)
            assert not any(isinstance(p, Partial) for p in param.grad.placements)
        return comm.get_comm_counts()

    counts = run_threaded(check, 4)[0]
    # forward: one all_reduce per row-wise module (embedding; attention out and MLP down per layer)
    assert counts == {"all_reduce": 1 + 2 * cfg.n_layers}


def _torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess[str]:
    result = run_torchrun(EXAMPLE, nproc, args=args)
    assert result.returncode == 0, f"torchrun failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
    return result


@pytest.mark.multiprocess
def test_torchrun_two_processes_on_gloo() -> None:
    result = _torchrun(2, "--dp", "1", "--tp", "2", "--steps", "3", "--sequence-parallel", "--check")
    assert "loss matches single device (3 steps" in result.stdout, result.stdout
    # the progress bar (tqdm, on stderr) or the step lines vary; the summary is printed once, by rank 0
    assert result.stdout.count("trained 3 steps") == 1, "only rank 0 prints"


@pytest.mark.multiprocess
def test_torchrun_fsdp_four_processes_on_gloo() -> None:
    result = _torchrun(4, "--fsdp", "--steps", "3", "--check")
    assert "loss matches single device (3 steps" in result.stdout, result.stdout
    assert "dp=2 fully sharded (--fsdp) x tp=2" in result.stdout, result.stdout


def test_resume_on_another_mesh_continues_the_loss_curve(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--save on dp=2 x tp=2, --resume on tp=4 and on 2 ranks with FSDP: the steps after the checkpoint
    give the losses of one uninterrupted run (the checkpoint is DCP's format, each rank its own blocks)."""
    uninterrupted = demo.train_single_device(demo.Config(steps=5))
    checkpoint = str(tmp_path / "step-3")
    first = demo.main(["--steps", "3", "--save", checkpoint])
    assert (tmp_path / "step-3" / ".metadata").exists()
    for mesh in (["--dp", "1", "--tp", "4"], ["--dp", "2", "--tp", "1", "--fsdp"]):
        resumed = demo.main(["--steps", "5", "--resume", checkpoint, *mesh])
        torch.testing.assert_close(torch.tensor(first + resumed), torch.tensor(uninterrupted), rtol=1e-4, atol=1e-6)
    assert "saved step 3 to" in capsys.readouterr().out


@pytest.mark.multiprocess
def test_torchrun_fsdp_checkpoint_resumes_on_two_threads(tmp_path: Path) -> None:
    """Saved by 4 gloo processes under --fsdp, resumed by 2 rank threads with tensor parallelism only."""
    checkpoint = str(tmp_path / "step-3")
    _torchrun(4, "--fsdp", "--steps", "3", "--save", checkpoint)
    resumed = demo.main(["--steps", "5", "--resume", checkpoint, "--dp", "1", "--tp", "2"])
    expected = demo.train_single_device(demo.Config(steps=5))[3:]
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(expected), rtol=1e-4, atol=1e-6)
