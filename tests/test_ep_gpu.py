"""Expert parallelism on one GPU: W ranks share one workspace buffer and run on W streams.

The kernels address every rank's region at rank·stride in one range, exactly as they will
over NVLink through the symmetric VMM mapping; here the "peers" are other streams.
"""

import pytest
import torch

from mok.pipeline.workspace import EPLayout, EPWorkspace

from helpers import (
    ep_moe_backward, ep_moe_forward, ep_moe_forward_saved, ep_training_case, ep_training_mismatches, gpu_layer, moe_backward, moe_forward,
    rel_err, run_train_ranks, split_ranks, split_rows, warm_up_both_forwards, warm_up_training,
)

pytestmark = pytest.mark.gpu


def warm_up(layout, per_rank_args, capacity=None, **dispatch):
    """Launch every kernel once, one rank at a time (its waits time out at once), on a throwaway workspace.

    CUDA loads a kernel lazily at its first launch, and loading waits for the device: on ONE
    GPU that would wait for another "rank's" spinning kernel, which waits for this rank. (On
    separate GPUs a rank's loading only waits for its own GPU.)
    """
    for ws, args in zip(EPWorkspace.local_group(layout, capacity=capacity), per_rank_args):
        ep_moe_forward(ws, *args, timeout_s=1e-4, **dispatch)
        torch.cuda.synchronize()


def run_ranks(workspaces, per_rank_args, timeout_s=20.0, check=True, **dispatch):
    streams = [torch.cuda.Stream() for _ in workspaces]
    outs = []
    torch.cuda.synchronize()
    for ws, args, stream in zip(workspaces, per_rank_args, streams):
        with torch.cuda.stream(stream):
            outs.append(ep_moe_forward(ws, *args, timeout_s=timeout_s, **dispatch))
    torch.cuda.synchronize()
    for ws in workspaces if check else ():
        ws.check()
    return outs


def replay_on_streams(graphs, workspaces):
    """Replay every rank's CUDA graph at once, each on a stream of its own; then check every workspace."""
    streams = [torch.cuda.Stream() for _ in graphs]
    torch.cuda.synchronize()
    for graph, stream in zip(graphs, streams):
        with torch.cuda.stream(stream):
            graph.replay()
    torch.cuda.synchronize()
    for ws in workspaces:
        ws.check()


@pytest.mark.parametrize("world,counts,E,k,shared_inter,routing", [
    (2, (300, 517), 8, 4, 256, "uniform"),
    (3, (128, 1, 250), 6, 2, None, "uniform"),
    (2, (200, 200), 8, 4, None, "one_expert"),  # every token's slot 0 on expert 0: rank 1 sends rank 0 everything
    (4, (100, 37, 250, 1), 8, 4, 256, "uniform"),  # EP = 4 (issue 7's size, emulated)
    (2, (0, 300), 8, 1, None, "one_expert"),  # rank 0 sends nothing; every token of rank 1 to expert 0, on rank 0
])
@pytest.mark.parametrize("dispatch", [{}, {"one_launch": True}])
def test_ep_equals_single_gpu_forward_bitwise(world, counts, E, k, shared_inter, routing, dispatch):
    """EP = W emulated on one GPU: within 1e-2 of the fp32 reference, bit for bit the single-GPU
    forward on the concatenated batch, and the same bits over 20 calls; with ``one_launch`` the
    whole forward of a rank is one kernel (its ranks resident at once on their share of the SMs)."""
    from mok.reference import moe_reference

    total = sum(counts)
    x, idx, w, experts, shared = gpu_layer(total, 512, 256, E, k, shared_inter, seed=world * 7 + total, routing=routing)
    want = moe_forward(x, idx, w, *experts, shared).out  # also compiles the GEMMs before any rank waits
    layout = EPLayout(world=world, max_tokens=max(counts) + 13, hidden=512, topk=k)
    args = split_ranks(world, counts, x, idx, w, experts, shared)
    warm_up(layout, args, **dispatch)
    workspaces = EPWorkspace.local_group(layout)
    first = torch.cat(run_ranks(workspaces, args, **dispatch))
    assert rel_err(first, moe_reference(x, idx, w, *experts, shared)) <= 1e-2
    assert torch.equal(first, want)
    for _ in range(19):  # epochs advance; every call gives the same bits
        assert torch.equal(torch.cat(run_ranks(workspaces, args, **dispatch)), first)


