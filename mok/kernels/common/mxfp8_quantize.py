"""bf16 rows <-> MXFP8 (E4M3 elements, one E8M0 scale byte per 32 consecutive elements).

The rule is mok/mxfp8.py's, bit for bit: the block's largest magnitude is an integer max over
the fp32 bit patterns with the sign cleared (a NaN's pattern is above every other, so it wins;
a float max would drop it), the scale exponent comes from that pattern's exponent and mantissa
fields, the elements are ``x * 2**-e`` (exact: a power-of-two factor) rounded by
``cvt.rn.satfinite.e4m3x2.f32``. Arch-neutral. One thread per block of 32: four 16-byte loads,
two 16-byte stores and the scale byte; the rows are contiguous, so the tensor is one run of
blocks and the row width does not enter the kernel. ``bounded``: the count of rows to convert is
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
    elements = cute.make_rmem_tensor((BLOCK,), m_elements.element_type)
    elements.store((values.load() * factor).to(m_elements.element_type))
    if field == NAN_EXPONENT:  # an Inf or a NaN in the block
        exponent = NAN_EXPONENT
        cute.recast_tensor(elements, cutlass.Uint8).fill(ELEMENT_NAN)
    m_elements[block, None].store(elements.load())
    if cutlass.const_expr(scale_index is None):
        m_scales[block] = cutlass.Uint8(exponent)
    else:
        m_scales[scale_index] = cutlass.Uint8(exponent)


@cute.jit
def mma_scale_index(block, blocks_per_row) -> cutlass.Int32:
    """Where block ``block`` (of rows of ``blocks_per_row`` blocks, a multiple of 4) keeps its scale
    in the order SM100's block-scaled MMAs read (mok.mxfp8.mma_scale_layout): a 512-byte chunk per
    128 rows and 4 blocks, K's chunks innermost; in a chunk (r % 32)·16 + (r // 32 % 4)·4 + c % 4."""
    row = block // blocks_per_row
    col = block - row * blocks_per_row
    chunk = (row >> 7) * (blocks_per_row >> 2) + (col >> 2)
    return chunk * 512 + (row & 31) * 16 + ((row >> 5) & 3) * 4 + (col & 3)


def column_block_tensors(values_ptr: cute.Pointer, elements_ptr: cute.Pointer, num_blocks, columns) -> tuple:
    """Blocks of 32 rows of one column of a row-major [R, columns] matrix (R = 32·num_blocks /
    columns): bf16 values and E4M3 elements as [num_blocks, 32], block (m, b) = rows 32b..32b+31
    of column m at linear index m + b·columns (a warp's threads take neighbouring columns)."""
    row_blocks = num_blocks // columns
    blocks = cute.make_layout(((columns, row_blocks), BLOCK), stride=((1, BLOCK * columns), columns))
    return cute.make_tensor(values_ptr, blocks), cute.make_tensor(elements_ptr, blocks)


