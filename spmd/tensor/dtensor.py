"""DTensor: a torch.Tensor subclass standing for a global tensor laid out over a DeviceMesh.

Each rank holds its local shard (``to_local()``) and a frozen ``DTensorSpec``. Aten ops go through
``__torch_dispatch__`` to the dispatcher; ``from_local``, ``to_local``, ``redistribute`` and
``full_tensor`` are autograd functions, so gradients come back with the right placements.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import sys
import threading
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from spmd.comm.base import full_check_here
from spmd.comm.threaded import thread_rank
from spmd.compile import values as _compile_values  # noqa: F401  (meshes, placements: constants to Dynamo)
from spmd.compile.cache_key import stable_cache_key
from spmd.compile.compiling import compiling_here
from spmd.compile.eager_frames import keep_dynamo_out_of_dispatch
from spmd.compile.guards import (
    COMPILE_LOGGER,
    CompiledInputMismatch,
    DataDependentShapeError,
    FlatContext,
    describe_change,
)
from spmd.hooks import HOOKS
from spmd.tensor import checkpoint_protocol
from spmd.tensor.device_mesh.mesh import DeviceMesh, current_mesh
from spmd.tensor.local_shards import (
    FROM_LOCAL_FIX,
    GRAD_FIX,
    check_and_gather_shape,
    compare_replicated,
    infer_global_shape,
    label_local,
    layout_strides,
)
from spmd.tensor.placement import Partial, Placement, Replicate
from spmd.tensor.redistribute.collectives import broadcast_from
from spmd.tensor.redistribute.run import Redistribute, grad_placements_for, redistribute_local
from spmd.tensor.spec import (
    DTensorSpec,
    TensorMeta,
    contiguous_strides,
    normalize_placements,
)
from spmd.tensor.torch_objects import (
    MixedDTensorLibrariesError,
    refuse_torch_object,
    torch_object_error,
    torch_operand_error,
)

__all__ = ["DTensor", "DataDependentShapeError", "implicit_replication"]


class DTensor(torch.Tensor):
    """A global tensor: ``shape`` is global, ``to_local()`` is this rank's shard."""

    _local_tensor: torch.Tensor
    _spec: DTensorSpec
    _copied_view: bool
    """A view whose input had to be redistributed first: it aliases a copy, so writes are refused."""
    __slots__ = ["_copied_view", "_local_grad_placements", "_local_tensor", "_spec"]
    _local_grad_placements: tuple[Placement, ...] | None
    """``to_local()``'s default ``grad_placements`` when set on an instance: fully_shard marks the gathered
    copies it hands a module on a mesh with a dp dim, whose local gradient is each dp rank's contribution.
    ``detach`` keeps it, and it is part of the compile context (``__tensor_flatten__``), so a compiled
    forward sees it and a differently marked input recompiles."""

    # Run Python-level torch functions as plain tensor code; only aten ops reach the dispatcher.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, local_tensor: torch.Tensor, spec: DTensorSpec, *, requires_grad: bool) -> DTensor:
        if local_tensor.requires_grad and not requires_grad:
            if torch.is_grad_enabled():  # the caller may expect autograd to reach local_tensor: say it won't
                warnings.warn(
                    "DTensor(local_tensor, spec, requires_grad=False) got a local tensor that requires grad and "
                    "detaches it, so no gradient flows back to it. To construct a DTensor that keeps the "
                    "autograd link use DTensor.from_local(local_tensor, ...); to drop it, pass local_tensor.detach()",
                    UserWarning,
                    stacklevel=2,
                )
            local_tensor = local_tensor.detach()
        return wrap_result(local_tensor, spec, cls=cls, requires_grad=requires_grad)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"DTensor(local_tensor={self._local_tensor}, spec={self._spec})"

    # ----- deepcopy (pickling: spmd/tensor/serialization.py registers it with copyreg) ------------
    def __deepcopy__(self, memo: dict[int, Any]) -> DTensor:
        """A new local tensor (and grad), the same spec and mesh; leaf DTensors only, as for tensors."""
        if id(self) in memo:
            return memo[id(self)]
        if not self.is_leaf:
            raise RuntimeError(
                "only leaf DTensors can be deep-copied, as with plain tensors; this one was computed with "
                f"autograd (grad_fn={type(self.grad_fn).__name__}); deepcopy dtensor.detach() instead"
            )
        result = DTensor(copy.deepcopy(self._local_tensor, memo), self._spec, requires_grad=self.requires_grad)
        if self.grad is not None:
            result.grad = copy.deepcopy(self.grad, memo)
        for name, value in self.__dict__.items():
            setattr(result, name, copy.deepcopy(value, memo))
        memo[id(self)] = result
        return result

    # ----- torch.compile: AOTAutograd takes a DTensor apart into its local shard and its spec -------
    def __tensor_flatten__(self) -> tuple[list[str], FlatContext]:
        """The inner tensor the compiler traces (the local shard) and the hashable context it guards on.

        The context holds the calling thread's rank in a threaded world (None elsewhere): a traced
        graph bakes in the rank's mesh coordinate and groups, so the rank threads of one process,
        which share torch.compile's cache, each get their own graph, as torchrun's processes do.
        """
        _keep_dynamo_out_of_dispatch()
        return ["_local_tensor"], (self._spec, self.requires_grad, thread_rank(), self._local_grad_placements)

    def _stable_hash_for_caching(self) -> str:
        """The key torch.compile's on-disk caches file this input under (spmd/compile/cache_key.py)."""
        return stable_cache_key(self._spec, self._local_tensor, self.requires_grad)

    @staticmethod
    def __tensor_unflatten__(
        inner_tensors: dict[str, torch.Tensor],
        context: FlatContext,
        outer_size: Any,
        outer_stride: Any,
    ) -> DTensor:
        spec, requires_grad, _, local_grad_placements = context
        meta = spec.tensor_meta
        if outer_size != meta.shape or outer_stride != meta.stride:  # torch.Size compares as a tuple
            spec = DTensorSpec(
                spec.mesh, spec.placements, TensorMeta(tuple(outer_size), tuple(outer_stride), meta.dtype)
            )
        made = DTensor(inner_tensors["_local_tensor"], spec, requires_grad=requires_grad)
        if local_grad_placements is not None:
            made._local_grad_placements = local_grad_placements
        return made

    @classmethod
    def __metadata_guard__(cls, expected: FlatContext, actual: FlatContext) -> bool:
        """torch.compile's check that a DTensor input still matches the graph it was traced for.

        A mismatch raises instead of returning False: Dynamo counts the guard as failed either way,
        and when it explains a recompile (``TORCH_LOGS=recompiles``) it prints the exception, which
        says what differs: the spec (placements, shape, stride, dtype, mesh), requires_grad or rank.
        The text is built only when printed; a rank thread checking another rank's graph pays for
        one exception object. The ``spmd.compile`` logger (at INFO) also gets a line per mismatch.
        """
        if expected == actual:
            return True
        if COMPILE_LOGGER.isEnabledFor(logging.INFO):
            COMPILE_LOGGER.info(
                "DTensor input differs from a compiled graph's: %s", describe_change(expected, actual)
            )
        raise CompiledInputMismatch(expected, actual)

    def __coerce_tangent_metadata__(self) -> DTensor:
        """A gradient flowing into a compiled backward is never Partial: reduce it first."""
        if not self._spec.has_partial:
            return self
        return self.redistribute(placements=grad_placements_for(self._spec.placements))

    def __coerce_same_metadata_as_tangent__(self, context: FlatContext, expected_type: Any = None) -> DTensor | None:
        """The runtime gradient laid out as the one the compiled backward was traced with."""
        if expected_type is not None:
            return None
        return self.redistribute(placements=context[0].placements)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:  # type: ignore[override]
        try:
            result = HOOKS.dispatch(func, args, kwargs or {})  # the dispatcher (spmd/hooks.py says why late)
        except MixedDTensorLibrariesError:
            raise
        except Exception as error:
            # While torch.compile traces, an output shape that depends on values is a symbol, and a
            # spec (hashable, static) cannot hold it: say which op it was.
            if isinstance(error, TypeError) and "SymInt" in str(error):
                raise DataDependentShapeError(func) from error
            # A DTensor of torch's the dispatcher took for a plain 0-d tensor fails inside torch: say so.
            mixed = torch_operand_error(func, args, kwargs)
            if mixed is not None:
                raise mixed from error
            raise
        if func is _DETACH and args[0]._local_grad_placements is not None:
            # The same tensor without history keeps to_local()'s default: torch.compile fakes a
            # non-leaf input (fully_shard's gathered copy) through a detach.
            result._local_grad_placements = args[0]._local_grad_placements
        return result

    # ----- indexing with Python lists ---------------------------------------------------------------
    def __getitem__(self, index: Any) -> Any:
        """``x[[0, 2]]``: torch turns the list into a plain index tensor before dispatch; a list in
        the program is the same on every rank, so that tensor counts as replicated."""
        if _is_list_index(index):
            with implicit_replication():
                return super().__getitem__(index)
        return super().__getitem__(index)

    def __setitem__(self, index: Any, value: Any) -> None:
        """``x[[0, 2]] = v`` as ``__getitem__``; a plain (not 0-d) tensor ``v`` must still be distributed."""
        plain_value = isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.ndim > 0
        if _is_list_index(index) and not plain_value:
            with implicit_replication():
                super().__setitem__(index, value)
            return
        super().__setitem__(index, value)

    # ----- metadata ---------------------------------------------------------------------------------
    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._spec.placements

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._spec.mesh

    # ----- conversions ------------------------------------------------------------------------------
    @staticmethod
    def from_local(
        local_tensor: torch.Tensor,
        device_mesh: DeviceMesh | None = None,
        placements: Sequence[Placement] | None = None,
        *,
        shape: Sequence[int] | None = None,
        stride: Sequence[int] | None = None,
        run_check: bool = False,
        grad_placements: Sequence[Placement] | None = None,
    ) -> DTensor:
        """Wrap each rank's ``local_tensor`` as the shard of one global DTensor (no data moves).

        Without ``shape`` the global shape assumes even shards (local size times the shard count)
        and the global stride keeps the local tensor's dim order; pass ``shape`` for uneven ones,
        or ``run_check=True`` to gather every rank's local meta (shape, dtype, requires_grad,
        layout), check them against each other and, for Replicate dims, broadcast the data of
        coordinate 0. Without ``device_mesh``, the mesh entered with ``with mesh:`` is used.

        ``grad_placements`` is the layout the local tensor's gradient is taken in (by default the
        DTensor's placements with Partial read as Replicate): e.g. ``[Partial()]`` hands each rank
        its unreduced contribution.
        """
        if isinstance(local_tensor, DTensor):
            raise TypeError(
                f"from_local takes this rank's plain local tensor, got a DTensor ({local_tensor._spec}); "
                "to change its placements call .redistribute(placements=...), or pass its .to_local()"
            )
        if not isinstance(local_tensor, torch.Tensor):
            raise TypeError(
                f"from_local takes this rank's local shard as one torch.Tensor, got {type(local_tensor).__name__}; "
                "each rank passes only the piece it holds"
            )
        if device_mesh is None:
            device_mesh = current_mesh()
        if not isinstance(device_mesh, DeviceMesh):
            raise torch_object_error(device_mesh, "DTensor.from_local (device_mesh)") or TypeError(
                f"from_local takes a DeviceMesh, got {type(device_mesh).__name__}; "
                'build one with init_device_mesh("cpu", (world_size,))'
            )
        if compiling_here():  # Dynamo records one opaque call (see spmd/compile/from_local.py)
            return HOOKS.from_local_in_graph(
                local_tensor, device_mesh, placements, run_check, shape, stride,
                rank=thread_rank(), grad_placements=grad_placements,
            )
        return from_local_eager(local_tensor, device_mesh, placements, run_check, shape, stride, grad_placements)

    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """This rank's shard as a plain tensor (autograd flows back into the DTensor).

        ``grad_placements`` says how the gradient of the local tensor is laid out, when it is
        not laid out as this DTensor is (e.g. ``[Partial()]`` for per-rank losses).
        """
        if not torch.is_grad_enabled():
            return self._local_tensor
        if grad_placements is None:
            grad_placements = self._local_grad_placements
        return _ToLocal.apply(self, None if grad_placements is None else tuple(grad_placements))  # type: ignore[no-untyped-call]

    def redistribute(
        self, device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None, *,
        async_op: bool = False, forward_dtype: torch.dtype | None = None, backward_dtype: torch.dtype | None = None,
    ) -> DTensor:  # fmt: skip
        """The same global tensor laid out as ``placements`` (collectives as the plan needs).

        ``forward_dtype`` casts before the collectives (the result has that dtype), e.g. to gather
        bf16 weights; ``backward_dtype`` is the dtype the gradient's collectives run in (the
        gradient still comes back in this DTensor's dtype).
        """
        if device_mesh is not None and device_mesh != self._spec.mesh:
            refuse_torch_object(device_mesh, "DTensor.redistribute (device_mesh)")
            raise ValueError(
                f"cannot redistribute from {self._spec.mesh} to another mesh {device_mesh}; "
                "redistribute only changes placements on the same mesh"
            )
        if placements is None:
            raise ValueError("redistribute needs placements, e.g. [Replicate()]")
        target = normalize_placements(placements, self._spec.mesh, self.ndim, where="DTensor.redistribute (placements)")
        if forward_dtype == self.dtype:
            forward_dtype = None
        if backward_dtype == self.dtype:
            backward_dtype = None
        if target == self._spec.placements and forward_dtype is None and backward_dtype is None:
            return self
        return Redistribute.apply(self, target, forward_dtype, backward_dtype)  # type: ignore[no-untyped-call]

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """The whole global tensor on every rank, as a plain tensor."""
        replicated = self.redistribute(placements=[Replicate()] * self._spec.mesh.ndim)
        return replicated.to_local(grad_placements=grad_placements)

    # ----- torch.distributed.checkpoint's planner protocol (see spmd/tensor/checkpoint_protocol.py) --
    def __create_write_items__(self, fqn: str, object: Any) -> list[Any]:
        return checkpoint_protocol.create_write_items(fqn, self)

    def __create_chunk_list__(self) -> list[Any]:
        return checkpoint_protocol.create_chunk_list(self)

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        return checkpoint_protocol.get_tensor_shard(self, index)


