"""_StridedShard: torch's placement for a dim sharded "right to left" (FSDP2 over TP), checked against
torch's own ``_StridedShard`` piece by piece and against the full tensor."""

from __future__ import annotations

import copy
import io
import itertools
import pickle
from pathlib import Path

import pytest
import torch

import spmd.checkpoint as checkpoint
from spmd.tensor import (
    DeviceMesh,
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
    init_device_mesh,
    rand,
    zeros,
)
from spmd.tensor.debug import CommDebugMode
from spmd.tensor.placement import _StridedShard, strided_shard_indices
from spmd.tensor.redistribute.plan import plan_redistribute
from spmd.tensor.sharding.vocabulary import ShardingError
from spmd.tensor.spec import (
    compute_local_shape_and_global_offset,
    local_shape,
    local_shape_and_offset,
    normalize_placements,
    unstrided_placements,
)
from spmd.testing import DTensorTestBase, run_threaded, with_comms


def torch_strided_shard() -> type:
    """torch's placement, the reference (by name: an export of these tests must not import it)."""
    return pytest.importorskip("torch.distributed.tensor.placement_types")._StridedShard


def expected_piece(full: torch.Tensor, mesh_shape: tuple[int, ...], placements, coordinate) -> torch.Tensor:
    """The piece torch's placements cut for ``coordinate``: each mesh dim cuts the previous piece."""
    reference = torch_strided_shard()
    piece = full
    for n, p, i in zip(mesh_shape, placements, coordinate):
        if isinstance(p, _StridedShard):
            piece = reference(p.dim, split_factor=p.split_factor)._split_tensor(piece, n, with_padding=False)[0][i]
        elif isinstance(p, Shard):
            chunks = list(torch.chunk(piece, n, p.dim))
            piece = chunks[i] if i < len(chunks) else piece.narrow(p.dim, 0, 0)
    return piece


def assert_same(actual: torch.Tensor, expected: torch.Tensor, msg: str = "") -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=lambda m: f"{msg}: {m}")


SS = _StridedShard
S0, S1, R = Shard(0), Shard(1), Replicate()
LAYOUTS_2D: list[list[Placement]] = [
    [SS(0, split_factor=2), S0],  # FSDP2 over TP: the TP dim cut the rows first
    [SS(1, split_factor=3), S0],
    [S0, SS(0, split_factor=2)],
    [SS(0, split_factor=2), R],
    [SS(0, split_factor=2), SS(0, split_factor=3)],
    [Partial(), SS(1, split_factor=2)],
]
SHAPES = [(8, 4), (9, 5), (3, 2)]  # even, uneven, fewer rows than pieces


# ----- the placement as a value ------------------------------------------------------------------
def test_repr_str_equality_and_hash_follow_torch() -> None:
    p = _StridedShard(0, split_factor=2)
    assert repr(p) == "_StridedShard(dim=0, sf=2)" and str(p) == "_S(0, 2)"
    assert eval(repr(p)) == p == _StridedShard(dim=0, sf=2)
    assert hash(p) == hash(_StridedShard(0, split_factor=2))
    assert p != Shard(0) and Shard(0) != p and p != _StridedShard(0, split_factor=3) != _StridedShard(1, split_factor=3)
    assert not p.is_shard() and not p.is_replicate() and not p.is_partial() and not isinstance(p, Shard)
    assert _StridedShard(1).split_factor == 1 and _StridedShard(1) != Shard(1)
    assert pickle.loads(pickle.dumps(p)) == p and copy.deepcopy(p) == p


def test_repr_and_equality_match_torchs() -> None:
    reference = torch_strided_shard()
    for dim, sf in [(0, 1), (3, 2), (4, 9)]:
        assert repr(_StridedShard(dim, split_factor=sf)) == repr(reference(dim, split_factor=sf))
        assert str(_StridedShard(dim, split_factor=sf)) == str(reference(dim, split_factor=sf))


def test_split_factor_is_keyword_only_and_checked() -> None:
    with pytest.raises(TypeError):
        _StridedShard(3, 4)  # type: ignore[misc]
    with pytest.raises(ValueError, match="split_factor must be >= 1"):
        _StridedShard(0, split_factor=0)
    with pytest.raises(TypeError, match="not both"):
        _StridedShard(0, split_factor=2, sf=3)


