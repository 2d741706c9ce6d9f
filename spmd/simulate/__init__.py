"""Plan at the scale of a cluster on one CPU: simulate one rank's training step on N ranks.

The simulated world runs one rank's program on meta tensors: DeviceMesh, DTensor, redistribute,
every op rule, ``parallelize_module`` and ``fully_shard`` work unchanged; collectives return
correctly shaped results and are recorded, not moved. The report gives per-rank memory (parameters,
gradients, optimizer state, activation peak) and the step's collectives by kind and mesh dim with
a ring-model time.

>>> from spmd.simulate import GPTConfig, model_workload, parse_plan, simulate  # doctest: +SKIP
>>> plan = parse_plan("dp=512,tp=8")  # doctest: +SKIP
>>> report = simulate(model_workload("gpt", GPTConfig(layers=32, dim=4096, heads=32), plan), plan)  # doctest: +SKIP

Modules, one job each::

  world.py           SimulatedWorld / SimulatedCommunicator: N ranks, one runs, nothing moves
  meta_semantics.py  value reads and attention on meta tensors behave as on CPU
  memory.py          storage lifetimes on the simulated rank -> peak bytes; training-state bytes
  plan.py            Plan and Links, parsed from "dp=256,tp=8,fsdp" and "intra=450GB/s,inter=50GB/s"
  models.py          the built-in models ("gpt") and how a plan parallelises and trains them
  runner.py          simulate(workload, plan): build, warm-up step, measured step, report
  report.py          collectives by kind and mesh dim, the ring model, the tables
  plot.py            memory and communication per plan as a PNG (matplotlib, imported on demand)
  cli.py             python -m spmd.simulate
"""

from spmd.simulate.memory import MemoryTracker, StateBytes, training_state_bytes
from spmd.simulate.models import MODELS, GPTConfig, GPTWorkload, model_workload
from spmd.simulate.plan import Link, Links, Plan, parse_links, parse_plan
from spmd.simulate.report import CollectiveStat, PlanReport, collective_stats, format_comparison, format_report
from spmd.simulate.runner import Workload, simulate
from spmd.simulate.world import SimulatedCommunicator, SimulatedWorld

__all__ = [
    "simulate",
    "Workload",
    "SimulatedWorld",
    "SimulatedCommunicator",
    "Plan",
    "Link",
    "Links",
    "parse_plan",
    "parse_links",
    "GPTConfig",
    "GPTWorkload",
    "MODELS",
    "model_workload",
    "PlanReport",
    "CollectiveStat",
    "collective_stats",
    "format_report",
    "format_comparison",
    "MemoryTracker",
    "StateBytes",
    "training_state_bytes",
]
