"""local_map: run a function written for plain tensors on each rank's shards of DTensors.

The wrapped function sees ``to_local()`` tensors and its tensor results are wrapped back with
``DTensor.from_local`` under the placements the caller names. Nothing moves unless the caller asks
for it (``redistribute_inputs=True``): the caller states the layouts, and the function's body is the
per-rank program (it may call collectives itself, e.g. to finish a partial sum).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch.utils import _pytree as pytree

from spmd.tensor.device_mesh.mesh import DeviceMesh
from spmd.tensor.dtensor import DTensor
from spmd.tensor.placement import Placement, format_placements
from spmd.tensor.spec import normalize_placements
from spmd.tensor.torch_objects import refuse_torch_object, torch_object_error

__all__ = ["local_map"]

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)

TensorPlacements = Sequence[Placement] | None
"""The placements of one tensor (one per mesh dim), or None for a value that is not a tensor."""
PerArgument = tuple[TensorPlacements, ...] | None
"""One ``TensorPlacements`` per flattened positional argument, or None for no check."""
PerOutput = TensorPlacements | tuple[TensorPlacements, ...]
"""One ``TensorPlacements`` for a single output, or a tuple of them for several."""


def local_map(
    func: Callable[..., Any] | None = None,
    out_placements: PerOutput = None,
    in_placements: PerArgument = None,
    in_grad_placements: PerArgument = None,
    device_mesh: DeviceMesh | None = None,
    *,
    redistribute_inputs: bool = False,
) -> Any:
    """Wrap ``func`` (written for ``torch.Tensor``) so that it takes DTensors and returns DTensors.

    Each DTensor among the positional arguments (after pytree flattening) is handed to ``func`` as
    its ``to_local()`` shard; each tensor ``func`` returns becomes ``DTensor.from_local(out,
    device_mesh, placements)``. Without ``func`` this returns a decorator.

    * ``out_placements``: the placements of ``func``'s flattened outputs, one entry per output (a
      tuple of them when there are several); None for an output that is not a tensor.
    * ``in_placements``: one entry per flattened positional argument: the placements each DTensor
      must have (None for non-tensor arguments; plain tensors are passed as they are, whatever
      their entry). A DTensor laid out otherwise is redistributed when ``redistribute_inputs`` is
      True, else ``ValueError`` names it. None: inputs are taken as they come.
    * ``in_grad_placements``: per flattened argument, the layout of the gradient of its local tensor
      when it differs from the DTensor's own (e.g. ``[Partial()]`` when each rank's local gradient
      is only its contribution); passed to ``to_local(grad_placements=...)``.
    * ``device_mesh``: the mesh of the outputs; by default that of the first DTensor argument.

    When no argument is a DTensor, ``func`` runs unchanged on what it was given and its result is
    returned as it is (``out_placements`` is then ignored). Keyword arguments go to ``func``
    untouched. For example, a row-parallel matmul whose partial sums are finished by hand::

        def local_mm(w, x):
            return mesh.get_communicator(0).all_reduce(w @ x, "sum")

        mm = local_map(local_mm, out_placements=[Replicate()], in_placements=([Shard(1)], [Shard(0)]))
        y = mm(w_dt, x_dt)  # a Replicate DTensor equal to w @ x
    """
    if device_mesh is not None and not isinstance(device_mesh, DeviceMesh):
        raise torch_object_error(device_mesh, "local_map (device_mesh)") or TypeError(
            f"local_map takes a DeviceMesh as device_mesh, got {type(device_mesh).__name__}"
        )
    for name, entries in (("out_placements", out_placements), ("in_placements", in_placements),
                          ("in_grad_placements", in_grad_placements)):
        _refuse_torch_placements(name, entries)
    if func is None:  # used as @local_map(...): the same options, the function comes next
        options = (out_placements, in_placements, in_grad_placements, device_mesh)
        return lambda f: local_map(f, *options, redistribute_inputs=redistribute_inputs)

    @functools.wraps(func)
    def run_on_shards(*args: Any, **kwargs: Any) -> Any:
        leaves, layout = pytree.tree_flatten(args)
        _check_count("in_placements", in_placements, len(leaves), "flattened positional argument")
        _check_count("in_grad_placements", in_grad_placements, len(leaves), "flattened positional argument")
        local_leaves, first_mesh = _to_local_leaves(leaves, in_placements, in_grad_placements, redistribute_inputs)
        result = func(*pytree.tree_unflatten(local_leaves, layout), **kwargs)
        if first_mesh is None:  # no DTensor argument: func ran as it would without local_map
            return result
        return _wrap_outputs(result, out_placements, device_mesh if device_mesh is not None else first_mesh)

    return run_on_shards


def _to_local_leaves(
    leaves: Sequence[Any], in_placements: PerArgument, in_grad_placements: PerArgument, redistribute: bool
) -> tuple[list[Any], DeviceMesh | None]:
    """The flattened arguments as ``func`` sees them (each DTensor checked, then its local shard) and
    the first DTensor's mesh (None when no argument is a DTensor)."""
    first_mesh: DeviceMesh | None = None
    local_leaves: list[Any] = []
    for index, leaf in enumerate(leaves):
        if not isinstance(leaf, DTensor):
            if isinstance(leaf, torch.Tensor) and type(leaf) not in _PLAIN_TENSORS:  # torch's DTensor is not plain
                refuse_torch_object(leaf, f"local_map (argument {index})")
            if in_placements is not None and in_placements[index] is not None and not isinstance(leaf, torch.Tensor):
                raise AssertionError(
                    f"local_map: argument {index} is a {type(leaf).__name__}, not a tensor, so its "
                    f"in_placements entry must be None, got {_show(in_placements[index])}"
                )
            local_leaves.append(leaf)
            continue
        if first_mesh is None:
            first_mesh = leaf.device_mesh
        if in_placements is not None:
            leaf = _laid_out_as(leaf, index, in_placements[index], redistribute)
        grad_placements = None
        if in_grad_placements is not None:
            grad_placements = _placements_of(leaf, index, in_grad_placements[index], "in_grad_placements")
        local_leaves.append(leaf.to_local(grad_placements=grad_placements))
    return local_leaves, first_mesh


