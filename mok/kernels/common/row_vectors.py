"""Kernels that move bf16 rows in 16-byte vectors, one vector of a row per thread (arch-neutral: the
combine, the row gathers, the EP push). A CTA of ``threads`` threads covers threads·VECTOR
columns of its rows: grid x names the rows (a row, or a block of them), grid y the column block,
grid z which of several tensors."""

from __future__ import annotations

import cutlass.cute as cute

VECTOR = 8  # bf16 elements per 16-byte access


def vector_grid(rows, width: int, threads: int, depth: int = 1) -> list:
    """The launch grid: ``rows`` along x, the column blocks of a ``width``-wide row along y, ``depth`` along z."""
    cols = threads * VECTOR
    return [rows, (width + cols - 1) // cols, depth]


def row_vector(m: cute.Tensor, row, chunk, width: int = VECTOR) -> cute.Tensor:
    """Columns width·chunk .. width·chunk + width - 1 of row ``row`` of a row-major matrix (a
    16-byte vector of bf16 by default)."""
    return cute.zipped_divide(m[row, None], (width,))[None, chunk]


def thread_vector(threads: int) -> tuple:
    """In a kernel: this thread's vector of the row (column block · ``threads`` + thread; VECTOR
    columns each), and its CTA's grid x and z."""
    tidx, _, _ = cute.arch.thread_idx()
    x, col_block, z = cute.arch.block_idx()
    return col_block * threads + tidx, x, z
