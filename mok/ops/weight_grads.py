"""The backward's reductions over rows: per-expert weight gradients and the router-weight gradient.

    weight_grad  out[e] (+)= a[rows of e]ᵀ · b[rows of e]   (rows in order, one CTA per output tile)
    router_grad  d_topk_w[t, j] = Σ_c partial[slot_row[t, j], c]   (column order)

Nothing here uses atomics: each output element has one writer and one fixed order of sums, so
the gradients are bitwise reproducible. The operand format is a parameter, as for the grouped
GEMM: bf16 tensors, MXFP8 (elements, scales) pairs quantized along the rows (SM100 only; also
fp8_block's power-of-two 1 x 128 blocks, ops.quantize_fp8_columns(scale_order="mma")), or FP8
with 1 x 128 blocks along the rows, the rows' transposes (Hopper).
"""

from __future__ import annotations

import torch

from ..kernels.common.records import weight_grad_args
from ..kernels.variants import deep_turn_for, router_grad_variant, weight_grad_block_sets, weight_grad_pingpong, weight_grad_variant
from ..mxfp8 import ROW_STEP as MXFP8_ROW_STEP, mma_chunks_of
from ..runtime import launch
from ..runtime.arch import require_mxfp8_gemms
from ..validation import check_tensor
from .common import BF16, E4M3, I32, arch_of, check_32bit, check_launchable, check_weights_launchable, kernel_for, persistent_default, sm_count
from .gemm import Operand, operand_parts

TMA_STRIDE_LIMIT = 2**40  # bytes: a TMA descriptor's strides stay below it (cuTensorMapEncodeTiled)


def launch_weight_grad(variant, a: Operand, b: Operand, offsets, counts, outs, half_stride: int = 0, upper_first: int = 0) -> None:
    """Launch a checked weight-gradient variant on A [R, M] with R >= 1 (``outs``: its output tensor,
    or split_out's two; ``counts`` None: not read)."""
    (a_values, a_scales), (b_values, b_scales) = operand_parts("a", a), operand_parts("b", b)
    operand = variant.config.get("operand", "bf16")
    record = weight_grad_args(operand, "f32" if outs[0].dtype == torch.float32 else "bf16")
    device = a_values.device
    num_rows = a_values.shape[1] if operand == "e4m3_block" else a_values.shape[0]  # (FP8 blocks: A is the rows' transpose)
    kernel_for(variant, device)(
        *record.values(
            a=a_values, a_scale=a_scales, b=b_values, b_scale=b_scales, out=min(outs, key=lambda o: o.data_ptr()), offsets=offsets,
            counts=offsets if counts is None else counts, counted=int(counts is not None), num_rows=num_rows,
            num_experts=offsets.shape[0] - 1, max_ctas=sm_count(device), half_stride=half_stride, upper_first=upper_first,
        ),
        launch.stream(device),
    )


