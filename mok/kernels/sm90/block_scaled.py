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
warpgroups run this on their own rows, so one's WGMMAs overlap the other's promotion. SwiGLU's two
products run as one (``stacked_b``): gate's and up's B tiles are the two halves of one stage's B
tile, one WGMMA twice as wide covers both, and each product's block accumulator is its half of
that WGMMA's (so A is read from shared memory once a step, not twice).

With ``block_buffers=2`` (the default) each warpgroup keeps two sets of block accumulators and
issues a stage's WGMMAs into one before it promotes the previous stage's, retired, from the other,
then waits for them: its tensor work no longer waits for its own promotion. (The loop takes two
stages a turn so that each set is named statically, and nothing is in flight across its back
edge: else ptxas serializes every WGMMA; ``pin_registers`` keeps each promotion between its
waits.) The extra accumulators (64 registers a thread at 128-wide tiles, or the stacked SwiGLU
WGMMA's second n = 2·tile_n block) need the producer warpgroup's registers: the hand-over
(setmaxnreg 40 / 232; the SwiGLU backward 128 wide 24 / 240) is on for it. Every epilogue (the
SwiGLU backward's then reads the saved h from shared memory, TMA-loaded during the mainloop: its
64 registers a thread beside the two sets would spill; GroupedGemmSm90.h_in_smem). With ``deep_turn`` = d as well, the loop
runs turns of d stages in which a warpgroup issues each stage's WGMMAs before it waits for the
previous stage's (``wait_group 1``), so two stages are in flight and the tensor cores always have
the next stage queued while the last is promoted; every group is retired at the turn's end (the
back edge again), the stages past whole turns taking the pairs above. The sums and their order
are the same as with one set: the same bits.

With ``ordered_issue`` (the grouped GEMM, either set count, and the weight gradient) the two MMA
warpgroups issue each stage's WGMMAs in a fixed order, warpgroup 1's after warpgroup 0's (a named
barrier over both, met by warpgroup 0 after its issue and by warpgroup 1 before its own), as
cuBLAS's FP8 kernel orders them: the tensor cores then run the two warpgroups' stage products one
after the other, not interleaved, so that their promotions fall at different times instead of
competing for the same issue slots (Nsight Compute put the two-set loop's promotions at 2.5x
cuBLAS's warp time a promotion, most of it dispatch stalls: docs/notes/fp8-block-hopper.md). The
same sums: the same bits.

K is reduced in one fixed order (K blocks in order, one fma each), one CTA per output tile: the
result depends only on the tile's inputs and scales (deterministic, batch-invariant with per-row
scales). The epilogues are the bf16 kernel's, on the promoted fp32 accumulators.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

SCALE_BLOCK = 128  # elements along K (and, for B, along N) that share one fp32 scale
TILE_K_BLOCK_SCALED = 128  # K per shared-memory stage: one scale block (128 E4M3 bytes a row)
ISSUE_ORDER_BARRIER = 5  # the named barrier of ``ordered_issue`` (1: the epilogue's, 2: scatter's, 3-4: ping-pong turns)
FP8_ROW_ELEMENTS = 16  # N and K are multiples of it: 16-byte E4M3 rows (TMA, the gather's chunks)


