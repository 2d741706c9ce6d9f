"""OpInfo sweep: run PyTorch's OpInfo samples on DTensors in many layouts and compare with plain torch.

The harness does not care which DTensor library it drives: a ``Library`` bundles one library's
``init_device_mesh``, ``distribute_tensor``, placements and DTensor type, so the same cases run on
spmd (threaded world, ``run_threaded_sweep``) and, from ``benchmarks/opinfo_sweep.py``, on
``torch.distributed.tensor`` (gloo processes). Three steps:

1. ``prepare_ops`` (one thread; all randomness happens here, under a seed derived from the op's
   name, so every process that prepares the same ops gets the same tensors): takes a few samples
   per OpInfo, runs plain torch for the expected outputs and gradients, and lists the layouts.
2. ``sweep_rank`` (every rank): for each case distributes the inputs, runs the op, gathers the
   outputs with ``full_tensor()``, backpropagates, and compares; ranks agree on each outcome
   through an out-of-band ``OutcomeExchange``, so one rank's failure never leaves the others
   mismatched in later collectives: the sweep stops and resumes in a fresh world instead.
3. ``summarize``: one ``OpReport`` per op (PASS only when all its cases pass).

PyTorch's OpInfo database (``torch.testing._internal.common_methods_invocations``) is imported only
inside ``load_op_db``: importing this module (or ``spmd.testing``) never loads it.
"""

from __future__ import annotations

import contextlib
import math
import random
import threading
import warnings
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "PASS",
    "FAIL_WRONG",
    "NOT_IMPLEMENTED",
    "ERROR_OTHER",
    "Library",
    "spmd_library",
    "CaseLayout",
    "PreparedSample",
    "PreparedOp",
    "Case",
    "Outcome",
    "OpReport",
    "OutcomeExchange",
    "ThreadOutcomeExchange",
    "load_op_db",
    "op_key",
    "prepare_sample",
    "prepare_ops",
    "build_cases",
    "run_case",
    "sweep_rank",
    "run_threaded_sweep",
    "summarize",
    "format_report",
]

PASS = "PASS"
FAIL_WRONG = "FAIL-WRONG"
"""A wrong value (output, shape, dtype or gradient): the one outcome that must never happen."""
NOT_IMPLEMENTED = "ERROR-NOT-IMPLEMENTED"
"""The library said it has no way to run the op (acceptable: a missing rule)."""
ERROR_OTHER = "ERROR-OTHER"
"""Any other exception: usually a bug in the library (or an op the harness cannot express)."""

_SEVERITY = {PASS: 0, NOT_IMPLEMENTED: 1, ERROR_OTHER: 2, FAIL_WRONG: 3}

MESH_1D = (4,)
MESH_2D = (2, 2)
WORLD_SIZE = 4

RTOL = 1e-4
"""Relative tolerance for floating outputs: sharded reductions add in a different order."""
ATOL = 1e-5
"""Absolute tolerance, scaled by the largest finite magnitude of the expected value."""

