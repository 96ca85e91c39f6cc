"""Expert-parallel backward over the symmetric workspace: a first, multi-launch version.

After :func:`mok.ep.ep_moe_forward_saved`, per rank and call, on the rank's stream, with no
host synchronisation (the same steps as mok/fused_backward.py, plus the exchanges; an h kept in
MXFP8 is turned back into bf16 first, as there):

    publish      dout and topk_w into this rank's regions; signal every rank (one launch)
    gather       once every rank published (bounded wait, same launch): every rank's router
                 weights -> [W·T_max, k] (the s of each local row)
    pull         each local row's dout from its token's rank (reverse combine)
    SwiGLU bwd   dA_u = dout_rows·W_down with the SwiGLU backward and the router-gradient
                 pieces in the epilogue -> dh, s·a, pieces
    dx GEMM      dx rows = dh_gate·W_gate + dh_up·W_up, each written straight into its token's
                 rank, slot [t, j] (no dx_rows buffer, no push kernel)
    router grad  the pieces of each (token, slot) this rank computed, in column order, into
                 this rank's "dw" region
    signal       every rank (after NaN into what a capacity bound dropped, if one is set)
    weight grads this rank's experts over their rows in canonical order (while peers push)
    shared       the shared expert's gradients over this rank's tokens
    wait         until every rank pushed (bounded)
    d_topk_w     each (t, j) read from the "dw" region of the rank that owns its expert
    combine      dx[t] = dx_shared[t] + Σ_j slots[t, j] (fp32, j in order)

Every row and every expert's weight gradient is computed exactly as the single-GPU backward
computes it on the concatenated batch (same kernels, same rows in the same order), so the
gradients are the same bits. The shared expert's weight gradients cover this rank's tokens
only: sum them over ranks as data-parallel gradients are summed.
"""

from __future__ import annotations

import torch

from . import grad_ops, ops
from .ep import (
    EPForwardResult, EPWorkspace, _kernels, announce_pushed, check_ep_inputs, check_rows_aligned, gather_ranks, publish, pull_rows,
    scatter_into_slots, wait_pushed,
)
from .fused_backward import _gate_up_grad, _shared_backward, _weight_grad
from .fused_forward import check_tile_multiples
from .reference_backward import Gradients
from .saved_mxfp8 import unpack_saved
from .schedule import check_schedule
from .validation import check_main_grads, check_tensor, check_timeout


