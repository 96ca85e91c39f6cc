"""Row movers: the gather into the expert-grouped rows and the combine back into tokens.

    gather_rows       out[r] = src[index[r]]                (zeros where index[r] < 0; up to a device count)
    gather_rows_pair  the same rows of two sources in one launch (the backward's dout and x)
    gather_fp8_rows   E4M3 rows with their 1 x 128 blocks' scales (x quantized once per token)
    combine           out[t] = shared[t] + Σ_j w[t, j]·y[t, j]   (fp32, j in order, bf16 out)
"""

from __future__ import annotations

import torch

from ..kernels.variants import combine_variant, gather_variant
from ..runtime import launch
from ..validation import check_tensor
from .common import BF16, E4M3, I32, bf16_out, check_32bit, check_cuda_aligned, check_disjoint, check_launchable, check_rows_used, kernel_for


def combine(
    y: torch.Tensor,
    topk_w: torch.Tensor | None,
    shared_out: torch.Tensor | None = None,
    *,
    slot_row: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    router: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """out[t] = shared_out[t] + Σ_j topk_w[t, j]·y[t, j] in fp32, fixed j order, bf16 result.

    y: [T, k, H] bf16, the expert outputs in their (token, slot) combine slots; or, with
    ``slot_row`` [T, k] int32, the expert-grouped rows [R, H] with y[t, j] = y[slot_row[t, j]]
    (a negative slot_row adds nothing). topk_w: [T, k] fp32 router weights, or None for
    weights of 1 (read from nowhere: the backward's dx = Σ_j dx_slot). shared_out:
    optional [T, H] bf16 shared-expert output. out: optional [T, H] bf16 destination.
    All contiguous, on one CUDA device, H % 8 == 0. The operation order (one FMA per slot)
    is given in ``mok.kernels.common.combine``; ``mok.reference.combine_reference``
    reproduces it exactly. ``router`` = (partial [R, parts] fp32, d_topk_w [T, k] fp32), with
    gathered rows and unit weights only (the backward's dx): the same launch also writes
    d_topk_w as :func:`mok.ops.router_grad` computes it.
    """
    gathered = slot_row is not None
    if gathered:
        check_tensor("slot_row", slot_row, dtypes=(torch.int32,), ndim=2, contiguous=True)
        num_tokens, topk = slot_row.shape
        check_tensor("y", y, dtypes=BF16, ndim=2, device=slot_row.device, contiguous=True)
        num_rows, hidden = y.shape
    else:
        check_tensor("y", y, dtypes=BF16, ndim=3, contiguous=True)
        num_tokens, topk, hidden = y.shape
        num_rows = num_tokens * topk
    check_cuda_aligned("y", y)
    if topk < 1:
        raise ValueError(f"topk_w: expected k >= 1 slots per token, got k={topk}")
    if hidden % 8:
        raise ValueError(f"y: expected hidden size H % 8 == 0, got H={hidden}")
    check_32bit("y", y)
    if topk_w is not None:
        check_tensor("topk_w", topk_w, dtypes=(torch.float32,), shape=(num_tokens, topk), device=y.device, contiguous=True)
    if shared_out is not None:
        check_tensor("shared_out", shared_out, dtypes=BF16, shape=(num_tokens, hidden), device=y.device, contiguous=True)
        check_cuda_aligned("shared_out", shared_out)
    given = out
    out = bf16_out(out, (num_tokens, hidden), y.device)
    check_32bit("out", out)  # (gathered: T rows may outnumber y's R when a capacity bound cut them)
    check_disjoint({"out": given}, {"y": y})  # (out may be shared_out itself: a thread reads its element before writing it)
    if router is not None:
        if not gathered or topk_w is not None:
            raise ValueError("router: only with slot_row and topk_w=None (the backward's dx combine)")
        partial, d_topk_w = router
        check_tensor("router partial", partial, dtypes=(torch.float32,), ndim=2, device=y.device, contiguous=True)
        if partial.shape[0] != num_rows or not 1 <= partial.shape[1] <= 1024:
            raise ValueError(f"router partial: expected [{num_rows}, parts] with 1 <= parts <= 1024, got {list(partial.shape)}")
        check_tensor("router d_topk_w", d_topk_w, dtypes=(torch.float32,), shape=(num_tokens, topk), device=y.device, contiguous=True)
        if topk > 128:
            raise ValueError(f"router: expected k <= 128 (one thread per pair), got k={topk}")
        check_32bit("router partial", partial)
    if num_tokens == 0:
        return out
    if gathered and num_rows == 0:  # no row to read, so no slot has one: the shared expert's output, or zeros (the kernel's bits)
        out.copy_(shared_out) if shared_out is not None else out.zero_()
        if router is not None:
            router[1].zero_()
        return out
    if router is not None:
        kernel = kernel_for(combine_variant(hidden, topk, shared_out is not None, True, True, router_parts=partial.shape[1]), y.device)
        kernel(
            launch.ptr("bf16", y), launch.ptr("i32", slot_row, 4), launch.ptr("f32", partial, 4), launch.ptr("bf16", shared_out), launch.ptr("bf16", out),
            launch.ptr("f32", d_topk_w, 4), launch.i32(num_tokens), launch.i32(num_rows), launch.stream(y.device),
        )
        return out
    kernel = kernel_for(combine_variant(hidden, topk, shared_out is not None, gathered, unit_weights=topk_w is None), y.device)
    kernel(
        launch.ptr("bf16", y), launch.ptr("i32", slot_row, 4), launch.ptr("f32", topk_w, 4), launch.ptr("bf16", shared_out), launch.ptr("bf16", out),
        launch.i32(num_tokens), launch.i32(num_rows), launch.stream(y.device),
    )
    return out


def check_gather_args(name: str, src: torch.Tensor, index: torch.Tensor) -> tuple[int, int]:
    """A row gather's source ``name`` (bf16 [T, W], W % 8 == 0, launchable) and index; returns (rows out, W)."""
    check_tensor(name, src, dtypes=BF16, ndim=2, contiguous=True)
    check_cuda_aligned(name, src)
    check_32bit(name, src)
    check_tensor("index", index, dtypes=(torch.int32,), ndim=1, device=src.device, contiguous=True)
    num_out, width = index.shape[0], src.shape[1]
    if width % 8:
        raise ValueError(f"{name}: expected a row width % 8 == 0, got {width}")
    return num_out, width


def gather_rows(
    src: torch.Tensor, index: torch.Tensor, *, out: torch.Tensor | None = None, rows_used: torch.Tensor | None = None
) -> torch.Tensor:
    """out[r] = src[index[r]] (bf16 rows), zeros where index[r] < 0. Indices must be < len(src).
    ``rows_used`` (int32 [1] on src's device): only the first rows_used[0] rows written, the rest
    of ``out`` left as it was (the count stays on the device: a schedule's rows in use)."""
    num_out, width = check_gather_args("src", src, index)
    check_rows_used(rows_used, src.device)
    given = out
    out = bf16_out(out, (num_out, width), src.device)
    check_32bit("out", out)
    check_disjoint({"out": given}, {"src": src})
    if num_out == 0:
        return out
    kernel = kernel_for(gather_variant(width, bounded=rows_used is not None), src.device)
    kernel(launch.ptr("bf16", src), launch.ptr("i32", index, 4), launch.ptr("bf16", out), launch.ptr("i32", rows_used, 4), launch.i32(src.shape[0]),
           launch.i32(num_out), launch.stream(src.device))
    return out


def gather_fp8_rows(
    rows: tuple[torch.Tensor, torch.Tensor], index: torch.Tensor, *, rows_used: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 rows quantized once per token, gathered: ``rows`` = (elements float8_e4m3fn [T, K],
    scales float32 [blocks, T]) as mok.ops.quantize_fp8_rows(x) gives them (K a multiple of 16,
    blocks = ceil(K / 128)); returns (elements [R, K], scales [blocks, R]) with row r = token
    index[r]'s, zeros with scale 1.0 where index[r] < 0 (a schedule's padding rows): the bits of
    quantize_fp8_rows(x, row_source=index) in one pass over the E4M3 bytes (half of bf16's).
    ``rows_used`` (int32 [1] on the device): only the first rows_used[0] rows written, the rest
    of the outputs left unwritten (the count stays on the device)."""
    if not isinstance(rows, (tuple, list)) or len(rows) != 2:
        raise TypeError(f"rows: expected (elements, scales) as quantize_fp8_rows gives them, got {type(rows).__name__}")
    elements, scales = rows
    check_tensor("elements", elements, dtypes=E4M3, ndim=2, contiguous=True)
    num_src, width = elements.shape
    if width % 16 or width == 0:
        raise ValueError(f"elements: expected [T, K] with K a positive multiple of 16 (16-byte rows), got {list(elements.shape)}")
    blocks = -(-width // 128)
    check_tensor("scales", scales, dtypes=(torch.float32,), shape=(blocks, num_src), device=elements.device, contiguous=True)
    check_tensor("index", index, dtypes=I32, ndim=1, device=elements.device, contiguous=True)
    check_rows_used(rows_used, elements.device)
    num_out = index.shape[0]
    out = torch.empty(num_out, width, dtype=torch.float8_e4m3fn, device=elements.device)
    out_scales = torch.empty(blocks, num_out, dtype=torch.float32, device=elements.device)
    if num_out == 0:
        return out, out_scales
    used = rows_used if rows_used is not None else torch.full((1,), num_out, dtype=torch.int32, device=elements.device)
    check_launchable(elements=elements, scales=scales, index=index, out=out)  # (CUDA, aligned, 32-bit indexable)
    kernel = kernel_for(gather_variant(width, fp8=True), elements.device)
    kernel(launch.ptr("bf16", elements), launch.ptr("f32", scales, 4), launch.ptr("i32", index, 4), launch.ptr("bf16", out),
           launch.ptr("f32", out_scales, 4), launch.ptr("i32", used, 4), launch.i32(num_src), launch.i32(num_out), launch.stream(elements.device))
    return out, out_scales


def gather_rows_pair(
    first: torch.Tensor, second: torch.Tensor, index: torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor] | None = None,
    rows_used: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(first[index], second[index]) as :func:`gather_rows` gives each, in one launch; the two
    sources [T, W] bf16 of one shape (the backward's dout and x); ``out``: the two results' tensors;
    ``rows_used``: as in :func:`gather_rows`."""
    num_out, width = check_gather_args("first", first, index)
    check_tensor("second", second, shape=tuple(first.shape), device=first.device)
    check_gather_args("second", second, index)
    check_rows_used(rows_used, first.device)
    if out is not None and (not isinstance(out, (tuple, list)) or len(out) != 2):
        raise TypeError(f"out: expected a pair of tensors, got {type(out).__name__}")
    outs = tuple(bf16_out(None if out is None else out[i], (num_out, width), first.device) for i in range(2))
    for name, t in zip(("out[0]", "out[1]"), outs):
        check_32bit(name, t)
    if out is not None:
        check_disjoint({"out[0]": outs[0], "out[1]": outs[1]}, {"first": first, "second": second})
    if num_out == 0:
        return outs
    kernel = kernel_for(gather_variant(width, sources=2, bounded=rows_used is not None), first.device)
    kernel(
        launch.ptr("bf16", first), launch.ptr("bf16", second), launch.ptr("i32", index, 4), launch.ptr("bf16", outs[0]), launch.ptr("bf16", outs[1]),
        launch.ptr("i32", rows_used, 4), launch.i32(first.shape[0]), launch.i32(num_out), launch.stream(first.device),
    )
    return outs
