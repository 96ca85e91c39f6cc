"""The MoE backward with its GEMMs on MXFP8 operands (SM100: block-scaled tcgen05 MMAs), after
mok.mxfp8_forward's forward (``save_for_backward=True``).

    gather (one launch)      dout_rows, x_rows [R, H] bf16 (as mok/fused_backward.py)
    quantize                 dout_rows in MXFP8 along H
    MXFP8 grouped GEMM       dA_u = dout_rows·W_down (W_down transposed, in MXFP8 along H), with the
                             SwiGLU backward in the epilogue: dh [R, 2I], s·a [R, I], router pieces
    quantize                 dh in MXFP8 along I (no block straddles gate and up: I % 32 == 0)
    MXFP8 grouped GEMM, K split  dx_rows = dh_gate·W_gate + dh_up·W_up (W transposed, along I)
    quantize along the rows  dout_rows, s·a, dh, x_rows: blocks of 32 rows down each column (their
                             K in the weight gradients; an expert's rows start on a 128-row tile)
    MXFP8 weight gradients   dW_down[e] = dout_rowsᵀ·(s·a), [dW_gate; dW_up][e] = dhᵀ·x_rows, fp32 sums
    shared expert, combine   bf16, as the bf16 backward

``wgrad_format="bf16"`` keeps the weight gradients on the bf16 rows instead (the bf16 backward's
kernels). ``main_grads``: the weight gradients added into fp32 buffers by the weight-gradient GEMMs
themselves (Megatron's main_grad, as mok/fused_backward.py does). A packed MXFP8 h
(mok/saved_mxfp8.py) is turned back into bf16 first. Deterministic and batch invariant as the
bf16 backward (per-row and per-expert-block quantization, one CTA per output tile, fixed orders). ``emulate=True`` runs the same numerics on
Hopper (the GEMMs' operands dequantized, exactly, into the bf16 GEMMs). The MXFP8 GEMMs are
compile-verified only (no SM100 GPU was available).
"""

from __future__ import annotations

import torch

from . import grad_ops, ops
from .fused_backward import _gate_up_grad, _shared_backward, _weight_grad
from .fused_forward import ForwardResult
from .mxfp8 import rows_scale_layout
from .mxfp8_forward import (
    Mxfp8ExpertWeights, check_mxfp8_device, check_mxfp8_weights, dequantized_rows, dequantized_weights, mxfp8_grouped_gemm,
)
from .reference import SharedExpert
from .reference_backward import Gradients
from .saved_mxfp8 import unpack_saved
from .schedule import check_schedule
from .validation import check_main_grads, check_moe_inputs, check_tensor


