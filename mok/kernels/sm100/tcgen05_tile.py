"""What MoK's Blackwell GEMM kernels share: tcgen05 MMAs on one CTA's output tile, fed by a TMA
multistage shared-memory pipeline, accumulating in tensor memory (compile-verified only: no SM100
GPU has run them).

A CTA of four warps owns one output tile (128 x tile_n). Warp 0 issues the TMA loads
``stages - 2`` K tiles ahead of the MMAs (so refilling a stage waits for MMAs issued a stage
earlier, never for the ones just issued) and the MMAs (128 x tile_n x 16, cta_group::1), one or
two accumulators (the second in the next tile_n columns of tensor memory). Each stage's MMAs free
it on completion (tcgen05.commit onto its empty barrier), the last ones signal the accumulator
barrier. Then the four warps read the accumulators back with tcgen05.ld 32x32b (thread t holds row
t of the tile, ``EPI_COLS`` columns at a time) for the subclass's epilogue. K is reduced in one
fixed order, by one CTA per output tile: the result depends only on the tile's inputs.

A subclass sets ``tile_shape_mnk``, ``num_b`` and ``ab_stage`` and writes ``load_stage`` (the TMA
loads of one K tile) and its epilogue.
"""

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass.cute.nvgpu import tcgen05

TILE_M = 128  # rows of a tile: one tcgen05 MMA's M on one CTA (and the schedule's row tile)
TILE_K = 64  # bf16: four 16-deep MMAs per shared-memory stage (one 128-byte swizzle atom)
THREADS = 128  # four warps: warp 0 loads and issues the MMAs; all four run the epilogue
EPI_COLS = 32  # accumulator columns a thread reads per tcgen05.ld (32x32b, 32 repetitions)
SMEM_BYTES = 227 * 1024
MAX_STAGES = 8
TMEM_ALLOC_BARRIER = 1  # named barrier: the TMEM allocation's retrieval and its release
MAJOR = {"k": cute.nvgpu.OperandMajorMode.K, "mn": cute.nvgpu.OperandMajorMode.MN}


