"""The routed experts' whole forward in one persistent launch on Hopper: the schedule, fc1 (gathered
rows, SwiGLU), fc2, the combine. The phases, their synchronisation and what every arch shares:
mok/kernels/common/expert_mlp.py; here the WGMMA kernel.

The two grouped GEMMs of mok/kernels/sm90/grouped_gemm.py (the gathering SwiGLU one and the
down projection) share one persistent, warp-specialised CTA per SM. Tiles are handed out in
one global order, fc1's first, then fc2's (each phase in its L2-friendly grouped order, over
the row tiles the schedule uses): the producer's TMA thread takes the next index from a
counter (an integer atomic) and passes it to its warps and, through a small shared-memory
ring, to the MMA warps. So tiles run in that order whatever each CTA's speed: the fc2 tiles
start on SMs that fc1's tail leaves idle, yet the tiles in flight stay together (a static
round robin let CTAs enter fc2 up to a tile apart, and that skew spread the fc2 tiles in
flight over several experts' w_down, 29 MB each at dsv3, which then no longer stayed in L2;
docs/notes/one-launch.md). The store warp publishes an fc1 tile's row tile once the next fc1
tile's mainloop is done, by which time its TMA stores have drained (and before its first fc2
tile at the latest); the TMA thread waits for an fc2 tile's a rows, then fences (proxy) before
its TMA loads of a. An index is taken only after the previous tile's loads are all issued, so a
CTA waiting before an fc2 tile still finishes (and publishes) every fc1 tile it took, and every
fc1 tile is taken before any fc2 tile. At EP, fc2's MMA warps hand each finished subtile to the
producer warpgroup's warps 1-3 (idle after fc1), which push its rows into the tokens' slots on
their ranks (tile indices from warp 0 through a second ring). The MMA warps combine (after the
warp roles join, the producer's 40-register bound would bound the combine).

The operand stages of the two phases share one region of shared memory: fc1 holds A,
B = w_gate and B2 = w_up per stage (48 KB, 4 stages), fc2 A = a and B = w_down in the tile
and depth the down projection has on its own (256 columns: 48 KB, 4 stages; 128: 32 KB, 6),
each phase with its own mbarrier pipeline; the producer starts the fc2 pipeline once every
fc1 stage has been consumed.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.tensor_utils import LayoutEnum

from ..common import ep_phases
from ..common.compile import compile_kernel
from ..common.expert_mlp import TILE, ExpertMlp, MlpTensors
from ..common.records import EXPERT_MLP_ARGS
from ..common.waits import grid_barrier
from .grouped_gemm import SCATTER_THREADS, GroupedGemmSm90
from .wgmma_tile import TILE_K

RING = 4  # tile indices the producer may hand the MMA warps ahead
TILE_BARRIER = 3  # named barrier of the producer warpgroup (1: the MMA warps' epilogue, 2: scatter warps)


class ExpertMlpSm90(ExpertMlp):
    """Static config: H, I, top-k, whether h is saved for the backward, whether the combine adds a shared
    expert's output, fc2's column tile, E, and the expert-parallel options."""

    def __init__(
        self, hidden: int, inter: int, topk: int, *, save_h: bool = False, has_shared: bool = False, fc2_tile_n: int = TILE,
        num_experts: int, ep_world: int | None = None, shared_prefix: bool = False, dispatch_format: str = "bf16",
        gate_up_stride: int | None = None, gate_up_row_stride: int | None = None, activation: str = "swiglu", bias: bool = False,
    ):
        """``fc2_tile_n``: fc2's column tile (128, or 256 as the down projection takes on its own where H allows).
        ``num_experts``: E, the experts (of this rank) the schedule is built over; the launch's E must be it.
        ``ep_world``: the expert-parallel forward of one rank of W in this one launch (see "Expert
        parallelism" in the module docstring; its phases: common/ep_phases.py).
        ``shared_prefix`` (with ``has_shared``, not ``ep_world``): a shared expert of the routed
        ones' shapes is expert E of the weights (E + 1 of them) and the schedule puts its T rows
        first (common/schedule.py); the combine reads its output rows as the shared input.
        ``dispatch_format`` (with ``ep_world``): "mxfp8" publishes x quantized (mok.pipeline.exchange.quantized_region's
        layout) and dequantizes each row as it is copied into x_all (common/ep_phases.py).
        ``gate_up_stride``: elements from one expert's w_gate (and w_up) to the next (None: I·H; 2·I·H
        for the halves or the even and odd rows of one [E, 2I, H] tensor); ``gate_up_row_stride``:
        from one of their rows to the next (None: H; 2·H for the even and odd rows).
        ``activation``: fc1's gated activation. ``bias``: the experts' biases added in both GEMMs'
        epilogues (common/grouped_gemm.py)."""
        self.configure(
            hidden, inter, topk, has_shared=has_shared, num_experts=num_experts, ep_world=ep_world, shared_prefix=shared_prefix,
            dispatch_format=dispatch_format, bias=bias,
        )
        self.fc1 = GroupedGemmSm90(
            inter, hidden, "swiglu_save" if save_h else "swiglu", tile_n=TILE, persistent=True, gather_a=True,
            b_expert_stride=gate_up_stride, b_row_stride=gate_up_row_stride, activation=activation, bias=bias,
        )
        self.fc2 = GroupedGemmSm90(  # EP: y rows pushed into their tokens' ranks
            hidden, inter, "plain", tile_n=fc2_tile_n, persistent=True, topk=topk, scatter=ep_world is not None, bias=bias
        )
        self.fc2_tile_n = fc2_tile_n
        self.region_elems = 3 * TILE * TILE_K * self.fc1.ab_stage  # fc1: A, B, B2 per stage
        if (TILE + fc2_tile_n) * TILE_K * self.fc2.ab_stage > self.region_elems:
            raise ValueError(f"fc2's {self.fc2.ab_stage} stages do not fit in fc1's {self.fc1.ab_stage}")
        self.threads = self.fc1.threads
        self.check_scratch(self.region_elems * 2)

    @cute.jit
    def launch(self, t: MlpTensors, stream: cuda.CUstream):
        """Host side (ExpertMlp.launch): both GEMMs' MMAs and TMA atoms, the shared storage, the grid."""
        m_x, m_a3, m_a, m_y, m_h, m_a_st, m_y_st = t.m_x, t.m_a3, t.m_a, t.m_y, t.m_h, t.m_a_st, t.m_y_st
        m_wg, m_wu, m_wd = t.m_wg, t.m_wu, t.m_wd
        a_smem, b_smem, epi_smem = self.fc1.make_mma(m_x, m_wg, m_a.element_type, LayoutEnum.from_tensor(m_a))
        a2_smem, b2_smem, _ = self.fc2.make_mma(m_a3, m_wd, m_y.element_type, LayoutEnum.from_tensor(m_y))
        tma_x, t_x = self.fc1.load_atom(m_x, a_smem, (TILE, TILE_K))  # (A of fc1 is gathered; tile_loads still partitions it)
        tma_wg, t_wg = self.fc1.load_atom(m_wg, b_smem, (TILE, TILE_K))
        tma_wu, t_wu = self.fc1.load_atom(m_wu, b_smem, (TILE, TILE_K))
        tma_a, t_a = self.fc2.load_atom(m_a3, a2_smem, (TILE, TILE_K))
        tma_wd, t_wd = self.fc2.load_atom(m_wd, b2_smem, (self.fc2_tile_n, TILE_K))
        tma_a_st, t_a_st = self.fc1.store_atom(m_a_st, epi_smem)
        tma_h, t_h = self.fc1.store_atom(m_h, epi_smem)  # swiglu_save only
        tma_y, t_y = self.fc2.store_atom(m_y_st, epi_smem)

        ep = self.ep_world is not None

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, self.fc1.ab_stage * 2]
            mbar2: cute.struct.MemRange[cutlass.Int64, self.fc2.ab_stage * 2]
            tile_mbar: cute.struct.MemRange[cutlass.Int64, RING * 2]
            s_tiles: cute.struct.MemRange[cutlass.Int32, RING + 1]  # the ring, then the producer warps' broadcast slot
            # ep_world only (one element otherwise): fc2's epilogue subtiles and tile indices to the scattering warps
            epi_mbar: cute.struct.MemRange[cutlass.Int64, 2 * self.fc2.epi_stage if ep else 1]
            scatter_mbar: cute.struct.MemRange[cutlass.Int64, 2 * RING if ep else 1]
            s_scatter: cute.struct.MemRange[cutlass.Int32, RING if ep else 1]
            s_dest: cute.struct.MemRange[cutlass.Int32, TILE if ep else 1]
            s_ab: cute.struct.Align[cute.struct.MemRange[self.fc1.ab_dtype, self.region_elems], self.fc1.buffer_align_bytes]
            s_c: cute.struct.Align[cute.struct.MemRange[self.fc1.c_dtype, cute.cosize(epi_smem)], self.fc1.buffer_align_bytes]

        self.shared_storage = SharedStorage
        row_args = (m_h, m_h, t.m_row_token, t.m_row_slot, t.m_topk_w)  # (the epilogues' row inputs; fc1's and fc2's use none)
        fc1_args = ((tma_x, t_x, tma_wg, t_wg, tma_wu, t_wu), (tma_a_st, t_a_st, tma_h, t_h, tma_h, t_h))
        fc2_args = ((tma_a, t_a, tma_wd, t_wd, tma_wd, t_wd), (tma_y, t_y, tma_y, t_y, tma_y, t_y))
        all_tiles = t.num_row_tiles * (self.fc1.col_tiles + self.fc2.col_tiles)
        grid = cutlass.max(cutlass.min(all_tiles, t.max_ctas), 1)
        mma_args = (self.fc1.tiled_mma, self.fc2.tiled_mma, a_smem, b_smem, a2_smem, b2_smem, epi_smem)
        self.kernel(
            fc1_args, fc2_args, row_args, t.combine_args, mma_args, t.sched_args, t.ep_args, t.scatter_dst, m_x, t.m_tiles, t.m_flags,
            t.m_ready, t.m_offsets, t.biases, t.sync_ptr, t.num_experts, t.num_row_tiles, t.num_rows, t.timeout_ns,
        ).launch(grid=[grid, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        fc1_args: tuple,
        fc2_args: tuple,
        row_args: tuple,
        combine_args: tuple,
        mma_args: tuple,
        sched_args: tuple,
        ep_args: tuple,
        scatter_dst: tuple,
        m_x: cute.Tensor,
        m_tiles: cute.Tensor,
        m_flags: cute.Tensor,
        m_ready: cute.Tensor,
        m_offsets: cute.Tensor,
        biases: tuple,
        sync_ptr: cute.Pointer,
        num_experts: cutlass.Int32,
        num_row_tiles: cutlass.Int32,
        num_rows: cutlass.Int32,
        timeout_ns: cutlass.Int64,
    ):
        """Warpgroup 0 loads (all four warps gather fc1's rows, warp 0 takes the tile indices,
        issues the TMA loads and, before an fc2 tile, waits for its a rows); warpgroups 1 and 2
        multiply and store, in the order the ring hands them the tiles."""
        fc1_loads, fc1_stores = fc1_args
        fc2_loads, fc2_stores = fc2_args
        _, _, m_row_token, _, _ = row_args
        tiled_mma, mma2, a_smem, b_smem, a2_smem, b2_smem, epi_smem = mma_args
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        fc1_cols, fc2_cols = self.fc1.col_tiles, self.fc2.col_tiles  # (partial last tiles where the widths are not multiples)
        k1_tiles, k2_tiles = self.fc1.k_tiles, self.fc2.k_tiles
        if warp_idx == 0:
            self.fc1.prefetch(fc1_loads[2], fc1_loads[4], fc2_loads[0], fc2_loads[2])

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        region = storage.s_ab.data_ptr()  # fc1: [A | B | B2] stages; fc2: [A | B] stages (first the schedule's scratch)
        scheduled_rows = self.build_schedule(sched_args, ep_args, region, num_rows, timeout_ns, m_offsets, num_experts)
        used_rows = cutlass.min(scheduled_rows // TILE, num_row_tiles)  # the schedule's (padded) row tiles
        fc1_tiles = used_rows * fc1_cols
        all_tiles = fc1_tiles + used_rows * fc2_cols
        pipe1 = self.fc1.make_pipeline(storage, 2, a_smem, b_smem, gather_threads=128)
        pipe2 = self.fc2.make_pipeline(storage, 1, a2_smem, b2_smem, barriers=storage.mbar2.data_ptr())
        ring = pipeline.PipelineAsync.create(
            barrier_storage=storage.tile_mbar.data_ptr(),
            num_stages=RING,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.fc1.consumer_threads),
            defer_sync=True,
        )
        epi_pipe = scatter_ring = None
        if cutlass.const_expr(self.ep_world is not None):
            epi_pipe = self.fc2.scatter_pipeline(storage)
            scatter_ring = pipeline.PipelineAsync.create(
                barrier_storage=storage.scatter_mbar.data_ptr(),
                num_stages=RING,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, SCATTER_THREADS),
                defer_sync=True,
            )
        pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)
        s_a = self.smem_view(region, a_smem)
        s_b = self.smem_view(region + cute.cosize(a_smem), b_smem)
        s_b2 = self.smem_view(region + cute.cosize(a_smem) + cute.cosize(b_smem), b_smem)
        s_a2 = self.smem_view(region, a2_smem)
        s_bd = self.smem_view(region + cute.cosize(a2_smem), b2_smem)
        s_c = storage.s_c.get_tensor(epi_smem.outer, swizzle=epi_smem.inner)
        s_tiles = storage.s_tiles.get_tensor(cute.make_layout(RING + 1))
        s_scatter = storage.s_scatter.get_tensor(cute.make_layout(RING))
        s_dest = storage.s_dest.get_tensor(cute.make_layout(TILE))
        pipeline_init_wait(cluster_shape_mn=(1, 1))

        if tidx < 128:  # producer warpgroup
            cute.arch.setmaxregister_decrease(40)
            prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.fc1.ab_stage)
            handed = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, RING)
            tile, handed = self.take_next(m_flags, ring, handed, s_tiles, tidx)
            while tile < fc1_tiles:
                tile_row, tile_col = self.fc1.grouped_tile(tile, used_rows, fc1_cols)
                loads = self.fc1.tile_loads(fc1_loads, s_a, s_b, s_b2, tile_row, tile_col, m_tiles[tile_row])
                prod = self.fc1.gather_tile(pipe1, prod, loads, m_x, m_row_token, (region, None), tile_row, num_rows, tidx, k1_tiles)
                tile, handed = self.take_next(m_flags, ring, handed, s_tiles, tidx)
            cute.arch.cp_async_wait_group(0)
            if warp_idx == 0:  # warps 1-3 are done: fc2's A comes by TMA
                pipe1.producer_tail(prod)  # every fc1 stage consumed: fc2's stages may take the region
                prod2 = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.fc2.ab_stage)
                scattered = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, RING)
                while tile < all_tiles:
                    tile_row, tile_col = self.fc2.grouped_tile(tile - fc1_tiles, used_rows, fc2_cols)
                    if tidx == 0:
                        self.wait_ready(m_ready, m_flags, tile_row, timeout_ns, sync_ptr)
                    cute.arch.sync_warp()
                    cute.arch.fence_proxy("async.global")  # the TMA loads of a (async proxy) after the acquire
                    loads = self.fc2.tile_loads(fc2_loads, s_a2, s_bd, s_bd, tile_row, tile_col, m_tiles[tile_row])
                    prod2 = self.fc2.produce_tile(pipe2, prod2, loads, k2_tiles)
                    tile, handed = self.take_next(m_flags, ring, handed, s_tiles, tidx, warp_only=True)
                    if cutlass.const_expr(self.ep_world is not None):
                        scattered = self.hand_to_scatter(scatter_ring, scattered, s_scatter, tile, tidx)
                pipe2.producer_tail(prod2)
            elif cutlass.const_expr(self.ep_world is not None):  # warps 1-3 push fc2's tiles (the first index they have)
                self.scatter_phase(
                    tile, fc1_tiles, all_tiles, used_rows, fc2_cols, scatter_ring, s_scatter, epi_pipe, s_c, s_dest,
                    m_row_token, row_args[3], num_rows, scatter_dst, tidx - 32,
                )
            grid_barrier(sched_args[2], timeout_ns, leader=128)  # (the MMA warps' thread 0 arrives and polls)
        else:  # the two MMA warpgroups
            cute.arch.setmaxregister_increase(232)
            mma_tidx = tidx - 128
            store_pipe = self.fc1.store_pipeline()
            given = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, RING)
            r_a, r_b, r_b2, acc, acc2 = self.fc1.mma_fragments(tiled_mma, mma_tidx, s_a, s_b, s_b2)
            cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.fc1.ab_stage)
            release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.fc1.ab_stage)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)  # onto accumulators zeroed per tile
            pending = cutlass.Int32(-1)  # the row tile of this CTA's last fc1 tile, not yet published
            tile, given = self.handed_tile(ring, given, s_tiles)
            while tile < fc1_tiles:
                tile_row, tile_col = self.fc1.grouped_tile(tile, used_rows, fc1_cols)
                acc.fill(0.0)
                acc2.fill(0.0)
                cons, release = self.fc1.consume_tile(pipe1, tiled_mma, acc, acc2, r_a, r_b, r_b2, k1_tiles, cons, release)
                if cutlass.const_expr(self.bias):
                    self.fc1.add_bias(mma_tidx, tiled_mma, (acc, acc2), biases[:2], m_tiles[tile_row], tile_col)
                self.publish(warp_idx, m_ready, pending)  # its stores drained during this mainloop
                self.fc1.epilogue(
                    mma_tidx, warp_idx, tiled_mma, acc, acc2, s_c, tile_row, tile_col, fc1_stores, row_args, num_rows, store_pipe
                )
                pending = tile_row
                tile, given = self.handed_tile(ring, given, s_tiles)
            self.publish(warp_idx, m_ready, pending)  # before any fc2 tile: its producer may wait for this one
            epi_prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.fc2.epi_stage)  # (ep_world only)
            if cutlass.const_expr(self.ep_world is not None):
                self.fc1.epilogue_sync()  # the store warp's TMA stores have read the epilogue buffers the scatter refills

            r_a2, r_bd, _, acc_d, _ = self.fc2.mma_fragments(mma2, mma_tidx, s_a2, s_bd, s_bd)
            cons2 = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.fc2.ab_stage)
            release2 = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.fc2.ab_stage)
            mma2.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            while tile < all_tiles:
                tile_row, tile_col = self.fc2.grouped_tile(tile - fc1_tiles, used_rows, fc2_cols)
                acc_d.fill(0.0)
                cons2, release2 = self.fc2.consume_tile(pipe2, mma2, acc_d, acc_d, r_a2, r_bd, r_bd, k2_tiles, cons2, release2)
                if cutlass.const_expr(self.bias):
                    self.fc2.add_bias(mma_tidx, mma2, (acc_d, acc_d), biases[2:], m_tiles[tile_row], tile_col)
                if cutlass.const_expr(self.ep_world is not None):
                    epi_prod = self.fc2.scatter_epilogue(mma_tidx, mma2, acc_d, s_c, epi_pipe, epi_prod)
                else:
                    self.fc2.epilogue(
                        mma_tidx, warp_idx, mma2, acc_d, acc_d, s_c, tile_row, tile_col, fc2_stores, row_args, num_rows, store_pipe
                    )
                tile, given = self.handed_tile(ring, given, s_tiles)
            if warp_idx == self.fc1.store_warp:
                store_pipe.producer_tail()
            if cutlass.const_expr(self.ep_world is not None):  # a capacity bound that overflowed: NaN, not stale rows
                ep_phases.mark_overflow(
                    ep_args, sched_args[1], num_rows, self.ep_world, self.topk, self.hidden, self.schedule.num_local,
                    self.fc1.consumer_threads, mma_tidx,
                )
            self.publish(warp_idx, m_ready, cutlass.Int32(-1))  # every y row stored and visible before the barrier
            grid_barrier(sched_args[2], timeout_ns, leader=128)
            if cutlass.const_expr(self.ep_world is not None):  # every rank's pushes into this rank's slots
                ep_phases.signal_done_and_wait(ep_args, self.ep_world, timeout_ns, mma_tidx, 0)
                self.fc1.epilogue_sync()
            self.combine_all(mma_tidx, self.fc1.consumer_threads, combine_args)

    @cute.jit
    def take_next(self, m_flags, ring, handed, s_tiles, tidx, warp_only: cutlass.Constexpr = False):
        """Producer: thread 0 takes the next tile index from the global counter and hands it to the
        MMA warps through the ring; every producer thread (only warp 0's with ``warp_only``) gets
        it too. Returns (index, advanced ring state)."""
        if tidx == 0:
            tile = cute.arch.atomic_add(m_flags.iterator + 1, cutlass.Int32(1), scope="gpu")
            s_tiles[RING] = tile
            ring.producer_acquire(handed)
            s_tiles[handed.index] = tile
            ring.producer_commit(handed)
        handed.advance()
        if cutlass.const_expr(warp_only):
            cute.arch.sync_warp()
            tile = s_tiles[RING]
            cute.arch.sync_warp()
        else:
            cute.arch.barrier(barrier_id=TILE_BARRIER, number_of_threads=128)
            tile = s_tiles[RING]
            cute.arch.barrier(barrier_id=TILE_BARRIER, number_of_threads=128)  # all read before the next index
        return tile, handed

    @cute.jit
    def handed_tile(self, ring, given, s_tiles):
        """MMA warps: the next tile index from the ring (past the last tile: stop). Returns (index, advanced state)."""
        ring.consumer_wait(given)
        tile = s_tiles[given.index]
        ring.consumer_release(given)
        given.advance()
        return tile, given

    @cute.jit
    def publish(self, warp_idx, m_ready, tile_row):
        """The store warp: ExpertMlp.publish_stores (fc1 row tile ``tile_row``, -1: none)."""
        if warp_idx == self.fc1.store_warp:
            self.publish_stores(m_ready, tile_row)

    @cute.jit
    def hand_to_scatter(self, scatter_ring, state, s_scatter, tile, tidx):
        """``ep_world``, warp 0 in fc2: thread 0 passes the next tile index on to the scattering warps. Returns the advanced state."""
        if tidx == 0:
            scatter_ring.producer_acquire(state)
            s_scatter[state.index] = tile
            scatter_ring.producer_commit(state)
        state.advance()
        return state

    @cute.jit
    def scatter_phase(
        self, tile, fc1_tiles, all_tiles, used_rows, fc2_cols, scatter_ring, s_scatter, epi_pipe, s_c, s_dest, m_row_token, m_row_slot,
        num_rows, scatter_dst, tid,
    ):
        """``ep_world``, producer warps 1-3 (``tid`` 0..95) from the first fc2 ``tile`` on: push each fc2
        tile's rows, as the MMA warps hand them over, into their tokens' slots on their tokens' ranks
        (grouped_gemm.scatter_tile); the next index from warp 0 (``hand_to_scatter``). Ends with a
        system-scope fence: the pushes before the grid barrier that precedes the done signal."""
        cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.fc2.epi_stage)
        got = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, RING)
        while tile < all_tiles:
            tile_row, tile_col = self.fc2.grouped_tile(tile - fc1_tiles, used_rows, fc2_cols)
            cons = self.fc2.scatter_tile(epi_pipe, cons, s_c, s_dest, tile_row, tile_col, m_row_token, m_row_slot, num_rows, scatter_dst, tid)
            scatter_ring.consumer_wait(got)
            tile = s_scatter[got.index]
            scatter_ring.consumer_release(got)
            got.advance()
        cute.arch.fence_acq_rel_sys()

    def smem_view(self, ptr, layout):
        """A staged operand layout (swizzle, outer) placed at ``ptr`` in the shared operand region."""
        return cute.make_tensor(cute.recast_ptr(ptr, layout.inner, dtype=self.fc1.ab_dtype), layout.outer)


def compile_expert_mlp(hidden: int, inter: int, topk: int, arch: str, options: str = "", **config):
    """Compile :class:`ExpertMlpSm90` (``config``: its keyword arguments) for ``arch`` without
    tensors: the stand-ins of EXPERT_MLP_ARGS (the launch's E must be ``num_experts``)."""
    return compile_kernel(ExpertMlpSm90(hidden, inter, topk, **config), EXPERT_MLP_ARGS, arch, options)
