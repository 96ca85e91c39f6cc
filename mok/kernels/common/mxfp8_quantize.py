"""bf16 rows <-> MXFP8 (E4M3 elements, one E8M0 scale byte per 32 consecutive elements).

The rule is mok/mxfp8.py's, bit for bit: the block's largest magnitude is an integer max over
the fp32 bit patterns with the sign cleared (a NaN's pattern is above every other, so it wins;
a float max would drop it), the scale exponent comes from that pattern's exponent and mantissa
fields, the elements are ``x * 2**-e`` (exact: a power-of-two factor) rounded by
``cvt.rn.satfinite.e4m3x2.f32``. Arch-neutral. One thread per block of 32: four 16-byte loads,
two 16-byte stores and the scale byte; where every row is whole blocks (and, in the MMA's order,
whole 128-value chunks) the rows are contiguous, so the tensor is one run of blocks and the row
width does not enter the kernel. Other widths (multiples of 16) are a static ``width``: a row's
last block may hold 16 values (two loads, one store; its scale from them), the MMA order has
ceil(width / 128) chunks a row and the thread of a row's last block writes the padding blocks'
bytes (scale 1: finite, so the zeros TMA loads past the width stay zeros in the MMA), and a
stack of weights whose N is no multiple of 128 is chunked one matrix at a time (``matrix_rows``).
``segments`` 2 blocks each half of a row on its own (dh, whose halves are the dx GEMM's two K
ranges). ``bounded``: the count of rows to convert is
read from the device (a schedule's used rows: buffers sized for the worst case need not be
converted whole, and the host never learns the count); the rest is left as it is.

``DequantizeMxfp8Kernel`` is the way back, ``bf16(float32(element) * 2**(byte - 127))`` as
mok.mxfp8.dequantize_mxfp8 then a bf16 rounding gives it (exact wherever the value is a normal
bf16: E4M3's 3 mantissa bits fit in bf16's 7). It writes twice the bytes it reads, so its unit is
a quarter block (an 8-byte load, a 16-byte store) and a warp's stores are 512 contiguous bytes,
where a block per thread left each store instruction half of every 32-byte sector; each thread
takes four quarter blocks a CTA width apart and loads all four before it stores.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

BLOCK = 32  # elements per scale (mok.mxfp8.BLOCK)
HALF = BLOCK // 2  # the values of a partial last block (rows a multiple of 16 wide)
CHUNK_ROWS = 128  # rows of a chunk of scales in the MMA's order (mok.mxfp8.MMA_CHUNK_ROWS)
CHUNK_BLOCKS = 4  # blocks along K of a chunk (mok.mxfp8.MMA_CHUNK_BLOCKS)
SCALE_ONE = 127  # the padding blocks' scale byte (mok.mxfp8.SCALE_ONE)
CHUNK = 8  # elements per thread of the dequantizer
CHUNKS_PER_BLOCK = BLOCK // CHUNK
CHUNKS_PER_BLOCK_LOG2 = 2  # (chunk indices are never negative: a shift, not a signed division)
ABS_MASK = 0x7FFFFFFF
MANTISSA_MASK = 0x7FFFFF
MANTISSA_1_75 = 0x600000  # fp32 mantissa field of 1.75 (448 = 1.75 * 2**8)
E4M3_MAX_EXP = 8
NAN_EXPONENT = 255  # the exponent field of Inf and NaN; also E8M0's NaN byte
ELEMENT_NAN = 0x7F
SMALLEST_SCALE_BITS = 0x00400000  # 2**-127 (scale byte 0), a subnormal float32
FLOAT_NAN_BITS = 0x7FC00000


@cute.jit
def e8m0_factor(exponent: cutlass.Int32) -> cutlass.Float32:
    """2**(exponent - 127) of an E8M0 scale byte (0..255) as a float32: byte 0 is the subnormal
    2**-127, byte 255 NaN. (Shared by the dequantizer and the EP dispatch of MXFP8 rows.)"""
    bits = cute.make_rmem_tensor((1,), cutlass.Int32)
    bits[0] = exponent << 23
    if exponent == 0:
        bits[0] = SMALLEST_SCALE_BITS
    if exponent == NAN_EXPONENT:
        bits[0] = FLOAT_NAN_BITS
    return cute.recast_tensor(bits, cutlass.Float32)[0]


def block_tensors(values_ptr: cute.Pointer, elements_ptr: cute.Pointer, scales_ptr: cute.Pointer, num_blocks) -> tuple:
    """A run of blocks: bf16 values [n, 32], E4M3 elements [n, 32], scale bytes [n]."""
    blocks = cute.make_layout((num_blocks, BLOCK), stride=(BLOCK, 1))
    scales = cute.make_layout((num_blocks,))
    return cute.make_tensor(values_ptr, blocks), cute.make_tensor(elements_ptr, blocks), cute.make_tensor(scales_ptr, scales)


@cute.jit
def quantize_block(m_x: cute.Tensor, m_elements: cute.Tensor, m_scales: cute.Tensor, block, scale_index=None):
    """Block ``block`` of ``m_x`` ([n, 32] bf16) into its 32 E4M3 elements and its scale byte (at
    ``scale_index``, default ``block``), by mok.mxfp8's rule (the module docstring). (Shared by the
    quantizer and the EP publish of MXFP8 rows.)"""
    values = cute.make_rmem_tensor((BLOCK,), cutlass.Float32)
    values.store(m_x[block, None].load().to(cutlass.Float32))
    exponent, elements = quantized_values(values, m_elements.element_type)
    m_elements[block, None].store(elements.load())
    if cutlass.const_expr(scale_index is None):
        m_scales[block] = cutlass.Uint8(exponent)
    else:
        m_scales[scale_index] = cutlass.Uint8(exponent)


@cute.jit
def quantized_values(values: cute.Tensor, element_type):
    """(the scale exponent, the E4M3 elements in a register tensor of ``values``' shape) of one
    block's 32 fp32 ``values`` (a partial block: zeros past the row, which raise no amax), by
    mok.mxfp8's rule (the module docstring)."""
    bits = cute.recast_tensor(values, cutlass.Int32)
    amax = cutlass.Int32(0)
    for i in cutlass.range_constexpr(BLOCK):
        amax = max(amax, bits[i] & ABS_MASK)
    field = amax >> 23
    exponent = field - E4M3_MAX_EXP
    if (amax & MANTISSA_MASK) > MANTISSA_1_75:
        exponent = exponent + 1
    exponent = min(max(exponent, 0), 254)
    inverse = cute.make_rmem_tensor((1,), cutlass.Int32)
    inverse[0] = (254 - exponent) << 23  # 2**-(exponent - 127): a normal float for every exponent here
    factor = cute.recast_tensor(inverse, cutlass.Float32)[0]
    elements = cute.make_rmem_tensor(values.shape, element_type)
    elements.store((values.load() * factor).to(element_type))
    if field == NAN_EXPONENT:  # an Inf or a NaN in the block
        exponent = NAN_EXPONENT
        cute.recast_tensor(elements, cutlass.Uint8).fill(ELEMENT_NAN)
    return exponent, elements


@cute.jit
def mma_scale_index(block, blocks_per_row) -> cutlass.Int32:
    """Where block ``block`` (of rows of ``blocks_per_row`` blocks, a multiple of 4) keeps its scale
    in the order SM100's block-scaled MMAs read (mok.mxfp8.mma_scale_layout): a 512-byte chunk per
    128 rows and 4 blocks, K's chunks innermost; in a chunk (r % 32)·16 + (r // 32 % 4)·4 + c % 4."""
    row = block // blocks_per_row
    col = block - row * blocks_per_row
    chunk = (row >> 7) * (blocks_per_row >> 2) + (col >> 2)
    return mma_chunk_byte(chunk, row, col)


@cute.jit
def mma_chunk_byte(chunk, row, col) -> cutlass.Int32:
    """The byte of chunk ``chunk`` (512 bytes) holding the scale of row ``row`` (its place in the
    chunk: row % 128) and block ``col`` (col % 4) in the MMA's order: (r % 32)·16 + (r // 32 % 4)·4 + c % 4."""
    return chunk * 512 + (row & 31) * 16 + ((row >> 5) & 3) * 4 + (col & 3)


def column_block_tensors(values_ptr: cute.Pointer, elements_ptr: cute.Pointer, num_blocks, columns) -> tuple:
    """Blocks of 32 rows of one column of a row-major [R, columns] matrix (R = 32·num_blocks /
    columns): bf16 values and E4M3 elements as [num_blocks, 32], block (m, b) = rows 32b..32b+31
    of column m at linear index m + b·columns (a warp's threads take neighbouring columns)."""
    row_blocks = num_blocks // columns
    blocks = cute.make_layout(((columns, row_blocks), BLOCK), stride=((1, BLOCK * columns), columns))
    return cute.make_tensor(values_ptr, blocks), cute.make_tensor(elements_ptr, blocks)


@cute.jit
def quantize_half_blocks(m_x: cute.Tensor, m_elements: cute.Tensor, sub_row, col, width: cutlass.Constexpr[int]) -> cutlass.Int32:
    """Block ``col`` of row ``sub_row`` of rows ``width`` wide as halves of blocks
    (:func:`half_block_tensors`): its values (16 where it is a row's partial last block, zeros
    after them raising no amax) into their E4M3 elements; returns its scale exponent. (Shared by
    the static-width quantizer and the EP publishes of MXFP8 rows.)"""
    last = -(-width // BLOCK) - 1
    values = cute.make_rmem_tensor((HALF, 2), cutlass.Float32)  # (value, half): a block's 32 in order
    values.fill(0.0)
    values[None, 0].store(m_x[sub_row, 2 * col, None].load().to(cutlass.Float32))
    if cutlass.const_expr(width % BLOCK == 0):
        values[None, 1].store(m_x[sub_row, 2 * col + 1, None].load().to(cutlass.Float32))
    else:
        if col < last:  # (not a row's partial last block)
            values[None, 1].store(m_x[sub_row, 2 * col + 1, None].load().to(cutlass.Float32))
    exponent, elements = quantized_values(values, m_elements.element_type)
    m_elements[sub_row, 2 * col, None].store(elements[None, 0].load())
    if cutlass.const_expr(width % BLOCK == 0):
        m_elements[sub_row, 2 * col + 1, None].store(elements[None, 1].load())
    else:
        if col < last:
            m_elements[sub_row, 2 * col + 1, None].store(elements[None, 1].load())
    return exponent


@cute.jit
def quantize_rows_strided(x_ptr: cute.Pointer, elements_ptr: cute.Pointer, scales_ptr: cute.Pointer, num_rows,
                          width: cutlass.Constexpr[int], first, step):
    """Rows [num_rows, width] bf16 (width a multiple of 16) into MXFP8 by rows (mok.ops.quantize_mxfp8's
    bytes): elements [num_rows, width], scale bytes [num_rows, ceil(width / 32)]; this thread's
    blocks ``first``, ``first + step``, ... (the EP publishes' grid-stride loop). Whole blocks: one run
    of them; a partial last block (width ≡ 16 mod 32): blocks of halves, a row at a time."""
    if cutlass.const_expr(width % BLOCK == 0):
        blocks = num_rows * (width // BLOCK)
        m_x, m_elements, m_scales = block_tensors(x_ptr, elements_ptr, scales_ptr, blocks)
        for b in cutlass.range(first, blocks, step, unroll=1):
            quantize_block(m_x, m_elements, m_scales, b)
    else:
        row_blocks = -(-width // BLOCK)
        blocks = num_rows * row_blocks
        m_x, m_elements = half_block_tensors(x_ptr, elements_ptr, num_rows, width)
        m_scales = cute.make_tensor(scales_ptr, cute.make_layout((blocks,)))
        for b in cutlass.range(first, blocks, step, unroll=1):
            row = b // row_blocks
            m_scales[b] = cutlass.Uint8(quantize_half_blocks(m_x, m_elements, row, b - row * row_blocks, width))


def half_block_tensors(values_ptr: cute.Pointer, elements_ptr: cute.Pointer, sub_rows, width: int) -> tuple:
    """Rows of ``width`` values (a multiple of 16) as halves of blocks: bf16 values and E4M3 elements
    [sub_rows, width / 16, 16] (block c of a row: halves 2c and 2c + 1, the second past a partial
    last block's row end)."""
    halves = cute.make_layout((sub_rows, width // HALF, HALF), stride=(width, HALF, 1))
    return cute.make_tensor(values_ptr, halves), cute.make_tensor(elements_ptr, halves)


class QuantizeMxfp8Kernel:
    """Static config: threads per CTA, ``bounded``, ``mma_order`` (the scales in the order of
    :func:`mma_scale_index`; rows of a multiple of 128 elements) (any row width that is a multiple
    of 32), ``columns``: blocks of 32 rows down each column instead (the MXFP8 of the matrix's
    transpose, elements left in the matrix's own layout: the weight gradients' operands, whose K is
    the rows). ``width`` (None: rows of whole blocks, or with ``mma_order`` whole chunks, their width
    read at run time): the width of a row's segment, a multiple of 16 (the module docstring);
    ``segments`` (1 or 2) and ``matrix_rows`` (``mma_order``: the rows of one matrix of a stack
    whose N is no multiple of 128) with it. With ``columns`` (and ``mma_order``), ``width`` and
    ``segments`` 2: each half of the columns chunked on its own in the MMA's order (dh's halves,
    the split-out weight gradient's two row ranges, where 128 does not divide a half)."""

    def __init__(self, threads: int = 128, bounded: bool = False, mma_order: bool = False, columns: bool = False,
                 width: int | None = None, segments: int = 1, matrix_rows: int | None = None) -> None:
        if width is not None and (width <= 0 or width % HALF):
            raise ValueError(f"width: expected a positive multiple of {HALF}, got {width}")
        if (segments != 1 or matrix_rows is not None) and width is None:
            raise ValueError("segments, matrix_rows: only with a static width")
        if segments not in (1, 2) or (matrix_rows is not None and (not mma_order or matrix_rows <= 0)):
            raise ValueError(f"segments: expected 1 or 2, matrix_rows a positive count with mma_order; got {segments}, {matrix_rows}")
        if columns and width is not None and (segments != 2 or not mma_order or matrix_rows is not None):
            raise ValueError("width with columns: the columns of each of two segments, in the MMA's order (dh's halves chunked apart)")
        self.threads = threads
        self.bounded = bounded
        self.mma_order = mma_order
        self.columns = columns
        self.width, self.segments, self.matrix_rows = width, segments, matrix_rows
        self.static_rows = width is not None and not columns  # rows of a static width (else one run of blocks, or columns)
        if width is not None:
            self.row_blocks = -(-width // BLOCK)  # a segment's blocks, the last one perhaps partial
            self.row_chunks = -(-width // (BLOCK * CHUNK_BLOCKS))  # its chunks of 128 along K in the MMA's order
            self.padding_blocks = self.row_chunks * CHUNK_BLOCKS - self.row_blocks  # their blocks past the segment

    @cute.jit
    def __call__(
        self, x_ptr: cute.Pointer, elements_ptr: cute.Pointer, scales_ptr: cute.Pointer, num_blocks: cutlass.Int32,
        rows_used_ptr: cute.Pointer, blocks_per_row: cutlass.Int32, stream: cuda.CUstream,
    ):
        """x [num_blocks·32] bf16 -> elements [num_blocks·32] E4M3, scales [num_blocks] E8M0 bytes
        (``bounded``: the first rows_used[0]·blocks_per_row blocks only; ``mma_order``: the scales at
        :func:`mma_scale_index`, the scale tensor covering whole 128-row chunks; blocks_per_row is
        read by either, else ignored). ``columns``: blocks_per_row is the matrix's column count,
        the scales those of its transpose ([columns, R / 32], or in the MMA's order), and with
        ``bounded`` the first rows_used[0] rows (a multiple of 32) are converted. A static
        ``width``: num_blocks is the scales of the rows (segments · ceil(width / 32) a row, what
        blocks_per_row says), x and the elements the rows' values."""
        m_x, m_elements, m_scales = block_tensors(x_ptr, elements_ptr, scales_ptr, num_blocks)
        if cutlass.const_expr(self.columns):
            m_x, m_elements = column_block_tensors(x_ptr, elements_ptr, num_blocks, blocks_per_row)
        if cutlass.const_expr(self.static_rows):
            m_x, m_elements = half_block_tensors(x_ptr, elements_ptr, num_blocks // self.row_blocks, self.width)
        m_used = cute.make_tensor(rows_used_ptr, cute.make_layout((1,)))
        self.kernel(m_x, m_elements, m_scales, m_used, blocks_per_row).launch(**self.launch_shape(num_blocks, stream))

    @cute.jit
    def blocks_to_convert(self, num_blocks: cutlass.Int32, m_used: cute.Tensor, blocks_per_row: cutlass.Int32) -> cutlass.Int32:
        """All blocks, or with ``bounded`` those of the rows in use (never more than there are)."""
        limit = num_blocks
        if cutlass.const_expr(self.bounded):
            used_blocks = m_used[0] * blocks_per_row
            if cutlass.const_expr(self.columns):
                used_blocks = (m_used[0] // BLOCK) * blocks_per_row
            limit = min(num_blocks, used_blocks)
        return limit

    def launch_shape(self, num_blocks, stream) -> dict:
        """A CTA per ``threads`` blocks."""
        return dict(grid=[(num_blocks + self.threads - 1) // self.threads, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, m_x: cute.Tensor, m_elements: cute.Tensor, m_scales: cute.Tensor, m_used: cute.Tensor, blocks_per_row: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        block = cta * self.threads + tidx
        num_blocks = cute.size(m_x, mode=[0])
        if cutlass.const_expr(self.static_rows):
            num_blocks = cute.size(m_x, mode=[0]) * self.row_blocks
        if block < self.blocks_to_convert(num_blocks, m_used, blocks_per_row):
            if cutlass.const_expr(self.static_rows):
                self.quantize_segment_block(m_x, m_elements, m_scales, block)
            elif cutlass.const_expr(self.columns):  # block (column m, row block b): the transpose's row m, block b
                row_blocks = num_blocks // blocks_per_row
                column = block % blocks_per_row
                transposed = column * row_blocks + block // blocks_per_row
                if cutlass.const_expr(self.width is not None):  # (two segments of columns)
                    at = self.column_segment_scale_byte(column, block // blocks_per_row, row_blocks)
                    quantize_block(m_x, m_elements, m_scales, block, at)
                elif cutlass.const_expr(self.mma_order):
                    quantize_block(m_x, m_elements, m_scales, block, mma_scale_index(transposed, row_blocks))
                else:
                    quantize_block(m_x, m_elements, m_scales, block, transposed)
            elif cutlass.const_expr(self.mma_order):
                quantize_block(m_x, m_elements, m_scales, block, mma_scale_index(block, blocks_per_row))
            else:
                quantize_block(m_x, m_elements, m_scales, block)


    @cute.jit
    def quantize_segment_block(self, m_x: cute.Tensor, m_elements: cute.Tensor, m_scales: cute.Tensor, block):
        """Block ``block`` of rows of a static width ([sub-rows, width / 16, 16] halves): its values
        (16 where it is a row's partial last block), their elements and its scale byte, by rows or in
        the MMA's order (the padding blocks' bytes by the row's last block)."""
        sub_row = block // self.row_blocks
        col = block - sub_row * self.row_blocks
        exponent = quantize_half_blocks(m_x, m_elements, sub_row, col, self.width)
        if cutlass.const_expr(not self.mma_order):
            m_scales[block] = cutlass.Uint8(exponent)
        else:
            at = self.segment_scale_byte(sub_row, col)
            m_scales[at] = cutlass.Uint8(exponent)
            if cutlass.const_expr(self.padding_blocks > 0):
                if col == self.row_blocks - 1:
                    for pad in cutlass.range_constexpr(1, self.padding_blocks + 1):
                        m_scales[at + pad] = cutlass.Uint8(SCALE_ONE)

    @cute.jit
    def segment_scale_byte(self, sub_row, col) -> cutlass.Int32:
        """Where block ``col`` of segment row ``sub_row`` keeps its scale in the MMA's order
        (mok.mxfp8.mma_scale_layout of each matrix's [rows, segments · ceil(width / 128) · 4]
        scales, each segment's blocks starting a chunk)."""
        row = sub_row // self.segments
        segment = sub_row - row * self.segments
        row_chunk = row >> 7
        if cutlass.const_expr(self.matrix_rows is not None):
            matrix = row // self.matrix_rows
            row = row - matrix * self.matrix_rows
            row_chunk = matrix * -(-self.matrix_rows // CHUNK_ROWS) + (row >> 7)
        chunk = (row_chunk * self.segments + segment) * self.row_chunks + (col >> 2)
        return mma_chunk_byte(chunk, row, col)

    @cute.jit
    def column_segment_scale_byte(self, column, row_block, row_blocks) -> cutlass.Int32:
        """``columns`` in two segments: where block ``row_block`` (of ``row_blocks`` down a column) of
        column ``column`` keeps its scale in the MMA's order, each segment's ``width`` columns
        starting a chunk (the transpose's rows of each half chunked on their own)."""
        segment = column // self.width
        row = column - segment * self.width
        chunk = (segment * self.row_chunks + (row >> 7)) * (row_blocks >> 2) + (row_block >> 2)
        return mma_chunk_byte(chunk, row, row_block)


class DequantizeMxfp8Kernel(QuantizeMxfp8Kernel):
    """elements [num_blocks·32] E4M3 and scales [num_blocks] E8M0 bytes -> bf16 [num_blocks·32]; with
    a static ``width`` (and ``segments``) the rows' elements (a row's last block perhaps 16 values)
    and their scales by rows, num_blocks of them."""

    @cute.jit
    def __call__(
        self, elements_ptr: cute.Pointer, scales_ptr: cute.Pointer, out_ptr: cute.Pointer, num_blocks: cutlass.Int32,
        rows_used_ptr: cute.Pointer, blocks_per_row: cutlass.Int32, stream: cuda.CUstream,
    ):
        chunks = num_blocks * CHUNKS_PER_BLOCK
        if cutlass.const_expr(self.width is not None):
            chunks = num_blocks // self.row_blocks * (self.width // CHUNK)
        layout = cute.make_layout((chunks, CHUNK), stride=(CHUNK, 1))
        m_elements = cute.make_tensor(elements_ptr, layout)
        m_out = cute.make_tensor(out_ptr, layout)
        m_scales = cute.make_tensor(scales_ptr, cute.make_layout((num_blocks,)))
        m_used = cute.make_tensor(rows_used_ptr, cute.make_layout((1,)))
        self.kernel_back(m_elements, m_scales, m_out, m_used, blocks_per_row).launch(**self.launch_shape(num_blocks, stream))

    @cute.jit
    def chunks_to_convert(self, m_elements: cute.Tensor, m_scales: cute.Tensor, m_used: cute.Tensor, blocks_per_row: cutlass.Int32):
        """The quarter blocks (8 values) to convert: those of every row, or of the rows in use."""
        limit = self.blocks_to_convert(m_scales.shape[0], m_used, blocks_per_row) * CHUNKS_PER_BLOCK
        if cutlass.const_expr(self.width is not None):
            limit = cute.size(m_elements, mode=[0])
            if cutlass.const_expr(self.bounded):
                limit = min(limit, m_used[0] * (self.segments * self.width // CHUNK))
        return limit

    @cute.jit
    def chunk_scale(self, chunk) -> cutlass.Int32:
        """The scale (index into the scales by rows) of quarter block ``chunk``."""
        if cutlass.const_expr(self.width is None):
            return chunk >> CHUNKS_PER_BLOCK_LOG2
        row_chunks = self.width // CHUNK
        sub_row = chunk // row_chunks
        return sub_row * self.row_blocks + ((chunk - sub_row * row_chunks) >> CHUNKS_PER_BLOCK_LOG2)

    @cute.kernel
    def kernel_back(
        self, m_elements: cute.Tensor, m_scales: cute.Tensor, m_out: cute.Tensor, m_used: cute.Tensor, blocks_per_row: cutlass.Int32
    ):
        """A CTA takes ``threads`` blocks as CHUNKS_PER_BLOCK rounds of ``threads`` quarter blocks;
        each thread loads its rounds' elements and scales before it stores any (more bytes in flight)."""
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        first = cta * (self.threads * CHUNKS_PER_BLOCK) + tidx
        limit = self.chunks_to_convert(m_elements, m_scales, m_used, blocks_per_row)
        loaded = cute.make_rmem_tensor((CHUNKS_PER_BLOCK, CHUNK), m_elements.element_type)
        exponents = cute.make_rmem_tensor((CHUNKS_PER_BLOCK,), cutlass.Int32)
        for r in cutlass.range_constexpr(CHUNKS_PER_BLOCK):
            chunk = first + r * self.threads
            if chunk < limit:
                loaded[r, None].store(m_elements[chunk, None].load())
                exponents[r] = cutlass.Int32(m_scales[self.chunk_scale(chunk)]) & 0xFF  # (the byte comes in sign-extended)
        for r in cutlass.range_constexpr(CHUNKS_PER_BLOCK):
            chunk = first + r * self.threads
            if chunk < limit:
                values = loaded[r, None].load().to(cutlass.Float32) * e8m0_factor(exponents[r])
                m_out[chunk, None].store(values.to(m_out.element_type))


def compile_mxfp8(arch: str, options: str = "", back: bool = False, bounded: bool = False, mma_order: bool = False, columns: bool = False,
                  width: int | None = None, segments: int = 1, matrix_rows: int | None = None):
    """Compile the quantizer (``back``: the dequantizer; ``bounded``: converting the rows in use;
    ``mma_order``: scales in the MMA's order; ``columns``: blocks down the columns; ``width``,
    ``segments``, ``matrix_rows``: rows of a static width, :class:`QuantizeMxfp8Kernel`) for
    ``arch`` without tensors."""
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    gmem = cute.AddressSpace.gmem
    bf16 = make_ptr(cutlass.BFloat16, 0, gmem, assumed_align=16)
    elements = make_ptr(cutlass.Float8E4M3FN, 0, gmem, assumed_align=16)
    scales = make_ptr(cutlass.Uint8, 0, gmem, assumed_align=1)
    rows_used = make_ptr(cutlass.Int32, 0, gmem, assumed_align=4)
    kernel_class = DequantizeMxfp8Kernel if back else QuantizeMxfp8Kernel
    pointers = (elements, scales, bf16) if back else (bf16, elements, scales)
    shape = {} if width is None else dict(width=width, segments=segments, matrix_rows=matrix_rows)
    return cute.compile(
        kernel_class(bounded=bounded, mma_order=mma_order, columns=columns, **shape), *pointers, cutlass.Int32(1), rows_used,
        cutlass.Int32(1), make_fake_stream(), options=f"--gpu-arch {arch} {options}".strip(),
    )
