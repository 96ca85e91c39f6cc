"""saved_h_format="recompute" on the H200: the forward keeps no h, the backward runs the gate/up
GEMM again (with "recompute_gate": h's up half kept, the gate GEMM alone run again), and every
gradient is the bits of the backward from a kept h (which
tests/test_backward_gpu.py checks against fp32 autograd): one-launch or not, the shared expert in
launches of its own or as expert E, MXFP8 numerics emulated; the layer eager, compiled and under
torch.utils.checkpoint, keeping exactly h's bytes fewer. Expert parallelism: tests/test_ep_gpu.py."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from mok import MoELayer
from mok.saved_h import pack_saved

from helpers import gpu_layer, moe_backward, moe_forward, rel_err
from test_backward_gpu import NAMES, autograd_reference, flat
from test_layer_gpu import external_routing, grads_of

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("T,H,I,E,k,shared_inter,stacked,options", [
    (1000, 512, 256, 8, 4, 384, False, {}),  # a shared expert of its own width: its h recomputed too
    (700, 1024, 512, 16, 8, 512, True, {}),  # the shared expert as expert E: its rows lead h
    (700, 1024, 512, 16, 8, 512, True, {"one_launch": True}),  # h from the one-launch kernel vs the gate/up GEMM
    (300, 256, 128, 64, 2, None, False, {"one_launch": True}),  # most experts empty
    (513, 512, 256, 8, 4, 256, False, {"precision": "mxfp8_emulated"}),  # rows and weights quantized again
])
@pytest.mark.parametrize("fmt", ["recompute", "recompute_gate"])
def test_recomputed_h_gives_the_kept_h_gradients_bitwise(T, H, I, E, k, shared_inter, stacked, options, fmt):
    """h recomputed whole ("recompute"), or its gate half recomputed beside the kept up half
    ("recompute_gate", bf16: the gate GEMM alone in the gate/up GEMM's column tile)."""
    if fmt == "recompute_gate" and options.get("precision"):
        pytest.skip("recompute_gate: bf16 precision only")
    x, idx, w, experts, shared = gpu_layer(T, H, I, E, k, shared_inter, seed=T + E + 3)
    if stacked:  # one [E + 1, ...] buffer per projection, as mok.MoELayer allocates them
        bufs = [torch.cat([routed, one[None]]) for routed, one in zip(experts, shared)]
        experts, shared = tuple(b[:E] for b in bufs), tuple(b[E] for b in bufs)
    kept = moe_forward(x, idx, w, *experts, shared, save_for_backward=True, **options)
    rec = pack_saved(moe_forward(x, idx, w, *experts, shared, save_for_backward=True, saved_h_format=fmt, **options), fmt)
    if fmt == "recompute":
        assert rec.h is None and rec.shared_h is None and kept.h is not None
    else:  # the up half, [R, I], of the rows in use (those past them are never written); a shared expert of its own keeps its h whole
        used = int(kept.schedule.expert_offsets[-1])
        assert rec.h.shape == (kept.h.shape[0], I) and torch.equal(rec.h[:used], kept.h[:used, I:])
        assert (rec.shared_h is None) == (shared is None or stacked)
    assert bool(rec.schedule.shared_rows) == stacked and torch.equal(rec.out, kept.out)
    dout = torch.randn_like(x)
    want = moe_backward(dout, x, idx, w, *experts, shared, kept, **options)
    got = moe_backward(dout, x, idx, w, *experts, shared, rec, saved_h_format=fmt, **options)
    for name, a, b in zip(NAMES, flat(got), flat(want)):
        assert torch.equal(a, b), name
    if not options.get("precision"):  # (and so near fp32 autograd: not a backward that ignores h)
        ref = autograd_reference(x, idx, w, experts, shared, dout)
        for name, a, b in zip(NAMES, flat(got), flat(ref)):
            if name != "d_topk_w":
                assert rel_err(a, b) <= 1e-2, name


def kept_bytes(layer, *args, **kwargs):
    """The layer's output and the tensors autograd keeps for its backward: [(shape, dtype, bytes)]."""
    kept = []

    def pack(t):
        kept.append((tuple(t.shape), t.dtype, t.numel() * t.element_size()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(*args, **kwargs)
    return out, kept


def test_layer_keeps_no_h_and_gives_the_default_bits_eager_checkpointed_and_compiled():
    T, H, I, E, k = 777, 512, 128, 16, 4  # (2I != H: h's width names it among the kept tensors)
    torch.manual_seed(21)
    default = MoELayer(H, I, E, k, shared_intermediate=I, device="cuda")
    rec = MoELayer(H, I, E, k, shared_intermediate=I, device="cuda", saved_h_format="recompute")
    rec.load_state_dict(default.state_dict())
    x = torch.randn(T, H, device="cuda").bfloat16()
    idx, w = external_routing(T, E=E, k=k, seed=22)
    dout = torch.randn(T, H, device="cuda").bfloat16()

    _, kept_default = kept_bytes(default, x, topk_idx=idx, topk_w=w)
    _, kept_rec = kept_bytes(rec, x, topk_idx=idx, topk_w=w)
    h_bytes = sum(b for shape, dtype, b in kept_default if dtype == torch.bfloat16 and shape[1:] == (2 * I,))
    assert h_bytes >= T * k * 2 * I * 2  # every pair's h row (and the shared expert's rows) kept by default
    assert sum(b for *_, b in kept_default) - sum(b for *_, b in kept_rec) == h_bytes  # exactly h less
    assert not any(shape[1:] == (2 * I,) and b for shape, _, b in kept_rec)

    want = grads_of(default, x, idx, w, dout)
    assert all(torch.equal(a, b) for a, b in zip(grads_of(rec, x, idx, w, dout), want))

    def grads_through(call):
        xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
        rec.zero_grad(set_to_none=True)
        out = call(xc, topk_idx=idx, topk_w=wc)
        out.backward(dout)
        return [out.detach(), xc.grad, wc.grad] + [p.grad for n, p in rec.named_parameters() if not n.startswith("router")]

    checkpointed = grads_through(lambda *a, **kw: checkpoint(rec, *a, use_reentrant=False, **kw))
    assert len(checkpointed) == len(want) and all(torch.equal(a, b) for a, b in zip(checkpointed, want))
    compiled = grads_through(torch.compile(rec, fullgraph=True))
    assert all(torch.equal(a, b) for a, b in zip(compiled, want))


def test_functional_api_keeps_no_h_and_its_backward_computes_it():
    from mok import api
    from mok.config import MoKConfig

    T, H, I, E, k = 500, 512, 256, 8, 4
    x, idx, w, experts, shared = gpu_layer(T, H, I, E, k, 384, seed=17)
    config = MoKConfig(H, I, E, k, shared_intermediate=384, saved_h_format="recompute")
    out, ctx = api.forward(config, None, x, idx, w, *experts, shared)
    assert ctx.saved.h is None and ctx.saved.shared_h is None
    dout = torch.randn_like(x)
    got = api.backward(config, None, ctx, dout)
    saved = moe_forward(x, idx, w, *experts, shared, save_for_backward=True)
    assert torch.equal(out, saved.out)
    want = moe_backward(dout, x, idx, w, *experts, shared, saved)
    for name, a, b in zip(NAMES, flat(got), flat(want)):
        assert torch.equal(a, b), name
