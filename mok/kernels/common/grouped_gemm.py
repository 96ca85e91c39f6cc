"""What the grouped GEMM is on every arch: its configuration, its launch arguments and its epilogue math.

    C[rows of tile m, :] = epilogue(A[rows of tile m, :] · B[e(m)])

A [R, K] holds rows grouped by expert (the schedule pads each expert's rows to whole 128-row
tiles, so a tile never mixes experts); ``tile_expert[m]`` names the expert of row tile m, or -1
for an unused tile, which no CTA computes. B holds one weight matrix per expert, K-major
[E, N, K] (C = A·Bᵀ, the forward's weights) or N-major [E, K, N] (C = A·B, the same weights read
transposed in the backward); with ``k_split`` K is two halves, the first read from B and the
second from B2 (dx = dh_gate·W_gate + dh_up·W_up in one pass). N and K are multiples of 8; where
the arch's kernel takes partial tiles (``partial_tiles``: Hopper's) the tile need not divide them:
the last column and K tiles are partial, and tensors of two halves side by side (h, dh, k_split's
A) are described per half, (rows, width, halves), so that no tile crosses from one into the other
(docs/notes/partial-tiles.md).

Epilogues (static), every value rounded once from fp32 to bf16; act is the gated activation
``activation`` (SwiGLU by default; common/gated_activation.py has the others and their derivatives):
- ``plain``: C = A·B.
- ``swiglu``: two products of the same A tile, gate (B) and up (B2); C = a = act(gate, up).
- ``swiglu_save``: the same, and h = [gate | up] [R, 2N] is written too (saved for backward).
- ``swiglu_bwd``: the accumulator is dA_u = dout_row·W_down for the row's token; with the saved
  h, the row's router weight s and a = act(h_g, h_u) it writes C = dh [R, 2N] =
  [s·dA_u·∂a/∂h_g | s·dA_u·∂a/∂h_u], a_scaled [R, N] = s·a (the operand of dW_down), and
  partial[R, ceil(N / tile_n)] = Σ over the tile's columns of dA_u·a, the router-weight gradient's
  per-tile pieces (reduced in column order by another kernel).

``bias`` (the experts have biases, gpt-oss's): plain, swiglu and swiglu_save add the expert's bias
row to the accumulators before anything else (gate's from ``bias``, up's from ``bias2``: so h and
the activation see them, as the reference's x·Wᵀ + b); swiglu_bwd leaves one more column in
``partial``, the last, for the down bias's piece of the router-weight gradient, <dout_row, b_down[e]>,
which another kernel writes (mok/kernels/common/bias_grads.py). The arch's kernel must take them
(``takes_bias``: Hopper's).

:class:`GroupedGemm` holds what does not depend on the arch: the checks of the configuration, the
launch (``__call__``: :func:`mok.kernels.common.gemm_args.grouped_gemm_args`'s arguments, the same
on every arch and operand format, turned into tensors) and the epilogue's value math
(:meth:`GroupedGemm.swiglu_subtile`, :meth:`GroupedGemm.swiglu_backward_value`,
:meth:`GroupedGemm.row_scale`). An arch's subclass (sm90/grouped_gemm.py: WGMMA; sm100/grouped_gemm.py:
tcgen05) holds the mainloop, how it reads the accumulators out and stores the epilogue's values
(``launch``: the host side from these tensors on).

Determinism and batch invariance: each output tile is owned by one CTA, K is reduced in one fixed
order by the MMA sequence, the row sums in a fixed order, and the tile shape comes from static
shapes only, so a row's result depends on nothing but that row, its expert's weights (and, for
swiglu_bwd, its saved h and router weight).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

from .gemm_args import expert_weights, grouped_row_tensors
from .row_vectors import VECTOR
from .row_weight import row_router_weight
from ..constants import check_activation
from .gated_activation import glu_backward_values, glu_value

EPILOGUES = ("plain", "swiglu", "swiglu_save", "swiglu_bwd")
TILE_M = 128  # rows of an output tile (the schedule's row tile)
VECTOR_SHIFT = VECTOR.bit_length() - 1  # log2(VECTOR)
SCATTER_ELEMS = (1 << 31) - VECTOR  # the scattered rows' address space: rank 0's slots on, 32-bit vector indices


class GroupedGemm:
    """Arch-neutral base of the grouped GEMM kernels (see the module docstring). A subclass calls
    :meth:`configure`, sets ``ab_stage`` and writes ``launch``."""

    gather_a = False  # (Hopper) A is the token matrix x [T, K], its rows gathered by row_token
    partial_tiles = False  # whether the arch's kernel takes N and K that its tile does not divide (else whole tiles only)
    takes_bias = False  # whether the arch's kernel adds expert biases (see the module docstring)

    def configure(
        self, n: int, k: int, epilogue: str, b_major: str, k_split: bool, topk: int, unit_scale: bool, tile_n: int, tile_k: int,
        b_expert_stride: int | None = None, activation: str = "swiglu", bias: bool = False, b_row_stride: int | None = None,
    ) -> None:
        """Check and keep the static configuration; the tile is (128, ``tile_n``, ``tile_k``).
        ``b_expert_stride``: elements from one expert's B (and B2) to the next (None: packed);
        ``b_row_stride``: from one of its rows to the next in memory (None: packed; gemm_args.expert_weights);
        ``activation``: the gated activation of the SwiGLU epilogues (common/gated_activation.py);
        ``bias``: the experts' biases (the module docstring)."""
        check_activation(activation)
        self.activation = activation
        if epilogue not in EPILOGUES:
            raise ValueError(f"epilogue: expected one of {EPILOGUES}, got {epilogue!r}")
        if b_major not in ("k", "n"):
            raise ValueError(f"b_major: expected 'k' or 'n', got {b_major!r}")
        if tile_n not in (64, 128, 256):
            raise ValueError(f"tile_n: expected 64, 128 or 256, got {tile_n}")
        halves = 2 if k_split else 1
        if n % VECTOR or k % (halves * VECTOR):
            raise ValueError(f"(n, k): expected multiples of {VECTOR} ({halves * VECTOR} for k with k_split: 16-byte rows), got ({n}, {k})")
        if not self.partial_tiles and (n % tile_n or k % (halves * tile_k)):
            raise ValueError(f"(n, k): this arch's kernel takes whole tiles: multiples of ({tile_n}, {halves * tile_k}), got ({n}, {k})")
        if k_split and epilogue != "plain":
            raise ValueError("k_split: only with the plain epilogue")
        if bias and (k_split or not self.takes_bias):
            raise ValueError("bias: not with k_split (dx has no bias)" if k_split else "bias: this arch's kernel does not add biases yet")
        self.bias = bias
        self.n, self.k, self.epilogue_kind, self.b_major, self.k_split = n, k, epilogue, b_major, k_split
        self.topk, self.unit_scale = topk, unit_scale
        self.two_accumulators = epilogue in ("swiglu", "swiglu_save")
        self.num_b = 2 if self.two_accumulators else 1
        self.b_k = k // halves  # K extent of each B tensor
        self.col_tiles = -(-n // tile_n)  # the last one partial where tile_n does not divide N
        self.partial_cols = self.col_tiles + (1 if bias and epilogue == "swiglu_bwd" else 0)  # (swiglu_bwd: the down bias's piece last)
        self.half_k_tiles = -(-self.b_k // tile_k)  # K tiles of each half (of K with k_split), the last one partial
        self.k_tiles = halves * self.half_k_tiles
        if b_expert_stride is not None and (b_expert_stride < n * self.b_k or b_expert_stride % 8):
            raise ValueError(f"b_expert_stride: expected a multiple of 8 (16 bytes) of at least N·K = {n * self.b_k}, got {b_expert_stride}")
        rows, row_length = (n, self.b_k) if b_major == "k" else (self.b_k, n)  # B's rows in memory: N of K values, or K of N
        if b_row_stride is not None and (b_row_stride < row_length or b_row_stride % 8):
            raise ValueError(f"b_row_stride: expected a multiple of 8 (16 bytes) of at least {row_length}, got {b_row_stride}")
        if b_row_stride is not None and (b_expert_stride or n * self.b_k) < rows * b_row_stride:
            raise ValueError(f"b_expert_stride: expected at least {rows} rows of {b_row_stride}, got {b_expert_stride}")
        self.b_expert_stride, self.b_row_stride = b_expert_stride, b_row_stride
        self.tile_shape_mnk = (TILE_M, tile_n, tile_k)

    def b_tensor(self, ptr: cute.Pointer, num_experts: cutlass.Int32) -> cute.Tensor:
        """One expert's B as (N, K) per expert: K-major [E, N, K] or N-major [E, K, N] in memory."""
        return expert_weights(ptr, self.n, self.b_k, num_experts, self.b_major, self.b_expert_stride, self.b_row_stride)

    @cute.jit
    def __call__(
        self,
        a_ptr: cute.Pointer, a_scale_ptr: cute.Pointer,  # the operands (the scales: MXFP8 only)
        b_ptr: cute.Pointer, b_scale_ptr: cute.Pointer,
        b2_ptr: cute.Pointer, b2_scale_ptr: cute.Pointer,
        c_ptr: cute.Pointer, c_scale_ptr: cute.Pointer, tile_expert_ptr: cute.Pointer,  # (C's scales: E4M3 output only)
        h_ptr: cute.Pointer, a_scaled_ptr: cute.Pointer, partial_ptr: cute.Pointer,  # the epilogue's row tensors
        row_token_ptr: cute.Pointer, row_slot_ptr: cute.Pointer, topk_w_ptr: cute.Pointer,
        bias_ptr: cute.Pointer, bias2_ptr: cute.Pointer,  # the experts' biases of B's and B2's products (``bias``)
        num_rows: cutlass.Int32, num_experts: cutlass.Int32, num_tokens: cutlass.Int32, max_ctas: cutlass.Int32,
        rows_per_rank: cutlass.Int32, rank_stride: cutlass.Int32,  # (scatter)
        stream: cuda.CUstream,
    ):
        """grouped_gemm_args' arguments (mok/kernels/common/gemm_args.py), in its order: A [R, K] (with
        ``gather_a`` x [T, K]), B and B2 (bf16 or E4M3; the scale pointers are read by the kernels
        of scaled operands only), C (and its scales, read with E4M3 output only), tile_expert [ceil(R / 128)], the epilogue's row tensors, the biases [E, N]
        (``bias``), R, E, T, the CTA cap (persistent kernels), and where scattered rows go
        (``scatter``: T_max and the ranks' distance in elements)."""
        tile_m = self.tile_shape_mnk[0]
        m_a = self.a_tensor(a_ptr, num_tokens if self.gather_a else num_rows)
        m_bs = (self.b_tensor(b_ptr, num_experts), self.b_tensor(b2_ptr, num_experts))
        c_halves = 2 if self.epilogue_kind == "swiglu_bwd" else 1  # dh = [dh_gate | dh_up]
        ptrs = (c_ptr, h_ptr, a_scaled_ptr, partial_ptr, row_token_ptr, row_slot_ptr, topk_w_ptr)
        m_c, *row_args = grouped_row_tensors(ptrs, num_rows, num_tokens, self.n, c_halves, self.partial_cols, self.topk)
        num_row_tiles = (num_rows + tile_m - 1) // tile_m  # a partial last tile: TMA zero-fills, stores stop at R
        m_tiles = cute.make_tensor(tile_expert_ptr, cute.make_layout((num_row_tiles,)))
        rows = (m_tiles, num_row_tiles, num_rows)
        scales = (a_scale_ptr, b_scale_ptr, b2_scale_ptr, c_scale_ptr)
        biases = (bias_ptr, bias2_ptr)
        self.launch(m_a, m_bs, scales, m_c, tuple(row_args), rows, num_experts, max_ctas, (c_ptr, rows_per_rank, rank_stride), stream,
                    biases)

    def a_tensor(self, ptr: cute.Pointer, rows) -> cute.Tensor:
        """A [R, K] as (R, K, 1), or with k_split as (R, K/2, 2): each half's K tiles bounded at K/2
        (dh's gate and up halves when K/2 is not a multiple of the K tile)."""
        if self.k_split:
            return cute.make_tensor(ptr, cute.make_layout((rows, self.b_k, 2), stride=(self.k, 1, self.b_k)))
        return cute.make_tensor(ptr, cute.make_layout((rows, self.k, 1), stride=(self.k, 1, rows * self.k)))

    def scatter_target(self, scatter_to) -> tuple:
        """``scatter``: where rows go, from ``launch``'s ``scatter_to`` = (C's pointer: rank 0's slots,
        T_max, the rank stride): (the slots as 16-byte vectors, T_max, the rank stride)."""
        c_ptr, rows_per_rank, rank_stride = scatter_to
        return cute.zipped_divide(cute.make_tensor(c_ptr, cute.make_layout((SCATTER_ELEMS,))), (VECTOR,)), rows_per_rank, rank_stride

    @cute.jit
    def slot_vector(self, row, num_rows, m_row_token, m_row_slot, m_dst):
        """``scatter``: the vector index (16 bytes, rank 0's slots on) of column 0 of buffer row
        ``row``'s slot: row (g % T_max)·topk + j of rank g // T_max's slots for its (token g, slot j);
        -1 for a padding row or one past R (nothing is written for those). Every slot lies within
        2^31 elements (the op checks it)."""
        _, rows_per_rank, rank_stride = m_dst
        vector = cutlass.Int32(-1)
        if row < num_rows:
            g = m_row_token[row]
            if g >= 0:
                dest = (g // rows_per_rank) * rank_stride + ((g % rows_per_rank) * self.topk + m_row_slot[row]) * self.n
                vector = dest >> VECTOR_SHIFT  # (dest >= 0 and a multiple of VECTOR: a shift, no signed division's fix-up)
        return vector

    def row_scale(self, row, num_rows, m_row_token, m_row_slot, m_topk_w):
        """Router weight of a buffer row (mok/kernels/common/row_weight.py)."""
        return row_router_weight(row, num_rows, m_row_token, m_row_slot, m_topk_w, self.topk, self.unit_scale)

    @cute.jit
    def swiglu_subtile(self, r_gate, r_up, r_act):
        """swiglu, swiglu_save: a = act(gate, up) of a subtile's values, value by value (no branch)."""
        for v in cutlass.range_constexpr(cute.size(r_act)):
            r_act[v] = glu_value(self.activation, r_gate[v], r_up[v])

    @cute.jit
    def swiglu_backward_value(self, d_a, h_g, h_u, first, scales, sums):
        """swiglu_bwd, one value: from dA_u (``d_a``, not yet scaled) and the saved h_gate, h_up of
        its row, (d h_gate, d h_up, s·a) and the row sums (Σ dA_u·a in column order) with this
        value added. A thread's values lie in one of two rows (``first``: the first; a Python
        bool where the thread has one row), each with its router weight (``scales``) and its sum
        (``sums``): returns (d h_gate, d h_up, s·a, sum of the first, sum of the second)."""
        sum_first, sum_second = sums
        s = scales[1]
        if first:
            s = scales[0]
        d_gate, d_up, a_scaled, a_val = glu_backward_values(self.activation, d_a, s, h_g, h_u)
        if first:
            sum_first = cute.math.fma(d_a, a_val, sum_first)
        else:
            sum_second = cute.math.fma(d_a, a_val, sum_second)
        return d_gate, d_up, a_scaled, sum_first, sum_second

    def launch(self, m_a, m_bs, scales, m_c, row_args, rows, num_experts, max_ctas, scatter_to, stream, biases):
        """Host side, the arch's: from the tensors ``__call__`` built (``row_args`` = h, a_scaled,
        partial, row_token, row_slot, topk_w; ``rows`` = tile_expert, its row tiles, R; ``scales``
        the scales' pointers of A, B, B2 and C (C's: E4M3 output only); ``scatter_to`` = C's pointer,
        T_max, the rank stride; ``biases`` the pointers of B's and B2's biases, read with ``bias``
        only) on."""
        raise NotImplementedError
