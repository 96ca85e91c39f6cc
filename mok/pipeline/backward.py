"""The MoE layer's backward: the forward's stages mirrored, as the plan says.

    rows in           dout_rows = dout[row_token] and x_rows = x[row_token] (one launch); EP: publish dout
                      and topk_w, gather every rank's router weights, pull each row's dout from its
                      token's owner (x_rows were kept by the forward; dispatch_format="fp8_block":
                      dout quantized by its owner, crossing as the FP8 rows the SwiGLU backward
                      takes, their values for the weight gradients)
    down backward     dA_u = dout_rows·W_down with the SwiGLU backward and the router-gradient pieces in
                      its epilogue: dh [R, 2I], s·a [R, I], pieces [R, I / tile]
    gate/up backward  dx_rows = dh_gate·W_gate + dh_up·W_up; EP: each row pushed into its token's slot
    weight grads      dW_down[e] = dout_rowsᵀ·(s·a), [dW_gate; dW_up][e] = dhᵀ·x_rows (one launch each),
                      rows in canonical order, one CTA per output tile; or added into fp32 main_grad
    shared expert     the same over every token with s = 1, or inside the launches above when the
                      forward ran it as expert E (its rows first)
    dx combine        dx[t] = dx_shared[t] + Σ_j dx_rows[t, j] (fp32, j in order) and, in the same launch,
                      d_topk_w[t, j] = Σ pieces in column order; EP: the pieces into the "dw" region,
                      the done handshake, each (t, j) read from the rank that owns its expert

Nothing uses atomics or reads device data back: the gradients are bitwise reproducible and a
token's dx and router gradient do not depend on the rest of the batch; at EP > 1 they are the
single-GPU backward's of the concatenated batch, bit for bit. An h kept in MXFP8
(mok/saved_mxfp8.py) is turned back into bf16 first; one kept as its up half gets its gate half
computed again (mok/saved_h.py).
"""

from __future__ import annotations

import dataclasses

import torch

from .. import ops
from ..config import check_wgrad_format
from ..plan import Plan
from ..reference_backward import Gradients
from ..runtime import launch
from ..saved_mxfp8 import unpack_saved
from ..schedule import shared_prefix_rows
from ..validation import check_main_grads, check_tensor, check_timeout
from . import exchange, stages
from .forward import check_inputs, check_on_gpu, check_saved
from .stages import ForwardResult
from .workspace import EPWorkspace