SLICE_OPS: tuple[str, ...] = (
    # pointwise
    "abs", "add", "sub", "mul", "div.no_rounding_mode", "neg", "exp", "log", "sin", "cos", "tanh",
    "sigmoid", "sqrt", "rsqrt", "pow", "clamp", "where", "maximum", "minimum", "eq", "lt", "ge",
    "logical_not", "logical_and", "erf", "reciprocal", "floor", "round", "sign", "isnan", "square",
    "remainder", "lerp", "addcmul", "masked_fill", "nan_to_num", "__rsub__", "float",
    "nn.functional.relu", "nn.functional.gelu", "nn.functional.silu", "nn.functional.leaky_relu",
    "nn.functional.softplus", "nn.functional.hardtanh", "nn.functional.elu",
    # reductions and normalisations
    "sum", "mean", "amax", "amin", "max.reduction_with_dim", "max.reduction_no_dim",
    "min.reduction_with_dim", "argmax", "argmin", "prod", "var", "std", "linalg.vector_norm",
    "logsumexp", "all", "any", "count_nonzero", "cumsum", "softmax", "log_softmax",
    "nn.functional.layer_norm", "nn.functional.rms_norm", "nn.functional.cross_entropy",
    "nn.functional.nll_loss", "nn.functional.mse_loss",
    # matrix
    "mm", "bmm", "matmul", "addmm", "addmv", "baddbmm", "mv", "dot", "outer", "einsum",
    "nn.functional.linear",
    # views and shape ops
    "view", "reshape", "permute", "transpose", "t", "flatten", "unflatten", "unsqueeze", "squeeze",
    "expand", "narrow", "select", "slice", "split", "chunk", "unbind", "cat", "stack", "movedim",
    "repeat", "flip", "roll", "tril", "triu", "__getitem__",
    # tensor ops and indexing
    "clone", "contiguous", "zeros_like", "ones_like", "full_like", "fill", "new_zeros", "new_full",
    "index_select", "gather", "scatter", "scatter_add", "take_along_dim", "nn.functional.embedding",
    "topk", "sort",
    # special functions and pointwise ops with extra arguments
    "acosh", "erfc", "special.bessel_j0", "special.i1e", "polygamma.polygamma_n_1", "frexp",
    "nn.functional.glu", "nn.functional.prelu", "nn.functional.celu",
    # fft, pools, upsampling, normalisation
    "fft.fft", "fft.rfft2", "fft.irfft", "nn.functional.avg_pool2d", "nn.functional.max_pool2d",
    "nn.functional.adaptive_avg_pool2d", "nn.functional.interpolate.bilinear", "nn.functional.grid_sample",
    "nn.functional.pixel_shuffle", "nn.functional.batch_norm", "nn.functional.group_norm",
    # products, distances, batched linalg, lookups
    "trace", "addr", "vdot", "cdist", "linalg.cross", "cholesky_solve", "nn.functional.bilinear",
    "isin", "bucketize", "histc", "renorm",
)
"""The fixed slice the CI test sweeps: about 150 common ops, by OpInfo name (``name.variant``)."""

_COMM_ERROR_NAMES = (
    "CollectiveTimeoutError",
    "CollectiveAbortedError",
    "CollectiveMismatchError",
    "DistBackendError",
    "DistNetworkError",
)
_COMM_ERROR_WORDS = ("collective mismatch", "gloo", "timed out", "connection closed", "connection reset")


# ----- the library under test ----------------------------------------------------------------------
@dataclass(frozen=True)
class Library:
    """The functions of one DTensor library that the harness calls."""

    name: str
    init_device_mesh: Callable[..., Any]
    distribute_tensor: Callable[..., Any]
    dtensor_type: type[Any]
    replicate: Callable[[], Any]
    shard: Callable[[int], Any]
    not_implemented: tuple[type[BaseException], ...] = (NotImplementedError,)
    """Exceptions meaning "no way to run this op" (ERROR-NOT-IMPLEMENTED rather than ERROR-OTHER)."""


def spmd_library() -> Library:
    """spmd's ``spmd.tensor``, for the threaded world."""
    from spmd.tensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh

    return Library("spmd", init_device_mesh, distribute_tensor, DTensor, Replicate, Shard)


# ----- cases -----------------------------------------------------------------------------------------
TensorLayout = tuple["int | None", ...]
"""One tensor's placements, one entry per mesh dim: ``None`` is Replicate, ``d`` is Shard(d)."""


@dataclass(frozen=True)
class CaseLayout:
    """A mesh shape and the placements of every tensor argument of a sample (in flattened order)."""

    mesh_shape: tuple[int, ...]
    placements: tuple[TensorLayout, ...]

    def __str__(self) -> str:
        def one(layout: TensorLayout) -> str:
            return "(" + ", ".join("R" if d is None else f"S({d})" for d in layout) + ")"

        mesh = "x".join(str(s) for s in self.mesh_shape)
        return f"mesh({mesh}) " + " ".join(one(p) for p in self.placements)


