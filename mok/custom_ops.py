"""The layer as PyTorch custom ops: ``mok::moe_forward`` and ``mok::moe_backward``.

Registered with torch.library so that autograd, ``torch.compile(fullgraph=True)`` and CUDA
graphs see two opaque ops with known output shapes (``register_fake``) instead of the
Python that launches the kernels. Only ``mok::moe_backward`` writes into an input: the
main_grad buffers it may be given (declared as mutated); every output is new.

- CUDA: MoK's fused kernels (mok/fused_forward.py, mok/fused_backward.py), bf16, Hopper (sm_90a).
- CPU: the reference (mok/reference.py, fp32 math, any float dtype), with a one-time
  warning, so that the same model code runs in CPU tests. It returns the same outputs
  (schedule from mok/schedule.py, h computed in fp32), so shapes match the fake kernels.

Output shapes depend only on (T, H, I, I_s, E, k) and ``shared_in_routed``, never on the
routing: the schedule's buffers have the worst-case capacity (``worst_case_capacity``), plus
the shared expert's rows in front when it runs in the routed launches (its h is then h[:T],
and the op's shared_h output is empty: outputs may not alias one another). With
``saved_h_format="mxfp8"`` h and shared_h come out packed (uint8, mok/saved_mxfp8.py) and the
backward op, seeing uint8, unpacks them.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import Tensor

from .config import check_saved_h_format
from .saved_mxfp8 import empty_saved_h, pack_h
from .schedule import build_schedule, shared_prefix_rows, worst_case_capacity

BLOCK_M = 128
_CPU_WARNED = False


def _warn_cpu_once() -> None:
    global _CPU_WARNED
    if not _CPU_WARNED:
        _CPU_WARNED = True
        warnings.warn(
            "MoK: running the MoE layer on the CPU through the reference path (fp32 math, no fused "
            "kernels); put the layer and its inputs on a Hopper GPU for the fused kernels",
            stacklevel=3,
        )


def _shared(sg, su, sd):
    return None if sg is None else (sg, su, sd)


def _forward_shapes(x, topk_idx, w_gate, shared_gate, save, shared_in_routed=False):
    """(capacity, h rows, shared h rows, I, I_s) for the outputs of moe_forward."""
    num_tokens, topk = topk_idx.shape
    num_experts, inter = w_gate.shape[0], w_gate.shape[1]
    capacity = worst_case_capacity(num_tokens, topk, num_experts, BLOCK_M)
    if shared_in_routed:
        capacity += shared_prefix_rows(num_tokens, BLOCK_M)
    shared_inter = 0 if shared_gate is None else shared_gate.shape[0]
    own_shared_h = save and shared_gate is not None and not shared_in_routed
    return capacity, (capacity if save else 0), (num_tokens if own_shared_h else 0), inter, shared_inter


@torch.library.custom_op("mok::moe_forward", mutates_args=(), device_types="cuda")
def moe_forward_op(
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
    one_launch: bool = False,
    shared_in_routed: bool = False,
    fuse_wgrad: bool = False,
    saved_h_format: str = "bf16",
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out, h, shared_h, row_token, row_slot, slot_row, tile_expert, expert_offsets, expert_counts).

    h and shared_h are empty unless ``save`` (shared_h also with ``shared_in_routed``: h[:T]
    holds it); the schedule tensors are what the backward needs to find each row again. Expert
    ids are not range-checked here (that reads the device): ``mok.MoELayer`` checks external
    routing outside graph capture and compilation. ``fuse_wgrad``: the backward adds the weight
    gradients into the weights' ``main_grad`` (mok/main_grad.py); the forward does not read it.
    ``saved_h_format``: "mxfp8" keeps h and shared_h packed (mok/saved_mxfp8.py).
    """
    from .fused_forward import moe_forward
    from .saved_mxfp8 import pack_saved

    check_saved_h_format(saved_h_format)

    res = moe_forward(
        x, topk_idx, topk_w, w_gate, w_up, w_down, _shared(shared_gate, shared_up, shared_down),
        check_routing=False, save_for_backward=save, one_launch=one_launch, shared_in_routed=shared_in_routed,
    )
    s = res.schedule
    if save and saved_h_format == "mxfp8":
        res = pack_saved(res)
    _, h_rows, sh_rows, inter, shared_inter = _forward_shapes(x, topk_idx, w_gate, shared_gate, save, shared_in_routed)
    h = res.h if res.h is not None else empty_saved_h(x, h_rows, 2 * inter, saved_h_format)
    shared_h = res.shared_h if res.shared_h is not None and not shared_in_routed else empty_saved_h(x, sh_rows, 2 * shared_inter, saved_h_format)
    return res.out, h, shared_h, s.row_token, s.row_slot, s.slot_row, s.tile_expert, s.expert_offsets, s.expert_counts