def weight_grad(
    a: Operand,
    b: Operand,
    offsets: torch.Tensor,
    *,
    counts: torch.Tensor | None = None,
    out: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    accumulate: bool = False,
    out_dtype: torch.dtype = torch.bfloat16,
    persistent: bool | None = None,
    tile_n: int = 128,
    pingpong: bool | None = None,
    split_out: bool = False,
    deep_turn: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-expert weight gradient: out[e] (+)= a[rows of e]ᵀ · b[rows of e], fp32 accumulation.

    a: [R, M] bf16 (rows may be strided: a column slice of a wider buffer), b: [R, N] bf16
    contiguous; expert e owns rows offsets[e] .. offsets[e+1] (offsets [E+1] int32 on the GPU,
    multiples of 128 except the last, which may be R; rows at or past R are not read).
    ``counts`` [E] int32 on the GPU (the schedule's expert_counts): expert e's rows past
    offsets[e] + counts[e] are padding (zero in a and b); the 64-row blocks holding only such
    rows are skipped, not multiplied (the same bits: they would add zeros). out:
    [E, M, N] bf16 or fp32, new unless given; ``accumulate`` adds into the given fp32 ``out``
    (main_grad style) instead of overwriting it. M % 8 == 0, N % 8 == 0 (the last row and column
    tiles may be partial; MXFP8 operands: M % 16 == 0, N % 16 == 0).
    ``persistent``: as in :func:`mok.ops.grouped_gemm`. ``tile_n``: the output tile's
    columns, 128 or 256. ``pingpong`` (persistent, 128-wide tiles; the default there): the two MMA
    warpgroups take whole tiles in turn (the same bits). ``split_out`` (M % 16 == 0): out is a
    pair of [E, M/2, N] tensors (new unless given), the product's first M/2 rows going into the
    first, the others into the second: dW_gate and dW_up from one launch over all of dh (the
    same bits as a launch per half, which it falls back to where the two tensors' distance is not
    one a TMA descriptor can hold); the pair may also be the even and odd rows of one contiguous
    [E, M, N] tensor (``w[:, 0::2]``, ``w[:, 1::2]``: gate and up interleaved, gpt-oss's layout).

    MXFP8 operands (SM100 only, no ping-pong): a = (elements float8_e4m3fn [R, M], scales
    [ceil(M / 128), R / 128, 512]; with split_out [2·ceil(M / 256), R / 128, 512], each half
    chunked on its own) and b likewise [R, N], as mok.ops.quantize_mxfp8_columns(...,
    scale_order="mma", segments=2 for split_out's a) gives them; R and every offset multiples of
    128 (the schedule's are).

    FP8 with 1 x 128 blocks along the rows (Hopper; persistent, no ping-pong, tile_n 128): a = the
    rows' transpose (elements float8_e4m3fn [M, R], scales float32 [R / 128, M]) and b likewise
    ([N, R], [R / 128, N]), as mok.ops.quantize_fp8_columns gives them; M and N multiples of 16, R
    and every offset multiples of 128; out[e] = Σ over expert e's 128-row blocks of the block's
    product times sa[m]·sb[n] (mok/kernels/sm90/weight_grad_gemm.py); ``deep_turn`` as in
    :func:`mok.ops.grouped_gemm` (the same bits; None: 8 on FP8).
    """
    (a_values, a_scales), (b_values, b_scales) = operand_parts("a", a), operand_parts("b", b)
    operand = "bf16" if a_scales is None else "e4m3_block" if a_scales.dtype == torch.float32 else "e4m3"
    deep_turn_for(deep_turn, weight_grad_block_sets(operand), "weight_grad")
    mxfp8 = operand == "e4m3"
    dev = a_values.device
    if operand == "e4m3_block":
        num_rows, m, n = _check_fp8_block_operands(a, b, split_out, persistent, tile_n, pingpong)
        persistent, pingpong = True, False
    else:
        if mxfp8:
            check_tensor("a", a_values, dtypes=E4M3, ndim=2, contiguous=True)
            check_tensor("b", b_values, dtypes=E4M3, ndim=2, device=dev, contiguous=True)
            if b_scales is None or pingpong:
                raise ValueError("MXFP8 operands: b as an (elements, scales) pair too, no ping-pong")
            persistent, pingpong = persistent_default(dev) if persistent is None else persistent, False
        else:
            check_tensor("a", a_values, dtypes=BF16, ndim=2)
            check_tensor("b", b_values, dtypes=BF16, ndim=2, device=dev, contiguous=True)
            persistent = persistent_default(dev) if persistent is None else persistent
        num_rows, m = a_values.shape
        if num_rows and (a_values.stride(1) != 1 or a_values.stride(0) < m or a_values.stride(0) % 8):  # (empty views: any strides)
            raise ValueError(f"a: expected unit column stride and a row stride >= {m} that is a multiple of 8, got strides {a_values.stride()}")
        if b_values.shape[0] != num_rows:
            raise ValueError(f"b: expected {num_rows} rows like a, got {b_values.shape[0]}")
        n = b_values.shape[1]
        step = MXFP8_ROW_STEP if mxfp8 else 8  # (16-byte rows, each half's with MXFP8's split_out: the tiles past M and N partial)
        halves = 2 if split_out and mxfp8 else 1
        if m % (halves * step) or n % step or (mxfp8 and num_rows % 128):
            widths = f"M, N multiples of {step}" if halves == 1 else f"M a multiple of {halves * step}, N of {step}"
            raise ValueError(f"(R, M, N): expected {widths}{', R of 128' if mxfp8 else ''}, got ({num_rows}, {m}, {n})")
        if mxfp8:  # (split_out: each half of M chunked on its own, quantize_mxfp8_columns(segments=2))
            for name, t, chunks in (("a", a_scales, halves * mma_chunks_of(m // halves)), ("b", b_scales, mma_chunks_of(n))):
                check_tensor(f"{name} scales", t, dtypes=(torch.uint8,), shape=(chunks, num_rows // 128, 512), device=dev, contiguous=True)
    num_experts = _check_rows_and_outputs(offsets, counts, m, n, split_out, tile_n, accumulate, out, out_dtype, dev)
    pingpong = weight_grad_pingpong(persistent, tile_n) if pingpong is None else pingpong
    if pingpong and (not persistent or tile_n != 128):
        raise ValueError("pingpong: only with persistent=True and tile_n=128")
    dtypes = (torch.float32,) if accumulate else (torch.bfloat16, torch.float32)
    outs = _outputs(out, split_out, (num_experts, m, n), out_dtype, dtypes, dev)
    check_launchable(a=a_values, b=b_values, a_scales=a_scales, b_scales=b_scales)
    check_weights_launchable(**{f"out[{i}]": o for i, o in enumerate(outs)})  # (the gradient: written by TMA only)
    if mxfp8 and dev.type == "cuda":
        require_mxfp8_gemms("weight_grad", arch_of(dev.index))
    result = tuple(outs) if split_out else outs[0]
    if num_rows == 0:  # nothing to add (and no TMA descriptor can describe zero rows)
        if not accumulate:
            for o in outs:
                o.zero_()
        return result
    interleaved = split_out and _interleaved_rows(outs)
    half_stride, upper_first = (n, 0) if interleaved else _split_out_stride(outs) if split_out else (0, 0)
    if half_stride is None:  # not a TMA descriptor's stride: a launch per half of A
        opts = dict(counts=counts, accumulate=accumulate, persistent=persistent, tile_n=tile_n, pingpong=pingpong, deep_turn=deep_turn)
        for half, o in enumerate(outs):
            weight_grad(_half_of_a(operand, a_values, a_scales, half, m), b, offsets, out=o, **opts)
        return result
    variant = weight_grad_variant(
        m, n, "f32" if outs[0].dtype == torch.float32 else "bf16", accumulate,
        a_stride=None if operand == "e4m3_block" else a_values.stride(0), tile_n=tile_n, persistent=persistent, pingpong=pingpong,
        split_out=split_out, operand=operand, interleaved_out=interleaved, deep_turn=deep_turn,
    )
    launch_weight_grad(variant, a, b, offsets, counts, outs, half_stride, upper_first)
    return result


def _check_fp8_block_operands(a, b, split_out: bool, persistent, tile_n: int, pingpong) -> tuple[int, int, int]:
    """:func:`weight_grad`'s FP8 block-scaled transposes and the kernel's options checked (its
    docstring); returns (R, M, N)."""
    (a_values, a_scales), (b_values, b_scales) = operand_parts("a", a), operand_parts("b", b)
    check_tensor("a", a_values, dtypes=E4M3, ndim=2, contiguous=True)
    dev = a_values.device
    check_tensor("b", b_values, dtypes=E4M3, ndim=2, device=dev, contiguous=True)
    if b_scales is None or b_scales.dtype != torch.float32:
        raise ValueError("FP8 block-scaled operands: b as an (elements, float32 scales) pair too")
    if persistent is False or pingpong or tile_n != 128:
        raise ValueError(f"FP8 block-scaled operands: the persistent kernel, no ping-pong, tile_n 128, got persistent={persistent}, "
                         f"pingpong={pingpong}, tile_n={tile_n}")
    (m, num_rows), n = a_values.shape, b_values.shape[0]
    if b_values.shape[1] != num_rows:
        raise ValueError(f"b: expected [N, R] with R={num_rows} like a's [M, R] (the rows' transposes), got {list(b_values.shape)}")
    if m % (32 if split_out else 16) or n % 16 or num_rows % 128:
        raise ValueError(f"(M, N, R): expected M a multiple of {32 if split_out else 16}, N of 16 and R of 128, got ({m}, {n}, {num_rows})")
    for name, t, width in (("a", a_scales, m), ("b", b_scales, n)):
        check_tensor(f"{name} scales", t, dtypes=(torch.float32,), shape=(num_rows // 128, width), device=dev, contiguous=True)
    return num_rows, m, n


def _half_of_a(operand: str, values: torch.Tensor, scales: torch.Tensor | None, half: int, m: int):
    """split_out's half ``half`` of A (M/2 of its M) in its format: bf16 A's column range; MXFP8's
    and its scales' chunk range; FP8 blocks' row range of the transpose and its scales' columns."""
    cut = slice(half * (m // 2), (half + 1) * (m // 2))
    if operand == "e4m3_block":
        return values[cut], scales[:, cut].contiguous()
    if operand == "e4m3":  # (the halves' chunks in turn: quantize_mxfp8_columns(segments=2))
        chunks = scales.shape[0] // 2
        return values[:, cut], scales[half * chunks:(half + 1) * chunks]
    return values[:, cut]


def _check_rows_and_outputs(offsets, counts, m: int, n: int, split_out: bool, tile_n: int, accumulate: bool, out, out_dtype,
                            device) -> int:
    """The experts' row ranges and the output's form; returns E."""
    check_tensor("offsets", offsets, dtypes=I32, ndim=1, device=device, contiguous=True)
    num_experts = offsets.shape[0] - 1
    if num_experts < 1:
        raise ValueError(f"offsets: expected E + 1 >= 2 entries, got {offsets.shape[0]}")
    if counts is not None:
        check_tensor("counts", counts, dtypes=I32, shape=(num_experts,), device=device, contiguous=True)
    if split_out and m % 16:
        raise ValueError(f"split_out: expected M a multiple of 16 (each half 16-byte rows), got M={m}")
    if tile_n not in (128, 256):
        raise ValueError(f"tile_n: expected 128 or 256, got {tile_n}")
    if accumulate and out is None:
        raise ValueError("accumulate: needs out, the fp32 gradient to add into")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"out_dtype: expected torch.bfloat16 or torch.float32, got {out_dtype}")
    return num_experts


def _split_out_stride(outs) -> tuple[int | None, int]:
    """split_out's two output tensors as one TMA descriptor's halves: (elements from the lower to the
    upper one, 1 when the second tensor lies lower); (None, 0) when their distance is not a stride a
    descriptor can hold (then a launch per half)."""
    elem = outs[0].element_size()
    distance = outs[1].data_ptr() - outs[0].data_ptr()  # bytes from the first half's tensor to the second's
    if abs(distance) < outs[0].numel() * elem:
        raise ValueError("out: the two halves overlap in memory")
    if distance % 16 or abs(distance) >= TMA_STRIDE_LIMIT:
        return None, 0
    return abs(distance) // elem, int(distance < 0)


def _interleaved_rows(outs) -> bool:
    """Whether split_out's two outputs are the even and odd rows of one contiguous [E, M, N] tensor."""
    half, other = outs
    experts, rows, n = half.shape
    return (
        half.stride() == (2 * rows * n, 2 * n, 1) and other.stride() == half.stride()
        and other.untyped_storage().data_ptr() == half.untyped_storage().data_ptr()
        and other.storage_offset() == half.storage_offset() + n
    )


def _outputs(out, split_out, shape, out_dtype, dtypes, device) -> list[torch.Tensor]:
    """The output tensors, checked (one [E, M, N], or with ``split_out`` two [E, M/2, N], each
    contiguous or the even and odd rows of one), new where not given."""
    num_experts, m, n = shape
    if split_out:
        shape = (num_experts, m // 2, n)
        if out is None:
            return [torch.empty(shape, dtype=out_dtype, device=device) for _ in range(2)]
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise TypeError(f"out: with split_out, expected a pair of tensors, got {type(out).__name__}")
        for i, o in enumerate(out):
            check_tensor(f"out[{i}]", o, dtypes=dtypes, shape=shape, device=device)
        if not _interleaved_rows(out):
            for i, o in enumerate(out):
                check_tensor(f"out[{i}]", o, contiguous=True)
        if out[0].dtype != out[1].dtype:
            raise TypeError(f"out: expected one dtype for both halves, got {out[0].dtype} and {out[1].dtype}")
        return list(out)
    if out is None:
        return [torch.empty(shape, dtype=out_dtype, device=device)]
    check_tensor("out", out, dtypes=dtypes, shape=shape, device=device, contiguous=True)
    return [out]


def router_grad(partial: torch.Tensor, slot_row: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """d_topk_w [T, k] fp32: Σ_c partial[slot_row[t, j], c] in column order; 0 where slot_row < 0.

    ``out``: an optional [T, k] fp32 destination (the expert-parallel backward's workspace).
    """
    check_tensor("partial", partial, dtypes=(torch.float32,), ndim=2, contiguous=True)
    if partial.device.type != "cuda":
        raise ValueError(f"partial: expected a CUDA tensor, got one on {partial.device}")
    check_tensor("slot_row", slot_row, dtypes=I32, ndim=2, device=partial.device, contiguous=True)
    num_tokens, topk = slot_row.shape
    if out is None:
        out = torch.empty(num_tokens, topk, dtype=torch.float32, device=partial.device)
    check_tensor("out", out, dtypes=(torch.float32,), shape=(num_tokens, topk), device=partial.device, contiguous=True)
    if num_tokens == 0:
        return out
    check_32bit("partial", partial)
    kernel = kernel_for(router_grad_variant(topk, partial.shape[1]), partial.device)
    kernel(
        launch.ptr("f32", partial, 4), launch.ptr("i32", slot_row, 4), launch.ptr("f32", out, 4),
        launch.i32(num_tokens), launch.i32(partial.shape[0]), launch.stream(partial.device),
    )
    return out
