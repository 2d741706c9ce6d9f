"""spmd.checkpoint: distributed checkpoints of DTensor state_dicts in torch.distributed.checkpoint's format.

Each rank writes only the blocks it owns (one copy of each, whatever the placements) and reads
only the blocks it needs, so a checkpoint saved on one mesh and layout loads into any other:
saved ``[Shard(0)]`` over 4 ranks, loaded ``[Replicate()]`` over 2, or ``[Shard(1), Replicate()]``
over a (2, 2) mesh. The same calls work under torchrun (c10d: ``dcp.save``/``dcp.load`` run as
they are) and in ``spmd.testing.run_threaded`` (DCP's planners driven over the threaded world).

Save and resume a model and its optimizer (every rank runs this)::

    from spmd import checkpoint

    # save, e.g. every N steps, each to its own directory
    model_sd, optim_sd = checkpoint.get_state_dict(model, optimizer)
    checkpoint.save({"model": model_sd, "optim": optim_sd, "step": step}, f"ckpt/step-{step}")

    # resume, into a model and optimizer built and parallelized as this run wants (any layout)
    model_sd, optim_sd = checkpoint.get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "step": 0}
    checkpoint.load(state, f"ckpt/step-{step}")
    checkpoint.set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    step = state["step"]

``get_state_dict``/``set_state_dict`` and the rest of ``spmd.checkpoint.state_dict`` are
``torch.distributed.checkpoint.state_dict``'s API (``StateDictOptions``, ``get_model_state_dict``,
full state_dicts...): the optimizer state is keyed by parameter name (``"0.weight"``), not by
index, so it follows the parameters into any layout.

``Partial`` DTensors are reduced before they are written. Errors on any rank (a shape or key that
does not match, a missing file) raise ``CheckpointError`` on every rank, naming the key or file. The files are DCP's (``.metadata`` plus ``__<rank>_0.distcp``), so
``torch.distributed.checkpoint`` reads them too.

Importing this package imports ``torch.distributed.checkpoint``, which itself imports
``torch.distributed.tensor``; ``spmd.tensor`` alone does not.
"""

from spmd.checkpoint.errors import CheckpointError
from spmd.checkpoint.save_load import load, reduce_partials, save
from spmd.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

__all__ = [
    "save",
    "load",
    "get_state_dict",
    "set_state_dict",
    "get_model_state_dict",
    "set_model_state_dict",
    "get_optimizer_state_dict",
    "set_optimizer_state_dict",
    "StateDictOptions",
    "reduce_partials",
    "CheckpointError",
]
