"""Memory per rank and communication per step, one bar group per plan, as a PNG.

matplotlib is imported here, only when a plot is asked for; without it the error says how to get it.
"""

from __future__ import annotations

from collections.abc import Sequence

from spmd.simulate.report import PlanReport

__all__ = ["plot_reports", "require_matplotlib"]

_GIB = 2.0**30


def require_matplotlib() -> None:
    """Raise ImportError with the fix if matplotlib is missing (checked before a long simulation)."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(
            "--plot needs matplotlib, which is not installed; pip install matplotlib (or the dev extra: pip install -e '.[dev]')"
        ) from None
    matplotlib.use("Agg")  # files only, no display


def plot_reports(reports: Sequence[PlanReport], path: str) -> None:
    """Write a two-panel PNG: stacked memory (GiB per rank) and collective bytes and ring time per step."""
    require_matplotlib()
    import matplotlib.pyplot as plt

    names = [r.plan for r in reports]
    xs = range(len(reports))
    fig, (memory, comm) = plt.subplots(1, 2, figsize=(max(8.0, 2.5 * len(reports) + 4), 4.5))
    bottom = [0.0] * len(reports)
    parts = (
        ("parameters", [r.state.params for r in reports]),
        ("gradients", [r.state.grads for r in reports]),
        ("optimizer state", [r.state.optimizer for r in reports]),
        ("activations (peak)", [r.activations_peak for r in reports]),
    )
    for label, values in parts:
        gib = [v / _GIB for v in values]
        memory.bar(xs, gib, bottom=bottom, label=label)
        bottom = [b + g for b, g in zip(bottom, gib)]
    memory.set_title("memory per rank")
    memory.set_ylabel("GiB")
    memory.set_xticks(list(xs), names, rotation=20, ha="right")
    memory.legend(fontsize="small")
    comm.bar(xs, [r.comm_bytes / _GIB for r in reports], color="tab:purple")
    comm.set_title("collectives per step (bar: GiB received; label: ring time)")
    comm.set_ylabel("GiB received per rank")
    comm.set_xticks(list(xs), names, rotation=20, ha="right")
    for x, r in zip(xs, reports):
        comm.annotate(f"{r.comm_seconds:.3g} s", (x, r.comm_bytes / _GIB), ha="center", va="bottom", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
