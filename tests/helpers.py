"""Random inputs for the MoE layer, shared by tests (fresh random data, never zeros)."""

from __future__ import annotations

import torch


def random_routing(num_tokens: int, num_experts: int, topk: int, generator: torch.Generator, device="cpu"):
    """Distinct experts per token (as a top-k router gives) and positive weights."""
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    topk_idx = scores.topk(topk, dim=1).indices.to(torch.int32)
    topk_w = torch.rand(num_tokens, topk, generator=generator) + 0.05
    return topk_idx.to(device), topk_w.to(device)


def random_layer(num_tokens, hidden, inter, num_experts, topk, shared_inter=None, *, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    topk_idx, topk_w = random_routing(num_tokens, num_experts, topk, g)
    scale = hidden ** -0.5
    w_gate = (torch.randn(num_experts, inter, hidden, generator=g) * scale).to(dtype)
    w_up = (torch.randn(num_experts, inter, hidden, generator=g) * scale).to(dtype)
    w_down = (torch.randn(num_experts, hidden, inter, generator=g) * inter ** -0.5).to(dtype)
    shared = None
    if shared_inter:
        shared = (
            (torch.randn(shared_inter, hidden, generator=g) * scale).to(dtype),
            (torch.randn(shared_inter, hidden, generator=g) * scale).to(dtype),
            (torch.randn(hidden, shared_inter, generator=g) * shared_inter ** -0.5).to(dtype),
        )
    return x, topk_idx, topk_w, (w_gate, w_up, w_down), shared
