"""Debugging aids: see what DTensor decides and communicates without editing library code."""

from spmd.tensor.debug.comm_mode import CommDebugMode

__all__ = ["CommDebugMode"]
