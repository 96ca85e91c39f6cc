"""Row gather: out[r] = src[index[r]], or zeros where index[r] < 0 (padding rows).

Builds the expert-grouped activation buffer from the token rows, in the row order the
schedule gives (canonical within each expert). Arch-neutral: 16-byte vector loads and
stores, one CTA row of ``threads`` threads per 8·threads columns of one output row.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

VECTOR = 8  # bf16 elements per 16-byte access


class GatherRowsKernel:
    """Static config: row width (bf16 elements)."""

    def __init__(self, width: int, threads: int = 128) -> None:
        if width % VECTOR:
            raise ValueError(f"width: expected a multiple of {VECTOR}, got {width}")
        self.width = width
        self.threads = threads
        self.cols_per_cta = threads * VECTOR

    @cute.jit
    def __call__(
        self,
        src_ptr: cute.Pointer,
        index_ptr: cute.Pointer,
        out_ptr: cute.Pointer,
        num_src: cutlass.Int32,
        num_out: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        """src [num_src, width] bf16, index [num_out] int32, out [num_out, width] bf16."""
        w = self.width
        m_src = cute.make_tensor(src_ptr, cute.make_layout((num_src, w), stride=(w, 1)))
        m_index = cute.make_tensor(index_ptr, cute.make_layout((num_out,)))
        m_out = cute.make_tensor(out_ptr, cute.make_layout((num_out, w), stride=(w, 1)))
        self.kernel(m_src, m_index, m_out).launch(
            grid=[num_out, (w + self.cols_per_cta - 1) // self.cols_per_cta, 1],
            block=[self.threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, m_src: cute.Tensor, m_index: cute.Tensor, m_out: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        row, col_block, _ = cute.arch.block_idx()
        chunk = col_block * self.threads + tidx
        if chunk * VECTOR < self.width:
            out_vec = cute.zipped_divide(m_out[row, None], (VECTOR,))[None, chunk]
            source = m_index[row]
            if source >= 0:
                out_vec.store(cute.zipped_divide(m_src[source, None], (VECTOR,))[None, chunk].load())
            else:
                out_vec.store(cute.full(out_vec.shape, 0.0, m_out.element_type))


def compile_gather(width: int, arch: str, options: str = ""):
    """Compile for ``arch`` without tensors."""
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    gmem = cute.AddressSpace.gmem
    args = (
        make_ptr(cutlass.BFloat16, 0, gmem, assumed_align=16),
        make_ptr(cutlass.Int32, 0, gmem, assumed_align=4),
        make_ptr(cutlass.BFloat16, 0, gmem, assumed_align=16),
        cutlass.Int32(1),
        cutlass.Int32(1),
        make_fake_stream(),
    )
    return cute.compile(GatherRowsKernel(width), *args, options=f"--gpu-arch {arch} {options}".strip())
