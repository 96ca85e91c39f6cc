"""The expert-parallel layer as PyTorch custom ops: ``mok::ep_moe_forward`` and ``mok::ep_moe_backward``.

The same role as mok/custom_ops.py at EP = 1: autograd, ``torch.compile(fullgraph=True)``
and CUDA graphs see two opaque ops with known output shapes. The workspace cannot be an op
argument (a tensor argument the op writes would be cloned by functionalisation, and the
peers' memory is not this process's to clone), so the ops take the workspace's handle, an
int (:func:`mok.ep.workspace_by_handle`); its memory is the ops' private state. Every rank
runs the same model code, hence the same sequence of ops, which is all the exchange needs.

Outputs are everything the backward needs and nothing of the workspace: this rank's
output, the rows it pulled (x_rows), h, every rank's routing and this rank's schedule; their
shapes follow from the layout (W, T_max, H, k), the local experts and the capacity bound,
never from the routing.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .config import check_saved_h_format
from .custom_ops import (
    BLOCK_M, _accumulating_weights, _autograd_weight_grads, _fake_weight_grads, _main_grads, _shared, _wants_weight_grads,
    _weight_grads_out,
)
from .saved_mxfp8 import empty_saved_h, pack_saved


def _workspace(handle: int):
    from .ep import workspace_by_handle

    return workspace_by_handle(handle)


@torch.library.custom_op("mok::ep_moe_forward", mutates_args=(), device_types="cuda")
def ep_moe_forward_op(
    x: Tensor,
    topk_idx: Tensor,
    topk_w: Tensor,
    w_gate: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    shared_gate: Optional[Tensor],
    shared_up: Optional[Tensor],
    shared_down: Optional[Tensor],
    workspace: int,
    save: bool,
    timeout_s: float,
    one_launch: bool = False,
    fuse_wgrad: bool = False,
    saved_h_format: str = "bf16",
    dispatch_format: str = "bf16",
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out, x_rows, h, shared_h, routing, counts, offsets, row_token, row_slot, slot_row, tile_expert, overflow).

    x_rows, h and shared_h are empty unless ``save``. ``one_launch``: the forward in one kernel
    (mok/ep_one_launch.py). ``fuse_wgrad``: the backward adds the weight gradients into the
    weights' ``main_grad`` (mok/main_grad.py). ``saved_h_format``: "mxfp8" keeps h and shared_h
    packed (mok/saved_mxfp8.py). ``dispatch_format``: "mxfp8" sends x to the experts' ranks in
    MXFP8. See :func:`mok.ep.ep_moe_forward_saved`.
    """
    from .ep import ep_moe_forward_saved

    check_saved_h_format(saved_h_format)
    ws = _workspace(workspace)
    res = ep_moe_forward_saved(
        ws, x, topk_idx, topk_w, w_gate, w_up, w_down, _shared(shared_gate, shared_up, shared_down), timeout_s=timeout_s, save_h=save,
        one_launch=one_launch, dispatch_format=dispatch_format,
    )
    s = res.schedule
    if save and saved_h_format == "mxfp8":
        res = pack_saved(res)
    x_rows = res.x_rows if save else x.new_empty(0, x.shape[1])  # (the backward's only)
    h = res.h if res.h is not None else empty_saved_h(x, 0, 2 * w_gate.shape[1], saved_h_format)
    shared_h = res.shared_h if res.shared_h is not None else empty_saved_h(
        x, 0, 0 if shared_gate is None else 2 * shared_gate.shape[0], saved_h_format
    )
    return (
        res.out, x_rows, h, shared_h, res.routing,
        s.expert_counts, s.expert_offsets, s.row_token, s.row_slot, s.slot_row, s.tile_expert, s.overflow,
    )


