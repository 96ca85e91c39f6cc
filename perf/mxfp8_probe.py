"""MXFP8 quantizer and dequantizer kernels against the same rule in plain PyTorch, on the GPU.

    python perf/mxfp8_probe.py [--shapes 4096x7168,8192x2048,65536x7168]

Per shape [rows, n] of bf16: ops.quantize_mxfp8 (scales in row order, and in the SM100 MMA's
order), ops.quantize_mxfp8_columns (blocks of 32 rows down each column: the MXFP8 weight
gradients' operands) and ops.dequantize_mxfp8, mok.mxfp8's PyTorch functions run on the GPU (what
one would write without the kernels; the same bytes), and a device-to-device copy of the bf16
tensor (for scale). Prints ms and GB/s of bytes read plus written (quantize: 2 B in, 1 + 1/32 B
out per element; dequantize the reverse).
"""

from __future__ import annotations

import argparse

import torch

from mok import mxfp8, ops
from mok.bench import time_ms


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="4096x7168,8192x2048,65536x7168")
    args = parser.parse_args()
    print(f"# {torch.cuda.get_device_name()}")
    print(f"{'shape':<12}{'path':<20}{'ms':>9}{'GB/s':>8}")
    for shape in args.shapes.split(","):
        rows, n = (int(v) for v in shape.split("x"))
        x = torch.randn(rows, n, device="cuda").bfloat16()
        elements, scales = ops.quantize_mxfp8(x)
        back = torch.empty_like(x)
        copy_out = torch.empty_like(x)
        moved = rows * n * (2 + 1 + 1 / mxfp8.BLOCK)
        want = mxfp8.quantize_mxfp8(x)
        same = torch.equal(want[0].view(torch.uint8), elements.view(torch.uint8)) and torch.equal(want[1], scales)
        paths = {
            "mok quantize": (lambda: ops.quantize_mxfp8(x, out=(elements, scales)), moved),
            "mok quantize mma": (lambda: ops.quantize_mxfp8(x, scale_order="mma"), moved),
            "mok columns": (lambda: ops.quantize_mxfp8_columns(x, scale_order="mma"), moved),
            "torch columns": (lambda: mxfp8.quantize_mxfp8(x.T), moved),
            "torch quantize": (lambda: mxfp8.quantize_mxfp8(x), moved),
            "mok dequantize": (lambda: ops.dequantize_mxfp8(elements, scales, out=back), moved),
            "torch dequantize": (lambda: mxfp8.dequantize_mxfp8(elements, scales).bfloat16(), moved),
            "copy": (lambda: copy_out.copy_(x), 4 * rows * n),
        }
        for path, (fn, nbytes) in paths.items():
            ms = time_ms(fn, batch=10, repeats=5)
            print(f"{shape:<12}{path:<20}{ms:>9.3f}{nbytes / ms / 1e6:>8.0f}")
        print(f"{shape:<12}kernel bytes == torch bytes: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