def pick_stages(stage_bytes: int, stages: int | None) -> int:
    """Pipeline depth: as deep as shared memory allows (at most 8), or ``stages`` if it fits."""
    most = min((SMEM_BYTES - 1024) // stage_bytes, MAX_STAGES)
    if stages is not None and not 2 <= stages <= most:
        raise ValueError(f"stages: expected 2..{most} for this tile, got {stages}")
    return most if stages is None else stages


class Tcgen05TileKernel:
    """Base of the SM100 GEMM kernels (see the module docstring)."""

    num_b = 1  # accumulators (B operands per stage): 2 for SwiGLU's gate and up

    def make_mma(self, a_major: str, b_major: str):
        """Host side: the tiled MMA for operands of these major modes ("k" or "mn"), and the staged
        shared-memory layouts of A and B."""
        tiled_mma = sm100_utils.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16, MAJOR[a_major], MAJOR[b_major], cutlass.Float32, tcgen05.CtaGroup.ONE,
            self.tile_shape_mnk[:2],
        )
        a_smem = sm100_utils.make_smem_layout_a(tiled_mma, self.tile_shape_mnk, cutlass.BFloat16, self.ab_stage)
        b_smem = sm100_utils.make_smem_layout_b(tiled_mma, self.tile_shape_mnk, cutlass.BFloat16, self.ab_stage)
        return tiled_mma, a_smem, b_smem

    def load_atoms(self, tiled_mma, a_smem, b_smem, m_a: cute.Tensor, *m_bs: cute.Tensor):
        """Host side: TMA load atoms and coordinate tensors of A and each B (all (MN, K, L)), and the
        bytes one stage receives (``stage_tx_bytes``: A and ``num_b`` B tiles)."""
        a_stage = cute.slice_(a_smem, (None, None, None, 0))
        b_stage = cute.slice_(b_smem, (None, None, None, 0))
        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        atoms = (cute.nvgpu.make_tiled_tma_atom_A(g2s, m_a, a_stage, self.tile_shape_mnk, tiled_mma),)
        atoms += tuple(cute.nvgpu.make_tiled_tma_atom_B(g2s, m_b, b_stage, self.tile_shape_mnk, tiled_mma) for m_b in m_bs)
        bf16 = cutlass.BFloat16
        self.stage_tx_bytes = cute.size_in_bytes(bf16, a_stage) + self.num_b * cute.size_in_bytes(bf16, b_stage)
        return atoms

    def shared_storage(self, a_smem, b_smem):
        """Host side: the CTA's shared memory: the pipeline's barriers, the TMEM address, the stages.
        (The struct's annotations are evaluated here, with ``self`` in scope: this module does not
        postpone annotations.)"""
        b2_elems = cute.cosize(b_smem) if self.num_b == 2 else 8  # no second B buffer otherwise

        @cute.struct
        class SharedStorage:
            ab_mbar: cute.struct.MemRange[cutlass.Int64, self.ab_stage * 2]
            acc_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            tmem_base: cutlass.Int32
            s_a: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(a_smem)], 1024]
            s_b: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(b_smem)], 1024]
            s_b2: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, b2_elems], 1024]

        return SharedStorage

    def tmem_columns(self) -> int:
        """Tensor-memory columns to allocate: the accumulators' (a power of two, at least 32)."""
        used = self.num_b * self.tile_shape_mnk[1]
        return max(32, 1 << (used - 1).bit_length())

    def operand_view(self, tiled_mma, load, s_x, operand: str, mn_tile, l_index):
        """One operand's TMA partition for this CTA's tile: (atom, global by K tile, shared by stage).
        ``load`` = (atom, coordinate tensor (MN, K, L)) from :meth:`load_atoms`, ``operand`` "a" or
        "b", ``mn_tile`` its tile along M or N, ``l_index`` its L coordinate (an expert, or 0)."""
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
        return atom, g_part[(None, mn_tile, None, l_index)], s_part

    @cute.jit
    def setup(self, warp_idx, tiled_mma, a_smem, b_smem, loads):
        """Every thread: the TMA descriptors prefetched (warp 0), shared memory, the two pipelines, and
        the accumulators allocated in tensor memory (as (MMA, MMA_M, MMA_N, accumulator)). Returns
        (stages, pipelines, tmem, t_acc)."""
        if warp_idx == 0:
            for atom, _ in loads:
                cute.nvgpu.cpasync.prefetch_descriptor(atom)
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage_type)
        s_a = storage.s_a.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        s_b = storage.s_b.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        s_b2 = s_b
        if cutlass.const_expr(self.num_b == 2):
            s_b2 = storage.s_b2.get_tensor(b_smem.outer, swizzle=b_smem.inner)
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
        return (s_a, s_b, s_b2), (ab_producer, ab_consumer, acc_producer, acc_consumer), tmem, t_acc

    @cute.jit
    def mma_warp(self, warp_idx, tiled_mma, stages, pipes, t_acc, views, k_tiles):
        """Warp 0: TMA loads (``load_stage(empty, views)``) ``stages - 2`` K tiles ahead of the MMAs;
        acc (acc2) = A·Bᵀ (A·B2ᵀ) over ``k_tiles`` K tiles in order (none: the accumulators are not
        written; the epilogue must not read them). The accumulator barrier fires once every MMA has
        completed. The other warps return at once."""
        if warp_idx == 0:
            s_a, s_b, s_b2 = stages
            ab_producer, ab_consumer, acc_producer, _ = pipes
            r_a = tiled_mma.make_fragment_A(s_a)  # (MMA, MMA_M, MMA_K, stage): shared-memory descriptors
            r_b = tiled_mma.make_fragment_B(s_b)
            r_b2 = tiled_mma.make_fragment_B(s_b2)
            acc = t_acc[(None, None, None, 0)]
            acc2 = t_acc[(None, None, None, self.num_b - 1)]
            ahead = cutlass.min(self.ab_stage - 2, k_tiles)
            acc_empty = acc_producer.acquire_and_advance()
            for _ in cutlass.range(ahead, unroll=1):
                self.load_stage(ab_producer.acquire_and_advance(), views)
            tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
            for k_tile in cutlass.range(k_tiles, unroll=1):
                if k_tile < k_tiles - ahead:
                    self.load_stage(ab_producer.acquire_and_advance(), views)
                full = ab_consumer.wait_and_advance()
                for kb in cutlass.range(cute.size(r_a, mode=[2]), unroll_full=True):
                    blk = (None, None, kb, full.index)
                    cute.gemm(tiled_mma, acc, r_a[blk], r_b[blk], acc)
                    if cutlass.const_expr(self.num_b == 2):
                        cute.gemm(tiled_mma, acc2, r_a[blk], r_b2[blk], acc2)
                    tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                full.release()  # the stage is free once these MMAs complete
            acc_empty.commit()  # the accumulators are final once every MMA has completed

    @cute.jit
    def wait_accumulators(self, tmem, pipes):
        """Every thread: give up the right to allocate tensor memory (others' CTAs may), then wait until
        the MMAs are done; returns the accumulator barrier's handle for :meth:`finish`."""
        tmem.relinquish_alloc_permit()
        return pipes[3].wait_and_advance()

    @cute.jit
    def finish(self, warp_idx, pipes, tmem, t_acc, acc_full):
        """Every thread, after its epilogue: release the accumulator, free the tensor memory once
        every warp's reads are done, and (warp 0) wait for the pipeline's last stages."""
        ab_producer = pipes[0]
        acc_full.release()
        pipeline.sync(barrier_id=TMEM_ALLOC_BARRIER)
        tmem.free(t_acc.iterator)
        if warp_idx == 0:
            ab_producer.tail()

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
