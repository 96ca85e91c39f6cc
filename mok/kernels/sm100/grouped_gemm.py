"""Expert-grouped GEMM for Blackwell (sm_100a / sm_103a): tcgen05 MMA into tensor memory, fed by TMA.

    C[rows of tile m, :] = epilogue(A[rows of tile m, :] · B[e(m)])

The contract (A's expert-grouped rows, B's major modes, k_split, the four epilogues and their
value math, the launch arguments) is every arch's: mok/kernels/common/grouped_gemm.py. Here: the
warp-specialised kernel of mok/kernels/sm100/tcgen05_tile.py, persistent (at most one CTA per SM
walks the tiles in the L2-grouped order of mok/kernels/common/tile_order.py) or one CTA per tile,
on bf16 operands or on MXFP8 ones (block-scaled MMAs: GroupedGemmMxfp8Sm100). The Hopper kernel's
gather_a is not written here yet (its ping-pong is what two accumulator stages give this kernel
anyway). ``scatter`` (the expert-parallel push): each epilogue thread's row goes to
its (token, slot) row of the combine slots of the token's rank, 16-byte stores from registers.

The MMA warp accumulates into tensor memory (one accumulator, or two for SwiGLU: gate in columns
[0, tile_n), up in [tile_n, 2·tile_n) of the accumulator stage); the four epilogue warps read
them back (thread t holds row t of the tile, 32 columns at a time), apply the epilogue, stage
each output's 128 x 32 bf16 subtile in shared memory and store it by TMA (Tcgen05TileKernel.store_subtile;
the TMA clips rows past R and columns past N; ``scatter``'s rows go from registers). With whole
rows per thread the SwiGLU backward's row sums are plain sequential sums in column order (the
Hopper kernel adds four threads' parts with shuffles).

``cluster_m`` = 2 (bf16): clusters of two CTAs on row tiles 2p and 2p + 1 of one column tile,
which load each B (and B2) tile once for both by TMA multicast where one expert has both row
tiles, each its own otherwise (a CTA whose row tile has no rows runs the stages on the other's
expert and stores nothing): Hopper's row-tile pairs (mok/kernels/sm90/grouped_gemm.py), on the
cluster pipeline of mok/kernels/sm100/tcgen05_tile.py. The same sums as one CTA.

Determinism and batch invariance as on Hopper: one CTA owns each output tile, K is reduced in one
fixed order (the MMA sequence), the tile shape comes from static shapes only. Results are not the
Hopper kernel's bits (another MMA unit, another summation inside it).

Status: compiled for sm_100a and sm_103a and its PTX checked (tests/test_kernels_ptx.py); never
run: no SM100 GPU was available to this project. tests/test_sm100_gpu.py holds it to the float32
reference on such a GPU.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline

from ..common.compile import compile_kernel
from ..common.records import grouped_gemm_args
from ..common.grouped_gemm import GroupedGemm
from ..common.row_gather import gather_stage, gathered_rows
from ..common.row_vectors import VECTOR
from ..common.tile_order import grouped_tile, row_tile_pair
from .tcgen05_tile import (
    E4M3_ROW_STEP, EPI_COLS, PAIR, STORE_BUFFERS, TILE_K, TILE_K_MXFP8, Tcgen05TileKernel, pick_mxfp8_stages, pick_stages,
)


class GroupedGemmSm100(GroupedGemm, Tcgen05TileKernel):
    """Static config: N, K, epilogue, B's major mode, K split, top-k, unit scale, column tile, stages,
    the gated activation, persistent, scatter (the plain epilogue's rows to their (token, slot) rows
    of the combine slots, common/grouped_gemm.py's slot_vector: the expert-parallel push), expert
    biases (common/grouped_gemm.py)."""

    takes_bias = True
    partial_tiles = True  # N and K past the tile: TMA zero-fills the loads, the epilogue stores nothing past N
    tile_k = TILE_K  # K values a stage holds (its K tiles: ceil(K / tile_k), each half's with k_split)

    def __init__(
        self, n: int, k: int, epilogue: str = "plain", *, b_major: str = "k", k_split: bool = False, topk: int = 1,
        unit_scale: bool = False, tile_n: int = 128, stages: int | None = None, b_expert_stride: int | None = None,
        activation: str = "swiglu", persistent: bool = False, scatter: bool = False, bias: bool = False, gather_a: bool = False,
        b_row_stride: int | None = None, cluster_m: int = 1,
    ) -> None:
        self.configure(n, k, epilogue, b_major, k_split, topk, unit_scale, tile_n, self.tile_k, b_expert_stride, activation, bias, b_row_stride)
        if cluster_m not in (1, PAIR) or (cluster_m == PAIR and self.mxfp8):
            raise ValueError(f"cluster_m: expected 1, or {PAIR} with bf16 operands, got {cluster_m}{' (MXFP8)' if self.mxfp8 else ''}")
        self.cluster_m = cluster_m
        if scatter and epilogue != "plain":
            raise ValueError(f"scatter: only with the plain epilogue (the expert-parallel row pushes), got epilogue={epilogue!r}")
        if gather_a and (k_split or scatter):
            raise ValueError("gather_a: not with k_split or scatter (the forward's gate/up GEMM gathers x's rows)")
        self.persistent, self.scatter, self.gather_a = persistent, scatter, gather_a
        self.store_dtype = None if scatter else cutlass.BFloat16  # (rows stored by TMA; scattered ones from registers)
        self.ab_stage = pick_stages((self.tile_shape_mnk[0] + self.num_b * tile_n) * TILE_K * 2, stages, self.store_bytes())

    def launch(self, m_a, m_bs, scales, m_c, row_args, rows, num_experts, max_ctas, scatter_to, stream, biases):
        """Host side (see GroupedGemm.launch): MXFP8's scale tensors, the TMA loads, the grid (the
        scatter arguments and the biases are the Hopper kernel's)."""
        m_tiles, num_row_tiles, num_rows = rows
        scale_tensors = ()
        if self.mxfp8:  # A's scales [ceil(R / 128)·128 rows, K' / 32], B's and B2's per expert [N, K / 32] (whole chunks)
            a_scale_ptr, b_scale_ptr, b2_scale_ptr = scales[:3]
            m_sfa = self.scale_tensor(a_scale_ptr, num_row_tiles * self.tile_shape_mnk[0], self.scale_k, 1)
            m_sfbs = (self.scale_tensor(b_scale_ptr, self.n, self.b_k, num_experts),
                      self.scale_tensor(b2_scale_ptr, self.n, self.b_k, num_experts))
            scale_tensors = (m_sfa, m_sfbs)
        tiled_mma, layouts, loads = self.prepare("k", "k" if self.b_major == "k" else "mn", m_a, m_bs, *scale_tensors)
        all_tiles = (num_row_tiles + self.cluster_m - 1) // self.cluster_m * self.col_tiles
        m_dst = self.scatter_target(scatter_to) if self.scatter else None
        m_biases = tuple(cute.make_tensor(p, cute.make_layout((num_experts * self.n,))) for p in biases) if self.bias else None
        m_x = m_a if self.gather_a else None  # (gather_a: A is x [T, K], its rows copied by the gather warps)
        stores = ()  # the TMA stores of C (dh with swiglu_bwd), then of h (swiglu_save) or of a_scaled (swiglu_bwd)
        if not self.scatter:
            stores = (self.store_atom(m_c),)
            if self.epilogue_kind == "swiglu_save":
                stores += (self.store_atom(row_args[0]),)
            if self.epilogue_kind == "swiglu_bwd":
                stores += (self.store_atom(row_args[1]),)
        kernel = self.kernel(tiled_mma, layouts, loads, m_c, row_args, m_tiles, num_row_tiles, num_rows, m_dst, m_biases, m_x, stores)
        self.launch_kernel(kernel, all_tiles, max_ctas, stream)

    @cute.kernel
    def kernel(
        self, tiled_mma: cute.TiledMma, smem_layouts: tuple, loads: tuple, m_c: cute.Tensor, row_args: tuple, m_tiles: cute.Tensor,
        num_row_tiles: cutlass.Int32, num_rows: cutlass.Int32, m_dst: tuple | None, m_biases: tuple | None, m_x: cute.Tensor | None,
        stores: tuple,
    ):
        """The CTA's tiles (Tcgen05TileKernel.run_tiles); ``smem_layouts`` = the staged layouts of A
        and B (MXFP8: and of their scales), ``loads`` = the TMA atoms and coordinate tensors of A, B
        and B2 (MXFP8: then of their scales), ``row_args`` the epilogue's row tensors (h, a_scaled,
        partial, row_token, row_slot, topk_w), ``m_dst`` where scattered rows go (``scatter``),
        ``m_biases`` B's and B2's bias rows [E·N] (``bias``), ``m_x`` the token matrix (``gather_a``),
        ``stores`` the TMA stores (atom, coordinate tensor) of the outputs (none with ``scatter``)."""
        tiles = ((num_row_tiles + self.cluster_m - 1) // self.cluster_m * self.col_tiles, m_tiles, num_row_tiles)
        row_token = row_args[3]
        epi_args = (m_c, row_args, num_rows, m_dst, m_biases, stores)
        self.run_tiles(tiled_mma, smem_layouts, loads, tiles, epi_args, (m_x, row_token, num_rows))

    @cute.jit
    def tile_at(self, linear, tiles):
        """Tile ``linear`` of the walk (the L2-grouped order) -> (computed, K tiles, (row tile, column
        tile, its expert, the expert whose B the stages hold, whether B is loaded for both CTAs)):
        computed where the row tile holds rows of an expert; with ``cluster_m`` = 2 the walk goes
        over pairs of row tiles (CTA rank r: row tile 2p + r), computed where either of the pair
        holds rows, B shared where one expert has both (-1: no rows)."""
        _, m_tiles, num_row_tiles = tiles
        if cutlass.const_expr(self.cluster_m == PAIR):
            tile = row_tile_pair(linear, num_row_tiles, self.col_tiles, m_tiles, self.rank_along_m())
            return tile[3] >= 0, self.k_tiles, tile
        tile_row, tile_col = grouped_tile(linear, num_row_tiles, self.col_tiles)
        expert = m_tiles[tile_row]
        return expert >= 0, self.k_tiles, (tile_row, tile_col, expert, expert, False)

    def stores_tile(self, tile):
        """``cluster_m``: whether the CTA's row tile of a computed pair has rows (else nothing is stored)."""
        return tile[2] >= 0

    def tma_views(self, tiled_mma, loads, stages, tile):
        """The TMA partitions of this tile's operands, (atom, global by K tile, shared by stage) for
        A, B, B2 and A's second half of K (k_split; else A again) (MXFP8: then for their scales;
        ``cluster_m``: then B's and B2's multicast loads of this CTA's half, and whether to use them):
        what ``load_stage`` reads."""
        tile_row, tile_col, _, expert, shared_b = tile
        a = self.operand_view(tiled_mma, loads[0], stages[0], "a", tile_row, 0)
        views = (
            a,
            self.operand_view(tiled_mma, loads[1], stages[1], "b", tile_col, expert),
            self.operand_view(tiled_mma, loads[2], stages[2], "b", tile_col, expert),
            self.operand_view(tiled_mma, loads[0], stages[0], "a", tile_row, 1) if self.k_split else a,
        )
        if cutlass.const_expr(self.mxfp8):
            views += (
                self.operand_view(tiled_mma, loads[3], stages[3], "a", tile_row, 0, scales=True),
                self.operand_view(tiled_mma, loads[4], stages[4], "b", tile_col, expert, scales=True),
                self.operand_view(tiled_mma, loads[5], stages[5], "b", tile_col, expert, scales=True),
            )
        if cutlass.const_expr(self.cluster_m == PAIR):
            rank = self.rank_along_m()
            views += (
                self.operand_view(tiled_mma, loads[-2], stages[1], "b", tile_col, expert, multicast_rank=rank),
                self.operand_view(tiled_mma, loads[-1], stages[2], "b", tile_col, expert, multicast_rank=rank),
                shared_b,
            )
        return views

    @cute.jit
    def load_stage(self, empty, views):
        """TMA-load K tile ``empty.count`` of A and B (and B2; k_split: A's and B's first halves of K
        or their second halves, A's and B2's; MXFP8: and their scales the same way, A's counted
        through both halves) into stage ``empty.index``."""
        k_tile = empty.count
        if cutlass.const_expr(not self.gather_a):  # (gathered: the gather warps copy A's rows)
            self.load_operand(views[0], views[3], k_tile, empty, False)
        if cutlass.const_expr(self.cluster_m == PAIR):
            if views[-1]:  # one expert's two row tiles: this CTA's half of B (and B2) into both CTAs
                both = cute.nvgpu.cpasync.create_tma_multicast_mask(cute.make_layout((1, PAIR, 1, 1)), (0, 0, 0, 0), mcast_mode=1)
                self.load_operand(views[-3], views[-2], k_tile, empty, self.num_b == 2, both)
            else:
                self.load_operand(views[1], views[2], k_tile, empty, self.num_b == 2)
        else:
            self.load_operand(views[1], views[2], k_tile, empty, self.num_b == 2)
        if cutlass.const_expr(self.mxfp8):
            self.load_tile(views[4], k_tile, empty)
            self.load_operand(views[5], views[6], k_tile, empty, self.num_b == 2)

    @cute.jit
    def gather_warps(self, tidx, stages, pipes, tiles, gather_args):
        """``gather_a``, warps 6-9 (``tidx`` 0..127): for each computed tile, :meth:`gather_tile`; the
        states follow the load warp's stage by stage."""
        m_x, m_row_token, num_rows = gather_args
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)
        linear, step = self.first_tile_and_step()
        while linear < tiles[0]:
            active, k_tiles, tile = self.tile_at(linear, tiles)
            if active:
                state = self.gather_tile(tidx, stages, pipes, state, m_x, m_row_token, num_rows, tile[0], k_tiles)
            linear += step
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def gather_tile(self, tidx, stages, pipes, state, m_x, m_row_token, num_rows, tile_row, k_tiles):
        """``gather_a``, the gather warps, one tile: its rows of x (row_token; zeros for padding rows)
        into each K tile's stage by cp.async, once the stage is free (mok/kernels/common/row_gather.py),
        each thread's copies arriving on the stage's full barrier as they land. Returns the
        advanced pipeline state."""
        ab_pipeline, a_base = pipes[4], stages[3]
        tile_m, _, tile_k = self.tile_shape_mnk
        addresses, rows_read = gathered_rows(m_x, m_row_token, tile_row, num_rows, tidx, tile_m, self.k, VECTOR)
        for k_tile in cutlass.range(k_tiles, unroll=1):
            ab_pipeline.sync_object_empty.wait(state.index, state.phase)
            gather_stage(a_base, state.index, addresses, rows_read, k_tile, cutlass.BFloat16, tidx, tile_m, tile_k, self.k)
            cute.arch.cp_async_mbarrier_arrive_noinc(ab_pipeline.producer_get_barrier(state))
            state.advance()
        return state

    @cute.jit
    def load_tile(self, view, k_tile, empty, into=None, mcast_mask=None):
        """One TMA load: K tile ``k_tile`` of ``view`` = (atom, global by K tile, shared by stage) into
        stage ``empty.index`` of its own shared buffer (or of ``into``'s); ``mcast_mask``: the CTAs a
        multicast load writes (the same stage of each)."""
        atom, g_x, s_x = view
        if cutlass.const_expr(into is not None):
            s_x = into[2]
        multicast = {} if mcast_mask is None else {"mcast_mask": mcast_mask}
        cute.copy(atom, g_x[(None, k_tile)], s_x[(None, empty.index)], tma_bar_ptr=empty.barrier, **multicast)

    @cute.jit
    def load_operand(self, view, view2, k_tile, empty, both: cutlass.Constexpr, mcast_mask=None):
        """K tile ``k_tile`` of an operand: with k_split K's first half from ``view`` and its second
        from ``view2`` into ``view``'s buffer (each half's tiles bounded at K/2, the last zero-filled
        past it); else from ``view``, and with ``both`` (SwiGLU's B and B2) from ``view2`` too.
        ``mcast_mask``: multicast loads' CTAs."""
        if cutlass.const_expr(self.k_split):
            half = self.half_k_tiles
            if k_tile < half:
                self.load_tile(view, k_tile, empty, mcast_mask=mcast_mask)
            else:
                self.load_tile(view2, k_tile - half, empty, into=view, mcast_mask=mcast_mask)
        else:
            self.load_tile(view, k_tile, empty, mcast_mask=mcast_mask)
            if cutlass.const_expr(both):
                self.load_tile(view2, k_tile, empty, mcast_mask=mcast_mask)

    @cute.jit
    def epilogue(self, tidx, t_acc, stage, tile, k_tiles, epi_args):
        """Accumulator stage ``stage`` of ``tile`` (tensor memory) -> registers (32 columns of one row
        per thread at a time) -> epilogue math -> bf16 -> shared memory -> TMA stores, 128 x 32 at
        a time (Tcgen05TileKernel.store_subtile; the TMA clips rows past R and columns past N).
        ``epi_args`` = (C, the row tensors, R, where scattered rows go, the biases, the outputs'
        TMA stores, their staging buffers). With ``scatter`` the thread's row goes to its slot from
        registers, 16 bytes at a time (none for a padding row); with ``bias`` (plain, swiglu,
        swiglu_save) the expert's bias is added to each accumulator first, so h and the activation
        see x·Wᵀ + b."""
        m_c, row_args, num_rows, m_dst, m_biases, stores = epi_args[:6]
        tile_row, tile_col, expert = tile[:3]
        m_h, m_as, m_part, m_row_token, m_row_slot, m_topk_w = row_args
        tile_m, tile_n, _ = self.tile_shape_mnk
        t2r, thr, src, src2 = self.accumulator_reader(tidx, t_acc, stage)

        def thread_view(tensor, col_tile):  # this thread's part of a [128, tile_n] tile, by subtile
            return self.thread_view(thr, cute.local_tile(tensor, (tile_m, tile_n), (tile_row, col_tile)))

        def by_subtile(store, tensor):  # a TMA store and this tile of its output as 128 x 32 subtiles
            return store[0], cute.flat_divide(cute.local_tile(tensor, (tile_m, tile_n), (tile_row, tile_col)), (tile_m, EPI_COLS))

        dst = thread_view(m_c[None, None, 0], tile_col)  # (C and h: (R, N, halves), common/gemm_args.halves)
        dst_gate = thread_view(m_h[None, None, 0], tile_col)  # swiglu_bwd: h read
        dst_up = thread_view(m_h[None, None, 1], tile_col)
        coords = thread_view(cute.make_identity_tensor((num_rows, self.n)), tile_col)
        row = coords[0][0]  # 32x32b: all of a thread's values lie in one row
        row_ok = row < num_rows
        # the outputs of a subtile in the order they are stored (the last: C)
        outputs = ()
        if cutlass.const_expr(self.scatter):  # C: every row of the tile at this thread's slot (a row stride of 0)
            first = self.slot_vector(row, num_rows, m_row_token, m_row_slot, m_dst)
            row_ok = first >= 0
            slot = cute.make_ptr(cutlass.BFloat16, (m_c.iterator + first * VECTOR).toint(), cute.AddressSpace.gmem, assumed_align=16)
            slot_rows = cute.make_tensor(slot, cute.make_layout((tile_m, self.n), stride=(0, 1)))
            dst = self.thread_view(thr, cute.local_tile(slot_rows, (tile_m, tile_n), (0, tile_col)))
        else:
            s_store, t_c = epi_args[6], stores[0][1]
            if cutlass.const_expr(self.epilogue_kind == "swiglu_bwd"):  # dh_up, a_scaled, then dh_gate
                outputs = (by_subtile(stores[0], t_c[None, None, 1]), by_subtile(stores[1], stores[1][1]))
            if cutlass.const_expr(self.epilogue_kind == "swiglu_save"):  # h's gate and up halves, then a
                t_h = stores[1][1]
                outputs = (by_subtile(stores[1], t_h[None, None, 0]), by_subtile(stores[1], t_h[None, None, 1]))
            outputs += (by_subtile(stores[0], t_c[None, None, 0]),)
        adds_bias = self.bias and self.epilogue_kind != "swiglu_bwd"
        bias_rows = ()
        if cutlass.const_expr(adds_bias):  # the expert's bias rows as tiles of identical rows (a row stride of 0)
            for m_bias in m_biases[: self.num_b]:
                first_col = cute.make_ptr(cutlass.BFloat16, (m_bias.iterator + expert * self.n).toint(), cute.AddressSpace.gmem,
                                          assumed_align=4)
                rows_of_bias = cute.make_tensor(first_col, cute.make_layout((tile_m, self.n), stride=(0, 1)))
                bias_rows += (self.thread_view(thr, cute.local_tile(rows_of_bias, (tile_m, tile_n), (0, tile_col))),)

        r_acc = cute.make_rmem_tensor(dst[(None, None, None, 0, 0)].shape, cutlass.Float32)
        r_acc2 = cute.make_rmem_tensor(r_acc.shape, cutlass.Float32)
        r_x = cute.make_rmem_tensor(r_acc.shape, cutlass.Float32)
        r_out = cute.make_rmem_tensor(r_acc.shape, cutlass.BFloat16)
        r_gate = cute.make_rmem_tensor(r_acc.shape, cutlass.BFloat16)
        r_up = cute.make_rmem_tensor(r_acc.shape, cutlass.BFloat16)
        r_bias = cute.make_rmem_tensor(r_acc.shape, cutlass.BFloat16)  # (bias: the subtile's columns of B's and B2's)
        r_bias2 = cute.make_rmem_tensor(r_acc.shape, cutlass.BFloat16)
        s = cutlass.Float32(0.0)
        if cutlass.const_expr(self.epilogue_kind == "swiglu_bwd"):
            s = self.row_scale(row, num_rows, m_row_token, m_row_slot, m_topk_w)
            r_gate.fill(0.0)  # (rows past R: zeros; their values are clipped by the stores)
            r_up.fill(0.0)
        row_sum = cutlass.Float32(0.0)
        partial = self.n % tile_n != 0  # N's last column tile holds fewer columns: nothing read or written past N
        for sub in cutlass.range(tile_n // EPI_COLS, unroll=1):
            cols_left = self.n - (tile_col * tile_n + sub * EPI_COLS)

            def put(values, which: int):  # output ``which`` of this subtile by TMA (the staging buffers alternate)
                self.store_subtile(tidx, t2r, values, s_store, outputs[which], sub, (sub * len(outputs) + which) % STORE_BUFFERS)

            if cutlass.const_expr(partial):  # (what is not loaded past N reads as zero)
                r_gate.fill(0.0)
                r_up.fill(0.0)
                r_bias.fill(0.0)
                r_bias2.fill(0.0)
            if cutlass.const_expr(self.epilogue_kind == "swiglu_bwd"):
                if row_ok:  # the saved h of these columns, loaded while the accumulator comes out of tensor memory
                    self.copy_row_part(dst_gate[(None, None, None, 0, sub)], r_gate, cols_left, partial)
                    self.copy_row_part(dst_up[(None, None, None, 0, sub)], r_up, cols_left, partial)
            if cutlass.const_expr(adds_bias):  # the subtile's columns of the bias rows, while the accumulators come out
                self.copy_row_part(bias_rows[0][(None, None, None, 0, sub)], r_bias, cols_left, partial)
                if cutlass.const_expr(self.two_accumulators):
                    self.copy_row_part(bias_rows[1][(None, None, None, 0, sub)], r_bias2, cols_left, partial)
            cute.copy(t2r, src[(None, None, None, 0, sub)], r_acc)
            if cutlass.const_expr(self.two_accumulators):
                cute.copy(t2r, src2[(None, None, None, 0, sub)], r_acc2)
            cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld: the loaded registers are ready
            if cutlass.const_expr(adds_bias):
                r_acc.store(r_acc.load() + r_bias.load().to(cutlass.Float32))
                if cutlass.const_expr(self.two_accumulators):
                    r_acc2.store(r_acc2.load() + r_bias2.load().to(cutlass.Float32))
            if cutlass.const_expr(self.epilogue_kind == "swiglu_bwd"):
                for v in cutlass.range_constexpr(cute.size(r_acc)):  # dA_u (unscaled) -> dh_gate, dh_up, s·a; Σ dA_u·a in column order
                    r_acc[v], r_acc2[v], r_x[v], row_sum, _ = self.swiglu_backward_value(  # (a thread's values: one row)
                        r_acc[v], r_gate[v].to(cutlass.Float32), r_up[v].to(cutlass.Float32), True, (s, s), (row_sum, row_sum)
                    )
                put(r_acc2, 0)  # dh_up
                put(r_x, 1)  # a_scaled
            if cutlass.const_expr(self.two_accumulators):
                if cutlass.const_expr(self.epilogue_kind == "swiglu_save"):
                    put(r_acc, 0)  # h: gate
                    put(r_acc2, 1)  # h: up
                self.swiglu_subtile(r_acc, r_acc2, r_acc)
            if cutlass.const_expr(self.scatter):
                if row_ok:
                    r_out.store(r_acc.load().to(cutlass.BFloat16))
                    self.copy_row_part(r_out, dst[(None, None, None, 0, sub)], cols_left, partial)
            else:
                put(r_acc, len(outputs) - 1)  # C (dh_gate with swiglu_bwd)
        if cutlass.const_expr(self.epilogue_kind == "swiglu_bwd" and not self.unit_scale):
            if row_ok:  # the router-weight gradient's piece of this row and column tile
                m_part[row, tile_col] = row_sum


class GroupedGemmMxfp8Sm100(GroupedGemmSm100):
    """The grouped GEMM on MXFP8 operands (block-scaled tcgen05 MMAs, kind::mxf8f6f4):

        C[rows of tile m, :] = epilogue((A ⊙ SA)[rows of tile m, :] · (B[e(m)] ⊙ SB[e(m)])ᵀ)

    A [R, K] and each expert's B [N, K] (K-major) hold E4M3 elements; SA and SB one E8M0 scale per
    32 elements along K, in the MMA's scale order (mok.mxfp8.mma_scale_layout: A's rows padded to
    whole 128-row tiles, each row's K to whole 128-value chunks, with k_split each half's; each
    expert's B to whole chunks of rows and of K). Every epilogue of the bf16 kernel (plain, swiglu, swiglu_save,
    swiglu_bwd; k_split: B and B2 [E, N, K/2] hold K's two halves, each with its scales) on the
    same fp32 accumulators, bf16 out: the forward's two GEMMs, and the backward's SwiGLU-backward
    and dx GEMMs given the weights transposed (K-major for their K), the expert-parallel ``scatter``
    of the plain epilogue and the experts' ``bias`` as the bf16 kernel has them (the epilogue is
    its). Static config: N, K (multiples of 16, each half of K with k_split: the last column and
    K tiles partial, as the bf16 kernel's; docs/notes/partial-tiles.md), epilogue, k_split, top-k,
    unit scale, column tile (128 or 256; 128 with SwiGLU: two accumulators and the scales must fit
    512 tensor-memory columns), stages, scatter, bias. Compile-verified only, never run (no SM100
    GPU here)."""

    mxfp8 = True
    tile_k = TILE_K_MXFP8  # (one 128-value chunk of the scales a stage)

    def __init__(
        self, n: int, k: int, epilogue: str = "plain", *, b_major: str = "k", k_split: bool = False, topk: int = 1,
        unit_scale: bool = False, tile_n: int = 128, stages: int | None = None, activation: str = "swiglu", persistent: bool = False,
        scatter: bool = False, bias: bool = False,
    ) -> None:
        if b_major != "k":
            raise ValueError(f"b_major: expected 'k' with MXFP8 operands (K-major B: give the weights transposed), got {b_major!r}")
        if tile_n not in (128, 256) or (epilogue in ("swiglu", "swiglu_save") and tile_n != 128):
            raise ValueError(f"tile_n: expected 128 or 256 (128 with SwiGLU) with MXFP8 operands, got {tile_n}")
        halves = 2 if k_split else 1
        if n % E4M3_ROW_STEP or k % (halves * E4M3_ROW_STEP):
            raise ValueError(f"(n, k): expected multiples of {E4M3_ROW_STEP} ({halves * E4M3_ROW_STEP} for k with k_split: 16-byte "
                             f"E4M3 rows) with MXFP8 operands, got ({n}, {k})")
        super().__init__(n, k, epilogue, k_split=k_split, topk=topk, unit_scale=unit_scale, tile_n=tile_n, activation=activation,
                         persistent=persistent, scatter=scatter, bias=bias)
        self.ab_stage = pick_mxfp8_stages(self.tile_shape_mnk[0] + self.num_b * tile_n, stages, self.store_bytes())

    @property
    def scale_k(self) -> int:
        """K as A's scales cover it: each half's (k_split) ceil(K / 128) chunks, the MMA order of
        ``ops.quantize_mxfp8(..., segments=2)``; K itself where 128 divides each half."""
        return self.k_tiles * TILE_K_MXFP8


def compile_grouped_gemm_sm100(n: int, k: int, arch: str, options: str = "", *, operand: str = "bf16", **config):
    """Compile :class:`GroupedGemmSm100` (``operand`` "bf16") or :class:`GroupedGemmMxfp8Sm100`
    ("e4m3"), ``config`` their keyword arguments, for ``arch`` (sm_100a or sm_103a) without tensors:
    the stand-ins of grouped_gemm_args(operand). ``pingpong`` (Hopper's two MMA warpgroups taking
    tiles in turn, so that one's epilogue runs under the other's MMAs) is what this kernel does
    anyway, through two accumulator stages: it changes nothing here."""
    config.pop("pingpong", None)
    kernel = (GroupedGemmMxfp8Sm100 if operand == "e4m3" else GroupedGemmSm100)(n, k, **config)
    return compile_kernel(kernel, grouped_gemm_args(operand), arch, options)
