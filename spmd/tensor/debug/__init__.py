"""Debugging aids: see what DTensor decides and communicates without editing library code.

* ``SPMD_DEBUG=verbose`` / ``set_verbose(True)`` / ``with verbose():`` -- one log line per op.
* ``CommDebugMode`` -- collectives and bytes, total, per op and per module.
* ``visualize_sharding(dtensor)`` -- which rank holds which block.
* ``explain(op, *args)`` -- the candidate strategies of one call, with costs.
* ``fallback_report()`` -- every op that ran on the replicate fallback, with calls and bytes
  gathered per rank (``reset_fallback_report()`` starts afresh).
* ``SPMD_DEBUG=check`` / ``with check_collectives():`` -- ranks compare each collective before
  issuing it and all raise ``CollectiveMismatchError`` if they disagree. The first two runs of each
  distinct collective are checked by default (the warm-up check; ``SPMD_DEBUG=nocheck`` /
  ``set_warmup_check(False)`` / ``with warmup_check(False):`` turn it off).
* ``SPMD_DEBUG=explicit`` / ``with explicit_redistribution():`` -- an op that would move an input
  between ranks on its own raises ``ExplicitRedistributionError`` with the ``redistribute`` line to write.
"""

from spmd.tensor.debug.check import (
    WARMUP_RUNS,
    CollectiveFingerprint,
    CollectiveMismatchError,
    check_collectives,
    is_warmup_check,
    set_check_collectives,
    set_warmup_check,
    warmup_check,
)
from spmd.tensor.debug.comm_mode import CommDebugMode
from spmd.tensor.debug.environment import configure_from_environment
from spmd.tensor.debug.explain import Explanation, explain
from spmd.tensor.debug.explicit import (
    ExplicitRedistributionError,
    explicit_redistribution,
    is_explicit_redistribution,
    set_explicit_redistribution,
)
from spmd.tensor.debug.fallbacks import FallbackRecord, FallbackReport, fallback_report, reset_fallback_report
from spmd.tensor.debug.verbose import is_verbose, set_verbose, verbose
from spmd.tensor.debug.visualize import sharding_table, visualize_sharding
from spmd.tensor.dispatch.dispatcher import DISPATCHER

__all__ = [
    "CommDebugMode",
    "set_verbose",
    "verbose",
    "is_verbose",
    "visualize_sharding",
    "sharding_table",
    "explain",
    "Explanation",
    "fallback_report",
    "reset_fallback_report",
    "FallbackReport",
    "FallbackRecord",
    "check_collectives",
    "set_check_collectives",
    "warmup_check",
    "set_warmup_check",
    "is_warmup_check",
    "WARMUP_RUNS",
    "CollectiveFingerprint",
    "CollectiveMismatchError",
    "explicit_redistribution",
    "set_explicit_redistribution",
    "is_explicit_redistribution",
    "ExplicitRedistributionError",
]

configure_from_environment()


def _clear_sharding_prop_cache() -> None:
    """Forget every cached sharding decision; the next call of each op decides afresh.

    torch's private name, which tests call between worlds: a cached decision holds its mesh, and so
    the world it belongs to, until the cache is cleared (or fills up).
    """
    DISPATCHER.clear_cache()
