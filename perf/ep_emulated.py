"""Expert parallelism EMULATED on one GPU: W ranks share one workspace buffer, one stream each.

    python perf/ep_emulated.py [--configs qwen3,dsv3] [--world 2] [--iters 20] [--backward] [--modes multi-launch,overlap]

No NVLink here: the "remote" reads and writes are local, and the ranks share one GPU's SMs
(the one-launch forward gives each rank an equal share). What this measures is what does not
depend on the link: the host time to issue one step of every rank (all launches of all ranks,
no waiting), and the device time of that step, for the multi-launch forward (mok/ep.py) and
the one-launch forward (mok/ep_one_launch.py) on the same inputs. Per-rank shapes as bench_ep's
(T tokens per rank, E experts over all ranks), uniform routing. ``--backward``: a step is the
forward keeping h (mok.ep.ep_moe_forward_saved) and mok.ep_backward.ep_moe_backward.
``--modes`` picks the forwards (MODES: the default multi-launch one, ``fused_dispatch``,
``overlap_dispatch``, ``one_launch``, ``dispatch_format="mxfp8"`` with and without one_launch);
every mode's output must equal, bit for bit, the first's of the same dispatch format (MXFP8
rounds x).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mok.ep import EPLayout, EPWorkspace, ep_moe_forward, ep_moe_forward_saved
from mok.ep_backward import ep_moe_backward

from bench_layer import make_inputs

CONFIGS = {  # per rank: T, H, I, E over all ranks, k
    "qwen3": (8192, 2048, 768, 128, 8),
    "dsv3": (4096, 7168, 2048, 256, 8),
    "qwen3-small": (512, 2048, 768, 128, 8),
}


MODES = {  # label: ep_moe_forward's keyword arguments
    "multi-launch": {},
    "fused": {"fused_dispatch": True},
    "overlap": {"overlap_dispatch": True},
    "one launch": {"one_launch": True},
    "mxfp8": {"dispatch_format": "mxfp8"},  # (other bits: compared with each other only)
    "one launch mxfp8": {"one_launch": True, "dispatch_format": "mxfp8"},
}


def split(world, tokens, x, idx, w, experts):
    e_local = experts[0].shape[0] // world
    return [
        (x[p * tokens:(p + 1) * tokens].contiguous(), idx[p * tokens:(p + 1) * tokens].contiguous(),
         w[p * tokens:(p + 1) * tokens].contiguous(), *(t[p * e_local:(p + 1) * e_local].contiguous() for t in experts))
        for p in range(world)
    ]


def train_step(ws, args, dout, **mode):
    """One rank's forward (h kept) and backward; returns (output, dx)."""
    saved = ep_moe_forward_saved(ws, *args, timeout_s=20.0, **mode)
    return saved.out, ep_moe_backward(ws, dout, *args, None, saved, timeout_s=20.0).dx


def step(workspaces, per_rank, streams, douts=None, **mode):
    """Issue one forward (with ``douts``: forward + backward) of every rank on its stream; returns
    (host seconds to issue, outputs; with douts, outputs then dx of every rank)."""
    outs, grads = [], []
    start = time.perf_counter()
    for p, (ws, args, stream) in enumerate(zip(workspaces, per_rank, streams)):
        with torch.cuda.stream(stream):
            if douts is None:
                outs.append(ep_moe_forward(ws, *args, timeout_s=20.0, **mode))
            else:
                out, dx = train_step(ws, args, douts[p], **mode)
                outs.append(out)
                grads.append(dx)
    return time.perf_counter() - start, outs + grads


def measure(workspaces, per_rank, iters, douts=None, **mode):
    streams = [torch.cuda.Stream() for _ in workspaces]
    for _ in range(3):
        step(workspaces, per_rank, streams, douts, **mode)
    torch.cuda.synchronize()
    host, device = [], []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        issue, outs = step(workspaces, per_rank, streams, douts, **mode)
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
    parser.add_argument("--backward", action="store_true", help="a step is forward (h kept) + backward")
    parser.add_argument("--modes", default="multi-launch,one launch", help=f"comma-separated, of {', '.join(MODES)}")
    args = parser.parse_args()
    modes = [(label, MODES[label]) for label in args.modes.split(",")]
    what = "forward + backward" if args.backward else "forward"
    print(f"{'config':<12} {'forward':<12} {'host ms':>8} {'step ms':>8}  ({what}; W={args.world} emulated on one GPU: no NVLink)")
    for name in args.configs.split(","):
        tokens, hidden, inter, experts, topk = CONFIGS[name]
        world = args.world
        x, idx, w, weights, _ = make_inputs(world * tokens, hidden, inter, experts, topk, None, "uniform", seed=1)
        per_rank = split(world, tokens, x, idx, w, weights)
        douts = [torch.randn(tokens, hidden, device="cuda").bfloat16() for _ in range(world)] if args.backward else None
        layout = EPLayout(world=world, max_tokens=tokens, hidden=hidden, topk=topk)
        for p, args_p in enumerate(per_rank):  # load every kernel, one rank at a time (the waits time out at once)
            for _, mode in modes:
                if args.backward:  # (a fresh workspace: the forward's timeout is in the first one's record)
                    saved = ep_moe_forward_saved(EPWorkspace.local_group(layout)[p], *args_p, timeout_s=1e-4, **mode)
                    ep_moe_backward(EPWorkspace.local_group(layout)[p], douts[p], *args_p, None, saved, timeout_s=1e-4)
                else:
                    ep_moe_forward(EPWorkspace.local_group(layout)[p], *args_p, timeout_s=1e-4, **mode)
                torch.cuda.synchronize()
        results = {}
        for label, mode in modes:
            host, device, out = measure(EPWorkspace.local_group(layout), per_rank, args.iters, douts, **mode)
            results[label] = out
            print(f"{name:<12} {label:<12} {host:8.3f} {device:8.3f}")
        for dispatch_format in ("bf16", "mxfp8"):  # every mode's output the bits of the first of its format
            same_format = [label for label, mode in modes if mode.get("dispatch_format", "bf16") == dispatch_format]
            for label in same_format[1:]:
                assert torch.equal(results[label], results[same_format[0]]), f"{label} disagrees with {same_format[0]}"
        del x, idx, w, weights, per_rank, results
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
