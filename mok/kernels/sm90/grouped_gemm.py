"""Expert-grouped GEMM for Hopper: WGMMA with a TMA-fed multistage shared-memory pipeline.

    C[rows of tile m, :] = epilogue(A[rows of tile m, :] · B[e(m)]ᵀ)

A [R, K] holds rows grouped by expert (the schedule pads each expert's rows to a whole
``tile_m`` tile, so a tile never mixes experts); ``tile_expert[m]`` names the expert of row
tile m, or -1 for an unused tile, which the CTA skips. B [E, N, K] holds one K-major weight
matrix per expert; the CTA's TMA loads read the slice of its tile's expert. C [R, N] bf16.

Epilogues (static): ``swiglu`` computes two products with the same A tile, gate (B) and up
(B2), and writes a = silu(gate)·up; otherwise C = A·Bᵀ. Both round once from fp32 to bf16.

Determinism and batch invariance: each output tile is owned by one CTA, K is reduced in
one fixed order by the WGMMA sequence, and the tile shape comes from (N, K) only, so a
row's result depends on nothing but that row and its expert's weights.

One CTA per (row tile, column tile), launched in L2-friendly groups; two consumer warpgroups of 64 rows each; warp 0 also
issues the TMA loads (the structure of CUTLASS's Hopper dense GEMM example). Persistence,
warp specialisation and fusion with the gather and the down projection come next.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.tensor_utils import LayoutEnum

TILE_K = 64  # bf16: four 16-deep WGMMA k-blocks per shared-memory stage
ROW_GROUP = 8  # row tiles per CTA group in the launch order (see tile_of)
SMEM_BYTES = 227 * 1024


class GroupedGemmSm90:
    """Static config: N, K, epilogue kind, tile (M, N). Runtime: pointers, row count R, E."""

    def __init__(self, n: int, k: int, swiglu: bool, tile_m: int = 128, tile_n: int = 128, stages: int | None = None) -> None:
        if n % tile_n:
            raise ValueError(f"n: expected a multiple of the column tile {tile_n}, got {n}")
        if k % TILE_K:
            raise ValueError(f"k: expected a multiple of {TILE_K}, got {k}")
        if tile_m != 128 or tile_n not in (64, 128, 256):
            raise ValueError(f"tile: expected (128, 64|128|256), got ({tile_m}, {tile_n})")
        self.n, self.k, self.swiglu = n, k, swiglu
        self.tile_shape_mnk = (tile_m, tile_n, TILE_K)
        self.atom_layout_mnk = (2, 1, 1)  # two consumer warpgroups, 64 rows each
        self.threads = 256
        self.num_b = 2 if swiglu else 1
        stage_bytes = (tile_m * TILE_K + self.num_b * tile_n * TILE_K) * 2
        most = min((SMEM_BYTES - 1024) // stage_bytes, 8)
        if stages is not None and not 2 <= stages <= most:
            raise ValueError(f"stages: expected 2..{most} for this tile, got {stages}")
        self.ab_stage = most if stages is None else stages  # fewer stages: two CTAs per SM
        self.epi_stage = 4
        self.buffer_align_bytes = 1024

    @cute.jit
    def __call__(
        self,
        a_ptr: cute.Pointer,
        b_ptr: cute.Pointer,
        b2_ptr: cute.Pointer,
        c_ptr: cute.Pointer,
        tile_expert_ptr: cute.Pointer,
        num_rows: cutlass.Int32,
        num_experts: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        n, k = self.n, self.k
        tile_m, tile_n, _ = self.tile_shape_mnk
        m_a = cute.make_tensor(a_ptr, cute.make_layout((num_rows, k, 1), stride=(k, 1, num_rows * k)))
        m_b = cute.make_tensor(b_ptr, cute.make_layout((n, k, num_experts), stride=(k, 1, n * k)))
        m_b2 = cute.make_tensor(b2_ptr, cute.make_layout((n, k, num_experts), stride=(k, 1, n * k)))
        m_c = cute.make_tensor(c_ptr, cute.make_layout((num_rows, n, 1), stride=(n, 1, num_rows * n)))
        num_tiles = (num_rows + tile_m - 1) // tile_m  # a partial last tile: TMA zero-fills and clips
        m_tiles = cute.make_tensor(tile_expert_ptr, cute.make_layout((num_tiles,)))

        ab_dtype = m_a.element_type
        self.ab_dtype = ab_dtype
        self.c_dtype = m_c.element_type
        self.c_layout = LayoutEnum.from_tensor(m_c)
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            ab_dtype,
            ab_dtype,
            LayoutEnum.from_tensor(m_a).sm90_mma_major_mode(),
            LayoutEnum.from_tensor(m_b).sm90_mma_major_mode(),
            cutlass.Float32,
            self.atom_layout_mnk,
            tiler_mn=(64, tile_n),
        )
        self.epi_tile = sm90_utils.compute_tile_shape_or_override(self.tile_shape_mnk, self.c_dtype, is_cooperative=True)
        a_smem = sm90_utils.make_smem_layout_a(LayoutEnum.from_tensor(m_a), self.tile_shape_mnk, ab_dtype, self.ab_stage)
        b_smem = sm90_utils.make_smem_layout_b(LayoutEnum.from_tensor(m_b), self.tile_shape_mnk, ab_dtype, self.ab_stage)
        epi_smem = sm90_utils.make_smem_layout_epi(self.c_dtype, self.c_layout, self.epi_tile, self.epi_stage)

        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        tma_a, t_a = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, m_a, cute.slice_(a_smem, (None, None, 0)), (tile_m, TILE_K))
        tma_b, t_b = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, m_b, cute.slice_(b_smem, (None, None, 0)), (tile_n, TILE_K))
        tma_b2, t_b2 = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, m_b2, cute.slice_(b_smem, (None, None, 0)), (tile_n, TILE_K))
        tma_c, t_c = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), m_c, cute.slice_(epi_smem, (None, None, 0)), self.epi_tile
        )

        b2_elems = cute.cosize(b_smem) if self.swiglu else 8  # no second B without SwiGLU

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, self.ab_stage * 2]
            s_a: cute.struct.Align[cute.struct.MemRange[ab_dtype, cute.cosize(a_smem)], self.buffer_align_bytes]
            s_b: cute.struct.Align[cute.struct.MemRange[ab_dtype, cute.cosize(b_smem)], self.buffer_align_bytes]
            s_b2: cute.struct.Align[cute.struct.MemRange[ab_dtype, b2_elems], self.buffer_align_bytes]

        self.shared_storage = SharedStorage
        self.kernel(tma_a, t_a, tma_b, t_b, tma_b2, t_b2, tma_c, t_c, m_tiles, num_tiles, self.tiled_mma, a_smem, b_smem, epi_smem).launch(
            grid=[num_tiles * (n // tile_n), 1, 1],
            block=[self.threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        m_a: cute.Tensor,
        tma_b: cute.CopyAtom,
        m_b: cute.Tensor,
        tma_b2: cute.CopyAtom,
        m_b2: cute.Tensor,
        tma_c: cute.CopyAtom,
        m_c: cute.Tensor,
        m_tiles: cute.Tensor,
        num_row_tiles: cutlass.Int32,
        tiled_mma: cute.TiledMma,
        a_smem: cute.ComposedLayout,
        b_smem: cute.ComposedLayout,
        epi_smem: cute.ComposedLayout,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        linear, _, _ = cute.arch.block_idx()
        tile_row, tile_col = self.tile_of(linear, num_row_tiles)
        expert = m_tiles[tile_row]
        if expert >= 0:
            if warp_idx == 0:
                cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
                cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
                if cutlass.const_expr(self.swiglu):
                    cute.nvgpu.cpasync.prefetch_descriptor(tma_b2)

            smem = cutlass.memory.SmemAllocator()
            storage = smem.allocate(self.shared_storage)
            a_stage = cute.slice_(a_smem, (None, None, 0))
            b_stage = cute.slice_(b_smem, (None, None, 0))
            tx_bytes = cute.size_in_bytes(self.ab_dtype, a_stage) + self.num_b * cute.size_in_bytes(self.ab_dtype, b_stage)
            ab_pipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar.data_ptr(),
                num_stages=self.ab_stage,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.threads // 32),
                tx_count=tx_bytes,
                cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
                defer_sync=True,
            )
            pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

            s_a = storage.s_a.get_tensor(a_smem.outer, swizzle=a_smem.inner)
            s_b = storage.s_b.get_tensor(b_smem.outer, swizzle=b_smem.inner)
            s_b2 = s_b  # stands in where there is no second B
            if cutlass.const_expr(self.swiglu):
                s_b2 = storage.s_b2.get_tensor(b_smem.outer, swizzle=b_smem.inner)
            s_c = cute.make_tensor(cute.recast_ptr(s_a.iterator, epi_smem.inner, dtype=self.c_dtype), epi_smem.outer)

            coord = (tile_row, tile_col, None, 0)
            g_a = cute.local_tile(m_a, self.tile_shape_mnk, coord, proj=(1, None, 1))  # (bM, bK, k tiles)
            g_b = cute.local_tile(m_b, self.tile_shape_mnk, (tile_row, tile_col, None, expert), proj=(None, 1, 1))
            g_b2 = cute.local_tile(m_b2, self.tile_shape_mnk, (tile_row, tile_col, None, expert), proj=(None, 1, 1))
            g_c = cute.local_tile(m_c, self.tile_shape_mnk, coord, proj=(1, 1, None))  # (bM, bN)

            one = cute.make_layout(1)
            t_as, t_ag = cute.nvgpu.cpasync.tma_partition(tma_a, 0, one, cute.group_modes(s_a, 0, 2), cute.group_modes(g_a, 0, 2))
            t_bs, t_bg = cute.nvgpu.cpasync.tma_partition(tma_b, 0, one, cute.group_modes(s_b, 0, 2), cute.group_modes(g_b, 0, 2))
            t_b2s, t_b2g = cute.nvgpu.cpasync.tma_partition(tma_b2, 0, one, cute.group_modes(s_b2, 0, 2), cute.group_modes(g_b2, 0, 2))

            warp_group = cute.arch.make_warp_uniform(tidx // 128)
            thr_mma = tiled_mma.get_slice(cute.make_layout(2, stride=128)(warp_group))
            t_cg = thr_mma.partition_C(g_c)
            r_a = tiled_mma.make_fragment_A(thr_mma.partition_A(s_a))
            r_b = tiled_mma.make_fragment_B(thr_mma.partition_B(s_b))
            r_b2 = tiled_mma.make_fragment_B(thr_mma.partition_B(s_b2))
            acc = cute.make_rmem_tensor(t_cg.shape, cutlass.Float32)
            acc2 = cute.make_rmem_tensor(t_cg.shape, cutlass.Float32)
            acc.fill(0.0)
            if cutlass.const_expr(self.swiglu):
                acc2.fill(0.0)

            pipeline_init_wait(cluster_shape_mn=(1, 1))

            k_tiles = cute.size(g_a, mode=[2])
            prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)
            cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
            release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)

            # Fill the pipeline.
            if warp_idx == 0:
                for _ in cutlass.range(cutlass.min(self.ab_stage, k_tiles), unroll=1):
                    self.load_stage(ab_pipe, prod, tma_a, t_ag, t_as, tma_b, t_bg, t_bs, tma_b2, t_b2g, t_b2s)
                    prod.advance()

            k_blocks = cute.size(r_a, mode=[2])
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)  # onto the zeroed accumulators
            for k_tile in cutlass.range(k_tiles, unroll=1):
                ab_pipe.consumer_wait(cons)
                cute.nvgpu.warpgroup.fence()
                for kb in cutlass.range(k_blocks, unroll_full=True):
                    blk = (None, None, kb, cons.index)
                    cute.gemm(tiled_mma, acc, r_a[blk], r_b[blk], acc)
                    if cutlass.const_expr(self.swiglu):
                        cute.gemm(tiled_mma, acc2, r_a[blk], r_b2[blk], acc2)
                cute.nvgpu.warpgroup.commit_group()
                cons.advance()
                # Keep this stage's WGMMAs in flight; once the previous stage's are done,
                # free its buffers and refill them with the next k tile.
                if k_tile > 0:
                    cute.nvgpu.warpgroup.wait_group(1)
                    ab_pipe.consumer_release(release)
                    release.advance()
                    if warp_idx == 0 and prod.count < k_tiles:
                        self.load_stage(ab_pipe, prod, tma_a, t_ag, t_as, tma_b, t_bg, t_bs, tma_b2, t_b2g, t_b2s)
                        prod.advance()
            cute.nvgpu.warpgroup.wait_group(0)
            cute.arch.sync_threads()  # the epilogue reuses A's shared memory

            self.epilogue(tidx, warp_idx, tiled_mma, acc, acc2, s_c, g_c, tma_c)

    @cute.jit
    def tile_of(self, linear: cutlass.Int32, num_row_tiles: cutlass.Int32):
        """CTA -> (row tile, column tile), grouped for L2 reuse.

        CTAs run in groups of ROW_GROUP row tiles; inside a group the row tile varies fastest,
        then the column tile. The CTAs in flight then share a few A row tiles (read from HBM
        once, then from L2 for every column tile) and the B tiles of one or two experts
        (each read by the group's row tiles at about the same time), instead of sweeping all
        of A once per column tile.
        """
        col_tiles = self.n // self.tile_shape_mnk[1]
        group = linear // (ROW_GROUP * col_tiles)
        first_row = group * ROW_GROUP
        rows_here = cutlass.min(ROW_GROUP, num_row_tiles - first_row)  # the last group may be short
        within = linear - group * ROW_GROUP * col_tiles
        return first_row + within % rows_here, within // rows_here

    @cute.jit
    def load_stage(self, ab_pipe, prod, tma_a, t_ag, t_as, tma_b, t_bg, t_bs, tma_b2, t_b2g, t_b2s):
        """Warp 0: wait for a free stage, then TMA-load the next A tile and B tile(s) into it."""
        ab_pipe.producer_acquire(prod)
        bar = ab_pipe.producer_get_barrier(prod)
        cute.copy(tma_a, t_ag[(None, prod.count)], t_as[(None, prod.index)], tma_bar_ptr=bar)
        cute.copy(tma_b, t_bg[(None, prod.count)], t_bs[(None, prod.index)], tma_bar_ptr=bar)
        if cutlass.const_expr(self.swiglu):
            cute.copy(tma_b2, t_b2g[(None, prod.count)], t_b2s[(None, prod.index)], tma_bar_ptr=bar)
        ab_pipe.producer_commit(prod)

    @cute.jit
    def epilogue(self, tidx, warp_idx, tiled_mma, acc, acc2, s_c, g_c, tma_c):
        """Registers -> (SwiGLU) -> bf16 -> shared memory (stmatrix) -> global memory (TMA store)."""
        r2s_atom = sm90_utils.sm90_get_smem_store_op(self.c_layout, elem_ty_d=self.c_dtype, elem_ty_acc=cutlass.Float32)
        stmatrix = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(self.c_layout.is_m_major_c(), 4), self.c_dtype)
        tiled_r2s = cute.make_tiled_copy_S(r2s_atom, cute.make_tiled_copy_C_atom(stmatrix, tiled_mma))
        thr_r2s = tiled_r2s.get_slice(tidx)
        t_sd = thr_r2s.partition_D(s_c)
        t_acc = tiled_r2s.retile(acc)
        t_acc2 = tiled_r2s.retile(acc2)
        rd_layout = cute.make_layout(cute.shape(thr_r2s.partition_S(s_c))[:3])
        r_d = cute.make_rmem_tensor_like(rd_layout, cutlass.Float32)
        r_u = cute.make_rmem_tensor_like(rd_layout, cutlass.Float32)
        per_epi = cute.size(r_d)

        g_c_epi = cute.zipped_divide(g_c, self.epi_tile)
        b_sd, b_gd = cute.nvgpu.cpasync.tma_partition(tma_c, 0, cute.make_layout(1), cute.group_modes(s_c, 0, 2), g_c_epi)
        epi_count = cute.size(g_c_epi, mode=[1])
        epi_shape = g_c_epi.shape[1]
        epi_order = cute.make_layout(epi_shape, stride=(epi_shape[1], 1))
        store_pipe = pipeline.PipelineTmaStore.create(
            num_stages=self.epi_stage, producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.threads)
        )
        for epi in cutlass.range_constexpr(epi_count):
            for v in cutlass.range_constexpr(per_epi):
                r_d[v] = t_acc[epi * per_epi + v]
                if cutlass.const_expr(self.swiglu):
                    r_u[v] = t_acc2[epi * per_epi + v]
            values = r_d.load()
            if cutlass.const_expr(self.swiglu):
                gate = values
                values = gate / (1.0 + cute.math.exp(-gate, fastmath=True)) * r_u.load()
            r_out = cute.make_rmem_tensor_like(rd_layout, self.c_dtype)
            r_out.store(values.to(self.c_dtype))
            buf = epi % self.epi_stage
            cute.copy(tiled_r2s, r_out, t_sd[(None, None, None, buf)])
            cute.arch.fence_proxy("async.shared", space="cta")
            pipeline.sync(barrier_id=1)
            if warp_idx == 0:
                cute.copy(tma_c, b_sd[(None, buf)], b_gd[(None, epi_order.get_hier_coord(epi))])
                store_pipe.producer_commit()
                store_pipe.producer_acquire()
            pipeline.sync(barrier_id=1)
        if warp_idx == 0:
            store_pipe.producer_tail()


def compile_grouped_gemm(n: int, k: int, swiglu: bool, arch: str, options: str = "", tile_n: int = 128, stages: int | None = None):
    """Compile for ``arch`` without tensors: pointers, the row count R and E are runtime arguments."""
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    gmem = cute.AddressSpace.gmem
    bf16 = cutlass.BFloat16
    args = (
        make_ptr(bf16, 0, gmem, assumed_align=16),
        make_ptr(bf16, 0, gmem, assumed_align=16),
        make_ptr(bf16, 0, gmem, assumed_align=16),
        make_ptr(bf16, 0, gmem, assumed_align=16),
        make_ptr(cutlass.Int32, 0, gmem, assumed_align=4),
        cutlass.Int32(128),
        cutlass.Int32(1),
        make_fake_stream(),
    )
    return cute.compile(GroupedGemmSm90(n, k, swiglu, tile_n=tile_n, stages=stages), *args, options=f"--gpu-arch {arch} {options}".strip())
