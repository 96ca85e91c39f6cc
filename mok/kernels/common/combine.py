"""Final combine: out[t] = shared[t] + Σ_j topk_w[t, j]·y[t, j], fp32 accumulation, bf16 out.

Arch-neutral (plain vectorised global loads and stores; the same source builds for
sm_90a and sm_100a). One CTA row of ``threads`` threads covers ``threads·8`` columns of
one token; each thread owns 8 consecutive bf16 columns (16-byte loads and stores).

Operation order, fixed and documented because tests hold the kernel to it bitwise:
with a shared expert acc = fma(topk_w[t, 0], float(y[t, 0, c]), float(shared[t, c])), without
one acc = topk_w[t, 0]·float(y[t, 0, c]) (an fp32 multiply); then for j = 1, ..., k-1:
acc = fma(topk_w[t, j], float(y[t, j, c]), acc), each an fp32 fused multiply-add with a
single round-to-nearest-even; out[t, c] = bf16(acc), round to nearest even.
``mok.reference.combine_reference`` computes exactly this.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

VECTOR = 8  # bf16 elements per 16-byte access


class CombineKernel:
    """Static config: hidden size, top-k, whether a shared-expert row is added."""

    def __init__(self, hidden: int, topk: int, has_shared: bool, threads: int = 128) -> None:
        if hidden % VECTOR:
            raise ValueError(f"hidden: expected a multiple of {VECTOR}, got {hidden}")
        self.hidden = hidden
        self.topk = topk
        self.has_shared = has_shared
        self.threads = threads
        self.cols_per_cta = threads * VECTOR

    @cute.jit
    def __call__(
        self,
        y_ptr: cute.Pointer,
        w_ptr: cute.Pointer,
        shared_ptr: cute.Pointer,
        out_ptr: cute.Pointer,
        num_tokens: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        """y [T, k, H] bf16, topk_w [T, k] fp32, shared [T, H] bf16 (ignored unless has_shared), out [T, H] bf16."""
        k, h = self.topk, self.hidden
        m_y = cute.make_tensor(y_ptr, cute.make_layout((num_tokens, k, h), stride=(k * h, h, 1)))
        m_w = cute.make_tensor(w_ptr, cute.make_layout((num_tokens, k), stride=(k, 1)))
        m_shared = cute.make_tensor(shared_ptr, cute.make_layout((num_tokens, h), stride=(h, 1)))
        m_out = cute.make_tensor(out_ptr, cute.make_layout((num_tokens, h), stride=(h, 1)))
        self.kernel(m_y, m_w, m_shared, m_out).launch(
            grid=[num_tokens, (h + self.cols_per_cta - 1) // self.cols_per_cta, 1],
            block=[self.threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, m_y: cute.Tensor, m_w: cute.Tensor, m_shared: cute.Tensor, m_out: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        token, col_block, _ = cute.arch.block_idx()
        chunk = col_block * self.threads + tidx  # which 8-column vector of the row
        if chunk * VECTOR < self.hidden:
            out_vec = cute.zipped_divide(m_out[token, None], (VECTOR,))[None, chunk]
            y_first = cute.zipped_divide(m_y[token, 0, None], (VECTOR,))[None, chunk].load().to(cutlass.Float32)
            w_first = cute.full(out_vec.shape, m_w[token, 0], cutlass.Float32)
            if cutlass.const_expr(self.has_shared):
                shared = cute.zipped_divide(m_shared[token, None], (VECTOR,))[None, chunk].load().to(cutlass.Float32)
                acc = cute.math.fma(w_first, y_first, shared)
            else:
                acc = w_first * y_first
            for j in cutlass.range_constexpr(1, self.topk):
                y_vec = cute.zipped_divide(m_y[token, j, None], (VECTOR,))[None, chunk].load().to(cutlass.Float32)
                acc = cute.math.fma(cute.full(out_vec.shape, m_w[token, j], cutlass.Float32), y_vec, acc)
            out_vec.store(acc.to(m_out.element_type))


def compile_combine(hidden: int, topk: int, has_shared: bool, arch: str, options: str = ""):
    """Compile for ``arch`` without tensors: pointers and the token count are runtime arguments."""
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    gmem = cute.AddressSpace.gmem
    args = (
        make_ptr(cutlass.BFloat16, 0, gmem, assumed_align=16),
        make_ptr(cutlass.Float32, 0, gmem, assumed_align=4),
        make_ptr(cutlass.BFloat16, 0, gmem, assumed_align=16),
        make_ptr(cutlass.BFloat16, 0, gmem, assumed_align=16),
        cutlass.Int32(1),
        make_fake_stream(),
    )
    return cute.compile(CombineKernel(hidden, topk, has_shared), *args, options=f"--gpu-arch {arch} {options}".strip())
