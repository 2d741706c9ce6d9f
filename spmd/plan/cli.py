"""python -m spmd.plan: the fastest parallel layouts of a model on a cluster, and why.

python -m spmd.plan --model llama --preset 8b --world 1024 --ranks-per-node 8 --memory 80GiB
python -m spmd.plan --model llama --preset 70b --world 4096 --memory 80GiB --global-batch 2048
python -m spmd.plan ... --explain "fsdp=128,tp=8,sp"     # one plan's collectives and their ops
python -m spmd.plan ... --plot frontier.png              # memory against step time
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import time
from collections.abc import Sequence

import torch

from spmd.plan.branch_and_bound import evaluate, not_searched, search_layouts
from spmd.plan.cluster import Cluster, Workload
from spmd.plan.decoder import ModuleDecoder, PlanModel
from spmd.plan.layout import parse_layout
from spmd.plan.llama import GPT_PRESETS, LLAMA_PRESETS, LlamaConfig
from spmd.plan.report import format_explain, format_header, format_result, plot_frontier
from spmd.simulate.plan import parse_links

__all__ = ["main", "build_parser", "parse_bytes"]

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_PRESETS = {"llama": LLAMA_PRESETS, "gpt": GPT_PRESETS}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]i?)?B?\s*$")
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(text: str) -> int:
    """``"80GiB"``, ``"80GB"``, ``"1.5TiB"`` or a plain number of bytes."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"--memory {text!r}: write bytes such as 80GiB, 96GB or 85899345920")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m spmd.plan",
        description="Search the parallel layouts (dp, fsdp, hsdp, tp, sp, cp, pp, activation checkpointing, "
        "micro-batches, mesh order) of a model on a cluster: each simulated on meta tensors through spmd, "
        "ranked by step time, with the reasons.",
    )
    parser.add_argument(
        "--model", default="llama", help="llama, gpt, or package.module:NAME naming a spmd.plan.ModuleDecoder"
    )
    parser.add_argument("--preset", default="8b", help="llama: debug, 1b, 8b, 70b, 405b; gpt: demo, 7b")
    for name in ("layers", "dim", "heads", "kv-heads", "ffn-dim", "vocab"):
        parser.add_argument(f"--{name}", type=int, help=f"override the preset's {name}")
    parser.add_argument("--world", type=int, required=True, help="ranks in the job")
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--memory", default="80GiB", help="bytes per rank, e.g. 80GiB")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense TFLOP/s per rank at --dtype")
    parser.add_argument(
        "--memory-bandwidth",
        type=float,
        help="GB/s of one rank's memory, to price memory-bound ops (norms, activations, optimizer); unpriced "
        "by default (FLOP-bound)",
    )
    parser.add_argument(
        "--efficiency", type=float, default=1.0, help="share of the peak the kernels reach (1.0: the FLOP bound)"
    )
    parser.add_argument("--link", default="", help="intra=450GB/s@3us,inter=50GB/s@10us")
    parser.add_argument("--global-batch", type=int, help="sequences per step (default: one per rank)")
    parser.add_argument("--seq", type=int, default=8192, help="tokens per sequence")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    parser.add_argument("--top", type=int, default=5, help="how many plans to rank")
    parser.add_argument("--explain", metavar="PLAN", help='one plan, e.g. "fsdp=128,tp=8,sp,ac=full"')
    parser.add_argument("--plot", metavar="PNG", help="draw the frontier of memory against step time")
    return parser


def model_config(args: argparse.Namespace) -> PlanModel:
    """The built-in preset, with the size flags applied; or ``--model package.module:NAME``, a
    ``ModuleDecoder`` (or ``LlamaConfig``) defined in the user's code."""
    if ":" in args.model:
        return _imported_model(args.model)
    if args.model not in _PRESETS:
        raise ValueError(f"--model {args.model!r}: write llama, gpt, or package.module:NAME for a ModuleDecoder")
    presets = _PRESETS[args.model]
    if args.preset not in presets:
        raise ValueError(f"--preset {args.preset!r}: the {args.model} presets are {sorted(presets)}")
    cfg = presets[args.preset]
    overrides = {"layers": args.layers, "dim": args.dim, "heads": args.heads, "kv_heads": args.kv_heads,
                 "ffn_dim": args.ffn_dim, "vocab": args.vocab}  # fmt: skip
    fields = {name: getattr(cfg, name) for name in (*overrides, "gated")}
    fields.update({name: value for name, value in overrides.items() if value is not None})
    cfg = LlamaConfig(**fields)
    if cfg.dim % cfg.heads or cfg.heads % cfg.kv_heads:
        raise ValueError(
            f"--dim {cfg.dim}, --heads {cfg.heads}, --kv-heads {cfg.kv_heads}: heads must divide dim and kv heads divide heads"
        )
    return cfg


def _imported_model(text: str) -> PlanModel:
    module_name, _, attr = text.partition(":")
    try:
        model = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"--model {text!r}: cannot import {attr!r} from {module_name!r} ({error})") from error
    if not isinstance(model, (ModuleDecoder, LlamaConfig)):
        raise ValueError(f"--model {text!r} is a {type(model).__name__}; give a spmd.plan.ModuleDecoder")
    return model


def run(args: argparse.Namespace) -> str:
    cfg = model_config(args)
    links = parse_links(args.link, ranks_per_node=args.ranks_per_node)
    if not 0 < args.efficiency <= 1:
        raise ValueError(f"--efficiency {args.efficiency}: give the share of the peak, in (0, 1]")
    flops = args.peak_tflops * 1e12
    cluster = Cluster(
        world=args.world,
        memory=parse_bytes(args.memory),
        ranks_per_node=args.ranks_per_node,
        peak_flops=flops,
        memory_bandwidth=None if args.memory_bandwidth is None else args.memory_bandwidth * 1e9,
        links=links,
        compute_efficiency=args.efficiency,
    )
    workload = Workload(args.global_batch or args.world, args.seq)
    dtype = _DTYPES[args.dtype]
    name = str(cfg) if ":" in args.model else f"{args.model} {args.preset}"
    if args.explain:
        layout = parse_layout(args.explain)
        if layout.world_size != cluster.world:
            raise ValueError(f"--explain {args.explain!r} holds {layout.world_size} ranks, not --world {cluster.world}")
        reason = not_searched(layout)
        if reason is not None:
            raise ValueError(f"--explain {args.explain!r}: spmd cannot run this layout yet")
        started = time.perf_counter()
        estimate = evaluate(cfg, layout, cluster, workload, dtype, keep_order=True)
        header = format_header(cfg, name, cluster, workload, dtype)
        return f"{header}\n\n{format_explain(estimate, cfg, cluster, workload, dtype)}\n\n(simulated in {time.perf_counter() - started:.1f} s)"
    result = search_layouts(cfg, cluster, workload, top_k=args.top, dtype=dtype)
    text = format_result(result, name)
    if args.plot:
        plot_frontier(result, args.plot)
        text += f"\n\nwrote {args.plot}"
    return text


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        print(run(args))
    except (ValueError, ImportError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0
