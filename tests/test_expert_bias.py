"""Expert biases (MoKConfig.expert_bias, gpt-oss's): b_gate, b_up [E, I] on h_gate and h_up, b_down
[E, H] on each expert's output. On the CPU (float64 where it checks a formulation): the reference
against a loop written independently of it, the written-out backward (the kernels' formulation:
the biases' gradients as per-expert column sums, the router-weight gradient <dout, y> with the down
bias in y) against autograd and central differences, and mok.MoELayer(bias=True) through the op's
CPU path."""

import pytest
import torch

from helpers import random_layer
from test_activations import check_layer_matches_the_reference
from mok import MoELayer
from mok.config import MoKConfig
from mok.reference import moe_reference
from mok.reference_backward import moe_backward_reference

ACTIVATIONS = ["swiglu", "clamped_swiglu", "geglu"]


def biased_layer(T, H, I, E, k, seed):
    x, idx, w, experts, _ = random_layer(T, H, I, E, k, None, seed=seed, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed + 1)
    biases = tuple(torch.randn(E, n, dtype=torch.float64, generator=g) for n in (I, I, H))
    return x, idx, w.double(), experts, biases


def loop_reference(x, idx, w, experts, biases):
    """out[t] = Σ_j w[t, j]·(silu(x_t·W_g[e]ᵀ + b_g[e])·(x_t·W_u[e]ᵀ + b_u[e])·W_d[e]ᵀ + b_d[e]), token by token."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            h_g = experts[0][e] @ x[t] + biases[0][e]
            h_u = experts[1][e] @ x[t] + biases[1][e]
            out[t] += w[t, j] * (experts[2][e] @ (torch.nn.functional.silu(h_g) * h_u) + biases[2][e])
    return out


def test_reference_adds_the_biases_where_a_loop_does():
    x, idx, w, experts, biases = biased_layer(9, 16, 8, 4, 2, seed=1)
    got = moe_reference(x, idx, w, *experts, dtype=torch.float64, biases=biases)
    assert torch.allclose(got, loop_reference(x, idx, w, experts, biases), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(got, moe_reference(x, idx, w, *experts, dtype=torch.float64), rtol=1e-3)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("T,E,k", [(13, 4, 2), (7, 8, 3), (6, 1, 1)])
def test_backward_formulation_matches_autograd(T, E, k, activation):
    """dx, d_topk_w (with <dout, b_down>), every weight's and every bias's gradient; an expert no
    token chooses gets zero bias gradients."""
    x, idx, w, experts, biases = biased_layer(T, 16, 8, E, k, seed=T + E)
    dout = torch.randn(T, 16, generator=torch.Generator().manual_seed(T), dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (x, w, *experts, *biases)]
    moe_reference(leaves[0], idx, leaves[1], *leaves[2:5], dtype=torch.float64, activation=activation,
                  biases=tuple(leaves[5:])).backward(dout)
    got = moe_backward_reference(x, idx, w, *experts, None, dout, dtype=torch.float64, activation=activation, biases=biases)
    flat = [got.dx, got.d_topk_w, got.d_w_gate, got.d_w_up, got.d_w_down, *got.d_biases]
    for name, g, leaf in zip(["dx", "d_topk_w", "d_w_gate", "d_w_up", "d_w_down", "d_b_gate", "d_b_up", "d_b_down"], flat, leaves):
        want = torch.zeros_like(leaf) if leaf.grad is None else leaf.grad
        assert torch.allclose(g, want, rtol=1e-10, atol=1e-12), name
    unused = sorted(set(range(E)) - set(idx.flatten().tolist()))
    for e in unused:
        assert not any(b[e].any() for b in got.d_biases)


def test_reference_with_biases_passes_finite_difference_gradcheck():
    x, idx, w, experts, biases = biased_layer(5, 8, 4, 3, 2, seed=9)
    leaves = [t.clone().requires_grad_() for t in (x, w, *experts, *biases)]

    def layer(x, w, wg, wu, wd, bg, bu, bd):
        return moe_reference(x, idx, w, wg, wu, wd, dtype=torch.float64, activation="clamped_swiglu", biases=(bg, bu, bd))

    assert torch.autograd.gradcheck(layer, leaves, eps=1e-6, atol=1e-7, rtol=1e-5)


def test_layer_with_biases_on_the_cpu():
    """MoELayer(bias=True): the biases are parameters named gate_bias, up_bias, down_bias, zero at
    first; with random values the layer's output and every gradient are the reference's."""
    torch.manual_seed(3)
    layer = MoELayer(64, 32, 8, 2, dtype=torch.float32, bias=True, activation="clamped_swiglu")
    assert {"gate_bias", "up_bias", "down_bias"} <= set(dict(layer.named_parameters()))
    assert layer.down_bias.shape == (8, 64) and not any(b.any() for b in layer.expert_biases())
    assert "gate_bias" not in dict(MoELayer(64, 32, 8, 2).named_parameters())
    assert layer.extra_repr().endswith("activation='clamped_swiglu', bias=True")
    check_layer_matches_the_reference(layer, "clamped_swiglu")


def test_ops_with_biases_pass_opcheck():
    """mok::moe_forward / moe_backward with the biases: schema, fake tensors (the biases' gradients
    shaped like them) and the forward's autograd registration."""
    from mok.torch_ops import config_text

    layer = MoELayer(64, 32, 8, 2, dtype=torch.float32, bias=True, activation="geglu")
    for b in layer.expert_biases():
        torch.nn.init.normal_(b)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 64, generator=g)
    idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(6)]).int()
    w = torch.rand(6, 2, generator=g)
    weights = [t.detach() for t in (layer.gate_proj, layer.up_proj, layer.down_proj)]
    biases = [t.detach() for t in layer.expert_biases()]
    config = config_text(layer.config)
    fwd_args = (x, idx, w, *weights, None, None, None, config, 0, True, False, 5.0, *biases)
    torch.library.opcheck(torch.ops.mok.moe_forward.default, fwd_args)
    _, *saved = torch.ops.mok.moe_forward(*fwd_args)
    bwd_args = (torch.randn(6, 64, generator=g), x, idx, w, *weights, None, None, None, saved, config, 0, 5.0, [], True, *biases)
    torch.library.opcheck(torch.ops.mok.moe_backward.default, bwd_args, test_utils=("test_schema", "test_faketensor"))
    grads = torch.ops.mok.moe_backward(*bwd_args)
    assert [tuple(t.shape) for t in grads[8:]] == [(8, 32), (8, 32), (8, 64)]
    mains = [torch.zeros(t.shape) for t in weights]  # (the weights' gradients added there, the biases' returned)
    added_args = (*bwd_args[:14], mains, True, *biases)
    torch.library.opcheck(torch.ops.mok.moe_backward.default, added_args, test_utils=("test_schema", "test_faketensor"))
    added = torch.ops.mok.moe_backward(*added_args)
    assert all(t.numel() == 0 for t in added[2:8])
    assert all(torch.equal(a, b) for a, b in zip(added[8:], grads[8:]))