@dataclass
class PreparedSample:
    """One OpInfo sample, flattened, with plain torch's outputs and gradients to compare against."""

    description: str
    leaves: list[Any]
    """Leaves of ``(input, args, kwargs)``; tensors are detached copies."""
    spec: Any
    tensor_positions: list[int]
    expected: list[Any]
    """Leaves of plain torch's output (tensors detached)."""
    grad_weights: dict[int, torch.Tensor]
    """Output leaf index -> the weight ``w`` of ``sum(out * w)``; empty when backward is not checked."""
    expected_grads: list[torch.Tensor | None]
    """Per tensor argument (same order as ``tensor_positions``); None where it gets no gradient."""
    layouts: list[CaseLayout]


@dataclass
class PreparedOp:
    """An OpInfo ready to sweep, or the reason it is skipped."""

    key: str
    op: Callable[..., Any] | None
    samples: list[PreparedSample] = field(default_factory=list)
    skip_reason: str = ""


@dataclass(frozen=True)
class Case:
    """One (op, sample, layout) to run: indices into the prepared ops."""

    op_index: int
    sample_index: int
    layout_index: int


@dataclass(frozen=True)
class Outcome:
    kind: str
    detail: str = ""
    desync: bool = False
    """The error came from (or may have left behind) a collective only some ranks issued."""


@dataclass
class OpReport:
    key: str
    status: str
    """PASS, one of the error kinds, or ``SKIP``."""
    cases: int
    counts: dict[str, int]
    worst: str = ""
    """The first case of the worst kind: ``sample | layout | detail``."""


class OutcomeExchange(Protocol):
    """Out-of-band all-gather of each case's outcome (must not use the library's collectives)."""

    def exchange(self, rank: int, index: int, outcome: Outcome) -> list[Outcome]: ...


class ThreadOutcomeExchange:
    """``OutcomeExchange`` for ranks that are threads of one process."""

    def __init__(self, world_size: int, timeout: float) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self._values: dict[int, dict[int, Outcome]] = {}
        self._cond = threading.Condition()

    def exchange(self, rank: int, index: int, outcome: Outcome) -> list[Outcome]:
        with self._cond:
            self._values.setdefault(index, {})[rank] = outcome
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: len(self._values[index]) == self.world_size, self.timeout):
                raise TimeoutError(f"rank {rank}: other ranks did not finish case {index} in {self.timeout:g}s")
            got = self._values[index]
            return [got[r] for r in range(self.world_size)]


def load_op_db() -> list[Any]:
    """PyTorch's OpInfo database (imported here, never at module import time)."""
    # The one place spmd/ touches torch's test internals; only tests and benchmarks call this.
    from torch.testing._internal.common_methods_invocations import op_db  # noqa: TID251

    return list(op_db)


def op_key(opinfo: Any) -> str:
    """``name`` or ``name.variant`` (e.g. ``max.reduction_with_dim``): unique within op_db."""
    return f"{opinfo.name}.{opinfo.variant_test_name}" if opinfo.variant_test_name else opinfo.name


# ----- preparing ---------------------------------------------------------------------------------------
def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy

        numpy.random.seed(seed % 2**32)
    except ImportError:
        pass


def _is_plain_tensor(value: Any) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and type(value) is torch.Tensor
        and value.layout == torch.strided
        and value.device.type == "cpu"
        and not value.is_conj()
        and not value.is_neg()
    )


def _call(op: Callable[..., Any], leaves: list[Any], spec: Any) -> Any:
    sample_input, args, kwargs = pytree.tree_unflatten(leaves, spec)
    return op(sample_input, *args, **kwargs)


