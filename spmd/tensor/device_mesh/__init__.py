"""The device mesh: an n-d grid of ranks with one communicator per mesh dim.

- ``mesh``: ``DeviceMesh`` and ``current_mesh``;
- ``init``: ``init_device_mesh``, a mesh over the whole world;
- ``args``: argument checks, the rank tensor and its coordinate and group arithmetic;
- ``layout``: mesh dims as strided axes over the root mesh's ranks (slicing, flattening);
- ``flattened``: the dims each rank has flattened on each root mesh;
- ``check``: the check that every rank built the same mesh.
"""

from spmd.tensor.device_mesh.init import init_device_mesh
from spmd.tensor.device_mesh.mesh import DeviceMesh, current_mesh

__all__ = ["DeviceMesh", "init_device_mesh", "current_mesh"]
