"""Per-expert weight gradients for Hopper: a K-grouped GEMM over the expert-grouped rows.

    out[e] (+)= A[rows of e]ᵀ · B[rows of e]        out [E, M, N], A [R, M] (row stride >= M), B [R, N]

The contract (rows, counts, accumulate, split_out, determinism, the launch arguments) is every
arch's: mok/kernels/common/weight_grad.py. The three weight gradients of the layer are all this
product:

    dW_down[e]        = (dout rows)ᵀ · (s·a rows)          M = H, N = I
    [dW_gate; dW_up]  = (dh rows)ᵀ · (x rows)              M = 2I, N = H

Here: WGMMA on both operands read MN-major by TMA (mok/kernels/sm90/wgmma_tile.py), the output
stored by TMA (``accumulate``: a TMA reduce-add into the fp32 tensor). split_out's two tensors
are described to the TMA store as one tensor [2, E, M/2, N] from the lower of the two
addresses, the halves ``half_stride`` elements apart.

``pingpong`` (persistent): each MMA warpgroup computes whole output tiles on its own (128 x
tile_n, two 64-row WGMMAs per K block), the two taking the CTA's tiles in turn; a named-barrier
handshake lets only one of them issue its mainloop's WGMMAs at a time, so one's epilogue
(conversion, stores) runs while the other's WGMMAs keep the tensor cores busy. With a few
hundred rows per expert (128 experts a rank) an output tile reduces only ~5 K tiles and the
epilogue is about as long as the mainloop. The same WGMMA sequence per output element: the same bits.

``operand="e4m3_block"`` (FP8 with 1 x 128 blocks along the rows, DeepSeek-V3's recipe; persistent,
cooperative): FP8 WGMMAs read K-major operands only, so A and B come as the transposes of the rows,
[M, R] and [N, R] in E4M3 with fp32 scales [R / 128, M] and [R / 128, N] (mok.ops.quantize_fp8_columns);
a stage is one 128-row block, its 128 row scales of A and tile_n of B by TMA beside the elements;
each stage's product is promoted as acc += block · (sa[m] · sb[n]) (BlockScaledMainloop.
consume_outer_scaled_tile). An expert's rows are whole 128-row blocks of the schedule, so no block
straddles two experts. Its product registers apart from the running sums let a tile's epilogue run
after the next tile's first stage is issued, under its WGMMAs (``overlaps_epilogue``): with a few
128-row blocks an expert the epilogue is a large share of a tile (2-13% faster, H100). With
``stages_under_epilogue=2`` (the default: mok.kernels.variants) the next tile's first two stages go
out before it, one into each block set: 2-7% faster again (H100, docs/notes/fp8-block-hopper.md).
``ordered_issue``: the two MMA warpgroups issue each stage's WGMMAs in a fixed order
(mok/kernels/sm90/block_scaled.py).
"""

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.tensor_utils import LayoutEnum

from ..common.compile import compile_kernel
from ..common.records import weight_grad_args
from ..common.weight_grad import WeightGradGemm
from ..variants import check_deep_turn, weight_grad_block_sets
from .block_scaled import FP8_ROW_ELEMENTS, SCALE_BLOCK, TILE_K_BLOCK_SCALED, BlockScaledMainloop
from .wgmma_tile import TILE_K, WgmmaTileKernel, pick_stages


