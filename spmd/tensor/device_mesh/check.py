"""The check ``init_device_mesh`` runs first: every rank passed the same mesh shape and names.

One all_gather of a 16-byte tensor (a digest and a length) per mesh; only when the digests differ
do the ranks exchange their arguments themselves, to name who passed what. Tensors, not
``all_gather_object``: that pickles through numpy on c10d and fails where numpy is missing.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from spmd.comm import World

__all__ = ["check_ranks_agree"]


def check_ranks_agree(world: World, mesh_shape: tuple[int, ...], names: Any, timeout_s: float | None) -> None:
    """Raise on every rank, naming the ranks that differ, unless all passed ``mesh_shape`` and ``names``."""
    everyone = tuple(range(world.size))
    world.create_groups([everyone], timeout_s=timeout_s)
    comm = world.communicator(everyone)
    if getattr(comm, "backend", None) == "fake":  # a fake process group has no peers to compare with
        return
    mine = f"mesh_shape={mesh_shape}, mesh_dim_names={names}".encode()
    digest = int.from_bytes(hashlib.sha256(mine).digest()[:8], "little", signed=True)
    # CPU tensors, also under `with torch.device("meta")`. The raw collective: this check is set-up, not traffic a CommDebugMode should count.
    gathered = comm._all_gather(torch.tensor([digest, len(mine)], dtype=torch.int64, device="cpu"))
    if bool((gathered[:, 0] == digest).all()):
        return
    longest = int(gathered[:, 1].max())
    padded = torch.zeros(longest, dtype=torch.uint8, device="cpu")
    padded[: len(mine)] = torch.tensor(list(mine), dtype=torch.uint8, device="cpu")
    described = comm._all_gather(padded)
    by_args: dict[str, list[int]] = {}
    for rank, (row, length) in enumerate(zip(described.tolist(), gathered[:, 1].tolist())):
        by_args.setdefault(bytes(row[:length]).decode(), []).append(rank)
    listed = "; ".join(f"ranks {ranks}: {args}" for args, ranks in by_args.items())
    raise ValueError(
        f"init_device_mesh was called with different arguments on different ranks ({listed}); "
        "every rank must build the same mesh"
    )
