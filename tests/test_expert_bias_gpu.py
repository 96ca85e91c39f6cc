"""Expert biases (gpt-oss's: b_gate, b_up [E, I], b_down [E, H]) in Hopper's kernels, on the H200.

The GEMMs add them to the products in their epilogues (so h keeps x·Wᵀ + b), the backward sums
them per expert in a fixed order (mok/kernels/common/bias_grads.py) and adds the down bias's
piece <dout, b_down> to the router-weight gradient. Checked here: each kernel against a float64
reference (outputs poisoned first), the layer's forward and every gradient against autograd of the
fp32 reference (SwiGLU and gpt-oss's clamped SwiGLU, widths the tile divides and gpt-oss's), the
bits run to run, for a sub-batch (batch invariance), with h recomputed, at EP = 2 emulated on one
GPU (equal to one GPU), and the layer (``MoELayer(bias=True)``) under autograd."""

import dataclasses

import pytest
import torch

from mok import ops, pipeline
from mok.config import MoKConfig
from mok.plan import Plan
from mok.runtime.arch import device_arch
from mok.reference import moe_reference

from helpers import gpu_layer, poisoned, rel_err, split_ranks, split_rows, worst_row_err

pytestmark = pytest.mark.gpu

CASES = [
    # T, H, I, E, k
    (1000, 2880, 2880, 32, 4),  # gpt-oss's widths (partial tiles)
    (700, 1024, 512, 16, 4),
    (333, 256, 136, 8, 2),  # I an odd multiple of 8
]


