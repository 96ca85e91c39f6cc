"""The SASS of MoK's SM100 GEMMs (compiled for sm_100a here, on any machine), instruction counts.

There is no SM100 GPU to run them; this shows what ptxas made of the PTX: tensor-core MMAs of
the tcgen05 family (block-scaled for the MXFP8 GEMMs), TMA loads, tensor-memory loads (and
copies into it), no Hopper or warp-level MMA. Needs cuobjdump (the CUDA toolkit's, or the dev
extra's nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels: mok.kernels.cuobjdump). Usage: python3 tools/sm100_sass.py
(counts of 2026-12-06: docs/notes/sm100.md)
"""

import collections
import re

from mok.kernels import compiled_sass
from mok.kernels.variants import grouped_gemm_variant, weight_grad_variant

VARIANTS = [
    grouped_gemm_variant(2048, 7168, epilogue="swiglu_save"),
    grouped_gemm_variant(7168, 2048),
    grouped_gemm_variant(2048, 7168, epilogue="swiglu_bwd", b_major="n", topk=8),
    weight_grad_variant(4096, 7168, split_out=True),
    grouped_gemm_variant(2048, 7168, epilogue="swiglu_save", operand="e4m3"),  # MXFP8 operands: block-scaled MMAs, scales copied into TMEM
    grouped_gemm_variant(7168, 2048, operand="e4m3"),
    weight_grad_variant(4096, 7168, split_out=True, operand="e4m3"),  # MN-major block-scaled operands (K = rows)
]


def mnemonics(sass: str) -> collections.Counter:
    """Opcode (without modifiers) -> count."""
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]+)", sass)
    return collections.Counter(ops)


def main() -> int:
    for variant in VARIANTS:
        counts = mnemonics(compiled_sass(variant, "sm_100a"))
        keep = {op: n for op, n in sorted(counts.items()) if re.search(r"MMA|UTC|UTMA|LDTM|STTM|TMEM|SYNCS|LDG|STG|LDS|STS", op)}
        print(variant.describe()[:100])
        print("   ", keep)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
