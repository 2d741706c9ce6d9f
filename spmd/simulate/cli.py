"""python -m spmd.simulate: per-rank memory and per-step collectives of a plan, for a cluster you do not have.

    python -m spmd.simulate --model gpt --layers 32 --dim 4096 --heads 32 --vocab 32000 --seq 4096 \\
        --batch 1 --mesh dp=512,tp=8 [--fsdp] [--sequence-parallel] [--link intra=450GB/s,inter=50GB/s]
    python -m spmd.simulate ... --compare "dp=4096" "dp=512,tp=8" "dp=256,tp=8,fsdp" [--plot out.png]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from spmd.simulate.models import MODELS, GPTConfig, model_workload
from spmd.simulate.plan import Links, Plan, parse_links, parse_plan
from spmd.simulate.report import PlanReport, format_comparison, format_report
from spmd.simulate.runner import simulate

__all__ = ["main", "build_parser"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m spmd.simulate",
        description="Simulate one rank of a training step on N ranks (meta tensors, one CPU): "
        "memory per rank and the step's collectives, per plan.",
    )
    parser.add_argument("--model", default="gpt", help=f"built-in model: {', '.join(sorted(MODELS))}")
    parser.add_argument("--layers", type=int, default=GPTConfig.layers)
    parser.add_argument("--dim", type=int, default=GPTConfig.dim)
    parser.add_argument("--heads", type=int, default=GPTConfig.heads)
    parser.add_argument("--vocab", type=int, default=GPTConfig.vocab)
    parser.add_argument("--seq", type=int, default=GPTConfig.seq)
    parser.add_argument("--batch", type=int, default=GPTConfig.batch, help="sequences per data-parallel rank")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32", help="parameter dtype")
    parser.add_argument("--mesh", help="one plan, e.g. dp=512,tp=8 (dims outermost first)")
    parser.add_argument("--compare", nargs="+", metavar="PLAN", help='several plans, e.g. "dp=4096" "dp=256,tp=8,fsdp"')
    parser.add_argument("--fsdp", action="store_true", help="fully shard over dp (ZeRO-3) in every plan")
    parser.add_argument("--sequence-parallel", action="store_true", help="sequence-parallel norms in every plan")
    parser.add_argument("--world", type=int, help="world size to check the mesh against (default: the mesh's size)")
    parser.add_argument(
        "--rank", type=int, nargs="+", default=[0], help="the rank(s) to simulate (uneven shards differ by rank)"
    )
    parser.add_argument(
        "--link", default="", help="link bandwidths (and latencies): intra=450GB/s@3us,inter=50GB/s@10us"
    )
    parser.add_argument("--ranks-per-node", type=int, default=8, help="ranks sharing the intra-node link")
    parser.add_argument("--plot", metavar="PNG", help="also draw memory and communication per plan (needs matplotlib)")
    return parser


def _plans(args: argparse.Namespace) -> list[Plan]:
    texts = ([args.mesh] if args.mesh else []) + list(args.compare or [])
    if not texts:
        raise ValueError("give a plan with --mesh dp=512,tp=8, or several with --compare")
    return [parse_plan(text, fsdp=args.fsdp, sequence_parallel=args.sequence_parallel) for text in texts]


def run(args: argparse.Namespace) -> list[PlanReport]:
    """Simulate every plan the arguments name; print the table (one plan) or the comparison."""
    cfg = GPTConfig(
        layers=args.layers,
        dim=args.dim,
        heads=args.heads,
        vocab=args.vocab,
        seq=args.seq,
        batch=args.batch,
        dtype=_DTYPES[args.dtype],
    )
    plans = _plans(args)
    links: Links = parse_links(args.link, ranks_per_node=args.ranks_per_node)
    workloads = [model_workload(args.model, cfg, plan) for plan in plans]  # check every plan before the first runs
    if args.plot:
        from spmd.simulate.plot import require_matplotlib

        require_matplotlib()
    reports = [
        simulate(w, plan, rank=rank, world_size=args.world, links=links)
        for w, plan in zip(workloads, plans)
        for rank in args.rank
    ]
    print(format_report(reports[0]) if len(reports) == 1 else format_comparison(reports, by_rank=len(args.rank) > 1))
    if args.plot:
        from spmd.simulate.plot import plot_reports

        plot_reports(reports, args.plot)
        print(f"wrote {args.plot}")
    return reports


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        run(args)
    except (ValueError, ImportError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0
