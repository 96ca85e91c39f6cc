"""saved_h_format="recompute" (and "recompute_gate": h's up half kept, its gate half computed
again) on the CPU: the option, what the ops keep, what precompile lists, and the layer through its
ops (GPU: test_recompute_gpu.py, and tests/test_ep_gpu.py at EP > 1)."""

import pytest
import torch

from mok.config import MoKConfig
from mok.kernels.variants import grouped_gemm_variant
from mok.layer import MoELayer
from mok.plan import plan_for
from mok.torch_ops import forward_outputs

from helpers import opchecked_layer_ops


def test_the_option_is_a_saved_h_format():
    config = MoKConfig(256, 128, 8, 2, saved_h_format="recompute")
    assert config.recomputes_h and not MoKConfig(256, 128, 8, 2).recomputes_h
    assert not MoKConfig(256, 128, 8, 2, saved_h_format="mxfp8").recomputes_h
    with pytest.raises(ValueError, match=r"saved_h_format: expected one of \('bf16', 'mxfp8', 'recompute', 'recompute_gate'\), got 'recomputed'"):
        MoKConfig(256, 128, 8, 2, saved_h_format="recomputed")
    gate = MoKConfig(256, 128, 8, 2, saved_h_format="recompute_gate")
    assert gate.recomputes_gate and not gate.recomputes_h and not config.recomputes_gate
    with pytest.raises(ValueError, match=r"saved_h_format='recompute_gate': bf16 precision only .* got precision='mxfp8_emulated'"):
        MoKConfig(256, 128, 8, 2, saved_h_format="recompute_gate", precision="mxfp8_emulated")


@pytest.mark.parametrize("shared", [None, 96, 64])  # none; its own h; its rows in the routed launches (stacked)
def test_the_forward_op_keeps_no_h(shared):
    x, idx = torch.randn(10, 128), torch.zeros(10, 2, dtype=torch.int32)
    kept = forward_outputs(MoKConfig(128, 64, 8, 2, shared_intermediate=shared), x, idx, 0, True, shared == 64)
    rec = forward_outputs(MoKConfig(128, 64, 8, 2, shared_intermediate=shared, saved_h_format="recompute"), x, idx, 0, True, shared == 64)
    assert kept["h"][0][0] > 0 and rec["h"][0] == (0, 128)
    assert rec["shared_h"][0][0] == 0 and kept["shared_h"][0][0] == (10 if shared == 96 else 0)
    assert {n: v for n, v in rec.items() if n not in ("h", "shared_h")} == {n: v for n, v in kept.items() if n not in ("h", "shared_h")}


@pytest.mark.parametrize("shared", [None, 96, 64])  # none; its own h (kept whole); its rows in the routed launches (stacked)
def test_the_forward_op_keeps_the_up_half_of_h(shared):
    x, idx = torch.randn(10, 128), torch.zeros(10, 2, dtype=torch.int32)
    kept = forward_outputs(MoKConfig(128, 64, 8, 2, shared_intermediate=shared), x, idx, 0, True, shared == 64)
    half = forward_outputs(MoKConfig(128, 64, 8, 2, shared_intermediate=shared, saved_h_format="recompute_gate"), x, idx, 0, True,
                           shared == 64)
    assert half["h"][0] == (kept["h"][0][0], 64) and half["shared_h"] == kept["shared_h"]
    assert {n: v for n, v in half.items() if n != "h"} == {n: v for n, v in kept.items() if n != "h"}


@pytest.mark.parametrize("options", [{}, {"ep_size": 2}, {"gate_up_layout": "interleaved", "one_launch": True}])
def test_precompile_lists_the_gate_gemm_that_recomputes_h_gate(options):
    """"recompute_gate": the gate GEMM alone, plain, in the gate/up GEMM's 128-column tile (gathering
    its rows at one GPU; on the pulled rows at EP; reading w_gate in place where it is a part of one
    tensor)."""
    base = dict(hidden=512, intermediate=256, num_experts=16, topk=4, **options)
    kept = plan_for(MoKConfig(**base), "sm_90a").variants()
    half = plan_for(MoKConfig(**base, saved_h_format="recompute_gate"), "sm_90a").variants()
    gate = grouped_gemm_variant(256, 512, tile_n=128, gather_a="ep_size" not in options)
    in_place = [grouped_gemm_variant(256, 512, tile_n=128, gather_a=True, b_expert_stride=2 * 256 * 512, b_row_stride=2 * 512)]
    assert [v for v in half if v not in kept] == [gate] + (in_place if options.get("gate_up_layout") else [])


