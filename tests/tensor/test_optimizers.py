"""torch.optim and clip_grad_norm_ on DTensor parameters equal a single-device run.

Each optimizer runs its for-loop, foreach (list ops) and fused implementations on parameters of
mixed placements (sharded, uneven, replicated, 2-d meshes); after three steps the parameters and
the optimizer states equal plain torch's, and a step whose grads are laid out like the params
moves no data.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from spmd.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor.debug import CommDebugMode
from spmd.testing import DTensorTestBase, seeded_randn, with_comms
from spmd.testing.layouts import make_dtensor

R, S0, S1 = Replicate(), Shard(0), Shard(1)
SUM = Partial("sum")

SHAPES = {"w_in": (8, 6), "w_out": (6, 5), "bias": (5,), "uneven": (7, 3), "scale": ()}
"""Parameter shapes; 7 rows over 4 ranks is an uneven 2, 2, 2, 1 split."""
LAYOUTS_1D = {"w_in": [S0], "w_out": [S1], "bias": [R], "uneven": [S0], "scale": [R]}
LAYOUTS_2D = {"w_in": [S0, S1], "w_out": [R, S0], "bias": [S0, R], "uneven": [S1, S0], "scale": [R, R]}

OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any], tuple[str, ...]]] = {
    # name: (class, options, implementations)
    "AdamW": (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}, ("for-loop", "foreach", "fused")),
    "Adam-amsgrad": (torch.optim.Adam, {"lr": 0.05, "amsgrad": True}, ("for-loop", "foreach", "fused")),
    "SGD-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}, ("for-loop", "foreach", "fused")),
    "SGD-nesterov": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}, ("foreach", "fused")),
    "SGD": (torch.optim.SGD, {"lr": 0.1}, ("foreach", "fused")),
    "AdamW-tensor-lr": (torch.optim.AdamW, {"lr": torch.tensor(0.05)}, ("for-loop", "fused")),
    "RMSprop": (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True}, ("for-loop", "foreach")),
    "Adagrad": (torch.optim.Adagrad, {"lr": 0.1}, ("for-loop", "foreach", "fused")),
}
IMPLEMENTATIONS = {"for-loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


class Params(nn.Module):
    """A small model: only parameters, so tests set their gradients directly."""

    def __init__(self) -> None:
        super().__init__()
        for i, (name, shape) in enumerate(SHAPES.items()):
            self.register_parameter(name, nn.Parameter(seeded_randn(*shape, seed=i)))


def distribute_params(model: nn.Module, mesh: Any, layouts: dict[str, Sequence[Any]]) -> nn.Module:
    for name, param in list(model.named_parameters()):
        setattr(model, name, nn.Parameter(distribute_tensor(param.detach(), mesh, layouts[name])))
    return model


def grads_for_step(step: int) -> dict[str, torch.Tensor]:
    return {name: seeded_randn(*shape, seed=100 * step + i) for i, (name, shape) in enumerate(SHAPES.items())}


def run_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    set_grad: Callable[[str, nn.Parameter, torch.Tensor], None],
    *,
    steps: int = 3,
) -> None:
    for step in range(steps):
        grads = grads_for_step(step)
        for name, param in model.named_parameters():
            set_grad(name, param, grads[name])
        optimizer.step()


def assert_same_state(model: nn.Module, optimizer: torch.optim.Optimizer, ref: nn.Module, ref_opt: torch.optim.Optimizer) -> None:
    for (name, param), ref_param in zip(model.named_parameters(), ref.parameters()):
        assert isinstance(param, DTensor), name
        torch.testing.assert_close(param.full_tensor(), ref_param.detach(), msg=lambda m, n=name: f"param {n}: {m}")
        state, ref_state = optimizer.state[param], ref_opt.state[ref_param]
        assert state.keys() == ref_state.keys(), name
        for key, value in state.items():
            full = value.full_tensor() if isinstance(value, DTensor) else value
            torch.testing.assert_close(full, ref_state[key], msg=lambda m, n=name, k=key: f"state {k} of {n}: {m}")


def reference_run(cls: type[torch.optim.Optimizer], options: dict[str, Any]) -> tuple[nn.Module, torch.optim.Optimizer]:
    ref = Params()
    ref_opt = cls(ref.parameters(), **options)
    run_steps(ref, ref_opt, lambda name, p, g: setattr(p, "grad", g.clone()))
    return ref, ref_opt


class OptimizerTest(DTensorTestBase):
    def check_optimizer(self, mesh: Any, layouts: dict[str, Sequence[Any]], case: tuple[str, str]) -> None:
        name, implementation = case
        cls, options, _ = OPTIMIZERS[name]
        options = {**options, **IMPLEMENTATIONS[implementation]}
        model = distribute_params(Params(), mesh, layouts)
        optimizer = cls(model.parameters(), **options)

        def set_grad(param_name: str, param: nn.Parameter, grad: torch.Tensor) -> None:
            param.grad = distribute_tensor(grad, mesh, param.placements)

        run_steps(model, optimizer, set_grad)
        ref, ref_opt = reference_run(cls, options)
        assert_same_state(model, optimizer, ref, ref_opt)

    @with_comms
    def test_optimizers_match_one_device(self) -> None:
        cases = [(name, impl) for name, (_, _, impls) in OPTIMIZERS.items() for impl in impls]
        for mesh_shape, layouts in [((4,), LAYOUTS_1D), ((2, 2), LAYOUTS_2D)]:
            mesh = init_device_mesh("cpu", mesh_shape)
            self.run_subtests({"case": cases}, self.check_optimizer, mesh, layouts)

    @with_comms
    def test_step_with_grads_laid_out_like_params_moves_nothing(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        for name, (cls, options, implementations) in OPTIMIZERS.items():
            for implementation in implementations:
                model = distribute_params(Params(), mesh, LAYOUTS_2D)
                optimizer = cls(model.parameters(), **options, **IMPLEMENTATIONS[implementation])
                for step in range(2):  # the first step creates the states, the second reuses them
                    grads = grads_for_step(step)
                    for param_name, param in model.named_parameters():
                        param.grad = distribute_tensor(grads[param_name], mesh, param.placements)
                    with CommDebugMode() as comm:
                        optimizer.step()
                    self.assertEqual(comm.get_total_counts(), 0, f"{name} {implementation} step {step}")

    @with_comms
    def test_grads_laid_out_otherwise_are_moved_for_the_step(self) -> None:
        """Partial and replicated grads of sharded params: the step reduces or chunks them first."""
        mesh = init_device_mesh("cpu", (4,))
        grad_layouts = {"w_in": [SUM], "w_out": [R], "bias": [SUM], "uneven": [R], "scale": [SUM]}
        for name in ("AdamW", "SGD-momentum"):
            cls, options, _ = OPTIMIZERS[name]
            for implementation in ("foreach", "fused"):
                all_options = {**options, **IMPLEMENTATIONS[implementation]}
                model = distribute_params(Params(), mesh, LAYOUTS_1D)
                optimizer = cls(model.parameters(), **all_options)
                run_steps(model, optimizer, lambda n, p, g: setattr(p, "grad", make_dtensor(g, mesh, grad_layouts[n])))
                ref, ref_opt = reference_run(cls, all_options)
                assert_same_state(model, optimizer, ref, ref_opt)
                for param_name, param in model.named_parameters():  # the step leaves the grads as they were
                    self.assertEqual(param.grad.placements, tuple(grad_layouts[param_name]))

    @with_comms
    def test_forward_backward_step(self) -> None:
        """A real backward (grads as the rules produce them) followed by foreach and fused steps."""
        x = seeded_randn(4, 8, seed=7)
        mesh = init_device_mesh("cpu", (4,))
        for implementation in ("foreach", "fused"):
            model = distribute_params(Params(), mesh, LAYOUTS_1D)
            ref = Params()
            optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, **IMPLEMENTATIONS[implementation])
            ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05, **IMPLEMENTATIONS[implementation])
            inputs = distribute_tensor(x, mesh, [R])
            for _ in range(3):
                for m, opt, inp in ((model, optimizer, inputs), (ref, ref_opt, x)):
                    opt.zero_grad()
                    hidden = torch.tanh(inp @ m.w_in) @ m.w_out + m.bias
                    loss = hidden.pow(2).sum() * m.scale + m.uneven.pow(2).sum()
                    loss.backward()
                    opt.step()
            assert_same_state(model, optimizer, ref, ref_opt)

    @with_comms
    def test_params_sharded_over_a_one_rank_mesh_dim_train_like_one_device(self) -> None:
        """Shard over a mesh dim of one rank is the whole tensor: nn.Parameter and AdamW keep it as it is."""
        x = seeded_randn(4, 8, seed=7)
        one_rank_layouts = {
            (4, 1): {"w_in": [S0, S1], "w_out": [R, S0], "bias": [R, S0], "uneven": [S1, S0], "scale": [R, R]},
            (1, 4): {"w_in": [S1, S0], "w_out": [S0, R], "bias": [S0, R], "uneven": [S0, S0], "scale": [R, R]},
        }
        for mesh_shape, layouts in one_rank_layouts.items():
            mesh = init_device_mesh("cpu", mesh_shape)
            for implementation in ("for-loop", "foreach"):
                model = distribute_params(Params(), mesh, layouts)
                for name, param in model.named_parameters():
                    self.assertEqual(param.placements, tuple(layouts[name]), f"{mesh_shape} {name}")
                ref = Params()
                options = {"lr": 0.05, "weight_decay": 0.1, **IMPLEMENTATIONS[implementation]}
                optimizer = torch.optim.AdamW(model.parameters(), **options)
                ref_opt = torch.optim.AdamW(ref.parameters(), **options)
                inputs = distribute_tensor(x, mesh, [R, R])
                for _ in range(3):
                    for m, opt, inp in ((model, optimizer, inputs), (ref, ref_opt, x)):
                        opt.zero_grad()
                        hidden = torch.tanh(inp @ m.w_in) @ m.w_out + m.bias
                        loss = hidden.pow(2).sum() * m.scale + m.uneven.pow(2).sum()
                        loss.backward()
                        opt.step()
                assert_same_state(model, optimizer, ref, ref_opt)
                for name, param in model.named_parameters():
                    self.assertEqual(param.placements, tuple(layouts[name]), f"{mesh_shape} {implementation} {name}")


class ClipGradNormTest(DTensorTestBase):
    def check_clip(self, mesh: Any, layouts: dict[str, Sequence[Any]], norm_type: float, foreach: bool) -> None:
        model = distribute_params(Params(), mesh, layouts)
        ref = Params()
        grads = grads_for_step(0)
        for (name, param), ref_param in zip(model.named_parameters(), ref.parameters()):
            param.grad = distribute_tensor(grads[name], mesh, param.placements)
            ref_param.grad = grads[name].clone()
        total = nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0, norm_type=norm_type, foreach=foreach)
        expected = nn.utils.clip_grad_norm_(ref.parameters(), max_norm=1.0, norm_type=norm_type, foreach=foreach)
        assert isinstance(total, DTensor)
        torch.testing.assert_close(total.full_tensor(), expected)
        self.assertGreater(expected.item(), 1.0)  # the grads really were clipped
        for (name, param), ref_param in zip(model.named_parameters(), ref.parameters()):
            assert isinstance(param.grad, DTensor)
            self.assertEqual(param.grad.placements, param.placements)
            torch.testing.assert_close(param.grad.full_tensor(), ref_param.grad, msg=lambda m, n=name: f"grad {n}: {m}")

    @with_comms
    def test_clip_grad_norm_matches_one_device(self) -> None:
        for mesh_shape, layouts in [((4,), LAYOUTS_1D), ((2, 2), LAYOUTS_2D)]:
            mesh = init_device_mesh("cpu", mesh_shape)
            self.run_subtests(
                {"norm_type": [2.0, math.inf, 1.0, 3.0], "foreach": [True, False]}, self.check_clip, mesh, layouts
            )

    @with_comms
    def test_clip_grad_norm_only_reduces_scalars(self) -> None:
        """The 2- and 3-norms sum powers shard by shard (list op or one norm per grad): all_reduces of
        scalars, no gathered grads."""
        mesh = init_device_mesh("cpu", (4,))
        grads = grads_for_step(0)
        sharded = sum(1 for p in LAYOUTS_1D.values() if p != [R])  # w_in, w_out, uneven
        for foreach, norm_type in itertools.product((True, False), (2.0, 3.0)):
            model = distribute_params(Params(), mesh, LAYOUTS_1D)
            for name, param in model.named_parameters():
                param.grad = distribute_tensor(grads[name], mesh, param.placements)
            with CommDebugMode() as comm:
                total = nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0, norm_type=norm_type, foreach=foreach)
            counts = {str(op): n for op, n in comm.get_comm_counts().items()}
            self.assertEqual(counts, {"all_reduce": sharded}, f"foreach={foreach} norm_type={norm_type}")
            norms = torch.stack([torch.linalg.vector_norm(g, norm_type) for g in grads.values()])
            torch.testing.assert_close(total.full_tensor(), torch.linalg.vector_norm(norms, norm_type))


class OptimizerDispatchTest(DTensorTestBase):
    @with_comms
    def test_changing_learning_rate_keeps_hitting_the_decision_cache(self) -> None:
        """A scheduler changes lr (and Adam its bias corrections) every step; no step re-decides.

        The for-loop implementation (CPU's default) passes them as Python floats
        (``addcdiv_(..., value=-step_size)``): elementwise ops key floats by type, not value.
        """
        from spmd.tensor.dispatch.dispatcher import DISPATCHER

        mesh = init_device_mesh("cpu", (4,))
        barrier = distribute_tensor(torch.zeros(4), mesh, [S0])
        for implementation in ("for-loop", "foreach", "fused"):
            model = distribute_params(Params(), mesh, LAYOUTS_1D)
            optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, **IMPLEMENTATIONS[implementation])
            misses = []
            for step in range(4):
                grads = grads_for_step(step)
                for name, param in model.named_parameters():
                    param.grad = distribute_tensor(grads[name], mesh, param.placements)
                for group in optimizer.param_groups:
                    group["lr"] = 0.1 / (step + 1)
                barrier.full_tensor()  # every rank has finished the previous step
                misses.append(DISPATCHER.misses)
                optimizer.step()
            barrier.full_tensor()
            misses.append(DISPATCHER.misses)
            self.assertEqual(misses[-1], misses[2], f"{implementation}: steps 3 and 4 decided again")

    @with_comms
    def test_plain_and_distributed_params_in_one_foreach_group_are_refused(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        model = Params()
        model.w_in = nn.Parameter(distribute_tensor(model.w_in.detach(), mesh, [S0]))
        for param in model.parameters():
            param.grad = torch.ones_like(param)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)
        with self.assertRaisesRegex(RuntimeError, "mixes DTensors .* and plain tensors"):
            optimizer.step()



def _clip_and_step(implementation: str, mesh: Any | None) -> dict[str, torch.Tensor]:
    """Clip the grads (foreach 2-norm) and take three AdamW steps; on one device when mesh is None."""
    model = Params() if mesh is None else distribute_params(Params(), mesh, LAYOUTS_1D)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, **IMPLEMENTATIONS[implementation])
    result: dict[str, torch.Tensor] = {}
    for step in range(3):
        grads = grads_for_step(step)
        for name, param in model.named_parameters():
            param.grad = grads[name].clone() if mesh is None else distribute_tensor(grads[name], mesh, param.placements)
        total = nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0, foreach=True)
        result[f"norm{step}"] = total.full_tensor() if isinstance(total, DTensor) else total
        optimizer.step()
    for name, param in model.named_parameters():
        result[name] = param.full_tensor() if isinstance(param, DTensor) else param.detach()
    return result


def clip_and_step_each_implementation() -> dict[str, dict[str, torch.Tensor]]:
    mesh = init_device_mesh("cpu", (2,))
    return {implementation: _clip_and_step(implementation, mesh) for implementation in ("foreach", "fused")}


def test_clip_and_steps_on_2_ranks(world: Callable[..., list[Any]]) -> None:
    for per_rank in world(clip_and_step_each_implementation, 2, timeout=240):
        for implementation, results in per_rank.items():
            expected = _clip_and_step(implementation, None)
            assert results.keys() == expected.keys()
            for key, value in expected.items():
                torch.testing.assert_close(results[key], value, msg=lambda m, k=key, i=implementation: f"{i} {k}: {m}")
