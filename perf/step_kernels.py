"""One layer training step (forward keeping h, backward) kernel by kernel, with a hash of its bits:
the A/B of two source trees at the kernel level.

    PYTHONPATH=<tree> MOK_CACHE_DIR=<its cache> python perf/step_kernels.py --configs dsv3,qwen3-235b \
        [--precision fp8_block] [--wgrad-format fp8_block]

For each config: the step's launches in order with each one's mean device time over ``--calls``
calls (the profiler, after three warm-up steps), their sum, and a hash of the step's gradients'
bytes. Run it once per tree on one machine, alternating: the per-kernel figures say where a change
moved time, and equal hashes that the trees compute the same bits (the same inputs every run).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mok  # noqa: E402
from bench_layer import CONFIGS, config_of, make_inputs, mok_plan_train_step  # noqa: E402
from mok.bench.baseline import device_events, profiled  # noqa: E402


def bits_hash(grads) -> str:
    """The first 12 hex digits of the SHA-1 of every gradient tensor's bytes, in order."""
    tensors = [t for v in grads for t in (v if isinstance(v, tuple) else (v,)) if isinstance(t, torch.Tensor)]
    return hashlib.sha1(b"".join(t.contiguous().view(torch.uint8).cpu().numpy().tobytes() for t in tensors)).hexdigest()[:12]


def step_kernels(step, calls: int) -> list[tuple[str, float]]:
    """(kernel name, mean device ms) of each launch of one ``step()`` in order, over ``calls`` calls
    (memcpy and memset left out)."""
    events = sorted((e for e in device_events(profiled(step, calls)) if "Memcpy" not in e.name and "Memset" not in e.name),
                    key=lambda e: e.time_range.start)
    per_call = len(events) // calls
    return [(events[i].name, sum(events[c * per_call + i].time_range.end - events[c * per_call + i].time_range.start
                                 for c in range(calls)) / calls / 1e3) for i in range(per_call)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="dsv3,qwen3-235b", help=f"comma-separated, of {sorted(CONFIGS)}")
    parser.add_argument("--precision", default="fp8_block", choices=("bf16", "fp8_block"))
    parser.add_argument("--wgrad-format", default=None, help="the backward's weight-gradient operands (default: the precision's)")
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    from mok.plan import Plan

    print(f"# {torch.cuda.get_device_name()}, mok from {os.path.dirname(mok.__file__)}")
    for name in args.configs.split(","):
        inputs = make_inputs(*CONFIGS[name])
        dout = torch.randn(inputs[0].shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7)).bfloat16()
        plan = Plan(config_of(inputs, precision=args.precision), "sm_90a")
        step = lambda: mok_plan_train_step(inputs, dout, plan, wgrad_format=args.wgrad_format)  # noqa: E731
        for _ in range(3):
            grads = step()
        digest = bits_hash(grads)
        kernels = step_kernels(step, args.calls)
        print(f"{name}: {len(kernels)} launches, kernels {sum(ms for _, ms in kernels):.3f} ms a step, bits {digest}")
        for i, (kernel, ms) in enumerate(kernels):
            print(f"  {i:>2} {ms:8.3f}  {kernel.replace('kernel_cutlass_kernel_', '').replace('mokkernels', '')[:70]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
