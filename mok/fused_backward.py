"""The MoE layer backward on one GPU (EP = 1) from MoK's kernels.

Inputs: dout [T, H], the forward's inputs, and what ``moe_forward(save_for_backward=True)``
kept (the schedule and h; an h kept in MXFP8, mok/saved_mxfp8.py, is turned back into bf16 first,
one launch more). The kernels, in order (mok/reference_backward.py spells out the same math in
PyTorch):

    gather (one launch)     dout_rows [R, H] = dout[row_token], x_rows [R, H] = x[row_token]   (zeros on padding rows)
    grouped GEMM, N-major B dA_u = dout_rows·W_down, with the SwiGLU backward in the epilogue:
                            dh [R, 2I], a_scaled = s·a [R, I], router-gradient pieces [R, I/tile]
    grouped GEMM, K split   dx_rows [R, H] = dh_gate·W_gate + dh_up·W_up
    weight_grad (K-grouped) dW_down[e] = dout_rowsᵀ·a_scaled; [dW_gate[e]; dW_up[e]] = dhᵀ·x_rows (one launch)
    shared expert           the same four GEMM launches over all tokens with s = 1; or, when the forward ran it
                            as expert E (its rows first, s = 1 there), inside the launches above, plus
                            its two weight-gradient launches over rows 0 .. T-1
    combine                 dx[t] = dx_shared[t] + Σ_j dx_rows[slot_row[t, j]]  (fp32, j in order), and in
                            the same launch d_topk_w[t, j] = Σ pieces of row slot_row[t, j], in column order

Nothing here uses atomics or reads device data back: every output element is written by one
thread or one CTA in a fixed order, so gradients are bitwise reproducible and a token's dx
and router gradient do not depend on the rest of the batch. The weight gradients sum each
expert's rows in canonical order.
"""

from __future__ import annotations

import torch

from . import grad_ops, ops
from .fused_forward import ForwardResult, check_tile_multiples, single_expert_tiles, stacked_weights
from .reference import SharedExpert
from .reference_backward import Gradients
from .saved_mxfp8 import unpack_saved
from .schedule import check_schedule, shared_prefix_rows
from .validation import check_main_grads, check_moe_inputs, check_tensor


def _shared_backward(x, dout, shared, shared_h, dtype, main_grads, weight_grads=True):
    """dx, (dW_gate, dW_up, dW_down) of the shared expert (one expert over every token, s = 1); the
    weight gradients None unless ``weight_grads``."""
    num_tokens = x.shape[0]
    tiles = single_expert_tiles(num_tokens, x.device)
    w_gate, w_up, w_down = shared
    dh, a, _ = grad_ops.swiglu_backward_gemm(dout, w_down[None], tiles, shared_h)
    dx = ops.grouped_gemm(dh, w_gate[None], tiles, b2=w_up[None], b_major="n", k_split=True)
    return dx, (_shared_weight_grads(dout, a, dh, x, dtype, main_grads) if weight_grads else None)


def _shared_weight_grads(dout, a, dh, x, dtype, main_grads):
    """(dW_gate, dW_up, dW_down) of the shared expert from its T rows: dout, a (s = 1), dh, x."""
    offsets = torch.arange(2, dtype=torch.int32, device=x.device) * x.shape[0]  # [0, T]: all rows
    d_down = _weight_grad(dout, a, offsets, dtype, None if main_grads is None else main_grads[2][None])
    d_gate, d_up = _gate_up_grad(dh, x, offsets, dtype, None if main_grads is None else (main_grads[0][None], main_grads[1][None]))
    return d_gate[0], d_up[0], d_down[0]


def _weight_grad(a, b, offsets, dtype, main_grad, counts=None):
    """One weight gradient, fresh in ``dtype`` or added into ``main_grad``; ``counts``: the experts'
    unpadded row counts (the kernel then skips the K tiles of padding alone)."""
    if main_grad is not None:
        return grad_ops.weight_grad(a, b, offsets, counts=counts, out=main_grad, accumulate=True)
    return grad_ops.weight_grad(a, b, offsets, counts=counts, out_dtype=dtype)


def _gate_up_grad(dh, x_rows, offsets, dtype, main_grads, counts=None):
    """dW_gate, dW_up from the two column halves of dh, each into its own tensor, in one launch."""
    if main_grads is None:
        return grad_ops.weight_grad(dh, x_rows, offsets, counts=counts, out_dtype=dtype, split_out=True)
    return grad_ops.weight_grad(dh, x_rows, offsets, counts=counts, out=tuple(main_grads), accumulate=True, split_out=True)


