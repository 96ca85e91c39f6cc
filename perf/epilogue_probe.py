"""What a grouped GEMM's epilogue costs: the same mainloop under different epilogues, one process.

    python perf/epilogue_probe.py [--configs qwen3,dsv3,e128]

Per config, on one rank's rows (E experts x rows per expert, whole 128-row tiles, as the
schedule lays them out), ms and TFLOP/s of:
- the SwiGLU-backward GEMM (dA = dout_rows·W_down read N-major; writes dh [R, 2I], a_scaled,
  the router-gradient pieces: 3 stores per epilogue subtile, h read), cooperative and ping-pong;
- the plain GEMM of the same product (1 store per subtile, no math);
- the gate/up GEMM with the SwiGLU epilogue, h saved or not (3 or 1 stores per subtile), and
  with A gathered from a token matrix by cp.async as the layer's fc1 does;
- dx (dh·[W_gate; W_up], the two K halves, tile 256): the gate/up GEMM's FLOPs by TMA alone;
- the down projection (K-major, tile 256), the forward's GEMM of the SwiGLU-backward's FLOPs.

``--only TEXT`` keeps the kernels whose label holds TEXT; ``--profile`` launches each kept kernel
twice without timing, for Nsight Compute (profile the second launch of one kernel, after the setup
GEMM and the JIT; then perf/sass_stalls.py):

    ncu --set full --import-source no -k regex:persistent --launch-skip 2 --launch-count 1 -o $OUT/rep \
        python3 perf/epilogue_probe.py --configs e128 --only "A gathered" --profile
"""

from __future__ import annotations

import argparse

import torch

from mok import grad_ops, ops
from mok.bench import time_ms

CONFIGS = {  # name: (E, rows per expert, H, I)
    "qwen3": (64, 1024, 2048, 768),
    "dsv3": (32, 1024, 7168, 2048),
    "e128": (128, 256, 7168, 2048),  # one rank of dsv3 at EP 2: each expert's weights used by 2 row tiles
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="qwen3,dsv3", help=f"of {','.join(CONFIGS)}")
    parser.add_argument("--only", default="", help="keep the kernels whose label holds this text")
    parser.add_argument("--profile", action="store_true", help="launch each kernel twice, untimed (for ncu)")
    args = parser.parse_args()
    print(f"# {torch.cuda.get_device_name()}")
    print(f"{'config':<7}{'kernel':<44}{'ms':>8}{'TFLOP/s':>9}")
    for name in args.configs.split(","):
        E, per, H, I = CONFIGS[name]
        R = E * per
        g = torch.Generator(device="cuda").manual_seed(0)
        x_rows = torch.randn(R, H, device="cuda", generator=g).bfloat16()
        dout_rows = torch.randn(R, H, device="cuda", generator=g).bfloat16()
        wg, wu = ((torch.randn(E, I, H, device="cuda", generator=g) * H**-0.5).bfloat16() for _ in range(2))
        wd = (torch.randn(E, H, I, device="cuda", generator=g) * I**-0.5).bfloat16()
        tiles = torch.arange(R // 128, device="cuda", dtype=torch.int32) // (per // 128)
        row_token = torch.randperm(R, device="cuda", generator=g).int()  # every row a distinct (token, slot)
        row_slot = torch.zeros(R, dtype=torch.int32, device="cuda")
        topk_w = torch.rand(R, 1, device="cuda", generator=g)
        h = torch.empty(R, 2 * I, dtype=torch.bfloat16, device="cuda")
        a = ops.grouped_gemm(x_rows, wg, tiles, b2=wu, h_out=h)
        a_kmajor = a  # fc2's A
        runs = {
            "SwiGLU-backward GEMM, cooperative (tile 128)": (lambda: grad_ops.swiglu_backward_gemm(
                dout_rows, wd, tiles, h, row_token=row_token, row_slot=row_slot, topk_w=topk_w, pingpong=False), 1),
            "SwiGLU-backward GEMM, ping-pong": (lambda: grad_ops.swiglu_backward_gemm(
                dout_rows, wd, tiles, h, row_token=row_token, row_slot=row_slot, topk_w=topk_w, pingpong=True), 1),
            "plain, the same product (N-major B, tile 128)": (lambda: ops.grouped_gemm(dout_rows, wd, tiles, b_major="n", tile_n=128), 1),
            "gate/up + SwiGLU, h saved (tile 128)": (lambda: ops.grouped_gemm(x_rows, wg, tiles, b2=wu, h_out=h), 2),
            "gate/up + SwiGLU (tile 128)": (lambda: ops.grouped_gemm(x_rows, wg, tiles, b2=wu), 2),
            "gate/up + SwiGLU, h saved, A gathered": (lambda: ops.grouped_gemm(x_rows, wg, tiles, b2=wu, h_out=h, gather=row_token), 2),
            "dx: dh·[W_gate; W_up] (K halves, tile 256)": (lambda: ops.grouped_gemm(h, wg, tiles, b2=wu, b_major="n", k_split=True), 2),
            "down projection (K-major B, tile 256)": (lambda: ops.grouped_gemm(a_kmajor, wd, tiles), 1),
        }
        for label, (fn, products) in runs.items():
            if args.only not in label:
                continue
            if args.profile:
                fn(), fn()
                torch.cuda.synchronize()
                continue
            ms = time_ms(fn, batch=5, repeats=10)
            print(f"{name:<7}{label:<44}{ms:8.3f}{2 * R * H * I * products / ms / 1e9:9.0f}")


if __name__ == "__main__":
    main()
