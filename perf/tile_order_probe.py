"""Does the grouped GEMM lose time when a group of ROW_GROUP row tiles splits an expert?

    python perf/tile_order_probe.py

fc1 (gate/up, SwiGLU) at dsv3's H = 7168, I = 2048 with 128 experts of 2 row tiles each (groups
of 8 row tiles hold 4 whole experts: each expert's weights are streamed by one group) against 3
row tiles each (every group boundary splits an expert, whose weights are then streamed by two
groups), the real uniform schedule of one EP = 2 rank, and 32 experts of 8 tiles (aligned), in
TFLOP/s on the rows computed (padding included).
"""

from __future__ import annotations

import torch

from mok import ops
from mok.bench import time_ms

H, I = 7168, 2048


def fc1_tflops(tiles: torch.Tensor, E: int) -> tuple[float, float]:
    rows = tiles.numel() * 128
    x_rows = torch.randn(rows, H, device="cuda").bfloat16()
    wg, wu = ((torch.randn(E, I, H, device="cuda") * H**-0.5).bfloat16() for _ in range(2))
    a = ops.grouped_gemm(x_rows, wg, tiles, b2=wu)
    ms = time_ms(lambda: ops.grouped_gemm(x_rows, wg, tiles, b2=wu, out=a), batch=10, repeats=5)
    return ms, 2 * rows * H * 2 * I / ms / 1e9


def main() -> None:
    cases = {
        "E128 x 2 tiles (aligned)": (128, torch.arange(256, device="cuda", dtype=torch.int32) // 2),
        "E128 x 3 tiles (split)": (128, torch.arange(384, device="cuda", dtype=torch.int32) // 3),
        "E32 x 8 tiles (aligned)": (32, torch.arange(256, device="cuda", dtype=torch.int32) // 8),
    }
    sched = ops.device_schedule(torch.rand(4096, 128, device="cuda").topk(8, dim=1).indices.int(), 128)
    used = int(sched.expert_offsets[-1]) // 128
    cases["E128 real schedule"] = (128, sched.tile_expert[:used].contiguous())
    for _ in range(2):
        for name, (E, tiles) in cases.items():
            ms, tflops = fc1_tflops(tiles, E)
            print(f"{name:<26}{tiles.numel():>5} row tiles {ms:8.3f} ms {tflops:7.0f} TFLOP/s")


if __name__ == "__main__":
    main()
