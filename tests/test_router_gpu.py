"""The built-in router on MoK's GEMMs (mok/router.py, mok/torch_ops.py) on the H200: logits and gradients against
fp32, a token's bits independent of the batch, and the layer batch-invariant with its own routing."""

import pytest
import torch

from mok.layer import MoELayer
from mok.torch_ops import router_logits

from helpers import rel_err, worst_row_err

pytestmark = pytest.mark.gpu

SHAPES = [(300, 512, 8), (37, 2048, 128), (1, 256, 160), (4096, 7168, 256)]  # (T, H, E): E padded to 128s in three


def router_case(T, H, E, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    w = (torch.randn(E, H, device="cuda", generator=g) * H ** -0.5).bfloat16()
    return x, w


@pytest.mark.parametrize("T,H,E", SHAPES)
def test_router_logits_and_gradients_match_fp32(T, H, E):
    x, w = router_case(T, H, E, seed=T + E)
    d_logits = torch.randn(T, E, device="cuda").bfloat16()
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    logits = router_logits(xg, wg)
    logits.backward(d_logits)
    xf, wf = x.double().requires_grad_(), w.double().requires_grad_()
    want = xf @ wf.T
    want.backward(d_logits.double())
    assert logits.shape == (T, E) and logits.dtype == torch.bfloat16
    for got, ref in ((logits, want), (xg.grad, xf.grad), (wg.grad, wf.grad)):
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
        assert rel_err(got, ref) <= 1e-2
        assert worst_row_err(got, ref) <= 2e-2  # every token's logits and dx, every expert's weight row


def test_eager_calls_and_the_op_torch_compile_sees_give_the_same_bits():
    """Eager calls take an autograd.Function (less host time), torch.compile the torch.library ops
    over the same functions: logits, dx and the weight's gradient the same bits, frozen weight too."""
    from mok.torch_ops import router_logits_op

    x, w = router_case(1000, 2048, 160, seed=3)
    d_logits = torch.randn(1000, 160, device="cuda").bfloat16()
    results = []
    for logits_of in (router_logits, lambda xs, ws: router_logits_op(xs, ws)[:, :160]):
        for weight_grad in (True, False):
            xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_(weight_grad)
            logits = logits_of(xg, wg)
            logits.backward(d_logits)
            results.append([logits, xg.grad] + ([wg.grad] if weight_grad else []))
    eager, eager_frozen, op, op_frozen = results
    assert all(torch.equal(a, b) for a, b in zip(eager + eager_frozen, op + op_frozen))
    assert torch.equal(eager[1], eager_frozen[1])


def test_a_tokens_logits_and_dx_do_not_depend_on_the_rest_of_the_batch():
    """The rows of any sub-batch get the bits they get in the whole batch, forward and dx (the
    GEMMs tile by (H, E) only); cuBLAS's nn.Linear may not (it picks kernels by token count)."""
    x, w = router_case(4096, 7168, 256, seed=5)
    d_logits = torch.randn(4096, 256, device="cuda").bfloat16()

    def logits_and_dx(rows):
        xr = x[rows].clone().requires_grad_()
        out = router_logits(xr, w)
        out.backward(d_logits[rows])
        return out.detach(), xr.grad

    whole = logits_and_dx(slice(None))
    for rows in (slice(0, 1), slice(7, 8), slice(100, 229), slice(1000, 4000)):
        part = logits_and_dx(rows)
        assert all(torch.equal(p, full[rows]) for p, full in zip(part, whole)), rows


def make_layer(seed):
    torch.manual_seed(seed)
    return MoELayer(7168, 256, 256, 8, device="cuda")  # dsv3's H and E (where nn.Linear's bits followed T), small I


def test_the_layer_with_its_own_router_is_batch_invariant_forward_and_backward():
    layer = make_layer(seed=6)
    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(2048, 7168, device="cuda", generator=g).bfloat16()
    dout = torch.randn(2048, 7168, device="cuda", generator=g).bfloat16()

    def run(rows):
        xr = x[rows].clone().requires_grad_()
        out = layer(xr)
        out.backward(dout[rows])
        return out.detach(), xr.grad

    whole = run(slice(None))
    for rows in (slice(0, 1), slice(300, 301), slice(5, 700)):
        part = run(rows)
        assert all(torch.equal(p, full[rows]) for p, full in zip(part, whole)), rows


def test_the_layer_with_its_own_router_replays_from_a_cuda_graph_with_the_eager_bits():
    layer = make_layer(seed=8)
    x = torch.randn(512, 7168, device="cuda").bfloat16()
    dout = torch.randn(512, 7168, device="cuda").bfloat16()

    def step(xs):
        out = layer(xs)
        out.backward(dout)
        return out

    xe = x.clone().requires_grad_()
    eager = [step(xe).detach(), xe.grad.clone(), layer.router.weight.grad.clone()]
    static_x = x.clone().requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # kernels compiled and loaded outside the capture
        step(static_x)
    torch.cuda.current_stream().wait_stream(side)
    layer.zero_grad(set_to_none=True)
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(static_x)
    graph.replay()
    torch.cuda.synchronize()
    replayed = [static_out, static_x.grad, layer.router.weight.grad]
    assert all(torch.equal(a, b) for a, b in zip(replayed, eager))


def test_a_hooked_or_replaced_router_module_is_called():
    """The MoK router GEMM stands in for the plain nn.Linear only: a forward hook, or another
    module put in its place, still sees the tokens."""
    layer = MoELayer(512, 256, 16, 4, device="cuda")
    x = torch.randn(64, 512, device="cuda").bfloat16()
    seen = []
    handle = layer.router.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    layer(x)
    handle.remove()
    assert seen == [torch.Size([64, 16])]
    linear = layer.router
    layer.router = torch.nn.Sequential(linear)
    assert torch.equal(layer(x), layer(x, *_routing_of(linear(x), 4)))


def _routing_of(logits, topk):
    from mok.layer import route

    return route(logits, topk)
