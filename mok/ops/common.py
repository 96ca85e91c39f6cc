"""What every kernel entry point shares: the launch-time checks of its tensors, and the device facts it launches with.

The kernels read and write through 16-byte vectors and TMA, index rows in 32 bits and launch on
the current device's current stream; these checks turn a tensor that breaks one of those rules
into a ValueError that names it, before anything launches (validation.py has the shape and
dtype checks).
"""

from __future__ import annotations

import functools

import torch

from ..kernels import get_kernel
from ..runtime.arch import device_arch, has_persistent_gemms
from ..validation import check_tensor

ALIGN = 16  # bytes: the kernels use 16-byte vector loads and stores (and TMA)
BF16 = (torch.bfloat16,)
I32 = (torch.int32,)
E4M3 = (torch.float8_e4m3fn,)
INDEX_LIMIT = 2**31  # elements a kernel's 32-bit row indexing reaches


def check_cuda_aligned(name: str, t: torch.Tensor) -> None:
    """``t`` is on a CUDA device and starts on a 16-byte boundary."""
    if t.device.type != "cuda":
        raise ValueError(f"{name}: expected a CUDA tensor, got one on {t.device}")
    if t.data_ptr() % ALIGN:
        raise ValueError(f"{name}: expected a {ALIGN}-byte aligned data pointer, got address {t.data_ptr():#x}")


def check_32bit(name: str, t: torch.Tensor) -> None:
    if t.numel() >= INDEX_LIMIT:
        raise ValueError(f"{name}: expected fewer than 2**31 elements (32-bit indexing), got {t.numel()}")


def check_32bit_rows(name: str, rows: int, width: int) -> None:
    """An intermediate buffer [rows, width] an op allocates: 32-bit indexable (checked before it exists)."""
    if rows * width >= INDEX_LIMIT:
        raise ValueError(f"{name}: expected fewer than 2**31 elements (32-bit indexing), got {rows} x {width} = {rows * width}")


def check_launchable(**tensors: torch.Tensor | None) -> None:
    """Each tensor given (None: skipped) is on a CUDA device, 16-byte aligned and 32-bit indexable."""
    for name, t in tensors.items():
        if t is not None:
            check_cuda_aligned(name, t)
            check_32bit(name, t)


def check_weights_launchable(**tensors: torch.Tensor | None) -> None:
    """Per-expert weight tensors (and weight gradients) [E, *, *]: on a CUDA device and 16-byte
    aligned. Only TMA reads and writes them, by (column, k, expert) coordinates that each stay far
    below 2^31, so the whole tensor may hold more elements than 32 bits index (a DeepSeek-V3-sized
    layer's 256 experts on one GPU: 3.8e9 per weight)."""
    for name, t in tensors.items():
        if t is not None:
            check_cuda_aligned(name, t)


def bf16_out(out: torch.Tensor | None, shape: tuple[int, int], device: torch.device, name: str = "out") -> torch.Tensor:
    """The caller's ``out`` after checking it (bf16, shape, device, contiguous, aligned), or a new one."""
    if out is None:
        return torch.empty(shape, dtype=torch.bfloat16, device=device)
    check_tensor(name, out, dtypes=BF16, shape=shape, device=device, contiguous=True)
    check_cuda_aligned(name, out)
    return out


def byte_span(t: torch.Tensor) -> tuple[int, int] | None:
    """[first byte, past the last byte) that ``t`` can touch (None when it holds nothing)."""
    if t.numel() == 0:
        return None
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def check_disjoint(written: dict, read: dict) -> None:
    """Each output in ``written`` shares no memory with any tensor in ``read`` or with another
    output (the kernels read rows other threads write: an overlap gives wrong values, not an
    error); None entries (outputs the op allocates itself) are skipped."""
    if all(t is None for t in written.values()):
        return
    spans = {name: (t.device, byte_span(t)) for name, t in {**written, **read}.items() if t is not None}
    names = [n for n in written if written[n] is not None]
    for i, out_name in enumerate(names):
        dev, span = spans[out_name]
        for other in names[i + 1:] + [n for n in read if read[n] is not None]:
            dev2, span2 = spans[other]
            if span and span2 and dev == dev2 and span[0] < span2[1] and span2[0] < span[1]:
                raise ValueError(f"{out_name}: expected memory of its own, got a tensor that overlaps {other}")


def check_rank_stride(name: str, ranks: tuple[int, int], per_rank: int, limit: int, limit_text: str) -> None:
    """(world W, rank stride) of W ranks' tensors of ``per_rank`` elements lying a stride apart in one
    mapping: 16-byte aligned strides, no overlap, every element within ``limit`` of rank 0's start."""
    world, stride = ranks
    if world < 1 or stride < per_rank or stride % 8 or (world - 1) * stride + per_rank > limit:
        raise ValueError(
            f"{name}: expected (world >= 1, rank stride >= {per_rank} elements, a multiple of 8, "
            f"every rank within {limit_text}), got {ranks}"
        )


def check_rows_used(rows_used: torch.Tensor | None, device: torch.device) -> None:
    """A row count on the device: int32 with one element."""
    if rows_used is not None:
        check_tensor("rows_used", rows_used, dtypes=I32, device=device)
        if rows_used.numel() != 1:
            raise ValueError(f"rows_used: expected one element (a count of rows), got shape {tuple(rows_used.shape)}")


@functools.cache
def arch_of(index: int) -> str | None:
    """The target of CUDA device ``index`` (it does not change while the process runs)."""
    return device_arch(index)


_LAST_KERNEL: list = [None]  # the variant kernel_for handed out last (last_kernel)


def kernel_for(variant, device: torch.device):
    """The compiled kernel of ``variant`` for the device's target (compiled on first use, then cached)."""
    _LAST_KERNEL[0] = variant
    return get_kernel(variant, arch_of(device.index))


def last_kernel() -> str | None:
    """The kernel variant :func:`kernel_for` handed out last, described (None before any). The ops
    launch right after taking their kernel (the EP exchange kernels are taken together first), so
    with CUDA_LAUNCH_BLOCKING=1 a launch that never returns is most likely in this kernel
    (tests/conftest.py names it when an SM100 test hangs)."""
    variant = _LAST_KERNEL[0]
    return None if variant is None else variant.describe()


def persistent_default(device: torch.device) -> bool:
    """The default GEMM kind: persistent where the GPU has persistent GEMMs (Hopper; and where no
    GPU is involved, so that the argument checks read the same everywhere)."""
    return device.type != "cuda" or has_persistent_gemms(arch_of(device.index))


@functools.cache
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of the device: the CTA count of a persistent kernel."""
    return _sm_count_of(device.index)
