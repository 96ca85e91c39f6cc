"""Per-expert weight gradients for Blackwell (sm_100a / sm_103a): a K-grouped tcgen05 GEMM over the
expert-grouped rows, accumulating in tensor memory.

    out[e] (+)= A[rows of e]ᵀ · B[rows of e]        out [E, M, N], A [R, M] (row stride >= M), B [R, N]

The contract (rows, counts, accumulate, split_out, the tile order, determinism, the launch
arguments) is every arch's: mok/kernels/common/weight_grad.py. Here: both operands read MN-major
by TMA, in the warp-specialised kernel of mok/kernels/sm100/tcgen05_tile.py (persistent, or one CTA
per output tile of 128 x tile_n); on bf16 operands with at least two row tiles in each half of M,
CTA pairs (clusters of two) compute 256 x tile_n tiles with tcgen05.mma.cta_group::2, each CTA
holding its 128 rows of A and half of B's tile (an odd last row tile: the pair's second CTA
computes rows past M and writes none of them); each epilogue thread converts (or adds) its row of
the tile, 32 columns at a time, with
16-byte accesses; ``accumulate`` reads, adds to and writes back each element by the one thread
that owns it (the same single fp32 addition as the Hopper kernel's TMA reduce-add). On bf16
operands, or on MXFP8 ones (block-scaled MMAs: WeightGradGemmMxfp8Sm100). Compiled for sm_100a /
sm_103a and its PTX checked (tests/test_kernels_ptx.py); never run: no SM100 GPU was available to
this project (tests/test_sm100_gpu.py is for one).
"""

import cutlass
import cutlass.cute as cute

from ..common.compile import compile_kernel
from ..common.records import weight_grad_args
from ..common.weight_grad import OUT_DTYPES, WeightGradGemm, expert_tile
from .tcgen05_tile import EPI_COLS, PAIR, TILE_K, TILE_K_MXFP8, Tcgen05TileKernel, pick_mxfp8_stages, pick_stages