@moe_forward_op.register_fake
def fake_forward(x, topk_idx, topk_w, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, save, one_launch=False,
                 shared_in_routed=False, fuse_wgrad=False, saved_h_format="bf16"):
    """The forward op's outputs as empty tensors of their shapes (also the MXFP8 op's: mok/mxfp8_ops.py)."""
    capacity, h_rows, sh_rows, inter, shared_inter = _forward_shapes(x, topk_idx, w_gate, shared_gate, save, shared_in_routed)
    num_tokens, topk = topk_idx.shape
    i32 = dict(dtype=torch.int32, device=x.device)
    return (
        x.new_empty(num_tokens, x.shape[1]),
        empty_saved_h(x, h_rows, 2 * inter, saved_h_format),
        empty_saved_h(x, sh_rows, 2 * shared_inter, saved_h_format),
        torch.empty(capacity, **i32),
        torch.empty(capacity, **i32),
        torch.empty(num_tokens, topk, **i32),
        torch.empty(capacity // BLOCK_M, **i32),
        torch.empty(w_gate.shape[0] + 1, **i32),
        torch.empty(w_gate.shape[0], **i32),
    )


@moe_forward_op.register_kernel("cpu")
def _(x, topk_idx, topk_w, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, save, one_launch=False, shared_in_routed=False,
      fuse_wgrad=False, saved_h_format="bf16"):
    from .reference import moe_reference

    check_saved_h_format(saved_h_format)
    _warn_cpu_once()
    shared = _shared(shared_gate, shared_up, shared_down)
    out = moe_reference(x, topk_idx, topk_w, w_gate, w_up, w_down, shared).to(x.dtype)
    s = build_schedule(topk_idx, w_gate.shape[0], block_m=BLOCK_M, shared_prefix=shared_in_routed)
    _, h_rows, sh_rows, inter, shared_inter = _forward_shapes(x, topk_idx, w_gate, shared_gate, save, shared_in_routed)
    h = x.new_zeros(h_rows, 2 * inter)
    if save:  # what the fused gate/up GEMM saves: [x_row·w_gateᵀ | x_row·w_upᵀ] per buffer row
        rows = s.row_token.long()
        experts = s.tile_expert.long().repeat_interleave(BLOCK_M)
        extra = (shared_gate, shared_up) if shared_in_routed else None  # (expert E: the shared expert)
        gates, ups = [*w_gate, *([extra[0]] if extra else [])], [*w_up, *([extra[1]] if extra else [])]
        for e, (wg, wu) in enumerate(zip(gates, ups)):
            sel = ((experts == e) & (rows >= 0)).nonzero().flatten()
            xr = x[rows[sel]].float()
            h[sel] = torch.cat([xr @ wg.float().T, xr @ wu.float().T], 1).to(x.dtype)
    shared_h = x.new_empty(sh_rows, 2 * shared_inter)
    if save and shared is not None and not shared_in_routed:
        xf = x.float()
        shared_h = torch.cat([xf @ shared_gate.float().T, xf @ shared_up.float().T], 1).to(x.dtype)
    if saved_h_format == "mxfp8":  # (packed as the CUDA op packs; the reference backward recomputes h)
        h, shared_h = (pack_h(t.to(torch.bfloat16)) if save else empty_saved_h(x, t.shape[0], t.shape[1], "mxfp8") for t in (h, shared_h))
    return out, h, shared_h, s.row_token, s.row_slot, s.slot_row, s.tile_expert, s.expert_offsets, s.expert_counts


@torch.library.custom_op("mok::moe_backward", mutates_args=("main_grads",), device_types="cuda")
def moe_backward_op(
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
    main_grads: list[Tensor],
    weight_grads: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, d_topk_w, d_w_gate, d_w_up, d_w_down, d_shared_gate, d_shared_up, d_shared_down).

    The shared expert's gradients are empty tensors when there is none. ``main_grads`` (one fp32
    buffer per weight: gate, up, down[, shared gate, up, down], or none): the weight gradients
    are added into them by the weight-gradient GEMMs themselves, and come out as empty tensors.
    ``weight_grads=False`` (every expert weight frozen): none computed, all six empty.
    """
    from .fused_backward import moe_backward
    from .fused_forward import ForwardResult
    from .schedule import Schedule

    no_overflow = torch.empty(0, dtype=torch.int32, device=x.device)  # (the backward does not read the flag)
    routed_rows = worst_case_capacity(x.shape[0], topk_idx.shape[1], w_gate.shape[0], BLOCK_M)
    shared_rows = row_token.shape[0] - routed_rows  # (rows in front: the shared expert ran in the routed launches)
    sched = Schedule(
        expert_counts, expert_offsets, row_token, row_slot, slot_row, tile_expert, no_overflow, BLOCK_M, row_token.shape[0], shared_rows
    )
    shared = _shared(shared_gate, shared_up, shared_down)
    saved = ForwardResult(out=None, schedule=sched, h=h, shared_h=shared_h if shared is not None else None)
    g = moe_backward(
        dout.contiguous(), x, topk_idx, topk_w, w_gate, w_up, w_down, shared, saved, grad_dtype=w_gate.dtype,
        main_grads=tuple(main_grads) or None, weight_grads=weight_grads,
    )
    return g.dx, g.d_topk_w, *_weight_grads_out(g, x, len(main_grads) > 0)


def _weight_grads_out(g, x: Tensor, added: bool) -> list[Tensor]:
    """The six weight-gradient outputs of a backward op: empty where there is no shared expert, and
    all empty when they went into main_grad buffers (an output may not alias an input) or were not
    computed (weight_grads=False)."""
    if added or g.d_w_gate is None:
        return [x.new_empty(0) for _ in range(6)]
    return [g.d_w_gate, g.d_w_up, g.d_w_down, *(g.d_shared if g.d_shared is not None else [x.new_empty(0) for _ in range(3)])]


@moe_backward_op.register_fake
def _(dout, x, topk_idx, topk_w, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, h, shared_h, row_token, row_slot, slot_row,
      tile_expert, expert_offsets, expert_counts, main_grads, weight_grads=True):
    weights = (w_gate, w_up, w_down, shared_gate, shared_up, shared_down)
    return torch.empty_like(x), torch.empty_like(topk_w), *_fake_weight_grads(x, *weights, added=len(main_grads) > 0 or not weight_grads)


def _fake_weight_grads(x, *weights, added: bool) -> list[Tensor]:
    """Fake twins of :func:`_weight_grads_out`'s outputs."""
    return [torch.empty_like(w) if w is not None and not added else x.new_empty(0) for w in weights]


