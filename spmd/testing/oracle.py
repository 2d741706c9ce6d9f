"""Plain torch on one device as the oracle: an op on DTensors must give what it gives on plain tensors.

``check_against_torch(fn, *inputs, placements=..., mesh=...)`` runs ``fn`` twice: on the plain
inputs and on distributed copies laid out as ``placements``. It compares every output (the
DTensor's ``full_tensor()`` against the plain result), then backpropagates the same seeded weights
through both and compares the gradients of the inputs that require grad. Partial layouts are built
with pieces that really differ between ranks (``spmd.testing.layouts.local_piece``), so a rule that
forgets a reduction fails here instead of passing by luck.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from spmd.tensor.debug.comm_mode import CommDebugMode
from spmd.tensor.device_mesh.mesh import DeviceMesh, current_mesh
from spmd.tensor.dtensor import DTensor
from spmd.tensor.placement import Partial, Placement
from spmd.testing.layouts import make_dtensor
from spmd.testing.seeded import seeded_randn

__all__ = ["check_against_torch", "assert_same_grads", "assert_same_params"]

GRAD_WEIGHT_SEED = 99
"""Seed of the weights the outputs are multiplied by before backward, so every output element counts."""


def check_against_torch(
    fn: Callable[..., Any],
    *inputs: Any,
    placements: Sequence[Sequence[Placement] | None],
    mesh: DeviceMesh | None = None,
    backward: bool = True,
    collectives: int | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    equal_nan: bool = False,
) -> Any:
    """Assert that ``fn`` on DTensors equals ``fn`` on plain tensors, forward and backward.

    ``placements[i]`` lays out ``inputs[i]`` on ``mesh`` (the current mesh, ``with mesh:``, when
    omitted); give ``None`` for an input that is not a tensor (it is passed as it is). Inputs with
    ``requires_grad=True`` get their gradients compared, except those laid out with a max/min
    ``Partial`` (their pieces' gradients are not the plain tensor's). ``collectives``: the number of
    collectives the DTensor forward must issue. ``equal_nan``: NaNs in the same places count as
    equal (inputs with NaNs). Returns ``fn``'s result on the DTensors.

    >>> x = seeded_randn(8, 6).requires_grad_()  # doctest: +SKIP
    >>> check_against_torch(torch.softmax, x, 1, placements=[[Shard(0)], None], mesh=mesh)  # doctest: +SKIP
    """
    mesh = mesh if mesh is not None else current_mesh()
    if len(placements) != len(inputs):
        raise ValueError(
            f"check_against_torch got {len(inputs)} inputs but {len(placements)} placements; "
            "give one placement list per input (None for a non-tensor input)"
        )
    layout = "(" + ", ".join("-" if p is None else "[" + ", ".join(map(str, p)) + "]" for p in placements) + ")"
    where = f"{getattr(fn, '__name__', repr(fn))} on inputs laid out as {layout} on {mesh}"
    distributed, plain, differentiable = _prepare(inputs, placements, mesh, where)

    with CommDebugMode() as comm:
        actual = fn(*distributed)
    expected = fn(*plain)
    if collectives is not None and comm.get_total_counts() != collectives:
        raise AssertionError(
            f"{where}: expected {collectives} collectives in the forward, got {comm.get_total_counts()} "
            f"({dict(comm.get_comm_counts())})"
        )
    actual_outputs, expected_outputs = _paired_outputs(actual, expected, where)
    tolerances: dict[str, Any] = {"atol": atol, "rtol": rtol} if atol is not None or rtol is not None else {}
    tolerances["equal_nan"] = equal_nan
    for index, (out, ref) in enumerate(zip(actual_outputs, expected_outputs)):
        _assert_close(_full(out), ref, f"{where}: output {index} differs from plain torch", tolerances)

    if backward and any(differentiable):
        _backward_both(actual_outputs, expected_outputs)
        _assert_same_input_grads(distributed, plain, differentiable, where, tolerances)
    return actual


def _assert_same_input_grads(
    distributed: Sequence[Any],
    plain: Sequence[Any],
    differentiable: Sequence[bool],
    where: str,
    tolerances: dict[str, Any],
) -> None:
    """After backward: each differentiable input has a gradient on both sides or neither, and they match."""
    for index, (dist_input, ref) in enumerate(zip(distributed, plain)):
        if not differentiable[index]:
            continue
        if (dist_input.grad is None) != (ref.grad is None):
            raise AssertionError(
                f"{where}: input {index} got a gradient only {'in plain torch' if dist_input.grad is None else 'as a DTensor'}"
            )
        if ref.grad is not None:
            _assert_close(_full(dist_input.grad), ref.grad, f"{where}: gradient of input {index} differs", tolerances)


def _prepare(
    inputs: Sequence[Any], placements: Sequence[Sequence[Placement] | None], mesh: DeviceMesh, where: str
) -> tuple[list[Any], list[Any], list[bool]]:
    """The DTensor inputs, the plain inputs, and which of them take gradients."""
    distributed: list[Any] = []
    plain: list[Any] = []
    differentiable: list[bool] = []
    for index, (value, layout) in enumerate(zip(inputs, placements)):
        if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
            if layout is not None:
                raise ValueError(
                    f"{where}: input {index} is a {type(value).__name__}, not a plain tensor; give it None"
                )
            distributed.append(value)
            plain.append(value)
            differentiable.append(False)
            continue
        if layout is None:
            raise ValueError(f"{where}: input {index} is a tensor; give it a placement list")
        wants_grad = value.requires_grad and not any(isinstance(p, Partial) and not p.is_linear for p in layout)
        full = value.detach()
        dtensor = make_dtensor(full, mesh, layout, requires_grad=wants_grad)
        if wants_grad:
            dtensor.retain_grad()  # from_local makes it a non-leaf; its .grad is what users read
        distributed.append(dtensor)
        plain.append(full.clone().requires_grad_(wants_grad))
        differentiable.append(wants_grad)
    return distributed, plain, differentiable


def _paired_outputs(actual: Any, expected: Any, where: str) -> tuple[list[Any], list[Any]]:
    actual_leaves, actual_structure = tree_flatten(actual)
    expected_leaves, expected_structure = tree_flatten(expected)
    if actual_structure != expected_structure:
        raise AssertionError(f"{where}: returned {actual_structure}, plain torch returned {expected_structure}")
    for index, (out, ref) in enumerate(zip(actual_leaves, expected_leaves)):
        if isinstance(ref, torch.Tensor) and not isinstance(out, DTensor):
            raise AssertionError(
                f"{where}: output {index} is a {type(out).__name__}, not a DTensor; plain torch gave a tensor"
            )
    return actual_leaves, expected_leaves


def _full(value: Any) -> Any:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _assert_close(actual: Any, expected: Any, message: str, tolerances: dict[str, Any]) -> None:
    if not isinstance(expected, torch.Tensor):
        if actual != expected:
            raise AssertionError(f"{message}: {actual!r} != {expected!r}")
        return
    torch.testing.assert_close(actual, expected, msg=_prefixed(message), **tolerances)


def _prefixed(message: str) -> Callable[[str], str]:
    """An ``assert_close`` message callback: our context line, then torch's detail."""
    return lambda detail: f"{message}\n{detail}"