@pytest.mark.parametrize("dispatch", [{}, {"one_launch": True}])
@pytest.mark.parametrize("world,counts,E,k,shared_inter,routing,H", [
    (2, (300, 517), 8, 4, None, "uniform", 512),
    (3, (128, 0, 250), 6, 2, 256, "zipf", 512),  # a rank with no tokens; a shared expert (on x itself)
    (2, (200, 200), 8, 4, None, "one_expert", 512),
    (2, (300, 129), 8, 4, None, "uniform", 2064),  # rows ending in half a block of 32
])
def test_mxfp8_dispatch_gives_the_single_gpu_forward_of_the_dequantized_x_bitwise(world, counts, E, k, shared_inter, routing, H, dispatch):
    """dispatch_format='mxfp8': x crosses to the experts' ranks in MXFP8. The routed experts see
    mok.mxfp8's rounding of x (the torch reference rule) and the shared expert x itself: the
    output is within 1e-2 of the fp32 reference of exactly that, bit for bit the single-GPU
    forward of the rounded x (without a shared expert), the same over 5 calls, and not the bf16
    dispatch's output (the rounding happened). The same with the one-launch forward (which
    quantizes as it publishes and dequantizes as it copies rows into x_all). H = 2064: each row's
    last block holds 16 values, its scale from them (mok.mxfp8's rule)."""
    from mok.mxfp8 import fake_quantize_mxfp8
    from mok.reference import moe_reference

    total = sum(counts)
    x, idx, w, experts, shared = gpu_layer(total, H, 256, E, k, shared_inter, seed=world * 5 + total, routing=routing)
    x_rounded = fake_quantize_mxfp8(x).bfloat16()  # (exact: E4M3 values times a power of two fit in bf16)
    want_ref = moe_reference(x_rounded, idx, w, *experts, None)
    if shared is not None:
        want_ref = want_ref + (moe_reference(x, idx, torch.zeros_like(w), *experts, shared))
    layout = EPLayout(world=world, max_tokens=max(counts) + 13, hidden=H, topk=k)
    args = split_ranks(world, counts, x, idx, w, experts, shared)
    bf16_out = moe_forward(x, idx, w, *experts, shared).out
    warm_up(layout, args, dispatch_format="mxfp8", **dispatch)
    workspaces = EPWorkspace.local_group(layout)
    first = torch.cat(run_ranks(workspaces, args, dispatch_format="mxfp8", **dispatch))
    assert rel_err(first, want_ref) <= 1e-2
    assert not torch.equal(first, bf16_out)
    if shared is None:
        assert torch.equal(first, moe_forward(x_rounded, idx, w, *experts).out)
    for _ in range(4):
        assert torch.equal(torch.cat(run_ranks(workspaces, args, dispatch_format="mxfp8", **dispatch)), first)


@pytest.mark.parametrize("forward", [{}, {"one_launch": True}])
def test_mxfp8_dispatch_training_step_equals_single_gpu_backward_of_the_dequantized_x_bitwise(forward):
    """The backward after an MXFP8 dispatch (multi-launch or one-launch forward): the expert
    weights' gradients come from the rounded rows the forward kept, dx passes through the
    rounding (straight-through): every gradient is the single-GPU backward's on the rounded x,
    bit for bit, over two steps."""
    from mok.mxfp8 import fake_quantize_mxfp8

    world, counts = 2, (260, 190)
    x, idx, w, experts, _ = gpu_layer(sum(counts), 512, 256, 8, 4, None, seed=41, routing="uniform")
    x_rounded = fake_quantize_mxfp8(x).bfloat16()
    dout = torch.randn(sum(counts), 512, device="cuda").bfloat16()
    saved = moe_forward(x_rounded, idx, w, *experts, save_for_backward=True)
    want = moe_backward(dout, x_rounded, idx, w, *experts, None, saved)
    layout = EPLayout(world=world, max_tokens=max(counts), hidden=512, topk=4)
    args = split_ranks(world, counts, x, idx, w, experts, None)
    douts = split_rows(dout, counts)
    warm_up_training(layout, args, douts, dispatch_format="mxfp8", **forward)
    workspaces = EPWorkspace.local_group(layout)
    for _ in range(2):
        results = run_train_ranks(workspaces, args, douts, dispatch_format="mxfp8", **forward)
        assert ep_training_mismatches(results, saved.out, want) == []


@pytest.mark.parametrize("dispatch", [{}, {"one_launch": True}])
def test_a_rank_that_skips_the_call_makes_the_other_raise_not_hang(dispatch):
    x, idx, w, experts, _ = gpu_layer(64, 512, 256, 4, 2, None, seed=5)
    layout = EPLayout(world=2, max_tokens=64, hidden=512, topk=2)
    ws0, _ = EPWorkspace.local_group(layout)
    args = split_ranks(2, (32, 32), x, idx, w, experts, None)[0]
    ep_moe_forward(ws0, *args, timeout_s=0.2, **dispatch)  # rank 1 never calls
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match=r"rank 0 timed out in phase publish .* waiting for rank 1"):
        ws0.check()


