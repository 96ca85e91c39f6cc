"""h kept for the backward in MXFP8 (``MoKConfig.saved_h_format="mxfp8"``): about half of bf16's bytes.

h [rows, 2I] (the SwiGLU inputs x·W_gateᵀ | x·W_upᵀ of every expert row) is the largest thing the
layer keeps between its forward and its backward: k·2I values per token against x's H. Packed,
it is one uint8 tensor [rows, 2I·33/32]: all rows' E4M3 elements (rows·2I bytes), then all their
E8M0 scale bytes (one per 32 along a row), the two contiguous runs ``ops.quantize_mxfp8`` writes
(its shape names the rows and the width; a row of it is not a row of h). The backward turns it
back into bf16 (exact: an E4M3 value times a power of two is a bf16) and runs as it does on a
bf16 h, so its gradients are bit for bit those of the bf16 backward given that h. DeepSeek-V3
keeps its MoE SwiGLU inputs in FP8 the same way. The price: a quantize launch in the forward, a
dequantize launch in the backward (two each with a shared expert in launches of its own), and E4M3's 3 mantissa bits, about 3-4% relative error in the
expert path's gradients where a bf16 h gives about 0.2% (docs/notes/saved-h-mxfp8.md).
"""

from __future__ import annotations

import dataclasses

import torch

from .mxfp8 import BLOCK, dequantize_mxfp8, quantize_mxfp8

PACKED_DTYPE = torch.uint8


def packed_width(width: int) -> int:
    """Bytes per row of a packed h of ``width`` columns: the elements and their scale bytes."""
    return width + width // BLOCK


def empty_saved_h(x: torch.Tensor, rows: int, width: int, saved_h_format: str) -> torch.Tensor:
    """An uninitialised h of ``rows`` rows in the given format (bf16 [rows, width] or packed)."""
    if saved_h_format == "mxfp8":
        return torch.empty(rows, packed_width(width), dtype=PACKED_DTYPE, device=x.device)
    return x.new_empty(rows, width)


def _views(packed: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(elements float8_e4m3fn [rows, width], scales uint8 [rows, width // 32]) inside ``packed``."""
    rows = packed.shape[0]
    flat = packed.view(-1)
    split = rows * width
    return flat[:split].view(torch.float8_e4m3fn).view(rows, width), flat[split:].view(rows, width // BLOCK)


def pack_h(h: torch.Tensor, rows_used: torch.Tensor | None = None) -> torch.Tensor:
    """bf16 ``h`` [rows, width] (width a multiple of 32) -> packed MXFP8 uint8 [rows, width·33/32]:
    MoK's quantize kernel on CUDA, mok.mxfp8's rule (the same bytes) elsewhere. ``rows_used`` (int32
    [1] on the device, CUDA only): convert only the first rows_used[0] rows (the rest stay unset)."""
    rows, width = h.shape
    packed = torch.empty(rows, packed_width(width), dtype=PACKED_DTYPE, device=h.device)
    elements, scales = _views(packed, width)
    if h.is_cuda:
        from . import ops

        ops.quantize_mxfp8(h, out=(elements, scales), rows_used=rows_used)
    else:
        reference_elements, reference_scales = quantize_mxfp8(h)
        elements.copy_(reference_elements)
        scales.copy_(reference_scales)
    return packed


def unpack_h(name: str, packed: torch.Tensor, width: int, rows_used: torch.Tensor | None = None) -> torch.Tensor:
    """The bf16 h [rows, width] of a packed one (MoK's dequantize kernel on CUDA; ``rows_used``: as
    in :func:`pack_h`); raises naming ``name`` when ``packed`` is not a packed h of that width."""
    if packed.dtype != PACKED_DTYPE or packed.dim() != 2 or packed.shape[1] != packed_width(width) or not packed.is_contiguous():
        raise ValueError(
            f"{name}: expected a packed MXFP8 h, contiguous uint8 [rows, {packed_width(width)}] for {width} columns, "
            f"got {packed.dtype} {tuple(packed.shape)}"
        )
    elements, scales = _views(packed, width)
    if packed.is_cuda:
        from . import ops

        return ops.dequantize_mxfp8(elements, scales, rows_used=rows_used)
    return dequantize_mxfp8(elements, scales).to(torch.bfloat16)


def _rows_in_use(schedule, h: torch.Tensor) -> torch.Tensor | None:
    """The schedule's used rows (its last expert offset, on the device) on CUDA: the buffer has the
    worst case's rows, the backward reads only these; None elsewhere (all rows)."""
    return schedule.expert_offsets[-1:] if h.is_cuda else None


def pack_saved(result):
    """A forward result (mok.pipeline.ForwardResult) with h and shared_h packed; of h, the rows the schedule uses (the rest of the packed buffer stays unset, as
    those rows of h were). A shared_h that is h's first rows (the shared expert ran as expert E: its
    rows lead the schedule) is dropped: the backward reads it in h."""
    shared_h = result.shared_h
    if getattr(result.schedule, "shared_rows", 0):
        shared_h = None
    h = result.h
    return dataclasses.replace(
        result,
        h=None if h is None else pack_h(h, _rows_in_use(result.schedule, h)),
        shared_h=None if shared_h is None else pack_h(shared_h),
    )


def unpack_saved(saved, inter: int, shared_inter: int | None):
    """``saved`` with a packed h and shared_h turned back into bf16 (unchanged when they are not
    uint8); ``inter`` and ``shared_inter`` are the experts' widths I and I_s (h has 2I columns)."""
    if saved.h is None or saved.h.dtype != PACKED_DTYPE:
        return saved
    h = unpack_h("saved.h", saved.h, 2 * inter, _rows_in_use(saved.schedule, saved.h))
    shared_h = saved.shared_h
    if shared_h is not None and shared_inter is not None:
        shared_h = unpack_h("saved.shared_h", shared_h, 2 * shared_inter)
    return dataclasses.replace(saved, h=h, shared_h=shared_h)
