"""What MoK's Hopper GEMM kernels share: WGMMA on output tiles fed by a TMA multistage
shared-memory pipeline, each tile stored through shared memory with TMA.

A subclass decides which tiles a CTA owns, where their K tiles come from (``load_stage``)
and what the epilogue computes; this base holds the pieces that do not change:

- ``make_mma``: the tiled WGMMA (two MMA warpgroups of 64 rows) and the shared-memory
  layouts for the operands' major modes (K-major or MN-major, read from the tensors' strides);
- ``mainloop`` (one tile per CTA): warp 0 issues the TMA loads between its WGMMAs;
  ``produce_tile`` / ``consume_tile`` (persistent kernels): a producer warp loads while the
  MMA warpgroups consume. Either way each stage's buffers are released once its WGMMAs
  retired and K is reduced in one fixed order, so a tile's result depends only on its inputs
  (determinism, batch invariance) — and is the same bits in both kinds of kernel;
- ``store_fragment``: registers -> dtype -> shared memory -> global memory (TMA store, or
  TMA reduce-add into an existing fp32 tensor), synchronised over the MMA threads only;
- ``pingpong_consumers`` (persistent kernels that opt in): each MMA warpgroup computes whole
  128-row tiles, the two taking turns, so that one's epilogue runs under the other's WGMMAs.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.tensor_utils import LayoutEnum

from ..common.tile_order import grouped_tile

TILE_K = 64  # bf16: four 16-deep WGMMA k-blocks per shared-memory stage
SMEM_BYTES = 227 * 1024
THREADS = 256  # two consumer warpgroups; warp 0 also produces
EPI_STAGES = 4
PINGPONG_EPI_STAGES = 2  # ping-pong: per warpgroup (each has its own two epilogue buffers)
TURN_BARRIERS = (4, 3)  # ping-pong: the named barrier warpgroup w waits on for its turn (1, 2: the epilogues')


def pick_stages(stage_bytes: int, epi_bytes: int, stages: int | None, dedicated_epi: bool = False) -> int:
    """Pipeline depth: as deep as shared memory allows (at most 8), or ``stages`` if it fits.

    The epilogue's buffers either reuse the pipeline's (a CTA that owns one tile) or come on
    top of them (``dedicated_epi``: a persistent CTA loads its next tile during the epilogue).
    """
    budget = SMEM_BYTES - 1024 - (epi_bytes if dedicated_epi else 0)
    most = min(budget // stage_bytes, 8)
    if stages is not None and not 2 <= stages <= most:
        raise ValueError(f"stages: expected 2..{most} for this tile, got {stages}")
    chosen = most if stages is None else stages
    if not dedicated_epi and chosen * stage_bytes < epi_bytes:  # the epilogue reuses A's buffers
        raise ValueError(f"stages: {chosen} stages are too few to hold the epilogue's {epi_bytes} bytes")
    return chosen


class WgmmaTileKernel:
    """Base of the SM90 GEMM kernels; subclasses set ``tile_shape_mnk`` and ``ab_stage``."""

    threads = THREADS  # launched threads (a persistent kernel adds a producer warpgroup)
    consumer_threads = THREADS  # the two MMA warpgroups: they run the epilogue
    store_warp = 0  # the warp that issues the epilogue's TMA stores
    atom_layout_mnk = (2, 1, 1)
    epi_stage = EPI_STAGES
    buffer_align_bytes = 1024
    gather_a = False  # A rows gathered by the producer warpgroup with cp.async (grouped GEMM only)

    def make_mma(self, m_a: cute.Tensor, m_b: cute.Tensor, c_dtype, c_layout: LayoutEnum):
        """Tiled WGMMA, staged smem layouts of A and B, and the epilogue's smem layout (host side)."""
        ab_dtype = m_a.element_type
        self.ab_dtype = ab_dtype
        self.c_dtype = c_dtype
        self.c_layout = c_layout
        a_layout, b_layout = LayoutEnum.from_tensor(m_a), LayoutEnum.from_tensor(m_b)
        self.tiled_mma = self.wgmma_of_width(m_a, m_b, self.tile_shape_mnk[1])
        self.epi_tile = sm90_utils.compute_tile_shape_or_override(self.tile_shape_mnk, c_dtype, is_cooperative=True)
        a_smem = sm90_utils.make_smem_layout_a(a_layout, self.tile_shape_mnk, ab_dtype, self.ab_stage)
        b_smem = sm90_utils.make_smem_layout_b(b_layout, self.tile_shape_mnk, ab_dtype, self.ab_stage)
        epi_smem = sm90_utils.make_smem_layout_epi(c_dtype, c_layout, self.epi_tile, self.epi_stage)
        return a_smem, b_smem, epi_smem

    def wgmma_of_width(self, m_a: cute.Tensor, m_b: cute.Tensor, width: int):
        """Host side: the tiled WGMMA (fp32 accumulators, the operands' major modes, this kernel's
        warpgroup layout) over 64-row blocks ``width`` columns wide: the tile's, or a stacked or
        half-width tile's."""
        a_layout, b_layout = LayoutEnum.from_tensor(m_a), LayoutEnum.from_tensor(m_b)
        return sm90_utils.make_trivial_tiled_mma(
            m_a.element_type, m_a.element_type, a_layout.sm90_mma_major_mode(), b_layout.sm90_mma_major_mode(),
            cutlass.Float32, self.atom_layout_mnk, tiler_mn=(64, width),
        )

    def load_atom(self, m_x: cute.Tensor, smem, box, multicast: int = 1):
        """TMA load atom for one operand (``box`` = its (rows, K) tile); with ``multicast`` CTAs, each
        loads its 1/multicast of the box into all of them (TMA multicast within a cluster)."""
        if multicast > 1:
            g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp()
            return cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, m_x, cute.slice_(smem, (None, None, 0)), box, num_multicast=multicast)
        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        return cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, m_x, cute.slice_(smem, (None, None, 0)), box)

    def store_atom(self, m_x: cute.Tensor, epi_smem, reduce_add: bool = False):
        """TMA store atom (or reduce-add into the existing values) for one output tensor."""
        op = cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp()
        if reduce_add:
            op = cute.nvgpu.cpasync.CopyReduceBulkTensorTileS2GOp(cute.ReductionKind.ADD)
        return cute.nvgpu.cpasync.make_tiled_tma_atom(op, m_x, cute.slice_(epi_smem, (None, None, 0)), self.epi_tile)

    def tma_split(self, tma, s_x, g_x, multicast: tuple = (0, 1)):
        """One operand's TMA partition for this CTA: (smem side, gmem side per k tile); ``multicast``
        = (this CTA's rank, CTAs) for an atom of :meth:`load_atom`'s ``multicast``: the CTA's part of
        the box."""
        rank, ctas = multicast
        return cute.nvgpu.cpasync.tma_partition(tma, rank, cute.make_layout(ctas), cute.group_modes(s_x, 0, 2), cute.group_modes(g_x, 0, 2))

    def warpgroup_slice(self, tiled_mma, tidx):
        """The WGMMA slice of this thread's warpgroup (WGMMA partitions per warpgroup, not per thread).

        ``tidx`` counts from the first MMA thread (a persistent kernel's producer warpgroup comes first).
        """
        warp_group = cute.arch.make_warp_uniform(tidx // 128)
        return tiled_mma.get_slice(cute.make_layout(2, stride=128)(warp_group))

    def prefetch(self, *tma_atoms) -> None:
        """Bring the kernel's TMA descriptors into the descriptor cache (one warp calls it)."""
        for atom in tma_atoms:
            cute.nvgpu.cpasync.prefetch_descriptor(atom)

    def mma_operands(self, tiled_mma, mma_tidx, s_a, s_b, tile_mn: tuple | None = None):
        """This warpgroup's MMA slice, its WGMMA views of the A and B stages, and an fp32 accumulator
        (not zeroed) of the ``tile_mn`` product (default: the CTA's tile)."""
        thr_mma = self.warpgroup_slice(tiled_mma, mma_tidx)
        tile_mn = tile_mn or (self.tile_shape_mnk[0], self.tile_shape_mnk[1])
        acc = cute.make_rmem_tensor(thr_mma.partition_C(cute.make_identity_tensor(tile_mn)).shape, cutlass.Float32)
        r_a = tiled_mma.make_fragment_A(thr_mma.partition_A(s_a))
        r_b = tiled_mma.make_fragment_B(thr_mma.partition_B(s_b))
        return thr_mma, r_a, r_b, acc

    def use_pingpong(self, epi_stages: int = PINGPONG_EPI_STAGES):
        """Ping-pong (host side, before make_mma): a tiled MMA of one warpgroup (it covers a
        128-row tile in two 64-row WGMMAs) and ``epi_stages`` epilogue buffers per warpgroup."""
        self.atom_layout_mnk, self.epi_stage = (1, 1, 1), epi_stages

    def pingpong_epi_smem(self):
        """Ping-pong: both warpgroups' epilogue buffers (warpgroup w's from w·epi_stage on)."""
        return sm90_utils.make_smem_layout_epi(self.c_dtype, self.c_layout, self.epi_tile, 2 * self.epi_stage)

    @cute.jit
    def pingpong_consumers(self, mma_tidx, warp_idx, ab_pipe, tiled_mma, s_a, s_b, s_c, tiles, epi_args):
        """Ping-pong: MMA warpgroup w takes the CTA's tiles j = w, w + 2, ... (tile j is output tile
        first + j·step; ``tiles`` = (first, step, all_tiles, ...)), skipping the other's stages in
        the shared pipeline (its consumers: 4 warps). Before its mainloop a warpgroup waits until
        the other has issued the last WGMMAs of the tile before (named barrier TURN_BARRIERS[w]);
        once its own are issued it lets the other go, waits for its WGMMAs to retire and runs its
        epilogue (its own barrier, store warp and epilogue buffers) while the other's WGMMAs run.
        The subclass says what a tile is (``pingpong_tile``: its K tiles, whether it has an output,
        what the epilogue needs) and stores it (``pingpong_epilogue``, with ``epi_args``). A tile's
        WGMMAs and their order per output element are those of the cooperative kernel: the same bits."""
        first, step, all_tiles = tiles[0], tiles[1], tiles[2]
        tile_m, tile_n, _ = self.tile_shape_mnk
        group_idx = cute.arch.make_warp_uniform(mma_tidx // 128)
        thr_mma = tiled_mma.get_slice(0)  # (the tiled MMA is one warpgroup's)
        acc = cute.make_rmem_tensor(thr_mma.partition_C(cute.make_identity_tensor((tile_m, tile_n))).shape, cutlass.Float32)
        r_a = tiled_mma.make_fragment_A(thr_mma.partition_A(s_a))
        r_b = tiled_mma.make_fragment_B(thr_mma.partition_B(s_b))
        cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
        store_pipe = self.store_pipeline(threads=128)
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)  # onto accumulators zeroed per tile
        # Both warpgroups run one copy of the code, their barriers, store warp and buffers as
        # values (a copy per warpgroup doubled the code past the instruction cache: ncu showed a
        # third of the warps' time waiting for instructions).
        group = (1 + group_idx, 128, 4 + 4 * group_idx)  # epilogue barrier, its threads, its store warp
        my_turn = TURN_BARRIERS[0] - group_idx  # (4 for warpgroup 0, 3 for warpgroup 1)
        their_turn = TURN_BARRIERS[1] + group_idx
        linear = first + group_idx * step
        if group_idx == 1:  # warpgroup 1 starts past tile 0's stages
            cons, release = self.skip_stages(first, tiles, cons, release)
        while linear < all_tiles:
            k_tiles, has_output, tile = self.pingpong_tile(linear, tiles)
            if linear != first:  # the other warpgroup ran the tile before: wait until it issued its last WGMMAs
                cute.arch.barrier(barrier_id=my_turn, number_of_threads=256)
            acc.fill(0.0)
            cons, release = self.issue_tile(ab_pipe, tiled_mma, acc, acc, r_a, r_b, r_b, k_tiles, cons, release)
            if linear + step < all_tiles:  # all WGMMAs issued: the other warpgroup's turn while ours drain
                cute.arch.barrier_arrive(barrier_id=their_turn, number_of_threads=256)
            release = self.retire_tile(ab_pipe, k_tiles, release)
            if has_output:
                self.pingpong_epilogue(mma_tidx % 128, warp_idx, tiled_mma, acc, s_c, store_pipe, group, group_idx * self.epi_stage, tile, epi_args)
            cons, release = self.skip_stages(linear + step, tiles, cons, release)
            linear += 2 * step
        if warp_idx == group[2]:
            store_pipe.producer_tail()

    @cute.jit
    def skip_stages(self, linear, tiles, cons, release):
        """Advance a ping-pong warpgroup's pipeline states past the stages of output tile ``linear``
        (the other warpgroup's; nothing if there is no such tile)."""
        if linear < tiles[2]:
            k_tiles, _, _ = self.pingpong_tile(linear, tiles)
            for _ in cutlass.range(k_tiles, unroll=1):
                cons.advance()
                release.advance()
        return cons, release

    @cute.jit
    def store_acc(self, tidx, warp_idx, tiled_mma, acc, s_c, tma_c, g_c, store_pipe, group=None, first_buf=0):
        """The accumulators -> out dtype -> shared memory -> global memory (TMA store or reduce-add).

        A tile stores a multiple of epi_stage subtiles, so each tile starts again at buffer 0 of
        the round robin (``first_buf`` with ping-pong: the warpgroup's buffers; ``group``: its
        barrier, threads and store warp, see ``epilogue_sync``).
        """
        tiled_r2s, t_sd, t_acc, rd_layout = self.epilogue_views(tiled_mma, tidx, s_c, acc)
        r_d = cute.make_rmem_tensor_like(rd_layout, cutlass.Float32)
        _, epi_count, _ = self.epi_order(g_c)
        for epi in cutlass.range_constexpr(epi_count):
            for i in cutlass.range_constexpr(cute.size(rd_layout)):
                r_d[i] = t_acc[self.acc_index(rd_layout, epi, i)]
            self.store_fragment(
                r_d.load(), tiled_r2s, t_sd, s_c, tma_c, g_c, epi, first_buf + epi % self.epi_stage, warp_idx, store_pipe, rd_layout, group
            )

    @cute.jit
    def store_acc_at_once(self, tidx, warp_idx, tiled_mma, acc, s_c, tma_c, g_c):
        """:meth:`store_acc` with every subtile of the tile staged before one barrier, their TMA
        stores then issued together (needs the tile's subtiles <= epi_stage): two barriers a tile
        instead of two a subtile, and no wait for a store's read within it; the buffers' previous
        stores are waited for (read) first, a tile later than they were issued. The same values
        stored: the same bits."""
        tiled_r2s, t_sd, t_acc, rd_layout = self.epilogue_views(tiled_mma, tidx, s_c, acc)
        _, epi_count, _ = self.epi_order(g_c)
        if warp_idx == self.store_warp:
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        self.epilogue_sync()
        for epi in cutlass.range_constexpr(epi_count):
            r_d = cute.make_rmem_tensor_like(rd_layout, cutlass.Float32)
            for i in cutlass.range_constexpr(cute.size(rd_layout)):
                r_d[i] = t_acc[self.acc_index(rd_layout, epi, i)]
            self.stage_subtile(r_d.load(), tiled_r2s, t_sd, epi, rd_layout)
        cute.arch.fence_proxy("async.shared", space="cta")
        self.epilogue_sync()
        if warp_idx == self.store_warp:
            for epi in cutlass.range_constexpr(epi_count):
                self.issue_subtile_store(tma_c, s_c, g_c, epi, epi)
            cute.arch.cp_async_bulk_commit_group()

    @staticmethod
    def acc_index(rd_layout, epi: int, i: int):
        """Where value ``i`` of epilogue subtile ``epi`` (columns 32·epi.., every row of the tile)
        sits in the accumulator retiled for the epilogue (``epilogue_views``).

        rd_layout is (values, 64-row blocks, column groups) and the retiled accumulator (values of
        a row block across all columns, 64-row blocks, 1). With one row block (two warpgroups of
        64 rows) that is the flat index epi·size(rd) + i; with two (one warpgroup holding 128 rows,
        ping-pong) the blocks interleave, so the index is by coordinate.
        """
        per_group, row_blocks, col_groups = (cute.size(rd_layout, mode=[m]) for m in range(3))
        v, rest = i % per_group, i // per_group
        m, n = rest % row_blocks, rest // row_blocks
        return (v + per_group * (n + col_groups * epi), m, 0)

    def epilogue_sync(self, group=None):
        """Barrier over the threads that run the epilogue: barrier 1 over every MMA thread (the
        producer warpgroup of a persistent kernel stays out), or ``group`` = (barrier id, threads,
        store warp) of one MMA warpgroup when each warpgroup runs its own tiles (ping-pong)."""
        barrier_id, threads = (1, self.consumer_threads) if group is None else group[:2]
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)

    def shared_buffers(self, storage, a_smem, b_smem, epi_smem, dedicated_epi: bool):
        """The A, B and epilogue tensors in shared memory; the epilogue's either has its own
        buffer (persistent kernels) or reuses A's stages (one tile per CTA)."""
        s_a = storage.s_a.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        s_b = storage.s_b.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        if dedicated_epi:
            s_c = storage.s_c.get_tensor(epi_smem.outer, swizzle=epi_smem.inner)
        else:
            s_c = cute.make_tensor(cute.recast_ptr(s_a.iterator, epi_smem.inner, dtype=self.c_dtype), epi_smem.outer)
        return s_a, s_b, s_c

    def make_pipeline(self, storage, num_b: int, a_smem, b_smem, gather_threads: int = 0, barriers=None, consumer_warps=None,
                      extra_tx_bytes: int = 0, cluster_m: int = 1):
        """The producer / consumer (all MMA warps, or ``consumer_warps``) pipeline over ``ab_stage`` stages.

        A stage is full once its TMA bytes landed (one thread arms the count; ``extra_tx_bytes``:
        what else its loads bring, e.g. block scales) and, when ``gather_threads`` threads cp.async
        A's rows instead, once each of them arrived; it is free again once every consuming warp
        released it: with ``cluster_m`` = 2 every consuming warp of both CTAs of the cluster, since
        either CTA's loads may write both CTAs' stages (a warp's lanes 0 and 1 arrive on CTA 0's and
        CTA 1's barrier). ``barriers``: where its mbarriers live (default: ``storage.mbar``).
        """
        a_stage = cute.slice_(a_smem, (None, None, 0))
        b_stage = cute.slice_(b_smem, (None, None, 0))
        tx_bytes = num_b * cute.size_in_bytes(self.ab_dtype, b_stage) + extra_tx_bytes
        if gather_threads == 0:
            tx_bytes += cute.size_in_bytes(self.ab_dtype, a_stage)
        consumers = self.consumer_threads // 32 if consumer_warps is None else consumer_warps
        return pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar.data_ptr() if barriers is None else barriers,
            num_stages=self.ab_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1 + gather_threads),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumers * cluster_m),
            tx_count=tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, cluster_m, 1, 1)),
            defer_sync=True,
        )

    def launch_tiles(self, args: tuple, all_tiles, max_ctas, stream, cluster_m: int = 1) -> None:
        """Host side: the persistent kernel (``kernel_persistent``) on min(all_tiles, max_ctas)
        CTAs (at least one), or one CTA per output tile (``kernel``), with ``args``. With
        ``cluster_m`` = 2 ``all_tiles`` counts the clusters' tiles: clusters of two CTAs, one per
        SM, min(all_tiles, max_ctas / 2) of them. The shared storage (``shared_storage``, its
        alignment padding included) must fit an SM's 227 KB: checked here, at compile time."""
        used = self.shared_storage.size_in_bytes()
        if used > SMEM_BYTES:
            raise ValueError(f"shared memory: this kernel's storage takes {used} bytes, more than the {SMEM_BYTES} an SM has "
                             f"({self.ab_stage} stages, {self.epi_stage} epilogue buffers)")
        if self.persistent:
            if cutlass.const_expr(cluster_m > 1):
                clusters = cutlass.max(cutlass.min(all_tiles, max_ctas // cluster_m), 1)
                self.kernel_persistent(*args).launch(grid=[clusters * cluster_m, 1, 1], block=[self.threads, 1, 1],
                                                     cluster=[cluster_m, 1, 1], stream=stream)
            else:
                grid = cutlass.max(cutlass.min(all_tiles, max_ctas), 1)
                self.kernel_persistent(*args).launch(grid=[grid, 1, 1], block=[self.threads, 1, 1], stream=stream)
        else:
            self.kernel(*args).launch(grid=[all_tiles, 1, 1], block=[self.threads, 1, 1], stream=stream)

    def grouped_tile(self, linear: cutlass.Int32, num_row_tiles: cutlass.Int32, col_tiles: cutlass.Constexpr):
        """CTA -> (row tile, column tile), grouped for L2 reuse (mok/kernels/common/tile_order.py)."""
        return grouped_tile(linear, num_row_tiles, col_tiles)

    @cute.jit
    def mainloop(self, ab_pipe, tiled_mma, acc, acc2, r_a, r_b, r_b2, k_tiles, warp_idx, loads):
        """acc (+)= A·Bᵀ over ``k_tiles`` K tiles (acc2 with B2 when two accumulators are used).

        ``loads`` is handed to the subclass's ``load_stage``, which warp 0 calls once per K tile.
        """
        prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)
        cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
        if warp_idx == 0:  # fill the pipeline
            for _ in cutlass.range(cutlass.min(self.ab_stage, k_tiles), unroll=1):
                self.load_stage(ab_pipe, prod, loads)
                prod.advance()

        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)  # onto the zeroed accumulators
        for k_tile in cutlass.range(k_tiles, unroll=1):
            ab_pipe.consumer_wait(cons)
            self.mma_stage(tiled_mma, acc, acc2, r_a, r_b, r_b2, cons.index)
            cons.advance()
            # Keep this stage's WGMMAs in flight; once the previous stage's are done,
            # free its buffers and refill them with the next k tile.
            if k_tile > 0:
                cute.nvgpu.warpgroup.wait_group(1)
                ab_pipe.consumer_release(release)
                release.advance()
                if warp_idx == 0 and prod.count < k_tiles:
                    self.load_stage(ab_pipe, prod, loads)
                    prod.advance()
        cute.nvgpu.warpgroup.wait_group(0)

    @cute.jit
    def mma_stage(self, tiled_mma, acc, acc2, r_a, r_b, r_b2, stage, overwrite: cutlass.Constexpr = False,
                  one_product: cutlass.Constexpr = False, b_stage_step: cutlass.Constexpr[int] = 1):
        """Issue one shared-memory stage's WGMMAs (its k blocks) as one commit group. ``overwrite``:
        the first k block's WGMMAs replace acc (and acc2) instead of adding to them (scale-d 0), so
        that a per-stage accumulator needs no zeroing; the ACCUMULATE field is set again after it.
        ``one_product``: acc only, also where there are two accumulators (their B tiles stacked: one
        WGMMA covers both). ``b_stage_step``: B's views count that many stages to the pipeline's one
        (a half-width B tile in the first half of a stage's buffer: the grouped GEMM's tail split)."""
        cute.nvgpu.warpgroup.fence()
        for kb in cutlass.range(cute.size(r_a, mode=[2]), unroll_full=True):
            if cutlass.const_expr(overwrite):
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, kb > 0)
            blk = (None, None, kb, stage)
            b_blk = (None, None, kb, stage * b_stage_step)
            cute.gemm(tiled_mma, acc, r_a[blk], r_b[b_blk], acc)
            if cutlass.const_expr(self.two_accumulators and not one_product):
                cute.gemm(tiled_mma, acc2, r_a[blk], r_b2[b_blk], acc2)
        cute.nvgpu.warpgroup.commit_group()

    @cute.jit
    def produce_tile(self, ab_pipe, prod, loads, k_tiles, *stage_args):
        """Persistent producer: TMA-load one tile's ``k_tiles`` stages (``stage_args``: what else the
        subclass's load_stage takes); returns the advanced state."""
        prod.reset_count()  # load_stage reads the tile's k index from the count
        for _ in cutlass.range(k_tiles, unroll=1):
            self.load_stage(ab_pipe, prod, loads, *stage_args)
            prod.advance()
        return prod

    @cute.jit
    def consume_tile(self, ab_pipe, tiled_mma, acc, acc2, r_a, r_b, r_b2, k_tiles, cons, release, b_stage_step: cutlass.Constexpr[int] = 1):
        """Persistent consumer: acc (+)= one tile's product over ``k_tiles`` stages, every stage
        handed back once its WGMMAs retired; returns the advanced (read, release) states.
        The caller zeroes acc and sets the MMA's ACCUMULATE field once, outside its tile loop.
        ``b_stage_step``: see :meth:`mma_stage`."""
        cons, release = self.issue_tile(ab_pipe, tiled_mma, acc, acc2, r_a, r_b, r_b2, k_tiles, cons, release, b_stage_step)
        return cons, self.retire_tile(ab_pipe, k_tiles, release)

    @cute.jit
    def issue_tile(self, ab_pipe, tiled_mma, acc, acc2, r_a, r_b, r_b2, k_tiles, cons, release, b_stage_step: cutlass.Constexpr[int] = 1):
        """:meth:`consume_tile` up to its last stage's WGMMAs issued (one group may still run);
        :meth:`retire_tile` waits for it. Ping-pong hands the tensor cores over in between.
        ``b_stage_step``: see :meth:`mma_stage`."""
        for k_tile in cutlass.range(k_tiles, unroll=1):
            self.wait_stage(ab_pipe, cons)
            self.mma_stage(tiled_mma, acc, acc2, r_a, r_b, r_b2, cons.index, b_stage_step=b_stage_step)
            cons.advance()
            if k_tile > 0:  # the previous stage's WGMMAs are done: hand its buffers back
                cute.nvgpu.warpgroup.wait_group(1)
                ab_pipe.consumer_release(release)
                release.advance()
        return cons, release

    @cute.jit
    def wait_stage(self, ab_pipe, cons):
        """Wait for stage ``cons`` to land (with ``gather_a``, A came through the generic proxy by
        cp.async, and the WGMMAs read it through the async one: a proxy fence)."""
        ab_pipe.consumer_wait(cons)
        if cutlass.const_expr(self.gather_a):
            cute.arch.fence_proxy("async.shared", space="cta")

    @cute.jit
    def retire_tile(self, ab_pipe, k_tiles, release):
        """Wait for a tile's last WGMMAs and hand its last stage back; returns the release state."""
        cute.nvgpu.warpgroup.wait_group(0)
        if k_tiles > 0:  # the tile's last stage
            ab_pipe.consumer_release(release)
            release.advance()
        return release

    def epilogue_threads(self, tiled_mma):
        """Which thread moves which accumulator values between registers and an epilogue buffer:
        stmatrix's tiling over the MMA's accumulator (the stores', and the loads' that read a
        buffer back in the same layout)."""
        stmatrix = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(self.c_layout.is_m_major_c(), 4), self.c_dtype)
        return cute.make_tiled_copy_C_atom(stmatrix, tiled_mma)

    def r2s_copy(self, tiled_mma, tidx):
        """Registers -> epilogue smem copy (stmatrix layout for 16-bit outputs) and its thread slice."""
        r2s_atom = sm90_utils.sm90_get_smem_store_op(self.c_layout, elem_ty_d=self.c_dtype, elem_ty_acc=cutlass.Float32)
        tiled_r2s = cute.make_tiled_copy_S(r2s_atom, self.epilogue_threads(tiled_mma))
        return tiled_r2s, tiled_r2s.get_slice(tidx)

    def epilogue_views(self, tiled_mma, tidx, s_c, acc):
        """What every epilogue starts from: the register -> smem copy, this thread's smem
        destinations, ``acc`` retiled to that copy, and one subtile's register layout."""
        tiled_r2s, thr_r2s = self.r2s_copy(tiled_mma, tidx)
        t_sd = thr_r2s.partition_D(s_c)
        return tiled_r2s, t_sd, tiled_r2s.retile(acc), self.epi_layout(thr_r2s, s_c)

    def epi_layout(self, thr_r2s, s_c):
        """Register layout of one epilogue subtile's values held by a thread."""
        return cute.make_layout(cute.shape(thr_r2s.partition_S(s_c))[:3])

    def epi_order(self, g_tile):
        """Epilogue subtiles of a CTA tile and the row-major order in which they are stored."""
        g_epi = cute.zipped_divide(g_tile, self.epi_tile)
        shape = g_epi.shape[1]
        return g_epi, cute.size(g_epi, mode=[1]), cute.make_layout(shape, stride=(shape[1], 1))

    @cute.jit
    def store_fragment(self, values, tiled_r2s, t_sd, s_c, tma, g_tile, epi, buf, warp_idx, store_pipe, rd_layout, group=None):
        """Store one epilogue subtile ``epi`` of ``values`` (SSA, fp32 or already the output dtype)
        into ``g_tile`` via smem buffer ``buf``; ``group``: see :meth:`epilogue_sync` (its store
        warp issues the TMA store)."""
        store_warp = self.store_warp if group is None else group[2]
        self.stage_subtile(values, tiled_r2s, t_sd, buf, rd_layout)
        cute.arch.fence_proxy("async.shared", space="cta")
        self.epilogue_sync(group)
        if warp_idx == store_warp:
            self.issue_subtile_store(tma, s_c, g_tile, epi, buf)
            store_pipe.producer_commit()
            store_pipe.producer_acquire()
        self.epilogue_sync(group)

    @cute.jit
    def stage_subtile(self, values, tiled_r2s, t_sd, buf, rd_layout):
        """One epilogue subtile's ``values`` (SSA, fp32 or already the output dtype) in the output
        dtype into shared-memory buffer ``buf`` (stmatrix)."""
        r_out = cute.make_rmem_tensor_like(rd_layout, self.c_dtype)
        r_out.store(values.to(self.c_dtype))
        cute.copy(tiled_r2s, r_out, t_sd[(None, None, None, buf)])

    @cute.jit
    def issue_subtile_store(self, tma, s_c, g_tile, epi, buf):
        """The store warp: TMA-store shared-memory buffer ``buf`` to subtile ``epi`` of ``g_tile``."""
        g_epi, _, order = self.epi_order(g_tile)
        b_sd, b_gd = cute.nvgpu.cpasync.tma_partition(tma, 0, cute.make_layout(1), cute.group_modes(s_c, 0, 2), g_epi)
        cute.copy(tma, b_sd[(None, buf)], b_gd[(None, order.get_hier_coord(epi))])

    def store_pipeline(self, threads=None):
        """The epilogue's TMA-store pipeline over its ``epi_stage`` buffers (all MMA threads, or ``threads``)."""
        return pipeline.PipelineTmaStore.create(
            num_stages=self.epi_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.consumer_threads if threads is None else threads),
        )
