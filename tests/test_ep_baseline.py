"""The PyTorch-native expert-parallel baseline of perf/bench_ep.py computes the layer and its
gradients (2 gloo ranks, CPU)."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import random_layer
from mok.reference import moe_reference

PERF = str(Path(__file__).resolve().parents[1] / "perf")
COUNTS = (7, 12)


def _worker(rank, init_file, out_dir):
    sys.path.insert(0, PERF)
    from bench_ep import torch_ep_forward, torch_ep_train_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        x, idx, w, experts, _ = random_layer(sum(COUNTS), 32, 16, 4, 2, seed=3, dtype=torch.bfloat16)
        lo = sum(COUNTS[:rank])
        mine = slice(lo, lo + COUNTS[rank])
        local = tuple(t[rank * 2:(rank + 1) * 2].contiguous() for t in experts)
        out = torch_ep_forward(x[mine], idx[mine], w[mine], local, dist.group.WORLD)
        dout = torch.randn(sum(COUNTS), 32, generator=torch.Generator().manual_seed(5)).bfloat16()
        grads = torch_ep_train_step(x[mine], idx[mine], w[mine], local, dout[mine], dist.group.WORLD)
        torch.save((out, grads), f"{out_dir}/{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _rel(got, want):
    return float((got.detach().float() - want.detach().float()).norm() / want.detach().float().norm())


def test_torch_ep_baseline_matches_the_reference(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    results = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    x, idx, w, experts, _ = random_layer(sum(COUNTS), 32, 16, 4, 2, seed=3, dtype=torch.bfloat16)
    leaves = [t.float().requires_grad_() for t in (x, w, *experts)]
    want = moe_reference(leaves[0], idx, leaves[1], *leaves[2:])
    assert _rel(torch.cat([out for out, _ in results]), want) <= 1e-2
    dout = torch.randn(sum(COUNTS), 32, generator=torch.Generator().manual_seed(5)).bfloat16()
    want_grads = torch.autograd.grad(want, leaves, dout.float())
    for i in range(2):  # dx, d_topk_w: the ranks' tokens in order
        assert _rel(torch.cat([g[i] for _, g in results]), want_grads[i]) <= 1e-2
    for i in range(2, 5):  # the experts' weights: rank 0's experts, then rank 1's
        assert _rel(torch.cat([g[i] for _, g in results]), want_grads[i]) <= 1e-2
