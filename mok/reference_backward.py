"""The MoE layer's backward written out as the fused kernels compute it, in plain PyTorch.

Autograd of :func:`mok.reference.moe_reference` is the oracle; this module spells out the
same gradients in the order and with the intermediates of the planned kernels, so that each
kernel has a reference for exactly what it produces, and so that the formulation itself is
checked against autograd (tests/test_reference_backward.py). Per row (token t, slot j) of
expert e, with s = topk_w[t, j] and g = dout[t]:

    h_g = x·W_gᵀ + b_g, h_u = x·W_uᵀ + b_u, a = act(h_g, h_u)   (recomputed here; the kernels read the saved h)
    dA_unscaled = g·W_d                                      (down-projection backward)
    d_topk_w[t, j] = rowsum(dA_unscaled ⊙ a) + <g, b_d>      (= <g, y>; y is never formed)
    dA = s·dA_unscaled
    d_h_g = dA ⊙ ∂a/∂h_g,  d_h_u = dA ⊙ ∂a/∂h_u              (the activation's backward: SwiGLU's
                                                             d_h_g = dA ⊙ h_u ⊙ silu'(h_g), d_h_u = dA ⊙ silu(h_g))
    dx_slot = d_h_g·W_g + d_h_u·W_u
    dW_d[e] += (s·g)ᵀ·a,  dW_g[e] += d_h_gᵀ·x,  dW_u[e] += d_h_uᵀ·x   (rows in canonical order)
    db_d[e] += Σ_rows s·g,  db_g[e] += Σ_rows d_h_g,  db_u[e] += Σ_rows d_h_u    (with biases: column sums)
    dx[t] = dx_shared[t] + Σ_j dx_slot[t, j]                  (j in increasing order)

The shared expert is the same with s = 1 and every token as a row.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .kernels.constants import CLAMP_LIMIT, CLAMPED_ALPHA, GELU_CUBIC, GELU_SCALE
from .reference import RoutedExperts, expert_rows, gated_activation
from .validation import FLOAT_DTYPES, check_moe_inputs, check_tensor


class Gradients(NamedTuple):
    """Gradients of the layer's inputs and weights (shared ones None without a shared expert)."""

    dx: torch.Tensor
    d_topk_w: torch.Tensor
    d_w_gate: torch.Tensor
    d_w_up: torch.Tensor
    d_w_down: torch.Tensor
    d_shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    d_biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # the routed experts' (gate, up, down), given biases


def silu_grad(z: torch.Tensor) -> torch.Tensor:
    """d silu(z) / dz = σ(z)·(1 + z·(1 - σ(z)))."""
    sig = torch.sigmoid(z)
    return sig * (1 + z * (1 - sig))


