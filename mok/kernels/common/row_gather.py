"""A's rows gathered from the token matrix into shared memory by cp.async (arch-neutral: Hopper's
producer warpgroup and SM100's gather warps run it, 128 threads either way).

Row r of the tile is x[row_token[r]], or zeros where row_token[r] < 0 (a padding row) or r lies
past the buffer. Thread t copies 16-byte chunk t % 8 of rows t // 8 + 16·i (i < 8) of every K
tile, so a warp reads four whole 128-byte row segments at a time (a K tile is 128 bytes a row:
64 bf16 or 128 E4M3). The destination follows the stage's 128-byte swizzle, the same on both
arches (K-major, Swizzle<3,4,3>, rows 128 bytes apart): chunk c of row r sits at byte
r·128 + ((c ^ (r % 8))·16). The gather is bound by how fast these threads issue
(docs/notes/gather-in-gemm.md), so each row's source address and whether it is read are worked
out once a tile (:func:`gathered_rows`): a stage then costs a 64-bit add and a cp.async per row
(:func:`gather_stage`).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute


GATHER_THREADS = 128  # threads that gather a tile's rows
CHUNKS = 8  # 16-byte chunks of a row's 128 bytes in one K tile
ROWS_PER_PASS = GATHER_THREADS // CHUNKS  # rows the threads copy at once


def swizzled_128b(row, chunk, chunk_elems: int, row_elems: int):
    """Where 16-byte chunk ``chunk`` of row ``row`` lies in a stage of 128-byte rows with the
    128-byte swizzle (Swizzle<3,4,3>: byte r·128 + (c ^ r % 8)·16), in elements of
    ``chunk_elems`` a chunk and ``row_elems`` a row (every writer of such a stage by hand)."""
    return row * row_elems + (chunk ^ (row % 8)) * chunk_elems


@cute.jit
def gathered_rows(m_x: cute.Tensor, m_row_token: cute.Tensor, tile_row, num_rows, tidx, tile_m: cutlass.Constexpr,
                  k: cutlass.Constexpr, per_chunk: cutlass.Constexpr):
    """Thread ``tidx`` (0..127)'s rows of row tile ``tile_row``: (the address of its chunk of each
    in K tile 0, as 64-bit integers; a bit mask of the rows that are read, bit i for row
    row0 + 16·i). ``per_chunk``: elements in 16 bytes; ``k``: x's row length."""
    passes = tile_m // ROWS_PER_PASS
    chunk = tidx % CHUNKS
    row0 = tidx // CHUNKS
    x_base = m_x.iterator
    addresses = cute.make_rmem_tensor(cute.make_layout(passes), cutlass.Int64)  # row i's chunk in K tile 0
    rows_read = cutlass.Uint32(0)  # bit i: row i is read (else padding: zero-filled)
    for i in cutlass.range_constexpr(passes):
        row = tile_row * tile_m + row0 + ROWS_PER_PASS * i
        token = cutlass.Int32(-1)
        if row < num_rows:
            token = m_row_token[row]
        element = cutlass.Int64(0)
        if token >= 0:
            element = cutlass.Int64(token) * k
        addresses[i] = (x_base + (element + chunk * per_chunk)).toint()
        rows_read = rows_read | (cutlass.Uint32(token >= 0) << i)
    return addresses, rows_read


@cute.jit
def gather_stage(a_base, stage, addresses, rows_read, k_tile, dtype: cutlass.Constexpr, tidx, tile_m: cutlass.Constexpr,
                 tile_k: cutlass.Constexpr, k: cutlass.Constexpr):
    """Thread ``tidx``'s cp.async of K tile ``k_tile`` of its rows (:func:`gathered_rows`) into
    stage ``stage`` of the A stages at ``a_base`` (a shared-memory pointer of ``dtype``); chunks of
    padding rows, and past K in its partial last tile, copy 0 bytes (zero-filled)."""
    element_bytes = dtype.width // 8
    per_chunk = 16 // element_bytes  # elements in a 16-byte chunk
    chunk = tidx % CHUNKS
    row0 = tidx // CHUNKS
    dst0 = swizzled_128b(row0, chunk, per_chunk, tile_k)  # the same swizzle for rows row0 + 16·i
    column_bytes = cutlass.Int64(k_tile * tile_k * element_bytes)
    dst = a_base + (stage * (tile_m * tile_k) + dst0)
    chunk_bytes = cutlass.Int32(16)
    if cutlass.const_expr(k % tile_k):  # K's partial last tile: chunks past K zero-filled, like padding rows
        chunk_bytes = cutlass.Int32(k_tile * tile_k + chunk * per_chunk < k) * 16
    for i in cutlass.range_constexpr(tile_m // ROWS_PER_PASS):
        src = cute.make_ptr(dtype, addresses[i] + column_bytes, cute.AddressSpace.gmem, assumed_align=16)
        copy_async_16b(dst + i * ROWS_PER_PASS * tile_k, src, cutlass.Int32((rows_read >> i) & 1) * chunk_bytes)


@cute.jit
def copy_async_4b(dst: cute.Pointer, src: cute.Pointer, nbytes) -> None:
    """cp.async of 4 bytes global -> shared (``nbytes`` 4, or 0: zero-filled): a gathered row's scale."""
    from cutlass.experimental import primitives

    primitives.cp_async_shared_global(dst, src, 4, "ca", cp_size=nbytes)


@cute.jit
def copy_async_16b(dst: cute.Pointer, src: cute.Pointer, nbytes) -> None:
    """cp.async of 16 bytes global -> shared, ``nbytes`` (16, or 0: no source read) of them from
    ``src``, the rest zero-filled.

    (CuTe DSL's experimental NVVM wrapper is the one that exposes cp.async's source size.)
    """
    from cutlass.experimental import primitives

    primitives.cp_async_shared_global(dst, src, 16, "cg", cp_size=nbytes)
