"""Do Hopper's m64nNk16 WGMMAs give an output element the same bits whatever N (64, 128, 256)?

The grouped GEMM's column tile sets the WGMMA's N; this runs the same products with tile widths
128 and 256 (the plain epilogue's; the SwiGLU epilogues take 128 only) and compares the bits, in
the persistent and the one-tile kernels. If
they agree, a tile computed with a narrower N (e.g. a tail tile split along N between the two
MMA warpgroups) would keep batch invariance (perf/NOTES.md, twenty-sixth session's leads).
Usage: python3 perf/wgmma_n_bits_probe.py
"""

import torch

from mok import ops


def main() -> int:
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, k, n, experts = 1024, 2048, 768, 4
    a = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
    b = (torch.randn(experts, n, k, device="cuda", generator=g) * k**-0.5).bfloat16()
    tile_expert = torch.arange(rows // 128, device="cuda", dtype=torch.int32) % experts
    for persistent in (True, False):
        outs = {t: ops.grouped_gemm(a, b, tile_expert, tile_n=t, persistent=persistent) for t in (128, 256)}
        differing = int((outs[128] != outs[256]).sum())
        print(f"persistent={persistent}: tile_n 128 and 256 give the same bits: {torch.equal(outs[128], outs[256])} "
              f"({differing} of {outs[128].numel()} elements differ)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