def moe_backward(
    dout: torch.Tensor,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    shared: SharedExpert | tuple | None,
    saved: ForwardResult,
    *,
    grad_dtype: torch.dtype = torch.bfloat16,
    main_grads: tuple | None = None,
    weight_grads: bool = True,
) -> Gradients:
    """All gradients of the layer for ``dout`` [T, H] bf16, after ``moe_forward(..., save_for_backward=True)``.

    Returns :class:`mok.reference_backward.Gradients`: dx [T, H] bf16, d_topk_w [T, k] fp32,
    weight gradients in ``grad_dtype`` (bf16 or fp32). ``main_grads``, if given, is
    (d_w_gate, d_w_up, d_w_down[, shared_gate, shared_up, shared_down]) fp32 buffers shaped
    like the weights; the weight gradients are added into them (Megatron's main_grad) and
    returned. ``weight_grads=False`` (frozen experts): dx and d_topk_w only, the weight-gradient
    GEMMs not run (the weight gradients None).
    """
    num_tokens, hidden, inter, num_experts, _ = check_moe_inputs(
        x, topk_idx, topk_w, w_gate, w_up, w_down, shared,
        dtypes=(torch.bfloat16,), router_dtypes=(torch.float32,), contiguous=True, check_range=False,
    )
    check_tile_multiples(hidden, inter, shared)
    check_tensor("dout", dout, dtypes=(torch.bfloat16,), shape=(num_tokens, hidden), device=x.device, contiguous=True)
    shared_rows = getattr(saved.schedule, "shared_rows", 0)  # (its shared expert's h is then h[:T])
    if saved.h is None or (shared is not None and saved.shared_h is None and not shared_rows):
        raise ValueError("saved: the forward did not keep h; call moe_forward(..., save_for_backward=True)")
    if grad_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"grad_dtype: expected torch.bfloat16 or torch.float32, got {grad_dtype}")
    check_main_grads(main_grads, (w_gate, w_up, w_down), None if shared is None else tuple(shared), weight_grads)
    sched = check_schedule(
        "saved.schedule", saved.schedule, num_tokens=num_tokens, topk=topk_idx.shape[1], num_experts=num_experts, device=x.device
    )
    saved = unpack_saved(saved, inter, None if shared is None else shared[0].shape[0])  # (an MXFP8 h back to bf16: the used rows)
    check_tensor("saved.h", saved.h, dtypes=(torch.bfloat16,), shape=(sched.capacity, 2 * w_gate.shape[1]), device=x.device, contiguous=True)
    if shared_rows and (shared is None or tuple(shared[0].shape) != tuple(w_gate.shape[1:])
                        or shared_rows != shared_prefix_rows(num_tokens, sched.block_m)):
        raise ValueError(
            f"saved.schedule: has {shared_rows} rows of a shared expert in front; expected a shared expert of the "
            f"routed experts' shapes and {shared_prefix_rows(num_tokens, sched.block_m)} rows for {num_tokens} tokens"
        )
    if shared is not None and not shared_rows:
        check_tensor("saved.shared_h", saved.shared_h, dtypes=(torch.bfloat16,), shape=(num_tokens, 2 * shared[0].shape[0]),
                     device=x.device, contiguous=True)

    weights = (w_gate, w_up, w_down)
    if sched.shared_rows:  # the forward ran the shared expert as expert E, its rows first
        weights = stacked_weights(w_gate, w_up, w_down, shared)
    if weight_grads:
        dout_rows, x_rows = ops.gather_rows_pair(dout, x, sched.row_token)  # (x_rows: not saved by the forward)
    else:
        dout_rows, x_rows = ops.gather_rows(dout, sched.row_token), None
    dh, a_scaled, partial = grad_ops.swiglu_backward_gemm(
        dout_rows, weights[2], sched.tile_expert, saved.h, row_token=sched.row_token, row_slot=sched.row_slot, topk_w=topk_w
    )
    dx_rows = ops.grouped_gemm(dh, weights[0], sched.tile_expert, b2=weights[1], b_major="n", k_split=True)
    offsets, counts = sched.expert_offsets, sched.expert_counts
    d_gate = d_up = d_down = None
    if weight_grads:
        d_down = _weight_grad(dout_rows, a_scaled, offsets, grad_dtype, None if main_grads is None else main_grads[2], counts)
        d_gate, d_up = _gate_up_grad(dh, x_rows, offsets, grad_dtype, None if main_grads is None else main_grads[:2], counts)

    dx_shared = d_shared = None
    if sched.shared_rows:  # its dx rows, and its weight gradients from its rows (views [:T]: what _shared_backward reads)
        dx_shared = dx_rows[:num_tokens]
        rows = slice(0, num_tokens)
        if weight_grads:
            d_shared = _shared_weight_grads(
                dout_rows[rows], a_scaled[rows], dh[rows], x_rows[rows], grad_dtype, None if main_grads is None else main_grads[3:]
            )
    elif shared is not None:
        dx_shared, d_shared = _shared_backward(
            x, dout, shared, saved.shared_h, grad_dtype, None if main_grads is None else main_grads[3:], weight_grads
        )
    d_topk_w = torch.empty(sched.slot_row.shape, dtype=torch.float32, device=x.device)
    dx = ops.combine(  # unweighted (s is already inside dh), and d_topk_w from the SwiGLU backward's pieces
        dx_rows, None, dx_shared, slot_row=sched.slot_row, router=(partial, d_topk_w)
    )
    return Gradients(dx, d_topk_w, d_gate, d_up, d_down, d_shared)
