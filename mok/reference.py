"""Plain-PyTorch semantics of the MoE layer: the oracle every kernel is tested against.

Per token t and slot j (DESIGN.md):

    h_g = x[t]·w_gate[e]ᵀ (+ b_gate[e]),  h_u = x[t]·w_up[e]ᵀ (+ b_up[e]),  a = act(h_g, h_u),
    y[t, j] = a·w_down[e]ᵀ (+ b_down[e])
    out[t] = shared(x[t]) + Σ_{j=0..k-1} topk_w[t, j]·y[t, j]      (j in increasing order)

with e = topk_idx[t, j], act the gated activation (:func:`gated_activation`; SwiGLU,
silu(h_g)·h_u, by default) and the routed experts' biases (:class:`ExpertBiases`) where given. Everything is computed in ``dtype`` (float32 by default, float64
for finite-difference checks) from upcast inputs, and is differentiable by autograd, which
gives dx, d_topk_w and every weight gradient.

Each expert processes its rows in canonical order (token, then slot), as one matrix
product, so the expert-parallel version below feeds every expert exactly the same matrix
as the single-process version does and returns a bitwise-equal output.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .kernels.constants import CLAMP_LIMIT, CLAMPED_ALPHA, check_activation
from .validation import check_moe_inputs


class SharedExpert(NamedTuple):
    """Weights of the shared expert (unit routing weight, sees every token)."""

    gate: torch.Tensor  # [I_s, H]
    up: torch.Tensor  # [I_s, H]
    down: torch.Tensor  # [H, I_s]


class ExpertBiases(NamedTuple):
    """Biases of the routed experts held by one rank (gpt-oss has them), added to h_gate, h_up and y."""

    gate: torch.Tensor  # [E_local, I]
    up: torch.Tensor  # [E_local, I]
    down: torch.Tensor  # [E_local, H]


class RoutedExperts(NamedTuple):
    """Weights of the routed experts held by one rank."""

    gate: torch.Tensor  # [E_local, I, H]
    up: torch.Tensor  # [E_local, I, H]
    down: torch.Tensor  # [E_local, H, I]


def gated_activation(activation: str, h_gate: torch.Tensor, h_up: torch.Tensor) -> torch.Tensor:
    """a = act(h_gate, h_up), elementwise: "swiglu" silu(h_gate)·h_up; "clamped_swiglu" (gpt-oss's)
    (u + 1)·g·σ(1.702·g) with g = h_gate clamped to at most 7 and u = h_up to [-7, 7]; "geglu"
    gelu(h_gate)·h_up with gelu's tanh approximation."""
    check_activation(activation)
    if activation == "clamped_swiglu":
        gate = h_gate.clamp(max=CLAMP_LIMIT)
        return (h_up.clamp(-CLAMP_LIMIT, CLAMP_LIMIT) + 1) * (gate * torch.sigmoid(CLAMPED_ALPHA * gate))
    if activation == "geglu":
        return F.gelu(h_gate, approximate="tanh") * h_up
    return F.silu(h_gate) * h_up


def gated_mlp(rows: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, activation: str = "swiglu",
              biases: tuple | None = None) -> torch.Tensor:
    """The gated MLP of a block of rows: act(rows·w_gateᵀ + b_gate, rows·w_upᵀ + b_up)·w_downᵀ + b_down
    (SwiGLU by default; ``biases`` (b_gate [I], b_up [I], b_down [H]) or None: no biases)."""
    h_gate, h_up = rows @ w_gate.T, rows @ w_up.T
    if biases is None:
        return gated_activation(activation, h_gate, h_up) @ w_down.T
    return gated_activation(activation, h_gate + biases[0], h_up + biases[1]) @ w_down.T + biases[2]


def expert_biases(biases: ExpertBiases | None, expert: int) -> tuple | None:
    """Expert ``expert``'s (b_gate, b_up, b_down), or None without biases."""
    return None if biases is None else (biases.gate[expert], biases.up[expert], biases.down[expert])


def expert_rows(topk_idx: torch.Tensor, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, slot) pairs routed to ``expert``, in canonical order (token, then slot)."""
    tok, slot = (topk_idx == expert).nonzero(as_tuple=True)
    return tok, slot


def expert_outputs(
    x: torch.Tensor, topk_idx: torch.Tensor, experts: RoutedExperts, expert_offset: int = 0, activation: str = "swiglu",
    biases: ExpertBiases | None = None,
) -> torch.Tensor:
    """y[t, j] for every (t, j) routed to the given experts (ids from ``expert_offset``), else 0."""
    num_tokens, topk = topk_idx.shape
    y = x.new_zeros(num_tokens, topk, x.shape[1])
    for local in range(experts.gate.shape[0]):
        tok, slot = expert_rows(topk_idx, expert_offset + local)
        if tok.numel():
            mlp = gated_mlp(x[tok], experts.gate[local], experts.up[local], experts.down[local], activation, expert_biases(biases, local))
            y = y.index_put((tok, slot), mlp)
    return y


def weighted_sum(y: torch.Tensor, topk_w: torch.Tensor, base: torch.Tensor | None) -> torch.Tensor:
    """base + Σ_j topk_w[:, j]·y[:, j], accumulated in increasing j (each step: multiply, then add)."""
    acc = torch.zeros_like(y[:, 0]) if base is None else base
    for j in range(y.shape[1]):
        acc = acc + topk_w[:, j, None] * y[:, j]
    return acc


def _upcast(dtype: torch.dtype, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(dtype) for t in tensors]


def moe_reference(
    x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
    shared: SharedExpert | tuple | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    activation: str = "swiglu",
    biases: ExpertBiases | tuple | None = None,
) -> torch.Tensor:
    """MoE layer output [T, H] in ``dtype``, all E experts on this process (EP = 1); ``activation``:
    the experts' gated activation (:func:`gated_activation`), the shared expert's too; ``biases``:
    the routed experts' (b_gate, b_up, b_down) (:class:`ExpertBiases`; the shared expert has none)."""
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype: expected float32 or float64, got {dtype}")
    check_moe_inputs(x, topk_idx, topk_w, w_gate, w_up, w_down, shared, biases=biases)
    experts = RoutedExperts(w_gate, w_up, w_down)
    xc, wc = _upcast(dtype, x, topk_w)
    experts = RoutedExperts(*_upcast(dtype, *experts))
    biases = None if biases is None else ExpertBiases(*_upcast(dtype, *biases))
    y = expert_outputs(xc, topk_idx, experts, activation=activation, biases=biases)
    base = None if shared is None else gated_mlp(xc, *_upcast(dtype, *shared), activation)
    return weighted_sum(y, wc, base)


def moe_reference_ep(
    x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
    shared: SharedExpert | tuple | None = None,
    *,
    group: "torch.distributed.ProcessGroup | None" = None,
    dtype: torch.dtype = torch.float32,
    activation: str = "swiglu",
    biases: ExpertBiases | tuple | None = None,
) -> torch.Tensor:
    """Expert-parallel MoE layer over ``torch.distributed`` (gloo or NCCL); ``biases``: this rank's
    experts' (as :func:`moe_reference`'s).

    Each rank passes its own tokens (x, topk_idx with global expert ids, topk_w) and its
    E_local = E / world_size experts (rank r holds experts r·E_local ...). Rows travel by
    all_to_all to the rank of their expert and back; the result is this rank's slice of
    what :func:`moe_reference` returns for the concatenated global batch, bitwise, and
    autograd flows through the exchange. Ranks may hold different token counts.
    """
    import torch.distributed as dist

    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype: expected float32 or float64, got {dtype}")
    world = dist.get_world_size(group)
    num_local = w_gate.shape[0] if isinstance(w_gate, torch.Tensor) and w_gate.dim() == 3 else 0
    _, hidden, _, _, _ = check_moe_inputs(x, topk_idx, topk_w, w_gate, w_up, w_down, shared, experts_total=num_local * world, biases=biases)
    experts = RoutedExperts(w_gate, w_up, w_down)
    rank = dist.get_rank(group)
    group = group if group is not None else dist.group.WORLD

    xc, wc = _upcast(dtype, x, topk_w)
    experts = RoutedExperts(*_upcast(dtype, *experts))
    biases = None if biases is None else ExpertBiases(*_upcast(dtype, *biases))

    # Send side: every (t, j) pair goes to the rank that owns its expert, grouped by
    # destination and in canonical (t, j) order inside each group.
    flat_expert = topk_idx.reshape(-1).long()
    dest = flat_expert // num_local
    order = torch.sort(dest, stable=True).indices
    send_counts = torch.bincount(dest, minlength=world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
    num_recv = sum(recv_splits)

    topk = topk_idx.shape[1]
    send_tok = order // topk
    recv_expert = flat_expert.new_empty(num_recv)
    dist.all_to_all_single(recv_expert, flat_expert[order].contiguous(), recv_splits, send_splits, group=group)
    recv_x = AllToAll.apply(xc[send_tok].contiguous(), recv_splits, send_splits, group)

    # Expert side: rows arrive in source-rank order, each source in (t, j) order, which is
    # the canonical global order (g = token offset of the source + t, then j).
    # Every received row is overwritten below; deriving the buffer from recv_x keeps both
    # exchanges in every rank's backward graph, so ranks with no rows still take part.
    recv_y = recv_x * 0
    for local in range(num_local):
        (rows,) = (recv_expert == rank * num_local + local).nonzero(as_tuple=True)
        if rows.numel():
            out_rows = gated_mlp(recv_x[rows], experts.gate[local], experts.up[local], experts.down[local], activation,
                                 expert_biases(biases, local))
            recv_y = recv_y.index_put((rows,), out_rows)

    back_y = AllToAll.apply(recv_y, send_splits, recv_splits, group)
    y = xc.new_zeros(x.shape[0] * topk, hidden).index_put((order,), back_y).view(x.shape[0], topk, hidden)
    base = None if shared is None else _shared_on_global_batch(xc, _upcast(dtype, *shared), group, activation)
    return weighted_sum(y, wc, base)


class AllToAll(torch.autograd.Function):
    """Rows exchanged between ranks (``dist.all_to_all_single``: ``in_splits`` rows of ``rows`` to
    each rank, ``out_splits`` rows from each), differentiable: the backward is the reverse exchange
    of the gradient."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        import torch.distributed as dist

        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = rows.new_empty(sum(out_splits), *rows.shape[1:])
        dist.all_to_all_single(out, rows, out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        out_splits, in_splits = ctx.splits
        grad_rows = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(grad_rows, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return grad_rows, None, None, None


def _shared_on_global_batch(x: torch.Tensor, shared: list[torch.Tensor], group, activation: str = "swiglu") -> torch.Tensor:
    """This rank's rows of the shared expert applied to the whole global batch.

    A matrix product's rows can change in the last bit with the number of rows (the BLAS
    picks its blocking by shape), so the shared expert runs on the same [N, H] matrix as in
    the single-process reference: the other ranks' tokens are gathered (without gradient)
    around this rank's own, differentiable, rows.
    """
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    count = torch.tensor([x.shape[0]], device=x.device)
    counts = [torch.empty_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    counts = [int(c) for c in counts]
    padded = x.detach().new_zeros(max(counts), x.shape[1])
    padded[: x.shape[0]] = x.detach()
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    rows = [x if r == rank else part[: counts[r]] for r, part in enumerate(parts)]
    start = sum(counts[:rank])
    return gated_mlp(torch.cat(rows), *shared, activation)[start : start + x.shape[0]]


def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 fused multiply-add, round(a·b + c) once, emulated in float64.

    The product of two fp32 values is exact in float64. Their sum with c is rounded to float64
    by round-to-odd (the exact error of the sum, by TwoSum, decides: an inexact sum is moved to
    the odd neighbour), which keeps enough information for the final rounding to fp32 to be the
    single rounding of the exact value. (Rounding the sum to nearest first is wrong whenever c is
    far below a·b and a·b lies on an fp32 midpoint, which bf16 · fp32 products often do.)
    """
    p, c = a.double() * b.double(), c.double()
    s = p + c
    v = s - p
    err = (p - (s - v)) + (c - v)  # TwoSum: p + c = s + err exactly
    even = (s.view(torch.int64) & 1) == 0
    odd = torch.where((err != 0) & even, torch.nextafter(s, torch.where(err > 0, torch.inf, -torch.inf).double()), s)
    return odd.float()


def combine_reference(y: torch.Tensor, topk_w: torch.Tensor, shared_out: torch.Tensor | None = None) -> torch.Tensor:
    """What the combine kernel computes, in its exact operation order.

    acc = shared_out[t] (or +0), then acc = fma(topk_w[t, j], y[t, j], acc) for j = 0..k-1,
    in fp32 with bf16 inputs widened exactly; out = bf16(acc), rounded to nearest even.
    """
    w = topk_w.float()
    acc = torch.zeros(y.shape[0], y.shape[2], dtype=torch.float32, device=y.device)
    if shared_out is not None:
        acc = shared_out.float()
    for j in range(y.shape[1]):
        acc = fma_f32(w[:, j, None], y[:, j].float(), acc)
    return acc.to(torch.bfloat16)
