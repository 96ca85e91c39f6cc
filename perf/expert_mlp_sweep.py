"""The one-launch expert MLP against the two GEMM launches it replaces, on real uniform schedules.

    python perf/expert_mlp_sweep.py

Per benchmark config (single GPU): fc1 (gathering, SwiGLU) and fc2 as separate persistent
launches (fc2 at column tiles 128 and 256), the counter fill the one-launch kernel needs, and
the one-launch MLP itself (its timed calls include that fill). Two rounds: this machine's
clocks move 10-20% between rounds, so compare within one.
"""

from __future__ import annotations

import torch

from mok import ops
from mok.bench import time_ms

CONFIGS = {"dsv3": (4096, 7168, 2048, 32, 8), "qwen3": (8192, 2048, 768, 64, 8)}  # T, H, I, E, k


def main() -> None:
    print(f"# {torch.cuda.get_device_name()}")
    for name, (T, H, I, E, k) in CONFIGS.items():
        idx = torch.rand(T, E, device="cuda").topk(k, dim=1).indices.int()
        x = torch.randn(T, H, device="cuda").bfloat16()
        wg, wu = ((torch.randn(E, I, H, device="cuda") * H**-0.5).bfloat16() for _ in range(2))
        wd = (torch.randn(E, H, I, device="cuda") * I**-0.5).bfloat16()
        sched = ops.device_schedule(idx, E)
        counters = ops.expert_mlp_counters(T, H, sched.capacity, x.device)
        a = torch.empty(sched.capacity, I, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(sched.capacity, H, device="cuda", dtype=torch.bfloat16)
        runs = {
            "fc1 launch": lambda: ops.grouped_gemm(x, wg, sched.tile_expert, b2=wu, gather=sched.row_token, out=a),
            "fc2 launch, tile 128": lambda: ops.grouped_gemm(a, wd, sched.tile_expert, tile_n=128, out=y),
            "fc2 launch, tile 256": lambda: ops.grouped_gemm(a, wd, sched.tile_expert, tile_n=256, out=y),
            "zero counters": lambda: counters.zero_(),
            "one-launch MLP": lambda: (counters.zero_(), ops.expert_mlp(x, wg, wu, wd, sched, counters, y_rows=y)),
        }
        for _ in range(2):
            for kname, fn in runs.items():
                print(f"{name:<7}{kname:<24}{time_ms(fn, batch=10, repeats=5):>8.3f} ms")


if __name__ == "__main__":
    main()