@pytest.mark.parametrize("shared,fuse", [(32, False), (48, True), (None, True)])
def test_biases_beside_a_shared_expert_and_main_grad_on_the_cpu(shared, fuse):
    """MoELayer(bias=True) with a shared expert (of the routed width too: it then runs in launches of
    its own) and/or fuse_wgrad_accumulation: output and gradients the reference's; with main_grad
    the weights' gradients are added there (autograd gets None), the biases' come as .grad."""
    torch.manual_seed(5)
    layer = MoELayer(64, 32, 8, 2, shared_intermediate=shared, dtype=torch.float32, bias=True, fuse_wgrad_accumulation=fuse)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    experts = [layer.gate_proj, layer.up_proj, layer.down_proj, *(layer.shared_weights() or ())]
    before = [torch.randn(p.shape) for p in experts]
    for p, buf in zip(experts, before):
        p.main_grad = buf.clone()
    x = torch.randn(20, 64).requires_grad_()
    idx = torch.stack([torch.randperm(8)[:2] for _ in range(20)]).int()
    topk_w = torch.rand(20, 2).requires_grad_()
    out = layer(x, topk_idx=idx, topk_w=topk_w)
    leaves = [t.detach().clone().requires_grad_() for t in (x, topk_w, *experts, *layer.expert_biases())]
    n = len(experts)
    want = moe_reference(leaves[0], idx, leaves[1], *leaves[2:5], tuple(leaves[5:2 + n]) if shared else None,
                         biases=tuple(leaves[2 + n:]))
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-5)
    dout = torch.randn_like(out)
    out.backward(dout)
    want.backward(dout)
    for got, leaf in zip((x.grad, topk_w.grad, *(b.grad for b in layer.expert_biases())), (leaves[0], leaves[1], *leaves[2 + n:])):
        assert torch.allclose(got, leaf.grad, rtol=1e-4, atol=1e-5)
    for p, old, leaf in zip(experts, before, leaves[2:2 + n]):
        if fuse:
            assert p.grad is None and torch.allclose(p.main_grad, old + leaf.grad, rtol=1e-4, atol=1e-5)
        else:
            assert torch.allclose(p.grad, leaf.grad, rtol=1e-4, atol=1e-5) and torch.equal(p.main_grad, old)


