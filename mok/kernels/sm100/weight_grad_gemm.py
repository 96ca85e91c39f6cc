"""Per-expert weight gradients for Blackwell (sm_100a / sm_103a): a K-grouped tcgen05 GEMM over the
expert-grouped rows, accumulating in tensor memory.

    out[e] (+)= A[rows of e]ᵀ · B[rows of e]        out [E, M, N], A [R, M] (row stride >= M), B [R, N]

The contract (rows, counts, accumulate, split_out, the tile order, determinism, the launch
arguments) is every arch's: mok/kernels/common/weight_grad.py. Here: both operands read MN-major
by TMA, in the warp-specialised kernel of mok/kernels/sm100/tcgen05_tile.py (persistent, or one CTA
per output tile of 128 x tile_n); on bf16 operands with at least two row tiles in each half of M,
CTA pairs (clusters of two) compute 256 x tile_n tiles with tcgen05.mma.cta_group::2, each CTA
holding its 128 rows of A and half of B's tile (an odd last row tile: the pair's second CTA
computes rows past M and writes none of them); the epilogue stages the tile 128 x 32 at a time
in shared memory (two buffers) and stores it by TMA, ``accumulate`` by a TMA reduce-add into the
fp32 gradient (one fp32 addition per element, by the tile's only owner, as on Hopper); the TMA
clips rows and columns past M and N. On bf16
operands, or on MXFP8 ones (block-scaled MMAs: WeightGradGemmMxfp8Sm100). Compiled for sm_100a /
sm_103a and its PTX checked (tests/test_kernels_ptx.py); never run: no SM100 GPU was available to
this project (tests/test_sm100_gpu.py is for one).
"""

import cutlass
import cutlass.cute as cute

from ..common.compile import compile_kernel
from ..common.records import weight_grad_args
from ..common.weight_grad import OUT_DTYPES, WeightGradGemm
from .tcgen05_tile import (
    E4M3_ROW_STEP, EPI_COLS, PAIR, STORE_BUFFERS, TILE_K, TILE_K_MXFP8, Tcgen05TileKernel, pick_mxfp8_stages, pick_stages,
)


