"""Entry points of the backward's kernels on PyTorch tensors (see mok/ops.py for the forward's).

Like the forward ops, each checks its arguments and raises before any launch, fetches its
kernel through the registry and cache, launches on the current stream and never reads
device data back (CUDA-graph capturable).
"""

from __future__ import annotations

import torch

from .kernels import (
    default_tile_n, grouped_gemm_mxfp8_variant, grouped_gemm_variant, router_grad_variant, swiglu_backward_pingpong,
    weight_grad_mxfp8_variant, weight_grad_pingpong, weight_grad_variant,
)
from .ops import (
    BF16, _check_32bit, _check_launchable, _check_mxfp8_gemm_arch, _check_mxfp8_rows, _check_mxfp8_weights, _check_weights_launchable,
    _i32, _i64, _kernel, _persistent, _ptr, _sm_count, _stream, launch_grouped_gemm, launch_grouped_gemm_mxfp8,
)
from .validation import check_tensor

I32 = (torch.int32,)


def swiglu_backward_gemm(
    dout_rows: torch.Tensor,
    w_down: torch.Tensor,
    tile_expert: torch.Tensor,
    h: torch.Tensor,
    *,
    row_token: torch.Tensor | None = None,
    row_slot: torch.Tensor | None = None,
    topk_w: torch.Tensor | None = None,
    persistent: bool | None = None,
    skip_padding: bool = False,
    pingpong: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Down-projection backward with the SwiGLU backward and the router gradient's pieces fused in.

    Per buffer row r (expert e of its tile, token t, slot j, router weight s = topk_w[t, j]):
    dA_u = dout_rows[r]·w_down[e] (w_down [E, H, I], read N-major); with the saved
    h[r] = [h_gate | h_up] ([R, 2I] bf16) and a = silu(h_gate)·h_up it returns
    dh [R, 2I] = [s·dA_u·h_up·silu'(h_gate) | s·dA_u·silu(h_gate)] (bf16), a_scaled [R, I] = s·a
    (bf16, for dW_down) and partial [R, I/tile_n] fp32, Σ over each column tile of dA_u·a
    (:func:`router_grad` adds them up). row_token/row_slot [R] int32 and topk_w [T, k] fp32
    give s (0 for padding rows); all None for the shared expert (s = 1, partial is None).
    Rows of tiles with tile_expert -1 are left unwritten. ``persistent=False``: the
    one-tile-per-CTA kernel (the same results, bit for bit); None (default): persistent where the
    GPU has that kernel (Hopper), else one tile per CTA (SM100, compile-verified, never run).
    ``skip_padding`` (with row_token, persistent): 64-row halves of a tile that are all padding
    issue no WGMMA (see ops.grouped_gemm).
    ``pingpong`` (persistent, no skip_padding; the default there): the two MMA warpgroups take
    whole tiles in turn, one's epilogue under the other's WGMMAs (the same bits; 16% faster at
    qwen3's shapes, 4% at dsv3's — perf/NOTES.md).
    """
    check_tensor("dout_rows", dout_rows, dtypes=BF16, ndim=2, contiguous=True)
    num_rows, hidden = dout_rows.shape
    dev = dout_rows.device
    persistent = _persistent(dev) if persistent is None else persistent
    check_tensor("w_down", w_down, dtypes=BF16, ndim=3, device=dev, contiguous=True)
    num_experts, _, inter = w_down.shape
    check_tensor("w_down", w_down, shape=(num_experts, hidden, inter))
    check_tensor("h", h, dtypes=BF16, shape=(num_rows, 2 * inter), device=dev, contiguous=True)
    check_tensor("tile_expert", tile_expert, dtypes=I32, shape=(-(-num_rows // 128),), device=dev, contiguous=True)
    unit_scale, num_tokens, topk = _check_router_rows(row_token, row_slot, topk_w, num_rows, dev)
    if inter % 128 or hidden % 64:
        raise ValueError(f"w_down: expected I % 128 == 0 and H % 64 == 0, got I={inter}, H={hidden}")
    if skip_padding and (unit_scale or not persistent):
        raise ValueError("skip_padding: only with row_token (routed experts) and the persistent kernel")
    tile_n = default_tile_n(inter, hidden, True)
    if pingpong is None:
        pingpong = swiglu_backward_pingpong(persistent, skip_padding, tile_n)
    if pingpong and (skip_padding or not persistent):
        raise ValueError("pingpong: only with persistent=True and without skip_padding")
    dh, a_scaled, partial = _swiglu_backward_outputs(num_rows, inter, tile_n, unit_scale, dev)
    _check_launchable(dout_rows=dout_rows, h=h, dh=dh)
    _check_weights_launchable(w_down=w_down)
    if num_rows == 0:
        return dh, a_scaled, partial
    variant = grouped_gemm_variant(
        inter, hidden, tile_n=tile_n, epilogue="swiglu_bwd", b_major="n", topk=topk, unit_scale=unit_scale,
        persistent=persistent, skip_padding=skip_padding, pingpong=pingpong,
    )
    launch_grouped_gemm(
        variant, dout_rows, w_down, w_down, dh, tile_expert, h=h, a_scaled=a_scaled, partial=partial,
        row_token=row_token, row_slot=row_slot, topk_w=topk_w,
        num_rows=num_rows, num_experts=num_experts, num_tokens=num_tokens,
    )
    return dh, a_scaled, partial


TMA_STRIDE_LIMIT = 2**40  # bytes: a TMA descriptor's strides stay below it (cuTensorMapEncodeTiled)


def _check_router_rows(row_token, row_slot, topk_w, num_rows: int, device) -> tuple[bool, int, int]:
    """The SwiGLU backward's router inputs: all three (routed experts: row_token, row_slot [R] int32,
    topk_w [T, k] fp32) or none (the shared expert, s = 1). Returns (unit_scale, T, k)."""
    unit_scale = topk_w is None
    if unit_scale != (row_token is None) or unit_scale != (row_slot is None):
        raise ValueError("row_token, row_slot, topk_w: give all three (routed experts) or none (shared expert)")
    if unit_scale:
        return True, 1, 1
    check_tensor("topk_w", topk_w, dtypes=(torch.float32,), ndim=2, device=device, contiguous=True)
    check_tensor("row_token", row_token, dtypes=I32, shape=(num_rows,), device=device, contiguous=True)
    check_tensor("row_slot", row_slot, dtypes=I32, shape=(num_rows,), device=device, contiguous=True)
    return False, *topk_w.shape


def _swiglu_backward_outputs(num_rows: int, inter: int, tile_n: int, unit_scale: bool, device) -> tuple:
    """dh [R, 2I] and a_scaled [R, I] bf16, and the router gradient's pieces [R, I / tile_n] fp32 (None for the shared expert)."""
    dh = torch.empty(num_rows, 2 * inter, dtype=torch.bfloat16, device=device)
    a_scaled = torch.empty(num_rows, inter, dtype=torch.bfloat16, device=device)
    partial = None if unit_scale else torch.empty(num_rows, inter // tile_n, dtype=torch.float32, device=device)
    return dh, a_scaled, partial


def swiglu_backward_gemm_mxfp8(
    dout_rows: tuple[torch.Tensor, torch.Tensor],
    w_down_t: tuple[torch.Tensor, torch.Tensor],
    tile_expert: torch.Tensor,
    h: torch.Tensor,
    *,
    row_token: torch.Tensor | None = None,
    row_slot: torch.Tensor | None = None,
    topk_w: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`swiglu_backward_gemm` with dA_u = dout_rows·w_down on MXFP8 operands, SM100 only
    (block-scaled tcgen05 MMAs; compile-verified, never run: no SM100 GPU was available).

    dout_rows: (elements float8_e4m3fn [R, H], scales in the MMA's order [ceil(R / 128), H / 128,
    512]); w_down_t: the down projection's weights transposed, K-major for this product, in MXFP8
    along H: (elements [E, I, H], scales [E, I / 128, H / 128, 512]) (e.g.
    mok.mxfp8_forward.quantize_weights(w_down.transpose(1, 2).contiguous())). h, row_token,
    row_slot, topk_w and the results (dh, a_scaled, partial) as there; 128-wide column tiles.
    """
    dout, dout_scales = dout_rows
    check_tensor("dout_rows", dout, dtypes=(torch.float8_e4m3fn,), ndim=2, contiguous=True)
    num_rows, hidden = dout.shape
    dev = dout.device
    num_experts, inter = _check_mxfp8_weights("w_down_t", w_down_t[0], w_down_t[1], dev, hidden)
    _check_mxfp8_rows("dout_rows", dout, dout_scales)
    check_tensor("h", h, dtypes=BF16, shape=(num_rows, 2 * inter), device=dev, contiguous=True)
    check_tensor("tile_expert", tile_expert, dtypes=I32, shape=(-(-num_rows // 128),), device=dev, contiguous=True)
    unit_scale, num_tokens, topk = _check_router_rows(row_token, row_slot, topk_w, num_rows, dev)
    tile_n = 128
    dh, a_scaled, partial = _swiglu_backward_outputs(num_rows, inter, tile_n, unit_scale, dev)
    _check_launchable(dout_rows=dout, dout_scales=dout_scales, h=h, dh=dh)
    _check_weights_launchable(w_down_t=w_down_t[0], w_down_t_scales=w_down_t[1])
    _check_mxfp8_gemm_arch("swiglu_backward_gemm_mxfp8", dev)
    if num_rows == 0:
        return dh, a_scaled, partial
    variant = grouped_gemm_mxfp8_variant(inter, hidden, "swiglu_bwd", tile_n, topk=topk, unit_scale=unit_scale)
    launch_grouped_gemm_mxfp8(
        variant, dout_rows, w_down_t, w_down_t, dh, tile_expert, h=h, a_scaled=a_scaled, partial=partial, row_token=row_token,
        row_slot=row_slot, topk_w=topk_w, num_experts=num_experts, num_tokens=num_tokens,
    )
    return dh, a_scaled, partial


def weight_grad(
    a: torch.Tensor,
    b: torch.Tensor,
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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-expert weight gradient: out[e] (+)= a[rows of e]ᵀ · b[rows of e], fp32 accumulation.

    a: [R, M] bf16 (rows may be strided: a column slice of a wider buffer), b: [R, N] bf16
    contiguous; expert e owns rows offsets[e] .. offsets[e+1] (offsets [E+1] int32 on the GPU,
    multiples of 128 except the last, which may be R; rows at or past R are not read).
    ``counts`` [E] int32 on the GPU (the schedule's expert_counts): expert e's rows past
    offsets[e] + counts[e] are padding (zero in a and b); the 64-row blocks holding only such
    rows are skipped, not multiplied (the same bits: they would add zeros). out:
    [E, M, N] bf16 or fp32, new unless given; ``accumulate`` adds into the given fp32 ``out``
    (main_grad style) instead of overwriting it. M % 128 == 0, N % 128 == 0. ``persistent=False``
    selects the one-tile-per-CTA kernel (the same bits); None (default): persistent where the GPU
    has that kernel (Hopper), else one tile per CTA (SM100, compile-verified, never run).
    ``tile_n``: the output tile's columns, 128 or 256 (N % tile_n == 0); a wider tile reads each
    expert's A rows half as often.
    ``pingpong`` (persistent, 128-wide tiles; the default there): the two MMA warpgroups take
    whole tiles in turn, so that one's epilogue runs under the other's mainloop (the same bits).
    ``split_out`` (M % 256 == 0): out is a pair of [E, M/2, N] tensors (new unless given), the
    product's first M/2 rows going into the first, the others into the second: dW_gate and dW_up
    from one launch over all of dh (the same bits as a launch per half, which it falls back to
    where the two tensors' distance is not one a TMA descriptor can hold).
    """
    check_tensor("a", a, dtypes=BF16, ndim=2)
    num_rows, m = a.shape
    dev = a.device
    persistent = _persistent(dev) if persistent is None else persistent
    if num_rows and (a.stride(1) != 1 or a.stride(0) < m or a.stride(0) % 8):  # (empty views have any strides)
        raise ValueError(f"a: expected unit column stride and a row stride >= {m} that is a multiple of 8, got strides {a.stride()}")
    check_tensor("b", b, dtypes=BF16, ndim=2, device=dev, contiguous=True)
    if b.shape[0] != num_rows:
        raise ValueError(f"b: expected {num_rows} rows like a, got {b.shape[0]}")
    n = b.shape[1]
    if m % 128 or n % 128:
        raise ValueError(f"(M, N): expected multiples of 128, got ({m}, {n})")
    num_experts = _check_weight_grad_args(offsets, counts, m, n, split_out, tile_n, accumulate, out, out_dtype, dev)
    pingpong = weight_grad_pingpong(persistent, tile_n) if pingpong is None else pingpong
    if pingpong and (not persistent or tile_n != 128):
        raise ValueError("pingpong: only with persistent=True and tile_n=128")
    dtypes = (torch.float32,) if accumulate else (torch.bfloat16, torch.float32)
    outs = _weight_grad_outputs(out, split_out, (num_experts, m, n), out_dtype, dtypes, dev)
    _check_launchable(a=a, b=b)
    _check_weights_launchable(**{f"out[{i}]": o for i, o in enumerate(outs)})  # (the gradient: written by TMA only)
    result = tuple(outs) if split_out else outs[0]
    if num_rows == 0:  # nothing to add (and no TMA descriptor can describe zero rows)
        if not accumulate:
            for o in outs:
                o.zero_()
        return result
    half_stride, upper_first = _split_out_stride(outs) if split_out else (0, 0)
    if half_stride is None:  # not a TMA descriptor's stride: a launch per half
        opts = dict(counts=counts, accumulate=accumulate, persistent=persistent, tile_n=tile_n, pingpong=pingpong)
        for half, o in zip((a[:, : m // 2], a[:, m // 2 :]), outs):
            weight_grad(half, b, offsets, out=o, **opts)
        return result
    dtype_name = "f32" if outs[0].dtype == torch.float32 else "bf16"
    variant = weight_grad_variant(
        m, n, dtype_name, accumulate, a_stride=a.stride(0), tile_n=tile_n, persistent=persistent, pingpong=pingpong, split_out=split_out
    )
    launch_weight_grad(variant, a, b, offsets, counts, outs, half_stride, upper_first)
    return result


def launch_weight_grad(variant, a, b, offsets, counts, outs, half_stride: int = 0, upper_first: int = 0) -> None:
    """Launch a checked weight-gradient variant on A [R, M] with R >= 1 (``outs``: its output
    tensor, or split_out's two; ``counts`` None: offsets stand in, not read)."""
    dtype_name = "f32" if outs[0].dtype == torch.float32 else "bf16"
    base = min(outs, key=lambda o: o.data_ptr())
    _kernel(variant, a.device)(
        _ptr("bf16", a), _ptr("bf16", b), _ptr(dtype_name, base), _ptr("i32", offsets, 4),
        _ptr("i32", offsets if counts is None else counts, 4), _i32(counts is not None),
        _i32(a.shape[0]), _i32(offsets.shape[0] - 1), _i32(_sm_count(a.device)), _i64(half_stride), _i32(upper_first),
        _stream(a.device),
    )


def weight_grad_mxfp8(
    a_q: tuple[torch.Tensor, torch.Tensor],
    b_q: tuple[torch.Tensor, torch.Tensor],
    offsets: torch.Tensor,
    *,
    counts: torch.Tensor | None = None,
    out: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    accumulate: bool = False,
    out_dtype: torch.dtype = torch.bfloat16,
    tile_n: int = 128,
    split_out: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`weight_grad` on MXFP8 operands quantized along the rows, SM100 only (block-scaled
    tcgen05 MMAs; compile-verified, never run: no SM100 GPU was available).

    a_q = (elements float8_e4m3fn [R, M], scales [ceil(M / 128), R / 128, 512]) and b_q likewise
    [R, N], as mok.ops.quantize_mxfp8_columns(..., scale_order="mma") gives them; R a multiple of
    128 and every offset too (the schedule's are). offsets, counts, out, accumulate, out_dtype,
    tile_n and split_out as there (one tile per CTA).
    """
    (a, a_scales), (b, b_scales) = a_q, b_q
    check_tensor("a", a, dtypes=(torch.float8_e4m3fn,), ndim=2, contiguous=True)
    num_rows, m = a.shape
    dev = a.device
    check_tensor("b", b, dtypes=(torch.float8_e4m3fn,), ndim=2, device=dev, contiguous=True)
    if b.shape[0] != num_rows:
        raise ValueError(f"b: expected {num_rows} rows like a, got {b.shape[0]}")
    n = b.shape[1]
    if num_rows % 128 or m % 128 or n % 128:
        raise ValueError(f"(R, M, N): expected multiples of 128 with MXFP8 operands, got ({num_rows}, {m}, {n})")
    for name, t, width in (("a", a_scales, m), ("b", b_scales, n)):
        check_tensor(f"{name}_scales", t, dtypes=(torch.uint8,), shape=(width // 128, num_rows // 128, 512), device=dev, contiguous=True)
    num_experts = _check_weight_grad_args(offsets, counts, m, n, split_out, tile_n, accumulate, out, out_dtype, dev)
    dtypes = (torch.float32,) if accumulate else (torch.bfloat16, torch.float32)
    outs = _weight_grad_outputs(out, split_out, (num_experts, m, n), out_dtype, dtypes, dev)
    _check_launchable(a=a, a_scales=a_scales, b=b, b_scales=b_scales)
    _check_weights_launchable(**{f"out[{i}]": o for i, o in enumerate(outs)})
    _check_mxfp8_gemm_arch("weight_grad_mxfp8", dev)
    result = tuple(outs) if split_out else outs[0]
    if num_rows == 0:
        if not accumulate:
            for o in outs:
                o.zero_()
        return result
    half_stride, upper_first = _split_out_stride(outs) if split_out else (0, 0)
    if half_stride is None:  # a launch per half: A's column halves, their scales' chunk halves
        half_chunks = m // 2 // 128
        for half, o in enumerate(outs):
            cols = slice(half * (m // 2), (half + 1) * (m // 2))
            a_half = (a[:, cols], a_scales[half * half_chunks : (half + 1) * half_chunks])
            _launch_weight_grad_mxfp8(a_half, b_q, offsets, counts, [o], accumulate, tile_n, False, 0, 0)
        return result
    _launch_weight_grad_mxfp8(a_q, b_q, offsets, counts, outs, accumulate, tile_n, split_out, half_stride, upper_first)
    return result


def _launch_weight_grad_mxfp8(a_q, b_q, offsets, counts, outs, accumulate, tile_n, split_out, half_stride, upper_first) -> None:
    """Launch the MXFP8 weight-gradient kernel on checked arguments (A may be a column slice)."""
    (a, a_scales), (b, b_scales) = a_q, b_q
    num_rows, m = a.shape
    dtype_name = "f32" if outs[0].dtype == torch.float32 else "bf16"
    variant = weight_grad_mxfp8_variant(
        m, b.shape[1], dtype_name, accumulate, a_stride=a.stride(0), tile_n=tile_n,
        split_out=split_out,
    )
    base = min(outs, key=lambda o: o.data_ptr())
    _kernel(variant, a.device)(
        _ptr("e4m3", a), _ptr("e8m0", a_scales), _ptr("e4m3", b), _ptr("e8m0", b_scales), _ptr(dtype_name, base),
        _ptr("i32", offsets, 4), _ptr("i32", offsets if counts is None else counts, 4), _i32(counts is not None),
        _i32(num_rows), _i32(offsets.shape[0] - 1), _i64(half_stride), _i32(upper_first), _stream(a.device),
    )


def _check_weight_grad_args(offsets, counts, m: int, n: int, split_out: bool, tile_n: int, accumulate: bool, out, out_dtype,
                            device) -> int:
    """The weight-gradient ops' shared arguments (the experts' row ranges, the output's form);
    returns E."""
    check_tensor("offsets", offsets, dtypes=I32, ndim=1, device=device, contiguous=True)
    num_experts = offsets.shape[0] - 1
    if num_experts < 1:
        raise ValueError(f"offsets: expected E + 1 >= 2 entries, got {offsets.shape[0]}")
    if counts is not None:
        check_tensor("counts", counts, dtypes=I32, shape=(num_experts,), device=device, contiguous=True)
    if split_out and m % 256:
        raise ValueError(f"split_out: expected M a multiple of 256 (each half whole 128-row tiles), got M={m}")
    if tile_n not in (128, 256) or n % tile_n:
        raise ValueError(f"tile_n: expected 128 or 256 dividing N={n}, got {tile_n}")
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


def _weight_grad_outputs(out, split_out, shape, out_dtype, dtypes, device) -> list[torch.Tensor]:
    """weight_grad's output tensors, checked (one [E, M, N], or with ``split_out`` two [E, M/2, N]), new where not given."""
    num_experts, m, n = shape
    if split_out:
        shape = (num_experts, m // 2, n)
        if out is None:
            return [torch.empty(shape, dtype=out_dtype, device=device) for _ in range(2)]
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise TypeError(f"out: with split_out, expected a pair of tensors, got {type(out).__name__}")
        for i, o in enumerate(out):
            check_tensor(f"out[{i}]", o, dtypes=dtypes, shape=shape, device=device, contiguous=True)
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
    _check_32bit("partial", partial)
    kernel = _kernel(router_grad_variant(topk, partial.shape[1]), partial.device)
    kernel(
        _ptr("f32", partial, 4), _ptr("i32", slot_row, 4), _ptr("f32", out, 4),
        _i32(num_tokens), _i32(partial.shape[0]), _stream(partial.device),
    )
    return out
