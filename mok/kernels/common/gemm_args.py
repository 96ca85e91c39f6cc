"""Placeholder runtime arguments for compiling the GEMMs without tensors (either arch)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute


def grouped_gemm_compile_args() -> tuple:
    """The grouped GEMM's ``__call__`` arguments as compile-time stand-ins: 17 pointers (bf16,
    int32 or fp32, each as mok.ops.launch_grouped_gemm passes it), the row count R, E, T, the CTA
    cap, the rows per rank, the rank stride, the timeout and a stream."""
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    gmem = cute.AddressSpace.gmem
    bf16_ptr = lambda: make_ptr(cutlass.BFloat16, 0, gmem, assumed_align=16)  # noqa: E731
    i32_ptr = lambda: make_ptr(cutlass.Int32, 0, gmem, assumed_align=4)  # noqa: E731
    f32_ptr = lambda: make_ptr(cutlass.Float32, 0, gmem, assumed_align=4)  # noqa: E731
    return (
        bf16_ptr(), bf16_ptr(), bf16_ptr(), bf16_ptr(), i32_ptr(), bf16_ptr(), bf16_ptr(), f32_ptr(), i32_ptr(), i32_ptr(),
        f32_ptr(), i32_ptr(), bf16_ptr(), bf16_ptr(), i32_ptr(), bf16_ptr(), i32_ptr(),
        cutlass.Int32(128), cutlass.Int32(1), cutlass.Int32(1), cutlass.Int32(1), cutlass.Int32(1), cutlass.Int32(0),
        cutlass.Int64(1), make_fake_stream(),
    )


def weight_grad_compile_args(out_dtype: type) -> tuple:
    """The weight-gradient GEMM's ``__call__`` arguments as compile-time stand-ins: A, B (bf16),
    out (``out_dtype``), offsets, counts (int32), counted, R, E, the CTA cap, the halves' distance,
    upper_first and a stream."""
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    gmem = cute.AddressSpace.gmem
    bf16_ptr = lambda: make_ptr(cutlass.BFloat16, 0, gmem, assumed_align=16)  # noqa: E731
    i32_ptr = lambda: make_ptr(cutlass.Int32, 0, gmem, assumed_align=4)  # noqa: E731
    return (
        bf16_ptr(), bf16_ptr(), make_ptr(out_dtype, 0, gmem, assumed_align=16), i32_ptr(), i32_ptr(),
        cutlass.Int32(0), cutlass.Int32(128), cutlass.Int32(1), cutlass.Int32(1), cutlass.Int64(0), cutlass.Int32(0),
        make_fake_stream(),
    )


def expert_weights(ptr: cute.Pointer, n: int, k: int, num_experts, b_major: str) -> cute.Tensor:
    """One weight matrix per expert as (N, K, E): K-major [E, N, K] or N-major [E, K, N] in memory."""
    stride = (k, 1, n * k) if b_major == "k" else (1, n, n * k)
    return cute.make_tensor(ptr, cute.make_layout((n, k, num_experts), stride=stride))


def grouped_row_tensors(ptrs: tuple, num_rows, num_tokens, n: int, c_cols: int, tile_n: int, topk: int) -> tuple:
    """The grouped GEMM's row-indexed tensors from ``ptrs`` = (C, h, a_scaled, partial, row_token,
    row_slot, topk_w): C [R, c_cols], h [R, 2N], a_scaled [R, N], partial [R, N / tile_n], row_token
    and row_slot [R], topk_w [T·k] (the arguments of variants that do not use one are placeholders)."""
    c_ptr, h_ptr, a_scaled_ptr, partial_ptr, row_token_ptr, row_slot_ptr, topk_w_ptr = ptrs
    return (
        cute.make_tensor(c_ptr, cute.make_layout((num_rows, c_cols), stride=(c_cols, 1))),
        cute.make_tensor(h_ptr, cute.make_layout((num_rows, 2 * n), stride=(2 * n, 1))),
        cute.make_tensor(a_scaled_ptr, cute.make_layout((num_rows, n), stride=(n, 1))),
        cute.make_tensor(partial_ptr, cute.make_layout((num_rows, n // tile_n), stride=(n // tile_n, 1))),
        cute.make_tensor(row_token_ptr, cute.make_layout((num_rows,))),
        cute.make_tensor(row_slot_ptr, cute.make_layout((num_rows,))),
        cute.make_tensor(topk_w_ptr, cute.make_layout((num_tokens * topk,))),
    )


def weight_grad_output(out_ptr: cute.Pointer, m: int, n: int, num_experts, half_stride, split_out: bool) -> cute.Tensor:
    """The weight gradient as (M, N, E), or with ``split_out`` as (M/2, N, E, 2): two [E, M/2, N]
    tensors ``half_stride`` elements apart."""
    if split_out:
        return cute.make_tensor(out_ptr, cute.make_layout((m // 2, n, num_experts, 2), stride=(n, 1, m // 2 * n, half_stride)))
    return cute.make_tensor(out_ptr, cute.make_layout((m, n, num_experts), stride=(n, 1, m * n)))


def expert_row_ranges(offsets_ptr: cute.Pointer, counts_ptr: cute.Pointer, counted, num_experts) -> tuple:
    """(offsets [E + 1], counts [E], counted): where each expert's rows start and end (common/weight_grad_tiles.py)."""
    m_off = cute.make_tensor(offsets_ptr, cute.make_layout((num_experts + 1,)))
    return m_off, cute.make_tensor(counts_ptr, cute.make_layout((num_experts,))), counted
