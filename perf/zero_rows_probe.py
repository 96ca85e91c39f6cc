"""What a GEMM's zero rows cost at the power limit: the tile padding question, asked of cuBLAS.

    python perf/zero_rows_probe.py [--seconds 2]

MoK pads every expert's rows to whole 128-row tiles with zero rows (~20% of the rows at 128
experts per GPU), and at steady state every MoK kernel runs at the H200's 700 W limit. A zero
row costs the same tensor-core cycles as any other, but flips fewer bits, so it may cost less
energy, and energy is what sets the clock there. This times one fc1-shaped GEMM (bf16, M = 32768
rows, K = 7168, N = 4096) alone at its steady state (mok.bench.time_ms_sustained) with a
fraction of A's rows zero (whole 128-row tiles, or rows spread), and prints ms, the clock and the power: if zero rows were free in
energy, 20% of them would cost no time at the limit; if they cost a normal row's energy, the
time would not change either, and the clock would not rise.
"""

from __future__ import annotations

import argparse

import torch

from mok.bench import format_gpu, time_ms_sustained


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()
    m, k, n = 32768, 7168, 4096
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    b = (torch.randn(k, n, device="cuda", generator=g) * k**-0.5).bfloat16()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; C[{m}, {n}] = A[{m}, {k}]·B, bf16, each alone")
    print(f"{'zero rows':<12}{'ms':>9}{'TFLOP/s':>9}{'useful':>9}{'MHz':>7}{'W':>6}{'C':>4}")
    tiles = a.view(m // 128, 128, k)
    cases = [("none", a)]
    for every in (5, 2):  # whole 128-row tiles of zeros, 1 in 5 (20%) or 1 in 2: padding gathers in experts' last tiles
        zeroed = tiles.clone()
        zeroed[::every] = 0
        cases.append((f"tiles 1/{every}", zeroed.view(m, k)))
    spread = a.clone()
    spread[torch.randperm(m, device="cuda", generator=g)[: m // 5]] = 0
    cases += [("rows 1/5", spread), ("all", torch.zeros_like(a))]
    flops = 2 * m * n * k
    for name, a_z in cases:
        useful = float((a_z.abs().amax(1) > 0).float().mean())  # the share of rows not zero
        ms, gpu = time_ms_sustained(lambda: a_z @ b, args.seconds)
        print(f"{name:<12}{ms:>9.3f}{flops / ms / 1e9:>9.0f}{flops * useful / ms / 1e9:>9.0f}{format_gpu(gpu)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