_dynamo_kept_out = False
"""Whether Dynamo has been told to skip ``__torch_dispatch__`` (done once, after it is loaded)."""


def _keep_dynamo_out_of_dispatch() -> None:
    """Once Dynamo is loaded, have it skip the dispatcher's frames (see spmd/compile/eager_frames.py)."""
    global _dynamo_kept_out
    if not _dynamo_kept_out and "torch._dynamo" in sys.modules:
        keep_dynamo_out_of_dispatch(DTensor.__torch_dispatch__.__func__.__code__)  # type: ignore[attr-defined]
        _dynamo_kept_out = True


def _is_list_index(index: Any) -> bool:
    """The index holds a Python list and no plain (not 0-d) tensor, which could differ between ranks."""
    parts = index if isinstance(index, tuple) else (index,)
    plain = any(isinstance(i, torch.Tensor) and not isinstance(i, DTensor) and i.ndim > 0 for i in parts)
    return not plain and any(isinstance(i, list) for i in parts)


def from_local_eager(
    local_tensor: torch.Tensor,
    device_mesh: DeviceMesh,
    placements: Sequence[Placement] | None,
    run_check: bool,
    shape: Sequence[int] | None,
    stride: Sequence[int] | None,
    grad_placements: Sequence[Placement] | None = None,
) -> DTensor:
    """``DTensor.from_local`` after its type checks: placements checked, then the autograd function.

    Under torch.compile this runs inside the traced call, where the mesh's properties can be read
    (Dynamo cannot read a property of a mesh it received from outside the region).
    """
    if type(local_tensor) is not torch.Tensor:  # torch's DTensor would pass for a plain local tensor
        refuse_torch_object(local_tensor, "DTensor.from_local (local_tensor)")
    if placements is None:
        placements = [Replicate()] * device_mesh.ndim
    normalized = normalize_placements(placements, device_mesh, local_tensor.ndim, where="DTensor.from_local (placements)")
    grads = None if grad_placements is None else normalize_placements(
        grad_placements, device_mesh, local_tensor.ndim, where="DTensor.from_local (grad_placements)"
    )
    return _FromLocal.apply(local_tensor, device_mesh, normalized, run_check, shape, stride, grads)  # type: ignore[no-untyped-call]


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        local: torch.Tensor,
        mesh: DeviceMesh,
        placements: tuple[Placement, ...],
        run_check: bool,
        shape: Sequence[int] | None,
        stride: Sequence[int] | None,
        grad_placements: tuple[Placement, ...] | None,
    ) -> DTensor:
        member = mesh.get_coordinate() is not None
        if run_check and member:
            global_shape = check_and_gather_shape(local, mesh, placements, shape)
            for d, p in enumerate(placements):
                if isinstance(p, Replicate):
                    local = broadcast_from(mesh, d, local.detach())
        elif shape is not None:
            global_shape = tuple(shape)
        else:
            global_shape = infer_global_shape(local.shape, mesh, placements)
        if stride is None:
            stride = layout_strides(local, global_shape)
        spec = DTensorSpec(mesh, placements, TensorMeta(tuple(global_shape), tuple(stride), local.dtype))
        if not member:  # a rank outside the mesh holds nothing of the tensor (its shape is still global)
            local = local.new_empty(0)
        ctx.label = ""
        if member and full_check_here() and not compiling_here():  # SPMD_DEBUG=check
            ctx.label = label_local(local, "DTensor.from_local")
            if not run_check:  # run_check broadcast the replicated dims already
                compare_replicated(local, spec, placements, f"the local tensor passed to {ctx.label}", FROM_LOCAL_FIX)
        ctx.spec = spec
        ctx.grad_placements = grad_placements
        # The DTensor must not alias the caller's tensor object for autograd, but may share storage.
        return DTensor(local.view_as(local), spec, requires_grad=False)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[Any, ...]:
        spec: DTensorSpec = ctx.spec
        if spec.mesh.get_coordinate() is None:  # the rank held nothing of the tensor: its local gets no gradient
            return (None,) * 7
        if full_check_here() and not compiling_here():
            what = f"the gradient arriving at the backward of {ctx.label or 'DTensor.from_local'}"
            compare_replicated(grad._local_tensor, grad._spec, grad._spec.placements, what, GRAD_FIX)
        if ctx.grad_placements is not None:
            return redistribute_local(grad._local_tensor, grad._spec, ctx.grad_placements), *(None,) * 6
        target = grad_placements_for(spec.placements)
        local = redistribute_local(grad._local_tensor, grad._spec, target)
        for d, p in enumerate(spec.placements):
            if isinstance(p, Partial):
                if p.reduce_op == "avg":
                    local = local / spec.mesh.shape[d]
                elif p.reduce_op != "sum":
                    raise NotImplementedError(
                        f"the gradient of from_local with {p} is not defined here; "
                        f"redistribute to Replicate() before the op that needs the gradient"
                    )
        return local, *(None,) * 6


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input: DTensor, grad_placements: tuple[Placement, ...] | None) -> torch.Tensor:
        ctx.spec = input._spec
        ctx.grad_placements = grad_placements
        ctx.label = ""
        if full_check_here() and not compiling_here():  # SPMD_DEBUG=check
            ctx.label = label_local(input, "to_local()")
        return input._local_tensor.view_as(input._local_tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None]:
        spec: DTensorSpec = ctx.spec
        placements = ctx.grad_placements or spec.placements
        if full_check_here() and not compiling_here() and spec.mesh.get_coordinate() is not None:
            what = f"the gradient arriving at the backward of {ctx.label or 'to_local()'}"
            compare_replicated(grad, spec, placements, what, GRAD_FIX)
        grad_spec = DTensorSpec(
            spec.mesh, tuple(placements), TensorMeta(spec.shape, contiguous_strides(spec.shape), grad.dtype)
        )
        return DTensor(grad, grad_spec, requires_grad=False), None


