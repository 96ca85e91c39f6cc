"""The PyTorch-native expert-parallel baseline of perf/bench_ep.py computes the layer (2 gloo ranks, CPU)."""

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
    from bench_ep import torch_ep_forward

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        x, idx, w, experts, _ = random_layer(sum(COUNTS), 32, 16, 4, 2, seed=3, dtype=torch.bfloat16)
        lo = sum(COUNTS[:rank])
        mine = slice(lo, lo + COUNTS[rank])
        local = tuple(t[rank * 2:(rank + 1) * 2].contiguous() for t in experts)
        out = torch_ep_forward(x[mine], idx[mine], w[mine], local, dist.group.WORLD)
        torch.save(out, f"{out_dir}/{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_torch_ep_baseline_matches_the_reference(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    got = torch.cat([torch.load(tmp_path / f"{r}.pt") for r in range(2)]).float()
    x, idx, w, experts, _ = random_layer(sum(COUNTS), 32, 16, 4, 2, seed=3, dtype=torch.bfloat16)
    want = moe_reference(x, idx, w, *experts)
    assert float((got - want).norm() / want.norm()) <= 1e-2
