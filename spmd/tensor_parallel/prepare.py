"""PrepareModuleInput / PrepareModuleOutput: lay out a module's inputs or outputs, leave its parameters.

Each layout tuple has one entry per positional input (output); ``None`` leaves that entry alone.
A plain tensor is read as this rank's piece of ``*_layouts``, then redistributed to
``desired_*_layouts``. Layouts are on the tp mesh dim; on an n-d mesh a DTensor keeps its other
dims' placements, and a plain tensor is ``Replicate()`` there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from spmd.tensor import DeviceMesh, Placement
from spmd.tensor.torch_objects import refuse_torch_objects
from spmd.tensor_parallel.layouts import as_dtensor, relayout, resolve_tp_mesh_dim, resolve_use_local
from spmd.tensor_parallel.style import ParallelStyle

__all__ = ["PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput"]

Layouts = Placement | tuple[Placement | None, ...] | None


def _as_tuple(style: str, name: str, layouts: Layouts) -> tuple[Placement | None, ...] | None:
    if layouts is None:
        return None
    if isinstance(layouts, Placement):
        return (layouts,)
    if isinstance(layouts, (tuple, list)) and all(p is None or isinstance(p, Placement) for p in layouts):
        return tuple(layouts)
    refuse_torch_objects(layouts if isinstance(layouts, (tuple, list)) else (layouts,), f"{style}({name}=...)")
    raise TypeError(f"{style}({name}=...) takes a Placement or a tuple of Placement/None, got {layouts!r}")


class LayoutCountError(ValueError, AssertionError):
    """A style's given and desired layouts differ in length.

    Also an ``AssertionError``, the type torch raises for it, so code written against either
    library catches it.
    """


def _check_pairs(
    style: str,
    given_name: str,
    given: tuple[Placement | None, ...] | None,
    desired: tuple[Placement | None, ...] | None,
) -> None:
    """The desired layouts match the given ones entry by entry."""
    if given is None:
        if desired is not None:
            raise ValueError(f"{style} got desired layouts {desired} without {given_name}; give both")
        return
    if desired is None or len(desired) != len(given):
        raise LayoutCountError(
            f"{style}: {given_name} and desired_{given_name} should have same length! Got {given} and {desired}; "
            "give one entry each per tensor (None where a tensor is left alone)"
        )
    for i, (g, d) in enumerate(zip(given, desired)):
        if g is None and d is not None:
            raise ValueError(
                f"{style}: entry {i} has no {given_name[:-1]} (None) but a desired layout {d}; say how it is laid out"
            )


def _prepare(
    value: Any,
    mesh: DeviceMesh,
    layout: Placement | None,
    desired: Placement | None,
    *,
    use_local: bool,
    where: str,
    tp_dim: int,
) -> Any:
    if layout is None:
        return value
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where} was given layout {layout} but is a {type(value).__name__}, not a tensor")
    return relayout(as_dtensor(value, mesh, layout, tp_dim), desired, use_local=use_local, tp_dim=tp_dim)


@dataclass(frozen=True, kw_only=True, slots=True)
class PrepareModuleInput(ParallelStyle):
    """Convert a module's inputs to DTensors and redistribute them before its forward runs.

    >>> PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))  # doctest: +SKIP
    """

    input_layouts: Layouts = None
    """Layout of each positional input as given (None: leave it)."""
    desired_input_layouts: Layouts = None
    """Layout each positional input is redistributed to (None: keep the given one)."""
    input_kwarg_layouts: Mapping[str, Placement] | None = field(default=None, hash=False)
    """Layout of keyword inputs as given, by name."""
    desired_input_kwarg_layouts: Mapping[str, Placement] | None = field(default=None, hash=False)
    """Layout keyword inputs are redistributed to, by name."""
    use_local_output: bool = False
    """Hand the module local tensors instead of DTensors."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        given = _as_tuple(name, "input_layouts", self.input_layouts)
        desired = _as_tuple(name, "desired_input_layouts", self.desired_input_layouts)
        _check_pairs(name, "input_layouts", given, desired)
        object.__setattr__(self, "input_layouts", given)
        object.__setattr__(self, "desired_input_layouts", desired)
        kwargs, desired_kwargs = dict(self.input_kwarg_layouts or {}), dict(self.desired_input_kwarg_layouts or {})
        refuse_torch_objects(kwargs.values(), f"{name}(input_kwarg_layouts=...)")
        refuse_torch_objects(desired_kwargs.values(), f"{name}(desired_input_kwarg_layouts=...)")
        unknown = sorted(set(desired_kwargs) - set(kwargs))
        if unknown:
            raise ValueError(f"{name}: desired_input_kwarg_layouts names {unknown}, which input_kwarg_layouts lacks")
        object.__setattr__(self, "input_kwarg_layouts", kwargs or None)
        object.__setattr__(self, "desired_input_kwarg_layouts", desired_kwargs or None)

    def prepare_inputs(
        self, module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh, tp_dim: int = 0
    ) -> tuple[Any, ...]:
        """The positional inputs laid out as configured."""
        given = self.input_layouts
        if given is None:
            return inputs
        assert isinstance(given, tuple) and isinstance(self.desired_input_layouts, tuple)  # set in __post_init__
        if len(inputs) != len(given):
            raise ValueError(
                f"module inputs and input_layouts should have same length! {type(module).__name__} got "
                f"{len(inputs)} positional inputs but {self!r} lays out {len(given)}"
            )
        return tuple(
            _prepare(x, mesh, layout, desired, use_local=self.use_local_output,
                     where=f"input {i} of {type(module).__name__}", tp_dim=tp_dim)
            for i, (x, layout, desired) in enumerate(zip(inputs, given, self.desired_input_layouts))
        )

    def prepare_kwargs(
        self, module: nn.Module, kwargs: dict[str, Any], mesh: DeviceMesh, tp_dim: int = 0
    ) -> dict[str, Any]:
        """The keyword inputs laid out as configured."""
        given = self.input_kwarg_layouts or {}
        desired = self.desired_input_kwarg_layouts or {}
        return {
            key: _prepare(value, mesh, given.get(key), desired.get(key), use_local=self.use_local_output,
                          where=f"keyword input {key!r} of {type(module).__name__}", tp_dim=tp_dim)
            for key, value in kwargs.items()
        }

    def apply(
        self,
        module: nn.Module,
        device_mesh: DeviceMesh,
        *,
        src_data_rank: int | None = 0,
        tp_mesh_dim: int | str | None = None,
    ) -> nn.Module:
        tp = resolve_tp_mesh_dim(device_mesh, tp_mesh_dim)
        hook = _PrepareInputsHook(self, device_mesh, tp)
        module.register_forward_pre_hook(hook, with_kwargs=bool(self.input_kwarg_layouts))
        return module


