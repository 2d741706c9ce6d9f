"""What ``torch.distributed._tensor.placement_types`` (torch's old path) means inside a redirected package.

The old module held the placements and, before torch moved them to ``_dtensor_spec``, the spec
classes too; code written then (torchtune) still imports ``DTensorSpec`` and ``TensorMeta`` from it.
"""

from spmd.tensor.placement import Partial, Placement, Replicate, Shard, _StridedShard
from spmd.tensor.spec import DTensorSpec, TensorMeta

__all__ = ["Placement", "Shard", "Replicate", "Partial", "_StridedShard", "DTensorSpec", "TensorMeta"]
