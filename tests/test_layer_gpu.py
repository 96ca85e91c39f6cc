"""MoELayer on the H200: fused custom ops against the reference, torch.compile, CUDA graphs, memory."""

import copy
import dataclasses

import pytest
import torch

from mok.layer import MoELayer

from helpers import rel_err, worst_entry_err, worst_row_err

pytestmark = pytest.mark.gpu


def make_layer(seed=0, shared=256, **options):
    torch.manual_seed(seed)
    return MoELayer(512, 256, 16, 4, shared_intermediate=shared, device="cuda", **options)


def external_routing(T, E=16, k=4, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    idx = torch.rand(T, E, device="cuda", generator=g).topk(k, dim=1).indices.int()
    w = torch.softmax(torch.randn(T, k, device="cuda", generator=g), 1)
    return idx, w


def grads_of(layer, x, idx, w, dout):
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    out = layer(x, topk_idx=idx, topk_w=w)
    out.backward(dout)
    # out detached: a live graph would keep the parameters' AccumulateGrad nodes, and with them
    # the stream of this eager call, into a later CUDA-graph capture (a cross-stream wait there).
    return [out.detach(), x.grad, w.grad] + [p.grad for n, p in layer.named_parameters() if not n.startswith("router")]


def test_fused_layer_matches_the_reference_path():
    layer = make_layer()
    x = torch.randn(700, 512, device="cuda").bfloat16()
    idx, w = external_routing(700)
    dout = torch.randn(700, 512, device="cuda").bfloat16()
    got = grads_of(layer, x, idx, w, dout)
    cpu = copy.deepcopy(layer).cpu()
    want = grads_of(cpu, x.cpu(), idx.cpu(), w.cpu(), dout.cpu())
    for i, (g, r) in enumerate(zip(got, want)):  # out, x.grad, topk_w.grad, the weights' grads
        assert g.is_cuda and not g.isnan().any()
        assert rel_err(g.cpu(), r) <= 1e-2
        assert (worst_entry_err if i == 2 else worst_row_err)(g.cpu(), r) <= 5e-2  # per token, value or expert


def test_built_in_router_learns():
    layer = make_layer()
    x = torch.randn(300, 512, device="cuda").bfloat16().requires_grad_()
    layer(x).float().square().sum().backward()
    assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0
    assert torch.isfinite(layer.router.weight.grad).all() and torch.isfinite(x.grad).all()


def test_torch_compile_fullgraph_two_layers():
    torch.manual_seed(2)
    model = torch.nn.Sequential(
        MoELayer(512, 256, 16, 4, device="cuda"), torch.nn.GELU(), MoELayer(512, 256, 16, 4, 256, device="cuda")
    )
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(400, 512, device="cuda").bfloat16().requires_grad_()
    out_c = compiled(x)
    out_c.float().square().sum().backward()
    got = [out_c, x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    x.grad = None
    model.zero_grad(set_to_none=True)
    out_e = model(x)
    out_e.float().square().sum().backward()
    want = [out_e, x.grad] + [p.grad for p in model.parameters()]
    for g, w in zip(got, want):  # the router's softmax may be fused differently: close, not bitwise
        assert rel_err(g, w) <= 1e-2


def test_one_launch_layer_gives_the_default_layers_bits_eager_and_compiled():
    """MoELayer(one_launch=True): the forward in one kernel (plus 2 for the shared expert); output
    and every gradient the same bits as the default layer's, also under torch.compile(fullgraph=True)."""
    default = make_layer(seed=6)
    one = MoELayer(512, 256, 16, 4, shared_intermediate=256, device="cuda", one_launch=True)
    one.load_state_dict(default.state_dict())
    x = torch.randn(333, 512, device="cuda").bfloat16()
    idx, w = external_routing(333, seed=7)
    dout = torch.randn(333, 512, device="cuda").bfloat16()
    want = grads_of(default, x, idx, w, dout)
    assert all(torch.equal(a, b) for a, b in zip(grads_of(one, x, idx, w, dout), want))
    compiled = torch.compile(one, fullgraph=True)
    xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
    one.zero_grad(set_to_none=True)
    out = compiled(xc, topk_idx=idx, topk_w=wc)
    out.backward(dout)
    got = [out.detach(), xc.grad, wc.grad] + [p.grad for n, p in one.named_parameters() if not n.startswith("router")]
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("options", [{}, {"saved_h_format": "recompute"}])
def test_forward_backward_cuda_graph_equals_eager(options):
    layer = make_layer(seed=3, **options)
    x = torch.randn(256, 512, device="cuda").bfloat16()
    idx, w = external_routing(256, seed=4)
    dout = torch.randn(256, 512, device="cuda").bfloat16()
    eager = grads_of(layer, x, idx, w, dout)
    static_x = x.clone().requires_grad_()
    static_w = w.clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (kernels compiled and loaded) outside the capture
        for _ in range(2):
            layer(static_x, topk_idx=idx, topk_w=static_w).backward(dout)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    for p in layer.parameters():
        p.grad = None
    static_x.grad = static_w.grad = None
    with torch.cuda.graph(graph):
        static_out = layer(static_x, topk_idx=idx, topk_w=static_w)
        static_out.backward(dout)
    graph.replay()
    torch.cuda.synchronize()
    replayed = [static_out, static_x.grad, static_w.grad] + [
        p.grad for n, p in layer.named_parameters() if not n.startswith("router")
    ]
    assert all(torch.equal(a, b) for a, b in zip(replayed, eager))


def test_1000_calls_leave_memory_flat():
    layer = make_layer(seed=5)
    x = torch.randn(512, 512, device="cuda").bfloat16().requires_grad_()
    for step in range(1000):
        layer(x).sum().backward()
        if step == 9:
            torch.cuda.synchronize()
            settled = torch.cuda.memory_allocated()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == settled


def test_nan_in_one_token_stays_in_that_token():
    layer = make_layer(seed=6)
    x = torch.randn(300, 512, device="cuda").bfloat16()
    idx, w = external_routing(300, seed=7)
    with torch.no_grad():
        clean = layer(x, topk_idx=idx, topk_w=w)
        x[123, 5] = float("nan")
        out = layer(x, topk_idx=idx, topk_w=w)
    assert out[123].isnan().all()
    keep = torch.arange(300, device="cuda") != 123
    assert torch.equal(out[keep], clean[keep])


def test_zero_tokens_on_the_gpu():
    layer = make_layer(seed=8)
    x = torch.randn(0, 512, device="cuda").bfloat16().requires_grad_()
    out = layer(x)
    out.sum().backward()
    assert out.shape == (0, 512) and x.grad.shape == (0, 512)
    assert all(p.grad is None or not p.grad.any() for p in layer.parameters())


def test_fused_wgrad_accumulation_adds_the_gradients_into_main_grad_deterministically():
    """fuse_wgrad_accumulation on the GPU: the weight-gradient GEMMs add into each expert weight's
    fp32 main_grad (TMA reduce-add: no bf16 gradient in between), bit for bit the same on every
    run; what they add is the layer's own weight gradient (which is that sum rounded to bf16), and
    dx and the router-weight gradient are the plain backward's bits."""
    layer = make_layer(seed=5)
    x = torch.randn(500, 512, device="cuda").bfloat16()
    idx, w = external_routing(500, seed=6)
    dout = torch.randn(500, 512, device="cuda").bfloat16()
    plain = grads_of(layer, x, idx, w, dout)
    fused = copy.deepcopy(layer)
    fused.config = dataclasses.replace(fused.config, fuse_wgrad_accumulation=True)
    experts = [fused.gate_proj, fused.up_proj, fused.down_proj, *fused.shared_weights()]
    g = torch.Generator(device="cuda").manual_seed(7)
    start = [torch.randn(p.shape, device="cuda", generator=g) for p in experts]
    runs = []
    for _ in range(2):
        for p, s in zip(experts, start):
            p.main_grad = s.clone()
        got = grads_of(fused, x, idx, w, dout)
        assert all(p.grad is None for p in experts)
        assert torch.equal(got[1], plain[1]) and torch.equal(got[2], plain[2])  # dx, d_topk_w
        runs.append([p.main_grad.clone() for p in experts])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    for added, s, want in zip(runs[0], start, plain[3:]):
        assert rel_err((added - s).cpu(), want.float().cpu()) <= 4e-3


def test_frozen_experts_backward_gives_the_same_dx_and_router_gradient_bitwise():
    """Every expert weight frozen: the backward skips the weight-gradient GEMMs (and the x rows'
    gather), and x's and the router's gradients are the bits of the layer that trains everything."""
    plain = make_layer()
    frozen = make_layer()
    frozen.load_state_dict(plain.state_dict())
    for name, p in frozen.named_parameters():
        if not name.startswith("router"):
            p.requires_grad_(False)
    x = torch.randn(700, 512, device="cuda").bfloat16()
    dout = torch.randn(700, 512, device="cuda").bfloat16()
    grads = []
    for layer in (plain, frozen):
        xg = x.clone().requires_grad_()
        layer(xg).backward(dout)
        grads.append((xg.grad, layer.router.weight.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
    assert all(p.grad is None for name, p in frozen.named_parameters() if not name.startswith("router"))
