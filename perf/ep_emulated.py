"""Expert parallelism EMULATED on one GPU: W ranks share one workspace buffer, one stream each.

    python perf/ep_emulated.py [--configs qwen3,dsv3] [--world 2] [--iters 20]

No NVLink here: the "remote" reads and writes are local, and the ranks share one GPU's SMs
(the one-launch forward gives each rank an equal share). What this measures is what does not
depend on the link: the host time to issue one step of every rank (all launches of all ranks,
no waiting), and the device time of that step, for the multi-launch forward (mok/ep.py) and
the one-launch forward (mok/ep_one_launch.py) on the same inputs. Per-rank shapes as bench_ep's
(T tokens per rank, E experts over all ranks), uniform routing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mok.ep import EPLayout, EPWorkspace, ep_moe_forward

from bench_layer import make_inputs

CONFIGS = {  # per rank: T, H, I, E over all ranks, k
    "qwen3": (8192, 2048, 768, 128, 8),
    "dsv3": (4096, 7168, 2048, 256, 8),
    "qwen3-small": (512, 2048, 768, 128, 8),
}


def split(world, tokens, x, idx, w, experts):
    e_local = experts[0].shape[0] // world
    return [
        (x[p * tokens:(p + 1) * tokens].contiguous(), idx[p * tokens:(p + 1) * tokens].contiguous(),
         w[p * tokens:(p + 1) * tokens].contiguous(), *(t[p * e_local:(p + 1) * e_local].contiguous() for t in experts))
        for p in range(world)
    ]


def step(workspaces, per_rank, streams, **mode):
    """Issue one forward of every rank on its stream; returns (host seconds to issue, outputs)."""
    outs = []
    start = time.perf_counter()
    for ws, args, stream in zip(workspaces, per_rank, streams):
        with torch.cuda.stream(stream):
            outs.append(ep_moe_forward(ws, *args, timeout_s=20.0, **mode))
    return time.perf_counter() - start, outs


def measure(workspaces, per_rank, iters, **mode):
    streams = [torch.cuda.Stream() for _ in workspaces]
    for _ in range(3):
        step(workspaces, per_rank, streams, **mode)
    torch.cuda.synchronize()
    host, device = [], []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        issue, outs = step(workspaces, per_rank, streams, **mode)
        torch.cuda.synchronize()
        device.append(time.perf_counter() - t0)
        host.append(issue)
    for ws in workspaces:
        ws.check()
    return statistics.median(host) * 1e3, statistics.median(device) * 1e3, torch.cat(outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="qwen3-small,qwen3,dsv3")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    print(f"{'config':<12} {'forward':<12} {'host ms':>8} {'step ms':>8}  (W={args.world} emulated on one GPU: no NVLink)")
    for name in args.configs.split(","):
        tokens, hidden, inter, experts, topk = CONFIGS[name]
        world = args.world
        x, idx, w, weights, _ = make_inputs(world * tokens, hidden, inter, experts, topk, None, "uniform", seed=1)
        per_rank = split(world, tokens, x, idx, w, weights)
        layout = EPLayout(world=world, max_tokens=tokens, hidden=hidden, topk=topk)
        for p, args_p in enumerate(per_rank):  # load every kernel, one rank at a time (the waits time out at once)
            for mode in ({}, {"one_launch": True}):
                ep_moe_forward(EPWorkspace.local_group(layout)[p], *args_p, timeout_s=1e-4, **mode)
                torch.cuda.synchronize()
        results = {}
        for label, mode in (("multi-launch", {}), ("one launch", {"one_launch": True})):
            host, device, out = measure(EPWorkspace.local_group(layout), per_rank, args.iters, **mode)
            results[label] = out
            print(f"{name:<12} {label:<12} {host:8.3f} {device:8.3f}")
        assert torch.equal(results["multi-launch"], results["one launch"]), "the two forwards disagree"
        del x, idx, w, weights, per_rank, results
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