@pytest.mark.parametrize("world,counts,E,k,shared_inter,routing", [
    (2, (300, 517), 8, 4, 256, "uniform"),
    (3, (128, 1, 250), 6, 2, None, "zipf"),
    (2, (200, 200), 8, 4, None, "one_expert"),
    (4, (100, 37, 250, 1), 8, 4, 256, "zipf"),  # EP = 4 (issue 7's size, emulated)
    (2, (0, 300), 8, 1, 256, "one_expert"),  # rank 0 sends nothing; every token to expert 0, on rank 0
])
@pytest.mark.parametrize("forward", [{}, {"one_launch": True}, {"saved_h_format": "recompute"},
                                     {"one_launch": True, "saved_h_format": "recompute"}, {"saved_h_format": "recompute_gate"}],
                         ids=["kept", "one_launch-kept", "recompute", "one_launch-recompute", "recompute_gate"])
def test_ep_gradients_equal_single_gpu_backward_bitwise(world, counts, E, k, shared_inter, routing, forward):
    """EP = 2, 3 (emulated on one GPU) against the fused single-GPU backward on the concatenated
    batch: dx, d_topk_w and every expert's weight gradients are the same bits; the shared
    expert's weight gradients, summed over ranks, agree to rounding. ``forward``: the forward
    the backward follows (its one-launch version keeps h and the rows the same; with
    saved_h_format="recompute" nothing keeps h and the backward computes it from the kept rows; with
    "recompute_gate" its gate half)."""
    total = sum(counts)
    x, idx, w, experts, shared = gpu_layer(total, 512, 256, E, k, shared_inter, seed=world * 11 + total, routing=routing)
    dout = torch.randn(total, 512, device="cuda").bfloat16()
    saved = moe_forward(x, idx, w, *experts, shared, save_for_backward=True)
    want = moe_backward(dout, x, idx, w, *experts, shared, saved)
    layout = EPLayout(world=world, max_tokens=max(counts) + 5, hidden=512, topk=k)
    args = split_ranks(world, counts, x, idx, w, experts, shared)
    douts = split_rows(dout, counts)
    warm_up_training(layout, args, douts, **forward)
    workspaces = EPWorkspace.local_group(layout)
    for _ in range(2):  # a second training step on the same workspace: the same bits
        results = run_train_ranks(workspaces, args, douts, **forward)
        assert torch.equal(torch.cat([out for out, _ in results]), saved.out)
        grads = [g for _, g in results]
        assert torch.equal(torch.cat([g.dx for g in grads]), want.dx)
        assert torch.equal(torch.cat([g.d_topk_w for g in grads]), want.d_topk_w)
        for name in ("d_w_gate", "d_w_up", "d_w_down"):
            assert torch.equal(torch.cat([getattr(g, name) for g in grads]), getattr(want, name)), name
        if shared is not None:
            for i in range(3):
                summed = sum(g.d_shared[i].float() for g in grads)
                assert float((summed - want.d_shared[i].float()).norm() / want.d_shared[i].float().norm()) < 1e-2


@pytest.mark.parametrize("world,counts,shared_inter,options", [
    (2, (300, 517), 256, {"precision": "fp8_block"}),  # a shared expert (on each rank's own tokens)
    (3, (0, 200, 333), None, {"precision": "fp8_block", "saved_h_format": "recompute"}),  # a rank with no tokens; h recomputed
    (2, (300, 517), 256, {"precision": "mxfp8_emulated"}),  # MXFP8's numerics (SM100: its GEMMs, tests/test_sm100_gpu.py)
])
def test_quantized_ep_training_step_equals_single_gpu_bitwise(world, counts, shared_inter, options):
    """FP8 precisions at EP = 2, 3 (emulated): the rows cross in bf16 and are quantized per row on
    the experts' rank (per-row scales: the bytes of x's own quantization at one GPU), the down
    projection and dx push their products into the owners' slots. Output, dx, d_topk_w and every
    expert's weight gradients are the single-GPU bits on the concatenated batch; the shared
    expert's weight gradients, summed over ranks, agree to rounding."""
    total, H, I, E, k = sum(counts), 512, 256, 12, 4
    x, idx, w, experts, shared = gpu_layer(total, H, I, E, k, shared_inter, seed=31 + world)
    dout = torch.randn(total, H, device="cuda").bfloat16()
    saved = moe_forward(x, idx, w, *experts, shared, save_for_backward=True, **options)
    want = moe_backward(dout, x, idx, w, *experts, shared, saved, **options)
    layout = EPLayout(world=world, max_tokens=max(counts) + 3, hidden=H, topk=k)
    args = split_ranks(world, counts, x, idx, w, experts, shared)
    douts = split_rows(dout, counts)
    warm_up_training(layout, args, douts, **options)
    results = run_train_ranks(EPWorkspace.local_group(layout), args, douts, **options)
    grads = [g for _, g in results]
    assert torch.equal(torch.cat([out for out, _ in results]), saved.out)
    for name in ("dx", "d_topk_w", "d_w_gate", "d_w_up", "d_w_down"):
        assert torch.equal(torch.cat([getattr(g, name) for g in grads]), getattr(want, name)), name
    if shared is not None:
        for i in range(3):
            assert rel_err(sum(g.d_shared[i].float() for g in grads), want.d_shared[i]) < 1e-2