class WeightGradGemmSm100(WeightGradGemm, Tcgen05TileKernel):
    """Static config: M, N, output dtype, accumulate, A's row stride, column tile, split_out, stages,
    persistent."""

    partial_tiles = True  # M (each half's) and N past the tile: TMA zero-fills the loads and clips the stores

    def __init__(
        self, m: int, n: int, out_dtype: str = "bf16", accumulate: bool = False, *, a_stride: int | None = None,
        tile_n: int = 128, stages: int | None = None, split_out: bool = False, persistent: bool = False,
        mma_ctas: int | None = None, interleaved_out: bool = False,
    ) -> None:
        self.configure(m, n, out_dtype, accumulate, a_stride, tile_n, TILE_K, split_out, interleaved_out)
        self.persistent = persistent
        self.store_dtype = OUT_DTYPES[out_dtype]  # (stored, or reduce-added, by TMA)
        self.pick_mma_ctas(mma_ctas)
        self.ab_stage = pick_stages((self.tile_shape_mnk[0] + tile_n // self.mma_ctas) * TILE_K * 2, stages, self.store_bytes())

    def pick_mma_ctas(self, mma_ctas: int | None) -> None:
        """CTAs per MMA: ``mma_ctas`` (1 or 2), or by default a pair wherever it may run
        (Tcgen05TileKernel.pair_reason) and each half of M has two row tiles or more (fewer: half
        of a pair would compute nothing)."""
        if mma_ctas not in (None, 1, PAIR):
            raise ValueError(f"mma_ctas: expected 1, 2 or None (the kernel's choice), got {mma_ctas}")
        if mma_ctas is None:
            mma_ctas = PAIR if self.pair_reason() is None and self.row_tiles >= PAIR else 1
        self.use_pair(mma_ctas == PAIR)
        self.mma_row_tiles = -(-self.row_tiles // self.mma_ctas)

    def operand_tensor(self, ptr, mn, row_stride, num_rows):
        """(MN, K = R, 1): MN-major, the rows ``row_stride`` elements apart."""
        return cute.make_tensor(ptr, cute.make_layout((mn, num_rows, 1), stride=(1, row_stride, row_stride * num_rows)))

    def a_operand(self, ptr, num_rows):
        """A as (M / halves, R, halves): split_out's halves (dh_gate, dh_up) each bounded at M/2,
        so a partial last row tile of the first stops there instead of reading the second."""
        m_half = self.m // self.halves
        return cute.make_tensor(ptr, cute.make_layout((m_half, num_rows, self.halves), stride=(1, self.a_stride, m_half)))

    def launch(self, m_a, m_b, scales, m_c, upper_first, rows, num_rows, num_experts, max_ctas, stream):
        """Host side (see WeightGradGemm.launch): MXFP8's scale tensors, the TMA loads, the grid."""
        scale_tensors = ()
        if self.mxfp8:  # the scales of A [R, M] and B [R, N] along the rows, in the MMA's order (A's: each half's chunks)
            a_rows = self.halves * self.row_tiles * self.tile_shape_mnk[0]
            scale_tensors = (self.scale_tensor(scales[0], a_rows, num_rows, 1), (self.scale_tensor(scales[1], self.n, num_rows, 1),))
        tiled_mma, layouts, loads = self.prepare("mn", "mn", m_a, (m_b,), *scale_tensors)
        atom, t_c = self.store_atom(m_c, reduce_add=self.accumulate)
        all_tiles = self.all_tiles(num_experts)
        kernel = self.kernel(tiled_mma, layouts, loads, (t_c, upper_first, atom), rows, num_rows, all_tiles)
        self.launch_kernel(kernel, all_tiles, max_ctas, stream)

    @cute.kernel
    def kernel(
        self, tiled_mma: cute.TiledMma, smem_layouts: tuple, loads: tuple, out: tuple, rows: tuple, num_rows: cutlass.Int32,
        all_tiles: cutlass.Int32,
    ):
        """The CTA's output tiles (Tcgen05TileKernel.run_tiles), each of one expert; ``smem_layouts``:
        the staged layouts of A and B (MXFP8: and of their scales), ``loads``: the TMA atoms and
        coordinate tensors of A and B (MXFP8: then of their scales), ``out``: the output's TMA
        coordinate tensor, upper_first (split_out) and the store's atom."""
        self.run_tiles(tiled_mma, smem_layouts, loads, (all_tiles, rows, num_rows), out)

    @cute.jit
    def tile_at(self, linear, tiles):
        """MMA tile ``linear`` -> (computed: always (an expert without rows gets zeros, or is left
        as it was), K tiles, (expert, half of M, this CTA's row tile in it, column tile, first K
        tile))."""
        _, rows, num_rows = tiles
        expert, mma_row, tile_col, row_start, k_tiles = self.tile_of(linear, rows, num_rows)
        half = mma_row // self.mma_row_tiles if self.split_out else 0
        in_half = (mma_row - half * self.mma_row_tiles) * self.mma_ctas + self.rank_in_pair()
        return True, k_tiles, (expert, half, in_half, tile_col, row_start // self.tile_shape_mnk[2])  # (offsets: multiples of 128)

    def tma_views(self, tiled_mma, loads, stages, tile):
        """(atom, global by K tile, shared by stage) for A and B (MXFP8: then for their scales), and
        the expert's first K tile: what ``load_stage`` reads."""
        _, half, in_half, tile_col, k_first = tile
        views = (
            self.operand_view(tiled_mma, loads[0], stages[0], "a", in_half // self.mma_ctas, half),
            self.operand_view(tiled_mma, loads[1], stages[1], "b", tile_col, 0),
        )
        if cutlass.const_expr(self.mxfp8):
            views += (
                self.operand_view(tiled_mma, loads[2], stages[3], "a", half * self.row_tiles + in_half, 0, scales=True),
                self.operand_view(tiled_mma, loads[3], stages[4], "b", tile_col, 0, scales=True),
            )
        return views + (k_first,)

    @cute.jit
    def load_stage(self, empty, views):
        """TMA-load the expert's K tile ``empty.count`` (64 rows; MXFP8: 128, and their scales) of A
        and B into stage ``empty.index``."""
        k_tile = views[-1] + empty.count
        for operand in cutlass.range_constexpr(len(views) - 1):
            atom, g_x, s_x = views[operand]
            cute.copy(atom, g_x[(None, k_tile)], s_x[(None, empty.index)], tma_bar_ptr=empty.barrier)

    @cute.jit
    def epilogue(self, tidx, t_acc, stage, tile, k_tiles, epi_args):
        """The tile, 32 columns at a time: accumulator stage ``stage`` (zeros for an expert without
        rows, whose MMAs never ran) staged in shared memory in the output dtype and stored by TMA,
        or, accumulating, added into the output by a TMA reduce-add (the same single fp32 addition
        per element; an expert without rows adds nothing: its gradient stays as it was). The TMA
        clips what lies past M (each half's) and N. ``epi_args`` = (the output's TMA coordinate
        tensor, upper_first, the store atom, the staging buffers)."""
        t_c, upper_first, atom, s_store = epi_args
        expert, half, in_half, tile_col, _ = tile
        tile_m, tile_n, _ = self.tile_shape_mnk
        g_tile = self.out_tile(t_c, upper_first, expert, half * self.row_tiles + in_half, tile_col)
        store = (atom, cute.flat_divide(g_tile, (tile_m, EPI_COLS)))
        t2r, thr, src, _ = self.accumulator_reader(tidx, t_acc, stage)
        r_acc = cute.make_rmem_tensor(self.thread_view(thr, g_tile)[(None, None, None, 0, 0)].shape, cutlass.Float32)
        has_rows = k_tiles > 0
        if has_rows or not self.accumulate:  # (the same for every epilogue thread: the tile's stores and barriers all or none)
            for sub in cutlass.range(tile_n // EPI_COLS, unroll=1):
                r_acc.fill(0.0)
                if has_rows:
                    cute.copy(t2r, src[(None, None, None, 0, sub)], r_acc)
                    cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld
                self.store_subtile(tidx, t2r, r_acc, s_store, store, sub, sub % STORE_BUFFERS)


class WeightGradGemmMxfp8Sm100(WeightGradGemmSm100):
    """The weight gradients on MXFP8 operands (block-scaled tcgen05 MMAs, kind::mxf8f6f4):

        out[e] (+)= (A ⊙ SA)[rows of e]ᵀ · (B ⊙ SB)[rows of e]

    A [R, M] (row stride ``a_stride``: a column slice of a wider matrix) and B [R, N] hold E4M3
    elements in their own row-major layout (MN-major for this product), quantized along the rows (their K: a scale per 32 rows of a column, as
    mok.ops.quantize_mxfp8_columns gives them); SA and SB in the MMA's scale order
    ([ceil(M / 128), R / 128, 512]; with split_out each half's ceil(M / 256) chunks in turn,
    quantize_mxfp8_columns(segments=2)). R a multiple of 128, every expert's first row too (the
    schedule's offsets are); 128-row K tiles. M and N multiples of 16 (16-byte E4M3 rows; each
    half of M with split_out): the last row and column tiles may be partial, as the bf16 kernel's
    (their scales' padding rows multiply only the rows and columns the stores clip). Outputs as
    the bf16 kernel's (fresh bf16 / fp32, or added into fp32; split_out). Compile-verified only,
    never run (no SM100 GPU here)."""

    mxfp8 = True

    def __init__(self, m: int, n: int, out_dtype: str = "bf16", accumulate: bool = False, *, a_stride: int | None = None,
                 tile_n: int = 128, stages: int | None = None, split_out: bool = False, persistent: bool = False) -> None:
        if tile_n not in (128, 256):
            raise ValueError(f"tile_n: expected 128 or 256 with MXFP8 operands, got {tile_n}")
        halves = 2 if split_out else 1
        if m % (halves * E4M3_ROW_STEP) or n % E4M3_ROW_STEP or (a_stride is not None and a_stride % E4M3_ROW_STEP):
            raise ValueError(f"(m, n, a_stride): expected multiples of ({halves * E4M3_ROW_STEP}, {E4M3_ROW_STEP}, {E4M3_ROW_STEP}) "
                             f"(16-byte E4M3 rows) with MXFP8 operands, got ({m}, {n}, {a_stride})")
        super().__init__(m, n, out_dtype, accumulate, a_stride=a_stride, tile_n=tile_n, split_out=split_out, persistent=persistent)
        self.tile_shape_mnk = (self.tile_shape_mnk[0], tile_n, TILE_K_MXFP8)
        self.ab_stage = pick_mxfp8_stages(self.tile_shape_mnk[0] + tile_n, stages, self.store_bytes())


def compile_weight_grad_sm100(
    m: int, n: int, out_dtype: str, accumulate: bool, arch: str, options: str = "", *, operand: str = "bf16",
    pingpong: bool = False, **config
):
    """Compile :class:`WeightGradGemmSm100` (``operand`` "bf16") or :class:`WeightGradGemmMxfp8Sm100`
    ("e4m3"), ``config`` their keyword arguments, for ``arch`` (sm_100a or sm_103a) without tensors:
    the stand-ins of weight_grad_args(operand, out_dtype). ``pingpong`` (Hopper's two MMA
    warpgroups taking tiles in turn, so that one's epilogue runs under the other's MMAs) is what
    this kernel does anyway, through two accumulator stages: it changes nothing here."""
    kernel = (WeightGradGemmMxfp8Sm100 if operand == "e4m3" else WeightGradGemmSm100)(m, n, out_dtype, accumulate, **config)
    return compile_kernel(kernel, weight_grad_args(operand, out_dtype), arch, options)
