"""The expert biases' gradients and their piece of the router-weight gradient (mok/kernels/common/bias_grads.py).

    expert_column_sums   out[e] = Σ_r w_r·rows[r] over expert e's rows (w = 1, or each row's router weight)
    bias_router_pieces   pieces[r, -1] = <rows[r], bias[e(r)]>   (the down bias's piece, the last column)
"""

from __future__ import annotations

import torch

from ..kernels.common.records import COLUMN_SUMS_ARGS, ROW_DOTS_ARGS
from ..kernels.variants import column_sums_variant, row_dots_variant
from ..runtime import launch
from ..schedule import Schedule
from ..validation import check_tensor
from .common import BF16, check_launchable, kernel_for


def expert_column_sums(rows: torch.Tensor, schedule: Schedule, *, topk_w: torch.Tensor | None = None) -> torch.Tensor:
    """[E, N] fp32: the sum of each expert's rows of ``rows`` [R, N] bf16 (the schedule's buffer rows:
    expert e's are offsets[e] .. offsets[e] + counts[e]) in a fixed order that depends on those rows
    only. ``topk_w`` [T, k] fp32 (the router weights the schedule's row_token / row_slot index; at EP
    every rank's): each row weighted by its router weight."""
    check_tensor("rows", rows, dtypes=BF16, shape=(schedule.capacity, None), contiguous=True)
    num_experts = schedule.expert_counts.shape[0]
    width = rows.shape[1]
    if width % 8:
        raise ValueError(f"rows: expected a width that is a multiple of 8 (16-byte rows), got {width}")
    topk, num_tokens = 1, 1
    if topk_w is not None:
        check_tensor("topk_w", topk_w, dtypes=(torch.float32,), ndim=2, device=rows.device, contiguous=True)
        num_tokens, topk = topk_w.shape
    check_launchable(rows=rows)
    out = torch.empty(num_experts, width, dtype=torch.float32, device=rows.device)
    if num_experts == 0:
        return out
    kernel = kernel_for(column_sums_variant(width, topk_w is not None, topk), rows.device)
    kernel(*COLUMN_SUMS_ARGS.values(
        rows=rows, offsets=schedule.expert_offsets, counts=schedule.expert_counts, row_token=schedule.row_token,
        row_slot=schedule.row_slot, topk_w=topk_w, out=out, num_rows=rows.shape[0], num_experts=num_experts,
        num_tokens=max(num_tokens, 1),
    ), launch.stream(rows.device))
    return out


def bias_router_pieces(rows: torch.Tensor, bias: torch.Tensor, schedule: Schedule, pieces: torch.Tensor) -> torch.Tensor:
    """Write <rows[r], bias[e(r)]> (fp32, a fixed order per row) into the last column of ``pieces``
    [R, parts + 1] fp32 (0 for padding and unused rows): ``rows`` [R, H] the rows of dout, ``bias``
    [E, H] the down bias. Returns ``pieces``."""
    check_tensor("rows", rows, dtypes=BF16, shape=(schedule.capacity, None), contiguous=True)
    num_experts, width = schedule.expert_counts.shape[0], rows.shape[1]
    check_tensor("bias", bias, dtypes=BF16, shape=(num_experts, width), device=rows.device, contiguous=True)
    check_tensor("pieces", pieces, dtypes=(torch.float32,), shape=(schedule.capacity, None), device=rows.device, contiguous=True)
    if width % 8:
        raise ValueError(f"rows: expected a width that is a multiple of 8 (16-byte rows), got {width}")
    if pieces.shape[1] < 2:
        raise ValueError(f"pieces: expected at least 2 columns (the GEMM's pieces, then the down bias's), got {pieces.shape[1]}")
    check_launchable(rows=rows, bias=bias)
    if rows.shape[0] == 0:
        return pieces
    kernel = kernel_for(row_dots_variant(width, pieces.shape[1]), rows.device)
    kernel(*ROW_DOTS_ARGS.values(
        rows=rows, bias=bias, tile_expert=schedule.tile_expert, row_token=schedule.row_token, out=pieces[:, -1],
        num_rows=rows.shape[0], num_experts=num_experts,
    ), launch.stream(rows.device))
    return pieces