def _as_real(tensor: torch.Tensor) -> torch.Tensor:
    """Complex outputs are weighted through their (re, im) pairs."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def _backward_both(actual_outputs: Sequence[Any], expected_outputs: Sequence[Any]) -> None:
    """Backpropagate the same seeded weighted sum of the outputs through both runs."""
    actual_loss: list[torch.Tensor] = []
    expected_loss: list[torch.Tensor] = []
    for index, (out, ref) in enumerate(zip(actual_outputs, expected_outputs)):
        if not isinstance(ref, torch.Tensor) or not ref.requires_grad:
            continue
        real = _as_real(ref)
        weight = seeded_randn(*real.shape, seed=GRAD_WEIGHT_SEED + index, dtype=real.dtype)
        expected_loss.append((real * weight).sum())
        actual_loss.append((_as_real(_full(out)) * weight).sum())
    if expected_loss:
        torch.autograd.backward(sum(expected_loss[1:], expected_loss[0]))
        torch.autograd.backward(sum(actual_loss[1:], actual_loss[0]))


def assert_same_params(model: nn.Module, reference: nn.Module) -> None:
    """Every parameter of ``model`` (DTensor or plain) equals the reference module's, by name."""
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(_full(param), ref, msg=_prefixed(f"parameter {name}"))


def assert_same_grads(model: nn.Module, reference: nn.Module) -> None:
    """Every parameter gradient of ``model`` (DTensor or plain) equals the reference module's, by name."""
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        if param.grad is None or ref.grad is None:
            raise AssertionError(f"parameter {name}: gradient missing ({param.grad is None=}, {ref.grad is None=})")
        torch.testing.assert_close(_full(param.grad), ref.grad, msg=_prefixed(f"gradient of {name}"))
