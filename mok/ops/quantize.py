"""FP8 conversion kernels: bf16 to E4M3 elements with E8M0 scales per 32 (MXFP8, mok.mxfp8's rule)
and back, or with fp32 scales per 128 (DeepSeek-V3's recipe, mok.fp8_block's rule).

    quantize_mxfp8          blocks of 32 along each row (scales by rows, or in the MMA's order)
    quantize_mxfp8_columns  blocks of 32 rows down each column (the operands of a weight gradient)
    dequantize_mxfp8        back to bf16 (exact: an E4M3 value times a power of two is a bf16)
    quantize_fp8_rows       1 x 128 blocks along each row, the scales [K / 128, R]
    quantize_fp8_columns    1 x 128 blocks down each column (a weight gradient's operands on FP8)
    dequantize_fp8_rows     FP8 rows with fp32 block scales back to bf16
    quantize_fp8_weights    128 x 128 blocks of each expert's [N, K], the scales [E, N / 128, K / 128]
"""

from __future__ import annotations

import torch

from ..kernels.common.records import FP8_BLOCK_QUANTIZE_ARGS
from ..kernels.variants import fp8_weights_quantizer, mxfp8_column_shape, mxfp8_row_shape, quantize_fp8_block_variant, quantize_mxfp8_variant
from ..mxfp8 import (
    BLOCK as MXFP8_BLOCK, MMA_CHUNK_ROWS as MXFP8_CHUNK_ROWS, ROW_STEP as MXFP8_ROW_STEP, SCALE_ONE as MXFP8_SCALE_ONE,
    blocks_of as mxfp8_blocks_of, check_blocked, mma_chunks_of,
)
from ..runtime import launch
from ..validation import check_tensor
from .common import BF16, bf16_out, check_cuda_aligned, check_disjoint, check_launchable, check_rows_used, kernel_for


