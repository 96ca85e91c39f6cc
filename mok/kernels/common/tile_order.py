"""The order in which the GEMMs map CTAs (or a persistent CTA's turns) to output tiles (arch-neutral)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

ROW_GROUP = 8  # row tiles per CTA group in the launch order (see grouped_tile)
PAIR = 2  # row tiles of a pair (row_tile_pair)


@cute.jit
def grouped_tile(linear: cutlass.Int32, num_row_tiles: cutlass.Int32, col_tiles: cutlass.Constexpr):
    """CTA -> (row tile, column tile), grouped for L2 reuse.

    CTAs run in groups of ROW_GROUP row tiles; inside a group the row tile varies fastest,
    then the column tile. The CTAs in flight then share a few A row tiles (read from HBM
    once, then from L2 for every column tile) and the B tiles of one or two experts,
    instead of sweeping all of A once per column tile.
    """
    group = linear // (ROW_GROUP * col_tiles)
    first_row = group * ROW_GROUP
    rows_here = cutlass.min(ROW_GROUP, num_row_tiles - first_row)  # the last group may be short
    within = linear - group * ROW_GROUP * col_tiles
    return first_row + within % rows_here, within // rows_here


@cute.jit
def row_tile_pair(linear: cutlass.Int32, num_row_tiles: cutlass.Int32, col_tiles: cutlass.Constexpr, m_tiles: cute.Tensor, rank):
    """A cluster of two CTAs on pairs of row tiles (the grouped GEMMs' ``cluster_m`` = 2): walk index
    ``linear`` -> CTA ``rank``'s (row tile 2p + rank, column tile, its expert (-1: no rows), the
    expert whose B the pair's stages hold (-1: neither tile has rows, nothing to compute), whether
    one expert has both tiles: B then loaded once for both). The pairs in grouped_tile's order over
    ceil(num_row_tiles / 2) pair rows; row tiles past the last count as empty."""
    row_pair, tile_col = grouped_tile(linear, (num_row_tiles + PAIR - 1) // PAIR, col_tiles)
    tile_row = row_pair * PAIR + rank
    other_row = row_pair * PAIR + (1 - rank)
    expert = cutlass.Int32(-1)
    if tile_row < num_row_tiles:
        expert = m_tiles[tile_row]
    other = cutlass.Int32(-1)
    if other_row < num_row_tiles:
        other = m_tiles[other_row]
    b_expert = expert
    if expert < 0:
        b_expert = other
    return tile_row, tile_col, expert, b_expert, expert == other
