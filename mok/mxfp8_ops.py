"""The MXFP8 layer as PyTorch custom ops: ``mok::moe_forward_mxfp8`` and ``mok::moe_backward_mxfp8``.

What ``mok.MoELayer(precision="mxfp8" | "mxfp8_emulated")`` calls: mok/mxfp8_forward.py and
mok/mxfp8_backward.py behind two opaque ops with known output shapes (``register_fake``), so that
autograd, torch.compile and CUDA graphs see them as they see the bf16 ops (mok/custom_ops.py).
The weights are quantized inside the ops on every call (they change with every optimizer step):
along K for the forward, and transposed for the backward. ``emulate``: the GEMMs' operands
dequantized into the bf16 GEMMs (any GPU MoK runs on), else the block-scaled GEMMs (SM100 only,
compile-verified, never run). GPU only: there is no CPU reference of the MXFP8 numerics here.
``fuse_wgrad`` and ``saved_h_format`` as in mok/custom_ops.py: the weight gradients added into the
weights' fp32 ``main_grad`` (the backward op declares the buffers mutated), h kept packed in MXFP8.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .config import check_saved_h_format
from .custom_ops import (
    BLOCK_M, _accumulating_weights, _autograd_weight_grads, _fake_weight_grads, _forward_shapes, _main_grads, _shared,
    _wants_weight_grads, _weight_grads_out, fake_forward,
)
from .saved_mxfp8 import empty_saved_h


@torch.library.custom_op("mok::moe_forward_mxfp8", mutates_args=(), device_types="cuda")
def moe_forward_mxfp8_op(
    x: Tensor,
    topk_idx: Tensor,
    topk_w: Tensor,
    w_gate: Tensor,
    w_up: Tensor,
    w_down: Tensor,
    shared_gate: Optional[Tensor],
    shared_up: Optional[Tensor],
    shared_down: Optional[Tensor],
    save: bool,
    emulate: bool,
    fuse_wgrad: bool = False,
    saved_h_format: str = "bf16",
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out, h, shared_h, row_token, row_slot, slot_row, tile_expert, expert_offsets, expert_counts),
    as ``mok::moe_forward`` returns them (h and shared_h empty unless ``save``; bf16, or packed
    with ``saved_h_format="mxfp8"``)."""
    from .mxfp8_forward import mxfp8_moe_forward, quantize_expert_weights
    from .saved_mxfp8 import pack_saved

    check_saved_h_format(saved_h_format)
    res = mxfp8_moe_forward(
        x, topk_idx, topk_w, quantize_expert_weights(w_gate, w_up, w_down), _shared(shared_gate, shared_up, shared_down),
        check_routing=False, save_for_backward=save, emulate=emulate,
    )
    s = res.schedule
    if save and saved_h_format == "mxfp8":
        res = pack_saved(res)
    _, h_rows, sh_rows, inter, shared_inter = _forward_shapes(x, topk_idx, w_gate, shared_gate, save)
    h = res.h if res.h is not None else empty_saved_h(x, h_rows, 2 * inter, saved_h_format)
    shared_h = res.shared_h if res.shared_h is not None else empty_saved_h(x, sh_rows, 2 * shared_inter, saved_h_format)
    return res.out, h, shared_h, s.row_token, s.row_slot, s.slot_row, s.tile_expert, s.expert_offsets, s.expert_counts


@moe_forward_mxfp8_op.register_fake
def _(x, topk_idx, topk_w, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, save, emulate, fuse_wgrad=False,
      saved_h_format="bf16"):
    return fake_forward(  # (the shared expert's h of its own, never in h's rows)
        x, topk_idx, topk_w, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, save, saved_h_format=saved_h_format
    )


@torch.library.custom_op("mok::moe_backward_mxfp8", mutates_args=("main_grads",), device_types="cuda")
def moe_backward_mxfp8_op(
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
    h: Tensor,
    shared_h: Tensor,
    row_token: Tensor,
    row_slot: Tensor,
    slot_row: Tensor,
    tile_expert: Tensor,
    expert_offsets: Tensor,
    expert_counts: Tensor,
    emulate: bool,
    main_grads: list[Tensor],
    weight_grads: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, d_topk_w, d_w_gate, d_w_up, d_w_down, d_shared_gate, d_shared_up, d_shared_down); the
    shared expert's are empty tensors when there is none, and all six are when they were added into
    ``main_grads`` (one fp32 buffer per weight, or none) or not computed (``weight_grads=False``)."""
    from .fused_forward import ForwardResult
    from .mxfp8_backward import mxfp8_moe_backward
    from .mxfp8_forward import quantize_expert_weights
    from .schedule import Schedule

    no_overflow = torch.empty(0, dtype=torch.int32, device=x.device)  # (the backward does not read the flag)
    sched = Schedule(expert_counts, expert_offsets, row_token, row_slot, slot_row, tile_expert, no_overflow, BLOCK_M, row_token.shape[0], 0)
    shared = _shared(shared_gate, shared_up, shared_down)
    saved = ForwardResult(out=None, schedule=sched, h=h, shared_h=shared_h if shared is not None else None)
    g = mxfp8_moe_backward(
        dout.contiguous(), x, topk_idx, topk_w, quantize_expert_weights(w_gate, w_up, w_down, transposed=True), shared, saved,
        grad_dtype=w_gate.dtype, emulate=emulate, main_grads=tuple(main_grads) or None, weight_grads=weight_grads,
    )
    return g.dx, g.d_topk_w, *_weight_grads_out(g, x, len(main_grads) > 0)


@moe_backward_mxfp8_op.register_fake
def _(dout, x, topk_idx, topk_w, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, h, shared_h, row_token, row_slot, slot_row,
      tile_expert, expert_offsets, expert_counts, emulate, main_grads, weight_grads=True):
    weights = (w_gate, w_up, w_down, shared_gate, shared_up, shared_down)
    return torch.empty_like(x), torch.empty_like(topk_w), *_fake_weight_grads(x, *weights, added=len(main_grads) > 0 or not weight_grads)


def _setup_context(ctx, inputs, output):
    (x, topk_idx, topk_w, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, save, emulate, fuse_wgrad, _saved_h_format) = inputs
    _, h, shared_h, *schedule = output
    ctx.saved_h, ctx.emulate, ctx.has_shared = save, emulate, shared_gate is not None
    ctx.params = _accumulating_weights(fuse_wgrad, w_gate, w_up, w_down, shared_gate, shared_up, shared_down)
    ctx.save_for_backward(x, topk_idx, topk_w, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, h, shared_h, *schedule)
    ctx.mark_non_differentiable(h, shared_h)  # (saved state: a gradient flowing into it would be dropped)


def _backward(ctx, d_out, *_unused):
    if not ctx.saved_h:
        raise RuntimeError("mok::moe_forward_mxfp8: called with save=False, so it kept nothing for the backward")
    want = _wants_weight_grads(ctx)
    dx, d_topk_w, *weight_grads = moe_backward_mxfp8_op(
        d_out.contiguous(), *ctx.saved_tensors, ctx.emulate, _main_grads(ctx) if want else [], want
    )
    return dx, None, d_topk_w, *_autograd_weight_grads(ctx, weight_grads), None, None, None, None


moe_forward_mxfp8_op.register_autograd(_backward, setup_context=_setup_context)