def quantize_mxfp8(
    x: torch.Tensor,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    rows_used: torch.Tensor | None = None,
    scale_order: str = "rows",
    segments: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(elements float8_e4m3fn of x's shape, scales uint8 [..., ceil(n / 32)]) of bf16 ``x`` [..., n]
    (contiguous, n a multiple of 16: a row's last block may hold 16 values): the bytes
    mok.mxfp8.quantize_mxfp8 gives, in one launch. ``out``: the (elements, scales) tensors to write.
    ``rows_used`` (int32 [1] on x's device): only the first rows_used[0] rows of x (as rows of n) are
    converted, the rest of ``out`` is left as it is; the count stays on the device (no host sync).
    ``scale_order`` "mma" (x [R, n], or a stack of matrices [E, N, n]): the scales in the order
    SM100's block-scaled MMAs read them, uint8 [ceil(R / 128), ceil(n / 128), 512] (or [E,
    ceil(N / 128), ceil(n / 128), 512], each matrix chunked on its own), the bytes of
    mok.mxfp8.mma_scale_layout for rows < R, padding blocks included (the padding rows' scales are
    left unwritten: they never reach a row of the GEMM's output; a stack's are scale 1 as there:
    they are the GEMM's columns past N, whose products the SwiGLU backward's row sums add, 0·1),
    what grouped_gemm_mxfp8 takes.
    ``segments`` 2: each half of a row blocked on its own (dh, whose halves are the dx GEMM's two K
    ranges: the bytes of quantizing the halves apart, side by side; scales [..., 2·ceil(n / 64)],
    or in the MMA's order each half's ceil(n / 256) chunks in turn); the same bytes as one segment
    where 32 (128 in the MMA's order) divides a half."""
    check_tensor("x", x, dtypes=BF16, contiguous=True)
    check_blocked("x", x)
    if scale_order not in ("rows", "mma"):
        raise ValueError(f"scale_order: expected 'rows' or 'mma', got {scale_order!r}")
    mma_order = scale_order == "mma"
    if segments not in (1, 2) or x.shape[-1] % (MXFP8_ROW_STEP * segments):
        raise ValueError(f"segments: expected 1, or 2 with halves of a multiple of {MXFP8_ROW_STEP} values, got {segments} for shape {tuple(x.shape)}")
    if mma_order and (x.dim() not in (2, 3) or (x.dim() == 3 and (rows_used is not None or segments != 1))):
        raise ValueError(f"x: expected [R, n], or a stack [E, N, n] (whole, one segment), for scale_order='mma', got shape {tuple(x.shape)}")
    check_launchable(x=x)
    check_rows_used(rows_used, x.device)
    width = x.shape[-1] // segments
    blocks_per_row = segments * mxfp8_blocks_of(width)
    if mma_order:
        chunks = segments * -(-width // 128)
        scale_shape = (*x.shape[:-2], -(-x.shape[-2] // 128), chunks, 512)
    else:
        scale_shape = (*x.shape[:-1], blocks_per_row)
    elements, scales = _output_pair(out, tuple(x.shape), scale_shape, torch.uint8, x.device)
    check_cuda_aligned("out[0]", elements)
    if x.numel() == 0:
        return elements, scales
    if mma_order and x.dim() == 3 and x.shape[1] % MXFP8_CHUNK_ROWS:  # (the rows the kernel writes are overwritten)
        scales.fill_(MXFP8_SCALE_ONE)
    shape = mxfp8_row_shape(x.shape[-1], segments=segments, mma_order=mma_order, matrix_rows=x.shape[1] if x.dim() == 3 and mma_order else None)
    kernel = kernel_for(quantize_mxfp8_variant(bounded=rows_used is not None, mma_order=mma_order, **shape), x.device)
    kernel(
        launch.ptr("bf16", x), launch.ptr("e4m3", elements), launch.ptr("u8", scales, 1), launch.i32(x.numel() // x.shape[-1] * blocks_per_row),
        launch.ptr("i32", rows_used, 4), launch.i32(blocks_per_row), launch.stream(x.device),
    )
    return elements, scales


def quantize_mxfp8_columns(
    x: torch.Tensor, *, rows_used: torch.Tensor | None = None, scale_order: str = "rows", segments: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 of bf16 ``x`` [R, M] along its rows (blocks of 32 rows down each column: what a GEMM
    that sums over the rows, a weight gradient, takes), in one launch: elements float8_e4m3fn
    [R, M] in x's own layout, each the element of x's transpose that mok.mxfp8.quantize_mxfp8(x.T)
    gives, and that call's scales, uint8 [M, R / 32], or with ``scale_order="mma"`` in the order
    SM100's block-scaled MMAs read them, [ceil(M / 128), R / 128, 512] (mok.mxfp8.mma_scale_layout;
    the padding columns' scales left unwritten). R a multiple of 32 (of 128 for "mma"), contiguous x.
    ``rows_used`` (int32 [1] on x's device, a multiple of 32): only the first rows_used[0] rows are
    converted, the rest of the outputs left as they are; the count stays on the device.
    ``segments`` 2 ("mma"; dh, whose halves the split-out weight gradient takes as two row ranges):
    each half of the columns chunked on its own, scales [2·ceil(M / 256), R / 128, 512] (the same
    bytes as one segment where 128 divides a half)."""
    check_tensor("x", x, dtypes=BF16, ndim=2, contiguous=True)
    if scale_order not in ("rows", "mma"):
        raise ValueError(f"scale_order: expected 'rows' or 'mma', got {scale_order!r}")
    rows, columns = x.shape
    if segments not in (1, 2) or (segments == 2 and (scale_order != "mma" or columns % (2 * MXFP8_ROW_STEP))):
        raise ValueError(f"segments: expected 1, or 2 with scale_order='mma' and halves of a multiple of {MXFP8_ROW_STEP} columns, "
                         f"got {segments} for shape {tuple(x.shape)} ({scale_order!r})")
    if rows % (128 if scale_order == "mma" else MXFP8_BLOCK):
        raise ValueError(f"x: expected a row count that is a multiple of {128 if scale_order == 'mma' else MXFP8_BLOCK}, got shape {tuple(x.shape)}")
    check_launchable(x=x)
    check_rows_used(rows_used, x.device)
    elements = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    if scale_order == "mma":
        scales = torch.empty(segments * mma_chunks_of(columns // segments), rows // 128, 512, dtype=torch.uint8, device=x.device)
    else:
        scales = torch.empty(columns, rows // MXFP8_BLOCK, dtype=torch.uint8, device=x.device)
    if x.numel() == 0:
        return elements, scales
    shape = mxfp8_column_shape(columns, segments=segments)
    variant = quantize_mxfp8_variant(bounded=rows_used is not None, mma_order=scale_order == "mma", columns=True, **shape)
    kernel_for(variant, x.device)(
        launch.ptr("bf16", x), launch.ptr("e4m3", elements), launch.ptr("u8", scales, 1), launch.i32(x.numel() // MXFP8_BLOCK), launch.ptr("i32", rows_used, 4),
        launch.i32(columns), launch.stream(x.device),
    )
    return elements, scales


def _output_pair(out, elements_shape: tuple, scales_shape: tuple, scales_dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A quantizer's (elements float8_e4m3fn, scales): ``out`` checked against their shapes, or new tensors."""
    if out is None:
        return (torch.empty(elements_shape, dtype=torch.float8_e4m3fn, device=device),
                torch.empty(scales_shape, dtype=scales_dtype, device=device))
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise TypeError(f"out: expected a pair of tensors (elements, scales), got {type(out).__name__}")
    check_tensor("out[0]", out[0], dtypes=(torch.float8_e4m3fn,), shape=elements_shape, device=device, contiguous=True)
    check_tensor("out[1]", out[1], dtypes=(scales_dtype,), shape=scales_shape, device=device, contiguous=True)
    return tuple(out)


def dequantize_mxfp8(
    elements: torch.Tensor, scales: torch.Tensor, *, out: torch.Tensor | None = None, rows_used: torch.Tensor | None = None,
    segments: int = 1,
) -> torch.Tensor:
    """bf16 values of MXFP8 ``elements`` (float8_e4m3fn [..., n], contiguous, n a multiple of 16) with
    ``scales`` (uint8 [..., ceil(n / 32)]; ``segments`` 2: [..., 2·ceil(n / 64)], each half of a row
    blocked on its own, as :func:`quantize_mxfp8` gives them): mok.mxfp8.dequantize_mxfp8 rounded
    to bf16, in one launch. ``rows_used``: as in :func:`quantize_mxfp8` (the rows past the count
    are left as ``out`` has them)."""
    check_tensor("elements", elements, dtypes=(torch.float8_e4m3fn,), contiguous=True)
    check_blocked("elements", elements)
    if segments not in (1, 2) or elements.shape[-1] % (MXFP8_ROW_STEP * segments):
        raise ValueError(f"segments: expected 1, or 2 with halves of a multiple of {MXFP8_ROW_STEP} values, got {segments} for shape "
                         f"{tuple(elements.shape)}")
    check_launchable(elements=elements)
    check_rows_used(rows_used, elements.device)
    width = elements.shape[-1] // segments
    scale_shape = (*elements.shape[:-1], segments * mxfp8_blocks_of(width))
    check_tensor("scales", scales, dtypes=(torch.uint8,), shape=scale_shape, device=elements.device, contiguous=True)
    if out is None:
        out = torch.empty(elements.shape, dtype=torch.bfloat16, device=elements.device)
    check_tensor("out", out, dtypes=BF16, shape=tuple(elements.shape), device=elements.device, contiguous=True)
    check_cuda_aligned("out", out)
    if scales.numel() == 0:
        return out
    shape = mxfp8_row_shape(elements.shape[-1], segments=segments)
    kernel = kernel_for(quantize_mxfp8_variant(back=True, bounded=rows_used is not None, **shape), elements.device)
    kernel(
        launch.ptr("e4m3", elements), launch.ptr("u8", scales, 1), launch.ptr("bf16", out), launch.i32(scales.numel()),
        launch.ptr("i32", rows_used, 4), launch.i32(scales.shape[-1]),  # (null count: an unbounded kernel reads neither)
        launch.stream(elements.device),
    )
    return out


def quantize_fp8_rows(
    x: torch.Tensor, *, power_of_two: bool = False, rows_used: torch.Tensor | None = None, segments: int = 1, scale_order: str = "rows",
    row_source: torch.Tensor | None = None, rows_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(elements float8_e4m3fn [R, K], scales float32 [blocks, R]) of bf16 rows ``x`` [R, K] (K a
    multiple of 16), 1 x 128 blocks (the last one partial where 128 does not divide K; blocks =
    ceil(K / 128)): the bits mok.fp8_block.quantize_rows gives (finite values), in one launch. (A
    GEMM that reads the rows whole takes R a multiple of 4; gathered, any R.) ``rows_used`` (int32
    [1] on x's device): only the first rows_used[0] rows are converted (the rest of the outputs
    left unwritten; the count stays on the device). ``segments`` = 2: each half of a row blocked on
    its own (2·ceil(K / 256) blocks; dh for the dx GEMM, whose two K ranges are its halves).
    ``scale_order="mma"`` (power_of_two): the scales as E8M0 bytes in the order SM100's
    block-scaled MMAs read MXFP8 scales, uint8 [ceil(R / 128), blocks, 512], each block's byte at
    its 32-blocks (127 at those past a partial last block; each half's blocks starting a chunk with
    ``segments`` 2; the padding rows' left unwritten): an MXFP8 operand of the same elements, what
    ops.grouped_gemm's MXFP8 form takes. ``row_source`` (int32 [R'] on x's device):
    the R' rows x[row_source[r]] (zeros where an index is negative: a schedule's padding rows) in
    one pass, the bits of quantizing ops.gather_rows(x, row_source), with no bf16 copy of them;
    ``rows_out`` (bf16 [R', K], with row_source): that copy written too, in the same pass (what
    ops.gather_rows(x, row_source) gives), for a caller that needs the rows both ways."""
    rows, k = _source_rows(x, row_source)
    if rows_out is not None:
        if row_source is None:
            raise ValueError("rows_out: the gathered rows' bf16 copy, given with row_source only")
        bf16_out(rows_out, (rows, k), x.device, "rows_out")
        check_disjoint({"rows_out": rows_out}, {"x": x, "row_source": row_source})
    if segments not in (1, 2):
        raise ValueError(f"segments: expected 1 or 2, got {segments}")
    mma = _check_scale_order(scale_order, power_of_two)
    if k % (16 * segments) or k == 0:
        raise ValueError(f"x: expected [R, K] with K a positive multiple of {16 * segments} (16-byte E4M3 rows"
                         f"{' in each half' if segments == 2 else ''}), got {list(x.shape)}")
    check_launchable(x=x)
    check_rows_used(rows_used, x.device)
    elements = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    blocks = segments * -(-k // segments // 128)
    if mma:
        scales = torch.empty(-(-rows // 128), blocks, 512, dtype=torch.uint8, device=x.device)
    else:
        scales = torch.empty(blocks, rows, dtype=torch.float32, device=x.device)
    if rows:
        variant = quantize_fp8_block_variant(k, 1, power_of_two, bounded=rows_used is not None, segments=segments, mma_scales=mma,
                                             gathered=row_source is not None, copies_rows=rows_out is not None)
        _quantize_fp8_block(variant, x, elements, scales, rows_used, row_source, rows_copy=rows_out)
    return elements, scales


def quantize_fp8_columns(
    x: torch.Tensor, *, power_of_two: bool = False, rows_used: torch.Tensor | None = None, row_source: torch.Tensor | None = None,
    scale_order: str = "rows", out: tuple[torch.Tensor, torch.Tensor] | None = None, segments: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The transpose of bf16 rows ``x`` [R, M] (R a multiple of 128, M of 16) quantized with 1 x 128
    blocks along R: (elements float8_e4m3fn [M, R], scales float32 [R / 128, M]), the bits
    mok.fp8_block.quantize_rows(x.T) gives, in one launch: the K-major operands a weight gradient
    on FP8 (whose K is the rows) takes, each expert's rows being whole 128-row blocks of a
    schedule. ``rows_used`` (int32 [1] on x's device, a multiple of 128): only the row blocks below
    rows_used[0] are converted (the rest of both outputs left unwritten; the count stays on the
    device). ``row_source`` (int32 [R] on x's device): the rows x[row_source[r]] (zeros where an
    index is negative: a schedule's padding rows), gathered as they are quantized.
    ``scale_order="mma"`` (power_of_two): the same values as the MXFP8 operands SM100's weight
    gradient reads (what quantize_mxfp8_columns(scale_order="mma") gives for MXFP8): elements [R,
    M] in x's own layout (the transposed elements' transpose) and each column's 128-row block scale
    as its E8M0 byte at the block's four 32-blocks, uint8 [ceil(M / 128), R / 128, 512] in
    mok.mxfp8.mma_scale_layout's order (the chunk rows past M: 127); ``segments`` 2 (dh's halves,
    the split-out weight gradient's two M ranges): each half's columns starting a chunk,
    [2·ceil(M / 256), R / 128, 512]. ``out``: the (elements, scales) tensors to write."""
    rows, m = _source_rows(x, row_source)
    mma = _check_scale_order(scale_order, power_of_two)
    if segments not in (1, 2) or (segments == 2 and (not mma or m % 32)):
        raise ValueError(f"segments: 1, or 2 with scale_order='mma' and M a multiple of 32, got {segments} with "
                         f"scale_order={scale_order!r}, M={m}")
    if rows % 128 or m % 16 or m == 0:
        raise ValueError(f"x: expected [R, M] rows with R a multiple of 128 and M a positive multiple of 16, got R={rows}, M={m}"
                         f"{' (R: row_source)' if row_source is not None else ''}")
    check_launchable(x=x)
    check_rows_used(rows_used, x.device)
    if mma:
        elements, scales = _output_pair(out, (rows, m), (segments * -(-m // segments // 128), rows // 128, 512), torch.uint8, x.device)
    else:
        elements, scales = _output_pair(out, (m, rows), (rows // 128, m), torch.float32, x.device)
    if rows:
        variant = quantize_fp8_block_variant(m, 1, power_of_two, bounded=rows_used is not None, gathered=row_source is not None,
                                             columns=True, mma_scales=mma, segments=segments)
        _quantize_fp8_block(variant, x, elements, scales, rows_used, row_source, num_rows=rows)
    return elements, scales


def dequantize_fp8_rows(elements: torch.Tensor, scales: torch.Tensor, *, rows_used: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 [R, K] of FP8 rows with 1 x 128 block scales (:func:`quantize_fp8_rows`' form: elements
    float8_e4m3fn [R, K], scales float32 [ceil(K / 128), R]): bf16(element · scale), in one launch.
    ``rows_used``: as in :func:`quantize_fp8_rows` (the rows past the count left unwritten)."""
    check_tensor("elements", elements, dtypes=(torch.float8_e4m3fn,), ndim=2, contiguous=True)
    rows, k = elements.shape
    if k % 16 or k == 0:
        raise ValueError(f"elements: expected [R, K] with K a positive multiple of 16 (16-byte E4M3 rows), got {list(elements.shape)}")
    check_tensor("scales", scales, dtypes=(torch.float32,), shape=(-(-k // 128), rows), device=elements.device, contiguous=True)
    check_launchable(elements=elements, scales=scales)
    check_rows_used(rows_used, elements.device)
    out = torch.empty(rows, k, dtype=torch.bfloat16, device=elements.device)
    if rows:
        _quantize_fp8_block(quantize_fp8_block_variant(k, bounded=rows_used is not None, back=True), out, elements, scales, rows_used)
    return out


def _source_rows(x: torch.Tensor, row_source: torch.Tensor | None) -> tuple[int, int]:
    """x [R, K] bf16 checked, and (the rows a quantizer writes: R, or row_source's count, K)."""
    check_tensor("x", x, dtypes=BF16, ndim=2, contiguous=True)
    if row_source is None:
        return tuple(x.shape)
    check_tensor("row_source", row_source, dtypes=(torch.int32,), ndim=1, contiguous=True, device=x.device)
    return row_source.shape[0], x.shape[1]


def _check_scale_order(scale_order: str, power_of_two: bool) -> bool:
    """Whether FP8 block scales go out in the MMA's order as E8M0 bytes; refuses what that cannot hold."""
    if scale_order not in ("rows", "mma"):
        raise ValueError(f"scale_order: expected 'rows' or 'mma', got {scale_order!r}")
    if scale_order == "mma" and not power_of_two:
        raise ValueError(f"scale_order='mma': E8M0 scales need power_of_two=True, got power_of_two={power_of_two}")
    return scale_order == "mma"


def quantize_fp8_weights(w: torch.Tensor, *, power_of_two: bool = False, scale_order: str = "rows") -> tuple[torch.Tensor, torch.Tensor]:
    """(elements float8_e4m3fn [E, N, K], scales float32 [E, ceil(N / 128), ceil(K / 128)]) of bf16
    weights ``w`` [E, N, K] (N and K multiples of 16), 128 x 128 blocks (partial last ones where 128
    does not divide N or K): mok.fp8_block.quantize_weights's bits (finite values), in one launch.
    ``scale_order="mma"`` (power_of_two): the scales as E8M0 bytes in the MMA's order, uint8 [E,
    ceil(N / 128), ceil(K / 128), 512], each block's byte at every one of its chunk's 512 (127 at
    the 32-blocks past a partial last K block and at the rows past N: an MXFP8 weight of the same
    elements, as :func:`quantize_fp8_rows` says)."""
    check_tensor("w", w, dtypes=BF16, ndim=3, contiguous=True)
    experts, n, k = w.shape
    if n % 16 or k % 16 or not n or not k:
        raise ValueError(f"w: expected [E, N, K] with N and K positive multiples of 16, got {list(w.shape)}")
    mma = _check_scale_order(scale_order, power_of_two)
    check_launchable(w=w)
    elements = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    if mma:
        scales = torch.empty(experts, -(-n // 128), -(-k // 128), 512, dtype=torch.uint8, device=w.device)
    else:
        scales = torch.empty(experts, -(-n // 128), -(-k // 128), dtype=torch.float32, device=w.device)
    if w.numel():
        variant = fp8_weights_quantizer(n, k, power_of_two, mma_scales=mma)
        _quantize_fp8_block(variant, w.view(experts * n, k), elements.view(experts * n, k), scales, None)
    return elements, scales


def _quantize_fp8_block(variant, x, elements, scales, rows_used, row_source=None, num_rows: int | None = None,
                        rows_copy: torch.Tensor | None = None) -> None:
    """Launch a quantizer variant; ``num_rows``: the rows it writes (default: the elements' first dimension)."""
    kernel_for(variant, x.device)(
        *FP8_BLOCK_QUANTIZE_ARGS.values(x=x, elements=elements, scales=scales, rows_used=rows_used, row_source=row_source,
                                        rows_copy=rows_copy, num_rows=elements.shape[0] if num_rows is None else num_rows,
                                        num_src=x.shape[0]),
        launch.stream(x.device),
    )
