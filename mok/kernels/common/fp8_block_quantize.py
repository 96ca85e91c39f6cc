"""bf16 -> FP8 with 128-block fp32 scales, mok.fp8_block's rule bit for bit (arch-neutral).

A CTA takes a tile of 128 rows x 128 columns (one K block of 128 rows) with four warps; a warp
takes rows w, w + 4, ..., a lane four consecutive values of the row (8-byte loads, a warp's 256
bytes contiguous; 4-byte stores). ``block_rows`` (static) says what one scale covers:

- 1 (activations, 1 x 128): each row's largest magnitude is a butterfly max over the warp's lanes,
  its scale goes to scales[k_block, row] (the transposed [K / 128, R] layout the GEMM's TMA reads);
- 128 (weights, 128 x 128): the tile's largest magnitude (the warps' maxima through shared
  memory) scales every row; the scale goes to scales[row tile, k_block] ([E, N / 128, K / 128] for
  weights [E, N, K] taken as E·N rows, each expert's N rows tiled on their own).

Widths need not be multiples of 128 (multiples of 16: 16-byte E4M3 rows): a partial last block
holds the values there are (lanes past the width read and write nothing), and a partial last row
tile of an expert's weights the rows there are. ``segments`` = 2 blocks each half of a row on its
own (dh, whose halves are the dx GEMM's two K ranges, k_split): blocks restart at the second half,
ceil(K / 2 / 128) of them a half.

``mma_scales`` (power-of-two scales: SM100's block-scaled MMAs): each scale as its E8M0 byte (the
power's exponent + 127: the fp32 scale's exponent field) at every 32-block it covers, in the order
the MMAs read MXFP8 scales (mok.mxfp8.mma_scale_layout: a 512-byte chunk per 128 rows and 128 K
values, ceil(width / 128) chunks a row, each segment's starting a chunk): a row's block is its
four bytes of a chunk, one 4-byte store; a weight's 128 x 128 block is a whole chunk, a 4-byte
store per thread. A segment's partial last block has its scale at the 32-blocks it covers and
127 (scale 1) at the rest, a matrix's padding rows 127 throughout (mok.mxfp8's padding
convention: finite scales where the MMA reads past the values, whose zeros stay zeros). The
elements are the same, so the product the MXFP8 kernels compute is the recipe's, up to the MMA's
own rounding.

scale = amax / 448 (1 for an all-zero block; ``power_of_two``: the power of two at or above it,
from its bits: a set mantissa rounds the exponent up, at least 2^-126), factor = 448 / amax (1 / scale
for a power of two, exact), elements = cvt.rn.satfinite.e4m3x2(x · factor). A max is the same in
any order, so the bits do not depend on the launch. ``bounded``: only the first rows_used[0] rows
(a schedule's used rows, read on the device). ``gathered`` (rows, block_rows 1): output row r is
source row row_source[r] quantized (zeros with scale 1 where it is negative: a schedule's padding
rows), so a GEMM's gathered rows come out in FP8 in one pass, with no bf16 copy of them: the
bits of quantizing the gathered bf16 rows, each row being quantized on its own. ``copies_rows``
(with ``gathered``): the gathered bf16 rows are written too, from the values already loaded (zeros
at padding rows: ops.gather_rows' bits), for a consumer that needs both (the backward's dout rows:
the FP8 SwiGLU backward and the bf16 weight gradients), with no second pass over them.

:class:`QuantizeFp8ColumnsKernel` quantizes the rows' transpose instead (1 x 128 blocks along the
rows, for the weight gradients on FP8, whose K is the rows; with ``mma_scales`` the same blocks as
SM100's MXFP8 weight gradient reads them): see its docstring. :func:`e8m0_word` and
:func:`mma_scale_word` are the MMA order's byte and place, for every kernel that writes it (the
quantizers, the FP8 EP dispatch).
:class:`DequantizeFp8RowsKernel` takes rows (1 x 128 blocks, fp32 scales) back to bf16.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory

from .compile import compile_kernel
from .records import FP8_BLOCK_QUANTIZE_ARGS
from .row_gather import copy_async_16b
from .row_vectors import row_vector

BLOCK = 128  # values along a row that share a scale (mok.fp8_block.BLOCK)
WARPS = 4
LANES = 32
PER_LANE = BLOCK // LANES  # 4 values a lane
E4M3_MAX = 448.0
MANTISSA_MASK = 0x7FFFFF
EXPONENT_MASK = 0x7F800000
EXPONENT_ONE = 0x00800000
ROW_CHUNK = 8  # bf16 values of one 16-byte load (QuantizeFp8ColumnsKernel)
SEGMENT_CHUNKS = BLOCK // ROW_CHUNK  # 16-byte chunks of a row's 128 values
OUT_CHUNK = 16  # E4M3 values of one 16-byte store
SCALE_ONE = 127  # E8M0 byte of scale 1 (mok.mxfp8.SCALE_ONE): the MMA order's padding blocks and rows
BLOCKS_32 = BLOCK // 32  # MXFP8 32-blocks of a 128-block (bytes of its E8M0 word)
QUAD = 4  # adjacent columns a thread of QuantizeFp8ColumnsKernel takes (an 8-byte shared-memory load a row)
COLUMN_ROWS = BLOCK // WARPS  # rows of them it takes (a warp's quarter of the tile)
ROWS_IN_FLIGHT = 8  # rows a warp of the rows' quantizer loads before it converts any (8 x 8 bytes a lane in flight)


@cute.jit
def power_of_two_at_or_above(s: cutlass.Float32) -> cutlass.Float32:
    """The power of two at or above a non-negative finite ``s``, at least 2^-126, from its bits."""
    bits = cute.make_rmem_tensor((1,), cutlass.Float32)
    bits[0] = s
    raw = cute.recast_tensor(bits, cutlass.Int32)
    if (raw[0] & MANTISSA_MASK) != 0:
        raw[0] = (raw[0] & EXPONENT_MASK) + EXPONENT_ONE
    return bits[0]


@cute.jit
def block_scale_and_factor(amax: cutlass.Float32, power_of_two: cutlass.Constexpr[bool]):
    """(scale, the factor a block's values are multiplied by before their E4M3 conversion) of a
    block whose largest magnitude is ``amax``: the module docstring's rule (every kernel that
    quantizes 1 x 128 or 128 x 128 blocks applies it from here)."""
    scale = cutlass.Float32(1.0)
    factor = cutlass.Float32(1.0)
    if amax > 0.0:
        scale = amax / E4M3_MAX
        if cutlass.const_expr(power_of_two):
            scale = power_of_two_at_or_above(scale)
            factor = 1.0 / scale
        else:
            factor = E4M3_MAX / amax
    return scale, factor


@cute.jit
def e8m0_word(scale: cutlass.Float32, blocks: cutlass.Constexpr[int] = 4) -> cutlass.Float32:
    """A power-of-two ``scale``'s E8M0 byte (its exponent field: exponent + 127) in each of the
    word's first ``blocks`` bytes (the 32-blocks a 128-block has: fewer where it is a row's partial
    last one) and 127 (scale 1, mok.mxfp8.SCALE_ONE: finite, so the zeros the MMA reads past the
    row stay zeros) in the rest, as the fp32 word whose bits they are (0.0 gives zero bytes)."""
    ones = sum(1 << (8 * i) for i in range(blocks))
    padding = sum(SCALE_ONE << (8 * i) for i in range(blocks, 4))
    bits = cute.make_rmem_tensor((1,), cutlass.Float32)
    bits[0] = scale
    raw = cute.recast_tensor(bits, cutlass.Int32)
    raw[0] = ((raw[0] >> 23) & 0xFF) * ones + padding
    return bits[0]


def last_block_32s(width: int) -> int:
    """The MXFP8 32-blocks a row of ``width`` values has in its last 128-block (its E8M0 word's bytes
    that carry the scale; 4 where 128 divides the width)."""
    return -(-(width - (-(-width // BLOCK) - 1) * BLOCK) // 32)


@cute.jit
def block_e8m0_word(scale: cutlass.Float32, k_block, blocks: cutlass.Constexpr[int], last_32s: cutlass.Constexpr[int]):
    """K block ``k_block``'s E8M0 word (:func:`e8m0_word`) of a row of ``blocks`` 128-blocks a
    segment whose last has ``last_32s`` 32-blocks (:func:`last_block_32s`): 127 past them there.
    (Shared by the quantizers and the FP8 EP dispatch in the MMA order.)"""
    word = e8m0_word(scale)
    if cutlass.const_expr(last_32s < BLOCKS_32):
        if (k_block + 1) % blocks == 0:
            word = e8m0_word(scale, last_32s)
    return word


@cute.jit
def padding_word() -> cutlass.Float32:
    """The 4-byte word of an MMA-ordered chunk's padding row (past a matrix's rows): 127 four
    times (:func:`e8m0_word` of no 32-block)."""
    return e8m0_word(cutlass.Float32(0.0), 0)


@cute.jit
def mma_scale_word(row, k_block, k_blocks):
    """The 4-byte word holding row ``row``'s E8M0 bytes of 128-block ``k_block`` (``k_blocks`` a
    row; one byte per 32-block) in the order SM100's block-scaled MMAs read MXFP8 scales
    (mok.mxfp8.mma_scale_layout): word (row % 32)·4 + (row / 32) % 4 of the 128-word chunk
    (row / 128, k_block)."""
    return ((row >> 7) * k_blocks + k_block) * BLOCK + (row & 31) * 4 + ((row >> 5) & 3)


class QuantizeFp8BlockKernel:
    """Static config: the rows' width K (a multiple of 16), ``block_rows`` (1 or 128),
    ``power_of_two``, ``bounded``, ``segments`` (1, or 2 for rows), ``matrix_rows`` (weights
    whose N is no multiple of 128: the rows of one expert's matrix, N; None: the rows tile by 128
    whole), ``mma_scales``, ``gathered`` and ``copies_rows`` (see the module docstring)."""

    def __init__(self, width: int, block_rows: int = 1, power_of_two: bool = False, bounded: bool = False, segments: int = 1,
                 matrix_rows: int | None = None, mma_scales: bool = False, gathered: bool = False, copies_rows: bool = False) -> None:
        if block_rows not in (1, BLOCK):
            raise ValueError(f"block_rows: expected 1 (rows) or {BLOCK} (weights), got {block_rows}")
        if segments not in (1, 2) or (segments == 2 and block_rows != 1):
            raise ValueError(f"segments: expected 1, or 2 for rows (block_rows 1), got {segments} with block_rows {block_rows}")
        if width % (16 * segments) or width <= 0:
            raise ValueError(f"width: expected a positive multiple of {16 * segments} (16-byte E4M3 rows per segment), got {width}")
        if matrix_rows is not None and (block_rows == 1 or matrix_rows <= 0):
            raise ValueError(f"matrix_rows: expected None, or the rows of one expert's weights with block_rows {BLOCK}, got {matrix_rows}")
        if mma_scales and not power_of_two:
            raise ValueError("mma_scales: E8M0 scales for SM100's block-scaled MMAs need power_of_two")
        if gathered and block_rows != 1:
            raise ValueError(f"gathered: rows only (block_rows 1), got block_rows {block_rows}")
        if copies_rows and not gathered:
            raise ValueError("copies_rows: the gathered rows' bf16 copy, with gathered=True only")
        self.copies_rows = copies_rows
        self.width, self.block_rows, self.power_of_two, self.bounded = width, block_rows, power_of_two, bounded
        self.gathered = gathered
        self.mma_scales = mma_scales
        self.segments, self.matrix_rows = segments, matrix_rows
        self.segment_width = width // segments
        self.segment_blocks = -(-self.segment_width // BLOCK)  # K blocks of a segment, the last one partial
        self.k_blocks = segments * self.segment_blocks
        self.whole_blocks = self.segment_width % BLOCK == 0  # (no lane ever lies past its segment)
        self.last_32s = last_block_32s(self.segment_width)  # (mma_scales: the rest of a segment's last E8M0 word padding)

    @cute.jit
    def __call__(
        self, x_ptr: cute.Pointer, elements_ptr: cute.Pointer, scales_ptr: cute.Pointer, rows_used_ptr: cute.Pointer,
        row_source_ptr: cute.Pointer, rows_copy_ptr: cute.Pointer, num_rows: cutlass.Int32, num_src: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        """x [R, K] bf16 (``gathered``: [num_src, K], row_source [R] int32) -> elements [R, K] E4M3
        and fp32 scales: [k blocks, R] (block_rows 1) or [E, ceil(N / 128), k blocks] (block_rows
        128, R = E·N); ``copies_rows``: the gathered rows [R, K] bf16 into rows_copy."""
        k_blocks = self.k_blocks
        rows = cute.make_layout((num_rows, self.width), stride=(self.width, 1))
        m_q = cute.make_tensor(elements_ptr, rows)
        m_x = cute.make_tensor(x_ptr, rows)
        if cutlass.const_expr(self.gathered):
            m_x = cute.make_tensor(x_ptr, cute.make_layout((num_src, self.width), stride=(self.width, 1)))
        m_source = cute.make_tensor(row_source_ptr, cute.make_layout((num_rows,)))
        m_copy = cute.make_tensor(rows_copy_ptr, rows) if cutlass.const_expr(self.copies_rows) else None
        row_tiles = (num_rows + BLOCK - 1) // BLOCK
        if cutlass.const_expr(self.matrix_rows is not None):  # (each matrix's row tiles on their own)
            row_tiles = num_rows // self.matrix_rows * ((self.matrix_rows + BLOCK - 1) // BLOCK)
        if cutlass.const_expr(self.mma_scales):  # (uint8 [chunks, k blocks, 512] as 4-byte words: 128 a chunk)
            m_s = cute.make_tensor(scales_ptr, cute.make_layout((row_tiles * k_blocks * BLOCK,)))
        elif cutlass.const_expr(self.block_rows == 1):
            m_s = cute.make_tensor(scales_ptr, cute.make_layout((num_rows, k_blocks), stride=(1, num_rows)))
        else:
            m_s = cute.make_tensor(scales_ptr, cute.make_layout((row_tiles, k_blocks), stride=(k_blocks, 1)))
        m_used = cute.make_tensor(rows_used_ptr, cute.make_layout((1,)))
        self.kernel(m_x, m_q, m_s, m_used, m_source, m_copy, num_rows).launch(
            grid=[k_blocks, row_tiles, 1], block=[WARPS * LANES, 1, 1], stream=stream
        )

    @cute.jit
    def cta_rows(self, m_used, num_rows):
        """This CTA's (K block, row tile), the thread's (warp, lane), and the rows to convert: all
        ``num_rows``, or with ``bounded`` the first rows_used[0]."""
        tidx, _, _ = cute.arch.thread_idx()
        k_block, row_tile, _ = cute.arch.block_idx()
        limit = num_rows
        if cutlass.const_expr(self.bounded):
            limit = min(num_rows, m_used[0])
        return k_block, row_tile, tidx // LANES, tidx % LANES, limit

    @cute.jit
    def lane_column(self, k_block, lane):
        """(the first of this lane's four columns in K block ``k_block``, whether they lie in the row:
        a partial last block of a segment holds fewer than 128)."""
        segment = k_block // self.segment_blocks
        column = segment * self.segment_width + (k_block - segment * self.segment_blocks) * BLOCK + lane * PER_LANE
        return column, column < (segment + 1) * self.segment_width

    @cute.jit
    def lane_values(self, m_x, row, k_block, lane):
        """This lane's four values of row ``row`` in K block ``k_block``, as fp32 (zeros past the segment)."""
        column, inside = self.lane_column(k_block, lane)
        if cutlass.const_expr(self.whole_blocks):
            return row_vector(m_x, row, column // PER_LANE, PER_LANE).load().to(cutlass.Float32)
        values = cute.make_rmem_tensor((PER_LANE,), cutlass.Float32)
        values.fill(0.0)
        if inside:
            values.store(row_vector(m_x, row, column // PER_LANE, PER_LANE).load().to(cutlass.Float32))
        return values.load()

    @cute.jit
    def scale_and_factor(self, amax):
        """(scale, the factor the values are multiplied by) of a block with largest magnitude ``amax``."""
        return block_scale_and_factor(amax, self.power_of_two)

    @cute.jit
    def store_row_scale(self, m_s, row, k_block, scale):
        """Row ``row``'s scale of K block ``k_block``: fp32 at [k_block, row], or (``mma_scales``) its
        E8M0 byte for the block's four 32-blocks, one word of the row's chunk (the four bytes lie
        together: mok.mxfp8.mma_scale_layout)."""
        if cutlass.const_expr(self.mma_scales):
            m_s[mma_scale_word(row, k_block, self.k_blocks)] = block_e8m0_word(scale, k_block, self.segment_blocks, self.last_32s)
        else:
            m_s[row, k_block] = scale

    @cute.jit
    def quantize_row(self, m_x, m_q, source, row, k_block, lane, factor):
        """Row ``source`` of x times ``factor`` into row ``row`` of the elements, as E4M3."""
        values = self.lane_values(m_x, source, k_block, lane)
        column, inside = self.lane_column(k_block, lane)
        if cutlass.const_expr(self.whole_blocks):
            self.store_lane(m_q, None, row, column, values, factor)
        elif inside:
            self.store_lane(m_q, None, row, column, values, factor)

    @cute.jit
    def store_lane(self, m_q, m_copy, row, column, values, factor):
        """A lane's four values times ``factor`` into the elements as E4M3 (and as they are into
        ``m_copy`` where given)."""
        row_vector(m_q, row, column // PER_LANE, PER_LANE).store((values * factor).to(m_q.element_type))
        if cutlass.const_expr(m_copy is not None):
            row_vector(m_copy, row, column // PER_LANE, PER_LANE).store(values.to(m_copy.element_type))

    @cute.jit
    def quantize_row_block(self, m_x, m_q, source, row, k_block, lane):
        """Row ``source`` of x's K block ``k_block`` quantized on its own into row ``row``; its
        scale (one token's block at a time: the EP publish's)."""
        scale, factor = self.scale_and_factor(self.row_amax(m_x, source, k_block, lane))
        self.quantize_row(m_x, m_q, source, row, k_block, lane, factor)
        return scale

    @cute.jit
    def load_lane(self, m_x, row, k_block, lane, valid):
        """This lane's four values of row ``row`` in K block ``k_block`` as they are (bf16), zeros
        past the segment and where not ``valid`` (nothing read there). A warp loads a group's rows
        before it converts any: each lane's loads in flight together (a store between them would
        keep the next load behind it)."""
        column, inside = self.lane_column(k_block, lane)
        values = cute.make_rmem_tensor((PER_LANE,), m_x.element_type)
        values.fill(0.0)
        if valid:
            if cutlass.const_expr(self.whole_blocks):
                values.store(row_vector(m_x, row, column // PER_LANE, PER_LANE).load())
            elif inside:
                values.store(row_vector(m_x, row, column // PER_LANE, PER_LANE).load())
        return values

    @cute.jit
    def convert_lane(self, m_q, m_copy, row, k_block, lane, values):
        """A row's block from this lane's four loaded ``values`` (:meth:`load_lane`; all-zero for
        padding rows, which so come out zeros with scale 1): its scale, the elements (and the
        values as they are into ``m_copy`` where given) stored."""
        values_f32 = values.load().to(cutlass.Float32)
        scale, factor = self.scale_and_factor(self.amax_of(values_f32))
        column, inside = self.lane_column(k_block, lane)
        if cutlass.const_expr(self.whole_blocks):
            self.store_lane(m_q, m_copy, row, column, values_f32, factor)
        elif inside:
            self.store_lane(m_q, m_copy, row, column, values_f32, factor)
        return scale

    @cute.jit
    def row_amax(self, m_x, row, k_block, lane):
        """The largest magnitude of the row's K block (every lane gets it: a butterfly max)."""
        return self.amax_of(self.lane_values(m_x, row, k_block, lane))

    @cute.jit
    def amax_of(self, values):
        """The largest magnitude of a block whose lanes hold ``values`` (four fp32 each), on every lane."""
        amax = cutlass.Float32(0.0)
        for v in cutlass.range_constexpr(PER_LANE):
            amax = cute.arch.fmax(amax, cute.math.absf(values[v]))
        for offset in cutlass.range_constexpr(5):
            amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << offset))
        return amax

    @cute.kernel
    def kernel(self, m_x: cute.Tensor, m_q: cute.Tensor, m_s: cute.Tensor, m_used: cute.Tensor, m_source: cute.Tensor,
               m_copy: cute.Tensor | None, num_rows: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        k_block, row_tile, warp, lane, limit = self.cta_rows(m_used, num_rows)
        first = row_tile * BLOCK
        if cutlass.const_expr(self.matrix_rows is not None):  # an expert's row tiles on their own: its last one partial
            tiles_per_matrix = (self.matrix_rows + BLOCK - 1) // BLOCK
            matrix = row_tile // tiles_per_matrix
            first = matrix * self.matrix_rows + (row_tile - matrix * tiles_per_matrix) * BLOCK
            limit = min(limit, (matrix + 1) * self.matrix_rows)
        if cutlass.const_expr(self.block_rows == 1):
            lane_source = cutlass.Int32(-1)  # (gathered: lane j holds the source of the warp's j-th row, read up front)
            if cutlass.const_expr(self.gathered):
                if first + warp + WARPS * lane < limit:
                    lane_source = m_source[first + warp + WARPS * lane]
            for group in cutlass.range(BLOCK // WARPS // ROWS_IN_FLIGHT):  # (the warp's rows w, w + 4, ...: its j-th row, lane j's source)
                loaded = []
                for i in cutlass.range_constexpr(ROWS_IN_FLIGHT):
                    j = group * ROWS_IN_FLIGHT + i
                    row = first + warp + WARPS * j
                    source = row
                    valid = row < limit
                    if cutlass.const_expr(self.gathered):  # (negative past the limit and for padding rows: zeros, scale 1)
                        source = cute.arch.shuffle_sync(lane_source, j)
                        valid = source >= 0
                    loaded.append((row, self.load_lane(m_x, source, k_block, lane, valid)))
                for i in cutlass.range_constexpr(ROWS_IN_FLIGHT):
                    row, values = loaded[i]
                    if row < limit:
                        scale = self.convert_lane(m_q, m_copy, row, k_block, lane, values)
                        if lane == 0:
                            self.store_row_scale(m_s, row, k_block, scale)
        else:
            smem = cutlass.memory.SmemAllocator()
            s_max = smem.allocate_tensor(cutlass.Float32, cute.make_layout((WARPS,)), byte_alignment=16)
            amax = cutlass.Float32(0.0)
            for r in cutlass.range(warp, BLOCK, WARPS, unroll=2):
                if first + r < limit:
                    amax = cute.arch.fmax(amax, self.row_amax(m_x, first + r, k_block, lane))
            if lane == 0:
                s_max[warp] = amax
            cute.arch.sync_threads()
            for w in cutlass.range_constexpr(WARPS):
                amax = cute.arch.fmax(amax, s_max[w])
            scale, factor = self.scale_and_factor(amax)
            for r in cutlass.range(warp, BLOCK, WARPS, unroll=2):
                if first + r < limit:
                    self.quantize_row(m_x, m_q, first + r, first + r, k_block, lane, factor)
            if cutlass.const_expr(self.mma_scales):  # (the block is a whole chunk: every thread one word of it, word w row
                word = block_e8m0_word(scale, k_block, self.segment_blocks, self.last_32s)  # (w % 4)·32 + w / 4 of the
                # tile; past the matrix's rows padding)
                if cutlass.const_expr(self.matrix_rows is not None):
                    if first + (tidx % 4) * 32 + tidx // 4 >= limit:
                        word = padding_word()
                m_s[(row_tile * self.k_blocks + k_block) * BLOCK + tidx] = word
            elif tidx == 0 and first < limit:
                m_s[row_tile, k_block] = scale


class QuantizeFp8ColumnsKernel(QuantizeFp8BlockKernel):
    """The rows' transpose quantized: rows [R, M] bf16 (R a multiple of 128) -> elements [M, R] E4M3
    and fp32 scales [R / 128, M], each column's 128-row blocks scaled on their own: the bits of
    quantizing the transpose's rows (mok.fp8_block.quantize_rows(rows.T)), the operands a weight
    gradient on FP8 WGMMAs takes (its K is the rows, and FP8 WGMMAs read K-major operands only).
    A CTA takes a 128 x 128 tile: its threads copy the rows' 16-byte segments into shared memory by
    cp.async (16 threads a row, a warp two rows at a time; padding rows and columns past the width
    zero-filled, nothing staged in registers); then warp w takes rows 32w .. 32w + 31 of it, lane l
    columns 4l .. 4l + 3 (32 eight-byte loads: a warp reads whole rows; with two-byte loads, one
    column a thread, the shared-memory queue was the bound), the four warps' maxima meet in shared
    memory, each lane converts its columns' 32 values to E4M3, and the tile's transpose goes out
    through shared memory as whole 128-byte lines (:meth:`store_transposed_tile`), warp 0 the four
    scales. Static
    config: the width M (a multiple of 16; a partial last column tile), ``power_of_two``,
    ``bounded`` (the row blocks below rows_used[0], a multiple of 128), ``gathered`` (row r is
    source row row_source[r] of x, zeros where negative) and ``mma_scales`` (power_of_two: the
    operands SM100's MXFP8 weight gradient reads, MN-major): the elements stay in the rows' own
    layout [R, M] (a lane's four columns one 4-byte store a row) and each column's 128-row block
    scale goes out as its E8M0 byte at the block's four 32-blocks, in the order the MMAs read MXFP8
    scales ([ceil(M / 128), R / 128, 512]: column m's block b is one word of chunk (m / 128, b), as
    a row's is in the row quantizer; the words of the columns past M, 127 four times, by the lane
    of the last column). ``segments`` 2 (``mma_scales``; dh, whose halves are the split-out weight
    gradient's two M ranges): each half's columns start a chunk, ceil(M / 2 / 128) chunks a half
    (the values are the same: a column's blocks are its own)."""

    def __init__(self, width: int, power_of_two: bool = False, bounded: bool = False, gathered: bool = False,
                 mma_scales: bool = False, segments: int = 1) -> None:
        if segments != 1 and not mma_scales:
            raise ValueError(f"segments: 1, or 2 with mma_scales (the halves' chunks), got {segments} without")
        super().__init__(width, 1, power_of_two, bounded, segments=segments, mma_scales=mma_scales, gathered=gathered)
        self.padding_columns = self.segment_blocks * BLOCK - self.segment_width  # (a segment's chunk columns past it)

    @cute.jit
    def __call__(
        self, x_ptr: cute.Pointer, elements_ptr: cute.Pointer, scales_ptr: cute.Pointer, rows_used_ptr: cute.Pointer,
        row_source_ptr: cute.Pointer, rows_copy_ptr: cute.Pointer, num_rows: cutlass.Int32, num_src: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        """x [R, M] bf16 (``gathered``: [num_src, M], row_source [R] int32) -> elements [M, R] E4M3,
        scales [R / 128, M] fp32 (``mma_scales``: elements [R, M], scales [segments · ceil(M /
        segments / 128), R / 128, 512] E8M0 as 4-byte words)."""
        m = self.width
        sources = num_src if self.gathered else num_rows
        m_x = cute.make_tensor(x_ptr, cute.make_layout((sources, m), stride=(m, 1)))
        rows = cute.assume(num_rows, divby=BLOCK)  # (so that each 16-byte run of an output row is known to be aligned)
        row_blocks = num_rows // BLOCK
        if cutlass.const_expr(self.mma_scales):
            m_q = cute.make_tensor(elements_ptr, cute.make_layout((rows, m), stride=(m, 1)))
            m_s = cute.make_tensor(scales_ptr, cute.make_layout((self.k_blocks * row_blocks * BLOCK,)))
        else:
            m_q = cute.make_tensor(elements_ptr, cute.make_layout((m, rows), stride=(rows, 1)))
            m_s = cute.make_tensor(scales_ptr, cute.make_layout((row_blocks, m), stride=(m, 1)))
        m_source = cute.make_tensor(row_source_ptr, cute.make_layout((num_rows,)))
        m_used = cute.make_tensor(rows_used_ptr, cute.make_layout((1,)))
        self.kernel_columns(m_x, m_q, m_s, m_used, m_source).launch(
            grid=[(m + BLOCK - 1) // BLOCK, row_blocks, 1], block=[WARPS * LANES, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel_columns(self, m_x: cute.Tensor, m_q: cute.Tensor, m_s: cute.Tensor, m_used: cute.Tensor, m_source: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        column_tile, row_block, _ = cute.arch.block_idx()
        limit = m_q.shape[0] if cutlass.const_expr(self.mma_scales) else m_q.shape[1]  # (R)
        if cutlass.const_expr(self.bounded):
            limit = min(limit, m_used[0])
        first = row_block * BLOCK
        if first < limit:
            smem = cutlass.memory.SmemAllocator()
            s_tile = smem.allocate_tensor(cutlass.BFloat16, cute.make_layout((BLOCK, BLOCK), stride=(BLOCK, 1)), byte_alignment=16)
            s_amax = smem.allocate_tensor(cutlass.Float32, cute.make_layout((WARPS, BLOCK), stride=(BLOCK, 1)), byte_alignment=16)
            chunk = tidx % SEGMENT_CHUNKS  # (16 threads a row: a 16-byte chunk each)
            column0 = column_tile * BLOCK
            inside = column0 + chunk * ROW_CHUNK < self.width
            for step in cutlass.range_constexpr(BLOCK * SEGMENT_CHUNKS // (WARPS * LANES)):
                r = step * (WARPS * LANES // SEGMENT_CHUNKS) + tidx // SEGMENT_CHUNKS
                source = first + r
                if cutlass.const_expr(self.gathered):
                    source = m_source[first + r]
                nbytes = cutlass.Int32(inside and source >= 0) * 16  # (0: zero-filled, nothing read)
                element = cutlass.Int64(max(source, 0)) * self.width + column0 + chunk * ROW_CHUNK
                copy_async_16b(s_tile.iterator + (r * BLOCK + chunk * ROW_CHUNK), m_x.iterator + element, nbytes)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()
            # warp w takes rows 32w .. 32w + 31, lane l columns 4l .. 4l + 3: one 8-byte load a row
            warp, lane = tidx // LANES, tidx % LANES
            rows = cute.local_tile(s_tile, (COLUMN_ROWS, QUAD), (warp, lane))  # (its 32 x 4 values)
            amax = cute.make_rmem_tensor((QUAD,), cutlass.Float32)
            amax.fill(0.0)
            for i in cutlass.range_constexpr(COLUMN_ROWS):
                row = row_vector(rows, i, 0, QUAD).load().to(cutlass.Float32)
                for c in cutlass.range_constexpr(QUAD):
                    amax[c] = cute.arch.fmax(amax[c], cute.math.absf(row[c]))
            row_vector(s_amax, warp, lane, QUAD).store(amax.load())  # (each warp's maxima, then every warp's)
            cute.arch.sync_threads()
            for w in cutlass.range_constexpr(WARPS):
                for c in cutlass.range_constexpr(QUAD):
                    amax[c] = cute.arch.fmax(amax[c], s_amax[w, lane * QUAD + c])
            column = column0 + lane * QUAD  # (the width a multiple of 16: a lane's four columns all in or all out)
            runs = cute.make_rmem_tensor(cute.make_layout((QUAD, COLUMN_ROWS), stride=(COLUMN_ROWS, 1)), m_q.element_type)
            if column < self.width:
                factors = cute.make_rmem_tensor((QUAD,), cutlass.Float32)
                scales = cute.make_rmem_tensor((QUAD,), cutlass.Float32)
                for c in cutlass.range_constexpr(QUAD):
                    scales[c], factors[c] = self.scale_and_factor(amax[c])
                if cutlass.const_expr(self.mma_scales):
                    self.store_rows_mma(rows, factors, scales, m_q, m_s, first + warp * COLUMN_ROWS, column, row_block, warp)
                else:
                    for i in cutlass.range_constexpr(0, COLUMN_ROWS, 2):  # (two rows at a time: E4M3 converts in pairs)
                        pair = cute.make_rmem_tensor((2, QUAD), cutlass.Float32)
                        for h in cutlass.range_constexpr(2):
                            row = row_vector(rows, i + h, 0, QUAD).load().to(cutlass.Float32)
                            for c in cutlass.range_constexpr(QUAD):
                                pair[h, c] = row[c] * factors[c]
                        for c in cutlass.range_constexpr(QUAD):
                            row_vector(runs, c, i // 2, 2).store(pair[None, c].load().to(m_q.element_type))
                    if warp == 0:
                        row_vector(m_s, row_block, column // QUAD, QUAD).store(scales.load())
            if cutlass.const_expr(not self.mma_scales):
                self.store_transposed_tile(runs, s_tile, m_q, column0, row_block, tidx)

    @cute.jit
    def store_transposed_tile(self, runs, s_tile, m_q, column0, row_block, tidx):
        """The tile's E4M3 transpose out as whole 128-byte lines: each lane's four columns' 32-byte
        runs (``runs``) into shared memory, over the bf16 tile once every thread has read it, as
        [128 columns, 128 rows] bytes (each run's two 16-byte halves at chunk 2w + h of its column,
        XOR the lane's index mod 8, so a warp's stores spread over all banks), then each output row's
        128 bytes by eight adjacent threads (a warp four whole lines a store; columns past the width
        not written). Stored in 32-byte pieces straight from registers, 128 rows apart, the writes
        held the kernel at ~55% of the DRAM rate; as lines it runs at the rows' quantizer's rate
        (1.6x faster, perf/RESULTS.md)."""
        warp, lane = tidx // LANES, tidx % LANES
        s_out = cute.make_tensor(cute.recast_ptr(s_tile.iterator, dtype=m_q.element_type), cute.make_layout((BLOCK, BLOCK), stride=(BLOCK, 1)))
        halves = cute.make_tensor(runs.iterator, cute.make_layout((QUAD, 2, OUT_CHUNK), stride=(COLUMN_ROWS, OUT_CHUNK, 1)))
        line_chunks = BLOCK // OUT_CHUNK  # (16-byte chunks of an output row's 128 bytes)
        cute.arch.sync_threads()  # (every thread done reading the bf16 tile)
        for c in cutlass.range_constexpr(QUAD):
            for h in cutlass.range_constexpr(2):
                chunk = (2 * warp + h) ^ (lane % line_chunks)
                row_vector(s_out, lane * QUAD + c, chunk, OUT_CHUNK).store(halves[c, h, None].load())
        cute.arch.sync_threads()
        for j in cutlass.range_constexpr(BLOCK * line_chunks // (WARPS * LANES)):
            out_row = j * (WARPS * LANES // line_chunks) + tidx // line_chunks
            chunk = tidx % line_chunks
            if column0 + out_row < self.width:
                stored = row_vector(s_out, out_row, chunk ^ (out_row // QUAD % line_chunks), OUT_CHUNK).load()
                row_vector(m_q, column0 + out_row, row_block * line_chunks + chunk, OUT_CHUNK).store(stored)

    @cute.jit
    def store_rows_mma(self, rows, factors, scales, m_q, m_s, first_row, column, row_block, warp):
        """``mma_scales``: this lane's 32 rows x 4 columns as E4M3 into the rows' own layout (4 bytes a
        row: a warp writes a row's 128 bytes), and (warp 0) its columns' scales as E8M0 words
        (:func:`mma_scale_word`, a column being the MMA's row and the row block its K block)."""
        for i in cutlass.range_constexpr(COLUMN_ROWS):
            row = row_vector(rows, i, 0, QUAD).load().to(cutlass.Float32)
            scaled = cute.make_rmem_tensor((QUAD,), cutlass.Float32)
            for c in cutlass.range_constexpr(QUAD):
                scaled[c] = row[c] * factors[c]
            row_vector(m_q, first_row + i, column // QUAD, QUAD).store(scaled.load().to(m_q.element_type))
        if warp == 0:  # (column m's row block is chunk (m / 128, row_block): the column is the MMA's row)
            k_blocks = m_q.shape[0] // BLOCK
            segment = column // self.segment_width  # (the MMA's row: the column's place in its segment's chunks)
            at = segment * self.segment_blocks * BLOCK + column - segment * self.segment_width
            for c in cutlass.range_constexpr(QUAD):
                m_s[mma_scale_word(at + c, row_block, k_blocks)] = e8m0_word(scales[c])
            if cutlass.const_expr(self.padding_columns > 0):  # (the segment's last column's lane: its chunk's rows past it)
                if column + QUAD == (segment + 1) * self.segment_width:
                    for pad in cutlass.range_constexpr(self.padding_columns):
                        m_s[mma_scale_word(at + QUAD + pad, row_block, k_blocks)] = padding_word()


class DequantizeFp8RowsKernel(QuantizeFp8BlockKernel):
    """FP8 rows with 1 x 128 block scales back to bf16 (the quantizer's launch arguments, x now the
    output): x[r, c] = bf16(elements[r, c] · scales[c / 128, r]), the rows' values as the FP8 GEMMs
    see them (x's rows that crossed to an expert's rank in FP8, for the backward's bf16 weight
    gradient). The quantizer's grid: a CTA per 128 rows and K block, a warp's lane four values of a
    row (4-byte loads, 8-byte stores); ``bounded``: the first rows_used[0] rows only."""

    def __init__(self, width: int, bounded: bool = False) -> None:
        super().__init__(width, bounded=bounded)

    @cute.jit
    def __call__(
        self, x_ptr: cute.Pointer, elements_ptr: cute.Pointer, scales_ptr: cute.Pointer, rows_used_ptr: cute.Pointer,
        row_source_ptr: cute.Pointer, rows_copy_ptr: cute.Pointer, num_rows: cutlass.Int32, num_src: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        """elements [R, K] E4M3 and scales [k blocks, R] fp32 -> x [R, K] bf16 (``row_source``,
        ``rows_copy``, ``num_src``: unused)."""
        rows = cute.make_layout((num_rows, self.width), stride=(self.width, 1))
        m_s = cute.make_tensor(scales_ptr, cute.make_layout((num_rows, self.k_blocks), stride=(1, num_rows)))
        m_used = cute.make_tensor(rows_used_ptr, cute.make_layout((1,)))
        self.kernel_back(cute.make_tensor(elements_ptr, rows), m_s, cute.make_tensor(x_ptr, rows), m_used, num_rows).launch(
            grid=[self.k_blocks, (num_rows + BLOCK - 1) // BLOCK, 1], block=[WARPS * LANES, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel_back(self, m_q: cute.Tensor, m_s: cute.Tensor, m_x: cute.Tensor, m_used: cute.Tensor, num_rows: cutlass.Int32):
        k_block, row_tile, warp, lane, limit = self.cta_rows(m_used, num_rows)
        column, inside = self.lane_column(k_block, lane)
        for r in cutlass.range(warp, BLOCK, WARPS, unroll=2):
            row = row_tile * BLOCK + r
            if row < limit:
                if inside:
                    values = row_vector(m_q, row, column // PER_LANE, PER_LANE).load().to(cutlass.Float32) * m_s[row, k_block]
                    row_vector(m_x, row, column // PER_LANE, PER_LANE).store(values.to(m_x.element_type))


def compile_fp8_block_quantize(width: int, block_rows: int, power_of_two: bool, bounded: bool, arch: str, options: str = "",
                               segments: int = 1, matrix_rows: int | None = None, mma_scales: bool = False, gathered: bool = False,
                               columns: bool = False, back: bool = False, copies_rows: bool = False):
    """Compile :class:`QuantizeFp8BlockKernel` (``columns``: :class:`QuantizeFp8ColumnsKernel`;
    ``back``: :class:`DequantizeFp8RowsKernel`) for ``arch`` without tensors (FP8_BLOCK_QUANTIZE_ARGS'
    stand-ins)."""
    if back:
        return compile_kernel(DequantizeFp8RowsKernel(width, bounded), FP8_BLOCK_QUANTIZE_ARGS, arch, options)
    if columns:
        kernel = QuantizeFp8ColumnsKernel(width, power_of_two, bounded, gathered, mma_scales, segments)
    else:
        kernel = QuantizeFp8BlockKernel(width, block_rows, power_of_two, bounded, segments, matrix_rows, mma_scales, gathered, copies_rows)
    return compile_kernel(kernel, FP8_BLOCK_QUANTIZE_ARGS, arch, options)