@ep_moe_forward_op.register_fake
def _(x, topk_idx, topk_w, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, workspace, save, timeout_s, one_launch=False,
      fuse_wgrad=False, saved_h_format="bf16", dispatch_format="bf16"):
    ws = _workspace(workspace)
    lay, num_local, inter = ws.layout, w_gate.shape[0], w_gate.shape[1]
    pairs_rows = lay.world * lay.max_tokens
    capacity = ws.expert_rows(num_local, BLOCK_M)
    i32 = dict(dtype=torch.int32, device=x.device)
    shared_cols = 0 if shared_gate is None else 2 * shared_gate.shape[0]
    return (
        x.new_empty(x.shape),
        x.new_empty(capacity if save else 0, x.shape[1]),
        empty_saved_h(x, capacity if save else 0, 2 * inter, saved_h_format),
        empty_saved_h(x, x.shape[0] if save and shared_gate is not None else 0, shared_cols, saved_h_format),
        torch.empty(pairs_rows, lay.topk, **i32),
        torch.empty(num_local, **i32),
        torch.empty(num_local + 1, **i32),
        torch.empty(capacity, **i32),
        torch.empty(capacity, **i32),
        torch.empty(pairs_rows, lay.topk, **i32),
        torch.empty(capacity // BLOCK_M, **i32),
        torch.empty((), **i32),
    )


@torch.library.custom_op("mok::ep_moe_backward", mutates_args=("main_grads",), device_types="cuda")
def ep_moe_backward_op(
    dout: Tensor,
    x: Tensor,
    topk_idx: Tensor,
    topk_w: Tensor,
    w_gate: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    shared_gate: Optional[Tensor],
    shared_up: Optional[Tensor],
    shared_down: Optional[Tensor],
    x_rows: Tensor,
    h: Tensor,
    shared_h: Tensor,
    routing: Tensor,
    counts: Tensor,
    offsets: Tensor,
    row_token: Tensor,
    row_slot: Tensor,
    slot_row: Tensor,
    tile_expert: Tensor,
    overflow: Tensor,
    workspace: int,
    timeout_s: float,
    main_grads: list[Tensor],
    weight_grads: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, d_topk_w, d_w_gate, d_w_up, d_w_down, d_shared_gate, d_shared_up, d_shared_down); see
    :func:`mok.ep_backward.ep_moe_backward`. The shared expert's are empty when there is none;
    ``main_grads`` and ``weight_grads``: as in mok::moe_backward."""
    from .ep import EPForwardResult
    from .ep_backward import ep_moe_backward
    from .schedule import Schedule

    ws = _workspace(workspace)
    sched = Schedule(counts, offsets, row_token, row_slot, slot_row, tile_expert, overflow, BLOCK_M, row_token.shape[0],
                     world_size=ws.layout.world)
    shared = _shared(shared_gate, shared_up, shared_down)
    saved = EPForwardResult(None, sched, x_rows, h, shared_h if shared is not None else None, routing)
    g = ep_moe_backward(
        ws, dout.contiguous(), x, topk_idx, topk_w, w_gate, w_up, w_down, shared, saved,
        grad_dtype=w_gate.dtype, timeout_s=timeout_s, main_grads=tuple(main_grads) or None, weight_grads=weight_grads,
    )
    return g.dx, g.d_topk_w, *_weight_grads_out(g, x, len(main_grads) > 0)


@ep_moe_backward_op.register_fake
def _(dout, x, topk_idx, topk_w, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, x_rows, h, shared_h, routing, counts,
      offsets, row_token, row_slot, slot_row, tile_expert, overflow, workspace, timeout_s, main_grads, weight_grads=True):
    weights = (w_gate, w_up, w_down, shared_gate, shared_up, shared_down)
    return torch.empty_like(x), torch.empty_like(topk_w), *_fake_weight_grads(x, *weights, added=len(main_grads) > 0 or not weight_grads)


def _setup_context(ctx, inputs, output):
    (x, topk_idx, topk_w, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, workspace, save, timeout_s, _one_launch,
     fuse_wgrad, _saved_h_format, _dispatch_format) = inputs
    _, *saved = output
    ctx.saved_h, ctx.has_shared = save, shared_gate is not None
    ctx.workspace, ctx.timeout_s = workspace, timeout_s
    ctx.params = _accumulating_weights(fuse_wgrad, w_gate, w_up, w_down, shared_gate, shared_up, shared_down)
    ctx.save_for_backward(x, topk_idx, topk_w, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, *saved)
    ctx.mark_non_differentiable(*(t for t in saved if t.is_floating_point()))  # (saved state: no gradient flows into it)


def _backward(ctx, d_out, *_unused):
    if not ctx.saved_h:
        raise RuntimeError("mok::ep_moe_forward: called with save=False, so it kept nothing for the backward")
    want = _wants_weight_grads(ctx)
    dx, d_topk_w, *weight_grads = ep_moe_backward_op(
        d_out.contiguous(), *ctx.saved_tensors, ctx.workspace, ctx.timeout_s, _main_grads(ctx) if want else [], want
    )
    return dx, None, d_topk_w, *_autograd_weight_grads(ctx, weight_grads), None, None, None, None, None, None, None


ep_moe_forward_op.register_autograd(_backward, setup_context=_setup_context)