def _same(a: list[Any], b: list[Any]) -> bool:
    """Exactly equal output leaves (NaN equals NaN): used to spot random ops."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            try:
                torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True)
            except AssertionError:
                return False
        elif not (x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y))):
            return False
    return True


class _RandomOpDetector(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Notes whether any aten op tagged ``nondeterministic_seeded`` (bernoulli, randn, ...) runs."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.seen = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.seen = True
        return func(*args, **(kwargs or {}))


def _grad_copy(tensor: torch.Tensor) -> torch.Tensor | None:
    return None if tensor.grad is None else tensor.grad.detach().clone()


def _detached(values: Iterable[Any]) -> list[Any]:
    return [v.detach().clone() if isinstance(v, torch.Tensor) else v for v in values]


def layouts_for(shapes: Sequence[tuple[int, ...]], *, max_layouts: int) -> list[CaseLayout]:
    """The layouts a sample is run in: all-Replicate; one tensor sharded on one dim, the rest
    replicated; every tensor sharded on its first / last dim; and two 2-d mesh layouts.

    A dim is sharded only if it has at least 2 elements (on a mesh dim of 4 that still gives
    uneven and empty shards, e.g. 5 -> 2,2,1,0).
    """
    n = len(shapes)

    def can_shard(shape: tuple[int, ...], d: int) -> bool:
        return 0 <= d < len(shape) and shape[d] >= 2

    replicated: TensorLayout = (None,)
    one_d: list[CaseLayout] = [CaseLayout(MESH_1D, (replicated,) * n)]
    for i, shape in enumerate(shapes):
        dims = range(len(shape)) if i == 0 else sorted({0, len(shape) - 1}) if shape else []
        for d in dims:
            if can_shard(shape, d):
                placements = [replicated] * n
                placements[i] = (d,)
                one_d.append(CaseLayout(MESH_1D, tuple(placements)))
    if n > 1:
        for pick in (0, -1):
            placements = []
            for shape in shapes:
                d = pick % len(shape) if shape else 0
                placements.append((d,) if can_shard(shape, d) else replicated)
            one_d.append(CaseLayout(MESH_1D, tuple(placements)))

    def mixed(shape: tuple[int, ...], flip: bool) -> TensorLayout:
        last = len(shape) - 1
        if len(shape) >= 2:
            first, second = (last, 0) if flip else (0, last)
            return (first if can_shard(shape, first) else None, second if can_shard(shape, second) else None)
        if len(shape) == 1 and can_shard(shape, 0):
            return (0, 0) if flip else (0, None)
        return (None, None)

    two_d = [
        CaseLayout(MESH_2D, tuple(mixed(s, flip=False) for s in shapes)),
        CaseLayout(MESH_2D, tuple(mixed(s, flip=True) for s in shapes)),
    ]
    unique_1d = list(dict.fromkeys(one_d))
    unique_2d = [layout for layout in dict.fromkeys(two_d) if any(p != (None, None) for p in layout.placements)]
    if not unique_2d:
        unique_2d = [two_d[0]]
    keep = max(1, max_layouts - len(unique_2d))
    return unique_1d[:keep] + unique_2d


def prepare_sample(
    op: Callable[..., Any], sample: Any, *, check_backward: bool, seed: int, max_layouts: int = 8
) -> PreparedSample | str:
    """One sample (anything with ``input``, ``args``, ``kwargs``, like OpInfo's SampleInput) ready
    to sweep, or why it is left out (``"random"`` marks a random op)."""
    leaves, spec = pytree.tree_flatten((sample.input, tuple(sample.args), dict(sample.kwargs)))
    positions = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    if not positions:
        return "no tensor argument"
    if any(not _is_plain_tensor(leaves[i]) for i in positions):
        return "a tensor argument is not a plain strided CPU tensor"
    leaves = _detached(leaves)

    def forward(grad: bool) -> tuple[list[Any], list[Any]]:
        inputs = _detached(leaves)
        if grad:
            for i in positions:
                if inputs[i].is_floating_point():
                    inputs[i].requires_grad_()
        with torch.set_grad_enabled(grad):
            out = _call(op, inputs, spec)
        return inputs, pytree.tree_leaves(out)

    detector = _RandomOpDetector()
    try:
        _seed_all(seed)
        with detector:
            _, first = forward(grad=False)
        _seed_all(seed + 1)
        _, second = forward(grad=False)
    except Exception as error:
        return f"plain torch raised {type(error).__name__}"
    # Some OpInfos reseed inside the op (dropout), so a seeded op can still repeat itself exactly.
    if detector.seen or not _same(first, second):
        return "random"
    expected = _detached(first)

    grad_weights: dict[int, torch.Tensor] = {}
    expected_grads: list[torch.Tensor | None] = [None] * len(positions)
    if check_backward:
        grad_weights, expected_grads = _expected_grads(forward, positions, seed)
    shapes = [tuple(leaves[i].shape) for i in positions]
    description = " ".join(f"{list(s)}" for s in shapes)
    return PreparedSample(
        description, leaves, spec, positions, expected, grad_weights, expected_grads,
        layouts_for(shapes, max_layouts=max_layouts),
    )


def _expected_grads(
    forward: Callable[[bool], tuple[list[Any], list[Any]]], positions: list[int], seed: int
) -> tuple[dict[int, torch.Tensor], list[torch.Tensor | None]]:
    """Plain torch's backward of sum(output_j * w_j) over the float outputs: the random weights w_j by
    output index, and the gradient of each tensor input (all None when backward raises or has no loss)."""
    grad_weights: dict[int, torch.Tensor] = {}
    try:
        inputs, outs = forward(True)
        generator = torch.Generator().manual_seed(seed)
        loss: torch.Tensor | None = None
        for j, o in enumerate(outs):
            if isinstance(o, torch.Tensor) and o.requires_grad and o.is_floating_point():
                w = torch.randn(o.shape, generator=generator, dtype=o.dtype)
                grad_weights[j] = w
                term = (o * w).sum()
                loss = term if loss is None else loss + term
        if loss is not None:
            loss.backward()  # type: ignore[no-untyped-call]
            return grad_weights, [_grad_copy(inputs[i]) for i in positions]
    except Exception:
        return {}, [None] * len(positions)
    return grad_weights, [None] * len(positions)


def prepare_ops(
    opinfos: Iterable[Any], *, max_samples: int = 3, max_layouts: int = 8, dtype: torch.dtype = torch.float32
) -> list[PreparedOp]:
    """Samples, expected values and layouts for each OpInfo; call from ONE thread (uses the global RNG)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [_prepare_op(o, max_samples=max_samples, max_layouts=max_layouts, dtype=dtype) for o in opinfos]


def _prepare_op(opinfo: Any, *, max_samples: int, max_layouts: int, dtype: torch.dtype) -> PreparedOp:
    key = op_key(opinfo)
    if dtype not in opinfo.supported_dtypes("cpu"):
        return PreparedOp(key, None, skip_reason=f"no {dtype} on cpu")
    if opinfo.has_nondeterministic_output or "empty" in opinfo.name:
        return PreparedOp(key, None, skip_reason="nondeterministic output")
    check_backward = bool(opinfo.supports_autograd) and dtype in opinfo.supported_backward_dtypes("cpu")
    seed = zlib.crc32(key.encode())
    op = PreparedOp(key, opinfo.op)
    reasons: list[str] = []
    try:
        _seed_all(seed)
        samples = iter(opinfo.sample_inputs("cpu", dtype, requires_grad=check_backward))
        for index, sample in enumerate(samples):
            if len(op.samples) >= max_samples or index >= 4 * max_samples:
                break
            result = prepare_sample(
                opinfo.op, sample, check_backward=check_backward, seed=seed + index, max_layouts=max_layouts
            )
            if result == "random":
                return PreparedOp(key, None, skip_reason="random output")
            if isinstance(result, str):
                reasons.append(result)
            else:
                op.samples.append(result)
    except Exception as error:
        return PreparedOp(key, None, skip_reason=f"sample_inputs raised {type(error).__name__}")
    if not op.samples:
        op.op = None
        op.skip_reason = "no usable sample" + (f" ({reasons[0]})" if reasons else "")
    return op


def build_cases(ops: Sequence[PreparedOp]) -> list[Case]:
    """Every (op, sample, layout) of the prepared ops, in a fixed order."""
    return [
        Case(i, s, k)
        for i, op in enumerate(ops)
        for s, sample in enumerate(op.samples)
        for k in range(len(sample.layouts))
    ]


# ----- running -----------------------------------------------------------------------------------------
def _message(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300] if text else ''}"


