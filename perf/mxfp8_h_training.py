"""Does keeping h in MXFP8 for the backward hurt training? A CPU emulation, student against teacher.

    python perf/mxfp8_h_training.py [--steps 400] [--seeds 3]

A toy MoE layer (top-k routing by a learned router, SwiGLU experts) learns to imitate a fixed
random teacher layer with Adam, starting from the teacher's weights with noise of half their
size added (a task it can learn, routing included), twice from the same start on the same batches: once with the
exact backward, once with the backward MoK runs under ``saved_h_format="mxfp8"`` — h rounded to
bf16 and then through MXFP8 (mok/mxfp8.py's rule) before the backward uses it, for the SwiGLU
gradient, for a (dW_down) and for the router-weight gradient <dout, y> (y from the rounded h, as
MoK's fused router gradient forms it). Prints the loss of both at intervals and the ratio at
the end. The forward is exact in both (MoK's forward does not change either).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mok.mxfp8 import fake_quantize_mxfp8  # noqa: E402


def swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


class ExpertPath(torch.autograd.Function):
    """s · (swiglu(h) · W_downᵀ) whose backward sees h as ``keep`` stores it (the exact h or its
    bf16-then-MXFP8 rounding), as MoK's backward sees the h it saved."""

    @staticmethod
    def forward(ctx, h, w_down, s, mxfp8):
        kept = fake_quantize_mxfp8(h.to(torch.bfloat16)).to(h.dtype) if mxfp8 else h
        ctx.save_for_backward(kept, w_down, s)
        return s[:, None] * (swiglu(h) @ w_down.T)

    @staticmethod
    def backward(ctx, grad):
        kept, w_down, s = ctx.saved_tensors
        with torch.enable_grad():
            h = kept.detach().requires_grad_()
            a = swiglu(h)
        y = a.detach() @ w_down.T
        d_s = (grad * y).sum(1)  # the router-weight gradient from the kept h
        d_y = s[:, None] * grad
        d_w_down = d_y.T @ a.detach()
        (d_h,) = torch.autograd.grad(a, h, d_y @ w_down)
        return d_h, d_w_down, d_s, None


class ToyMoE(torch.nn.Module):
    def __init__(self, hidden, inter, experts, topk):
        super().__init__()
        self.topk = topk
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.w_gate_up = torch.nn.Parameter(torch.randn(experts, 2 * inter, hidden) * hidden**-0.5)
        self.w_down = torch.nn.Parameter(torch.randn(experts, hidden, inter) * inter**-0.5)

    def forward(self, x, mxfp8=False):
        weights, idx = torch.softmax(self.router(x), dim=-1).topk(self.topk, dim=-1)
        out = torch.zeros_like(x)
        for e in range(self.w_down.shape[0]):
            token, slot = (idx == e).nonzero(as_tuple=True)
            if token.numel():
                h = x[token] @ self.w_gate_up[e].T
                y = ExpertPath.apply(h, self.w_down[e], weights[token, slot], mxfp8)
                out = out.index_add(0, token, y)
        return out


def train(seed, steps, mxfp8, args):
    torch.manual_seed(1000 + seed)
    teacher = ToyMoE(args.hidden, args.inter, args.experts, args.topk)
    torch.manual_seed(seed)
    student = ToyMoE(args.hidden, args.inter, args.experts, args.topk)
    with torch.no_grad():  # the teacher's weights, each moved by noise of half its size: a task the student can learn
        for mine, theirs in zip(student.parameters(), teacher.parameters()):
            mine.copy_(theirs + args.noise * mine * theirs.std() / mine.std())
    opt = torch.optim.Adam(student.parameters(), lr=args.lr)
    batches = torch.Generator().manual_seed(seed)
    losses = []
    for step in range(steps):
        x = torch.randn(args.tokens, args.hidden, generator=batches)
        with torch.no_grad():
            target = teacher(x)
        loss = F.mse_loss(student(x, mxfp8=mxfp8), target) / target.pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--inter", type=int, default=128)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--noise", type=float, default=0.5, help="the student's start: the teacher plus this much noise")
    args = parser.parse_args()
    torch.set_num_threads(2)
    marks = sorted({args.steps // 8, args.steps // 4, args.steps // 2, args.steps - 1})
    print("seed  h kept   " + "".join(f"{'step ' + str(m):>12}" for m in marks) + f"{'last 20 mean':>14}")
    ratios = []
    for seed in range(args.seeds):
        runs = {name: train(seed, args.steps, name == "mxfp8", args) for name in ("exact", "mxfp8")}
        for name, losses in runs.items():
            tail = sum(losses[-20:]) / 20
            print(f"{seed:<6}{name:<9}" + "".join(f"{losses[m]:>12.4e}" for m in marks) + f"{tail:>14.4e}")
        ratios.append(sum(runs["mxfp8"][-20:]) / sum(runs["exact"][-20:]))
    print("final loss, mxfp8 h / exact h (mean of the last 20 steps), per seed: " + ", ".join(f"{r:.4f}" for r in ratios))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
