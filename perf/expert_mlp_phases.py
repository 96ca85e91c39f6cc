"""Where the one-launch expert MLP's time goes: its fc1 and fc2 phases alone against the two GEMM launches.

    python perf/expert_mlp_phases.py

On real uniform schedules of the single-GPU benchmark configs: fc1 (gathering, SwiGLU) and fc2
as separate persistent launches (fc2 at column tiles 128 and 256), the one-launch MLP, and the
same kernel compiled to run only its fc1 phase or only its fc2 phase (the latter with its
done count preset, so it never waits). The counters are zeroed inside each timed call of the
kernels that need them (one small fill kernel, in every row that has it).
"""

from __future__ import annotations

import torch

from mok import ops
from mok.bench import time_ms
from mok.kernels import expert_mlp_variant

CONFIGS = {"dsv3": (4096, 7168, 2048, 32, 8), "qwen3": (8192, 2048, 768, 64, 8)}  # T, H, I, E, k


def main() -> None:
    print(f"# {torch.cuda.get_device_name()}")
    for name, (T, H, I, E, k) in CONFIGS.items():
        idx = torch.rand(T, E, device="cuda").topk(k, dim=1).indices.int()
        x = torch.randn(T, H, device="cuda").bfloat16()
        wg, wu = ((torch.randn(E, I, H, device="cuda") * H**-0.5).bfloat16() for _ in range(2))
        wd = (torch.randn(E, H, I, device="cuda") * I**-0.5).bfloat16()
        sched = ops.device_schedule(idx, E)
        counters = ops.expert_mlp_counters(T, H, x.device)
        a = torch.empty(sched.capacity, I, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(sched.capacity, H, device="cuda", dtype=torch.bfloat16)

        def phase(which: str):
            variant = expert_mlp_variant(H, I, k, phases=which)

            def run():
                counters.zero_()
                if which == "fc2":
                    counters[1] = 2**30  # every fc1 tile "done": no waits
                ops.launch_expert_mlp(variant, x, wg, wu, wd, a, None, y, sched, None, None, None, counters, 10.0)

            return run

        runs = {
            "fc1 launch": lambda: ops.grouped_gemm(x, wg, sched.tile_expert, b2=wu, gather=sched.row_token, out=a),
            "fc2 launch, tile 128": lambda: ops.grouped_gemm(a, wd, sched.tile_expert, tile_n=128, out=y),
            "fc2 launch, tile 256": lambda: ops.grouped_gemm(a, wd, sched.tile_expert, tile_n=256, out=y),
            "zero counters": lambda: counters.zero_(),
            "one-launch MLP": lambda: (counters.zero_(), ops.expert_mlp(x, wg, wu, wd, sched, counters, y_rows=y)),
            "its fc1 phase alone": phase("fc1"),
            "its fc2 phase alone": phase("fc2"),
        }
        for _ in range(2):
            for kname, fn in runs.items():
                print(f"{name:<7}{kname:<24}{time_ms(fn, batch=10, repeats=5):>8.3f} ms")


if __name__ == "__main__":
    main()
