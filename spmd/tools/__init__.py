"""Maintenance tools for the spmd repository (not part of the runtime library)."""