def test_bad_bias_input_is_refused_naming_it():
    from mok.plan import plan_for

    beside = plan_for(MoKConfig(64, 32, 8, 2, 32, expert_bias=True), "sm_90a")  # (a shared expert of the routed width: launches of its own)
    assert not beside.shared_in_routed and plan_for(MoKConfig(64, 32, 8, 2, 32), "sm_90a").shared_in_routed
    for ep_size in (1, 2):  # with one_launch: its kernels add the biases, at one GPU and per rank
        one = plan_for(MoKConfig(64, 32, 8, 2, ep_size=ep_size, expert_bias=True, one_launch=True), "sm_90a").variants()
        assert sorted(v.config["save_h"] for v in one if v.name == "expert_mlp" and v.config.get("bias")) == [False, True]
    emulated = plan_for(MoKConfig(128, 128, 8, 2, expert_bias=True, precision="mxfp8_emulated"), "sm_90a").variants()  # (bf16 GEMMs)
    assert {v.config["epilogue"] for v in emulated if v.name == "grouped_gemm" and v.config.get("bias")} == {"plain", "swiglu",
                                                                                                           "swiglu_save", "swiglu_bwd"}
    mxfp8 = plan_for(MoKConfig(128, 128, 8, 2, expert_bias=True, precision="mxfp8"), "sm_100a").variants()  # (SM100's MXFP8 kernels)
    assert {v.config["epilogue"] for v in mxfp8 if v.name == "grouped_gemm" and v.config.get("bias") and v.config.get("operand") == "e4m3"} \
        == {"plain", "swiglu", "swiglu_save", "swiglu_bwd"}
    on_sm100 = plan_for(MoKConfig(128, 128, 8, 2, expert_bias=True), "sm_100a").variants()  # (whole tiles there)
    assert {v.config["epilogue"] for v in on_sm100 if v.config.get("bias")} == {"plain", "swiglu", "swiglu_save", "swiglu_bwd"}
    plan_for(MoKConfig(2880, 2880, 8, 2, expert_bias=True), "sm_100a")  # (gpt-oss's widths: partial tiles there too)
    x, idx, w, experts, biases = biased_layer(4, 16, 8, 4, 2, seed=2)
    with pytest.raises(ValueError, match=r"biases.down: expected shape \[4, 16\], got \[4, 8\]"):
        moe_reference(x, idx, w, *experts, dtype=torch.float64, biases=(biases[0], biases[1], biases[0]))
    from mok.torch_ops import config_text

    args = (x.float(), idx.int(), w.float(), *(t.float() for t in experts), None, None, None)
    with pytest.raises(ValueError, match="biases: config.expert_bias is False, so expected none, got some"):
        torch.ops.mok.moe_forward(*args, config_text(MoKConfig(16, 8, 4, 2)), 0, False, False, 5.0, *(b.float() for b in biases))
    with pytest.raises(ValueError, match="biases: config.expert_bias is True, so expected the gate, up and down biases, got none"):
        torch.ops.mok.moe_forward(*args, config_text(MoKConfig(16, 8, 4, 2, expert_bias=True)), 0, False, False, 5.0)