@dsl_user_op
def _pinned(value: cutlass.Float32, *, loc=None, ip=None) -> cutlass.Float32:
    """``value`` through an empty volatile asm (no instruction): it stays in its place among the
    other side-effecting operations, the WGMMAs and their waits."""
    return cutlass.Float32(llvm.inline_asm(T.f32(), [cutlass.Float32(value).ir_value(loc=loc, ip=ip)], "", "=f,0",
                                           has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def bf16x2_rounded(first: cutlass.Float32, second: cutlass.Float32, *, loc=None, ip=None) -> cutlass.Uint32:
    """``first`` and ``second`` rounded to bf16 (to nearest, ties to even) and packed, ``first`` in
    the low half (the lower address): one packed conversion, where converting each value alone
    takes the scalar one (a quarter-rate unit on Hopper)."""
    operands = [cutlass.Float32(second).ir_value(loc=loc, ip=ip), cutlass.Float32(first).ir_value(loc=loc, ip=ip)]  # (cvt's first source: the high half)
    return cutlass.Uint32(llvm.inline_asm(T.i32(), operands, "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f",
                                          has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def pin_registers(values: cute.Tensor):
    """Hold a register tensor's values at this point of the WGMMA sequence (CUTLASS's
    warpgroup_fence_operand): reads of block accumulators after a ``wait_group`` stay after it, and
    a promotion's sums finish before the next WGMMAs are issued. Without it the compiler moves one
    stage's promotion past the next stage's WGMMAs (to chain the two fmas of each value), and
    ptxas then serializes every WGMMA: the register values of an in-flight WGMMA are read."""
    for i in cutlass.range_constexpr(cute.size(values)):
        values[i] = _pinned(values[i])


class BlockScaledMainloop:
    """Mixin of GroupedGemmSm90 for ``operand="e4m3_block"`` (see the module docstring)."""

    block_scaled = False
    block_buffers = 1  # sets of block accumulators a warpgroup cycles through (module docstring)
    deep_turn = 0  # with two sets: stages a turn in which two stages' WGMMAs are in flight (module docstring; 0: one)
    stacked_b = False  # two products' B tiles stacked, one WGMMA over both (GroupedGemmSm90.stacked_b)
    epilogue_kind = None  # (the grouped GEMM's sets its epilogue; a weight gradient's has none of these kinds)
    stages_under_epilogue = 1  # the weight gradient: stages of a tile issued before the previous tile's epilogue (1 or 2)
    ordered_issue = False  # warpgroup 1 issues each stage's WGMMAs after warpgroup 0 (module docstring)

    def use_ordered_issue(self, ordered_issue: bool) -> None:
        """Set :attr:`ordered_issue` (the module docstring), an option of the FP8 mainloop only."""
        if ordered_issue and not self.block_scaled:
            raise ValueError("ordered_issue: an option of the FP8 mainloop (operand='e4m3_block'), got operand='bf16'")
        self.ordered_issue = ordered_issue

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
        """The SwiGLU backward's one product 128 wide: with one block set (h loaded before the
        mainloop) its block accumulators beside the epilogue's registers spilled 276 bytes at the
        launch count, 8 with the 40 / 232 hand-over, none with 24 / 240 (ptxas launches it at 168,
        which both fit); two sets (h loaded after) take 24 / 240 too."""
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
    def consume_block_scaled_tile(self, ab_pipe, tiled_mma, accs, blocks, issue, k_tiles, cons, release, scales, tile, mma_tidx):
        """Persistent consumer of one tile: acc (and acc2) += each K block's product times its scales
        (the module docstring), every stage handed back once its WGMMAs retired and its row scales
        were read; returns the advanced (read, release) states. ``blocks`` = the block accumulators
        (block, block2), and with ``block_buffers=2`` a second such pair; ``issue`` = (the tiled MMA
        the stages' WGMMAs are issued with, its A, B and B2 fragments, and with ``stacked_b`` the one
        block accumulator of both products, whose halves ``blocks`` are); ``scales`` = (the row
        scales' stage buffers, B's scales, B2's); ``tile`` = (expert, column tile). ``tiled_mma``:
        the tile's own (its partition of the output gives the rows' coordinates)."""
        s_sa, m_sb, m_sb2 = scales
        expert, tile_col = tile
        tile_m, tile_n, _ = self.tile_shape_mnk
        crd = tiled_mma.get_slice(mma_tidx).partition_C(cute.make_identity_tensor((tile_m, tile_n)))
        n_block = tile_col * tile_n // SCALE_BLOCK
        row_scale = cute.make_rmem_tensor((2, cute.size(crd, mode=[1])), cutlass.Float32)
        group_idx = cute.arch.make_warp_uniform(mma_tidx // 128)  # (the MMA warpgroup: ordered_issue)
        if cutlass.const_expr(self.block_buffers == 1):
            next_b = self.b_scales(m_sb, m_sb2, n_block, 0, expert)  # (each K block's B scales loaded one block ahead)
            for k_tile in cutlass.range(k_tiles, unroll=1):
                scale_b = next_b
                if k_tile + 1 < k_tiles:
                    next_b = self.b_scales(m_sb, m_sb2, n_block, k_tile + 1, expert)
                self.wait_stage(ab_pipe, cons)
                self.meet_issue_order(group_idx, 1)
                if cutlass.const_expr(self.stacked_b):  # one WGMMA a step over both products' stacked B tiles
                    self.mma_stage(issue[0], issue[4][0], issue[4][0], *issue[1:4], cons.index, overwrite=True, one_product=True)
                else:
                    self.mma_stage(issue[0], blocks[0], blocks[1], *issue[1:4], cons.index, overwrite=True)  # (no zeroing: scale-d 0 first)
                self.meet_issue_order(group_idx, 0)
                cute.nvgpu.warpgroup.wait_group(0)
                self.retire_block(ab_pipe, release, s_sa, crd, row_scale, cons.index)
                cons.advance()
                release.advance()
                self.promote(accs, blocks[:2], row_scale, scale_b)
        else:  # a stage's WGMMAs into one set while the previous stage's product, in the other, is promoted
            context = (ab_pipe, issue, accs, blocks, s_sa, m_sb, m_sb2, crd, row_scale, n_block, expert, k_tiles, group_idx)
            unread = (cutlass.Float32(0.0), cutlass.Float32(0.0))  # (B's scales before the first stage: none)
            first_b = self.b_scales(m_sb, m_sb2, n_block, 0, expert)  # (stage 0's; each later stage's read with the one before)
            cons, release, _, _, _ = self.two_set_schedule(  # (K tiles >= 1 here)
                k_tiles, self.issue_block_scaled_stage, self.settle_block_scaled_stage, context, (cons, release, unread, unread, first_b)
            )
        return cons, release

    @cute.jit
    def meet_issue_order(self, group_idx, warpgroup: cutlass.Constexpr[int]):
        """``ordered_issue``: the named barrier both MMA warpgroups meet once a stage, here for
        ``warpgroup`` only: warpgroup 1 before it issues the stage's WGMMAs, warpgroup 0 after, so
        that warpgroup 1's go out after warpgroup 0's."""
        if cutlass.const_expr(self.ordered_issue):
            if group_idx == warpgroup:
                cute.arch.barrier(barrier_id=ISSUE_ORDER_BARRIER, number_of_threads=self.consumer_threads)

    @cute.jit
    def two_set_schedule(self, k_tiles, issue, settle, context, carry, first_issued: cutlass.Constexpr[int] = 0):
        """The FP8 mainloops' schedule over ``k_tiles`` >= 1 stages with two sets of block
        accumulators: stage k's WGMMAs are issued into set k % 2 (``issue(context, k, set, carry)``),
        then stage k - 1's product, retired in the other set, is promoted while they run
        (``settle(context, set, latest, carry)``; ``latest``: the stage is the one issued last), then
        they are waited for (``wait_group 0``): the tensor cores do not wait for the promotion. The
        loop takes two stages a turn so that each set is named statically, and retires every WGMMA
        before its back edge: otherwise ptxas serializes every WGMMA (docs/notes/kernel-pitfalls.md).
        ``carry``: what the two callbacks advance (pipeline states, scales), returned. With
        ``deep_turn`` the stages first run in turns of that many with two in flight (the module
        docstring), the rest as above. ``first_issued``: the stages (0, 1 or 2, at most ``k_tiles``)
        the caller issued already, into sets 0 and 1 (and ran other work while their WGMMAs did): the
        schedule starts at their waits."""
        if cutlass.const_expr(first_issued == 0):
            carry = issue(context, 0, 0, carry)
        if cutlass.const_expr(first_issued == 2):  # stage 0 retired and promoted while stage 1 runs
            cute.nvgpu.warpgroup.wait_group(1)
            carry = settle(context, 0, False, carry)
        cute.nvgpu.warpgroup.wait_group(0)
        entry = max(first_issued, 1)  # stages issued (the last of them retired, not promoted)
        base = entry % 2  # the set of the first stage the loops below issue (stage k: set k % 2)
        first = entry
        if cutlass.const_expr(self.deep_turn > 0):  # turns of deep_turn stages, two in flight (the last stage retired, not promoted, at entry)
            turns = (k_tiles - entry) // self.deep_turn
            for turn in cutlass.range(turns, unroll=1):
                for i in cutlass.range_constexpr(self.deep_turn):  # stage k into its set, then k - 1 retired and promoted
                    carry = issue(context, turn * self.deep_turn + entry + i, (base + i) % 2, carry)
                    if cutlass.const_expr(i > 0):
                        cute.nvgpu.warpgroup.wait_group(1)
                    carry = settle(context, (base + i + 1) % 2, False, carry)
                cute.nvgpu.warpgroup.wait_group(0)  # (nothing in flight across the back edge)
            first = entry + turns * self.deep_turn  # (deep_turn is even: the sets' parity holds)
        for pair in cutlass.range((k_tiles - first) // 2, unroll=1):  # stages first, first + 1 | ...
            for into in cutlass.range_constexpr(2):
                carry = issue(context, first + 2 * pair + into, (base + into) % 2, carry)
                carry = settle(context, (base + into + 1) % 2, False, carry)  # (the previous stage, retired)
                cute.nvgpu.warpgroup.wait_group(0)
        if k_tiles % 2 == (entry + 1) % 2:  # (k_tiles - entry odd) the last stage not issued yet: into set ``base``
            carry = issue(context, k_tiles - 1, base, carry)
            carry = settle(context, 1 - base, False, carry)
            cute.nvgpu.warpgroup.wait_group(0)
            carry = settle(context, base, True, carry)
        else:  # the last stage issued and retired, in the other set
            carry = settle(context, 1 - base, True, carry)
        return carry

    @cute.jit
    def issue_block_scaled_stage(self, context, k_tile, into: cutlass.Constexpr[int], carry):
        """:meth:`two_set_schedule`'s issue for consume_block_scaled_tile: B's scales of the stage
        after this one read (a whole stage ahead of their use: the scales of the stage issued now
        were read with the stage before, so no promotion waits on a load issued in its own turn),
        the stage's WGMMAs into set ``into``. carry, as returned: (read state, release state, B's
        scales of the stage before this one, of this one, of the next)."""
        ab_pipe, issue, _, blocks, _, m_sb, m_sb2, _, _, n_block, expert, k_tiles, group_idx = context
        cons, release, _, scales_b, this_b = carry
        next_b = self.b_scales(m_sb, m_sb2, n_block, cutlass.min(k_tile + 1, k_tiles - 1), expert)  # (the last stage's again past the end)
        self.wait_stage(ab_pipe, cons)
        self.meet_issue_order(group_idx, 1)
        if cutlass.const_expr(self.stacked_b):  # one WGMMA a step over both products' stacked B tiles, into set ``into``'s pair
            self.mma_stage(issue[0], issue[4][into], issue[4][into], *issue[1:4], cons.index, overwrite=True, one_product=True)
        else:
            self.mma_stage(issue[0], blocks[2 * into], blocks[2 * into + 1], *issue[1:4], cons.index, overwrite=True)
        self.meet_issue_order(group_idx, 0)
        cons.advance()
        return cons, release, scales_b, this_b, next_b

    @cute.jit
    def settle_block_scaled_stage(self, context, into: cutlass.Constexpr[int], latest: cutlass.Constexpr[bool], carry):
        """:meth:`two_set_schedule`'s settle for consume_block_scaled_tile: the oldest stage in
        flight, retired in set ``into``, handed back after its row scales are read, then promoted."""
        ab_pipe, _, accs, blocks, s_sa, _, _, crd, row_scale, _, _, _, _ = context
        cons, release, earlier_b, scales_b, next_b = carry
        self.retire_block(ab_pipe, release, s_sa, crd, row_scale, release.index)
        release.advance()
        self.promote(accs, blocks[2 * into: 2 * into + 2], row_scale, scales_b if latest else earlier_b)
        return cons, release, earlier_b, scales_b, next_b

    @cute.jit
    def issue_outer_scaled_stage(self, context, k_tile, into: cutlass.Constexpr[int], carry):
        """:meth:`two_set_schedule`'s issue for consume_outer_scaled_tile: the stage's WGMMAs into
        block ``into``. carry = (read state, release state)."""
        ab_pipe, tiled_mma, _, blocks, (r_a, r_b), _, _, group_idx = context
        cons, release = carry
        ab_pipe.consumer_wait(cons)
        self.meet_issue_order(group_idx, 1)
        self.mma_stage(tiled_mma, blocks[into], blocks[into], r_a, r_b, r_b, cons.index, overwrite=True)
        self.meet_issue_order(group_idx, 0)
        cons.advance()
        return cons, release

    @cute.jit
    def settle_outer_scaled_stage(self, context, into: cutlass.Constexpr[int], latest: cutlass.Constexpr[bool], carry):
        """:meth:`two_set_schedule`'s settle for consume_outer_scaled_tile: the oldest stage in
        flight, retired in block ``into``, promoted with its scales from shared memory, then handed back."""
        ab_pipe, _, acc, blocks, _, scales, crd, _ = context
        cons, release = carry
        self.promote_outer(acc, blocks[into], scales, crd, release.index)
        ab_pipe.consumer_release(release)
        release.advance()
        return cons, release

    @cute.jit
    def b_scales(self, m_sb, m_sb2, n_block, k_tile, expert):
        """(B's scale, B2's) of K block ``k_tile`` (B2's = B's without a second product)."""
        scale_b = self.b_scale(m_sb, m_sb2, n_block, k_tile, expert)
        scale_b2 = scale_b
        if cutlass.const_expr(self.two_accumulators):
            scale_b2 = m_sb2[n_block, k_tile, expert]
        return scale_b, scale_b2

    @cute.jit
    def consume_outer_scaled_tile(self, ab_pipe, tiled_mma, acc, blocks, operands, k_tiles, cons, scales, mma_tidx, under_first_stages):
        """Persistent consumer of one weight-gradient tile on FP8 (both operands scaled per 128-row
        block, along the output's rows and its columns: mok/kernels/sm90/weight_grad_gemm.py):
        acc += each stage's product · (sa[row] · sb[column]) per value, on :meth:`two_set_schedule`
        with ``blocks`` = two block accumulators used in turn (the two MMA warpgroups take the same
        stages and would otherwise promote at the same time, the tensor cores idle). The promotion
        reads the stage's scales from shared memory (``scales`` = their stage buffers) and hands the
        stage back after it; stages are released in the order they were read. Returns the advanced
        state. One fma per value and stage, in stage order.

        ``under_first_stages`` = (fn, args): ``fn(*args)`` runs once the tile's first
        ``stages_under_epilogue`` stages' WGMMAs are issued (into ``blocks[0]``, then ``blocks[1]``;
        fewer where the tile has fewer) and before they are waited for; it must leave ``acc`` zeroed
        (the previous tile's epilogue, reading ``acc``, can run there, under the tensor work)."""
        tile_m, tile_n, _ = self.tile_shape_mnk
        crd = tiled_mma.get_slice(mma_tidx).partition_C(cute.make_identity_tensor((tile_m, tile_n)))
        group_idx = cute.arch.make_warp_uniform(mma_tidx // 128)  # (the MMA warpgroup: ordered_issue)
        context = (ab_pipe, tiled_mma, acc, blocks, operands, scales, crd, group_idx)
        release = cons.clone()
        schedule = (k_tiles, self.issue_outer_scaled_stage, self.settle_outer_scaled_stage, context)
        if k_tiles > 0:
            cons, release = self.issue_outer_scaled_stage(context, 0, 0, (cons, release))
        if cutlass.const_expr(self.stages_under_epilogue == 2):
            lone = (cons.clone(), release.clone())  # (the states the second branch starts from: tracing the first advances these)
            if k_tiles > 1:  # (the second stage's WGMMAs in flight only within this branch: a join would copy their registers)
                cons, release = self.issue_outer_scaled_stage(context, 1, 1, (cons, release))
                under_first_stages[0](*under_first_stages[1])
                cons, _ = self.two_set_schedule(*schedule, (cons, release), first_issued=2)
            else:  # none or one stage
                under_first_stages[0](*under_first_stages[1])
                cute.nvgpu.warpgroup.wait_group(0)
                if k_tiles > 0:
                    cons, _ = self.settle_outer_scaled_stage(context, 0, True, lone)
        else:
            under_first_stages[0](*under_first_stages[1])
            if k_tiles > 0:
                cons, _ = self.two_set_schedule(*schedule, (cons, release), first_issued=1)
        return cons

    @cute.jit
    def promote_outer(self, acc, block, scales, crd, stage):
        """acc += block · (sa[row] · sb[column]) per value, the scales of stage ``stage`` read from
        shared memory (``scales`` = A's and B's stage buffers; a thread's columns come in pairs)."""
        s_sa, s_sb = scales
        pin_registers(block)  # (read after the wait that retired it)
        row_tiles, groups = cute.size(crd, mode=[1]), self.tile_shape_mnk[1] // 8
        row_scale = cute.make_rmem_tensor((2, row_tiles), cutlass.Float32)
        for m in cutlass.range_constexpr(row_tiles):
            for hi in cutlass.range_constexpr(2):
                row_scale[hi, m] = s_sa[crd[(0, hi, 0), m, 0][0], 0, stage]
        for j in cutlass.range_constexpr(groups):
            column_scale = (s_sb[crd[(0, 0, j), 0, 0][1], 0, stage], s_sb[crd[(1, 0, j), 0, 0][1], 0, stage])
            for m in cutlass.range_constexpr(row_tiles):
                for hi in cutlass.range_constexpr(2):
                    for c in cutlass.range_constexpr(2):
                        at = ((c, hi, j), m, 0)
                        acc[at] = cute.math.fma(block[at], row_scale[hi, m] * column_scale[c], acc[at])
        pin_registers(acc)  # (summed before the next stage's WGMMAs are issued)

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
        """acc += block · (row scale · B's scale) per value (acc2 with block2 and B2's scale); with
        two sets of blocks, the values pinned (pin_registers) around it."""
        tile_n = self.tile_shape_mnk[1]
        groups = tile_n // 8
        for pair in ((accs[0], blocks[0], scales_b[0]), (accs[1], blocks[1], scales_b[1]))[: self.num_b]:
            total, part, scale = pair
            if cutlass.const_expr(self.block_buffers == 2):
                pin_registers(part)
            for j in cutlass.range_constexpr(groups):
                for m in cutlass.range_constexpr(cute.size(row_scale, mode=[1])):
                    for hi in cutlass.range_constexpr(2):
                        factor = row_scale[hi, m] * scale
                        for c in cutlass.range_constexpr(2):
                            at = ((c, hi, j), m, 0)
                            total[at] = cute.math.fma(part[at], factor, total[at])
            if cutlass.const_expr(self.block_buffers == 2):
                pin_registers(total)
