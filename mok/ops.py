"""Entry points that launch MoK's kernels on PyTorch tensors.

Each one validates its arguments (dtype, shape, device, layout) and raises before any
launch, then fetches its compiled kernel through the registry and cache (JIT on first
call) and launches it on the current CUDA stream. Nothing here reads device data back,
so every op is CUDA-graph capturable.
"""

from __future__ import annotations

import torch

from .kernels import combine_variant, get_kernel
from .runtime.arch import device_arch
from .validation import check_tensor

_ALIGN = 16  # bytes: the kernels use 16-byte vector loads and stores


def _check_cuda_aligned(name: str, t: torch.Tensor) -> None:
    if t.device.type != "cuda":
        raise ValueError(f"{name}: expected a CUDA tensor, got one on {t.device}")
    if t.data_ptr() % _ALIGN:
        raise ValueError(f"{name}: expected a {_ALIGN}-byte aligned data pointer, got address {t.data_ptr():#x}")


def combine(
    y: torch.Tensor,
    topk_w: torch.Tensor,
    shared_out: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[t] = shared_out[t] + Σ_j topk_w[t, j]·y[t, j] in fp32, fixed j order, bf16 result.

    y: [T, k, H] bf16, the expert outputs in their (token, slot) combine slots.
    topk_w: [T, k] fp32 router weights. shared_out: optional [T, H] bf16 shared-expert output.
    out: optional [T, H] bf16 destination. All contiguous, on one CUDA device, H % 8 == 0.
    The operation order (FMA per slot) is given in ``mok.kernels.common.combine``;
    ``mok.reference.combine_reference`` reproduces it exactly.
    """
    check_tensor("y", y, dtypes=(torch.bfloat16,), ndim=3, contiguous=True)
    num_tokens, topk, hidden = y.shape
    _check_cuda_aligned("y", y)
    if topk < 1:
        raise ValueError(f"y: expected k >= 1 slots per token, got shape {list(y.shape)}")
    if hidden % 8:
        raise ValueError(f"y: expected hidden size H % 8 == 0, got H={hidden}")
    if y.numel() >= 2**31:
        raise ValueError(f"y: expected fewer than 2**31 elements (32-bit indexing), got {y.numel()}")
    check_tensor("topk_w", topk_w, dtypes=(torch.float32,), shape=(num_tokens, topk), device=y.device, contiguous=True)
    if shared_out is not None:
        check_tensor("shared_out", shared_out, dtypes=(torch.bfloat16,), shape=(num_tokens, hidden), device=y.device, contiguous=True)
        _check_cuda_aligned("shared_out", shared_out)
    if out is None:
        out = torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=y.device)
    else:
        check_tensor("out", out, dtypes=(torch.bfloat16,), shape=(num_tokens, hidden), device=y.device, contiguous=True)
        _check_cuda_aligned("out", out)
    if num_tokens == 0:
        return out

    kernel = get_kernel(combine_variant(hidden, topk, shared_out is not None), device_arch(y.device.index))
    _launch(kernel, y, topk_w, shared_out, out, num_tokens)
    return out


def _launch(kernel, y, topk_w, shared_out, out, num_tokens: int) -> None:
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass.cute.runtime import make_ptr

    gmem = cutlass.cute.AddressSpace.gmem
    bf16 = cutlass.BFloat16
    shared_addr = shared_out.data_ptr() if shared_out is not None else 0  # unread without a shared expert
    stream = cuda.CUstream(torch.cuda.current_stream(y.device).cuda_stream)
    kernel(
        make_ptr(bf16, y.data_ptr(), gmem, assumed_align=_ALIGN),
        make_ptr(cutlass.Float32, topk_w.data_ptr(), gmem, assumed_align=4),
        make_ptr(bf16, shared_addr, gmem, assumed_align=_ALIGN),
        make_ptr(bf16, out.data_ptr(), gmem, assumed_align=_ALIGN),
        cutlass.Int32(num_tokens),
        stream,
    )