def test_row_tile_pairs_at_ep_give_the_single_gpu_training_bits():
    """row_tile_pairs at EP = 2 (emulated): the gate/up GEMM on the pulled rows, the down projection
    and dx pushing into the owners' slots, all on clusters sharing the weight tile: every output
    and gradient the single-GPU bits (without pairs)."""
    world, counts = 2, (300, 517)
    per_rank, douts, want_out, want = ep_training_case(world, counts, 512, 256, 8, 4, seed=71, routing="zipf")
    layout = EPLayout(world=world, max_tokens=max(counts), hidden=512, topk=4)
    warm_up_training(layout, per_rank, douts, row_tile_pairs=True)
    results = run_train_ranks(EPWorkspace.local_group(layout), per_rank, douts, row_tile_pairs=True)
    assert ep_training_mismatches(results, want_out, want) == []


@pytest.mark.parametrize("world,counts,scales", [(2, (300, 517), "power_of_two"), (3, (0, 200, 333), "fp32"), (2, (200, 200), "fp32")])
def test_fp8_dispatch_training_step_crosses_the_rows_its_fc1_takes(world, counts, scales, H=528):
    """dispatch_format='fp8_block' (precision fp8_block): x crosses to the experts' ranks as the FP8
    rows its fc1 takes, quantized once by its owner, and in the backward dout as the rows the
    SwiGLU backward takes. The forward is the bf16 dispatch's, bit for bit (the same per-row
    quantization, done before the link instead of after); the backward's x and dout rows are those
    FP8 rows' values: with power-of-two scales (exact in bf16, and quantized again to the same
    values) every output and gradient is the single-GPU step's on x and dout rounded through FP8
    (mok.fp8_block's rule), bit for bit; with fp32 scales the step on x and dout themselves, dx and
    the router weights' gradient bit for bit (the FP8 GEMMs read the same bytes), the weight
    gradients within FP8's rounding; twice, on one set of workspaces. (H = 528: a
    partial last 128-block of x's rows; SM100, whole blocks and E8M0 scales in the MMA order, runs
    it at H = 512 with power-of-two scales: tests/test_sm100_gpu.py.)"""
    from mok import fp8_block

    total, I, E, k = sum(counts), 256, 12, 4
    options = dict(precision="fp8_block", fp8_scales=scales)
    x, idx, w, experts, _ = gpu_layer(total, H, I, E, k, None, seed=53 + world, routing="zipf" if world == 3 else "uniform")
    dout = torch.randn(total, H, device="cuda").bfloat16()
    pow2 = scales == "power_of_two"
    x_rounded, dout_rounded = (fp8_block.dequantize_rows(*fp8_block.quantize_rows(t.float().cpu(), power_of_two=pow2)).bfloat16().cuda()
                               for t in (x, dout))
    saved = moe_forward(x_rounded if pow2 else x, idx, w, *experts, save_for_backward=True, **options)
    want = moe_backward(dout_rounded if pow2 else dout, x_rounded if pow2 else x, idx, w, *experts, None, saved, **options)
    layout = EPLayout(world=world, max_tokens=max(counts) + 3, hidden=H, topk=k)
    args = split_ranks(world, counts, x, idx, w, experts, None)
    douts = split_rows(dout, counts)
    for dispatch_format in ("bf16", "fp8_block"):  # (both runs' kernels loaded before any rank spins)
        warm_up_training(layout, args, douts, dispatch_format=dispatch_format, **options)
    workspaces = EPWorkspace.local_group(layout)
    bf16_dispatch = run_train_ranks(EPWorkspace.local_group(layout), args, douts, **options)
    for _ in range(2):
        results = run_train_ranks(workspaces, args, douts, dispatch_format="fp8_block", **options)
        out = torch.cat([o for o, _ in results])
        assert torch.equal(out, torch.cat([o for o, _ in bf16_dispatch])) and torch.equal(out, saved.out)
        grads = [g for _, g in results]
        rounded = ("d_w_gate", "d_w_up", "d_w_down")  # (from x's and dout's values: their FP8 rounding with fp32 scales)
        for name in ("dx", "d_topk_w") + (rounded if pow2 else ()):
            assert torch.equal(torch.cat([getattr(g, name) for g in grads]), getattr(want, name)), name
        for name in () if pow2 else rounded:  # (E4M3's 3 mantissa bits)
            got = torch.cat([getattr(g, name) for g in grads])
            assert 0 < rel_err(got, getattr(want, name)) < 0.05, name


