"""Expert parallelism on one GPU: W ranks share one workspace buffer and run on W streams.

The kernels address every rank's region at rank·stride in one range, exactly as they will
over NVLink through the symmetric VMM mapping; here the "peers" are other streams.
"""

import pytest
import torch

from mok.ep import EPLayout, EPWorkspace, ep_moe_forward
from mok.fused_forward import moe_forward

from helpers import gpu_layer

pytestmark = pytest.mark.gpu


def warm_up(layout, per_rank_args):
    """Launch every kernel once, one rank at a time (its waits time out at once), on a throwaway workspace.

    CUDA loads a kernel lazily at its first launch, and loading waits for the device: on ONE
    GPU that would wait for another "rank's" spinning kernel, which waits for this rank. (On
    separate GPUs a rank's loading only waits for its own GPU.)
    """
    for ws, args in zip(EPWorkspace.local_group(layout), per_rank_args):
        ep_moe_forward(ws, *args, timeout_s=1e-4)
        torch.cuda.synchronize()


def run_ranks(workspaces, per_rank_args, timeout_s=20.0):
    streams = [torch.cuda.Stream() for _ in workspaces]
    outs = []
    torch.cuda.synchronize()
    for ws, args, stream in zip(workspaces, per_rank_args, streams):
        with torch.cuda.stream(stream):
            outs.append(ep_moe_forward(ws, *args, timeout_s=timeout_s))
    torch.cuda.synchronize()
    for ws in workspaces:
        ws.check()
    return outs


def split(world, counts, x, idx, w, experts, shared):
    """Rank p's tokens (counts[p] of them, in order) and experts (E / world of them)."""
    e_local = experts[0].shape[0] // world
    bounds = [sum(counts[:p]) for p in range(world + 1)]
    return [
        (x[bounds[p]:bounds[p + 1]].contiguous(), idx[bounds[p]:bounds[p + 1]].contiguous(), w[bounds[p]:bounds[p + 1]].contiguous(),
         *(t[p * e_local:(p + 1) * e_local].contiguous() for t in experts), shared)
        for p in range(world)
    ]


@pytest.mark.parametrize("world,counts,E,k,shared_inter,routing", [
    (2, (300, 517), 8, 4, 256, "uniform"),
    (3, (128, 1, 250), 6, 2, None, "uniform"),
    (2, (200, 200), 8, 4, None, "one_expert"),  # every token's slot 0 on expert 0: rank 1 sends rank 0 everything
    (4, (100, 37, 250, 1), 8, 4, 256, "uniform"),  # EP = 4 (issue 7's size, emulated)
])
def test_ep_equals_single_gpu_forward_bitwise(world, counts, E, k, shared_inter, routing):
    total = sum(counts)
    x, idx, w, experts, shared = gpu_layer(total, 512, 256, E, k, shared_inter, seed=world * 7 + total, routing=routing)
    want = moe_forward(x, idx, w, *experts, shared).out  # also compiles the GEMMs before any rank waits
    layout = EPLayout(world=world, max_tokens=max(counts) + 13, hidden=512, topk=k)
    args = split(world, counts, x, idx, w, experts, shared)
    warm_up(layout, args)
    workspaces = EPWorkspace.local_group(layout)
    for _ in range(3):  # epochs advance; every call gives the same bits
        outs = run_ranks(workspaces, args)
        assert torch.equal(torch.cat(outs), want)


def test_a_rank_that_skips_the_call_makes_the_other_raise_not_hang():
    x, idx, w, experts, _ = gpu_layer(64, 512, 256, 4, 2, None, seed=5)
    layout = EPLayout(world=2, max_tokens=64, hidden=512, topk=2)
    ws0, _ = EPWorkspace.local_group(layout)
    args = split(2, (32, 32), x, idx, w, experts, None)[0]
    ep_moe_forward(ws0, *args, timeout_s=0.2)  # rank 1 never calls
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match=r"rank 0 timed out in phase publish .* waiting for rank 1"):
        ws0.check()


def run_train_ranks(workspaces, per_rank_args, per_rank_dout, timeout_s=20.0):
    """Forward (keeping h) then backward on every rank, each on its own stream."""
    from mok.ep import ep_moe_forward_saved
    from mok.ep_backward import ep_moe_backward

    streams = [torch.cuda.Stream() for _ in workspaces]
    results = []
    torch.cuda.synchronize()
    for ws, args, dout, stream in zip(workspaces, per_rank_args, per_rank_dout, streams):
        with torch.cuda.stream(stream):
            saved = ep_moe_forward_saved(ws, *args, timeout_s=timeout_s)
            results.append((saved.out, ep_moe_backward(ws, dout, *args, saved, timeout_s=timeout_s)))
    torch.cuda.synchronize()
    for ws in workspaces:
        ws.check()
    return results


@pytest.mark.parametrize("world,counts,E,k,shared_inter,routing", [
    (2, (300, 517), 8, 4, 256, "uniform"),
    (3, (128, 1, 250), 6, 2, None, "zipf"),
    (2, (200, 200), 8, 4, None, "one_expert"),
    (4, (100, 37, 250, 1), 8, 4, 256, "zipf"),  # EP = 4 (issue 7's size, emulated)
])
def test_ep_gradients_equal_single_gpu_backward_bitwise(world, counts, E, k, shared_inter, routing):
    """EP = 2, 3 (emulated on one GPU) against the fused single-GPU backward on the concatenated
    batch: dx, d_topk_w and every expert's weight gradients are the same bits; the shared
    expert's weight gradients, summed over ranks, agree to rounding."""
    from mok.ep import ep_moe_forward_saved
    from mok.ep_backward import ep_moe_backward
    from mok.fused_backward import moe_backward

    total = sum(counts)
    x, idx, w, experts, shared = gpu_layer(total, 512, 256, E, k, shared_inter, seed=world * 11 + total, routing=routing)
    dout = torch.randn(total, 512, device="cuda").bfloat16()
    saved = moe_forward(x, idx, w, *experts, shared, save_for_backward=True)
    want = moe_backward(dout, x, idx, w, *experts, shared, saved)
    layout = EPLayout(world=world, max_tokens=max(counts) + 5, hidden=512, topk=k)
    args = split(world, counts, x, idx, w, experts, shared)
    bounds = [sum(counts[:p]) for p in range(world + 1)]
    douts = [dout[bounds[p]:bounds[p + 1]].contiguous() for p in range(world)]
    for ws, a, d in zip(EPWorkspace.local_group(layout), args, douts):  # load every kernel before any rank waits
        s = ep_moe_forward_saved(ws, *a, timeout_s=1e-4)
        ep_moe_backward(ws, d, *a, s, timeout_s=1e-4)
        torch.cuda.synchronize()
    workspaces = EPWorkspace.local_group(layout)
    for _ in range(2):  # a second training step on the same workspace: the same bits
        results = run_train_ranks(workspaces, args, douts)
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
