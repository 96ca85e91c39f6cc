"""Final combine: out[t] = shared[t] + Σ_j topk_w[t, j]·y[t, j], fp32 accumulation, bf16 out.

Arch-neutral (plain vectorised global loads and stores; the same source builds for
sm_90a and sm_100a). One CTA row of ``threads`` threads covers ``threads·8`` columns of
one token; each thread owns 8 consecutive bf16 columns (16-byte loads and stores).

Two layouts of y (static ``gathered``): dense, y [T, k, H] with y[t, j] in slot (t, j); or
gathered, the expert-grouped rows y_rows [R, H] and slot_row [T, k] with
y[t, j] = y_rows[slot_row[t, j]], where a negative slot_row contributes nothing (the
schedule gives no row to a pair that did not fit; it is reported there, not read here).

Operation order, fixed and documented because tests hold the kernel to it bitwise:
acc = float(shared[t, c]), or +0.0 without a shared expert; then for j = 0, 1, ..., k-1:
acc = fma(topk_w[t, j], float(y[t, j, c]), acc), each an fp32 fused multiply-add with a
single round-to-nearest-even; out[t, c] = bf16(acc), round to nearest even.
``mok.reference.combine_reference`` computes exactly this. With ``unit_weights`` (the
backward's dx = Σ_j dx_slot) every weight is 1.0 and none is read; fma(1, y, acc) is the
single-rounding add, so the result equals the weighted kernel's with a tensor of ones.
``CombineRouterGradKernel`` is that backward combine with the router-weight gradient of
mok.kernels.common.router_grad in the same launch (the first column block's first k threads
of each token add its pairs' pieces).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

from .compile import compile_kernel
from .records import COMBINE_ARGS, COMBINE_ROUTER_GRAD_ARGS
from .router_grad import pair_router_grad
from .row_vectors import VECTOR, row_vector, thread_vector, vector_grid

# the launches' arguments (the CUDA stream follows): CombineKernel's, CombineRouterGradKernel's


class CombineKernel:
    """Static config: hidden size, top-k, shared-expert row or not, dense or gathered y."""

    def __init__(
        self, hidden: int, topk: int, has_shared: bool, gathered: bool = False, unit_weights: bool = False, threads: int = 128
    ) -> None:
        if hidden % VECTOR:
            raise ValueError(f"hidden: expected a multiple of {VECTOR}, got {hidden}")
        self.hidden, self.topk, self.has_shared, self.gathered = hidden, topk, has_shared, gathered
        self.unit_weights, self.threads = unit_weights, threads

    @cute.jit
    def __call__(
        self, y_ptr: cute.Pointer, slot_ptr: cute.Pointer, w_ptr: cute.Pointer, shared_ptr: cute.Pointer, out_ptr: cute.Pointer,
        num_tokens: cutlass.Int32, num_rows: cutlass.Int32, stream: cuda.CUstream,
    ):
        """y: [T, k, H] (dense) or [R, H] rows (gathered) bf16; slot_row [T, k] int32 (gathered only);
        topk_w [T, k] fp32; shared [T, H] bf16 (read only with has_shared); out [T, H] bf16."""
        k, h = self.topk, self.hidden
        if cutlass.const_expr(self.gathered):
            m_y = cute.make_tensor(y_ptr, cute.make_layout((num_rows, h), stride=(h, 1)))
        else:
            m_y = cute.make_tensor(y_ptr, cute.make_layout((num_tokens * k, h), stride=(h, 1)))
        m_slot = cute.make_tensor(slot_ptr, cute.make_layout((num_tokens, k), stride=(k, 1)))
        m_w = cute.make_tensor(w_ptr, cute.make_layout((num_tokens, k), stride=(k, 1)))
        m_shared = cute.make_tensor(shared_ptr, cute.make_layout((num_tokens, h), stride=(h, 1)))
        m_out = cute.make_tensor(out_ptr, cute.make_layout((num_tokens, h), stride=(h, 1)))
        self.kernel(m_y, m_slot, m_w, m_shared, m_out).launch(
            grid=vector_grid(num_tokens, h, self.threads), block=[self.threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, m_y: cute.Tensor, m_slot: cute.Tensor, m_w: cute.Tensor, m_shared: cute.Tensor, m_out: cute.Tensor):
        chunk, token, _ = thread_vector(self.threads)  # which 8-column vector of which token's row
        if chunk * VECTOR < self.hidden:
            combine_vector(
                m_y, m_slot, m_w, m_shared, m_out, token, chunk, self.topk, self.has_shared, self.unit_weights, self.gathered
            )


class CombineRouterGradKernel(CombineKernel):
    """dx[t] = shared[t] + Σ_j dx_rows[slot_row[t, j]] (unit weights, gathered rows) and
    d_topk_w[t, j] = Σ_c partial[slot_row[t, j], c] in one launch. Static: hidden, top-k, shared or
    not, the number of router pieces per row."""

    def __init__(self, hidden: int, topk: int, has_shared: bool, parts: int, threads: int = 128) -> None:
        super().__init__(hidden, topk, has_shared, gathered=True, unit_weights=True, threads=threads)
        if parts < 1 or topk > threads:
            raise ValueError(f"(parts, topk): expected parts >= 1 and topk <= {threads}, got ({parts}, {topk})")
        self.parts = parts

    @cute.jit
    def __call__(
        self, y_ptr: cute.Pointer, slot_ptr: cute.Pointer, partial_ptr: cute.Pointer, shared_ptr: cute.Pointer, out_ptr: cute.Pointer,
        d_w_ptr: cute.Pointer, num_tokens: cutlass.Int32, num_rows: cutlass.Int32, stream: cuda.CUstream,
    ):
        """y [R, H] bf16 rows, slot_row [T, k] int32, partial [R, parts] fp32, shared [T, H] bf16 (read
        only with has_shared), out [T, H] bf16, d_w [T, k] fp32."""
        k, h = self.topk, self.hidden
        m_y = cute.make_tensor(y_ptr, cute.make_layout((num_rows, h), stride=(h, 1)))
        m_slot = cute.make_tensor(slot_ptr, cute.make_layout((num_tokens, k), stride=(k, 1)))
        m_part = cute.make_tensor(partial_ptr, cute.make_layout((num_rows, self.parts), stride=(self.parts, 1)))
        m_shared = cute.make_tensor(shared_ptr, cute.make_layout((num_tokens, h), stride=(h, 1)))
        m_out = cute.make_tensor(out_ptr, cute.make_layout((num_tokens, h), stride=(h, 1)))
        m_d_w = cute.make_tensor(d_w_ptr, cute.make_layout((num_tokens, k), stride=(k, 1)))
        self.kernel_router(m_y, m_slot, m_part, m_shared, m_out, m_d_w).launch(
            grid=vector_grid(num_tokens, h, self.threads), block=[self.threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel_router(
        self, m_y: cute.Tensor, m_slot: cute.Tensor, m_part: cute.Tensor, m_shared: cute.Tensor, m_out: cute.Tensor, m_d_w: cute.Tensor
    ):
        tidx, _, _ = cute.arch.thread_idx()
        token, col_block, _ = cute.arch.block_idx()
        chunk = col_block * self.threads + tidx  # (the router pieces: threads < k of column block 0)
        if chunk * VECTOR < self.hidden:
            # (unit weights: the weights' tensor is not read; slot_row stands in for it)
            combine_vector(m_y, m_slot, m_slot, m_shared, m_out, token, chunk, self.topk, self.has_shared, True, True)
        if col_block == 0 and tidx < self.topk:
            m_d_w[token, tidx] = pair_router_grad(m_part, m_slot[token, tidx], self.parts)


@cute.jit
def combine_vector(
    m_y: cute.Tensor, m_slot: cute.Tensor, m_w: cute.Tensor, m_shared: cute.Tensor, m_out: cute.Tensor,
    token, chunk, topk: cutlass.Constexpr, has_shared: cutlass.Constexpr, unit_weights: cutlass.Constexpr = False,
    gathered: cutlass.Constexpr = True,
) -> None:
    """out[token, 8·chunk : 8·chunk + 8] from y's rows: slot_row[token, j] (gathered) or token·k + j
    (dense), in the order the module docstring fixes (also run by the grouped GEMM that combines
    as it goes)."""
    out_vec = row_vector(m_out, token, chunk)
    # All k rows are loaded before the first FMA (a slot without a row reads row 0 and adds
    # nothing), so the loads overlap instead of waiting on each other.
    rows = []
    weights = []
    y_vecs = []
    for j in cutlass.range_constexpr(topk):
        rows.append(m_slot[token, j] if gathered else token * topk + j)
        weights.append(cutlass.Float32(1.0) if unit_weights else m_w[token, j])
    for j in cutlass.range_constexpr(topk):
        y_vecs.append(row_vector(m_y, cutlass.max(rows[j], 0), chunk).load())
    acc = cute.full(out_vec.shape, 0.0, cutlass.Float32)
    if cutlass.const_expr(has_shared):
        acc = row_vector(m_shared, token, chunk).load().to(cutlass.Float32)
    for j in cutlass.range_constexpr(topk):
        if cutlass.const_expr(gathered):
            if rows[j] >= 0:
                acc = cute.math.fma(cute.full(out_vec.shape, weights[j], cutlass.Float32), y_vecs[j].to(cutlass.Float32), acc)
        else:
            acc = cute.math.fma(cute.full(out_vec.shape, weights[j], cutlass.Float32), y_vecs[j].to(cutlass.Float32), acc)
    out_vec.store(acc.to(m_out.element_type))


def compile_combine(
    hidden: int, topk: int, has_shared: bool, gathered: bool, arch: str, options: str = "", unit_weights: bool = False,
    router_parts: int = 0,
):
    """Compile for ``arch`` without tensors: pointers and the token/row counts are runtime arguments
    (``router_parts`` > 0: CombineRouterGradKernel, gathered with unit weights)."""
    if router_parts:
        return compile_kernel(CombineRouterGradKernel(hidden, topk, has_shared, router_parts), COMBINE_ROUTER_GRAD_ARGS, arch, options)
    return compile_kernel(CombineKernel(hidden, topk, has_shared, gathered, unit_weights), COMBINE_ARGS, arch, options)
