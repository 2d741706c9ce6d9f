"""Replica check: do the ranks of a mesh dim hold the same values where a DTensor says Replicate?

Runs under the full collective check (``SPMD_DEBUG=check``) at the two places a Replicate claim
enters from local code: ``DTensor.from_local(x, mesh, [..., Replicate(), ...])`` (the forward
values) and the gradients arriving at ``to_local()``'s and ``from_local``'s backward. Each rank
all-gathers a 24-byte summary of its values over the mesh dim (a position-weighted sum, the sum and
the sum of magnitudes, in float64), so a permutation is caught as well as a changed value. Summaries
equal within ``REPLICA_RTOL`` of the magnitude pass; a kernel's last-bit noise is not a mismatch.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from types import FrameType

import torch
from torch._subclasses.fake_tensor import is_fake

from spmd.comm.base import CollectiveMismatchError, Communicator, collective_name

__all__ = ["REPLICA_RTOL", "ReplicaMismatchError", "compare_replicas", "user_frame", "call_site", "tensor_label"]

REPLICA_RTOL = 1e-5
"""Relative tolerance on the summaries (of the sum of magnitudes) below which replicas count as equal."""


class ReplicaMismatchError(CollectiveMismatchError):
    """Ranks of a mesh dim hold different values where a DTensor claims Replicate (raised on each of them)."""


def _summary(local: torch.Tensor) -> torch.Tensor:
    values = local.detach().reshape(-1)
    if values.is_complex():
        values = torch.view_as_real(values).reshape(-1)
    values = values.to(torch.float64)
    if values.numel() == 0:
        return torch.zeros(3, dtype=torch.float64, device=values.device)
    # Weights that differ per position (and are the same on every rank) make a permutation visible.
    weights = torch.cos(torch.arange(values.numel(), dtype=torch.float64, device=values.device) * 0.7548776662)
    return torch.stack([(values * weights).sum(), values.sum(), values.abs().sum()])


def compare_replicas(local: torch.Tensor, comm: Communicator, describe: str, fix: str) -> None:
    """Raise ``ReplicaMismatchError`` on every rank of ``comm`` if their ``local`` values differ.

    ``describe`` names the tensor and its claim ("the gradient of Linear.weight, Replicate on mesh
    dim 'tp'"); ``fix`` says what to do. One all_gather of 24 bytes over the group. Nothing while
    the compiler traces ``local`` as a fake tensor: the peers' compiled graphs hold no check to meet.
    """
    if is_fake(local):
        return
    summaries = comm._all_gather(_summary(local)).cpu()
    finite = torch.nan_to_num(summaries, nan=0.0, posinf=1e300, neginf=-1e300)
    scale = finite[:, 2].abs().max().item()
    tolerance = REPLICA_RTOL * max(scale, 1e-30)
    groups: list[list[int]] = []
    for i in range(comm.size):
        for group in groups:
            if bool(((finite[i] - finite[group[0]]).abs() <= tolerance).all()):
                group.append(i)
                break
        else:
            groups.append([i])
    if len(groups) == 1:
        return
    reference = max(groups, key=len)  # the majority's values (the lowest rank's, on a tie)
    differing = [comm.ranks[i] for group in groups if group is not reference for i in group]
    same = [comm.ranks[i] for i in reference]
    where = collective_name("", comm.ranks, comm.mesh_dim).strip()  # "on mesh dim 'tp' (ranks [0, 1])"
    raise ReplicaMismatchError(
        f"rank {comm.ranks[comm.local_rank]}: replica check: {describe} claims Replicate {where}, but the "
        f"ranks hold different values there: ranks {differing} differ from ranks {same}. {fix}"
    )


_SPMD_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The spmd package's folder (this file is spmd/comm/replicas.py)."""
_LIBRARY_DIRS = (
    _SPMD_DIR + os.sep,
    *(os.path.dirname(module.__file__ or "") + os.sep for module in (torch, contextlib, threading)),
)


def user_frame(start: FrameType | None = None) -> FrameType | None:
    """The innermost frame outside spmd, torch and the standard library, from ``start`` (default: the
    caller's) outwards: where the user's code is."""
    frame: FrameType | None = sys._getframe(1) if start is None else start
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame = frame.f_back
    return frame


def call_site(frame: FrameType | None) -> str:
    """``file.py:42 in step`` (relative to the working directory when under it)."""
    if frame is None:
        return "<unknown>"
    path = frame.f_code.co_filename
    with contextlib.suppress(ValueError):
        relative = os.path.relpath(path)
        path = path if relative.startswith("..") else relative
    return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"


def tensor_label(tensor: torch.Tensor, frame: FrameType | None) -> str:
    """What the user calls ``tensor`` in ``frame``: a module's parameter (``Linear.weight``), a local
    variable's name, or "" when neither holds it."""
    if frame is None:
        return ""
    for name, value in frame.f_locals.items():
        if value is tensor:
            return name
        if isinstance(value, torch.nn.Module):
            for param_name, param in value.named_parameters():
                if param is tensor:
                    return f"{type(value).__name__}.{param_name}"
    return ""