def mxfp8_moe_backward(
    dout: torch.Tensor,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    weights_t: Mxfp8ExpertWeights,
    shared: SharedExpert | tuple | None,
    saved: ForwardResult,
    *,
    grad_dtype: torch.dtype = torch.bfloat16,
    wgrad_format: str = "mxfp8",
    emulate: bool = False,
    main_grads: tuple | None = None,
    weight_grads: bool = True,
) -> Gradients:
    """All gradients of the layer for ``dout`` [T, H] bf16 (module docstring), after
    ``mxfp8_moe_forward(..., save_for_backward=True)``. ``weights_t``: the expert weights from
    ``quantize_expert_weights(w_gate, w_up, w_down, transposed=True)``. Returns
    mok.reference_backward.Gradients: dx [T, H] bf16, d_topk_w [T, k] fp32, weight gradients in
    ``grad_dtype`` (bf16 or fp32), or, with ``main_grads`` (one fp32 buffer per weight: gate, up,
    down[, shared gate, up, down]), added into those and returned as them; ``weight_grads=False``
    (frozen experts): dx and d_topk_w only (the weight gradients None)."""
    if not isinstance(weights_t, Mxfp8ExpertWeights) or not weights_t.transposed:
        got = "the forward's copies (transposed=False)" if isinstance(weights_t, Mxfp8ExpertWeights) else type(weights_t).__name__
        raise TypeError(f"weights_t: expected Mxfp8ExpertWeights (quantize_expert_weights(..., transposed=True)), got {got}")
    gate_t, up_t, down_t = weights_t.gate[0], weights_t.up[0], weights_t.down[0]
    # the forward's shapes of the weights (views, for the shared checks): gate, up [E, I, H], down [E, H, I]
    forward_shapes = (gate_t.transpose(1, 2), up_t.transpose(1, 2), down_t.transpose(1, 2))
    num_tokens, hidden, inter, num_experts, _ = check_moe_inputs(
        x, topk_idx, topk_w, *forward_shapes, shared, dtypes=(torch.bfloat16, torch.float8_e4m3fn), router_dtypes=(torch.float32,),
        check_range=False,
    )
    check_tensor("x", x, dtypes=(torch.bfloat16,), contiguous=True)
    check_mxfp8_weights(weights_t, shared, x.device, "weights_t")
    check_tensor("dout", dout, dtypes=(torch.bfloat16,), shape=(num_tokens, hidden), device=x.device, contiguous=True)
    if grad_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"grad_dtype: expected torch.bfloat16 or torch.float32, got {grad_dtype}")
    if wgrad_format not in ("mxfp8", "bf16"):
        raise ValueError(f"wgrad_format: expected 'mxfp8' or 'bf16', got {wgrad_format!r}")
    check_main_grads(main_grads, forward_shapes, None if shared is None else tuple(shared), weight_grads)
    if not isinstance(saved, ForwardResult) or saved.h is None or (shared is not None and saved.shared_h is None):
        raise ValueError("saved: expected the ForwardResult of mxfp8_moe_forward(..., save_for_backward=True)")
    sched = check_schedule(
        "saved.schedule", saved.schedule, num_tokens=num_tokens, topk=topk_idx.shape[1], num_experts=num_experts, device=x.device
    )
    if getattr(sched, "shared_rows", 0):
        raise ValueError("saved.schedule: has a shared expert's rows in front; mxfp8_moe_forward never puts them there")
    saved = unpack_saved(saved, inter, None if shared is None else shared[0].shape[0])  # (an MXFP8 h back to bf16: the used rows)
    check_tensor("saved.h", saved.h, dtypes=(torch.bfloat16,), shape=(sched.capacity, 2 * inter), device=x.device, contiguous=True)
    check_mxfp8_device("mxfp8_moe_backward", x, emulate)

    used = sched.expert_offsets[-1:]  # the rows in use (tile-aligned), on the device
    dout_rows, x_rows = ops.gather_rows_pair(dout, x, sched.row_token)
    dout_q = ops.quantize_mxfp8(dout_rows, rows_used=used, scale_order="mma")
    route = dict(row_token=sched.row_token, row_slot=sched.row_slot, topk_w=topk_w.contiguous())
    if emulate:
        w_down = dequantized_weights(weights_t.down).transpose(1, 2).contiguous()  # [E, H, I], the values of the MXFP8 copy
        dh, a_scaled, partial = grad_ops.swiglu_backward_gemm(dequantized_rows(dout_q, used), w_down, sched.tile_expert, saved.h, **route)
    else:
        dh, a_scaled, partial = grad_ops.swiglu_backward_gemm_mxfp8(dout_q, weights_t.down, sched.tile_expert, saved.h, **route)
    dh_q = ops.quantize_mxfp8(dh, rows_used=used, scale_order="mma")
    dx_rows = mxfp8_grouped_gemm(dh_q, weights_t.gate, sched.tile_expert, weights_t.up, used=used, k_split=True, emulate=emulate)
    offsets, counts = sched.expert_offsets, sched.expert_counts
    d_gate = d_up = d_down = None  # (stay None with weight_grads=False)
    if weight_grads and wgrad_format == "bf16":
        d_down = _weight_grad(dout_rows, a_scaled, offsets, grad_dtype, None if main_grads is None else main_grads[2], counts)
        d_gate, d_up = _gate_up_grad(dh, x_rows, offsets, grad_dtype, None if main_grads is None else main_grads[:2], counts)
    elif weight_grads:
        columns = [ops.quantize_mxfp8_columns(t, rows_used=used, scale_order="mma") for t in (dout_rows, a_scaled, dh, x_rows)]
        if emulate:
            columns = [dequantized_columns(q) for q in columns]
        weight_grad = grad_ops.weight_grad if emulate else grad_ops.weight_grad_mxfp8
        wgrad = dict(offsets=offsets, counts=counts, out_dtype=grad_dtype)
        down_into, gate_up_into = {}, {}  # (fresh tensors, or added into the main_grad buffers)
        if main_grads is not None:
            down_into, gate_up_into = dict(out=main_grads[2], accumulate=True), dict(out=tuple(main_grads[:2]), accumulate=True)
        d_down = weight_grad(columns[0], columns[1], **wgrad, **down_into)
        d_gate, d_up = weight_grad(columns[2], columns[3], split_out=True, **wgrad, **gate_up_into)
    dx_shared = d_shared = None
    if shared is not None:
        shared_mains = None if main_grads is None else main_grads[3:]
        dx_shared, d_shared = _shared_backward(x, dout, tuple(shared), saved.shared_h, grad_dtype, shared_mains, weight_grads)
    d_topk_w = torch.empty(sched.slot_row.shape, dtype=torch.float32, device=x.device)
    dx = ops.combine(dx_rows, None, dx_shared, slot_row=sched.slot_row, router=(partial, d_topk_w))
    return Gradients(dx, d_topk_w, d_gate, d_up, d_down, d_shared)


def dequantized_columns(q: tuple) -> torch.Tensor:
    """bf16 [R, M] of a matrix quantized along its rows (elements [R, M], MMA-ordered scales, as
    ops.quantize_mxfp8_columns gives them), exact; the emulation's weight-gradient operands (rows
    the quantizer left unconverted come out as whatever they hold: no expert's range reads them)."""
    elements, scales = q
    transposed = ops.dequantize_mxfp8(elements.T.contiguous(), rows_scale_layout(scales, elements.shape[1]))
    return transposed.T.contiguous()
