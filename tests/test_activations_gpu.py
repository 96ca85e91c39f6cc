"""The gated activations beside SwiGLU in the fused kernels, on the H200: gpt-oss's clamped SwiGLU
and GeGLU, forward and backward (the router-weight gradient included) against autograd of the fp32
reference, the one-launch forward and recomputed h giving the staged path's bits, 20-run
determinism and batch invariance. The gate and up weights are scaled up so that a good share of the
pre-activations lies past the clamp's bounds (±7). The tests build the plan directly (mok.plan.Plan)."""

import pytest
import torch

import mok.reference
from mok import pipeline
from mok.config import MoKConfig
from mok.plan import Plan
from mok.runtime.arch import device_arch
from mok.reference import gated_activation, moe_reference

from helpers import gpu_layer, poisoned, rel_err, worst_row_err

pytestmark = pytest.mark.gpu

ACTIVATIONS = ["clamped_swiglu", "geglu"]
CASES = [
    # T, H, I, E, k, shared I_s
    (1000, 2880, 2880, 32, 4, None),  # gpt-oss's widths (partial tiles)
    (700, 1024, 512, 16, 4, 256),
    (333, 256, 128, 8, 2, 128),  # the shared expert in the routed launches
]


def scaled_layer(T, H, I, E, k, shared_inter, seed):
    """gpu_layer with the gate and up weights 8x: pre-activations of a few units, many past ±7."""
    x, idx, w, (wg, wu, wd), shared = gpu_layer(T, H, I, E, k, shared_inter, seed=seed)
    wg, wu = (t * 8 for t in (wg, wu))
    if shared is not None:
        shared = (shared[0] * 8, shared[1] * 8, shared[2])
    return x, idx, w, (wg, wu, wd), shared


def plan_of(x, idx, experts, shared, activation, **options):
    config = MoKConfig(x.shape[1], experts[0].shape[1], experts[0].shape[0], idx.shape[1],
                       None if shared is None else shared[0].shape[0], activation=activation, **options)
    return Plan(config, device_arch())  # (the device's plan: Hopper's, or SM100's where these run there)


def forward(plan, x, idx, w, experts, shared, **kw):
    return pipeline.forward(plan, x, idx, w, experts, shared, save=True, **kw)


def train_step(plan, x, idx, w, experts, shared, dout):
    saved = forward(plan, x, idx, w, experts, shared)
    return saved.out, pipeline.backward(plan, dout, x, idx, w, experts, shared, saved)


def activation_of_bf16_h(activation, h_gate, h_up):
    """The reference's activation on h rounded to bf16, as the fused backward sees it (it reads the
    saved bf16 h): the clamps' gradients switch at ±7, so an fp32 h a rounding away from the bound
    on the other side of it would give those elements the other gradient (~4% of dx at these scales)."""
    return gated_activation(activation, h_gate.bfloat16().float(), h_up.bfloat16().float())


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("T,H,I,E,k,shared_inter", CASES)
def test_forward_and_backward_match_autograd_of_the_reference(T, H, I, E, k, shared_inter, activation, monkeypatch):
    monkeypatch.setattr(mok.reference, "gated_activation", activation_of_bf16_h)
    x, idx, w, experts, shared = scaled_layer(T, H, I, E, k, shared_inter, seed=T + H)
    h_gate = (x[:64].float() @ experts[0][idx[0, 0]].float().T)
    assert (h_gate.abs() > 7).float().mean() > 0.05  # (the clamps are exercised)
    dout = torch.randn(T, H, device="cuda").bfloat16()
    plan = plan_of(x, idx, experts, shared, activation)
    saved = forward(plan, x, idx, w, experts, shared, out=poisoned(T, H))
    grads = pipeline.backward(plan, dout, x, idx, w, experts, shared, saved)
    leaves = [t.float().requires_grad_() for t in (x, w, *experts, *(shared or ()))]
    want = moe_reference(leaves[0], idx, leaves[1], *leaves[2:5], tuple(leaves[5:]) or None, activation=activation)
    want.backward(dout.float())
    assert not saved.out.isnan().any()
    assert rel_err(saved.out, want) <= 1e-2 and worst_row_err(saved.out, want.detach()) <= 5e-2
    got = [grads.dx, grads.d_topk_w, grads.d_w_gate, grads.d_w_up, grads.d_w_down, *(grads.d_shared or ())]
    for name, g, leaf in zip(["dx", "d_topk_w", "d_w_gate", "d_w_up", "d_w_down", "d_s_gate", "d_s_up", "d_s_down"], got, leaves):
        assert not g.isnan().any(), name
        assert rel_err(g, leaf.grad) <= 2e-2, (name, rel_err(g, leaf.grad))


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_one_launch_and_recompute_give_the_staged_bits_deterministically_and_batch_invariant(activation):
    T, H, I, E, k = 2048, 1024, 512, 16, 4
    x, idx, w, experts, _ = scaled_layer(T, H, I, E, k, None, seed=5)
    dout = torch.randn(T, H, device="cuda").bfloat16()
    plan = plan_of(x, idx, experts, None, activation)
    out, grads = train_step(plan, x, idx, w, experts, None, dout)
    first = [out, grads.dx, grads.d_topk_w, grads.d_w_gate, grads.d_w_up, grads.d_w_down]
    for _ in range(19):
        again_out, again = train_step(plan, x, idx, w, experts, None, dout)
        assert all(torch.equal(a, b) for a, b in zip([again_out, again.dx, again.d_topk_w, again.d_w_gate, again.d_w_up, again.d_w_down], first))
    one_launch = forward(plan_of(x, idx, experts, None, activation, one_launch=True), x, idx, w, experts, None)
    staged = forward(plan, x, idx, w, experts, None)
    used = int(staged.schedule.expert_offsets[-1])  # (rows past the last expert's are not written)
    assert torch.equal(one_launch.out, out) and torch.equal(one_launch.h[:used], staged.h[:used])
    recompute_plan = plan_of(x, idx, experts, None, activation, saved_h_format="recompute")
    r_out, r_grads = train_step(recompute_plan, x, idx, w, experts, None, dout)
    assert torch.equal(r_out, out) and torch.equal(r_grads.dx, grads.dx) and torch.equal(r_grads.d_w_gate, grads.d_w_gate)
    rows = torch.randperm(T, device="cuda")[:17]
    part_out, part = train_step(plan, *(t[rows].contiguous() for t in (x, idx, w)), experts, None, dout[rows].contiguous())
    assert torch.equal(part_out, out[rows]) and torch.equal(part.dx, grads.dx[rows]) and torch.equal(part.d_topk_w, grads.d_topk_w[rows])