@pytest.mark.parametrize("size", [0, 1, 3, 7, 8, 9, 16, 17, 19])
@pytest.mark.parametrize("num_chunks", [1, 2, 3, 4])
@pytest.mark.parametrize("split_factor", [1, 2, 3, 5])
def test_split_tensor_matches_torchs(size: int, num_chunks: int, split_factor: int) -> None:
    reference = torch_strided_shard()
    for dim in (0, 1):
        tensor = torch.arange(size * 3).reshape((size, 3) if dim == 0 else (3, size))
        ours, theirs = _StridedShard(dim, split_factor=split_factor), reference(dim, split_factor=split_factor)
        for padding in (True, False):
            pieces, pads = ours._split_tensor(tensor, num_chunks, with_padding=padding)
            expected, expected_pads = theirs._split_tensor(tensor, num_chunks, with_padding=padding)
            assert pads == expected_pads
            assert [p.tolist() for p in pieces] == [p.tolist() for p in expected]
            for i in range(num_chunks):
                one = ours._select_split_tensor(tensor, num_chunks, i, with_padding=padding)
                assert torch.equal(one, theirs._select_split_tensor(tensor, num_chunks, i, with_padding=padding))
    entries, _ = reference(0, split_factor=split_factor)._split_tensor(
        torch.arange(size), num_chunks, with_padding=False
    )
    for i in range(num_chunks):
        size_there, _ = reference(0, split_factor=split_factor).local_shard_size_and_offset(size, num_chunks, i)
        assert _StridedShard(0, split_factor=split_factor).local_shard_size(size, num_chunks, i) == size_there
        assert strided_shard_indices(size, num_chunks, split_factor)[i] == entries[i].tolist()


def test_indices_of_each_piece() -> None:
    # 9 entries, 2 groups (0-4, 5-8), each cut over 4 ranks
    assert strided_shard_indices(9, 4, 2) == [[0, 1, 5], [2, 3, 6], [4, 7], [8]]
    assert strided_shard_indices(8, 2, 2) == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_an_offset_is_refused_rather_than_wrong() -> None:
    p = _StridedShard(0, split_factor=2)
    with pytest.raises(ValueError, match="no single offset"):
        p.local_shard_size_and_offset(8, 2, 1)

    def body() -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        placements = [p, S0]
        with pytest.raises(ValueError, match="local_shape"):
            local_shape_and_offset((8, 4), mesh, placements)
        assert local_shape((9, 4), mesh, placements, (0, 1)) == (2, 4)  # rows 5, 6 of 0-2 and 5-6
        assert normalize_placements([SS(-2, split_factor=2), Shard(-2)], mesh, 2) == (p, S0)
        assert unstrided_placements((S1, p, S0, Partial())) == (S1, R, R, Partial())

    run_threaded(body, 4)


def as_torch_placements(placements) -> list:
    names = pytest.importorskip("torch.distributed.tensor.placement_types")
    return [
        names._StridedShard(p.dim, split_factor=p.split_factor)
        if isinstance(p, _StridedShard)
        else names.Shard(p.dim)
        if isinstance(p, Shard)
        else names.Replicate()
        for p in placements
    ]


@pytest.mark.parametrize("rows", [8, 7, 3])
def test_compute_local_shape_and_global_offset_is_torchs(rows: int) -> None:
    # transformers reads each parameter's piece with torch's _utils.compute_local_shape_and_global_offset.
    reference = pytest.importorskip("torch.distributed.tensor._utils")._compute_local_shape_and_global_offset
    layouts = [(S0, S1), (S0, S0), (SS(0, split_factor=2), S0), (R, SS(1, split_factor=2)), (S1, R)]

    def body() -> list[tuple]:
        mesh = init_device_mesh("cpu", (2, 2))
        return [compute_local_shape_and_global_offset((rows, 5), mesh, layout) for layout in layouts]

    for coordinate, ours in zip(itertools.product(range(2), range(2)), run_threaded(body, 4)):
        for layout, got in zip(layouts, ours):
            expected = reference((rows, 5), (2, 2), list(coordinate), as_torch_placements(layout))
            assert got == expected, (layout, coordinate)


def test_compute_local_shape_and_global_offset_outside_the_mesh_and_without_offsets() -> None:
    def body() -> tuple:
        mesh = DeviceMesh("cpu", [0, 1])
        return compute_local_shape_and_global_offset((6, 4), mesh, [S0], skip_offset=True)

    assert run_threaded(body, 3) == [((3, 4), ()), ((3, 4), ()), ((0,), ())]


def test_plan_gathers_the_strided_dims_first_and_cuts_them_last() -> None:
    plan = plan_redistribute((SS(0, split_factor=2), S0), (S0, S1))
    assert [str(step) for step in plan] == [
        "mesh dim 1: S(0) -> R  all_gather(dim=0)",
        "mesh dim 0: _S(0, 2) -> R  all_gather(dim=0) + reorder",
        "mesh dim 0: R -> S(0)  local chunk",
        "mesh dim 1: R -> S(1)  local chunk",
    ]
    back = plan_redistribute((S0, R), (SS(0, split_factor=2), S0))
    assert [str(step) for step in back][-2:] == [
        "mesh dim 0: R -> _S(0, 2)  local strided select",
        "mesh dim 1: R -> S(0)  local chunk",
    ]


