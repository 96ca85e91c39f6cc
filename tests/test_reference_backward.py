"""The kernel-shaped backward formulation against autograd of the reference (float64, CPU)."""

import pytest
import torch

from helpers import random_layer
from mok.reference import moe_reference
from mok.reference_backward import moe_backward_reference


def autograd_grads(x, idx, w, experts, shared, dout):
    leaves = [t.clone().double().requires_grad_() for t in (x, w, *experts, *(shared or ()))]
    sh = tuple(leaves[5:]) if shared is not None else None
    moe_reference(leaves[0], idx, leaves[1], *leaves[2:5], sh, dtype=torch.float64).backward(dout.double())
    return [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]


@pytest.mark.parametrize("shared_inter", [None, 12])
@pytest.mark.parametrize("T,E,k,weights", [(9, 4, 2, "random"), (16, 8, 8, "random"), (7, 1, 1, "random"), (11, 6, 3, "zero"), (11, 6, 3, "tiny")])
def test_backward_formulation_matches_autograd(T, E, k, weights, shared_inter):
    x, idx, w, experts, shared = random_layer(T, 16, 8, E, k, shared_inter, seed=T * E + k, dtype=torch.float64)
    w = w.double()
    if weights == "zero":  # router weights exactly 0: d_topk_w must still be <dout, y>
        w[:, 0] = 0.0
    elif weights == "tiny":
        w[:, 1] = 1e-30
    dout = torch.randn(T, 16, generator=torch.Generator().manual_seed(T), dtype=torch.float64)
    want = autograd_grads(x, idx, w, experts, shared, dout)
    got = moe_backward_reference(x, idx, w, *experts, shared, dout, dtype=torch.float64)
    flat = [got.dx, got.d_topk_w, got.d_w_gate, got.d_w_up, got.d_w_down, *(got.d_shared or ())]
    assert len(flat) == len(want)
    for name, g, r in zip(["dx", "d_topk_w", "d_w_gate", "d_w_up", "d_w_down", "d_s_gate", "d_s_up", "d_s_down"], flat, want):
        assert torch.allclose(g, r, rtol=1e-10, atol=1e-12), name


def test_router_gradient_is_the_dot_product_with_the_expert_output():
    """d_topk_w[t, j] = <dout[t], y[t, j]>, computed without forming y."""
    from mok.reference import expert_outputs, RoutedExperts

    x, idx, w, experts, _ = random_layer(10, 16, 8, 4, 2, seed=3, dtype=torch.float64)
    dout = torch.randn(10, 16, dtype=torch.float64)
    y = expert_outputs(x, idx, RoutedExperts(*experts))
    got = moe_backward_reference(x, idx, w.double(), *experts, None, dout, dtype=torch.float64).d_topk_w
    assert torch.allclose(got, (dout[:, None, :] * y).sum(-1), rtol=1e-12, atol=1e-14)


def test_backward_reference_rejects_bad_dout():
    x, idx, w, experts, _ = random_layer(4, 16, 8, 4, 2, seed=1)
    with pytest.raises(ValueError, match=r"dout: expected shape \[4, 16\]"):
        moe_backward_reference(x, idx, w, *experts, None, torch.zeros(4, 8))


@pytest.mark.parametrize("shared_inter,routing", [(None, "random"), (6, "random"), (None, "k1 empty zero")])
def test_reference_passes_finite_difference_gradcheck(shared_inter, routing):
    """The oracle itself: autograd of moe_reference against central differences (float64, tiny
    shapes); also with k = 1, an expert no token chooses and router weights exactly 0."""
    k = 1 if routing == "k1 empty zero" else 2
    x, idx, w, experts, shared = random_layer(5, 8, 4, 3, k, shared_inter, seed=21, dtype=torch.float64)
    if routing == "k1 empty zero":
        idx = torch.tensor([[0], [2], [0], [2], [2]])  # expert 1 gets nothing
        w = w.clone()
        w[::2, 0] = 0.0
    leaves = [t.double().requires_grad_() for t in (x, w.double(), *experts, *(shared or ()))]

    def layer(x, w, wg, wu, wd, *sh):
        return moe_reference(x, idx, w, wg, wu, wd, tuple(sh) if sh else None, dtype=torch.float64)

    assert torch.autograd.gradcheck(layer, leaves, eps=1e-6, atol=1e-7, rtol=1e-5)
