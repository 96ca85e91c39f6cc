"""MXFP8: the OCP microscaling format with E4M3 elements, the exact rule MoK quantizes by.

A tensor is cut into blocks of 32 consecutive elements along its last dimension; each block
stores one shared power-of-two scale as an E8M0 byte (``2 ** (byte - 127)``) and 32 E4M3
elements, and stands for ``element * scale``.

The scale is rounded up, as NVIDIA's MXFP8 training recipes do (the OCP text rounds it down,
which lets a block's largest element overflow E4M3 and saturate): the smallest power of two
``2**e`` with ``448 * 2**e >= amax`` (448 = E4M3's largest finite value), clamped to E8M0's
finite range. With ``amax = m * 2**E`` (1 <= m < 2) that is ``e = E - 8 + (m > 1.75)``: integer
arithmetic on amax's bits, which the GPU kernel does too, so both give the same bytes. Every
element ``x * 2**-e`` then lies within E4M3's range and is rounded to nearest, ties to even.
A block holding an Inf or a NaN gets the NaN scale byte 0xFF and NaN elements (0x7F). Where 32
does not divide a row (its width a multiple of 16: 16-byte E4M3 rows), its last block is partial
and its scale comes from the values it holds.

This module is the reference (plain PyTorch, any device); ``mok.ops.quantize_mxfp8`` is the
kernel, held to these bytes by tests/test_mxfp8_gpu.py. :func:`mma_scale_layout` puts the scales
in the order SM100's block-scaled MMAs read them (``mok.ops.grouped_gemm_mxfp8``).
"""

from __future__ import annotations

import torch

BLOCK = 32  # elements per shared scale
E4M3_MAX = 448.0
SCALE_NAN = 0xFF  # E8M0's NaN
ELEMENT_NAN = 0x7F  # E4M3 (fn) NaN, positive sign
_SCALE_BIAS = 127
_E4M3_MAX_EXP = 8  # 448 = 1.75 * 2**8
_MANTISSA_1_75 = 0x600000  # fp32 mantissa field of 1.75
MMA_CHUNK_ROWS = 128  # rows (of A, or columns of B) of one chunk of scales in the MMA's order
MMA_CHUNK_BLOCKS = 4  # blocks of 32 along K per chunk: 128 K values, 512 bytes of scales
SCALE_ONE = 127  # E8M0 of 1.0: what padding rows' and padding blocks' scales hold (finite: a NaN byte times TMA's zeros is NaN)
ROW_STEP = 16  # a row's width is a multiple of this: 16 bytes of E4M3 (TMA's row strides, the kernels' vectors)


def check_blocked(name: str, x: torch.Tensor) -> None:
    """``x``'s last dimension is a multiple of 16: whole blocks of 32, the last one perhaps half
    a block (the reference and the kernels' ops alike)."""
    if x.dim() < 1 or x.shape[-1] % ROW_STEP:
        raise ValueError(f"{name}: expected a last dimension that is a multiple of {ROW_STEP} (16-byte E4M3 rows; blocks of {BLOCK}, "
                         f"the last one perhaps partial), got shape {tuple(x.shape)}")


