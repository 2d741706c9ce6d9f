"""tau's spmd package: DTensor (``spmd.tensor``), tensor parallelism and test utilities."""

__version__ = "0.1.0"
