"""One layer training step (forward keeping h, backward) kernel by kernel, with a hash of its bits:
the A/B of two source trees at the kernel level.

    PYTHONPATH=<tree> MOK_CACHE_DIR=<its cache> python perf/step_kernels.py --configs dsv3,qwen3-235b \
        [--precision fp8_block] [--wgrad-format fp8_block] [--set NAME=VALUE ...]

For each config: the step's launches in order with each one's mean device time over ``--calls``
calls (the profiler, after three warm-up steps), their sum, and a hash of the step's gradients'
bytes. Run it once per tree on one machine, alternating: the per-kernel figures say where a change
moved time, and equal hashes that the trees compute the same bits (the same inputs every run).
``--set`` changes a setting of mok.kernels.variants for the run instead (one tree, two settings:
perf/bench_layer.py's variant_setting), e.g. ``--set ISSUE_ORDER=[]``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mok  # noqa: E402
from bench_layer import CONFIGS, apply_variant_settings, config_of, make_inputs, mok_plan_train_step, variant_setting  # noqa: E402
from mok.bench import kernel_sequence  # noqa: E402


def bits_hash(grads) -> str:
    """The first 12 hex digits of the SHA-1 of every gradient tensor's bytes, in order."""
    tensors = [t for v in grads for t in (v if isinstance(v, tuple) else (v,)) if isinstance(t, torch.Tensor)]
    return hashlib.sha1(b"".join(t.contiguous().view(torch.uint8).cpu().numpy().tobytes() for t in tensors)).hexdigest()[:12]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="dsv3,qwen3-235b", help=f"comma-separated, of {sorted(CONFIGS)}")
    parser.add_argument("--precision", default="fp8_block", choices=("bf16", "fp8_block"))
    parser.add_argument("--wgrad-format", default=None, help="the backward's weight-gradient operands (default: the precision's)")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--set", type=variant_setting, action="append", default=[], metavar="NAME=VALUE",
                        help="a mok.kernels.variants setting for this run (repeatable)")
    args = parser.parse_args()
    from mok.plan import Plan

    print(f"# {torch.cuda.get_device_name()}, mok from {os.path.dirname(mok.__file__)}")
    apply_variant_settings(args.set)
    for name in args.configs.split(","):
        inputs = make_inputs(*CONFIGS[name])
        dout = torch.randn(inputs[0].shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7)).bfloat16()
        plan = Plan(config_of(inputs, precision=args.precision), "sm_90a")
        step = lambda: mok_plan_train_step(inputs, dout, plan, wgrad_format=args.wgrad_format)  # noqa: E731
        for _ in range(3):
            grads = step()
        digest = bits_hash(grads)
        kernels = [(k, ms) for k, ms in kernel_sequence(step, args.calls) if "Memcpy" not in k and "Memset" not in k]
        print(f"{name}: {len(kernels)} launches, kernels {sum(ms for _, ms in kernels):.3f} ms a step, bits {digest}")
        for i, (kernel, ms) in enumerate(kernels):
            print(f"  {i:>2} {ms:8.3f}  {kernel.replace('kernel_cutlass_kernel_', '').replace('mokkernels', '')[:70]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
