"""FP8 operands with an fp32 scale per 128 along K on Hopper (DeepSeek-V3's recipe): the mainloop.

    C = Σ over K blocks kb of 128:  (A_q[:, kb]·B_q[:, kb]ᵀ) · sa[row, kb] · sb[n_block, kb]

A [R, K] and B [E, N, K] are E4M3 (K-major both: FP8 WGMMA reads no other), A's scales fp32 per row
and K block, kept transposed [K / 128, R] so that a K tile's 128 row scales are one 512-byte TMA
box that lands with the stage (with ``gather_a``, A is x's E4M3 rows [T, K] with their scales
[K / 128, T], and the producer warpgroup gathers each row's scale with its row, by cp.async); B's
fp32 per 128 x 128 block [E, N / 128, K / 128]. A stage holds one K block (128 E4M3 values a row:
the 128-byte swizzle atom, as bf16's 64). Per stage each MMA warpgroup runs its WGMMAs (E4M3 x
E4M3, 32 deep) into a block accumulator (the first one overwriting it: nothing zeroes it), waits
for them, reads its rows' scales and hands the stage back, then adds the block's product into the running
accumulator scaled by sa·sb: ``acc = fma(block, sa·sb, acc)`` per value, every 128 of K (the
promotion DeepGEMM does: Hopper's FP8 WGMMA keeps fewer bits than fp32 over a long K). The two MMA
warpgroups run this on their own rows, so one's WGMMAs overlap the other's promotion.

K is reduced in one fixed order (K blocks in order, one fma each), one CTA per output tile: the
result depends only on the tile's inputs and scales (deterministic, batch-invariant with per-row
scales). The epilogues are the bf16 kernel's, on the promoted fp32 accumulators.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

SCALE_BLOCK = 128  # elements along K (and, for B, along N) that share one fp32 scale
TILE_K_BLOCK_SCALED = 128  # K per shared-memory stage: one scale block (128 E4M3 bytes a row)


class BlockScaledMainloop:
    """Mixin of GroupedGemmSm90 for ``operand="e4m3_block"`` (see the module docstring)."""

    block_scaled = False

    @property
    def hands_registers_over(self) -> bool:
        """Whether the producer warpgroup hands registers to the MMA warpgroups (setmaxnreg 40 / 232).
        Not here: the CTA's pool is what ptxas gave each thread at launch, which follows the code
        outside the MMA warps, 138-168 for these kernels, and 40 + 2 x 232 needs 168 (else the
        increase waits forever: docs/notes/kernel-pitfalls.md); every warp keeps the launch count."""
        return not self.block_scaled

    def a_scale_tensor(self, ptr: cute.Pointer, rows) -> cute.Tensor:
        """A's scales as (R, K / 128), stored [K / 128, R] (each K block's row scales contiguous)."""
        blocks = self.k // SCALE_BLOCK
        return cute.make_tensor(ptr, cute.make_layout((rows, blocks), stride=(1, rows)))

    def b_scale_tensor(self, ptr: cute.Pointer, num_experts) -> cute.Tensor:
        """One weight's scales as (N / 128, K / 128, E), stored [E, N / 128, K / 128] (K: each B's,
        half of it with k_split)."""
        n_blocks, k_blocks = self.n // SCALE_BLOCK, self.b_k // SCALE_BLOCK
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
        were read; returns the advanced (read, release) states (they move together here). ``scales``
        = (the row scales' stage buffers, B's scales, B2's); ``tile`` = (expert, column tile)."""
        acc, acc2 = accs
        block, block2 = blocks
        r_a, r_b, r_b2 = operands
        s_sa, m_sb, m_sb2 = scales
        expert, tile_col = tile
        tile_m, tile_n, _ = self.tile_shape_mnk
        crd = tiled_mma.get_slice(mma_tidx).partition_C(cute.make_identity_tensor((tile_m, tile_n)))
        # WGMMA accumulator of a thread: ((2 columns, rows r / r + 8, 8-column groups), row blocks, 1)
        row_blocks, groups = cute.size(crd, mode=[1]), tile_n // 8
        n_block = tile_col * tile_n // SCALE_BLOCK
        row_scale = cute.make_rmem_tensor((2, row_blocks), cutlass.Float32)
        next_b = self.b_scale(m_sb, m_sb2, n_block, 0, expert)  # (each K block's B scales loaded one block ahead)
        next_b2 = next_b
        if cutlass.const_expr(self.two_accumulators):
            next_b2 = m_sb2[n_block, 0, expert]
        for k_tile in cutlass.range(k_tiles, unroll=1):
            scale_b, scale_b2 = next_b, next_b2
            if k_tile + 1 < k_tiles:
                next_b = self.b_scale(m_sb, m_sb2, n_block, k_tile + 1, expert)
                if cutlass.const_expr(self.two_accumulators):
                    next_b2 = m_sb2[n_block, k_tile + 1, expert]
            ab_pipe.consumer_wait(cons)
            if cutlass.const_expr(self.gather_a):  # A came through the generic proxy (cp.async); WGMMA reads via the async one
                cute.arch.fence_proxy("async.shared", space="cta")
            self.mma_stage(tiled_mma, block, block2, r_a, r_b, r_b2, cons.index, overwrite=True)  # (no zeroing: scale-d 0 first)
            cute.nvgpu.warpgroup.wait_group(0)
            for m in cutlass.range_constexpr(row_blocks):
                for hi in cutlass.range_constexpr(2):
                    row_scale[hi, m] = s_sa[crd[(0, hi, 0), m, 0][0], 0, cons.index]
            ab_pipe.consumer_release(release)
            cons.advance()
            release.advance()
            for pair in ((acc, block, scale_b), (acc2, block2, scale_b2))[: self.num_b]:
                total, part, scale = pair
                for j in cutlass.range_constexpr(groups):
                    for m in cutlass.range_constexpr(row_blocks):
                        for hi in cutlass.range_constexpr(2):
                            factor = row_scale[hi, m] * scale
                            for c in cutlass.range_constexpr(2):
                                at = ((c, hi, j), m, 0)
                                total[at] = cute.math.fma(part[at], factor, total[at])
        return cons, release
