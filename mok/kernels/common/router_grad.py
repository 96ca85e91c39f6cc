"""Router-weight gradient from the SwiGLU backward's per-tile pieces.

    d_topk_w[t, j] = Σ_c partial[slot_row[t, j], c]      (c = 0, 1, ..., parts - 1 in order)

The SwiGLU-backward epilogue of the down-projection backward writes, for each buffer row and
column tile c, the sum over that tile of dA_u ⊙ a (DESIGN.md: d_topk_w = rowsum(dA_u ⊙ a),
the unscaled product, so a router weight of 0 still gets its gradient). This kernel adds a
row's pieces in column order with fp32 adds, so the result is the same on every run and
for every batch; a pair with no row (slot_row < 0) gets 0. One thread per (t, j).
Arch-neutral.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

from .compile import compile_kernel
from .records import ROUTER_GRAD_ARGS


class RouterGradKernel:
    """Static config: top-k and the number of column pieces per row."""

    def __init__(self, topk: int, parts: int, threads: int = 128) -> None:
        if topk < 1 or parts < 1:
            raise ValueError(f"(topk, parts): expected positive, got ({topk}, {parts})")
        self.topk, self.parts, self.threads = topk, parts, threads

    @cute.jit
    def __call__(
        self, partial_ptr: cute.Pointer, slot_row_ptr: cute.Pointer, out_ptr: cute.Pointer, num_tokens: cutlass.Int32,
        num_rows: cutlass.Int32, stream: cuda.CUstream,
    ):
        """partial [R, parts] fp32, slot_row [T, k] int32, out [T, k] fp32."""
        pairs = num_tokens * self.topk
        m_part = cute.make_tensor(partial_ptr, cute.make_layout((num_rows, self.parts), stride=(self.parts, 1)))
        m_slot = cute.make_tensor(slot_row_ptr, cute.make_layout((pairs,)))
        m_out = cute.make_tensor(out_ptr, cute.make_layout((pairs,)))
        self.kernel(m_part, m_slot, m_out, pairs).launch(
            grid=[(pairs + self.threads - 1) // self.threads, 1, 1], block=[self.threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, m_part: cute.Tensor, m_slot: cute.Tensor, m_out: cute.Tensor, pairs: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        block, _, _ = cute.arch.block_idx()
        pair = block * self.threads + tidx
        if pair < pairs:
            m_out[pair] = pair_router_grad(m_part, m_slot[pair], self.parts)


@cute.jit
def pair_router_grad(m_part: cute.Tensor, row, parts: cutlass.Constexpr) -> cutlass.Float32:
    """One pair's d_topk_w: Σ_c partial[row, c], c in order (fp32 adds), or 0 for row < 0 (no row)."""
    total = cutlass.Float32(0.0)
    if row >= 0:
        for c in cutlass.range_constexpr(parts):
            total = total + m_part[row, c]
    return total


def compile_router_grad(topk: int, parts: int, arch: str, options: str = ""):
    """Compile for ``arch`` without tensors (ROUTER_GRAD_ARGS' stand-ins)."""
    return compile_kernel(RouterGradKernel(topk, parts), ROUTER_GRAD_ARGS, arch, options)