@dataclass(frozen=True, kw_only=True, slots=True)
class PrepareModuleOutput(ParallelStyle):
    """Convert a module's outputs to DTensors and redistribute them after its forward runs."""

    output_layouts: Layouts
    """Layout of each output as the module returns it (None: leave it)."""
    desired_output_layouts: Layouts
    """Layout each output is redistributed to."""
    use_local_output: bool | None = None
    """Return local tensors instead of DTensors; None: local on a 1-d mesh, DTensors on an n-d one."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        given = _as_tuple(name, "output_layouts", self.output_layouts)
        desired = _as_tuple(name, "desired_output_layouts", self.desired_output_layouts)
        if given is None:
            raise ValueError(f"{name} needs output_layouts, e.g. output_layouts=Replicate()")
        _check_pairs(name, "output_layouts", given, desired)
        object.__setattr__(self, "output_layouts", given)
        object.__setattr__(self, "desired_output_layouts", desired)

    def prepare_outputs(self, module: nn.Module, outputs: Any, mesh: DeviceMesh, tp_dim: int = 0) -> Any:
        """The outputs laid out as configured (one value stays one value)."""
        given, desired = self.output_layouts, self.desired_output_layouts
        assert isinstance(given, tuple) and isinstance(desired, tuple)  # set in __post_init__
        values = outputs if isinstance(outputs, tuple) else (outputs,)
        if len(values) != len(given):
            raise ValueError(
                f"{type(module).__name__} returned {len(values)} outputs but {self!r} lays out {len(given)}"
            )
        use_local = resolve_use_local(self.use_local_output, mesh)
        prepared = tuple(
            _prepare(v, mesh, layout, want, use_local=use_local,
                     where=f"output {i} of {type(module).__name__}", tp_dim=tp_dim)
            for i, (v, layout, want) in enumerate(zip(values, given, desired))
        )
        return prepared if isinstance(outputs, tuple) else prepared[0]

    def apply(
        self,
        module: nn.Module,
        device_mesh: DeviceMesh,
        *,
        src_data_rank: int | None = 0,
        tp_mesh_dim: int | str | None = None,
    ) -> nn.Module:
        tp = resolve_tp_mesh_dim(device_mesh, tp_mesh_dim)
        module.register_forward_hook(_PrepareOutputsHook(self, device_mesh, tp))
        return module


@dataclass(frozen=True, slots=True)
class _PrepareInputsHook:
    """Forward pre-hook: the positional inputs (and, when given, the keyword inputs) laid out as ``style`` says."""

    style: PrepareModuleInput
    mesh: DeviceMesh
    tp_dim: int

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
    ) -> tuple[Any, ...] | tuple[tuple[Any, ...], dict[str, Any]]:
        inputs = self.style.prepare_inputs(module, args, self.mesh, self.tp_dim)
        if kwargs is None:  # registered without with_kwargs: the style lays out no keyword input
            return inputs
        return inputs, self.style.prepare_kwargs(module, kwargs, self.mesh, self.tp_dim)


@dataclass(frozen=True, slots=True)
class _PrepareOutputsHook:
    """Forward hook: the outputs laid out as ``style`` says."""

    style: PrepareModuleOutput
    mesh: DeviceMesh
    tp_dim: int

    def __call__(self, module: nn.Module, args: tuple[Any, ...], outputs: Any) -> Any:
        return self.style.prepare_outputs(module, outputs, self.mesh, self.tp_dim)


@dataclass(frozen=True, kw_only=True, slots=True)
class PrepareModuleInputOutput(ParallelStyle):
    """``PrepareModuleInput`` and ``PrepareModuleOutput`` on one module (same options, ``use_local_input``)."""

    input_layouts: Layouts = None
    desired_input_layouts: Layouts = None
    input_kwarg_layouts: Mapping[str, Placement] | None = field(default=None, hash=False)
    desired_input_kwarg_layouts: Mapping[str, Placement] | None = field(default=None, hash=False)
    use_local_input: bool = False
    output_layouts: Layouts
    desired_output_layouts: Layouts
    use_local_output: bool | None = None

    def __post_init__(self) -> None:
        self.styles()  # check the options now, not at apply time

    def styles(self) -> tuple[PrepareModuleInput, PrepareModuleOutput]:
        """The two styles this one combines."""
        input_options = {name: getattr(self, name) for name in _INPUT_OPTIONS}
        output_options = {name: getattr(self, name) for name in _OUTPUT_OPTIONS}
        inputs = PrepareModuleInput(**input_options, use_local_output=self.use_local_input)
        outputs = PrepareModuleOutput(**output_options, use_local_output=self.use_local_output)
        return inputs, outputs

    def apply(
        self,
        module: nn.Module,
        device_mesh: DeviceMesh,
        *,
        src_data_rank: int | None = 0,
        tp_mesh_dim: int | str | None = None,
    ) -> nn.Module:
        inputs, outputs = self.styles()
        inputs.apply(module, device_mesh, src_data_rank=src_data_rank, tp_mesh_dim=tp_mesh_dim)
        return outputs.apply(module, device_mesh, src_data_rank=src_data_rank, tp_mesh_dim=tp_mesh_dim)


_INPUT_OPTIONS = ("input_layouts", "desired_input_layouts", "input_kwarg_layouts", "desired_input_kwarg_layouts")
_OUTPUT_OPTIONS = ("output_layouts", "desired_output_layouts")
