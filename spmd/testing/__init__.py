"""Test utilities: the threaded world and PyTorch's DTensor test-base surface."""

from spmd.tensor.comm import CollectiveAbortedError, CollectiveTimeoutError, run_threaded
from spmd.testing.common_dtensor import DTensorTestBase, run_subtests, with_comms
from spmd.testing.layouts import seeded_randn
from spmd.testing.multiprocess import RankFailed, run_multiprocess

__all__ = [
    "run_threaded",
    "DTensorTestBase",
    "with_comms",
    "run_subtests",
    "seeded_randn",
    "run_multiprocess",
    "RankFailed",
    "CollectiveTimeoutError",
    "CollectiveAbortedError",
]