class WeightGradGemmSm90(BlockScaledMainloop, WeightGradGemm, WgmmaTileKernel):
    """Static config: M, N, A's row stride, output dtype, accumulate, tile N, persistent, pingpong, split_out (its halves'
    rows interleaved), the operands (bf16, or ``operand="e4m3_block"``: see the module docstring)."""

    two_accumulators = False
    partial_tiles = True  # M and N past the tile: TMA zero-fills the loads and clips the stores

    def __init__(
        self, m: int, n: int, out_dtype: str = "bf16", accumulate: bool = False, *, a_stride: int | None = None,
        tile_n: int = 128, stages: int | None = None, persistent: bool = False, pingpong: bool = False, split_out: bool = False,
        interleaved_out: bool = False, operand: str = "bf16", deep_turn: int = 0, stages_under_epilogue: int = 1,
        ordered_issue: bool = False,
    ):
        if operand not in ("bf16", "e4m3_block"):
            raise ValueError(f"operand: expected 'bf16' or 'e4m3_block' on Hopper, got {operand!r}")
        self.block_scaled = operand == "e4m3_block"
        check_deep_turn(deep_turn, weight_grad_block_sets(operand))
        self.deep_turn = deep_turn
        self.use_ordered_issue(ordered_issue)
        self.configure(m, n, out_dtype, accumulate, a_stride, tile_n, TILE_K_BLOCK_SCALED if self.block_scaled else TILE_K, split_out,
                       interleaved_out)
        if stages_under_epilogue not in (1, 2):
            raise ValueError(f"stages_under_epilogue: expected 1 or 2, got {stages_under_epilogue}")
        self.stages_under_epilogue = stages_under_epilogue if self.overlaps_epilogue else 1  # (else one tile after the other)
        if self.block_scaled:
            halves = 2 if split_out else 1
            problems = [what for what, bad in (
                ("persistent=True", not persistent), ("no pingpong", pingpong), ("tile_n=128", tile_n != 128),
                (f"M a multiple of {halves * FP8_ROW_ELEMENTS}", m % (halves * FP8_ROW_ELEMENTS)),
                (f"N a multiple of {FP8_ROW_ELEMENTS}", n % FP8_ROW_ELEMENTS), ("a_stride = M (packed transposes)", self.a_stride != m),
            ) if bad]
            if problems:
                raise ValueError(f"operand='e4m3_block': needs {', '.join(problems)} (m={m}, n={n}, tile_n={tile_n})")
        if pingpong and (not persistent or tile_n != 128):
            raise ValueError("pingpong: only in the persistent kernel with 128-column tiles (one warpgroup holds a whole tile)")
        tile_m = self.tile_shape_mnk[0]
        out_bytes = 4 if out_dtype == "f32" else 2
        self.persistent, self.pingpong = persistent, pingpong
        if persistent:  # a producer warpgroup in front of the two MMA warpgroups (see GroupedGemmSm90)
            self.threads, self.store_warp = self.consumer_threads + 128, 4
        if pingpong:  # one warpgroup per tile (two 64-row WGMMAs), its own epilogue buffers
            self.use_pingpong()
        epi_bytes = self.epi_stage * tile_m * 32 * out_bytes * (2 if pingpong else 1)
        tile_k = self.tile_shape_mnk[2]
        element_bytes, scale_bytes = (1, (tile_m + tile_n) * 4) if self.block_scaled else (2, 0)
        self.ab_stage = pick_stages((tile_m + tile_n) * tile_k * element_bytes + scale_bytes, epi_bytes, stages, dedicated_epi=persistent)

    def operand_tensor(self, ptr, mn, row_stride, num_rows):
        """(MN, R): MN-major, the rows ``row_stride`` elements apart; block-scaled: the rows'
        transpose [MN, R], K-major (R a multiple of 128)."""
        if cutlass.const_expr(self.block_scaled):
            rows = cute.assume(num_rows, divby=SCALE_BLOCK)
            return cute.make_tensor(ptr, cute.make_layout((mn, rows), stride=(rows, 1)))
        return cute.make_tensor(ptr, cute.make_layout((mn, num_rows), stride=(1, row_stride)))

    def a_operand(self, ptr, num_rows):
        """A as (M / halves, R, halves): split_out's halves (dh_gate, dh_up) each bounded at M/2,
        so a partial last row tile of the first stops there instead of reading the second
        (block-scaled: the transpose [M, R], each half M/2 of its rows)."""
        m_half = self.m // self.halves
        if cutlass.const_expr(self.block_scaled):
            rows = cute.assume(num_rows, divby=SCALE_BLOCK)
            return cute.make_tensor(ptr, cute.make_layout((m_half, rows, self.halves), stride=(rows, 1, m_half * rows)))
        return cute.make_tensor(ptr, cute.make_layout((m_half, num_rows, self.halves), stride=(1, self.a_stride, m_half)))

    def operand_scales(self, scales, num_rows):
        """Block-scaled: A's scales as (M / halves, R / 128, halves) and B's as (N, R / 128), stored
        [R / 128, M] and [R / 128, N] (a 128-row block's scales of a tile: one 512-byte TMA box)."""
        a_scale_ptr, b_scale_ptr = scales
        blocks = num_rows // SCALE_BLOCK
        m_half = self.m // self.halves
        m_sa = cute.make_tensor(a_scale_ptr, cute.make_layout((m_half, blocks, self.halves), stride=(1, self.m, m_half)))
        m_sb = cute.make_tensor(b_scale_ptr, cute.make_layout((self.n, blocks), stride=(1, self.n)))
        return m_sa, m_sb

    def scale_smem(self, rows: int) -> cute.Layout:
        """The stages' scale buffers of one operand: (``rows``, 1, stages), fp32."""
        return cute.make_layout((rows, 1, self.ab_stage), stride=(1, rows, rows))

    def scale_load_atom(self, m_s: cute.Tensor, rows: int):
        """TMA load atom of one stage's ``rows`` scales (a (rows, 1) box: contiguous fp32)."""
        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        return cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, m_s, cute.slice_(self.scale_smem(rows), (None, None, 0)), (rows, 1))

    def launch(self, m_a, m_b, scales, m_c, upper_first, rows, num_rows, num_experts, max_ctas, stream):
        """Host side (see WeightGradGemm.launch): the TMA atoms, the shared storage, the grid. (The
        storage struct's annotations are evaluated here, with ``self`` in scope: this module does
        not postpone annotations.)"""
        tile_m, tile_n, tile_k = self.tile_shape_mnk
        a_smem, b_smem, epi_smem = self.make_mma(m_a, m_b, m_c.element_type, LayoutEnum.from_tensor(m_c))
        tma_a, t_a = self.load_atom(m_a, a_smem, (tile_m, tile_k))
        tma_b, t_b = self.load_atom(m_b, b_smem, (tile_n, tile_k))
        tma_c, t_c = self.store_atom(m_c, epi_smem, reduce_add=self.accumulate)
        if cutlass.const_expr(self.pingpong):  # both warpgroups' epilogue buffers, warpgroup w's from w·epi_stage
            epi_smem = self.pingpong_epi_smem()

        c_elems = cute.cosize(epi_smem) if self.persistent else 8  # otherwise the epilogue reuses A's buffers

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, self.ab_stage * 2]
            s_a: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(a_smem)], self.buffer_align_bytes]
            s_b: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(b_smem)], self.buffer_align_bytes]
            s_c: cute.struct.Align[cute.struct.MemRange[self.c_dtype, c_elems], self.buffer_align_bytes]
            s_sa: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, cute.cosize(self.scale_smem(tile_m)) if self.block_scaled else 1], 128]
            s_sb: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, cute.cosize(self.scale_smem(tile_n)) if self.block_scaled else 1], 128]

        self.shared_storage = SharedStorage
        load_args = (tma_a, t_a, tma_b, t_b)
        if cutlass.const_expr(self.block_scaled):  # each stage's scales of A's rows and B's, by TMA beside the elements
            m_sa, m_sb = self.operand_scales(scales, num_rows)
            load_args += (*self.scale_load_atom(m_sa, tile_m), *self.scale_load_atom(m_sb, tile_n))
        store_args = (tma_c, t_c)
        mma_args = (self.tiled_mma, a_smem, b_smem, epi_smem)
        args = (load_args, store_args + (upper_first,), rows, num_rows, num_experts, mma_args)
        self.launch_tiles(args, self.all_tiles(num_experts), max_ctas, stream)

    @cute.kernel
    def kernel(
        self, load_args: tuple, store_args: tuple, rows: tuple, num_rows: cutlass.Int32, num_experts: cutlass.Int32, mma_args: tuple
    ):
        """One CTA per output tile. ``load_args``: the TMA atoms and tensors of A and B; ``store_args``:
        those of out; ``mma_args``: the tiled MMA and the shared-memory layouts (as ``__call__`` packs them)."""
        tma_a, _, tma_b, _ = load_args
        tiled_mma, a_smem, b_smem, epi_smem = mma_args
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        linear, _, _ = cute.arch.block_idx()
        expert, tile_row, tile_col, row_start, k_tiles = self.tile_of(linear, rows, num_rows)

        if warp_idx == 0:
            self.prefetch(tma_a, tma_b)
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        ab_pipe = self.make_pipeline(storage, 1, a_smem, b_smem)
        pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        s_a, s_b, s_c = self.shared_buffers(storage, a_smem, b_smem, epi_smem, dedicated_epi=False)

        tma_c, m_c, upper_first = store_args
        g_c = self.out_tile(m_c, upper_first, expert, tile_row, tile_col)
        loads = self.tile_loads(load_args, s_a, s_b, tile_row, tile_col, row_start)
        _, r_a, r_b, acc = self.mma_operands(tiled_mma, tidx, s_a, s_b)
        acc.fill(0.0)

        pipeline_init_wait(cluster_shape_mn=(1, 1))
        self.mainloop(ab_pipe, tiled_mma, acc, acc, r_a, r_b, r_b, k_tiles, warp_idx, loads)
        cute.arch.sync_threads()  # the epilogue reuses A's shared memory

        store_pipe = self.store_pipeline()
        self.store_acc(tidx, warp_idx, tiled_mma, acc, s_c, tma_c, g_c, store_pipe)
        if warp_idx == self.store_warp:
            store_pipe.producer_tail()

    @cute.kernel
    def kernel_persistent(
        self, load_args: tuple, store_args: tuple, rows: tuple, num_rows: cutlass.Int32, num_experts: cutlass.Int32, mma_args: tuple
    ):
        """Persistent and warp-specialised, as GroupedGemmSm90.kernel_persistent: CTA i takes output
        tiles i, i + grid, ... (expert by expert); each tile is still reduced by one CTA in row order
        (``pingpong``: by one of its MMA warpgroups, see ``pingpong_consumers``). Arguments as in ``kernel``."""
        tma_a, _, tma_b, _ = load_args[:4]
        tma_c, m_c, upper_first = store_args
        tiled_mma, a_smem, b_smem, epi_smem = mma_args
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        first, _, _ = cute.arch.block_idx()
        step, _, _ = cute.arch.grid_dim()
        all_tiles = self.all_tiles(num_experts)
        if warp_idx == 0:
            self.prefetch(tma_a, tma_b)
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        tile_m, tile_n, _ = self.tile_shape_mnk
        scale_bytes = (tile_m + tile_n) * 4 if self.block_scaled else 0  # (the stage's scales' TMA boxes)
        ab_pipe = self.make_pipeline(storage, 1, a_smem, b_smem, consumer_warps=4 if self.pingpong else None, extra_tx_bytes=scale_bytes)
        pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
        s_a, s_b, s_c = self.shared_buffers(storage, a_smem, b_smem, epi_smem, dedicated_epi=True)
        s_scales = (None, None)
        if cutlass.const_expr(self.block_scaled):
            s_scales = (storage.s_sa.get_tensor(self.scale_smem(tile_m)), storage.s_sb.get_tensor(self.scale_smem(tile_n)))
        pipeline_init_wait(cluster_shape_mn=(1, 1))

        if tidx < 128:  # producer warpgroup
            cute.arch.setmaxregister_decrease(40)
            if warp_idx == 0:
                self.produce_tiles(ab_pipe, load_args, (s_a, s_b, *s_scales), first, step, all_tiles, rows, num_rows)
        elif cutlass.const_expr(self.pingpong):  # each MMA warpgroup on its own tiles
            cute.arch.setmaxregister_increase(232)
            tiles = (first, step, all_tiles, rows, num_rows)
            self.pingpong_consumers(tidx - 128, warp_idx, ab_pipe, tiled_mma, s_a, s_b, s_c, tiles, store_args)
        else:  # the two MMA warpgroups
            cute.arch.setmaxregister_increase(232)
            mma_tidx = tidx - 128
            _, r_a, r_b, acc = self.mma_operands(tiled_mma, mma_tidx, s_a, s_b)
            store_pipe = self.store_pipeline()
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)  # onto accumulators zeroed per tile
            if cutlass.const_expr(self.block_scaled):
                tiles = (first, step, all_tiles, rows, num_rows)
                epilogue = (mma_tidx, warp_idx, tiled_mma, acc, s_c, store_args, store_pipe)
                self.block_scaled_consumers(ab_pipe, tiled_mma, acc, (r_a, r_b), s_scales, tiles, epilogue)
            else:
                cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
                release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
                linear = first
                while linear < all_tiles:
                    expert, tile_row, tile_col, row_start, k_tiles = self.tile_of(linear, rows, num_rows)
                    acc.fill(0.0)
                    cons, release = self.consume_tile(ab_pipe, tiled_mma, acc, acc, r_a, r_b, r_b, k_tiles, cons, release)
                    g_c = self.out_tile(m_c, upper_first, expert, tile_row, tile_col)
                    self.store_acc(mma_tidx, warp_idx, tiled_mma, acc, s_c, tma_c, g_c, store_pipe)
                    linear += step
            if warp_idx == self.store_warp:
                store_pipe.producer_tail()

    @property
    def overlaps_epilogue(self) -> bool:
        """FP8: a tile's epilogue runs under the next tile's first stage, or first two
        (``stages_under_epilogue``; :meth:`block_scaled_consumers`). Not for fp32 output without
        deep turns, where ptxas then spilled (12-24 bytes)."""
        return self.block_scaled and (self.deep_turn > 0 or self.out_dtype != "f32")

    @cute.jit
    def block_scaled_consumers(self, ab_pipe, tiled_mma, acc, operands, s_scales, tiles, epilogue):
        """The FP8 kernel's two MMA warpgroups on output tiles first, first + step, ... (``tiles`` =
        (first, step, all_tiles, rows, num_rows)), each tile reduced by :meth:`consume_outer_scaled_tile`
        into ``acc``. With :attr:`overlaps_epilogue` the tensor cores keep busy between tiles: a
        tile's epilogue (``epilogue`` = what :meth:`store_acc` needs but the tile) runs once the
        next tile's first stage is issued, under its WGMMAs, and a tile's coordinates (loads of the
        expert offsets) are read one tile ahead; without it, one tile after the other. Each tile's
        WGMMAs, promotions and stores are the same either way: the same bits."""
        first, step, all_tiles, rows, num_rows = tiles
        blocks = tuple(cute.make_rmem_tensor(acc.shape, cutlass.Float32) for _ in range(2))  # (two stages' products, used in turn)
        cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
        linear = first
        if cutlass.const_expr(not self.overlaps_epilogue):  # one tile at a time
            while linear < all_tiles:
                expert, tile_row, tile_col, _, k_tiles = self.tile_of(linear, rows, num_rows)
                zero = (self.zero_accumulators, (epilogue,))
                cons = self.consume_outer_scaled_tile(ab_pipe, tiled_mma, acc, blocks, operands, k_tiles, cons, s_scales, epilogue[0], zero)
                self.store_tile((expert, tile_row, tile_col), epilogue)
                linear += step
        else:
            expert, tile_row, tile_col, k_tiles = cutlass.Int32(0), cutlass.Int32(0), cutlass.Int32(0), cutlass.Int32(0)
            if first < all_tiles:  # (a CTA past the last tile reads nothing)
                expert, tile_row, tile_col, _, k_tiles = self.tile_of(first, rows, num_rows)
            done_expert, done_row, done_col = expert, tile_row, tile_col  # (the tile whose epilogue is pending, past the first)
            while linear < all_tiles:
                upcoming = self.tile_of(cutlass.min(linear + step, all_tiles - 1), rows, num_rows)
                finish = (self.finish_tile, (linear > first, (done_expert, done_row, done_col), epilogue))
                cons = self.consume_outer_scaled_tile(ab_pipe, tiled_mma, acc, blocks, operands, k_tiles, cons, s_scales, epilogue[0], finish)
                done_expert, done_row, done_col = expert, tile_row, tile_col
                expert, tile_row, tile_col, _, k_tiles = upcoming
                linear += step
            self.finish_tile(first < all_tiles, (done_expert, done_row, done_col), epilogue)

    @cute.jit
    def finish_tile(self, pending, tile, epilogue):
        """If ``pending``: :meth:`store_tile`; then the accumulators zeroed for the next tile."""
        if pending:
            self.store_tile(tile, epilogue)
        self.zero_accumulators(epilogue)

    @cute.jit
    def zero_accumulators(self, epilogue):
        """The running sums zeroed for the next tile (``epilogue``: see :meth:`block_scaled_consumers`)."""
        epilogue[3].fill(0.0)

    @cute.jit
    def store_tile(self, tile, epilogue):
        """Store output tile ``tile`` = (expert, tile row, tile column) from the accumulators
        (``epilogue``: see :meth:`block_scaled_consumers`)."""
        mma_tidx, warp_idx, tiled_mma, acc, s_c, store_args, store_pipe = epilogue
        tma_c, m_c, upper_first = store_args
        g_c = self.out_tile(m_c, upper_first, *tile)
        if cutlass.const_expr(self.overlaps_epilogue):
            self.store_acc_at_once(mma_tidx, warp_idx, tiled_mma, acc, s_c, tma_c, g_c)
        else:
            self.store_acc(mma_tidx, warp_idx, tiled_mma, acc, s_c, tma_c, g_c, store_pipe)

    @cute.jit
    def produce_tiles(self, ab_pipe, load_args, buffers, first, step, all_tiles, rows, num_rows):
        """The TMA warp of a persistent kernel: every K tile of output tiles first, first + step, ...
        in order (``buffers``: the A and B stages, and block-scaled their scales' stages)."""
        prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)
        s_a, s_b, s_sa, s_sb = buffers
        linear = first
        while linear < all_tiles:
            _, tile_row, tile_col, row_start, k_tiles = self.tile_of(linear, rows, num_rows)
            loads = self.tile_loads(load_args, s_a, s_b, tile_row, tile_col, row_start, s_sa, s_sb)
            prod = self.produce_tile(ab_pipe, prod, loads, k_tiles)
            linear += step
        ab_pipe.producer_tail(prod)

    @cute.jit
    def pingpong_tile(self, linear, tiles):
        """Ping-pong: output tile ``linear``'s K tiles, that it has an output (always: an expert
        without rows gets zeros), and (expert, tile row, tile column) for the epilogue."""
        expert, tile_row, tile_col, _, k_tiles = self.tile_of(linear, tiles[3], tiles[4])
        return k_tiles, True, (expert, tile_row, tile_col)

    @cute.jit
    def pingpong_epilogue(self, tidx, warp_idx, tiled_mma, acc, s_c, store_pipe, group, first_buf, tile, epi_args):
        """Ping-pong: one warpgroup stores its tile (``epi_args`` = the store's TMA atom, out, upper_first)."""
        expert, tile_row, tile_col = tile
        tma_c, m_c, upper_first = epi_args
        g_c = self.out_tile(m_c, upper_first, expert, tile_row, tile_col)
        self.store_acc(tidx, warp_idx, tiled_mma, acc, s_c, tma_c, g_c, store_pipe, group, first_buf)

    def tile_loads(self, load_args, s_a, s_b, tile_row, tile_col, row_start, s_sa=None, s_sb=None):
        """What ``load_stage`` needs for one output tile: TMA atoms, smem/gmem partitions, the expert's
        first k tile (block-scaled: the scales' too, into ``s_sa`` and ``s_sb``)."""
        tma_a, m_a, tma_b, m_b = load_args[:4]
        tile_m, tile_n, tile_k = self.tile_shape_mnk
        half = tile_row // self.row_tiles  # (split_out: which of A's halves; else 0)
        half_row = tile_row - half * self.row_tiles
        g_a = cute.local_tile(m_a[None, None, half], (tile_m, tile_k), (half_row, None))
        t_as, t_ag = self.tma_split(tma_a, s_a, g_a)
        t_bs, t_bg = self.tma_split(tma_b, s_b, cute.local_tile(m_b, (tile_n, tile_k), (tile_col, None)))
        loads = (tma_a, t_ag, t_as, tma_b, t_bg, t_bs, row_start // tile_k)  # offsets: multiples of 128 (or 0)
        if cutlass.const_expr(self.block_scaled):  # (a K tile is one 128-row block: its scales' index is the K tile's)
            tma_sa, m_sa, tma_sb, m_sb = load_args[4:8]
            t_sas, t_sag = self.tma_split(tma_sa, s_sa, cute.local_tile(m_sa[None, None, half], (tile_m, 1), (half_row, None)))
            t_sbs, t_sbg = self.tma_split(tma_sb, s_sb, cute.local_tile(m_sb, (tile_n, 1), (tile_col, None)))
            loads += (tma_sa, t_sag, t_sas, tma_sb, t_sbg, t_sbs)
        return loads

    @cute.jit
    def load_stage(self, ab_pipe, prod, loads):
        """Warp 0: wait for a free stage, then TMA-load the expert's next K tile of A and B (64 rows;
        block-scaled: 128, and their scales)."""
        tma_a, t_ag, t_as, tma_b, t_bg, t_bs, k_first = loads[:7]
        ab_pipe.producer_acquire(prod)
        bar = ab_pipe.producer_get_barrier(prod)
        k_tile = k_first + prod.count
        cute.copy(tma_a, t_ag[(None, k_tile)], t_as[(None, prod.index)], tma_bar_ptr=bar)
        cute.copy(tma_b, t_bg[(None, k_tile)], t_bs[(None, prod.index)], tma_bar_ptr=bar)
        if cutlass.const_expr(self.block_scaled):
            tma_sa, t_sag, t_sas, tma_sb, t_sbg, t_sbs = loads[7:13]
            cute.copy(tma_sa, t_sag[(None, k_tile)], t_sas[(None, prod.index)], tma_bar_ptr=bar)
            cute.copy(tma_sb, t_sbg[(None, k_tile)], t_sbs[(None, prod.index)], tma_bar_ptr=bar)
        ab_pipe.producer_commit(prod)


def compile_weight_grad(m: int, n: int, out_dtype: str, accumulate: bool, arch: str, options: str = "", operand: str = "bf16",
                        **config):
    """Compile :class:`WeightGradGemmSm90` (``config``: its keyword arguments) for ``arch`` without
    tensors: the stand-ins of weight_grad_args(operand, out_dtype)."""
    kernel = WeightGradGemmSm90(m, n, out_dtype, accumulate, operand=operand, **config)
    return compile_kernel(kernel, weight_grad_args(operand, out_dtype), arch, options)
