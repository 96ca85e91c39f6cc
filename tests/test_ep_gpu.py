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
