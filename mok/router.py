"""The built-in router's logits on MoK's own GEMMs: :func:`router_logits` and its backward.

Why not ``nn.Linear``: cuBLAS picks its kernel (tile shape, split-K) from the token count, so
one token's logits, and with them its experts, can change with the rest of the batch. MoK's
GEMMs pick every tile from the static shape (H, E) alone and give each output element one
fixed reduction order over H, so logits[t] depends on x[t] and the weight only: routing is
then batch- and EP-invariant like the experts. The backward keeps that for dx (the same GEMM,
reducing over the experts); the weight gradient, a sum over the batch, comes from the
weight-gradient kernel (rows in order, one CTA per output tile, no atomics).

The experts are padded to a multiple of 128 (the GEMMs' column tile) with zero weight rows;
:func:`padded_logits` returns the padded logits and :func:`router_logits` slices them off, so
the padding's gradient is zero and adds nothing (exact zeros in an fp32 sum). Eager calls go
through :class:`EagerRouterLogits` over the forward and backward functions, torch.compile through
the ops ``mok::router_logits`` / ``mok::router_logits_backward`` over the same two (the same bits;
mok.torch_ops.router_logits picks). On the CPU, and for dtypes other than bf16: ``F.linear``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from .ops.common import check_32bit_rows, persistent_default
from .ops.gemm import launch_grouped_gemm
from .ops.weight_grads import launch_weight_grad
from .plan import padded_experts, router_variants
from .runtime.arch import check_fused_layer_device
from .validation import check_tensor


def runs_on_mok(x: Tensor, weight: Tensor) -> bool:
    """Check the router's inputs (x [T, H], weight [E, H]); whether MoK's GEMMs compute the logits
    (bf16 CUDA tensors, H % 8 == 0) rather than ``F.linear``."""
    check_tensor("x", x, ndim=2)
    check_tensor("router weight", weight, ndim=2, dtypes=(x.dtype,), device=x.device)
    if weight.shape[1] != x.shape[1]:
        raise ValueError(f"router weight: expected [E, {x.shape[1]}] (x's width), got {list(weight.shape)}")
    if not (x.is_cuda and x.dtype == torch.bfloat16):
        return False
    if x.shape[1] % 8:
        raise ValueError(f"x: expected a width that is a multiple of 8 (16-byte rows) for MoK's router GEMM, got {x.shape[1]}")
    return True


def _padded_weight(weight: Tensor) -> Tensor:
    """weight [E, H] with zero rows appended up to E padded (itself when E is a multiple already)."""
    extra = padded_experts(weight.shape[0]) - weight.shape[0]
    return F.pad(weight, (0, 0, 0, extra)) if extra else weight


def _aligned(t: Tensor) -> Tensor:
    """t, or a copy of it where its data pointer is not 16-byte aligned (TMA's requirement)."""
    return t.clone() if t.data_ptr() % 16 else t


def _row_tiles(rows: int, device: torch.device) -> Tensor:
    """The tile_expert argument of a one-expert grouped GEMM: every 128-row tile is expert 0."""
    return torch.zeros(-(-rows // 128), dtype=torch.int32, device=device)


@functools.cache
def _gemms(device_index: int, hidden: int, num_experts: int) -> tuple:
    """(logits, dx, weight-gradient) kernel variants for this device: the ones ``mok precompile``
    lists (mok.plan.router_variants), looked up once per shape instead of per call (the
    router's tensors are made here, so the ops' per-call argument checks are not needed)."""
    return tuple(router_variants(hidden, num_experts, persistent=persistent_default(torch.device("cuda", device_index))))


def _check_launch(x: Tensor, num_experts: int) -> None:
    """Where the router's GEMMs may run: MoK's fused-layer GPUs, x on the current device, 32-bit indexable."""
    check_fused_layer_device(x.device.index)
    check_32bit_rows("x", x.shape[0], max(x.shape[1], padded_experts(num_experts)))


def padded_logits(x: Tensor, weight: Tensor) -> Tensor:
    """Padded logits [T, padded_experts(E)] bf16 from x [T, H] and weight [E, H] (MoK's grouped GEMM, one expert)."""
    num_tokens, num_experts = x.shape[0], weight.shape[0]
    _check_launch(x, num_experts)
    logits = x.new_empty(num_tokens, padded_experts(num_experts))
    if num_tokens:
        w = _aligned(_padded_weight(weight)).unsqueeze(0)
        variant = _gemms(x.device.index, x.shape[1], num_experts)[0]
        launch_grouped_gemm(
            variant, x.device, a=_aligned(x), b=w, b2=w, c=logits, tile_expert=_row_tiles(num_tokens, x.device), num_rows=num_tokens,
            num_experts=1,
        )
    return logits


def padded_logits_backward(d_logits: Tensor, x: Tensor, weight: Tensor, want_dx: bool, want_dw: bool) -> tuple[Tensor, Tensor]:
    """(dx [T, H], d_weight [E, H]) from the padded logits' gradient [T, padded E]; an empty
    tensor for one not wanted. dx = d_logits · W (reduced over the experts in the GEMM's fixed
    order); d_weight = d_logitsᵀ · x over all T rows in order (fp32 accumulation, bf16 out)."""
    (num_tokens, hidden), num_experts = x.shape, weight.shape[0]
    _check_launch(x, num_experts)
    check_tensor("d_logits", d_logits, dtypes=(x.dtype,), shape=(num_tokens, padded_experts(num_experts)), device=x.device)
    _, dx_gemm, dw_gemm = _gemms(x.device.index, hidden, num_experts)
    d_logits = _aligned(d_logits.contiguous())
    dx = x.new_empty(x.shape) if want_dx else x.new_empty(0)
    d_weight = weight.new_empty(padded_experts(num_experts), hidden) if want_dw else weight.new_empty(0)
    if want_dw and not num_tokens:  # (a sum over no tokens)
        d_weight.zero_()
    if num_tokens and want_dx:
        w = _aligned(_padded_weight(weight)).unsqueeze(0)  # [1, K = padded E, N = H]
        launch_grouped_gemm(
            dx_gemm, x.device, a=d_logits, b=w, b2=w, c=dx, tile_expert=_row_tiles(num_tokens, x.device), num_rows=num_tokens, num_experts=1,
        )
    if num_tokens and want_dw:
        offsets = torch.arange(2, dtype=torch.int32, device=x.device) * num_tokens  # one expert: rows 0 .. T
        launch_weight_grad(dw_gemm, d_logits, _aligned(x), offsets, None, [d_weight])
    if want_dw and d_weight.shape[0] != num_experts:
        d_weight = d_weight[:num_experts].contiguous()
    return dx, d_weight


def route(logits: Tensor, topk: int) -> tuple[Tensor, Tensor]:
    """Softmax over experts in fp32, top-k, weights renormalised to sum to 1: (topk_idx int32, topk_w fp32)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, idx = probs.topk(topk, dim=-1)
    return idx.to(torch.int32), weights / weights.sum(-1, keepdim=True)


def route_backward(d_weights: Tensor, logits: Tensor, topk: int) -> Tensor:
    """The logits' gradient for the routing weights' gradient ``d_weights``: the operations eager
    autograd runs through :func:`route` (division, sum, top-k's scatter, softmax's backward, the
    cast back), written out in its order, so the same bits (tests hold it to autograd)."""
    probs = torch.softmax(logits.float(), dim=-1)
    raw, idx = probs.topk(topk, dim=-1)
    total = raw.sum(-1, keepdim=True)
    d_raw = d_weights / total + (-d_weights * ((raw / total) / total)).sum(-1, keepdim=True).expand_as(raw)
    d_probs = torch.zeros_like(probs).scatter(-1, idx.long(), d_raw)
    return torch._softmax_backward_data(d_probs, probs, -1, torch.float32).to(logits.dtype)


class EagerRouterLogits(torch.autograd.Function):
    """The same two functions as the ops, for eager calls: the GPU machine spent several hundred
    µs of host time per call in torch.library's dispatch of the two ops
    (docs/notes/router-batch-invariance.md), more than the GEMMs' device time; torch.compile
    still gets the ops."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight)
        return padded_logits(x, weight)

    @staticmethod
    def backward(ctx, d_logits: Tensor):
        x, weight = ctx.saved_tensors
        want_dx, want_dw = ctx.needs_input_grad[:2]
        if not (want_dx or want_dw):
            return None, None
        dx, d_weight = padded_logits_backward(d_logits, x, weight, want_dx, want_dw)
        return (dx if want_dx else None), (d_weight if want_dw else None)
