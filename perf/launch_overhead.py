"""Where the host time of one MoK kernel call goes (Python side), on the GPU machine.

    python perf/launch_overhead.py                  # TVM-FFI, the default (see mok/runtime/launch.py)
    MOK_TVM_FFI=0 python perf/launch_overhead.py    # CuTe DSL's own calling convention
"""

from __future__ import annotations

import cProfile
import pstats
import time

import torch

from mok import ops
from mok.kernels import combine_variant, get_kernel
from mok.runtime.arch import device_arch


def per_call_us(fn, calls=500):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def main() -> None:
    from mok.runtime.launch import convention

    print(f"calling convention: {convention()}")
    y = torch.randn(8, 2, 256, device="cuda").bfloat16()
    w = torch.rand(8, 2, device="cuda")
    out = torch.empty(8, 256, device="cuda", dtype=torch.bfloat16)
    print(f"ops.combine: {per_call_us(lambda: ops.combine(y, w, out=out)):.1f} us/call")
    kernel = get_kernel(combine_variant(256, 2, False), device_arch())
    args = (ops._ptr("bf16", y), ops._ptr("i32", None, 4), ops._ptr("f32", w, 4), ops._ptr("bf16", None), ops._ptr("bf16", out),
            ops._i32(8), ops._i32(16), ops._stream(y.device))
    print(f"compiled kernel, prebuilt args: {per_call_us(lambda: kernel(*args)):.1f} us/call")
    print(f"building the args only: {per_call_us(lambda: (ops._ptr('bf16', y), ops._ptr('i32', None, 4), ops._ptr('f32', w, 4), ops._ptr('bf16', None), ops._ptr('bf16', out), ops._i32(8), ops._i32(16), ops._stream(y.device))):.1f} us/call")
    print(f"torch launch (y.add_(0)): {per_call_us(lambda: out.add_(0)):.1f} us/call")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        ops.combine(y, w, out=out)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
