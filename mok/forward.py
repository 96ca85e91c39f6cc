"""The MoE layer forward on one GPU (EP = 1) from MoK's kernels.

    device schedule (1 CTA)    -> row slots, tile -> expert map; no host sync
    gather                     -> x_rows [R, H], rows grouped by expert (canonical order)
    grouped GEMM + SwiGLU      -> a [R, I] = silu(x_rows·w_gateᵀ) ⊙ x_rows·w_upᵀ
    grouped GEMM               -> y_rows [R, H] = a·w_downᵀ
    shared expert (optional)   -> the same two GEMMs over x itself, one "expert"
    gathered combine           -> out[t] = shared[t] + Σ_j w[t, j]·y_rows[slot_row[t, j]]

Every kernel's configuration depends only on (H, I, E, k), so a token's output does not
depend on the other tokens in the batch. Saved for backward (next): x_rows is not kept;
the backward re-gathers x and recomputes h = x_rows·w_gateᵀ, x_rows·w_upᵀ from the
schedule, which it keeps (routing only, 4 bytes per (token, slot)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import ops
from .reference import SharedExpert
from .schedule import Schedule
from .validation import check_moe_inputs

TILE_M = 128  # row tile of the grouped GEMMs: each expert's rows are padded to it


@dataclass
class ForwardResult:
    """The layer output and what the backward will need."""

    out: torch.Tensor
    schedule: Schedule


def _shared_expert(x: torch.Tensor, shared: SharedExpert) -> torch.Tensor:
    """The shared expert as a grouped GEMM with one expert over all of x."""
    tiles = torch.zeros(-(-x.shape[0] // TILE_M), dtype=torch.int32, device=x.device)
    a = ops.grouped_gemm(x, shared[0][None], tiles, b2=shared[1][None])
    return ops.grouped_gemm(a, shared[2][None], tiles)


def moe_forward(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    shared: SharedExpert | tuple | None = None,
    *,
    check_routing: bool = True,
    out: torch.Tensor | None = None,
) -> ForwardResult:
    """MoE layer output [T, H] bf16 for bf16 x [T, H] and bf16 weights, all experts on this GPU.

    topk_idx [T, k] int32/int64 and topk_w [T, k] fp32 are the router's output. With
    ``check_routing`` (the default) expert ids are range-checked, which reads two scalars
    back from the GPU; pass False inside CUDA-graph capture (the forward itself never
    synchronises with the host). ``out`` optionally receives the result ([T, H] bf16).
    """
    if isinstance(x, torch.Tensor) and x.device.type != "cuda":
        raise ValueError(f"x: expected a CUDA tensor, got one on {x.device}")
    _, _, _, num_experts, _ = check_moe_inputs(
        x, topk_idx, topk_w, w_gate, w_up, w_down, shared,
        dtypes=(torch.bfloat16,), router_dtypes=(torch.float32,), contiguous=True, check_range=check_routing,
    )
    sched = ops.device_schedule(topk_idx.to(torch.int32).contiguous(), num_experts, block_m=TILE_M)
    x_rows = ops.gather_rows(x, sched.row_token)
    a = ops.grouped_gemm(x_rows, w_gate, sched.tile_expert, b2=w_up)
    y_rows = ops.grouped_gemm(a, w_down, sched.tile_expert)
    shared_out = None if shared is None else _shared_expert(x, shared)
    out = ops.combine(y_rows, topk_w, shared_out, slot_row=sched.slot_row, out=out)
    return ForwardResult(out=out, schedule=sched)