def test_plan_with_biases_lists_the_bias_kernels():
    """On Hopper a biased layer's plan adds the biases in the GEMMs that make the products (gate/up
    with and without h, the down projection or, at EP, its scatter, the recomputed h), leaves the
    down bias's piece a column of the SwiGLU backward's pieces (the combine's or router_grad's
    pieces one more), and plans the column sums (dh's, the weighted dout rows') and the row dots;
    dx and the weight gradients are the bias-free kernels."""
    from mok.plan import Plan

    def grouped(plan):
        return {(v.config["epilogue"], v.config.get("scatter", False), v.config["k_split"]): v.config.get("bias", False)
                for v in plan.variants() if v.name == "grouped_gemm" and 128 not in (v.config["n"], v.config["k"])}  # (not the router's)

    one_gpu = Plan(MoKConfig(2880, 2880, 32, 4, expert_bias=True, saved_h_format="recompute"), "sm_90a")
    assert grouped(one_gpu) == {("swiglu", False, False): True, ("swiglu_save", False, False): True, ("plain", False, False): True,
                                ("swiglu_bwd", False, False): True, ("plain", False, True): False}
    ep = Plan(MoKConfig(2880, 2880, 32, 4, expert_bias=True, ep_size=2), "sm_90a")
    assert grouped(ep)[("plain", True, False)] is True and grouped(ep)[("plain", True, True)] is False
    names = {v.name: v.config for v in one_gpu.variants()}
    parts = 2880 // 128 + 1 + 1  # ceil(I / 128) GEMM pieces, the down bias's last
    assert names["combine"].get("router_parts", parts) == parts and names["row_dots"] == {"width": 2880, "out_stride": parts}
    sums = sorted((v.config["width"], v.config.get("weighted", False)) for v in one_gpu.variants() if v.name == "column_sums")
    assert sums == [(2880, True), (5760, False)]
    assert {v.name: v.config for v in ep.variants()}["router_grad"]["parts"] == parts
    plain = Plan(MoKConfig(2880, 2880, 32, 4), "sm_90a").variants()
    assert not any(v.name in ("column_sums", "row_dots") or v.config.get("bias") for v in plain)


def test_bias_kernels_and_ops_refuse_what_they_do_not_take():
    """The GEMM's bias option: not with k_split (dx has no bias), not in the SM100 kernels; the ops
    name a bias of the wrong shape, a missing second bias and a bias beside k_split, before
    anything launches (CPU tensors: the checks come before the launch's)."""
    from mok import ops
    from mok.kernels import compiled_ptx
    from mok.kernels.variants import grouped_gemm_variant
    from mok.schedule import Schedule

    with pytest.raises(ValueError, match=r"bias: not with k_split \(dx has no bias\)"):
        compiled_ptx(grouped_gemm_variant(256, 512, b_major="n", k_split=True, bias=True), "sm_90a")
    with pytest.raises(ValueError, match=r"bias: not with k_split \(dx has no bias\)"):
        compiled_ptx(grouped_gemm_variant(256, 512, b_major="n", k_split=True, bias=True), "sm_100a")
    a, b, b2 = torch.randn(256, 64).bfloat16(), torch.randn(4, 32, 64).bfloat16(), torch.randn(4, 32, 64).bfloat16()
    tiles = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"bias: expected shape \[4, 32\], got \[4, 64\]"):
        ops.grouped_gemm(a, b, tiles, bias=torch.zeros(4, 64).bfloat16())
    with pytest.raises(ValueError, match="give bias for a plain GEMM, bias and bias2 for the SwiGLU form"):
        ops.grouped_gemm(a, b, tiles, b2=b2, bias=torch.zeros(4, 32).bfloat16())
    with pytest.raises(ValueError, match=r"bias: not with k_split \(dx has no bias\)"):
        ops.grouped_gemm(torch.randn(256, 128).bfloat16(), b.transpose(1, 2).contiguous(), tiles, b2=b2.transpose(1, 2).contiguous(),
                         b_major="n", k_split=True, bias=torch.zeros(4, 32).bfloat16())
    sched = Schedule.empty(8, 2, 4, 256, 128, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"rows: expected shape \[256, \*\], got \[128, 64\]"):
        ops.expert_column_sums(torch.zeros(128, 64).bfloat16(), sched)
    with pytest.raises(ValueError, match=r"bias: expected shape \[4, 64\], got \[4, 32\]"):
        ops.bias_router_pieces(torch.zeros(256, 64).bfloat16(), torch.zeros(4, 32).bfloat16(), sched, torch.zeros(256, 3))
