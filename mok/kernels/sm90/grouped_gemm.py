"""Expert-grouped GEMM for Hopper: WGMMA with a TMA-fed multistage shared-memory pipeline.

    C[rows of tile m, :] = epilogue(A[rows of tile m, :] · B[e(m)])

The contract (A's expert-grouped rows, B's major modes, k_split, the four epilogues, the launch
arguments) is every arch's: mok/kernels/common/grouped_gemm.py, whose epilogue math this kernel
applies to its WGMMA accumulators. Here: the mainloop (WGMMA, mok/kernels/sm90/wgmma_tile.py),
how the accumulators reach global memory (stmatrix into shared memory, TMA stores), and the
Hopper-only variants.

``persistent``: one CTA per SM walks the tiles, a producer warpgroup loading ahead while the two
MMA warpgroups run the epilogue (otherwise one CTA per output tile). With ``gather_a``
(persistent) A is not materialised: A is the token matrix x [T, K] and buffer row r reads
x[row_token[r]] (zeros where row_token[r] < 0, the padding rows); the producer warpgroup gathers
the rows with cp.async straight into the swizzled shared-memory tile (Hopper's TMA cannot gather
rows).

With ``scatter`` (plain epilogue, persistent) C is not a [R, N] matrix: buffer row r goes to
the slot of its (token g, slot j) = (row_token[r], row_slot[r]), row (g % T_max)·topk + j of
the [T_max·topk, N] slots of rank g // T_max, whose slots lie ``rank stride`` elements apart in
one mapping (the expert-parallel push: y rows written straight into the owners' combine
slots over NVLink, no y_rows buffer and no push kernel; at one rank T_max = T). TMA cannot
scatter rows, so the MMA warps hand each bf16 epilogue subtile (128 x 32) to the producer
warpgroup's idle warps 1-3 through an mbarrier pipeline over the epilogue buffers, and those
copy it out with 16-byte stores while the MMA warps go on to the next tile; padding rows are
not written.

Partial tiles (N or K not a multiple of the tile): TMA zero-fills what a load box holds past the
tensor (and counts the whole box's bytes) and clips what a store box holds past it; what is not
TMA is predicated by hand, per 16-byte chunk or 8-column group: the gathered rows' chunks past K
(zero-filled like padding rows), the saved h loaded by the SwiGLU backward, the scattered vectors.

With ``cluster_m`` = 2 (persistent, cooperative; bf16 or FP8 block scales, whose B scales are then
read for the expert whose B the stages hold) the CTAs run in clusters of two on row
tiles 2p and 2p + 1 of one column tile (the walk goes over pairs of row tiles, in the same
L2-grouped order). Where one expert has both row tiles each CTA loads half of every B (and B2)
tile into both CTAs' stages by TMA multicast, so the weights are read from L2 once for 256 rows;
where the two are different experts' each loads its own; a CTA whose row tile has no rows runs
its stages on the other's expert and stores nothing. Either CTA's loads may write both CTAs'
stages, so every stage is released to both CTAs' empty barriers and the two pipelines move in
step (both walk the same pairs with the same K tiles). The sums are the one-CTA kernel's.

With ``tail_split`` (persistent, cooperative, bf16, the plain epilogue and k_split's, 256-wide
tiles) the walk stops at the last row tile with an expert, and where its last round would keep at
most half the CTAs busy those tiles are taken as 128-wide halves, one a CTA: a GEMM of few rounds
of long tiles (mixtral's down projection, K = 14336, 8-9 rounds on 132 SMs) loses half a round
instead of most of one. A half's B lands in the first half of its stage's B buffer, its WGMMAs
are 128 wide, its stores the plain epilogue's (with ``scatter``: its four subtiles handed to the
scatter warps, which walk the same tiles); m64n128k16 gives an element the bits m64n256k16
gives it, so the result does not depend on which tiles were split.

With ``pingpong`` (persistent, swiglu_bwd, 128-wide tiles) each MMA warpgroup computes whole
128-row tiles, the two taking the CTA's tiles in turn (WgmmaTileKernel.pingpong_consumers): the
SwiGLU backward's epilogue (three stores per subtile, h read, ~0.5 GB moved at qwen3's shapes)
then runs under the other warpgroup's WGMMAs instead of stopping the tensor cores. The same
WGMMAs per output element and the same row sums: the same bits as the cooperative kernel.
"""

import math

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.tensor_utils import LayoutEnum

from ..common.combine import VECTOR
from ..common.compile import compile_kernel
from ..common.records import grouped_gemm_args
from ..common.row_gather import copy_async_4b, gather_stage, gathered_rows, swizzled_128b
from ..common.fp8_block_quantize import block_scale_and_factor
from ..common.grouped_gemm import GroupedGemm
from ..common.tile_order import PAIR, row_tile_pair
from ..variants import block_buffers_for, check_deep_turn
from .block_scaled import FP8_ROW_ELEMENTS, SCALE_BLOCK, TILE_K_BLOCK_SCALED, BlockScaledMainloop, bf16x2_rounded
from .wgmma_tile import TILE_K, WgmmaTileKernel, pick_stages

PARK_VALUES = 8  # bf16 values of one 16-byte slot of the pair buffer (store_activation_e4m3)
SCATTER_COLS = 32  # columns of an epilogue subtile (128 x 32 for a 128-row tile)
SCATTER_THREADS = 96  # the producer warpgroup's warps 1-3 store the scattered rows
PINGPONG_BWD_EPI_STAGES = 4  # ping-pong swiglu_bwd: epilogue buffers per warpgroup (12 stores per tile)
OUT_FORMATS = ("bf16", "e4m3_block")  # C's format: bf16, or (the SwiGLU forward on FP8) E4M3 with 1 x 128 block scales
H_IN_SMEM_EPI_STAGES = 3  # FP8 swiglu_bwd with h in shared memory: epilogue buffers (12 stores a 128-wide tile)
TAIL_SPLIT_TILE_N = 256  # tail_split: the tile whose last round is taken in halves 128 wide


