"""The routed experts' whole forward in one persistent launch on Blackwell (sm_100a / sm_103a): the
schedule, fc1 (gathered rows, SwiGLU), fc2, the combine. Compile-verified only: no SM100 GPU has
run it.

The phases, their synchronisation and what every arch shares: mok/kernels/common/expert_mlp.py.
Here the two grouped GEMMs of mok/kernels/sm100/grouped_gemm.py (fc1: the gathering SwiGLU one,
fc2: the down projection) run in one warp-specialised CTA of mok/kernels/sm100/tcgen05_tile.py
per SM, on one set of stages and one tensor-memory allocation:

- Each CTA walks its tiles in one static order, ``blockIdx.x``, + ``gridDim.x``, ... over fc1's
  tiles and then fc2's (each phase in the L2-grouped order of common/tile_order.py over the row
  tiles the schedule uses); every warp role walks the same list, so no tile index is handed
  between them. (Hopper's kernel hands out tiles from an atomic counter instead, which keeps
  the fc2 tiles in flight on few experts; whether that pays here is for a B200 to say.)
- The stages are fc1's: A (gathered by the four gather warps), B = w_gate, B2 = w_up, 16 KiB
  each. An fc2 stage holds A = a (by TMA) and B = w_down in the same A and B buffers, 128 columns
  wide, so that it brings the same TMA bytes as an fc1 stage (fc1: B and B2; fc2: A and B) and
  the stages' full barriers keep one byte count. Their arrival count includes the 128 gather
  threads: for an fc2 stage the first gather thread waits until the stage is free and arrives
  for all of them, with no data.
- Tensor memory holds two accumulator stages of fc1's two 128-column accumulators (all 512
  columns); an fc2 tile uses the first accumulator of a stage.
- The epilogue warps store a (and h with ``save_h``) and the y rows through the shared staging
  buffers by TMA (at EP the y rows go from registers into their tokens' slots on their ranks).
  The store warp publishes an fc1 tile's row tile once the next tile's MMAs have completed (its
  TMA stores have drained by then) and its last one when fc1 ends; the load warp's first lane
  waits for an fc2 tile's a rows (bounded), then the warp fences (proxy) before the TMA loads.
- After the last tile: the y rows' stores complete and visible (at EP: the pushes fenced at
  system scope, an overflowed capacity's pairs set to NaN), the tensor memory freed, the second
  grid barrier; every thread of every CTA combines.

The same bits as the four launches on SM100 (schedule, the gathering gate/up GEMM, the down GEMM,
combine) by design: each output tile is computed by one CTA with the same MMAs in the same order;
fc2 runs in 128-column tiles whatever the down projection's own tile, which is expected not to
change a value's sum (as measured on Hopper's WGMMAs; tests/test_sm100_gpu.py holds the bits to
the staged launches' on a B200).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import tcgen05

from ..common import ep_phases
from ..common.compile import compile_kernel
from ..common.expert_mlp import TILE, ExpertMlp, MlpTensors
from ..common.gemm_args import halves
from ..common.records import EXPERT_MLP_ARGS
from ..common.row_gather import GATHER_THREADS
from ..common.tile_order import grouped_tile
from ..common.waits import grid_barrier
from .grouped_gemm import GroupedGemmSm100
from .tcgen05_tile import EPILOGUE_THREADS, FIRST_GATHER_WARP, LOAD_WARP, MMA_WARP, STORE_WARP, TILE_K, Tcgen05TileKernel


class ExpertMlpSm100(ExpertMlp, Tcgen05TileKernel):
    """Static config: H, I, top-k, whether h is saved for the backward, whether the combine adds a
    shared expert's output, E, the expert-parallel options, w_gate's and w_up's expert and row
    strides, fc1's gated activation and the experts' biases (the Hopper kernel's arguments but its
    fc2 column tile)."""

    num_b = 2  # fc1's gate and up accumulators (an fc2 tile uses the first)
    gather_a = True  # fc1's A: x's rows, copied by the gather warps
    persistent = True
    store_dtype = cutlass.BFloat16  # a, h and the y rows go through the staging buffers by TMA

    def __init__(
        self, hidden: int, inter: int, topk: int, *, save_h: bool = False, has_shared: bool = False, num_experts: int,
        ep_world: int | None = None, shared_prefix: bool = False, dispatch_format: str = "bf16", gate_up_stride: int | None = None,
        gate_up_row_stride: int | None = None, activation: str = "swiglu", bias: bool = False,
    ) -> None:
        """As ExpertMlpSm90's, without its fc2 column tile: 128 here (an fc2 stage brings an fc1 stage's TMA bytes)."""
        self.configure(
            hidden, inter, topk, has_shared=has_shared, num_experts=num_experts, ep_world=ep_world, shared_prefix=shared_prefix,
            dispatch_format=dispatch_format, bias=bias,
        )
        self.save_h = save_h
        self.fc1 = GroupedGemmSm100(
            inter, hidden, "swiglu_save" if save_h else "swiglu", tile_n=TILE, persistent=True, gather_a=True,
            b_expert_stride=gate_up_stride, b_row_stride=gate_up_row_stride, activation=activation, bias=bias,
        )
        self.fc2 = GroupedGemmSm100(
            hidden, inter, "plain", tile_n=TILE, persistent=True, topk=topk, scatter=ep_world is not None, bias=bias
        )
        self.tile_shape_mnk = self.fc1.tile_shape_mnk
        self.ab_stage = self.fc1.ab_stage
        self.threads = self.cta_threads
        self.check_scratch(self.ab_stage * TILE * TILE_K * 2)  # (the scratch lies in A's stages)

    def launch(self, t: MlpTensors, stream: cuda.CUstream) -> None:
        """Host side (ExpertMlp.launch): the tiled MMA and stages (fc1's), the TMA loads of both phases
        (fc2: A = a, B = w_down, no B2), the outputs' TMA stores, the grid."""
        tiled_mma, layouts, fc1_loads = self.prepare("k", "k", t.m_x, (t.m_wg, t.m_wu))
        fc2_loads, _ = self.stage_loads(tiled_mma, layouts[0], layouts[1], cutlass.BFloat16, t.m_a3, (t.m_wd,))
        fc2_loads = (fc2_loads[0], fc2_loads[1], fc2_loads[1])
        row_args = (t.m_h, t.m_a, t.m_a, t.m_row_token, t.m_row_slot, t.m_topk_w)  # (the epilogues read none of the first three)
        fc1_stores = (self.store_atom(t.m_a_st),) + ((self.store_atom(t.m_h),) if self.save_h else ())
        fc1_epi = (t.m_a_st, row_args, t.num_rows, None, t.biases[:2], fc1_stores)
        if self.ep_world is None:
            fc2_epi = (t.m_y_st, row_args, t.num_rows, None, t.biases[2:], (self.store_atom(t.m_y_st),))
        else:  # the y rows pushed into the slots: their base (rank 0's slots) as C
            slots = halves(t.scatter_dst[0].iterator, t.num_rows, self.hidden, 1)
            fc2_epi = (slots, row_args, t.num_rows, t.scatter_dst, t.biases[2:], ())
        kernel = self.kernel(
            tiled_mma, layouts, fc1_loads, fc2_loads, fc1_epi, fc2_epi, t.combine_args, t.sched_args, t.ep_args, t.m_x, t.m_tiles,
            t.m_flags, t.m_ready, t.m_offsets, t.sync_ptr, t.num_experts, t.num_row_tiles, t.num_rows, t.timeout_ns,
        )
        self.launch_kernel(kernel, t.num_row_tiles * (self.fc1.col_tiles + self.fc2.col_tiles), t.max_ctas, stream)

    @cute.kernel
    def kernel(
        self, tiled_mma: cute.TiledMma, layouts: tuple, fc1_loads: tuple, fc2_loads: tuple, fc1_epi: tuple, fc2_epi: tuple,
        combine_args: tuple, sched_args: tuple, ep_args: tuple, m_x: cute.Tensor, m_tiles: cute.Tensor, m_flags: cute.Tensor,
        m_ready: cute.Tensor, m_offsets: cute.Tensor, sync_ptr: cute.Pointer, num_experts: cutlass.Int32,
        num_row_tiles: cutlass.Int32, num_rows: cutlass.Int32, timeout_ns: cutlass.Int64,
    ):
        """Every thread: the CTA's resources (Tcgen05TileKernel.setup), the schedule phase, its warp's
        role over fc1's and fc2's tiles, the second grid barrier, the combine."""
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        stages, pipes, tmem, t_acc, s_store = self.setup(warp_idx, tiled_mma, layouts, fc1_loads + fc2_loads)
        scheduled_rows = self.build_schedule(sched_args, ep_args, stages[3], num_rows, timeout_ns, m_offsets, num_experts)
        used_rows = cutlass.min(scheduled_rows // TILE, num_row_tiles)  # the schedule's (padded) row tiles
        fc1_tiles = used_rows * self.fc1.col_tiles
        phases = (fc1_tiles, fc1_tiles + used_rows * self.fc2.col_tiles, used_rows, m_tiles)
        m_row_token = fc1_epi[1][3]
        if warp_idx == LOAD_WARP:
            self.load_phases(tiled_mma, (fc1_loads, fc2_loads), stages, pipes, phases, (m_ready, m_flags, timeout_ns, sync_ptr))
        if warp_idx == MMA_WARP:
            self.mma_phases(tiled_mma, stages, pipes, t_acc, phases)
        if warp_idx >= FIRST_GATHER_WARP:
            self.gather_phases(tidx - FIRST_GATHER_WARP * 32, stages, pipes, phases, (m_x, m_row_token, num_rows))
        if warp_idx < MMA_WARP:
            self.epilogue_phases(
                tidx, tmem, t_acc, pipes, phases, (fc1_epi + (s_store,), fc2_epi + (s_store,)), m_ready, sched_args, ep_args, num_rows
            )
        grid_barrier(sync_ptr, timeout_ns)
        if cutlass.const_expr(self.ep_world is not None):  # every rank's pushes into this rank's slots
            ep_phases.signal_done_and_wait(ep_args, self.ep_world, timeout_ns, tidx, 0)
            cute.arch.sync_threads()
        self.combine_all(tidx, self.threads, combine_args)

    @cute.jit
    def phase_tile(self, gemm, linear, phases):
        """Tile ``linear`` of ``gemm``'s phase (counted from the phase's first) -> the grouped GEMM's
        tile (row tile, column tile, expert, B's expert: the same, B not shared), in the L2-grouped
        order over the schedule's row tiles."""
        _, _, used_rows, m_tiles = phases
        tile_row, tile_col = grouped_tile(linear, used_rows, gemm.col_tiles)
        expert = m_tiles[tile_row]
        return tile_row, tile_col, expert, expert, False

    @cute.jit
    def load_phases(self, tiled_mma, loads, stages, pipes, phases, ready_args):
        """The load warp: each fc1 tile's K tiles of w_gate and w_up (A is gathered), then each fc2
        tile's of a and w_down once its a rows are published (the first lane waits, bounded; the
        warp fences the proxies before the TMA reads a), into the stages as the MMAs free them;
        then the producer's tail, on the state these loops advanced."""
        fc1_loads, fc2_loads = loads
        fc1_tiles, all_tiles, _, _ = phases
        m_ready, m_flags, timeout_ns, sync_ptr = ready_args
        ab_producer = pipes[0]
        linear, step = self.first_tile_and_step()
        while linear < fc1_tiles:
            views = self.fc1.tma_views(tiled_mma, fc1_loads, stages, self.phase_tile(self.fc1, linear, phases))
            ab_producer.reset()  # (the handles count this tile's K tiles from 0)
            for _ in cutlass.range(self.fc1.k_tiles, unroll=1):
                self.fc1.load_stage(ab_producer.acquire_and_advance(), views)
            linear += step
        while linear < all_tiles:
            tile = self.phase_tile(self.fc2, linear - fc1_tiles, phases)
            if cute.arch.lane_idx() == 0:
                self.wait_ready(m_ready, m_flags, tile[0], timeout_ns, sync_ptr)
            cute.arch.sync_warp()
            cute.arch.fence_proxy("async.global")  # the TMA loads of a (async proxy) after the acquire
            views = self.fc2.tma_views(tiled_mma, fc2_loads, stages, tile)
            ab_producer.reset()
            for _ in cutlass.range(self.fc2.k_tiles, unroll=1):
                self.fc2.load_stage(ab_producer.acquire_and_advance(), views)
            linear += step
        ab_producer.tail()

    @cute.jit
    def mma_phases(self, tiled_mma, stages, pipes, t_acc, phases):
        """The MMA warp: each fc1 tile's gate and up products (the gathered rows fenced into the async
        proxy first) onto both accumulators of a free accumulator stage, then each fc2 tile's
        product onto its first; each shared-memory stage freed as its MMAs complete, each
        accumulator stage signalled full once its tile's last MMA has."""
        fc1_tiles, all_tiles, _, _ = phases
        ab_consumer, acc_producer = pipes[1], pipes[2]
        fragments = (tiled_mma.make_fragment_A(stages[0]), tiled_mma.make_fragment_B(stages[1]), tiled_mma.make_fragment_B(stages[2]))
        linear, step = self.first_tile_and_step()
        while linear < fc1_tiles:
            acc_empty = acc_producer.acquire_and_advance()
            acc = t_acc[(None, None, None, acc_empty.index * 2)]
            acc2 = t_acc[(None, None, None, acc_empty.index * 2 + 1)]
            tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
            for _ in cutlass.range(self.fc1.k_tiles, unroll=1):
                full = ab_consumer.wait_and_advance()
                cute.arch.fence_proxy("async.shared", space="cta")  # (the gathered rows: written through the generic proxy)
                tiled_mma = self.mma_stage(tiled_mma, acc, acc2, fragments, full.index, 2, None)
                full.release()
            acc_empty.commit()
            linear += step
        while linear < all_tiles:
            acc_empty = acc_producer.acquire_and_advance()
            acc = t_acc[(None, None, None, acc_empty.index * 2)]
            tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
            for _ in cutlass.range(self.fc2.k_tiles, unroll=1):
                full = ab_consumer.wait_and_advance()
                tiled_mma = self.mma_stage(tiled_mma, acc, acc, fragments, full.index, 1, None)
                full.release()
            acc_empty.commit()
            linear += step

    @cute.jit
    def gather_phases(self, tidx, stages, pipes, phases, gather_args):
        """The gather warps (``tidx`` 0..127): each fc1 tile's rows of x into its stages
        (GroupedGemmSm100.gather_tile); then, for each fc2 stage, the first thread waits until it is
        free and arrives for all 128 (its A comes by TMA), keeping the full barriers' count."""
        m_x, m_row_token, num_rows = gather_args
        fc1_tiles, all_tiles, _, _ = phases
        ab_pipeline = pipes[4]
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)
        linear, step = self.first_tile_and_step()
        while linear < fc1_tiles:
            tile_row = self.phase_tile(self.fc1, linear, phases)[0]
            state = self.fc1.gather_tile(tidx, stages, pipes, state, m_x, m_row_token, num_rows, tile_row, self.fc1.k_tiles)
            linear += step
        cute.arch.cp_async_wait_group(0)
        if tidx == 0:
            while linear < all_tiles:
                for _ in cutlass.range(self.fc2.k_tiles, unroll=1):
                    ab_pipeline.sync_object_empty.wait(state.index, state.phase)
                    cute.arch.mbarrier_arrive(ab_pipeline.producer_get_barrier(state), arrive_count=GATHER_THREADS)
                    state.advance()
                linear += step

    @cute.jit
    def epilogue_phases(self, tidx, tmem, t_acc, pipes, phases, epi_args, m_ready, sched_args, ep_args, num_rows):
        """Warps 0-3: each fc1 tile's epilogue (a, and h with ``save_h``), the store warp publishing
        the previous fc1 tile once this one's MMAs are done (its stores have drained meanwhile) and
        the last when fc1 ends; then each fc2 tile's (the y rows, or at EP their pushes); then the
        y rows' stores complete and visible (at EP: an overflowed capacity's pairs marked, the
        pushes fenced at system scope) and the tensor memory freed."""
        fc1_tiles, all_tiles, _, _ = phases
        fc1_epi, fc2_epi = epi_args
        acc_consumer = pipes[3]
        tmem.relinquish_alloc_permit()  # (other CTAs on the SM may allocate)
        store_warp = cute.arch.make_warp_uniform(cute.arch.warp_idx()) == STORE_WARP
        pending = cutlass.Int32(-1)  # the row tile of this CTA's last fc1 tile, not yet published
        linear, step = self.first_tile_and_step()
        while linear < fc1_tiles:
            tile = self.phase_tile(self.fc1, linear, phases)
            acc_full = acc_consumer.wait_and_advance()
            if store_warp:
                self.publish_stores(m_ready, pending)
            self.fc1.epilogue(tidx, t_acc, acc_full.index, tile, self.fc1.k_tiles, fc1_epi)
            acc_full.release()
            pending = tile[0]
            linear += step
        if store_warp:  # before any fc2 tile: its loads may wait for this one
            self.publish_stores(m_ready, pending)
        while linear < all_tiles:
            tile = self.phase_tile(self.fc2, linear - fc1_tiles, phases)
            acc_full = acc_consumer.wait_and_advance()
            self.fc2.epilogue(tidx, t_acc, acc_full.index * 2, tile, self.fc2.k_tiles, fc2_epi)  # (fc2's accumulator: the stage's first)
            acc_full.release()
            linear += step
        if store_warp:  # every y row stored and visible before the grid barrier
            self.publish_stores(m_ready, cutlass.Int32(-1))
        if cutlass.const_expr(self.ep_world is not None):  # a capacity bound that overflowed: NaN, not stale rows
            ep_phases.mark_overflow(
                ep_args, sched_args[1], num_rows, self.ep_world, self.topk, self.hidden, self.schedule.num_local, EPILOGUE_THREADS, tidx
            )
            cute.arch.fence_acq_rel_sys()  # the pushes, before the grid barrier that precedes the done signal
        self.free_tensor_memory(tmem, t_acc)


def compile_expert_mlp_sm100(hidden: int, inter: int, topk: int, arch: str, options: str = "", **config):
    """Compile :class:`ExpertMlpSm100` (``config``: its keyword arguments) for ``arch`` (sm_100a or
    sm_103a) without tensors: the stand-ins of EXPERT_MLP_ARGS."""
    return compile_kernel(ExpertMlpSm100(hidden, inter, topk, **config), EXPERT_MLP_ARGS, arch, options)
