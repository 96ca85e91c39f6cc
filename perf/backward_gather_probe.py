"""The backward's GEMMs fed gathered rows (by the kernel) against pre-gathered buffers (by TMA).

    python perf/backward_gather_probe.py [--configs qwen3,dsv3-e128]

Per config, on the layer's schedule (uniform routing, the worst-case capacity): the SwiGLU-backward
GEMM, dW_down and dW_gate/up (one launch), each timed reading rows from buffers that
ops.gather_rows_pair filled (TMA) and gathering the rows from dout and x itself (cp.async by the
row_token), interleaved in one run; and the pair gather the second way saves. Prints ms per
kernel and the step's sum either way.
"""

from __future__ import annotations

import argparse

import torch

from mok import grad_ops, ops
from mok.bench import time_ms_interleaved
from mok.schedule import worst_case_capacity

from bench_layer import CONFIGS, make_inputs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="qwen3,dsv3-e128")
    args = parser.parse_args()
    print(f"# {torch.cuda.get_device_name()}")
    for name in args.configs.split(","):
        T, H, I, E, k, shared, routing = CONFIGS[name]
        x, idx, w, (_, _, w_down), _ = make_inputs(T, H, I, E, k, shared, routing)
        s = ops.device_schedule(idx, E, capacity=worst_case_capacity(T, k, E, 128))
        dout = torch.randn_like(x)
        h = torch.randn(s.row_token.shape[0], 2 * I, device="cuda").bfloat16()
        dout_rows, x_rows = ops.gather_rows_pair(dout, x, s.row_token)
        routing_args = dict(row_token=s.row_token, row_slot=s.row_slot, topk_w=w)
        dh, a_scaled, _ = grad_ops.swiglu_backward_gemm(dout_rows, w_down, s.tile_expert, h, **routing_args)
        rows = dict(offsets=s.expert_offsets, counts=s.expert_counts)
        gather_a, gather_b = dict(row_token=s.row_token, gathered="a"), dict(row_token=s.row_token, gathered="b")
        kernels = {
            "gather pair": (lambda: ops.gather_rows_pair(dout, x, s.row_token, out=(dout_rows, x_rows)), None),
            "swiglu bwd": (
                lambda: grad_ops.swiglu_backward_gemm(dout_rows, w_down, s.tile_expert, h, **routing_args),
                lambda: grad_ops.swiglu_backward_gemm(dout, w_down, s.tile_expert, h, gather_rows=True, **routing_args),
            ),
            "dW_down": (
                lambda: grad_ops.weight_grad(dout_rows, a_scaled, **rows),
                lambda: grad_ops.weight_grad(dout, a_scaled, **rows, **gather_a),
            ),
            "dW_gate+up": (
                lambda: grad_ops.weight_grad(dh, x_rows, split_out=True, **rows),
                lambda: grad_ops.weight_grad(dh, x, split_out=True, **rows, **gather_b),
            ),
        }
        print(f"{name}: {'kernel':<12}{'rows (TMA)':>12}{'gathered':>12}")
        sums = [0.0, 0.0]
        for kernel, (by_rows, gathered) in kernels.items():
            fns = {"rows": by_rows} if gathered is None else {"rows": by_rows, "gathered": gathered}
            ms = time_ms_interleaved(fns)
            sums[0] += ms["rows"]
            sums[1] += ms.get("gathered", 0.0)
            print(f"{'':<{len(name) + 2}}{kernel:<12}{ms['rows']:>12.3f}{ms.get('gathered', float('nan')):>12.3f}")
        print(f"{'':<{len(name) + 2}}{'sum':<12}{sums[0]:>12.3f}{sums[1]:>12.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
