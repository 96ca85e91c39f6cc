"""Which output tile a weight-gradient CTA owns and which rows it reduces (arch-neutral).

    out[e] (+)= A[rows of e]ᵀ · B[rows of e]        out [E, M, N] (or two [E, M/2, N] with split_out)

Output tiles are taken expert by expert, inside an expert in the L2-grouped order of
:func:`mok.kernels.common.tile_order.grouped_tile`.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from .tile_order import grouped_tile


@cute.jit
def expert_tile(linear, rows, num_rows, m: cutlass.Constexpr, n: cutlass.Constexpr, tile_shape_mnk: cutlass.Constexpr):
    """Output tile ``linear`` -> (expert, tile row, tile column, first row, K tiles).

    ``rows`` = (offsets, counts, counted): expert e's rows run from offsets[e] to offsets[e + 1]
    (and R), or, when ``counted``, only to the K tile that holds row offsets[e] + counts[e] - 1."""
    m_off, m_cnt, counted = rows
    tile_m, tile_n, tile_k = tile_shape_mnk
    tiles_per_expert = (m // tile_m) * (n // tile_n)
    expert = linear // tiles_per_expert
    tile_row, tile_col = grouped_tile(linear - expert * tiles_per_expert, m // tile_m, n // tile_n)
    row_start = m_off[expert]
    row_end = cutlass.min(m_off[expert + 1], num_rows)
    if counted != 0:
        row_end = cutlass.min(row_end, row_start + m_cnt[expert])
    k_tiles = cutlass.Int32(0)
    if row_end > row_start:
        k_tiles = (row_end - row_start + tile_k - 1) // tile_k
    return expert, tile_row, tile_col, row_start, k_tiles


@cute.jit
def out_tile(m_c, upper_first, expert, tile_row, tile_col, m: cutlass.Constexpr, tile_shape_mnk: cutlass.Constexpr,
             split_out: cutlass.Constexpr):
    """Output tile (tile row, tile column) of ``expert``'s gradient, (tile_m, tile_n); with
    ``split_out`` a tile row in M's second half lies in the second tensor (m_c's last mode: 1, or 0
    when ``upper_first``)."""
    if cutlass.const_expr(split_out):
        rows_per_half = m // 2 // tile_shape_mnk[0]
        half = tile_row // rows_per_half
        g_c = cute.local_tile(
            m_c[None, None, None, half ^ upper_first], tile_shape_mnk, (tile_row - half * rows_per_half, tile_col, None, expert),
            proj=(1, 1, None),
        )
    else:
        g_c = cute.local_tile(m_c, tile_shape_mnk, (tile_row, tile_col, None, expert), proj=(1, 1, None))
    return g_c