@pytest.mark.parametrize("one_launch", [False, True])
def test_precompile_lists_the_gate_up_gemm_the_backward_runs_again(one_launch):
    base = dict(hidden=512, intermediate=256, num_experts=16, topk=4, shared_intermediate=256, one_launch=one_launch)
    kept = plan_for(MoKConfig(**base), "sm_90a").variants()
    rec = plan_for(MoKConfig(**base, saved_h_format="recompute"), "sm_90a").variants()
    gate_up = grouped_gemm_variant(256, 512, epilogue="swiglu_save", gather_a=True)  # (bf16, one GPU: gathered in the GEMM)
    assert gate_up in rec
    added = [v for v in rec if v not in kept]
    assert added == ([gate_up] if one_launch else [])  # (the multi-launch forward already launches it)


def layers_kept_and_checked(saved_h_format: str, shared) -> dict:
    """A default layer and one with ``saved_h_format`` (the same weights, fp32 on the CPU): what
    autograd keeps for each's backward ({"plain": [...], "other": [...]}), after checking that the
    two give the same output and the same gradients of x and of every parameter, bit for bit."""
    torch.manual_seed(0)
    plain = MoELayer(64, 40, 8, 2, shared_intermediate=shared, dtype=torch.float32)
    other = MoELayer(64, 40, 8, 2, shared_intermediate=shared, dtype=torch.float32, saved_h_format=saved_h_format)
    other.load_state_dict(plain.state_dict())
    x = torch.randn(3, 5, 64)
    kept = {}
    for name, layer in (("plain", plain), ("other", other)):
        tensors = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: tensors.append(t) or t, lambda t: t):
            layer(x.clone())
        kept[name] = tensors
    xs = [x.clone().requires_grad_() for _ in range(2)]
    outs = [plain(xs[0]), other(xs[1])]
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
    for out in outs:
        out.square().sum().backward()
    torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=0, atol=0)
    for a, b in zip(other.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    return kept


def total_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("shared", [48, 40, None])  # its own h; its rows in the routed launches; none
def test_layer_keeps_no_h_through_its_ops(shared):
    """On the CPU the ops run the reference, which recomputes whatever it needs: what is tested here
    is that the recomputing layer's ops keep exactly h's bytes fewer and carry the same output and
    gradients."""
    kept = layers_kept_and_checked("recompute", shared)
    h_widths = (80, 2 * (shared or 40))  # 2I and 2I_s (no weight or activation has them)
    h_bytes = total_bytes(t for t in kept["plain"] if t.ndim == 2 and t.shape[1] in h_widths)
    assert h_bytes >= 15 * 2 * 80 * 4  # every pair's row of h
    assert total_bytes(kept["plain"]) - total_bytes(kept["other"]) == h_bytes
    assert not any(t.numel() for t in kept["other"] if t.ndim == 2 and t.shape[1] in h_widths)


def test_layer_keeps_the_up_half_of_h_through_its_ops():
    """saved_h_format="recompute_gate" on the CPU: the layer's ops keep h's up half, half of h's bytes
    fewer than the default, and carry the same output and gradients (the reference recomputes
    whatever it needs; the GPU backward's recompute: test_recompute_gpu.py)."""
    kept = layers_kept_and_checked("recompute_gate", None)
    h = [t for t in kept["plain"] if t.ndim == 2 and t.shape[1] == 80]  # (2I: no weight or activation has it)
    up = [t for t in kept["other"] if t.ndim == 2 and t.shape[1] == 40 and t.shape[0] == h[0].shape[0]]
    assert len(h) == len(up) == 1 and torch.equal(up[0], h[0][:, 40:])
    assert total_bytes(kept["plain"]) - total_bytes(kept["other"]) == total_bytes(h) // 2


def test_custom_ops_without_h_pass_opcheck():
    h, shared_h = opchecked_layer_ops(saved_h_format="recompute")[:2]
    assert h.shape[0] == 0 and shared_h.shape[0] == 0  # neither h nor the shared expert's h


def test_custom_ops_with_the_up_half_of_h_pass_opcheck():
    h, shared_h = opchecked_layer_ops(saved_h_format="recompute_gate")[:2]
    assert h.shape[1] == 32 and h.shape[0] > 0 and shared_h.shape == (6, 2 * 48)  # (I; the shared expert's h kept whole)