@pytest.mark.parametrize("world,counts,E,k,hidden", [(2, (300, 517), 8, 4, 1024), (3, (128, 0, 250), 12, 8, 1024), (2, (300, 200), 8, 4, 2880)])
def test_fp8_dispatch_in_the_mma_order_writes_each_token_s_scales_as_e8m0(world, counts, E, k, hidden):
    """pull_rows(rows_format="fp8_block", scale_order="mma") (SM100's dispatch_format="fp8_block";
    the dispatch is arch-neutral, so checked here on emulated ranks) into a packed buffer poisoned
    with 0xFF (NaN as E4M3 and as E8M0): each row the E4M3 bytes its token's owner published
    (mok.fp8_block's power-of-two rule), the token's 128-block scales as their E8M0 bytes (exponent
    + 127) at each block's four 32-blocks in mok.mxfp8's MMA order (mma_scale_layout of the
    reference bytes), zero elements and scale bytes in the padding rows, nothing written past the
    schedule's rows; the elements those of the fp32-scale dispatch. H = 2880: a row's last block
    has two 32-blocks, the layout's padding (127) after them."""
    from mok import fp8_block, ops
    from mok.mxfp8 import mma_scale_layout
    from mok.pipeline.exchange import exchange_kernels, pull_rows, quantized_region
    from mok.pipeline.stages import fp8_rows, packed_fp8_rows
    from mok.runtime import launch

    t_max = 640
    layout = EPLayout(world=world, max_tokens=t_max, hidden=hidden, topk=k)
    ws = EPWorkspace.local_group(layout)
    routing = torch.full((world * t_max, k), -1, dtype=torch.int32, device="cuda")
    x_all = torch.zeros(world * t_max, hidden, dtype=torch.bfloat16, device="cuda")
    for p, count in enumerate(counts):  # (each owner's region as its quantizing publish leaves it: elements, then scales per token)
        x = (torch.randn(count, hidden, device="cuda") * torch.logspace(-3, 3, hidden, device="cuda")).bfloat16()
        q, s = ops.quantize_fp8_rows(x, power_of_two=True)
        elements, scales = quantized_region(ws[p], p, count, "fp8_block")
        elements.copy_(q)
        scales.copy_(s.T)
        x_all[p * t_max:p * t_max + count] = x
        routing[p * t_max:p * t_max + count] = torch.rand(count, E, device="cuda").topk(k, dim=1).indices.int()
    want_q, want_s = fp8_block.quantize_rows(x_all.float().cpu(), power_of_two=True)  # [W·T_max, H], [H / 128, W·T_max]
    exponents = (torch.log2(want_s.T.double()).round().long() + 127).repeat_interleave(4, dim=1)[:, : -(-hidden // 32)]  # [W·T_max, ceil(H / 32)]
    stream = launch.stream(torch.device("cuda"))
    for rank in range(world):
        sched = ops.device_schedule(routing, E, rank=rank, world_size=world)
        kernels = exchange_kernels(ws[rank], ws[rank].buffer.device, "fp8_block", True, "mma")
        poisoned = packed_fp8_rows(sched.capacity, hidden, "cuda").fill_(0xFF)
        rows = pull_rows(ws[rank], kernels, "x", sched, stream, rows_format="fp8_block", scale_order="mma", out=poisoned)
        kernels = exchange_kernels(ws[rank], ws[rank].buffer.device, "fp8_block", True)
        fp32_rows = pull_rows(ws[rank], kernels, "x", sched, stream, rows_format="fp8_block")
        torch.cuda.synchronize()
        assert rows.data_ptr() == poisoned.data_ptr()
        used = int(sched.expert_offsets[-1])
        token = sched.row_token[:used].long().cpu()
        assert used % 128 == 0 and 0 < used < sched.capacity and int((token >= 0).sum()) > 0
        padding = (token < 0)[:, None]
        elements, scales = fp8_rows(rows, hidden, "mma")
        want_elements = torch.where(padding, 0, want_q.view(torch.uint8)[token.clamp(min=0)])
        want_bytes = torch.where(padding, 0, exponents[token.clamp(min=0)]).to(torch.uint8)
        assert torch.equal(elements[:used].cpu().view(torch.uint8), want_elements), f"rank {rank}"
        assert torch.equal(scales[: used // 128].cpu(), mma_scale_layout(want_bytes)), f"rank {rank}"
        assert bool((elements[used:].view(torch.uint8) == 0xFF).all()) and bool((scales[used // 128:] == 0xFF).all())
        assert torch.equal(elements[:used].view(torch.uint8), fp8_rows(fp32_rows, hidden)[0][:used].view(torch.uint8))


@pytest.mark.parametrize("world", [2, 3])
def test_ep_training_steps_with_a_new_batch_every_step_on_one_workspace_equal_single_gpu_bitwise(world):
    """One long-lived workspace, a different batch at every step: token counts that shrink and grow
    (0 and 1 included), uniform, Zipf and all-to-one-expert routing, the multi-launch and the
    one-launch forward in turn. Nothing from an earlier, larger call may leak into a later one
    (flags, epochs, slots, rows): every step's output and gradients are the single-GPU bits on
    the concatenated batch. (tools/ep_soak.py runs the same for thousands of steps.)"""
    max_tokens, E, k = 300, 12, 4
    layout = EPLayout(world=world, max_tokens=max_tokens, hidden=512, topk=k)
    warm_up_both_forwards(layout, 256, E)
    workspaces = EPWorkspace.local_group(layout)
    plan = [(300, 0, 1), (1, 300, 17), (0, 0, 300), (150, 299, 64), (5, 1, 0), (300, 300, 300), (0, 2, 1), (77, 128, 255)]
    for step, counts in enumerate(plan):
        counts = list(counts[:world]) if sum(counts[:world]) else [max_tokens] * world
        routing = ("uniform", "zipf", "one_expert")[step % 3]
        forward = {"one_launch": True} if step % 2 else {}
        per_rank, douts, want_out, want = ep_training_case(world, counts, 512, 256, E, k, seed=100 * world + step, routing=routing)
        wrong = ep_training_mismatches(run_train_ranks(workspaces, per_rank, douts, **forward), want_out, want)
        assert not wrong, f"step {step}: counts {counts}, {routing}, {forward or 'multi-launch'}: not the single-GPU bits: {wrong}"


@pytest.mark.parametrize("forward", [{}, {"one_launch": True}])
def test_capacity_bound_that_holds_changes_no_bit_and_one_that_overflows_raises_with_nan_not_stale_rows(forward):
    """EP = 2 with a capacity bound: a routing within it gives the unbounded bits; one past it
    gives NaN exactly for the tokens (and the router-weight gradients) of the pairs that did
    not fit, every other token's bits unchanged, and an error on both ranks — at check(),
    and at the workspace's next call without any host wait. ``forward``: the forward (the
    one-launch kernel marks the overflow itself)."""
    from mok.pipeline.workspace import capacity_rows

    world, counts, E, k = 2, (300, 260), 8, 2
    total = sum(counts)
    layout = EPLayout(world=world, max_tokens=320, hidden=512, topk=k)
    capacity = capacity_rows(layout, E // world, 1.0)  # 640 + 4 experts' padding -> 1152 rows per rank
    assert capacity == 1152
    for routing, overflows in (("uniform", False), ("one_expert", True)):
        x, idx, w, experts, _ = gpu_layer(total, 512, 256, E, k, None, seed=41, routing=routing)
        if overflows:  # every pair of every token on rank 0's experts: 1120 rows routed there, plus padding
            idx = torch.randint(0, E // world, idx.shape, device="cuda", dtype=torch.int32)
            idx[:, 1] = (idx[:, 0] + 1) % (E // world)
        dout = torch.randn(total, 512, device="cuda").bfloat16()
        args = split_ranks(world, counts, x, idx, w, experts, None)
        douts = split_rows(dout, counts)
        warm_up_training(layout, args, douts, capacity=capacity, **forward)
        warm_up(layout, args, capacity=capacity, **forward)  # (the forward without h is another GEMM variant)
        bounded_ws = EPWorkspace.local_group(layout, capacity=capacity)
        for ws in bounded_ws:  # let the backward run after an overflowing forward, to look at its gradients
            ws.raise_pending = lambda: None
        bounded = run_train_ranks(bounded_ws, args, douts, check=False, **forward)
        free = run_train_ranks(EPWorkspace.local_group(layout), args, douts, **forward)
        out_b, out_f = (torch.cat([o for o, _ in r]) for r in (bounded, free))
        dx_b, dx_f = (torch.cat([g.dx for _, g in r]) for r in (bounded, free))
        dw_b, dw_f = (torch.cat([g.d_topk_w for _, g in r]) for r in (bounded, free))
        if not overflows:
            assert torch.equal(out_b, out_f) and torch.equal(dx_b, dx_f) and torch.equal(dw_b, dw_f)
            continue
        # which pairs fit: rank 0's schedule with the bound, over the global routing (the Python twin)
        from mok.schedule import build_schedule

        global_idx = torch.full((world * layout.max_tokens, k), -1, dtype=torch.int32, device="cuda")
        global_idx[:counts[0]], global_idx[layout.max_tokens:layout.max_tokens + counts[1]] = idx[:counts[0]], idx[counts[0]:]
        sched = build_schedule(global_idx, E, capacity=capacity, world_size=world)
        assert bool(sched.overflow)
        slot_row = torch.cat([sched.slot_row[:counts[0]], sched.slot_row[layout.max_tokens:layout.max_tokens + counts[1]]])
        dropped_pair = slot_row < 0
        dropped = dropped_pair.any(1)
        assert 0 < int(dropped.sum()) < total
        assert out_b[dropped].isnan().all() and dx_b[dropped].isnan().all()
        assert torch.equal(out_b[~dropped], out_f[~dropped]) and torch.equal(dx_b[~dropped], dx_f[~dropped])
        assert dw_b[dropped_pair].isnan().all() and torch.equal(dw_b[~dropped_pair], dw_f[~dropped_pair])
        needed = int(sched.expert_offsets[-1])
        message = rf"experts of rank 0 were routed {needed} rows .* capacity is {capacity}"
        workspaces = EPWorkspace.local_group(layout, capacity=capacity)  # forward only: a backward launched after
        run_ranks(workspaces, args, check=False, **forward)  # its forward finished would raise already (below)
        for ws in workspaces:
            with pytest.raises(RuntimeError, match=message):
                ws.check()
            with pytest.raises(RuntimeError, match=message):  # the next call refuses before launching anything
                ep_moe_forward(ws, *args[ws.rank])


def test_ep_forward_and_backward_replayed_from_cuda_graphs_equal_single_gpu_bitwise():
    """Each rank captures its forward + backward in a CUDA graph once; replays on new inputs
    (new routing included) give the single-GPU bits: nothing in the path reads back to the
    host, and the epochs advance on the device."""
    world, counts, E, k, hidden = 2, (300, 217), 8, 4, 512
    total = sum(counts)
    x, idx, w, experts, shared = gpu_layer(total, hidden, 256, E, k, 256, seed=77)
    dout = torch.randn(total, hidden, device="cuda").bfloat16()
    layout = EPLayout(world=world, max_tokens=320, hidden=hidden, topk=k)
    args = split_ranks(world, counts, x, idx, w, experts, shared)  # the static inputs of the graphs
    douts = split_rows(dout, counts)
    moe_backward(dout, x, idx, w, *experts, shared, moe_forward(x, idx, w, *experts, shared, save_for_backward=True))
    warm_up_training(layout, args, douts)
    workspaces = EPWorkspace.local_group(layout)
    run_train_ranks(workspaces, args, douts)  # one eager step: every rank at the same epoch
    graphs, captured = [], []
    for ws, a, d in zip(workspaces, args, douts):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            saved = ep_moe_forward_saved(ws, *a, timeout_s=20.0)
            captured.append((saved.out, ep_moe_backward(ws, d, *a, saved, timeout_s=20.0)))
        graphs.append(graph)
    for step in range(3):
        x2, idx2, w2, _, _ = gpu_layer(total, hidden, 256, E, k, 256, seed=100 + step, routing=("uniform", "zipf", "one_expert")[step])
        dout2 = torch.randn(total, hidden, device="cuda").bfloat16()
        for p, pieces in enumerate(zip(*(split_rows(t, counts) for t in (x2, idx2, w2, dout2)))):
            for static, new in zip((*args[p][:3], douts[p]), pieces):
                static.copy_(new)
        saved = moe_forward(x2, idx2, w2, *experts, shared, save_for_backward=True)
        want = moe_backward(dout2, x2, idx2, w2, *experts, shared, saved)
        replay_on_streams(graphs, workspaces)
        assert torch.equal(torch.cat([out for out, _ in captured]), saved.out)
        assert torch.equal(torch.cat([g.dx for _, g in captured]), want.dx)
        assert torch.equal(torch.cat([g.d_topk_w for _, g in captured]), want.d_topk_w)
        for name in ("d_w_gate", "d_w_up", "d_w_down"):
            assert torch.equal(torch.cat([getattr(g, name) for _, g in captured]), getattr(want, name)), name


def test_ep_backward_accumulates_into_main_grads_like_the_single_gpu_backward():
    """main_grads at EP = 2: each rank adds its experts' weight gradients into its fp32 buffers,
    bit for bit as the single-GPU backward adds them; the shared expert's, summed over ranks,
    agree to rounding."""
    world, counts, E, k = 2, (300, 217), 8, 4
    total = sum(counts)
    x, idx, w, experts, shared = gpu_layer(total, 512, 256, E, k, 256, seed=91, routing="zipf")
    dout = torch.randn(total, 512, device="cuda").bfloat16()
    start = [torch.randn(t.shape, device="cuda") for t in (*experts, *shared)]
    single = [b.clone() for b in start]
    moe_backward(dout, x, idx, w, *experts, shared, moe_forward(x, idx, w, *experts, shared, save_for_backward=True), main_grads=single)
    layout = EPLayout(world=world, max_tokens=320, hidden=512, topk=k)
    args = split_ranks(world, counts, x, idx, w, experts, shared)
    douts = split_rows(dout, counts)
    warm_up_training(layout, args, douts)
    e_local = E // world
    buffers = [[b[p * e_local:(p + 1) * e_local].clone() for b in start[:3]] + [b.clone() for b in start[3:]] for p in range(world)]
    workspaces = EPWorkspace.local_group(layout)
    streams = [torch.cuda.Stream() for _ in workspaces]
    torch.cuda.synchronize()
    for ws, a, d, bufs, stream in zip(workspaces, args, douts, buffers, streams):
        with torch.cuda.stream(stream):
            saved = ep_moe_forward_saved(ws, *a, timeout_s=20.0)
            grads = ep_moe_backward(ws, d, *a, saved, main_grads=tuple(bufs), timeout_s=20.0)
            assert grads.d_w_gate.data_ptr() == bufs[0].data_ptr() and grads.d_shared[2].data_ptr() == bufs[5].data_ptr()
    torch.cuda.synchronize()
    for ws in workspaces:
        ws.check()
    for i in range(3):
        assert torch.equal(torch.cat([bufs[i] for bufs in buffers]), single[i]), i
    for i in range(3, 6):
        summed = start[i] + sum(bufs[i] - start[i] for bufs in buffers)
        assert float((summed - single[i]).norm() / (single[i] - start[i]).norm()) < 1e-2


@pytest.mark.parametrize("world,counts,E,k,capacity", [
    (2, (300, 517), 8, 4, None),
    (3, (128, 0, 250), 12, 8, None),  # k = 8 over 4 local experts: tokens with several slots on one rank
    (2, (320, 320), 8, 4, 640),  # a capacity bound that the routing overflows: pairs past it get no row
])
def test_dispatch_puts_each_token_in_every_local_row_and_zeros_the_padding(world, counts, E, k, capacity):
    """pull_rows (token-major: each token read once) against indexing the ranks' published x:
    rows[r] = x of row_token[r], zeros for the padding rows below the schedule's end, on every rank
    (into a NaN-filled rows buffer: a row it does not write shows)."""
    from mok import ops
    from mok.pipeline.exchange import exchange_kernels, pull_rows
    from mok.runtime import launch

    hidden, t_max = 1024, 640
    layout = EPLayout(world=world, max_tokens=t_max, hidden=hidden, topk=k)
    ws = EPWorkspace.local_group(layout)
    routing = torch.full((world * t_max, k), -1, dtype=torch.int32, device="cuda")
    x_all = torch.zeros(world * t_max, hidden, dtype=torch.bfloat16, device="cuda")
    for p, count in enumerate(counts):
        x = torch.randn(count, hidden, device="cuda").bfloat16()
        ws[p].region("x")[: x.numel()].copy_(x.reshape(-1))
        x_all[p * t_max:p * t_max + count] = x
        routing[p * t_max:p * t_max + count] = torch.rand(count, E, device="cuda").topk(k, dim=1).indices.int()
    stream = launch.stream(torch.device("cuda"))
    for rank in range(world):
        sched = ops.device_schedule(routing, E, rank=rank, world_size=world, capacity=capacity)
        kernels = exchange_kernels(ws[rank], ws[rank].buffer.device)
        poisoned_rows = torch.full((sched.capacity, hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
        rows = pull_rows(ws[rank], kernels, "x", sched, stream, out=poisoned_rows)
        assert rows.shape == (sched.capacity, hidden) and rows.dtype == torch.bfloat16
        torch.cuda.synchronize()
        used = min(int(sched.expert_offsets[-1]), sched.capacity)
        token = sched.row_token[:used].long()
        want = torch.where((token >= 0)[:, None], x_all[token.clamp(min=0)], torch.zeros((), dtype=torch.bfloat16, device="cuda"))
        assert used > 0 and int((token >= 0).sum()) > 0
        assert torch.equal(rows[:used], want), f"rank {rank}"
        if capacity is not None:
            assert bool(sched.overflow) and int((sched.slot_row >= 0).sum()) == int((token >= 0).sum())


def test_one_launch_ep_forward_is_one_kernel_per_rank_and_replays_from_cuda_graphs():
    """The one-launch EP forward (no shared expert) is ONE CUDA kernel per rank; captured once per
    rank in a CUDA graph, replays on new inputs (new routing included) give the single-GPU bits."""
    from torch.profiler import ProfilerActivity, profile

    world, counts, E, k, hidden = 2, (300, 217), 8, 4, 512
    total = sum(counts)
    x, idx, w, experts, _ = gpu_layer(total, hidden, 256, E, k, None, seed=78)
    layout = EPLayout(world=world, max_tokens=320, hidden=hidden, topk=k)
    args = split_ranks(world, counts, x, idx, w, experts, None)
    moe_forward(x, idx, w, *experts)
    warm_up(layout, args, one_launch=True)
    workspaces = EPWorkspace.local_group(layout)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_ranks(workspaces, args, one_launch=True)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "memcpy" not in e.name.lower()]
    assert len(kernels) == world, [e.name for e in kernels]
    graphs, captured = [], []
    for ws, a in zip(workspaces, args):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured.append(ep_moe_forward(ws, *a, timeout_s=20.0, one_launch=True))
        graphs.append(graph)
    for step in range(3):
        x2, idx2, w2, _, _ = gpu_layer(total, hidden, 256, E, k, None, seed=200 + step, routing=("uniform", "zipf", "one_expert")[step])
        for p, (lo, hi) in enumerate(((0, counts[0]), (counts[0], total))):
            for static, new in zip(args[p][:3], (x2, idx2, w2)):
                static.copy_(new[lo:hi])
        want = moe_forward(x2, idx2, w2, *experts).out
        replay_on_streams(graphs, workspaces)
        assert torch.equal(torch.cat(captured), want)
