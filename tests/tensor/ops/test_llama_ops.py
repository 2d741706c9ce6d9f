"""The ops a torchtitan-style Llama uses beyond matmuls: complex views for rotary embeddings,
in-place views, dtype views and repeat_interleave keep their shards; values and gradients equal torch."""

from __future__ import annotations

import functools
import itertools

import torch
import torch.nn.functional as F

from spmd.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from spmd.tensor import ones as spmd_ones
from spmd.tensor.debug import CommDebugMode
from spmd.tensor.dispatch.dispatcher import implicit_replication, replicate_fallback
from spmd.tensor.placement import Placement
from spmd.testing import DTensorTestBase, assert_same_grads, check_against_torch, seeded_randn, with_comms
from spmd.testing.layouts import make_dtensor

R = Replicate()
MESHES = [(4,), (2, 2)]


randn = functools.partial(seeded_randn, dtype=torch.float64)


def layouts_for(mesh_ndim: int, tensor_ndim: int) -> list[tuple[Placement, ...]]:
    options = [R, *(Shard(d) for d in range(tensor_ndim))]
    return list(itertools.product(options, repeat=mesh_ndim))


# ----- the torchtitan rotary embedding ----------------------------------------------------------------
def precompute_freqs_cis(head_dim: int, seq_len: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k: [batch, seq, heads, head_dim]; freqs_cis: [seq, head_dim // 2] complex."""
    xq_ = torch.view_as_complex(xq.reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.reshape(*xk.shape[:-1], -1, 2))
    freqs = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[3])
    xq_out = torch.view_as_real(xq_ * freqs).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class RotaryEmbeddingTest(DTensorTestBase):
    @with_comms
    def test_rotary_block_on_head_or_batch_shards_moves_nothing(self) -> None:
        batch, seq, heads, head_dim = 4, 6, 8, 16
        freqs_full = precompute_freqs_cis(head_dim, seq)

        def one(mesh_shape, layout) -> None:
            mesh = init_device_mesh("cpu", mesh_shape)
            q_full, k_full = randn(batch, seq, heads, head_dim, seed=1), randn(batch, seq, heads, head_dim, seed=2)
            q = distribute_tensor(q_full, mesh, layout).requires_grad_()
            k = distribute_tensor(k_full, mesh, layout).requires_grad_()
            freqs = distribute_tensor(freqs_full, mesh, [R] * mesh.ndim)
            with CommDebugMode() as comm:
                q_out, k_out = apply_rotary_emb(q, k, freqs)
                loss_q = (q_out * q_out).sum(dim=(1, 3))  # stays sharded on batch or heads
                loss_k = (k_out * k_out.detach()).sum(dim=(1, 3))
                (loss_q.to_local().sum() + loss_k.to_local().sum()).backward()
            self.assertEqual(comm.get_total_counts(), 0, (mesh_shape, layout, comm.get_comm_counts()))
            self.assertEqual(q_out.placements, tuple(layout))
            self.assertEqual(q.grad.placements, tuple(layout))

            q_ref, k_ref = q_full.clone().requires_grad_(), k_full.clone().requires_grad_()
            q_exp, k_exp = apply_rotary_emb(q_ref, k_ref, freqs_full)
            ((q_exp * q_exp).sum() + (k_exp * k_exp.detach()).sum()).backward()
            torch.testing.assert_close(q_out.full_tensor(), q_exp)
            torch.testing.assert_close(k_out.full_tensor(), k_exp)
            torch.testing.assert_close(q.grad.full_tensor(), q_ref.grad)
            torch.testing.assert_close(k.grad.full_tensor(), k_ref.grad)

        self.run_subtests(
            {"mesh_shape": [(4,)], "layout": [(Shard(2),), (Shard(0),)]}, one
        )
        self.run_subtests({"mesh_shape": [(2, 2)], "layout": [(Shard(0), Shard(2)), (Shard(2), Shard(0))]}, one)

    @with_comms
    def test_rotary_block_on_sharded_sequence_with_sharded_freqs(self) -> None:
        # Sequence parallel: q and freqs_cis both sharded on the sequence dim.
        mesh = init_device_mesh("cpu", (4,))
        q_full, freqs_full = randn(2, 8, 3, 8, seed=3), precompute_freqs_cis(8, 8)
        q = distribute_tensor(q_full, mesh, [Shard(1)])
        freqs = distribute_tensor(freqs_full, mesh, [Shard(0)])
        with CommDebugMode() as comm:
            out, _ = apply_rotary_emb(q, q, freqs)
        self.assertEqual(comm.get_total_counts(), 0)
        self.assertEqual(out.placements, (Shard(1),))
        torch.testing.assert_close(out.full_tensor(), apply_rotary_emb(q_full, q_full, freqs_full)[0])


# ----- complex views and builders -------------------------------------------------------------------
class ComplexOpsTest(DTensorTestBase):
    @with_comms
    def test_view_as_complex_and_back_keep_every_shard_but_the_pair_dim(self) -> None:
        c = torch.polar(randn(7, 3, seed=4).abs(), randn(7, 3, seed=5))

        def one(mesh_shape) -> None:
            mesh = init_device_mesh("cpu", mesh_shape)
            replicated = (R,) * mesh.ndim
            for layout in layouts_for(mesh.ndim, 3):
                moves_pair = Shard(2) in layout  # the (re, im) pair is made whole first
                check_against_torch(lambda x, w: torch.view_as_complex(x) * w, randn(7, 3, 2).requires_grad_(), c.requires_grad_(), placements=[layout, replicated], mesh=mesh, collectives=None if moves_pair else 0)
            for layout in layouts_for(mesh.ndim, 2):  # 3 rows over 4 ranks: one holds an empty shard
                check_against_torch(lambda x: torch.view_as_real(torch.view_as_complex(x) * 1j), randn(3, 2, 2).requires_grad_(), placements=[layout], mesh=mesh, collectives=None if Shard(1) in layout else 0)
                check_against_torch(torch.view_as_real, c.requires_grad_(), placements=[layout], mesh=mesh, collectives=0)
                check_against_torch(lambda z: torch.view_as_real(z * 2).flatten(1), c.requires_grad_(), placements=[layout], mesh=mesh)

        self.run_subtests({"mesh_shape": MESHES}, one)

    @with_comms
    def test_complex_views_pass_sum_partials_and_keep_views_aliased(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        for layout in [(Partial("sum"), Shard(0)), (Partial("avg"), R)]:
            out = check_against_torch(lambda x: torch.view_as_real(torch.view_as_complex(x) * 2), randn(6, 4, 2).requires_grad_(), placements=[layout], mesh=mesh, collectives=0)
            self.assertEqual(out.placements, layout)
        # a max-partial has no meaning on complex values: it is reduced first
        check_against_torch(torch.view_as_complex, randn(6, 4, 2), placements=[(Partial("max"), R)], mesh=mesh, backward=False)

        x = distribute_tensor(randn(8, 4, 2), mesh, [Shard(0), Shard(1)])
        z = torch.view_as_complex(x)
        self.assertEqual(z.placements, (Shard(0), Shard(1)))
        self.assertEqual(z.to_local().data_ptr(), x.to_local().data_ptr())
        torch.view_as_real(z).mul_(3)  # writes through both views into x
        torch.testing.assert_close(x.full_tensor(), randn(8, 4, 2) * 3)

        # a shard's conjugate is computed, not a lazy view (torch skips the conj bit inside dispatch),
        # so writing into it is refused rather than silently lost
        conj = z.conj()
        torch.testing.assert_close(conj.full_tensor(), torch.view_as_complex(randn(8, 4, 2) * 3).conj())
        with self.assertRaisesRegex(RuntimeError, "conjugated"):
            conj.mul_(2)
        torch.testing.assert_close(conj.clone().mul_(2).full_tensor(), conj.full_tensor() * 2)

    @with_comms
    def test_polar_complex_and_conj_are_pointwise(self) -> None:
        def one(mesh_shape) -> None:
            mesh = init_device_mesh("cpu", mesh_shape)
            for layout in layouts_for(mesh.ndim, 2):
                fulls = [randn(5, 6, seed=6).abs().requires_grad_(), randn(5, 6, seed=7).requires_grad_()]
                check_against_torch(torch.polar, *fulls, placements=[layout, layout], mesh=mesh, collectives=0)
                check_against_torch(torch.complex, *fulls, placements=[layout, layout], mesh=mesh, collectives=0)
                check_against_torch(lambda a, b: torch.complex(a, b).conj() * torch.polar(a, b), *fulls, placements=[layout, layout], mesh=mesh, collectives=0)
                check_against_torch(lambda a, b: torch.conj_physical(torch.complex(a, b)), *fulls, placements=[layout, layout], mesh=mesh, collectives=0)
                check_against_torch(lambda a, b: torch.angle(torch.complex(a, b)), *fulls, placements=[layout, layout], mesh=mesh, collectives=0)

        self.run_subtests({"mesh_shape": MESHES}, one)
        mesh = init_device_mesh("cpu", (4,))
        # complex(re, im) is linear in (re, im) together: sum partials pass through
        out = check_against_torch(torch.complex, randn(4, 3, seed=8).requires_grad_(), randn(4, 3, seed=9).requires_grad_(), placements=[(Partial("sum"),), (Partial("sum"),)], mesh=mesh, collectives=0)
        self.assertEqual(out.placements, (Partial("sum"),))


# ----- in-place views --------------------------------------------------------------------------------
class InplaceViewTest(DTensorTestBase):
    @with_comms
    def test_matmul_of_vector_and_matrix_matches_torch(self) -> None:
        # matmul(1-d, 2-d) runs unsqueeze(0) -> mm -> squeeze_(0) on the DTensor itself
        def one(mesh_shape) -> None:
            mesh = init_device_mesh("cpu", mesh_shape)
            for layout_v, layout_m in itertools.product(layouts_for(mesh.ndim, 1), layouts_for(mesh.ndim, 2)):
                check_against_torch(torch.matmul, randn(8).requires_grad_(), randn(8, 6, seed=1).requires_grad_(), placements=[layout_v, layout_m], mesh=mesh)
                check_against_torch(torch.matmul, randn(6, 8, seed=1).requires_grad_(), randn(8).requires_grad_(), placements=[layout_m, layout_v], mesh=mesh)

        self.run_subtests({"mesh_shape": MESHES}, one)

    @with_comms
    def test_inplace_views_update_the_dtensor_spec_without_moving_data(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        full = randn(5, 1, 8)
        cases = [
            # (op, input placement, output placement)
            (lambda x: x.squeeze_(1), Shard(2), Shard(1)),
            (lambda x: x.squeeze_(), Shard(2), Shard(1)),  # 8 over 4: no rank's piece is 1 long
            (lambda x: x.unsqueeze_(0), Shard(2), Shard(3)),
            (lambda x: x.transpose_(0, 2), Shard(0), Shard(2)),
            (lambda x: x.squeeze_(1).t_(), Shard(2), Shard(0)),
            (lambda x: x.swapdims_(1, 2), R, R),
        ]
        for op, before, after in cases:
            x = distribute_tensor(full, mesh, [before])
            local = x.to_local()
            with CommDebugMode() as comm:
                result = op(x)
            expected = op(full.clone())
            self.assertIs(result, x)
            self.assertEqual(comm.get_total_counts(), 0)
            self.assertEqual(x.placements, (after,))
            self.assertEqual(x.shape, expected.shape)
            self.assertEqual(x.stride(), expected.stride())
            self.assertEqual(x._spec.shape, expected.shape)
            self.assertEqual(x.to_local().data_ptr(), local.data_ptr())
            torch.testing.assert_close(x.full_tensor(), expected)
        x = distribute_tensor(randn(3, 1, 8), mesh, [Shard(0)])  # 3 rows over 4 ranks: one shard is empty
        with CommDebugMode() as comm:
            x.squeeze_(1).unsqueeze_(2)
        self.assertEqual((comm.get_total_counts(), x.placements, x.shape), (0, (Shard(0),), (3, 8, 1)))
        torch.testing.assert_close(x.full_tensor(), randn(3, 8, 1))

    @with_comms
    def test_inplace_view_that_would_need_a_move_says_to_redistribute_self(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(randn(4, 1), mesh, [Shard(1)])  # a size-1 dim on 4 ranks: 3 hold nothing
        with self.assertRaisesRegex(NotImplementedError, "redistribute self"):
            x.squeeze_(1)
        self.assertEqual(x.shape, (4, 1))
        y = distribute_tensor(randn(5, 1, 3), mesh, [Shard(0)])  # 5 rows over 4: one rank holds a single row
        with self.assertRaisesRegex(NotImplementedError, "redistribute self"):
            y.squeeze_()
        y = y.redistribute(mesh, [R])
        y.squeeze_()
        self.assertEqual(y.placements, (R,))
        torch.testing.assert_close(y.full_tensor(), randn(5, 3))

    @with_comms
    def test_inplace_views_backward(self) -> None:
        def fn(x: torch.Tensor) -> torch.Tensor:
            y = x * 2
            y.unsqueeze_(0).transpose_(1, 2)
            return y.squeeze_(0) * 3

        def one(mesh_shape) -> None:
            mesh = init_device_mesh("cpu", mesh_shape)
            for layout in layouts_for(mesh.ndim, 2):
                check_against_torch(fn, randn(5, 6).requires_grad_(), placements=[layout], mesh=mesh, collectives=0)
            check_against_torch(fn, randn(4, 6).requires_grad_(), placements=[(Partial("sum"),) * mesh.ndim], mesh=mesh, collectives=0)

        self.run_subtests({"mesh_shape": MESHES}, one)


# ----- view(dtype) -----------------------------------------------------------------------------------
class ViewDtypeTest(DTensorTestBase):
    @with_comms
    def test_view_dtype_keeps_shards_where_the_blocks_line_up(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        cases = [
            # (shape, placement, dtype, placement kept without communication; None: data must move)
            ((6, 8), Shard(0), torch.int32, Shard(0)),
            ((6, 8), Shard(1), torch.int32, Shard(1)),  # same itemsize: any shard
            ((7, 5), Shard(1), torch.int32, Shard(1)),  # uneven, same itemsize
            ((6, 8), Shard(1), torch.int8, Shard(1)),  # 8 -> 32 bytes: both divide by 4
            ((6, 8), Shard(1), torch.float64, Shard(1)),  # 8 -> 4
            ((6, 4), Shard(1), torch.float64, None),  # 4 -> 2 doubles: a rank's pair of floats is not a block
            ((6, 6), Shard(1), torch.bfloat16, None),  # 6 does not divide by 4
            ((5, 6), Shard(0), torch.bfloat16, Shard(0)),  # other dims keep any shard
        ]
        for shape, placement, dtype, kept in cases:
            full = seeded_randn(*shape)
            x = distribute_tensor(full, mesh, [placement])
            with CommDebugMode() as comm:
                out = x.view(dtype)
            what = f"{shape} {placement} -> {dtype}"
            if kept is None:
                self.assertGreater(comm.get_total_counts(), 0, what)
            else:
                self.assertEqual(comm.get_total_counts(), 0, what)
                self.assertEqual(out.placements, (kept,), what)
                self.assertEqual(out.to_local().data_ptr(), x.to_local().data_ptr(), what)
            self.assertTrue(torch.equal(out.full_tensor(), full.view(dtype)), what)

    @with_comms
    def test_view_dtype_reduces_partials_first(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        full = seeded_randn(4, 6)
        x = make_dtensor(full, mesh, (Partial("sum"), Shard(0)))
        out = x.view(torch.int32)
        self.assertFalse(any(isinstance(p, Partial) for p in out.placements), out.placements)
        self.assertTrue(torch.equal(out.full_tensor(), x.full_tensor().view(torch.int32)))


# ----- repeat_interleave -----------------------------------------------------------------------------
class RepeatInterleaveTest(DTensorTestBase):
    @with_comms
    def test_repeat_interleave_int_keeps_shards(self) -> None:
        def one(mesh_shape) -> None:
            mesh = init_device_mesh("cpu", mesh_shape)
            for layout in layouts_for(mesh.ndim, 3):
                for dim in (0, 1, 2, None):
                    check_against_torch(lambda x, dim=dim: x.repeat_interleave(2, dim=dim), randn(5, 4, 3).requires_grad_(), placements=[layout], mesh=mesh)

        self.run_subtests({"mesh_shape": MESHES}, one)
        mesh = init_device_mesh("cpu", (4,))
        cases = [
            # (placement, dim, placement kept without communication)
            (Shard(0), 2, Shard(0)),  # a dim not repeated keeps its shard, even or not
            (Shard(2), 0, Shard(2)),
            (Shard(1), 1, Shard(1)),  # the repeated dim, sharded evenly (4 over 4)
        ]
        full = randn(5, 4, 3)
        for placement, dim, kept in cases:
            x = distribute_tensor(full, mesh, [placement])
            with CommDebugMode() as comm:
                out = torch.repeat_interleave(x, 3, dim=dim)
            self.assertEqual(comm.get_total_counts(), 0)
            self.assertEqual(out.placements, (kept,))
            torch.testing.assert_close(out.full_tensor(), torch.repeat_interleave(full, 3, dim=dim))

    @with_comms
    def test_repeat_kv_for_grouped_query_attention(self) -> None:
        # torchtitan's repeat_kv: [bs, seq, kv_heads, head_dim] -> [bs, seq, kv_heads * n_rep, head_dim]
        mesh = init_device_mesh("cpu", (4,))
        for layout in [(Shard(0),), (Shard(2),)]:
            check_against_torch(lambda kv: torch.repeat_interleave(kv, 2, dim=2), randn(4, 3, 4, 8).requires_grad_(), placements=[layout], mesh=mesh, collectives=0)
            check_against_torch(lambda kv: kv[:, :, :, None, :].expand(4, 3, 4, 2, 8).reshape(4, 3, 8, 8), randn(4, 3, 4, 8).requires_grad_(), placements=[layout], mesh=mesh, collectives=0)


class RulesOnlyTest(DTensorTestBase):
    """Ops that used to reach the replicate fallback (or raise) now run on their rules alone."""

    def setUp(self) -> None:
        super().setUp()
        self.enterContext(replicate_fallback(False))

    @with_comms
    def test_repeat_interleave_with_a_tensor_of_counts(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        full = randn(8, 3, 4)
        counts = distribute_tensor(torch.tensor([1, 2, 3]), mesh, [R])
        x = distribute_tensor(full, mesh, [Shard(0)])
        with CommDebugMode() as comm:
            out = torch.repeat_interleave(x, counts, dim=1, output_size=6)
        self.assertEqual(comm.get_total_counts(), 0)
        self.assertEqual(out.placements, (Shard(0),))
        torch.testing.assert_close(out.full_tensor(), torch.repeat_interleave(full, torch.tensor([1, 2, 3]), dim=1))
        with implicit_replication():  # a plain tensor of counts, the same on every rank
            out = torch.repeat_interleave(x, torch.tensor([1, 2, 3]), dim=1)
        torch.testing.assert_close(out.full_tensor(), torch.repeat_interleave(full, torch.tensor([1, 2, 3]), dim=1))

    @with_comms
    def test_item_and_narrow_with_a_tensor_start(self) -> None:
        mesh = init_device_mesh("cpu", (2, 2))
        self.assertEqual(distribute_tensor(torch.tensor(2.5), mesh, [R, R]).item(), 2.5)
        self.assertEqual(make_dtensor(torch.tensor([3.0]), mesh, [Partial("sum"), Shard(0)]).item(), 3.0)
        start = distribute_tensor(torch.tensor(2), mesh, [R, R])
        full = randn(5, 6, 7)
        for layout in [(Shard(0), R), (Shard(2), Shard(0)), (R, Shard(1))]:
            check_against_torch(lambda x: x.narrow(1, start, 3), full.requires_grad_(), placements=[layout], mesh=mesh)
            check_against_torch(lambda x: x.narrow(1, torch.tensor(2), 3), full.requires_grad_(), placements=[layout], mesh=mesh)

    @with_comms
    def test_list_indexing_treats_the_list_as_replicated(self) -> None:
        full = randn(5, 6, 4)
        cases = [
            lambda x: x[[0, 2]],
            lambda x: x[:, [0, 2, 5]],
            lambda x: x[:, [0, 2], 1:],
            lambda x: x[([[0, 1], [4, 2]],)],  # a 2-d index
            lambda x: x[[0, 2], :, [1, 3]],  # two index lists, not adjacent
        ]

        def one(mesh_shape) -> None:
            mesh = init_device_mesh("cpu", mesh_shape)
            for fn in cases:
                for layout in layouts_for(mesh.ndim, 3):
                    check_against_torch(fn, full.detach().requires_grad_(), placements=[layout], mesh=mesh)  # full is written below

        self.run_subtests({"mesh_shape": MESHES}, one)
        mesh = init_device_mesh("cpu", (4,))
        x = distribute_tensor(full, mesh, [Shard(0)])
        with CommDebugMode() as comm:
            kept = x[:, [0, 2, 5]]
        self.assertEqual((comm.get_total_counts(), kept.placements), (0, (Shard(0),)))  # dim 0 not indexed
        with self.assertRaisesRegex(RuntimeError, "plain torch.Tensor"):
            x[torch.tensor([0, 2])]  # a plain tensor may differ between ranks: distribute it
        with self.assertRaisesRegex(RuntimeError, "plain torch.Tensor"):
            x[[0, 2], torch.tensor([1, 3])]  # even beside a list

    @with_comms
    def test_list_index_assignment_writes_into_the_shards(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        full = randn(5, 6)
        x = distribute_tensor(full, mesh, [Shard(0)])
        expected = full.clone()
        values = distribute_tensor(randn(5, 2, seed=1), mesh, [Shard(0)])
        with CommDebugMode() as comm:
            x[:, [0, 2]] = 7.0
            x[:, [1, 3]] = values
        expected[:, [0, 2]] = 7.0
        expected[:, [1, 3]] = randn(5, 2, seed=1)
        self.assertEqual(comm.get_total_counts(), 0)
        self.assertEqual(x.placements, (Shard(0),))
        torch.testing.assert_close(x.full_tensor(), expected)
        with self.assertRaisesRegex(RuntimeError, "plain torch.Tensor"):
            x[:, [0, 2]] = torch.ones(5, 2)

    @with_comms
    def test_index_put_keeps_self_sharded_on_dims_not_indexed(self) -> None:
        mesh = init_device_mesh("cpu", (4,))
        full, values_full = randn(8, 6), randn(8, 3, seed=2)
        columns = torch.tensor([0, 3, 5])
        aten = torch.ops.aten
        for accumulate in (False, True):
            x = distribute_tensor(full, mesh, [Shard(0)])
            values = distribute_tensor(values_full, mesh, [Shard(0)])
            index = distribute_tensor(columns, mesh, [R])
            with CommDebugMode() as comm:  # x[:, columns] = values (or +=, accumulating)
                aten.index_put_(x, [None, index], values, accumulate)
            self.assertEqual(comm.get_total_counts(), 0)
            self.assertEqual(x.placements, (Shard(0),))
            expected = aten.index_put(full, [None, columns], values_full, accumulate)
            torch.testing.assert_close(x.full_tensor(), expected)

            def put(t: torch.Tensor, v: torch.Tensor, accumulate: bool = accumulate, index: DTensor = index) -> torch.Tensor:
                return aten.index_put(t, [None, index if isinstance(t, DTensor) else columns], v, accumulate)

            check_against_torch(put, full.detach().requires_grad_(), values_full.detach().requires_grad_(), placements=[(Shard(0),), (Shard(0),)], mesh=mesh, collectives=0)


class CausalMaskTest(DTensorTestBase):
    @with_comms
    def test_causal_attention_masks_keep_head_and_batch_shards(self) -> None:
        b, h, seq, d = 4, 4, 6, 8
        fulls = [randn(b, h, seq, d, seed=i) for i in range(3)]
        expected_out = F.scaled_dot_product_attention(*fulls, is_causal=True)

        bool_mask_full = torch.ones(seq, seq, dtype=torch.bool).tril()
        float_mask_full = torch.full((seq, seq), float("-inf")).triu(1)

        def explicit(q, k, v, bool_mask, float_mask):  # masked_fill broadcasts the [seq, seq] mask
            scores = torch.einsum("bhld,bhmd->bhlm", q, k) / d**0.5
            scores = scores.masked_fill(~bool_mask, float("-inf"))
            return torch.einsum("bhlm,bhmd->bhld", torch.softmax(scores, -1), v)

        variants = [
            lambda q, k, v, bool_mask, float_mask: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            lambda q, k, v, bool_mask, float_mask: F.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask),
            lambda q, k, v, bool_mask, float_mask: F.scaled_dot_product_attention(q, k, v, attn_mask=float_mask),
        ]

        def one(placement) -> None:
            mesh = init_device_mesh("cpu", (4,))
            bool_mask = torch.tril(spmd_ones(seq, seq, device_mesh=mesh, placements=[R], dtype=torch.bool))
            float_mask = distribute_tensor(float_mask_full, mesh, [R])
            # heads sharded: the einsum's (b, h) flatten cannot keep an inner shard, so only batch here
            for fn in variants + ([explicit] if placement == Shard(0) else []):
                qkv = [distribute_tensor(f, mesh, [placement]).requires_grad_() for f in fulls]
                refs = [f.clone().requires_grad_() for f in fulls]
                with CommDebugMode() as comm:
                    out = fn(*qkv, bool_mask, float_mask)
                    out.to_local().sum().backward()
                self.assertEqual(comm.get_total_counts(), 0, comm.get_comm_counts())
                self.assertEqual(out.placements, (placement,))
                torch.testing.assert_close(out.full_tensor(), expected_out)
                fn(*refs, bool_mask_full, float_mask_full).sum().backward()
                for x, ref in zip(qkv, refs):
                    torch.testing.assert_close(x.grad.full_tensor(), ref.grad)

        self.run_subtests({"placement": [Shard(0), Shard(1)]}, one)


# ----- a torchtitan-style attention block under tensor parallelism ----------------------------------
class Attention(torch.nn.Module):
    """Llama attention: grouped-query heads, rotary embeddings, causal SDPA (torchtitan's shape)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = torch.nn.Linear(dim, n_heads * self.head_dim, bias=False, dtype=torch.float64)
        self.wk = torch.nn.Linear(dim, n_kv_heads * self.head_dim, bias=False, dtype=torch.float64)
        self.wv = torch.nn.Linear(dim, n_kv_heads * self.head_dim, bias=False, dtype=torch.float64)
        self.wo = torch.nn.Linear(n_heads * self.head_dim, dim, bias=False, dtype=torch.float64)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        # -1 heads: under TP each rank holds its heads (a DTensor keeps the global count)
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        xv = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        n_rep = self.n_heads // self.n_kv_heads
        keys, values = torch.repeat_interleave(xk, n_rep, dim=2), torch.repeat_interleave(xv, n_rep, dim=2)
        out = F.scaled_dot_product_attention(
            xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).contiguous().view(bs, seqlen, -1))


class TensorParallelAttentionTest(DTensorTestBase):
    def setUp(self) -> None:
        super().setUp()
        self.enterContext(replicate_fallback(False))  # every op below must have a rule

    @with_comms
    def test_attention_block_with_rotary_embeddings_matches_one_device(self) -> None:
        from spmd.tensor_parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        dim, n_heads, n_kv_heads, seq = 32, 8, 4, 6
        reference = Attention(dim, n_heads, n_kv_heads)
        with torch.no_grad():
            for i, p in enumerate(reference.parameters()):
                p.copy_(randn(*p.shape, seed=20 + i) / dim**0.5)
        model = Attention(dim, n_heads, n_kv_heads)
        model.load_state_dict(reference.state_dict())
        mesh = init_device_mesh("cpu", (4,))
        parallelize_module(model, mesh, {
            "wq": ColwiseParallel(use_local_output=False),
            "wk": ColwiseParallel(use_local_output=False),
            "wv": ColwiseParallel(use_local_output=False),
            "wo": RowwiseParallel(),
        })
        x_full, freqs_full = randn(2, seq, dim, seed=1), precompute_freqs_cis(dim // n_heads, seq)
        freqs = distribute_tensor(freqs_full, mesh, [R])
        x = x_full.clone().requires_grad_()
        with CommDebugMode() as comm:
            out = model(x, freqs)
            out.sum().backward()
        # forward: one all-reduce after wo; backward: one per colwise layer for the input's gradient;
        # rotary embeddings, repeat_interleave and attention move nothing
        self.assertEqual(comm.get_comm_counts(), {"all_reduce": 4})

        x_ref = x_full.clone().requires_grad_()
        expected = reference(x_ref, freqs_full)
        expected.sum().backward()
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(x.grad, x_ref.grad)
        assert_same_grads(model, reference)