@moe_backward_op.register_kernel("cpu")
def _(dout, x, topk_idx, topk_w, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, h, shared_h, row_token, row_slot, slot_row,
      tile_expert, expert_offsets, expert_counts, main_grads, weight_grads=True):
    from .reference_backward import moe_backward_reference

    _warn_cpu_once()
    shared = _shared(shared_gate, shared_up, shared_down)
    g = moe_backward_reference(x, topk_idx, topk_w, w_gate, w_up, w_down, shared, dout)
    if not weight_grads:
        return g.dx.to(x.dtype), g.d_topk_w.to(topk_w.dtype), *[x.new_empty(0) for _ in range(6)]
    grads = (g.d_w_gate, g.d_w_up, g.d_w_down, *(g.d_shared or ()))
    for buf, grad in zip(main_grads, grads):
        buf.add_(grad.float())
    if main_grads:
        return g.dx.to(x.dtype), g.d_topk_w.to(topk_w.dtype), *[x.new_empty(0) for _ in range(6)]
    outs = [grad.to(w.dtype) for grad, w in zip(grads, (w_gate, w_up, w_down, *(shared or ())))]
    return g.dx.to(x.dtype), g.d_topk_w.to(topk_w.dtype), *outs, *[x.new_empty(0) for _ in range(6 - len(outs))]


