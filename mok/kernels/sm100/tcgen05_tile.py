"""What MoK's Blackwell GEMM kernels share: tcgen05 MMAs on one CTA's output tile, fed by a TMA
multistage shared-memory pipeline, accumulating in tensor memory (compile-verified only: no SM100
GPU has run them).

A CTA of four warps owns one output tile (128 x tile_n). Warp 0 issues the TMA loads
``stages - 2`` K tiles ahead of the MMAs (so refilling a stage waits for MMAs issued two K tiles
earlier, never for the ones just issued) and the MMAs (128 x tile_n x 16, cta_group::1), one or
two accumulators (the second in the next tile_n columns of tensor memory). Each stage's MMAs free
it on completion (tcgen05.commit onto its empty barrier), the last ones signal the accumulator
barrier; warp 0 then waits until every stage's last release has landed (the producer's tail).
Then the four warps read the accumulators back with tcgen05.ld 32x32b (thread t holds row
t of the tile, ``EPI_COLS`` columns at a time) for the subclass's epilogue. K is reduced in one
fixed order, by one CTA per output tile: the result depends only on the tile's inputs.

With ``mxfp8`` the operands are MXFP8 (E4M3 elements, an E8M0 scale per 32 along K): each stage
also brings the tile's scales (TMA, in the MMA's scale order, see mok.mxfp8.mma_scale_layout), warp 0
copies them into tensor memory (tcgen05.cp) ahead of the stage's block-scaled MMAs
(kind::mxf8f6f4, 128 x tile_n x 32), and a stage holds 128 K values (128 bytes a row, as bf16's 64).

A subclass sets ``tile_shape_mnk``, ``num_b`` and ``ab_stage`` and writes ``load_stage`` (the TMA
loads of one K tile) and its epilogue.
"""

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.blockscaled_layout as blockscaled_layout
from cutlass.cute.nvgpu import tcgen05

TILE_M = 128  # rows of a tile: one tcgen05 MMA's M on one CTA (and the schedule's row tile)
TILE_K = 64  # bf16: four 16-deep MMAs per shared-memory stage (one 128-byte swizzle atom)
TILE_K_MXFP8 = 128  # MXFP8: four 32-deep block-scaled MMAs per stage (128 bytes a row, the same atom)
SCALE_BLOCK = 32  # MXFP8: elements along K that share one E8M0 scale
SCALE_ATOM = 32  # MXFP8: tensor memory reserved for scales, per stage: (rows / 32) x (MMAs per stage) columns
THREADS = 128  # four warps: warp 0 loads and issues the MMAs; all four run the epilogue
EPI_COLS = 32  # accumulator columns a thread reads per tcgen05.ld (32x32b, 32 repetitions)
SMEM_BYTES = 227 * 1024
MAX_STAGES = 8
TMEM_ALLOC_BARRIER = 1  # named barrier: the TMEM allocation's retrieval and its release
MAJOR = {"k": cute.nvgpu.OperandMajorMode.K, "mn": cute.nvgpu.OperandMajorMode.MN}


def load_lookahead(stages: int) -> int:
    """K tiles warp 0 loads ahead of its MMAs: refilling a stage then waits for the MMAs issued two
    K tiles earlier, never for the ones just issued (tests/barrier_model.py runs this schedule)."""
    return stages - 2