class QuantizeMxfp8Kernel:
    """Static config: threads per CTA, ``bounded``, ``mma_order`` (the scales in the order of
    :func:`mma_scale_index`; rows of a multiple of 128 elements) (any row width that is a multiple
    of 32), ``columns``: blocks of 32 rows down each column instead (the MXFP8 of the matrix's
    transpose, elements left in the matrix's own layout: the weight gradients' operands, whose K is
    the rows)."""

    def __init__(self, threads: int = 128, bounded: bool = False, mma_order: bool = False, columns: bool = False) -> None:
        self.threads = threads
        self.bounded = bounded
        self.mma_order = mma_order
        self.columns = columns

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
        ``bounded`` the first rows_used[0] rows (a multiple of 32) are converted."""
        m_x, m_elements, m_scales = block_tensors(x_ptr, elements_ptr, scales_ptr, num_blocks)
        if cutlass.const_expr(self.columns):
            m_x, m_elements = column_block_tensors(x_ptr, elements_ptr, num_blocks, blocks_per_row)
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
        if block < self.blocks_to_convert(num_blocks, m_used, blocks_per_row):
            if cutlass.const_expr(self.columns):  # block (column m, row block b): the transpose's row m, block b
                row_blocks = num_blocks // blocks_per_row
                column = block % blocks_per_row
                transposed = column * row_blocks + block // blocks_per_row
                if cutlass.const_expr(self.mma_order):
                    quantize_block(m_x, m_elements, m_scales, block, mma_scale_index(transposed, row_blocks))
                else:
                    quantize_block(m_x, m_elements, m_scales, block, transposed)
            elif cutlass.const_expr(self.mma_order):
                quantize_block(m_x, m_elements, m_scales, block, mma_scale_index(block, blocks_per_row))
            else:
                quantize_block(m_x, m_elements, m_scales, block)


class DequantizeMxfp8Kernel(QuantizeMxfp8Kernel):
    """elements [num_blocks·32] E4M3 and scales [num_blocks] E8M0 bytes -> bf16 [num_blocks·32]."""

    @cute.jit
    def __call__(
        self, elements_ptr: cute.Pointer, scales_ptr: cute.Pointer, out_ptr: cute.Pointer, num_blocks: cutlass.Int32,
        rows_used_ptr: cute.Pointer, blocks_per_row: cutlass.Int32, stream: cuda.CUstream,
    ):
        chunks = num_blocks * CHUNKS_PER_BLOCK
        layout = cute.make_layout((chunks, CHUNK), stride=(CHUNK, 1))
        m_elements = cute.make_tensor(elements_ptr, layout)
        m_out = cute.make_tensor(out_ptr, layout)
        m_scales = cute.make_tensor(scales_ptr, cute.make_layout((num_blocks,)))
        m_used = cute.make_tensor(rows_used_ptr, cute.make_layout((1,)))
        self.kernel_back(m_elements, m_scales, m_out, m_used, blocks_per_row).launch(**self.launch_shape(num_blocks, stream))

    @cute.kernel
    def kernel_back(
        self, m_elements: cute.Tensor, m_scales: cute.Tensor, m_out: cute.Tensor, m_used: cute.Tensor, blocks_per_row: cutlass.Int32
    ):
        """A CTA takes ``threads`` blocks as CHUNKS_PER_BLOCK rounds of ``threads`` quarter blocks;
        each thread loads its rounds' elements and scales before it stores any (more bytes in flight)."""
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        first = cta * (self.threads * CHUNKS_PER_BLOCK) + tidx
        limit = self.blocks_to_convert(m_scales.shape[0], m_used, blocks_per_row) * CHUNKS_PER_BLOCK
        loaded = cute.make_rmem_tensor((CHUNKS_PER_BLOCK, CHUNK), m_elements.element_type)
        exponents = cute.make_rmem_tensor((CHUNKS_PER_BLOCK,), cutlass.Int32)
        for r in cutlass.range_constexpr(CHUNKS_PER_BLOCK):
            chunk = first + r * self.threads
            if chunk < limit:
                loaded[r, None].store(m_elements[chunk, None].load())
                exponents[r] = cutlass.Int32(m_scales[chunk >> CHUNKS_PER_BLOCK_LOG2]) & 0xFF  # (the byte comes in sign-extended)
        for r in cutlass.range_constexpr(CHUNKS_PER_BLOCK):
            chunk = first + r * self.threads
            if chunk < limit:
                values = loaded[r, None].load().to(cutlass.Float32) * e8m0_factor(exponents[r])
                m_out[chunk, None].store(values.to(m_out.element_type))


def compile_mxfp8(arch: str, options: str = "", back: bool = False, bounded: bool = False, mma_order: bool = False, columns: bool = False):
    """Compile the quantizer (``back``: the dequantizer; ``bounded``: converting the rows in use;
    ``mma_order``: scales in the MMA's order; ``columns``: blocks down the columns) for ``arch``
    without tensors."""
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    gmem = cute.AddressSpace.gmem
    bf16 = make_ptr(cutlass.BFloat16, 0, gmem, assumed_align=16)
    elements = make_ptr(cutlass.Float8E4M3FN, 0, gmem, assumed_align=16)
    scales = make_ptr(cutlass.Uint8, 0, gmem, assumed_align=1)
    rows_used = make_ptr(cutlass.Int32, 0, gmem, assumed_align=4)
    kernel_class = DequantizeMxfp8Kernel if back else QuantizeMxfp8Kernel
    pointers = (elements, scales, bf16) if back else (bf16, elements, scales)
    return cute.compile(
        kernel_class(bounded=bounded, mma_order=mma_order, columns=columns), *pointers, cutlass.Int32(1), rows_used, cutlass.Int32(1), make_fake_stream(),
        options=f"--gpu-arch {arch} {options}".strip(),
    )