def biases_for(E, H, I, seed):
    """Random biases of a few tenths (bf16, CUDA): large enough to move every output, never zeros."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple((torch.randn(E, n, device="cuda", generator=g) * 0.3).bfloat16() for n in (I, I, H))


def plan_of(H, I, E, k, **options):
    return Plan(MoKConfig(H, I, E, k, expert_bias=True, **options), device_arch())  # (Hopper's, or SM100's there)


def train_step(plan, x, idx, w, experts, biases, dout, **kw):
    saved = pipeline.forward(plan, x, idx, w, experts, None, save=True, biases=biases, **kw)
    return saved.out, pipeline.backward(plan, dout, x, idx, w, experts, None, saved, biases=biases)


def all_bits(out, grads):
    return [out, grads.dx, grads.d_topk_w, grads.d_w_gate, grads.d_w_up, grads.d_w_down, *grads.d_biases]


def test_gemms_add_the_bias_to_each_product():
    """ops.grouped_gemm with biases: the plain product (partial last column tile), the SwiGLU form
    with h (gathered rows: padding rows get the bias alone) and the scatter-free plain product of
    whole tiles, against float64 of the bf16 operands."""
    T, H, I, E, k = 300, 1032, 2056, 8, 2
    x, idx, w, (wg, wu, wd), _ = gpu_layer(T, H, I, E, k, seed=3)
    b_gate, b_up, b_down = biases_for(E, H, I, seed=3)
    sched = ops.device_schedule(idx.int(), E, block_m=128)
    rows = ops.gather_rows(x, sched.row_token)
    expert_of_row = sched.tile_expert.long().repeat_interleave(128)[: rows.shape[0]]
    used = expert_of_row >= 0
    h = poisoned(rows.shape[0], 2 * I)
    a = ops.grouped_gemm(x, wg, sched.tile_expert, b2=wu, h_out=h, gather=sched.row_token, bias=b_gate, bias2=b_up)
    r64, e = rows.double()[used], expert_of_row[used]
    gate = torch.einsum("rh,rih->ri", r64, wg.double()[e]) + b_gate.double()[e]
    up = torch.einsum("rh,rih->ri", r64, wu.double()[e]) + b_up.double()[e]
    assert rel_err(h[used], torch.cat([gate, up], 1)) < 1e-2 and not h[used].isnan().any()
    assert rel_err(a[used], torch.nn.functional.silu(gate) * up) < 1e-2
    y = ops.grouped_gemm(a, wd, sched.tile_expert, bias=b_down)
    want = torch.einsum("ri,rhi->rh", a.double()[used], wd.double()[e]) + b_down.double()[e]
    assert rel_err(y[used], want) < 1e-2 and worst_row_err(y[used], want) < 2e-2


def test_bias_gradient_kernels_against_float64():
    """ops.expert_column_sums (each expert's rows, plain and weighted by the router weights) and
    ops.bias_router_pieces (the last column of the pieces, the others left as they were) against
    float64, at gpt-oss's widths, with an expert that gets no rows; the same bits on every run."""
    T, H, I, E, k = 900, 2880, 2880, 16, 4
    x, idx, w, _, _ = gpu_layer(T, H, 64, E - 1, k, seed=5)
    idx = idx + (idx >= 3).int()  # expert 3 gets no rows
    sched = ops.device_schedule(idx.int(), E, block_m=128)
    rows = ops.gather_rows(torch.randn(T, 2 * I, device="cuda").bfloat16(), sched.row_token)
    dout_rows = ops.gather_rows(torch.randn(T, H, device="cuda").bfloat16(), sched.row_token)
    b_down = biases_for(E, H, I, seed=5)[2]
    token, slot = sched.row_token.long(), sched.row_slot.long()
    counts, offsets = sched.expert_counts.tolist(), sched.expert_offsets.tolist()
    s = torch.zeros(rows.shape[0], dtype=torch.float64, device="cuda")
    s[token >= 0] = w.double()[token[token >= 0], slot[token >= 0]]
    want_plain = torch.stack([rows.double()[offsets[e]:offsets[e] + counts[e]].sum(0) for e in range(E)])
    want_weighted = torch.stack([(s[:, None] * dout_rows.double())[offsets[e]:offsets[e] + counts[e]].sum(0) for e in range(E)])
    got_plain = ops.expert_column_sums(rows, sched)
    got_weighted = ops.expert_column_sums(dout_rows, sched, topk_w=w)
    assert counts[3] == 0 and torch.equal(got_plain[3], torch.zeros_like(got_plain[3]))
    assert rel_err(got_plain, want_plain) < 1e-5 and rel_err(got_weighted, want_weighted) < 1e-5
    pieces = torch.full((rows.shape[0], 24), float("nan"), device="cuda")
    ops.bias_router_pieces(dout_rows, b_down, sched, pieces)
    e = sched.tile_expert.long().repeat_interleave(128)[: rows.shape[0]]
    want_piece = torch.where(token >= 0, (dout_rows.double() * b_down.double()[e.clamp(min=0)]).sum(1), 0.0)
    assert pieces[:, :-1].isnan().all() and rel_err(pieces[:, -1], want_piece) < 1e-5
    for _ in range(4):
        assert torch.equal(ops.expert_column_sums(dout_rows, sched, topk_w=w), got_weighted)
        assert torch.equal(ops.bias_router_pieces(dout_rows, b_down, sched, pieces.clone())[:, -1], pieces[:, -1])


@pytest.mark.parametrize("activation", ["swiglu", "clamped_swiglu"])
@pytest.mark.parametrize("T,H,I,E,k", CASES)
def test_forward_and_backward_match_autograd_of_the_reference(T, H, I, E, k, activation):
    x, idx, w, experts, _ = gpu_layer(T, H, I, E, k, seed=T + H)
    biases = biases_for(E, H, I, seed=T)
    dout = torch.randn(T, H, device="cuda").bfloat16()
    plan = plan_of(H, I, E, k, activation=activation)
    saved = pipeline.forward(plan, x, idx, w, experts, None, save=True, biases=biases, out=poisoned(T, H))
    grads = pipeline.backward(plan, dout, x, idx, w, experts, None, saved, biases=biases)
    leaves = [t.float().requires_grad_() for t in (x, w, *experts, *biases)]
    want = moe_reference(leaves[0], idx, leaves[1], *leaves[2:5], None, activation=activation, biases=tuple(leaves[5:]))
    want.backward(dout.float())
    assert not saved.out.isnan().any()
    assert rel_err(saved.out, want) <= 1e-2 and worst_row_err(saved.out, want.detach()) <= 5e-2
    got = [grads.dx, grads.d_topk_w, grads.d_w_gate, grads.d_w_up, grads.d_w_down, *grads.d_biases]
    names = ["dx", "d_topk_w", "d_w_gate", "d_w_up", "d_w_down", "d_b_gate", "d_b_up", "d_b_down"]
    for name, g, leaf in zip(names, got, leaves):
        assert g.shape == leaf.shape and not g.isnan().any(), name
        assert rel_err(g, leaf.grad) <= 2e-2, (name, rel_err(g, leaf.grad))


def test_bits_are_deterministic_batch_invariant_and_equal_with_h_recomputed_or_in_one_launch():
    T, H, I, E, k = 2048, 2880, 2880, 16, 4
    x, idx, w, experts, _ = gpu_layer(T, H, I, E, k, seed=7)
    biases = biases_for(E, H, I, seed=7)
    dout = torch.randn(T, H, device="cuda").bfloat16()
    plan = plan_of(H, I, E, k)
    first = all_bits(*train_step(plan, x, idx, w, experts, biases, dout))
    for _ in range(9):
        assert all(torch.equal(a, b) for a, b in zip(all_bits(*train_step(plan, x, idx, w, experts, biases, dout)), first))
    for options in (dict(saved_h_format="recompute"), dict(one_launch=True)):  # h recomputed; the forward in one launch
        again = all_bits(*train_step(plan_of(H, I, E, k, **options), x, idx, w, experts, biases, dout))
        assert all(torch.equal(a, b) for a, b in zip(again, first)), options
    rows = torch.randperm(T, device="cuda")[:17]
    part_out, part = train_step(plan, *(t[rows].contiguous() for t in (x, idx, w)), experts, biases, dout[rows].contiguous())
    assert torch.equal(part_out, first[0][rows]) and torch.equal(part.dx, first[1][rows]) and torch.equal(part.d_topk_w, first[2][rows])


@pytest.mark.parametrize("one_launch", [False, True])
def test_ep_with_biases_equals_one_gpu_bitwise(one_launch):
    """EP = 2 emulated on one GPU (two workspaces on one buffer, two streams): each rank's output,
    dx, d_topk_w and its experts' weight and bias gradients are the single-GPU bits of the
    concatenated batch, the forward staged or in one launch per rank."""
    from mok.pipeline.workspace import EPLayout, EPWorkspace

    world, counts, H, I, E, k = 2, (300, 517), 1032, 520, 8, 4
    total = sum(counts)
    x, idx, w, experts, _ = gpu_layer(total, H, I, E, k, seed=11)
    biases = biases_for(E, H, I, seed=11)
    dout = torch.randn(total, H, device="cuda").bfloat16()
    want_out, want = train_step(plan_of(H, I, E, k), x, idx, w, experts, biases, dout)
    layout = EPLayout(world=world, max_tokens=max(counts) + 5, hidden=H, topk=k)
    per_rank = split_ranks(world, counts, x, idx, w, experts, None)
    douts = split_rows(dout, counts)
    local = E // world
    rank_biases = [tuple(b[p * local:(p + 1) * local].contiguous() for b in biases) for p in range(world)]
    plan = plan_of(H, I, E, k, ep_size=world, one_launch=one_launch)

    def forward(ws, p, timeout_s):
        xr, ir, wr, *ex, _ = per_rank[p]
        return pipeline.forward(plan, xr, ir, wr, tuple(ex), None, workspace=ws, save=True, check_routing=False, timeout_s=timeout_s,
                                biases=rank_biases[p])

    def backward(ws, p, saved, timeout_s):
        xr, ir, wr, *ex, _ = per_rank[p]
        return pipeline.backward(plan, douts[p], xr, ir, wr, tuple(ex), None, saved, workspace=ws, timeout_s=timeout_s,
                                 biases=rank_biases[p])

    # every kernel loaded once first, by rank 0 alone on throwaway workspaces (its waits time out at
    # once): CUDA loads a kernel at its first launch, and loading waits for the device
    saved = forward(EPWorkspace.local_group(layout)[0], 0, 1e-4)
    backward(EPWorkspace.local_group(layout)[0], 0, saved, 1e-4)
    torch.cuda.synchronize()
    workspaces = EPWorkspace.local_group(layout)
    streams = [torch.cuda.Stream() for _ in workspaces]
    results = []
    for p, (ws, stream) in enumerate(zip(workspaces, streams)):
        with torch.cuda.stream(stream):
            saved = forward(ws, p, 20.0)
            results.append((saved.out, backward(ws, p, saved, 20.0)))
    torch.cuda.synchronize()
    for ws in workspaces:
        ws.check()
    grads = [g for _, g in results]
    assert torch.equal(torch.cat([out for out, _ in results]), want_out)
    for name in ("dx", "d_topk_w", "d_w_gate", "d_w_up", "d_w_down"):
        assert torch.equal(torch.cat([getattr(g, name) for g in grads]), getattr(want, name)), name
    for i in range(3):
        assert torch.equal(torch.cat([g.d_biases[i] for g in grads]), want.d_biases[i]), i


def test_layer_with_biases_trains_on_the_gpu_as_on_the_cpu():
    """MoELayer(bias=True, activation="clamped_swiglu") on the GPU: output and every parameter's
    gradient (the biases' included) against the same layer on the CPU reference path in fp32."""
    import copy

    from mok import MoELayer

    torch.manual_seed(0)
    cpu = MoELayer(1032, 520, 8, 2, bias=True, activation="clamped_swiglu", dtype=torch.float32)
    for p in cpu.parameters():
        torch.nn.init.normal_(p, std=0.05)
    with torch.no_grad():
        for b in cpu.expert_biases():
            b.normal_(0, 0.3)
    gpu = copy.deepcopy(cpu).cuda().bfloat16()
    x = torch.randn(300, 1032)
    idx = torch.stack([torch.randperm(8)[:2] for _ in range(300)]).int()
    topk_w = torch.rand(300, 2)
    out_cpu = cpu(x, topk_idx=idx, topk_w=topk_w)
    out_gpu = gpu(x.cuda().bfloat16(), topk_idx=idx.cuda(), topk_w=topk_w.cuda())
    dout = torch.randn_like(out_cpu)
    out_cpu.backward(dout)
    out_gpu.backward(dout.cuda().bfloat16())
    assert rel_err(out_gpu.cpu(), out_cpu) < 1e-2
    on_gpu = dict(gpu.named_parameters())
    trained = [name for name, p in cpu.named_parameters() if p.grad is not None]  # (external routing: not the router)
    assert {"gate_bias", "up_bias", "down_bias", "gate_proj", "down_proj"} <= set(trained)
    for name in trained:
        assert on_gpu[name].grad is not None and rel_err(on_gpu[name].grad.cpu(), cpu.get_parameter(name).grad) < 3e-2, name


@pytest.mark.parametrize("precision", ["bf16", "fp8_block", "mxfp8_emulated"])
def test_biases_beside_a_shared_expert_and_with_main_grads(precision):
    """Biased routed experts beside a shared expert of the routed width (which then runs in launches
    of its own), bf16, FP8 with block scales and MXFP8 (emulated): the output and every gradient
    against autograd of the fp32 reference (FP8, MXFP8: their rounding's error; the down bias's
    gradient has no FP8 product in it); with main_grads each weight's fp32 gradient is added once
    into its buffer (the bits of the fresh fp32 one added) and the biases' gradients are the plain
    backward's bits."""
    T, H, I, E, k = 700, 1024, 512, 16, 4
    x, idx, w, experts, shared = gpu_layer(T, H, I, E, k, I, seed=23)
    biases = biases_for(E, H, I, seed=23)
    dout = torch.randn(T, H, device="cuda").bfloat16()
    plan = plan_of(H, I, E, k, shared_intermediate=I, precision=precision)
    assert not plan.shared_in_routed
    saved = pipeline.forward(plan, x, idx, w, experts, shared, save=True, biases=biases, out=poisoned(T, H))
    grads = pipeline.backward(plan, dout, x, idx, w, experts, shared, saved, biases=biases)
    leaves = [t.float().requires_grad_() for t in (x, w, *experts, *shared, *biases)]
    want = moe_reference(leaves[0], idx, leaves[1], *leaves[2:5], tuple(leaves[5:8]), biases=tuple(leaves[8:]))
    want.backward(dout.float())
    out_tol, grad_tol = (1e-2, 2e-2) if precision == "bf16" else (0.1, 0.15)  # (FP8, MXFP8: tests/test_fp8_block_gpu.py's bounds)
    assert not saved.out.isnan().any() and rel_err(saved.out, want) <= out_tol
    got = [grads.dx, grads.d_topk_w, grads.d_w_gate, grads.d_w_up, grads.d_w_down, *grads.d_shared, *grads.d_biases]
    for n, (g, leaf) in enumerate(zip(got, leaves)):
        assert g.shape == leaf.shape and rel_err(g, leaf.grad) <= grad_tol, (n, rel_err(g, leaf.grad))
    assert rel_err(grads.d_biases[2], leaves[-1].grad) <= 1e-2
    fresh = pipeline.backward(plan, dout, x, idx, w, experts, shared, saved, grad_dtype=torch.float32, biases=biases)
    buffers = [torch.randn(t.shape, device="cuda") for t in (*experts, *shared)]
    before = [b.clone() for b in buffers]
    added = pipeline.backward(plan, dout, x, idx, w, experts, shared, saved, main_grads=tuple(buffers), biases=biases)
    for buf, old, new in zip(buffers, before, (fresh.d_w_gate, fresh.d_w_up, fresh.d_w_down, *fresh.d_shared)):
        assert torch.equal(buf, old + new)
    assert all(torch.equal(a, b) for a, b in zip(added.d_biases, grads.d_biases))


def test_layer_with_biases_adds_weight_gradients_into_main_grad():
    """MoELayer(bias=True, fuse_wgrad_accumulation=True) on the GPU: the weights' gradients land in
    their main_grad (autograd gets None for them), the biases' come as .grad, the bits of the same
    layer without fused accumulation."""
    import copy

    from mok import MoELayer

    torch.manual_seed(1)
    plain = MoELayer(1024, 512, 8, 2, bias=True, device="cuda")
    with torch.no_grad():
        for b in plain.expert_biases():
            b.normal_(0, 0.3)
    fused = copy.deepcopy(plain)
    fused.config = dataclasses.replace(fused.config, fuse_wgrad_accumulation=True)
    weights = (fused.gate_proj, fused.up_proj, fused.down_proj)
    for p in weights:
        p.main_grad = torch.zeros(p.shape, device="cuda")
    x = torch.randn(300, 1024, device="cuda").bfloat16()
    idx = torch.stack([torch.randperm(8)[:2] for _ in range(300)]).int().cuda()
    topk_w = torch.rand(300, 2, device="cuda")
    dout = torch.randn(300, 1024, device="cuda").bfloat16()
    plain(x, topk_idx=idx, topk_w=topk_w).backward(dout)
    fused(x, topk_idx=idx, topk_w=topk_w).backward(dout)
    for p, q in zip(weights, (plain.gate_proj, plain.up_proj, plain.down_proj)):
        assert p.grad is None and rel_err(p.main_grad, q.grad.float()) < 1e-2
    for b, c in zip(fused.expert_biases(), plain.expert_biases()):
        assert torch.equal(b.grad, c.grad)
