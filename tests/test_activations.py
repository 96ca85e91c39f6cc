"""The gated activations beside SwiGLU (MoKConfig.activation): gpt-oss's clamped SwiGLU and GeGLU, on
the CPU (float64). Each against a formula written independently of mok.reference (gpt-oss's own
expression, torch's tanh GELU), the written-out backward (the kernels' formulation) against autograd
and central differences, clamp bounds included, and the layer's CPU path against the reference."""

import math

import pytest
import torch

from helpers import random_layer
from mok.config import MoKConfig
from mok.reference import gated_activation, moe_reference
from mok.reference_backward import gated_activation_partials, moe_backward_reference

ACTIVATIONS = ["swiglu", "clamped_swiglu", "geglu"]


def independent_activation(activation, g, u):
    """Each activation as its source writes it (gpt-oss: transformers' GptOssExperts._apply_gate)."""
    if activation == "clamped_swiglu":
        gate, up = g.clamp(min=None, max=7.0), u.clamp(min=-7.0, max=7.0)
        return (up + 1) * (gate * torch.sigmoid(gate * 1.702))
    if activation == "geglu":
        return 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g.pow(3)))) * u
    return g * torch.sigmoid(g) * u


def pre_activations():
    """(h_gate, h_up) float64 over [-12, 12]: both clamp bounds crossed, ±7 themselves included."""
    g = torch.linspace(-12, 12, 241, dtype=torch.float64)[:, None].expand(241, 9).contiguous()
    u = torch.linspace(-9, 9, 9, dtype=torch.float64)[None, :].expand(241, 9).contiguous()
    return g, u


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activation_is_its_source_formula(activation):
    g, u = pre_activations()
    assert torch.allclose(gated_activation(activation, g, u), independent_activation(activation, g, u), rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_written_out_partials_are_autograds(activation):
    """∂a/∂h_g and ∂a/∂h_u as the kernels compute them, against autograd (clamp: no gradient past the
    bounds, the gradient at the bounds themselves as torch.clamp passes it)."""
    g, u = (t.clone().requires_grad_() for t in pre_activations())
    gated_activation(activation, g, u).sum().backward()
    d_g, d_u = gated_activation_partials(activation, g.detach(), u.detach())
    assert torch.allclose(d_g, g.grad, rtol=1e-12, atol=1e-12) and torch.allclose(d_u, u.grad, rtol=1e-12, atol=1e-12)
    if activation == "clamped_swiglu":
        assert not d_g[g.detach() > 7].any() and d_g[g.detach() <= 7].abs().sum() > 0
        assert not d_u[u.detach().abs() > 7].any()


@pytest.mark.parametrize("activation", ["clamped_swiglu", "geglu"])
@pytest.mark.parametrize("shared_inter", [None, 12])
def test_backward_formulation_matches_autograd(activation, shared_inter):
    """The layer's whole backward (router weights' and shared expert's gradients included), weights
    scaled up so that many pre-activations lie past the clamp bounds."""
    T, H, I, E, k = 13, 16, 8, 4, 2
    x, idx, w, experts, shared = random_layer(T, H, I, E, k, shared_inter, seed=7, dtype=torch.float64)
    experts = tuple(t * 6 for t in experts)
    w = w.double()
    dout = torch.randn(T, H, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    h_g = torch.einsum("th,eih->tei", x, experts[0])
    assert (h_g > 7).float().mean() > 0.05  # (the clamp's cut is exercised)
    leaves = [t.clone().requires_grad_() for t in (x, w, *experts, *(shared or ()))]
    sh = tuple(leaves[5:]) if shared is not None else None
    moe_reference(leaves[0], idx, leaves[1], *leaves[2:5], sh, dtype=torch.float64, activation=activation).backward(dout)
    got = moe_backward_reference(x, idx, w, *experts, shared, dout, dtype=torch.float64, activation=activation)
    flat = [got.dx, got.d_topk_w, got.d_w_gate, got.d_w_up, got.d_w_down, *(got.d_shared or ())]
    for name, g, leaf in zip(["dx", "d_topk_w", "d_w_gate", "d_w_up", "d_w_down", "d_s_gate", "d_s_up", "d_s_down"], flat, leaves):
        assert torch.allclose(g, leaf.grad, rtol=1e-10, atol=1e-12), name


@pytest.mark.parametrize("activation", ["clamped_swiglu", "geglu"])
def test_reference_passes_finite_difference_gradcheck(activation):
    x, idx, w, experts, shared = random_layer(5, 8, 4, 3, 2, 4, seed=22, dtype=torch.float64)
    leaves = [t.double().requires_grad_() for t in (x, w.double(), *experts, *shared)]

    def layer(x, w, wg, wu, wd, *sh):
        return moe_reference(x, idx, w, wg, wu, wd, tuple(sh), dtype=torch.float64, activation=activation)

    assert torch.autograd.gradcheck(layer, leaves, eps=1e-6, atol=1e-7, rtol=1e-5)


def check_layer_matches_the_reference(layer, activation: str):
    """``layer`` (an fp32 mok.MoELayer, 64 -> 32, 8 experts, top-2) on the CPU with random parameters
    and external routing: its output and every gradient (x, router weights, every parameter of the
    experts, biases included) those of mok.reference.moe_reference with ``activation``. Returns the
    reference's output and the call's inputs (x, idx, topk_w)."""
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(20, 64).requires_grad_()
    idx = torch.stack([torch.randperm(8)[:2] for _ in range(20)]).int()
    topk_w = torch.rand(20, 2).requires_grad_()
    out = layer(x, topk_idx=idx, topk_w=topk_w)
    biases = layer.expert_biases()
    params = [layer.gate_proj, layer.up_proj, layer.down_proj, *(biases or ())]
    want = moe_reference(x, idx, topk_w, *params[:3], activation=activation, biases=biases)
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-5)
    dout = torch.randn_like(out)
    for got, ref in zip(torch.autograd.grad(out, [x, topk_w, *params], dout), torch.autograd.grad(want, [x, topk_w, *params], dout)):
        assert torch.allclose(got, ref, rtol=1e-4, atol=1e-5)
    return want.detach(), (x, idx, topk_w)


@pytest.mark.parametrize("activation", ["clamped_swiglu", "geglu"])
def test_layer_on_the_cpu_computes_the_activation(activation):
    """mok.MoELayer(activation=...) on the CPU (the op's reference path): its output and gradients
    are the reference's with that activation, and not SwiGLU's."""
    from mok import MoELayer

    torch.manual_seed(4)
    layer = MoELayer(64, 32, 8, 2, dtype=torch.float32, activation=activation)
    want, (x, idx, topk_w) = check_layer_matches_the_reference(layer, activation)
    assert not torch.allclose(want, moe_reference(x, idx, topk_w, layer.gate_proj, layer.up_proj, layer.down_proj), rtol=1e-2)


def test_config_names_the_activations_and_refuses_others():
    with pytest.raises(ValueError, match=r"activation: expected one of \('swiglu', 'clamped_swiglu', 'geglu'\), got 'relu'"):
        MoKConfig(64, 32, 8, 2, activation="relu")
