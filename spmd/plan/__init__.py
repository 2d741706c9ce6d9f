"""Choose the plan: search every parallel layout of a model on a cluster, say why, in seconds on one CPU.

>>> from spmd.plan import Cluster, Workload, LLAMA_PRESETS, search  # doctest: +SKIP
>>> result = search(LLAMA_PRESETS["8b"], Cluster(world=1024, memory=80 * 2**30), Workload(1024, 8192))  # doctest: +SKIP
>>> print(format_result(result))  # doctest: +SKIP

Modules, one job each::

  layout.py    Layout: the degrees of pp / dp_replicate / dp_shard / cp / tp, sp, ac, micro-batches, mesh order
  llama.py     the Llama- and GPT-shaped decoder the search plans, its presets and tp plan
  decoder.py   PlanModel (what the search reads of a model) and ModuleDecoder (any decoder nn.Module)
  cluster.py   Cluster (ranks, links, FLOP/s, memory) and Workload (global batch, sequence)
  program.py   one micro-batch of a layout simulated on meta (spmd.simulate's world), cut into pieces
  recorder.py  memory events, collectives and FLOPs between marks of a simulated step
  compose.py   a layout's step from its program: stages, schedule, memory, time by kind
  bounds.py    closed-form lower bounds that prune before simulating
  branch_and_bound.py  enumerate, prune, branch and bound, rank
  why.py       the reasons a plan wins: memory and time by kind, the binding constraints
  report.py    the tables, --explain, the frontier plot
  cli.py       python -m spmd.plan
"""

from spmd.plan.branch_and_bound import SearchResult, evaluate, search_layouts
from spmd.plan.cluster import Cluster, Workload
from spmd.plan.decoder import ModuleDecoder, PlanModel
from spmd.plan.layout import Layout, parse_layout
from spmd.plan.llama import GPT_PRESETS, LLAMA_PRESETS, LlamaConfig

search = search_layouts

__all__ = [
    "search",
    "search_layouts",
    "evaluate",
    "SearchResult",
    "Cluster",
    "Workload",
    "Layout",
    "parse_layout",
    "LlamaConfig",
    "ModuleDecoder",
    "PlanModel",
    "LLAMA_PRESETS",
    "GPT_PRESETS",
]
