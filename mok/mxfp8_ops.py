"""The MXFP8 layer as PyTorch custom ops: ``mok::moe_forward_mxfp8`` and ``mok::moe_backward_mxfp8``.

What ``mok.MoELayer(precision="mxfp8" | "mxfp8_emulated")`` calls: mok/mxfp8_forward.py and
mok/mxfp8_backward.py behind two opaque ops with known output shapes (``register_fake``), so that
autograd, torch.compile and CUDA graphs see them as they see the bf16 ops (mok/custom_ops.py).
The weights are quantized inside the ops on every call (they change with every optimizer step):
along K for the forward, and transposed for the backward. ``emulate``: the GEMMs' operands
dequantized into the bf16 GEMMs (any GPU MoK runs on), else the block-scaled GEMMs (SM100 only,
compile-verified, never run). GPU only: there is no CPU reference of the MXFP8 numerics here.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .custom_ops import BLOCK_M, _fake_weight_grads, _forward_shapes, _shared, fake_forward


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
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out, h, shared_h, row_token, row_slot, slot_row, tile_expert, expert_offsets, expert_counts),
    as ``mok::moe_forward`` returns them (h and shared_h bf16, empty unless ``save``)."""
    from .mxfp8_forward import mxfp8_moe_forward, quantize_expert_weights

    res = mxfp8_moe_forward(
        x, topk_idx, topk_w, quantize_expert_weights(w_gate, w_up, w_down), _shared(shared_gate, shared_up, shared_down),
        check_routing=False, save_for_backward=save, emulate=emulate,
    )
    s = res.schedule
    _, h_rows, sh_rows, inter, shared_inter = _forward_shapes(x, topk_idx, w_gate, shared_gate, save)
    h = res.h if res.h is not None else x.new_empty(h_rows, 2 * inter)
    shared_h = res.shared_h if res.shared_h is not None else x.new_empty(sh_rows, 2 * shared_inter)
    return res.out, h, shared_h, s.row_token, s.row_slot, s.slot_row, s.tile_expert, s.expert_offsets, s.expert_counts


@moe_forward_mxfp8_op.register_fake
def _(x, topk_idx, topk_w, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, save, emulate):
    return fake_forward(x, topk_idx, topk_w, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, save)  # (bf16 h, shared h of its own)


@torch.library.custom_op("mok::moe_backward_mxfp8", mutates_args=(), device_types="cuda")
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
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, d_topk_w, d_w_gate, d_w_up, d_w_down, d_shared_gate, d_shared_up, d_shared_down); the
    shared expert's are empty tensors when there is none."""
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
        grad_dtype=w_gate.dtype, emulate=emulate,
    )
    shared_grads = g.d_shared if g.d_shared is not None else [x.new_empty(0) for _ in range(3)]
    return g.dx, g.d_topk_w, g.d_w_gate, g.d_w_up, g.d_w_down, *shared_grads


@moe_backward_mxfp8_op.register_fake
def _(dout, x, topk_idx, topk_w, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, h, shared_h, *schedule_and_emulate):
    weights = (w_gate, w_up, w_down, shared_gate, shared_up, shared_down)
    return torch.empty_like(x), torch.empty_like(topk_w), *_fake_weight_grads(x, *weights, added=False)


def _setup_context(ctx, inputs, output):
    (x, topk_idx, topk_w, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, save, emulate) = inputs
    _, h, shared_h, *schedule = output
    ctx.saved_h, ctx.emulate, ctx.has_shared = save, emulate, shared_gate is not None
    ctx.save_for_backward(x, topk_idx, topk_w, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, h, shared_h, *schedule)


def _backward(ctx, d_out, *_unused):
    if not ctx.saved_h:
        raise RuntimeError("mok::moe_forward_mxfp8: called with save=False, so it kept nothing for the backward")
    dx, d_topk_w, *weight_grads = moe_backward_mxfp8_op(d_out.contiguous(), *ctx.saved_tensors, ctx.emulate)
    shared_grads = weight_grads[3:] if ctx.has_shared else [None] * 3
    return dx, None, d_topk_w, *weight_grads[:3], *shared_grads, None, None


moe_forward_mxfp8_op.register_autograd(_backward, setup_context=_setup_context)