def _setup_context(ctx, inputs, output):
    (x, topk_idx, topk_w, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, save, _one_launch, _shared_in_routed,
     fuse_wgrad, _saved_h_format) = inputs
    _, h, shared_h, *schedule = output
    ctx.saved_h = save
    ctx.has_shared = shared_gate is not None
    ctx.params = _accumulating_weights(fuse_wgrad, w_gate, w_up, w_down, shared_gate, shared_up, shared_down)
    ctx.save_for_backward(x, topk_idx, topk_w, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, h, shared_h, *schedule)
    ctx.mark_non_differentiable(h, shared_h)  # (saved state: a gradient flowing into it would be dropped)


def _backward(ctx, d_out, *_unused):
    if not ctx.saved_h:
        raise RuntimeError("mok::moe_forward: called with save=False, so it kept nothing for the backward")
    want = _wants_weight_grads(ctx)
    dx, d_topk_w, *weight_grads = moe_backward_op(d_out.contiguous(), *ctx.saved_tensors, _main_grads(ctx) if want else [], want)
    return dx, None, d_topk_w, *_autograd_weight_grads(ctx, weight_grads), None, None, None, None, None


def _wants_weight_grads(ctx) -> bool:
    """Whether any expert weight (routed or shared: the forward op's inputs 3..8) wants a gradient;
    with every one frozen the backward runs no weight-gradient GEMM."""
    return any(ctx.needs_input_grad[3:9])


def _autograd_weight_grads(ctx, weight_grads: list) -> list:
    """The six weight gradients autograd gets from a backward op's outputs: those, or what
    mok/main_grad.py hands out once they went into main_grad; None for an absent shared expert,
    and for all six when none wanted one."""
    if not _wants_weight_grads(ctx):
        return [None] * 6
    grads = list(weight_grads) if ctx.params is None else _after_accumulation(ctx)
    return grads if ctx.has_shared else grads[:3] + [None] * 3


def _accumulating_weights(fuse_wgrad: bool, *weights) -> tuple | None:
    """The weights whose gradients the backward adds into main_grad: all of them when the forward
    asked for it and every one wants a gradient (frozen experts keep the plain path), else None."""
    weights = tuple(w for w in weights if w is not None)
    return weights if fuse_wgrad and all(w.requires_grad for w in weights) else None


def _main_grads(ctx) -> list[Tensor]:
    """The weights' main_grad buffers when the forward asked for fused accumulation, else none."""
    if ctx.params is None:
        return []
    from .main_grad import main_grads_of

    return main_grads_of(ctx.params)


def _after_accumulation(ctx) -> list:
    """What autograd gets for the six weights once their gradients are in main_grad (mok/main_grad.py)."""
    from .main_grad import grads_after_accumulation

    grads = grads_after_accumulation(ctx.params)
    return grads + [None] * (6 - len(grads))


moe_forward_op.register_autograd(_backward, setup_context=_setup_context)
