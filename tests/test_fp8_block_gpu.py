"""FP8 with 128-block scales (DeepSeek-V3's recipe) on the H200: the grouped GEMM (mok.fp8_block's
operands on Hopper's FP8 WGMMAs, promoted into fp32 every 128 of K: mok/kernels/sm90/block_scaled.py),
the quantizers, and the layer's precision="fp8_block".

The GEMM against the float64 product of the same (dequantized) operands: the plain, SwiGLU (with h)
and k-split forms, a last row tile that is partial, unused tiles left unwritten (outputs poisoned
first), expert biases in the epilogue, the same bits on every run and for a tile alone. The
quantizers against the rule's bits. The layer against a float64 emulation of the recipe and the
bf16 model, its bits run to run, per sub-batch and with h recomputed, the weights' cache, and
``MoELayer(precision="fp8_block")`` under autograd giving the pipeline's bits."""

import pytest
import torch

from mok import fp8_block as fp8
from mok import ops, pipeline

from helpers import gpu_layer, poisoned, rel_err

pytestmark = pytest.mark.gpu


def operands(R, N, K, E, seed, two=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(R, K, device="cuda", generator=g)
    b = torch.randn(E, N, K, device="cuda", generator=g) * K**-0.5
    tiles = torch.randint(0, E, (-(-R // 128),), device="cuda", generator=g, dtype=torch.int32)
    tiles[1] = -1  # an unused tile: its rows stay as they were
    a_q, b_q = fp8.quantize_rows(a), fp8.quantize_weights(b)
    b2_q = fp8.quantize_weights(torch.randn(E, N, K, device="cuda", generator=g) * K**-0.5) if two else None
    experts = tiles.long().repeat_interleave(128)[:R]
    return a_q, b_q, b2_q, tiles, experts


@pytest.mark.parametrize("R,N,K,E", [(1000, 256, 2048, 4), (644, 2048, 7168, 3)])
def test_plain_product_matches_float64_of_its_operands(R, N, K, E):
    a_q, b_q, _, tiles, experts = operands(R, N, K, E, seed=R)
    out = poisoned(R, N)
    ops.grouped_gemm(a_q, b_q, tiles, out=out)
    used = experts >= 0
    want = fp8.block_scaled_gemm_reference(a_q, b_q, experts)
    assert out[~used].isnan().all() and not out[used].isnan().any()
    assert rel_err(out[used], want[used]) < 5e-3
    again = ops.grouped_gemm(a_q, b_q, tiles)
    assert torch.equal(again[used], out[used])
    one = ops.grouped_gemm((a_q[0][:128].contiguous(), a_q[1][:, :128].contiguous()), b_q, tiles[:1])  # the first tile alone
    assert torch.equal(one, out[:128])


@pytest.mark.parametrize("k_split", [False, True])
def test_two_block_buffers_give_the_same_bits(k_split):
    """block_buffers=2 (a stage's WGMMAs overlapping the previous stage's promotion, the register
    hand-over on): the same sums in the same order, so the one-set kernel's bits; odd and even K
    block counts (K = 1152: 9 blocks; k_split: 9 a half), unused tiles left unwritten."""
    R, N, K, E = 900, 1024, 2304 if k_split else 1152, 3
    a_q, b_q, b2_q, tiles, experts = operands(R, N, K, E, seed=11, two=k_split)
    used = experts >= 0
    if k_split:
        b_q = fp8.quantize_weights(torch.randn(E, N, K // 2, device="cuda") * K**-0.5)
        b2_q = fp8.quantize_weights(torch.randn(E, N, K // 2, device="cuda") * K**-0.5)
    one, two = poisoned(R, N), poisoned(R, N)
    ops.grouped_gemm(a_q, b_q, tiles, b2=b2_q, k_split=k_split, out=one)
    ops.grouped_gemm(a_q, b_q, tiles, b2=b2_q, k_split=k_split, out=two, block_buffers=2)
    assert two[~used].isnan().all() and torch.equal(two[used], one[used])
    if not k_split:
        assert rel_err(two[used], fp8.block_scaled_gemm_reference(a_q, b_q, experts)[used]) < 5e-3


def test_swiglu_with_h_and_biases_and_the_k_split_form():
    R, N, K, E = 768, 512, 1024, 4
    a_q, b_q, b2_q, tiles, experts = operands(R, N, K, E, seed=3, two=True)
    used = experts >= 0
    bias = (torch.randn(E, N, device="cuda") * 0.3).bfloat16()
    bias2 = (torch.randn(E, N, device="cuda") * 0.3).bfloat16()
    h = poisoned(R, 2 * N)
    act = ops.grouped_gemm(a_q, b_q, tiles, b2=b2_q, h_out=h, bias=bias, bias2=bias2)
    e = experts.clamp(min=0)
    gate = fp8.block_scaled_gemm_reference(a_q, b_q, experts) + bias.double()[e]
    up = fp8.block_scaled_gemm_reference(a_q, b2_q, experts) + bias2.double()[e]
    assert rel_err(h[used], torch.cat([gate, up], 1)[used]) < 5e-3 and h[~used].isnan().all()
    assert rel_err(act[used], (torch.nn.functional.silu(gate) * up)[used]) < 1e-2
    # k_split: [dh_gate | dh_up] against two weights, each half of K with its own scales
    dh = fp8.quantize_rows(torch.randn(R, 2 * K, device="cuda"))
    w1, w2 = (fp8.quantize_weights(torch.randn(E, N, K, device="cuda") * K**-0.5) for _ in range(2))
    got = ops.grouped_gemm(dh, w1, tiles, b2=w2, k_split=True)
    halves = [(dh[0][:, :K].contiguous(), dh[1][: K // 128].contiguous()), (dh[0][:, K:].contiguous(), dh[1][K // 128:].contiguous())]
    want = fp8.block_scaled_gemm_reference(halves[0], w1, experts) + fp8.block_scaled_gemm_reference(halves[1], w2, experts)
    assert rel_err(got[used], want[used]) < 5e-3


@pytest.mark.parametrize("power_of_two", [False, True])
def test_quantizers_give_the_rule_s_bits(power_of_two):
    """ops.quantize_fp8_rows / quantize_fp8_weights against mok.fp8_block's rule computed on the CPU:
    the same E4M3 bytes and fp32 scales (an all-zero block, magnitudes over twelve decades); with
    rows_used, the rows in use the same."""
    g = torch.Generator(device="cuda").manual_seed(9)
    x = (torch.randn(1000, 2048, device="cuda", generator=g) * torch.logspace(-6, 6, 1000, device="cuda")[:, None]).bfloat16()
    x[3, 128:256] = 0
    q, s = ops.quantize_fp8_rows(x, power_of_two=power_of_two)
    want_q, want_s = fp8.quantize_rows(x.cpu(), power_of_two=power_of_two)
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s.cpu(), want_s)
    used = torch.tensor([300], dtype=torch.int32, device="cuda")
    q_used, s_used = ops.quantize_fp8_rows(x, power_of_two=power_of_two, rows_used=used)
    assert torch.equal(q_used[:300].view(torch.uint8), q[:300].view(torch.uint8)) and torch.equal(s_used[:, :300], s[:, :300])
    w = (torch.randn(3, 256, 384, device="cuda", generator=g) * 0.02).bfloat16()
    w[1, :128, 128:256] *= 1e4
    wq, ws = ops.quantize_fp8_weights(w, power_of_two=power_of_two)
    want_wq, want_ws = fp8.quantize_weights(w.cpu(), power_of_two=power_of_two)
    assert torch.equal(wq.cpu().view(torch.uint8), want_wq.view(torch.uint8)) and torch.equal(ws.cpu(), want_ws)


def fp8_plan(x, idx, experts, **options):
    from mok.config import MoKConfig
    from mok.plan import Plan

    E, I, H = experts[0].shape
    return Plan(MoKConfig(H, I, E, idx.shape[1], precision="fp8_block", **options), "sm_90a")


def fp8_recipe_reference(x, idx, w, experts):
    """float64 of the recipe: x per token and the weights per block quantized (mok.fp8_block), the
    FP8 products exact, a = silu(gate)·up rounded to bf16 (as the kernel hands it on) and quantized
    per row, the down product, the router-weighted sum."""
    q_x = fp8.quantize_rows(x)
    rows = fp8.dequantize_rows(*q_x)
    gate_w, up_w, down_w = (fp8.dequantize_weights(*fp8.quantize_weights(t)) for t in experts)
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in range(gate_w.shape[0]):
        token, slot = (idx == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        a = (torch.nn.functional.silu(rows[token] @ gate_w[e].T) * (rows[token] @ up_w[e].T)).bfloat16()
        y = fp8.dequantize_rows(*fp8.quantize_rows(a)) @ down_w[e].T
        out.index_add_(0, token, w[token, slot].double()[:, None] * y)
    return out


def test_fp8_block_layer_forward_follows_the_recipe_and_trains():
    """precision="fp8_block": the forward within 1e-2 of the float64 recipe (and within FP8's ~6% of
    the bf16 model), the backward (FP8 dgrad GEMMs, bf16 weight gradients, on the FP8 forward's h)
    within FP8's error of autograd of the bf16 model; the same bits on every run, for a sub-batch
    (per-token scales), with h recomputed."""
    from mok.reference import moe_reference

    T, H, I, E, k = 1500, 2048, 768, 16, 4
    x, idx, w, experts, _ = gpu_layer(T, H, I, E, k, seed=4)
    plan = fp8_plan(x, idx, experts)
    saved = pipeline.forward(plan, x, idx, w, experts, None, save=True, out=poisoned(T, H))
    assert not saved.out.isnan().any()
    assert rel_err(saved.out, fp8_recipe_reference(x, idx, w, experts)) < 1e-2
    leaves = [t.float().requires_grad_() for t in (x, w, *experts)]
    want = moe_reference(leaves[0], idx, leaves[1], *leaves[2:])
    assert rel_err(saved.out, want) < 0.1  # (E4M3 keeps 3 mantissa bits: ~6% of a bf16 model, measured on the CPU)
    dout = torch.randn(T, H, device="cuda").bfloat16()
    grads = pipeline.backward(plan, dout, x, idx, w, experts, None, saved)
    want.backward(dout.float())
    for name, got, leaf in zip(["dx", "d_topk_w", "d_w_gate", "d_w_up", "d_w_down"],
                               [grads.dx, grads.d_topk_w, grads.d_w_gate, grads.d_w_up, grads.d_w_down], leaves):
        assert rel_err(got, leaf.grad) < 0.15, (name, rel_err(got, leaf.grad))  # (two FP8 products in a row: ~9%)
    again = pipeline.forward(plan, x, idx, w, experts, None, save=True)
    used = int(saved.schedule.expert_offsets[-1])  # (rows past the last expert's are not written)
    assert torch.equal(again.out, saved.out) and torch.equal(again.h[:used], saved.h[:used])
    rows = torch.randperm(T, device="cuda")[:17]
    part = pipeline.forward(plan, *(t[rows].contiguous() for t in (x, idx, w)), experts, None)
    assert torch.equal(part.out, saved.out[rows])
    recomputed = pipeline.backward(fp8_plan(x, idx, experts, saved_h_format="recompute"), dout, x, idx, w, experts, None,
                                   pipeline.forward(fp8_plan(x, idx, experts, saved_h_format="recompute"), x, idx, w, experts, None, save=True))
    assert torch.equal(recomputed.dx, grads.dx) and torch.equal(recomputed.d_w_gate, grads.d_w_gate)


def test_fp8_block_layer_gives_the_pipeline_s_bits():
    """MoELayer(precision="fp8_block") under autograd (the custom ops, the weights' cache): output
    and every gradient the pipeline's, bit for bit."""
    from mok import MoELayer

    T, H, I, E, k = 700, 1024, 512, 8, 2
    x, idx, w, experts, _ = gpu_layer(T, H, I, E, k, seed=12)
    layer = MoELayer(H, I, E, k, precision="fp8_block", device="cuda")
    with torch.no_grad():
        for param, weight in zip((layer.gate_proj, layer.up_proj, layer.down_proj), experts):
            param.copy_(weight)
    x_leaf, w_leaf = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = layer(x_leaf, topk_idx=idx, topk_w=w_leaf)
    dout = torch.randn_like(out)
    out.backward(dout)
    plan = fp8_plan(x, idx, experts)
    saved = pipeline.forward(plan, x, idx, w, experts, None, save=True)
    grads = pipeline.backward(plan, dout, x, idx, w, experts, None, saved)
    assert torch.equal(out, saved.out) and torch.equal(x_leaf.grad, grads.dx) and torch.equal(w_leaf.grad, grads.d_topk_w)
    for param, want in zip((layer.gate_proj, layer.up_proj, layer.down_proj), (grads.d_w_gate, grads.d_w_up, grads.d_w_down)):
        assert torch.equal(param.grad, want)


def test_fp8_weights_are_quantized_once_per_version():
    """The weights' FP8 copies come from the cache while the weight is unchanged, and again after an
    in-place update: doubling w_down doubles every scale exactly, so the output doubles bit for bit."""
    from mok.pipeline.fp8_weights import quantized_once

    x, idx, w, experts, _ = gpu_layer(512, 1024, 512, 8, 2, seed=6)
    assert quantized_once(experts[2]) is quantized_once(experts[2])
    plan = fp8_plan(x, idx, experts)
    first = pipeline.forward(plan, x, idx, w, experts, None).out
    cached = quantized_once(experts[2])
    experts[2].mul_(2)
    assert quantized_once(experts[2]) is not cached
    assert torch.equal(pipeline.forward(plan, x, idx, w, experts, None).out, first * 2)


def test_swiglu_backward_on_fp8_matches_float64_of_its_operands():
    """ops.swiglu_backward_gemm on FP8 rows of dout and w_down's transpose (block scales): dh, s·a and
    the router pieces against float64 of the dequantized operands and the same saved h."""
    from mok.reference_backward import gated_activation_partials

    R, H, I, E, k = 640, 1024, 256, 4, 2
    g = torch.Generator(device="cuda").manual_seed(8)
    tiles = torch.randint(0, E, (R // 128,), device="cuda", generator=g, dtype=torch.int32)
    experts = tiles.long().repeat_interleave(128)
    dout_q = fp8.quantize_rows(torch.randn(R, H, device="cuda", generator=g))
    w_t = fp8.quantize_weights(torch.randn(E, I, H, device="cuda", generator=g) * H**-0.5)
    h = torch.randn(R, 2 * I, device="cuda", generator=g).bfloat16()
    row_token = torch.arange(R, device="cuda", dtype=torch.int32) // k
    row_slot = torch.arange(R, device="cuda", dtype=torch.int32) % k
    topk_w = torch.rand(R // k, k, device="cuda", generator=g)
    dh, a_scaled, pieces = ops.swiglu_backward_gemm(dout_q, w_t, tiles, h, row_token=row_token, row_slot=row_slot, topk_w=topk_w)
    d_a = fp8.block_scaled_gemm_reference(dout_q, w_t, experts)
    s = topk_w.double().flatten()[:, None]
    h_g, h_u = h.double()[:, :I], h.double()[:, I:]
    da_dg, da_du = gated_activation_partials("swiglu", h_g, h_u)
    a = torch.nn.functional.silu(h_g) * h_u
    assert rel_err(dh, torch.cat([s * d_a * da_dg, s * d_a * da_du], 1)) < 1e-2
    assert rel_err(a_scaled, s * a) < 1e-2
    assert rel_err(pieces.sum(1), (d_a * a).sum(1)) < 1e-2 and pieces.shape == (R, I // 64)


def test_gathered_fp8_rows_with_their_scales_match_the_rows_gathered_first():
    """The gate/up GEMM gathering x's E4M3 rows and their scales in its producer (each token quantized
    once) against the same product on rows gathered first and quantized per row: the same bits
    (quantizing is per row, so either way a row gets the same elements and scale); padding rows are
    zeros in h."""
    T, H, I, E, k = 1001, 1024, 256, 8, 2
    x, idx, _, (wg, wu, _), _ = gpu_layer(T, H, I, E, k, seed=12)
    sched = ops.device_schedule(idx, E, block_m=128)
    gate, up = fp8.quantize_weights(wg), fp8.quantize_weights(wu)
    h_gathered, h_first = poisoned(sched.capacity, 2 * I), poisoned(sched.capacity, 2 * I)
    a_gathered = ops.grouped_gemm(ops.quantize_fp8_rows(x), gate, sched.tile_expert, b2=up, h_out=h_gathered, gather=sched.row_token)
    rows = ops.gather_rows(x, sched.row_token)
    a_first = ops.grouped_gemm(ops.quantize_fp8_rows(rows), gate, sched.tile_expert, b2=up, h_out=h_first)
    used = sched.tile_expert.long().repeat_interleave(128)[: sched.capacity] >= 0
    assert torch.equal(h_gathered[used], h_first[used]) and torch.equal(a_gathered[used], a_first[used])
    padding = used & (sched.row_token.long() < 0)
    assert padding.any() and (h_gathered[padding] == 0).all()
