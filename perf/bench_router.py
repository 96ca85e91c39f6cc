"""The built-in router's logits: MoK's GEMMs (mok/router.py, mok/torch_ops.py) against nn.Linear (cuBLAS), side by side.

    python perf/bench_router.py [--configs dsv3,qwen3,qwen3-small]

For each config, on the same inputs in one process (MoK's router as eager calls take it, "mok";
through its torch.library op as torch.compile does, "mok op"; cuBLAS's F.linear): milliseconds
of the logits (forward) and of forward + backward (dx and the weight's gradient), eager (the paths timed in turn,
mok.bench.time_ms_interleaved) and replayed from a CUDA graph (the device's time alone), with the
host microseconds per eager call; then batch dependence: for sub-batches x[:n] of several sizes n,
how many of them give some token other logits bits than the whole batch does, and how many
tokens then get other experts (top-k of the softmax), for each path. ``--profile N``: the N
functions with the most host time in MoK's eager forward + backward (cProfile).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from mok.bench import host_profile, host_us, time_ms_interleaved
from mok.layer import route
from mok.torch_ops import router_logits, router_logits_op

CONFIGS = {  # name: (T, H, E, k)
    "dsv3": (4096, 7168, 256, 8),
    "qwen3": (8192, 2048, 128, 8),
    "qwen3-small": (256, 2048, 128, 8),
    "mixtral": (4096, 4096, 8, 2),  # E padded to 128 inside MoK's GEMMs
}
SUB_BATCHES = (1, 2, 3, 5, 8, 17, 31, 64, 100, 129, 255, 513, 1000, 1537, 2048, 3001)


def via_the_op(x, w):
    """MoK's router through the torch.library op as torch.compile calls it (eager calls take an
    autograd.Function over the same functions): the two paths' host time side by side."""
    return router_logits_op(x, w)[:, : w.shape[0]]


def train_step(logits_fn, x, w, d_logits):
    """Logits, then their backward into x and w (grads cleared first)."""
    x.grad = w.grad = None
    logits_fn(x, w).backward(d_logits)


def graph_of(fn):
    """fn captured in a CUDA graph after two eager calls (kernels compiled and loaded); returns the replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def print_host_profile(fn, top: int) -> None:
    """The ``top`` functions by own host time over 50 calls of fn, after one call that loads everything."""
    fn()
    host_profile(fn, 50).sort_stats("tottime").print_stats(top)


def batch_dependence(logits_fn, x, w, topk) -> tuple[int, int, int]:
    """(sub-batch sizes tried, those where some token's logits bits differ from the whole batch's,
    tokens over all of them whose top-k experts differ)."""
    with torch.no_grad():
        whole = logits_fn(x, w)
        whole_idx = route(whole, topk)[0]
        sizes = [n for n in SUB_BATCHES if n < x.shape[0]]
        changed = moved = 0
        for n in sizes:
            part = logits_fn(x[:n], w)
            if not torch.equal(part, whole[:n]):
                changed += 1
                moved += int((route(part, topk)[0].sort(1).values != whole_idx[:n].sort(1).values).any(1).sum())
    return len(sizes), changed, moved


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="dsv3,qwen3,qwen3-small,mixtral")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile's top N of MoK's eager forward + backward, per config")
    args = parser.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; eager ms (host us per call) | graph-replayed ms")
    print(
        f"{'config':<12}{'path':<8}{'fwd ms (us)':>16}{'fwd+bwd ms (us)':>18}{'graph fwd':>11}{'graph f+b':>11}"
        f"{'sub-batches: bits differ':>27}{'tokens re-routed':>18}"
    )
    paths = {"mok": router_logits, "mok op": via_the_op, "cublas": F.linear}
    for name in args.configs.split(","):
        T, H, E, k = CONFIGS[name]
        g = torch.Generator(device="cuda").manual_seed(T + H + E)
        x = torch.randn(T, H, device="cuda", generator=g).bfloat16().requires_grad_()
        w = (torch.randn(E, H, device="cuda", generator=g) * H ** -0.5).bfloat16().requires_grad_()
        d_logits = torch.randn(T, E, device="cuda", generator=g).bfloat16()
        with torch.no_grad():
            fwd = time_ms_interleaved({p: (lambda fn=fn: fn(x, w)) for p, fn in paths.items()}, batch=20, repeats=15)
            fwd_graphs = {p: graph_of(lambda fn=fn: fn(x, w)) for p, fn in paths.items()}
            fwd_us = {p: host_us(lambda fn=fn: fn(x, w)) for p, fn in paths.items()}
        steps = {p: (lambda fn=fn: train_step(fn, x, w, d_logits)) for p, fn in paths.items()}
        step = time_ms_interleaved(steps, batch=20, repeats=15)
        step_us = {p: host_us(fn) for p, fn in steps.items()}
        graphs = time_ms_interleaved({**{f"{p} fwd": g for p, g in fwd_graphs.items()}, **{p: graph_of(f) for p, f in steps.items()}})
        for p, fn in paths.items():
            tried, changed, moved = batch_dependence(fn, x.detach(), w.detach(), k)
            print(
                f"{name:<12}{p:<8}{f'{fwd[p]:.4f} ({fwd_us[p]:.0f})':>16}{f'{step[p]:.4f} ({step_us[p]:.0f})':>18}"
                f"{graphs[f'{p} fwd']:>11.4f}{graphs[p]:>11.4f}{f'{changed} of {tried}':>27}{moved:>18}"
            )
        if args.profile:
            print_host_profile(steps["mok"], args.profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
