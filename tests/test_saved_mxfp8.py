"""h kept for the backward in MXFP8 (mok/saved_mxfp8.py) on the CPU: the packed layout, the checks,
the saved state's round trip, and the layer and its ops carrying a packed h (GPU: test_saved_mxfp8_gpu.py)."""

import json

import pytest
import torch

from mok.config import MoKConfig
from mok.layer import MoELayer
from mok.mxfp8 import dequantize_mxfp8, quantize_mxfp8
from mok.pipeline import ForwardResult
from mok.plan import plan_for
from mok.saved_mxfp8 import pack_h, pack_saved, packed_width, unpack_h, unpack_saved
from mok.schedule import build_schedule

from helpers import opchecked_layer_ops


def random_h(rows, width, seed):
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-20, 20, (rows, width // 32, 1), generator=g).float())
    return (torch.randn(rows, width // 32, 32, generator=g) * scale).reshape(rows, width).bfloat16()


def test_packed_h_is_the_elements_then_the_scales_of_the_reference_rule():
    h = random_h(37, 256, seed=1)
    h[3, 40] = float("inf")  # a block with an Inf: scale 0xFF, NaN elements, as the rule says
    packed = pack_h(h)
    assert packed.dtype == torch.uint8 and packed.shape == (37, packed_width(256)) == (37, 264)
    elements, scales = quantize_mxfp8(h)
    assert torch.equal(packed.view(-1)[: 37 * 256], elements.view(torch.uint8).view(-1))
    assert torch.equal(packed.view(-1)[37 * 256:], scales.view(-1))
    back = unpack_h("h", packed, 256)
    want = dequantize_mxfp8(elements, scales).to(torch.bfloat16)
    assert back.dtype == torch.bfloat16 and torch.equal(back.isnan(), want.isnan())
    assert torch.equal(back.nan_to_num(), want.nan_to_num()) and back[3, 32:64].isnan().all()


@pytest.mark.parametrize("bad,match", [
    (torch.zeros(4, 264, dtype=torch.bfloat16), r"saved.h: expected a packed MXFP8 h, contiguous uint8 \[rows, 264\].*bfloat16"),
    (torch.zeros(4, 256, dtype=torch.uint8), r"\[rows, 264\] for 256 columns, got torch.uint8 \(4, 256\)"),
    (torch.zeros(4 * 264, dtype=torch.uint8), r"got torch.uint8 \(1056,\)"),
    (torch.zeros(264, 4, dtype=torch.uint8).T, r"contiguous"),
])
def test_unpack_refuses_what_is_not_a_packed_h_of_that_width(bad, match):
    with pytest.raises(ValueError, match=match):
        unpack_h("saved.h", bad, 256)


def test_saved_state_round_trip_drops_the_shared_prefix_alias_and_leaves_bf16_alone():
    num_tokens, topk, experts, inter = 10, 2, 4, 64
    idx = torch.randint(0, experts, (num_tokens, topk), generator=torch.Generator().manual_seed(2))
    sched = build_schedule(idx, experts, block_m=128, shared_prefix=True)
    h = random_h(sched.capacity, 2 * inter, seed=3)
    saved = ForwardResult(out=None, schedule=sched, h=h, shared_h=h[:num_tokens])
    packed = pack_saved(saved)
    assert packed.shared_h is None and packed.h.shape == (sched.capacity, packed_width(2 * inter))
    assert saved.h is h and saved.shared_h is not None  # (the original is not changed)
    back = unpack_saved(packed, inter, inter)
    assert torch.equal(back.h, dequantize_mxfp8(*quantize_mxfp8(h)).to(torch.bfloat16)) and back.shared_h is None
    assert unpack_saved(saved, inter, inter) is saved  # a bf16 h stays as it is
    plain = build_schedule(idx, experts, block_m=128)
    shared_h = random_h(num_tokens, 2 * 96, seed=4)
    own = pack_saved(ForwardResult(out=None, schedule=plain, h=random_h(plain.capacity, 2 * inter, seed=5), shared_h=shared_h))
    assert own.shared_h.shape == (num_tokens, packed_width(192))
    assert torch.equal(unpack_saved(own, inter, 96).shared_h, unpack_h("s", pack_h(shared_h), 192))
    with pytest.raises(ValueError, match=r"saved.h: expected a packed MXFP8 h, contiguous uint8 \[rows, 264\] for 256 columns"):
        unpack_saved(own, 128, 96)  # the wrong I: the widths do not fit


def test_the_format_is_checked_where_it_is_given():
    with pytest.raises(ValueError, match=r"saved_h_format: expected one of \('bf16', 'mxfp8', 'recompute', 'recompute_gate'\), got 'fp8'"):
        MoKConfig(256, 128, 8, 2, saved_h_format="fp8")
    with pytest.raises(ValueError, match="saved_h_format: expected one of"):
        MoELayer(64, 32, 8, 2, dtype=torch.float32, saved_h_format="e4m3")
    x, idx, w = torch.randn(4, 64), torch.zeros(4, 2, dtype=torch.int32), torch.full((4, 2), 0.5)
    weights = (torch.randn(8, 32, 64), torch.randn(8, 32, 64), torch.randn(8, 64, 32))
    config = json.dumps({**MoKConfig(64, 32, 8, 2).as_dict(), "saved_h_format": "MXFP8"}, sort_keys=True)  # (as config_text spells it)
    with pytest.raises(ValueError, match="saved_h_format: expected one of"):
        torch.ops.mok.moe_forward(x, idx, w, *weights, None, None, None, config, 0, True, False, 5.0)


def test_precompile_lists_the_quantize_kernels_for_an_mxfp8_h():
    base = MoKConfig(hidden=256, intermediate=128, num_experts=16, topk=4)
    plain = [v.name for v in plan_for(base, "sm_90a").variants()]
    packed = [v.name for v in plan_for(MoKConfig(**{**base.as_dict(), "saved_h_format": "mxfp8"}), "sm_90a").variants()]
    assert sorted(packed) == sorted([*plain, "quantize_mxfp8", "dequantize_mxfp8"])


@pytest.mark.parametrize("shared", [48, 32, None])  # its own h; its rows in the routed launches (h[:T]); none
def test_layer_keeps_h_packed_through_its_ops(shared):
    """On the CPU the ops run the reference, which recomputes what it needs: what is tested here is
    that the packed h is what autograd keeps, and that forward and backward carry it through."""
    torch.manual_seed(0)
    plain = MoELayer(64, 32, 8, 2, shared_intermediate=shared, dtype=torch.float32)
    packed = MoELayer(64, 32, 8, 2, shared_intermediate=shared, dtype=torch.float32, saved_h_format="mxfp8")
    packed.load_state_dict(plain.state_dict())
    kept = []
    x = torch.randn(3, 5, 64)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        out = packed(xs[1])
    hs = [t for t in kept if t.dtype == torch.uint8]
    assert hs and hs[0].shape[1] == packed_width(64) and hs[0].shape[0] >= 15 * 2  # every pair's h row
    if shared == 48:
        assert hs[1].shape == (15, packed_width(96))
    plain_kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: plain_kept.append(t) or t, lambda t: t):
        plain(xs[0])
    h_shape = (hs[0].shape[0], 64)  # [rows, 2I]: the plain layer keeps h so, the packed one does not
    assert any(t.shape == h_shape for t in plain_kept) and not any(t.shape == h_shape for t in kept)
    torch.testing.assert_close(out, plain(xs[0]), rtol=0, atol=0)
    out.square().sum().backward()
    plain(xs[0]).square().sum().backward()
    torch.testing.assert_close(xs[1].grad, xs[0].grad)
    torch.testing.assert_close(packed.gate_proj.grad, plain.gate_proj.grad)


def test_custom_ops_with_a_packed_h_pass_opcheck():
    h, shared_h = opchecked_layer_ops(saved_h_format="mxfp8")[:2]
    assert h.dtype == shared_h.dtype == torch.uint8 and shared_h.shape == (6, packed_width(96))
