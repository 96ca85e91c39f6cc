"""Train a toy two-layer MoE model for a few steps with ``mok.MoELayer``.

    python examples/train_toy.py                          # one GPU (the CPU reference path without one)
    torchrun --nproc_per_node 2 examples/train_toy.py     # experts split over 2 ranks
    python examples/train_toy.py --precision fp8_block --compare --steps 200   # FP8 (Hopper) beside bf16

The model learns to imitate a fixed random "teacher" network; the loss printed every few
steps goes down. With torchrun each rank holds num_experts / world_size experts and its own
batch, and the layers run MoK's expert-parallel kernels (on CUDA); the replicated
parameters (router, norms, shared expert) average their gradients over the ranks, the
experts do not. More ranks than GPUs share the GPUs (gloo instead of NCCL then).

``--precision fp8_block`` runs the experts' GEMMs in FP8 with 128-block scales (DeepSeek-V3's recipe,
one Hopper GPU); with ``--compare`` the same model, data and optimizer also train in bf16, and the
two loss curves print side by side with the relative difference of their final losses (the mean
of the last ten steps), exit status 1 above ``--tol``.
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

    def __init__(self, hidden: int, inter: int, experts: int, topk: int, group, device, dtype, precision: str = "bf16") -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.RMSNorm(hidden, device=device, dtype=dtype) for _ in range(2))
        self.moes = nn.ModuleList(
            mok.MoELayer(hidden, inter, experts, topk, shared_intermediate=inter, group=group, precision=precision, device=device,
                         dtype=dtype)
            for _ in range(2)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm, moe in zip(self.norms, self.moes):
            x = x + moe(norm(x))
        return x


HIDDEN, INTER, EXPERTS, TOPK = 256, 256, 8, 2


def train(args, precision: str, device: torch.device, group, rank: int, world: int) -> list[float]:
    """Train the toy model for ``args.steps`` steps from the same start and on the same batches
    whatever the precision; returns every step's loss (printed every five on rank 0 unless comparing)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the fused kernels take bf16
    torch.manual_seed(0)  # the same router, norms and teacher on every rank
    model = ToyMoE(HIDDEN, INTER, EXPERTS, TOPK, group, device, dtype, precision)
    teacher = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN)).to(device, dtype)
    torch.manual_seed(1 + rank)  # each rank its own experts' initial weights and its own batches
    for moe in model.moes:
        for p in (moe.gate_proj, moe.up_proj, moe.down_proj):
            nn.init.uniform_(p, -p.shape[-1] ** -0.5, p.shape[-1] ** -0.5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    replicated = [p for n, p in model.named_parameters() if "router" in n or "norms" in n or "shared" in n]
    losses = []
    for step in range(args.steps):
        x = torch.randn(args.tokens, HIDDEN, device=device, dtype=dtype)
        with torch.no_grad():
            target = x + teacher(x)
        loss = (model(x).float() - target.float()).square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if world > 1:  # data-parallel parameters: average their gradients over the ranks
            for p in replicated:
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        optimizer.step()
        losses.append(loss.item())
        if rank == 0 and not args.compare and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {losses[-1]:.4f}", flush=True)
    return losses


def compare(args, device: torch.device) -> int:
    """bf16 and ``args.precision`` side by side (one process); 0 if the final losses agree within ``args.tol``."""
    runs = {precision: train(args, precision, device, None, 0, 1) for precision in ("bf16", args.precision)}
    print(f"{'step':>5} {'loss bf16':>12} {'loss ' + args.precision:>18}")
    for step in range(args.steps):
        if step % 10 == 0 or step == args.steps - 1:
            print(f"{step:>5} {runs['bf16'][step]:>12.4f} {runs[args.precision][step]:>18.4f}")
    last = min(10, args.steps)
    final = {precision: sum(losses[-last:]) / last for precision, losses in runs.items()}
    difference = abs(final[args.precision] - final["bf16"]) / final["bf16"]
    ok = difference <= args.tol
    print(f"final loss (mean of the last {last} steps): bf16 {final['bf16']:.4f}, {args.precision} {final[args.precision]:.4f}, "
          f"relative difference {difference:.2%}: {'within' if ok else 'OUTSIDE'} {args.tol:.0%}")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", default="bf16", help="the experts' GEMMs: bf16 (default) or fp8_block (one Hopper GPU)")
    parser.add_argument("--compare", action="store_true", help="also train in bf16 from the same start; print both loss curves")
    parser.add_argument("--tol", type=float, default=0.02, help="--compare: largest relative difference of the final losses (default 2%%)")
    args = parser.parse_args()

    group = None
    rank, world = 0, 1
    if "WORLD_SIZE" in os.environ:  # launched by torchrun
        if args.compare:
            parser.error("--compare runs in one process (not under torchrun)")
        world = int(os.environ["WORLD_SIZE"])
        one_gpu_each = args.device == "cuda" and world <= torch.cuda.device_count()
        dist.init_process_group("nccl" if one_gpu_each else "gloo")
        rank = dist.get_rank()
        group = dist.group.WORLD
    device = torch.device(args.device, rank % torch.cuda.device_count()) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if args.compare:
        return compare(args, device)
    train(args, args.precision, device, group, rank, world)
    if world > 1:  # every rank past its last collective before any tears its connections down
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
