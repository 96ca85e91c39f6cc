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
