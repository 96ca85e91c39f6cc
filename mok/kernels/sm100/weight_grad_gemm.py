"""Per-expert weight gradients for Blackwell (sm_100a / sm_103a): a K-grouped tcgen05 GEMM over the
expert-grouped rows, accumulating in tensor memory.

    out[e] (+)= A[rows of e]ᵀ · B[rows of e]        out [E, M, N], A [R, M] (row stride >= M), B [R, N]

The Hopper kernel's contract (mok/kernels/sm90/weight_grad_gemm.py): expert e's rows are
``offsets[e] .. offsets[e + 1]`` (padding rows zero in both operands), cut at the K tile holding
its last counted row when ``counted``; both operands are read MN-major (the rows are the
reduction dimension) by TMA; one CTA owns one output tile of one expert (the same tile order,
common/weight_grad_tiles.py) and reduces the expert's rows in increasing order, so the result is
the same on every run and for every batch holding the same rows. An expert with no rows gets
zeros (accumulating: its gradient is left as it was). ``accumulate`` adds into an existing fp32
tensor (each element read, added to and written back by the one thread that owns it: the same
single fp32 addition as the Hopper kernel's TMA reduce-add); ``split_out`` writes the two halves
of M into two tensors [E, M/2, N] ``half_stride`` elements apart (``upper_first``: the second
lies lower), as there.

One CTA of four warps per output tile (128 x tile_n): mok/kernels/sm100/tcgen05_tile.py's
pipeline, then each thread converts (or adds) its row of the tile, 32 columns at a time, with
16-byte accesses. Compiled for sm_100a / sm_103a and its PTX checked (tests/test_kernels_ptx.py);
never run: no SM100 GPU was available to this project (tests/test_sm100_gpu.py is for one).
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

from ..common.gemm_args import expert_row_ranges, weight_grad_compile_args, weight_grad_output
from ..common.weight_grad_tiles import expert_tile, out_tile
from .tcgen05_tile import EPI_COLS, THREADS, TILE_K, TILE_K_MXFP8, TILE_M, Tcgen05TileKernel, pick_mxfp8_stages, pick_stages

OUT_DTYPES = {"bf16": cutlass.BFloat16, "f32": cutlass.Float32}


class WeightGradGemmSm100(Tcgen05TileKernel):
    """Static config: M, N, output dtype, accumulate, A's row stride, column tile, split_out, stages."""

    def __init__(
        self,
        m: int,
        n: int,
        out_dtype: str = "bf16",
        accumulate: bool = False,
        *,
        a_stride: int | None = None,
        tile_n: int = 128,
        stages: int | None = None,
        split_out: bool = False,
    ) -> None:
        if out_dtype not in OUT_DTYPES:
            raise ValueError(f"out_dtype: expected one of {sorted(OUT_DTYPES)}, got {out_dtype!r}")
        if accumulate and out_dtype != "f32":
            raise ValueError("accumulate: only into fp32 gradients")
        if tile_n not in (64, 128, 256):
            raise ValueError(f"tile_n: expected 64, 128 or 256, got {tile_n}")
        if m % TILE_M or n % tile_n:
            raise ValueError(f"(m, n): expected multiples of the tile ({TILE_M}, {tile_n}), got ({m}, {n})")
        if split_out and m % (2 * TILE_M):
            raise ValueError(f"split_out: expected m a multiple of {2 * TILE_M} (each half whole tiles), got {m}")
        a_stride = m if a_stride is None else a_stride
        if a_stride < m or a_stride % 8:
            raise ValueError(f"a_stride: expected a multiple of 8 that is >= m={m}, got {a_stride}")
        self.m, self.n, self.out_dtype, self.accumulate, self.a_stride = m, n, out_dtype, accumulate, a_stride
        self.split_out = split_out
        self.tile_shape_mnk = (TILE_M, tile_n, TILE_K)
        self.ab_stage = pick_stages((TILE_M + tile_n) * TILE_K * 2, stages)

    @cute.jit
    def __call__(
        self,
        a_ptr: cute.Pointer,
        b_ptr: cute.Pointer,
        out_ptr: cute.Pointer,
        offsets_ptr: cute.Pointer,
        counts_ptr: cute.Pointer,
        counted: cutlass.Int32,
        num_rows: cutlass.Int32,
        num_experts: cutlass.Int32,
        max_ctas: cutlass.Int32,
        half_stride: cutlass.Int64,
        upper_first: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        """The Hopper kernel's argument list (mok.grad_ops.weight_grad launches either)."""
        m, n = self.m, self.n
        tile_m, tile_n, _ = self.tile_shape_mnk
        # (MN, K = rows, 1): both operands MN-major
        m_a = cute.make_tensor(a_ptr, cute.make_layout((m, num_rows, 1), stride=(1, self.a_stride, self.a_stride * num_rows)))
        m_b = cute.make_tensor(b_ptr, cute.make_layout((n, num_rows, 1), stride=(1, n, n * num_rows)))
        if cutlass.const_expr(self.split_out):  # the halves lie a multiple of 16 bytes apart (grad_ops checks): 16-byte stores
            half_stride = cute.assume(half_stride, divby=16 // (OUT_DTYPES[self.out_dtype].width // 8))
        m_c = weight_grad_output(out_ptr, m, n, num_experts, half_stride, self.split_out)
        rows = expert_row_ranges(offsets_ptr, counts_ptr, counted, num_experts)  # where each expert's rows start and end

        tiled_mma, layouts, loads = self.prepare("mn", "mn", m_a, (m_b,))
        self.launch(tiled_mma, layouts, loads, m_c, upper_first, rows, num_rows, num_experts, stream)

    def launch(self, tiled_mma, smem_layouts, loads, m_c, upper_first, rows, num_rows, num_experts, stream):
        """Host side: one CTA per output tile of each expert."""
        all_tiles = num_experts * (self.m // self.tile_shape_mnk[0]) * (self.n // self.tile_shape_mnk[1])
        self.kernel(tiled_mma, smem_layouts, loads, m_c, upper_first, rows, num_rows).launch(
            grid=[all_tiles, 1, 1], block=[THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        smem_layouts: tuple,
        loads: tuple,
        m_c: cute.Tensor,
        upper_first: cutlass.Int32,
        rows: tuple,
        num_rows: cutlass.Int32,
    ):
        """One CTA per output tile of one expert; ``smem_layouts``: the staged layouts of A and B
        (MXFP8: and of their scales), ``loads``: the TMA atoms and coordinate tensors of A and B
        (MXFP8: then of their scales)."""
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        linear, _, _ = cute.arch.block_idx()
        expert, tile_row, tile_col, row_start, k_tiles = expert_tile(linear, rows, num_rows, self.m, self.n, self.tile_shape_mnk)
        stages, pipes, tmem, t_acc = self.setup(warp_idx, tiled_mma, smem_layouts, loads)
        k_first = row_start // self.tile_shape_mnk[2]  # (offsets: multiples of 128)
        views = self.tma_views(tiled_mma, loads, stages, tile_row, tile_col, k_first)
        self.mma_warp(warp_idx, tiled_mma, stages, pipes, t_acc, views, k_tiles, smem_layouts)
        acc_full = self.wait_accumulators(tmem, pipes)
        g_c = out_tile(m_c, upper_first, expert, tile_row, tile_col, self.m, self.tile_shape_mnk, self.split_out)
        self.epilogue(tidx, t_acc, g_c, k_tiles > 0)
        self.finish(warp_idx, pipes, tmem, t_acc, acc_full)

    def tma_views(self, tiled_mma, loads, stages, tile_row, tile_col, k_first):
        """(atom, global by K tile, shared by stage) for A and B (MXFP8: then for their scales), and
        the expert's first K tile: what ``load_stage`` reads."""
        views = (
            self.operand_view(tiled_mma, loads[0], stages[0], "a", tile_row, 0),
            self.operand_view(tiled_mma, loads[1], stages[1], "b", tile_col, 0),
        )
        if cutlass.const_expr(self.mxfp8):
            views += (
                self.operand_view(tiled_mma, loads[2], stages[3], "a", tile_row, 0, scales=True),
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
    def epilogue(self, tidx, t_acc, g_c, has_rows):
        """Each thread's row of the tile, 32 columns at a time: the accumulator (zeros for an expert
        without rows, whose MMAs never ran) converted to the output dtype, or added into it."""
        t2r, thr, src, _ = self.accumulator_reader(tidx, t_acc)
        dst = self.thread_view(thr, g_c)
        out_dtype = OUT_DTYPES[self.out_dtype]
        r_acc = cute.make_rmem_tensor(dst[(None, None, None, 0, 0)].shape, cutlass.Float32)
        r_out = cute.make_rmem_tensor(r_acc.shape, out_dtype)
        for sub in cutlass.range(self.tile_shape_mnk[1] // EPI_COLS, unroll=1):
            if cutlass.const_expr(self.accumulate):
                if has_rows:  # (without rows nothing is added: the gradient stays as it was)
                    cute.copy(t2r, src[(None, None, None, 0, sub)], r_acc)
                    cute.autovec_copy(dst[(None, None, None, 0, sub)], r_out)
                    cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld
                    r_out.store(r_out.load() + r_acc.load())
                    cute.autovec_copy(r_out, dst[(None, None, None, 0, sub)])
            else:
                r_acc.fill(0.0)
                if has_rows:
                    cute.copy(t2r, src[(None, None, None, 0, sub)], r_acc)
                    cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld
                r_out.store(r_acc.load().to(out_dtype))
                cute.autovec_copy(r_out, dst[(None, None, None, 0, sub)])


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

    def __init__(self, m: int, n: int, out_dtype: str = "bf16", accumulate: bool = False, *, a_stride: int | None = None,
                 tile_n: int = 128, stages: int | None = None, split_out: bool = False) -> None:
        if tile_n not in (128, 256):
            raise ValueError(f"tile_n: expected 128 or 256 with MXFP8 operands, got {tile_n}")
        if a_stride is not None and a_stride % 16:
            raise ValueError(f"a_stride: expected a multiple of 16 (bytes of E4M3) with MXFP8 operands, got {a_stride}")
        super().__init__(m, n, out_dtype, accumulate, a_stride=a_stride, tile_n=tile_n, split_out=split_out)
        self.tile_shape_mnk = (TILE_M, tile_n, TILE_K_MXFP8)
        self.ab_stage = pick_mxfp8_stages(TILE_M + tile_n, stages)

    @cute.jit
    def __call__(
        self,
        a_ptr: cute.Pointer,
        a_scale_ptr: cute.Pointer,
        b_ptr: cute.Pointer,
        b_scale_ptr: cute.Pointer,
        out_ptr: cute.Pointer,
        offsets_ptr: cute.Pointer,
        counts_ptr: cute.Pointer,
        counted: cutlass.Int32,
        num_rows: cutlass.Int32,
        num_experts: cutlass.Int32,
        half_stride: cutlass.Int64,
        upper_first: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        """A and B (E4M3, [R, M] and [R, N]) with their scales, then the bf16 kernel's outputs and row
        ranges (mok.grad_ops.weight_grad_mxfp8 launches it)."""
        m, n = self.m, self.n
        m_a = cute.make_tensor(a_ptr, cute.make_layout((m, num_rows, 1), stride=(1, self.a_stride, self.a_stride * num_rows)))
        m_b = cute.make_tensor(b_ptr, cute.make_layout((n, num_rows, 1), stride=(1, n, n * num_rows)))
        m_sfa = self.scale_tensor(a_scale_ptr, m, num_rows, 1)
        m_sfb = self.scale_tensor(b_scale_ptr, n, num_rows, 1)
        if cutlass.const_expr(self.split_out):
            half_stride = cute.assume(half_stride, divby=16 // (OUT_DTYPES[self.out_dtype].width // 8))
        m_c = weight_grad_output(out_ptr, m, n, num_experts, half_stride, self.split_out)
        rows = expert_row_ranges(offsets_ptr, counts_ptr, counted, num_experts)

        tiled_mma, layouts, loads = self.prepare("mn", "mn", m_a, (m_b,), m_sfa, (m_sfb,))
        self.launch(tiled_mma, layouts, loads, m_c, upper_first, rows, num_rows, num_experts, stream)


def weight_grad_mxfp8_compile_args(out_dtype: type) -> tuple:
    """:class:`WeightGradGemmMxfp8Sm100`'s ``__call__`` arguments as compile-time stand-ins."""
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    gmem = cute.AddressSpace.gmem
    e4m3 = lambda: make_ptr(cutlass.Float8E4M3FN, 0, gmem, assumed_align=16)  # noqa: E731
    e8m0 = lambda: make_ptr(cutlass.Float8E8M0FNU, 0, gmem, assumed_align=16)  # noqa: E731
    i32 = lambda: make_ptr(cutlass.Int32, 0, gmem, assumed_align=4)  # noqa: E731
    return (
        e4m3(), e8m0(), e4m3(), e8m0(), make_ptr(out_dtype, 0, gmem, assumed_align=16), i32(), i32(), cutlass.Int32(0),
        cutlass.Int32(128), cutlass.Int32(1), cutlass.Int64(0), cutlass.Int32(0), make_fake_stream(),
    )


def compile_weight_grad_mxfp8_sm100(
    m: int, n: int, out_dtype: str, accumulate: bool, arch: str, options: str = "", *, a_stride: int | None = None, tile_n: int = 128,
    stages: int | None = None, split_out: bool = False,
):
    """Compile :class:`WeightGradGemmMxfp8Sm100` for ``arch`` (sm_100a or sm_103a) without tensors."""
    kernel = WeightGradGemmMxfp8Sm100(m, n, out_dtype, accumulate, a_stride=a_stride, tile_n=tile_n, stages=stages, split_out=split_out)
    return cute.compile(kernel, *weight_grad_mxfp8_compile_args(OUT_DTYPES[out_dtype]), options=f"--gpu-arch {arch} {options}".strip())


def compile_weight_grad_sm100(
    m: int, n: int, out_dtype: str, accumulate: bool, arch: str, options: str = "", *, a_stride: int | None = None,
    tile_n: int = 128, stages: int | None = None, persistent: bool = False, pingpong: bool = False, split_out: bool = False,
):
    """Compile for ``arch`` (sm_100a or sm_103a) without tensors, with the Hopper kernel's runtime
    arguments; ``persistent`` and ``pingpong`` (Hopper only so far) raise NotImplementedError."""
    if persistent or pingpong:
        raise NotImplementedError(
            f"weight-gradient GEMM on {arch}: {'persistent' if persistent else 'pingpong'} not written yet (sm_100a has the "
            f"one-tile-per-CTA kernel: pass persistent=False)"
        )
    kernel = WeightGradGemmSm100(m, n, out_dtype, accumulate, a_stride=a_stride, tile_n=tile_n, stages=stages, split_out=split_out)
    return cute.compile(kernel, *weight_grad_compile_args(OUT_DTYPES[out_dtype]), options=f"--gpu-arch {arch} {options}".strip())
