"""Test utilities: the threaded world, gloo processes, torchrun, PyTorch's DTensor test-base surface and the oracle."""

from spmd.comm import CollectiveAbortedError, CollectiveTimeoutError, run_threaded
from spmd.testing.common_dtensor import DTensorTestBase, run_subtests, with_comms
from spmd.testing.multiprocess import RankFailed, run_multiprocess
from spmd.testing.oracle import assert_same_grads, assert_same_params, check_against_torch
from spmd.testing.scripts import load_script
from spmd.testing.seeded import seeded_module, seeded_randint, seeded_randn
from spmd.testing.torchrun import run_torchrun

__all__ = [
    "load_script",
    "run_threaded",
    "DTensorTestBase",
    "with_comms",
    "run_subtests",
    "check_against_torch",
    "assert_same_grads",
    "assert_same_params",
    "seeded_randn",
    "seeded_randint",
    "seeded_module",
    "run_multiprocess",
    "RankFailed",
    "run_torchrun",
    "CollectiveTimeoutError",
    "CollectiveAbortedError",
]