def ep_moe_backward(
    ws: EPWorkspace,
    dout: torch.Tensor,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_w: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    shared: tuple | None,
    saved: EPForwardResult,
    *,
    grad_dtype: torch.dtype = torch.bfloat16,
    main_grads: tuple | None = None,
    timeout_s: float = 5.0,
    weight_grads: bool = True,
) -> Gradients:
    """This rank's gradients for ``dout`` [T_r, H] bf16: dx [T_r, H], d_topk_w [T_r, k] fp32,
    the weight gradients of this rank's experts (and of the shared expert over this rank's
    tokens) in ``grad_dtype``. ``saved``: this rank's ``ep_moe_forward_saved`` of the same
    inputs. ``main_grads``: as in :func:`mok.fused_backward.moe_backward` (fp32 buffers shaped
    like this rank's weights, the gradients added into them); ``weight_grads=False`` (frozen
    experts): dx and d_topk_w only, no weight-gradient GEMM (ranks may differ in it: it exchanges
    nothing). Every rank of the workspace must make the same sequence of calls, each ordered after
    the previous one on the GPU (one stream, or the caller's events between streams).
    """
    num_tokens, hidden, num_local, topk = check_ep_inputs(ws, x, topk_idx, topk_w, w_gate, w_up, w_down, shared)
    check_tensor("dout", dout, dtypes=(torch.bfloat16,), shape=(num_tokens, hidden), device=x.device, contiguous=True)
    check_rows_aligned("dout", dout)
    if not isinstance(saved, EPForwardResult):
        raise TypeError(f"saved: expected the EPForwardResult of ep_moe_forward_saved, got {type(saved).__name__}")
    if saved.h is None or (shared is not None and saved.shared_h is None) or saved.x_rows is None:
        raise ValueError("saved: the forward did not keep h; call ep_moe_forward_saved(..., save_h=True)")
    if grad_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"grad_dtype: expected torch.bfloat16 or torch.float32, got {grad_dtype}")
    check_main_grads(main_grads, (w_gate, w_up, w_down), None if shared is None else tuple(shared), weight_grads)
    check_timeout(timeout_s)
    _check_saved_matches(saved, ws, num_tokens, hidden, num_local, topk, x.device)
    saved = unpack_saved(saved, w_gate.shape[1], None if shared is None else shared[0].shape[0])  # (an MXFP8 h back to bf16)
    check_tensor("saved.h", saved.h, dtypes=(torch.bfloat16,), shape=(saved.schedule.capacity, 2 * w_gate.shape[1]), contiguous=True)
    check_tile_multiples(hidden, w_gate.shape[1], None if shared is None else tuple(shared))
    ws.raise_pending()
    lay, dev, sched = ws.layout, x.device, saved.schedule
    k = _kernels(ws, dev)
    stream = ops._stream(dev)

    publish(ws, k, ("x", dout), ("w", topk_w.view(torch.int32)), stream)  # dout replaces x (pulled in the forward)
    weights_all = gather_ranks(ws, k, "w", timeout_s, stream).view(torch.float32)
    dout_rows = pull_rows(ws, k, "x", sched, stream)
    dh, a_scaled, partial = grad_ops.swiglu_backward_gemm(
        dout_rows, w_down, sched.tile_expert, saved.h, row_token=sched.row_token, row_slot=sched.row_slot, topk_w=weights_all
    )
    scatter_into_slots(ws, dh, w_gate, sched, b2=w_up, b_major="n", k_split=True)  # dx rows straight into their tokens' slots
    router_pieces = ws.region("dw")[: lay.world * lay.max_tokens * topk].view(lay.world * lay.max_tokens, topk)
    grad_ops.router_grad(partial, sched.slot_row, out=router_pieces)
    announce_pushed(ws, k, sched, saved.routing, stream, gradient=True)  # (router pieces too: peers read them after it)

    offsets, counts = sched.expert_offsets, sched.expert_counts  # (while the peers push)
    d_gate = d_up = d_down = None
    if weight_grads:  # (local work: the exchanges are the same either way)
        d_down = _weight_grad(dout_rows, a_scaled, offsets, grad_dtype, None if main_grads is None else main_grads[2], counts)
        d_gate, d_up = _gate_up_grad(dh, saved.x_rows, offsets, grad_dtype, None if main_grads is None else main_grads[:2], counts)
    dx_shared = d_shared = None
    if shared is not None:
        dx_shared, d_shared = _shared_backward(
            x, dout, shared, saved.shared_h, grad_dtype, None if main_grads is None else main_grads[3:], weight_grads
        )
    wait_pushed(ws, k, timeout_s, stream)

    d_topk_w = _owned_router_grads(ws, topk_idx, num_local, num_tokens)
    slots = ws.region("slots")[: num_tokens * topk * hidden].view(num_tokens, topk, hidden)
    dx = ops.combine(slots, None, dx_shared)  # unweighted: s is already inside dh
    ws.copy_record()
    return Gradients(dx, d_topk_w, d_gate, d_up, d_down, d_shared)


def _check_saved_matches(saved: EPForwardResult, ws: EPWorkspace, num_tokens: int, hidden: int, num_local: int, topk: int,
                         device: torch.device) -> None:
    """``saved`` is a forward of this call's shapes on this workspace: its output this rank's T_r
    rows, its schedule this rank's E_local experts over every rank's T_max·k pairs, its pulled rows,
    routing and h sized by that schedule (a forward of other inputs would send stale rows and slots)."""
    lay = ws.layout
    if saved.out is not None:  # (the custom op's backward rebuilds the result without it)
        check_tensor("saved.out", saved.out, shape=(num_tokens, hidden), device=device)
    sched = check_schedule("saved.schedule", saved.schedule, num_tokens=lay.world * lay.max_tokens, topk=topk,
                           num_experts=num_local, device=device)
    check_tensor("saved.x_rows", saved.x_rows, dtypes=(torch.bfloat16,), shape=(sched.capacity, hidden), device=device, contiguous=True)
    check_tensor("saved.routing", saved.routing, dtypes=(torch.int32,), shape=(lay.world * lay.max_tokens, topk), device=device)


def _owned_router_grads(ws: EPWorkspace, topk_idx: torch.Tensor, num_local: int, num_tokens: int) -> torch.Tensor:
    """d_topk_w[t, j] of this rank's tokens, each read from the "dw" region of the rank owning expert topk_idx[t, j]."""
    lay, rank = ws.layout, ws.rank
    first = rank * lay.max_tokens
    per_rank = torch.stack([
        ws.region("dw", p)[first * lay.topk:(first + num_tokens) * lay.topk].view(num_tokens, lay.topk) for p in range(lay.world)
    ])
    owner = (topk_idx // num_local).long()
    return per_rank.gather(0, owner[None]).squeeze(0)