def _classify(lib: Library, error: BaseException, phase: str) -> Outcome:
    name = type(error).__name__
    text = str(error).lower()
    desync = name in _COMM_ERROR_NAMES or any(word in text for word in _COMM_ERROR_WORDS)
    if isinstance(error, lib.not_implemented) and not desync:
        return Outcome(NOT_IMPLEMENTED, f"{phase}: {_message(error)}")
    return Outcome(ERROR_OTHER, f"{phase}: {_message(error)}", desync=desync)


def _compare(actual: Any, expected: Any, what: str) -> str | None:
    """Why ``actual`` is not ``expected`` (None when it is)."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return f"{what}: got {type(actual).__name__}, expected a tensor"
        if actual.shape != expected.shape or actual.dtype != expected.dtype:
            return (
                f"{what}: got {actual.dtype}{list(actual.shape)}, expected {expected.dtype}{list(expected.shape)}"
            )
        if expected.is_floating_point() or expected.is_complex():
            finite = expected[torch.isfinite(expected)]
            scale = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
            rtol, atol = RTOL, ATOL * scale
        else:
            rtol, atol = 0.0, 0.0
        try:
            torch.testing.assert_close(
                actual.detach(), expected, rtol=rtol, atol=atol, equal_nan=True, check_device=False, check_stride=False
            )
        except AssertionError as error:
            lines = [line.strip() for line in str(error).splitlines() if line.strip()]
            return f"{what}: " + "; ".join(lines[:4])
        return None
    if isinstance(actual, torch.Tensor):
        return f"{what}: got a tensor, expected {type(expected).__name__} {expected!r}"
    if isinstance(expected, float) and isinstance(actual, (int, float)):
        if math.isclose(actual, expected, rel_tol=RTOL, abs_tol=ATOL) or (math.isnan(actual) and math.isnan(expected)):
            return None
    elif actual == expected:
        return None
    return f"{what}: got {actual!r}, expected {expected!r}"


def _full(lib: Library, value: Any) -> Any:
    """A DTensor's global value as a plain tensor (a collective); anything else as it is."""
    return value.full_tensor() if isinstance(value, lib.dtensor_type) else value


