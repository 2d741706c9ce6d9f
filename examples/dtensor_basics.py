"""DTensor basics on a 2-d mesh (dp=2, tp=2): placements, redistribute, sharded matmuls, collectives.

It shards a tensor as [Shard(0), Replicate()], redistributes it, multiplies sharded matrices (the
mm rules decide the output placements), adds a bias and applies relu, checks every result against
plain torch, and prints the collectives CommDebugMode counted. The same file runs on 4 ranks either
as threads of one process or as 4 gloo processes:

    python examples/dtensor_basics.py
    torchrun --nproc-per-node 4 --master-addr 127.0.0.1 --master-port 29531 examples/dtensor_basics.py

(any free port will do; set GLOO_SOCKET_IFNAME=lo if the host name does not resolve to loopback).
"""

import os

import torch
import torch.distributed as dist

from spmd.tensor import Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.testing import run_threaded


def main() -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    is_rank_0 = mesh.get_rank() == 0

    def show(label: str, value: object) -> None:
        if is_rank_0:
            print(f"{label:<30}{value}")

    # Every rank builds the same global tensors and keeps only its shard. A generator of its own,
    # because the rank threads of a `python` run share torch's global RNG.
    gen = torch.Generator().manual_seed(0)
    a, b, bias = (torch.randn(*shape, generator=gen) for shape in [(8, 6), (6, 4), (4,)])

    da = distribute_tensor(a, mesh, [Shard(0), Replicate()])
    show("a", f"{da._spec}, local shard {list(da.to_local().shape)}")
    with CommDebugMode() as comm:
        a_cols = da.redistribute(mesh, [Replicate(), Shard(1)])
    show("a redistributed", f"{a_cols._spec}, collectives {comm.get_comm_counts()}")

    # mm per mesh dim: S(0) x R -> S(0) and R x S(1) -> S(1): each rank multiplies its blocks, no traffic.
    b_cols = distribute_tensor(b, mesh, [Replicate(), Shard(1)])
    with CommDebugMode() as comm:
        c = da @ b_cols
    show("a[S(0), R] @ b[R, S(1)]", f"{c._spec}, collectives {comm.get_comm_counts()}")

    # S(1) x S(0) -> P(sum): each tp rank holds a partial product; the sum is reduced only when needed.
    b_rows = distribute_tensor(b, mesh, [Replicate(), Shard(0)])
    d_bias = distribute_tensor(bias, mesh, [Replicate(), Replicate()])
    with CommDebugMode() as comm:
        partial = a_cols @ b_rows
        # A bias cannot be added to every addend, so the sum is reduced first: the propagator picks a
        # reduce_scatter (to S(0)), cheaper than an all_reduce.
        y = (partial + d_bias).relu()
    show("a[R, S(1)] @ b[R, S(0)]", f"{partial._spec}")
    show("relu(a @ b + bias)", f"{y._spec}")
    if is_rank_0:
        print("collectives for mm + add + relu:")
        print(comm)

    torch.testing.assert_close(c.full_tensor(), a @ b)
    torch.testing.assert_close(y.full_tensor(), torch.relu(a @ b + bias))
    show("full_tensor() == plain torch", True)


if __name__ == "__main__":
    if "RANK" in os.environ:  # launched by torchrun: one process per rank, gloo collectives
        dist.init_process_group("gloo")
        try:
            main()
        finally:
            dist.destroy_process_group()
    else:  # a plain `python` run: 4 ranks as threads of this process
        run_threaded(main, 4)