def backward(
    plan: Plan,
    dout: torch.Tensor,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    weights: tuple,
    shared: tuple | None,
    saved: ForwardResult,
    *,
    workspace: EPWorkspace | None = None,
    grad_dtype: torch.dtype = torch.bfloat16,
    main_grads: tuple | None = None,
    weight_grads: bool = True,
    wgrad_format: str | None = None,
    timeout_s: float = 5.0,
    biases: tuple | None = None,
) -> Gradients:
    """All gradients for ``dout`` [T, H] bf16 after ``forward(..., save=True)`` of the same inputs
    (module docstring): :class:`mok.reference_backward.Gradients` with dx [T, H] bf16, d_topk_w
    [T, k] fp32 and the weight gradients in ``grad_dtype`` (bf16 or fp32). ``main_grads`` (one fp32
    buffer per weight: gate, up, down[, shared gate, up, down]): the weight gradients are added into
    them by the weight-gradient GEMMs (Megatron's main_grad) and returned as them.
    ``weight_grads=False`` (frozen experts): dx and d_topk_w only, no weight-gradient GEMM (the
    weight gradients None). ``wgrad_format`` (None: the config's, MoKConfig.weight_grad_format):
    "bf16" (on the bf16 rows); "mxfp8" (MXFP8 precision: on rows quantized down their columns);
    "fp8_block" (precision fp8_block): on the rows' transposes in FP8 with 1 x 128 blocks along the
    rows, DeepSeek-V3's recipe (stages.fp8_weight_grad_operands; SM100: the same blocks as MXFP8
    operands of its MXFP8 weight-gradient kernel).
    At EP > 1 the shared expert's weight gradients cover this rank's tokens (sum them over ranks
    as data-parallel gradients).
    With ``gate_up_layout="concatenated"`` d_w_gate is [dW_gate; dW_up] per expert in one
    [E, 2I, H] tensor (the layout of the weights', such as transformers' gate_up_proj: nothing to
    concatenate after), with "interleaved" the two interleaved row by row (gpt-oss's), and d_w_up is
    None; the same bits. ``biases``: the forward's (exactly when
    the config's expert_bias): their gradients come as ``d_biases`` (with the weight gradients), and
    the down bias's share of d_topk_w, <dout, b_down>, is in it.
    """
    num_tokens, hidden, inter, num_local, topk = check_inputs(plan.config, workspace, x, topk_idx, topk_w, weights, shared,
                                                              biases=biases)
    check_tensor("dout", dout, dtypes=(torch.bfloat16,), shape=(num_tokens, hidden), device=x.device, contiguous=True)
    if grad_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"grad_dtype: expected torch.bfloat16 or torch.float32, got {grad_dtype}")
    wgrad_format = plan.config.weight_grad_format if wgrad_format is None else check_wgrad_format(wgrad_format, plan.config.precision)
    check_main_grads(main_grads, tuple(weights), None if shared is None else tuple(shared), weight_grads)
    sched = check_saved("saved", saved, plan, num_tokens, topk, num_local, x.device, workspace)
    shared_inter = None if shared is None else shared[0].shape[0]
    if sched.shared_rows and (shared is None or shared_inter != inter or sched.shared_rows != shared_prefix_rows(num_tokens, sched.block_m)):
        raise ValueError(
            f"saved.schedule: has {sched.shared_rows} rows of a shared expert in front; expected a shared expert of the "
            f"routed experts' shapes and {shared_prefix_rows(num_tokens, sched.block_m)} rows for {num_tokens} tokens"
        )
    if shared is not None and not sched.shared_rows and saved.shared_h is None and not plan.config.recomputes_h:
        raise ValueError("saved: the forward did not keep the shared expert's h; call it with save=True")
    half = False  # (h kept as its up half: its gate half computed below)
    if not plan.config.recomputes_h:
        saved = unpack_saved(saved, inter, shared_inter)  # (an MXFP8 h back to bf16: the used rows)
        half = plan.config.recomputes_gate and saved.h is not None and saved.h.dim() == 2 and saved.h.shape[1] == inter
        kept = inter if half else 2 * inter  # ("recompute_gate": the up half, mok.saved_h.pack_saved; or h whole)
        check_tensor("saved.h", saved.h, dtypes=(torch.bfloat16,), shape=(sched.capacity, kept), device=x.device, contiguous=True)
        if shared is not None and not sched.shared_rows:
            check_tensor("saved.shared_h", saved.shared_h, dtypes=(torch.bfloat16,), shape=(num_tokens, 2 * shared_inter),
                         device=x.device, contiguous=True)
    check_on_gpu(x)
    # the forward ran the shared expert as expert E, its rows first: the [E + 1, ...] weights, once
    stacked = stages.stacked_weights(*weights, shared) if sched.shared_rows else None
    if plan.config.recomputes_h:
        saved = recomputed_h(plan, saved, x, weights, stacked, shared, biases)
    elif half:
        saved = gate_recomputed(plan, saved, x, weights, stacked, biases)
    mains = (None, None) if main_grads is None else (main_grads[:3], main_grads[3:])
    if plan.ep:
        check_timeout(timeout_s)
        return _ep_backward(plan, workspace, dout, x, topk_idx, topk_w, weights, shared, saved, grad_dtype, mains, weight_grads,
                            timeout_s, biases, wgrad_format)

    expert_weights = stages.backward_weights(plan, weights, stacked)
    fp8_wgrad = wgrad_format == "fp8_block"  # (x's rows then gathered as their transposes are quantized)
    bf16_wgrad = weight_grads and not fp8_wgrad
    dout_q = None
    used = stages.rows_in_use(sched)  # (the rows' gathers stop there: the capacity's row tiles past it no GEMM reads)
    if plan.quantizes_gathered_rows:  # dout's FP8 rows from dout's tokens (stages.quantized_rows), in bf16 too where something reads them so
        # (bf16 weight gradients, the expert biases' sums, a shared expert among the routed ones); with FP8 weight
        # gradients dW_down's operand is gathered from dout as its transpose is quantized
        dout_rows, dout_q = stages.gathered_dout(plan, dout, sched, bf16_wgrad or biases is not None or bool(sched.shared_rows))
        x_rows = ops.gather_rows(x, sched.row_token, rows_used=used) if bf16_wgrad else None
    elif bf16_wgrad:
        dout_rows, x_rows = ops.gather_rows_pair(dout, x, sched.row_token, rows_used=used)  # (x_rows: not saved by the forward)
    else:
        dout_rows, x_rows = ops.gather_rows(dout, sched.row_token, rows_used=used), None
    dh, a_scaled, partial = stages.down_backward(plan, dout_rows, sched, expert_weights, saved.h, topk_w, biases, dout_q)
    dx_rows = stages.gate_up_backward(plan, dh, sched, expert_weights)
    d_gate = d_up = d_down = d_biases = None
    if weight_grads:
        d_gate, d_up, d_down = stages.expert_weight_grads(
            plan, (dout_rows, a_scaled, dh, x_rows), sched, grad_dtype, mains[0], wgrad_format, plan.config.gate_up_layout,
            tokens=(dout, x),
        )
        if biases is not None:
            d_biases = stages.expert_bias_grads(dout_rows, dh, sched, topk_w, biases)
    dx_shared = d_shared = None
    if sched.shared_rows:  # its dx rows, and its weight gradients from its rows (views [:T])
        dx_shared = dx_rows[:num_tokens]
        if weight_grads:
            rows = slice(0, num_tokens)
            d_shared = stages.shared_weight_grads(dout_rows[rows], a_scaled[rows], dh[rows], x_rows[rows], grad_dtype, mains[1])
    elif shared is not None:
        dx_shared, d_shared = stages.shared_expert_backward(plan, x, dout, shared, saved.shared_h, grad_dtype, mains[1], weight_grads)
    d_topk_w = torch.empty(sched.slot_row.shape, dtype=torch.float32, device=x.device)
    dx = ops.combine(  # unweighted (s is already inside dh), and d_topk_w from the SwiGLU backward's pieces
        dx_rows, None, dx_shared, slot_row=sched.slot_row, router=(partial, d_topk_w)
    )
    return Gradients(dx, d_topk_w, d_gate, d_up, d_down, d_shared, d_biases)


