"""The expert-parallel forward of one rank in ONE kernel launch (plus 2 for a shared expert, and a
row gather after it when h is saved for the backward).

The multi-launch forward of mok/ep.py (publish and signal, wait and routing gather, schedule,
dispatch, two grouped GEMMs, done signal, wait, combine: 9 launches) as one persistent kernel
(mok/kernels/sm90/expert_mlp.py with ``ep_world``): every CTA publishes its share of this rank's x
and routing, the ranks meet on the workspace's epoch flags, every CTA gathers every rank's
routing and copies the tokens routed here into x_all, builds its part of the schedule, runs the
expert MLP's tiles (fc2 pushing each y row into its token's slot on its token's rank), and
after the done handshake combines this rank's tokens. Every wait is bounded; a timeout lands in
the workspace's error record (raised by a later call, or :meth:`EPWorkspace.check`), and so does
a capacity bound that the routing overflowed (the pairs that got no row come out NaN, as in the
multi-launch forward).

The same operations in the same order as the multi-launch forward: the same bits, which are
those of the single-GPU forward of the concatenated batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import ops
from .ep import EPForwardResult, EPWorkspace
from .fused_forward import shared_expert_forward
from .kernels import GRID_SYNC_WORDS, expert_mlp_variant
from .kernels.common.ep import grid_sync_slot


def ep_one_launch_forward(
    ws: EPWorkspace,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    shared: tuple | None,
    *,
    timeout_s: float,
    save_h: bool,
    max_ctas: int | None = None,
    dispatch_format: str = "bf16",
) -> EPForwardResult:
    """:func:`mok.ep.ep_moe_forward_saved` in one launch (inputs already checked by it). ``max_ctas``:
    the CTA cap (default: every SM, or an equal share of them when several of the workspace's
    ranks run on this GPU, where every rank's launch must be resident at once). ``dispatch_format``
    "mxfp8": x published in MXFP8 (mok.ep.mxfp8_region's layout), each row dequantized into x_all
    as it is copied (the bits of the multi-launch forward's MXFP8 dispatch)."""
    ops._check_cuda_aligned("x", x)  # (the launch copies it in 16-byte vectors)
    lay, dev = ws.layout, x.device
    num_local, inter = w_gate.shape[0], w_gate.shape[1]
    static = _static(ws, dev, num_local, inter, save_h, shared is not None, dispatch_format)
    tokens_all, capacity = lay.world * lay.max_tokens, static.capacity
    sched = ops._empty_schedule(tokens_all, lay.topk, num_local, capacity, ops.MLP_TILE, dev)
    routing = torch.empty(tokens_all, lay.topk, dtype=torch.int32, device=dev)
    x_all = torch.empty(tokens_all, lay.hidden, dtype=x.dtype, device=dev)  # the tokens routed here, by global id
    a = torch.empty(capacity, inter, dtype=x.dtype, device=dev)
    h = torch.empty(capacity, 2 * inter, dtype=x.dtype, device=dev) if save_h else None
    shared_h = torch.empty(x.shape[0], 2 * shared[0].shape[0], dtype=x.dtype, device=dev) if save_h and shared is not None else None
    shared_out = None if shared is None else shared_expert_forward(x, shared, shared_h)
    out = torch.empty(x.shape[0], lay.hidden, dtype=x.dtype, device=dev)
    counters = torch.empty(static.counters, dtype=torch.int32, device=dev)  # zeroed by the launch's schedule
    ops.launch_expert_mlp(
        static.variant, x_all, w_gate, w_up, w_down, a, h, None, sched, topk_w, shared_out, out, counters, timeout_s,
        topk_idx=routing, grid_sync=static.grid_sync, ep=(*static.regions, x, topk_idx, ws.rank, lay.max_tokens, static.strides),
        max_ctas=max_ctas or static.max_ctas,
    )
    x_rows = ops.gather_rows(x_all, sched.row_token) if save_h else None  # the backward's rows (training only)
    ws.copy_record()
    return EPForwardResult(out, sched, x_rows, h, shared_h, routing)


@dataclass(frozen=True)
class _Static:
    """What every call of one workspace with the same weight shapes launches with (built once)."""

    variant: object
    capacity: int
    counters: tuple
    regions: tuple  # rank 0's flags, x, idx and slots regions
    strides: tuple  # their rank strides in elements
    grid_sync: torch.Tensor  # this rank's grid-barrier words, zeroed with the workspace
    max_ctas: int


def _static(
    ws: EPWorkspace, dev: torch.device, num_local: int, inter: int, save_h: bool, has_shared: bool, dispatch_format: str
) -> _Static:
    key = (num_local, inter, save_h, has_shared, dispatch_format)
    found = ws._one_launch.get(key)
    if found is None:
        lay = ws.layout
        capacity = ws.expert_rows(num_local, ops.MLP_TILE)
        variant = expert_mlp_variant(
            lay.hidden, inter, lay.topk, save_h=save_h, combine=True, has_shared=has_shared, schedule_experts=num_local,
            combine_phase=True, ep_world=lay.world, dispatch_format=dispatch_format,
        )
        names = ("flags", "x", "idx", "slots")
        first = grid_sync_slot(lay.world)
        sms = ops._sm_count(dev)
        found = ws._one_launch[key] = _Static(
            variant, capacity, ops.expert_mlp_counters(lay.world * lay.max_tokens, lay.hidden, capacity, dev, shape_only=True),
            tuple(ws.region(name, 0) for name in names), tuple(ws.stride_elems(name) for name in names),
            ws.region("flags")[first:first + GRID_SYNC_WORDS],
            max(sms // ws.ranks_on_device, 1),  # ranks on one GPU (emulated, or processes sharing it) all resident at once
        )
    return found
