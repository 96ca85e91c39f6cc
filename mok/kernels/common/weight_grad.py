"""What the per-expert weight-gradient GEMM is on every arch: its configuration, its launch
arguments, which output tile a CTA owns and which rows it reduces.

    out[e] (+)= A[rows of e]ᵀ · B[rows of e]        out [E, M, N], A [R, M] (row stride >= M), B [R, N]

M and N are multiples of 8 (each half's M with split_out); where the arch's kernel takes partial
tiles (``partial_tiles``: Hopper's) the last row tile of each half and the last column tile may be
partial (docs/notes/partial-tiles.md). The rows of expert e are ``offsets[e] .. offsets[e + 1]`` of the buffers the forward and the
SwiGLU backward filled (padding rows are zero in both operands, so they add nothing); given the
experts' row counts (``counted``), a tile stops at the K tile holding expert e's last row. Both
operands are read MN-major (the rows are the reduction dimension). One CTA (or MMA warpgroup)
owns one output tile of one expert and reduces that expert's rows in increasing order: no
split-K, no atomics, so the result is the same on every run and, the rows being in canonical
order, for every batch that holds the same rows. An expert with no rows gets zeros (or,
accumulating, is left as it was). ``accumulate`` adds the result into an existing fp32 tensor
(Megatron's ``main_grad``; one addition per element, by the tile's only owner); ``split_out``:
the output is two tensors [E, M/2, N] ``half_stride`` elements apart, the product's rows below
M/2 going into the first (``upper_first``: the second lies lower), dW_gate and dW_up in one
launch over all of dh.

Output tiles are taken expert by expert, inside an expert in the L2-grouped order of
:func:`mok.kernels.common.tile_order.grouped_tile`. :class:`WeightGradGemm` holds the checks, the
launch (``__call__``: :func:`mok.kernels.common.gemm_args.weight_grad_args`' arguments, every arch
and operand format alike) and the tile map; an arch's subclass (sm90/weight_grad_gemm.py,
sm100/weight_grad_gemm.py) holds the operands' layout, the mainloop and the epilogue's stores.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

from .gemm_args import expert_row_ranges, weight_grad_output
from .row_vectors import VECTOR
from .tile_order import grouped_tile

OUT_DTYPES = {"bf16": cutlass.BFloat16, "f32": cutlass.Float32}
TILE_M = 128  # rows of an output tile


class WeightGradGemm:
    """Arch-neutral base of the weight-gradient kernels (see the module docstring). A subclass
    calls :meth:`configure`, sets ``ab_stage`` and writes ``operand_tensor`` and ``launch``."""

    partial_tiles = False  # whether the arch's kernel takes M (each half's) and N its tile does not divide (else whole tiles only)

    def configure(self, m: int, n: int, out_dtype: str, accumulate: bool, a_stride: int | None, tile_n: int, tile_k: int,
                  split_out: bool, interleaved_out: bool = False) -> None:
        """Check and keep the static configuration; the tile is (128, ``tile_n``, ``tile_k``);
        ``interleaved_out`` (split_out): the halves are the even and odd rows of one [E, M, N]
        tensor (gemm_args.weight_grad_output)."""
        if interleaved_out and not split_out:
            raise ValueError("interleaved_out: only with split_out (the halves' rows interleaved)")
        if out_dtype not in OUT_DTYPES:
            raise ValueError(f"out_dtype: expected one of {sorted(OUT_DTYPES)}, got {out_dtype!r}")
        if accumulate and out_dtype != "f32":
            raise ValueError("accumulate: only into fp32 gradients")
        if tile_n not in (64, 128, 256):
            raise ValueError(f"tile_n: expected 64, 128 or 256, got {tile_n}")
        halves = 2 if split_out else 1
        if m % (halves * VECTOR) or n % VECTOR:
            raise ValueError(f"(m, n): expected multiples of ({halves * VECTOR}, {VECTOR}) (16-byte rows, each half's), got ({m}, {n})")
        if not self.partial_tiles and (m % (halves * TILE_M) or n % tile_n):
            raise ValueError(f"(m, n): this arch's kernel takes whole tiles: multiples of ({halves * TILE_M}, {tile_n}), got ({m}, {n})")
        a_stride = m if a_stride is None else a_stride
        if a_stride < m or a_stride % 8:
            raise ValueError(f"a_stride: expected a multiple of 8 that is >= m={m}, got {a_stride}")
        self.m, self.n, self.out_dtype, self.accumulate, self.a_stride = m, n, out_dtype, accumulate, a_stride
        self.split_out, self.halves, self.interleaved_out = split_out, halves, interleaved_out
        self.row_tiles = -(-m // halves // TILE_M)  # output row tiles of each half (the last one partial where 128 does not divide)
        self.mma_row_tiles = self.row_tiles  # MMA tiles along each half of M (an arch's CTA pairs take two row tiles each)
        self.col_tiles = -(-n // tile_n)
        self.tile_shape_mnk = (TILE_M, tile_n, tile_k)

    @cute.jit
    def __call__(
        self,
        a_ptr: cute.Pointer, a_scale_ptr: cute.Pointer, b_ptr: cute.Pointer, b_scale_ptr: cute.Pointer,  # (the scales: MXFP8 only)
        out_ptr: cute.Pointer, offsets_ptr: cute.Pointer, counts_ptr: cute.Pointer, counted: cutlass.Int32,
        num_rows: cutlass.Int32, num_experts: cutlass.Int32, max_ctas: cutlass.Int32,
        half_stride: cutlass.Int64, upper_first: cutlass.Int32,  # (split_out)
        stream: cuda.CUstream,
    ):
        """weight_grad_args' arguments (mok/kernels/common/gemm_args.py), in its order: A [R, M] and B
        [R, N] (bf16 or E4M3; the scale pointers are read by the MXFP8 kernel only), out, the
        experts' row offsets and counts, R, E, the CTA cap (persistent kernels), the halves'
        distance and order (split_out)."""
        m_a = self.a_operand(a_ptr, num_rows)
        m_b = self.operand_tensor(b_ptr, self.n, self.n, num_rows)
        m_c = weight_grad_output(out_ptr, self.m, self.n, num_experts, half_stride, self.split_out, self.interleaved_out)
        rows = expert_row_ranges(offsets_ptr, counts_ptr, counted, num_experts)  # where each expert's rows start and end
        self.launch(m_a, m_b, (a_scale_ptr, b_scale_ptr), m_c, upper_first, rows, num_rows, num_experts, max_ctas, stream)

    def all_tiles(self, num_experts):
        """MMA tiles of every expert's gradient (a CTA pair's 256 rows count once)."""
        return num_experts * self.halves * self.mma_row_tiles * self.col_tiles

    def tile_of(self, linear, rows, num_rows):
        """MMA tile ``linear`` -> (expert, MMA row tile (over both halves with split_out), tile column,
        first row, k tiles) (:func:`expert_tile`)."""
        return expert_tile(linear, rows, num_rows, (self.halves * self.mma_row_tiles, self.col_tiles), self.tile_shape_mnk[2])

    def out_tile(self, m_c, upper_first, expert, tile_row, tile_col):
        """Output tile of ``expert``'s gradient (:func:`out_tile`)."""
        return out_tile(m_c, upper_first, expert, tile_row, tile_col, self.row_tiles, self.tile_shape_mnk, self.split_out)

    def a_operand(self, ptr: cute.Pointer, num_rows) -> cute.Tensor:
        """A as the MMA reads it (:meth:`operand_tensor`); an arch whose kernel reads split_out's
        halves of A on their own (each bounded at M/2) overrides it."""
        return self.operand_tensor(ptr, self.m, self.a_stride, num_rows)

    def operand_tensor(self, ptr: cute.Pointer, mn: int, row_stride: int, num_rows) -> cute.Tensor:
        """An operand [R, MN] (rows ``row_stride`` elements apart) as the arch's MMA reads it, MN-major."""
        raise NotImplementedError

    def launch(self, m_a, m_b, scales, m_c, upper_first, rows, num_rows, num_experts, max_ctas, stream):
        """Host side, the arch's: from the tensors ``__call__`` built (``rows``: offsets, counts,
        counted; ``scales``: the MXFP8 scales' pointers) on."""
        raise NotImplementedError