def recomputed_h(plan: Plan, saved: ForwardResult, x: torch.Tensor, weights: tuple, stacked: tuple | None,
                 shared: tuple | None, biases: tuple | None = None) -> ForwardResult:
    """``saved`` with h (and the shared expert's h) computed again, as the forward computed them: the
    gate/up stage on the same rows with the same weights (at one GPU gathered from x, with the shared
    expert as expert E, ``stacked`` [E + 1, ...] weights, when the forward ran it so; at EP > 1 the
    rows this rank pulled, which the forward kept), so the same bits (saved_h_format="recompute")."""
    sched, inter = saved.schedule, weights[0].shape[1]
    h = torch.empty(sched.capacity, 2 * inter, dtype=x.dtype, device=x.device)
    if plan.ep:
        stages.gate_up(plan, saved.x_rows, sched, stages.routed_weights(plan, weights, None), h, gather=False, biases=biases)
    else:
        stages.gate_up_from_tokens(plan, x, sched, stages.routed_weights(plan, weights, stacked), h, biases)
    shared_h = None
    if sched.shared_rows:
        shared_h = h[: x.shape[0]]
    elif shared is not None:
        shared_h = torch.empty(x.shape[0], 2 * shared[0].shape[0], dtype=x.dtype, device=x.device)
        stages.shared_expert_gate_up(plan, x, shared, shared_h)
    return dataclasses.replace(saved, h=h, shared_h=shared_h)


