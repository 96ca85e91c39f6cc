"""Row gather: out[r] = src[index[r]], or zeros where index[r] < 0 (padding rows).

Builds the expert-grouped activation buffer from the token rows, in the row order the
schedule gives (canonical within each expert). Arch-neutral: 16-byte vector loads and
stores; a CTA of ``threads`` threads covers 8·threads columns of ROWS output rows, each
thread loading its ROWS vectors before it stores any, so that ROWS loads are in flight per
thread (one row per CTA kept one load in flight and launched a CTA per 2 KB moved).
``GatherTwoRowsKernel`` gathers the same rows of two sources of one width in one launch (the
backward's dout and x rows). Bounded, a launch writes only the rows below a count on the device
(the schedule's rows in use: the capacity's row tiles past them no GEMM reads).
``GatherFp8RowsKernel`` gathers rows quantized once per token (E4M3 with a scale per 1 x 128
block, mok.ops.quantize_fp8_rows's layout), always bounded: each row's bytes as above (eight bf16
lanes a 16-byte vector), and its scales from the transposed [blocks, T] into [blocks, R], 1.0 for
padding rows (what the quantizer gives them).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

from .compile import compile_kernel
from .fp8_block_quantize import BLOCK as SCALE_BLOCK
from .records import GATHER_ARGS, GATHER_FP8_ARGS, GATHER_TWO_ARGS
from .row_vectors import VECTOR, row_vector, thread_vector, vector_grid

ROWS = 4  # output rows per CTA (16-byte loads in flight per thread)
# the launches' arguments (the CUDA stream follows): GatherRowsKernel's, GatherTwoRowsKernel's


class GatherRowsKernel:
    """Static config: row width (bf16 elements); ``bounded``: only the rows below a count on the
    device written (the rows a schedule uses), the rest left as they were."""

    def __init__(self, width: int, threads: int = 128, bounded: bool = False) -> None:
        if width % VECTOR:
            raise ValueError(f"width: expected a multiple of {VECTOR}, got {width}")
        self.width = width
        self.threads = threads
        self.bounded = bounded

    @cute.jit
    def __call__(
        self, src_ptr: cute.Pointer, index_ptr: cute.Pointer, out_ptr: cute.Pointer, rows_used_ptr: cute.Pointer, num_src: cutlass.Int32,
        num_out: cutlass.Int32, stream: cuda.CUstream,
    ):
        """src [num_src, width] bf16, index [num_out] int32, out [num_out, width] bf16; rows_used [1]
        int32 (bounded only, else null): the rows written, those below min(rows_used[0], num_out)."""
        w = self.width
        m_src = cute.make_tensor(src_ptr, cute.make_layout((num_src, w), stride=(w, 1)))
        m_index = cute.make_tensor(index_ptr, cute.make_layout((num_out,)))
        m_out = cute.make_tensor(out_ptr, cute.make_layout((num_out, w), stride=(w, 1)))
        m_used = cute.make_tensor(rows_used_ptr, cute.make_layout((1,)))
        self.kernel(m_src, m_index, m_out, m_used).launch(
            grid=vector_grid((num_out + ROWS - 1) // ROWS, w, self.threads), block=[self.threads, 1, 1], stream=stream
        )

    @cute.jit
    def rows_written(self, m_used: cute.Tensor, num_out):
        """The rows below which this launch writes: the device count where bounded, else all."""
        rows = num_out
        if cutlass.const_expr(self.bounded):
            rows = cutlass.min(m_used[0], num_out)
        return rows

    @cute.kernel
    def kernel(self, m_src: cute.Tensor, m_index: cute.Tensor, m_out: cute.Tensor, m_used: cute.Tensor):
        chunk, row_block, _ = thread_vector(self.threads)
        rows = self.rows_written(m_used, m_out.shape[0])
        if row_block * ROWS < rows and chunk * VECTOR < self.width:
            gather_row_block(m_src, m_index, m_out, row_block, chunk, rows)


class GatherTwoRowsKernel(GatherRowsKernel):
    """The same rows of two sources: out_a[r] = src_a[index[r]], out_b[r] = src_b[index[r]] (grid z: which)."""

    @cute.jit
    def __call__(
        self, src_a_ptr: cute.Pointer, src_b_ptr: cute.Pointer, index_ptr: cute.Pointer, out_a_ptr: cute.Pointer,
        out_b_ptr: cute.Pointer, rows_used_ptr: cute.Pointer, num_src: cutlass.Int32, num_out: cutlass.Int32, stream: cuda.CUstream,
    ):
        """src_a, src_b [num_src, width] bf16, index [num_out] int32, out_a, out_b [num_out, width]
        bf16; rows_used: as GatherRowsKernel's."""
        w = self.width
        rows_of = lambda ptr, count: cute.make_tensor(ptr, cute.make_layout((count, w), stride=(w, 1)))  # noqa: E731
        m_index = cute.make_tensor(index_ptr, cute.make_layout((num_out,)))
        m_used = cute.make_tensor(rows_used_ptr, cute.make_layout((1,)))
        self.kernel_two(rows_of(src_a_ptr, num_src), rows_of(src_b_ptr, num_src), m_index, rows_of(out_a_ptr, num_out),
                        rows_of(out_b_ptr, num_out), m_used).launch(
            grid=vector_grid((num_out + ROWS - 1) // ROWS, w, self.threads, depth=2), block=[self.threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel_two(self, m_src_a: cute.Tensor, m_src_b: cute.Tensor, m_index: cute.Tensor, m_out_a: cute.Tensor, m_out_b: cute.Tensor,
                   m_used: cute.Tensor):
        chunk, row_block, which = thread_vector(self.threads)
        rows = self.rows_written(m_used, m_out_a.shape[0])
        if row_block * ROWS < rows and chunk * VECTOR < self.width:
            if which == 0:
                gather_row_block(m_src_a, m_index, m_out_a, row_block, chunk, rows)
            else:
                gather_row_block(m_src_b, m_index, m_out_b, row_block, chunk, rows)


class GatherFp8RowsKernel(GatherRowsKernel):
    """Static config: row width in E4M3 elements (a multiple of 16: whole 16-byte vectors)."""

    def __init__(self, width: int, threads: int = 128) -> None:
        if width % (2 * VECTOR):
            raise ValueError(f"width: expected a multiple of {2 * VECTOR} E4M3 elements, got {width}")
        super().__init__(width // 2, threads, bounded=True)  # (the bytes moved as bf16 lanes, two E4M3 elements each)
        self.blocks = -(-width // SCALE_BLOCK)

    @cute.jit
    def __call__(
        self, src_ptr: cute.Pointer, src_scales_ptr: cute.Pointer, index_ptr: cute.Pointer, out_ptr: cute.Pointer,
        out_scales_ptr: cute.Pointer, rows_used_ptr: cute.Pointer, num_src: cutlass.Int32, num_out: cutlass.Int32, stream: cuda.CUstream,
    ):
        """src [num_src, width] E4M3 (read as bf16 lanes) with scales [blocks, num_src] fp32; index
        [num_out] int32; out [num_out, width] and out_scales [blocks, num_out]; rows_used [1] int32: the
        rows written (those below min(rows_used[0], num_out))."""
        w, blocks = self.width, self.blocks
        rows_of = lambda ptr, count: cute.make_tensor(ptr, cute.make_layout((count, w), stride=(w, 1)))  # noqa: E731
        scales_of = lambda ptr, count: cute.make_tensor(ptr, cute.make_layout((blocks, count), stride=(count, 1)))  # noqa: E731
        m_index = cute.make_tensor(index_ptr, cute.make_layout((num_out,)))
        m_used = cute.make_tensor(rows_used_ptr, cute.make_layout((1,)))
        self.kernel_fp8(rows_of(src_ptr, num_src), scales_of(src_scales_ptr, num_src), m_index, rows_of(out_ptr, num_out),
                        scales_of(out_scales_ptr, num_out), m_used).launch(
            grid=vector_grid((num_out + ROWS - 1) // ROWS, w, self.threads), block=[self.threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel_fp8(self, m_src: cute.Tensor, m_src_scales: cute.Tensor, m_index: cute.Tensor, m_out: cute.Tensor,
                   m_out_scales: cute.Tensor, m_used: cute.Tensor):
        chunk, row_block, _ = thread_vector(self.threads)
        rows = self.rows_written(m_used, m_out.shape[0])
        if row_block * ROWS < rows:
            if chunk * VECTOR < self.width:
                gather_row_block(m_src, m_index, m_out, row_block, chunk, rows)
            if chunk < self.blocks:  # (a thread per 128-block of the row: its scale)
                for i in cutlass.range_constexpr(ROWS):
                    row = row_block * ROWS + i
                    if row < rows:
                        source = m_index[row]
                        scale = cutlass.Float32(1.0)
                        if source >= 0:
                            scale = m_src_scales[chunk, source]
                        m_out_scales[chunk, row] = scale


@cute.jit
def gather_row_block(m_src: cute.Tensor, m_index: cute.Tensor, m_out: cute.Tensor, row_block, chunk, num_out):
    """Column chunk ``chunk`` (VECTOR elements) of out rows row_block·ROWS .. + ROWS - 1 (those below
    ``num_out``): every load first, then every store, so ROWS loads are in flight per thread."""
    held = []
    for i in cutlass.range_constexpr(ROWS):  # every load first ...
        row = row_block * ROWS + i
        vec = cute.make_rmem_tensor((VECTOR,), m_out.element_type)
        vec.fill(0.0)
        if row < num_out:
            source = m_index[row]
            if source >= 0:
                vec.store(row_vector(m_src, source, chunk).load())
        held.append(vec)
    for i in cutlass.range_constexpr(ROWS):  # ... then every store
        row = row_block * ROWS + i
        if row < num_out:
            row_vector(m_out, row, chunk).store(held[i].load())


def compile_gather(width: int, arch: str, options: str = "", sources: int = 1, fp8: bool = False, bounded: bool = False):
    """Compile for ``arch`` without tensors (``sources`` 2: GatherTwoRowsKernel; ``fp8``:
    GatherFp8RowsKernel, ``width`` in E4M3 elements, always bounded), the records' stand-ins."""
    if fp8:
        return compile_kernel(GatherFp8RowsKernel(width), GATHER_FP8_ARGS, arch, options)
    if sources == 2:
        return compile_kernel(GatherTwoRowsKernel(width, bounded=bounded), GATHER_TWO_ARGS, arch, options)
    return compile_kernel(GatherRowsKernel(width, bounded=bounded), GATHER_ARGS, arch, options)