_DETACH = torch.ops.aten.detach.default

class _ImplicitReplication(threading.local):
    enabled = False


_implicit = _ImplicitReplication()


@contextlib.contextmanager
def implicit_replication() -> Iterator[None]:
    """Treat plain tensors mixed with DTensors as replicated (every rank must hold the same values)."""
    was = _implicit.enabled
    _implicit.enabled = True
    try:
        yield
    finally:
        _implicit.enabled = was


def plain_tensors_allowed() -> bool:
    """Whether a plain tensor among DTensors may be read as replicated: inside ``implicit_replication()``,
    or inside backward, where autograd's own formulas make them alike on every rank."""
    return _implicit.enabled or torch._C._current_graph_task_id() != -1


def wrap_result(
    local_tensor: torch.Tensor, spec: DTensorSpec, *, cls: type[DTensor] = DTensor, requires_grad: bool = False
) -> DTensor:
    """``local_tensor`` as the shard of a DTensor of ``spec``.

    The dispatcher calls this directly for a kernel's fresh result (it never requires grad:
    autograd sits above ``__torch_dispatch__``), skipping the constructor's call protocol.
    """
    meta = spec.tensor_meta
    r: DTensor
    if meta.contiguous:  # the default strides: not passing them saves parsing them
        r = torch.Tensor._make_wrapper_subclass(
            cls, meta.shape, dtype=meta.dtype, device=local_tensor.device, requires_grad=requires_grad
        )
    else:
        r = torch.Tensor._make_wrapper_subclass(
            cls, meta.shape, strides=meta.stride, dtype=meta.dtype, device=local_tensor.device, requires_grad=requires_grad
        )
    r._local_tensor = local_tensor
    r._spec = spec
    r._copied_view = False
    r._local_grad_placements = None
    return r