def gate_recomputed(plan: Plan, saved: ForwardResult, x: torch.Tensor, weights: tuple, stacked: tuple | None,
                    biases: tuple | None = None) -> ForwardResult:
    """``saved`` whose h is its up half (saved_h_format="recompute_gate") with the whole h again: the
    gate half computed once more (stages.gate_from_tokens: the forward's gate product, the same
    bits; at one GPU from x, with the shared expert as expert E when the forward ran it so; at EP
    > 1 on the rows this rank pulled) and the two halves joined into a fresh [R, 2I]."""
    sched = saved.schedule
    if plan.ep:
        gate = stages.gate_from_tokens(plan, x, sched, weights, biases, rows=saved.x_rows)
    else:
        gate = stages.gate_from_tokens(plan, x, sched, stages.routed_weights(plan, weights, stacked), biases)
    h = torch.cat([gate, saved.h], dim=1)
    return dataclasses.replace(saved, h=h, shared_h=h[: x.shape[0]] if sched.shared_rows else saved.shared_h)


def _ep_backward(plan: Plan, ws: EPWorkspace, dout, x, topk_idx, topk_w, weights, shared, saved, grad_dtype, mains, weight_grads,
                 timeout_s, biases, wgrad_format: str) -> Gradients:
    """This rank's gradients over the workspace (module docstring): every rank makes the same calls."""
    if dout.data_ptr() % 16:  # (published with 16-byte vectors)
        raise ValueError(f"dout: expected a 16-byte aligned data pointer, got address {dout.data_ptr():#x}")
    ws.raise_pending()
    dev, sched, num_tokens, c = x.device, saved.schedule, x.shape[0], plan.config
    link = "fp8_block" if c.dispatch_format == "fp8_block" else "bf16"  # (dout crosses as x did: fp8_block's rows, or bf16)
    kernels = exchange.exchange_kernels(ws, dev, link, c.fp8_power_of_two, plan.fp8_scale_order)
    stream = launch.stream(dev)
    exchange.publish(ws, kernels, ("x", dout), ("w", topk_w.view(torch.int32)), stream,  # dout replaces x (pulled in the forward)
                     rows_format=link, power_of_two=c.fp8_power_of_two)
    weights_all = exchange.gather_ranks(ws, kernels, "w", timeout_s, stream).view(torch.float32)
    dout_pulled = exchange.pull_rows(ws, kernels, "x", sched, stream, rows_format=link, scale_order=plan.fp8_scale_order)
    dout_rows = stages.bf16_rows(plan, dout_pulled, sched) if weight_grads or link == "bf16" else None  # (their values: the weight grads')
    expert_weights = stages.backward_weights(plan, weights, None)
    dh, a_scaled, partial = stages.down_backward(plan, dout_pulled, sched, expert_weights, saved.h, weights_all, biases)
    dx_a, dx_b, dx_options = stages.dx_operands(plan, dh, sched, expert_weights)
    exchange.push_rows(ws, dx_a, dx_b, sched, **dx_options)  # dx rows straight into their tokens' slots
    ops.router_grad(partial, sched.slot_row, out=exchange.router_pieces(ws))
    exchange.announce_pushed(ws, kernels, sched, saved.routing, stream, gradient=True)  # (router pieces too: peers read them after it)
    d_gate = d_up = d_down = d_biases = None
    if weight_grads:  # (local work while the peers push: the exchanges are the same either way)
        d_gate, d_up, d_down = stages.expert_weight_grads(
            plan, (dout_rows, a_scaled, dh, stages.bf16_rows(plan, saved.x_rows, sched)), sched, grad_dtype, mains[0],
            wgrad_format, plan.config.gate_up_layout,
        )
        if biases is not None:
            d_biases = stages.expert_bias_grads(dout_rows, dh, sched, weights_all, biases)
    dx_shared = d_shared = None
    if shared is not None:
        dx_shared, d_shared = stages.shared_expert_backward(plan, x, dout, shared, saved.shared_h, grad_dtype, mains[1], weight_grads)
    exchange.wait_pushed(ws, kernels, timeout_s, stream)
    d_topk_w = exchange.owned_router_grads(ws, topk_idx, weights[0].shape[0], num_tokens)
    dx = ops.combine(exchange.own_slots(ws, num_tokens), None, dx_shared)  # unweighted: s is already inside dh
    ws.copy_record()
    return Gradients(dx, d_topk_w, d_gate, d_up, d_down, d_shared, d_biases)
