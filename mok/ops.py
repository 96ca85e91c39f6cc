"""Entry points that launch MoK's kernels on PyTorch tensors.

Each one validates its arguments (dtype, shape, device, layout) and raises before any
launch, then fetches its compiled kernel through the registry and cache (JIT on first
call) and launches it on the current CUDA stream. The launching ops read no device data
back, so they are CUDA-graph capturable (``raise_grid_timeouts`` reads one int, and
``grid_sync_words`` synchronises once when it allocates a stream's words: call it before capture).
"""

from __future__ import annotations

import functools
import threading

import torch

from .kernels import (
    GRID_SYNC_WORDS, MXFP8_GEMM_ARCHS, combine_variant, default_tile_n, expert_mlp_variant, gather_variant, get_kernel,
    grouped_gemm_mxfp8_variant, grouped_gemm_variant, quantize_mxfp8_variant, schedule_ctas, schedule_variant,
)
from .mxfp8 import BLOCK as MXFP8_BLOCK, check_blocked
from .schedule import Schedule, check_schedule, check_schedule_args, shared_prefix_rows, worst_case_capacity
from .runtime.arch import device_arch, has_persistent_gemms
from .runtime.launch import i32 as _i32, i64 as _i64, ptr as _ptr, stream as _stream
from .validation import check_tensor, check_timeout

_ALIGN = 16  # bytes: the kernels use 16-byte vector loads and stores (and TMA)
BF16 = (torch.bfloat16,)


def _check_cuda_aligned(name: str, t: torch.Tensor) -> None:
    if t.device.type != "cuda":
        raise ValueError(f"{name}: expected a CUDA tensor, got one on {t.device}")
    if t.data_ptr() % _ALIGN:
        raise ValueError(f"{name}: expected a {_ALIGN}-byte aligned data pointer, got address {t.data_ptr():#x}")


def _check_32bit(name: str, t: torch.Tensor) -> None:
    if t.numel() >= 2**31:
        raise ValueError(f"{name}: expected fewer than 2**31 elements (32-bit indexing), got {t.numel()}")


def _check_32bit_rows(name: str, rows: int, width: int) -> None:
    """An intermediate buffer [rows, width] the op allocates: 32-bit indexable (checked before it exists)."""
    if rows * width >= 2**31:
        raise ValueError(f"{name}: expected fewer than 2**31 elements (32-bit indexing), got {rows} x {width} = {rows * width}")


def _check_launchable(**tensors: torch.Tensor | None) -> None:
    """Each tensor given (None: skipped) is on a CUDA device, 16-byte aligned and 32-bit indexable."""
    for name, t in tensors.items():
        if t is not None:
            _check_cuda_aligned(name, t)
            _check_32bit(name, t)


def _check_weights_launchable(**tensors: torch.Tensor | None) -> None:
    """Per-expert weight tensors (and weight gradients) [E, *, *]: on a CUDA device and 16-byte
    aligned. Only TMA reads and writes them, by (column, k, expert) coordinates that each stay far
    below 2^31, so the whole tensor may hold more elements than 32 bits index (a DeepSeek-V3-sized
    layer's 256 experts on one GPU: 3.8e9 per weight)."""
    for name, t in tensors.items():
        if t is not None:
            _check_cuda_aligned(name, t)


