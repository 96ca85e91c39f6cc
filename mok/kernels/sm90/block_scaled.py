"""FP8 operands with an fp32 scale per 128 along K on Hopper (DeepSeek-V3's recipe): the mainloop.

    C = Σ over K blocks kb of 128:  (A_q[:, kb]·B_q[:, kb]ᵀ) · sa[row, kb] · sb[n_block, kb]

A [R, K] and B [E, N, K] are E4M3 (K-major both: FP8 WGMMA reads no other), A's scales fp32 per row
and K block, kept transposed [K / 128, R] so that a K tile's 128 row scales are one 512-byte TMA
box that lands with the stage (with ``gather_a``, A is x's E4M3 rows [T, K] with their scales
[K / 128, T], and the producer warpgroup gathers each row's scale with its row, by cp.async); B's
fp32 per 128 x 128 block [E, N / 128, K / 128]. N and K need only be multiples of 16: TMA (and
the gather) zero-fill a partial last K block's elements past K, whose scale covers the values
there are, and B's rows past N, as with bf16; the scale tensors then have ceil()'d block counts. A stage holds one K block (128 E4M3 values a row:
the 128-byte swizzle atom, as bf16's 64). Per stage each MMA warpgroup runs its WGMMAs (E4M3 x
E4M3, 32 deep) into a block accumulator (the first one overwriting it: nothing zeroes it), waits
for them, reads its rows' scales and hands the stage back, then adds the block's product into the
running accumulator scaled by sa·sb: ``acc = fma(block, sa·sb, acc)`` per value, every 128 of K (the
promotion DeepGEMM does: Hopper's FP8 WGMMA keeps fewer bits than fp32 over a long K). The two MMA
warpgroups run this on their own rows, so one's WGMMAs overlap the other's promotion.

With ``block_buffers=2`` each warpgroup keeps two sets of block accumulators and issues a stage's
WGMMAs into one before it promotes the previous stage's from the other (``wait_group 1``): its
tensor work no longer waits for its own promotion. The extra accumulators (64 registers a thread
at 128-wide tiles) need the producer warpgroup's registers: the hand-over (setmaxnreg 40 / 232)
is on for it. The plain epilogue only (k_split and scatter included): with SwiGLU's two products
ptxas spills 636-792 bytes. The sums and their order are the same as with one set: the same bits.

K is reduced in one fixed order (K blocks in order, one fma each), one CTA per output tile: the
result depends only on the tile's inputs and scales (deterministic, batch-invariant with per-row
scales). The epilogues are the bf16 kernel's, on the promoted fp32 accumulators.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

SCALE_BLOCK = 128  # elements along K (and, for B, along N) that share one fp32 scale
TILE_K_BLOCK_SCALED = 128  # K per shared-memory stage: one scale block (128 E4M3 bytes a row)
FP8_ROW_ELEMENTS = 16  # N and K are multiples of it: 16-byte E4M3 rows (TMA, the gather's chunks)


class BlockScaledMainloop:
    """Mixin of GroupedGemmSm90 for ``operand="e4m3_block"`` (see the module docstring)."""

    block_scaled = False
    block_buffers = 1  # sets of block accumulators a warpgroup cycles through (module docstring)
    epilogue_kind = None  # (the grouped GEMM's sets its epilogue; a weight gradient's has none of these kinds)

    @property
    def hands_registers_over(self) -> bool:
        """Whether the producer warpgroup hands registers to the MMA warpgroups (setmaxnreg 40 / 232).
        Not with one set of block accumulators: the CTA's pool is what ptxas gave each thread at
        launch, which follows the code, 136-155 for those kernels, and 40 + 2 x 232 needs 168 (else
        the increase waits forever: docs/notes/kernel-pitfalls.md); every warp keeps the launch
        count. Two sets need the registers, and so does the SwiGLU backward 128 wide (the PTX test
        checks the launch count fits)."""
        return not self.block_scaled or self.block_buffers == 2 or self.swiglu_backward_128_wide

    @property
    def swiglu_backward_128_wide(self) -> bool:
        """The SwiGLU backward's one product 128 wide: its block accumulators beside the epilogue's
        registers spill 276 bytes at the launch count, 8 with the 40 / 232 hand-over, none with
        24 / 240 (ptxas launches it at 168, which both fit)."""
        return self.block_scaled and self.epilogue_kind == "swiglu_bwd" and self.tile_shape_mnk[1] == 128

    @property
    def register_split(self) -> tuple[int, int]:
        """(the producer warpgroup's registers, each MMA warpgroup's) where they are handed over:
        24 / 240 for the SwiGLU backward 128 wide on FP8 (its producer is one TMA warp), else 40 / 232."""
        return (24, 240) if self.swiglu_backward_128_wide else (40, 232)

    def a_scale_tensor(self, ptr: cute.Pointer, rows) -> cute.Tensor:
        """A's scales as (R, K blocks), stored [K blocks, R] (each K block's row scales contiguous):
        one block a K tile, ceil(K / 128) of them (with k_split ceil(K / 2 / 128) a half: the rows
        quantized a half at a time, mok.ops.quantize_fp8_rows(segments=2))."""
        return cute.make_tensor(ptr, cute.make_layout((rows, self.k_tiles), stride=(1, rows)))

    def b_scale_tensor(self, ptr: cute.Pointer, num_experts) -> cute.Tensor:
        """One weight's scales as (N blocks, K blocks, E), stored [E, ceil(N / 128), ceil(K / 128)]
        (K: each B's, half of it with k_split; a partial last block where 128 does not divide them)."""
        n_blocks, k_blocks = -(-self.n // SCALE_BLOCK), self.half_k_tiles
        return cute.make_tensor(ptr, cute.make_layout((n_blocks, k_blocks, num_experts), stride=(k_blocks, 1, n_blocks * k_blocks)))

    def a_scale_smem(self) -> cute.Layout:
        """The stages' row-scale buffers: (tile rows, 1, stages), fp32."""
        tile_m = self.tile_shape_mnk[0]
        return cute.make_layout((tile_m, 1, self.ab_stage), stride=(1, tile_m, tile_m))

    def a_scale_load_atom(self, m_sa: cute.Tensor):
        """TMA load atom of one stage's row scales (a (tile rows, 1) box: 512 contiguous bytes)."""
        tile_m = self.tile_shape_mnk[0]
        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        return cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, m_sa, cute.slice_(self.a_scale_smem(), (None, None, 0)), (tile_m, 1))

    def a_scale_loads(self, tma_sa, m_sa, s_sa, tile_row):
        """(the atom, its gmem partition per K block, its smem partition per stage) for one row tile."""
        g_sa = cute.local_tile(m_sa, (self.tile_shape_mnk[0], 1), (tile_row, None))
        t_sas, t_sag = self.tma_split(tma_sa, s_sa, g_sa)
        return tma_sa, t_sag, t_sas

    @cute.jit
    def b_scale(self, m_sb, m_sb2, n_block, k_tile, expert):
        """B's scale of K block ``k_tile``: from B's scales, or with k_split past the first half's
        blocks from B2's (the second half of K)."""
        scale = cutlass.Float32(0.0)
        if cutlass.const_expr(self.k_split):
            if k_tile < self.half_k_tiles:
                scale = m_sb[n_block, k_tile, expert]
            else:
                scale = m_sb2[n_block, k_tile - self.half_k_tiles, expert]
        else:
            scale = m_sb[n_block, k_tile, expert]
        return scale

    @cute.jit
    def consume_block_scaled_tile(self, ab_pipe, tiled_mma, accs, blocks, operands, k_tiles, cons, release, scales, tile, mma_tidx):
        """Persistent consumer of one tile: acc (and acc2) += each K block's product times its scales
        (the module docstring), every stage handed back once its WGMMAs retired and its row scales
        were read; returns the advanced (read, release) states. ``blocks`` = the block accumulators
        (block, block2), and with ``block_buffers=2`` a second such pair; ``scales`` = (the row
        scales' stage buffers, B's scales, B2's); ``tile`` = (expert, column tile)."""
        s_sa, m_sb, m_sb2 = scales
        expert, tile_col = tile
        tile_m, tile_n, _ = self.tile_shape_mnk
        crd = tiled_mma.get_slice(mma_tidx).partition_C(cute.make_identity_tensor((tile_m, tile_n)))
        n_block = tile_col * tile_n // SCALE_BLOCK
        row_scale = cute.make_rmem_tensor((2, cute.size(crd, mode=[1])), cutlass.Float32)
        next_b = self.b_scale(m_sb, m_sb2, n_block, 0, expert)  # (each K block's B scales loaded one block ahead)
        next_b2 = next_b
        if cutlass.const_expr(self.two_accumulators):
            next_b2 = m_sb2[n_block, 0, expert]
        last_b, last_b2 = next_b, next_b2  # (the previous K block's, for its promotion one block late)
        for k_tile in cutlass.range(k_tiles, unroll=1):
            scale_b, scale_b2 = next_b, next_b2
            if k_tile + 1 < k_tiles:
                next_b = self.b_scale(m_sb, m_sb2, n_block, k_tile + 1, expert)
                if cutlass.const_expr(self.two_accumulators):
                    next_b2 = m_sb2[n_block, k_tile + 1, expert]
            ab_pipe.consumer_wait(cons)
            if cutlass.const_expr(self.gather_a):  # A came through the generic proxy (cp.async); WGMMA reads via the async one
                cute.arch.fence_proxy("async.shared", space="cta")
            if cutlass.const_expr(self.block_buffers == 1):
                self.mma_stage(tiled_mma, blocks[0], blocks[1], *operands, cons.index, overwrite=True)  # (no zeroing: scale-d 0 first)
                cute.nvgpu.warpgroup.wait_group(0)
                self.retire_block(ab_pipe, release, s_sa, crd, row_scale, cons.index)
                cons.advance()
                release.advance()
                self.promote(accs, blocks[:2], row_scale, (scale_b, scale_b2))
            else:  # this stage's WGMMAs into one set while the previous stage's product, in the other, is promoted
                if k_tile % 2 == 0:
                    self.mma_stage(tiled_mma, blocks[0], blocks[1], *operands, cons.index, overwrite=True)
                else:
                    self.mma_stage(tiled_mma, blocks[2], blocks[3], *operands, cons.index, overwrite=True)
                cons.advance()
                if k_tile > 0:
                    cute.nvgpu.warpgroup.wait_group(1)  # (the previous stage's WGMMAs have retired)
                    self.retire_block(ab_pipe, release, s_sa, crd, row_scale, release.index)
                    release.advance()
                    if k_tile % 2 == 0:
                        self.promote(accs, blocks[2:], row_scale, (last_b, last_b2))
                    else:
                        self.promote(accs, blocks[:2], row_scale, (last_b, last_b2))
                last_b, last_b2 = scale_b, scale_b2
        if cutlass.const_expr(self.block_buffers == 2):  # the last stage's product
            cute.nvgpu.warpgroup.wait_group(0)
            self.retire_block(ab_pipe, release, s_sa, crd, row_scale, release.index)
            release.advance()
            if (k_tiles - 1) % 2 == 0:
                self.promote(accs, blocks[:2], row_scale, (last_b, last_b2))
            else:
                self.promote(accs, blocks[2:], row_scale, (last_b, last_b2))
        return cons, release

    @cute.jit
    def consume_outer_scaled_tile(self, ab_pipe, tiled_mma, acc, block, operands, k_tiles, cons, scales, mma_tidx):
        """Persistent consumer of one weight-gradient tile on FP8 (both operands scaled per 128-row
        block along the output's rows and columns: mok/kernels/sm90/weight_grad_gemm.py): per stage
        the WGMMAs into ``block`` (the first overwriting it), waited for, this thread's rows' and
        columns' scales read from the stage (``scales`` = their stage buffers), the stage handed
        back, then acc += block · (sa[row] · sb[column]) per value. Returns the advanced state (the
        stages are released in the order they were read: one state serves both)."""
        s_sa, s_sb = scales
        r_a, r_b = operands
        tile_m, tile_n, _ = self.tile_shape_mnk
        crd = tiled_mma.get_slice(mma_tidx).partition_C(cute.make_identity_tensor((tile_m, tile_n)))
        row_tiles, groups = cute.size(crd, mode=[1]), tile_n // 8
        row_scale = cute.make_rmem_tensor((2, row_tiles), cutlass.Float32)
        column_scale = cute.make_rmem_tensor((2, groups), cutlass.Float32)
        for k_tile in cutlass.range(k_tiles, unroll=1):
            ab_pipe.consumer_wait(cons)
            self.mma_stage(tiled_mma, block, block, r_a, r_b, r_b, cons.index, overwrite=True)
            cute.nvgpu.warpgroup.wait_group(0)
            for m in cutlass.range_constexpr(row_tiles):
                for hi in cutlass.range_constexpr(2):
                    row_scale[hi, m] = s_sa[crd[(0, hi, 0), m, 0][0], 0, cons.index]
            for j in cutlass.range_constexpr(groups):
                for c in cutlass.range_constexpr(2):
                    column_scale[c, j] = s_sb[crd[(c, 0, j), 0, 0][1], 0, cons.index]
            ab_pipe.consumer_release(cons)
            cons.advance()
            for j in cutlass.range_constexpr(groups):
                for m in cutlass.range_constexpr(row_tiles):
                    for hi in cutlass.range_constexpr(2):
                        for c in cutlass.range_constexpr(2):
                            at = ((c, hi, j), m, 0)
                            acc[at] = cute.math.fma(block[at], row_scale[hi, m] * column_scale[c, j], acc[at])
        return cons

    @cute.jit
    def retire_block(self, ab_pipe, release, s_sa, crd, row_scale, stage):
        """Once the WGMMAs of stage ``stage`` (``release``'s) retired: read this thread's rows' scales
        of it into ``row_scale`` and hand the stage back (the caller advances ``release``)."""
        for m in cutlass.range_constexpr(cute.size(crd, mode=[1])):
            for hi in cutlass.range_constexpr(2):
                row_scale[hi, m] = s_sa[crd[(0, hi, 0), m, 0][0], 0, stage]
        ab_pipe.consumer_release(release)

    @cute.jit
    def promote(self, accs, blocks, row_scale, scales_b):
        """acc += block · (row scale · B's scale) per value (acc2 with block2 and B2's scale)."""
        tile_n = self.tile_shape_mnk[1]
        groups = tile_n // 8
        for pair in ((accs[0], blocks[0], scales_b[0]), (accs[1], blocks[1], scales_b[1]))[: self.num_b]:
            total, part, scale = pair
            for j in cutlass.range_constexpr(groups):
                for m in cutlass.range_constexpr(cute.size(row_scale, mode=[1])):
                    for hi in cutlass.range_constexpr(2):
                        factor = row_scale[hi, m] * scale
                        for c in cutlass.range_constexpr(2):
                            at = ((c, hi, j), m, 0)
                            total[at] = cute.math.fma(part[at], factor, total[at])
