"""torch.compile support for spmd DTensors: what Dynamo needs to trace DTensor code without graph breaks.

- ``values``: placements, meshes and communicators as constants Dynamo can hold and guard on,
  registered when spmd.tensor is imported (cheap: no ``torch._dynamo`` import);
- ``from_local``: ``DTensor.from_local``'s body as one opaque call in Dynamo's graph, imported only
  once a compile is under way (it imports ``torch._dynamo``, about 1.5 s);
- ``eager_frames``: Dynamo skips the dispatcher's frames when an op runs eagerly inside a compiled
  function (after a graph break).

The rest needs no registration: a DTensor is a traceable wrapper subclass (``__tensor_flatten__``),
its methods (``to_local``, ``redistribute``, ``full_tensor``, ``placements``) are plain Python that
Dynamo inlines, and the collectives are ``spmd::`` ops (spmd/comm/library_ops.py).
See docs/compile.md.
"""
