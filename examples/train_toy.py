"""Train a toy two-layer MoE model for a few steps with ``mok.MoELayer``.

    python examples/train_toy.py                          # one GPU (the CPU reference path without one)
    torchrun --nproc_per_node 2 examples/train_toy.py     # experts split over 2 ranks

The model learns to imitate a fixed random "teacher" network; the loss printed every few
steps goes down. With torchrun each rank holds num_experts / world_size experts and its own
batch, and the layers run MoK's expert-parallel kernels (on CUDA); the replicated
parameters (router, norms, shared expert) average their gradients over the ranks, the
experts do not. More ranks than GPUs share the GPUs (gloo instead of NCCL then).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

import mok


class ToyMoE(nn.Module):
    """Two MoE blocks with residual connections and RMS norms."""

    def __init__(self, hidden: int, inter: int, experts: int, topk: int, group, device, dtype) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.RMSNorm(hidden, device=device, dtype=dtype) for _ in range(2))
        self.moes = nn.ModuleList(
            mok.MoELayer(hidden, inter, experts, topk, shared_intermediate=inter, group=group, device=device, dtype=dtype)
            for _ in range(2)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm, moe in zip(self.norms, self.moes):
            x = x + moe(norm(x))
        return x


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    group = None
    rank, world = 0, 1
    if "WORLD_SIZE" in os.environ:  # launched by torchrun
        world = int(os.environ["WORLD_SIZE"])
        one_gpu_each = args.device == "cuda" and world <= torch.cuda.device_count()
        dist.init_process_group("nccl" if one_gpu_each else "gloo")
        rank = dist.get_rank()
        group = dist.group.WORLD
    device = torch.device(args.device, rank % torch.cuda.device_count()) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the fused kernels take bf16
    hidden, inter, experts, topk = 256, 256, 8, 2

    torch.manual_seed(0)  # the same router, norms and teacher on every rank
    model = ToyMoE(hidden, inter, experts, topk, group, device, dtype)
    teacher = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, hidden)).to(device, dtype)
    torch.manual_seed(1 + rank)  # each rank its own experts' initial weights and its own batches
    for moe in model.moes:
        for p in (moe.gate_proj, moe.up_proj, moe.down_proj):
            nn.init.uniform_(p, -p.shape[-1] ** -0.5, p.shape[-1] ** -0.5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    replicated = [p for n, p in model.named_parameters() if "router" in n or "norms" in n or "shared" in n]
    for step in range(args.steps):
        x = torch.randn(args.tokens, hidden, device=device, dtype=dtype)
        with torch.no_grad():
            target = x + teacher(x)
        loss = (model(x).float() - target.float()).square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if world > 1:  # data-parallel parameters: average their gradients over the ranks
            for p in replicated:
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        optimizer.step()
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)
    if world > 1:  # every rank past its last collective before any tears its connections down
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
