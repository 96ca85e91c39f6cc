"""The order in which the GEMMs map CTAs (or a persistent CTA's turns) to output tiles (arch-neutral)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

ROW_GROUP = 8  # row tiles per CTA group in the launch order (see grouped_tile)


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