class WeightGradGemmSm100(WeightGradGemm, Tcgen05TileKernel):
    """Static config: M, N, output dtype, accumulate, A's row stride, column tile, split_out, stages,
    persistent."""

    aligned_halves = True  # split_out's halves lie a multiple of 16 bytes apart (the launcher checks): 16-byte stores
    partial_tiles = True  # M (each half's) and N past the tile: TMA zero-fills the loads, the epilogue writes nothing past them

    def __init__(
        self, m: int, n: int, out_dtype: str = "bf16", accumulate: bool = False, *, a_stride: int | None = None,
        tile_n: int = 128, stages: int | None = None, split_out: bool = False, persistent: bool = False,
        mma_ctas: int | None = None, interleaved_out: bool = False,
    ) -> None:
        self.configure(m, n, out_dtype, accumulate, a_stride, tile_n, TILE_K, split_out, interleaved_out)
        self.persistent = persistent
        self.pick_mma_ctas(mma_ctas)
        self.ab_stage = pick_stages((self.tile_shape_mnk[0] + tile_n // self.mma_ctas) * TILE_K * 2, stages)

    def pick_mma_ctas(self, mma_ctas: int | None) -> None:
        """CTAs per MMA: ``mma_ctas`` (1 or 2), or by default a pair wherever it may run
        (Tcgen05TileKernel.pair_reason) and each half of M has two row tiles or more (fewer: half
        of a pair would compute nothing)."""
        if mma_ctas not in (None, 1, PAIR):
            raise ValueError(f"mma_ctas: expected 1, 2 or None (the kernel's choice), got {mma_ctas}")
        if mma_ctas is None:
            mma_ctas = PAIR if self.pair_reason() is None and self.row_tiles >= PAIR else 1
        self.use_pair(mma_ctas == PAIR)
        self.mma_row_tiles = -(-self.row_tiles // self.mma_ctas)  # MMA tiles along each half of M

    def all_tiles(self, num_experts):
        """MMA tiles of every expert's gradient (a pair's 256 rows count once)."""
        return num_experts * self.halves * self.mma_row_tiles * self.col_tiles

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
        if self.mxfp8:  # the scales of A [R, M] and B [R, N] along the rows, in the MMA's order
            scale_tensors = (self.scale_tensor(scales[0], self.m, num_rows, 1), (self.scale_tensor(scales[1], self.n, num_rows, 1),))
        tiled_mma, layouts, loads = self.prepare("mn", "mn", m_a, (m_b,), *scale_tensors)
        all_tiles = self.all_tiles(num_experts)
        self.launch_kernel(self.kernel(tiled_mma, layouts, loads, m_c, upper_first, rows, num_rows, all_tiles), all_tiles, max_ctas, stream)

    @cute.kernel
    def kernel(
        self, tiled_mma: cute.TiledMma, smem_layouts: tuple, loads: tuple, m_c: cute.Tensor, upper_first: cutlass.Int32, rows: tuple,
        num_rows: cutlass.Int32, all_tiles: cutlass.Int32,
    ):
        """The CTA's output tiles (Tcgen05TileKernel.run_tiles), each of one expert; ``smem_layouts``:
        the staged layouts of A and B (MXFP8: and of their scales), ``loads``: the TMA atoms and
        coordinate tensors of A and B (MXFP8: then of their scales)."""
        self.run_tiles(tiled_mma, smem_layouts, loads, (all_tiles, rows, num_rows), (m_c, upper_first))

    @cute.jit
    def tile_at(self, linear, tiles):
        """MMA tile ``linear`` -> (computed: always (an expert without rows gets zeros, or is left
        as it was), K tiles, (expert, half of M, this CTA's row tile in it, column tile, first K
        tile))."""
        _, rows, num_rows = tiles
        tile_k = self.tile_shape_mnk[2]
        expert, mma_row, tile_col, row_start, k_tiles = expert_tile(
            linear, rows, num_rows, (self.halves * self.mma_row_tiles, self.col_tiles), tile_k
        )
        half = mma_row // self.mma_row_tiles if self.split_out else 0
        in_half = (mma_row - half * self.mma_row_tiles) * self.mma_ctas + self.rank_in_pair()
        return True, k_tiles, (expert, half, in_half, tile_col, row_start // tile_k)  # (offsets: multiples of 128)

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
        """Each thread's row of the tile, 32 columns at a time: accumulator stage ``stage`` (zeros for
        an expert without rows, whose MMAs never ran) converted to the output dtype, or added into
        it. ``epi_args`` = (the output, upper_first)."""
        m_c, upper_first = epi_args
        expert, half, in_half, tile_col, _ = tile
        tile_m, tile_n, _ = self.tile_shape_mnk
        g_c = self.out_tile(m_c, upper_first, expert, half * self.row_tiles + in_half, tile_col)
        has_rows = k_tiles > 0
        t2r, thr, src, _ = self.accumulator_reader(tidx, t_acc, stage)
        dst = self.thread_view(thr, g_c)
        m_half = self.m // self.halves
        row_ok = True  # (a partial last row tile of a half, or a pair's second tile past it: rows past it are not written)
        if cutlass.const_expr(m_half % tile_m or self.row_tiles % self.mma_ctas):
            coords = self.thread_view(thr, cute.local_tile(cute.make_identity_tensor((m_half, self.n)), (tile_m, tile_n), (in_half, tile_col)))
            row_ok = coords[0][0] < m_half  # 32x32b: all of a thread's values lie in one row
        partial = self.n % tile_n != 0  # N's last column tile: nothing read or written past N
        out_dtype = OUT_DTYPES[self.out_dtype]
        r_acc = cute.make_rmem_tensor(dst[(None, None, None, 0, 0)].shape, cutlass.Float32)
        r_out = cute.make_rmem_tensor(r_acc.shape, out_dtype)
        for sub in cutlass.range(tile_n // EPI_COLS, unroll=1):
            cols_left = self.n - (tile_col * tile_n + sub * EPI_COLS)
            if cutlass.const_expr(self.accumulate):
                if has_rows:  # (without rows nothing is added: the gradient stays as it was)
                    cute.copy(t2r, src[(None, None, None, 0, sub)], r_acc)
                    if row_ok:
                        self.copy_row_part(dst[(None, None, None, 0, sub)], r_out, cols_left, partial)
                    cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld
                    r_out.store(r_out.load() + r_acc.load())
                    if row_ok:
                        self.copy_row_part(r_out, dst[(None, None, None, 0, sub)], cols_left, partial)
            else:
                r_acc.fill(0.0)
                if has_rows:
                    cute.copy(t2r, src[(None, None, None, 0, sub)], r_acc)
                    cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld
                r_out.store(r_acc.load().to(out_dtype))
                if row_ok:
                    self.copy_row_part(r_out, dst[(None, None, None, 0, sub)], cols_left, partial)


class WeightGradGemmMxfp8Sm100(WeightGradGemmSm100):
    """The weight gradients on MXFP8 operands (block-scaled tcgen05 MMAs, kind::mxf8f6f4):

        out[e] (+)= (A ⊙ SA)[rows of e]ᵀ · (B ⊙ SB)[rows of e]

    A [R, M] (row stride ``a_stride``: a column slice of a wider matrix) and B [R, N] hold E4M3
    elements in their own row-major layout (MN-major for this product), quantized along the rows (their K: a scale per 32 rows of a column, as
    mok.ops.quantize_mxfp8_columns gives them); SA and SB in the MMA's scale order
    ([ceil(M / 128), R / 128, 512]). R a multiple of 128, every expert's first row too (the
    schedule's offsets are); 128-row K tiles. Outputs as the bf16 kernel's (fresh bf16 / fp32, or
    added into fp32; split_out). Compile-verified only, never run (no SM100 GPU here)."""

    mxfp8 = True
    partial_tiles = False  # (whole tiles: the scales' layout)

    def __init__(self, m: int, n: int, out_dtype: str = "bf16", accumulate: bool = False, *, a_stride: int | None = None,
                 tile_n: int = 128, stages: int | None = None, split_out: bool = False, persistent: bool = False) -> None:
        if tile_n not in (128, 256):
            raise ValueError(f"tile_n: expected 128 or 256 with MXFP8 operands, got {tile_n}")
        if a_stride is not None and a_stride % 16:
            raise ValueError(f"a_stride: expected a multiple of 16 (bytes of E4M3) with MXFP8 operands, got {a_stride}")
        super().__init__(m, n, out_dtype, accumulate, a_stride=a_stride, tile_n=tile_n, split_out=split_out, persistent=persistent)
        self.tile_shape_mnk = (self.tile_shape_mnk[0], tile_n, TILE_K_MXFP8)
        self.ab_stage = pick_mxfp8_stages(self.tile_shape_mnk[0] + tile_n, stages)


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
