"""The expert biases' share of the backward (arch-neutral: plain vector loads, warp shuffles).

    column sums   out[e, c] = Σ_r w_r·rows[r, c]  over expert e's rows r, in a fixed order
                  d b_gate | d b_up = the column sums of dh (w = 1: dh already holds the router weight);
                  d b_down = those of dout's rows, each weighted by its router weight s
    row dots      piece[r] = <rows[r], bias[e(r)]>  the down bias's piece of the router-weight gradient,
                  <dout_row, b_down[e]> (y = a·W_downᵀ + b_down, so d s = <dout, a·W_downᵀ> + <dout, b_down>),
                  written into the last column of the SwiGLU backward's pieces

Column sums: a CTA takes one expert and 256 columns (32 lanes x 8 columns, 16-byte loads); its 8
warps take the expert's rows i, i + 8, i + 16, ... (i the warp), each lane adding its columns in
fp32 in row order, and warp 0 adds the 8 partial sums in warp order. So the sum of a column is one
fixed sequence of fp32 adds that depends on the expert's rows only (the rows of an expert are in
canonical order: its tokens ascending), the same on every run and for every batch holding those
rows, like the weight gradients. Row dots: a warp per row, lane l adding columns 8·l + 256·i in
order, then a fixed butterfly over the lanes: a row's piece depends on that row only.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.memory

from .compile import compile_kernel
from .records import COLUMN_SUMS_ARGS, ROW_DOTS_ARGS
from .row_vectors import VECTOR, row_vector
from .row_weight import row_router_weight

WARPS = 8  # column sums: row groups per CTA (a warp each)
LANES = 32
TILE_M = 128  # the schedule's row tile (tile_expert is per tile)


class ColumnSumsKernel:
    """Static config: the rows' width, whether each row is weighted by its router weight (``topk``
    slots per token: the schedule's row_token / row_slot index topk_w)."""

    def __init__(self, width: int, weighted: bool = False, topk: int = 1) -> None:
        if width % VECTOR or width < VECTOR:
            raise ValueError(f"width: expected a positive multiple of {VECTOR}, got {width}")
        self.width, self.weighted, self.topk = width, weighted, topk if weighted else 1

    @cute.jit
    def __call__(
        self, rows_ptr: cute.Pointer, offsets_ptr: cute.Pointer, counts_ptr: cute.Pointer, row_token_ptr: cute.Pointer,
        row_slot_ptr: cute.Pointer, topk_w_ptr: cute.Pointer, out_ptr: cute.Pointer, num_rows: cutlass.Int32,
        num_experts: cutlass.Int32, num_tokens: cutlass.Int32, stream: cuda.CUstream,
    ):
        """rows [R, width] bf16; the schedule's expert offsets [E + 1] and counts [E] (expert e's rows:
        offsets[e] .. offsets[e] + counts[e]), row_token, row_slot [R] and topk_w [T·k] (``weighted``
        only); out [E, width] fp32."""
        m_rows = cute.make_tensor(rows_ptr, cute.make_layout((num_rows, self.width), stride=(self.width, 1)))
        m_off = cute.make_tensor(offsets_ptr, cute.make_layout((num_experts + 1,)))
        m_count = cute.make_tensor(counts_ptr, cute.make_layout((num_experts,)))
        m_token = cute.make_tensor(row_token_ptr, cute.make_layout((num_rows,)))
        m_slot = cute.make_tensor(row_slot_ptr, cute.make_layout((num_rows,)))
        m_w = cute.make_tensor(topk_w_ptr, cute.make_layout((num_tokens * self.topk,)))
        m_out = cute.make_tensor(out_ptr, cute.make_layout((num_experts, self.width), stride=(self.width, 1)))
        col_blocks = (self.width + LANES * VECTOR - 1) // (LANES * VECTOR)
        self.kernel(m_rows, m_off, m_count, m_token, m_slot, m_w, m_out, num_rows).launch(
            grid=[col_blocks, num_experts, 1], block=[WARPS * LANES, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, m_rows: cute.Tensor, m_off: cute.Tensor, m_count: cute.Tensor, m_token: cute.Tensor, m_slot: cute.Tensor,
               m_w: cute.Tensor, m_out: cute.Tensor, num_rows: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        col_block, expert, _ = cute.arch.block_idx()
        warp, lane = tidx // LANES, tidx % LANES
        chunk = col_block * LANES + lane  # this lane's 8 columns
        smem = cutlass.memory.SmemAllocator()
        s_sum = smem.allocate_tensor(cutlass.Float32, cute.make_layout((WARPS, LANES * VECTOR), stride=(LANES * VECTOR, 1)),
                                     byte_alignment=16)
        acc = cute.make_rmem_tensor_like(row_vector(m_rows, 0, 0), cutlass.Float32)
        acc.fill(0.0)
        if chunk * VECTOR < self.width:
            first = m_off[expert]
            end = first + m_count[expert]
            for row in cutlass.range(first + warp, end, WARPS, unroll=4):
                values = row_vector(m_rows, row, chunk).load().to(cutlass.Float32)
                if cutlass.const_expr(self.weighted):
                    s = row_router_weight(row, num_rows, m_token, m_slot, m_w, self.topk, False)
                    acc.store(cute.math.fma(cute.full(values.shape, s, cutlass.Float32), values, acc.load()))
                else:
                    acc.store(acc.load() + values)
        row_vector(s_sum, warp, lane).store(acc.load())
        cute.arch.sync_threads()
        if warp == 0 and chunk * VECTOR < self.width:
            total = row_vector(s_sum, 0, lane).load()
            for w in cutlass.range_constexpr(1, WARPS):
                total = total + row_vector(s_sum, w, lane).load()
            row_vector(m_out, expert, chunk).store(total)


class RowDotsKernel:
    """Static config: the rows' width and the output's row stride (the SwiGLU backward's pieces per row)."""

    def __init__(self, width: int, out_stride: int, warps: int = 4) -> None:
        if width % VECTOR or width < VECTOR:
            raise ValueError(f"width: expected a positive multiple of {VECTOR}, got {width}")
        if out_stride < 1:
            raise ValueError(f"out_stride: expected >= 1, got {out_stride}")
        self.width, self.out_stride, self.warps = width, out_stride, warps

    @cute.jit
    def __call__(
        self, rows_ptr: cute.Pointer, bias_ptr: cute.Pointer, tile_expert_ptr: cute.Pointer, row_token_ptr: cute.Pointer,
        out_ptr: cute.Pointer, num_rows: cutlass.Int32, num_experts: cutlass.Int32, stream: cuda.CUstream,
    ):
        """rows [R, width] bf16, bias [E, width] bf16, tile_expert [ceil(R / 128)], row_token [R];
        out: element r·out_stride of it is row r's piece (fp32; 0 for padding and unused rows)."""
        m_rows = cute.make_tensor(rows_ptr, cute.make_layout((num_rows, self.width), stride=(self.width, 1)))
        m_bias = cute.make_tensor(bias_ptr, cute.make_layout((num_experts, self.width), stride=(self.width, 1)))
        m_tiles = cute.make_tensor(tile_expert_ptr, cute.make_layout(((num_rows + TILE_M - 1) // TILE_M,)))
        m_token = cute.make_tensor(row_token_ptr, cute.make_layout((num_rows,)))
        m_out = cute.make_tensor(out_ptr, cute.make_layout((num_rows,), stride=(self.out_stride,)))
        self.kernel(m_rows, m_bias, m_tiles, m_token, m_out, num_rows).launch(
            grid=[(num_rows + self.warps - 1) // self.warps, 1, 1], block=[self.warps * LANES, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, m_rows: cute.Tensor, m_bias: cute.Tensor, m_tiles: cute.Tensor, m_token: cute.Tensor, m_out: cute.Tensor,
               num_rows: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        row = block * self.warps + tidx // LANES
        lane = tidx % LANES
        if row < num_rows:
            expert = m_tiles[row // TILE_M]
            total = cutlass.Float32(0.0)
            if expert >= 0 and m_token[row] >= 0:
                for chunk in cutlass.range(lane, self.width // VECTOR, LANES, unroll=2):
                    x = row_vector(m_rows, row, chunk).load().to(cutlass.Float32)
                    b = row_vector(m_bias, expert, chunk).load().to(cutlass.Float32)
                    for v in cutlass.range_constexpr(VECTOR):
                        total = cute.math.fma(x[v], b[v], total)
            for offset in cutlass.range_constexpr(5):  # (a fixed butterfly: every lane ends with the same sum)
                total = total + cute.arch.shuffle_sync_bfly(total, offset=1 << offset)
            if lane == 0:
                m_out[row] = total


def compile_column_sums(width: int, weighted: bool, topk: int, arch: str, options: str = ""):
    """Compile :class:`ColumnSumsKernel` for ``arch`` without tensors (COLUMN_SUMS_ARGS' stand-ins)."""
    return compile_kernel(ColumnSumsKernel(width, weighted, topk), COLUMN_SUMS_ARGS, arch, options)


def compile_row_dots(width: int, out_stride: int, arch: str, options: str = ""):
    """Compile :class:`RowDotsKernel` for ``arch`` without tensors (ROW_DOTS_ARGS' stand-ins)."""
    return compile_kernel(RowDotsKernel(width, out_stride), ROW_DOTS_ARGS, arch, options)