def run_case(lib: Library, mesh: Any, op: Callable[..., Any], sample: PreparedSample, layout: CaseLayout) -> Outcome:
    """Run one case on this rank: distribute, call, gather, backprop, compare."""
    backward = bool(sample.grad_weights)
    leaves = list(sample.leaves)
    inputs: list[Any] = []
    phase = "distribute"
    try:
        for position, placements in zip(sample.tensor_positions, layout.placements):
            tensor = sample.leaves[position].clone()
            dt = lib.distribute_tensor(
                tensor, mesh, [lib.replicate() if d is None else lib.shard(d) for d in placements]
            )
            if backward and tensor.is_floating_point():
                dt = dt.requires_grad_()
            leaves[position] = dt
            inputs.append(dt)
        phase = "forward"
        out = pytree.tree_leaves(_call(op, leaves, sample.spec))
        gathered = [_full(lib, o) for o in out]
    except Exception as error:
        return _classify(lib, error, phase)
    if len(gathered) != len(sample.expected):
        return Outcome(FAIL_WRONG, f"forward: {len(gathered)} output leaves, expected {len(sample.expected)}")
    for j, (got, want) in enumerate(zip(gathered, sample.expected)):
        problem = _compare(got, want, f"output {j}")
        if problem is not None:
            return Outcome(FAIL_WRONG, f"forward: {problem}")
    if not backward:
        return Outcome(PASS)

    try:
        phase = "backward"
        loss: torch.Tensor | None = None
        for j, w in sample.grad_weights.items():
            if not gathered[j].requires_grad:
                return Outcome(FAIL_WRONG, f"backward: output {j} does not require grad (its gradient would be lost)")
            term = (gathered[j] * w).sum()
            loss = term if loss is None else loss + term
        assert loss is not None
        loss.backward()  # type: ignore[no-untyped-call]
        grads: list[Any] = []
        for dt in inputs:
            grad = dt.grad if dt.requires_grad else None
            grads.append(_full(lib, grad))
    except Exception as error:
        return _classify(lib, error, phase)
    for i, (got, want) in enumerate(zip(grads, sample.expected_grads)):
        if want is None:
            if got is not None and bool(got.count_nonzero()):
                return Outcome(FAIL_WRONG, f"backward: tensor argument {i} got a gradient, expected none")
            continue
        if got is None:
            return Outcome(FAIL_WRONG, f"backward: tensor argument {i} got no gradient")
        problem = _compare(got, want, f"grad of tensor argument {i}")
        if problem is not None:
            return Outcome(FAIL_WRONG, f"backward: {problem}")
    return Outcome(PASS)