def blocks_of(width: int) -> int:
    """Scale blocks of a row of ``width`` values: ceil(width / 32), the last one perhaps partial."""
    return -(-width // BLOCK)


def mma_chunks_of(width: int) -> int:
    """Chunks of 128 values along a row of ``width`` in the MMA's scale order (:func:`mma_scale_layout`):
    ceil(width / 128), the last one padded."""
    return -(-width // (BLOCK * MMA_CHUNK_BLOCKS))


def scale_exponents(amax: torch.Tensor) -> torch.Tensor:
    """Biased E8M0 exponents (int32, 0..254, or 255 for a non-finite amax) of blocks with maximum
    magnitude ``amax`` (float32, >= 0 or NaN): the smallest ``e`` with ``448 * 2**(e - 127) >= amax``."""
    bits = amax.to(torch.float32).view(torch.int32) & 0x7FFFFFFF
    biased = bits >> 23  # amax's own biased exponent (0 for zero and subnormals)
    exps = (biased - _E4M3_MAX_EXP + ((bits & 0x7FFFFF) > _MANTISSA_1_75).to(torch.int32)).clamp(0, 254)
    return torch.where(biased == 255, torch.full_like(exps, SCALE_NAN), exps)


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(elements float8_e4m3fn of x's shape, scales uint8 [..., ceil(n / 32)]) of x (bf16, fp16 or
    fp32; n a multiple of 16) along its last dimension, by the rule in the module docstring."""
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"x: expected a bf16, fp16 or fp32 tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    check_blocked("x", x)
    width = x.shape[-1]
    # a partial last block as a whole one with zeros past the row: they raise no block's amax
    whole = torch.nn.functional.pad(x.to(torch.float32), (0, -width % BLOCK))
    blocks = whole.reshape(*x.shape[:-1], blocks_of(width), BLOCK)
    # the largest magnitude's bits: integer max, so a NaN anywhere wins (float max may drop it)
    amax_bits = (blocks.view(torch.int32) & 0x7FFFFFFF).amax(dim=-1)
    exps = scale_exponents(amax_bits.view(torch.float32))
    finite = exps != SCALE_NAN
    inverse = ((254 - exps.clamp(max=254)) << 23).view(torch.float32)  # 2**-(e - 127), always a normal float
    scaled = blocks * inverse.unsqueeze(-1)  # exact: a power-of-two factor, |result| <= 448
    elements = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    elements = torch.where(finite.unsqueeze(-1), elements, torch.full_like(elements, ELEMENT_NAN))
    return elements.view(torch.float8_e4m3fn).reshape(whole.shape)[..., :width].contiguous(), exps.to(torch.uint8)


def dequantize_mxfp8(elements: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 values of MXFP8 ``elements`` (float8_e4m3fn, [..., n]) with ``scales`` (uint8, [..., ceil(n / 32)])."""
    if elements.dtype != torch.float8_e4m3fn:
        raise TypeError(f"elements: expected float8_e4m3fn, got {elements.dtype}")
    if scales.dtype != torch.uint8:
        raise TypeError(f"scales: expected uint8 (E8M0 bytes), got {scales.dtype}")
    check_blocked("elements", elements)
    width = elements.shape[-1]
    expected = (*elements.shape[:-1], blocks_of(width))
    if tuple(scales.shape) != expected:
        raise ValueError(f"scales: expected shape {expected}, got {tuple(scales.shape)}")
    exps = scales.to(torch.int32)
    # 2**(byte - 127) as float32 bits; bytes 0 and 255 have no normal float32 twin
    factor = torch.ldexp(torch.ones_like(exps, dtype=torch.float32), exps - _SCALE_BIAS)
    factor = torch.where(exps == SCALE_NAN, torch.full_like(factor, float("nan")), factor)
    blocks = torch.nn.functional.pad(elements.to(torch.float32), (0, -width % BLOCK)).reshape(*expected, BLOCK)
    return (blocks * factor.unsqueeze(-1)).reshape(*expected[:-1], -1)[..., :width]


def fake_quantize_mxfp8(x: torch.Tensor) -> torch.Tensor:
    """x rounded through MXFP8 and back (float32): what a GEMM on MXFP8 operands sees of x."""
    return dequantize_mxfp8(*quantize_mxfp8(x))


def mma_scale_layout(scales: torch.Tensor) -> torch.Tensor:
    """MXFP8 scales (uint8 [..., rows, ceil(K / 32)], as :func:`quantize_mxfp8` gives them) in the
    order SM100's block-scaled MMAs read them (tcgen05 ``kind::mxf8f6f4``, a scale per 32 along K):
    uint8 [..., ceil(rows / 128), ceil(K / 128), 512], one 512-byte chunk per 128 rows and 128 K
    values, K's chunks innermost; in a chunk, row r's scale of block c lies at byte
    ``(r % 32) * 16 + (r // 32) * 4 + c`` (the PTX ISA's scale-factor layout for a 128-row MMA:
    four 32-row groups side by side in each 16-byte line). Rows past the last, and blocks past a
    row's last (K no multiple of 128), are padded with scale 1: their elements are the zeros TMA
    fills in, and a finite scale keeps them zeros (a NaN byte would make every product NaN)."""
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.uint8 or scales.dim() < 2:
        raise TypeError(f"scales: expected a uint8 tensor [..., rows, ceil(K / 32)], got {getattr(scales, 'dtype', type(scales).__name__)}"
                        f"{'' if not isinstance(scales, torch.Tensor) else f' of shape {tuple(scales.shape)}'}")
    *lead, rows, row_blocks = scales.shape
    chunks = -(-rows // MMA_CHUNK_ROWS)
    blocks = -(-row_blocks // MMA_CHUNK_BLOCKS) * MMA_CHUNK_BLOCKS
    padded = scales.new_full((*lead, chunks * MMA_CHUNK_ROWS, blocks), SCALE_ONE)
    padded[..., :rows, :row_blocks] = scales
    # rows as (chunk, 32-row group, row in group), blocks as (chunk, block in chunk)
    split = padded.reshape(*lead, chunks, 4, 32, blocks // MMA_CHUNK_BLOCKS, MMA_CHUNK_BLOCKS)
    n = len(lead)
    order = (*range(n), n, n + 3, n + 2, n + 1, n + 4)  # (row chunk, block chunk, row in group, group, block)
    return split.permute(order).reshape(*lead, chunks, blocks // MMA_CHUNK_BLOCKS, 512).contiguous()


def rows_scale_layout(scales: torch.Tensor, rows: int, width: int | None = None) -> torch.Tensor:
    """The inverse of :func:`mma_scale_layout`: scales uint8 [..., chunks, ceil(K / 128), 512] in
    the MMA's order back to [..., rows, ceil(K / 32)] (the padding rows past ``rows`` dropped, and
    with the rows' ``width`` K the padding blocks past ceil(K / 32); default: K a multiple of 128)."""
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.uint8 or scales.dim() < 3 or scales.shape[-1] != 512:
        raise TypeError(f"scales: expected uint8 [..., chunks, K // 128, 512], got {getattr(scales, 'dtype', type(scales).__name__)}"
                        f"{'' if not isinstance(scales, torch.Tensor) else f' of shape {tuple(scales.shape)}'}")
    *lead, chunks, col_chunks, _ = scales.shape
    if not 0 <= rows <= chunks * MMA_CHUNK_ROWS:
        raise ValueError(f"rows: expected 0..{chunks * MMA_CHUNK_ROWS} for {chunks} chunks of 128, got {rows}")
    n = len(lead)
    # (row chunk, block chunk, row in group, group, block) -> (row chunk, group, row in group, block chunk, block)
    split = scales.reshape(*lead, chunks, col_chunks, 32, 4, MMA_CHUNK_BLOCKS)
    order = (*range(n), n, n + 3, n + 2, n + 1, n + 4)
    flat = split.permute(order).reshape(*lead, chunks * MMA_CHUNK_ROWS, col_chunks * MMA_CHUNK_BLOCKS)
    blocks = flat.shape[-1] if width is None else blocks_of(width)
    if width is not None and -(-width // (BLOCK * MMA_CHUNK_BLOCKS)) != col_chunks:
        raise ValueError(f"width: expected one of {col_chunks} chunks of 128 along K, got {width}")
    return flat[..., :rows, :blocks].contiguous()