def _bf16_out(out: torch.Tensor | None, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    """The caller's ``out`` after checking it (bf16, shape, device, contiguous, aligned), or a new one."""
    if out is None:
        return torch.empty(shape, dtype=torch.bfloat16, device=device)
    check_tensor("out", out, dtypes=BF16, shape=shape, device=device, contiguous=True)
    _check_cuda_aligned("out", out)
    return out


def _byte_span(t: torch.Tensor) -> tuple[int, int] | None:
    """[first byte, past the last byte) that ``t`` can touch (None when it holds nothing)."""
    if t.numel() == 0:
        return None
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _check_disjoint(written: dict, read: dict) -> None:
    """Each output in ``written`` shares no memory with any tensor in ``read`` or with another
    output (the kernels read rows other threads write: an overlap gives wrong values, not an
    error); None entries (outputs the op allocates itself) are skipped."""
    if all(t is None for t in written.values()):
        return
    spans = {name: (t.device, _byte_span(t)) for name, t in {**written, **read}.items() if t is not None}
    names = [n for n in written if written[n] is not None]
    for i, out_name in enumerate(names):
        dev, span = spans[out_name]
        for other in names[i + 1:] + [n for n in read if read[n] is not None]:
            dev2, span2 = spans[other]
            if span and span2 and dev == dev2 and span[0] < span2[1] and span2[0] < span[1]:
                raise ValueError(f"{out_name}: expected memory of its own, got a tensor that overlaps {other}")


def _kernel(variant, device: torch.device):
    return get_kernel(variant, _arch_of(device.index))


def _persistent(device: torch.device) -> bool:
    """The default kernel kind: persistent where the GPU has persistent GEMMs (Hopper; and where no
    GPU is involved, so that the argument checks read as they always did)."""
    return device.type != "cuda" or has_persistent_gemms(_arch_of(device.index))


@functools.cache
def _arch_of(index: int) -> str | None:
    """The target of CUDA device ``index`` (it does not change while the process runs)."""
    return device_arch(index)


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
    d_topk_w as :func:`mok.grad_ops.router_grad` computes it.
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
    _check_cuda_aligned("y", y)
    if topk < 1:
        raise ValueError(f"topk_w: expected k >= 1 slots per token, got k={topk}")
    if hidden % 8:
        raise ValueError(f"y: expected hidden size H % 8 == 0, got H={hidden}")
    _check_32bit("y", y)
    if topk_w is not None:
        check_tensor("topk_w", topk_w, dtypes=(torch.float32,), shape=(num_tokens, topk), device=y.device, contiguous=True)
    if shared_out is not None:
        check_tensor("shared_out", shared_out, dtypes=BF16, shape=(num_tokens, hidden), device=y.device, contiguous=True)
        _check_cuda_aligned("shared_out", shared_out)
    given = out
    out = _bf16_out(out, (num_tokens, hidden), y.device)
    _check_32bit("out", out)  # (gathered: T rows may outnumber y's R when a capacity bound cut them)
    _check_disjoint({"out": given}, {"y": y})  # (out may be shared_out itself: a thread reads its element before writing it)
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
        _check_32bit("router partial", partial)
    if num_tokens == 0:
        return out
    if gathered and num_rows == 0:  # no row to read, so no slot has one: the shared expert's output, or zeros (the kernel's bits)
        out.copy_(shared_out) if shared_out is not None else out.zero_()
        if router is not None:
            router[1].zero_()
        return out
    if router is not None:
        kernel = _kernel(combine_variant(hidden, topk, shared_out is not None, True, True, router_parts=partial.shape[1]), y.device)
        kernel(
            _ptr("bf16", y), _ptr("i32", slot_row, 4), _ptr("f32", partial, 4), _ptr("bf16", shared_out), _ptr("bf16", out),
            _ptr("f32", d_topk_w, 4), _i32(num_tokens), _i32(num_rows), _stream(y.device),
        )
        return out
    kernel = _kernel(combine_variant(hidden, topk, shared_out is not None, gathered, unit_weights=topk_w is None), y.device)
    kernel(
        _ptr("bf16", y), _ptr("i32", slot_row, 4), _ptr("f32", topk_w, 4), _ptr("bf16", shared_out), _ptr("bf16", out),
        _i32(num_tokens), _i32(num_rows), _stream(y.device),
    )
    return out


def _check_gather_args(name: str, src: torch.Tensor, index: torch.Tensor) -> tuple[int, int]:
    """A row gather's source ``name`` (bf16 [T, W], W % 8 == 0, launchable) and index; returns (rows out, W)."""
    check_tensor(name, src, dtypes=BF16, ndim=2, contiguous=True)
    _check_cuda_aligned(name, src)
    _check_32bit(name, src)
    check_tensor("index", index, dtypes=(torch.int32,), ndim=1, device=src.device, contiguous=True)
    num_out, width = index.shape[0], src.shape[1]
    if width % 8:
        raise ValueError(f"{name}: expected a row width % 8 == 0, got {width}")
    return num_out, width


def gather_rows(src: torch.Tensor, index: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """out[r] = src[index[r]] (bf16 rows), zeros where index[r] < 0. Indices must be < len(src)."""
    num_out, width = _check_gather_args("src", src, index)
    given = out
    out = _bf16_out(out, (num_out, width), src.device)
    _check_32bit("out", out)
    _check_disjoint({"out": given}, {"src": src})
    if num_out == 0:
        return out
    kernel = _kernel(gather_variant(width), src.device)
    kernel(_ptr("bf16", src), _ptr("i32", index, 4), _ptr("bf16", out), _i32(src.shape[0]), _i32(num_out), _stream(src.device))
    return out


def gather_rows_pair(
    first: torch.Tensor, second: torch.Tensor, index: torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(first[index], second[index]) as :func:`gather_rows` gives each, in one launch; the two
    sources [T, W] bf16 of one shape (the backward's dout and x); ``out``: the two results' tensors."""
    num_out, width = _check_gather_args("first", first, index)
    check_tensor("second", second, shape=tuple(first.shape), device=first.device)
    _check_gather_args("second", second, index)
    if out is not None and (not isinstance(out, (tuple, list)) or len(out) != 2):
        raise TypeError(f"out: expected a pair of tensors, got {type(out).__name__}")
    outs = tuple(_bf16_out(None if out is None else out[i], (num_out, width), first.device) for i in range(2))
    for name, t in zip(("out[0]", "out[1]"), outs):
        _check_32bit(name, t)
    if out is not None:
        _check_disjoint({"out[0]": outs[0], "out[1]": outs[1]}, {"first": first, "second": second})
    if num_out == 0:
        return outs
    kernel = _kernel(gather_variant(width, sources=2), first.device)
    kernel(
        _ptr("bf16", first), _ptr("bf16", second), _ptr("i32", index, 4), _ptr("bf16", outs[0]), _ptr("bf16", outs[1]),
        _i32(first.shape[0]), _i32(num_out), _stream(first.device),
    )
    return outs


def quantize_mxfp8(
    x: torch.Tensor,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    rows_used: torch.Tensor | None = None,
    scale_order: str = "rows",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(elements float8_e4m3fn of x's shape, scales uint8 [..., n // 32]) of bf16 ``x`` [..., n]
    (contiguous, n a multiple of 32): the bytes mok.mxfp8.quantize_mxfp8 gives, in one launch.
    ``out``: the (elements, scales) tensors to write. ``rows_used`` (int32 [1] on x's device): only
    the first rows_used[0] rows of x (as rows of n) are converted, the rest of ``out`` is left as it
    is; the count stays on the device (no host sync). ``scale_order`` "mma" (x [R, n], n a multiple
    of 128): the scales in the order SM100's block-scaled MMAs read them, uint8 [ceil(R / 128),
    n // 128, 512], the bytes of mok.mxfp8.mma_scale_layout for rows < R (the padding rows' scales
    are left unwritten: they never reach a row of the GEMM's output), what grouped_gemm_mxfp8 takes."""
    check_tensor("x", x, dtypes=BF16, contiguous=True)
    check_blocked("x", x)
    if scale_order not in ("rows", "mma"):
        raise ValueError(f"scale_order: expected 'rows' or 'mma', got {scale_order!r}")
    mma_order = scale_order == "mma"
    if mma_order and (x.dim() != 2 or x.shape[1] % 128):
        raise ValueError(f"x: expected [R, n] with n a multiple of 128 for scale_order='mma', got shape {tuple(x.shape)}")
    _check_launchable(x=x)
    _check_rows_used(rows_used, x.device)
    blocks_per_row = x.shape[-1] // MXFP8_BLOCK
    if mma_order:
        scale_shape = (-(-x.shape[0] // 128), x.shape[1] // 128, 512)
    else:
        scale_shape = (*x.shape[:-1], blocks_per_row)
    if out is None:
        out = (torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device), torch.empty(scale_shape, dtype=torch.uint8, device=x.device))
    elif not isinstance(out, (tuple, list)) or len(out) != 2:
        raise TypeError(f"out: expected a pair of tensors (elements, scales), got {type(out).__name__}")
    elements, scales = out
    check_tensor("out[0]", elements, dtypes=(torch.float8_e4m3fn,), shape=tuple(x.shape), device=x.device, contiguous=True)
    check_tensor("out[1]", scales, dtypes=(torch.uint8,), shape=scale_shape, device=x.device, contiguous=True)
    _check_cuda_aligned("out[0]", elements)
    if x.numel() == 0:
        return elements, scales
    kernel = _kernel(quantize_mxfp8_variant(bounded=rows_used is not None, mma_order=mma_order), x.device)
    kernel(
        _ptr("bf16", x), _ptr("e4m3", elements), _ptr("u8", scales, 1), _i32(x.numel() // MXFP8_BLOCK), _ptr("i32", rows_used, 4),
        _i32(blocks_per_row), _stream(x.device),
    )
    return elements, scales


def quantize_mxfp8_columns(
    x: torch.Tensor, *, rows_used: torch.Tensor | None = None, scale_order: str = "rows"
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 of bf16 ``x`` [R, M] along its rows (blocks of 32 rows down each column: what a GEMM
    that sums over the rows, a weight gradient, takes), in one launch: elements float8_e4m3fn
    [R, M] in x's own layout, each the element of x's transpose that mok.mxfp8.quantize_mxfp8(x.T)
    gives, and that call's scales, uint8 [M, R / 32], or with ``scale_order="mma"`` in the order
    SM100's block-scaled MMAs read them, [ceil(M / 128), R / 128, 512] (mok.mxfp8.mma_scale_layout;
    the padding columns' scales left unwritten). R a multiple of 32 (of 128 for "mma"), contiguous x.
    ``rows_used`` (int32 [1] on x's device, a multiple of 32): only the first rows_used[0] rows are
    converted, the rest of the outputs left as they are; the count stays on the device."""
    check_tensor("x", x, dtypes=BF16, ndim=2, contiguous=True)
    if scale_order not in ("rows", "mma"):
        raise ValueError(f"scale_order: expected 'rows' or 'mma', got {scale_order!r}")
    rows, columns = x.shape
    if rows % (128 if scale_order == "mma" else MXFP8_BLOCK):
        raise ValueError(f"x: expected a row count that is a multiple of {128 if scale_order == 'mma' else MXFP8_BLOCK}, got shape {tuple(x.shape)}")
    _check_launchable(x=x)
    _check_rows_used(rows_used, x.device)
    elements = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    if scale_order == "mma":
        scales = torch.empty(-(-columns // 128), rows // 128, 512, dtype=torch.uint8, device=x.device)
    else:
        scales = torch.empty(columns, rows // MXFP8_BLOCK, dtype=torch.uint8, device=x.device)
    if x.numel() == 0:
        return elements, scales
    variant = quantize_mxfp8_variant(bounded=rows_used is not None, mma_order=scale_order == "mma", columns=True)
    _kernel(variant, x.device)(
        _ptr("bf16", x), _ptr("e4m3", elements), _ptr("u8", scales, 1), _i32(x.numel() // MXFP8_BLOCK), _ptr("i32", rows_used, 4),
        _i32(columns), _stream(x.device),
    )
    return elements, scales


def dequantize_mxfp8(
    elements: torch.Tensor, scales: torch.Tensor, *, out: torch.Tensor | None = None, rows_used: torch.Tensor | None = None
) -> torch.Tensor:
    """bf16 values of MXFP8 ``elements`` (float8_e4m3fn [..., n], contiguous) with ``scales`` (uint8
    [..., n // 32]): mok.mxfp8.dequantize_mxfp8 rounded to bf16, in one launch. ``rows_used``: as
    in :func:`quantize_mxfp8` (the rows past the count are left as ``out`` has them)."""
    check_tensor("elements", elements, dtypes=(torch.float8_e4m3fn,), contiguous=True)
    check_blocked("elements", elements)
    _check_launchable(elements=elements)
    _check_rows_used(rows_used, elements.device)
    scale_shape = (*elements.shape[:-1], elements.shape[-1] // MXFP8_BLOCK)
    check_tensor("scales", scales, dtypes=(torch.uint8,), shape=scale_shape, device=elements.device, contiguous=True)
    if out is None:
        out = torch.empty(elements.shape, dtype=torch.bfloat16, device=elements.device)
    check_tensor("out", out, dtypes=BF16, shape=tuple(elements.shape), device=elements.device, contiguous=True)
    _check_cuda_aligned("out", out)
    if scales.numel() == 0:
        return out
    kernel = _kernel(quantize_mxfp8_variant(back=True, bounded=rows_used is not None), elements.device)
    kernel(
        _ptr("e4m3", elements), _ptr("u8", scales, 1), _ptr("bf16", out), _i32(scales.numel()), *_rows_bound(rows_used, scales),
        _stream(elements.device),
    )
    return out


def _check_rows_used(rows_used: torch.Tensor | None, device: torch.device) -> None:
    """A row count on the device: int32 with one element."""
    if rows_used is not None:
        check_tensor("rows_used", rows_used, dtypes=(torch.int32,), device=device)
        if rows_used.numel() != 1:
            raise ValueError(f"rows_used: expected one element (a count of rows), got shape {tuple(rows_used.shape)}")


def _rows_bound(rows_used: torch.Tensor | None, scales: torch.Tensor) -> tuple:
    """The (count pointer, blocks per row) kernel arguments (null for an unbounded kernel, which
    reads neither)."""
    return _ptr("i32", rows_used, 4), _i32(scales.shape[-1])


def _check_rank_stride(name: str, ranks: tuple[int, int], per_rank: int, limit: int, limit_text: str) -> None:
    """(world W, rank stride) of W ranks' tensors of ``per_rank`` elements lying a stride apart in one
    mapping: 16-byte aligned strides, no overlap, every element within ``limit`` of rank 0's start."""
    world, stride = ranks
    if world < 1 or stride < per_rank or stride % 8 or (world - 1) * stride + per_rank > limit:
        raise ValueError(
            f"{name}: expected (world >= 1, rank stride >= {per_rank} elements, a multiple of 8, "
            f"every rank within {limit_text}), got {ranks}"
        )


def _check_weights(a: torch.Tensor, b: torch.Tensor, b2: torch.Tensor | None, b_major: str, k_split: bool) -> tuple[int, int]:
    """Check a grouped GEMM's B (and B2) against A [R, K]; returns (E, N)."""
    k = a.shape[1]
    if b_major not in ("k", "n"):
        raise ValueError(f"b_major: expected 'k' or 'n', got {b_major!r}")
    if k_split and b2 is None:
        raise ValueError("k_split: needs b2, the weights of K's second half")
    check_tensor("b", b, dtypes=BF16, ndim=3, device=a.device, contiguous=True)
    num_experts = b.shape[0]
    n = b.shape[1] if b_major == "k" else b.shape[2]
    b_k = k // 2 if k_split else k
    b_shape = (num_experts, n, b_k) if b_major == "k" else (num_experts, b_k, n)
    check_tensor("b", b, shape=b_shape)
    if b2 is not None:
        check_tensor("b2", b2, dtypes=BF16, shape=b_shape, device=a.device, contiguous=True)
    if n % 128 or k % (128 if k_split else 64):
        raise ValueError(f"b: expected N % 128 == 0 and K % {128 if k_split else 64} == 0, got N={n}, K={k}")
    return num_experts, n


def grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    tile_expert: torch.Tensor,
    *,
    b2: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    h_out: torch.Tensor | None = None,
    b_major: str = "k",
    k_split: bool = False,
    tile_n: int | None = None,
    stages: int | None = None,
    persistent: bool | None = None,
    gather: torch.Tensor | None = None,
    gather_ranks: tuple[int, int] | None = None,
    skip_padding: torch.Tensor | None = None,
    pull: tuple | None = None,
    timeout_s: float = 10.0,
) -> torch.Tensor:
    """Expert-grouped GEMM: out[rows of tile m] = a[rows of tile m] · B[tile_expert[m]] (bf16, fp32 accumulation).

    a: [R, K] bf16, rows grouped by expert in 128-row tiles. tile_expert: [ceil(R / 128)]
    int32, the expert of each row tile, -1 to skip the tile (its output rows are left
    unwritten). b: [E, N, K] (``b_major="k"``: B = bᵀ, the forward's weights) or [E, K, N]
    (``b_major="n"``: B = b, the same weights in the backward). With ``b2`` shaped like b:
    SwiGLU, out = silu(a·B)⊙(a·B2), and ``h_out`` [R, 2N] (optional) receives the pre-activations
    [a·B | a·B2] for the backward; or, with ``k_split``, b and b2 hold the two halves of K
    (b, b2 [E, K/2, N]: out = a[:, :K/2]·b + a[:, K/2:]·b2). out: [R, N] bf16.
    Needs N % 128 == 0 and K % 64 == 0 (K % 128 with ``k_split``). ``tile_n`` overrides the
    column tile (64, 128 or 256 dividing N; default from the static shape), ``stages`` the
    shared-memory pipeline depth (default: as deep as fits), ``persistent=False`` selects the
    one-tile-per-CTA kernel (same results, bit for bit); None (default): the persistent kernel
    where the GPU has one (Hopper), else the one-tile kernel (SM100: the only one so far, and
    without ``gather``, ``skip_padding`` and ``pull``; compile-verified, never run).
    ``gather`` [R] int32 (the schedule's row_token): A is not materialised; a is the token
    matrix x [T, K] and row r of A is x[gather[r]], or zeros where gather[r] < 0 (each
    entry must be < T: the schedule guarantees it; nothing here reads it back).
    ``gather_ranks`` (world W, rank stride in elements), with ``gather``: ``a`` is rank 0's
    token matrix [T_max, K] in an expert-parallel workspace whose W ranks' matrices lie
    ``rank stride`` elements apart in one mapping; gather[r] = g names row g % T_max of rank
    g // T_max (the fc1 of mok/ep.py pulling its rows from the peers inside the GEMM).
    ``skip_padding`` [R] int32 (the schedule's row_token; the same tensor as ``gather`` when
    gathering): a 64-row half of a tile whose first row is padding (row_token < 0) is not
    multiplied; its output rows are what zero A rows give. It relies on the schedule's row
    order, where each expert's padding rows follow its rows (so such a half holds only
    padding); do not use it with padding rows placed otherwise. Persistent kernel only.
    ``pull`` (src, (world W, rank stride), row_token, counters): the kernel also FILLS ``a`` —
    row r becomes row g % T_max of rank g // T_max's token matrix (g = row_token[r] [R] int32;
    zeros where g < 0), src being rank 0's [T_max, K] matrix in an expert-parallel workspace —
    copying row tile by row tile with warps the GEMM leaves idle, each tile's loads waiting for
    its rows (at most ``timeout_s``; on expiry counters[0] is set and the output is wrong).
    counters: int32 [2 + R/128], zeroed (e.g. by the schedule launch's ``clear``). Only rows of
    tiles with tile_expert >= 0 are written. The same bits as filling ``a`` first (the dispatch).
    """
    check_tensor("a", a, dtypes=BF16, ndim=2, contiguous=True)
    num_rows, k = a.shape
    persistent = _persistent(a.device) if persistent is None else persistent
    pull_src = pull_counters = None
    if pull is not None:
        pull_src, pull_ranks, pull_tokens, pull_counters = pull
        if gather is not None or skip_padding is not None or not persistent:
            raise ValueError("pull: only with the persistent kernel, without gather or skip_padding")
        check_tensor("pull src", pull_src, dtypes=BF16, ndim=2, device=a.device, contiguous=True)
        if pull_src.shape[1] != k:
            raise ValueError(f"pull src: expected rows of a's {k} columns, got {pull_src.shape[1]}")
        _check_rank_stride("pull ranks", pull_ranks, pull_src.numel(), 2**31 - 1, "2^31 elements")
        check_tensor("pull row_token", pull_tokens, dtypes=(torch.int32,), shape=(num_rows,), device=a.device, contiguous=True)
        check_tensor("pull counters", pull_counters, dtypes=(torch.int32,), shape=(2 + -(-num_rows // 128),), device=a.device,
                     contiguous=True)
        check_timeout(timeout_s)
    if skip_padding is not None:
        if not persistent:
            raise ValueError("skip_padding: only with the persistent kernel")
        if gather is not None and skip_padding is not gather:
            raise ValueError("skip_padding: expected the gather tensor itself (the kernel reads one row_token)")
    if gather is not None:
        check_tensor("gather", gather, dtypes=(torch.int32,), ndim=1, device=a.device, contiguous=True)
        if not persistent:
            raise ValueError("gather: only with the persistent kernel")
        num_rows = gather.shape[0]
    world, rank_stride = gather_ranks if gather_ranks is not None else (pull[1] if pull is not None else (1, 0))
    if gather_ranks is not None:
        if gather is None:
            raise ValueError("gather_ranks: only with gather (the rows to pull)")
        _check_rank_stride("gather_ranks", gather_ranks, a.numel(), 2**31 - 1, "2^31 elements")
    num_experts, n = _check_weights(a, b, b2, b_major, k_split)
    if h_out is not None:
        if b2 is None or k_split:
            raise ValueError("h_out: only with the SwiGLU epilogue (b2 given, no k_split)")
        check_tensor("h_out", h_out, dtypes=BF16, shape=(num_rows, 2 * n), device=a.device, contiguous=True)
    tiles = -(-num_rows // 128)
    check_tensor("tile_expert", tile_expert, dtypes=(torch.int32,), shape=(tiles,), device=a.device, contiguous=True)
    if skip_padding is not None:
        check_tensor("skip_padding", skip_padding, dtypes=(torch.int32,), shape=(num_rows,), device=a.device, contiguous=True)
    given = out
    out = _bf16_out(out, (num_rows, n), a.device)
    _check_launchable(a=a, out=out, h_out=h_out)
    _check_weights_launchable(b=b, b2=b2)
    _check_disjoint({"out": given, "h_out": h_out}, {"a": a, "b": b, "b2": b2})
    if pull_src is not None:
        _check_cuda_aligned("pull src", pull_src)  # (its rows are copied in 16-byte vectors)
    if num_rows == 0 or a.shape[0] * world == 0:  # (gather from no tokens: every row is padding)
        return out
    if pull is not None and pull_src.shape[0] == 0:  # (no tokens anywhere to pull)
        raise ValueError("pull src: expected a token matrix with rows (T_max >= 1)")
    epilogue = "plain" if b2 is None or k_split else ("swiglu" if h_out is None else "swiglu_save")
    variant = grouped_gemm_variant(
        n, k, tile_n=tile_n, stages=stages, epilogue=epilogue, b_major=b_major, k_split=k_split, persistent=persistent,
        gather_a=gather is not None, gather_ranks=gather_ranks is not None, skip_padding=skip_padding is not None,
        pull_a=pull is not None,
    )
    row_token = gather if gather is not None else (skip_padding if pull is None else pull[2])
    rows_per_rank = a.shape[0] if pull is None else pull_src.shape[0]
    launch_grouped_gemm(
        variant, a, b, b if b2 is None else b2, out, tile_expert, h=h_out, row_token=row_token, num_rows=num_rows,
        num_experts=num_experts, num_tokens=a.shape[0] if gather is not None else 1, rows_per_rank=rows_per_rank,
        rank_stride=rank_stride, pull_src=pull_src, pull_counters=pull_counters, timeout_s=timeout_s,
    )
    return out


def grouped_gemm_mxfp8(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    b: torch.Tensor,
    b_scales: torch.Tensor,
    tile_expert: torch.Tensor,
    *,
    b2: torch.Tensor | None = None,
    b2_scales: torch.Tensor | None = None,
    k_split: bool = False,
    out: torch.Tensor | None = None,
    h_out: torch.Tensor | None = None,
    tile_n: int | None = None,
    stages: int | None = None,
) -> torch.Tensor:
    """:func:`grouped_gemm` on MXFP8 operands, SM100 only (block-scaled tcgen05 MMAs; compile-verified,
    never run: no SM100 GPU was available to this project).

    out[rows of tile m] = (a ⊙ a_scales)[rows of tile m] · (b ⊙ b_scales)[tile_expert[m]]ᵀ, fp32
    accumulation, bf16 out [R, N]. a: [R, K] float8_e4m3fn, rows grouped by expert in 128-row
    tiles; b: [E, N, K] float8_e4m3fn (K-major, the forward's weights); each with its E8M0 scales
    (a scale per 32 along K) in the MMA's order, mok.mxfp8.mma_scale_layout of what
    quantize_mxfp8 gives: a_scales uint8 [ceil(R / 128), K / 128, 512], b_scales uint8
    [E, N / 128, K / 128, 512]. With ``b2`` (and ``b2_scales``) shaped like b: SwiGLU,
    out = silu(a·B)⊙(a·B2), and ``h_out`` [R, 2N] (optional) receives [a·B | a·B2]; or, with
    ``k_split``, b and b2 [E, N, K/2] hold K's two halves (out = a[:, :K/2]·Bᵀ + a[:, K/2:]·B2ᵀ: the
    backward's dx from [dh_gate | dh_up] and the transposed gate and up weights). Needs N % 128 == 0
    and K % 128 == 0 (% 256 with k_split). tile_expert: [ceil(R / 128)] int32, -1 leaves a tile's
    rows unwritten.
    """
    check_tensor("a", a, dtypes=(torch.float8_e4m3fn,), ndim=2, contiguous=True)
    num_rows, k = a.shape
    if k_split and b2 is None:
        raise ValueError("k_split: needs b2 (and b2_scales), the weights of K's second half")
    num_experts, n = _check_mxfp8_weights("b", b, b_scales, a.device, k // 2 if k_split else k)
    if (b2 is None) != (b2_scales is None):
        raise ValueError("b2, b2_scales: expected both (SwiGLU's up projection, or K's second half) or neither")
    if b2 is not None:
        check_tensor("b2", b2, dtypes=(torch.float8_e4m3fn,), shape=tuple(b.shape), device=a.device, contiguous=True)
        check_tensor("b2_scales", b2_scales, dtypes=(torch.uint8,), shape=tuple(b_scales.shape), device=a.device, contiguous=True)
    if k % (256 if k_split else 128):
        raise ValueError(f"a: expected K % {256 if k_split else 128} == 0 with MXFP8 operands, got K={k}")
    _check_mxfp8_rows("a", a, a_scales)
    if h_out is not None:
        if b2 is None or k_split:
            raise ValueError("h_out: only with the SwiGLU epilogue (b2 given, no k_split)")
        check_tensor("h_out", h_out, dtypes=BF16, shape=(num_rows, 2 * n), device=a.device, contiguous=True)
    check_tensor("tile_expert", tile_expert, dtypes=(torch.int32,), shape=(-(-num_rows // 128),), device=a.device, contiguous=True)
    out = _bf16_out(out, (num_rows, n), a.device)
    _check_launchable(a=a, a_scales=a_scales, out=out, h_out=h_out)
    _check_weights_launchable(b=b, b_scales=b_scales, b2=b2, b2_scales=b2_scales)
    _check_mxfp8_gemm_arch("grouped_gemm_mxfp8", a.device)
    if num_rows == 0:
        return out
    epilogue = "plain" if b2 is None or k_split else ("swiglu" if h_out is None else "swiglu_save")
    variant = grouped_gemm_mxfp8_variant(n, k, epilogue, tile_n, stages, k_split=k_split)
    b2_q = (b, b_scales) if b2 is None else (b2, b2_scales)
    launch_grouped_gemm_mxfp8(variant, (a, a_scales), (b, b_scales), b2_q, out, tile_expert, h=h_out, num_experts=num_experts)
    return out


def _check_mxfp8_weights(name: str, b: torch.Tensor, scales: torch.Tensor, device: torch.device, k: int) -> tuple[int, int]:
    """MXFP8 weights [E, N, k] float8_e4m3fn (K-major, N a multiple of 128) with their scales uint8
    [E, N / 128, k / 128, 512] in the MMA's order; returns (E, N)."""
    check_tensor(name, b, dtypes=(torch.float8_e4m3fn,), ndim=3, device=device, contiguous=True)
    num_experts, n = b.shape[0], b.shape[1]
    check_tensor(name, b, shape=(num_experts, n, k))
    if n % 128 or k % 128:
        raise ValueError(f"{name}: expected N % 128 == 0 and K % 128 == 0 with MXFP8 operands, got N={n}, K={k}")
    check_tensor(f"{name}_scales", scales, dtypes=(torch.uint8,), shape=(num_experts, n // 128, k // 128, 512), device=device, contiguous=True)
    return num_experts, n


def _check_mxfp8_rows(name: str, a: torch.Tensor, scales: torch.Tensor) -> None:
    """MXFP8 rows [R, K] with their scales uint8 [ceil(R / 128), K / 128, 512] in the MMA's order."""
    rows, k = a.shape
    check_tensor(f"{name}_scales", scales, dtypes=(torch.uint8,), shape=(-(-rows // 128), k // 128, 512), device=a.device, contiguous=True)


def _check_mxfp8_gemm_arch(op: str, device: torch.device) -> None:
    """The block-scaled MMAs exist on SM100 only: refuse other GPUs before anything launches."""
    arch = _arch_of(device.index)
    if arch not in MXFP8_GEMM_ARCHS:
        raise NotImplementedError(f"{op}: needs an SM100 GPU ({', '.join(MXFP8_GEMM_ARCHS)}: block-scaled MMAs), got {arch}")


def launch_grouped_gemm_mxfp8(
    variant, a_q, b_q, b2_q, out, tile_expert, *, h=None, a_scaled=None, partial=None, row_token=None, row_slot=None, topk_w=None,
    num_experts: int, num_tokens: int = 1,
) -> None:
    """Launch a checked MXFP8 grouped-GEMM variant on (elements, scales) pairs (arguments it does not
    use may be None)."""
    kernel = _kernel(variant, a_q[0].device)
    kernel(
        _ptr("e4m3", a_q[0]), _ptr("e8m0", a_q[1]), _ptr("e4m3", b_q[0]), _ptr("e8m0", b_q[1]), _ptr("e4m3", b2_q[0]),
        _ptr("e8m0", b2_q[1]), _ptr("bf16", out), _ptr("bf16", h), _ptr("bf16", a_scaled), _ptr("f32", partial, 4),
        _ptr("i32", row_token, 4), _ptr("i32", row_slot, 4), _ptr("f32", topk_w, 4), _ptr("i32", tile_expert, 4),
        _i32(a_q[0].shape[0]), _i32(num_experts), _i32(num_tokens), _stream(a_q[0].device),
    )


def grouped_gemm_scatter(
    a: torch.Tensor,
    b: torch.Tensor,
    tile_expert: torch.Tensor,
    row_token: torch.Tensor,
    row_slot: torch.Tensor,
    slots: torch.Tensor,
    *,
    slot_ranks: tuple[int, int] | None = None,
    b2: torch.Tensor | None = None,
    b_major: str = "k",
    k_split: bool = False,
    skip_padding: bool = False,
) -> None:
    """The plain :func:`grouped_gemm` (``b``, ``b_major``, ``k_split`` with ``b2`` as there), each
    row written into the (token, slot) row of ``slots`` instead of an [R, N] output (no rows
    buffer, no copy).

    a [R, K] bf16 in the schedule's row order, b [E, N, K] (or [E, K, N] for "n"), tile_expert [ceil(R / 128)];
    row r belongs to token g = row_token[r] (-1: padding, not written) and slot j = row_slot[r]
    (int32 [R]). ``slots`` [T, k, N] bf16 receives row r at [g, j]; with ``slot_ranks`` =
    (W, rank stride in elements) it is rank 0's slots in an expert-parallel workspace, the W
    ranks' slots ``rank stride`` elements apart in one mapping, and g = p·T + t goes to rank
    p's [t, j] (mok/ep.py: the down projection pushing y, and the backward's dx GEMM pushing
    dx, to the tokens' owners). Slots no row maps to are left as they were. ``skip_padding``: 64-row
    halves of a tile that are all padding (by row_token) issue no WGMMA (see :func:`grouped_gemm`).
    """
    check_tensor("a", a, dtypes=BF16, ndim=2, contiguous=True)
    num_rows, k = a.shape
    if b2 is not None and not k_split:
        raise ValueError("b2: only with k_split (the scattering GEMM has the plain epilogue)")
    num_experts, n = _check_weights(a, b, b2, b_major, k_split)
    check_tensor("tile_expert", tile_expert, dtypes=(torch.int32,), shape=(-(-num_rows // 128),), device=a.device, contiguous=True)
    for name, t in (("row_token", row_token), ("row_slot", row_slot)):
        check_tensor(name, t, dtypes=(torch.int32,), shape=(num_rows,), device=a.device, contiguous=True)
    check_tensor("slots", slots, dtypes=BF16, ndim=3, device=a.device, contiguous=True)
    if slots.shape[2] != n:
        raise ValueError(f"slots: expected [T, k, {n}] (N of b), got {list(slots.shape)}")
    slot_ranks = slot_ranks if slot_ranks is not None else (1, slots.numel())
    _check_rank_stride("slot_ranks", slot_ranks, slots.numel(), 2**31 - 8, "2^31 - 8 elements")  # (the kernel's vector indices)
    _, rank_stride = slot_ranks
    _check_launchable(a=a, slots=slots)
    _check_weights_launchable(b=b, b2=b2)
    if num_rows == 0:
        return
    num_tokens, topk, _ = slots.shape
    variant = grouped_gemm_variant(n, k, scatter=True, topk=topk, b_major=b_major, k_split=k_split, skip_padding=skip_padding)
    launch_grouped_gemm(
        variant, a, b, b if b2 is None else b2, slots, tile_expert, row_token=row_token, row_slot=row_slot, num_rows=num_rows,
        num_experts=num_experts, rows_per_rank=num_tokens, rank_stride=rank_stride,
    )


def launch_grouped_gemm(
    variant, a, b, b2, out, tile_expert, *, h=None, a_scaled=None, partial=None, row_token=None, row_slot=None,
    topk_w=None, slot_row=None, shared_out=None, combined=None, arrivals=None, num_rows: int, num_experts: int,
    num_tokens: int = 1, rows_per_rank: int = 1, rank_stride: int = 0, pull_src=None, pull_counters=None, timeout_s: float = 10.0,
) -> None:
    """Launch a checked grouped-GEMM variant (arguments it does not use may be None; ``rows_per_rank``
    and ``rank_stride`` only with ``gather_ranks`` or ``scatter``)."""
    kernel = _kernel(variant, a.device)
    kernel(
        _ptr("bf16", a), _ptr("bf16", b), _ptr("bf16", b2), _ptr("bf16", out), _ptr("i32", tile_expert, 4),
        _ptr("bf16", h), _ptr("bf16", a_scaled), _ptr("f32", partial, 4), _ptr("i32", row_token, 4),
        _ptr("i32", row_slot, 4), _ptr("f32", topk_w, 4), _ptr("i32", slot_row, 4), _ptr("bf16", shared_out),
        _ptr("bf16", combined), _ptr("i32", arrivals, 4), _ptr("bf16", pull_src), _ptr("i32", pull_counters, 4),
        _i32(num_rows), _i32(num_experts), _i32(num_tokens), _i32(_sm_count(a.device)), _i32(rows_per_rank), _i32(rank_stride),
        _i64(int(timeout_s * 1e9)), _stream(a.device),
    )


def arrival_counters(num_tokens: int, hidden: int, device: torch.device) -> torch.Tensor:
    """The [T, H / tile] int32 counters :func:`grouped_gemm_combine` needs zeroed (pass them to
    :func:`device_schedule` as ``clear``, which zeroes them in the same launch)."""
    return torch.empty(num_tokens, _column_tiles(hidden), dtype=torch.int32, device=device)


def _column_tiles(hidden: int) -> int:
    """Column tiles of the down projection (its tile width depends on H only)."""
    return hidden // default_tile_n(hidden, 0, False)


def _check_no_slot_dropped(schedule: Schedule) -> None:
    """A down projection that combines needs every (token, slot) to have a row: the schedule's
    capacity must be the worst case for its tokens, top-k and experts, its experts every expert (not
    one rank's share) and no shared expert's rows in front (they would count an arrival too many)."""
    if schedule.world_size > 1 or schedule.shared_rows:
        what = f"an expert-parallel one (world_size={schedule.world_size})" if schedule.world_size > 1 else "one with a shared prefix"
        raise ValueError(f"schedule: expected one GPU's schedule of the routed experts alone, got {what}")
    num_tokens, topk = schedule.slot_row.shape
    worst = worst_case_capacity(num_tokens, topk, schedule.expert_counts.shape[0], schedule.block_m)
    if schedule.capacity < worst:
        raise ValueError(f"schedule: expected a capacity of at least {worst} rows (no slot dropped), got {schedule.capacity}")


def grouped_gemm_combine(
    a: torch.Tensor,
    w_down: torch.Tensor,
    schedule: Schedule,
    topk_w: torch.Tensor,
    arrivals: torch.Tensor,
    *,
    shared_out: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    y_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The down projection and the final combine in one launch: out [T, H] bf16.

    y_rows = a · w_downᵀ per expert (a [R, I] bf16 in the schedule's row order, w_down
    [E, H, I]), then out[t] = shared_out[t] + Σ_j topk_w[t, j]·y_rows[slot_row[t, j]] with the
    combine kernel's exact operations (:func:`combine`), done inside the GEMM by the CTA that
    finishes a token's last slot. ``arrivals``: from :func:`arrival_counters`, zeroed since
    (``device_schedule(..., clear=arrivals)``). ``y_rows`` [R, H] optionally receives the rows.
    The schedule must give every slot a row: one GPU's schedule (every expert local) with the
    default worst-case capacity.
    """
    check_tensor("a", a, dtypes=BF16, ndim=2, contiguous=True)
    num_rows, inter = a.shape
    check_tensor("w_down", w_down, dtypes=BF16, ndim=3, device=a.device, contiguous=True)
    num_experts, hidden = w_down.shape[:2]
    check_tensor("w_down", w_down, shape=(num_experts, hidden, inter))
    num_tokens, topk = schedule.slot_row.shape
    check_schedule("schedule", schedule, num_tokens=num_tokens, topk=topk, num_experts=num_experts, device=a.device)
    check_tensor("topk_w", topk_w, dtypes=(torch.float32,), shape=(num_tokens, topk), device=a.device, contiguous=True)
    if schedule.row_token.shape[0] != num_rows:
        raise ValueError(f"a: expected the schedule's {schedule.row_token.shape[0]} rows, got {num_rows}")
    _check_no_slot_dropped(schedule)  # a token's last slot is its k-th arrival
    check_tensor("arrivals", arrivals, dtypes=(torch.int32,), shape=(num_tokens, _column_tiles(hidden)), device=a.device, contiguous=True)
    if shared_out is not None:
        check_tensor("shared_out", shared_out, dtypes=BF16, shape=(num_tokens, hidden), device=a.device, contiguous=True)
    out = _bf16_out(out, (num_tokens, hidden), a.device)
    y_rows = _bf16_out(y_rows, (num_rows, hidden), a.device)
    if hidden % 128 or inter % 64:
        raise ValueError(f"w_down: expected H % 128 == 0 and I % 64 == 0, got H={hidden}, I={inter}")
    _check_launchable(a=a, out=out, y_rows=y_rows, shared_out=shared_out)
    _check_weights_launchable(w_down=w_down)
    if num_rows == 0 or num_tokens == 0:
        return out
    variant = grouped_gemm_variant(hidden, inter, combine=True, topk=topk, has_shared=shared_out is not None)
    launch_grouped_gemm(
        variant, a, w_down, w_down, y_rows, schedule.tile_expert, row_token=schedule.row_token, row_slot=schedule.row_slot,
        topk_w=topk_w, slot_row=schedule.slot_row, shared_out=shared_out, combined=out, arrivals=arrivals,
        num_rows=num_rows, num_experts=num_experts, num_tokens=num_tokens,
    )
    return out


MLP_TILE = 128  # the one-launch expert MLP's row tile and fc1's column tile


def expert_mlp_counters(num_tokens: int, hidden: int, num_rows: int, device: torch.device, *, shape_only: bool = False):
    """The int32 counters :func:`expert_mlp` needs zeroed for a schedule of ``num_rows`` rows: an
    error word, the next tile to take, one ready counter per row tile and one arrival counter
    per (token, column tile of the down projection). Pass them to :func:`device_schedule` as
    ``clear``, which zeroes them in its launch. (``shape_only``: just their shape.)"""
    shape = (2 + -(-num_rows // MLP_TILE) + num_tokens * _column_tiles(hidden),)
    return shape if shape_only else torch.empty(shape, dtype=torch.int32, device=device)


def expert_mlp(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    schedule: Schedule,
    counters: torch.Tensor,
    *,
    topk_w: torch.Tensor | None = None,
    h_out: torch.Tensor | None = None,
    shared_out: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    y_rows: torch.Tensor | None = None,
    timeout_s: float = 10.0,
    grid_sync: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every expert's MLP in one launch: fc1 on the gathered rows with SwiGLU, then fc2, and with
    ``topk_w`` the combine too. Returns out [T, H] (with ``topk_w``) or y_rows [R, H] bf16.

    x [T, H] bf16; w_gate, w_up [E, I, H]; w_down [E, H, I] (H, I multiples of 128); the
    ``schedule`` of this routing (its row_token gathers x; its capacity must be the worst case
    when combining: every slot needs a row); ``counters`` from :func:`expert_mlp_counters`,
    zeroed since (``device_schedule(..., clear=counters)``). The same bits as
    ``grouped_gemm(x, w_gate, ..., b2=w_up, gather=row_token)``, ``grouped_gemm(a, w_down, ...)``
    and :func:`combine` in three launches. ``h_out`` [R, 2I]: keep h for the backward;
    ``shared_out`` [T, H]: a shared expert's output, added by the combine. An fc2 tile waits for
    its rows' fc1 tiles at most ``timeout_s`` (it can only time out if work sharing the GPU keeps
    SMs from this launch); on expiry the kernel sets counters[0] to 1, counts the timeout in
    ``grid_sync[2]`` (default: :func:`grid_sync_words`, as for :func:`scheduled_expert_mlp`;
    :func:`raise_grid_timeouts` reports it) and finishes with wrong values instead of hanging.
    """
    num_rows = schedule.row_token.shape[0]
    topk = schedule.slot_row.shape[1]
    combine = topk_w is not None
    _check_expert_mlp_args(x, w_gate, w_up, w_down, num_rows, topk, topk_w, h_out, shared_out, out, timeout_s)
    num_tokens, hidden = x.shape
    check_schedule("schedule", schedule, num_tokens=num_tokens, topk=topk, num_experts=w_gate.shape[0], device=x.device, block_m=MLP_TILE)
    check_tensor("counters", counters, dtypes=(torch.int32,), device=x.device, contiguous=True)
    if grid_sync is not None:
        check_tensor("grid_sync", grid_sync, dtypes=(torch.int32,), shape=(GRID_SYNC_WORDS,), device=x.device, contiguous=True)
    want = expert_mlp_counters(num_tokens, hidden, num_rows, x.device, shape_only=True)
    if counters.shape != want:
        raise ValueError(f"counters: expected shape {want} (expert_mlp_counters), got {tuple(counters.shape)}")
    if combine:
        _check_no_slot_dropped(schedule)
        out = _bf16_out(out, (num_tokens, hidden), x.device)
    y_rows = _bf16_out(y_rows, (num_rows, hidden), x.device)
    _check_launchable(x=x, y_rows=y_rows, h_out=h_out, shared_out=shared_out, out=out)
    _check_weights_launchable(w_gate=w_gate, w_up=w_up, w_down=w_down)
    _check_32bit_rows("a (fc1's output)", num_rows, w_gate.shape[1])
    a = torch.empty(num_rows, w_gate.shape[1], dtype=torch.bfloat16, device=x.device)  # fc1's output, fc2's input
    if num_rows == 0 or num_tokens == 0:
        return out if combine else y_rows
    variant = expert_mlp_variant(hidden, w_gate.shape[1], topk, save_h=h_out is not None, combine=combine, has_shared=shared_out is not None)
    launch_expert_mlp(
        variant, x, w_gate, w_up, w_down, a, h_out, y_rows, schedule, topk_w, shared_out, out, counters, timeout_s,
        grid_sync=grid_sync_words(x.device) if grid_sync is None else grid_sync,
    )
    return out if combine else y_rows


def scheduled_expert_mlp(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    grid_sync: torch.Tensor | None = None,
    h_out: torch.Tensor | None = None,
    shared_out: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    timeout_s: float = 10.0,
    combine_phase: bool = True,
    gather_first: bool = False,
    shared_in_routed: bool = False,
) -> tuple[torch.Tensor, Schedule]:
    """The routed experts' whole forward in ONE launch: the device schedule of ``topk_idx``, then
    :func:`expert_mlp` with the combine, all CTAs waiting for all after the schedule (a grid
    barrier). Returns (out [T, H] bf16, the schedule), the same bits as
    ``device_schedule`` + ``expert_mlp(..., topk_w=topk_w)``.

    topk_idx [T, k] int32 (ids in [0, E), not checked here: :func:`mok.validation.check_moe_inputs`);
    the rest as :func:`expert_mlp`. ``grid_sync``: the barrier's GRID_SYNC_WORDS int32 words,
    zero when first used and kept across calls (the barrier leaves them ready for the next); two
    launches that may run at the same time must not share them. Default: the current stream's
    set (:func:`grid_sync_words`). A barrier that waits longer than
    ``timeout_s`` counts it in grid_sync[2] and goes on (wrong output, no hang;
    :func:`raise_grid_timeouts` reports it), leaving the words ready for the next call; an fc2
    tile whose wait for its rows timed out is counted there too. ``combine_phase`` (default): the
    combine as the launch's last phase (after a second grid barrier, as the combine launch
    computes it); False: in fc2's epilogue, as :func:`expert_mlp` does. The same bits; the phase
    was 2-6% faster on an H200 (perf/NOTES.md). ``gather_first``: after the schedule the CTAs
    gather the rows into an x_rows buffer [R, H] (transient) and meet at another grid barrier;
    fc1 then loads them by TMA instead of gathering them with cp.async (the same bits).
    ``shared_in_routed``: the weights hold E + 1 experts, the last a shared expert that runs as
    one more expert, its T rows in front of the routed ones (the schedule's shared prefix); its
    output rows y_rows[:T] are the combine's shared input (so no ``shared_out``), h_out then has
    the prefix's rows too (its h is h_out[:T]).
    """
    check_tensor("x", x, dtypes=BF16, ndim=2, contiguous=True)
    check_tensor("topk_idx", topk_idx, dtypes=(torch.int32,), ndim=2, device=x.device, contiguous=True)
    check_tensor("w_gate", w_gate, dtypes=BF16, ndim=3, device=x.device, contiguous=True)
    num_tokens, topk = topk_idx.shape
    num_experts, inter = w_gate.shape[:2]
    if shared_in_routed:
        if shared_out is not None or num_experts < 2 or not combine_phase:
            raise ValueError(
                f"shared_in_routed: expected E + 1 >= 2 experts' weights, no shared_out and combine_phase, got {num_experts} "
                f"experts, shared_out {'given' if shared_out is not None else 'None'}, combine_phase={combine_phase}"
            )
        num_experts -= 1  # (routed)
    if x.shape[0] != num_tokens:
        raise ValueError(f"topk_idx: expected one row per token of x ({x.shape[0]}), got {num_tokens}")
    check_tensor("topk_w", topk_w, dtypes=(torch.float32,), shape=(num_tokens, topk), device=x.device, contiguous=True)  # (it combines)
    prefix = shared_prefix_rows(num_tokens, MLP_TILE) if shared_in_routed else 0
    capacity = prefix + worst_case_capacity(num_tokens, topk, num_experts, MLP_TILE)
    _check_expert_mlp_args(x, w_gate, w_up, w_down, capacity, topk, topk_w, h_out, shared_out, out, timeout_s)
    if grid_sync is not None:
        check_tensor("grid_sync", grid_sync, dtypes=(torch.int32,), shape=(GRID_SYNC_WORDS,), device=x.device, contiguous=True)
    hidden = x.shape[1]
    out = _bf16_out(out, (num_tokens, hidden), x.device)
    y_rows = torch.empty(capacity, hidden, dtype=torch.bfloat16, device=x.device)
    if shared_in_routed:
        shared_out = y_rows[:num_tokens]
    _check_launchable(x=x, topk_idx=topk_idx, y_rows=y_rows, h_out=h_out, shared_out=shared_out, out=out)
    _check_weights_launchable(w_gate=w_gate, w_up=w_up, w_down=w_down)
    _check_32bit_rows("a (fc1's output)", capacity, w_gate.shape[1])
    schedule = _empty_schedule(num_tokens, topk, num_experts, capacity, MLP_TILE, x.device, prefix)
    if num_tokens == 0:  # nothing routed: no launch
        return out, _unrouted(schedule)
    if grid_sync is None:
        grid_sync = grid_sync_words(x.device)
    counters = expert_mlp_counters(num_tokens, hidden, capacity, x.device)  # zeroed by the launch itself
    a = torch.empty(capacity, inter, dtype=torch.bfloat16, device=x.device)
    variant = expert_mlp_variant(
        hidden, inter, topk, save_h=h_out is not None, combine=True, has_shared=shared_out is not None, schedule_experts=num_experts,
        combine_phase=combine_phase, gather_phase=gather_first, shared_prefix=shared_in_routed,
    )
    x_rows = torch.empty(capacity, hidden, dtype=torch.bfloat16, device=x.device) if gather_first else None
    launch_expert_mlp(
        variant, x, w_gate, w_up, w_down, a, h_out, y_rows, schedule, topk_w, shared_out, out, counters, timeout_s,
        topk_idx=topk_idx, grid_sync=grid_sync, x_rows=x_rows, num_experts=num_experts,
    )
    return out, schedule


def _check_expert_mlp_args(x, w_gate, w_up, w_down, num_rows, topk, topk_w, h_out, shared_out, out, timeout_s) -> None:
    """The checks :func:`expert_mlp` and :func:`scheduled_expert_mlp` share (``topk_w`` None: no combine)."""
    check_tensor("x", x, dtypes=BF16, ndim=2, contiguous=True)
    num_tokens, hidden = x.shape
    check_tensor("w_gate", w_gate, dtypes=BF16, ndim=3, device=x.device, contiguous=True)
    num_experts, inter = w_gate.shape[:2]
    check_tensor("w_gate", w_gate, shape=(num_experts, inter, hidden))
    check_tensor("w_up", w_up, dtypes=BF16, shape=(num_experts, inter, hidden), device=x.device, contiguous=True)
    check_tensor("w_down", w_down, dtypes=BF16, shape=(num_experts, hidden, inter), device=x.device, contiguous=True)
    if hidden % MLP_TILE or inter % MLP_TILE:
        raise ValueError(f"w_gate: expected H and I multiples of {MLP_TILE}, got H={hidden}, I={inter}")
    if topk_w is not None:
        check_tensor("topk_w", topk_w, dtypes=(torch.float32,), shape=(num_tokens, topk), device=x.device, contiguous=True)
    elif shared_out is not None or out is not None:
        raise ValueError("shared_out, out: only with topk_w (they belong to the combine)")
    if shared_out is not None:
        check_tensor("shared_out", shared_out, dtypes=BF16, shape=(num_tokens, hidden), device=x.device, contiguous=True)
    if h_out is not None:
        check_tensor("h_out", h_out, dtypes=BF16, shape=(num_rows, 2 * inter), device=x.device, contiguous=True)
    check_timeout(timeout_s)


GRID_SYNC_STREAMS = 64  # word sets per pool: a device's streams (and captured launches) take sets of their own
_GRID_SYNC_POOLS: dict[int, list[torch.Tensor]] = {}  # per device, pools of GRID_SYNC_STREAMS sets
_GRID_SYNC_TAKEN: dict[int, int] = {}  # per device, sets handed out so far
_GRID_SYNC_SET: dict[tuple[int, int], torch.Tensor] = {}  # (device, stream) -> its set (eager launches)
_GRID_SYNC_CAPTURED: list[torch.Tensor] = []  # sets made inside captures (kept: the graphs point at them)
_GRID_SYNC_LOCK = threading.Lock()


def grid_sync_words(device: torch.device) -> torch.Tensor:
    """The default grid-barrier words of :func:`scheduled_expert_mlp`: a set no launch that may run
    at the same time shares. Eager launches get their stream's set (a set of its own per stream of
    ``device``); a launch captured into a CUDA graph gets a set of its own, whatever the capture
    stream (graphs captured on one stream may be replayed at once on several). The sets come from
    pools of GRID_SYNC_STREAMS, zeroed when made, which happens outside capture only (the
    device's first use, a warm-up call as capture needs anyway, or when a stream finds every set
    taken) and waits for its zero fill once (a host sync), so a set used on another stream never
    reads the fill before it lands. A capture that finds every pooled set taken (many captured
    one-launch forwards) makes a set of its own inside the capture: its zero fill is captured too,
    so every replay starts it from zeros, before the launch that uses it."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    capturing = torch.cuda.is_current_stream_capturing()
    key = (index, torch.cuda.current_stream(index).cuda_stream)
    if not capturing:
        words = _GRID_SYNC_SET.get(key)
        if words is not None:
            return words
    with _GRID_SYNC_LOCK:
        pools = _GRID_SYNC_POOLS.setdefault(index, [])
        taken = _GRID_SYNC_TAKEN.get(index, 0)
        if taken == len(pools) * GRID_SYNC_STREAMS:
            if capturing:  # (no host sync allowed here: a set of this graph's own, zeroed by the graph itself)
                words = torch.zeros(GRID_SYNC_WORDS, dtype=torch.int32, device=torch.device("cuda", index))
                _GRID_SYNC_CAPTURED.append(words)
                return words
            shape = (GRID_SYNC_STREAMS, GRID_SYNC_WORDS)
            pools.append(torch.zeros(shape, dtype=torch.int32, device=torch.device("cuda", index)))
            torch.cuda.synchronize(index)  # (once per pool) the zeros land before any stream reads a set
        words = pools[taken // GRID_SYNC_STREAMS][taken % GRID_SYNC_STREAMS]
        _GRID_SYNC_TAKEN[index] = taken + 1
        if not capturing:
            _GRID_SYNC_SET[key] = words
    return words


def raise_grid_timeouts(grid_sync: torch.Tensor) -> None:
    """Raise if the one-launch forwards or one-launch MLPs using these words (:func:`grid_sync_words`,
    or a caller's) have timed out since their timeout count was last cleared (at a grid barrier, or
    an fc2 tile waiting for its rows): the outputs of those launches are wrong.
    Reads one int back from the GPU (a host sync): call it off the hot path, e.g. every N steps."""
    check_tensor("grid_sync", grid_sync, dtypes=(torch.int32,), shape=(GRID_SYNC_WORDS,))
    timeouts = int(grid_sync[2])
    if timeouts:
        raise RuntimeError(
            f"MoK one-launch forward: {timeouts} grid-barrier timeouts or fc2 waits that timed out (CTAs of a launch "
            "were not all resident at once, e.g. other work held SMs); those outputs are wrong. Clear with grid_sync[2] = 0."
        )


def launch_expert_mlp(
    variant, x, w_gate, w_up, w_down, a, h_out, y_rows, schedule, topk_w, shared_out, out, counters, timeout_s, *,
    topk_idx=None, grid_sync=None, ep: tuple | None = None, max_ctas: int | None = None, x_rows=None, num_experts=None,
) -> None:
    """Launch a checked expert-MLP variant (see :func:`expert_mlp`; None for what it does not use;
    ``topk_idx`` only when it builds the ``schedule`` itself; ``grid_sync``: its barrier words, or
    where a variant without barriers counts its waits' timeouts). ``ep``: the
    expert-parallel variant's (flags, x, idx and slots regions of rank 0, this rank's x and
    topk_idx, rank, T_max, and the four regions' rank strides in elements); ``max_ctas``: a CTA
    cap below the SM count (ranks emulated on one GPU must all be resident at once); ``x_rows``
    [R, H]: where a gather_phase variant gathers the rows; ``num_experts``: the routed experts when the
    weights also hold a shared expert (a shared_prefix variant), else theirs."""
    num_rows, num_tokens = schedule.row_token.shape[0], x.shape[0]
    num_experts = w_gate.shape[0] if num_experts is None else num_experts
    flags = x_pub = idx_pub = slots = x_in = idx_in = None
    rank = t_max = my_tokens = 0
    strides = (0, 0, 0, 0)
    if ep is not None:
        flags, x_pub, idx_pub, slots, x_in, idx_in, rank, t_max, strides = ep
        my_tokens = x_in.shape[0]
    _kernel(variant, x.device)(
        _ptr("bf16", x), _ptr("bf16", w_gate), _ptr("bf16", w_up), _ptr("bf16", w_down), _ptr("bf16", a), _ptr("bf16", h_out),
        _ptr("bf16", y_rows), _ptr("i32", schedule.tile_expert, 4), _ptr("i32", schedule.row_token, 4),
        _ptr("i32", schedule.row_slot, 4), _ptr("f32", topk_w, 4), _ptr("i32", schedule.slot_row, 4), _ptr("bf16", shared_out),
        _ptr("bf16", out), _ptr("i32", counters, 4), _ptr("i32", schedule.expert_offsets, 4),
        _ptr("i32", topk_idx, 4), _ptr("i32", schedule.expert_counts, 4), _ptr("i32", schedule.overflow, 4), _ptr("i32", grid_sync, 4),
        _ptr("i32", flags, 4), _ptr("bf16", x_pub), _ptr("i32", idx_pub, 4), _ptr("bf16", slots), _ptr("bf16", x_in),
        _ptr("i32", idx_in, 4), _ptr("bf16", x_rows),
        _i32(num_rows), _i32(num_experts), _i32(num_tokens), _i32(max_ctas or _sm_count(x.device)), _i64(int(timeout_s * 1e9)),
        _i32(rank), _i32(t_max), _i32(my_tokens), *(_i32(s) for s in strides), _stream(x.device),
    )


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of the device: the CTA count of a persistent kernel."""
    return _sm_count_of(device.index)


@functools.cache
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def device_schedule(
    topk_idx: torch.Tensor,
    num_experts: int,
    *,
    block_m: int = 128,
    capacity: int | None = None,
    rank: int = 0,
    world_size: int = 1,
    clear: torch.Tensor | None = None,
    shared_prefix: bool = False,
) -> Schedule:
    """:func:`mok.schedule.build_schedule` computed by one kernel launch (many CTAs), bit for bit.

    topk_idx: [N, k] int32 on the GPU (global expert ids, canonical token order). The
    overflow field is an int32 flag (non-zero: the routing needed more than ``capacity`` rows).
    ``clear``: an int32 CUDA tensor the same launch fills with zeros (the arrival counters of
    :func:`grouped_gemm_combine`). ``shared_prefix``: a shared expert's rows in front of the routed
    ones (the same launch writes them; ``capacity`` is the routed rows').
    """
    num_tokens, topk, num_local, capacity = check_schedule_args(topk_idx, num_experts, block_m, capacity, rank, world_size)
    prefix = shared_prefix_rows(num_tokens, block_m) if shared_prefix else 0
    check_tensor("topk_idx", topk_idx, dtypes=(torch.int32,), contiguous=True)
    if topk_idx.device.type != "cuda":
        raise ValueError(f"topk_idx: expected a CUDA tensor, got one on {topk_idx.device}")
    _check_32bit("topk_idx", topk_idx)
    dev = topk_idx.device
    sched = _empty_schedule(num_tokens, topk, num_local, prefix + capacity, block_m, dev, prefix, world_size)
    if clear is not None:
        check_tensor("clear", clear, dtypes=(torch.int32,), device=dev, contiguous=True)
        _check_32bit("clear", clear)
    if num_tokens:
        kernel = _kernel(schedule_variant(num_local, topk, block_m), dev)
        buffers = (topk_idx, sched.expert_counts, sched.expert_offsets, sched.row_token, sched.row_slot, sched.slot_row,
                   sched.tile_expert, sched.overflow, clear)
        kernel(
            *(_ptr("i32", t, 4) for t in buffers),
            _i32(num_tokens), _i32(rank * num_local), _i32(prefix + capacity), _i32(0 if clear is None else clear.numel()),
            _i32(schedule_ctas(num_tokens * topk, _sm_count(dev))), _i32(prefix), _stream(dev),
        )
    else:  # nothing routed: no launch
        _unrouted(sched)
        if clear is not None:
            clear.zero_()
    return sched


def _unrouted(sched: Schedule) -> Schedule:
    """``sched`` filled as the schedule of no tokens: no rows, every row unused."""
    sched.expert_counts.zero_(), sched.expert_offsets.zero_(), sched.overflow.zero_()
    sched.row_token.fill_(-1), sched.row_slot.fill_(-1), sched.tile_expert.fill_(-1)
    return sched


def _empty_schedule(
    num_tokens: int, topk: int, num_local: int, capacity: int, block_m: int, device: torch.device, shared_rows: int = 0,
    world_size: int = 1,
) -> Schedule:
    """A schedule's tensors, unwritten (a schedule launch fills them)."""
    i32 = dict(dtype=torch.int32, device=device)
    return Schedule(
        torch.empty(num_local, **i32), torch.empty(num_local + 1, **i32), torch.empty(capacity, **i32),
        torch.empty(capacity, **i32), torch.empty(num_tokens, topk, **i32), torch.empty(capacity // block_m, **i32),
        torch.empty((), **i32), block_m, capacity, shared_rows, world_size,
    )
