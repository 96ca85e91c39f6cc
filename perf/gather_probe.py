"""The backward's row gathers (dout and x into the expert-grouped buffer) at the layer's shapes.

    python perf/gather_probe.py [--configs qwen3,dsv3-e128]

Per config: the layer's schedule's row_token (uniform routing, padding rows -1), then
ops.gather_rows timed against torch's index_select of the same rows (no zero padding) and a
device-to-device copy of as many bytes (for scale only: the copy reads HBM, while the gathered
token rows come largely from L2, so it bounds nothing) and a fill of the output (writes only: what
HBM's write rate allows a gather whose reads hit L2). Prints ms and GB/s of bytes read plus
written (the fill: written).
"""

from __future__ import annotations

import argparse

import torch

from mok import ops
from mok.bench import time_ms
from mok.schedule import worst_case_capacity

from bench_layer import CONFIGS, make_inputs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="qwen3,dsv3-e128")
    args = parser.parse_args()
    print(f"# {torch.cuda.get_device_name()}")
    print(f"{'config':<10}{'path':<14}{'ms':>8}{'GB/s':>8}")
    for name in args.configs.split(","):
        T, H, I, E, k, shared, routing = CONFIGS[name]
        x, idx, *_ = make_inputs(T, H, I, E, k, shared, routing)
        token = ops.device_schedule(idx, E, capacity=worst_case_capacity(T, k, E, 128)).row_token  # as the layer's
        rows = token.shape[0]
        out = torch.empty(rows, H, dtype=torch.bfloat16, device="cuda")
        picked = token.clamp(min=0).long()
        copy_src = torch.empty_like(out)
        paths = {
            "mok gather": lambda: ops.gather_rows(x, token, out=out),
            "index_select": lambda: torch.index_select(x, 0, picked, out=out),
            "copy": lambda: out.copy_(copy_src),
            "fill (writes)": lambda: out.fill_(1.0),
            "mok gather x2": lambda: ops.gather_rows_pair(x, x, token),  # the backward's pair (dout and x rows)
        }
        moved = 2 * rows * H * 2  # bytes read + written
        for path, fn in paths.items():
            ms = time_ms(fn)
            nbytes = {"fill (writes)": moved // 2, "mok gather x2": 2 * moved}.get(path, moved)
            print(f"{name:<10}{path:<14}{ms:>8.3f}{nbytes / ms / 1e6:>8.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
