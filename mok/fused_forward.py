"""The MoE layer forward on one GPU (EP = 1) from MoK's kernels.

    device schedule            -> row slots, tile -> expert map; no host sync
    grouped GEMM + SwiGLU      -> a [R, I] = silu(x_rows·w_gateᵀ) ⊙ x_rows·w_upᵀ, where the
                                  producer warpgroup gathers x_rows = x[row_token] (rows grouped
                                  by expert, canonical order) straight into shared memory
    grouped GEMM               -> y_rows [R, H] = a·w_downᵀ
    shared expert (optional)   -> the same two GEMMs over x itself, one "expert"
    gathered combine           -> out[t] = shared[t] + Σ_j w[t, j]·y_rows[slot_row[t, j]]

or, with ``combine_in_gemm``, the down projection combines as it goes: the CTA that writes a
token's last slot adds up its columns (integer arrival counters that the schedule launch
zeroes; the same operations in the same order, so the same bits) — 3 launches, not 4.
With ``one_launch_mlp`` both grouped GEMMs run in one persistent launch (tiles in one global
order, an fc2 row tile waiting for its fc1 row tile, mok/kernels/sm90/expert_mlp.py): 3 launches, and
2 with ``combine_in_gemm`` as well (schedule, MLP) — again the same bits. With ``one_launch``
that launch builds the schedule first (every CTA its part, then a grid barrier) and combines
last (after a second grid barrier): the routed experts' whole forward is ONE launch (plus 2
for a shared expert), the same bits again.

On SM100 (``MOK_UNVERIFIED_SM100=1``; compile-verified, never run) the GEMMs run one tile per CTA
and the rows are gathered first (``gather_first``); ``one_launch``, ``one_launch_mlp`` and
``combine_in_gemm`` are Hopper's so far.

Every kernel's configuration depends only on (H, I, E, k), so a token's output does not
depend on the other tokens in the batch. With ``save_for_backward`` the gate/up GEMM also
writes h = [x_rows·w_gateᵀ | x_rows·w_upᵀ] (bf16, [R, 2I], and [T, 2I_s] for the shared
expert); the backward (mok/fused_backward.py) needs h, the schedule and x, never a or y.
Saved bytes per token: 2·k·2I (h, plus the padding rows of each expert's last tile) +
2·2I_s (shared h) + the schedule's int32 row maps.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from . import ops
from .kernels import check_tiled_widths
from .reference import SharedExpert
from .runtime.arch import check_fused_layer_device, has_persistent_gemms
from .schedule import Schedule, shared_prefix_rows, worst_case_capacity
from .validation import check_moe_inputs

TILE_M = 128  # row tile of the grouped GEMMs: each expert's rows are padded to it


@dataclass
class ForwardResult:
    """The layer output and what the backward needs (h and shared_h only when saved; out is None
    when the saved state is rebuilt for a backward, as the custom op does)."""

    out: torch.Tensor | None
    schedule: Schedule
    h: torch.Tensor | None = None
    shared_h: torch.Tensor | None = None


def single_expert_tiles(num_rows: int, device: torch.device) -> torch.Tensor:
    """tile_expert for a GEMM over all rows with one expert (the shared expert)."""
    return torch.zeros(-(-num_rows // TILE_M), dtype=torch.int32, device=device)


def check_tile_multiples(hidden: int, inter: int, shared: tuple | None) -> None:
    """The layer's widths, as the weights give them, multiples of the fused kernels' tile
    (:func:`mok.kernels.check_tiled_widths`)."""
    check_tiled_widths("w_gate", {"H": hidden, "I": inter} | ({} if shared is None else {"I_s (shared)": shared[0].shape[0]}))


def shared_expert_forward(x: torch.Tensor, shared: SharedExpert, h_out: torch.Tensor | None = None) -> torch.Tensor:
    """The shared expert as a grouped GEMM with one expert over all of x (``h_out``: keep h for backward)."""
    tiles = single_expert_tiles(x.shape[0], x.device)
    a = ops.grouped_gemm(x, shared[0][None], tiles, b2=shared[1][None], h_out=h_out)
    return ops.grouped_gemm(a, shared[2][None], tiles)


def shared_expert_as_last(w_gate, w_up, w_down, shared) -> tuple | None:
    """(w_gate, w_up, w_down) over E + 1 experts, the shared expert the last, when each of its
    weights lies right after the routed experts' in the same storage with their shapes (as
    mok.MoELayer allocates them); else None (then the shared expert runs in launches of its own)."""
    if shared is None:
        return None
    stacked = []
    for routed, one in zip((w_gate, w_up, w_down), tuple(shared)):
        if (
            one.shape != routed.shape[1:] or one.dtype != routed.dtype or not one.is_contiguous() or not routed.is_contiguous()
            or one.device != routed.device
            or one.untyped_storage().data_ptr() != routed.untyped_storage().data_ptr()
            or one.storage_offset() != routed.storage_offset() + routed.numel()
        ):
            return None
        stacked.append(routed.as_strided((routed.shape[0] + 1, *routed.shape[1:]), routed.stride(), routed.storage_offset()))
    return tuple(stacked)


def stacked_weights(w_gate, w_up, w_down, shared) -> tuple:
    """The routed and shared experts' weights as [E + 1, ...] tensors, the shared expert last: views
    where they lie so (:func:`shared_expert_as_last`), else copies (one warning per process)."""
    stacked = shared_expert_as_last(w_gate, w_up, w_down, shared)
    if stacked is None:
        global _COPY_WARNED
        if not _COPY_WARNED:
            _COPY_WARNED = True
            warnings.warn(
                "MoK: the shared expert's weights do not lie right after the routed experts' (one [E + 1, ...] "
                "buffer per projection, as mok.MoELayer allocates them): copying them together on every call",
                stacklevel=3,
            )
        stacked = tuple(torch.cat([routed, one[None]]) for routed, one in zip((w_gate, w_up, w_down), tuple(shared)))
    return stacked


_COPY_WARNED = False


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
    save_for_backward: bool = False,
    combine_in_gemm: bool = False,
    one_launch_mlp: bool = False,
    one_launch: bool = False,
    gather_first: bool = False,
    shared_in_routed: bool | None = None,
) -> ForwardResult:
    """MoE layer output [T, H] bf16 for bf16 x [T, H] and bf16 weights, all experts on this GPU.

    topk_idx [T, k] int32/int64 and topk_w [T, k] fp32 are the router's output. With
    ``check_routing`` (the default) expert ids are range-checked, which reads two scalars
    back from the GPU; pass False inside CUDA-graph capture (the forward itself never
    synchronises with the host). ``out`` optionally receives the result ([T, H] bf16).
    ``save_for_backward`` keeps h (see the module docstring) in the result.
    ``combine_in_gemm``: the down projection also combines (3 launches instead of 4, the same
    bits); slower at the benchmark shapes so far (perf/NOTES.md), hence off by default.
    ``one_launch_mlp``: fc1 and fc2 (and with ``combine_in_gemm`` the combine) in one launch, the
    same bits; within 1% of four launches at steady state (perf/NOTES.md, fifteenth session).
    Its fc2 tiles wait for their rows' fc1 tiles, at most 10 s: only a GPU
    shared so that not all of this launch's CTAs can run at once could make it time out, and
    then the output is wrong: the timeout is counted in the stream's grid-barrier words, which
    ``mok.ops.raise_grid_timeouts(mok.ops.grid_sync_words(x.device))`` reads (as for ``one_launch``).
    ``one_launch``: the schedule, fc1, fc2 and the combine in one launch
    (:func:`mok.ops.scheduled_expert_mlp`), within 1% of the four launches at steady state; its grid
    barriers keep 16 bytes per stream across calls, allocated on the device's first such call:
    warm up before CUDA-graph capture. Like ``one_launch_mlp`` it needs all its CTAs resident at
    once (waits bounded by the same timeout).
    ``shared_in_routed``: a shared expert of the routed experts' shapes runs in the routed GEMM
    launches as expert E, its rows in front of the routed ones (the schedule's shared prefix): 4
    launches instead of 6, with ``one_launch`` ONE instead of 3, the same bits; its saved h is
    then h[:T]. None (default): wherever its weights lie right after the routed experts'
    (:func:`shared_expert_as_last`, mok.MoELayer's layout) and neither ``combine_in_gemm`` nor
    ``one_launch_mlp`` is asked for (those run it on its own so far); True: always (weights
    elsewhere are copied together first, per call); False: never.
    ``gather_first`` (not with ``one_launch_mlp``): the rows are gathered into x_rows [R, H]
    first, by a launch of their own (with ``one_launch``: by a phase of the launch, after the
    schedule, behind a grid barrier), and the gate/up GEMM loads them by TMA, instead of
    gathering them itself with cp.async: R·H·2 bytes of transient memory (and in the multi-launch
    forward one launch) more, the same bits. It was 2-3% faster at H = 7168 until the GEMM's
    gather worked out its source addresses once a tile; since then (perf/NOTES.md, twenty-third
    session) the gathering gate/up GEMM is as fast as the TMA-fed one and the default forward
    as fast as this at H = 7168 and 4% faster at H = 2048. Kept for comparison; opt-in.
    """
    if gather_first and one_launch_mlp:
        raise ValueError("gather_first: not with one_launch_mlp (its fc1 gathers the rows itself)")
    if isinstance(x, torch.Tensor) and x.device.type != "cuda":
        raise ValueError(f"x: expected a CUDA tensor, got one on {x.device}")
    arch = check_fused_layer_device(x.device.index)
    if not has_persistent_gemms(arch):  # (SM100: GEMMs of one tile per CTA so far)
        if one_launch or one_launch_mlp or combine_in_gemm:
            raise NotImplementedError(
                f"one_launch, one_launch_mlp, combine_in_gemm: not on {arch} yet (they are built on Hopper's persistent "
                f"GEMMs); call moe_forward without them"
            )
        gather_first = True  # (the gathering gate/up GEMM is a persistent one)
    _, hidden, inter, num_experts, _ = check_moe_inputs(
        x, topk_idx, topk_w, w_gate, w_up, w_down, shared,
        dtypes=(torch.bfloat16,), router_dtypes=(torch.float32,), contiguous=True, check_range=check_routing,
    )
    check_tile_multiples(hidden, inter, shared)
    num_tokens, hidden = x.shape
    topk_idx = topk_idx.to(torch.int32).contiguous()
    other_path = one_launch_mlp or combine_in_gemm
    if shared_in_routed and (shared is None or tuple(shared[0].shape) != tuple(w_gate.shape[1:]) or other_path):
        raise ValueError(
            "shared_in_routed: needs a shared expert of the routed experts' shapes, and neither combine_in_gemm nor "
            "one_launch_mlp"
        )
    stacked = None
    if shared_in_routed:
        stacked = stacked_weights(w_gate, w_up, w_down, shared)
    elif shared_in_routed is None and not other_path:
        stacked = shared_expert_as_last(w_gate, w_up, w_down, shared)
    rows = worst_case_capacity(num_tokens, topk_idx.shape[1], num_experts, TILE_M)  # the schedule's buffer rows
    # (refused before any launch: the expert rows' buffers, h [rows, 2I], a [rows, I], y [rows, H], are 32-bit indexed)
    prefix = shared_prefix_rows(num_tokens, TILE_M) if stacked is not None else 0
    ops._check_32bit_rows("the expert rows (h, a, y)", prefix + rows, max(hidden, (2 if save_for_backward else 1) * inter))
    if stacked is not None:
        return _forward_shared_in_routed(x, topk_idx, topk_w, stacked, num_experts, out, save_for_backward, gather_first, one_launch)
    h = shared_h = None
    if save_for_backward:
        h = torch.empty(rows, 2 * w_gate.shape[1], dtype=x.dtype, device=x.device)
        if shared is not None:
            shared_h = torch.empty(num_tokens, 2 * shared[0].shape[0], dtype=x.dtype, device=x.device)
    if one_launch:  # the shared expert (if any), then one launch
        shared_out = None if shared is None else shared_expert_forward(x, shared, shared_h)
        out, sched = ops.scheduled_expert_mlp(
            x, topk_idx, topk_w, w_gate, w_up, w_down, h_out=h, shared_out=shared_out, out=out, gather_first=gather_first
        )
        return ForwardResult(out=out, schedule=sched, h=h, shared_h=shared_h)
    if one_launch_mlp:  # its tile, ready and arrival counters
        counters = ops.expert_mlp_counters(num_tokens, hidden, rows, x.device)
    else:
        counters = ops.arrival_counters(num_tokens, hidden, x.device) if combine_in_gemm else None
    sched = ops.device_schedule(topk_idx, num_experts, block_m=TILE_M, capacity=rows, clear=counters)
    if one_launch_mlp:
        shared_out = None if shared is None else shared_expert_forward(x, shared, shared_h)
        if combine_in_gemm:
            out = ops.expert_mlp(x, w_gate, w_up, w_down, sched, counters, topk_w=topk_w, h_out=h, shared_out=shared_out, out=out)
        else:
            y_rows = ops.expert_mlp(x, w_gate, w_up, w_down, sched, counters, h_out=h)
            out = ops.combine(y_rows, topk_w, shared_out, slot_row=sched.slot_row, out=out)
        return ForwardResult(out=out, schedule=sched, h=h, shared_h=shared_h)
    if gather_first:
        a = ops.grouped_gemm(ops.gather_rows(x, sched.row_token), w_gate, sched.tile_expert, b2=w_up, h_out=h)
    else:
        a = ops.grouped_gemm(x, w_gate, sched.tile_expert, b2=w_up, h_out=h, gather=sched.row_token)
    shared_out = None if shared is None else shared_expert_forward(x, shared, shared_h)
    if combine_in_gemm:
        out = ops.grouped_gemm_combine(a, w_down, sched, topk_w, counters, shared_out=shared_out, out=out)
    else:
        y_rows = ops.grouped_gemm(a, w_down, sched.tile_expert)
        out = ops.combine(y_rows, topk_w, shared_out, slot_row=sched.slot_row, out=out)
    return ForwardResult(out=out, schedule=sched, h=h, shared_h=shared_h)


def _forward_shared_in_routed(
    x, topk_idx, topk_w, stacked, num_experts, out, save_for_backward, gather_first, one_launch
) -> ForwardResult:
    """The forward (four launches, or ``one_launch``) with the shared expert as expert E of
    ``stacked`` (E + 1 experts), its T rows first in the buffer (the schedule's shared prefix); its
    output rows y_rows[:T] are the combine's shared input, h[:T] its saved h."""
    num_tokens = x.shape[0]
    w_gate, w_up, w_down = stacked
    capacity = worst_case_capacity(num_tokens, topk_idx.shape[1], num_experts, TILE_M)
    rows = shared_prefix_rows(num_tokens, TILE_M) + capacity
    h = torch.empty(rows, 2 * w_gate.shape[1], dtype=x.dtype, device=x.device) if save_for_backward else None
    shared_h = None if h is None else h[:num_tokens]
    if one_launch:
        out, sched = ops.scheduled_expert_mlp(
            x, topk_idx, topk_w, w_gate, w_up, w_down, h_out=h, out=out, gather_first=gather_first, shared_in_routed=True
        )
        return ForwardResult(out=out, schedule=sched, h=h, shared_h=shared_h)
    sched = ops.device_schedule(topk_idx, num_experts, block_m=TILE_M, capacity=capacity, shared_prefix=True)
    if gather_first:
        a = ops.grouped_gemm(ops.gather_rows(x, sched.row_token), w_gate, sched.tile_expert, b2=w_up, h_out=h)
    else:
        a = ops.grouped_gemm(x, w_gate, sched.tile_expert, b2=w_up, h_out=h, gather=sched.row_token)
    y_rows = ops.grouped_gemm(a, w_down, sched.tile_expert)
    out = ops.combine(y_rows, topk_w, y_rows[:num_tokens], slot_row=sched.slot_row, out=out)
    return ForwardResult(out=out, schedule=sched, h=h, shared_h=shared_h)