def _agree(outcomes: list[Outcome]) -> tuple[Outcome, bool]:
    """The case's outcome over all ranks, and whether the world is still in step.

    Ranks that disagree mean a rank-dependent failure (typically a kernel raising on one rank's
    empty shard while the others wait in a collective): ERROR-OTHER naming the first rank whose
    own error started it, or FAIL-WRONG if any rank saw a wrong value.
    """
    kinds = {o.kind for o in outcomes}
    if len(kinds) == 1 and not any(o.desync for o in outcomes):
        return outcomes[0], True
    if FAIL_WRONG in kinds:
        rank = next(r for r, o in enumerate(outcomes) if o.kind == FAIL_WRONG)
        return Outcome(FAIL_WRONG, f"rank {rank}: {outcomes[rank].detail}", desync=True), False
    errors = [r for r, o in enumerate(outcomes) if o.kind != PASS]
    rank = next((r for r in errors if not outcomes[r].desync), errors[0])
    by_rank = ", ".join(f"{r}: {'comm' if o.desync else o.kind}" for r, o in enumerate(outcomes))
    detail = f"ranks disagree ({by_rank}); rank {rank}: {outcomes[rank].detail}"
    return Outcome(ERROR_OTHER, detail, desync=True), False


def sweep_rank(
    lib: Library,
    ops: Sequence[PreparedOp],
    cases: Sequence[Case],
    start: int,
    exchange: OutcomeExchange,
    rank: int,
    record: Callable[[int, Outcome], None],
) -> int:
    """Run ``cases[start:]`` on this rank; ``record`` (called on rank 0) gets each agreed outcome.

    Returns the index to resume from: ``len(cases)`` when done, earlier when a case left the ranks
    out of step (the caller must then start a fresh world).
    """
    meshes: dict[tuple[int, ...], Any] = {shape: lib.init_device_mesh("cpu", shape) for shape in (MESH_1D, MESH_2D)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for index in range(start, len(cases)):
            case = cases[index]
            op = ops[case.op_index]
            sample = op.samples[case.sample_index]
            layout = sample.layouts[case.layout_index]
            assert op.op is not None
            outcome = run_case(lib, meshes[layout.mesh_shape], op.op, sample, layout)
            agreed, in_step = _agree(exchange.exchange(rank, index, outcome))
            if rank == 0:
                record(index, agreed)
            if not in_step:
                return index + 1
    return len(cases)


def run_threaded_sweep(
    ops: Sequence[PreparedOp],
    *,
    lib: Library | None = None,
    collective_timeout: float = 20.0,
    progress: Callable[[int, int], None] | None = None,
    fallback: bool | None = None,
) -> list[Outcome]:
    """Every case of ``ops`` on spmd's threaded world of 4 ranks; one world unless a case desyncs it.

    ``fallback`` turns the dispatcher's replicate fallback for ops without a rule on or off for the
    sweep (None keeps the current setting): off measures the rules alone.
    """
    from spmd.tensor.dispatch.dispatcher import replicate_fallback

    with replicate_fallback(fallback) if fallback is not None else contextlib.nullcontext():
        return _run_threaded_sweep(ops, lib or spmd_library(), collective_timeout, progress)


def _run_threaded_sweep(
    ops: Sequence[PreparedOp],
    library: Library,
    collective_timeout: float,
    progress: Callable[[int, int], None] | None,
) -> list[Outcome]:
    from spmd.comm.threaded import current_threaded_world
    from spmd.testing import run_threaded

    cases = build_cases(ops)
    outcomes: list[Outcome | None] = [None] * len(cases)

    def record(index: int, outcome: Outcome) -> None:
        outcomes[index] = outcome
        if progress is not None:
            progress(index + 1, len(cases))

    def rank_main(start: int, exchange: ThreadOutcomeExchange, resume: dict[int, int]) -> None:
        world = current_threaded_world()
        assert world is not None
        rank = world.current_rank()
        resume[rank] = sweep_rank(library, ops, cases, start, exchange, rank, record)

    start = 0
    while start < len(cases):
        exchange = ThreadOutcomeExchange(WORLD_SIZE, timeout=10 * collective_timeout)
        resume: dict[int, int] = {}
        try:
            run_threaded(rank_main, WORLD_SIZE, start, exchange, resume, timeout=collective_timeout)
        except Exception as error:  # the world broke: note it on the case it broke in, if no rank did
            if 0 not in resume:
                failed = next((i for i in range(start, len(cases)) if outcomes[i] is None), len(cases))
                if failed < len(cases):
                    outcomes[failed] = Outcome(ERROR_OTHER, f"world failed: {_message(error)}", desync=True)
                resume[0] = failed + 1
        start = resume[0]
    return [o if o is not None else Outcome(ERROR_OTHER, "not run") for o in outcomes]


# ----- reporting ---------------------------------------------------------------------------------------
def summarize(ops: Sequence[PreparedOp], outcomes: Sequence[Outcome]) -> list[OpReport]:
    """One report per op: its worst case decides its status (SKIP for ops that were not run)."""
    cases = build_cases(ops)
    reports = [OpReport(op.key, "SKIP" if op.op is None else PASS, 0, {}, op.skip_reason) for op in ops]
    for case, outcome in zip(cases, outcomes):
        report = reports[case.op_index]
        report.cases += 1
        report.counts[outcome.kind] = report.counts.get(outcome.kind, 0) + 1
        if _SEVERITY[outcome.kind] > _SEVERITY[report.status]:
            report.status = outcome.kind
            sample = ops[case.op_index].samples[case.sample_index]
            layout = sample.layouts[case.layout_index]
            report.worst = f"sample {case.sample_index} {sample.description} | {layout} | {outcome.detail}"
    return reports


def format_report(reports: Sequence[OpReport], *, title: str) -> str:
    """Counts per status, then one line per op that did not pass, then the passing ops."""
    lines = [f"== {title}: {len(reports)} ops"]
    lines += [
        f"   {status:<22} {sum(1 for r in reports if r.status == status)}"
        for status in (PASS, FAIL_WRONG, ERROR_OTHER, NOT_IMPLEMENTED, "SKIP")
    ]
    lines += [
        f"{status:<22} {r.key:<36} {r.worst}"
        for status in (FAIL_WRONG, ERROR_OTHER, NOT_IMPLEMENTED)
        for r in reports
        if r.status == status
    ]
    passing = sorted(r.key for r in reports if r.status == PASS)
    lines.append(f"passing ({len(passing)}): " + ", ".join(passing))
    return "\n".join(lines)