class GroupedGemmSm90(BlockScaledMainloop, GroupedGemm, WgmmaTileKernel):
    """Static config: N, K, epilogue, B's major mode, K split, top-k, tile (M, N), stages, the gated
    activation, expert biases, the operands (bf16, or ``operand="e4m3_block"``: FP8 with an fp32 scale
    per 128 along K, mok/kernels/sm90/block_scaled.py; persistent, K-major B, N and K multiples of 16), and
    the Hopper variants (persistent, gather_a, scatter, pingpong, tail_split). With bf16 operands N and K need not
    be multiples of the tile: TMA zero-fills the loads past them and clips the stores (see the
    module docstring)."""

    partial_tiles = True
    takes_bias = True

    def __init__(
        self, n: int, k: int, epilogue: str = "plain", *, b_major: str = "k", k_split: bool = False, topk: int = 1,
        unit_scale: bool = False, tile_n: int = 128, stages: int | None = None, persistent: bool = False,
        gather_a: bool = False, scatter: bool = False, pingpong: bool = False, b_expert_stride: int | None = None,
        activation: str = "swiglu", bias: bool = False, operand: str = "bf16", block_buffers: int = 1,
        b_row_stride: int | None = None, cluster_m: int = 1, deep_turn: int = 0, out_format: str = "bf16",
        power_of_two: bool = False, ordered_issue: bool = False, tail_split: bool = False, bounded_walk: bool = False,
    ) -> None:
        if operand not in ("bf16", "e4m3_block"):
            raise ValueError(f"operand: expected 'bf16' or 'e4m3_block' on Hopper, got {operand!r}")
        self.block_scaled = operand == "e4m3_block"
        self.block_buffers = block_buffers_for(block_buffers, operand)
        check_deep_turn(deep_turn, self.block_buffers)
        self.deep_turn = deep_turn
        tile_k = TILE_K_BLOCK_SCALED if self.block_scaled else TILE_K
        self.configure(n, k, epilogue, b_major, k_split, topk, unit_scale, tile_n, tile_k, b_expert_stride, activation, bias, b_row_stride)
        if self.block_scaled:
            halves = 2 if k_split else 1
            problems = [what for what, bad in (
                ("persistent=True", not persistent), ("no pingpong", pingpong), ("b_major='k'", b_major != "k"),
                (f"N a multiple of {FP8_ROW_ELEMENTS}", n % FP8_ROW_ELEMENTS),
                (f"K a multiple of {halves * FP8_ROW_ELEMENTS}", k % (halves * FP8_ROW_ELEMENTS)),
                (f"tile_n dividing {SCALE_BLOCK}", SCALE_BLOCK % tile_n),
            ) if bad]
            if problems:
                raise ValueError(f"operand='e4m3_block': needs {', '.join(problems)} (n={n}, k={k}, tile_n={tile_n})")
        if gather_a and not persistent:
            raise ValueError("gather_a: only in the persistent kernel (its producer warpgroup gathers)")
        if scatter and (epilogue != "plain" or gather_a or not persistent):
            raise ValueError("scatter: only for the persistent plain GEMM without gather (the row pushes of EP)")
        if pingpong and (epilogue != "swiglu_bwd" or tile_n != 128 or not persistent):
            raise ValueError("pingpong: only for the persistent swiglu_bwd GEMM with 128-column tiles")
        if cluster_m not in (1, PAIR):
            raise ValueError(f"cluster_m: expected 1 or {PAIR}, got {cluster_m}")
        if cluster_m == PAIR and (not persistent or pingpong):
            raise ValueError("cluster_m=2: only in the persistent cooperative kernel")
        self.cluster_m = cluster_m
        if tail_split:
            problems = [what for what, bad in (
                ("persistent=True", not persistent), ("no pingpong", pingpong), ("no gather_a", gather_a),
                ("cluster_m=1", cluster_m != 1), ("operand='bf16'", self.block_scaled), ("the plain epilogue", epilogue != "plain"),
                (f"tile_n={TAIL_SPLIT_TILE_N}", tile_n != TAIL_SPLIT_TILE_N), ("no bias", bias),
            ) if bad]
            if problems:
                raise ValueError(f"tail_split: needs {', '.join(problems)}")
        self.tail_split = tail_split
        if bounded_walk and not persistent:
            raise ValueError("bounded_walk: only in the persistent kernel (one CTA a tile walks nothing)")
        self.bounded_walk = bounded_walk or tail_split
        self.use_ordered_issue(ordered_issue)
        self.check_out_format(out_format, power_of_two, epilogue, tile_n)
        self.pingpong = pingpong
        if pingpong:  # one warpgroup per tile (two 64-row WGMMAs), its own epilogue buffers
            self.use_pingpong(PINGPONG_BWD_EPI_STAGES)
        self.persistent, self.gather_a, self.scatter = persistent, gather_a, scatter
        if persistent:  # a producer warpgroup (one warp issues TMA) in front of the two MMA warpgroups
            self.threads, self.store_warp = self.consumer_threads + 128, 4
        tile_m = self.tile_shape_mnk[0]
        if self.h_in_smem:  # beside h's 64 KB and four stages only three buffers leave room for the storage's alignment
            self.epi_stage = H_IN_SMEM_EPI_STAGES
        stores_per_tile = (tile_n // 32) * ((3 if epilogue in ("swiglu_save", "swiglu_bwd") else 1) - (1 if self.quantizes_out else 0))
        if stores_per_tile % self.epi_stage and not pingpong:  # each tile starts again at buffer 0 (see epilogue): 64-wide tiles take 2
            self.epi_stage = math.gcd(stores_per_tile, self.epi_stage)
        if stores_per_tile % self.epi_stage:
            raise ValueError(f"tile_n: {tile_n} gives {stores_per_tile} epilogue stores, not a multiple of {self.epi_stage}")
        element_bytes = 1 if self.block_scaled else 2
        stage_bytes = (tile_m * tile_k + self.num_b * tile_n * tile_k) * element_bytes + (tile_m * 4 if self.block_scaled else 0)
        self.epi_bytes = self.epi_stage * tile_m * 32 * 2 * (2 if pingpong else 1)
        self.pair_bytes = tile_m * SCALE_BLOCK if self.quantizes_out else 0  # (the E4M3 block tile's buffer: store_activation_e4m3)
        h_bytes = 2 * tile_m * tile_n * 2 if self.h_in_smem else 0  # (the saved h's gate and up halves of a tile, bf16)
        self.ab_stage = pick_stages(stage_bytes, self.epi_bytes + self.pair_bytes + h_bytes, stages, dedicated_epi=persistent)

    def check_out_format(self, out_format: str, power_of_two: bool, epilogue: str, tile_n: int) -> None:
        """``out_format`` "e4m3_block": the SwiGLU forward's activation leaves in E4M3 with 1 x 128
        block scales (:meth:`store_activation_e4m3`; ``power_of_two`` scales by that rule), not in
        bf16: on FP8 operands (the down GEMM's operand comes from the one that gives it its
        precision), 64-wide tiles (two make a block), one CTA a tile."""
        if out_format not in OUT_FORMATS:
            raise ValueError(f"out_format: expected one of {OUT_FORMATS}, got {out_format!r}")
        self.quantizes_out = out_format == "e4m3_block"
        self.power_of_two = power_of_two
        if self.quantizes_out:
            problems = [what for what, bad in (
                ("operand='e4m3_block'", not self.block_scaled), ("epilogue 'swiglu' or 'swiglu_save'", epilogue not in ("swiglu", "swiglu_save")),
                (f"tile_n={SCALE_BLOCK // PAIR}", tile_n != SCALE_BLOCK // PAIR), ("cluster_m=1", self.cluster_m != 1),
            ) if bad]
            if problems:
                raise ValueError(f"out_format='e4m3_block': needs {', '.join(problems)} (epilogue={epilogue!r}, tile_n={tile_n})")
        elif power_of_two:
            raise ValueError("power_of_two: the rule of out_format='e4m3_block''s scales, not with bf16 output")

    def launch(self, m_a, m_bs, scales, m_c, row_args, rows, num_experts, max_ctas, scatter_to, stream, biases):
        """Host side (see GroupedGemm.launch): the TMA atoms, the shared storage, the grid. (The
        storage struct's annotations are evaluated here, with ``self`` in scope: this module does
        not postpone annotations.)"""
        tile_m, tile_n, _ = self.tile_shape_mnk
        m_b, m_b2 = m_bs
        m_h, m_as, m_part, m_row_token, m_row_slot, m_topk_w = row_args
        m_tiles, num_tiles, num_rows = rows
        tile_k = self.tile_shape_mnk[2]
        epi_dtype = cutlass.BFloat16 if self.quantizes_out else m_c.element_type  # (E4M3 C: the buffers still stage h's bf16)
        a_smem, b_smem, epi_smem = self.make_mma(m_a, m_b, epi_dtype, LayoutEnum.from_tensor(m_c))
        b_pair_smem = self.stack_b(m_a, m_b) if self.stacked_b else b_smem
        tma_a, t_a = self.load_atom(m_a, a_smem, (tile_m, tile_k))
        tma_b, t_b = self.load_atom(m_b, b_smem, (tile_n, tile_k))
        tma_b2, t_b2 = self.load_atom(m_b2, b_smem, (tile_n, tile_k))
        b_multicast = ()  # cluster_m = 2: B's and B2's loads that write both CTAs of the cluster
        if cutlass.const_expr(self.cluster_m == PAIR):
            b_multicast = (*self.load_atom(m_b, b_smem, (tile_n, tile_k), PAIR), *self.load_atom(m_b2, b_smem, (tile_n, tile_k), PAIR))
        pair_smem = cute.slice_(a_smem, (None, None, 0))  # (out_format e4m3_block: a block tile staged as an A stage is)
        if cutlass.const_expr(self.quantizes_out):
            tma_c, t_c = cute.nvgpu.cpasync.make_tiled_tma_atom(cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), m_c, pair_smem,
                                                                (tile_m, SCALE_BLOCK))
        else:
            tma_c, t_c = self.store_atom(m_c, epi_smem)
        tma_h, t_h = self.store_atom(m_h, epi_smem)  # used by swiglu_save only
        tma_as, t_as = self.store_atom(m_as, epi_smem)  # used by swiglu_bwd only
        h_smem = None
        h_load = ()
        if cutlass.const_expr(self.h_in_smem):  # the tile's h, subtile by subtile as the epilogue reads it: gate's, then up's
            h_smem = sm90_utils.make_smem_layout_epi(self.c_dtype, self.c_layout, self.epi_tile, 2 * (tile_n // self.epi_tile[1]))
            h_load = self.load_atom(m_h, h_smem, self.epi_tile)
        if cutlass.const_expr(self.pingpong):
            epi_smem = self.pingpong_epi_smem()

        b2_elems = cute.cosize(b_smem) if self.num_b == 2 and not self.stacked_b else 8  # no second B buffer otherwise
        c_elems = cute.cosize(epi_smem) if self.persistent else 8  # otherwise the epilogue reuses A's buffers

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, self.ab_stage * 2]
            # epi_mbar and s_dest scatter only (one element otherwise): in front of s_a's 1024-byte alignment
            epi_mbar: cute.struct.MemRange[cutlass.Int64, 2 * self.epi_stage if self.scatter else 1]
            s_dest: cute.struct.MemRange[cutlass.Int32, self.tile_shape_mnk[0] if self.scatter else 1]
            s_a: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(a_smem)], self.buffer_align_bytes]
            s_b: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, cute.cosize(b_pair_smem)], self.buffer_align_bytes]
            s_b2: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, b2_elems], self.buffer_align_bytes]
            s_c: cute.struct.Align[cute.struct.MemRange[self.c_dtype, c_elems], self.buffer_align_bytes]
            s_sa: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, cute.cosize(self.a_scale_smem()) if self.block_scaled else 1], 128]
            s_q: cute.struct.Align[cute.struct.MemRange[self.ab_dtype, self.pair_bytes or 8], self.buffer_align_bytes if self.quantizes_out else 8]
            if self.h_in_smem:
                h_mbar: cute.struct.MemRange[cutlass.Int64, 1]
                s_h: cute.struct.Align[cute.struct.MemRange[self.c_dtype, cute.cosize(h_smem)], self.buffer_align_bytes]

        self.shared_storage = SharedStorage
        load_args = (tma_a, t_a, tma_b, t_b, tma_b2, t_b2)
        b_scales = ()
        m_x = m_a  # gather_a: x [T, K]
        if cutlass.const_expr(self.block_scaled):  # A's row scales with each stage (TMA, or gathered), B's read by the MMA warps
            a_scale_ptr, b_scale_ptr, b2_scale_ptr = scales[:3]
            m_sa = self.a_scale_tensor(a_scale_ptr, m_a.shape[0])
            if cutlass.const_expr(self.gather_a):
                m_x = (m_a, m_sa)
            else:
                load_args += tuple(self.a_scale_load_atom(m_sa))
            b_scales = (self.b_scale_tensor(b_scale_ptr, num_experts), self.b_scale_tensor(b2_scale_ptr, num_experts))
        store_args = (tma_c, t_c, tma_h, t_h, tma_as, t_as, *h_load)  # (h_in_smem: h's load atom and tensor last)
        if cutlass.const_expr(self.quantizes_out):  # C's row scales [ceil(N / 128), R] and the block tile's layout last
            c_blocks = -(-self.n // SCALE_BLOCK)
            store_args += (cute.make_tensor(scales[3], cute.make_layout((num_rows, c_blocks), stride=(1, num_rows))), pair_smem)
        row_args = (m_h, m_part, m_row_token, m_row_slot, m_topk_w)
        tail = self.tail_operands(m_a, m_bs) if self.tail_split else None
        mma_args = (self.tiled_mma, a_smem, b_smem, epi_smem, self.tiled_mma_pair if self.stacked_b else None, b_pair_smem, h_smem, tail)
        if cutlass.const_expr(self.scatter):  # C as 16-byte vectors from rank 0's slots on (see scatter_tiles)
            m_x = self.scatter_target(scatter_to)
        bias_tensors = tuple(cute.make_tensor(p, cute.make_layout((num_experts * self.n,))) for p in biases)
        args = (load_args, store_args, row_args, m_tiles, num_tiles, num_rows, mma_args, m_x, bias_tensors, b_scales, b_multicast)
        self.launch_tiles(args, (num_tiles + self.cluster_m - 1) // self.cluster_m * self.walk_cols, max_ctas, stream, self.cluster_m)

    @cute.kernel
    def kernel(
        self, load_args: tuple, store_args: tuple, row_args: tuple, m_tiles: cute.Tensor, num_row_tiles: cutlass.Int32,
        num_rows: cutlass.Int32, mma_args: tuple, m_x: cute.Tensor | tuple, biases: tuple, b_scales: tuple, b_multicast: tuple,
    ):
        """One CTA per output tile (bf16 operands). The tuples are the ones ``__call__`` packs: ``load_args`` the
        TMA atoms and tensors of A, B, B2; ``store_args`` those of C, h and a_scaled; ``row_args``
        the epilogue's row inputs; ``mma_args`` the tiled MMA and the shared-memory layouts;
        ``biases`` B's and B2's bias rows [E·N] (``bias``)."""
        tma_a, _, tma_b, _, tma_b2, _ = load_args
        tiled_mma, a_smem, b_smem, epi_smem = mma_args[:4]
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        linear, _, _ = cute.arch.block_idx()
        tile_row, tile_col = self.grouped_tile(linear, num_row_tiles, self.col_tiles)
        expert = m_tiles[tile_row]
        if expert >= 0:
            if warp_idx == 0:
                self.prefetch(tma_a, tma_b, *((tma_b2,) if self.num_b == 2 or self.k_split else ()))

            smem = cutlass.memory.SmemAllocator()
            storage = smem.allocate(self.shared_storage)
            ab_pipe = self.make_pipeline(storage, self.num_b, a_smem, b_smem)
            pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

            s_a, s_b, s_c = self.shared_buffers(storage, a_smem, b_smem, epi_smem, dedicated_epi=False)
            s_b2 = self.second_b(storage, b_smem, s_b)
            loads = self.tile_loads(load_args, s_a, s_b, s_b2, tile_row, tile_col, expert)
            r_a, r_b, r_b2, acc, acc2 = self.mma_fragments(tiled_mma, tidx, s_a, s_b, s_b2)
            acc.fill(0.0)
            if cutlass.const_expr(self.two_accumulators):
                acc2.fill(0.0)

            pipeline_init_wait(cluster_shape_mn=(1, 1))
            k_tiles = self.k_tiles
            rows_in = self.load_row_inputs(tidx, tiled_mma, tile_row, tile_col, row_args, num_rows)
            self.mainloop(ab_pipe, tiled_mma, acc, acc2, r_a, r_b, r_b2, k_tiles, warp_idx, loads)
            self.add_bias(tidx, tiled_mma, (acc, acc2), biases, expert, tile_col)
            cute.arch.sync_threads()  # the epilogue reuses A's shared memory

            store_pipe = self.store_pipeline()
            self.epilogue(
                tidx, warp_idx, tiled_mma, acc, acc2, s_c, tile_row, tile_col, store_args, row_args, num_rows, store_pipe, rows_in
            )
            if warp_idx == self.store_warp:
                store_pipe.producer_tail()

    @cute.kernel
    def kernel_persistent(
        self, load_args: tuple, store_args: tuple, row_args: tuple, m_tiles: cute.Tensor, num_row_tiles: cutlass.Int32,
        num_rows: cutlass.Int32, mma_args: tuple, m_x: cute.Tensor | tuple, biases: tuple, b_scales: tuple, b_multicast: tuple,
    ):
        """Persistent and warp-specialised: CTA i takes tiles i, i + grid, ... in the L2-friendly order.

        Warpgroup 0 produces (its warp 0 issues every TMA load, running ahead into the next
        tile while the MMA warpgroups run the epilogue of the last); warpgroups 1 and 2 consume
        (WGMMA, 64 rows each) and store. A tile's result does not depend on which CTA took it.
        Arguments as in ``kernel``; ``m_x`` is x for ``gather_a`` and where C's rows go for ``scatter``;
        ``b_scales`` B's and B2's scales (``block_scaled``; A's row scales come with ``load_args``);
        ``b_multicast`` the loads of B and B2 that write both CTAs of a cluster (``cluster_m``).
        """
        tma_a, _, tma_b, _, tma_b2, _ = load_args[:6]
        _, _, m_row_token, m_row_slot, _ = row_args
        tiled_mma, a_smem, b_smem, epi_smem, tiled_mma_pair, b_pair_smem, h_smem, tail = mma_args
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        col_tiles = self.col_tiles
        walk_rows = num_row_tiles  # (bounded_walk: up to the last row tile with rows)
        if cutlass.const_expr(self.bounded_walk):
            walk_rows = self.walked_row_tiles(m_tiles, num_row_tiles)
        first, step, all_tiles = self.cta_walk(walk_rows, col_tiles)
        whole, halves = all_tiles, cutlass.Int32(0)  # (tail_split: the tiles walked whole, then one half tile a CTA at most)
        if cutlass.const_expr(self.tail_split):
            whole, halves = self.tail_walk(all_tiles, step)
        if warp_idx == 0:
            self.prefetch(tma_a, tma_b, *((tma_b2,) if self.num_b == 2 or self.k_split else ()), *load_args[6:7], *b_multicast[0::2])

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        ab_pipe = self.make_pipeline(
            storage, self.num_b, a_smem, b_smem, gather_threads=128 if self.gather_a else 0, consumer_warps=4 if self.pingpong else None,
            extra_tx_bytes=self.tile_shape_mnk[0] * 4 if self.block_scaled and not self.gather_a else 0,  # (the row scales' TMA box)
            cluster_m=self.cluster_m,
        )
        epi_pipe = None
        if cutlass.const_expr(self.scatter):
            epi_pipe = self.scatter_pipeline(storage)
        h_tile = None  # h_in_smem: (its buffers, the barrier its loads complete on)
        if cutlass.const_expr(self.h_in_smem):
            h_tile = (storage.s_h.get_tensor(h_smem.outer, swizzle=h_smem.inner), storage.h_mbar.data_ptr())
            if warp_idx == 0:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_init(h_tile[1], 1)
            cute.arch.mbarrier_init_fence()
        pipeline_init_arrive(cluster_shape_mn=(self.cluster_m, 1), is_relaxed=True)  # (a cluster: its CTAs' barriers initialised before any load)
        s_a, s_b, s_c = self.shared_buffers(storage, a_smem, b_smem, epi_smem, dedicated_epi=True)
        s_b2 = self.second_b(storage, b_smem, s_b)
        s_b_pair = s_b
        if cutlass.const_expr(self.stacked_b):  # one buffer, each stage gate's tile_n rows then up's: B and B2 its halves
            s_b_pair = storage.s_b.get_tensor(b_pair_smem.outer, swizzle=b_pair_smem.inner)
            s_b, s_b2 = self.stacked_halves(s_b_pair)
        s_sa = storage.s_sa.get_tensor(self.a_scale_smem()) if self.block_scaled else None  # (A's row scales per stage)
        s_b_half = storage.s_b.get_tensor(tail[1].outer, swizzle=tail[1].inner) if self.tail_split else None
        if cutlass.const_expr(self.quantizes_out):  # the block tile's buffer in place of its layout (store_activation_e4m3)
            pair_smem = store_args[7]
            store_args = (*store_args[:7], storage.s_q.get_tensor(pair_smem.outer, swizzle=pair_smem.inner))
        pipeline_init_wait(cluster_shape_mn=(self.cluster_m, 1))
        k_tiles = self.k_tiles

        if tidx < 128:  # producer warpgroup
            if cutlass.const_expr(self.hands_registers_over):
                cute.arch.setmaxregister_decrease(self.register_split[0])
            # warp 0 issues the TMA loads; with gather_a all four warps also cp.async A's rows
            if warp_idx < (4 if self.gather_a else 1):
                prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.ab_stage)
                linear = first
                while linear < whole:
                    tile_row, tile_col, _, b_expert, shared_b = self.cta_tile(linear, walk_rows, col_tiles, m_tiles)
                    if b_expert >= 0:
                        loads = self.tile_loads(load_args, s_a, s_b, s_b2, tile_row, tile_col, b_expert, s_sa, (b_multicast, shared_b))
                        if cutlass.const_expr(self.gather_a):
                            bases = (storage.s_a.data_ptr(), storage.s_sa.data_ptr())
                            prod = self.gather_tile(ab_pipe, prod, loads, m_x, m_row_token, bases, tile_row, num_rows, tidx, k_tiles)
                        else:
                            prod = self.produce_tile(ab_pipe, prod, loads, k_tiles)
                    linear = self.next_walk(linear, step)
                if cutlass.const_expr(self.tail_split):
                    if first < halves:
                        tile_row, half_col, expert = self.tail_tile(first, whole, walk_rows, m_tiles)
                        if expert >= 0:
                            loads = self.tile_loads(load_args, s_a, s_b, s_b2, tile_row, 0, expert)
                            prod = self.produce_half_tile(ab_pipe, prod, loads, tail, s_b_half, tile_row, half_col, expert, k_tiles)
                if cutlass.const_expr(self.gather_a):
                    cute.arch.cp_async_wait_group(0)
                if warp_idx == 0:
                    ab_pipe.producer_tail(prod)
            if cutlass.const_expr(self.scatter):
                if warp_idx >= 1:  # warps 1-3 copy the MMA warps' epilogue subtiles out to the slots
                    tiles = (first, step, whole, walk_rows, col_tiles, m_tiles, halves)
                    self.scatter_tiles(epi_pipe, s_c, storage.s_dest.get_tensor(cute.make_layout(self.tile_shape_mnk[0])),
                                       tiles, m_row_token, m_row_slot, num_rows, m_x, tidx - 32)
        elif cutlass.const_expr(self.pingpong):  # each MMA warpgroup on its own tiles
            cute.arch.setmaxregister_increase(232)
            tiles = (first, step, whole, walk_rows, col_tiles, m_tiles)
            self.pingpong_consumers(tidx - 128, warp_idx, ab_pipe, tiled_mma, s_a, s_b, s_c, tiles, (store_args, row_args, num_rows))
        else:  # the two MMA warpgroups
            if cutlass.const_expr(self.hands_registers_over):
                cute.arch.setmaxregister_increase(self.register_split[1])
            mma_tidx = tidx - 128
            r_a, r_b, r_b2, acc, acc2 = self.mma_fragments(tiled_mma, mma_tidx, s_a, s_b, s_b2)
            blocks = (None, None)
            issue = (tiled_mma, r_a, r_b, r_b2, None)  # (the MMA the stages are issued with, its operands, stacked: its blocks)
            if cutlass.const_expr(self.block_scaled):  # each K block's product, before its scales (block_buffers sets)
                blocks = tuple(cute.make_rmem_tensor(acc.shape, cutlass.Float32) for _ in range(2 * self.block_buffers))
            if cutlass.const_expr(self.stacked_b):  # one n = 2·tile_n WGMMA a step; gate's and up's blocks are its halves
                pair_r_a, pair_r_b, pair_block = self.mma_operands(tiled_mma_pair, mma_tidx, s_a, s_b_pair, (self.tile_shape_mnk[0],
                                                                                                             2 * self.tile_shape_mnk[1]))[1:]
                pair_blocks = (pair_block,) + tuple(cute.make_rmem_tensor(pair_block.shape, cutlass.Float32) for _ in range(self.block_buffers - 1))
                blocks = sum((self.stacked_blocks(b, acc) for b in pair_blocks), ())
                issue = (tiled_mma_pair, pair_r_a, pair_r_b, pair_r_b, pair_blocks)
                tiled_mma_pair.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
            release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stage)
            store_pipe = self.store_pipeline()
            epi_prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.epi_stage)  # (scatter only)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)  # onto accumulators zeroed per tile
            h_phase = cutlass.Int32(0)  # (h_in_smem: the parity of h_tile's barrier the next tile's loads complete)
            linear = first
            while linear < whole:
                tile_row, tile_col, expert, b_expert, _ = self.cta_tile(linear, walk_rows, col_tiles, m_tiles)
                if b_expert >= 0:
                    acc.fill(0.0)
                    if cutlass.const_expr(self.two_accumulators):
                        acc2.fill(0.0)
                    rows_in = None
                    if cutlass.const_expr(self.h_in_smem):
                        self.load_h_tile(warp_idx, store_args[6:], h_tile, tile_row, tile_col)
                        rows_in = (h_tile[0], *self.router_scales(mma_tidx, tiled_mma, tile_row, row_args, num_rows))
                    else:
                        rows_in = self.load_row_inputs(mma_tidx, tiled_mma, tile_row, tile_col, row_args, num_rows)
                    if cutlass.const_expr(self.block_scaled):
                        cons, release = self.consume_block_scaled_tile(
                            ab_pipe, tiled_mma, (acc, acc2), blocks, issue, k_tiles, cons, release, (s_sa, *b_scales), (b_expert, tile_col),
                            mma_tidx,
                        )
                    else:
                        cons, release = self.consume_tile(ab_pipe, tiled_mma, acc, acc2, r_a, r_b, r_b2, k_tiles, cons, release)
                    if cutlass.const_expr(self.h_in_smem):
                        cute.arch.mbarrier_wait(h_tile[1], h_phase)
                        h_phase = h_phase ^ 1
                    tile = (tile_row, tile_col, expert, rows_in)
                    if cutlass.const_expr(self.cluster_m == PAIR):
                        if expert >= 0:  # (else only the other row tile of the pair has rows: these stages were shared, nothing is stored)
                            epi_prod = self.finish_tile(mma_tidx, warp_idx, tiled_mma, (acc, acc2), s_c, tile, (store_args, row_args, num_rows),
                                                        store_pipe, biases, (epi_pipe, epi_prod))
                    else:
                        epi_prod = self.finish_tile(mma_tidx, warp_idx, tiled_mma, (acc, acc2), s_c, tile, (store_args, row_args, num_rows),
                                                    store_pipe, biases, (epi_pipe, epi_prod))
                linear = self.next_walk(linear, step)
            if cutlass.const_expr(self.tail_split):
                if first < halves:
                    tile_row, half_col, expert = self.tail_tile(first, whole, walk_rows, m_tiles)
                    if expert >= 0:
                        cons, release, epi_prod = self.consume_half_tile(ab_pipe, mma_tidx, warp_idx, tail, acc, s_a, s_b_half, s_c, tile_row,
                                                                         half_col, k_tiles, (cons, release), store_args, store_pipe,
                                                                         (epi_pipe, epi_prod))
            if warp_idx == self.store_warp:
                store_pipe.producer_tail()

    @cute.jit
    def finish_tile(self, mma_tidx, warp_idx, tiled_mma, accs, s_c, tile, epi_args, store_pipe, biases, scatter):
        """MMA warps, after a tile's mainloop: the biases, then its epilogue (``tile`` = (row tile,
        column tile, expert, the epilogue's row inputs); ``epi_args`` = (store_args, row_args,
        num_rows)), or with ``scatter`` the hand-over of its subtiles (``scatter`` = (that pipeline,
        its state)). Returns the scatter pipeline's advanced state."""
        tile_row, tile_col, expert, rows_in = tile
        store_args, row_args, num_rows = epi_args
        acc, acc2 = accs
        epi_pipe, epi_prod = scatter
        self.add_bias(mma_tidx, tiled_mma, accs, biases, expert, tile_col)
        if cutlass.const_expr(self.scatter):
            epi_prod = self.scatter_epilogue(mma_tidx, tiled_mma, acc, s_c, epi_pipe, epi_prod)
        else:
            self.epilogue(mma_tidx, warp_idx, tiled_mma, acc, acc2, s_c, tile_row, tile_col, store_args, row_args, num_rows, store_pipe, rows_in)
        return epi_prod

    def cta_walk(self, num_row_tiles, col_tiles):
        """The persistent CTA's walk: (first, step, end) of the linear tile index it takes (first,
        then :meth:`next_walk` on, below end). With ``cluster_m`` = 2 the index is its cluster's,
        over pairs of row tiles (both CTAs of a cluster walk the same pairs). With E4M3 output the
        index is 2·u + h for half h of unit u = (row tile, pair of column tiles): a CTA takes both
        halves of a unit in turn (:meth:`store_activation_e4m3`)."""
        first, _, _ = cute.arch.block_idx()
        step, _, _ = cute.arch.grid_dim()
        if cutlass.const_expr(self.cluster_m == PAIR):
            return first // PAIR, step // PAIR, (num_row_tiles + PAIR - 1) // PAIR * col_tiles
        if cutlass.const_expr(self.quantizes_out):
            return PAIR * first, step, PAIR * num_row_tiles * self.walk_cols
        return first, step, num_row_tiles * col_tiles

    @property
    def walk_cols(self) -> int:
        """Column units of the walk: the column tiles, or with E4M3 output their pairs (a block each)."""
        return -(-self.col_tiles // PAIR) if self.quantizes_out else self.col_tiles

    def next_walk(self, linear, step):
        """The walk index after ``linear`` (:meth:`cta_walk`): ``step`` on, or with E4M3 output a
        unit's second half after its first, then the first half ``step`` units on."""
        if cutlass.const_expr(self.quantizes_out):
            return linear + 1 + (linear % PAIR) * (PAIR * step - PAIR)
        return linear + step

    @cute.jit
    def cta_tile(self, linear, num_row_tiles, col_tiles, m_tiles):
        """The CTA's tile at walk index ``linear`` (:meth:`cta_walk`): (row tile, column tile, its
        expert (-1: no rows), the expert whose B its stages hold (-1: nothing to compute), whether
        B is loaded for both CTAs of the cluster). In the L2-grouped order (grouped_tile); with
        ``cluster_m`` = 2 over pairs of row tiles, CTA rank r taking row tile 2p + r of pair p, both
        in one column tile: where both rows tiles are one expert's, each CTA loads half of each B
        tile into both (TMA multicast: B read from L2 once for 256 rows); where they are not, each
        loads its own, and a CTA whose row tile has no rows runs the stages on the other's expert
        (its loads and releases keep the two pipelines in step) and stores nothing. A tile's sums
        do not depend on any of this: the same bits as without the cluster."""
        if cutlass.const_expr(self.cluster_m == PAIR):
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            return row_tile_pair(linear, num_row_tiles, col_tiles, m_tiles, rank)
        if cutlass.const_expr(self.quantizes_out):  # (unit, half): column tile 2·pair + half, none past the last
            tile_row, pair = self.grouped_tile(linear // PAIR, num_row_tiles, self.walk_cols)
            tile_col = pair * PAIR + linear % PAIR
            expert = m_tiles[tile_row]
            if tile_col >= col_tiles:
                expert = cutlass.Int32(-1)
            return tile_row, tile_col, expert, expert, False
        tile_row, tile_col = self.grouped_tile(linear, num_row_tiles, col_tiles)
        expert = m_tiles[tile_row]
        return tile_row, tile_col, expert, expert, False

    @cute.jit
    def add_bias(self, tidx, tiled_mma, accs, biases, expert, tile_col):
        """``bias`` (plain, swiglu, swiglu_save): add the expert's bias to each accumulator value of
        this thread, by its column (B's bias to acc, B2's to acc2), before the epilogue: so h keeps
        x·Wᵀ + b and the activation reads it. Loaded after the mainloop, a bf16 pair (32 bits) per
        column pair of the thread, added to each of its rows (column groups past N read nothing)."""
        if cutlass.const_expr(self.bias and self.epilogue_kind != "swiglu_bwd"):
            tile_m, tile_n, _ = self.tile_shape_mnk
            thr = tiled_mma.get_slice(tidx)
            crd = thr.partition_C(cute.make_identity_tensor((tile_m, tile_n)))
            # WGMMA accumulator of a thread: ((2 columns, rows r / r + 8, 8-column groups), row blocks, 1)
            groups, row_blocks = tile_n // 8, cute.size(crd, mode=[1])
            for acc, m_bias in zip(accs[: self.num_b], biases[: self.num_b]):
                pair = cute.make_rmem_tensor(cute.make_layout(2), cutlass.BFloat16)
                for j in cutlass.range_constexpr(groups):
                    col = tile_col * tile_n + crd[(0, 0, j), 0, 0][1]  # (even: the pair is 4-byte aligned)
                    src = cute.make_ptr(cutlass.BFloat16, (m_bias.iterator + (expert * self.n + col)).toint(), cute.AddressSpace.gmem,
                                        assumed_align=4)
                    pair.fill(0.0)
                    if cutlass.const_expr(self.n % tile_n):  # N's partial last tile: nothing read past N
                        if col < self.n:
                            cute.autovec_copy(cute.make_tensor(src, cute.make_layout(2)), pair)
                    else:
                        cute.autovec_copy(cute.make_tensor(src, cute.make_layout(2)), pair)
                    for m in cutlass.range_constexpr(row_blocks):
                        for hi in cutlass.range_constexpr(2):
                            for c in cutlass.range_constexpr(2):
                                acc[(c, hi, j), m, 0] = acc[(c, hi, j), m, 0] + pair[c].to(cutlass.Float32)

    def tail_operands(self, m_a, m_bs):
        """Host side, ``tail_split``: what a half tile takes (:meth:`tail_walk`): the WGMMA 128 rows
        by half the tile's width, B's half-width staged layout with twice the stages (half stage 2s
        is the first half of stage s's buffer: a half tile's B lands where its stage's B would),
        the TMA loads of B's and B2's half-width boxes, and the bytes a half stage brings."""
        tile_m, tile_n, tile_k = self.tile_shape_mnk
        half_shape = (tile_m, tile_n // 2, tile_k)
        tiled_mma = self.wgmma_of_width(m_a, m_bs[0], tile_n // 2)
        b_smem = sm90_utils.make_smem_layout_b(LayoutEnum.from_tensor(m_bs[0]), half_shape, self.ab_dtype, 2 * self.ab_stage)
        loads = (*self.load_atom(m_bs[0], b_smem, half_shape[1:]), *self.load_atom(m_bs[1], b_smem, half_shape[1:]))
        tx_bytes = (tile_m + tile_n // 2) * tile_k * self.ab_dtype.width // 8
        return tiled_mma, b_smem, loads, tx_bytes

    @cute.jit
    def walked_row_tiles(self, m_tiles, num_row_tiles):
        """``bounded_walk``: the row tiles up to the last one with an expert (the schedule's unused
        tiles come last), so that the walk ends with the rows, and its last group of row tiles
        (grouped_tile) holds only tiles with rows: spread over the capacity's rows, that group's
        tiles would stretch the walk (docs/notes/grouped-gemms-vs-quack.md, "The walk's bound").
        Every warp finds it alone: its lanes scan every 32nd entry (four loads in flight), then the
        largest of their answers (butterfly)."""
        last = cutlass.Int32(0)
        for j in cutlass.range(cute.arch.lane_idx(), num_row_tiles, 32, unroll=4):
            if m_tiles[j] >= 0:
                last = j + 1
        for offset in cutlass.range_constexpr(5):
            last = cutlass.max(last, cute.arch.shuffle_sync_bfly(last, offset=1 << offset))
        return last

    @cute.jit
    def tail_walk(self, all_tiles, step):
        """``tail_split``: (tiles walked whole, half tiles after them). Where the walk's last round
        would leave at most half the CTAs busy, its r tiles are taken as 2·r half-width tiles, one
        a CTA, instead: the round takes about half as long. A half tile's WGMMAs give its elements
        the sums the whole tile's give them (m64n128k16 and m64n256k16: the same bits), so who takes
        which tile changes nothing in the result. ``all_tiles``: the walk's (:meth:`cta_walk`)."""
        rest = all_tiles % step
        halves = cutlass.Int32(0)
        if 2 * rest <= step:
            halves = 2 * rest
        return all_tiles - halves // 2, halves

    @cute.jit
    def tail_tile(self, first, whole, walk_rows, m_tiles):
        """``tail_split``: this CTA's half tile (index ``first`` after the ``whole`` tiles walked
        whole): (row tile, half-width column tile, its expert; -1 where the tile has no rows or the
        half starts past N)."""
        tile_row, tile_col = self.grouped_tile(whole + first // 2, walk_rows, self.col_tiles)
        half_col = tile_col * 2 + first % 2
        expert = m_tiles[tile_row]
        if half_col * (self.tile_shape_mnk[1] // 2) >= self.n:
            expert = cutlass.Int32(-1)
        return tile_row, half_col, expert

    @cute.jit
    def produce_half_tile(self, ab_pipe, prod, loads, tail, s_b_half, tile_row, half_col, expert, k_tiles):
        """``tail_split``'s producer (warp 0): a half tile's stages (:meth:`load_stage` with B's
        half-width loads, B2's past K's first half with k_split)."""
        tile_m, tile_n, tile_k = self.tile_shape_mnk
        _, _, (tma_b, m_b, tma_b2, m_b2), tx_bytes = tail
        half_shape = (tile_m, tile_n // 2, tile_k)
        g_b = cute.local_tile(m_b, half_shape, (tile_row, half_col, None, expert), proj=(None, 1, 1))
        g_b2 = cute.local_tile(m_b2, half_shape, (tile_row, half_col, None, expert), proj=(None, 1, 1))
        t_bs, t_bg = self.tma_split(tma_b, s_b_half, g_b)
        half_b = (tma_b, t_bg, tma_b2, self.tma_split(tma_b2, s_b_half, g_b2)[1], t_bs, tx_bytes)
        return self.produce_tile(ab_pipe, prod, loads, k_tiles, half_b)

    @cute.jit
    def consume_half_tile(self, ab_pipe, mma_tidx, warp_idx, tail, acc, s_a, s_b_half, s_c, tile_row, half_col, k_tiles, states,
                          store_args, store_pipe, scatter):
        """``tail_split``'s MMA warpgroups: a half tile's product into the first half of ``acc``'s
        registers (a 128-wide fragment is the first half of a 256-wide one), then its store, or
        with ``scatter`` (that pipeline, its state) its subtiles' hand-over. ``states``: the
        (read, release) states; returns them and the scatter pipeline's."""
        cons, release = states
        epi_pipe, epi_prod = scatter
        tile_m, tile_n, _ = self.tile_shape_mnk
        tiled_mma = tail[0]
        thr_mma = self.warpgroup_slice(tiled_mma, mma_tidx)
        half_acc = cute.make_tensor(acc.iterator, cute.make_layout(thr_mma.partition_C(cute.make_identity_tensor((tile_m, tile_n // 2))).shape))
        r_a = tiled_mma.make_fragment_A(thr_mma.partition_A(s_a))
        r_b = tiled_mma.make_fragment_B(thr_mma.partition_B(s_b_half))
        half_acc.fill(0.0)
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        cons, release = self.consume_tile(ab_pipe, tiled_mma, half_acc, half_acc, r_a, r_b, r_b, k_tiles, cons, release, b_stage_step=2)
        if cutlass.const_expr(self.scatter):
            epi_prod = self.scatter_epilogue(mma_tidx, tiled_mma, half_acc, s_c, epi_pipe, epi_prod, tile_n // 2)
        else:
            tma_c, m_c = store_args[:2]
            g_c = cute.local_tile(m_c[None, None, 0], (tile_m, tile_n // 2), (tile_row, half_col))
            self.store_acc(mma_tidx, warp_idx, tiled_mma, half_acc, s_c, tma_c, g_c, store_pipe)
        return cons, release, epi_prod

    @property
    def stacked_b(self) -> bool:
        """FP8 SwiGLU (block-scaled, two products): gate's and up's B tiles stacked in one 2·tile_n-row
        stage and multiplied by one n = 2·tile_n WGMMA a step, so that A is read from shared memory
        once, not once per product (shared memory's bandwidth bounds the 64-wide FP8 SwiGLU tile:
        docs/notes/fp8-block-hopper.md). Each product's values are their own half of the WGMMA's."""
        return self.block_scaled and self.two_accumulators

    def stack_b(self, m_a, m_b):
        """Host side, ``stacked_b``: the WGMMA over both B tiles (n = 2·tile_n) and their staged layout
        (each stage gate's tile_n rows, then up's: the halves of one K-major tile)."""
        tile_m, tile_n, tile_k = self.tile_shape_mnk
        self.tiled_mma_pair = self.wgmma_of_width(m_a, m_b, 2 * tile_n)
        return sm90_utils.make_smem_layout_b(LayoutEnum.from_tensor(m_b), (tile_m, 2 * tile_n, tile_k), self.ab_dtype, self.ab_stage)

    def stacked_halves(self, s_b_pair):
        """(B's, B2's) stages as views of the stacked buffer (rows [0, tile_n) and [tile_n, 2·tile_n) of each stage)."""
        halves = cute.flat_divide(s_b_pair, (self.tile_shape_mnk[1],))
        return halves[None, 0, None, None], halves[None, 1, None, None]

    def stacked_blocks(self, pair_block, acc):
        """The two products' block accumulators as the halves of the stacked WGMMA's: a thread's values
        of an n = 2·tile_n fragment come 4 per 8 columns in column order, so gate's tile_n columns are
        its first half and up's its second, each laid out as one tile_n-wide product's fragment."""
        half = cute.size(acc)
        return cute.make_tensor(pair_block.iterator, acc.layout), cute.make_tensor(pair_block.iterator + half, acc.layout)

    def second_b(self, storage, b_smem, s_b):
        """B2's shared-memory tile: its own buffer for SwiGLU's second product, else B's (k_split loads B2 there)."""
        if cutlass.const_expr(self.num_b == 2):
            return storage.s_b2.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        return s_b

    def tile_loads(self, load_args, s_a, s_b, s_b2, tile_row, tile_col, expert, s_sa=None, multicast=((), False)):
        """What ``load_stage`` needs for one output tile: the TMA atoms and their smem/gmem partitions
        (``block_scaled``: A's row scales too, into ``s_sa``; ``cluster_m`` = 2: last, whether B is
        loaded for both CTAs and this CTA's half of B's and B2's multicast loads, from ``multicast``
        = (their atoms and tensors, that flag))."""
        tma_a, m_a, tma_b, m_b, tma_b2, m_b2 = load_args[:6]
        g_a = cute.local_tile(m_a, self.tile_shape_mnk, (tile_row, tile_col, None, 0), proj=(1, None, 1))
        g_b = cute.local_tile(m_b, self.tile_shape_mnk, (tile_row, tile_col, None, expert), proj=(None, 1, 1))
        g_b2 = cute.local_tile(m_b2, self.tile_shape_mnk, (tile_row, tile_col, None, expert), proj=(None, 1, 1))
        t_as, t_ag = self.tma_split(tma_a, s_a, g_a)
        t_ag2 = t_ag  # k_split: A's second half (the K tiles of dh_up)
        if cutlass.const_expr(self.k_split):
            g_a2 = cute.local_tile(m_a, self.tile_shape_mnk, (tile_row, tile_col, None, 1), proj=(1, None, 1))
            t_ag2 = self.tma_split(tma_a, s_a, g_a2)[1]
        t_bs, t_bg = self.tma_split(tma_b, s_b, g_b)
        t_b2s, t_b2g = self.tma_split(tma_b2, s_b2, g_b2)
        loads = (tma_a, t_ag, t_as, tma_b, t_bg, t_bs, tma_b2, t_b2g, t_b2s, t_ag2)
        if cutlass.const_expr(self.block_scaled and not self.gather_a):
            loads += self.a_scale_loads(*load_args[6:8], s_sa, tile_row)
        if cutlass.const_expr(self.cluster_m == PAIR):
            (tma_b_mc, m_b_mc, tma_b2_mc, m_b2_mc), shared_b = multicast
            rank = (cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster()), PAIR)
            g_b_mc = cute.local_tile(m_b_mc, self.tile_shape_mnk, (tile_row, tile_col, None, expert), proj=(None, 1, 1))
            g_b2_mc = cute.local_tile(m_b2_mc, self.tile_shape_mnk, (tile_row, tile_col, None, expert), proj=(None, 1, 1))
            t_bs_mc, t_bg_mc = self.tma_split(tma_b_mc, s_b, g_b_mc, rank)
            t_b2s_mc, t_b2g_mc = self.tma_split(tma_b2_mc, s_b2, g_b2_mc, rank)
            loads += ((shared_b, tma_b_mc, t_bg_mc, t_bs_mc, tma_b2_mc, t_b2g_mc, t_b2s_mc),)
        return loads

    def mma_fragments(self, tiled_mma, mma_tidx, s_a, s_b, s_b2):
        """The warpgroup's WGMMA views of the A, B and B2 stages and two fp32 accumulators (not zeroed)."""
        thr_mma, r_a, r_b, acc = self.mma_operands(tiled_mma, mma_tidx, s_a, s_b)
        r_b2 = tiled_mma.make_fragment_B(thr_mma.partition_B(s_b2))
        return r_a, r_b, r_b2, acc, cute.make_rmem_tensor(acc.shape, cutlass.Float32)

    @cute.jit
    def load_stage(self, ab_pipe, prod, loads, half_b=None):
        """Warp 0: wait for a free stage, then TMA-load the next A tile and B tile(s) into it.
        ``half_b`` (``tail_split``'s half tile): B's and B2's half-width loads instead (atoms, gmem
        partitions, the half-width staged buffer, the bytes a half stage brings), into the first
        half of the stage's B buffer, the stage's barrier armed for those bytes."""
        tma_a, t_ag, t_as, t_ag2 = loads[0], loads[1], loads[2], loads[9]  # (t_ag2: k_split's second half of A)
        if cutlass.const_expr(half_b is None):
            ab_pipe.producer_acquire(prod)
        else:
            ab_pipe.sync_object_empty.wait(prod.index, prod.phase)
            ab_pipe.sync_object_full.arrive_and_expect_tx(prod.index, half_b[5])
        bar = ab_pipe.producer_get_barrier(prod)
        k_tile = prod.count
        self.load_k_tile((tma_a, t_ag), (tma_a, t_ag2), t_as[(None, prod.index)], k_tile, bar)
        if cutlass.const_expr(half_b is None):
            self.load_b(prod, loads, k_tile, bar)
        else:  # (half stage 2s is the first half of stage s's buffer)
            tma_b, t_bg, tma_b2, t_b2g, t_bs = half_b[:5]
            self.load_k_tile((tma_b, t_bg), (tma_b2, t_b2g), t_bs[(None, 2 * prod.index)], k_tile, bar)
        if cutlass.const_expr(self.block_scaled and not self.gather_a):  # the K block's row scales (k_split: K counts on through the second half)
            tma_sa, t_sag, t_sas = loads[10:13]
            cute.copy(tma_sa, t_sag[(None, k_tile)], t_sas[(None, prod.index)], tma_bar_ptr=bar)
        ab_pipe.producer_commit(prod)

    @cute.jit
    def load_b(self, prod, loads, k_tile, bar):
        """TMA-load the B tile(s) of K tile ``k_tile`` into stage ``prod.index`` (``cluster_m`` = 2,
        where both CTAs' row tiles are one expert's: this CTA's half of each, into both CTAs)."""
        if cutlass.const_expr(self.cluster_m == PAIR):
            shared_b = loads[-1][0]
            if shared_b:
                both = cute.make_layout_image_mask(cute.make_layout((PAIR, 1, 1)), (0, 0, 0), mode=0)  # (the cluster's two CTAs)
                self.load_b_tiles(prod, loads[-1][1:], k_tile, bar, both)
            else:
                self.load_b_tiles(prod, loads[3:9], k_tile, bar)
        else:
            self.load_b_tiles(prod, loads[3:9], k_tile, bar)

    @cute.jit
    def load_b_tiles(self, prod, b_loads, k_tile, bar, mcast_mask=None):
        """:meth:`load_b` with ``b_loads`` = B's and B2's (atom, gmem partition, smem partition);
        ``mcast_mask``: the CTAs a multicast load writes."""
        tma_b, t_bg, t_bs, tma_b2, t_b2g, t_b2s = b_loads
        self.load_k_tile((tma_b, t_bg), (tma_b2, t_b2g), t_bs[(None, prod.index)], k_tile, bar, mcast_mask)
        if cutlass.const_expr(self.num_b == 2 and not self.k_split):
            if cutlass.const_expr(mcast_mask is None):
                cute.copy(tma_b2, t_b2g[(None, k_tile)], t_b2s[(None, prod.index)], tma_bar_ptr=bar)
            else:
                cute.copy(tma_b2, t_b2g[(None, k_tile)], t_b2s[(None, prod.index)], tma_bar_ptr=bar, mcast_mask=mcast_mask)

    @cute.jit
    def load_k_tile(self, first, second, dst, k_tile, bar, mcast_mask=None):
        """TMA-load K tile ``k_tile`` of one operand into ``dst``: from ``first`` (TMA atom, its gmem
        partition), or with k_split the K tiles of K's second half from ``second``, each half's
        tiles bounded at K/2 (their last one zero-filled past it); ``mcast_mask``: a multicast
        load's CTAs."""
        multicast = {} if mcast_mask is None else {"mcast_mask": mcast_mask}
        if cutlass.const_expr(self.k_split):
            half = self.half_k_tiles
            if k_tile < half:
                cute.copy(first[0], first[1][(None, k_tile)], dst, tma_bar_ptr=bar, **multicast)
            else:
                cute.copy(second[0], second[1][(None, k_tile - half)], dst, tma_bar_ptr=bar, **multicast)
        else:
            cute.copy(first[0], first[1][(None, k_tile)], dst, tma_bar_ptr=bar, **multicast)

    @cute.jit
    def gather_tile(self, ab_pipe, prod, loads, m_x, m_row_token, bases, tile_row, num_rows, tidx, k_tiles):
        """Producer warpgroup, ``gather_a``: fill one tile's ``k_tiles`` stages, B by TMA (warp 0)
        and A's 128 rows by cp.async from x, returning the advanced pipeline state. ``bases``: the
        A stages' shared memory (and the row scales' with ``block_scaled``: then ``m_x`` is x's
        E4M3 rows and their scales [K / 128, T], thread t copying row t's scale of each K block).

        The rows' copies: mok/kernels/common/row_gather.py (padding rows zero-filled, so the
        backward never sees garbage there). (Keeping 32-bit offsets instead of the rows' 64-bit
        addresses, which spares the producer's registers a 16-byte spill, measured 4-6% slower.)
        """
        tile_m, _, tile_k = self.tile_shape_mnk
        a_base, sa_base = bases
        m_sa = None
        if cutlass.const_expr(self.block_scaled):
            m_x, m_sa = m_x
        addresses, rows_read = gathered_rows(m_x, m_row_token, tile_row, num_rows, tidx, tile_m, self.k, 16 * 8 // self.ab_dtype.width)
        scale_src, scale_bytes = cutlass.Int64(0), cutlass.Int32(0)
        if cutlass.const_expr(self.block_scaled):  # thread t: row t's scale (its token's, column k_tile of [K / 128, T])
            scale_token = cutlass.Int32(-1)
            if tile_row * tile_m + tidx < num_rows:
                scale_token = m_row_token[tile_row * tile_m + tidx]
            scale_bytes = cutlass.Int32(scale_token >= 0) * 4
            scale_src = (m_sa.iterator + cutlass.max(scale_token, 0)).toint()
        prod.reset_count()
        for k_tile in cutlass.range(k_tiles, unroll=1):
            ab_pipe.sync_object_empty.wait(prod.index, prod.phase)
            if tidx < 32:  # warp 0 arms the stage's byte count and loads B
                ab_pipe.sync_object_full.arrive(prod.index, ab_pipe.producer_mask)
                self.load_b(prod, loads, k_tile, ab_pipe.producer_get_barrier(prod))
            gather_stage(a_base, prod.index, addresses, rows_read, k_tile, self.ab_dtype, tidx, tile_m, tile_k, self.k)
            if cutlass.const_expr(self.block_scaled):
                tokens = cute.size(m_sa, mode=[0])
                src = cute.make_ptr(cutlass.Float32, scale_src + cutlass.Int64(k_tile) * tokens * 4, cute.AddressSpace.gmem, assumed_align=4)
                copy_async_4b(sa_base + (prod.index * tile_m + tidx), src, scale_bytes)
            cute.arch.cp_async_mbarrier_arrive_noinc(ab_pipe.producer_get_barrier(prod))
            prod.advance()
        return prod

    def scatter_pipeline(self, storage):
        """``scatter``: epilogue subtiles handed from the MMA warps (they fill the epilogue buffers)
        to the producer warpgroup's warps 1-3 (they copy them out), ``epi_stage`` buffers deep."""
        return pipeline.PipelineAsync.create(
            barrier_storage=storage.epi_mbar.data_ptr(),
            num_stages=self.epi_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.consumer_threads),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, SCATTER_THREADS),
            defer_sync=True,
        )

    @cute.jit
    def scatter_epilogue(self, tidx, tiled_mma, acc, s_c, epi_pipe, epi_prod, width: cutlass.Constexpr[int] = 0):
        """``scatter``, MMA warps: the tile (``width`` columns of it: a tail split's half; 0: all) as
        bf16 into the next free epilogue buffers, one 128 x 32 subtile each (the values and rounding
        of the plain epilogue); returns the advanced state."""
        tiled_r2s, t_sd, t_acc, rd_layout = self.epilogue_views(tiled_mma, tidx, s_c, acc)
        per_epi = cute.size(rd_layout)
        r_d = cute.make_rmem_tensor_like(rd_layout, cutlass.Float32)
        r_out = cute.make_rmem_tensor_like(rd_layout, self.c_dtype)
        for epi in cutlass.range_constexpr((width or self.tile_shape_mnk[1]) // SCATTER_COLS):
            for v in cutlass.range_constexpr(per_epi):
                r_d[v] = t_acc[epi * per_epi + v]
            r_out.store(r_d.load().to(self.c_dtype))
            epi_pipe.producer_acquire(epi_prod)
            cute.copy(tiled_r2s, r_out, t_sd[(None, None, None, epi_prod.index)])
            epi_pipe.producer_commit(epi_prod)
            epi_prod.advance()
        return epi_prod

    @cute.jit
    def scatter_tiles(self, epi_pipe, s_c, s_dest, tiles, m_row_token, m_row_slot, num_rows, m_dst, tid):
        """``scatter``, producer warps 1-3 (``tid`` 0..95): walk the CTA's tiles as the MMA warps do
        and copy each one out (:meth:`scatter_tile`). ``tiles``: (first, step, end of the walk, its
        row tiles, column tiles, the tiles' experts, ``tail_split``'s half tiles after it)."""
        first, step, whole, walk_rows, col_tiles, m_tiles, halves = tiles
        cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.epi_stage)
        linear = first
        while linear < whole:
            tile_row, tile_col, expert, _, _ = self.cta_tile(linear, walk_rows, col_tiles, m_tiles)
            if expert >= 0:
                cons = self.scatter_tile(epi_pipe, cons, s_c, s_dest, tile_row, tile_col, m_row_token, m_row_slot, num_rows, m_dst, tid)
            linear += step
        if cutlass.const_expr(self.tail_split):
            if first < halves:
                tile_row, half_col, expert = self.tail_tile(first, whole, walk_rows, m_tiles)
                if expert >= 0:
                    cons = self.scatter_tile(epi_pipe, cons, s_c, s_dest, tile_row, half_col, m_row_token, m_row_slot, num_rows, m_dst, tid,
                                             self.tile_shape_mnk[1] // 2)

    @cute.jit
    def scatter_tile(self, epi_pipe, cons, s_c, s_dest, tile_row, tile_col, m_row_token, m_row_slot, num_rows, m_dst, tid,
                     width: cutlass.Constexpr[int] = 0):
        """``scatter``, producer warps 1-3, one tile (``width`` columns wide, column tile ``tile_col``
        of that width: a tail split's half; 0: the tile's): each row's first vector in the slots
        (GroupedGemm.slot_vector; -1 for padding rows) into ``s_dest``, then per subtile copy the handed-over buffer
        out, 16 bytes per store. A thread copies the same chunk of the same rows in every subtile,
        their destinations read into registers once a tile: the copy is bound by these three warps'
        issue rate (docs/notes/expert-parallel-exchange.md). Returns the advanced epilogue-pipeline state."""
        m_vecs = m_dst[0]
        tile_m = self.tile_shape_mnk[0]
        tile_n = width or self.tile_shape_mnk[1]
        per_row = SCATTER_COLS // VECTOR
        self.scatter_sync()  # the previous tile's destinations are read no more
        for r in cutlass.range(tid, tile_m, SCATTER_THREADS, unroll=1):
            s_dest[r] = self.slot_vector(tile_row * tile_m + r, num_rows, m_row_token, m_row_slot, m_dst)
        self.scatter_sync()
        # this thread's rows: row0 + rows_per_pass·j, its chunk of each (16 bytes), the same in every
        # subtile; their vector indices in column 0 are read once a tile (-1: none, or past the tile)
        rows_per_pass = SCATTER_THREADS // per_row
        passes = (tile_m + rows_per_pass - 1) // rows_per_pass
        chunk = tid % per_row
        row0 = tid // per_row
        vectors = cute.make_rmem_tensor(cute.make_layout(passes), cutlass.Int32)
        for j in cutlass.range_constexpr(passes):
            vector = cutlass.Int32(-1)
            if row0 + rows_per_pass * j < tile_m:
                first = s_dest[row0 + rows_per_pass * j]
                if first >= 0:
                    vector = first + chunk
            vectors[j] = vector
        for epi in cutlass.range(tile_n // SCATTER_COLS, unroll=1):
            epi_pipe.consumer_wait(cons)
            col_vectors = tile_col * (tile_n // VECTOR) + epi * (SCATTER_COLS // VECTOR)
            col_ok = True
            if cutlass.const_expr(self.n % tile_n):  # N's partial last tile: no vector past N
                col_ok = (col_vectors + chunk) * VECTOR < self.n
            for j in cutlass.range_constexpr(passes):
                if vectors[j] >= 0:
                    if col_ok:
                        src = cute.zipped_divide(s_c[row0 + rows_per_pass * j, None, cons.index], (VECTOR,))[None, chunk]
                        dst = m_vecs[None, vectors[j] + col_vectors]
                        cute.arch.store(dst.iterator, src.load(), cop="cs")  # streaming: y is read once, by the combine
            epi_pipe.consumer_release(cons)
            cons.advance()
        return cons

    def scatter_sync(self):
        """Barrier 2 over the producer warpgroup's warps 1-3 only (scattering or copying A's rows)."""
        cute.arch.barrier(barrier_id=2, number_of_threads=SCATTER_THREADS)

    @cute.jit
    def load_row_inputs(self, tidx, tiled_mma, tile_row, tile_col, row_args, num_rows):
        """swiglu_bwd: what the epilogue reads from global memory besides the accumulator, all
        loads issued at once before the tile's mainloop: this thread's values of the saved h_gate
        and h_up (bf16 pairs as 32-bit loads, laid out like its accumulator; 0 past the last row)
        and the router weights of its two rows. Other epilogues: None (nothing to load).

        (Loaded inside the epilogue one bf16 at a time, between its subtile barriers, they made
        this GEMM up to 2.8x slower than the down projection of the same FLOPs; this way it is
        27% faster at qwen3's shapes. Issued after the mainloop they measure the same: the
        mainloop does not hide them — docs/notes/pingpong-backward-gemms.md.)
        """
        rows_in = None
        if cutlass.const_expr(self.epilogue_kind == "swiglu_bwd"):
            m_h = row_args[0]
            tile_m, tile_n, _ = self.tile_shape_mnk
            thr = tiled_mma.get_slice(tidx)  # per thread (see the epilogue's coordinates)
            crd = thr.partition_C(cute.make_identity_tensor((tile_m, tile_n)))
            t_gate = thr.partition_C(self.half_tile(m_h, 0, tile_row, tile_col))
            t_up = thr.partition_C(self.half_tile(m_h, 1, tile_row, tile_col))
            r_gate = cute.make_rmem_tensor(crd.shape, cutlass.BFloat16)
            r_up = cute.make_rmem_tensor(crd.shape, cutlass.BFloat16)
            first_row = tile_row * tile_m
            rows_left = num_rows - first_row
            cols_left = self.n - tile_col * tile_n
            if rows_left >= tile_m and cols_left >= tile_n:
                cute.autovec_copy(t_gate, r_gate)
                cute.autovec_copy(t_up, r_up)
            else:  # a partial tile: the buffer's last (the shared expert's T rows) or N's last
                for i in cutlass.range_constexpr(cute.size(r_gate)):
                    r_gate[i] = cutlass.BFloat16(0.0)
                    r_up[i] = cutlass.BFloat16(0.0)
                    if crd[i][0] < rows_left:
                        if crd[i][1] < cols_left:
                            r_gate[i] = t_gate[i]
                            r_up[i] = t_up[i]
            rows_in = (r_gate, r_up, *self.router_scales(tidx, tiled_mma, tile_row, row_args, num_rows))
        return rows_in

    @property
    def h_in_smem(self) -> bool:
        """swiglu_bwd on FP8 with two block sets: the tile's saved h comes into shared memory by TMA
        while its mainloop runs and the epilogue reads it with ldmatrix, a subtile at a time (its 64
        registers a thread beside the two sets and the running sums would spill, and loaded from
        global memory after the mainloop, 32-bit loads by every thread, it held the tensor cores up
        longer than any other part of the epilogue); the other forms load it into registers before
        the mainloop (:meth:`load_row_inputs`)."""
        return self.block_scaled and self.block_buffers == 2 and self.epilogue_kind == "swiglu_bwd"

    @cute.jit
    def load_h_tile(self, warp_idx, h_load, h_tile, tile_row, tile_col):
        """h_in_smem, MMA warps before a tile's mainloop: one thread TMA-loads the tile's h (gate's
        subtiles into buffers 0.., up's after them) and arms ``h_tile``'s barrier with their bytes.
        The buffers are free: every MMA thread read the last tile's before its last store barrier.
        Rows past the last and columns past N come in as zeros (TMA's fill), as load_row_inputs
        gives them."""
        tma, m_h = h_load
        s_h, bar = h_tile
        if warp_idx == self.store_warp:
            subtiles = self.tile_shape_mnk[1] // self.epi_tile[1]
            cute.arch.fence_proxy("async.shared", space="cta")  # (the buffers' generic reads before the async proxy's writes)
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(bar, 2 * cute.size_in_bytes(self.c_dtype, cute.slice_(s_h, (None, None, 0))) * subtiles)
            for half in cutlass.range_constexpr(2):  # (the whole warp: a TMA copy elects its issuing thread itself)
                g_epi, _, order = self.epi_order(self.half_tile(m_h, half, tile_row, tile_col))
                b_sd, b_gd = cute.nvgpu.cpasync.tma_partition(tma, 0, cute.make_layout(1), cute.group_modes(s_h, 0, 2), g_epi)
                for epi in cutlass.range_constexpr(subtiles):
                    cute.copy(tma, b_gd[(None, order.get_hier_coord(epi))], b_sd[(None, half * subtiles + epi)], tma_bar_ptr=bar)

    @cute.jit
    def router_scales(self, tidx, tiled_mma, tile_row, row_args, num_rows):
        """swiglu_bwd: the router weights of this thread's two rows of the tile (0 past the last row)."""
        _, _, m_row_token, m_row_slot, m_topk_w = row_args
        row_lo = tile_row * self.tile_shape_mnk[0] + tiled_mma.get_slice(tidx).partition_C(cute.make_identity_tensor(self.tile_shape_mnk[:2]))[0][0]
        return (self.row_scale(row_lo, num_rows, m_row_token, m_row_slot, m_topk_w),
                self.row_scale(row_lo + 8, num_rows, m_row_token, m_row_slot, m_topk_w))

    @cute.jit
    def epilogue(
        self, tidx, warp_idx, tiled_mma, acc, acc2, s_c, tile_row, tile_col, store_args, row_args, num_rows, store_pipe, rows_in=None
    ):
        """Registers -> epilogue math -> bf16 -> shared memory (stmatrix) -> global memory (TMA store).

        ``tidx`` counts the MMA threads from 0; ``rows_in``: :meth:`load_row_inputs` of the tile
        (swiglu_bwd). Every tile starts again at buffer 0 of the store pipeline: a tile stores a
        multiple of ``epi_stage`` subtiles, so that is the buffer the round-robin order reaches
        next anyway.
        """
        tma_c, m_c, tma_h, m_h_store, tma_as, m_as = store_args[:6]
        m_part = row_args[1]  # (the row inputs themselves come in rows_in)
        tile_m, tile_n, _ = self.tile_shape_mnk
        tiled_r2s, t_sd, t_acc, rd_layout = self.epilogue_views(tiled_mma, tidx, s_c, acc)
        t_acc2 = tiled_r2s.retile(acc2)
        per_epi = cute.size(rd_layout)
        r_d = cute.make_rmem_tensor_like(rd_layout, cutlass.Float32)
        r_u = cute.make_rmem_tensor_like(rd_layout, cutlass.Float32)
        r_x = cute.make_rmem_tensor_like(rd_layout, cutlass.Float32)

        g_c = self.half_tile(m_c, 0, tile_row, tile_col)
        g_c2 = g_c  # swiglu_bwd: dh_up goes to the right half of dh
        g_h_gate = g_c
        g_h_up = g_c
        g_as = g_c
        if cutlass.const_expr(self.epilogue_kind == "swiglu_bwd"):
            g_c2 = self.half_tile(m_c, 1, tile_row, tile_col)
            g_as = cute.local_tile(m_as, (tile_m, tile_n), (tile_row, tile_col))
        if cutlass.const_expr(self.epilogue_kind == "swiglu_save"):
            g_h_gate = self.half_tile(m_h_store, 0, tile_row, tile_col)
            g_h_up = self.half_tile(m_h_store, 1, tile_row, tile_col)

        # swiglu_bwd: the row in the tile of each accumulator value, and the prefetched h, in
        # registers laid out like the accumulator so that the epilogue's retiling reorders them
        # alike. The slice is per thread (the MMA's own slice is per warpgroup). The WGMMA
        # accumulator gives each thread rows r and r + 8 of its warp's 16.
        crd = tiled_mma.get_slice(tidx).partition_C(cute.make_identity_tensor((tile_m, tile_n)))
        r_row = cute.make_rmem_tensor_like(acc, cutlass.Int32)
        t_gate = t_up = None
        s_lo = cutlass.Float32(0.0)
        s_hi = cutlass.Float32(0.0)
        h_views = None  # h_in_smem: (the ldmatrix copy, this thread's h buffers, its registers for a subtile's h_gate and h_up)
        if cutlass.const_expr(self.epilogue_kind == "swiglu_bwd"):
            for i in cutlass.range_constexpr(cute.size(acc)):
                r_row[i] = crd[i][0]
            if cutlass.const_expr(self.h_in_smem):
                s_h, s_lo, s_hi = rows_in
                h_views = self.h_smem_views(tidx, tiled_mma, s_h, rd_layout)
            else:
                r_gate, r_up, s_lo, s_hi = rows_in
                t_gate = tiled_r2s.retile(r_gate)
                t_up = tiled_r2s.retile(r_up)
        t_row = tiled_r2s.retile(r_row)
        row_lo = crd[0][0]
        first_row = tile_row * tile_m
        sum_lo = cutlass.Float32(0.0)
        sum_hi = cutlass.Float32(0.0)

        _, epi_count, _ = self.epi_order(g_c)
        stores = 0
        for epi in cutlass.range_constexpr(epi_count):
            for v in cutlass.range_constexpr(per_epi):
                r_d[v] = t_acc[epi * per_epi + v]
                if cutlass.const_expr(self.two_accumulators):
                    r_u[v] = t_acc2[epi * per_epi + v]
            if cutlass.const_expr(self.epilogue_kind == "swiglu_bwd"):
                if cutlass.const_expr(self.h_in_smem):
                    tiled_s2r, t_sh, r_hg, r_hu = h_views
                    cute.copy(tiled_s2r, t_sh[(None, None, None, epi)], tiled_s2r.get_slice(tidx).retile(r_hg))
                    cute.copy(tiled_s2r, t_sh[(None, None, None, epi_count + epi)], tiled_s2r.get_slice(tidx).retile(r_hu))
                for v in cutlass.range_constexpr(per_epi):
                    row_in_tile = t_row[epi * per_epi + v]
                    if cutlass.const_expr(self.h_in_smem):
                        h_g = r_hg[v].to(cutlass.Float32)
                        h_u = r_hu[v].to(cutlass.Float32)
                    else:
                        h_g = t_gate[epi * per_epi + v].to(cutlass.Float32)
                        h_u = t_up[epi * per_epi + v].to(cutlass.Float32)
                    d_a = r_d[v]  # dA_u: dout·W_down for this row's token, not yet scaled
                    r_d[v], r_u[v], r_x[v], sum_lo, sum_hi = self.swiglu_backward_value(
                        d_a, h_g, h_u, row_in_tile == row_lo, (s_lo, s_hi), (sum_lo, sum_hi)
                    )
                self.store_fragment(r_d.load(), tiled_r2s, t_sd, s_c, tma_c, g_c, epi, stores % self.epi_stage, warp_idx, store_pipe, rd_layout)
                self.store_fragment(r_u.load(), tiled_r2s, t_sd, s_c, tma_c, g_c2, epi, (stores + 1) % self.epi_stage, warp_idx, store_pipe, rd_layout)
                self.store_fragment(r_x.load(), tiled_r2s, t_sd, s_c, tma_as, g_as, epi, (stores + 2) % self.epi_stage, warp_idx, store_pipe, rd_layout)
                stores += 3
            elif cutlass.const_expr(self.two_accumulators):
                gate = r_d.load()
                up = r_u.load()
                if cutlass.const_expr(not self.quantizes_out):
                    self.swiglu_subtile(r_d, r_u, r_x)
                    self.store_fragment(r_x.load(), tiled_r2s, t_sd, s_c, tma_c, g_c, epi, stores % self.epi_stage, warp_idx, store_pipe, rd_layout)
                    stores += 1
                if cutlass.const_expr(self.epilogue_kind == "swiglu_save"):
                    self.store_fragment(gate, tiled_r2s, t_sd, s_c, tma_h, g_h_gate, epi, stores % self.epi_stage, warp_idx, store_pipe, rd_layout)
                    self.store_fragment(up, tiled_r2s, t_sd, s_c, tma_h, g_h_up, epi, (stores + 1) % self.epi_stage, warp_idx, store_pipe, rd_layout)
                    stores += 2
            else:
                self.store_fragment(r_d.load(), tiled_r2s, t_sd, s_c, tma_c, g_c, epi, stores % self.epi_stage, warp_idx, store_pipe, rd_layout)
                stores += 1
        if cutlass.const_expr(self.quantizes_out):  # (a leaves in E4M3 after h's stores, which the loop above issued)
            self.store_activation_e4m3(tidx, warp_idx, tiled_mma, (acc, acc2), (tile_row, tile_col), store_args, num_rows, stores)

        if cutlass.const_expr(self.epilogue_kind == "swiglu_bwd" and not self.unit_scale):
            self.store_row_sum(tidx, sum_lo, first_row + row_lo, tile_col, m_part, num_rows)
            self.store_row_sum(tidx, sum_hi, first_row + row_lo + 8, tile_col, m_part, num_rows)

    @cute.jit
    def store_activation_e4m3(self, tidx, warp_idx, tiled_mma, accs, tile, store_args, num_rows, later_stores):
        """``out_format`` "e4m3_block": the tile's a = act(gate, up), rounded to bf16 as the bf16
        output is, leaves as E4M3 with a 1 x 128 block scale per row (mok.fp8_block's rule on
        those bf16 values: bit for bit what the rows' quantizer makes of the bf16 output).

        A block is two 64-wide column tiles, which one CTA takes in turn (:meth:`cta_walk`). The
        first (even) parks its bf16 values in the pair buffer, each thread in 16-byte slots of its
        own; the second reads them back, takes each row's largest magnitude over both (its own
        values, then the quad's four threads), converts both halves, stages them in the buffer as
        an E4M3 operand stage is laid out (128-byte swizzle) and TMA-stores the 128 x 128 box; the
        quad's first thread writes its two rows' scales (C's scales [ceil(N / 128), R]). The last
        column tile of an odd count is its block alone (N's partial last block: its values there
        are). Rows past R are neither stored (TMA clips) nor scaled. ``tile`` = (row tile, column
        tile); ``store_args[6:8]`` = (C's scales, the pair buffer); ``later_stores``: the TMA store
        groups this tile committed before (h's), which need not be read out before the buffer is
        reused: only the box older than them.

        a is rounded to bf16 in pairs (the packed conversion), and a half's row maxima come from its
        fp32 values, rounded once: bf16 rounding is monotonic and odd, so the largest |bf16(a)| is
        bf16 of the largest |a|, the same bits."""
        acc, acc2 = accs
        tile_row, tile_col = tile
        tma_q, t_q = store_args[0], store_args[1]
        m_scales, s_pair = store_args[6], store_args[7]
        tile_m, tile_n, _ = self.tile_shape_mnk
        crd = tiled_mma.get_slice(tidx).partition_C(cute.make_identity_tensor((tile_m, tile_n)))
        count = cute.size(acc)
        a_f32 = cute.make_rmem_tensor(cute.make_layout(count), cutlass.Float32)
        self.swiglu_subtile(acc, acc2, a_f32)  # (the whole tile's values at once)
        packed = cute.make_rmem_tensor(cute.make_layout(count // 2), cutlass.Uint32)
        for p in cutlass.range_constexpr(count // 2):
            packed[p] = bf16x2_rounded(a_f32[2 * p], a_f32[2 * p + 1])
        a_bf16 = cute.make_tensor(cute.recast_tensor(packed, cutlass.BFloat16).iterator, cute.make_layout((PARK_VALUES, count // PARK_VALUES)))
        # each thread's slots: 16 bytes (8 bf16) apart by thread, so a warp's stores are conflict-free
        parked = cute.make_tensor(cute.recast_ptr(s_pair.iterator, dtype=cutlass.BFloat16) + tidx * PARK_VALUES,
                                  cute.make_layout((PARK_VALUES, count // PARK_VALUES), stride=(1, self.consumer_threads * PARK_VALUES)))
        second = tile_col % PAIR == 1
        if tile_col % PAIR == 0 and tile_col + 1 < self.col_tiles:  # the block's first half: parked until the second
            if warp_idx == self.store_warp:  # (the buffer's last box read out by its TMA store)
                cute.arch.cp_async_bulk_wait_group(later_stores, read=True)
            self.epilogue_sync()
            cute.autovec_copy(a_bf16, parked)
        else:
            earlier = cute.make_rmem_tensor_like(a_bf16)
            earlier.fill(0.0)
            if second:
                cute.autovec_copy(parked, earlier)
            elif warp_idx == self.store_warp:  # (a block alone: the buffer's last box read out by its TMA store)
                cute.arch.cp_async_bulk_wait_group(later_stores, read=True)
            self.epilogue_sync()  # (every thread's parked values read before the buffer is overwritten)
            amax = cute.make_rmem_tensor(cute.make_layout(2), cutlass.Float32)  # rows r, r + 8 of the thread
            amax.fill(0.0)
            for i in cutlass.range_constexpr(count):
                hi = (i // 2) % 2  # the accumulator's ((2 columns, 2 rows, groups), ...) order
                amax[hi] = cute.arch.fmax(amax[hi], cute.math.absf(a_f32[i]))
            for hi in cutlass.range_constexpr(2):  # (this half's largest |bf16(a)|: see the docstring)
                amax[hi] = amax[hi].to(cutlass.BFloat16).to(cutlass.Float32)
            flat = cute.make_tensor(earlier.iterator, cute.make_layout(count))  # (zeros for a block alone)
            for i in cutlass.range_constexpr(count):
                hi = (i // 2) % 2
                amax[hi] = cute.arch.fmax(amax[hi], cute.math.absf(flat[i].to(cutlass.Float32)))
            factors = cute.make_rmem_tensor(cute.make_layout(2), cutlass.Float32)
            row_lo = crd[0][0]
            for hi in cutlass.range_constexpr(2):
                for offset in cutlass.range_constexpr(2):  # the quad's four threads hold the row's other columns
                    amax[hi] = cute.arch.fmax(amax[hi], cute.arch.shuffle_sync_bfly(amax[hi], offset=1 << offset))
                scale, factors[hi] = block_scale_and_factor(amax[hi], self.power_of_two)
                row = tile_row * tile_m + row_lo + 8 * hi
                if tidx % 4 == 0 and row < num_rows:
                    m_scales[row, tile_col // PAIR] = scale
            self.stage_e4m3(a_bf16, factors, crd, tile_col % PAIR, s_pair)
            if second:
                self.stage_e4m3(earlier, factors, crd, 0, s_pair)
            cute.arch.fence_proxy("async.shared", space="cta")
            self.epilogue_sync()
            if warp_idx == self.store_warp:
                g_q = cute.local_tile(t_q[None, None, 0], (tile_m, SCALE_BLOCK), (tile_row, tile_col // PAIR))
                b_sd, b_gd = cute.nvgpu.cpasync.tma_partition(tma_q, 0, cute.make_layout(1), cute.group_modes(s_pair, 0, 2),
                                                              cute.group_modes(g_q, 0, 2))
                cute.copy(tma_q, b_sd, b_gd)
                cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def stage_e4m3(self, values, factors, crd, half, s_pair):
        """One 64-wide half (``half`` of the block) of a thread's a values (bf16, the accumulator's
        order) times its rows' ``factors``, as E4M3 pairs into the pair buffer at their place in
        an E4M3 stage's 128-byte swizzle (row_gather.swizzled_128b)."""
        tile_n = self.tile_shape_mnk[1]
        count = cute.size(values)
        flat = cute.make_tensor(values.iterator, cute.make_layout(count))
        scaled = cute.make_rmem_tensor(cute.make_layout(count), cutlass.Float32)
        for i in cutlass.range_constexpr(count):
            scaled[i] = flat[i].to(cutlass.Float32) * factors[(i // 2) % 2]
        q = cute.make_rmem_tensor(cute.make_layout(count), cutlass.Float8E4M3FN)
        q.store(scaled.load().to(cutlass.Float8E4M3FN))
        pairs = cute.recast_tensor(q, cutlass.Uint16)
        s_pairs = cute.make_tensor(cute.recast_ptr(s_pair.iterator, dtype=cutlass.Uint16), cute.make_layout(cute.cosize(s_pair.layout) // 2))
        for p in cutlass.range_constexpr(count // 2):
            row, col = crd[2 * p]
            byte = half * tile_n + col  # (even: a pair's two E4M3 bytes are one 16-bit store)
            s_pairs[(swizzled_128b(row, byte // 16, 16, SCALE_BLOCK) + byte % 16) // 2] = pairs[p]

    def h_smem_views(self, tidx, tiled_mma, s_h, rd_layout):
        """h_in_smem: the ldmatrix copy that reads a subtile of h from its buffer in the layout the
        epilogue's stmatrix writes (so value v of a subtile is the accumulator's value v), this
        thread's view of the buffers, and registers for one subtile's h_gate and h_up."""
        ldmatrix = cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(self.c_layout.is_m_major_c(), 4), self.c_dtype)
        tiled_s2r = cute.make_tiled_copy_S(ldmatrix, self.epilogue_threads(tiled_mma))
        t_sh = tiled_s2r.get_slice(tidx).partition_S(s_h)
        return tiled_s2r, t_sh, cute.make_rmem_tensor(rd_layout, self.c_dtype), cute.make_rmem_tensor(rd_layout, self.c_dtype)

    def half_tile(self, m_x, half, tile_row, tile_col):
        """Output tile (tile_row, tile_col) of half ``half`` of a (R, N, halves) tensor (C, h: common/gemm_args.halves)."""
        return cute.local_tile(m_x[None, None, half], self.tile_shape_mnk[:2], (tile_row, tile_col))

    @cute.jit
    def store_row_sum(self, tidx, total, row, tile_col, m_part, num_rows):
        """swiglu_bwd: the four threads of a quad hold parts of the same row: add their sums in a
        fixed butterfly order (every lane ends with the same value); lane 0 of the quad writes
        partial[row, tile_col] (rows past the end: nothing)."""
        for offset in cutlass.range_constexpr(2):
            total = total + cute.arch.shuffle_sync_bfly(total, offset=1 << offset)
        if tidx % 4 == 0:
            if row < num_rows:
                m_part[row, tile_col] = total

    @cute.jit
    def pingpong_tile(self, linear, tiles):
        """Ping-pong: tile ``linear``'s K tiles (0 for an unused row tile: the producer skips it
        too), whether it has an output, and (row tile, column tile)."""
        tile_row, tile_col = self.grouped_tile(linear, tiles[3], tiles[4])
        expert = tiles[5][tile_row]
        k_tiles = cutlass.Int32(0)
        if expert >= 0:
            k_tiles = cutlass.Int32(self.k_tiles)
        return k_tiles, expert >= 0, (tile_row, tile_col)

    @cute.jit
    def pingpong_epilogue(self, tidx, warp_idx, tiled_mma, acc, s_c, store_pipe, group, first_buf, tile, epi_args):
        """Ping-pong swiglu_bwd: one warpgroup's epilogue of a whole 128-row tile, the values of
        ``epilogue`` (the same bits). A thread holds 128 accumulators, so h is read one subtile
        at a time after the mainloop, the next subtile's loads in flight during this one's math
        (the outputs held as bf16 leave the registers for that: as fp32, ptxas spilled); the
        thread's rows are r, r + 8, r + 64 and r + 72 of the tile (two 64-row blocks)."""
        tile_row, tile_col = tile
        store_args, row_args, num_rows = epi_args
        tma_c, m_c, _, _, tma_as, m_as = store_args
        m_h, m_part, m_row_token, m_row_slot, m_topk_w = row_args
        tile_m, tile_n, _ = self.tile_shape_mnk
        g_c = self.half_tile(m_c, 0, tile_row, tile_col)
        g_c2 = self.half_tile(m_c, 1, tile_row, tile_col)  # dh_up: the right half
        g_as = cute.local_tile(m_as, (tile_m, tile_n), (tile_row, tile_col))
        tiled_r2s, t_sd, t_acc, rd_layout = self.epilogue_views(tiled_mma, tidx, s_c, acc)
        per_group, row_blocks = cute.size(rd_layout, mode=[0]), cute.size(rd_layout, mode=[1])
        block_rows = tile_m // row_blocks

        thr = tiled_mma.get_slice(tidx)  # per thread
        crd = thr.partition_C(cute.make_identity_tensor((tile_m, tile_n)))
        h_gate = thr.partition_C(self.half_tile(m_h, 0, tile_row, tile_col))
        h_up = thr.partition_C(self.half_tile(m_h, 1, tile_row, tile_col))
        r_gate = cute.make_rmem_tensor(crd.shape, cutlass.BFloat16)  # (filled one subtile at a time)
        r_up = cute.make_rmem_tensor(crd.shape, cutlass.BFloat16)
        r_row = cute.make_rmem_tensor_like(acc, cutlass.Int32)
        for i in cutlass.range_constexpr(cute.size(acc)):
            r_row[i] = crd[i][0]
        t_gate, t_up, t_row = tiled_r2s.retile(r_gate), tiled_r2s.retile(r_up), tiled_r2s.retile(r_row)

        first_row = tile_row * tile_m
        row_lo = crd[0][0]
        r_scale = cute.make_rmem_tensor((2, row_blocks), cutlass.Float32)  # (row r / r + 8, row block)
        r_sum = cute.make_rmem_tensor((2, row_blocks), cutlass.Float32)
        for m in cutlass.range_constexpr(row_blocks):
            for hi in cutlass.range_constexpr(2):
                row = first_row + row_lo + block_rows * m + 8 * hi
                r_scale[hi, m] = self.row_scale(row, num_rows, m_row_token, m_row_slot, m_topk_w)
                r_sum[hi, m] = cutlass.Float32(0.0)

        # the three outputs rounded to bf16 as they are computed (half the registers of fp32),
        # which leaves room for the next subtile's h to be in flight during this one's math
        r_d = cute.make_rmem_tensor_like(rd_layout, self.c_dtype)
        r_u = cute.make_rmem_tensor_like(rd_layout, self.c_dtype)
        r_x = cute.make_rmem_tensor_like(rd_layout, self.c_dtype)
        _, epi_count, _ = self.epi_order(g_c)
        first = (first_row, tile_col * tile_n)
        self.load_h_subtile(h_gate, h_up, r_gate, r_up, crd, 0, first, num_rows)
        for epi in cutlass.range_constexpr(epi_count):
            if cutlass.const_expr(epi + 1 < epi_count):
                self.load_h_subtile(h_gate, h_up, r_gate, r_up, crd, epi + 1, first, num_rows)
            for i in cutlass.range_constexpr(cute.size(rd_layout)):
                at = self.acc_index(rd_layout, epi, i)
                m = (i // per_group) % row_blocks
                d_a = t_acc[at]  # dA_u: dout·W_down for this row's token, not yet scaled
                h_g = t_gate[at].to(cutlass.Float32)
                h_u = t_up[at].to(cutlass.Float32)
                is_lo = t_row[at] == row_lo + block_rows * m
                d_gate, d_up, a_scaled, r_sum[0, m], r_sum[1, m] = self.swiglu_backward_value(
                    d_a, h_g, h_u, is_lo, (r_scale[0, m], r_scale[1, m]), (r_sum[0, m], r_sum[1, m])
                )
                r_d[i], r_u[i], r_x[i] = d_gate.to(self.c_dtype), d_up.to(self.c_dtype), a_scaled.to(self.c_dtype)
            for j, (values, tma, g_out) in enumerate(((r_d, tma_c, g_c), (r_u, tma_c, g_c2), (r_x, tma_as, g_as))):
                buf = first_buf + (3 * epi + j) % self.epi_stage
                self.store_fragment(values.load(), tiled_r2s, t_sd, s_c, tma, g_out, epi, buf, warp_idx, store_pipe, rd_layout, group)

        if cutlass.const_expr(not self.unit_scale):
            for m in cutlass.range_constexpr(row_blocks):
                for hi in cutlass.range_constexpr(2):
                    self.store_row_sum(tidx, r_sum[hi, m], first_row + row_lo + block_rows * m + 8 * hi, tile_col, m_part, num_rows)

    @cute.jit
    def load_h_subtile(self, h_gate, h_up, r_gate, r_up, crd, epi, first, num_rows):
        """Ping-pong swiglu_bwd: this thread's saved h_gate and h_up of epilogue subtile ``epi``
        (columns 32·epi..) into the registers laid out like its accumulator, bf16 pairs as
        32-bit loads; zeros for rows past the end (a partial last tile: one branch per row,
        not a second copy of the loads) and, where N is not a multiple of the tile, for the
        8-column groups past N. ``first``: the tile's first (row, column)."""
        # WGMMA accumulator of a thread: ((2 columns, rows r / r + 8, 8-column groups), row blocks, 1)
        first_row, first_col = first
        groups = SCATTER_COLS // 8  # 8-column groups per subtile
        row_blocks = cute.size(crd, mode=[1])
        if cutlass.const_expr(self.n % self.tile_shape_mnk[1]):  # N's partial last tile: per column group, rows < 0 past N
            for j in cutlass.range_constexpr(groups):
                rows_of_group = num_rows * cutlass.Int32(first_col + 8 * (groups * epi + j) < self.n)
                for m in cutlass.range_constexpr(row_blocks):
                    for hi in cutlass.range_constexpr(2):
                        row = first_row + crd[0][0] + self.tile_shape_mnk[0] // row_blocks * m + 8 * hi
                        at = ((None, hi, groups * epi + j), m, 0)
                        if row < rows_of_group:
                            cute.autovec_copy(h_gate[at], r_gate[at])
                            cute.autovec_copy(h_up[at], r_up[at])
                        else:
                            r_gate[at].fill(0.0)
                            r_up[at].fill(0.0)
        else:
            for m in cutlass.range_constexpr(row_blocks):
                for hi in cutlass.range_constexpr(2):
                    row = first_row + crd[0][0] + self.tile_shape_mnk[0] // row_blocks * m + 8 * hi
                    if row < num_rows:
                        for j in cutlass.range_constexpr(groups):
                            at = ((None, hi, groups * epi + j), m, 0)
                            cute.autovec_copy(h_gate[at], r_gate[at])
                            cute.autovec_copy(h_up[at], r_up[at])
                    else:
                        for j in cutlass.range_constexpr(groups):
                            at = ((None, hi, groups * epi + j), m, 0)
                            r_gate[at].fill(0.0)
                            r_up[at].fill(0.0)


def compile_grouped_gemm(n: int, k: int, arch: str, options: str = "", **config):
    """Compile :class:`GroupedGemmSm90` (``config``: its keyword arguments) for ``arch`` without
    tensors: the stand-ins of grouped_gemm_args(its operand)."""
    return compile_kernel(GroupedGemmSm90(n, k, **config), grouped_gemm_args(config.get("operand", "bf16"), config.get("out_format", "bf16")),
                          arch, options)