def pick_stages(stage_bytes: int, stages: int | None) -> int:
    """Pipeline depth: as deep as shared memory allows (at most 8), or ``stages`` if it fits."""
    most = min((SMEM_BYTES - 1024) // stage_bytes, MAX_STAGES)
    if stages is not None and not 2 <= stages <= most:
        raise ValueError(f"stages: expected 2..{most} for this tile, got {stages}")
    return most if stages is None else stages


def pick_mxfp8_stages(rows: int, stages: int | None) -> int:
    """:func:`pick_stages` for MXFP8 stages of ``rows`` operand rows (A's and the B's): 128 E4M3
    bytes and 4 scale bytes a row, and the alignment of the three scale buffers."""
    return pick_stages(rows * TILE_K_MXFP8 + rows * (TILE_K_MXFP8 // SCALE_BLOCK) + 3 * 128, stages)


class Tcgen05TileKernel:
    """Base of the SM100 GEMM kernels (see the module docstring)."""

    num_b = 1  # accumulators (B operands per stage): 2 for SwiGLU's gate and up
    mxfp8 = False  # operands: bf16, or MXFP8 with block-scaled MMAs (see the module docstring)

    @property
    def operand_dtype(self) -> type:
        """The element type of A and B in memory."""
        return cutlass.Float8E4M3FN if self.mxfp8 else cutlass.BFloat16

    def make_mma(self, a_major: str, b_major: str):
        """Host side: the tiled MMA for operands of these major modes ("k" or "mn"), and the staged
        shared-memory layouts of A and B."""
        if self.mxfp8:
            tiled_mma = sm100_utils.make_blockscaled_trivial_tiled_mma(
                cutlass.Float8E4M3FN, cutlass.Float8E4M3FN, MAJOR[a_major], MAJOR[b_major], cutlass.Float8E8M0FNU,
                SCALE_BLOCK, tcgen05.CtaGroup.ONE, self.tile_shape_mnk[:2],
            )
        else:
            tiled_mma = sm100_utils.make_trivial_tiled_mma(
                cutlass.BFloat16, cutlass.BFloat16, MAJOR[a_major], MAJOR[b_major], cutlass.Float32, tcgen05.CtaGroup.ONE,
                self.tile_shape_mnk[:2],
            )
        a_smem = sm100_utils.make_smem_layout_a(tiled_mma, self.tile_shape_mnk, self.operand_dtype, self.ab_stage)
        b_smem = sm100_utils.make_smem_layout_b(tiled_mma, self.tile_shape_mnk, self.operand_dtype, self.ab_stage)
        return tiled_mma, a_smem, b_smem

    def make_scale_layouts(self, tiled_mma):
        """Host side (MXFP8): the staged shared-memory layouts of A's and of each B's scales."""
        sfa = blockscaled_layout.make_smem_layout_sfa(tiled_mma, self.tile_shape_mnk, SCALE_BLOCK, self.ab_stage)
        sfb = blockscaled_layout.make_smem_layout_sfb(tiled_mma, self.tile_shape_mnk, SCALE_BLOCK, self.ab_stage)
        return sfa, sfb

    def scale_tensor(self, ptr: cute.Pointer, mn, k: int, batches) -> cute.Tensor:
        """Scales of an (MN, K, L) MXFP8 operand, in the MMA's scale order (mok.mxfp8.mma_scale_layout):
        for each L, 128-row by 128-column chunks of 512 bytes, K's chunks innermost."""
        return cute.make_tensor(ptr, blockscaled_layout.tile_atom_to_shape_SF((mn, k, batches), SCALE_BLOCK))

    def prepare(self, a_major: str, b_major: str, m_a: cute.Tensor, m_bs: tuple, m_sfa=None, m_sfbs: tuple = ()):
        """Host side, what every kernel's launch needs: the tiled MMA, the staged shared-memory layouts
        (A's, B's; MXFP8: then their scales', from ``m_sfa`` / ``m_sfbs``), the TMA loads of A and
        each B (MXFP8: then of their scales), and the CTA's shared storage
        (``shared_storage_type``). Returns (tiled_mma, layouts, loads)."""
        tiled_mma, a_smem, b_smem = self.make_mma(a_major, b_major)
        layouts = (a_smem, b_smem)
        loads = self.load_atoms(tiled_mma, a_smem, b_smem, m_a, *m_bs)
        if self.mxfp8:
            layouts += self.make_scale_layouts(tiled_mma)
            loads += self.scale_load_atoms(tiled_mma, layouts[2], layouts[3], m_sfa, *m_sfbs)
        self.shared_storage_type = self.shared_storage(*layouts)
        return tiled_mma, layouts, loads

    def load_atoms(self, tiled_mma, a_smem, b_smem, m_a: cute.Tensor, *m_bs: cute.Tensor):
        """Host side: TMA load atoms and coordinate tensors of A and each B (all (MN, K, L)), and the
        bytes one stage receives (``stage_tx_bytes``: A and ``num_b`` B tiles)."""
        atoms, self.stage_tx_bytes = self.stage_loads(tiled_mma, a_smem, b_smem, self.operand_dtype, m_a, m_bs)
        return atoms

    def scale_load_atoms(self, tiled_mma, sfa_smem, sfb_smem, m_sfa: cute.Tensor, *m_sfbs: cute.Tensor):
        """Host side (MXFP8, after :meth:`load_atoms`): the same for A's scales and each B's; adds their
        bytes to ``stage_tx_bytes``."""
        atoms, scale_bytes = self.stage_loads(tiled_mma, sfa_smem, sfb_smem, cutlass.Float8E8M0FNU, m_sfa, m_sfbs, cutlass.Int16)
        self.stage_tx_bytes += scale_bytes
        return atoms

    def stage_loads(self, tiled_mma, a_smem, b_smem, dtype, m_a: cute.Tensor, m_bs: tuple, internal_type=None):
        """TMA atoms (A's, then each B's) into one stage of these staged layouts, and the bytes of A's
        and ``num_b`` B's loads. ``internal_type``: the unit the TMA moves (the scales go as 16-bit
        pairs, as NVIDIA's block-scaled kernels load them: fewer, wider boxes)."""
        a_stage = cute.slice_(a_smem, (None, None, None, 0))
        b_stage = cute.slice_(b_smem, (None, None, None, 0))
        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        unit = {} if internal_type is None else {"internal_type": internal_type}
        atoms = (cute.nvgpu.make_tiled_tma_atom_A(g2s, m_a, a_stage, self.tile_shape_mnk, tiled_mma, **unit),)
        atoms += tuple(cute.nvgpu.make_tiled_tma_atom_B(g2s, m_b, b_stage, self.tile_shape_mnk, tiled_mma, **unit) for m_b in m_bs)
        return atoms, cute.size_in_bytes(dtype, a_stage) + self.num_b * cute.size_in_bytes(dtype, b_stage)

    def shared_storage(self, a_smem, b_smem, sfa_smem=None, sfb_smem=None):
        """Host side: the CTA's shared memory: the pipeline's barriers, the TMEM address, the stages
        (MXFP8: and the stages' scales). (The struct's annotations are evaluated here, with ``self``
        in scope: this module does not postpone annotations.)"""
        b2_elems = cute.cosize(b_smem) if self.num_b == 2 else 8  # no second B buffer otherwise
        dtype, e8m0 = self.operand_dtype, cutlass.Float8E8M0FNU

        @cute.struct
        class SharedStorage:
            ab_mbar: cute.struct.MemRange[cutlass.Int64, self.ab_stage * 2]
            acc_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            tmem_base: cutlass.Int32
            s_a: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(a_smem)], 1024]
            s_b: cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(b_smem)], 1024]
            s_b2: cute.struct.Align[cute.struct.MemRange[dtype, b2_elems], 1024]
            if self.mxfp8:  # the stages' scales
                s_sfa: cute.struct.Align[cute.struct.MemRange[e8m0, cute.cosize(sfa_smem)], 128]
                s_sfb: cute.struct.Align[cute.struct.MemRange[e8m0, cute.cosize(sfb_smem)], 128]
                s_sfb2: cute.struct.Align[cute.struct.MemRange[e8m0, cute.cosize(sfb_smem) if self.num_b == 2 else 16], 128]

        return SharedStorage

    def accumulator_columns(self) -> int:
        """Tensor-memory columns of the accumulators (one fp32 column per output column)."""
        return self.num_b * self.tile_shape_mnk[1]

    def scale_columns(self) -> tuple[int, int]:
        """MXFP8: tensor-memory columns reserved for A's scales and for each B's (one stage, 4 MMAs
        deep), as CUTLASS's block-scaled kernels reserve them (the copies fill fewer: 4 columns a
        128 rows)."""
        tile_m, tile_n, tile_k = self.tile_shape_mnk
        mmas = tile_k // SCALE_BLOCK
        return tile_m // SCALE_ATOM * mmas, tile_n // SCALE_ATOM * mmas

    def tmem_columns(self) -> int:
        """Tensor-memory columns to allocate: the accumulators' (and MXFP8's scales'), a power of two,
        at least 32."""
        used = self.accumulator_columns()
        if self.mxfp8:
            sfa_cols, sfb_cols = self.scale_columns()
            used += sfa_cols + self.num_b * sfb_cols
        return max(32, 1 << (used - 1).bit_length())

    def operand_view(self, tiled_mma, load, s_x, operand: str, mn_tile, l_index, scales: bool = False):
        """One operand's TMA partition for this CTA's tile: (atom, global by K tile, shared by stage).
        ``load`` = (atom, coordinate tensor (MN, K, L)) from :meth:`load_atoms`, ``operand`` "a" or
        "b", ``mn_tile`` its tile along M or N, ``l_index`` its L coordinate (an expert, or 0);
        ``scales``: the operand's MXFP8 scales (from :meth:`scale_load_atoms`; their layouts repeat
        each scale over its 32 elements, which the copy leaves out)."""
        atom, coords = load
        thr_mma = tiled_mma.get_slice(0)
        # global tiles (bM|bN, bK, RestM|RestN, RestK, RestL) as the MMA partitions them, then the TMA's view of them
        if operand == "a":
            g_x = thr_mma.partition_A(cute.local_tile(coords, cute.slice_(self.tile_shape_mnk, (None, 0, None)), (None, None, None)))
        else:
            g_x = thr_mma.partition_B(cute.local_tile(coords, cute.slice_(self.tile_shape_mnk, (0, None, None)), (None, None, None)))
        s_part, g_part = cute.nvgpu.cpasync.tma_partition(
            atom, 0, cute.make_layout(1), cute.group_modes(s_x, 0, 3), cute.group_modes(g_x, 0, 3)
        )
        if scales:
            s_part, g_part = cute.filter_zeros(s_part), cute.filter_zeros(g_part)
        return atom, g_part[(None, mn_tile, None, l_index)], s_part

    @cute.jit
    def setup(self, warp_idx, tiled_mma, layouts, loads):
        """Every thread: the TMA descriptors prefetched (warp 0), shared memory, the two pipelines, and
        the accumulators allocated in tensor memory (as (MMA, MMA_M, MMA_N, accumulator)). Returns
        (stages, pipelines, tmem, t_acc); stages = (A, B, B2) in shared memory, with MXFP8 also their
        scales'. ``layouts`` and ``loads``: from :meth:`prepare`."""
        a_smem, b_smem = layouts[0], layouts[1]
        if warp_idx == 0:
            for atom, _ in loads:
                cute.nvgpu.cpasync.prefetch_descriptor(atom)
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage_type)
        s_a = storage.s_a.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        s_b = storage.s_b.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        s_b2 = s_b
        if cutlass.const_expr(self.num_b == 2):
            s_b2 = storage.s_b2.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        stages = (s_a, s_b, s_b2)
        if cutlass.const_expr(self.mxfp8):
            sfa_smem, sfb_smem = layouts[2], layouts[3]
            s_sfb = storage.s_sfb.get_tensor(sfb_smem)
            s_sfb2 = s_sfb
            if cutlass.const_expr(self.num_b == 2):
                s_sfb2 = storage.s_sfb2.get_tensor(sfb_smem)
            stages = (s_a, s_b, s_b2, storage.s_sfa.get_tensor(sfa_smem), s_sfb, s_sfb2)
        ab_producer, ab_consumer = pipeline.PipelineTmaUmma.create(
            num_stages=self.ab_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            tx_count=self.stage_tx_bytes,
            barrier_storage=storage.ab_mbar.data_ptr(),
        ).make_participants()
        acc_producer, acc_consumer = pipeline.PipelineUmmaAsync.create(
            num_stages=1,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, THREADS),
            barrier_storage=storage.acc_mbar.data_ptr(),
        ).make_participants()
        acc_shape = tiled_mma.partition_shape_C(self.tile_shape_mnk[:2])
        acc_layout = tiled_mma.make_fragment_C(cute.append(acc_shape, self.num_b)).layout
        tmem = cutlass.memory.TmemAllocator(
            storage.tmem_base.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=TMEM_ALLOC_BARRIER, num_threads=THREADS),
        )
        tmem.allocate(self.tmem_columns())
        tmem.wait_for_alloc()
        t_acc = cute.make_tensor(tmem.retrieve_ptr(cutlass.Float32), acc_layout)
        return stages, (ab_producer, ab_consumer, acc_producer, acc_consumer), tmem, t_acc

    @cute.jit
    def mma_warp(self, warp_idx, tiled_mma, stages, pipes, t_acc, views, k_tiles, layouts):
        """Warp 0: TMA loads (``load_stage(empty, views)``) ``stages - 2`` K tiles ahead of the MMAs;
        acc (acc2) = A·Bᵀ (A·B2ᵀ) over ``k_tiles`` K tiles in order (none: the accumulators are not
        written; the epilogue must not read them); MXFP8: each stage's scales copied into tensor
        memory before its block-scaled MMAs (tcgen05.cp and tcgen05.mma from one thread run in
        order). The accumulator barrier fires once every MMA has completed. The other warps return
        at once."""
        if warp_idx == 0:
            s_a, s_b, s_b2 = stages[0], stages[1], stages[2]
            ab_producer, ab_consumer, acc_producer, _ = pipes
            r_a = tiled_mma.make_fragment_A(s_a)  # (MMA, MMA_M, MMA_K, stage): shared-memory descriptors
            r_b = tiled_mma.make_fragment_B(s_b)
            r_b2 = tiled_mma.make_fragment_B(s_b2)
            acc = t_acc[(None, None, None, 0)]
            acc2 = t_acc[(None, None, None, self.num_b - 1)]
            scales = None
            if cutlass.const_expr(self.mxfp8):
                scales = self.scale_copies(tiled_mma, stages, t_acc, layouts[2], layouts[3])
            ahead = cutlass.min(load_lookahead(self.ab_stage), k_tiles)
            acc_empty = acc_producer.acquire_and_advance()
            for _ in cutlass.range(ahead, unroll=1):
                self.load_stage(ab_producer.acquire_and_advance(), views)
            tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
            for k_tile in cutlass.range(k_tiles, unroll=1):
                if k_tile < k_tiles - ahead:
                    self.load_stage(ab_producer.acquire_and_advance(), views)
                full = ab_consumer.wait_and_advance()
                if cutlass.const_expr(self.mxfp8):
                    self.copy_scales(scales, full.index)
                for kb in cutlass.range(cute.size(r_a, mode=[2]), unroll_full=True):
                    blk = (None, None, kb, full.index)
                    if cutlass.const_expr(self.mxfp8):
                        (_, _, _, t_sfa), (_, _, _, t_sfb), (_, _, _, t_sfb2) = scales
                        sf = (None, None, kb)
                        cute.gemm(tiled_mma, acc, [r_a[blk], t_sfa[sf]], [r_b[blk], t_sfb[sf]], acc)
                        if cutlass.const_expr(self.num_b == 2):
                            cute.gemm(tiled_mma, acc2, [r_a[blk], t_sfa[sf]], [r_b2[blk], t_sfb2[sf]], acc2)
                    else:
                        cute.gemm(tiled_mma, acc, r_a[blk], r_b[blk], acc)
                        if cutlass.const_expr(self.num_b == 2):
                            cute.gemm(tiled_mma, acc2, r_a[blk], r_b2[blk], acc2)
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                full.release()  # the stage is free once these MMAs complete
            acc_empty.commit()  # the accumulators are final once every MMA has completed
            # Before warp 0 moves on: every stage's last release has landed (no arrive onto shared
            # memory after the CTA exits). On the producer state these loops advanced: the state
            # ``setup`` made stays at stage 0, and its waits (parity 1) hang whenever a stage was
            # filled an odd number of times.
            ab_producer.tail()

    def scale_copies(self, tiled_mma, stages, t_acc, sfa_smem, sfb_smem):
        """MXFP8, warp 0: for A's scales, B's and B2's: (tcgen05.cp copy, shared-memory source by
        stage, tensor-memory destination, the MMAs' view of that tensor memory (MMA, MMA_MN, MMA_K)).
        The scales lie in tensor memory after the accumulators: A's, then B's, then B2's."""
        sfa_cols, sfb_cols = self.scale_columns()
        base = t_acc.iterator + self.accumulator_columns()
        e8m0 = cutlass.Float8E8M0FNU
        sfa_layout = blockscaled_layout.make_tmem_layout_sfa(
            tiled_mma, self.tile_shape_mnk, SCALE_BLOCK, cute.slice_(sfa_smem, (None, None, None, 0))
        )
        sfb_layout = blockscaled_layout.make_tmem_layout_sfb(
            tiled_mma, self.tile_shape_mnk, SCALE_BLOCK, cute.slice_(sfb_smem, (None, None, None, 0))
        )
        t_sfa = cute.make_tensor(cute.recast_ptr(base, dtype=e8m0), sfa_layout)
        t_sfb = cute.make_tensor(cute.recast_ptr(base + sfa_cols, dtype=e8m0), sfb_layout)
        t_sfb2 = cute.make_tensor(cute.recast_ptr(base + sfa_cols + (self.num_b - 1) * sfb_cols, dtype=e8m0), sfb_layout)
        return (
            self.scale_copy(stages[3], t_sfa) + (t_sfa,),
            self.scale_copy(stages[4], t_sfb) + (t_sfb,),
            self.scale_copy(stages[5], t_sfb2) + (t_sfb2,),
        )

    def scale_copy(self, s_sf: cute.Tensor, t_sf: cute.Tensor) -> tuple:
        """One operand's scales, shared memory (by stage) -> tensor memory: tcgen05.cp 32x128b.warpx4
        (each 16-byte line to four lane quarters). Returns (copy, source by stage, destination)."""
        s_compact, t_compact = cute.filter_zeros(s_sf), cute.filter_zeros(t_sf)
        atom = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(tcgen05.CtaGroup.ONE), cutlass.Float8E8M0FNU)
        copy = tcgen05.make_s2t_copy(atom, t_compact)
        thr = copy.get_slice(0)
        return copy, tcgen05.get_s2t_smem_desc_tensor(copy, thr.partition_S(s_compact)), thr.partition_D(t_compact)

    @cute.jit
    def copy_scales(self, scales, stage):
        """MXFP8, warp 0: stage ``stage``'s scales of A and B (and B2) into tensor memory."""
        for operand in cutlass.range_constexpr(1 + self.num_b):
            copy, src, dst, _ = scales[operand]
            cute.copy(copy, src[(None, None, None, None, stage)], dst)

    @cute.jit
    def wait_accumulators(self, tmem, pipes):
        """Every thread: give up the right to allocate tensor memory (others' CTAs may), then wait until
        the MMAs are done; returns the accumulator barrier's handle for :meth:`finish`."""
        tmem.relinquish_alloc_permit()
        return pipes[3].wait_and_advance()

    @cute.jit
    def finish(self, tmem, t_acc, acc_full):
        """Every thread, after its epilogue: release the accumulator and free the tensor memory once
        every warp's reads are done."""
        acc_full.release()
        pipeline.sync(barrier_id=TMEM_ALLOC_BARRIER)
        tmem.free(t_acc.iterator)

    def accumulator_reader(self, tidx, t_acc):
        """The epilogue's tcgen05.ld copy, this thread's slice of it, and the sources
        (T2R, T2R_M, T2R_N, 1, subtiles) of the first and the last accumulator."""
        epi_tile = (self.tile_shape_mnk[0], EPI_COLS)
        load_atom = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition.x32), cutlass.Float32)
        acc_epi = cute.flat_divide(t_acc[((None, None), 0, 0, 0)], epi_tile)  # (128, 32, 1, subtiles)
        acc2_epi = cute.flat_divide(t_acc[((None, None), 0, 0, self.num_b - 1)], epi_tile)
        t2r = tcgen05.make_tmem_copy(load_atom, acc_epi[(None, None, 0, 0)])
        thr = t2r.get_slice(tidx)
        return t2r, thr, thr.partition_S(acc_epi), thr.partition_S(acc2_epi)

    def thread_view(self, thr, tile: cute.Tensor) -> cute.Tensor:
        """This thread's part of a (128, tile_n) tile, by subtile: (T2R, T2R_M, T2R_N, 1, subtiles)."""
        return thr.partition_D(cute.flat_divide(tile, (self.tile_shape_mnk[0], EPI_COLS)))
