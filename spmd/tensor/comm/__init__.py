"""Legacy path of ``spmd.comm`` (the collective backends moved out of ``spmd.tensor``)."""

from spmd.comm import *  # noqa: F403
from spmd.comm import __all__ as __all__