# ----- DTensors ------------------------------------------------------------------------------------
class StridedShardTest(DTensorTestBase):
    world_size = 4

    @with_comms
    def test_distribute_tensor_cuts_torchs_pieces(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        for shape, placements, src_data_rank in itertools.product(SHAPES, LAYOUTS_2D, (0, None)):
            if any(isinstance(p, Partial) for p in placements):
                continue
            full = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
            x = distribute_tensor(full, mesh, placements, src_data_rank=src_data_rank)
            piece = expected_piece(full, mesh.shape, placements, mesh.get_coordinate())
            assert_same(x.to_local(), piece, f"{shape} {placements}")
            assert_same(x.full_tensor(), full)

    @with_comms
    def test_fsdp_over_tp_layout(self) -> None:
        """[_S(0, 2), S(0)] is TP's cut first, then FSDP's: coordinate (0, 1) holds rows 4-5, not 2-3."""
        mesh = init_device_mesh("cpu", (2, 2))
        full = torch.arange(8.0).unsqueeze(1)
        x = distribute_tensor(full, mesh, [SS(0, split_factor=2), S0])
        fsdp, tp = mesh.get_coordinate()
        tp_piece = full.chunk(2)[tp]
        assert_same(x.to_local(), tp_piece.chunk(2)[fsdp])

    @with_comms
    def test_redistribute_between_strided_and_plain(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        targets = [[S0, S1], [R, S0], [R, R], [SS(0, split_factor=2), S0], [S1, SS(0, split_factor=2)], [Partial(), R]]
        for shape, src, dst in itertools.product(SHAPES, LAYOUTS_2D, targets):
            full = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape) * 3 - 5
            x = distribute_tensor(full, mesh, src)
            y = x.redistribute(mesh, dst)
            self.assertEqual(y.placements, tuple(dst))
            if not any(isinstance(p, Partial) for p in dst):
                assert_same(y.to_local(), distribute_tensor(full, mesh, dst).to_local(), f"{src} -> {dst}")
            assert_same(y.full_tensor(), full, f"{shape} {src} -> {dst}")

    @with_comms
    def test_to_replicate_is_one_all_gather_and_back_is_local(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        full = torch.arange(18.0).reshape(9, 2)
        x = distribute_tensor(full, mesh, [SS(0, split_factor=2)])
        with CommDebugMode() as comm:
            y = x.redistribute(mesh, [R])
        self.assertEqual(comm.get_comm_counts(), {"all_gather": 1})
        assert_same(y.to_local(), full)
        with CommDebugMode() as comm:
            z = y.redistribute(mesh, [SS(0, split_factor=2)])
        self.assertEqual(comm.get_comm_counts(), {})
        assert_same(z.to_local(), x.to_local())

    @with_comms
    def test_gradient_comes_back_strided(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        full = torch.arange(36.0).reshape(9, 4)
        placements = [SS(0, split_factor=2), S0]
        x = distribute_tensor(full, mesh, placements).requires_grad_()
        y = x.redistribute(mesh, [R, S1])
        (y * y).sum().backward()
        self.assertEqual(x.grad.placements, tuple(placements))
        assert_same(x.grad.full_tensor(), 2 * full)

    @with_comms
    def test_from_local(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        placements = [SS(0, split_factor=2), S0]
        even = torch.arange(32.0).reshape(8, 4)
        x = DTensor.from_local(distribute_tensor(even, mesh, placements).to_local(), mesh, placements)
        self.assertEqual(x.shape, even.shape)
        assert_same(x.full_tensor(), even)
        uneven = torch.arange(36.0).reshape(9, 4)
        local = distribute_tensor(uneven, mesh, placements).to_local()
        checked = DTensor.from_local(local, mesh, placements, run_check=True)
        self.assertEqual(checked.shape, uneven.shape)
        assert_same(checked.full_tensor(), uneven)

    @with_comms
    def test_ops_gather_strided_inputs_first(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        full = torch.arange(54.0).reshape(9, 6) / 7
        weight = torch.arange(24.0).reshape(6, 4) / 5
        x = distribute_tensor(full, mesh, [SS(0, split_factor=2), S0])
        w = distribute_tensor(weight, mesh, [R, S1])
        with CommDebugMode() as comm:
            row_sums = x.sum(1)
        self.assertEqual(comm.get_comm_counts(), {"all_gather": 2})
        torch.testing.assert_close(row_sums.full_tensor(), full.sum(1))
        torch.testing.assert_close((x @ w).full_tensor(), full @ weight)
        torch.testing.assert_close(x.sum().full_tensor(), full.sum())
        torch.testing.assert_close(torch._foreach_add([x, x], 1.0)[1].full_tensor(), full + 1)
        grad_x = distribute_tensor(full, mesh, [SS(0, split_factor=2), S0]).requires_grad_()
        (grad_x * grad_x).sum().backward()
        torch.testing.assert_close(grad_x.grad.full_tensor(), 2 * full)

    @with_comms
    def test_an_input_passed_twice_is_gathered_once(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        full = torch.arange(16.0).reshape(8, 2)
        x = distribute_tensor(full, mesh, [SS(0, split_factor=2)])
        with CommDebugMode() as comm:
            y = torch.cat([x, x], dim=1)
        self.assertEqual(comm.get_comm_counts(), {"all_gather": 1})
        assert_same(y.full_tensor(), torch.cat([full, full], dim=1))
        kept = x.detach().float()
        self.assertEqual(kept.placements, x.placements)
        assert_same(kept.to_local(), x.to_local())

    @with_comms
    def test_factories(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        placements = [SS(0, split_factor=2), S0]
        z = zeros(9, 3, device_mesh=mesh, placements=placements)
        self.assertEqual(tuple(z.to_local().shape), local_shape((9, 3), mesh, placements))
        z = z.to_local()
        self.assertEqual(tuple(rand(9, 3, device_mesh=mesh, placements=placements).to_local().shape), z.shape)

    @with_comms
    def test_writes_go_through_a_gathered_copy_and_back_into_the_pieces(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        placements = [SS(0, split_factor=2), S0]
        full = torch.arange(36.0).reshape(9, 4)
        x = distribute_tensor(full, mesh, placements)
        storage = x.to_local().data_ptr()
        with CommDebugMode() as comm:
            same = x.cumsum_(1)
        self.assertIs(same, x)
        self.assertEqual(comm.get_comm_counts(), {"all_gather": 2})  # the gather; cutting back is local
        self.assertEqual(x.to_local().data_ptr(), storage)  # written in place
        self.assertEqual(x.placements, tuple(placements))
        assert_same(x.to_local(), distribute_tensor(full.cumsum(1), mesh, placements).to_local())
        full = full.cumsum(1)
        x.mul_(2)
        assert_same(x.to_local(), distribute_tensor(2 * full, mesh, placements).to_local())
        torch._foreach_add_([x], 1.0)
        x.add_(x)
        assert_same(x.full_tensor(), 2 * (2 * full + 1))
        with self.assertRaisesRegex(ShardingError, "in place"):
            x.t_()
        out = distribute_tensor(torch.zeros(9, 4), mesh, placements)
        torch.add(x, 1, out=out)
        assert_same(out.full_tensor(), 2 * (2 * full + 1) + 1)
        self.assertEqual(out.placements, tuple(placements))
        with self.assertRaisesRegex(RuntimeError, "writes into a view"):
            x[2] = 5.0  # a view of the gathered copy: the write would not reach x

    @with_comms
    def test_optimizer_step_on_a_strided_parameter(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        placements = [SS(0, split_factor=2), S0]
        full = torch.arange(36.0).reshape(9, 4) / 10
        for foreach in (False, True):
            param = torch.nn.Parameter(distribute_tensor(full, mesh, placements))
            reference = torch.nn.Parameter(full.clone())
            optimizers = [torch.optim.AdamW([p], lr=0.1, foreach=foreach) for p in (param, reference)]
            for p, opt in zip((param, reference), optimizers):
                for _ in range(2):
                    opt.zero_grad()
                    (p * p).sum().backward()
                    opt.step()
            self.assertEqual(param.placements, tuple(placements))
            torch.testing.assert_close(param.full_tensor(), reference.detach())
            # the moments are laid out as the parameter: sharded over both mesh dims, not gathered
            for name in ("exp_avg", "exp_avg_sq"):
                self.assertEqual(optimizers[0].state[param][name].placements, tuple(placements))

    @with_comms
    def test_elementwise_ops_on_operands_laid_out_alike_run_on_the_pieces(self) -> None:
        """No gather: each piece on its own, the result in the same (strided) layout, as torch's pointwise ops."""
        mesh = init_device_mesh("cpu", (2, 2))
        placements = (SS(0, split_factor=2), S0)
        full = torch.arange(36.0).reshape(9, 4) / 10
        x, y = (distribute_tensor(t, mesh, list(placements)) for t in (full, full + 1))
        scale = distribute_tensor(torch.tensor(3.0), mesh, [R, R])
        with CommDebugMode() as comm:
            results = {
                "mul": (x * y, full * (full + 1)),
                "scalar": (x.sqrt() * scale + 1, full.sqrt() * 3 + 1),
                "where": (torch.where(x > 1, x, y), torch.where(full > 1, full, full + 1)),
                "zeros_like": (torch.zeros_like(x), torch.zeros_like(full)),
                "float64": (x.double(), full.double()),
                "foreach": (torch._foreach_mul([x, y], [y, x])[1], (full + 1) * full),
            }
            state = torch.zeros_like(y)
            state.lerp_(x, 0.5).addcmul_(x, y, value=2)
            torch._foreach_add_([state], [x], alpha=1.0)
        self.assertEqual(comm.get_comm_counts(), {})
        for name, (got, want) in results.items():
            self.assertEqual(got.placements, placements, name)
            torch.testing.assert_close(got.full_tensor(), want, msg=name)
        self.assertEqual(state.placements, placements)
        torch.testing.assert_close(state.full_tensor(), full * 0.5 + 2 * full * (full + 1) + full)
        other = distribute_tensor(full, mesh, [S0, S1])  # laid out otherwise: gathered, as before
        with CommDebugMode() as comm:
            torch.testing.assert_close((x + other).full_tensor(), 2 * full)
        self.assertGreater(sum(comm.get_comm_counts().values()), 0)

    @with_comms
    def test_torch_save_and_load(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        x = distribute_tensor(torch.arange(36.0).reshape(9, 4), mesh, [SS(0, split_factor=2), S0])
        buffer = io.BytesIO()
        torch.save(x, buffer)
        buffer.seek(0)
        back = torch.load(buffer, weights_only=True)
        self.assertEqual(back.placements, x.placements)
        assert_same(back.to_local(), x.to_local())


def draw_full(placements: list[Placement]) -> torch.Tensor:
    torch.manual_seed(5)
    mesh = init_device_mesh("cpu", (2, 2))
    return rand(9, 3, device_mesh=mesh, placements=placements).full_tensor()


def test_rand_is_the_single_device_draw_in_any_layout() -> None:
    """In a fresh world each, after the same seed: the same global tensor, cut strided or not."""
    strided = run_threaded(draw_full, 4, [SS(0, split_factor=2), S0])
    replicated = run_threaded(draw_full, 4, [R, R])
    for a, b in zip(strided, replicated):
        assert_same(a, b)


# ----- torch.distributed.checkpoint ----------------------------------------------------------------
ROWS = torch.arange(54.0).reshape(9, 6)
COLS = torch.arange(80.0).reshape(8, 10)


def save_strided(path: str) -> None:
    mesh = init_device_mesh("cpu", (2, 2))
    state = {
        "rows": distribute_tensor(ROWS, mesh, [SS(0, split_factor=2), S0]),
        "cols": distribute_tensor(COLS, mesh, [S0, SS(1, split_factor=3)]),
    }
    checkpoint.save(state, path)


def load_into(path: str, rows: list[Placement], cols: list[Placement]) -> None:
    mesh = init_device_mesh("cpu", (2, 2))
    state = {
        "rows": distribute_tensor(torch.zeros_like(ROWS), mesh, rows),
        "cols": distribute_tensor(torch.zeros_like(COLS), mesh, cols),
    }
    checkpoint.load(state, path)
    assert torch.equal(state["rows"].full_tensor(), ROWS)
    assert torch.equal(state["cols"].full_tensor(), COLS)
    assert torch.equal(state["rows"].to_local(), distribute_tensor(ROWS, mesh, rows).to_local())


def test_checkpoint_saves_each_block_once_and_loads_into_any_layout(tmp_path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    path = str(tmp_path / "strided")
    run_threaded(save_strided, 4, path)
    chunks = {k: v.chunks for k, v in FileSystemReader(path).read_metadata().state_dict_metadata.items()}
    # rows: each rank's piece is one block; cols: 3 groups of 10 columns cut over 2 ranks -> 3 blocks a rank
    assert len(chunks["rows"]) == 4 and len(chunks["cols"]) == 12
    assert sum(c.sizes.numel() for c in chunks["cols"]) == COLS.numel()
    run_threaded(load_into, 4, path, [S1, S0], [R, S0])
    run_threaded(load_into, 4, path, [SS(0, split_factor=3), S0], [SS(1, split_factor=2), S1])