def gated_activation_partials(activation: str, h_g: torch.Tensor, h_u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(∂a/∂h_g, ∂a/∂h_u) of a = act(h_g, h_u) (mok.reference.gated_activation), written out; a clamp
    passes the gradient where its input lies within its bounds, ends included (as torch.clamp's)."""
    if activation == "clamped_swiglu":
        gate, up = h_g.clamp(max=CLAMP_LIMIT), h_u.clamp(-CLAMP_LIMIT, CLAMP_LIMIT)
        sig = torch.sigmoid(CLAMPED_ALPHA * gate)
        d_gate = (up + 1) * sig * (1 + CLAMPED_ALPHA * gate * (1 - sig)) * (h_g <= CLAMP_LIMIT)
        return d_gate, gate * sig * ((h_u >= -CLAMP_LIMIT) & (h_u <= CLAMP_LIMIT))
    if activation == "geglu":
        t = torch.tanh(GELU_SCALE * (h_g + GELU_CUBIC * h_g**3))
        d_gelu = 0.5 * (1 + t) + 0.5 * h_g * (1 - t * t) * GELU_SCALE * (1 + 3 * GELU_CUBIC * h_g**2)
        return h_u * d_gelu, 0.5 * h_g * (1 + t)
    return h_u * silu_grad(h_g), torch.nn.functional.silu(h_g)


def expert_backward(rows_x, g, scale, w_gate, w_up, w_down, activation="swiglu", biases=None):
    """Backward of one expert's gated MLP over a block of rows.

    rows_x [M, H], g [M, H] (dout of each row's token), scale [M] (its router weight; ones for
    the shared expert), biases None or the expert's (b_gate [I], b_up [I], b_down [H]). Returns
    (dx_rows [M, H], d_scale [M], dW_gate, dW_up, dW_down, (db_gate, db_up, db_down) or None).
    """
    h_g = rows_x @ w_gate.T
    h_u = rows_x @ w_up.T
    if biases is not None:
        h_g, h_u = h_g + biases[0], h_u + biases[1]
    a = gated_activation(activation, h_g, h_u)
    da_unscaled = g @ w_down
    d_scale = (da_unscaled * a).sum(1)
    da = scale[:, None] * da_unscaled
    partial_g, partial_u = gated_activation_partials(activation, h_g, h_u)
    d_h_g, d_h_u = da * partial_g, da * partial_u
    dx_rows = d_h_g @ w_gate + d_h_u @ w_up
    scaled_g = scale[:, None] * g
    d_w_down = scaled_g.T @ a
    d_biases = None
    if biases is not None:
        d_scale = d_scale + g @ biases[2]
        d_biases = (d_h_g.sum(0), d_h_u.sum(0), scaled_g.sum(0))
    return dx_rows, d_scale, d_h_g.T @ rows_x, d_h_u.T @ rows_x, d_w_down, d_biases


def moe_backward_reference(
    x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
    shared: tuple | None,
    dout: torch.Tensor,
    *,
    dtype: torch.dtype = torch.float32,
    activation: str = "swiglu",
    biases: tuple | None = None,
) -> Gradients:
    """All gradients of :func:`mok.reference.moe_reference` (with ``activation`` and ``biases``) for
    the output gradient ``dout`` [T, H]."""
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype: expected float32 or float64, got {dtype}")
    num_tokens, hidden, _, num_experts, topk = check_moe_inputs(x, topk_idx, topk_w, w_gate, w_up, w_down, shared, biases=biases)
    experts = RoutedExperts(w_gate, w_up, w_down)
    check_tensor("dout", dout, dtypes=FLOAT_DTYPES, shape=(num_tokens, hidden), device=x.device)

    xc, wc, g = (t.to(dtype) for t in (x, topk_w, dout))
    wg, wu, wd = (t.to(dtype) for t in experts)
    dx_slot = xc.new_zeros(num_tokens, topk, hidden)
    d_topk_w = wc.new_zeros(num_tokens, topk)
    d_wg, d_wu, d_wd = torch.zeros_like(wg), torch.zeros_like(wu), torch.zeros_like(wd)
    biases = None if biases is None else [t.to(dtype) for t in biases]
    d_biases = None if biases is None else [torch.zeros_like(t) for t in biases]
    for e in range(num_experts):
        tok, slot = expert_rows(topk_idx, e)
        if tok.numel() == 0:
            continue
        mine = None if biases is None else [t[e] for t in biases]
        dx_rows, d_s, d_wg[e], d_wu[e], d_wd[e], d_b = expert_backward(xc[tok], g[tok], wc[tok, slot], wg[e], wu[e], wd[e], activation, mine)
        dx_slot[tok, slot] = dx_rows
        d_topk_w[tok, slot] = d_s
        for grad, part in zip(d_biases or (), d_b or ()):
            grad[e] = part

    dx = xc.new_zeros(num_tokens, hidden)
    d_shared = None
    if shared is not None:
        sg, su, sd = (t.to(dtype) for t in shared)
        dx, _, d_sg, d_su, d_sd, _ = expert_backward(xc, g, xc.new_ones(num_tokens), sg, su, sd, activation)
        d_shared = (d_sg, d_su, d_sd)
    for j in range(topk):
        dx = dx + dx_slot[:, j]
    return Gradients(dx, d_topk_w, d_wg, d_wu, d_wd, d_shared, None if d_biases is None else tuple(d_biases))
