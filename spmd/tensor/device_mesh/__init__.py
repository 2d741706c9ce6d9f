"""The device mesh: an n-d grid of ranks with one communicator per mesh dim.

- ``mesh``: ``DeviceMesh`` and ``init_device_mesh`` (this package's public names);
- ``args``: argument checks and the rank tensor;
- ``layout``: mesh dims as strided axes over the root mesh's ranks (slicing, flattening);
- ``check``: the check that every rank built the same mesh.
"""

from spmd.tensor.device_mesh.mesh import DeviceMesh, current_mesh, init_device_mesh

__all__ = ["DeviceMesh", "init_device_mesh", "current_mesh"]