@cute.jit
def expert_tile(linear, rows, num_rows, tiles_mn: cutlass.Constexpr, tile_k: cutlass.Constexpr):
    """Output tile ``linear`` -> (expert, tile row, tile column, first row, K tiles); ``tiles_mn``:
    an expert's output tiles (rows, both halves of split_out's; columns).

    ``rows`` = (offsets, counts, counted): expert e's rows run from offsets[e] to offsets[e + 1]
    (and R), or, when ``counted``, only to the K tile that holds row offsets[e] + counts[e] - 1."""
    m_off, m_cnt, counted = rows
    row_tiles, col_tiles = tiles_mn
    tiles_per_expert = row_tiles * col_tiles
    expert = linear // tiles_per_expert
    tile_row, tile_col = grouped_tile(linear - expert * tiles_per_expert, row_tiles, col_tiles)
    row_start = m_off[expert]
    row_end = cutlass.min(m_off[expert + 1], num_rows)
    if counted != 0:
        row_end = cutlass.min(row_end, row_start + m_cnt[expert])
    k_tiles = cutlass.Int32(0)
    if row_end > row_start:
        k_tiles = (row_end - row_start + tile_k - 1) // tile_k
    return expert, tile_row, tile_col, row_start, k_tiles


@cute.jit
def out_tile(m_c, upper_first, expert, tile_row, tile_col, rows_per_half: cutlass.Constexpr, tile_shape_mnk: cutlass.Constexpr,
             split_out: cutlass.Constexpr):
    """Output tile (tile row, tile column) of ``expert``'s gradient, (tile_m, tile_n); with
    ``split_out`` tile rows from ``rows_per_half`` on lie in M's second half, the second tensor
    (m_c's last mode: 1, or 0 when ``upper_first``)."""
    if cutlass.const_expr(split_out):
        half = tile_row // rows_per_half
        g_c = cute.local_tile(
            m_c[None, None, None, half ^ upper_first], tile_shape_mnk, (tile_row - half * rows_per_half, tile_col, None, expert),
            proj=(1, 1, None),
        )
    else:
        g_c = cute.local_tile(m_c, tile_shape_mnk, (tile_row, tile_col, None, expert), proj=(1, 1, None))
    return g_c
