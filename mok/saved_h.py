"""How h lives between the forward and the backward (``MoKConfig.saved_h_format``).

h [rows, 2I] = [x·W_gateᵀ | x·W_upᵀ] per expert row, the SwiGLU inputs the backward needs, is the
largest thing the layer keeps: k·2I values per token against x's H. Its formats:

- "bf16" (default): as the gate/up GEMM wrote it.
- "mxfp8": packed in MXFP8, 33/64 of the bytes (mok/saved_mxfp8.py).
- "recompute": not kept; the backward runs the gate/up GEMM again (mok.pipeline.backward).
- "recompute_gate": the up half kept, [rows, I] (half of the bytes); the backward computes the
  gate half again with the gate GEMM alone, a plain GEMM of the forward's 128-column tile on the
  same rows (the same MMAs in the same order: the same bits), and joins the two. The forward
  copies the up half out of the h its GEMM wrote, the backward joins the halves into a fresh h:
  two copies of I columns per row, beside the gate GEMM's R·H·I multiply-adds.

The pipelines (mok.pipeline) return h as the GEMM wrote it; :func:`pack_saved` turns a forward's
result into the saved format (what the autograd op and the functional API keep), and the backward
takes either.
"""

from __future__ import annotations

import dataclasses

import torch

from . import saved_mxfp8


def saved_h_shape(saved_h_format: str, width: int, dtype: torch.dtype, shared: bool = False) -> tuple:
    """(columns, dtype) of a row of a kept h of ``width`` (2I) columns in ``saved_h_format``;
    ``shared``: a shared expert's own h (kept whole with "recompute_gate")."""
    if saved_h_format == "mxfp8":
        return saved_mxfp8.packed_width(width), saved_mxfp8.PACKED_DTYPE
    if saved_h_format == "recompute_gate" and not shared:
        return width // 2, dtype
    return width, dtype


def up_half(h: torch.Tensor) -> torch.Tensor:
    """The up half of h [rows, 2I] as a tensor of its own, [rows, I]."""
    return h[:, h.shape[1] // 2:].contiguous()


def pack_saved(result, saved_h_format: str):
    """A forward result (mok.pipeline.ForwardResult) with h as ``saved_h_format`` keeps it: MXFP8
    (saved_mxfp8.pack_saved), or its up half alone ("recompute_gate"; a shared expert's h in
    launches of its own stays whole; one that ran as expert E is h's first rows, dropped as the
    backward reads it in h); else unchanged."""
    if saved_h_format == "mxfp8":
        return saved_mxfp8.pack_saved(result)
    if saved_h_format != "recompute_gate" or result.h is None:
        return result
    shared_h = None if getattr(result.schedule, "shared_rows", 0) else result.shared_h
    return dataclasses.replace(result, h=up_half(result.h), shared_h=shared_h)