def _refuse_torch_placements(name: str, entries: Any) -> None:
    """torch's placements anywhere in one of local_map's placement arguments (checked once, when wrapping)."""
    if isinstance(entries, (list, tuple)):
        for entry in entries:
            _refuse_torch_placements(name, entry)
    elif entries is not None and not isinstance(entries, Placement):
        refuse_torch_object(entries, f"local_map ({name})")


def _check_count(name: str, entries: PerArgument, expected: int, what: str) -> None:
    if entries is not None and len(entries) != expected:
        raise AssertionError(
            f"local_map: {name} has {len(entries)} entries but the call has {expected} {what}s; give one "
            "entry per flattened positional argument (None for arguments that are not tensors)"
        )


def _placements_of(arg: DTensor, index: int, entry: TensorPlacements, name: str) -> tuple[Placement, ...]:
    """``entry`` checked against ``arg``'s mesh and rank (negative shard dims made positive)."""
    if entry is None:
        raise AssertionError(
            f"local_map: argument {index} is a DTensor {format_placements(arg.placements)} but its {name} entry "
            "is None; give its placements, e.g. [Shard(0)]"
        )
    return normalize_placements(entry, arg.device_mesh, arg.ndim)


def _laid_out_as(arg: DTensor, index: int, entry: TensorPlacements, redistribute: bool) -> DTensor:
    """``arg`` in the placements ``entry`` asks for: redistributed if allowed, else a ValueError."""
    wanted = _placements_of(arg, index, entry, "in_placements")
    if arg.placements == wanted:
        return arg
    if not redistribute:
        raise ValueError(
            f"local_map: argument {index} is a DTensor of shape {list(arg.shape)} placed "
            f"{format_placements(arg.placements)}, but in_placements asks for {format_placements(wanted)}; "
            f"redistribute it first (x.redistribute(placements={list(wanted)})) or pass "
            "redistribute_inputs=True to local_map"
        )
    return arg.redistribute(placements=wanted)


def _wrap_outputs(result: Any, out_placements: PerOutput, mesh: DeviceMesh) -> Any:
    """``func``'s flattened tensor results as DTensors on ``mesh``; other values as they are."""
    outputs, layout = pytree.tree_flatten(result)
    entries = _output_entries(out_placements)
    if len(entries) != len(outputs):
        raise AssertionError(
            f"local_map: func returned {len(outputs)} values (flattened) but out_placements gives "
            f"{len(entries)}; give one placements entry per returned value, as a tuple when there are "
            "several (None for values that are not tensors)"
        )
    wrapped: list[Any] = []
    for index, (value, entry) in enumerate(zip(outputs, entries)):
        if isinstance(value, DTensor):
            raise AssertionError(
                f"local_map: func returned a DTensor as output {index} ({value._spec}); it runs on local "
                "tensors and must return plain tensors (call .to_local() on it inside func)"
            )
        if not isinstance(value, torch.Tensor):
            if entry is not None:
                raise AssertionError(
                    f"local_map: output {index} is a {type(value).__name__}, not a tensor, so its "
                    f"out_placements entry must be None, got {_show(entry)}"
                )
            wrapped.append(value)
            continue
        if entry is None:
            raise AssertionError(
                f"local_map: output {index} is a tensor but its out_placements entry is None; give the "
                "placements its local pieces make up, e.g. [Shard(0)]"
            )
        wrapped.append(DTensor.from_local(value, mesh, entry, run_check=False))
    return pytree.tree_unflatten(wrapped, layout)


def _output_entries(out_placements: PerOutput) -> list[TensorPlacements]:
    """One entry per output: a tuple of entries is many outputs, anything else is one output's.

    A tuple of bare placements (``(Shard(0), Replicate())``) is one output's placements on a 2-d
    mesh: it cannot mean several outputs, whose entries are sequences or None.
    """
    if not isinstance(out_placements, tuple):
        return [out_placements]
    if out_placements and all(isinstance(p, Placement) for p in out_placements):
        return [cast(tuple[Placement, ...], out_placements)]
    return [cast(TensorPlacements, entry) for entry in out_placements]


def _show(entry: Any) -> str:
    if isinstance(entry, (list, tuple)) and all(isinstance(p, Placement) for p in entry):
        return format_placements(entry)
    return repr(entry)
