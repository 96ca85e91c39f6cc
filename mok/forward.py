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
from .validation import check_index_range, check_tensor

TILE_M = 128  # row tile of the grouped GEMMs: each expert's rows are padded to it


@dataclass
class ForwardResult:
    """The layer output and what the backward will need."""

    out: torch.Tensor
    schedule: Schedule


def _check_inputs(x, topk_idx, topk_w, w_gate, w_up, w_down, shared) -> tuple[int, int, int, int]:
    bf16 = (torch.bfloat16,)
    check_tensor("x", x, dtypes=bf16, ndim=2, contiguous=True)
    if x.device.type != "cuda":
        raise ValueError(f"x: expected a CUDA tensor, got one on {x.device}")
    dev = x.device
    num_tokens, hidden = x.shape
    check_tensor("w_gate", w_gate, dtypes=bf16, ndim=3, device=dev, contiguous=True)
    num_experts, inter, _ = w_gate.shape
    check_tensor("w_gate", w_gate, shape=(num_experts, inter, hidden))
    check_tensor("w_up", w_up, dtypes=bf16, shape=(num_experts, inter, hidden), device=dev, contiguous=True)
    check_tensor("w_down", w_down, dtypes=bf16, shape=(num_experts, hidden, inter), device=dev, contiguous=True)
    check_tensor("topk_idx", topk_idx, dtypes=(torch.int32, torch.int64), ndim=2, device=dev)
    if topk_idx.shape[0] != num_tokens:
        raise ValueError(f"topk_idx: expected {num_tokens} rows (as x), got {topk_idx.shape[0]}")
    topk = topk_idx.shape[1]
    if not 1 <= topk <= num_experts:
        raise ValueError(f"topk_idx: expected 1 <= k <= num_experts={num_experts}, got k={topk}")
    check_tensor("topk_w", topk_w, dtypes=(torch.float32,), shape=(num_tokens, topk), device=dev, contiguous=True)
    if shared is not None:
        if not isinstance(shared, tuple) or len(shared) != 3:
            raise TypeError(f"shared: expected None or (gate, up, down) weights, got {type(shared).__name__}")
        check_tensor("shared.gate", shared[0], dtypes=bf16, ndim=2, device=dev, contiguous=True)
        s_inter = shared[0].shape[0]
        check_tensor("shared.gate", shared[0], shape=(s_inter, hidden))
        check_tensor("shared.up", shared[1], dtypes=bf16, shape=(s_inter, hidden), device=dev, contiguous=True)
        check_tensor("shared.down", shared[2], dtypes=bf16, shape=(hidden, s_inter), device=dev, contiguous=True)
    return num_tokens, hidden, inter, num_experts


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
    num_tokens, hidden, inter, num_experts = _check_inputs(x, topk_idx, topk_w, w_gate, w_up, w_down, shared)
    if check_routing:
        check_index_range("topk_idx", topk_idx, num_experts)
    sched = ops.device_schedule(topk_idx.to(torch.int32).contiguous(), num_experts, block_m=TILE_M)
    x_rows = ops.gather_rows(x, sched.row_token)
    a = ops.grouped_gemm(x_rows, w_gate, sched.tile_expert, b2=w_up)
    y_rows = ops.grouped_gemm(a, w_down, sched.tile_expert)
    shared_out = None if shared is None else _shared_expert(x, shared)
    out = ops.combine(y_rows, topk_w, shared_out, slot_row=sched.slot_row, out=out)
    return ForwardResult(out=out, schedule=sched)
